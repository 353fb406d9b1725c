"""Shape and dtype facts every layer shares: head dims, the accumulation (and LSE) dtype, the LSE shape.

One owner each, so the validation, the ops' fake implementations, the backends and the integrations cannot
disagree about them.
"""
from __future__ import annotations

import torch

# The contract's head dims, the same on every backend so that code that runs on the CPU also runs on a GPU:
# the kernels load rows of 16 bytes (8 half elements) and instantiate head dims up to 256.
HEADDIM_MULTIPLE = 8
HEADDIM_MAX = 256
# The head dims the kernels are instantiated for (csrc/generate_kernels.py); a call runs on the smallest one
# that holds its head dim (the kernels pad the rest).
KERNEL_HEADDIMS = (64, 128, 256)


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
