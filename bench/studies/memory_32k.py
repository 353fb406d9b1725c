"""The reference backend's memory bound: it runs batch 1, 8 heads, head dim 128, seqlen 32k causal
on the CPU within 4 GiB of extra memory (a dense score matrix alone would be 8 * 32k * 32k * 4 B = 32 GiB).

Run in a fresh process; extra memory = peak RSS (ru_maxrss) minus the RSS just before the call, after the
inputs exist and after one tiny call has initialised the libraries. Exits 1 when over the limit.

    python bench/studies/memory_32k.py                 # bf16, prints time and memory, one JSON line last
    python bench/studies/memory_32k.py --seqlen 8192 --dtype float32
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo

import torch  # noqa: E402

from bench.harness.env import rss_bytes  # noqa: E402

import sinkattn  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqlen", type=int, default=32768)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--headdim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--limit-gib", type=float, default=4.0)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dt = getattr(torch, args.dtype)
    shape = (1, args.seqlen, args.heads, args.headdim)
    q, k, v = (torch.randn(shape).to(dt) for _ in range(3))
    sinks = torch.randn(args.heads)
    with torch.no_grad():
        tiny = q[:, :64].contiguous()
        sinkattn.flash_attn_with_sinks(tiny, tiny, tiny, sinks, causal=True)
        del tiny
        rss0 = rss_bytes()
        t = time.perf_counter()
        out, lse = sinkattn.flash_attn_with_sinks(q, k, v, sinks, causal=True, return_lse=True)
        elapsed = time.perf_counter() - t
    extra = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss0
    ok = bool(torch.isfinite(out).all() and torch.isfinite(lse).all())
    gib = extra / 1024 ** 3
    print(f"batch 1, {args.heads} heads, head dim {args.headdim}, seqlen {args.seqlen}, causal, {args.dtype}, "
          f"{torch.get_num_threads()} threads: {elapsed:.1f} s, peak extra memory {gib:.2f} GiB "
          f"(output {out.numel() * out.element_size() / 1024 ** 2:.0f} MiB; limit {args.limit_gib} GiB)")
    print(json.dumps({"seqlen": args.seqlen, "time_s": elapsed, "peak_extra_bytes": extra, "finite": ok}))
    return 0 if ok and gib <= args.limit_gib else 1


if __name__ == "__main__":
    sys.exit(main())
