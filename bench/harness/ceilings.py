"""The machine's ceilings, measured in the same run as the benchmarks.

- copy: a large device-to-device copy, counting bytes read plus bytes written, in GB/s (1e9 B/s);
- matmul: a large bf16 matrix product (random data, never zeros) through torch.matmul, in TFLOP/s.

Both use the same timing as the benchmarks (timing.py). Sizes are chosen to be far above L2 and
launch overhead on a GPU and small on the CPU, where the numbers only exercise the code.
"""
from __future__ import annotations

import torch

from . import timing


def measure_copy(device: torch.device, nbytes: int | None = None, budget_ms: float = 300.0) -> dict:
    if nbytes is None:
        nbytes = (2 << 30) if device.type == "cuda" else (64 << 20)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        nbytes = min(nbytes, int(free * 0.3) // 2)
    n = nbytes // 2
    src = torch.randn(n, dtype=torch.float32, device=device).to(torch.bfloat16)
    dst = torch.empty_like(src)
    t = timing.bench(lambda: dst.copy_(src), device, budget_ms=budget_ms, min_reps=5, max_reps=50,
                     flush_l2=False)  # a copy of GBs does not live in L2
    moved = 2 * src.numel() * src.element_size()
    return {"copy_GBps": moved / (t.median_ms * 1e-3) / 1e9, "copy_bytes": moved, "copy_ms": t.median_ms,
            "copy_reps": t.reps}


def measure_matmul(device: torch.device, n: int | None = None, dtype=torch.bfloat16,
                   budget_ms: float = 300.0) -> dict:
    if n is None:
        n = 8192 if device.type == "cuda" else 512
    if device.type == "cpu" and dtype == torch.bfloat16:
        dtype = torch.float32  # CPU bf16 GEMM speed varies by build; fp32 is the CPU's ceiling anyway
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    c = torch.empty(n, n, device=device, dtype=dtype)
    t = timing.bench(lambda: torch.matmul(a, b, out=c), device, budget_ms=budget_ms, min_reps=5, max_reps=50,
                     flush_l2=False)  # 3 x 128 MiB operands; compute-bound
    flops = 2 * n ** 3
    return {"matmul_TFLOPs": flops / (t.median_ms * 1e-3) / 1e12, "matmul_n": n, "matmul_dtype": str(dtype),
            "matmul_ms": t.median_ms, "matmul_reps": t.reps}


def measure(device: torch.device) -> dict:
    out = {"device": str(device)}
    out.update(measure_copy(device))
    out.update(measure_matmul(device))
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out
