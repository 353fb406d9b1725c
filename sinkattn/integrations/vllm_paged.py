"""The work of sinkattn's vLLM backend on vLLM's paged KV cache, with no vLLM import.

`vllm_backend` (the vLLM classes) calls these; the benchmark times them on a GPU machine where vLLM is not
installed, so what is measured is the backend's forward itself.

Layout: vLLM 0.33 hands FlashAttention-style backends a logical (num_blocks, num_kv_heads, block_size,
2 * head_size) cache, K then V in the last dim, over whichever physical order it allocated.
`cache_views` swaps dims 1 and 2 and splits the last one, giving the (num_pages, page_size, nheads_k,
headdim) views `sinkattn.flash_attn_with_kvcache` reads by strides (no copy).

Calls: vLLM has written this step's K/V into the cache before attention, so every request's keys are
all in the cache: cache_seqlens = seq_lens, and the queries are the request's last query_len positions,
flash_attn_with_kvcache's bottom-right alignment. `attend` is one call of the serving form
(dispatch.run_kvcache_serving: packed queries with vLLM's query_start_loc, one kernel launch for the whole batch,
whatever its mix) into vLLM's output buffer; it reads nothing on the host (vLLM's metadata is trusted: no value
checks), and its launch depends on the padded sizes alone, so any batch can be replayed in a CUDA graph.

FP8 caches (`--kv-cache-dtype fp8 | fp8_e4m3 | fp8_e5m2`): vLLM allocates them as uint8 (its
STR_DTYPE_TO_TORCH_DTYPE) and each backend views them as its FP8 type; on CUDA "fp8" is e4m3
(`FP8_KV_DTYPES`). The cache holds x / scale with the attention layer's scales, `layer._k_scale` and
`layer._v_scale` (float32 on the device, as vLLM's reshape_and_cache_flash and Triton writer divide by them):
one element (per tensor, vLLM's default and its `kv_scale` checkpoints) or one per KV head of this rank
(compressed-tensors' `attn_head` strategy, shape (num_kv_heads,)). `write_kv` quantizes with them
(sinkattn.fp8.quantize: saturating, NaN kept, as vLLM's writers); `attend` passes the scales as (requests, nheads_k)
descales, expanded views of the layer's own tensors (no copy, no host read; a CUDA graph replays the current
values).
"""
from __future__ import annotations

import torch

from .. import dispatch, fp8
from .._problem import Problem
from ..errors import SinkattnValueError
from ..mask import Mask

# vLLM's FP8 kv_cache_dtype names on CUDA -> the cache's element type (vLLM's "fp8" is e4m3 there:
# current_platform.fp8_dtype(), and its kv_cache_dtype mapping "fp8" -> "fp8_e4m3").
FP8_KV_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def cache_views(kv_cache: torch.Tensor, head_size: int,
                cache_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's logical (num_blocks, nheads_k, block_size, 2 * head_size) cache -> K and V page views.
    cache_dtype: an FP8 cache's element type; vLLM's uint8 allocation is viewed as it (same bytes)."""
    k, v = kv_cache.transpose(1, 2).split(head_size, dim=-1)
    if cache_dtype is not None and kv_cache.dtype != cache_dtype:
        if kv_cache.dtype != torch.uint8:
            raise SinkattnValueError(f"sinkattn vLLM backend: an FP8 ({cache_dtype}) KV cache must be allocated as "
                                     f"uint8 (as vLLM does) or {cache_dtype}; got {kv_cache.dtype}")
        k, v = k.view(cache_dtype), v.view(cache_dtype)
    return k, v


def layer_scales(layer, num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An FP8 cache's (k, v) scales from vLLM's attention layer: its `_k_scale`, `_v_scale` tensors, one element
    (per tensor) or num_kv_heads (per KV head). Shapes only are checked (no device read)."""
    out = []
    for name in ("_k_scale", "_v_scale"):
        t = getattr(layer, name, None)
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise SinkattnValueError(
                f"sinkattn vLLM backend: an FP8 KV cache needs the attention layer's {name} (a float32 tensor, as "
                f"vLLM's Attention layer holds); got {type(t).__name__ if t is None else t}")
        if t.numel() not in (1, num_kv_heads) or (t.numel() == num_kv_heads > 1 and t.dim() != 1):
            raise SinkattnValueError(
                f"sinkattn vLLM backend: layer.{name} has shape {tuple(t.shape)}; accepted: one element (a "
                f"per-tensor scale) or ({num_kv_heads},), one per KV head of this rank")
        out.append(t)
    return out[0], out[1]


def _descales(scales, batch: int, nheads_k: int):
    """The serving call's (k, v) descales for `batch` requests: the layer's scales (one element, or one per KV head)
    as (batch, nheads_k) float32 expanded views; None for a cache in q's dtype."""
    if scales is None:
        return None
    return tuple(t.to(torch.float32).reshape(1, -1).expand(batch, nheads_k) for t in scales)


def kernel_gap(head_size: int, dtype: torch.dtype, capability, kv_fp8: bool = False) -> str | None:
    """None when a compiled sinkattn kernel serves this paged attention on a GPU of `capability` (a (major,
    minor) pair or vLLM's DeviceCapability), over an FP8 cache when kv_fp8; else why not. Otherwise `attend`
    would run on the PyTorch reference: slow, and it reads sequence lengths on the host, which a CUDA graph
    cannot hold."""
    cap = (capability[0], capability[1]) if isinstance(capability, tuple) else (capability.major,
                                                                                capability.minor)
    problem = Problem(kind="kvcache", device_type="cuda", dtype=dtype, headdim=head_size, mask=Mask(1.0, -1, 0),
                      has_sinks=True, paged=True, kv_fp8=kv_fp8)
    chosen, declined = dispatch.plan(problem, cap)
    return None if chosen != "reference" else dispatch.declined_text(declined)


def write_kv(k_cache, v_cache, key, value, slot_mapping, scales=None) -> None:
    """Write key/value (num_tokens, nheads_k, head_size) at slot_mapping (block * block_size + offset); an FP8
    cache gets x / scale (`scales`: layer_scales' pair), saturating, NaN kept (sinkattn.fp8.quantize).

    Padding tokens have slot -1. A mask would need a device-to-host read, which a CUDA graph cannot hold, so
    they are written, as zeros, to slot 0 instead: block 0 is vLLM's null block (its block pool reserves it
    and never gives it to a request; sliding-window layers point dropped pages at it), which stays zero."""
    n = slot_mapping.shape[0]  # key/value may be padded beyond the scheduled tokens
    pad = (slot_mapping < 0)[:, None, None]
    slots = slot_mapping.clamp(min=0).long()
    block, offset = slots // k_cache.shape[1], slots % k_cache.shape[1]
    k_new, v_new = torch.where(pad, 0, key[:n]), torch.where(pad, 0, value[:n])
    if fp8.is_fp8(k_cache.dtype):
        hk = k_cache.shape[2]
        k_desc, v_desc = (s.to(torch.float32).reshape(1, -1).expand(1, hk) for s in scales)
        k_new = fp8.quantize(k_new[None], k_desc, k_cache.dtype)[0]
        v_new = fp8.quantize(v_new[None], v_desc, v_cache.dtype)[0]
    k_cache[block, offset] = k_new.to(k_cache.dtype)
    v_cache[block, offset] = v_new.to(v_cache.dtype)


def attend(query, k_cache, v_cache, seq_lens, block_table, query_start_loc, max_query_len: int, out, sinks=None, *,
           softmax_scale, window_size=(-1, -1), softcap=0.0, backend="auto", scales=None):
    """Causal attention of query (num_tokens, h, d) over the paged cache, into out (num_tokens, h, d): one serving
    call (query_start_loc (num_reqs + 1,), seq_lens (num_reqs,), block_table (num_reqs, max_blocks), all on the
    device; max_query_len the host's int); `scales`: an FP8 cache's (k, v) scales (layer_scales), None otherwise.
    Rows past query_start_loc[-1] (vLLM's padding tokens) are left as they are."""
    num_reqs = seq_lens.shape[0]
    mask = Mask(softmax_scale, window_size[0], 0, 0, softcap)
    dispatch.run_kvcache_serving(query, k_cache, v_cache, sinks, seq_lens, block_table[:num_reqs],
                                 query_start_loc[:num_reqs + 1], int(max_query_len), mask, backend,
                                 _descales(scales, num_reqs, k_cache.shape[2]), out=out, check_values=False)
    return out
