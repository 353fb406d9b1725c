"""Cheap device detection: compute capabilities through NVML, without creating a CUDA context.

Import-time code must not initialise CUDA (it costs hundreds of ms and breaks fork-based workers), so
sinkattn asks NVML (libnvidia-ml, loaded with ctypes) for names and compute capabilities. Without NVML
(no driver, CPU machine) it reports no devices; torch is consulted only when a CUDA tensor is at hand.
"""
from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceInfo:
    index: int
    name: str
    capability: tuple[int, int]
    sm_count: int | None = None
    smem_per_block_optin: int | None = None  # bytes


def _nvml():
    for lib in ("libnvidia-ml.so.1", "libnvidia-ml.so"):
        try:
            return ctypes.CDLL(lib)
        except OSError:
            continue
    return None


@functools.lru_cache(maxsize=1)
def nvml_devices() -> tuple[DeviceInfo, ...]:
    nvml = _nvml()
    if nvml is None or nvml.nvmlInit_v2() != 0:
        return ()
    try:
        count = ctypes.c_uint(0)
        if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
            return ()
        out = []
        for i in range(count.value):
            handle = ctypes.c_void_p()
            if nvml.nvmlDeviceGetHandleByIndex_v2(i, ctypes.byref(handle)) != 0:
                continue
            name = ctypes.create_string_buffer(96)
            nvml.nvmlDeviceGetName(handle, name, 96)
            major, minor = ctypes.c_int(0), ctypes.c_int(0)
            if nvml.nvmlDeviceGetCudaComputeCapability(handle, ctypes.byref(major), ctypes.byref(minor)) != 0:
                continue
            out.append(DeviceInfo(i, name.value.decode(errors="replace"), (major.value, minor.value)))
        return tuple(out)
    finally:
        nvml.nvmlShutdown()


@functools.lru_cache(maxsize=None)
def device_info(index: int) -> DeviceInfo:
    """Full properties of one CUDA device (creates a context: call only with CUDA tensors at hand)."""
    import torch

    p = torch.cuda.get_device_properties(index)
    return DeviceInfo(index, p.name, (p.major, p.minor), p.multi_processor_count,
                      getattr(p, "shared_memory_per_block_optin", None))


def capability(index: int) -> tuple[int, int]:
    for d in nvml_devices():
        if d.index == index:
            return d.capability
    return device_info(index).capability


# Shared memory one block may opt in to, in bytes, by compute capability (CUDA C++ Programming Guide,
# "Technical Specifications per Compute Capability"). Device facts, not kernel facts (what each kernel needs
# is in the binary's registry, `smem_bytes`): the table stands in for a device's own property when the
# capability is pretended (tests, the capability report's rows, vLLM's selection).
SMEM_PER_BLOCK_OPTIN = {(8, 0): 166912, (8, 7): 166912, (8, 6): 101376, (8, 9): 101376, (9, 0): 232448}
SMEM_PER_BLOCK_OPTIN_BY_MAJOR = {10: 232448, 12: 101376}


@functools.lru_cache(maxsize=None)
def smem_per_block_optin(cc: tuple[int, int], index: int | None = None) -> int | None:
    """The opt-in shared memory per block (bytes) of a device of compute capability `cc`: the device's own
    property when `index` is a visible CUDA device of that capability, else the table; None when unknown."""
    import torch

    cc = tuple(cc)
    if index is not None and torch.cuda.is_available() and index < torch.cuda.device_count() \
            and capability(index) == cc:
        own = device_info(index).smem_per_block_optin
        if own:
            return own
    return SMEM_PER_BLOCK_OPTIN.get(cc, SMEM_PER_BLOCK_OPTIN_BY_MAJOR.get(cc[0]))


# ---- a process-wide cap on the shared memory the sm80 kernels' tile tables see --------------------------------
# The sm80 kernels pick their tile by the device's opt-in shared memory per block (csrc/sm80/fwd_tiles.h,
# bwd_tiles.h): 163 KB tiles on an A100, 99 KB ones on cc 8.6/8.9 (A10, L4, RTX 3090/4090). A cap lowers the
# limit they read (never raises it: api.cpp takes the smaller of the cap and the device's), so the tiles of a
# 99 KB device run, and can be timed, on an A100 or H100/H200. Set for the whole process by the environment
# variable (read once, at import) or by `sm80_smem_limit`; dispatch passes it to every sm80 launch (forward,
# backward, KV cache) and `dispatch.why_not` declines a kernel whose smallest tile does not fit under it, as it
# does on a real 99 KB device. The sm90 kernels do not read it.
SM80_SMEM_ENV = "SINKATTN_SM80_MAX_SMEM"
# What the host emulation ("sm80-emulated") models when no cap is set: an A100 (csrc/emu/emu_launch.h).
EMULATED_SMEM_PER_BLOCK = 163 * 1024


@dataclass(frozen=True)
class SmemCap:
    nbytes: int
    source: str  # what set it, as a user wrote it: "SINKATTN_SM80_MAX_SMEM=99K", "sinkattn.sm80_smem_limit('99K')"


def parse_smem(value, what: str) -> int:
    """A shared-memory size in bytes from an int or a string of bytes ("101376") or KiB with a K ("99K")."""
    from .errors import SinkattnTypeError, SinkattnValueError

    accepted = "a positive number of bytes (101376) or of KiB with a K suffix (99K)"
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise SinkattnTypeError(f"sinkattn: {what} takes {accepted}, or None for no cap; got {type(value).__name__} "
                                f"{value!r}")
    if isinstance(value, int):
        nbytes = value
    else:
        text = value.strip()
        kib = text[-1:] in ("K", "k")
        digits = text[:-1].strip() if kib else text
        if not digits.isascii() or not digits.isdigit():
            raise SinkattnValueError(f"sinkattn: {what}={value!r} is not a shared-memory size; give {accepted}")
        nbytes = int(digits) * (1024 if kib else 1)
    if nbytes <= 0:
        raise SinkattnValueError(f"sinkattn: {what}={value!r} is not a shared-memory size; give {accepted} "
                                 "(no cap: leave it unset)")
    return nbytes


def _cap_from_env(environ=None) -> SmemCap | None:
    import os

    raw = (os.environ if environ is None else environ).get(SM80_SMEM_ENV)
    if raw is None or not raw.strip():
        return None
    return SmemCap(parse_smem(raw, SM80_SMEM_ENV), f"{SM80_SMEM_ENV}={raw.strip()}")


_sm80_cap: SmemCap | None = _cap_from_env()


def sm80_smem_cap() -> SmemCap | None:
    """The cap in force (None: the sm80 kernels see the device's own limit)."""
    return _sm80_cap


def sm80_max_smem(backend: str) -> int:
    """The `max_smem` argument of kernels.launch_* for `backend`: 0 (the device's limit) without a cap or for sm90,
    else the cap (for the host emulation, never above the A100 it models without one)."""
    cap = _sm80_cap
    if cap is None or backend in ("sm90", "sm90-emulated"):
        return 0
    return min(cap.nbytes, EMULATED_SMEM_PER_BLOCK) if backend == "sm80-emulated" else cap.nbytes


class sm80_smem_limit:
    """Caps the shared memory per block that the sm80 kernels' tile tables read, for the whole process.

        sinkattn.sm80_smem_limit(99 * 1024)   # from now on: the tiles of a 99 KB device (A10, L4, RTX 4090)
        with sinkattn.sm80_smem_limit("99K"):  # only inside the block; the previous cap comes back after it
            ...
        sinkattn.sm80_smem_limit(None)        # no cap: the device's own limit

    `limit`: bytes (int or digits) or KiB with a K suffix ("99K"); the environment variable SINKATTN_SM80_MAX_SMEM
    sets the same cap at import. The cap only lowers a device's limit. It applies to the sm80 kernels (forward,
    backward, KV cache; "sm80-emulated" too), not sm90; a kernel whose smallest tile needs more is declined by
    dispatch (backend="auto" falls back, a forced backend raises) with a reason that names the cap. It is one
    process-wide setting, read at each call (a CUDA graph keeps the tiles it was captured with): set it before
    running, not from concurrent threads that want different caps."""

    __slots__ = ("_previous",)

    def __init__(self, limit):
        global _sm80_cap
        cap = None if limit is None else SmemCap(parse_smem(limit, "sinkattn.sm80_smem_limit"),
                                                 f"sinkattn.sm80_smem_limit({limit!r})")
        self._previous = _sm80_cap
        _sm80_cap = cap

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        global _sm80_cap
        _sm80_cap = self._previous


def get_sm80_smem_limit() -> int | None:
    """The cap in force, in bytes (None: no cap). See `sm80_smem_limit`."""
    return None if _sm80_cap is None else _sm80_cap.nbytes
