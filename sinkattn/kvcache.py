"""Decode and chunked prefill over a contiguous or paged KV cache (body of sinkattn::kvcache_fwd).

Layouts follow FlashAttention's flash_attn_with_kvcache: a contiguous cache is
(batch, capacity, nheads_k, d); a paged cache is (num_pages, page_size, nheads_k, d) with
block_table (batch, max_pages) int32 mapping a sequence's page i to a cache page. cache_seqlens
(int32) counts the tokens already cached; new k/v land right after them, in place.

Rotary (optional) is applied here, in fp32, to q and to the new k before they are used or stored:
query i and new key i sit at absolute position cache_seqlens + i (FlashAttention's rule for causal and
local attention; we use it for every mask, so positions never depend on the mask).
Appending and rotating stay in Python for every backend (they touch only the new tokens); a kernel
backend only has to attend over the cache (dispatch.py: `_kernels.kvcache_forward`).
"""
from __future__ import annotations

import torch

from . import _kernels, dispatch, reference
from ._checks import check_kvcache_values


def apply_rotary(x, cos, sin, positions, interleaved: bool):
    """Rotate the first 2*cos.shape[1] dims of x (b, s, h, d) at positions (b, s); rest unchanged."""
    rd = 2 * cos.shape[1]
    c = cos[positions].float()[:, :, None, :]
    s = sin[positions].float()[:, :, None, :]
    xr = x[..., :rd].float()
    if interleaved:  # GPT-J: pairs (x[2i], x[2i+1])
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        rot = torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).flatten(-2)
    else:  # GPT-NeoX: halves (x[i], x[i + rd/2])
        x1, x2 = xr[..., : rd // 2], xr[..., rd // 2:]
        rot = torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1)
    return torch.cat([rot.to(x.dtype), x[..., rd:]], dim=-1)


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


def _paged_fetch(k_cache, v_cache, pages, page_size: int):
    def fetch(t0: int, t1: int):
        pos = torch.arange(t0, t1, device=pages.device)
        page, slot = pages[pos // page_size], pos % page_size
        return k_cache[page, slot], v_cache[page, slot]
    return fetch


def reference_attention(q, k_cache, v_cache, sinks, seqlens_k: list[int], block_table, mask: reference.Mask):
    b, sq, h, _ = q.shape
    acc_t = reference.acc_dtype(q.dtype)
    sink = reference.sink_vector(sinks, h, acc_t, q.device)
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((b, h, sq), dtype=acc_t, device=q.device)
    for bi in range(b):
        if block_table is None:
            fetch = reference.slicer(k_cache[bi], v_cache[bi])
        else:
            fetch = _paged_fetch(k_cache, v_cache, block_table[bi].long(), k_cache.shape[1])
        reference.forward_seq(q[bi], fetch, seqlens_k[bi], k_cache.shape[2], sink, out[bi], lse[bi], mask)
    return out, lse


def forward(q, k_cache, v_cache, sinks, k, v, cache_seqlens, block_table, rotary_cos, rotary_sin,
            rotary_interleaved, softmax_scale, window_left, window_right, sink_tokens, softcap, num_splits,
            backend):
    paged = block_table is not None
    problem = dispatch.make_problem("kvcache", q, k_cache, sinks, window_left=window_left,
                                    window_right=window_right, sink_tokens=sink_tokens, softcap=softcap,
                                    paged=paged)
    chosen = dispatch.choose(problem, backend)
    seqlen_new = 0 if k is None else k.shape[1]
    page_size = k_cache.shape[1]
    capacity = block_table.shape[1] * page_size if paged else k_cache.shape[1]
    # Validate before writing anything (reading cache_seqlens synchronises: see dispatch.check_values).
    if dispatch.check_values(cache_seqlens):
        check_kvcache_values(cache_seqlens, seqlen_new, q.shape[1], capacity, block_table, page_size,
                             k_cache.shape[0], None if rotary_cos is None else rotary_cos.shape[0])
    start = cache_seqlens.long()
    if rotary_cos is not None:
        q = apply_rotary(q, rotary_cos, rotary_sin, start[:, None] + torch.arange(q.shape[1], device=q.device),
                         rotary_interleaved)
        if k is not None:
            k = apply_rotary(k, rotary_cos, rotary_sin, start[:, None] + torch.arange(seqlen_new, device=k.device),
                             rotary_interleaved)
    if k is not None:
        append(k_cache, v_cache, k, v, start, block_table)
    seqlens_k = (cache_seqlens + seqlen_new).to(torch.int32)
    mask = reference.Mask(softmax_scale, window_left, window_right, sink_tokens, softcap)
    if chosen == "reference":
        return reference_attention(q, k_cache, v_cache, sinks, seqlens_k.tolist(), block_table, mask)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32, device=q.device)
    _kernels.kvcache_forward(chosen, q.contiguous(), k_cache, v_cache, sinks, out, lse, cache_seqlens=seqlens_k,
                             block_table=block_table, softmax_scale=softmax_scale, window_left=window_left,
                             window_right=window_right, sink_tokens=sink_tokens, softcap=softcap,
                             num_splits=num_splits)
    return out, lse
