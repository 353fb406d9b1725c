"""The sm90 backward (preprocess, the main kernel body sm90/bwd_kernel.cuh bwd_cta, postprocess) run on the CPU under
host emulation (csrc/emu/bwd_sm90_emu.h; the CTA model and its checks are tests/test_sm90_emulated.py's).

Gradients dq, dk, dv and dsinks against float64 autograd on the oracle (tests/bwd_cases.py, the tolerance rule of
docs/DESIGN.md section 6), with and without a returned lse in the loss, over the masks, GQA 8:1, varlen with empty
sequences, softcap and sinks 0 / -inf / +30; the deterministic mode bit for bit over runs; the edge cases:
varlen tiles that run into the next sequence's poisoned rows, seqlen_q = 0 with keys.
"""
from __future__ import annotations

import pytest
import torch

from bwd_cases import BwdCase, bwd_cases, run_bwd_case
from sinkattn import _ext, kernels
from test_nonfinite import check_rows_past_a_sequence_never_leak
from test_sm90_emulated import MUTATIONS, check_planted_bug

_REG = _ext.registry() if _ext.loaded() else []
EMU = sorted({(k["headdim"], k["dtype"]) for k in _REG if k["family"] == "sm90-emulated" and k["op"] == "bwd"})
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}

pytestmark = pytest.mark.skipif(not EMU, reason="no emulated sm90 backward kernels in this build")


def _cases():
    hds = sorted({h for h, _ in EMU})
    dts = [DTYPES[d] for d in sorted({d for _, d in EMU})]
    cases = [c for c in bwd_cases(hds, dts) if (c.headdim, NAMES[c.dtype]) in EMU]
    for h in hds:
        if (h, "bf16") not in EMU:
            continue
        cases += [
            BwdCase(f"d{h}-gqa8-window127-sinks0", h, batch=1, seqlen_q=300, seqlen_k=300, nheads=8, nheads_k=1,
                    causal=True, window=(127, 0), sinks="0"),
            BwdCase(f"d{h}-many-m-tiles-sinktok", h, batch=2, seqlen_q=520, seqlen_k=390, nheads=2, nheads_k=2,
                    causal=True, window=(200, 0), sink_tokens=4),
        ]
    return cases


@pytest.mark.parametrize("case", _cases(), ids=str)
def test_sm90_emulated_backward_matches_oracle(case, rng_seed):
    run_bwd_case(case, "sm90-emulated", "cpu", kernels.launch_bwd, seed=rng_seed)


@pytest.mark.parametrize("hd_dt", EMU, ids=lambda x: f"d{x[0]}-{x[1]}")
def test_sm90_emulated_backward_deterministic_bits(hd_dt, rng_seed):
    hd, dt = hd_dt
    case = BwdCase("det-causal-gqa-sinktok", hd, DTYPES[dt], batch=2, seqlen_q=260, seqlen_k=300, nheads=2,
                   nheads_k=1, causal=True, window=(70, 0), sink_tokens=3)
    runs = run_bwd_case(case, "sm90-emulated", "cpu", kernels.launch_bwd, seed=rng_seed, deterministic=True,
                        repeats=3)
    for r in runs[1:]:
        for a, b in zip(runs[0], r):
            assert torch.equal(a.view(torch.int16) if a.dtype != torch.float32 else a.view(torch.int32),
                               b.view(torch.int16) if b.dtype != torch.float32 else b.view(torch.int32))


HEADDIMS = [(h, min(d for hh, d in EMU if hh == h)) for h in sorted({h for h, _ in EMU})]


@pytest.mark.parametrize("which", ["q", "k", "dout"])
@pytest.mark.parametrize("poison", [float("inf"), float("nan")], ids=str)
@pytest.mark.parametrize("hd_dt", HEADDIMS, ids=lambda x: f"d{x[0]}-{x[1]}")
def test_sm90_emulated_backward_varlen_tails_never_leak(hd_dt, poison, which):
    """Sequence 0's last key block and last M tile end inside sequence 1, whose rows hold `poison`: sequences 0 and 2
    are bit for bit the clean run's (bwd_kernel.cuh zero_tail)."""
    hd, dt = hd_dt
    check_rows_past_a_sequence_never_leak("sm90-emulated", "cpu", which, poison, headdim=hd, dtype=DTYPES[dt],
                                          lq=(70, 9, 30), lk=(130, 23, 45), causal=True, window_size=(40, 0),
                                          sink_tokens=3)


# The forward's planted bugs (tests/test_sm90_emulated.py MUTATIONS, with what each may be reported as) in the
# backward's protocol and layout pieces: its barriers, its stage rings, its dS^T writes read by wgmma (the fence),
# its swizzled TMA boxes and descriptors.


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_a_planted_bug_in_the_backward_fails(mutation, monkeypatch, rng_seed):
    hd, dt = EMU[0]
    case = BwdCase(f"d{hd}-mutation-{mutation}", hd, DTYPES[dt], batch=1, seqlen_q=140, seqlen_k=200, nheads=2,
                   nheads_k=1, causal=True)
    check_planted_bug(mutation, monkeypatch,
                      lambda: run_bwd_case(case, "sm90-emulated", "cpu", kernels.launch_bwd, seed=rng_seed))
