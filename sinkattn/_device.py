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
