"""Drop-in replacements for flash-attn 2.8's and vllm-flash-attn's Python functions, served by sinkattn.

    # before                                            # after
    from flash_attn import flash_attn_func              from sinkattn.flash_attn_interface import flash_attn_func
    from vllm.vllm_flash_attn import flash_attn_varlen_func
                                                        from sinkattn.flash_attn_interface import (
                                                            vllm_flash_attn_varlen_func as flash_attn_varlen_func)

The module is named after flash-attn's own `flash_attn.flash_attn_interface`, so a caller changes one import and
no call. Each function keeps its peer's positional order, keyword names, defaults and return conventions (read
from flash-attn 2.8.3's flash_attn/flash_attn_interface.py and csrc/flash_attn/flash_api.cpp, and vLLM 0.33's
vllm/vllm_flash_attn/flash_attn_interface.py; no code copied). vLLM's varlen function has a different
positional order from flash-attn's (max_seqlen_q comes before cu_seqlens_q) under the same name, so it lives
here as `vllm_flash_attn_varlen_func`, and one module serves both without a name meaning two things.

Every function also takes, keyword-only, what the peers lack:
    sinks= / s_aux= / learnable_sink=   one learnable sink logit per query head, (nheads,), in the units of the
                                        scaled scores (docs/DESIGN.md section 1). The three names are aliases
                                        (sinkattn, vLLM/transformers, FlashAttention 4); give at most one.
    sink_tokens=                        StreamingLLM sink tokens: the first n keys stay visible to a windowed query.
    backend=                            sinkattn's backend choice ("auto" by default; see sinkattn.interface).

What maps to what (docs/migration.md has the full table):
- flash_attn_func / _qkvpacked_ / _kvpacked_ -> sinkattn.flash_attn_with_sinks (the packed tensors are split
  into views; gradients flow back into qkv / kv).
- flash_attn_varlen_func / _qkvpacked_ / _kvpacked_ -> sinkattn.flash_attn_varlen_with_sinks; with block_table
  (a paged cache, flash-attn 2.8's varlen paged form) -> the paged path below, with seqused_k taken from
  cu_seqlens_k.
- flash_attn_with_kvcache -> sinkattn.flash_attn_with_kvcache (appends k/v in place, rotary, paged caches).
  cache_batch_idx is served exactly by viewing the contiguous cache as a paged one (one page per cache row).
- vllm_flash_attn_varlen_func: with cu_seqlens_k, the varlen path; with seqused_k and block_table, paged
  attention over the cache: one sinkattn.flash_attn_with_kvcache call in its serving form (cu_seqlens_q,
  max_seqlen_q: one kernel launch for the whole batch, queries each request's last positions, bottom-right
  aligned). Nothing is read on the host but the value checks, which are off under CUDA-graph capture (and with
  SINKATTN_VALUE_CHECKS=0), so the call can be captured.

Conventions kept from the peers:
- return_attn_probs=True (flash-attn 2.8) returns (out, softmax_lse, S_dmask). flash-attn returns the
  probabilities only when dropout_p > 0 and an empty tensor (shape (0,), q's dtype) otherwise; dropout is
  refused here, so S_dmask is always that empty tensor, as flash-attn returns it at dropout_p=0.
- softmax_lse: natural log of the softmax denominator of the scaled (and softcapped) scores, float32;
  (batch, nheads, seqlen_q) for the batched and KV-cache functions, (nheads, total_q) for varlen (flash-attn
  2.8 and vLLM). With sinks it includes the sink's exp term, as sinkattn's lse does.
- window_size: None or any 2-element sequence of integers (tuple, list, tensor, numpy array; flash-attn indexes
  it, and its own tests pass torch.randint(0, seqlen_k, (2,))), converted to python ints here.
- causal=True makes the right window edge 0 whatever window_size[1] says, and a window edge >= seqlen_k
  (max_seqlen_k for varlen) is unbounded, as flash-attn's C++ front end does before launching.
- Head dims that are not a multiple of 8 are zero-padded and the output sliced back, as flash-attn 2.8 does
  (the default softmax_scale uses the caller's head dim; gradients flow back through the padding). The
  KV-cache and paged forms pad a copy of the cache (a cache cannot be padded in place) and write the appended
  keys and values back into the caller's cache: correct, but each such call copies the whole cache.
- The KV-cache and paged forms (flash_attn_with_kvcache, flash_attn_varlen_func with block_table,
  vllm_flash_attn_varlen_func with seqused_k) have no backward, in flash-attn as here; as flash-attn does, they
  run when an input requires grad under grad mode, and a backward through their output raises
  SinkattnRuntimeError naming why (with vLLM's out= the output is returned as given, without a backward).
- vLLM's scheduler_metadata (FlashAttention-3's precomputed split schedule) is accepted and ignored by
  flash_attn_with_kvcache (keyword-only) and vllm_flash_attn_varlen_func; get_scheduler_metadata (vLLM 0.33's
  signature) returns None: sinkattn plans its split-KV schedule inside each call.

Differences (documented, tested):
- A query row that sees no key: out 0 (as flash-attn), softmax_lse = -inf (sinks[h] with sinks); flash-attn 2
  writes +inf there (-inf on its split-KV path). -inf is what merging partial results needs.
- dropout_p > 0 and alibi_slopes raise (sinkattn has neither); vLLM's FP8 descales raise for FP8 inputs and
  are ignored for bf16/fp16/fp32 ones, as vLLM's FA3/FA4 do (vLLM's backend always passes them, ones for an
  unquantized cache). scheduler_metadata, fa_version, cp_rank and return_attn_probs (the vLLM function
  returns no probabilities either) are accepted and ignored. num_splits is a kernel hint.
"""
from __future__ import annotations

import numbers

import torch
import torch.nn.functional as F

from . import interface
from .errors import SinkattnRuntimeError, SinkattnTypeError, SinkattnValueError
from ._checks import default_scale, resolve_sinks
from .mask import window_with_causal

__all__ = [
    "flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func", "flash_attn_varlen_func",
    "flash_attn_varlen_qkvpacked_func", "flash_attn_varlen_kvpacked_func", "flash_attn_with_kvcache",
    "vllm_flash_attn_varlen_func", "get_scheduler_metadata",
]

_WHO = "sinkattn.flash_attn_interface"
_FP8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
             if hasattr(torch, n))


# ---------------------------------------------------------------------------------------------- argument checks

def _sinks(fn: str, sinks, s_aux, learnable_sink):
    return resolve_sinks(sinks, s_aux, learnable_sink, who=f"{_WHO}.{fn}")


def _refuse_dropout_alibi(fn: str, dropout_p, alibi_slopes) -> None:
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise SinkattnTypeError(f"{_WHO}.{fn}: dropout_p must be a float; got {type(dropout_p).__name__} "
                                f"{dropout_p!r}")
    if dropout_p != 0:
        raise SinkattnValueError(
            f"{_WHO}.{fn}: dropout_p={dropout_p!r} is not supported: sinkattn has no attention dropout; "
            f"accepted: dropout_p=0.0 (flash-attn's own advice for evaluation). To train with attention dropout "
            f"keep flash_attn (or eager attention) for that model; sinkattn's attention is exact")
    if alibi_slopes is not None:
        raise SinkattnValueError(
            f"{_WHO}.{fn}: alibi_slopes is not supported: sinkattn has no ALiBi bias; accepted: "
            f"alibi_slopes=None. For an ALiBi model keep flash_attn, or use "
            f"torch.nn.functional.scaled_dot_product_attention with the bias as attn_mask")


def _flag(fn: str, name: str, value) -> bool:
    if not isinstance(value, bool):
        raise SinkattnTypeError(f"{_WHO}.{fn}: {name} must be a bool; got {type(value).__name__} {value!r}")
    return value


def _window(fn: str, window_size, causal, seqlen_k: int | None):
    """flash-attn's front end: causal sets right = 0, and an edge >= seqlen_k is unbounded."""
    left, right = _pair(fn, window_size)
    if seqlen_k is not None:
        if isinstance(left, int) and left >= seqlen_k:
            left = -1
        if isinstance(right, int) and right >= seqlen_k:
            right = -1
    return window_with_causal(left, right, causal is True, strict=False)


def _pair(fn: str, window_size):
    """window_size as flash-attn takes it: None, or any 2-element sequence of integers (tuple, list, tensor,
    numpy array; flash-attn's own tests draw it as torch.randint(0, seqlen_k, (2,))) -> two python ints."""
    if window_size is None:
        return (-1, -1)
    if hasattr(window_size, "tolist") and not isinstance(window_size, (tuple, list)):  # tensor, numpy array
        items = window_size.tolist()
    elif isinstance(window_size, (tuple, list)):
        items = list(window_size)
    else:
        items = None
    if not isinstance(items, list) or len(items) != 2:
        raise SinkattnValueError(f"{_WHO}.{fn}: window_size must be a pair (left, right); got {window_size!r}; "
                                 f"-1 means unbounded")
    pair = []
    for v in items:
        if isinstance(v, torch.SymInt) or (isinstance(v, int) and not isinstance(v, bool)):
            pair.append(v)
        elif isinstance(v, numbers.Integral) and not isinstance(v, bool):
            pair.append(int(v))
        elif isinstance(v, torch.Tensor) and v.numel() == 1 and not v.is_floating_point() and v.dtype != torch.bool:
            pair.append(int(v))
        else:
            raise SinkattnTypeError(f"{_WHO}.{fn}: window_size must hold two integers (left, right); got "
                                    f"{window_size!r}; -1 means unbounded")
    return tuple(pair)


def _pad8(fn, q, k, v):
    """Zero-pad the head dim to a multiple of 8 (flash-attn's rule), after checking that q, k and v share it
    (so an error names the caller's head dims, not the padded ones)."""
    if not all(isinstance(t, torch.Tensor) and t.dim() for t in (q, k, v)):
        return q, k, v  # sinkattn's own checks name what is wrong
    for name, t in (("k", k), ("v", v)):
        if t.shape[-1] != q.shape[-1]:
            raise SinkattnValueError(f"{_WHO}.{fn}: {name} has head dim {t.shape[-1]} but q has {q.shape[-1]}; "
                                     f"they must match")
    extra = -q.shape[-1] % 8
    return (q, k, v) if extra == 0 else tuple(F.pad(t, (0, extra)) for t in (q, k, v))


def _scale(softmax_scale, headdim: int):
    """The caller's head dim sets the default scale (before any padding)."""
    return default_scale(headdim) if softmax_scale is None else softmax_scale


def _probs_placeholder(q: torch.Tensor) -> torch.Tensor:
    """What flash-attn 2.8 returns as S_dmask when dropout_p == 0: an empty tensor of q's dtype."""
    return torch.empty((0,), dtype=q.dtype, device=q.device)


def _check_packed(fn: str, name: str, t, rank: int, dim: int, n: int, layout: str) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != rank or t.shape[dim] != n:
        got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise SinkattnValueError(f"{_WHO}.{fn}: {name} must be {layout}; got {got}")


class _NoBackward(torch.autograd.Function):
    """The output of a forward-only call made with inputs that require grad: its backward raises, naming why."""

    @staticmethod
    def forward(ctx, why, out, *inputs):
        ctx.why = why
        return out

    @staticmethod
    def backward(ctx, *grads):
        raise SinkattnRuntimeError(ctx.why)


def _forward_only(fn: str, tensors, run):
    """flash-attn runs its KV-cache and paged forwards whatever requires grad (only a backward fails, as there is
    none); so does the drop-in: under grad mode with an input that requires grad, `run()` goes under
    torch.no_grad() and each returned tensor gets a backward that raises SinkattnRuntimeError."""
    leaves = [t for t in tensors if isinstance(t, torch.Tensor) and t.requires_grad]
    if not torch.is_grad_enabled() or not leaves:
        return run()
    with torch.no_grad():
        res = run()
    why = (f"{_WHO}.{fn} has no backward: the KV-cache and paged forms are forward-only (flash-attn has no "
           f"backward for them either), and this output came from one. To train, gather the cached keys and "
           f"values into dense k/v and call flash_attn_func or flash_attn_varlen_func without block_table; for "
           f"inference, call it under torch.no_grad() (or pass .detach()ed tensors)")
    if isinstance(res, tuple):
        return tuple(_NoBackward.apply(why, r, *leaves) for r in res)
    return _NoBackward.apply(why, res, *leaves)


def _pad_dim(t, to: int):
    return t if t is None or t.shape[-1] == to else F.pad(t, (0, to - t.shape[-1]))


def _round8(d: int) -> int:
    return d + (-d % 8)


# --------------------------------------------------------------------------------------------- flash-attn 2.8

def _batched(fn, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
             return_attn_probs, sinks, sink_tokens, backend):
    _refuse_dropout_alibi(fn, dropout_p, alibi_slopes)
    probs = _flag(fn, "return_attn_probs", return_attn_probs)
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        interface.flash_attn_with_sinks(q, k, v)  # sinkattn's own message for a wrong q
    d = q.shape[-1]
    window = _window(fn, window_size, causal, k.shape[1] if isinstance(k, torch.Tensor) and k.dim() == 4 else None)
    qp, kp, vp = _pad8(fn, q, k, v)
    res = interface.flash_attn_with_sinks(
        qp, kp, vp, sinks, softmax_scale=_scale(softmax_scale, d), causal=causal, window_size=window,
        sink_tokens=sink_tokens, softcap=softcap, return_lse=probs, deterministic=deterministic, backend=backend)
    out, lse = res if probs else (res, None)  # (lse only when asked: the CPU fast path skips it otherwise)
    out = out[..., :v.shape[-1]] if out.shape[-1] != v.shape[-1] else out
    return (out, lse, _probs_placeholder(q)) if probs else out


def _varlen(fn, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
            causal, window_size, softcap, alibi_slopes, deterministic, sinks, sink_tokens, backend):
    """-> (out, lse (nheads, total_q)) over packed sequences."""
    _refuse_dropout_alibi(fn, dropout_p, alibi_slopes)
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        interface.flash_attn_varlen_with_sinks(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    d = q.shape[-1]
    window = _window(fn, window_size, causal, max_seqlen_k if isinstance(max_seqlen_k, int) else None)
    qp, kp, vp = _pad8(fn, q, k, v)
    out, lse = interface.flash_attn_varlen_with_sinks(
        qp, kp, vp, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, sinks,
        softmax_scale=_scale(softmax_scale, d), causal=causal, window_size=window, sink_tokens=sink_tokens,
        softcap=softcap, return_lse=True, deterministic=deterministic, backend=backend)
    out = out[..., :v.shape[-1]] if out.shape[-1] != v.shape[-1] else out
    return out, lse


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False, *, sinks=None, s_aux=None,
                    learnable_sink=None, sink_tokens=0, backend="auto"):
    """flash-attn 2.8's flash_attn_func. q (batch, seqlen_q, nheads, headdim), k/v (batch, seqlen_k, nheads_k,
    headdim). Returns out, or (out, softmax_lse (batch, nheads, seqlen_q) float32, empty S_dmask) with
    return_attn_probs=True. See the module docstring for the sinkattn-only keywords and what is refused."""
    sinks = _sinks("flash_attn_func", sinks, s_aux, learnable_sink)
    return _batched("flash_attn_func", q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                    alibi_slopes, deterministic, return_attn_probs, sinks, sink_tokens, backend)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                              sinks=None, s_aux=None, learnable_sink=None, sink_tokens=0, backend="auto"):
    """flash-attn 2.8's flash_attn_qkvpacked_func. qkv (batch, seqlen, 3, nheads, headdim)."""
    fn = "flash_attn_qkvpacked_func"
    sinks = _sinks(fn, sinks, s_aux, learnable_sink)
    _check_packed(fn, "qkv", qkv, 5, 2, 3, "(batch, seqlen, 3, nheads, headdim)")
    q, k, v = qkv.unbind(2)
    return _batched(fn, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                    deterministic, return_attn_probs, sinks, sink_tokens, backend)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                             sinks=None, s_aux=None, learnable_sink=None, sink_tokens=0, backend="auto"):
    """flash-attn 2.8's flash_attn_kvpacked_func. q (batch, seqlen_q, nheads, headdim), kv (batch, seqlen_k, 2,
    nheads_k, headdim)."""
    fn = "flash_attn_kvpacked_func"
    sinks = _sinks(fn, sinks, s_aux, learnable_sink)
    _check_packed(fn, "kv", kv, 5, 2, 2, "(batch, seqlen_k, 2, nheads_k, headdim)")
    k, v = kv.unbind(2)
    return _batched(fn, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                    deterministic, return_attn_probs, sinks, sink_tokens, backend)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None, *, sinks=None,
                           s_aux=None, learnable_sink=None, sink_tokens=0, backend="auto"):
    """flash-attn 2.8's flash_attn_varlen_func. q (total_q, nheads, headdim), k/v (total_k, nheads_k, headdim),
    cu_seqlens_q/k int32 (batch + 1,). With block_table (batch, max_pages) int32, k/v are a paged cache
    (num_pages, page_size, nheads_k, headdim) and cu_seqlens_k's differences are the key lengths (no autograd).
    Returns out, or (out, softmax_lse (nheads, total_q) float32, empty S_dmask) with return_attn_probs=True."""
    fn = "flash_attn_varlen_func"
    sinks = _sinks(fn, sinks, s_aux, learnable_sink)
    probs = _flag(fn, "return_attn_probs", return_attn_probs)
    if block_table is not None:
        _refuse_dropout_alibi(fn, dropout_p, alibi_slopes)
        _flag(fn, "deterministic", deterministic)
        if not isinstance(cu_seqlens_k, torch.Tensor) or cu_seqlens_k.dim() != 1:
            raise SinkattnValueError(f"{_WHO}.{fn}: with block_table, cu_seqlens_k must be an int32 (batch + 1,) "
                                     f"tensor of cumulative key lengths; got {cu_seqlens_k!r}")
        seqused_k = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).to(torch.int32)
        out, lse = _forward_only(fn, (q, k, v, sinks), lambda: _paged(
            fn, q, k, v, cu_seqlens_q, seqused_k, block_table, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
            window_size, softcap, sinks, sink_tokens, 0, backend, None))
    else:
        out, lse = _varlen(fn, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                           softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, sinks,
                           sink_tokens, backend)
    return (out, lse, _probs_placeholder(q)) if probs else out


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False, *, sinks=None, s_aux=None, learnable_sink=None,
                                     sink_tokens=0, backend="auto"):
    """flash-attn 2.8's flash_attn_varlen_qkvpacked_func. qkv (total, 3, nheads, headdim)."""
    fn = "flash_attn_varlen_qkvpacked_func"
    sinks = _sinks(fn, sinks, s_aux, learnable_sink)
    probs = _flag(fn, "return_attn_probs", return_attn_probs)
    _check_packed(fn, "qkv", qkv, 4, 1, 3, "(total, 3, nheads, headdim)")
    q, k, v = qkv.unbind(1)
    out, lse = _varlen(fn, q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale,
                       causal, window_size, softcap, alibi_slopes, deterministic, sinks, sink_tokens, backend)
    return (out, lse, _probs_placeholder(q)) if probs else out


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False, *, sinks=None,
                                    s_aux=None, learnable_sink=None, sink_tokens=0, backend="auto"):
    """flash-attn 2.8's flash_attn_varlen_kvpacked_func. q (total_q, nheads, headdim), kv (total_k, 2, nheads_k,
    headdim)."""
    fn = "flash_attn_varlen_kvpacked_func"
    sinks = _sinks(fn, sinks, s_aux, learnable_sink)
    probs = _flag(fn, "return_attn_probs", return_attn_probs)
    _check_packed(fn, "kv", kv, 4, 1, 2, "(total_k, 2, nheads_k, headdim)")
    k, v = kv.unbind(1)
    out, lse = _varlen(fn, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                       softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, sinks, sink_tokens,
                       backend)
    return (out, lse, _probs_placeholder(q)) if probs else out


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False, *,
                            scheduler_metadata=None, sinks=None, s_aux=None, learnable_sink=None, sink_tokens=0,
                            backend="auto"):
    """flash-attn 2.8's flash_attn_with_kvcache: decode / chunked prefill over a contiguous or paged cache,
    appending k/v in place at cache_seqlens (no backward, as flash-attn: with inputs that require grad it runs,
    and a backward through the output raises). Returns out, or (out, softmax_lse (batch, nheads, seqlen_q)
    float32) with return_softmax_lse=True. scheduler_metadata (vLLM's keyword) is accepted and ignored.

    cache_batch_idx (batch,) int32 picks the cache row of each sequence (a contiguous cache only, as in
    flash-attn). cache_leftpad is refused (see the message). Rotary: flash-attn rotates every query at position
    cache_seqlens when causal=False and there is no window; that case is served by rotating q and k here and
    calling sinkattn without tables, every other case by sinkattn's fused rotary (positions cache_seqlens + i)."""
    fn = "flash_attn_with_kvcache"
    sinks = _sinks(fn, sinks, s_aux, learnable_sink)
    want_lse = _flag(fn, "return_softmax_lse", return_softmax_lse)
    if alibi_slopes is not None:
        _refuse_dropout_alibi(fn, 0.0, alibi_slopes)
    if cache_leftpad is not None:
        raise SinkattnValueError(
            f"{_WHO}.{fn}: cache_leftpad is not supported: sinkattn's caches start each sequence at slot 0; "
            f"accepted: cache_leftpad=None. Store each sequence from slot 0 (right-pad, and pass its length in "
            f"cache_seqlens), or use a paged cache whose block_table lists only the sequence's own pages")
    if not isinstance(q, torch.Tensor) or not isinstance(k_cache, torch.Tensor) or q.dim() != 4 or \
            k_cache.dim() != 4:
        interface.flash_attn_with_kvcache(q, k_cache, v_cache)  # sinkattn's own message for the layout
    batch, seqlen_q = q.shape[0], q.shape[1]
    paged = block_table is not None
    if isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        cache_seqlens = torch.full((batch,), cache_seqlens, dtype=torch.int32, device=q.device)
    if cache_batch_idx is not None:
        if paged:
            raise SinkattnValueError(
                f"{_WHO}.{fn}: cache_batch_idx and block_table were both given; flash-attn's paged cache takes no "
                f"cache_batch_idx either; accepted: one of them (block_table rows already pick each sequence's "
                f"pages)")
        if not isinstance(cache_batch_idx, torch.Tensor) or cache_batch_idx.shape != (batch,) or \
                cache_batch_idx.dtype not in (torch.int32, torch.int64):
            raise SinkattnValueError(
                f"{_WHO}.{fn}: cache_batch_idx must be an int32 ({batch},) tensor (a k_cache row per sequence); "
                f"got {cache_batch_idx!r}")
        if cache_seqlens is None:
            cache_seqlens = torch.full((batch,), k_cache.shape[1], dtype=torch.int32, device=q.device)
        # The contiguous cache (rows, capacity, hk, d) is, unchanged, a paged cache of `rows` pages of
        # `capacity` slots; sequence b's only page is row cache_batch_idx[b]. Appends land in place.
        block_table = cache_batch_idx.to(torch.int32).view(batch, 1)
    capacity = k_cache.shape[1] * (block_table.shape[1] if block_table is not None else 1)
    window = _window(fn, window_size, causal, capacity)

    def run(q, k):
        if rotary_cos is not None and not causal and tuple(window) == (-1, -1) and seqlen_q > 1:
            q, k = _rotate_at_cache_start(fn, q, k, rotary_cos, rotary_sin, cache_seqlens, rotary_interleaved,
                                          batch)
            cos = sin = None
        else:
            cos, sin = rotary_cos, rotary_sin
        kc, vc, scale = k_cache, v_cache, softmax_scale
        d, dv = q.shape[-1], v_cache.shape[-1]
        padded = (d % 8 or dv % 8) and k_cache.dtype not in _FP8 and k_cache.shape[-1] == d
        if padded:  # flash-attn's rule: zero-pad to a multiple of 8, slice the output back (see _pad_cache)
            q, k, kc = _pad_dim(q, _round8(d)), _pad_dim(k, _round8(d)), _pad_dim(k_cache, _round8(d))
            v, vc = _pad_dim(v_new, _round8(dv)), _pad_dim(v_cache, _round8(dv))
            scale = _scale(softmax_scale, d)
        else:
            v = v_new
        res = interface.flash_attn_with_kvcache(
            q, kc, vc, sinks, k=k, v=v, cache_seqlens=cache_seqlens, block_table=block_table, rotary_cos=cos,
            rotary_sin=sin, rotary_interleaved=rotary_interleaved, softmax_scale=scale, causal=causal,
            window_size=window, sink_tokens=sink_tokens, softcap=softcap, return_lse=want_lse,
            num_splits=num_splits, backend=backend)
        if not padded:
            return res
        if k is not None:  # the appended (and rotated) keys and values, back into the caller's cache
            k_cache.copy_(kc[..., :d])
            v_cache.copy_(vc[..., :dv])
        return (res[0][..., :dv], res[1]) if want_lse else res[..., :dv]

    v_new = v
    return _forward_only(fn, (q, k, v, k_cache, v_cache, sinks), lambda: run(q, k))


def _rotate_at_cache_start(fn, q, k, cos, sin, cache_seqlens, interleaved, batch):
    """flash-attn's non-causal, non-local rotary: every query at position cache_seqlens, new key i at
    cache_seqlens + i."""
    from ._checks import check_rotary_tables
    from .rotary import apply_rotary
    check_rotary_tables(cos, sin, q.shape[-1], who=f"{_WHO}.{fn}")
    if not isinstance(cache_seqlens, torch.Tensor):
        raise SinkattnValueError(f"{_WHO}.{fn}: rotary with causal=False needs cache_seqlens (the query "
                                 f"positions); got None")
    _flag(fn, "rotary_interleaved", interleaved)
    start = cache_seqlens.to(device=q.device, dtype=torch.long).view(batch, 1)
    needed = (int(start.max()) + max(1, k.shape[1] if k is not None else 0)) if batch else 0
    if needed > cos.shape[0]:
        raise SinkattnValueError(
            f"{_WHO}.{fn}: rotary_cos/rotary_sin have {cos.shape[0]} positions but position {needed - 1} is "
            f"needed (cache_seqlens plus the new tokens); accepted: tables with at least {needed} rows")
    q = apply_rotary(q, cos, sin, start.expand(batch, q.shape[1]), interleaved)
    if k is not None:
        k = apply_rotary(k, cos, sin, start + torch.arange(k.shape[1], device=k.device), interleaved)
    return q, k


# ----------------------------------------------------------------------------------------------- paged varlen

def _paged(fn, q, k_cache, v_cache, cu_seqlens_q, seqused_k, block_table, max_seqlen_q, max_seqlen_k, softmax_scale,
           causal, window_size, softcap, sinks, sink_tokens, num_splits, backend, out, k_descale=None, v_descale=None):
    """Varlen queries over a KV cache (paged with block_table, else contiguous (batch, capacity, hk, d)):
    -> (out (total_q, nheads, headdim_v), lse (nheads, total_q)). One sinkattn.flash_attn_with_kvcache call in its
    serving form (cu_seqlens_q: one kernel launch for the batch, no host read past the value checks); rows past
    cu_seqlens_q[-1] get out 0 and lse -inf. k_descale, v_descale: an FP8 cache's (batch, nheads_k) descales
    (FlashAttention-3's form)."""
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise SinkattnValueError(f"{_WHO}.{fn}: q must be (total_q, nheads, headdim); got "
                                 f"{tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__}")
    if not isinstance(cu_seqlens_q, torch.Tensor) or cu_seqlens_q.dim() != 1 or cu_seqlens_q.numel() < 1:
        raise SinkattnValueError(f"{_WHO}.{fn}: cu_seqlens_q must be an int32 (batch + 1,) tensor; got "
                                 f"{cu_seqlens_q!r}")
    batch = cu_seqlens_q.numel() - 1
    if not isinstance(seqused_k, torch.Tensor) or seqused_k.shape != (batch,):
        raise SinkattnValueError(f"{_WHO}.{fn}: seqused_k must be an int32 ({batch},) tensor (keys per sequence, "
                                 f"batch from cu_seqlens_q); got {seqused_k!r}")
    if block_table is not None and (not isinstance(block_table, torch.Tensor) or block_table.dim() != 2
                                    or block_table.shape[0] < batch):
        raise SinkattnValueError(f"{_WHO}.{fn}: block_table must be int32 (batch, max_pages) with batch = "
                                 f"{batch} rows (from cu_seqlens_q); got "
                                 f"{tuple(block_table.shape) if isinstance(block_table, torch.Tensor) else block_table!r}")
    if block_table is None and (k_cache.dim() != 4 or k_cache.shape[0] < batch):
        raise SinkattnValueError(
            f"{_WHO}.{fn}: seqused_k without block_table reads a contiguous cache: k/v must be (batch, capacity, "
            f"nheads_k, headdim) with batch = {batch}; got k {tuple(k_cache.shape)}. For packed keys pass "
            f"cu_seqlens_k instead of seqused_k; for a paged cache pass block_table")
    total_q, h, d = q.shape
    dv = v_cache.shape[-1]
    if (d % 8 or dv % 8) and k_cache.dtype not in _FP8 and k_cache.shape[-1] == d:
        # flash-attn's rule for head dims that are not a multiple of 8: zero-pad (here a padded copy of the
        # cache, read only), slice the output back; the default scale is the caller's head dim's.
        softmax_scale = _scale(softmax_scale, d)
        q, k_cache, v_cache = _pad_dim(q, _round8(d)), _pad_dim(k_cache, _round8(d)), _pad_dim(v_cache, _round8(dv))
        d = q.shape[-1]
    causal = _flag(fn, "causal", causal)
    window = _window(fn, window_size, causal, max_seqlen_k if isinstance(max_seqlen_k, int) else None)
    if not isinstance(max_seqlen_q, int) or isinstance(max_seqlen_q, bool) or max_seqlen_q < 0:
        raise SinkattnValueError(f"{_WHO}.{fn}: max_seqlen_q must be an int >= 0 (the longest request's query rows); "
                                 f"got {max_seqlen_q!r}")
    bt = None if block_table is None else block_table[:batch]
    kc, vc = (k_cache, v_cache) if block_table is not None else (k_cache[:batch], v_cache[:batch])
    o, lse = interface.flash_attn_with_kvcache(
        q, kc, vc, sinks, cache_seqlens=seqused_k, block_table=bt, softmax_scale=softmax_scale, causal=causal,
        window_size=window, sink_tokens=sink_tokens, softcap=softcap, return_lse=True, num_splits=num_splits,
        backend=backend, k_descale=_rows_of(k_descale, 0, batch), v_descale=_rows_of(v_descale, 0, batch),
        cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q)
    o = o[..., :dv]
    if out is None:
        return o, lse
    out.copy_(o)
    return out, lse


def _rows_of(descale, r0: int, r1: int):
    """Requests r0..r1's rows of a (batch, nheads_k) descale; None stays None, and a tensor of another shape goes
    to flash_attn_with_kvcache as it is, whose check words what is wrong with it."""
    if isinstance(descale, torch.Tensor) and descale.dim() == 2:
        return descale[r0:r1]
    return descale


# ------------------------------------------------------------------------------------------- vllm-flash-attn

def vllm_flash_attn_varlen_func(q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, cu_seqlens_k=None,
                                seqused_k=None, q_v=None, dropout_p=0.0, softmax_scale=None, causal=False,
                                window_size=None, softcap=0.0, alibi_slopes=None, deterministic=False,
                                return_attn_probs=False, block_table=None, return_softmax_lse=False, out=None,
                                scheduler_metadata=None, q_descale=None, k_descale=None, v_descale=None,
                                num_splits=0, output_scale=None, fa_version=2, s_aux=None, cp_world_size=1,
                                cp_rank=0, cp_tot_seqused_k=None, mask_mod=None, block_sparse_tensors=None,
                                aux_tensors=None, aux_tensor_leading_dims=None, dynamic_causal=None,
                                gather_kv_indices=None, gather_kv_valid_length=None, *, sinks=None,
                                learnable_sink=None, sink_tokens=0, backend="auto"):
    """vLLM's vllm.vllm_flash_attn.flash_attn_varlen_func (vLLM 0.33's positional order and keywords).

    q (total_q, nheads, headdim). Exactly one of cu_seqlens_k (packed keys k/v (total_k, nheads_k, headdim))
    and seqused_k (keys per sequence, int32 (batch,)) is given, as vLLM requires for FA2/FA3. With seqused_k,
    k/v are a paged cache (num_pages, page_size, nheads_k, headdim) read through block_table (batch,
    max_pages) int32, or without block_table a contiguous cache (batch, capacity, nheads_k, headdim); the
    queries are each request's last positions. out= (total_q, nheads, headdim) is written in place and
    returned. Returns out, or (out, softmax_lse (nheads, total_q) float32) with return_softmax_lse=True.

    Accepted and ignored: scheduler_metadata, fa_version (any version's semantics above), cp_rank,
    return_attn_probs (vLLM returns no probabilities either), q/k/v_descale for non-FP8 inputs. An FP8 KV cache
    (k/v float8_e4m3fn or float8_e5m2 with seqused_k, q in float16/bfloat16/float32; the cache holds x / scale)
    takes k_descale/v_descale as FlashAttention-3 does, (batch, nheads_k) float32 (vLLM passes its layer scales
    expanded to that shape), None meaning 1 (sinkattn.flash_attn_with_kvcache's FP8 caches; q_descale then must
    be None or ones: q is not quantized). Refused with a sinkattn error: dropout_p > 0, alibi_slopes, FP8 q, FP8
    packed keys (cu_seqlens_k), q_v, output_scale, cp_world_size > 1, cp_tot_seqused_k, mask_mod,
    block_sparse_tensors, aux_tensors, dynamic_causal, gather_kv_*."""
    fn = "vllm_flash_attn_varlen_func"
    sinks = _sinks(fn, sinks, s_aux, learnable_sink)
    _refuse_dropout_alibi(fn, dropout_p, alibi_slopes)
    want_lse = _flag(fn, "return_softmax_lse", return_softmax_lse)
    _flag(fn, "return_attn_probs", return_attn_probs)
    _refuse_vllm_extras(fn, q, k, v, q_v=q_v, output_scale=output_scale, cp_world_size=cp_world_size,
                        cp_tot_seqused_k=cp_tot_seqused_k, mask_mod=mask_mod,
                        block_sparse_tensors=block_sparse_tensors, aux_tensors=aux_tensors,
                        aux_tensor_leading_dims=aux_tensor_leading_dims, dynamic_causal=dynamic_causal,
                        gather_kv_indices=gather_kv_indices, gather_kv_valid_length=gather_kv_valid_length,
                        cache=seqused_k is not None and cu_seqlens_k is None)
    kv_fp8 = isinstance(k, torch.Tensor) and k.dtype in _FP8
    if kv_fp8:
        _check_q_descale(fn, q_descale)
    else:  # the descales of non-FP8 inputs mean nothing (vLLM's FA3/FA4 ignore them too), whatever they hold
        k_descale = v_descale = None
    if (cu_seqlens_k is None) == (seqused_k is None):
        raise SinkattnValueError(
            f"{_WHO}.{fn}: give exactly one of cu_seqlens_k (packed keys) and seqused_k (keys per sequence in a "
            f"cache); got {'both' if seqused_k is not None else 'neither'}")
    if block_table is not None and seqused_k is None:
        raise SinkattnValueError(f"{_WHO}.{fn}: block_table needs seqused_k (the keys per sequence in the paged "
                                 f"cache), as vLLM requires; cu_seqlens_k describes packed keys")
    if out is not None:
        _check_out(fn, out, q, v)
    if seqused_k is not None:
        _check_int32(fn, "seqused_k", seqused_k)
        _check_int32(fn, "cu_seqlens_q", cu_seqlens_q)
        def paged():
            return _paged(fn, q, k, v, cu_seqlens_q, seqused_k, block_table, max_seqlen_q, max_seqlen_k,
                          softmax_scale, causal, window_size, softcap, sinks, sink_tokens, num_splits, backend, out,
                          k_descale=k_descale, v_descale=v_descale)
        # out= is written in place and returned as given, so it cannot carry the forward-only marker: with out=
        # the call runs under no_grad and returns out without a backward, as vLLM's does.
        res, lse = _forward_only(fn, (q, k, v, sinks), paged) if out is None else _no_grad(paged)
    else:
        if not isinstance(num_splits, int) or isinstance(num_splits, bool) or num_splits < 0:
            raise SinkattnValueError(f"{_WHO}.{fn}: num_splits must be an int >= 0 (0 = heuristic); got "
                                     f"{num_splits!r}")
        res, lse = _varlen(fn, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, 0.0,
                           softmax_scale, causal, window_size, softcap, None, deterministic, sinks, sink_tokens,
                           backend)
        if out is not None:
            out.copy_(res)
            res = out
    return (res, lse) if want_lse else res


def _no_grad(run):
    with torch.no_grad():
        return run()


def get_scheduler_metadata(batch_size, max_seqlen_q, max_seqlen_k, num_heads_q, num_heads_kv, headdim,
                           cache_seqlens, qkv_dtype=torch.bfloat16, headdim_v=None, cu_seqlens_q=None,
                           cu_seqlens_k_new=None, cache_leftpad=None, page_size=None, max_seqlen_k_new=0,
                           causal=False, window_size=(-1, -1), has_softcap=False, num_splits=0, pack_gqa=None,
                           sm_margin=0):
    """vLLM's vllm.vllm_flash_attn.get_scheduler_metadata (vLLM 0.33's signature): FlashAttention-3's
    ahead-of-time split schedule. sinkattn plans its own split-KV schedule inside each call, so there is nothing
    to precompute: returns None, which vLLM passes on as scheduler_metadata=None (its value when it schedules
    nothing ahead of time) and which every function here accepts."""
    return None


def _refuse_vllm_extras(fn, q, k, v, *, cache, cp_world_size, **features) -> None:
    """cache: k/v are a KV cache (seqused_k), where FP8 k/v are served (flash_attn_with_kvcache's FP8 caches)."""
    what = {
        "q_v": "the fused q_v value input (FA3/FA4, MLA)", "output_scale": "fused FP8 output (FA4)",
        "cp_tot_seqused_k": "context parallelism (see sinkattn.distributed)", "mask_mod": "a custom mask_mod (FA4)",
        "block_sparse_tensors": "block-sparse attention (FA4)", "aux_tensors": "mask_mod's aux_tensors (FA4)",
        "aux_tensor_leading_dims": "mask_mod's aux_tensors (FA4)", "dynamic_causal": "dynamic causal offsets (FA4)",
        "gather_kv_indices": "gathered KV rows (FA4)", "gather_kv_valid_length": "gathered KV rows (FA4)",
    }
    for name, value in features.items():
        if value is not None:
            raise SinkattnValueError(f"{_WHO}.{fn}: {name} is not supported ({what[name]}); accepted: {name}=None. "
                                     f"Keep vLLM's FlashAttention backend for this layer")
    if cp_world_size != 1:
        raise SinkattnValueError(
            f"{_WHO}.{fn}: cp_world_size={cp_world_size!r} is not supported here; accepted: 1. For context "
            f"parallelism attend each shard with return_softmax_lse=True and merge the partial results with "
            f"sinkattn.merge_attn_states (sinkattn.distributed)")
    fp8 = [f"{name} {t.dtype}" for name, t in (("q", q), ("k", k), ("v", v))
           if isinstance(t, torch.Tensor) and t.dtype in _FP8 and (name == "q" or not cache)]
    if fp8:
        raise SinkattnTypeError(
            f"{_WHO}.{fn}: FP8 inputs ({', '.join(fp8)}) are not supported here: sinkattn reads FP8 only as a KV "
            f"cache (k/v with seqused_k, and block_table for pages), with q in float16, bfloat16 or float32; "
            f"accepted otherwise: float16, bfloat16, float32. Dequantize first (x.to(torch.bfloat16) * x_descale), "
            f"pass the keys as a cache, or use an unquantized KV cache (vLLM: kv_cache_dtype='auto')")


def _check_q_descale(fn, q_descale) -> None:
    """Over an FP8 cache q is not quantized: a q_descale other than ones would be a scale sinkattn does not apply."""
    if q_descale is None:
        return
    if not isinstance(q_descale, torch.Tensor) or not bool((q_descale == 1).all()):
        raise SinkattnValueError(
            f"{_WHO}.{fn}: q_descale other than ones over an FP8 KV cache: q is not quantized here (it must be "
            f"float16, bfloat16 or float32), so a query scale would be dropped; pass q_descale=None, or run with "
            f"the query unquantized (vLLM: no FP8 query quantization)")


def _check_out(fn, out, q, v) -> None:
    want = (q.shape[0], q.shape[1], v.shape[-1]) if isinstance(q, torch.Tensor) and q.dim() == 3 else None
    if not isinstance(out, torch.Tensor) or want is None or tuple(out.shape) != want or out.dtype != q.dtype \
            or out.device != q.device:
        got = (tuple(out.shape), out.dtype, str(out.device)) if isinstance(out, torch.Tensor) else type(out).__name__
        raise SinkattnValueError(f"{_WHO}.{fn}: out must be a {want} tensor of q's dtype {q.dtype} on "
                                 f"{q.device} (written in place); got {got}")


def _check_int32(fn, name, t) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int32:
        raise SinkattnTypeError(f"{_WHO}.{fn}: {name} must be an int32 tensor; got "
                                f"{t.dtype if isinstance(t, torch.Tensor) else type(t).__name__}")
