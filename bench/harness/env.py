"""What a result depends on, recorded next to it: date, device, versions, git commit, clocks and power."""
from __future__ import annotations

import datetime
import os
import platform
import subprocess

import torch

from . import timing


def rss_bytes() -> int:
    """This process's resident set size (Linux /proc; 0 elsewhere): the memory studies' measure."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _git_commit() -> str | None:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/harness/ -> repo
    try:
        r = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                           timeout=10)
        if r.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return r.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def device_info(device: torch.device) -> dict:
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        return {"type": "cuda", "index": device.index or 0, "name": p.name,
                "capability": f"{p.major}.{p.minor}", "sm_count": p.multi_processor_count,
                "l2_bytes": int(getattr(p, "L2_cache_size", 0) or 0), "memory_bytes": p.total_memory}
    return {"type": "cpu", "name": platform.processor() or platform.machine(), "threads": torch.get_num_threads()}


def collect(device: torch.device) -> dict:
    import sinkattn

    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "sinkattn": getattr(sinkattn, "__version__", None),
        "git_commit": _git_commit(),
        "device": device_info(device),
        "driver": None,
    }
    try:
        from sinkattn import _ext

        env["extension_loaded"] = _ext.loaded()
        env["extension_error"] = _ext.IMPORT_ERROR
        env["kernels"] = [f"{k['family']} {k['op']} hd{k['headdim']} {k['dtype']} [{k['archs']}]"
                          for k in _ext.registry()]
    except Exception as e:  # noqa: BLE001 - the report must not fail because the extension is odd
        env["extension_error"] = repr(e)
    if device.type == "cuda":
        st = timing.gpu_state(device.index or 0)
        env["gpu_state_before"] = st
        env["driver"] = st.get("driver_version")
    return env
