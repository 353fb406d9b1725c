"""The compiled sm80 backward kernels against float64 autograd on the oracle (docs/DESIGN.md section 6). Skipped without
a GPU. Same cases as the emulated backward tests (tests/bwd_cases.py) on every compiled head dim and dtype, plus a
large case; deterministic mode gives identical bits across 3 runs; the public autograd path. The helpers serve
tests/test_gpu_sm90_backward.py too (the sm90 backward: the same tests plus its own cases, in a file of its own so
that bench/gpu/check.sh runs it in a time box of its own).
"""
from __future__ import annotations

import pytest
import torch

from bwd_cases import BwdCase, bwd_cases, run_bwd_case
from sinkattn import _ext, kernels

pytestmark = pytest.mark.gpu

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
FAMILIES = ("sm80", "sm90")
COMPILED = {f: sorted({(k["headdim"], k["dtype"]) for k in _ext.registry() if k["family"] == f and k["op"] == "bwd"})
            for f in FAMILIES}


def _need(family):
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    cc = torch.cuda.get_device_capability()
    if family == "sm80" and cc[0] < 8:
        pytest.skip("needs a cc >= 8.0 GPU")
    if family == "sm90" and cc != (9, 0):
        pytest.skip("the sm90 backward needs a cc 9.0 GPU")
    if not COMPILED[family]:
        pytest.skip(f"no {family} backward kernels compiled")


def _cases(family):
    compiled = COMPILED[family]
    hds = sorted({h for h, _ in compiled})
    dts = [DTYPES[d] for d in sorted({d for _, d in compiled})]
    names = {torch.bfloat16: "bf16", torch.float16: "fp16"}
    cases = [c for c in bwd_cases(hds, dts) if (c.headdim, names[c.dtype]) in compiled]
    # Many CTAs at once (the float64 oracle on the CPU bounds the size: pytest -m gpu has two minutes).
    cases += [BwdCase(f"d{h}-large-{d}", h, DTYPES[d], batch=2, seqlen_q=500, seqlen_k=613, nheads=4, nheads_k=2,
                      causal=True, window=(300, 0), sink_tokens=4) for h, d in compiled]
    if family == "sm90":
        for h in hds:
            cases += [
                # More CTAs than an H200 has SMs (132): 9 key blocks x 8 heads x 2.
                BwdCase(f"d{h}-many-tiles", h, batch=2, seqlen_q=1100, seqlen_k=1100, nheads=8, nheads_k=8,
                        causal=True),
                BwdCase(f"d{h}-varlen-0-to-4000", h, varlen=[(0, 0), (1, 1), (4000, 4000), (0, 7), (333, 1200)],
                        nheads=1, nheads_k=1, causal=True),
                BwdCase(f"d{h}-gptoss-gqa8-window127", h, seqlen_q=300, seqlen_k=300, nheads=64, nheads_k=8,
                        causal=True, window=(127, 0)),
                BwdCase(f"d{h}-gptoss-gqa8-causal", h, seqlen_q=257, seqlen_k=257, nheads=64, nheads_k=8, causal=True),
                BwdCase(f"d{h}-sinks-zero", h, seqlen_q=200, seqlen_k=210, sinks="0"),
                BwdCase(f"d{h}-sinks-neginf-causal", h, seqlen_q=200, seqlen_k=210, causal=True, sinks="-inf"),
                BwdCase(f"d{h}-sinks+30-window", h, seqlen_q=200, seqlen_k=210, window=(64, 0), sinks="+30"),
            ]
    return cases


@pytest.mark.parametrize("case", _cases("sm80"), ids=str)
def test_sm80_backward_matches_oracle(case, rng_seed):
    check_matches_oracle("sm80", case, rng_seed)


@pytest.mark.parametrize("hd_dt", COMPILED["sm80"], ids=lambda x: f"d{x[0]}-{x[1]}")
def test_sm80_backward_deterministic_bits(hd_dt, rng_seed):
    check_deterministic_bits("sm80", hd_dt, rng_seed)


def test_sm80_backward_through_autograd(rng_seed):
    check_through_autograd("sm80", rng_seed)


def check_matches_oracle(family, case, rng_seed):
    _need(family)
    run_bwd_case(case, family, "cuda", kernels.launch_bwd, seed=rng_seed)
    torch.cuda.synchronize()


def check_deterministic_bits(family, hd_dt, rng_seed):
    _need(family)
    hd, dt = hd_dt
    case = BwdCase("det", hd, DTYPES[dt], batch=2, seqlen_q=300, seqlen_k=400, nheads=4, nheads_k=2, causal=True,
                   window=(120, 0), sink_tokens=3)
    runs = run_bwd_case(case, family, "cuda", kernels.launch_bwd, seed=rng_seed, deterministic=True, repeats=3)
    for r in runs[1:]:
        for a, b in zip(runs[0], r):
            assert torch.equal(a.view(torch.int16) if a.dtype != torch.float32 else a.view(torch.int32),
                               b.view(torch.int16) if b.dtype != torch.float32 else b.view(torch.int32))


def check_through_autograd(family, rng_seed):
    _need(family)
    import sinkattn

    hd, dt = COMPILED[family][0]
    q = torch.randn(2, 200, 4, hd, device="cuda", dtype=DTYPES[dt], requires_grad=True)
    k = torch.randn(2, 200, 2, hd, device="cuda", dtype=DTYPES[dt], requires_grad=True)
    v = torch.randn(2, 200, 2, hd, device="cuda", dtype=DTYPES[dt], requires_grad=True)
    sinks = torch.randn(4, device="cuda", requires_grad=True)
    out = sinkattn.flash_attn_with_sinks(q, k, v, sinks, causal=True, backend=family)
    out.float().square().sum().backward()
    leaves = [t.detach().cpu().float().requires_grad_() for t in (q, k, v, sinks)]
    ref = sinkattn.flash_attn_with_sinks(*leaves, causal=True, backend="reference")
    ref.square().sum().backward()
    for got, want in zip((q.grad, k.grad, v.grad, sinks.grad), leaves):
        assert (got.float().cpu() - want.grad).abs().max().item() < 5e-2 * max(1.0, want.grad.abs().max().item())
