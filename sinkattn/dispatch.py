"""Backend choice (docs/DESIGN.md section 2) and the call into the chosen backend: the third layer of

    interface (validation) -> ops (torch.library custom ops, fake impls, autograd) -> dispatch (here)
        -> kernels (the _C bridge) | reference (PyTorch)

for every op: forward and varlen (`run_fwd`), backward (`run_bwd`) and KV cache (`run_kvcache`). Each run_*
describes the call as a Problem, chooses its backend once (`choose`), allocates the outputs and calls
kernels.launch_* or reference.attention_*.

"auto": CUDA tensors go to sm90 on cc 9.0 when it serves, else sm80 on cc >= 8.0 when it serves,
else the reference backend with a one-time warning per distinct reason; CPU tensors go to the
reference silently. A forced backend that cannot serve raises SinkattnRuntimeError saying why and
what would serve. "sm80-emulated" / "sm90-emulated" (the kernel bodies under host emulation) are never chosen by
"auto"; they exist for tests on CPU tensors.

Whether a kernel serves a call is `why_not`, the one place that decides it (the capability report and the
vLLM integration ask it too): it reads what each kernel serves from the binary's registry (registry.py:
features, head dims, dtypes, shared memory, archs) and the device's facts from _device.py, including the process's
cap on the shared memory the sm80 tile tables see (`sinkattn.sm80_smem_limit`, SINKATTN_SM80_MAX_SMEM), which every
sm80 launch below passes on as `max_smem`.
"""
from __future__ import annotations

import os

import torch

from . import _checks, _device, _ext, kernels, kvcache, reference, registry
from ._problem import Problem
from .errors import SinkattnValueError, warn_once
from .mask import Mask
from .layout import KERNEL_HEADDIMS, acc_dtype, kernel_headdim, lse_shape

_warned: set[str] = set()

# Forward windows shorter than this many keys run faster on the sm80 kernel on cc 9.0: each sm90 tile then
# visits 2 key blocks, and its per-tile latency (Q load, epilogue) dominates. Measured on an H200
# (bench/RESULTS.md): gpt-oss window (127, 0), hd64, 64/8 heads, 2 x 8192: sm80 53.9 TFLOP/s, sm90 44.6; at
# window 1024 (hd128) sm90 is 1.8x faster. The crossover between 128 and 1024 is not measured.
SM90_MIN_WINDOW = 128

# The sm90 backward (csrc/sm90/bwd_*) was written and compiled in a session without a GPU: "auto" keeps the
# backward on the sm80 kernel on cc 9.0 until a GPU run passes tests/test_gpu_sm90_backward.py on it (then set this
# True, with the run in bench/RESULTS.md).
SM90_BWD_VALIDATED = False

# The sm90 forward over KV caches (paged or not, the serving call's packed queries, split-KV;
# csrc/sm90/fwd_kernel.cuh) was written and emulation-tested in sessions without a GPU: "auto" keeps cache calls on
# the sm80 kernels on cc 9.0 until a GPU run passes tests/test_gpu_sm90_serving.py on it and the serving bench
# measures it beside them (then set this True, with the run in bench/RESULTS.md); backend="sm90" runs it.
SM90_CACHE_VALIDATED = False

# What a registry feature means to a user (the reason a kernel is refused names what the call needs).
_FEATURE_WORDS = {"sinks": "learnable sinks", "sink_tokens": "sink tokens", "causal": "causal masks",
                  "window": "sliding windows", "softcap": "softcap", "gqa": "GQA/MQA (fewer KV heads than query heads)",
                  "varlen": "variable-length (varlen) batches", "kvcache": "decode over a KV cache",
                  "paged": "a paged KV cache whose page size is not a multiple of 16 rows",
                  "paged16": "a paged KV cache (pages of a multiple of 16 rows)",
                  "deterministic": "a deterministic backward",
                  "fp8_kv": "FP8 KV caches (float8_e4m3fn / float8_e5m2)"}
_WHAT = {"fwd": "forward", "bwd": "backward", "kvcache": "decode (KV-cache)", "fwd_fp8": "FP8-cache decode"}


class ReferenceFallbackWarning(UserWarning):
    """A call on CUDA tensors ran on the (slow) PyTorch reference backend; the message says why."""


def _capability(device_index) -> tuple[int, int]:
    # A function of its own so tests can pretend to be a given GPU.
    return _device.capability(device_index or 0)


# ---- can this backend serve this call ----------------------------------------------------------------------
def why_not(backend: str, problem: Problem, capability: tuple[int, int] | None = None) -> str | None:
    """None when `backend` serves `problem`, else a reason a user can act on.

    `capability` overrides the device's (the report asks for each visible GPU, vLLM's selection for the one it
    plans for). The device's shared-memory limit is its own when it is a visible GPU of that capability, else
    _device's table for the capability."""
    if backend == "reference":
        return None
    if backend not in registry.KERNEL_BACKENDS:
        return f"unknown backend {backend!r}; kernel backends are {', '.join(registry.KERNEL_BACKENDS)}"
    emulated = backend in registry.EMULATED_BACKENDS
    # Device type first: on a CPU "needs CUDA tensors" is the actionable answer, whatever the build holds.
    if emulated and problem.device_type != "cpu":
        return f"{backend!r} runs on CPU tensors only; these are on {problem.device_type}"
    if not emulated and problem.device_type != "cuda":
        return f"{backend!r} needs CUDA tensors; these are on {problem.device_type}"
    if not _ext.loaded():
        return f"the compiled extension is not available ({_ext.IMPORT_ERROR})"
    if not emulated:
        if capability is None:
            capability = _capability(problem.device_index)
        reason = _device_gap(backend, capability)
        if reason is not None:
            return reason
    return _kernel_gap(backend, problem, None if emulated else capability)


def _device_gap(backend: str, capability: tuple[int, int]) -> str | None:
    if backend == "sm90" and capability != (9, 0):
        return f"backend 'sm90' needs a cc 9.0 GPU (this one is cc {capability[0]}.{capability[1]})"
    if backend == "sm90" and os.environ.get("SINKATTN_DISABLE_SM90") == "1":
        return "disabled by SINKATTN_DISABLE_SM90=1 (the sm80 kernels serve cc 9.0)"
    if backend == "sm80" and capability[0] < 8:
        return f"sinkattn kernels need cc >= 8.0 (this GPU is cc {capability[0]}.{capability[1]})"
    return None


def _kb(nbytes: int) -> str:
    return f"{round(nbytes / 1024, 1):g}"


def _kernel_gap(backend: str, problem: Problem, capability: tuple[int, int] | None) -> str | None:
    """Whether the registry holds a kernel of `backend` that serves `problem` and runs on `capability` (None:
    host emulation, no device)."""
    family = registry.BACKEND_FAMILY[backend]
    op, what = registry.op_of(problem, family), _WHAT.get(problem.kind)
    if what is None:
        return f"no {problem.kind} kernel is built yet for backend {backend!r}; the reference backend serves it"
    siblings = registry.kernels(family, op)
    if op == "bwd" and not siblings:
        if backend == "sm90":
            return "this build has no sm90 backward kernels (built without 90a); the sm80 backward serves cc 9.0"
        return f"no backward kernel is built yet for backend {backend!r}; the reference backend serves it"
    if not problem.positive_scale:
        # The online softmax takes its running max over the raw scores and masks with -inf: a scale <= 0 turns
        # that into NaN (measured on the emulated sm80 kernels: scale 0 and -0.125 gave NaN rows).
        return "the kernels take softmax_scale > 0; the reference backend serves softmax_scale <= 0"
    dtype = registry.dtype_name(problem.dtype)
    if dtype not in ("bf16", "fp16"):
        return f"kernels take bf16 or fp16 (got {problem.dtype}); the reference backend serves fp32"
    hd = kernel_headdim(problem.headdim)
    if hd is None or problem.headdim % 8 != 0:
        return (f"kernels serve head dims that are multiples of 8 up to {KERNEL_HEADDIMS[-1]} "
                f"(got {problem.headdim})")
    if op == "fwd_fp8" and problem.headdim % 16 != 0:
        return (f"the FP8-cache kernels read 16 codes per vector and need a head dim that is a multiple of 16 (got "
                f"{problem.headdim}); the reference backend serves it")
    kernel = registry.find(family, op, hd, dtype)
    # Features are the family's, but for what a tile's shape allows (the sm90 forward gathers small pages at head
    # dims 64 and 128, not 256): this head dim's kernel answers, a sibling only when it is missing.
    described = kernel or (siblings[0] if siblings else None)
    if described is not None:
        served = registry.features(described)
        missing = [f for f in registry.needed_features(problem) if f not in served]
        if missing:
            return (f"the {backend} {_WHAT[op]} kernels do not serve "
                    + " or ".join(_FEATURE_WORDS.get(f, f) for f in missing)
                    + f" (registry features of {described['name']}: {described['features']})")
    # A GPU backend's units may be a subset of the grid (SINKATTN_GPU_HEADDIMS / _DTYPES, CI's compile check):
    # a head dim and dtype the grid holds but the GPU subset left out is a rebuild away, not a missing family.
    in_grid = str(hd) in registry.requested("requested_headdims") and dtype in registry.requested("requested_dtypes")
    narrowed = backend not in registry.EMULATED_BACKENDS and in_grid and (
        str(hd) not in (registry.requested("gpu_headdims") or [str(hd)])
        or dtype not in (registry.requested("gpu_dtypes") or [dtype]))
    if kernel is None and narrowed:
        return (f"no {backend} {what} kernel for head dim {hd} {dtype} in this build: its GPU units were narrowed "
                f"to head dims {','.join(registry.requested('gpu_headdims'))} and dtypes "
                f"{','.join(registry.requested('gpu_dtypes'))}; rebuild without SINKATTN_GPU_HEADDIMS and "
                f"SINKATTN_GPU_DTYPES")
    if kernel is None and op == "fwd_fp8" and backend != "sm90":
        compiled = sorted({(k["headdim"], k["dtype"]) for k in siblings})
        tiled = registry.fp8_kv_headdims()
        if hd not in tiled:
            return (f"the {backend} FP8-cache decode kernels exist for head dims "
                    f"{', '.join(map(str, tiled))} only (got head dim {hd}); the reference backend serves it")
        return (f"no {backend} FP8-cache decode kernel for head dim {hd} {dtype} in this build (compiled: "
                f"{compiled or 'none'}); rebuild with SINKATTN_HEADDIMS including {hd} and SINKATTN_DTYPES "
                f"including {dtype}")
    if kernel is None:
        if in_grid:
            if backend in registry.EMULATED_BACKENDS:
                return "this build has no emulated kernels (it was built with SINKATTN_EMULATION=0)"
            if backend == "sm90" and op == "bwd":
                # The generator makes no unit for a head dim the tile table has none for (sm90/bwd_tiles.h).
                return (f"the sm90 backward has no tile for head dim {hd} (dK and dV would take all of a thread's "
                        f"registers); the sm80 backward serves it")
            # The grid asked for it and the generator still made none: the family does not exist yet.
            return (f"sinkattn has no {backend} {what} kernels yet"
                    + ("; the sm80 kernels serve cc 9.0" if backend == "sm90" else ""))
        compiled = sorted({(k["headdim"], k["dtype"]) for k in siblings})
        return (f"no {backend} {what} kernel for head dim {hd} {dtype} in this build (compiled: "
                f"{compiled or 'none'}); rebuild with SINKATTN_HEADDIMS including {hd} and SINKATTN_DTYPES "
                f"including {dtype}")
    # The process's cap on the sm80 kernels' limit (_device.sm80_smem_limit, SINKATTN_SM80_MAX_SMEM): where it is
    # below the device's limit it decides, as a device with that limit would; under host emulation it is the limit.
    cap = _device.sm80_smem_cap() if backend not in ("sm90", "sm90-emulated") else None
    if capability is None:
        if cap is not None and registry.smem_bytes(kernel) > cap.nbytes:
            return _smem_gap(backend, op, hd, kernel, cap, None, None)
        return None
    need, allowed = registry.smem_bytes(kernel), _device.smem_per_block_optin(capability, problem.device_index)
    if cap is not None and (allowed is None or cap.nbytes < allowed):
        if need > cap.nbytes:
            return _smem_gap(backend, op, hd, kernel, cap, capability, allowed)
    elif allowed is not None and need > allowed:
        return _smem_gap(backend, op, hd, kernel, None, capability, allowed)
    if registry.how_it_runs(kernel["archs"], capability) is None:
        return (f"the {backend} kernels in this build are compiled for {kernel['archs']}, none of which runs on "
                f"cc {capability[0]}.{capability[1]}; {registry.rebuild_hint(capability)}")
    return None


def _smem_gap(backend, op, hd, kernel, cap, capability, allowed) -> str:
    """Why `kernel` does not fit: under the sm80 cap (`cap`, else None) and/or the device's limit (`allowed`)."""
    reason = f"the {backend} {_WHAT[op]} for head dim {hd} needs {_kb(registry.smem_bytes(kernel))} KB of shared " \
             "memory per block; "
    cc = None if capability is None else f"cc {capability[0]}.{capability[1]}"
    if cap is not None:
        reason += f"the sm80 shared-memory cap {cap.source} allows {_kb(cap.nbytes)} KB"
        if allowed is not None:
            reason += f" ({cc} allows {_kb(allowed)} KB)"
    else:
        reason += f"{cc} allows {_kb(allowed)} KB"
    return reason + "; the reference backend serves it"


# ---- which backend runs the call ---------------------------------------------------------------------------
def preference_note(capability: tuple[int, int] | None, problem: Problem | None) -> dict[str, str]:
    """Backends "auto" ranks below the usual order for this problem, with why (the report prints it)."""
    if (capability == (9, 0) and problem is not None and problem.kind == "fwd"
            and problem.mask.left_window_under(SM90_MIN_WINDOW)):
        return {"sm90": (f"windows under {SM90_MIN_WINDOW} keys run faster on the sm80 kernel on cc 9.0 "
                         "(measured on an H200); backend='sm90' still forces it")}
    if capability == (9, 0) and problem is not None and problem.kind == "kvcache" and not SM90_CACHE_VALIDATED:
        return {"sm90": ("the sm90 forward over KV caches (decode, chunked prefill, the serving call) is compiled "
                         "and emulation-tested but has not yet run on a GPU (tests/test_gpu_sm90_serving.py checks "
                         "it against the oracle on the next one); until then the sm80 kernels serve cache calls on "
                         "cc 9.0; backend='sm90' forces it")}
    if capability == (9, 0) and problem is not None and problem.kind == "bwd" and not SM90_BWD_VALIDATED:
        return {"sm90": ("the sm90 backward is compiled but has not yet run on a GPU (tests/test_gpu_sm90_backward.py "
                         "checks it against the oracle on the next one); until then the sm80 backward serves "
                         "cc 9.0; backend='sm90' forces it")}
    return {}


def preferred_backends(capability: tuple[int, int] | None, problem: Problem | None = None) -> tuple[str, ...]:
    """The kernel backends "auto" tries, best first, for a CUDA device of this compute capability (and, when
    given, this problem: see `preference_note`)."""
    if capability is None:
        return ()
    if capability == (9, 0):
        return ("sm80", "sm90") if preference_note(capability, problem) else ("sm90", "sm80")
    if capability[0] >= 8:
        return ("sm80",)
    return ()


def _what_would_serve(problem: Problem, refused: str) -> str:
    others = [b for b in registry.KERNEL_BACKENDS if b != refused and why_not(b, problem) is None]
    return "What would serve: " + ", ".join(f"backend={b!r}" for b in others + ["reference"]) + \
        (" (the reference backend is slow)" if not others else "")


def _warn_once(reason: str) -> None:
    warn_once(_warned, f"sinkattn: using the PyTorch reference backend (slow): {reason}", ReferenceFallbackWarning,
              stacklevel=2)


def plan(problem: Problem, capability: tuple[int, int] | None = None) -> tuple[str, dict[str, str]]:
    """What "auto" runs `problem` on, and why each better kernel backend does not serve it: (backend, {backend:
    reason}). The one owner of the choice: the call path (`choose`), the capability report's serving paths and the
    vLLM backend's kernel check all read it. `capability`: the GPU to plan for (default: the problem's device).

    CPU tensors: the reference, nothing declined. A CUDA device: the first of `preferred_backends` that serves;
    declined holds the ones tried before it, and (first) the ones "auto" ranks below the usual order that were not
    chosen (`preference_note`), so a reader sees why a faster-looking kernel is not used; on a device no kernel runs
    on, {"kernels": why}."""
    if problem.device_type != "cuda":
        return "reference", {}
    if capability is None:
        capability = _capability(problem.device_index)
    candidates = preferred_backends(capability, problem)
    if not candidates:
        return "reference", {"kernels": f"sinkattn kernels need cc >= 8.0 (this GPU is cc {capability[0]}."
                                        f"{capability[1]})"}
    declined, chosen = {}, "reference"
    for backend in candidates:
        reason = why_not(backend, problem, capability=capability)
        if reason is None:
            chosen = backend
            break
        declined[backend] = reason
    lower = {backend: why_not(backend, problem, capability=capability) or note
             for backend, note in preference_note(capability, problem).items()
             if backend != chosen and backend not in declined}
    return chosen, {**lower, **declined}


def choose(problem: Problem, requested: str) -> str:
    """The backend that runs `problem` given backend=`requested`; "auto" falling back to the reference on CUDA
    tensors warns once per distinct reason."""
    if requested == "reference":
        return "reference"
    if requested != "auto":
        if requested not in registry.KERNEL_BACKENDS:
            raise SinkattnValueError(f"sinkattn: backend={requested!r} is not a kernel backend; accepted: "
                                     + ", ".join(repr(b) for b in ("auto", "reference", *registry.KERNEL_BACKENDS)))
        reason = why_not(requested, problem)
        if reason is not None:
            raise _checks.forced_backend_error(requested, reason, _what_would_serve(problem, requested))
        return requested
    chosen, declined = plan(problem)
    if chosen == "reference" and problem.device_type == "cuda":
        _warn_once(declined_text(declined))
    return chosen


def declined_text(declined: dict[str, str]) -> str:
    """plan's declined reasons as one line: "sm90: why; sm80: why" (a device no kernel runs on: just why)."""
    return "; ".join(why if backend == "kernels" else f"{backend}: {why}" for backend, why in declined.items())


def choose_backward(problem: Problem, requested: str) -> str:
    """Like `choose`, but a forced kernel backend without a backward kernel falls back (with a
    one-time warning) instead of raising: the forward already ran on it, and training should go on."""
    if requested in ("auto", "reference"):
        return choose(problem, requested)
    reason = why_not(requested, problem)
    if reason is None:
        return requested
    _warn_once(f"backward of backend={requested!r}: {reason}")
    return "reference"


# ---- the op bodies -------------------------------------------------------------------------------------------
def _reference_anyway(q, backend: str) -> bool:
    """What `choose` answers without looking at the problem: backend="reference", or "auto" on tensors that are
    not CUDA tensors. The op bodies skip building the Problem then (a few microseconds of a CPU decode step)."""
    return backend == "reference" or (backend == "auto" and q.device.type != "cuda")


def run_fwd(q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, mask: Mask, deterministic,
            backend, need_lse=True):
    """Body of the sinkattn::fwd op (plain and varlen) -> (out, lse); need_lse=False (ops.call_fwd's direct path,
    when the caller drops lse) lets the reference return lse None."""
    varlen = cu_seqlens_q is not None
    if _reference_anyway(q, backend):
        chosen = "reference"
    else:
        chosen = choose(Problem.of_call("fwd", q, k, sinks, mask, varlen=varlen, deterministic=deterministic), backend)
    if varlen and _checks.value_checks_on(cu_seqlens_q):
        _checks.check_cu_seqlens_values(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], max_seqlen_q,
                                        max_seqlen_k)
    if chosen == "reference":
        return reference.attention_fwd(q, k, v, sinks, mask, cu_seqlens_q, cu_seqlens_k, need_lse)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(lse_shape(q, varlen), dtype=torch.float32, device=q.device)
    kernels.launch_fwd(chosen, q, k, v, sinks, out, lse, mask, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                       max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, max_smem=_device.sm80_max_smem(chosen))
    if varlen:
        _clear_tail_rows(out, lse, cu_seqlens_q)
    return out, lse


def _clear_tail_rows(out, lse, cu_seqlens_q) -> None:
    """Rows past cu_seqlens_q[-1] belong to no sequence: the kernels never write them, the contract says out 0 and
    lse -inf (as the reference gives). Read the end on the host when that is allowed (the value checks read
    cu_seqlens already); under CUDA-graph capture, a device-side mask instead (no host read)."""
    if _checks.value_checks_on(cu_seqlens_q):
        end = int(cu_seqlens_q[-1])
        if end < out.shape[0]:
            out[end:].zero_()
            lse[:, end:] = float("-inf")
        return
    tail = torch.arange(out.shape[0], device=out.device) >= cu_seqlens_q[-1]
    out.masked_fill_(tail[:, None, None], 0)
    lse.masked_fill_(tail[None, :], float("-inf"))


def run_bwd(dout, dlse, q, k, v, sinks, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
            mask: Mask, deterministic, backend):
    """Body of the sinkattn::bwd op -> (dq, dk, dv, dsinks); dsinks is zeros without sinks."""
    if _reference_anyway(q, backend):
        chosen = "reference"
    else:
        chosen = choose_backward(Problem.of_call("bwd", q, k, sinks, mask, varlen=cu_seqlens_q is not None,
                                                 deterministic=deterministic), backend)
    sink_dtype = sinks.dtype if sinks is not None else acc_dtype(q.dtype)
    if chosen == "reference":
        dq, dk, dv, dsinks = reference.attention_bwd(dout, dlse, q, k, v, sinks, out, lse, mask, cu_seqlens_q,
                                                     cu_seqlens_k)
        return dq, dk, dv, dsinks.to(sink_dtype)
    dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    dsinks = torch.empty((q.shape[-2],), dtype=torch.float32, device=q.device) if sinks is not None else None
    kernels.launch_bwd(chosen, dout.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), sinks,
                       out.contiguous(), lse.contiguous(), None if dlse is None else dlse.contiguous(),
                       dq, dk, dv, dsinks, mask, deterministic=deterministic, cu_seqlens_q=cu_seqlens_q,
                       cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                       max_smem=_device.sm80_max_smem(chosen))
    if dsinks is None:
        dsinks = torch.zeros((q.shape[-2],), dtype=sink_dtype, device=q.device)
    return dq, dk, dv, dsinks.to(sink_dtype)


def _cache_backend(q, k_cache, sinks, mask: Mask, block_table, backend: str) -> str:
    """The backend of a call over a KV cache (both the padded and the serving form)."""
    if _reference_anyway(q, backend):
        return "reference"
    return choose(Problem.of_call("kvcache", q, k_cache, sinks, mask, paged=block_table is not None), backend)


def run_kvcache(q, k_cache, v_cache, sinks, k, v, cache_seqlens, block_table, rotary_cos, rotary_sin,
                rotary_interleaved, mask: Mask, num_splits, backend, k_descale=None, v_descale=None,
                cu_seqlens_q=None, max_seqlen_q=0):
    """Body of the sinkattn::kvcache_fwd op -> (out, lse): rotary and the append (kvcache.prepare), then
    attention over the cache on the chosen backend. cu_seqlens_q: packed queries over a cache that holds every
    key (the serving form): one kernel launch for the batch, nothing read on the host past the value checks."""
    chosen = _cache_backend(q, k_cache, sinks, mask, block_table, backend)
    descales = None if k_descale is None else (k_descale, v_descale)
    if cu_seqlens_q is not None:
        return _serve(chosen, q, k_cache, v_cache, sinks, cache_seqlens, block_table, cu_seqlens_q, max_seqlen_q,
                      mask, num_splits, descales)
    q, seqlens_k = kvcache.prepare(q, k_cache, v_cache, k, v, cache_seqlens, block_table, rotary_cos, rotary_sin,
                                   rotary_interleaved, descales)
    if chosen == "reference":
        return reference.attention_kvcache(q, k_cache, v_cache, sinks, seqlens_k, block_table, mask, descales)
    if isinstance(seqlens_k, list):  # CPU tensors (sm80-emulated): prepare read the lengths on the host
        seqlens_k = torch.tensor(seqlens_k, dtype=torch.int32, device=q.device)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(lse_shape(q, False), dtype=torch.float32, device=q.device)
    kernels.launch_kvcache(chosen, q.contiguous(), k_cache, v_cache, sinks, out, lse, cache_seqlens=seqlens_k,
                           block_table=block_table, mask=mask, num_splits=num_splits,
                           max_smem=_device.sm80_max_smem(chosen), k_descale=k_descale, v_descale=v_descale)
    return out, lse


def run_kvcache_serving(q, k_cache, v_cache, sinks, seqused_k, block_table, cu_seqlens_q, max_seqlen_q: int,
                        mask: Mask, backend: str = "auto", descales=None, num_splits: int = 0, out=None,
                        check_values: bool = True):
    """The serving call (varlen queries over a cache that holds every key; run_kvcache's cu_seqlens_q form), for
    callers that own their output buffer and their metadata (sinkattn's vLLM backend): out (total_q, h, d) is
    written in place (rows past cu_seqlens_q[-1] untouched) and returned with lse (h, total_q; -inf on those
    rows). check_values=False skips the value checks, which read index tensors on the host (a device
    synchronisation per call)."""
    chosen = _cache_backend(q, k_cache, sinks, mask, block_table, backend)
    return _serve(chosen, q, k_cache, v_cache, sinks, seqused_k, block_table, cu_seqlens_q, max_seqlen_q, mask,
                  num_splits, descales, out, check_values)


def _serve(chosen, q, k_cache, v_cache, sinks, seqused_k, block_table, cu_seqlens_q, max_seqlen_q, mask: Mask,
           num_splits, descales, out=None, check_values=True):
    """One launch of the serving call on `chosen` -> (out, lse). Without `out`, rows past cu_seqlens_q[-1] get out 0
    and lse -inf (the kernel leaves them)."""
    if check_values:
        kvcache.check_varlen_values(q, k_cache, seqused_k, block_table, cu_seqlens_q)
    if chosen == "reference":
        res, lse = reference.attention_kvcache_varlen(q, k_cache, v_cache, sinks, seqused_k, block_table,
                                                      cu_seqlens_q, mask, descales)
        if out is None:
            return res, lse
        return out.copy_(res), lse
    if out is None:
        out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.full(lse_shape(q, True), float("-inf"), dtype=torch.float32, device=q.device)
    kernels.launch_kvcache(chosen, q, k_cache, v_cache, sinks, out, lse, cache_seqlens=seqused_k,
                           block_table=block_table, mask=mask, num_splits=num_splits,
                           max_smem=_device.sm80_max_smem(chosen), k_descale=None if descales is None else descales[0],
                           v_descale=None if descales is None else descales[1], cu_seqlens_q=cu_seqlens_q,
                           max_seqlen_q=max_seqlen_q)
    return out, lse
