"""Backend choice (DESIGN.md section 2) and the calls into the chosen backend.

"auto": CUDA tensors go to sm90 on cc 9.0 when it serves, else sm80 on cc >= 8.0 when it serves,
else the reference backend with a one-time warning per distinct reason; CPU tensors go to the
reference silently. A forced backend that cannot serve raises SinkattnRuntimeError saying why and
what would serve. "sm80-emulated" (the sm80 kernel body under host emulation) is never chosen by
"auto"; it exists for tests on CPU tensors.

Kernel extension points in sinkattn._kernels (each guarded: a missing one means "not served"):

    forward(backend, q, k, v, sinks, out, lse, *, softmax_scale, window_left, window_right,
            sink_tokens, softcap, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0,
            max_seqlen_k=0) -> None
        Problem.kind == "fwd". Writes out (like q, contiguous) and lse (fp32, (b, h, sq) or
        (h, total_q) for varlen) in place.
    backward(backend, dout, q, k, v, sinks, out, lse, dlse, dq, dk, dv, dsinks, *, softmax_scale,
             window_left, window_right, sink_tokens, softcap, deterministic, cu_seqlens_q=None,
             cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0) -> None
        Problem.kind == "bwd". dout/out/q/k/v contiguous; dlse fp32 like lse or None (lse unused);
        writes dq, dk, dv (preallocated like q, k, v; dk/dv summed over the query-head group) and
        dsinks (fp32 (nheads,), or None without sinks) in place.
    kvcache_forward(backend, q, k_cache, v_cache, sinks, out, lse, *, cache_seqlens, block_table,
                    softmax_scale, window_left, window_right, sink_tokens, softcap, num_splits) -> None
        Problem.kind == "kvcache". Attention over the cache only: q is already rotated and the new
        k/v already appended by sinkattn.kvcache; cache_seqlens (int32) counts the keys to attend to.
"""
from __future__ import annotations

import os

import warnings

import torch

from . import _device, _kernels, reference
from ._checks import check_cu_seqlens_values, forced_backend_error
from ._problem import Problem
from .errors import SinkattnValueError

_ENTRY_POINT = {"fwd": "forward", "bwd": "backward", "kvcache": "kvcache_forward"}
_warned: set[str] = set()


class ReferenceFallbackWarning(UserWarning):
    """A call on CUDA tensors ran on the (slow) PyTorch reference backend; the message says why."""


def make_problem(kind: str, q, k, sinks, *, window_left: int, window_right: int, sink_tokens: int,
                 softcap: float, varlen: bool = False, paged: bool = False,
                 deterministic: bool = False) -> Problem:
    return Problem(kind=kind, device_type=q.device.type, dtype=q.dtype, headdim=q.shape[-1],
                   headdim_v=q.shape[-1], nheads=q.shape[-2], nheads_k=k.shape[-2],
                   window_left=window_left, window_right=window_right, sink_tokens=sink_tokens,
                   softcap=softcap, has_sinks=sinks is not None, varlen=varlen, paged=paged,
                   deterministic=deterministic, device_index=q.device.index)


def _capability(device_index) -> tuple[int, int]:
    # A function of its own so tests can pretend to be a given GPU.
    return _device.capability(device_index or 0)


def why_not(backend: str, problem: Problem) -> str | None:
    """None when `backend` serves `problem`, else a reason a user can act on."""
    if backend == "reference":
        return None
    # Device type first: on a CPU "needs CUDA tensors" is the actionable answer, whatever the build holds.
    if backend == "sm80-emulated" and problem.device_type != "cpu":
        return f"'sm80-emulated' runs on CPU tensors only; these are on {problem.device_type}"
    if backend != "sm80-emulated" and problem.device_type != "cuda":
        return f"{backend!r} needs CUDA tensors; these are on {problem.device_type}"
    entry = _ENTRY_POINT[problem.kind]
    if not hasattr(_kernels, entry):
        return f"this build has no {problem.kind} kernel entry point (sinkattn._kernels.{entry})"
    cap = _capability(problem.device_index) if problem.device_type == "cuda" else None
    return _kernels.why_not(backend, problem, capability=cap)


def _what_would_serve(problem: Problem, refused: str) -> str:
    others = [b for b in _kernels.KERNEL_BACKENDS if b != refused and why_not(b, problem) is None]
    return "What would serve: " + ", ".join(f"backend={b!r}" for b in others + ["reference"]) + \
        (" (the reference backend is slow)" if not others else "")


def _warn_once(reason: str) -> None:
    if reason in _warned:
        return
    _warned.add(reason)
    warnings.warn(f"sinkattn: using the PyTorch reference backend (slow): {reason}",
                  ReferenceFallbackWarning, stacklevel=2)


def choose(problem: Problem, requested: str) -> str:
    """The backend that runs `problem` given backend=`requested`."""
    if requested == "reference":
        return "reference"
    if requested != "auto":
        if requested not in _kernels.KERNEL_BACKENDS:
            raise SinkattnValueError(f"sinkattn: backend={requested!r} is not a kernel backend; accepted: "
                                     + ", ".join(repr(b) for b in ("auto", "reference", *_kernels.KERNEL_BACKENDS)))
        reason = why_not(requested, problem)
        if reason is not None:
            raise forced_backend_error(requested, reason, _what_would_serve(problem, requested))
        return requested
    if problem.device_type != "cuda":
        return "reference"
    cap = _capability(problem.device_index)
    candidates = _kernels.preferred_backends(cap, problem)
    reasons = [] if candidates else [f"no sinkattn kernel runs on compute capability {cap[0]}.{cap[1]} (needs >= 8.0)"]
    for backend in candidates:
        reason = why_not(backend, problem)
        if reason is None:
            return backend
        reasons.append(f"{backend}: {reason}")
    _warn_once("; ".join(reasons))
    return "reference"


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


def _mask(softmax_scale, window_left, window_right, sink_tokens, softcap) -> reference.Mask:
    return reference.Mask(softmax_scale, window_left, window_right, sink_tokens, softcap)


def _capturing(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def check_values(t: torch.Tensor) -> bool:
    """Whether to read index tensors (cu_seqlens, cache_seqlens, block_table) to validate them. Each read
    synchronises with a CUDA device (a host round trip on every eager decode step), so: not while a CUDA graph
    is captured, and not with SINKATTN_VALUE_CHECKS=0 (then invalid values are not caught: the
    kernels read and write where they point)."""
    return os.environ.get("SINKATTN_VALUE_CHECKS", "1") != "0" and not _capturing(t)


def forward(q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
            window_left, window_right, sink_tokens, softcap, deterministic, backend):
    """Body of the sinkattn::fwd op -> (out, lse)."""
    varlen = cu_seqlens_q is not None
    problem = make_problem("fwd", q, k, sinks, window_left=window_left, window_right=window_right,
                           sink_tokens=sink_tokens, softcap=softcap, varlen=varlen,
                           deterministic=deterministic)
    chosen = choose(problem, backend)
    if varlen and check_values(cu_seqlens_q):
        check_cu_seqlens_values(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], max_seqlen_q, max_seqlen_k)
    if chosen == "reference":
        return reference.forward(q, k, v, sinks, _mask(softmax_scale, window_left, window_right, sink_tokens, softcap),
                                 cu_seqlens_q, cu_seqlens_k)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse_shape = (q.shape[1], q.shape[0]) if varlen else (q.shape[0], q.shape[2], q.shape[1])
    lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device)
    _kernels.forward(chosen, q, k, v, sinks, out, lse, softmax_scale=softmax_scale, window_left=window_left,
                     window_right=window_right, sink_tokens=sink_tokens, softcap=softcap,
                     cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                     max_seqlen_k=max_seqlen_k)
    if varlen:
        _clear_tail_rows(out, lse, cu_seqlens_q)
    return out, lse


def _clear_tail_rows(out, lse, cu_seqlens_q) -> None:
    """Rows past cu_seqlens_q[-1] belong to no sequence: the kernels never write them, the contract says out 0 and
    lse -inf (as the reference gives). Read the end on the host when that is allowed (the value checks read
    cu_seqlens already); under CUDA-graph capture, a device-side mask instead (no host read)."""
    if check_values(cu_seqlens_q):
        end = int(cu_seqlens_q[-1])
        if end < out.shape[0]:
            out[end:].zero_()
            lse[:, end:] = float("-inf")
        return
    tail = torch.arange(out.shape[0], device=out.device) >= cu_seqlens_q[-1]
    out.masked_fill_(tail[:, None, None], 0)
    lse.masked_fill_(tail[None, :], float("-inf"))


def backward(dout, dlse, q, k, v, sinks, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
             softmax_scale, window_left, window_right, sink_tokens, softcap, deterministic, backend):
    """Body of the sinkattn::bwd op -> (dq, dk, dv, dsinks); dsinks is zeros without sinks."""
    problem = make_problem("bwd", q, k, sinks, window_left=window_left, window_right=window_right,
                           sink_tokens=sink_tokens, softcap=softcap, varlen=cu_seqlens_q is not None,
                           deterministic=deterministic)
    chosen = choose_backward(problem, backend)
    sink_dtype = sinks.dtype if sinks is not None else reference.acc_dtype(q.dtype)
    if chosen == "reference":
        dq, dk, dv, dsinks = reference.backward(
            dout, dlse, q, k, v, sinks, out, lse,
            _mask(softmax_scale, window_left, window_right, sink_tokens, softcap), cu_seqlens_q, cu_seqlens_k)
        return dq, dk, dv, dsinks.to(sink_dtype)
    dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    dsinks = torch.empty((q.shape[-2],), dtype=torch.float32, device=q.device) if sinks is not None else None
    _kernels.backward(chosen, dout.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), sinks,
                      out.contiguous(), lse.contiguous(), None if dlse is None else dlse.contiguous(),
                      dq, dk, dv, dsinks, softmax_scale=softmax_scale, window_left=window_left,
                      window_right=window_right, sink_tokens=sink_tokens, softcap=softcap,
                      deterministic=deterministic, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                      max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
    if dsinks is None:
        dsinks = torch.zeros((q.shape[-2],), dtype=sink_dtype, device=q.device)
    return dq, dk, dv, dsinks.to(sink_dtype)
