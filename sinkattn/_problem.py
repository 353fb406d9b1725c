"""The normalized description of one attention call, shared by dispatch and the kernel backends.

Dispatch builds one Problem from validated arguments; each backend answers whether it can serve it
(`why_not`) with a reason a user can act on. Keeping it a plain frozen dataclass keeps backend choice
cheap and lets torch.compile treat it as a constant.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Problem:
    kind: str                 # "fwd", "bwd" or "kvcache"
    device_type: str          # "cuda" or "cpu"
    dtype: torch.dtype        # dtype of q/k/v
    headdim: int
    headdim_v: int
    nheads: int
    nheads_k: int
    window_left: int          # -1 = unbounded
    window_right: int         # -1 = unbounded; causal is window_right == 0
    sink_tokens: int
    softcap: float
    has_sinks: bool
    varlen: bool
    paged: bool = False
    deterministic: bool = False
    device_index: int | None = None
    positive_scale: bool = True  # softmax_scale > 0 (the kernels' running max is over the raw scores)
