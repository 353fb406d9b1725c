"""The bridge to the compiled kernels in sinkattn._C: the fourth layer, under dispatch, beside reference.

interface (validation) -> ops (custom ops, fake impls, autograd) -> dispatch (backend choice, outputs) ->
kernels (here) | reference. Each launch_* takes a backend dispatch has chosen (dispatch.why_not said it
serves the call) and outputs dispatch allocated, brings the tensors to the layout the kernels read (16-byte
aligned rows, dense int32 index tensors, no zero (broadcast) strides for a kernel whose registry entry does not
list "broadcast_strides"), calls _C and writes the outputs in place.

Backends: "sm90", "sm80" (CUDA tensors), "sm80-emulated" and "sm90-emulated" (the sm80 / sm90 kernel bodies on the
CPU under host emulation, for tests; csrc/emu/). launch_fwd also takes "variant:<registry name>": a tuning-grid variant (family
"*-sweep", built with SINKATTN_SWEEP; bench/sweep/runner.py runs them, dispatch never picks them).
"""
from __future__ import annotations

import torch

from . import _ext, registry
from .errors import SinkattnRuntimeError
from .mask import Mask


def launch_fwd(backend: str, q, k, v, sinks, out, lse, mask: Mask, *, cu_seqlens_q=None, cu_seqlens_k=None,
               max_seqlen_q: int = 0, max_seqlen_k: int = 0, max_smem: int = 0) -> None:
    """Run the forward kernel of `backend`, writing `out` (like q) and `lse` (fp32) in place.

    q (b, sq, h, d) and k/v (b, sk, hk, d), or packed (total, h, d) with cu_seqlens when varlen; the caller
    has validated shapes and checked `dispatch.why_not` first. `max_smem` overrides the shared-memory limit that
    picks the tile configuration (tests use it to run the sm86 configuration under emulation)."""
    C = _ext.require()
    q, k, v = _readable(backend, "fwd", q, (q, k, v))
    target = out if _aligned(out) else torch.empty_like(out, memory_format=torch.contiguous_format)
    cu_seqlens_q, cu_seqlens_k = _dense_index(cu_seqlens_q), _dense_index(cu_seqlens_k)
    C.fwd(backend, q, k, v, sinks, target, lse, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k),
          mask.kernel_args(), int(max_smem))
    if target is not out:
        out.copy_(target)


def launch_bwd(backend: str, dout, q, k, v, sinks, out, lse, dlse, dq, dk, dv, dsinks, mask: Mask, *,
               deterministic: bool, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q: int = 0, max_seqlen_k: int = 0,
               max_smem: int = 0) -> None:
    """Run the backward kernel of `backend`, writing dq, dk, dv (like q, k, v; dk/dv summed over the query-head
    group) and dsinks (fp32 (nheads,), or None without sinks) in place. dlse (fp32 like lse) or None.

    deterministic=True: dq, dk, dv and dsinks are bitwise repeatable (dsinks, dk and dv are always reduced in a
    fixed order; dq tiles are added in increasing key-block order per M tile, ordered by a counter per M tile).
    `max_smem` overrides the shared-memory limit that picks the tile configuration (tests: the sm86 one)."""
    C = _ext.require()
    dout, q, k, v, out = _readable(backend, "bwd", q, (dout, q, k, v, out))
    if out.stride() != dout.stride():  # the kernels read both with one set of strides
        out, dout = _dense(out), _dense(dout)
    targets = [t if _aligned(t) else torch.empty_like(t, memory_format=torch.contiguous_format) for t in (dq, dk, dv)]
    ds = None
    if sinks is not None:
        ds = dsinks if (dsinks is not None and dsinks.dtype == torch.float32 and dsinks.is_contiguous()) else \
            torch.empty((q.shape[-2],), dtype=torch.float32, device=q.device)
    C.bwd(backend, dout, q, k, v, sinks, out, lse.contiguous(), None if dlse is None else dlse.float().contiguous(),
          *targets, ds, _dense_index(cu_seqlens_q), _dense_index(cu_seqlens_k), int(max_seqlen_q), int(max_seqlen_k),
          mask.kernel_args(), bool(deterministic), int(max_smem))
    for t, dst in zip(targets, (dq, dk, dv)):
        if t is not dst:
            dst.copy_(t)
    if ds is not None and dsinks is not None and ds is not dsinks:
        dsinks.copy_(ds)


def launch_kvcache(backend: str, q, k_cache, v_cache, sinks, out, lse, *, cache_seqlens, block_table, mask: Mask,
                   num_splits: int = 0, max_smem: int = 0, k_descale=None, v_descale=None, cu_seqlens_q=None,
                   max_seqlen_q: int = 0) -> None:
    """Attention of q (b, sq, h, d) over a KV cache that already holds the new keys, writing out and lse (b, h, sq);
    or, with cu_seqlens_q (b + 1,) int32 and max_seqlen_q, of packed q (total_q, h, d) into out (total_q, h, d) and
    lse (h, total_q): one launch for a batch of any mix (the serving call), rows past cu_seqlens_q[b] untouched.

    cache_seqlens (b,) int32 counts the keys of each sequence; block_table (b, max_pages) int32 for a paged
    cache. The query heads of a KV head share a tile (K/V read once per group); num_splits 0 picks split-KV
    from the SM count and the work, and the combine adds the sink once. FP8 caches (float8_e4m3fn / float8_e5m2)
    take their (batch, nheads_k) float32 descales (sinkattn.fp8.descales) and need 16-byte aligned rows too, which
    for 1-byte codes is strides in multiples of 16."""
    C = _ext.require()
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not _aligned(t) or (t.element_size() == 1 and not _aligned_bytes(t)):
            raise SinkattnRuntimeError(f"backend {backend!r}: {name} must have 16-byte aligned rows (strides multiple "
                                       f"of 8 elements, last dim contiguous) to be read in place; got strides "
                                       f"{tuple(t.stride())}. Use backend='reference' for this cache layout.")
    q = q if _aligned(q) else q.contiguous()
    target = out if _aligned(out) else torch.empty_like(out, memory_format=torch.contiguous_format)
    C.fwd_kvcache(backend, q, k_cache, v_cache, sinks, target, lse, cache_seqlens.to(torch.int32).contiguous(),
                  _dense_index(block_table), mask.kernel_args(), int(num_splits), int(max_smem), k_descale, v_descale,
                  _dense_index(cu_seqlens_q), int(max_seqlen_q))
    if target is not out:
        out.copy_(target)


def _readable(backend: str, op: str, q, tensors: tuple) -> tuple:
    """`tensors` as the kernel of `backend` can read them in place: 16-byte aligned rows, and no zero (broadcast)
    stride unless its registry entry lists "broadcast_strides" (registry.reads_broadcast_strides; the registry is
    asked only when an input is broadcast, so the usual call pays nothing for it)."""
    broadcast = [0 in t.stride() and _broadcast(t) for t in tensors]
    if any(broadcast) and not registry.reads_broadcast_strides(registry.launched_by(backend, op, q.shape[-1],
                                                                                    q.dtype)):
        return tuple(t.contiguous() if (b or not _aligned(t)) else t for t, b in zip(tensors, broadcast))
    return tuple(t if _aligned(t) else t.contiguous() for t in tensors)


def _dense(t):
    """t with the strides of a contiguous tensor of its shape. (An empty tensor counts as contiguous whatever its
    strides, so .contiguous() keeps them: a (b, 0, h, d) out and dout from different producers would still differ.)"""
    if t.stride() == torch.empty(t.shape, device="meta").stride():
        return t
    return torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)


def _dense_index(t):
    """Index tensors (cu_seqlens, block tables) as the kernels read them: contiguous int32. The API accepts any
    strides (a view such as cu[::2] is a valid argument), so the bridge makes them dense."""
    return None if t is None else t.to(torch.int32).contiguous()


def _broadcast(t) -> bool:
    return any(t.stride(i) == 0 and t.size(i) > 1 for i in range(t.dim()))


def _aligned_bytes(t) -> bool:
    """Every outer stride a multiple of 16 bytes (what _aligned checks for 2-byte elements)."""
    return all((t.stride(i) * t.element_size()) % 16 == 0 or t.size(i) == 1 for i in range(t.dim() - 1))


def _aligned(t) -> bool:
    """cp.async moves 16-byte vectors: the base and every outer stride must be 16-byte aligned."""
    if t.stride(-1) != 1 or t.data_ptr() % 16:
        return False
    return all(t.stride(i) % 8 == 0 or t.size(i) == 1 for i in range(t.dim() - 1))
