"""The sm80 tile rules against the tile lists the units compile (csrc/sm80/fwd_tiles.h, bwd_tiles.h), on the host:
tests/tile_rules/sm80_tile_lists.cpp walks choose_fwd_tile, choose_fwd_fp8_tile and choose_bwd_tile over row counts,
split-KV, softcap and every per-block shared-memory limit from 48 to 240 KB, and asserts that each answer runs exactly
one compiled kernel through with_tile_in, that a tile outside a list throws rather than run nothing, and that the
answers for many rows are prefill tiles (FwdTile::prefill) and those for few rows and FP8 caches are not. No CuTe, no
CUDA: a second or two of g++. Planted by hand when it was written: a tile dropped from FwdTilesOf<64> (666 failures
reported) and one from BwdTilesOf<128> (129); a tile listed twice stops the compile at fwd_tiles.h's distinct_tiles
assert."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "tests" / "tile_rules" / "sm80_tile_lists.cpp"


def test_every_rule_answer_runs_one_compiled_kernel(tmp_path):
    cxx = shutil.which(os.environ.get("CXX", "c++"))
    if cxx is None:
        pytest.skip("needs a C++ compiler")
    out = tmp_path / "sm80_tile_lists"
    cuda = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "include"
    cmd = [cxx, "-std=c++20", "-O1", f"-I{ROOT / 'csrc'}", f"-I{cuda}", "-o", str(out), str(SRC)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"compiling {SRC.name} failed:\n{done.stderr[-4000:]}"
    run = subprocess.run([str(out)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stdout[-4000:]
