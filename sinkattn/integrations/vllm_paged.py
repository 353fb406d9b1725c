"""The work of sinkattn's vLLM backend on vLLM's paged KV cache, with no vLLM import.

`vllm_backend` (the vLLM classes) calls these; the benchmark times them on a GPU machine where vLLM is not
installed, so what is measured is the backend's forward itself.

Layout: vLLM 0.33 hands FlashAttention-style backends a logical (num_blocks, num_kv_heads, block_size,
2 * head_size) cache, K then V in the last dim, over whichever physical order it allocated.
`cache_views` swaps dims 1 and 2 and splits the last one, giving the (num_pages, page_size, nheads_k,
headdim) views `sinkattn.flash_attn_with_kvcache` reads by strides (no copy).

Calls: vLLM has written this step's K/V into the cache before attention, so every request's keys are
all in the cache: cache_seqlens = seq_lens, and the queries are the request's last query_len positions,
flash_attn_with_kvcache's bottom-right alignment. `plan_runs` groups consecutive requests of equal query
length (from vLLM's host copy of query_start_loc); `attend` makes one call per run on views of q, out,
seq_lens and block_table, and reads nothing on the host.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import dispatch
from .._problem import Problem
from ..mask import Mask
from ..interface import flash_attn_with_kvcache


@dataclass(frozen=True)
class Run:
    """Requests [r0, r1) all with query length L; their tokens start at row t0."""
    r0: int
    r1: int
    t0: int
    L: int


def plan_runs(query_start_loc_cpu: torch.Tensor, num_reqs: int) -> tuple[Run, ...]:
    """Runs of consecutive requests with equal query length, from a host (CPU) query_start_loc.
    Requests with no query (vLLM's padding requests in a padded batch) are skipped."""
    starts = query_start_loc_cpu[: num_reqs + 1].tolist()  # a CPU tensor: no device sync
    runs: list[Run] = []
    r = 0
    while r < num_reqs:
        L = starts[r + 1] - starts[r]
        r1 = r + 1
        while r1 < num_reqs and starts[r1 + 1] - starts[r1] == L:
            r1 += 1
        if L > 0:
            runs.append(Run(r, r1, starts[r], L))
        r = r1
    return tuple(runs)


def cache_views(kv_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's logical (num_blocks, nheads_k, block_size, 2 * head_size) cache -> K and V page views."""
    return kv_cache.transpose(1, 2).split(head_size, dim=-1)


def kernel_gap(head_size: int, dtype: torch.dtype, capability) -> str | None:
    """None when a compiled sinkattn kernel serves this paged attention on a GPU of `capability` (a (major,
    minor) pair or vLLM's DeviceCapability); else why not. Otherwise `attend` would run on the PyTorch
    reference: slow, and it reads sequence lengths on the host, which a CUDA graph cannot hold."""
    cap = (capability[0], capability[1]) if isinstance(capability, tuple) else (capability.major,
                                                                                capability.minor)
    problem = Problem(kind="kvcache", device_type="cuda", dtype=dtype, headdim=head_size, mask=Mask(1.0, -1, 0),
                      has_sinks=True, paged=True)
    chosen, declined = dispatch.plan(problem, cap)
    return None if chosen != "reference" else dispatch.declined_text(declined)


def write_kv(k_cache, v_cache, key, value, slot_mapping) -> None:
    """Write key/value (num_tokens, nheads_k, head_size) at slot_mapping (block * block_size + offset).

    Padding tokens have slot -1. A mask would need a device-to-host read, which a CUDA graph cannot hold, so
    they are written, as zeros, to slot 0 instead: block 0 is vLLM's null block (its block pool reserves it
    and never gives it to a request; sliding-window layers point dropped pages at it), which stays zero."""
    n = slot_mapping.shape[0]  # key/value may be padded beyond the scheduled tokens
    pad = (slot_mapping < 0)[:, None, None]
    slots = slot_mapping.clamp(min=0).long()
    block, offset = slots // k_cache.shape[1], slots % k_cache.shape[1]
    k_cache[block, offset] = torch.where(pad, 0, key[:n]).to(k_cache.dtype)
    v_cache[block, offset] = torch.where(pad, 0, value[:n]).to(v_cache.dtype)


def attend(query, k_cache, v_cache, seq_lens, block_table, runs, out, sinks=None, *, softmax_scale,
           window_size=(-1, -1), softcap=0.0, backend="auto"):
    """Causal attention of query (num_tokens, h, d) over the paged cache, into out (num_tokens, h, d)."""
    h, d = query.shape[1], query.shape[2]
    for run in runs:
        n = run.r1 - run.r0
        rows = slice(run.t0, run.t0 + n * run.L)
        o = flash_attn_with_kvcache(query[rows].view(n, run.L, h, d), k_cache, v_cache, sinks,
                                    cache_seqlens=seq_lens[run.r0:run.r1], block_table=block_table[run.r0:run.r1],
                                    softmax_scale=softmax_scale, causal=True, window_size=window_size,
                                    softcap=softcap, backend=backend)
        out[rows].copy_(o.view(n * run.L, h, d))
    return out
