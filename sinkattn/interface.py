"""The public attention functions (docs/DESIGN.md sections 1 and 2).

Each function's docstring ends with the conventions below (appended at import, so help() shows them).

- Layout as FlashAttention: q (batch, seqlen_q, nheads, headdim), k/v (batch, seqlen_k, nheads_k,
  headdim), nheads a multiple of nheads_k (GQA/MQA: query head h reads KV head h // (nheads // nheads_k)).
  Output like q. Head dims: multiples of 8 up to 256. Dtypes: float16, bfloat16, float32 (float64 on
  the reference backend, for gradcheck).
- Scores s = softmax_scale * q.k (default 1/sqrt(headdim)); softcap > 0 gives softcap * tanh(s / softcap).
- Bottom-right alignment: with off = seqlen_k - seqlen_q, query i sits at key position i + off.
  window_size = (left, right), -1 = unbounded: key j is visible if j <= i + off + right and
  (j >= i + off - left or j < sink_tokens). causal=True means right = 0 (a positive right with causal
  is an error). gpt-oss's sliding_window=128 is window_size=(127, 0).
- sink_tokens = n (StreamingLLM) keeps the first n keys visible however far the left edge has moved;
  it relaxes only the left edge (never lets a query see past its right edge) and changes nothing
  without a left bound.
- sinks (alias s_aux, as vLLM and transformers name it): one learnable logit per query head, shape
  (nheads,), in the units of the scaled scores (NOT multiplied by softmax_scale), added to the softmax
  denominator only: lse_i = log(exp(sinks[h]) + sum_j exp(s_ij)), out_i = sum_j exp(s_ij - lse_i) v_j.
  sinks[h] = -inf is plain attention. Gradients flow to sinks.
- lse: natural log, including the sink, float32 (float64 for float64 inputs), shape
  (batch, nheads, seqlen_q); (nheads, total_q) for varlen. Returned when return_lse=True, and
  differentiable.
- A query row that sees no key gets out = 0 and lse = sinks[h] (-inf without sinks). Never NaN.
- backend: "auto" (CUDA tensors: the best compiled kernel, else the PyTorch reference with a one-time
  warning saying why; CPU tensors: the reference), or one of "sm90", "sm80", "reference",
  "sm80-emulated", "sm90-emulated" (CPU tensors, for tests) to force it; a forced backend that cannot serve the call
  raises SinkattnRuntimeError saying why and what would.
- deterministic=True asks kernels for a deterministic backward (the reference always is).
"""
from __future__ import annotations

import torch

from . import _checks, _ext, fp8, ops  # noqa: F401  (ops registers torch.ops.sinkattn.*)
from .errors import SinkattnValueError

# The C++ front end of flash_attn_with_sinks's CPU good case (csrc/cpu_front.cpp: float32, no GQA, at most 16 query
# rows, all keys visible or square causal, no softcap), None in the pure-Python build. It serves exactly what the
# Python path below would serve with the same fused kernel and answers None for anything else, so errors keep
# their one owner (_checks). At a tiny call it is most of the difference to SDPA (bench/studies/cpu_overhead.py).
_CPU_FRONT = getattr(_ext._C, "cpu_fwd", None)

_CONVENTIONS = (__doc__ or "").partition("(appended at import, so help() shows them).\n")[2]


def _prologue(q, sinks, s_aux, softmax_scale, causal, window_size, sink_tokens, softcap, backend, return_lse,
              deterministic=False):
    """The checks every public function starts with -> (sinks, Mask). (Each test is the good case inline, the
    wording only on failure: at a tiny call these checks are a good part of the time; bench/studies/cpu_overhead.py.)"""
    if s_aux is not None:
        sinks = _checks.resolve_sinks(sinks, s_aux)
    if backend not in _checks.BACKENDS:
        _checks.check_backend(backend)
    # return_lse, deterministic: a truthy string is a mistake, not a yes
    if type(return_lse) is not bool:
        _checks.check_bool("return_lse", return_lse)
    if type(deterministic) is not bool:
        _checks.check_bool("deterministic", deterministic)
    mask = _checks.normalize_mask(q.shape[-1], softmax_scale, causal, window_size, sink_tokens, softcap)
    return sinks, mask


def flash_attn_with_sinks(q, k, v, sinks=None, *, softmax_scale=None, causal=False, window_size=(-1, -1),
                          sink_tokens=0, softcap=0.0, return_lse=False, deterministic=False,
                          backend="auto", s_aux=None):
    """Attention with learnable sinks, sliding windows and sink tokens.

    q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_k, headdim).
    sinks / s_aux: (nheads,) logits in scaled-score units (not multiplied by softmax_scale).
    Returns out (like q), or (out, lse) with return_lse=True, lse float32 (batch, nheads, seqlen_q),
    natural log, including the sink. See the module docstring for masks and conventions.
    """
    # The front end takes no alias (s_aux) and a scale already resolved, so the alias rule and the default scale
    # keep their one owner (_checks); the two tests here cost tens of nanoseconds.
    if _CPU_FRONT is not None and s_aux is None and type(q) is torch.Tensor and not torch.compiler.is_compiling():
        scale = softmax_scale if softmax_scale is not None or not q.dim() else _checks.default_scale(q.shape[-1])
        served = _CPU_FRONT(q, k, v, sinks, scale, causal, window_size, sink_tokens, softcap, return_lse,
                            deterministic, backend)
        if served is not None:
            return served
    _checks.check_tensor("q", q, 4, "(batch, seqlen_q, nheads, headdim)")
    sinks, mask = _prologue(q, sinks, s_aux, softmax_scale, causal, window_size, sink_tokens, softcap, backend,
                            return_lse=return_lse, deterministic=deterministic)
    _checks.check_batched(q, k, v)
    _checks.check_sinks(sinks, q)
    out, lse = ops.call_fwd(q, k, v, sinks, None, None, 0, 0, mask, deterministic, backend, need_lse=return_lse)
    return (out, lse) if return_lse else out


def flash_attn_varlen_with_sinks(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, sinks=None, *,
                                 softmax_scale=None, causal=False, window_size=(-1, -1), sink_tokens=0,
                                 softcap=0.0, return_lse=False, deterministic=False, backend="auto", s_aux=None):
    """Attention over packed variable-length sequences.

    q: (total_q, nheads, headdim); k, v: (total_k, nheads_k, headdim); cu_seqlens_q/k: int32 (batch + 1,)
    offsets starting at 0, non-decreasing (empty sequences allowed); max_seqlen_q/k: the longest
    sequence of each side. Masks align bottom-right within each sequence. Returns out (like q), or
    (out, lse) with lse float32 (nheads, total_q); rows past cu_seqlens_q[-1] get out 0, lse -inf.
    """
    _checks.check_tensor("q", q, 3, "(total_q, nheads, headdim)")
    sinks, mask = _prologue(q, sinks, s_aux, softmax_scale, causal, window_size, sink_tokens, softcap, backend,
                            return_lse=return_lse, deterministic=deterministic)
    _checks.check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    _checks.check_sinks(sinks, q)
    out, lse = ops.call_fwd(q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, mask,
                            deterministic, backend, need_lse=return_lse)
    return (out, lse) if return_lse else out


def flash_attn_with_kvcache(q, k_cache, v_cache, sinks=None, *, k=None, v=None, cache_seqlens=None,
                            block_table=None, rotary_cos=None, rotary_sin=None, rotary_interleaved=True,
                            softmax_scale=None, causal=False, window_size=(-1, -1), sink_tokens=0, softcap=0.0,
                            return_lse=False, num_splits=0, backend="auto", s_aux=None, k_scale=None, v_scale=None,
                            k_descale=None, v_descale=None, cu_seqlens_q=None, max_seqlen_q=None):
    """Decode / chunked prefill over a KV cache, appending the new k/v in place. Inference only: it has no
    backward, and an input that requires grad while grad mode is on raises SinkattnRuntimeError (wrap the call in
    torch.no_grad() / torch.inference_mode(); to train, gather the keys and call flash_attn_with_sinks or
    flash_attn_varlen_with_sinks, which are differentiable).

    q: (batch, seqlen_q, nheads, headdim).
    k_cache, v_cache: contiguous (batch, capacity, nheads_k, headdim), or paged
        (num_pages, page_size, nheads_k, headdim) with block_table (batch, max_pages) int32 (any page size).
        An FP8 cache (torch.float8_e4m3fn / float8_e5m2, q in float16/bfloat16/float32) holds x / scale: pass
        per-tensor k_scale, v_scale (floats or 1-element tensors, as vLLM's layer._k_scale) or per-(batch, KV head)
        k_descale, v_descale ((batch, nheads_k), as FlashAttention-3 takes them); none means scale 1. New k/v are
        quantized with the same scales, saturating (sinkattn.fp8 says what happens to values beyond the range).
    k, v: optional new tokens (batch, seqlen_new, nheads_k, headdim), written after cache_seqlens.
    cache_seqlens: int32 (batch,) or an int: tokens already in the cache (not updated here; the caller
        advances it). None means the cache is full (then k/v cannot be appended).
    rotary_cos, rotary_sin: optional (max_position, rotary_dim / 2) tables; q and the new k are rotated
        at absolute positions cache_seqlens + i (rotary_interleaved: GPT-J pairs; False: GPT-NeoX halves).
    The queries are the last seqlen_q positions of each sequence (bottom-right alignment), so decode
    with causal=True sees the whole cache. num_splits is a kernel hint (0 = heuristic); the reference
    ignores it. Returns out, or (out, lse) with lse float32 (batch, nheads, seqlen_q).

    The serving form, FlashAttention-3's: q packed (total_q, nheads, headdim) with cu_seqlens_q int32 (batch + 1,)
    and max_seqlen_q (an int the caller holds, e.g. vLLM's max_query_len; it picks the tile, any value is correct).
    Request b's queries are rows cu_seqlens_q[b]:cu_seqlens_q[b + 1], the last of its cache_seqlens[b] keys, which
    the cache already holds (no k/v, no rotary). One kernel launch serves the batch whatever its mix of decode,
    prefill chunks and empty requests (plus one combine under split-KV), and nothing is read on the host beyond the
    value checks (off under CUDA-graph capture or SINKATTN_VALUE_CHECKS=0). out (total_q, nheads, headdim), lse
    (nheads, total_q); rows past cu_seqlens_q[-1] (a caller's padding) get out 0 and lse -inf.
    """
    if cu_seqlens_q is not None:
        return _kvcache_varlen(q, k_cache, v_cache, sinks, k, v, rotary_cos, rotary_sin, cache_seqlens, block_table,
                               softmax_scale, causal, window_size, sink_tokens, softcap, return_lse, num_splits,
                               backend, s_aux, k_scale, v_scale, k_descale, v_descale, cu_seqlens_q, max_seqlen_q)
    _checks.check_tensor("q", q, 4, "(batch, seqlen_q, nheads, headdim)")
    _checks.check_tensor("k_cache", k_cache, 4, "(batch, capacity, nheads_k, headdim) or paged "
                                                "(num_pages, page_size, nheads_k, headdim)")
    sinks, mask = _prologue(q, sinks, s_aux, softmax_scale, causal, window_size, sink_tokens, softcap, backend,
                            return_lse=return_lse)
    if block_table is not None:
        _checks.check_tensor("block_table", block_table, 2, "(batch, max_pages) int32")
    cache_seqlens = _cache_seqlens(q, k_cache, k, cache_seqlens, block_table)
    _checks.check_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, block_table, rotary_cos, rotary_sin, num_splits)
    k_descale, v_descale = fp8.descales(k_cache.dtype, q.shape[0], k_cache.shape[2], k_cache.device, k_scale, v_scale,
                                        k_descale, v_descale)
    _checks.check_sinks(sinks, q)
    _checks.check_bool("rotary_interleaved", rotary_interleaved)
    _checks.check_no_grad_needed("flash_attn_with_kvcache", {"q": q, "k_cache": k_cache, "v_cache": v_cache,
                                                             "sinks": sinks, "k": k, "v": v, "rotary_cos": rotary_cos,
                                                             "rotary_sin": rotary_sin, "k_descale": k_descale,
                                                             "v_descale": v_descale})
    out, lse = ops.call_kvcache(q, k_cache, v_cache, sinks, k, v, cache_seqlens, block_table, rotary_cos, rotary_sin,
                                rotary_interleaved, mask, num_splits, backend, k_descale, v_descale)
    return (out, lse) if return_lse else out


def _kvcache_varlen(q, k_cache, v_cache, sinks, k, v, rotary_cos, rotary_sin, cache_seqlens, block_table,
                    softmax_scale, causal, window_size, sink_tokens, softcap, return_lse, num_splits, backend, s_aux,
                    k_scale, v_scale, k_descale, v_descale, cu_seqlens_q, max_seqlen_q):
    """flash_attn_with_kvcache's serving form (packed queries, cu_seqlens_q): one op call for the whole batch."""
    _checks.check_tensor("q", q, 3, "(total_q, nheads, headdim) with cu_seqlens_q")
    sinks, mask = _prologue(q, sinks, s_aux, softmax_scale, causal, window_size, sink_tokens, softcap, backend,
                            return_lse=return_lse)
    if max_seqlen_q is None:
        raise SinkattnValueError("sinkattn: cu_seqlens_q needs max_seqlen_q, the longest request's query rows (an int "
                                 "the caller holds: reading it from cu_seqlens_q would synchronise with the device)")
    batch = cu_seqlens_q.numel() - 1 if isinstance(cu_seqlens_q, torch.Tensor) else 0
    if not isinstance(cache_seqlens, torch.Tensor):
        if cache_seqlens is None:
            raise SinkattnValueError("sinkattn: with cu_seqlens_q pass cache_seqlens, the keys of each request in the "
                                     "cache (its new ones included)")
        _checks.check_int("cache_seqlens", cache_seqlens, minimum=0)
        cache_seqlens = torch.full((batch,), cache_seqlens, dtype=torch.int32, device=q.device)
    _checks.check_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, block_table, rotary_cos, rotary_sin, num_splits,
                          cu_seqlens_q, max_seqlen_q)
    k_descale, v_descale = fp8.descales(k_cache.dtype, batch, k_cache.shape[2], k_cache.device, k_scale, v_scale,
                                        k_descale, v_descale)
    _checks.check_sinks(sinks, q)
    _checks.check_no_grad_needed("flash_attn_with_kvcache", {"q": q, "k_cache": k_cache, "v_cache": v_cache,
                                                             "sinks": sinks, "k_descale": k_descale,
                                                             "v_descale": v_descale})
    out, lse = ops.call_kvcache(q, k_cache, v_cache, sinks, None, None, cache_seqlens, block_table, None, None, True,
                                mask, num_splits, backend, k_descale, v_descale, cu_seqlens_q, max_seqlen_q)
    return (out, lse) if return_lse else out


def _cache_seqlens(q, k_cache, k, cache_seqlens, block_table):
    """An int or None becomes the int32 (batch,) tensor the op takes."""
    if isinstance(cache_seqlens, torch.Tensor):
        return cache_seqlens
    if cache_seqlens is None:
        if k is not None:
            raise SinkattnValueError(
                "sinkattn: k/v were given to append but cache_seqlens is None (a full cache); pass "
                "cache_seqlens, the number of tokens already cached per sequence")
        full = k_cache.shape[1] * (block_table.shape[1] if block_table is not None else 1)
        cache_seqlens = full
    _checks.check_int("cache_seqlens", cache_seqlens, minimum=0)
    return torch.full((q.shape[0],), cache_seqlens, dtype=torch.int32, device=q.device)


for _f in (flash_attn_with_sinks, flash_attn_varlen_with_sinks, flash_attn_with_kvcache):
    if _f.__doc__ and _CONVENTIONS:  # python -OO strips docstrings
        _f.__doc__ += "\n    Conventions:\n" + "".join(f"    {line}\n" for line in _CONVENTIONS.strip("\n").splitlines())
