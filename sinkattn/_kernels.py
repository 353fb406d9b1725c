"""Bridge between dispatch and the compiled kernels in sinkattn._C.

Backends here: "sm80", "sm90" (CUDA tensors) and "sm80-emulated" (the sm80 kernel body run on the
CPU under host emulation, for tests). Dispatch asks `why_not(backend, problem)`; None means the
backend serves the problem, otherwise the string says why not and what would.
"""
from __future__ import annotations

from ._problem import Problem

KERNEL_BACKENDS = ("sm90", "sm80", "sm80-emulated")


def why_not(backend: str, problem: Problem) -> str | None:
    return f"backend {backend!r}: no kernels of this family are compiled into this build yet"


def forward(backend: str, q, k, v, sinks, out, lse, *, softmax_scale: float, window_left: int,
            window_right: int, sink_tokens: int, softcap: float,
            cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q: int = 0, max_seqlen_k: int = 0) -> None:
    raise NotImplementedError(why_not(backend, None))
