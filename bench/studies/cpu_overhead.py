"""CPU per-call time of sinkattn's public calls beside PyTorch's SDPA on identical shapes.

What a call costs on the CPU when the arithmetic is small: the Python wrapper (checks, dispatch, the op
layer) is then most of it. Every case runs in this one process; rounds are interleaved (each round times
every case once, --calls calls each), so a busy machine slows all cases alike; the table shows the median
per-call time over rounds, in microseconds, and the ratio to the case's baseline:

    python3 -m bench.studies.cpu_overhead [--calls 300] [--rounds 7] [--threads 1] [--context 1024] [--only tiny]

Cases (fp32, CPU, inference: torch.no_grad):
  tiny forward     flash_attn_with_sinks on (1, 16, 4, 64) q/k/v   vs SDPA on the same tensors as (b, h, s, d) views
  kvcache decode   flash_attn_with_kvcache, one query, gpt-oss 20b heads (64 q / 8 kv, hd 64), --context cached
                   keys, appending one token in place   vs SDPA (enable_gqa) over the same keys (+ the append)
  windowed decode  the same step with gpt-oss's sliding layers' window (127, 0), with 4 sink tokens or with
                   learnable sinks   vs the full-attention decode step through the same call
  transformers fn  the decode step through sinkattn's transformers attention function (q/k/v (b, h, s, d)), full
                   and sliding_window=128 with learnable sinks (gpt-oss's layers)   (when transformers is installed)
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import sinkattn
from sinkattn import interface

_FLASH = torch._scaled_dot_product_flash_attention_for_cpu  # the aten kernel SDPA and sinkattn's CPU path run


def _per_call(fn, calls: int) -> tuple[float, float]:
    """(wall, CPU time of this thread) per call in microseconds. With one torch thread every op runs on this
    thread, so its CPU time leaves out the time the machine gave to other processes (steadier when shared)."""
    t0, c0 = time.perf_counter(), time.thread_time()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6, (time.thread_time() - c0) / calls * 1e6


def _python_path(fn):
    """fn with flash_attn_with_sinks's C++ front end (csrc/cpu_front.cpp) switched off: the Python path the pure-Python
    build takes (the switch costs two attribute writes, about 0.1 us)."""
    def call():
        front, interface._CPU_FRONT = interface._CPU_FRONT, None
        try:
            return fn()
        finally:
            interface._CPU_FRONT = front
    return call


def cases(context: int):
    """[(name, baseline name or None, fn)]: the baseline of a row is the row it is compared with."""
    g = torch.Generator().manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=g)

    rows = []
    # tiny forward
    q, k, v = rnd(1, 16, 4, 64), rnd(1, 16, 4, 64), rnd(1, 16, 4, 64)
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    sinks4 = rnd(4)
    rows += [
        ("sdpa tiny (1,16,4,64)", None, lambda: F.scaled_dot_product_attention(qt, kt, vt)),
        ("sdpa tiny causal", None, lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)),
        # What a caller with flash-attn's (b, s, h, d) tensors pays for SDPA: the views in and out included.
        ("sdpa tiny, (b,s,h,d) in/out", "sdpa tiny (1,16,4,64)",
         lambda: F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)),
        # The floor of sinkattn's CPU path: the fused kernel it runs, with the layout views, and nothing else (no
        # checks, no dispatch, no sink).
        ("floor: tiny kernel + views", "sdpa tiny (1,16,4,64)",
         lambda: _FLASH(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=0.125)[0].transpose(1, 2)),
        ("sinkattn tiny", "sdpa tiny (1,16,4,64)", lambda: sinkattn.flash_attn_with_sinks(q, k, v)),
        ("sinkattn tiny causal+sinks", "sdpa tiny causal",
         lambda: sinkattn.flash_attn_with_sinks(q, k, v, sinks4, causal=True)),
        ("sinkattn tiny causal+sinks+lse", "sdpa tiny causal",
         lambda: sinkattn.flash_attn_with_sinks(q, k, v, sinks4, causal=True, return_lse=True)),
    ]
    if interface._CPU_FRONT is not None:  # the same calls without the C++ front end: what the pure-Python build pays
        rows += [
            ("sinkattn tiny, Python path", "sdpa tiny (1,16,4,64)",
             _python_path(lambda: sinkattn.flash_attn_with_sinks(q, k, v))),
            ("sinkattn tiny causal+sinks, Python path", "sdpa tiny causal",
             _python_path(lambda: sinkattn.flash_attn_with_sinks(q, k, v, sinks4, causal=True))),
        ]
    # decode over a KV cache: gpt-oss 20b's heads
    h, hk, d, cap = 64, 8, 64, context + 64
    kc, vc = rnd(1, cap, hk, d), rnd(1, cap, hk, d)
    qd, kn, vn = rnd(1, 1, h, d), rnd(1, 1, hk, d), rnd(1, 1, hk, d)
    sinks = rnd(h)
    n = context - 1  # tokens cached before the step; the step appends one at slot n (the same slot every call)
    lens = torch.tensor([n], dtype=torch.int32)
    qdt = qd.transpose(1, 2)

    def sdpa_decode():
        return F.scaled_dot_product_attention(qdt, kc[:, :n + 1].transpose(1, 2), vc[:, :n + 1].transpose(1, 2),
                                              enable_gqa=True)

    def sdpa_decode_append():
        kc[:, n:n + 1] = kn
        vc[:, n:n + 1] = vn
        return sdpa_decode()

    def kv(**kw):
        return lambda: sinkattn.flash_attn_with_kvcache(qd, kc, vc, k=kn, v=vn, cache_seqlens=lens, causal=True, **kw)

    kc_full = kc[:, :n + 1]
    vc_full = vc[:, :n + 1]

    def sinks_api(**kw):
        return lambda: sinkattn.flash_attn_with_sinks(qd, kc_full, vc_full, causal=True, **kw)

    full = f"kvcache decode ({context} keys)"
    full_s = f"with_sinks decode ({context} keys)"
    rows += [
        (f"sdpa decode ({context} keys, gqa)", None, sdpa_decode),
        ("sdpa decode + append", None, sdpa_decode_append),
        (full, "sdpa decode + append", kv()),
        ("kvcache decode, learnable sinks", "sdpa decode + append", kv(sinks=sinks)),
        ("kvcache decode, no append", f"sdpa decode ({context} keys, gqa)",
         lambda: sinkattn.flash_attn_with_kvcache(qd, kc, vc, cache_seqlens=lens + 1, causal=True)),
        ("kvcache window(127,0)+4 sink tokens", full, kv(window_size=(127, 0), sink_tokens=4)),
        ("kvcache window(127,0)+learnable sinks", full, kv(window_size=(127, 0), sinks=sinks)),
        (full_s, f"sdpa decode ({context} keys, gqa)", sinks_api()),
        ("with_sinks window(127,0)+4 sink tokens", full_s, sinks_api(window_size=(127, 0), sink_tokens=4)),
        ("with_sinks window(127,0)+learnable sinks", full_s, sinks_api(window_size=(127, 0), sinks=sinks)),
    ]
    # the same decode step through the transformers attention function (transformers' (b, h, s, d) layout; what a
    # gpt-oss model's sliding and full layers call), when transformers is installed
    try:
        import types
        from sinkattn.integrations import transformers as sat
    except ImportError:
        return rows
    module = types.SimpleNamespace(is_causal=True, layer_idx=0, config=None)
    kt_full, vt_full = kc_full.transpose(1, 2), vc_full.transpose(1, 2)

    def hf(**kw):
        return lambda: sat.sinkattn_attention_forward(module, qdt, kt_full, vt_full, None, scaling=0.125, **kw)

    full_hf = f"transformers fn decode ({context} keys)"
    rows += [
        (full_hf, f"sdpa decode ({context} keys, gqa)", hf()),
        ("transformers fn decode, learnable sinks", f"sdpa decode ({context} keys, gqa)", hf(s_aux=sinks)),
        ("transformers fn sliding_window=128+sinks", full_hf, hf(sliding_window=128, s_aux=sinks)),
    ]
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=300, help="calls per case per round")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--context", type=int, default=1024, help="cached keys of the decode cases")
    p.add_argument("--only", default="", help="run only the cases whose name (or baseline's) contains this")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    rows = cases(a.context)
    if a.only:
        keep = {n for n, b, _ in rows if a.only in n}
        rows = [r for r in rows if r[0] in keep or any(r[0] == b for n, b, _ in rows if n in keep)]
    got = {name: [] for name, _, _ in rows}
    with torch.no_grad():
        for _, _, fn in rows:  # warm-up (one-time warnings, caches, lazy imports)
            for _ in range(20):
                fn()
        for _ in range(a.rounds):
            for name, _, fn in rows:
                got[name].append(_per_call(fn, a.calls))
    wall = {name: statistics.median(t[0] for t in r) for name, r in got.items()}
    cpu = {name: statistics.median(t[1] for t in r) for name, r in got.items()}
    print(f"CPU per-call time, median over {a.rounds} interleaved rounds of {a.calls} calls, {torch.get_num_threads()} "
          f"torch thread(s), torch {torch.__version__}, sinkattn {sinkattn.__version__}, fp32, torch.no_grad; "
          f"us per call: wall, and CPU time of the calling thread; flash_attn_with_sinks's C++ front end: "
          f"{'on' if interface._CPU_FRONT is not None else 'absent (pure-Python build)'}")
    print(f"  {'case':44s} {'wall':>8s} {'cpu':>8s} {'cpu/base':>8s}  baseline")
    for name, base, _ in rows:
        ratio = f"{cpu[name] / cpu[base]:7.2f}x" if base else ""
        print(f"  {name:44s} {wall[name]:8.1f} {cpu[name]:8.1f} {ratio:>8s}  {base or ''}")
    return wall, cpu


if __name__ == "__main__":
    main()
