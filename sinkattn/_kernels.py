"""Bridge between dispatch and the compiled kernels in sinkattn._C.

Backends here: "sm90", "sm80" (CUDA tensors) and "sm80-emulated" (the sm80 kernel body run on the CPU
under host emulation, for tests). Dispatch asks `why_not(backend, problem)`; None means the backend
serves the problem, otherwise the string says why not and what would. The capability report asks the
same function, so what it prints is what dispatch does.
"""
from __future__ import annotations

import os

import torch

from . import _device, _ext
from ._problem import Problem
from .errors import SinkattnRuntimeError

KERNEL_BACKENDS = ("sm90", "sm80", "sm80-emulated")
COMPILED_HEADDIMS = (64, 128, 256)
DTYPE_NAMES = {"torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float32": "fp32"}
BIG_SMEM_CAPABILITIES = ((8, 0), (8, 7), (9, 0))  # >= 163 KB of shared memory per block
BACKEND_FAMILY = {"sm90": "sm90", "sm80": "sm80", "sm80-emulated": "sm80-emulated"}


# Forward windows shorter than this many keys run faster on the sm80 kernel on cc 9.0: each sm90 tile then
# visits 2 key blocks, and its per-tile latency (Q load, epilogue) dominates. Measured on an H200
# (bench/RESULTS.md): gpt-oss window (127, 0), hd64, 64/8 heads, 2 x 8192: sm80 53.9 TFLOP/s, sm90 44.6; at
# window 1024 (hd128) sm90 is 1.8x faster. The crossover between 128 and 1024 is not measured.
SM90_MIN_WINDOW = 128


def preference_note(capability: tuple[int, int] | None, problem: Problem | None) -> dict[str, str]:
    """Backends "auto" ranks below the usual order for this problem, with why (the report prints it)."""
    if (capability == (9, 0) and problem is not None and problem.kind == "fwd"
            and 0 <= problem.window_left < SM90_MIN_WINDOW):
        return {"sm90": (f"windows under {SM90_MIN_WINDOW} keys run faster on the sm80 kernel on cc 9.0 "
                         "(measured on an H200); backend='sm90' still forces it")}
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


def sass_runs_on(arch: str, capability: tuple[int, int]) -> bool:
    """Whether SASS compiled for `arch` ("sm_86", "sm_90a") loads on a device of this capability.

    SASS is compatible within a major version, upward in minor; arch-specific targets (sm_90a) run only
    on exactly their capability."""
    if not arch.startswith("sm_"):
        return False
    digits = arch[3:].rstrip("af")
    major, minor = int(digits[:-1]), int(digits[-1])
    if arch[3:] != digits:
        return (major, minor) == capability
    return major == capability[0] and minor <= capability[1]


def ptx_runs_on(arch: str, capability: tuple[int, int]) -> bool:
    """Whether embedded PTX for `arch` ("compute_80") can be JIT-compiled for this capability (any newer GPU)."""
    if not arch.startswith("compute_") or not arch[8:].isdigit():
        return False
    digits = arch[8:]
    return (int(digits[:-1]), int(digits[-1])) <= tuple(capability)


def how_it_runs(archs: str, capability: tuple[int, int]) -> str | None:
    """How a kernel compiled for `archs` (the registry's comma list) runs on this capability, or None."""
    codes = archs.split(",")
    for a in codes:
        if sass_runs_on(a, capability):
            return f"native {a} code"
    for a in codes:
        if ptx_runs_on(a, capability):
            return f"{a} PTX, JIT-compiled by the driver at first use"
    return None


def served_headdim(headdim: int) -> int | None:
    for h in COMPILED_HEADDIMS:
        if headdim <= h:
            return h
    return None


def _find(family: str, op: str, headdim: int, dtype: str):
    for k in _ext.registry():
        if k["family"] == family and k["op"] == op and k["headdim"] == headdim and k["dtype"] == dtype:
            return k
    return None


def _rebuild_hint(capability) -> str:
    if capability is None:
        return ""
    major, minor = capability
    arch = {8: "80", 9: "90a", 10: "100", 12: "120"}.get(major)
    if arch is None:
        return f"no sinkattn build targets cc {major}.{minor}"
    return f"rebuild with SINKATTN_CUDA_ARCHS={arch}"


def _requested(key: str) -> list[str]:
    info = _ext.build_info() or {}
    return [x for x in str(info.get(key, "")).replace(";", ",").split(",") if x]


def why_not(backend: str, problem: Problem, capability: tuple[int, int] | None = None) -> str | None:
    """None when `backend` serves `problem`; otherwise the reason and what would serve it.

    `capability` overrides the device's (the report uses it for each visible GPU)."""
    if backend not in KERNEL_BACKENDS:
        return f"unknown backend {backend!r}; kernel backends are {', '.join(KERNEL_BACKENDS)}"
    if not _ext.loaded():
        return f"the compiled extension is not available ({_ext.IMPORT_ERROR})"
    emulated = backend == "sm80-emulated"
    if emulated and problem.device_type != "cpu":
        return "backend 'sm80-emulated' runs the sm80 kernel on the CPU and takes CPU tensors only"
    if not emulated:
        if problem.device_type != "cuda":
            return f"backend {backend!r} needs CUDA tensors (got {problem.device_type}); use 'reference' on the CPU"
        if capability is None:
            capability = _device.capability(problem.device_index or 0)
        if backend == "sm90" and capability != (9, 0):
            return f"backend 'sm90' needs a cc 9.0 GPU (this one is cc {capability[0]}.{capability[1]})"
        if backend == "sm90" and os.environ.get("SINKATTN_DISABLE_SM90") == "1":
            return "disabled by SINKATTN_DISABLE_SM90=1 (the sm80 kernels serve cc 9.0)"
        if backend == "sm80" and capability[0] < 8:
            return f"sinkattn kernels need cc >= 8.0 (this GPU is cc {capability[0]}.{capability[1]})"
    op = "bwd" if problem.kind == "bwd" else "fwd"
    if backend == "sm90" and problem.kind == "kvcache":
        return ("the sm90 kernel serves attention over q/k/v tensors; decode and KV caches (seqused_k, paged, "
                "split-KV) run on the sm80 kernel")
    if problem.kind not in ("fwd", "kvcache", "bwd"):
        return f"no {problem.kind} kernel is built yet for backend {backend!r}; the reference backend serves it"
    if problem.kind == "bwd" and not any(k["family"] == BACKEND_FAMILY[backend] and k["op"] == "bwd"
                                         for k in _ext.registry()):
        if backend == "sm90":
            return "sinkattn has no sm90 backward kernels yet; the sm80 backward serves cc 9.0"
        return f"no backward kernel is built yet for backend {backend!r}; the reference backend serves it"
    dtype = DTYPE_NAMES.get(str(problem.dtype))
    if dtype not in ("bf16", "fp16"):
        return f"kernels take bf16 or fp16 (got {problem.dtype}); the reference backend serves fp32"
    if problem.headdim != problem.headdim_v:
        return f"kernels need equal q/k and v head dims (got {problem.headdim} and {problem.headdim_v})"
    hd = served_headdim(problem.headdim)
    if hd is None or problem.headdim % 8 != 0:
        return (f"kernels serve head dims that are multiples of 8 up to {COMPILED_HEADDIMS[-1]} "
                f"(got {problem.headdim})")
    kernel = _find(BACKEND_FAMILY[backend], op, hd, dtype)
    if kernel is None and op == "bwd":
        compiled = sorted({(k["headdim"], k["dtype"]) for k in _ext.registry()
                           if k["family"] == BACKEND_FAMILY[backend] and k["op"] == "bwd"})
        return (f"no {backend} backward kernel for head dim {hd} {dtype} in this build (compiled: {compiled}); "
                f"rebuild with SINKATTN_HEADDIMS including {hd} and SINKATTN_DTYPES including {dtype}")
    if kernel is None:
        if str(hd) in _requested("requested_headdims") and dtype in _requested("requested_dtypes"):
            if emulated:
                return "this build has no emulated kernels (it was built with SINKATTN_EMULATION=0)"
            # The grid asked for it and the generator still made none: the family does not exist yet.
            what = "decode (KV-cache)" if problem.kind == "kvcache" else "forward"
            return (f"sinkattn has no {backend} {what} kernels yet"
                    + ("; the sm80 kernels serve cc 9.0" if backend == "sm90" else ""))
        compiled = sorted({(k["headdim"], k["dtype"]) for k in _ext.registry()
                           if k["family"] == BACKEND_FAMILY[backend] and k["op"] == "fwd"})
        return (f"no {backend} forward kernel for head dim {hd} {dtype} in this build (compiled: "
                f"{compiled or 'none'}); rebuild with SINKATTN_HEADDIMS including {hd} and SINKATTN_DTYPES "
                f"including {dtype}")
    if (op == "bwd" and hd == 256 and not emulated and capability[0] < 10
            and capability not in BIG_SMEM_CAPABILITIES):
        return (f"the sm80 backward for head dim 256 needs 144 KB of shared memory per block (cc 8.0, 8.7, 9.0, "
                f"10.x); cc {capability[0]}.{capability[1]} has 99 KB; the reference backend serves it")
    if not emulated and how_it_runs(kernel["archs"], capability) is None:
        return (f"the {backend} kernels in this build are compiled for {kernel['archs']}, none of which runs on "
                f"cc {capability[0]}.{capability[1]}; {_rebuild_hint(capability)}")
    return None


def served_by(backend: str, problem: Problem, capability: tuple[int, int] | None) -> str:
    """Which compiled kernel serves `problem` on `backend` and how it runs (for the report)."""
    kernel = _find(BACKEND_FAMILY[backend], "bwd" if problem.kind == "bwd" else "fwd", served_headdim(problem.headdim) or 0,
                   DTYPE_NAMES.get(str(problem.dtype), ""))
    if kernel is None:
        return backend
    how = "host emulation" if capability is None else how_it_runs(kernel["archs"], capability)
    return f"{kernel['name']} ({how})"


def merge_kernel_runs(dtype, device_index: int) -> bool:
    """Whether a compiled merge kernel of this dtype can run on this CUDA device."""
    name = DTYPE_NAMES.get(str(dtype))
    kernel = next((k for k in _ext.registry() if k["op"] == "merge" and k["dtype"] == name), None)
    return kernel is not None and how_it_runs(kernel["archs"], _device.capability(device_index)) is not None


def forward(backend: str, q, k, v, sinks, out, lse, *, softmax_scale: float, window_left: int,
            window_right: int, sink_tokens: int, softcap: float,
            cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q: int = 0, max_seqlen_k: int = 0,
            max_smem: int = 0) -> None:
    """Run the forward kernel of `backend`, writing `out` (like q) and `lse` (fp32) in place.

    q (b, sq, h, d) and k/v (b, sk, hk, d), or packed (total, h, d) with cu_seqlens when varlen; the caller
    has validated shapes and checked `why_not` first. `max_smem` overrides the shared-memory limit that picks
    the tile configuration (tests use it to run the sm86 configuration under emulation)."""
    C = _ext.require()
    # The sm90 kernel reads q/k/v through TMA descriptors, which take no zero (broadcast) strides.
    tma = backend == "sm90"
    q, k, v = (t if _aligned(t) and not (tma and _broadcast(t)) else t.contiguous() for t in (q, k, v))
    target = out if _aligned(out) else torch.empty_like(out, memory_format=torch.contiguous_format)
    cu_seqlens_q, cu_seqlens_k = _dense_index(cu_seqlens_q), _dense_index(cu_seqlens_k)
    C.fwd(backend, q, k, v, sinks, target, lse, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k),
          float(softmax_scale), int(window_left), int(window_right), int(sink_tokens), float(softcap), int(max_smem))
    if target is not out:
        out.copy_(target)


def backward(backend: str, dout, q, k, v, sinks, out, lse, dlse, dq, dk, dv, dsinks, *, softmax_scale: float,
             window_left: int, window_right: int, sink_tokens: int, softcap: float, deterministic: bool,
             cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q: int = 0, max_seqlen_k: int = 0,
             max_smem: int = 0) -> None:
    """Run the backward kernel of `backend`, writing dq, dk, dv (like q, k, v; dk/dv summed over the query-head
    group) and dsinks (fp32 (nheads,), or None without sinks) in place. dlse (fp32 like lse) or None.

    deterministic=True: dq, dk, dv and dsinks are bitwise repeatable (dsinks, dk and dv are always reduced in a
    fixed order; dq tiles are added in increasing key-block order per M tile, ordered by a counter per M tile).
    `max_smem` overrides the shared-memory limit that picks the tile configuration (tests: the sm86 one)."""
    C = _ext.require()
    dout, q, k, v, out = (t if _aligned(t) else t.contiguous() for t in (dout, q, k, v, out))
    if out.stride() != dout.stride():
        out, dout = out.contiguous(), dout.contiguous()
    targets = [t if _aligned(t) else torch.empty_like(t, memory_format=torch.contiguous_format) for t in (dq, dk, dv)]
    ds = None
    if sinks is not None:
        ds = dsinks if (dsinks is not None and dsinks.dtype == torch.float32 and dsinks.is_contiguous()) else \
            torch.empty((q.shape[-2],), dtype=torch.float32, device=q.device)
    C.bwd(backend, dout, q, k, v, sinks, out, lse.contiguous(), None if dlse is None else dlse.float().contiguous(),
          *targets, ds, _dense_index(cu_seqlens_q), _dense_index(cu_seqlens_k), int(max_seqlen_q), int(max_seqlen_k),
          float(softmax_scale),
          int(window_left), int(window_right), int(sink_tokens), float(softcap), bool(deterministic), int(max_smem))
    for t, dst in zip(targets, (dq, dk, dv)):
        if t is not dst:
            dst.copy_(t)
    if ds is not None and dsinks is not None and ds is not dsinks:
        dsinks.copy_(ds)


def kvcache_forward(backend: str, q, k_cache, v_cache, sinks, out, lse, *, cache_seqlens, block_table,
                    softmax_scale: float, window_left: int, window_right: int, sink_tokens: int, softcap: float,
                    num_splits: int = 0, max_smem: int = 0) -> None:
    """Attention of q (b, sq, h, d) over a KV cache that already holds the new keys, writing out and lse (b, h, sq).

    cache_seqlens (b,) int32 counts the keys of each sequence; block_table (b, max_pages) int32 for a paged
    cache. The query heads of a KV head share a tile (K/V read once per group); num_splits 0 picks split-KV
    from the SM count and the work, and the combine adds the sink once."""
    C = _ext.require()
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not _aligned(t):
            raise SinkattnRuntimeError(f"backend {backend!r}: {name} must have 16-byte aligned rows (strides multiple "
                                       f"of 8 elements, last dim contiguous) to be read in place; got strides "
                                       f"{tuple(t.stride())}. Use backend='reference' for this cache layout.")
    q = q if _aligned(q) else q.contiguous()
    target = out if _aligned(out) else torch.empty_like(out, memory_format=torch.contiguous_format)
    C.fwd_kvcache(backend, q, k_cache, v_cache, sinks, target, lse, cache_seqlens.to(torch.int32).contiguous(),
                  _dense_index(block_table), float(softmax_scale),
                  int(window_left), int(window_right), int(sink_tokens), float(softcap), int(num_splits), int(max_smem))
    if target is not out:
        out.copy_(target)


def _dense_index(t):
    """Index tensors (cu_seqlens, block tables) as the kernels read them: contiguous int32. The API accepts any
    strides (a view such as cu[::2] is a valid argument), so the bridge makes them dense."""
    return None if t is None else t.to(torch.int32).contiguous()


def _broadcast(t) -> bool:
    return any(t.stride(i) == 0 and t.size(i) > 1 for i in range(t.dim()))


def _aligned(t) -> bool:
    """cp.async moves 16-byte vectors: the base and every outer stride must be 16-byte aligned."""
    if t.stride(-1) != 1 or t.data_ptr() % 16:
        return False
    return all(t.stride(i) % 8 == 0 or t.size(i) == 1 for i in range(t.dim() - 1))
