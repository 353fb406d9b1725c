"""The normalized description of one attention call, shared by dispatch and the kernel backends.

Dispatch builds one Problem per call (`Problem.of_call`, from the validated tensors and the call's Mask); the
report, the vLLM integration, bench/ and tests build representative ones with the constructor, naming only what
differs from the defaults. Each backend answers whether it can serve a Problem (`dispatch.why_not`) with a reason a
user can act on, and `dispatch.plan` picks the backend. A plain frozen dataclass keeps backend choice cheap and lets
torch.compile treat it as a constant.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from . import fp8
from .mask import Mask


@dataclass(frozen=True)
class Problem:
    kind: str                 # "fwd", "bwd" or "kvcache"
    device_type: str          # "cuda" or "cpu"
    dtype: torch.dtype        # dtype of q/k/v
    headdim: int
    nheads: int = 1
    nheads_k: int = 1
    mask: Mask = field(default_factory=Mask)  # scale, window, sink tokens, softcap
    has_sinks: bool = False
    varlen: bool = False
    paged: bool = False
    page_size: int = 0        # rows per page of a paged cache (0: not known, served as vLLM's 16)
    deterministic: bool = False
    device_index: int | None = None
    kv_fp8: bool = False          # the keys and values are an FP8 cache (sinkattn.fp8)

    @classmethod
    def of_call(cls, kind: str, q, k, sinks, mask: Mask, *, varlen: bool = False, paged: bool = False,
                deterministic: bool = False) -> "Problem":
        """The problem of one call on q (..., nheads, headdim) and k (..., nheads_k, headdim); a paged k is a page
        pool (pages, page_size, nheads_k, headdim)."""
        return cls(kind=kind, device_type=q.device.type, dtype=q.dtype, headdim=q.shape[-1], nheads=q.shape[-2],
                   nheads_k=k.shape[-2], mask=mask, has_sinks=sinks is not None, varlen=varlen, paged=paged,
                   page_size=k.shape[1] if paged else 0, deterministic=deterministic, device_index=q.device.index,
                   kv_fp8=fp8.is_fp8(k.dtype))

    @property
    def positive_scale(self) -> bool:
        """softmax_scale > 0 (the kernels' running max is over the raw scores)."""
        return self.mask.scale > 0
