"""The compile-time capability report as data: what this build holds and what serves what on each GPU.

Everything about the build is read from the binary itself (its kernel registry and the versions the
compiler baked in), never from environment variables or files that can drift. Which backend serves a
feature on a device is answered by dispatch itself (`dispatch.plan`, as a call would be). Works with no GPU and with no
compiled extension.
"""
from __future__ import annotations

import platform

import torch

from . import _device, _ext, dispatch, registry
from ._problem import Problem
from ._version import __version__
from .mask import Mask

# One representative problem per feature the report answers for (gpt-oss-like shapes).
FEATURES = {
    "learnable_sinks": dict(kind="fwd", has_sinks=True, mask=Mask(0.125, 127, 0)),
    "sink_tokens": dict(kind="fwd", mask=Mask(0.125, 1023, 0, 4)),
    "backward": dict(kind="bwd", has_sinks=True, mask=Mask(0.125, -1, 0)),
    "decode": dict(kind="kvcache", has_sinks=True, mask=Mask(0.125, 127, 0)),
    # decode over an FP8 (e4m3 / e5m2) KV cache: the sm80 FP8-cache kernels (csrc/sm80/fp8_kv.h)
    "fp8_decode": dict(kind="kvcache", has_sinks=True, mask=Mask(0.125, 127, 0), kv_fp8=True),
    # a vLLM layer's step: the serving call (packed queries of every request) over vLLM's paged cache, page 16
    "vllm_paged_step": dict(kind="kvcache", has_sinks=True, mask=Mask(0.125, 127, 0), varlen=True, paged=True,
                            page_size=16),
}


def _problem(feature: str, index: int, dtype=torch.bfloat16, headdim: int = 64) -> Problem:
    return Problem(device_type="cuda", dtype=dtype, headdim=headdim, nheads=64, nheads_k=8, device_index=index,
                   **FEATURES[feature])


def _fmt_version(v: int) -> str | None:
    return f"{v // 1000}.{(v % 1000) // 10}" if v else None


def _runtime() -> dict:
    if _ext.loaded():
        info = dict(_ext.require().runtime_info())
        return {"cuda_runtime": _fmt_version(info["cuda_runtime_version"]),
                "cuda_driver": _fmt_version(info["cuda_driver_version"])}
    return {"cuda_runtime": None, "cuda_driver": None}


def _served_by(backend: str, problem: Problem, capability: tuple[int, int] | None) -> str:
    """Which compiled kernel serves `problem` on `backend` and how it runs."""
    kernel = registry.kernel_for(backend, problem)
    if kernel is None:
        return backend
    how = "host emulation" if capability is None else registry.how_it_runs(kernel["archs"], capability)
    return f"{kernel['name']} ({how})"


def serving_paths(device: _device.DeviceInfo) -> dict:
    """For each feature: the backend that serves it on `device`, and why each better one does not."""
    paths = {}
    for feature in FEATURES:
        problem = _problem(feature, device.index)
        chosen, declined = dispatch.plan(problem, device.capability)
        served = _served_by(chosen, problem, device.capability) if chosen != "reference" else \
            "PyTorch reference backend"
        paths[feature] = {"backend": chosen, "kernel": served, "declined": declined}
    return paths


# What each arch of SINKATTN_CUDA_ARCHS adds to a build (the report lists the ones a build lacks).
ARCH_ADDS = {
    "80": "native sm_80 code of the sm80 kernels for cc 8.0 (A100), which cc 8.6/8.9 (A10, L4, RTX 30xx/40xx) "
          "run too",
    "86": "sm_86 SASS for cc 8.6/8.9 (they run the sm_80 SASS natively without it)",
    "89": "sm_89 SASS for cc 8.9 (it runs the sm_80 or sm_86 SASS natively without it)",
    "90a": "the Hopper kernels (the sm90 TMA + wgmma forward as sm_90a, the sm80 kernels as sm_90 SASS) for cc 9.0",
    "100": "native sm_100 SASS for Blackwell datacenter GPUs (cc 10.x), which otherwise JIT the compute_80 PTX",
    "120": "native sm_120 SASS for Blackwell workstation GPUs (cc 12.x), which otherwise JIT the compute_80 PTX",
}


def wider_build(build: dict | None) -> dict:
    """{arch: what it would add} for the archs this build did not compile."""
    if not build:
        return {}
    have = {a for a in build.get("requested_archs", "").replace(",", ";").split(";") if a}
    return {a: what for a, what in ARCH_ADDS.items() if a not in have}


def _mismatches(build: dict | None, runtime: dict, devices: list[dict]) -> list[dict]:
    out = []
    shadow = _ext.SHADOWING
    if not _ext.loaded() and shadow:
        tree = ", a source tree" if shadow["source_tree"] else ""
        out.append({"problem": f"the imported sinkattn ({shadow['imported']}{tree}) has no compiled extension and "
                               f"hides the build installed at {shadow['installed']}; "
                               "every call runs on the reference backend",
                    "fix": shadow["fix"]})
        return out
    if not _ext.loaded():
        out.append({"problem": f"no compiled extension ({_ext.IMPORT_ERROR}); every call runs on the reference "
                               "backend",
                    "fix": "pip install --no-build-isolation . on a machine with nvcc (CUDA_HOME set) and the "
                           "CUTLASS headers (make cutlass)"})
        return out
    nvcc_major = int(build["nvcc_version"].split(".")[0])
    tc = torch.version.cuda
    if tc and int(tc.split(".")[0]) != nvcc_major:
        out.append({"problem": f"extension built with nvcc {build['nvcc_version']} but torch uses CUDA {tc}",
                    "fix": f"rebuild with a CUDA {tc.split('.')[0]}.x toolkit (CUDA_HOME=...)"})
    if build.get("torch_version_at_build") and build["torch_version_at_build"] != torch.__version__:
        out.append({"problem": f"extension built against torch {build['torch_version_at_build']}, running with "
                               f"torch {torch.__version__}",
                    "fix": "rebuild: pip install --no-build-isolation ."})
    drv = runtime.get("cuda_driver")
    if devices and drv and nvcc_major and int(drv.split(".")[0]) < nvcc_major:
        out.append({"problem": f"the driver supports CUDA {drv} but the kernels were built with nvcc "
                               f"{build['nvcc_version']}",
                    "fix": f"update the NVIDIA driver to one for CUDA {nvcc_major}.x"})
    for d in devices:
        sinks_path = d["paths"]["learnable_sinks"]
        if "JIT" in sinks_path.get("kernel", ""):
            cc = tuple(int(x) for x in d["capability"].split("."))
            out.append({"problem": f"GPU {d['index']} ({d['name']}, cc {d['capability']}) runs the kernels from "
                                   "embedded PTX, JIT-compiled by the driver at first use (slow first call, no "
                                   "tuning for this arch)",
                        "fix": f"for native code, {registry.rebuild_hint(cc)}"})
            continue
        for feature, path in d["paths"].items():
            if path["backend"] == "reference" and feature in ("learnable_sinks", "sink_tokens"):
                why = "; ".join(f"{b}: {r}" for b, r in path["declined"].items())
                out.append({"problem": f"GPU {d['index']} ({d['name']}, cc {d['capability']}): {feature} runs on "
                                       f"the reference backend",
                            "fix": why})
                break
    return out


def capabilities(devices: list[_device.DeviceInfo] | None = None) -> dict:
    """The whole report as a dict (the --json output). `devices` overrides detection (tests)."""
    if devices is None:
        devices = list(_device.nvml_devices())
        if not devices and torch.cuda.is_available():
            devices = [_device.device_info(i) for i in range(torch.cuda.device_count())]
        elif devices and torch.cuda.is_available():
            devices = [_device.device_info(d.index) for d in devices]
    build = _ext.build_info()
    runtime = _runtime()
    dev_rows = []
    for d in devices:
        dev_rows.append({"index": d.index, "name": d.name, "capability": f"{d.capability[0]}.{d.capability[1]}",
                         "sm_count": d.sm_count, "smem_per_block_optin": d.smem_per_block_optin,
                         "paths": serving_paths(d)})
    return {
        "sinkattn_version": __version__,
        "python": platform.python_version(),
        "torch_version": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "extension": {"loaded": _ext.loaded(), "error": _ext.IMPORT_ERROR},
        "package": _package(),
        "build": build,
        "runtime": runtime,
        "kernels": [dict(k) for k in _ext.registry()],
        "wider_build": wider_build(build),
        "devices": dev_rows,
        "sm80_smem_cap": _sm80_smem_cap(),
        "mismatches": _mismatches(build, runtime, dev_rows),
    }


def _package() -> dict:
    """Where the imported sinkattn lives and the other copies it hides (a clone run after a non-editable install)."""
    return {"path": _ext.PACKAGE_DIR, "source_tree": _ext.is_source_tree(_ext.PACKAGE_DIR), "shadows": _ext.shadowed()}


def _sm80_smem_cap() -> dict | None:
    """The process's cap on the sm80 kernels' shared memory (sinkattn.sm80_smem_limit, SINKATTN_SM80_MAX_SMEM), or
    None. The serving paths above already answer under it (dispatch.why_not reads it)."""
    cap = _device.sm80_smem_cap()
    return None if cap is None else {"bytes": cap.nbytes, "set_by": cap.source}
