"""KV-cache helpers of the sinkattn::kvcache_fwd op: what happens to the new tokens before attention.

Layouts follow FlashAttention's flash_attn_with_kvcache: a contiguous cache is
(batch, capacity, nheads_k, d); a paged cache is (num_pages, page_size, nheads_k, d) with
block_table (batch, max_pages) int32 mapping a sequence's page i to a cache page. cache_seqlens
(int32) counts the tokens already cached; new k/v land right after them, in place.

Rotary (optional, sinkattn.rotary) is applied to q and to the new k before they are used or stored, in
fp32 (float64 for float64): query i and new key i sit at absolute position cache_seqlens + i
(FlashAttention's rule for causal and local attention; we use it for every mask, so positions never depend
on the mask). Appending and rotating stay in Python for every backend (they touch only the new tokens), so
a backend only attends over the cache. The backend is chosen by dispatch.run_kvcache, which calls `prepare`
once it has chosen (a refused forced backend writes nothing).

Varlen queries over a cache (vLLM's call, the drop-in's paged varlen forms) are the serving form: packed q with
cu_seqlens_q over a cache that already holds every key, one kernel launch for the whole batch
(interface.flash_attn_with_kvcache(cu_seqlens_q=...)); `check_varlen_values` is its value check.
"""
from __future__ import annotations

import torch

from . import _checks, fp8
from .errors import SinkattnValueError
from .rotary import apply_rotary


def _quantized(k_cache, v_cache, k, v, descales):
    """The new k/v as the cache stores them: FP8 caches (descales (k, v), each (b, hk)) take x / scale, saturating
    (sinkattn.fp8.quantize); other caches take k/v as they are."""
    if descales is None:
        return k, v
    return fp8.quantize(k, descales[0], k_cache.dtype), fp8.quantize(v, descales[1], v_cache.dtype)


def append(k_cache, v_cache, k, v, start, block_table) -> None:
    """Write k/v (b, s, hk, d) into the caches at positions start[b] + i (start int64 (b,))."""
    b, s = k.shape[:2]
    pos = start[:, None] + torch.arange(s, device=k.device)
    if block_table is None:
        rows = torch.arange(b, device=k.device)[:, None].expand(b, s)
        k_cache[rows, pos] = k
        v_cache[rows, pos] = v
    else:
        page_size = k_cache.shape[1]
        page = block_table.long().gather(1, pos // page_size)
        k_cache[page, pos % page_size] = k
        v_cache[page, pos % page_size] = v


def append_host(k_cache, v_cache, k, v, lens) -> None:
    """append() with the start positions known on the host (lens, a list): one slice copy per sequence
    (contiguous cache) instead of an index_put and its index tensors."""
    s = k.shape[1]
    for b, n in enumerate(lens):
        k_cache[b, n:n + s] = k[b]
        v_cache[b, n:n + s] = v[b]


def prepare(q, k_cache, v_cache, k, v, cache_seqlens, block_table, rotary_cos, rotary_sin, rotary_interleaved,
            descales=None):
    """Validate the index values, rotate q and the new k, append k/v (quantized for an FP8 cache: `descales`, the
    (k, v) descales of sinkattn.fp8) -> (q rotated, keys per sequence).

    The keys per sequence are an int32 tensor, or for CPU tensors a list of ints: reading cache_seqlens costs no
    device synchronisation there, so it is read once and the lengths serve the value checks, the append and the
    reference backend (which reads them on the host anyway)."""
    seqlen_new = 0 if k is None else k.shape[1]
    page_size = k_cache.shape[1]
    capacity = block_table.shape[1] * page_size if block_table is not None else k_cache.shape[1]
    host = cache_seqlens.device.type == "cpu"
    lens = cache_seqlens.tolist() if host else cache_seqlens
    # Validate before writing anything (reading cache_seqlens synchronises: see _checks.value_checks_on).
    if _checks.value_checks_on(cache_seqlens):
        _checks.check_kvcache_values(lens, seqlen_new, q.shape[1], capacity, block_table, page_size,
                                     k_cache.shape[0], None if rotary_cos is None else rotary_cos.shape[0])
    start = None
    if rotary_cos is not None:
        start = cache_seqlens.long()
        q = apply_rotary(q, rotary_cos, rotary_sin, start[:, None] + torch.arange(q.shape[1], device=q.device),
                         rotary_interleaved)
        if k is not None:
            k = apply_rotary(k, rotary_cos, rotary_sin, start[:, None] + torch.arange(seqlen_new, device=k.device),
                             rotary_interleaved)
    if k is not None:
        k, v = _quantized(k_cache, v_cache, k, v, descales)
        if host and block_table is None:
            append_host(k_cache, v_cache, k, v, lens)
        else:
            append(k_cache, v_cache, k, v, cache_seqlens.long() if start is None else start, block_table)
    if host:
        return q, [n + seqlen_new for n in lens]
    return q, (cache_seqlens + seqlen_new).to(torch.int32)


def check_varlen_values(q, k_cache, cache_seqlens, block_table, cu_seqlens_q) -> None:
    """The serving form's value checks (each reads an index tensor, so they are off where _checks.value_checks_on
    says: under CUDA-graph capture and with SINKATTN_VALUE_CHECKS=0): cu_seqlens_q starts at 0, never decreases and
    ends within q; each request's keys fit its cache (and its pages exist)."""
    if not _checks.value_checks_on(cu_seqlens_q):
        return
    starts = cu_seqlens_q.tolist()
    total = q.shape[0]
    if starts[0] != 0 or any(b < a for a, b in zip(starts, starts[1:])) or starts[-1] > total:
        shown = starts if len(starts) <= 12 else starts[:12] + ["..."]
        raise SinkattnValueError(
            f"sinkattn: cu_seqlens_q is {shown}; accepted: offsets starting at 0, non-decreasing, ending at most at "
            f"total_q = {total} (q.shape[0])")
    page_size = k_cache.shape[1]
    capacity = block_table.shape[1] * page_size if block_table is not None else k_cache.shape[1]
    _checks.check_kvcache_values(cache_seqlens, 0, 0, capacity, block_table, page_size, k_cache.shape[0], None)
