"""The compiled CUDA kernels against the float64 oracle (docs/DESIGN.md section 6). Skipped without a GPU.

Every case of tests/kernel_cases.py runs on every compiled head dim and dtype of the sm80 family; on a
cc 9.0 device the sm80 path is forced too, so one H200 tests it. Inputs are fresh each run and outputs are
poisoned with NaN before the call.
"""
from __future__ import annotations

import pytest
import torch

from kernel_cases import Case, kernel_cases, run_case
from sinkattn import _ext, kernels
from sinkattn.layout import kernel_headdim

pytestmark = pytest.mark.gpu

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
COMPILED = sorted({(k["headdim"], k["dtype"]) for k in _ext.registry() if k["family"] == "sm80" and k["op"] == "fwd"})


def _cases():
    hds = sorted({h for h, _ in COMPILED})
    dts = [DTYPES[d] for d in sorted({d for _, d in COMPILED})]
    cases = [c for c in kernel_cases(hds, dts)
             if (kernel_headdim(c.headdim), {torch.bfloat16: "bf16", torch.float16: "fp16"}[c.dtype])
             in COMPILED]
    cases += [Case(f"d{h}-large-{d}", h, DTYPES[d], batch=3, seqlen_q=1000, seqlen_k=1531, nheads=8, nheads_k=2,
                   causal=True, window=(300, 0), sink_tokens=4) for h, d in COMPILED]
    if (256, "bf16") in COMPILED:
        cases.append(Case("d256-sm86-config", 256, seqlen_q=300, seqlen_k=333, causal=True, max_smem=99 * 1024))
    # Maxima rising as the key blocks are visited: the prefill tiles' lazy rebase, a warp vote and a branch here
    # (test_emulated_kernel.py RISING_MAX_CASES has why).
    for h in sorted({h for h, _ in COMPILED}):
        cases += [Case(f"d{h}-rising-max", h, seqlen_q=300, seqlen_k=700, key_gain=2.0, sinks="random"),
                  Case(f"d{h}-rising-max-steep-causal", h, seqlen_q=200, seqlen_k=500, key_gain=12.0, causal=True)]
    return cases


@pytest.mark.parametrize("case", _cases(), ids=str)
def test_sm80_forward_matches_oracle(case, rng_seed):
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 8:
        pytest.skip("needs a cc >= 8.0 GPU")
    run_case(case, "sm80", "cuda", kernels.launch_fwd, seed=rng_seed)
    torch.cuda.synchronize()


def test_sm80_through_public_api_and_graph_capture(rng_seed):
    import sinkattn

    if not COMPILED:
        pytest.skip("no sm80 kernels compiled")
    hd, dt = COMPILED[0]
    q = torch.randn(2, 256, 8, hd, device="cuda", dtype=DTYPES[dt])
    k = torch.randn(2, 256, 2, hd, device="cuda", dtype=DTYPES[dt])
    v = torch.randn_like(k)
    sinks = torch.randn(8, device="cuda")
    ref = sinkattn.flash_attn_with_sinks(q.cpu().float(), k.cpu().float(), v.cpu().float(), sinks.cpu(), causal=True,
                                         window_size=(127, 0), backend="reference")
    out = sinkattn.flash_attn_with_sinks(q, k, v, sinks, causal=True, window_size=(127, 0), backend="sm80")
    assert (out.float().cpu() - ref).abs().max().item() < 2e-2
    # No host synchronisation or allocation outside the caching allocator: the op captures in a CUDA graph.
    static_out = torch.empty_like(out)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        sinkattn.flash_attn_with_sinks(q, k, v, sinks, causal=True, window_size=(127, 0), backend="sm80")
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        static_out.copy_(sinkattn.flash_attn_with_sinks(q, k, v, sinks, causal=True, window_size=(127, 0),
                                                        backend="sm80"))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, out)
