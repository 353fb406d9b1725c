"""What each benchmark case is run by: sinkattn and what users would pick instead, doing the same math.

    sinkattn        sinkattn's public API with backend "auto": the kernel a user of this GPU gets (on a CPU
                    that is the PyTorch reference backend); the column every ratio is taken against
    sinkattn-sm80   sinkattn forced onto its sm80 kernels, on a cc 9.0 GPU only (sm_80 code runs there too)
    sinkattn-sm90   sinkattn's sm90 backward forced (backend="sm90", forward and backward), backward cases on a
                    cc 9.0 GPU only: "auto" keeps the backward on sm80 until a GPU run validates the sm90 one
                    (dispatch.SM90_BWD_VALIDATED), so this column is where it is timed beside the others
    sinkattn-sm80-99k
                    the same under a 99 KB shared-memory cap (sinkattn.sm80_smem_limit, around the preparation
                    and every timed call): the sm80 tiles of cc 8.6/8.9 (A10, L4, RTX 4090), timed beside the
                    sm80 table's in the same run on a cc 9.0 GPU only; a kernel none of whose tiles fits 99 KB
                    (the head-dim-256 backward) is n/a with dispatch's reason
    reference       sinkattn's PyTorch reference backend, where it fits in time (REF_MAX_FLOPS on a GPU)
    sdpa-flash      torch.nn.functional.scaled_dot_product_attention restricted to its flash backend.
                    It has no sink: for a forward with learnable sinks the sink is added exactly from the
                    flash kernel's logsumexp (aten._scaled_dot_product_flash_attention[_for_cpu]):
                    out_sink = out * sigmoid(lse - sink). Its lse output has no gradient, so a backward
                    with sinks runs without the sink and is marked "no sink". No sliding window, no sink
                    tokens, causal only where bottom-right equals top-left alignment (seqlen_q == seqlen_k,
                    or one query of decode, which sees the whole cache): otherwise "n/a".
    flex            torch.nn.attention.flex_attention (torch.compile'd on a GPU; eager, unfused, on a CPU),
                    window and sink tokens through mask_mod (a BlockMask, built outside the timed region,
                    as a user would cache it), learnable sinks by the same exact lse correction, which is
                    differentiable here. Paged decode: n/a.
    vllm-triton     vLLM 0.33's Triton unified attention (its TRITON_ATTN backend's kernel, what vLLM serves
                    sinks with off Hopper), source from the vllm wheel at run time (peer_vllm.py here).
                    Paged decode on a GPU only; n/a elsewhere and when the source was not extracted.

FP8 decode cases (Case.kv_dtype "fp8_e4m3" / "fp8_e5m2"): the caches hold the random bf16 K/V quantized with
per-tensor scales calibrated as amax / the format's largest value (FP8Inputs); sinkattn and vllm-triton read the FP8
caches with those scales, SDPA and flex run on the dequantized K/V (x.k, x.v), the same math, so their error column
checks sinkattn's FP8 path.

Timed callables do nothing but the call (no per-call warning filters: run.py silences the one-time
fallback and FlexAttention warnings around the whole grid). Every prepared comparator returns a callable
that is timed, the sink handling ("exact (native)",
"exact (lse correction)", "no sink", "none needed"), the backend that ran, and, for the error column,
its forward output (or dq for a backward) in (batch, seqlen_q, nheads, headdim) layout.
"""
from __future__ import annotations

import math
import warnings

import torch

from . import flops as _flops
from .grids import Case
from .peer_vllm import prep_case as prep_vllm_triton
from .prepared import Inputs, Prepared, Unsupported  # noqa: F401  (C.Unsupported etc. for run.py and the tests)
from dataclasses import dataclass

REF_MAX_FLOPS = 5e11  # the reference backend on a GPU loops over tiles in Python; time it only below this


# ---------------------------------------------------------------------------------------------- inputs

FP8_TYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


@dataclass
class FP8Inputs(Inputs):
    """A decode case over an FP8 cache: k_cache/v_cache are FP8, k/v their dequantized (q-dtype) copies."""
    k_scale: torch.Tensor | None = None     # float32 0-dim, as vLLM's layer._k_scale
    v_scale: torch.Tensor | None = None


def _to_fp8(x: Inputs, kv_dtype: str) -> FP8Inputs:
    fmt, dt = FP8_TYPES[kv_dtype], x.q.dtype
    big = torch.finfo(fmt).max
    ks, vs = x.k_cache.abs().amax().float() / big, x.v_cache.abs().amax().float() / big
    k8 = (x.k_cache.float() / ks).clamp_(-big, big).to(fmt)
    v8 = (x.v_cache.float() / vs).clamp_(-big, big).to(fmt)
    if x.block_table is not None:
        idx = x.block_table.long()
        b, per = idx.shape
        k = k8[idx].reshape(b, per * k8.shape[1], *k8.shape[2:])[:, :x.k.shape[1]]
        v = v8[idx].reshape(b, per * v8.shape[1], *v8.shape[2:])[:, :x.v.shape[1]]
    else:
        k, v = k8, v8
    return FP8Inputs(x.q, (k.float() * ks).to(dt), (v.float() * vs).to(dt), x.sinks, x.dout, k8, v8, x.block_table,
                     x.cache_seqlens, ks, vs)

def make_inputs(case: Case, device: torch.device, generator: torch.Generator | None = None) -> Inputs:
    """Random inputs (never zeros: they hide unwritten outputs and run faster than real data)."""
    dt = case.torch_dtype
    b, sq, sk, h, hk, d = case.batch, case.seqlen_q, case.seqlen_k, case.nheads, case.nheads_k, case.headdim

    def rnd(*shape):
        return torch.randn(*shape, device=device, dtype=torch.float32, generator=generator).to(dt)

    sinks = None
    if case.sinks:  # logits around the scores' scale, so the sink matters but does not dominate
        sinks = torch.randn(h, device=device, dtype=torch.float32, generator=generator) + 1.0
    q = rnd(b, sq, h, d)
    if case.kind == "decode":
        if case.paged:
            ps = case.page_size
            per_seq = -(-sk // ps)
            pages = b * per_seq
            k_cache, v_cache = rnd(pages, ps, hk, d), rnd(pages, ps, hk, d)
            perm = torch.randperm(pages, device="cpu", generator=None).to(torch.int32)
            block_table = perm.view(b, per_seq).to(device)
            # The same keys in contiguous form, for comparators without paging and for checking.
            idx = block_table.long()
            k = k_cache[idx].reshape(b, per_seq * ps, hk, d)[:, :sk]
            v = v_cache[idx].reshape(b, per_seq * ps, hk, d)[:, :sk]
        else:
            k_cache, v_cache, block_table = rnd(b, sk, hk, d), rnd(b, sk, hk, d), None
            k, v = k_cache, v_cache
        seqlens = torch.full((b,), sk, dtype=torch.int32, device=device)
        x = Inputs(q, k, v, sinks, None, k_cache, v_cache, block_table, seqlens)
        return _to_fp8(x, case.kv_dtype) if case.kv_dtype != "auto" else x
    k, v = rnd(b, sk, hk, d), rnd(b, sk, hk, d)
    dout = rnd(b, sq, h, d) if case.mode == "bwd" else None
    return Inputs(q, k, v, sinks, dout)


def add_sink(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Exact learnable-sink correction of an attention output computed without the sink.

    out (b, h, s, d) and lse (b, h, s) (natural log, over the visible keys) ->
    out * exp(lse) / (exp(lse) + exp(sink)) = out * sigmoid(lse - sink)."""
    ct = torch.promote_types(out.dtype, torch.float32)  # fp32 math for bf16/fp16, fp64 stays fp64
    w = torch.sigmoid(lse.to(ct) - sinks.to(ct).view(1, -1, 1))
    return (out.to(ct) * w[..., None]).to(out.dtype)


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2).contiguous()


def _leaf(x: torch.Tensor) -> torch.Tensor:
    return x.detach().clone().requires_grad_(True)


def _bwd_callable(out: torch.Tensor, inputs: tuple, dout: torch.Tensor):
    def run():
        return torch.autograd.grad(out, inputs, dout, retain_graph=True)
    return run


# ---------------------------------------------------------------------------------------------- sinkattn

def _resolve(case: Case, device: torch.device, requested: str) -> tuple[str, str | None]:
    """(backend dispatch picks for this case, and why the kernels declined when it is the reference)."""
    try:
        from sinkattn import dispatch
        from sinkattn._problem import Problem
        from sinkattn.mask import Mask
    except ImportError as e:
        return "unknown", f"sinkattn.dispatch not importable: {e}"
    kind = {"attn": case.mode, "decode": "kvcache"}[case.kind]
    mask = Mask(scale=case.headdim ** -0.5, window_left=case.window_left, window_right=case.window_right,
                sink_tokens=case.sink_tokens)
    problem = Problem(kind=kind, device_type=device.type, dtype=case.torch_dtype, headdim=case.headdim,
                      nheads=case.nheads, nheads_k=case.nheads_k, mask=mask, has_sinks=case.sinks, paged=case.paged,
                      deterministic=case.deterministic, device_index=device.index if device.type == "cuda" else None,
                      kv_fp8=case.kv_dtype != "auto")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            chosen = dispatch.choose(problem, requested)
        except Exception as e:  # noqa: BLE001 - a forced backend that cannot serve: report why
            raise Unsupported(str(e)) from None
    why = None
    if chosen == "reference" and requested == "auto" and device.type == "cuda":
        why = dispatch.declined_text(dispatch.plan(problem)[1])  # the reasons "auto" itself gives
    return chosen, why


def case_fwd_flops(case: Case) -> int:
    return _flops.attention_flops(case.batch, case.nheads, case.headdim, case.seqlen_q, case.seqlen_k,
                                  causal=case.causal, window_size=case.window_size, sink_tokens=case.sink_tokens)


def _sinkattn(case: Case, x: Inputs, device: torch.device, backend: str) -> Prepared:
    import sinkattn

    chosen, why = _resolve(case, device, backend)
    if chosen == "reference" and device.type == "cuda" and case_fwd_flops(case) > REF_MAX_FLOPS:
        raise Unsupported(f"only the reference backend serves this here ({why or 'forced'}), and it is too slow "
                          f"to time at this size (> {REF_MAX_FLOPS:.0e} FLOPs)")
    kw = dict(causal=case.causal, window_size=case.window_size, sink_tokens=case.sink_tokens, backend=backend)
    if case.deterministic:
        kw["deterministic"] = True
    note = f"kernels declined: {why}" if why else ""
    if case.kv_dtype != "auto":
        note = "; ".join(n for n in (_fp8_bytes_note(case), note) if n)
    graphable = device.type == "cuda" and chosen != "reference"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if case.kind == "decode":
            fkw = dict(kw, cache_seqlens=x.cache_seqlens, block_table=x.block_table)
            if isinstance(x, FP8Inputs):
                fkw.update(k_scale=x.k_scale, v_scale=x.v_scale)

            def run():
                return sinkattn.flash_attn_with_kvcache(x.q, x.k_cache, x.v_cache, x.sinks, **fkw)
            return Prepared(run, "exact (native)" if case.sinks else "none needed", chosen,
                            output=run, graphable=graphable, note=note)
        if case.mode == "fwd":
            def run():
                return sinkattn.flash_attn_with_sinks(x.q, x.k, x.v, x.sinks, **kw)
            return Prepared(run, "exact (native)" if case.sinks else "none needed", chosen,
                            output=run, graphable=graphable, note=note)
        q, k, v = _leaf(x.q), _leaf(x.k), _leaf(x.v)
        leaves = (q, k, v)
        s = None
        if x.sinks is not None:
            s = _leaf(x.sinks)
            leaves += (s,)
        out = sinkattn.flash_attn_with_sinks(q, k, v, s, **kw)
    run = _bwd_callable(out, leaves, x.dout)
    return Prepared(run, "exact (native)" if case.sinks else "none needed", chosen, output=lambda: run()[0],
                    graphable=False, note=note, keep=[out])


def _fp8_bytes_note(case: Case) -> str:
    """'' when run.py's byte count reads the FP8 cache at 1 byte per element; else a warning for the row."""
    from . import run as _run
    want = _flops.decode_bytes(case.batch, case.nheads, case.nheads_k, case.headdim, case.seqlen_k, elem_bytes=1,
                               seqlen_q=case.seqlen_q, causal=case.causal, window_size=case.window_size,
                               sink_tokens=case.sink_tokens)
    qo = 2 * case.batch * case.seqlen_q * case.nheads * case.headdim * (case.torch_dtype.itemsize - 1)
    if _run.case_counts(case)[1] == want + qo:
        return ""
    return "bytes/gbps count the FP8 cache at the query dtype's size (run.case_counts): halve the K/V part"


def prep_sinkattn(case, x, device):
    return _sinkattn(case, x, device, "auto")


def prep_sinkattn_sm80(case, x, device):
    if device.type != "cuda":
        raise Unsupported("needs a CUDA GPU")
    if torch.cuda.get_device_capability(device) != (9, 0):
        raise Unsupported("run only on a cc 9.0 GPU (elsewhere 'sinkattn' already is the sm80 path)")
    return _sinkattn(case, x, device, "sm80")


def prep_sinkattn_sm90(case, x, device):
    if device.type != "cuda":
        raise Unsupported("needs a CUDA GPU")
    if torch.cuda.get_device_capability(device) != (9, 0):
        raise Unsupported("run only on a cc 9.0 GPU")
    if case.kind != "attn" or case.mode != "bwd":
        raise Unsupported("backward cases only (the 'sinkattn' column runs the sm90 forward where it is faster)")
    return _sinkattn(case, x, device, "sm90")


SM86_SMEM = 99 * 1024  # the opt-in shared memory per block of cc 8.6 / 8.9 (A10, L4, RTX 3090/4090)


def _capped(fn, nbytes: int):
    """fn run under sinkattn's sm80 shared-memory cap (the cap is process-wide: set around each call only, so the
    other columns see the device's own limit). Costs a Python setter per call; CUDA graphs keep the tiles they were
    captured with."""
    if fn is None:
        return None
    import sinkattn

    def run():
        with sinkattn.sm80_smem_limit(nbytes):
            return fn()
    return run


def prep_sinkattn_sm80_99k(case, x, device):
    if device.type != "cuda":
        raise Unsupported("needs a CUDA GPU")
    if torch.cuda.get_device_capability(device) != (9, 0):
        raise Unsupported("run only on a cc 9.0 GPU (on cc 8.6/8.9 'sinkattn' already runs the 99 KB tiles)")
    import sinkattn

    with sinkattn.sm80_smem_limit(SM86_SMEM):
        prep = _sinkattn(case, x, device, "sm80")
    prep.fn, prep.output = _capped(prep.fn, SM86_SMEM), _capped(prep.output, SM86_SMEM)
    prep.note = "; ".join(n for n in ("sm80 tiles under a 99 KB shared-memory cap", prep.note) if n)
    return prep


def prep_reference(case, x, device):
    if device.type != "cuda":
        raise Unsupported("on the CPU the 'sinkattn' column already is the reference backend")
    if _resolve(case, device, "auto")[0] == "reference":
        raise Unsupported("no kernel serves this case, so the 'sinkattn' column already is the reference backend")
    if case_fwd_flops(case) > REF_MAX_FLOPS:
        raise Unsupported(f"too slow to time at this size (> {REF_MAX_FLOPS:.0e} FLOPs)")
    return _sinkattn(case, x, device, "reference")


# ---------------------------------------------------------------------------------------------- SDPA

def _sdpa_causal(case: Case) -> bool:
    """is_causal for SDPA (top-left alignment), when that equals the case's bottom-right mask."""
    if case.window_left >= 0:
        raise Unsupported("SDPA's flash backend has no sliding window")
    if case.window_right > 0:
        raise Unsupported("SDPA's flash backend has no right window")
    if case.window_right < 0:
        return False
    if case.seqlen_q == case.seqlen_k:
        return True
    if case.seqlen_q == 1:
        return False  # one query, bottom-right aligned: sees every key
    raise Unsupported("SDPA's is_causal aligns top-left; this case has seqlen_q != seqlen_k")


def _flash_fwd(q, k, v, is_causal: bool, scale: float):
    """aten's flash forward -> (out, lse) in (b, h, s, d) / (b, h, s)."""
    if q.is_cuda:
        r = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal, False, scale=scale)
    else:
        r = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, scale=scale)
    return r[0], r[1][..., :q.shape[2]]


def prep_sdpa(case: Case, x: Inputs, device: torch.device) -> Prepared:
    if case.kind == "decode" and case.paged:
        raise Unsupported("SDPA has no paged KV cache")
    is_causal = _sdpa_causal(case)
    scale = 1.0 / math.sqrt(case.headdim)
    q, k, v = _bhsd(x.q), _bhsd(x.k), _bhsd(x.v)
    g = case.nheads // case.nheads_k
    note = ""
    if case.mode == "fwd":
        try:
            _flash_fwd(q, k, v, is_causal, scale)
        except RuntimeError:
            if g == 1:
                raise
            k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
            note = "K/V expanded to nheads (the flash op took no GQA here)"
            _flash_fwd(q, k, v, is_causal, scale)
        if x.sinks is not None:
            sinks = x.sinks

            def run():
                o, lse = _flash_fwd(q, k, v, is_causal, scale)
                return add_sink(o, lse, sinks)
            handling = "exact (lse correction)"
        else:
            def run():
                return _flash_fwd(q, k, v, is_causal, scale)[0]
            handling = "none needed"
        return Prepared(run, handling, "flash", output=lambda: run().transpose(1, 2), graphable=True, note=note)
    # backward: the public API under the flash backend; its lse has no gradient, so no sink.
    from torch.nn.attention import SDPBackend, sdpa_kernel

    ql, kl, vl = _leaf(q), _leaf(k), _leaf(v)
    gqa = {}
    if g > 1:
        gqa = {"enable_gqa": True}
    try:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            out = torch.nn.functional.scaled_dot_product_attention(ql, kl, vl, is_causal=is_causal, scale=scale,
                                                                   **gqa)
    except RuntimeError:
        if g == 1:
            raise
        kl, vl = _leaf(k.repeat_interleave(g, 1)), _leaf(v.repeat_interleave(g, 1))
        note = "K/V expanded to nheads (flash took no GQA here)"
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            out = torch.nn.functional.scaled_dot_product_attention(ql, kl, vl, is_causal=is_causal, scale=scale)
    dout = _bhsd(x.dout)
    run = _bwd_callable(out, (ql, kl, vl), dout)
    handling = "no sink" if x.sinks is not None else "none needed"
    return Prepared(run, handling, "flash", output=lambda: run()[0].transpose(1, 2), note=note, keep=[out])


# ---------------------------------------------------------------------------------------------- FlexAttention

_FLEX_COMPILED = None


def _flex_fn(device: torch.device):
    global _FLEX_COMPILED
    from torch.nn.attention.flex_attention import flex_attention

    if device.type != "cuda":
        return flex_attention
    if _FLEX_COMPILED is None:
        import torch._dynamo

        # One compile per distinct shape/mask; a low cache limit would silently fall back to eager.
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 512)
        if hasattr(torch._dynamo.config, "accumulated_cache_size_limit"):
            torch._dynamo.config.accumulated_cache_size_limit = max(
                torch._dynamo.config.accumulated_cache_size_limit, 4096)
        _FLEX_COMPILED = torch.compile(flex_attention, dynamic=False)
    return _FLEX_COMPILED


def mask_mod_for(case: Case):
    """docs/DESIGN.md section 1's visibility as a FlexAttention mask_mod (bottom-right alignment)."""
    off, left, right, n = case.seqlen_k - case.seqlen_q, case.window_left, case.window_right, case.sink_tokens

    def mask_mod(b, h, q_idx, kv_idx):
        pos = q_idx + off
        ok = kv_idx >= 0  # a tensor True, so the terms below combine as tensors
        if right >= 0:
            ok = ok & (kv_idx <= pos + right)
        if left >= 0:
            ok = ok & ((kv_idx >= pos - left) | (kv_idx < n))
        return ok
    return mask_mod


def _flex_call(flex, q, k, v, block_mask, scale, gqa):
    try:
        from torch.nn.attention.flex_attention import AuxRequest
    except ImportError:  # torch < 2.9
        return flex(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa, return_lse=True)
    out, aux = flex(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa, return_aux=AuxRequest(lse=True))
    return out, aux.lse


def prep_flex(case: Case, x: Inputs, device: torch.device) -> Prepared:
    try:
        from torch.nn.attention.flex_attention import create_block_mask
    except ImportError as e:
        raise Unsupported(f"FlexAttention not in this torch: {e}") from None
    if case.kind == "decode" and case.paged:
        raise Unsupported("paged KV cache: not wired for FlexAttention here")
    if case.mode == "bwd" and device.type != "cuda":
        raise Unsupported("FlexAttention has no CPU backward")
    flex = _flex_fn(device)
    scale = 1.0 / math.sqrt(case.headdim)
    gqa = case.nheads != case.nheads_k
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = (mask_mod_for(case), None, None, case.seqlen_q, case.seqlen_k)
        try:  # _compile builds the block mask without materialising seqlen_q x seqlen_k (128k x 128k)
            block_mask = create_block_mask(*args, device=str(device), _compile=device.type == "cuda")
        except TypeError:
            block_mask = create_block_mask(*args, device=str(device))
    q, k, v = _bhsd(x.q), _bhsd(x.k), _bhsd(x.v)
    note = "" if device.type == "cuda" else "eager (unfused) on the CPU"
    sinks = x.sinks
    handling = "exact (lse correction)" if sinks is not None else "none needed"

    def fwd(q_, k_, v_, s_):
        out, lse = _flex_call(flex, q_, k_, v_, block_mask, scale, gqa)
        return add_sink(out, lse, s_) if s_ is not None else out

    if case.mode == "fwd":
        def run():
            return fwd(q, k, v, sinks)
        return Prepared(run, handling, "compiled" if device.type == "cuda" else "eager",
                        output=lambda: run().transpose(1, 2), graphable=False, note=note, keep=[block_mask])
    ql, kl, vl = _leaf(q), _leaf(k), _leaf(v)
    leaves = (ql, kl, vl)
    sl = None
    if sinks is not None:
        sl = _leaf(sinks)
        leaves += (sl,)
    out = fwd(ql, kl, vl, sl)
    run = _bwd_callable(out, leaves, _bhsd(x.dout))
    return Prepared(run, handling, "compiled", output=lambda: run()[0].transpose(1, 2), note=note,
                    keep=[out, block_mask])


COMPARATORS = {
    "sinkattn": prep_sinkattn,
    "sinkattn-sm80": prep_sinkattn_sm80,
    "sinkattn-sm90": prep_sinkattn_sm90,
    "sinkattn-sm80-99k": prep_sinkattn_sm80_99k,
    "reference": prep_reference,
    "sdpa-flash": prep_sdpa,
    "flex": prep_flex,
    "vllm-triton": prep_vllm_triton,
}
PRIMARY = "sinkattn"
