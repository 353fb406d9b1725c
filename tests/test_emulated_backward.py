"""The sm80 backward kernel (preprocess, main kernel, postprocess), run on the CPU under host emulation.

Gradients dq, dk, dv and dsinks against float64 autograd on the oracle (tests/bwd_cases.py, the tolerance
rule of docs/DESIGN.md section 6), with and without a returned lse in the loss (dlse), over the masks, GQA,
varlen, softcap and sink values; deterministic mode gives identical bits across runs.
"""
from __future__ import annotations

import pytest
import torch

from bwd_cases import BwdCase, bwd_cases, run_bwd_case
from sinkattn import _ext, kernels
from sinkattn._problem import Problem
from sinkattn.mask import Mask

EMU = sorted({(k["headdim"], k["dtype"]) for k in _ext.registry()
              if k["family"] == "sm80-emulated" and k["op"] == "bwd"})
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

pytestmark = pytest.mark.skipif(not EMU, reason="no emulated backward kernels in this build")


def _cases():
    hds = sorted({h for h, _ in EMU})[:1]  # one head dim keeps the file under two minutes on two cores
    dts = [DTYPES[d] for d in sorted({d for _, d in EMU})]
    names = {torch.bfloat16: "bf16", torch.float16: "fp16"}
    cases = [c for c in bwd_cases(hds, dts) if (c.headdim, names[c.dtype]) in EMU]
    # The other compiled head dims run other warp grids (4x2 at 128, 2x4 at 256) and dQ column chunks: one
    # case with every mask feature each.
    for hd, dt in EMU:
        if hd != hds[0] and dt == "bf16":
            cases.append(BwdCase(f"d{hd}-window-cuts-blocks-sinktok-gqa", hd, seqlen_q=150, seqlen_k=200, nheads=2,
                                 nheads_k=1, causal=True, window=(37, 0), sink_tokens=5))
    if (128, "bf16") in EMU:  # head dim 128's 128-key tile over 64-row M tiles: a causal diagonal (bottom-right,
        # fewer queries than keys) that starts inside a key block and crosses two M tiles of it, a tail block of 74
        cases.append(BwdCase("d128-causal-diagonal-inside-wide-key-blocks", 128, seqlen_q=100, seqlen_k=330, nheads=2,
                             nheads_k=1, causal=True))
    if (128, "bf16") in EMU:  # softcap keeps head dim 128 on 64-key blocks (sm80/bwd_tiles.h)
        cases.append(BwdCase("d128-softcap-window-gqa", 128, seqlen_q=150, seqlen_k=200, nheads=2, nheads_k=1,
                             causal=True, window=(37, 0), softcap=30.0))
    if (128, "bf16") in EMU:  # the one-stage configuration of head dim 128 (sm86 / sm89: 99 KB)
        cases.append(BwdCase("d128-sm86-config", 128, seqlen_q=150, seqlen_k=140, nheads=2, nheads_k=1, causal=True,
                             window=(60, 0), sink_tokens=2, max_smem=99 * 1024))
    if (64, "bf16") in EMU:  # a head dim below the compiled one: zero-filled columns, none written back
        cases.append(BwdCase("d48-on-hdim64-causal", 48, seqlen_q=70, seqlen_k=90, causal=True, nheads=2, nheads_k=1))
    if (128, "bf16") in EMU:  # the same at head dim 128 (dQ columns 96..127 are dq_accum padding, never read)
        cases.append(BwdCase("d96-on-hdim128", 96, seqlen_q=140, seqlen_k=90, nheads=2, nheads_k=1))
    return cases


@pytest.mark.parametrize("case", _cases(), ids=str)
def test_emulated_backward_matches_oracle(case, rng_seed):
    run_bwd_case(case, "sm80-emulated", "cpu", kernels.launch_bwd, seed=rng_seed)


@pytest.mark.parametrize("hd", [64, 128])
def test_emulated_backward_deterministic_bits(hd, rng_seed):
    # head dim 64's key blocks are as tall as its M tiles, 128's twice as tall: each M tile's turn counts other blocks
    dt = next((d for h, d in EMU if h == hd), None)
    if dt is None:
        pytest.skip(f"no emulated hdim{hd} backward in this build")
    # M tiles visited by the sink-token key block and, apart from it, by window key blocks: the dq order per
    # M tile ranks both kinds.
    case = BwdCase("det-causal-gqa-sinktok", hd, DTYPES[dt], seqlen_q=260, seqlen_k=300, nheads=2, nheads_k=1,
                   causal=True, window=(70, 0), sink_tokens=3)
    runs = run_bwd_case(case, "sm80-emulated", "cpu", kernels.launch_bwd, seed=rng_seed, deterministic=True, repeats=3)
    for r in runs[1:]:
        for a, b in zip(runs[0], r):
            assert torch.equal(a.view(torch.int16) if a.dtype != torch.float32 else a.view(torch.int32),
                               b.view(torch.int16) if b.dtype != torch.float32 else b.view(torch.int32))


def test_emulated_backward_why_not_serves_bwd():
    from sinkattn import dispatch
    hd, dt = EMU[0]
    q = torch.zeros(1, 4, 2, hd, dtype=DTYPES[dt])
    problem = Problem.of_call("bwd", q, q, None, Mask(0.125))
    assert dispatch.why_not("sm80-emulated", problem) is None
