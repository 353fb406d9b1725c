"""Stream 20k+ tokens through a small model with a StreamingLLM cache (sinkattn.streaming.SinkKVCache).

The model is a small randomly initialised decoder (RoPE, grouped-query attention, gpt-oss-style
learnable sinks), built here so the example needs no download. It decodes one token at a time, feeding
back its own greedy prediction, through a SinkKVCache that holds `capacity` tokens per layer: the first
`sink_tokens` forever and a rolling window of the most recent. Memory stays flat and throughput stays
steady however long the stream; a full KV cache would grow by one token per step.

    python examples/long_stream.py                       # 20,480 tokens, writes long_stream.png here
    python examples/long_stream.py --tokens 50000 --capacity 1024 --device cuda --out /tmp/stream.png

It imports the installed sinkattn (`make install` or `pip install --no-build-isolation .`) and writes its plot
into the current directory (--out PATH elsewhere; examples/long_stream.png is the published one).

Every `--every` tokens it records the cache's bytes, the process's resident memory and the tokens/s
of the last interval (per wall-clock second, and per CPU-second of this process, which a busy shared
machine does not disturb), prints a line, and at the end plots them against the stream position.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch
import torch.nn as nn

from sinkattn.streaming import SinkKVCache


class Block(nn.Module):
    def __init__(self, dim, heads, kv_heads, head_dim):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.norm1, self.norm2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.qkv = nn.Linear(dim, (heads + 2 * kv_heads) * head_dim, bias=False)
        self.o = nn.Linear(heads * head_dim, dim, bias=False)
        self.sinks = nn.Parameter(torch.randn(heads))  # one learnable sink logit per head (gpt-oss)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x, cache: SinkKVCache, layer: int):
        b, s, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(
            [self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim], dim=-1)
        q = q.view(b, s, self.heads, self.head_dim)
        k = k.view(b, s, self.kv_heads, self.head_dim)
        v = v.view(b, s, self.kv_heads, self.head_dim)
        att = cache.attend(layer, q, k, v, self.sinks)  # pre-RoPE in; the cache assigns positions and rotates
        x = x + self.o(att.reshape(b, s, -1))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab=512, dim=128, layers=4, heads=4, kv_heads=2):
        super().__init__()
        self.head_dim = dim // heads
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, kv_heads, self.head_dim) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids, cache):
        x = self.embed(ids)
        for i, block in enumerate(self.blocks):
            x = block(x, cache, i)
        return self.lm_head(self.norm(x))


def rope_tables(positions, rotary_dim, base=10000.0, device=None):
    inv = 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    ang = torch.arange(positions, dtype=torch.float64)[:, None] * inv[None, :]
    return ang.cos().float().to(device), ang.sin().float().to(device)


def rss_mib() -> float:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run(args):
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    model = TinyLM(vocab=args.vocab, dim=args.dim, layers=args.layers, heads=args.heads,
                   kv_heads=args.kv_heads).to(device).eval()
    cos, sin = rope_tables(args.capacity, model.head_dim, device=device)
    cache = SinkKVCache(args.capacity, args.sink_tokens, num_layers=args.layers, batch_size=1,
                        num_kv_heads=args.kv_heads, head_dim=model.head_dim, dtype=torch.float32, device=device,
                        rotary_cos=cos, rotary_sin=sin, rotary_interleaved=False)
    token = torch.zeros(1, 1, dtype=torch.long, device=device)
    rows = []
    full_cache_bytes_per_token = 2 * args.layers * args.kv_heads * model.head_dim * 4
    start = last = time.perf_counter()
    last_cpu = time.process_time()
    with torch.inference_mode():
        for t in range(1, args.tokens + 1):
            logits = model(token, cache)
            token = logits[:, -1:].argmax(-1)
            if t % args.every == 0:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                now, now_cpu = time.perf_counter(), time.process_time()
                if not torch.isfinite(logits).all():
                    raise SystemExit(f"non-finite logits at token {t}")
                st = cache.stats()
                row = dict(position=t, tokens_per_s=args.every / (now - last),
                           tokens_per_cpu_s=args.every / max(now_cpu - last_cpu, 1e-9), cache_mib=cache.nbytes / 2**20,
                           rss_mib=rss_mib(), full_cache_mib=t * full_cache_bytes_per_token / 2**20,
                           length=st.length, evicted=st.evicted, occupancy=st.occupancy)
                if device.type == "cuda":
                    row["cuda_allocated_mib"] = torch.cuda.memory_allocated(device) / 2**20
                rows.append(row)
                last, last_cpu = now, now_cpu
                print(f"{t:>7} tokens  {row['tokens_per_s']:7.1f} tok/s ({row['tokens_per_cpu_s']:6.1f} per CPU-s)  cache {row['cache_mib']:.2f} MiB  "
                      f"rss {row['rss_mib']:.1f} MiB  held {st.length}/{st.capacity}  evicted {st.evicted}",
                      flush=True)
    total = time.perf_counter() - start
    return rows, total


def summarize(rows, total, args):
    steady = [r for r in rows if r["position"] > 2 * args.capacity] or rows
    tps = [r["tokens_per_s"] for r in steady]
    cpu = [r["tokens_per_cpu_s"] for r in steady]
    half = len(cpu) // 2 or 1
    first, second = sum(cpu[:half]) / half, sum(cpu[half:]) / max(1, len(cpu) - half)
    summary = dict(tokens=args.tokens, seconds=round(total, 1), capacity=args.capacity, sink_tokens=args.sink_tokens,
                   tokens_per_s_mean=round(sum(tps) / len(tps), 1),
                   tokens_per_cpu_s_mean=round(sum(cpu) / len(cpu), 1),
                   tokens_per_cpu_s_first_half=round(first, 1), tokens_per_cpu_s_second_half=round(second, 1),
                   cache_mib=round(rows[-1]["cache_mib"], 3),
                   cache_mib_range=[round(min(r["cache_mib"] for r in rows), 3),
                                    round(max(r["cache_mib"] for r in rows), 3)],
                   rss_mib_range=[round(min(r["rss_mib"] for r in steady), 1),
                                  round(max(r["rss_mib"] for r in steady), 1)],
                   full_kv_cache_would_be_mib=round(rows[-1]["full_cache_mib"], 2))
    return summary


def plot(rows, summary, path, args):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pos = [r["position"] for r in rows]
    fig, (ax_m, ax_t) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True)
    ax_m.plot(pos, [r["cache_mib"] for r in rows], label="SinkKVCache tensors", lw=2)
    ax_m.plot(pos, [r["full_cache_mib"] for r in rows], "--", label="a full KV cache (same model)", lw=1.5)
    ax_m.set_ylabel("KV cache memory (MiB)")
    ax_r = ax_m.twinx()
    ax_r.plot(pos, [r["rss_mib"] for r in rows], color="tab:gray", lw=1, label="process RSS")
    ax_r.set_ylabel("process RSS (MiB)", color="tab:gray")
    lo = min(r["rss_mib"] for r in rows)
    ax_r.set_ylim(lo * 0.9, max(r["rss_mib"] for r in rows) * 1.1)
    lines = ax_m.get_legend_handles_labels()[0] + ax_r.get_legend_handles_labels()[0]
    ax_m.legend(lines, [ln.get_label() for ln in lines], loc="upper left", fontsize=8)
    ax_m.set_title(f"StreamingLLM decode with sinkattn.SinkKVCache: capacity {args.capacity} "
                   f"({args.sink_tokens} sink tokens), {args.layers} layers, {args.device}")
    ax_t.plot(pos, [r["tokens_per_cpu_s"] for r in rows], lw=2, label="per CPU-second of this process")
    ax_t.plot(pos, [r["tokens_per_s"] for r in rows], lw=1, alpha=0.7, label="per wall-clock second (shared machine)")
    ax_t.legend(loc="upper right", fontsize=8)
    ax_t.axvline(args.capacity, color="tab:red", ls=":", lw=1)
    ax_t.text(args.capacity, 0.05, " cache full", color="tab:red", transform=ax_t.get_xaxis_transform(), fontsize=8)
    ax_t.set_ylim(0, max(max(r["tokens_per_s"], r["tokens_per_cpu_s"]) for r in rows) * 1.25)
    ax_t.set_ylabel(f"tokens/s (per {args.every})")
    ax_t.set_xlabel("stream position (tokens)")
    ax_t.text(0.99, 0.05, f"after the cache fills: {summary['tokens_per_cpu_s_first_half']:.0f} -> "
              f"{summary['tokens_per_cpu_s_second_half']:.0f} tokens per CPU-second (first / second half)",
              transform=ax_t.transAxes, ha="right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=20480)
    p.add_argument("--capacity", type=int, default=512)
    p.add_argument("--sink-tokens", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--every", type=int, default=256, help="measurement interval (tokens)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 = steadiest on a shared machine)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="long_stream.png", help="the plot (default: long_stream.png in the current "
                   "directory; an empty string writes none)")
    p.add_argument("--json", default=None, help="also write the measurements here")
    args = p.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    rows, total = run(args)
    summary = summarize(rows, total, args)
    print(json.dumps(summary, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(summary=summary, rows=rows), f, indent=1)
    if args.out:
        plot(rows, summary, args.out, args)
        print(f"wrote {args.out}")
    if not math.isfinite(summary["tokens_per_s_mean"]):
        raise SystemExit("no measurement")
    return summary


if __name__ == "__main__":
    main()
