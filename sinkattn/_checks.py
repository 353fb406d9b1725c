"""Input validation for the public API.

Every message names the argument, says what was given and what is accepted. Checks come in two
kinds: metadata checks (dtypes, ranks, shapes, devices, python scalars) run in the public functions,
before the op, so torch.compile traces them as constant conditions; value checks (cu_seqlens,
cache_seqlens, block_table contents) read tensor data and run inside the op implementations.
"""
from __future__ import annotations

import math
import os

import torch

from . import fp8
from .errors import SinkattnRuntimeError, SinkattnTypeError, SinkattnValueError
from .layout import HEADDIM_MAX, HEADDIM_MULTIPLE, headdim_supported
from .mask import Mask, window_with_causal

# float64 is served by the reference backend only; it exists so gradcheck can run.
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
SINK_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
INT32_MAX = 2**31 - 1
BACKENDS = ("auto", "sm90", "sm80", "reference", "sm80-emulated", "sm90-emulated")

_DTYPE_NAMES = "float16, bfloat16, float32 (float64: reference backend only)"


def _shape(t: torch.Tensor) -> tuple:
    return tuple(t.shape)


def check_tensor(name: str, t, rank: int, layout: str, who: str = "sinkattn") -> None:
    if not isinstance(t, torch.Tensor):
        raise SinkattnTypeError(f"{who}: {name} must be a torch.Tensor {layout}; got {type(t).__name__}")
    if t.dim() != rank:
        raise SinkattnValueError(f"{who}: {name} must be a {rank}-D tensor {layout}; got shape {_shape(t)}")


def check_dtype(name: str, t: torch.Tensor) -> None:
    if t.dtype not in DTYPES:
        raise SinkattnTypeError(f"sinkattn: {name} has dtype {t.dtype}; accepted: {_DTYPE_NAMES}")


def check_same_dtype(ref_name: str, ref: torch.Tensor, others: dict) -> None:
    for name, t in others.items():
        if t.dtype != ref.dtype:
            raise SinkattnTypeError(
                f"sinkattn: {name} has dtype {t.dtype} but {ref_name} has {ref.dtype}; they must match")


def check_same_device(ref_name: str, ref: torch.Tensor, others: dict) -> None:
    for name, t in others.items():
        if t is not None and t.device != ref.device:
            raise SinkattnValueError(
                f"sinkattn: {name} is on {t.device} but {ref_name} is on {ref.device}; "
                f"all tensors of one call must be on the same device")


def check_last_dim_contiguous(tensors: dict) -> None:
    for name, t in tensors.items():
        if t is not None and t.shape[-1] > 1 and t.stride(-1) != 1:
            raise SinkattnValueError(
                f"sinkattn: {name} must have a contiguous last dimension (stride 1); got strides "
                f"{tuple(t.stride())} for shape {_shape(t)} (call .contiguous() first)")


def check_headdim(name: str, d: int) -> None:
    if not headdim_supported(d):
        raise SinkattnValueError(
            f"sinkattn: {name} has head dim {d}; accepted: a multiple of {HEADDIM_MULTIPLE} from "
            f"{HEADDIM_MULTIPLE} to {HEADDIM_MAX} (pad the head dim to the next multiple of {HEADDIM_MULTIPLE})")


def check_heads(nheads: int, nheads_k: int, k_name: str = "k") -> None:
    if nheads_k <= 0 or nheads % nheads_k != 0:
        raise SinkattnValueError(
            f"sinkattn: nheads of q ({nheads}) must be a multiple of nheads of {k_name} ({nheads_k}) "
            f"(GQA/MQA); accepted: nheads_k dividing nheads")


def check_qkv_common(q, k, v, k_name="k", v_name="v", kv_fp8: bool = False) -> None:
    """The checks shared by all layouts: dtypes, devices, strides, heads, head dims. (Each check tests the
    good case inline and calls the function that words the message only when it fails: this runs on every
    call, and at decode size every microsecond of it shows; bench/studies/cpu_overhead.py.) kv_fp8: k and v are
    an FP8 cache (sinkattn.fp8), of one FP8 dtype, with q in float16, bfloat16 or float32."""
    dtype, device = q.dtype, q.device
    if kv_fp8:
        if dtype not in fp8.QUERY_DTYPES:
            raise SinkattnTypeError(f"sinkattn: q has dtype {dtype} over an FP8 cache; accepted: float16, "
                                    f"bfloat16, float32")
        if v.dtype != k.dtype:
            raise SinkattnTypeError(f"sinkattn: {v_name} has dtype {v.dtype} but {k_name} has {k.dtype}; they "
                                    f"must match")
    elif dtype not in DTYPES:
        check_dtype("q", q)
    if not kv_fp8 and (k.dtype != dtype or v.dtype != dtype):
        check_same_dtype("q", q, {k_name: k, v_name: v})
    if k.device != device or v.device != device:
        check_same_device("q", q, {k_name: k, v_name: v})
    if (q.stride(-1) != 1 and q.shape[-1] > 1) or (k.stride(-1) != 1 and k.shape[-1] > 1) \
            or (v.stride(-1) != 1 and v.shape[-1] > 1):
        check_last_dim_contiguous({"q": q, k_name: k, v_name: v})
    check_headdim("q", q.shape[-1])
    if k.shape[-1] != q.shape[-1]:
        raise SinkattnValueError(
            f"sinkattn: {k_name} has head dim {k.shape[-1]} but q has {q.shape[-1]}; they must match")
    if v.shape[-1] != q.shape[-1]:
        raise SinkattnValueError(
            f"sinkattn: {v_name} has head dim {v.shape[-1]} but q has {q.shape[-1]}; they must match")
    if v.shape[-2] != k.shape[-2]:
        raise SinkattnValueError(
            f"sinkattn: {v_name} has {v.shape[-2]} heads but {k_name} has {k.shape[-2]}; they must match")
    check_heads(q.shape[-2], k.shape[-2], k_name)


def check_batched(q, k, v) -> None:
    """q (b, sq, h, d), k and v (b, sk, hk, d). The good case is one pass over the facts (at a tiny call the checks
    are a good part of the time: each attribute read once); anything else goes to the checks below, which say what
    is wrong."""
    if isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor):
        qs, ks, dtype = q.shape, k.shape, q.dtype
        if (len(qs) == 4 and len(ks) == 4 and v.shape == ks and ks[0] == qs[0] and ks[3] == qs[3]
                and 0 < ks[2] and qs[2] % ks[2] == 0 and 0 < qs[3] <= HEADDIM_MAX and qs[3] % HEADDIM_MULTIPLE == 0
                and dtype in DTYPES and k.dtype == dtype and v.dtype == dtype
                and q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1
                and k.device == q.device and v.device == q.device):
            return
    _check_batched_words(q, k, v)


def _check_batched_words(q, k, v) -> None:
    check_tensor("q", q, 4, "(batch, seqlen_q, nheads, headdim)")
    check_tensor("k", k, 4, "(batch, seqlen_k, nheads_k, headdim)")
    check_tensor("v", v, 4, "(batch, seqlen_k, nheads_k, headdim)")
    check_qkv_common(q, k, v)
    if k.shape[0] != q.shape[0] or v.shape[0] != q.shape[0]:
        raise SinkattnValueError(
            f"sinkattn: batch sizes differ: q {q.shape[0]}, k {k.shape[0]}, v {v.shape[0]}; they must match")
    if v.shape[1] != k.shape[1]:
        raise SinkattnValueError(
            f"sinkattn: v has seqlen {v.shape[1]} but k has {k.shape[1]}; they must match")


def check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> None:
    check_tensor("q", q, 3, "(total_q, nheads, headdim)")
    check_tensor("k", k, 3, "(total_k, nheads_k, headdim)")
    check_tensor("v", v, 3, "(total_k, nheads_k, headdim)")
    check_qkv_common(q, k, v)
    if v.shape[0] != k.shape[0]:
        raise SinkattnValueError(f"sinkattn: v has {v.shape[0]} tokens but k has {k.shape[0]}; they must match")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        check_tensor(name, cu, 1, "(batch + 1,) int32")
        if cu.dtype != torch.int32:
            raise SinkattnTypeError(f"sinkattn: {name} has dtype {cu.dtype}; accepted: torch.int32")
        if cu.shape[0] < 1:
            raise SinkattnValueError(f"sinkattn: {name} has length 0; accepted: batch + 1 >= 1 entries")
    if cu_seqlens_q.shape[0] != cu_seqlens_k.shape[0]:
        raise SinkattnValueError(
            f"sinkattn: cu_seqlens_q has length {cu_seqlens_q.shape[0]} but cu_seqlens_k has "
            f"{cu_seqlens_k.shape[0]}; both must be batch + 1")
    check_same_device("q", q, {"cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k})
    for name, mx in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        check_int(name, mx, minimum=0)
        if mx > INT32_MAX:  # the kernels size their grids from it, in int32 like cu_seqlens
            raise SinkattnValueError(f"sinkattn: {name} is {mx}; accepted: an int from 0 to {INT32_MAX} "
                                     f"(cu_seqlens are int32)")


def value_checks_on(t: torch.Tensor) -> bool:
    """Whether to read index tensors (cu_seqlens, cache_seqlens, block_table) to validate them. Each read
    synchronises with a CUDA device (a host round trip on every eager decode step), so: not while a CUDA graph
    is captured, and not with SINKATTN_VALUE_CHECKS=0 (then invalid values are not caught: the
    kernels read and write where they point)."""
    return os.environ.get("SINKATTN_VALUE_CHECKS", "1") != "0" and not (
        t.is_cuda and torch.cuda.is_current_stream_capturing())


def check_cu_seqlens_values(cu_seqlens_q, cu_seqlens_k, total_q: int, total_k: int,
                            max_seqlen_q: int, max_seqlen_k: int) -> None:
    """Value checks (read the tensors): start at 0, non-decreasing, within the packed tensors."""
    for name, cu, total, mx, side in (("cu_seqlens_q", cu_seqlens_q, total_q, max_seqlen_q, "q"),
                                      ("cu_seqlens_k", cu_seqlens_k, total_k, max_seqlen_k, "k")):
        vals = cu.tolist()
        if vals[0] != 0:
            raise SinkattnValueError(f"sinkattn: {name}[0] is {vals[0]}; accepted: 0 (offsets start at 0)")
        lengths = [b - a for a, b in zip(vals, vals[1:])]
        bad = next((i for i, n in enumerate(lengths) if n < 0), None)
        if bad is not None:
            raise SinkattnValueError(
                f"sinkattn: {name} must be non-decreasing; got {name}[{bad}] = {vals[bad]} > "
                f"{name}[{bad + 1}] = {vals[bad + 1]}")
        if vals[-1] > total:
            raise SinkattnValueError(
                f"sinkattn: {name}[-1] is {vals[-1]} but {side} holds only {total} tokens; accepted: <= {total}")
        longest = max(lengths, default=0)
        if longest > mx:
            raise SinkattnValueError(
                f"sinkattn: a sequence in {name} has {longest} tokens but max_seqlen_{side} is {mx}; "
                f"accepted: max_seqlen_{side} >= the longest sequence")


def check_sinks(sinks, q: torch.Tensor) -> None:
    if sinks is None:
        return
    if not isinstance(sinks, torch.Tensor):
        raise SinkattnTypeError(f"sinkattn: sinks must be a torch.Tensor of shape (nheads,); got {type(sinks).__name__}")
    nheads = q.shape[-2]
    if _shape(sinks) != (nheads,):
        raise SinkattnValueError(
            f"sinkattn: sinks has shape {_shape(sinks)}; accepted: ({nheads},), one logit per query head")
    if sinks.dtype not in SINK_DTYPES:
        raise SinkattnTypeError(
            f"sinkattn: sinks has dtype {sinks.dtype}; accepted: float32, bfloat16, float16 (float64: reference only)")
    check_same_device("q", q, {"sinks": sinks})


def resolve_sinks(sinks, s_aux, learnable_sink=None, who: str = "sinkattn"):
    """The one rule for the sink logits' names: sinks= (sinkattn), s_aux= (vLLM, transformers) and learnable_sink=
    (FlashAttention 4) are aliases of one argument; at most one may be given."""
    given = [(n, t) for n, t in (("sinks", sinks), ("s_aux", s_aux), ("learnable_sink", learnable_sink))
             if t is not None]
    if len(given) > 1:
        raise SinkattnValueError(
            f"{who}: {' and '.join(f'{n}=' for n, _ in given)} were both given; they are aliases of one argument "
            f"(the learnable sink logits, (nheads,)); pass only one")
    return given[0][1] if given else None


def default_scale(headdim: int) -> float:
    """softmax_scale when the caller gives none: 1 / sqrt(headdim) of the caller's head dim. (A head dim < 1 gets 1.0:
    the head-dim check, which runs after the mask's, refuses that call with its own message.)"""
    return 1.0 / math.sqrt(headdim) if headdim >= 1 else 1.0


def check_int(name: str, value, minimum: int, who: str = "sinkattn") -> None:
    """`who` names the API in the message (SinkKVCache's arguments say "SinkKVCache")."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise SinkattnTypeError(f"{who}: {name} must be an int; got {type(value).__name__} {value!r}")
    if value < minimum:
        raise SinkattnValueError(f"{who}: {name} is {value}; accepted: an int >= {minimum}")


def check_bool(name: str, value, who: str = "sinkattn") -> None:
    if not isinstance(value, bool):
        raise SinkattnTypeError(f"{who}: {name} must be a bool; got {type(value).__name__} {value!r}")


def check_backend(backend) -> None:
    if backend not in BACKENDS:
        raise SinkattnValueError(
            f"sinkattn: backend={backend!r} is not known; accepted: " + ", ".join(repr(b) for b in BACKENDS))


def normalize_mask(headdim: int, softmax_scale, causal, window_size, sink_tokens, softcap) -> Mask:
    """The call's scale, window, sink tokens and softcap, checked, as the one Mask value the layers below carry."""
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise SinkattnValueError(
            f"sinkattn: window_size must be a pair (left, right); got {window_size!r}; -1 means unbounded")
    left, right = window_size
    check_int("window_size[0] (left)", left, minimum=-1)
    check_int("window_size[1] (right)", right, minimum=-1)
    if not isinstance(causal, bool):
        raise SinkattnTypeError(f"sinkattn: causal must be a bool; got {type(causal).__name__} {causal!r}")
    left, right = window_with_causal(left, right, causal, strict=True)
    check_int("sink_tokens", sink_tokens, minimum=0)
    # The kernels take int32 bounds. Positions are int32 too (cu_seqlens, cache_seqlens), so a bound past
    # INT32_MAX reaches past every key and clamping it changes nothing.
    left, right, sink_tokens = min(left, INT32_MAX), min(right, INT32_MAX), min(sink_tokens, INT32_MAX)
    softcap = _check_float("softcap", softcap)
    if softcap < 0:
        raise SinkattnValueError(f"sinkattn: softcap is {softcap}; accepted: 0 (off) or a positive float")
    softmax_scale = _check_float("softmax_scale", default_scale(headdim) if softmax_scale is None else softmax_scale)
    return Mask(softmax_scale, left, right, sink_tokens, softcap)


def _check_float(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SinkattnTypeError(f"sinkattn: {name} must be a float; got {type(value).__name__} {value!r}")
    value = float(value)
    # A comparison, not math.isfinite: under torch.compile(dynamic=True) a float can be a SymFloat, which
    # math.isfinite does not take; NaN fails both comparisons, +-inf one of them.
    if not -math.inf < value < math.inf:
        raise SinkattnValueError(f"sinkattn: {name} is {value}; accepted: a finite float")
    return value


def check_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, block_table, rotary_cos, rotary_sin,
                  num_splits, cu_seqlens_q=None, max_seqlen_q=None) -> None:
    """cu_seqlens_q: packed queries (total_q, nheads, headdim) over a cache that already holds every key (the
    serving form: no k/v to append, no rotary), batch = cu_seqlens_q.numel() - 1."""
    if cu_seqlens_q is None:
        check_tensor("q", q, 4, "(batch, seqlen_q, nheads, headdim)")
        batch = q.shape[0]
    else:
        check_tensor("q", q, 3, "(total_q, nheads, headdim) with cu_seqlens_q")
        check_tensor("cu_seqlens_q", cu_seqlens_q, 1, "(batch + 1,) int32")
        if cu_seqlens_q.dtype != torch.int32 or cu_seqlens_q.numel() < 1:
            raise SinkattnTypeError(f"sinkattn: cu_seqlens_q must be int32 (batch + 1,); got {cu_seqlens_q.dtype} "
                                    f"{_shape(cu_seqlens_q)}")
        check_same_device("q", q, {"cu_seqlens_q": cu_seqlens_q})
        check_int("max_seqlen_q", max_seqlen_q, minimum=0)
        if k is not None or v is not None or rotary_cos is not None or rotary_sin is not None:
            raise SinkattnValueError(
                "sinkattn: with cu_seqlens_q the cache must already hold every key (k/v to append and rotary are "
                "taken in the padded form only): write the new keys first (vLLM's reshape_and_cache_flash, or "
                "sinkattn.integrations.vllm_paged.write_kv) and pass cache_seqlens counting them")
        batch = cu_seqlens_q.numel() - 1
    paged = block_table is not None
    layout = "(num_pages, page_size, nheads_k, headdim)" if paged else "(batch, capacity, nheads_k, headdim)"
    check_tensor("k_cache", k_cache, 4, layout)
    check_tensor("v_cache", v_cache, 4, layout)
    check_qkv_common(q, k_cache, v_cache, "k_cache", "v_cache", kv_fp8=fp8.is_fp8(k_cache.dtype))
    if v_cache.shape[:2] != k_cache.shape[:2]:
        raise SinkattnValueError(
            f"sinkattn: v_cache has shape {_shape(v_cache)} but k_cache has {_shape(k_cache)}; they must match")
    if paged:
        check_tensor("block_table", block_table, 2, "(batch, max_pages) int32")
        if block_table.dtype != torch.int32:
            raise SinkattnTypeError(f"sinkattn: block_table has dtype {block_table.dtype}; accepted: torch.int32")
        if block_table.shape[0] != batch:
            raise SinkattnValueError(
                f"sinkattn: block_table has {block_table.shape[0]} rows but the call has batch {batch}; they must "
                "match")
        check_same_device("q", q, {"block_table": block_table})
    elif k_cache.shape[0] != batch:
        raise SinkattnValueError(
            f"sinkattn: k_cache has batch {k_cache.shape[0]} but the call has {batch}; they must match "
            f"(for a paged cache pass block_table)")
    if (k is None) != (v is None):
        raise SinkattnValueError("sinkattn: k and v (the new tokens to append) must be given together; got only "
                                 + ("k" if v is None else "v"))
    if k is not None:
        check_tensor("k", k, 4, "(batch, seqlen_new, nheads_k, headdim)")
        check_tensor("v", v, 4, "(batch, seqlen_new, nheads_k, headdim)")
        check_same_dtype("q", q, {"k": k, "v": v})
        check_same_device("q", q, {"k": k, "v": v})
        check_last_dim_contiguous({"k": k, "v": v})
        want = (batch, k.shape[1], *k_cache.shape[2:])
        for name, t in (("k", k), ("v", v)):
            if _shape(t) != want:
                raise SinkattnValueError(
                    f"sinkattn: {name} has shape {_shape(t)}; accepted: {want} (batch, seqlen_new, "
                    f"nheads_k, headdim of the cache)")
    if k is not None:
        check_writable_caches(k_cache, v_cache)
    check_tensor("cache_seqlens", cache_seqlens, 1, "(batch,) int32")
    if cache_seqlens.dtype != torch.int32:
        raise SinkattnTypeError(f"sinkattn: cache_seqlens has dtype {cache_seqlens.dtype}; accepted: torch.int32")
    if cache_seqlens.shape[0] != batch:
        raise SinkattnValueError(
            f"sinkattn: cache_seqlens has shape {_shape(cache_seqlens)}; accepted: ({batch},), one length per sequence")
    check_same_device("q", q, {"cache_seqlens": cache_seqlens})
    check_rotary_tables(rotary_cos, rotary_sin, q.shape[-1])
    check_same_device("q", q, {"rotary_cos": rotary_cos, "rotary_sin": rotary_sin})
    check_int("num_splits", num_splits, minimum=0)


def check_rotary_tables(rotary_cos, rotary_sin, headdim: int, who: str = "sinkattn") -> None:
    """FlashAttention's rotary tables (sinkattn.rotary): both or neither, floating, (max_position, rotary_dim / 2)
    each, rotating 2 to headdim dims. `who` names the API in the message (flash_attn_with_kvcache, SinkKVCache)."""
    if (rotary_cos is None) != (rotary_sin is None):
        raise SinkattnValueError(f"{who}: rotary_cos and rotary_sin must be given together; got only "
                                 + ("rotary_cos" if rotary_sin is None else "rotary_sin"))
    if rotary_cos is None:
        return
    check_tensor("rotary_cos", rotary_cos, 2, "(max_position, rotary_dim / 2)", who)
    check_tensor("rotary_sin", rotary_sin, 2, "(max_position, rotary_dim / 2)", who)
    if rotary_sin.shape != rotary_cos.shape:
        raise SinkattnValueError(
            f"{who}: rotary_sin has shape {_shape(rotary_sin)} but rotary_cos has {_shape(rotary_cos)}; they must match")
    for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        if not t.is_floating_point():
            raise SinkattnTypeError(f"{who}: {name} has dtype {t.dtype}; accepted: a floating dtype")
    rotary_dim = 2 * rotary_cos.shape[1]
    if rotary_dim == 0 or rotary_dim > headdim:
        raise SinkattnValueError(
            f"{who}: rotary_cos has {rotary_cos.shape[1]} columns, a rotary dim of {rotary_dim}; "
            f"accepted: 1 to headdim / 2 = {headdim // 2} columns")


def check_writable_caches(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Appending writes into the caches: each element must own its memory and the two caches must not share
    any, or one write lands in several places (a broadcast cache, k_cache is v_cache)."""
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if any(st == 0 and n > 1 for n, st in zip(t.shape, t.stride())):
            raise SinkattnValueError(
                f"sinkattn: {name} (strides {tuple(t.stride())}, shape {_shape(t)}) has elements sharing memory "
                f"(a broadcast/expanded view); new k/v cannot be appended into it; accepted: a cache whose "
                f"elements own their memory (.contiguous() or a real allocation)")
    # Interleaved views of one allocation (kv[:, :, 0], kv[:, :, 1]) are fine; the same first element is not.
    # (Data pointers do not exist while torch.compile traces: the check runs eagerly only.)
    if not torch.compiler.is_compiling() and k_cache.numel() and k_cache.data_ptr() == v_cache.data_ptr():
        raise SinkattnValueError(
            "sinkattn: k_cache and v_cache start at the same memory (the same tensor passed twice?); appending "
            "k/v would write one over the other; accepted: separate k and v caches")


def check_kvcache_values(cache_seqlens, seqlen_new: int, seqlen_q: int, capacity: int, block_table,
                         page_size: int, num_pages: int, rotary_positions: int | None) -> None:
    """Value checks, before anything is written to the cache (cache_seqlens: the tensor, or its values as a list)."""
    lens = cache_seqlens if isinstance(cache_seqlens, list) else cache_seqlens.tolist()
    for b, n in enumerate(lens):
        if n < 0:
            raise SinkattnValueError(f"sinkattn: cache_seqlens[{b}] is {n}; accepted: >= 0")
        if n + seqlen_new > capacity:
            raise SinkattnValueError(
                f"sinkattn: cache_seqlens[{b}] is {n}" + (f" and {seqlen_new} new tokens are appended" if seqlen_new else "")
                + f", beyond the cache capacity of {capacity} tokens; accepted: cache_seqlens + seqlen_new <= {capacity}")
    if block_table is not None and lens:
        total = torch.tensor(lens, dtype=torch.int64, device=block_table.device) + seqlen_new
        used = (total + page_size - 1) // page_size
        col = torch.arange(block_table.shape[1], device=block_table.device)
        bad = (col[None, :] < used[:, None]) & ((block_table < 0) | (block_table >= num_pages))
        if bad.any():
            b, i = (int(x) for x in bad.nonzero()[0].tolist())
            raise SinkattnValueError(
                f"sinkattn: block_table[{b}, {i}] is {int(block_table[b, i])}, a page this sequence uses; "
                f"accepted: a page index in [0, {num_pages}) (k_cache.shape[0])")
    if rotary_positions is not None and lens:
        needed = max(lens) + max(seqlen_q, seqlen_new)
        if needed > rotary_positions:
            raise SinkattnValueError(
                f"sinkattn: rotary_cos/rotary_sin have {rotary_positions} positions but position {needed - 1} "
                f"is needed (cache_seqlens up to {max(lens)} plus {max(seqlen_q, seqlen_new)} new tokens); "
                f"accepted: tables with at least {needed} rows")


def check_no_grad_needed(op: str, tensors: dict) -> None:
    """An op without a backward refuses, at call time, inputs autograd would have to differentiate (rather than
    return an output whose .backward() fails later inside torch)."""
    if not torch.is_grad_enabled():
        return
    names = [name for name, t in tensors.items() if t is not None and t.requires_grad]
    if names:
        raise SinkattnRuntimeError(
            f"sinkattn: {op} has no backward (it is for inference: it appends to the cache in place), but "
            f"{', '.join(names)} require{'s' if len(names) == 1 else ''} grad and grad mode is on. For inference, "
            f"call it under torch.no_grad() or torch.inference_mode() (or pass .detach()ed tensors); to train, gather "
            f"the cached keys and values and call flash_attn_with_sinks (or flash_attn_varlen_with_sinks for "
            f"packed sequences), which have a backward")


def forced_backend_error(backend: str, reason: str, would: str) -> SinkattnRuntimeError:
    return SinkattnRuntimeError(f"sinkattn: backend={backend!r} cannot serve this call: {reason}. {would}")
