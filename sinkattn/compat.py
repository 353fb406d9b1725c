"""Drop-in replacements for serving engines: vLLM's `vllm_flash_attn.flash_attn_varlen_func`.

vLLM runs gpt-oss's sink attention through `flash_attn_varlen_func(..., s_aux=sinks)`, which only
its FlashAttention-3 build (Hopper) and FA4 (Blackwell) serve; on an A100, L4 or RTX 3090/4090 the
FLASH_ATTN backend refuses models with sinks ("Sinks are only supported in FlashAttention 3").
`flash_attn_varlen_func` below has the same signature and semantics and runs on sinkattn, which
serves sinks on every GPU from sm80 up (and on the CPU reference backend).

Routing a gpt-oss deployment on an A100 / RTX 4090 here (vLLM V1; vLLM internals move, so this is
best effort: `patch_vllm` raises a clear error if the modules it patches are not where it expects)::

    # 1. make every vLLM process patch itself at start-up, through vLLM's plugin hook. sinkattn
    #    exposes the hook as sinkattn.compat:vllm_plugin; register it in your own package (or a
    #    sitecustomize) under the entry-point group "vllm.general_plugins":
    #        [project.entry-points."vllm.general_plugins"]
    #        sinkattn = "sinkattn.compat:vllm_plugin"
    #    The hook does nothing unless SINKATTN_VLLM=1, so installing it changes nothing by itself.
    # 2. select the FLASH_ATTN backend and turn the hook on:
    SINKATTN_VLLM=1 vllm serve openai/gpt-oss-20b --attention-backend FLASH_ATTN
    #    (older vLLM: VLLM_ATTENTION_BACKEND=FLASH_ATTN instead of --attention-backend)

    # Or in a single process (no plugin needed):
    import os; os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import sinkattn.compat; sinkattn.compat.patch_vllm()
    from vllm import LLM
    llm = LLM("openai/gpt-oss-20b", attention_backend="FLASH_ATTN")

`patch_vllm()` points `vllm.v1.attention.backends.flash_attn.flash_attn_varlen_func` (and the
`fa_utils` one) at this module, reports sink support, lifts the backend's "sink not supported on
compute capability < 9.0" refusal, and turns cascade attention off (it would add the sink twice).
Not supported here: ALiBi, dropout, fp8 KV caches, vLLM's decode context parallelism
(cp_world_size > 1). The query/key offsets are read on the host (`cu_seqlens_q`, once per call) for
mixed prefill/decode batches, so run vLLM with piecewise CUDA graphs (the default), not
`cudagraph_mode=FULL`; pure decode batches (max_seqlen_q == 1) do not read them.
"""
from __future__ import annotations

import inspect
import os

import torch

from .errors import SinkattnRuntimeError, SinkattnTypeError, SinkattnValueError
from .interface import flash_attn_varlen_with_sinks, flash_attn_with_kvcache

_FP8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
             if hasattr(torch, n))


def flash_attn_varlen_func(
    q,
    k,
    v,
    max_seqlen_q,
    cu_seqlens_q,
    max_seqlen_k,
    cu_seqlens_k=None,
    seqused_k=None,
    q_v=None,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=None,
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
    return_softmax_lse=False,
    out=None,
    scheduler_metadata=None,
    q_descale=None,
    k_descale=None,
    v_descale=None,
    num_splits=0,
    fa_version=None,
    s_aux=None,
    cp_world_size=1,
    cp_rank=0,
    cp_tot_seqused_k=None,
):
    """vLLM's `flash_attn_varlen_func`, served by sinkattn (same arguments, same positions).

    q: (total_q, nheads, headdim), the queries of all sequences packed; cu_seqlens_q (batch + 1,)
    int32 offsets; max_seqlen_q the longest. Keys come in one of three layouts:
      - paged KV cache (vLLM's decode and chunked prefill): k, v (num_blocks, block_size, nheads_k,
        headdim), block_table (batch, max_blocks) int32, seqused_k (batch,) int32 = keys per sequence
        (the new tokens included, already written to the cache);
      - packed keys: k, v (total_k, nheads_k, headdim) with cu_seqlens_k (batch + 1,);
      - batched keys: k, v (batch, seqlen_k, nheads_k, headdim) with seqused_k (keys used per row).
    Queries align bottom-right within their sequence (query i of a sequence with q_len queries and
    seqlen_k keys sits at key position seqlen_k - q_len + i). causal / window_size (left, right) /
    softcap / softmax_scale as in FlashAttention; s_aux (nheads,): the learnable sink logits
    (gpt-oss), added once to each row's softmax denominator. Returns out (total_q, nheads, headdim)
    (written into `out` if given), and with return_softmax_lse also lse (nheads, total_q) float32,
    natural log, including the sink. scheduler_metadata, fa_version and unit descales are accepted
    and ignored (they tune or select FlashAttention builds); num_splits is passed on as a hint.
    """
    _refuse(dropout_p=dropout_p, alibi_slopes=alibi_slopes, return_attn_probs=return_attn_probs, q_v=q_v,
            cp_world_size=cp_world_size, k=k)
    for name, t in (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale)):
        if t is not None and not isinstance(t, torch.Tensor):
            raise SinkattnTypeError(f"sinkattn.compat: {name} must be a tensor or None; got {type(t).__name__}")
    if window_size is None:
        window_size = (-1, -1)
    elif not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise SinkattnValueError(f"sinkattn.compat: window_size must be None or [left, right]; got {window_size!r}")
    window_size = (int(window_size[0]), int(window_size[1]))
    softcap = float(softcap or 0.0)
    common = dict(softmax_scale=softmax_scale, causal=bool(causal), window_size=window_size, softcap=softcap)
    if cu_seqlens_k is not None and seqused_k is not None:
        raise SinkattnValueError("sinkattn.compat: pass cu_seqlens_k (packed keys) or seqused_k (paged or batched "
                                 "keys), not both")
    if block_table is not None and seqused_k is None:
        raise SinkattnValueError("sinkattn.compat: block_table (a paged KV cache) needs seqused_k, the number of "
                                 "keys of each sequence")
    if cu_seqlens_k is not None:
        if block_table is not None:
            raise SinkattnValueError("sinkattn.compat: a paged KV cache (block_table) takes seqused_k, not "
                                     "cu_seqlens_k")
        o, lse = flash_attn_varlen_with_sinks(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                              s_aux, return_lse=True, deterministic=bool(deterministic), **common)
    elif seqused_k is not None:
        o, lse = _cached(q, k, v, cu_seqlens_q, int(max_seqlen_q), seqused_k, block_table, s_aux, num_splits,
                         common)
    else:
        raise SinkattnValueError("sinkattn.compat: give cu_seqlens_k (packed keys) or seqused_k (with block_table "
                                 "for a paged KV cache)")
    if out is not None:
        if out.shape != o.shape:
            raise SinkattnValueError(f"sinkattn.compat: out has shape {tuple(out.shape)}; accepted: {tuple(o.shape)} "
                                     f"(total_q, nheads, headdim)")
        out.copy_(o)
        o = out
    return (o, lse) if return_softmax_lse else o


def _refuse(*, dropout_p, alibi_slopes, return_attn_probs, q_v, cp_world_size, k):
    if dropout_p:
        raise SinkattnValueError(f"sinkattn.compat: dropout_p={dropout_p} is not supported; accepted: 0.0 "
                                 f"(inference)")
    if alibi_slopes is not None:
        raise SinkattnValueError("sinkattn.compat: alibi_slopes is not supported by sinkattn")
    if return_attn_probs:
        raise SinkattnValueError("sinkattn.compat: return_attn_probs is not supported (a testing-only option)")
    if q_v is not None:
        raise SinkattnValueError("sinkattn.compat: q_v (FA3's separate value-query input) is not supported")
    if cp_world_size not in (None, 1):
        raise SinkattnValueError(f"sinkattn.compat: cp_world_size={cp_world_size} (vLLM decode context "
                                 f"parallelism) is not supported; sinkattn.distributed.ring_attention is the "
                                 f"context-parallel path")
    if isinstance(k, torch.Tensor) and k.dtype in _FP8:
        raise SinkattnTypeError(f"sinkattn.compat: an fp8 KV cache ({k.dtype}) is not supported; accepted: "
                                f"bfloat16, float16, float32 (vLLM: --kv-cache-dtype auto)")


def _cached(q, k, v, cu_seqlens_q, max_seqlen_q, seqused_k, block_table, s_aux, num_splits, common):
    """Paged or batched keys: flash_attn_with_kvcache on groups of sequences with the same query count."""
    if q.dim() != 3:
        raise SinkattnValueError(f"sinkattn.compat: q must be (total_q, nheads, headdim); got {tuple(q.shape)}")
    batch = cu_seqlens_q.shape[0] - 1
    total_q, h, d = q.shape
    seqused_k = seqused_k.to(torch.int32)
    kw = dict(block_table=None, num_splits=int(num_splits or 0), return_lse=True, **common)
    if max_seqlen_q == 1 and total_q == batch:
        # Pure decode: one query per sequence, no host read of cu_seqlens_q (CUDA-graph friendly).
        kw["block_table"] = block_table
        o, lse = flash_attn_with_kvcache(q.unsqueeze(1), k, v, s_aux, cache_seqlens=seqused_k, **kw)
        return o.squeeze(1), lse.squeeze(2).transpose(0, 1).contiguous()
    starts = cu_seqlens_q.tolist()
    o = torch.zeros_like(q)
    lse = torch.full((h, total_q), float("-inf"), dtype=torch.float32, device=q.device)
    groups: dict[int, list[int]] = {}
    for b in range(batch):
        n = starts[b + 1] - starts[b]
        if n > 0:
            groups.setdefault(n, []).append(b)
    for n, seqs in groups.items():
        rows = torch.tensor([starts[b] + i for b in seqs for i in range(n)], dtype=torch.long, device=q.device)
        idx = torch.tensor(seqs, dtype=torch.long, device=q.device)
        if block_table is not None:
            kw["block_table"] = block_table.index_select(0, idx)
            kc, vc = k, v
        else:
            kc, vc = k.index_select(0, idx), v.index_select(0, idx)
        og, lg = flash_attn_with_kvcache(q.index_select(0, rows).view(len(seqs), n, h, d), kc, vc, s_aux,
                                         cache_seqlens=seqused_k.index_select(0, idx), **kw)
        o.index_copy_(0, rows, og.reshape(-1, h, d))
        lse.index_copy_(1, rows, lg.transpose(0, 1).reshape(h, -1).float())
    return o, lse


# ---- vLLM routing -------------------------------------------------------------------------------------------
def patch_vllm():
    """Route vLLM's FLASH_ATTN backend (vLLM V1) through sinkattn, sinks included (see the module docstring).

    Returns the list of what was patched. Raises SinkattnRuntimeError when vLLM is not installed or its
    attention modules are not where this function expects them."""
    try:
        import vllm.v1.attention.backends.fa_utils as fa_utils
        import vllm.v1.attention.backends.flash_attn as fa_backend
    except ImportError as e:
        raise SinkattnRuntimeError(f"sinkattn.compat.patch_vllm: cannot import vLLM's FlashAttention backend "
                                   f"(vllm.v1.attention.backends.flash_attn / fa_utils): {e}") from e
    backend_cls = getattr(fa_backend, "FlashAttentionBackend", None)
    if backend_cls is None:
        raise SinkattnRuntimeError("sinkattn.compat.patch_vllm: vllm.v1.attention.backends.flash_attn has no "
                                   "FlashAttentionBackend; this vLLM version is not supported")
    patched = []

    def supports_sinks(*args, **kwargs):
        return True

    for module in (fa_utils, fa_backend):
        for name, value in (("flash_attn_varlen_func", flash_attn_varlen_func),
                            ("flash_attn_supports_sinks", supports_sinks)):
            setattr(module, name, value)
            patched.append(f"{module.__name__}.{name}")
    if hasattr(fa_backend, "use_cascade_attention"):  # cascade would merge two sinked partials: sink twice
        fa_backend.use_cascade_attention = lambda *args, **kwargs: False
        patched.append(f"{fa_backend.__name__}.use_cascade_attention")
    original = inspect.getattr_static(backend_cls, "supports_combination", None)
    if original is not None and not getattr(original, "_sinkattn", False):
        func = original.__func__ if isinstance(original, (classmethod, staticmethod)) else original

        def supports_combination(cls, *args, **kwargs):
            bound = inspect.signature(func).bind(cls, *args, **kwargs)
            bound.arguments["has_sink"] = False  # sinkattn serves sinks on every arch from sm80
            return func(*bound.args, **bound.kwargs)

        supports_combination._sinkattn = True
        backend_cls.supports_combination = classmethod(supports_combination)
        patched.append(f"{backend_cls.__qualname__}.supports_combination")
    return patched


def vllm_plugin():
    """vLLM `vllm.general_plugins` entry point: patches vLLM when SINKATTN_VLLM=1, otherwise does nothing."""
    if os.environ.get("SINKATTN_VLLM", "0") == "1":
        patch_vllm()
