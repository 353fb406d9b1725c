"""The compiled sm80 backward kernels against float64 autograd on the oracle (DESIGN.md section 6). Skipped
without a GPU. Same cases as the emulated backward tests (tests/bwd_cases.py) on every compiled head dim and
dtype, plus a large case; deterministic mode gives identical bits across 3 runs; the public autograd path.
"""
from __future__ import annotations

import pytest
import torch

from bwd_cases import BwdCase, bwd_cases, run_bwd_case
from sinkattn import _ext, kernels

pytestmark = pytest.mark.gpu

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
COMPILED = sorted({(k["headdim"], k["dtype"]) for k in _ext.registry() if k["family"] == "sm80" and k["op"] == "bwd"})


def _need_gpu():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 8:
        pytest.skip("needs a cc >= 8.0 GPU")
    if not COMPILED:
        pytest.skip("no sm80 backward kernels compiled")


def _cases():
    hds = sorted({h for h, _ in COMPILED})
    dts = [DTYPES[d] for d in sorted({d for _, d in COMPILED})]
    names = {torch.bfloat16: "bf16", torch.float16: "fp16"}
    cases = [c for c in bwd_cases(hds, dts) if (c.headdim, names[c.dtype]) in COMPILED]
    # Many CTAs at once (the float64 oracle on the CPU bounds the size: pytest -m gpu has two minutes).
    cases += [BwdCase(f"d{h}-large-{d}", h, DTYPES[d], batch=2, seqlen_q=500, seqlen_k=613, nheads=4, nheads_k=2,
                      causal=True, window=(300, 0), sink_tokens=4) for h, d in COMPILED]
    return cases


@pytest.mark.parametrize("case", _cases(), ids=str)
def test_sm80_backward_matches_oracle(case, rng_seed):
    _need_gpu()
    run_bwd_case(case, "sm80", "cuda", kernels.launch_bwd, seed=rng_seed)
    torch.cuda.synchronize()


@pytest.mark.parametrize("hd_dt", COMPILED, ids=lambda x: f"d{x[0]}-{x[1]}")
def test_sm80_backward_deterministic_bits(hd_dt, rng_seed):
    _need_gpu()
    hd, dt = hd_dt
    case = BwdCase("det", hd, DTYPES[dt], batch=2, seqlen_q=300, seqlen_k=400, nheads=4, nheads_k=2, causal=True,
                   window=(120, 0), sink_tokens=3)
    runs = run_bwd_case(case, "sm80", "cuda", kernels.launch_bwd, seed=rng_seed, deterministic=True, repeats=3)
    for r in runs[1:]:
        for a, b in zip(runs[0], r):
            assert torch.equal(a.view(torch.int16) if a.dtype != torch.float32 else a.view(torch.int32),
                               b.view(torch.int16) if b.dtype != torch.float32 else b.view(torch.int32))


def test_sm80_backward_through_autograd(rng_seed):
    _need_gpu()
    import sinkattn

    hd, dt = COMPILED[0]
    q = torch.randn(2, 200, 4, hd, device="cuda", dtype=DTYPES[dt], requires_grad=True)
    k = torch.randn(2, 200, 2, hd, device="cuda", dtype=DTYPES[dt], requires_grad=True)
    v = torch.randn(2, 200, 2, hd, device="cuda", dtype=DTYPES[dt], requires_grad=True)
    sinks = torch.randn(4, device="cuda", requires_grad=True)
    out = sinkattn.flash_attn_with_sinks(q, k, v, sinks, causal=True, backend="sm80")
    out.float().square().sum().backward()
    leaves = [t.detach().cpu().float().requires_grad_() for t in (q, k, v, sinks)]
    ref = sinkattn.flash_attn_with_sinks(*leaves, causal=True, backend="reference")
    ref.square().sum().backward()
    for got, want in zip((q.grad, k.grad, v.grad, sinks.grad), leaves):
        assert (got.float().cpu() - want.grad).abs().max().item() < 5e-2 * max(1.0, want.grad.abs().max().item())
