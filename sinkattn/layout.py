"""Shape and dtype facts every layer shares: head dims, the accumulation (and LSE) dtype, the LSE shape.

One owner each, so the validation, the ops' fake implementations, the backends and the integrations cannot
disagree about them.
"""
from __future__ import annotations

import torch

from . import _ext

# The contract's head dims, the same on every backend so that code that runs on the CPU also runs on a GPU:
# the kernels load rows of 16 bytes (8 half elements) and instantiate head dims up to 256.
HEADDIM_MULTIPLE = 8
HEADDIM_MAX = 256


# What a process without the binary's list uses: a pure-Python build (no extension, and no csrc/ beside an installed
# package) or a binary built before build_info carried the list. The same as csrc/build_info.h kKernelHeadDims
# (tests/test_kernel_tables.py fails when they differ); with no kernels it only says what a kernel build serves.
SOURCE_HEADDIMS = (64, 128, 256)


def kernel_headdims_of(info: dict | None) -> tuple[int, ...]:
    """The head dims the kernels are instantiated for: the binary's build_info()["kernel_headdims"] (the C++ list,
    csrc/build_info.h kKernelHeadDims, which the generator reads too), else SOURCE_HEADDIMS."""
    if info is None or "kernel_headdims" not in info:
        return SOURCE_HEADDIMS
    return tuple(sorted(int(h) for h in info["kernel_headdims"]))


# A call runs on the smallest one that holds its head dim (the kernels pad the rest).
KERNEL_HEADDIMS = kernel_headdims_of(_ext.build_info())


def headdim_supported(d: int) -> bool:
    """Whether the API accepts head dim `d` (any backend)."""
    return 0 < d <= HEADDIM_MAX and d % HEADDIM_MULTIPLE == 0


def kernel_headdim(d: int) -> int | None:
    """The instantiated head dim whose kernels serve head dim `d`, or None (too large)."""
    for h in KERNEL_HEADDIMS:
        if d <= h:
            return h
    return None


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype softmax statistics are computed in and lse is returned in: float64 for float64 inputs
    (gradcheck), float32 for everything else."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def lse_shape(q: torch.Tensor, varlen: bool) -> tuple:
    """lse of q (batch, seqlen_q, nheads, d): (batch, nheads, seqlen_q); varlen q (total_q, nheads, d):
    (nheads, total_q)."""
    return (q.shape[1], q.shape[0]) if varlen else (q.shape[0], q.shape[2], q.shape[1])
