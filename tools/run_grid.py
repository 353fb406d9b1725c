"""The kernel grid `make run` builds: what a first look needs on this machine, never more.

`make run` is the first hour's command (install, report, quick start). What it compiles is the whole of its
cost: on the 2-core machine without ccache, the full default grid (SINKATTN_CUDA_ARCHS=80;90a, head dims 64,
128 and 256, bf16 and fp16: 47 kernel units) took 16 minutes (976 s, 2026-12-01), and the front end of each
unit (cicc, one pass per unit whatever the arch list) is about two thirds of that, so narrowing archs alone
saves little. So:

- A GPU is visible (nvidia-smi lists one): SINKATTN_CUDA_ARCHS=native, every head dim and dtype for the GPUs of
  this machine. Cost at run time: none here; the build does not hold other archs' SASS (the report says what a
  wider build adds).
- No GPU is visible: the first-look grid, every kernel family for every default arch at head dim 64 and bf16
  (gpt-oss's attention shape): 9 units. Cost at run time: calls at other head dims or fp16 run on the PyTorch
  reference backend with a one-time warning naming the rebuild, and the report lists what is compiled.
  `make install` (or `pip install --no-build-isolation .`) builds the full default grid.

Where make already installed a build (build/.installed and the grid it was built with, build/.grid), make run keeps
that grid: `make run` after `make test` or `make install` rebuilds nothing and never narrows an install.
A SINKATTN_CUDA_ARCHS / _HEADDIMS / _DTYPES set in the environment or on make's command line wins: this prints
only the variables the caller left unset, as make arguments (`VAR=value ...`), and a line on stderr saying why.
No torch here: make runs it before anything is installed.
"""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys

FIRST_LOOK = {"SINKATTN_HEADDIMS": "64", "SINKATTN_DTYPES": "bf16"}
# The Makefile's build/.grid holds these, joined by "|" (its GRID_STRING), for the build it last installed.
GRID_VARS = ("SINKATTN_CUDA_ARCHS", "SINKATTN_HEADDIMS", "SINKATTN_DTYPES", "SINKATTN_SWEEP")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def installed_grid(root: str = ROOT) -> dict[str, str] | None:
    """The grid of the build make last installed here ({} for the default grid), or None when there is none."""
    stamp, grid = os.path.join(root, "build", ".installed"), os.path.join(root, "build", ".grid")
    if not (os.path.exists(stamp) and os.path.exists(grid)):
        return None
    with open(grid) as f:
        values = f.read().strip().split("|")
    return {k: v for k, v in zip(GRID_VARS, values) if v}


def gpu_visible() -> bool:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and "GPU" in out.stdout


def choose(env=os.environ, gpu: bool | None = None, installed: dict | None = None) -> tuple[dict[str, str], str]:
    """(the variables to set, why) for make run; `installed` is installed_grid()'s answer."""
    if installed is not None:
        chosen = {k: v for k, v in installed.items() if not env.get(k)}
        return chosen, "keeping the grid of the build already installed here (build/.grid)"
    gpu = gpu_visible() if gpu is None else gpu
    if gpu:
        want, why = {"SINKATTN_CUDA_ARCHS": "native"}, "a GPU is visible: building its native archs only"
    else:
        want, why = dict(FIRST_LOOK), ("no GPU is visible: building the first-look grid (every kernel family and "
                                       "arch at head dim 64, bf16); `make install` builds the full default grid")
    chosen = {k: v for k, v in want.items() if not env.get(k)}
    if not chosen:
        return {}, "the SINKATTN_* grid given by the caller"
    return chosen, why


def main() -> int:
    chosen, why = choose(installed=installed_grid())
    print(f"make run: {why}", file=sys.stderr)
    print(" ".join(shlex.quote(f"{k}={v}") for k, v in chosen.items()))  # "80;90a" must reach make whole
    return 0


if __name__ == "__main__":
    sys.exit(main())
