"""The types every comparator shares: its inputs, what it prepares, and its refusal.

Their own module so that comparators.py and peer_vllm.py (whose "vllm-triton" entry comparators.py lists) both
import them without importing each other.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


class Unsupported(Exception):
    """This comparator cannot do this case's math; the message says why (reported as status 'n/a')."""


@dataclass
class Prepared:
    fn: object                    # the timed callable
    sink_handling: str
    backend: str
    output: object = None         # callable -> tensor to compare with sinkattn's (fwd: out; bwd: dq)
    graphable: bool = False       # whether fn may be captured in a CUDA graph
    note: str = ""
    keep: list = field(default_factory=list)  # tensors that must live as long as fn


@dataclass
class Inputs:
    """One case's random inputs (comparators.make_inputs), the same tensors for every comparator."""
    q: torch.Tensor                         # (b, sq, h, d)
    k: torch.Tensor | None                  # (b, sk, hk, d) (attn; decode: the cache's first sk tokens)
    v: torch.Tensor | None
    sinks: torch.Tensor | None              # (h,) fp32
    dout: torch.Tensor | None = None        # bwd
    k_cache: torch.Tensor | None = None     # decode: contiguous (b, sk, hk, d) or paged (pages, ps, hk, d)
    v_cache: torch.Tensor | None = None
    block_table: torch.Tensor | None = None
    cache_seqlens: torch.Tensor | None = None
