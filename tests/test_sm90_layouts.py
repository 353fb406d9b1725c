"""The layout facts the sm90 backward relies on, checked on the host without a GPU (docs/DESIGN.md section 6): the
transposed shared-memory views (Q^T, dO^T, K^T, dS^T) address the bytes TMA and the consumers write, the S^T
accumulator's registers are exactly the A operand of dV += P^T dO, S^T's rows are keys and its columns queries
(the per-key mask bounds and the per-query LSE reads), dQ / dK / dV register pairs are adjacent columns (8-byte
atomics and stores), dS^T register pairs are one 4-byte word of shared memory (st.shared.b32), and the 256
consumer threads cover each tile once, and 8 columns of Q / dO / K / V from a multiple of 8 are one 16-byte chunk
(the varlen tail zeroing's stores). tests/layout_facts/sm90_bwd.cu holds the checks; it is compiled here as host
code with the host C++ compiler (CuTe's layout algebra is constexpr host code, which the emulated sm90 units compile
with the same compiler; g++ takes 18 s where nvcc took 61) and run, and run again with --mutant, where four
planted layout bugs must each be reported (the
untransposed dS^T view breaks two facts)."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "tests" / "layout_facts" / "sm90_bwd.cu"
CUTLASS = ROOT / "third_party" / "cutlass" / "include"


def _cxx():
    return shutil.which(os.environ.get("CXX", "c++"))


@pytest.fixture(scope="module")
def facts_binary(tmp_path_factory):
    cxx = _cxx()
    cuda = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "include"
    if cxx is None or not (CUTLASS / "cute" / "tensor.hpp").exists() or not (cuda / "cuda_runtime.h").exists():
        pytest.skip("needs a C++ compiler, the CUDA headers and the CUTLASS headers (make cutlass)")
    out = tmp_path_factory.mktemp("layout_facts") / "sm90_bwd"
    cmd = [cxx, "-std=c++20", "-O1", "-x", "c++", f"-I{ROOT / 'csrc'}", f"-I{CUTLASS}", f"-I{cuda}",
           f"-I{cuda / 'cccl'}", "-o", str(out), str(SRC)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"compiling {SRC.name} failed:\n{done.stderr[-4000:]}"
    return out


def _run(binary, *args):
    done = subprocess.run([str(binary), *args], capture_output=True, text=True, timeout=120)
    lines = [ln for ln in done.stdout.splitlines() if ln.strip()]
    return done.returncode, lines


def test_sm90_backward_layout_facts(facts_binary):
    rc, lines = _run(facts_binary)
    assert len(lines) == 18, lines  # 9 facts x head dims 64 and 128
    broken = [ln for ln in lines if not ln.endswith(": ok")]
    assert rc == 0 and not broken, "\n".join(broken)


def test_layout_fact_checks_catch_planted_bugs(facts_binary):
    rc, lines = _run(facts_binary, "--mutant")
    failed = sorted(ln.split(":")[0] for ln in lines if ": FAIL" in ln)
    want = sorted(f"hd{hd} {fact}" for hd in (64, 128) for fact in (
        "K^T view (B of dQ) is K", "dS^T view (what the consumers write) is dS (A of dQ)",
        "S^T registers are the A operand of dV += P^T dO", "dS^T register pairs are one 4-byte word of dS",
        "8 columns from a multiple of 8 are one 16-byte chunk of Q, dO, K, V"))
    assert rc == 1 and failed == want, lines
