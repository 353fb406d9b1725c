"""The sm90 backward (csrc/sm90/bwd_*) against float64 autograd on the oracle, on a cc 9.0 GPU (skipped elsewhere):
every case of the sm80 backward's GPU tests (tests/bwd_cases.py, plus a large one), issue 16's own cases (more
CTAs than SMs, varlen lengths 0 to 4000, GQA 8:1 at gpt-oss's shape with window (127, 0) and full causal, sinks 0 /
-inf / +30, each with gradients through a returned LSE), the deterministic mode bitwise equal over 3 runs, and the
public autograd path with backend="sm90". A file of its own: bench/gpu_check.sh runs it in its own time box
before the other GPU tests (a hung pipeline costs that box, not the run)."""
from __future__ import annotations

import pytest

from test_gpu_backward import COMPILED, _cases, check_deterministic_bits, check_matches_oracle, check_through_autograd

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("case", _cases("sm90"), ids=str)
def test_sm90_backward_matches_oracle(case, rng_seed):
    check_matches_oracle("sm90", case, rng_seed)


@pytest.mark.parametrize("hd_dt", COMPILED["sm90"], ids=lambda x: f"d{x[0]}-{x[1]}")
def test_sm90_backward_deterministic_bits(hd_dt, rng_seed):
    check_deterministic_bits("sm90", hd_dt, rng_seed)


def test_sm90_backward_through_autograd(rng_seed):
    check_through_autograd("sm90", rng_seed)
