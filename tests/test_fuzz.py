"""Property-based fuzzing: whole random problems (tests/fuzz_problems.py) against the float64 oracle.

CI runs a fixed number of problems per backend, sized to stay inside its time budget (measured: see docs/testing.md,
Reliability); SINKATTN_FUZZ_SCALE multiplies the counts for a nightly run (e.g. SINKATTN_FUZZ_SCALE=20).
Failing examples found so far are pinned below with @example, so they run first on every CI run.
The GPU fuzz mode (marked gpu) draws from the same generator for the real sm80 and sm90 kernels.
"""
from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings

from fuzz_problems import INF, FuzzProblem, check, problems
from oracle import single_thread  # noqa: F401  (autouse: one torch thread per test)
from sinkattn import _ext

SCALE = float(os.environ.get("SINKATTN_FUZZ_SCALE", "1"))
# Per-CI-run counts. The reference gets most problems (about 8 ms each); the emulated kernel costs far more
# per problem (its threads), so it gets fewer, drawn small.
COUNTS = {"reference": 1800, "sm80-emulated": 240, "sm80": 120, "sm90": 80}
EMU = any(k["family"] == "sm80-emulated" and k["headdim"] == 64 for k in _ext.registry())
SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _settings(backend):
    return settings(max_examples=max(1, int(COUNTS[backend] * SCALE)), deadline=None, database=None,
                    suppress_health_check=list(HealthCheck), print_blob=True)


# Regression cases: problems that once failed (with what was fixed), and corners the generator reaches rarely.
REGRESSIONS = [
    # A NaN-free corner: every sink +inf, nothing visible in some rows (sq > sk, causal).
    FuzzProblem("batched", "fp32", 16, 1, 2, ((9, 4),), causal=True, sinks=(INF, INF), seed=1),
    # +-30 sinks with a sharp softmax in bf16, GQA, window + sink tokens, tiny reference tiles.
    FuzzProblem("varlen", "bf16", 40, 2, 3, ((0, 7), (13, 0), (20, 33)), causal=True, window=(5, 0), sink_tokens=4,
                sinks=(30.0, -30.0, 1.0, -INF, INF, 0.0), scale=4.0, seed=2, key_tile=8, row_chunk=3),
    # A paged cache with one-token pages, an empty cache and four appended tokens, strided inputs.
    FuzzProblem("kvcache", "fp16", 64, 1, 4, (0, 17), seqlen_new=4, seqlen_q=5, page_size=1, causal=True,
                window=(3, 0), sink_tokens=1, sinks=(-INF, 2.0, 30.0, -30.0), strided=True, seed=3),
    # bf16 gradients of large inputs (scale 4): the reference's dq 4 ulps from the float64 oracle, its bf16 twin 1 ulp
    # (2026-12-06: the bound had no term for the gradients' magnitude).
    FuzzProblem("batched", "bf16", 8, 2, 2, ((2, 2),), causal=True, window=(-1, 0), strided=True, grad=True,
                scale=4.0, seed=101, key_tile=8, row_chunk=3),
    # Gradients with -inf sinks, softcap and a two-sided window.
    FuzzProblem("batched", "fp32", 24, 2, 2, ((11, 19), (11, 19)), window=(4, 3), softcap=5.0,
                sinks=(-INF, 0.5, -30.0, 3.0), grad=True, seed=4, key_tile=8, row_chunk=3),
]


def _with_examples(cases):
    def deco(f):
        for c in cases:
            f = example(p=c)(f)
        return f
    return deco


@_with_examples(REGRESSIONS)
@_settings("reference")
@given(p=problems("reference"))
def test_fuzz_reference(p):
    check(p, "reference", "cpu")


def _emu_ok(p):
    return p.dtype in ("bf16", "fp16") and p.headdim in (40, 64)


@pytest.mark.skipif(not EMU, reason="no emulated kernels in this build (SINKATTN_EMULATION=0 or no extension)")
@_with_examples([c for c in REGRESSIONS if _emu_ok(c)])
@_settings("sm80-emulated")
@given(p=problems("sm80-emulated"))
def test_fuzz_sm80_emulated(p):
    check(p, "sm80-emulated", "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["sm80", pytest.param("sm90", marks=pytest.mark.skipif(not SM90, reason="cc 9.0"))])
def test_fuzz_gpu(backend):
    @_settings(backend)
    @given(p=problems(backend))
    def run(p):
        check(p, backend, "cuda")
    run()
