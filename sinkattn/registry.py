"""The kernels compiled into the binary, as its registry (sinkattn._C.registry(), loaded by _ext) records them.

Every "can this kernel serve this call" fact that belongs to a kernel is read here, never hard-coded: which
(family, op, head dim, dtype) exist, the features each serves, the shared memory per block its smallest
tile configuration needs, and the archs it was compiled for. An entry is a dict:

    name, family ("sm80", "sm90", "sm80-emulated", "common"; a tuning-grid variant's "<family>-sweep", which
    dispatch never reads), op ("fwd", "bwd", "merge", "fwd_fp8": decode over FP8 KV caches), headdim (0: any),
    dtype ("bf16", "fp16", "fp32"), features (comma list: sinks, sink_tokens, causal, window, softcap, gqa,
    varlen, kvcache, paged, split_kv, deterministic; and what the bridge must know to launch it:
    tile_counter (api.cpp hands it a zeroed tile counter), broadcast_strides (it reads inputs with zero
    strides in place; without it the bridge makes them contiguous)), archs (comma list of SASS sm_XY / PTX
    compute_XY), smem_bytes (0: no dynamic shared memory; absent in builds that predate it, read as 0)

Device facts (a device's shared-memory limit, its capability) live in _device; the decision that combines
the two is dispatch.why_not.
"""
from __future__ import annotations

import functools

from . import _ext
from ._problem import Problem
from .layout import kernel_headdim

# backend= name -> registry family. "sm80-emulated" and "sm90-emulated" are the sm80 and sm90 kernel bodies under
# host emulation (CPU tensors; csrc/emu/).
BACKEND_FAMILY = {"sm90": "sm90", "sm80": "sm80", "sm80-emulated": "sm80-emulated", "sm90-emulated": "sm90-emulated"}
KERNEL_BACKENDS = tuple(BACKEND_FAMILY)
EMULATED_BACKENDS = ("sm80-emulated", "sm90-emulated")
_DTYPE_NAMES = {"torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float32": "fp32"}


def dtype_name(dtype) -> str | None:
    """The registry's name of a torch dtype ("bf16"), or None for one no kernel takes."""
    return _DTYPE_NAMES.get(str(dtype))


def op_of(problem: Problem, family: str | None = None) -> str:
    """The registry op that serves a problem: KV-cache decode runs on the forward kernels; over an FP8 cache on the
    FP8-cache decode kernels ("fwd_fp8": csrc/sm80/fp8_kv.h) where `family` has any (None: assume it does), else on
    the forward kernels, which serve it only if they list the feature fp8_kv."""
    if problem.kind == "bwd":
        return "bwd"
    if problem.kv_fp8 and (family is None or kernels(family, "fwd_fp8")):
        return "fwd_fp8"
    return "fwd"


def needed_features(problem: Problem) -> list[str]:
    """The registry features a kernel must list to serve `problem`."""
    m = problem.mask
    wanted = [("sinks", problem.has_sinks), ("sink_tokens", m.sink_tokens > 0), ("causal", m.causal),
              ("window", m.windowed), ("softcap", m.softcap > 0), ("gqa", problem.nheads != problem.nheads_k),
              ("varlen", problem.varlen), ("kvcache", problem.kind == "kvcache"),
              # "paged16": pages of a multiple of 16 rows (the sm90 forward's page boxes); "paged": any page size
              ("paged", problem.paged and problem.page_size % 16 != 0),
              ("paged16", problem.paged and problem.page_size % 16 == 0),
              ("deterministic", problem.kind == "bwd" and problem.deterministic),
              ("fp8_kv", problem.kv_fp8)]
    return [name for name, needed in wanted if needed]


_index_of: tuple = (None, None)  # (the registry tuple, its index): rebuilt when _ext.registry() gives another


def _index():
    """{(family, op): [entries]} and {(family, op, headdim, dtype): entry} of the registry as it is now."""
    global _index_of
    reg = _ext.registry()
    seen, index = _index_of
    if seen is not reg:
        by_op, by_key = {}, {}
        for k in reg:
            by_op.setdefault((k["family"], k["op"]), []).append(k)
            by_key.setdefault((k["family"], k["op"], k["headdim"], k["dtype"]), k)
        index = (by_op, by_key)
        _index_of = (reg, index)
    return index


def kernels(family: str, op: str) -> list[dict]:
    return _index()[0].get((family, op), [])


def find(family: str, op: str, headdim: int, dtype: str | None) -> dict | None:
    return _index()[1].get((family, op, headdim, dtype))


def named(name: str) -> dict | None:
    """The entry registered as `name` (a tuning-grid variant's "variant:<name>"), or None."""
    return next((k for k in _ext.registry() if k["name"] == name), None)


def launched_by(backend: str, op: str, headdim: int, dtype) -> dict | None:
    """The entry kernels.launch_* runs for `backend` ("variant:<name>" included) on inputs of this head dim and
    torch dtype (None: not compiled)."""
    if backend.startswith("variant:"):
        return named(backend[len("variant:"):])
    family = BACKEND_FAMILY.get(backend)
    return None if family is None else find(family, op, kernel_headdim(headdim) or 0, dtype_name(dtype))


def reads_broadcast_strides(kernel: dict | None) -> bool:
    """Whether the kernel reads inputs with zero (broadcast) strides in place: the sm80 kernels' cp.async loads
    follow any stride; the sm90 kernels read through TMA descriptors, which take none, so their registry entries
    leave the feature out (an entry that does not say so gets contiguous inputs: a copy, never a refused launch)."""
    return kernel is not None and "broadcast_strides" in features(kernel)


def kernel_for(backend: str, problem: Problem) -> dict | None:
    """The entry of the kernel `backend` would run for `problem` (None: not compiled)."""
    family = BACKEND_FAMILY[backend]
    return find(family, op_of(problem, family), kernel_headdim(problem.headdim) or 0,
                dtype_name(problem.dtype))


def features(kernel: dict) -> frozenset[str]:
    return _feature_set(kernel["features"])


@functools.lru_cache(maxsize=64)
def _feature_set(listed: str) -> frozenset[str]:
    return frozenset(f for f in listed.split(",") if f)


def smem_bytes(kernel: dict) -> int:
    return int(kernel.get("smem_bytes", 0) or 0)


def fp8_kv_headdims() -> tuple[int, ...]:
    """The head dims the FP8-cache decode tiles exist for (the C++ tile table, csrc/sm80/fwd_tiles.h FwdFp8TilesOf,
    as the binary reports it), whether or not this build compiled them."""
    info = _ext.build_info() or {}
    return tuple(int(h) for h in info.get("fp8_kv_headdims", ()))


def requested(key: str) -> list[str]:
    """A list the build was asked for (requested_headdims, requested_dtypes, ...), from the binary."""
    info = _ext.build_info() or {}
    return [x for x in str(info.get(key, "")).replace(";", ",").split(",") if x]


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


def rebuild_hint(capability) -> str:
    """The SINKATTN_CUDA_ARCHS that gives native code for a device of this capability."""
    if capability is None:
        return ""
    major, minor = capability
    arch = {8: "80", 9: "90a", 10: "100", 12: "120"}.get(major)
    if arch is None:
        return f"no sinkattn build targets cc {major}.{minor}"
    return f"rebuild with SINKATTN_CUDA_ARCHS={arch}"


def merge_kernel_runs(dtype, capability: tuple[int, int]) -> bool:
    """Whether a compiled merge kernel of this dtype can run on a CUDA device of this capability."""
    name = dtype_name(dtype)
    kernel = next((k for k in _ext.registry() if k["op"] == "merge" and k["dtype"] == name), None)
    return kernel is not None and how_it_runs(kernel["archs"], capability) is not None
