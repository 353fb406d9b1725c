"""The sm90 forward kernel (TMA + wgmma, warp-specialized, persistent) against the float64 oracle.

Skipped without a cc 9.0 GPU. Every case the sm80 kernel is held to (tests/kernel_cases.py) runs here too,
plus shapes aimed at the pipeline and the persistent scheduler: many tiles per CTA, a single tile in all,
varlen batches of wildly different lengths, more key blocks than pipeline stages many times over; and the empty
sides (no query row, no key), where no TMA descriptor may be encoded over an empty tensor.
"""
from __future__ import annotations

import pytest
import torch

from kernel_cases import Case, kernel_cases, run_case
from sinkattn import _ext, kernels
from sinkattn.layout import kernel_headdim
from sinkattn._problem import Problem
from sinkattn.mask import Mask

pytestmark = pytest.mark.gpu

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}
COMPILED = sorted({(k["headdim"], k["dtype"]) for k in _ext.registry() if k["family"] == "sm90" and k["op"] == "fwd"})


def _served(c: Case) -> bool:
    return (kernel_headdim(c.headdim), NAMES[c.dtype]) in COMPILED


def _cases():
    hds = sorted({h for h, _ in COMPILED})
    dts = [DTYPES[d] for d in sorted({d for _, d in COMPILED})]
    cases = [c for c in kernel_cases(hds, dts) if _served(c)]
    for h, d in COMPILED:
        dt = DTYPES[d]
        cases += [
            # 3 x 8 heads x 8 M tiles = 192 tiles: more than one per CTA of the persistent grid.
            Case(f"d{h}-{d}-many-tiles", h, dt, batch=3, seqlen_q=1000, seqlen_k=1531, nheads=8, nheads_k=2,
                 causal=True, window=(300, 0), sink_tokens=4),
            # One tile in all, whose key range runs through the pipeline's stages many times.
            Case(f"d{h}-{d}-one-tile-long-keys", h, dt, batch=1, seqlen_q=77, seqlen_k=3000, nheads=1, nheads_k=1),
            Case(f"d{h}-{d}-varlen-wild", h, dt, varlen=[(1, 1), (1500, 2100), (0, 9), (129, 4000), (7, 0),
                                                          (300, 300), (2, 1800)],
                 nheads=4, nheads_k=1, causal=True),
            Case(f"d{h}-{d}-noncausal-gqa-softcap", h, dt, batch=2, seqlen_q=513, seqlen_k=700, nheads=6, nheads_k=2,
                 softcap=30.0),
        ]
    return cases


def _need_sm90():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs a cc 9.0 GPU")
    if not COMPILED:
        pytest.skip("no sm90 kernels in this build (SINKATTN_CUDA_ARCHS without 90a)")


@pytest.mark.parametrize("case", _cases(), ids=str)
def test_sm90_forward_matches_oracle(case, rng_seed):
    _need_sm90()
    run_case(case, "sm90", "cuda", kernels.launch_fwd, seed=rng_seed)
    torch.cuda.synchronize()


def test_sm90_is_what_auto_picks_and_captures_in_a_graph(rng_seed):
    _need_sm90()
    import sinkattn
    from sinkattn import dispatch

    hd, dt = COMPILED[0]
    q = torch.randn(2, 300, 8, hd, device="cuda", dtype=DTYPES[dt])
    k = torch.randn(2, 300, 2, hd, device="cuda", dtype=DTYPES[dt])
    v = torch.randn_like(k)
    sinks = torch.randn(8, device="cuda")
    kw = dict(causal=True, window_size=(127, 0))
    ref = sinkattn.flash_attn_with_sinks(q.cpu().float(), k.cpu().float(), v.cpu().float(), sinks.cpu(),
                                         backend="reference", **kw)
    out = sinkattn.flash_attn_with_sinks(q, k, v, sinks, backend="auto", **kw)
    assert (out.float().cpu() - ref).abs().max().item() < 2e-2
    problem = Problem.of_call("fwd", q, k, sinks, Mask(q.shape[-1] ** -0.5, 127, 0))
    assert dispatch.choose(problem, "auto") == "sm90"
    static_out = torch.empty_like(out)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        sinkattn.flash_attn_with_sinks(q, k, v, sinks, backend="sm90", **kw)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_out.copy_(sinkattn.flash_attn_with_sinks(q, k, v, sinks, backend="sm90", **kw))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, out)


def test_sm90_broadcast_kv_strides(rng_seed):
    """K/V expanded over heads (stride 0) cannot go into a TMA descriptor: the bridge copies them first."""
    _need_sm90()
    import sinkattn

    hd, dt = COMPILED[0]
    q = torch.randn(1, 200, 4, hd, device="cuda", dtype=DTYPES[dt])
    k = torch.randn(1, 200, 1, hd, device="cuda", dtype=DTYPES[dt]).expand(1, 200, 2, hd)
    v = torch.randn(1, 200, 1, hd, device="cuda", dtype=DTYPES[dt]).expand(1, 200, 2, hd)
    assert k.stride(2) == 0
    out = sinkattn.flash_attn_with_sinks(q, k, v, causal=True, backend="sm90")
    ref = sinkattn.flash_attn_with_sinks(q.cpu().float(), k.cpu().float(), v.cpu().float(), causal=True,
                                         backend="reference")
    assert (out.float().cpu() - ref).abs().max().item() < 2e-2


@pytest.mark.parametrize("side", ["no-queries", "no-keys", "varlen-no-keys"])
def test_sm90_forward_empty_side(side, capfd):
    """seqlen_q = 0 (no tile: the launcher returns before encoding any descriptor), or no key at all (padded
    seqlen_k = 0, or every varlen sequence's keys empty: the tiles visit no key block, and K / V get descriptors
    over a row of q, not over the empty k / v). Out and lse are the reference's (out 0, lse the sink), and CuTe
    never reported a failed encode (with NDEBUG it would carry on with a zeroed descriptor)."""
    _need_sm90()
    import sinkattn

    hd, dt = COMPILED[0]
    gen = torch.Generator().manual_seed(16)
    sq, sk = (0, 40) if side == "no-queries" else (37, 0)
    sinks = torch.linspace(-1, 1, 4)
    if side == "varlen-no-keys":
        q = torch.randn(sq * 2, 4, hd, generator=gen).to(DTYPES[dt])
        k = torch.randn(0, 2, hd, generator=gen).to(DTYPES[dt])
        cu_q = torch.tensor([0, sq, 2 * sq], dtype=torch.int32)
        cu_k = torch.zeros(3, dtype=torch.int32)
        run = lambda dev, backend: sinkattn.flash_attn_varlen_with_sinks(  # noqa: E731
            q.to(dev), k.to(dev), k.to(dev), cu_q.to(dev), cu_k.to(dev), sq, 0, sinks.to(dev), return_lse=True,
            backend=backend)
    else:
        q = torch.randn(2, sq, 4, hd, generator=gen).to(DTYPES[dt])
        k = torch.randn(2, sk, 2, hd, generator=gen).to(DTYPES[dt])
        run = lambda dev, backend: sinkattn.flash_attn_with_sinks(  # noqa: E731
            q.to(dev), k.to(dev), k.to(dev), sinks.to(dev), return_lse=True, backend=backend)
    out, lse = run("cuda", "sm90")
    torch.cuda.synchronize()
    ref_out, ref_lse = run("cpu", "reference")
    assert torch.equal(out.cpu(), ref_out.to(out.dtype))
    assert torch.allclose(lse.cpu(), ref_lse.float(), rtol=1e-6, atol=1e-6)
    assert "Failed to initialize the TMA descriptor" not in capfd.readouterr().err
