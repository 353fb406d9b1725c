"""The sm90 backward (csrc/sm90/bwd_*) against float64 autograd on the oracle, on a cc 9.0 GPU (skipped elsewhere):
every case of the sm80 backward's GPU tests (tests/bwd_cases.py, plus a large one), the sm90 backward's own cases (more
CTAs than SMs, varlen lengths 0 to 4000, GQA 8:1 at gpt-oss's shape with window (127, 0) and full causal, sinks 0 /
-inf / +30, each with gradients through a returned LSE), the deterministic mode bitwise equal over 3 runs, and the
public autograd path with backend="sm90". The edge cases: varlen tiles that run into the next sequence's
poisoned rows (Q, K, dO; at every compiled head dim, whose tiles differ), seqlen_q = 0 with keys (padded and
varlen: no TMA descriptor over an empty tensor, zero gradients). A file of its own: bench/gpu/check.sh runs it in
its own time box before the other GPU tests (a hung pipeline costs that box, not the run)."""
from __future__ import annotations

import pytest
import torch

import sinkattn
from test_gpu_backward import COMPILED, _cases, _need, check_deterministic_bits, check_matches_oracle, \
    check_through_autograd
from test_nonfinite import check_rows_past_a_sequence_never_leak

pytestmark = pytest.mark.gpu
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# CuTe prints this (and the encode's arguments) to stderr when cuTensorMapEncodeTiled fails; with NDEBUG it then
# carries on with a zeroed descriptor, so a test of an edge case also asserts it was never printed.
TMA_FAILURE = "Failed to initialize the TMA descriptor"


@pytest.mark.parametrize("case", _cases("sm90"), ids=str)
def test_sm90_backward_matches_oracle(case, rng_seed):
    check_matches_oracle("sm90", case, rng_seed)


@pytest.mark.parametrize("hd_dt", COMPILED["sm90"], ids=lambda x: f"d{x[0]}-{x[1]}")
def test_sm90_backward_deterministic_bits(hd_dt, rng_seed):
    check_deterministic_bits("sm90", hd_dt, rng_seed)


def test_sm90_backward_through_autograd(rng_seed):
    check_through_autograd("sm90", rng_seed)


# The head dims' first dtype: the tiles (and so which rows a tile holds past its sequence) differ by head dim only.
HEADDIMS = [(h, min(d for hh, d in COMPILED["sm90"] if hh == h)) for h in sorted({h for h, _ in COMPILED["sm90"]})]


@pytest.mark.parametrize("mask", [dict(), dict(causal=True, window_size=(40, 0), sink_tokens=3)],
                         ids=["full", "causal-window-sinktok"])
@pytest.mark.parametrize("which", ["q", "k", "dout"])
@pytest.mark.parametrize("poison", [float("inf"), float("nan")], ids=str)
@pytest.mark.parametrize("hd_dt", HEADDIMS, ids=lambda x: f"d{x[0]}-{x[1]}")
def test_sm90_backward_varlen_tails_never_leak(hd_dt, poison, which, mask):
    """Sequence 0 (70 queries, 130 keys) spans two key blocks of 128 and one M tile of 128 (hd64) or two of 64
    (hd128): its last block and last tile end inside sequence 1, whose Q / K / dO rows hold `poison`. Sequences 0
    and 2 must be bit for bit the clean run's (csrc/sm90/bwd_kernel.cuh zero_tail; before it, 0 * inf = NaN in
    sequence 0's dQ, dK, dV). V is the forward's known limit (tests/test_nonfinite.py SM90_VARLEN_V)."""
    _need("sm90")
    hd, dt = hd_dt
    check_rows_past_a_sequence_never_leak("sm90", "cuda", which, poison, headdim=hd, dtype=DTYPES[dt],
                                          lq=(70, 9, 30), lk=(130, 23, 45), **mask)
    torch.cuda.synchronize()


@pytest.mark.parametrize("varlen", [False, True], ids=["padded", "varlen"])
@pytest.mark.parametrize("hd_dt", HEADDIMS, ids=lambda x: f"d{x[0]}-{x[1]}")
def test_sm90_backward_no_query_rows(hd_dt, varlen, capfd):
    """seqlen_q = 0 with seqlen_k = 50 (padded), or every sequence's queries empty (varlen): the launcher returns
    before encoding a TMA descriptor over the empty q / dout (it launched a grid over the key blocks before); dk,
    dv and dsinks are exactly 0, dq is empty, and CuTe never reported a failed encode."""
    _need("sm90")
    hd, dt = hd_dt
    dtype = DTYPES[dt]
    gen = torch.Generator().manual_seed(15)
    if varlen:
        q = torch.randn(0, 4, hd, generator=gen).to(dtype).cuda()
        k, v = (torch.randn(80, 2, hd, generator=gen).to(dtype).cuda() for _ in range(2))
    else:
        q = torch.randn(2, 0, 4, hd, generator=gen).to(dtype).cuda()
        k, v = (torch.randn(2, 50, 2, hd, generator=gen).to(dtype).cuda() for _ in range(2))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    sinks = torch.linspace(-1, 1, 4, device="cuda").requires_grad_()
    if varlen:
        cu_q = torch.zeros(3, dtype=torch.int32, device="cuda")
        cu_k = torch.tensor([0, 50, 80], dtype=torch.int32, device="cuda")
        out, lse = sinkattn.flash_attn_varlen_with_sinks(q, k, v, cu_q, cu_k, 0, 50, sinks, causal=True,
                                                         return_lse=True, backend="sm90")
    else:
        out, lse = sinkattn.flash_attn_with_sinks(q, k, v, sinks, causal=True, return_lse=True, backend="sm90")
    assert out.shape == q.shape and lse.numel() == 0
    (out.float().sum() + lse.sum()).backward()
    torch.cuda.synchronize()
    assert q.grad.shape == q.shape
    for name, g in (("dk", k.grad), ("dv", v.grad), ("dsinks", sinks.grad)):
        assert torch.equal(g, torch.zeros_like(g)), f"{name} is not exactly 0"
    assert TMA_FAILURE not in capfd.readouterr().err
