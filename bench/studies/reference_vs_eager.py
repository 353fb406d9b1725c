"""The reference backend against the eager concat-softmax formulation, on the CPU.

Eager is what transformers' gpt-oss `eager_attention_forward` does: repeat the KV heads, materialise
the (heads, seqlen_q, seqlen_k) score matrix, add the mask, concatenate the sink logit as an extra
column, softmax, drop the column, multiply by V. The reference backend (sinkattn.reference) tiles over
keys with an online softmax and skips masked tiles.

Each (implementation, seqlen) runs in a fresh subprocess so its peak RSS is its own: the figure is
ru_maxrss at the end minus the RSS just before the first full-size call. Before that point: the inputs,
eager's additive mask (transformers builds it once per forward and shares it across layers), and one
tiny call of the same implementation, so one-time library initialisation (~160 MiB of OpenMP/BLAS
state here) is not charged to either side. Time: the best of a few runs after one warm-up.
On a shared machine pass --threads 1: with two OpenMP threads on two busy cores, every parallel op can
wait for a descheduled thread, which punishes the many mid-sized ops of the tiled loop far more than
eager's few huge ones.

    python bench/studies/reference_vs_eager.py                       # seqlen 2k, 4k, 8k, markdown to stdout
    python bench/studies/reference_vs_eager.py --seqlens 1024 --window 127
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo

import torch  # noqa: E402

from bench.harness.env import rss_bytes  # noqa: E402

import sinkattn  # noqa: E402


def eager_attention(q, k, v, sinks, scale, mask):
    """transformers' gpt-oss eager attention, in our (batch, seqlen, heads, dim) layout."""
    b, s, h, d = q.shape
    groups = h // k.shape[2]
    query = q.transpose(1, 2)
    key = k.transpose(1, 2).repeat_interleave(groups, dim=1)
    value = v.transpose(1, 2).repeat_interleave(groups, dim=1)
    w = torch.matmul(query, key.transpose(2, 3)) * scale
    w = w + mask
    sink_col = sinks.reshape(1, -1, 1, 1).expand(b, -1, s, -1)
    combined = torch.cat([w, sink_col], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = torch.softmax(combined, dim=-1, dtype=combined.dtype)
    scores = probs[..., :-1]
    return torch.matmul(scores, value).transpose(1, 2)


def _inputs(args, seqlen):
    g = torch.Generator().manual_seed(0)
    dt = getattr(torch, args.dtype)
    q = torch.randn(1, seqlen, args.heads, args.headdim, generator=g).to(dt)
    k = torch.randn(1, seqlen, args.kv_heads, args.headdim, generator=g).to(dt)
    v = torch.randn(1, seqlen, args.kv_heads, args.headdim, generator=g).to(dt)
    sinks = torch.randn(args.heads, generator=g).to(dt)
    return q, k, v, sinks


def child(args) -> dict:
    """One measurement in this (fresh) process."""
    seqlen = args.child_seqlen
    q, k, v, sinks = _inputs(args, seqlen)
    scale = args.headdim ** -0.5
    window = (args.window, 0)
    if args.child_impl == "eager":
        i = torch.arange(seqlen)[:, None]
        j = torch.arange(seqlen)[None, :]
        visible = (j <= i) & ((j >= i - args.window) if args.window >= 0 else True)
        mask = torch.zeros(seqlen, seqlen, dtype=q.dtype).masked_fill(~visible, torch.finfo(q.dtype).min)

        def call():
            return eager_attention(q, k, v, sinks, scale, mask)
    else:
        def call():
            return sinkattn.flash_attn_with_sinks(q, k, v, sinks, softmax_scale=scale, causal=True,
                                                  window_size=window, backend="reference")
    warm_q, warm_k, warm_v, _ = _inputs(argparse.Namespace(**{**vars(args)}), 64)
    with torch.no_grad():
        if args.child_impl == "eager":
            eager_attention(warm_q, warm_k, warm_v, sinks, scale, mask[:64, :64])
        else:
            sinkattn.flash_attn_with_sinks(warm_q, warm_k, warm_v, sinks, causal=True, backend="reference")
    del warm_q, warm_k, warm_v
    rss0 = rss_bytes()
    times = []
    with torch.no_grad():
        for _ in range(1 + args.reps):
            t = time.perf_counter()
            out = call()
            times.append(time.perf_counter() - t)
            del out
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"impl": args.child_impl, "seqlen": seqlen, "time_s": min(times[1:]), "peak_extra_bytes": peak - rss0}


def _agree(args, seqlen) -> float:
    """Max |eager - reference| on a short sequence, so the table compares the same computation."""
    a = argparse.Namespace(**vars(args))
    q, k, v, sinks = _inputs(a, seqlen)
    i = torch.arange(seqlen)[:, None]
    j = torch.arange(seqlen)[None, :]
    visible = (j <= i) & ((j >= i - args.window) if args.window >= 0 else True)
    mask = torch.zeros(seqlen, seqlen, dtype=q.dtype).masked_fill(~visible, torch.finfo(q.dtype).min)
    e = eager_attention(q, k, v, sinks, args.headdim ** -0.5, mask)
    r = sinkattn.flash_attn_with_sinks(q, k, v, sinks, causal=True, window_size=(args.window, 0), backend="reference")
    return (e.float() - r.float()).abs().max().item()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqlens", type=int, nargs="+", default=[2048, 4096, 8192])
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=1, help="default 1: one gpt-oss KV group (64 q / 8 kv heads)")
    p.add_argument("--headdim", type=int, default=64)
    p.add_argument("--window", type=int, default=-1, help="left window (gpt-oss sliding layers: 127); -1 = full causal")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--child-impl", help=argparse.SUPPRESS)
    p.add_argument("--child-seqlen", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.child_impl:
        print(json.dumps(child(args)))
        return
    passthrough = ["--heads", str(args.heads), "--kv-heads", str(args.kv_heads), "--headdim", str(args.headdim),
                   "--window", str(args.window), "--dtype", args.dtype, "--reps", str(args.reps),
                   "--threads", str(args.threads)]
    rows = {}
    for s in args.seqlens:
        for impl in ("eager", "reference"):
            r = subprocess.run([sys.executable, os.path.abspath(__file__), "--child-impl", impl, "--child-seqlen", str(s),
                                *passthrough], capture_output=True, text=True)
            if r.returncode != 0:
                rows[(impl, s)] = {"error": (r.stderr.strip().splitlines() or ["killed"])[-1]}
            else:
                rows[(impl, s)] = json.loads(r.stdout.strip().splitlines()[-1])
    mib = 1024 ** 2
    mask = "causal" if args.window < 0 else f"causal, window ({args.window}, 0)"
    print(f"CPU: {torch.get_num_threads()} threads; batch 1, {args.heads} q heads / {args.kv_heads} kv heads, "
          f"head dim {args.headdim}, {args.dtype}, {mask}, learnable sinks; time = best of {args.reps} after a warm-up; "
          f"memory = peak RSS above the inputs, fresh process per cell.\n")
    print("| seqlen | eager time (s) | reference time (s) | eager peak extra (MiB) | reference peak extra (MiB) |")
    print("|---:|---:|---:|---:|---:|")
    for s in args.seqlens:
        e, r = rows[("eager", s)], rows[("reference", s)]

        def t(x):
            return x.get("error") or f"{x['time_s']:.2f}"

        def m(x):
            return x.get("error") or f"{x['peak_extra_bytes'] / mib:.0f}"
        print(f"| {s} | {t(e)} | {t(r)} | {m(e)} | {m(r)} |")
    print(f"\nmax |eager - reference| at seqlen 512: {_agree(args, 512):.2e}")


if __name__ == "__main__":
    main()
