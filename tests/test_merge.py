"""merge_attn_states: the merge of two partial (out, lse) states with the sink counted once.

CPU: the reference path against float64 math written here from docs/DESIGN.md section 1:

    lse = log(exp(lse_a) + exp(lse_b) + exp(sink))
    out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b      (a part with lse -inf contributes 0)

GPU (marked): the CUDA merge kernel against the same math and the reference path.
"""
from __future__ import annotations

import math

import pytest
import torch

import sinkattn
from sinkattn import SinkattnError, merge_attn_states
from sinkattn.merge import merge_reference

NEG_INF = float("-inf")


def merge_f64(out_a, lse_a, out_b, lse_b, sinks=None):
    """The contract in float64. out (b, s, h, d), lse (b, h, s)."""
    la, lb = lse_a.double(), lse_b.double()
    ls = (torch.full_like(la, NEG_INF) if sinks is None else sinks.double().view(1, -1, 1).expand_as(la))
    lse = torch.logsumexp(torch.stack([la, lb, ls]), 0)  # all three -inf -> -inf
    lse_safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    wa = torch.where(la == NEG_INF, torch.zeros_like(la), torch.exp(la - lse_safe)).transpose(1, 2)[..., None]
    wb = torch.where(lb == NEG_INF, torch.zeros_like(lb), torch.exp(lb - lse_safe)).transpose(1, 2)[..., None]
    oa = torch.where(wa == 0, torch.zeros((), dtype=torch.float64), out_a.double())
    ob = torch.where(wb == 0, torch.zeros((), dtype=torch.float64), out_b.double())
    return wa * oa + wb * ob, lse


def _inputs(b, s, h, d, dtype, gen, device="cpu", empty_frac=0.2):
    out_a = torch.randn(b, s, h, d, generator=gen).to(dtype)
    out_b = torch.randn(b, s, h, d, generator=gen).to(dtype)
    lse_a = torch.randn(b, h, s, generator=gen) * 4
    lse_b = torch.randn(b, h, s, generator=gen) * 4
    # partials that saw no key: lse -inf and garbage (NaN / inf) out that must not leak
    ea = torch.rand(b, h, s, generator=gen) < empty_frac
    eb = torch.rand(b, h, s, generator=gen) < empty_frac
    lse_a[ea] = NEG_INF
    lse_b[eb] = NEG_INF
    out_a.masked_fill_(ea.transpose(1, 2)[..., None].expand_as(out_a), float("nan"))
    out_b.masked_fill_(eb.transpose(1, 2)[..., None].expand_as(out_b), float("inf"))
    return [t.to(device) for t in (out_a, lse_a, out_b, lse_b)]


def _sinks(kind, h, gen):
    if kind is None:
        return None
    if kind == "random":
        return torch.randn(h, generator=gen) * 3
    return torch.full((h,), float(kind))


TOL = {torch.float32: (2e-6, 2e-6), torch.bfloat16: (8e-3, 8e-3), torch.float16: (1e-3, 1e-3)}


def _check(out, lse, want_out, want_lse, dtype, what):
    assert out.dtype == dtype and lse.dtype == torch.float32, what
    assert out.shape == want_out.shape and lse.shape == want_lse.shape, what
    assert not torch.isnan(out).any(), f"{what}: NaN in out"
    assert not torch.isnan(lse).any(), f"{what}: NaN in lse"
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(out.double().cpu(), want_out, rtol=rtol, atol=atol, msg=lambda m: f"{what}: out: {m}")
    inf = torch.isinf(want_lse)
    assert torch.equal(lse.cpu()[inf].double(), want_lse[inf]), f"{what}: -inf lse rows"
    torch.testing.assert_close(lse.double().cpu()[~inf], want_lse[~inf], rtol=2e-6, atol=2e-6,
                               msg=lambda m: f"{what}: lse: {m}")


# ---- CPU (reference path) -----------------------------------------------------------------------------------
@pytest.mark.parametrize("sinks", [None, NEG_INF, 30.0, 0.0, "random"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_merge_cpu_against_float64(sinks, dtype, rng_seed):
    g = torch.Generator().manual_seed(rng_seed)
    b, s, h, d = 2, 7, 3, 40
    out_a, lse_a, out_b, lse_b = _inputs(b, s, h, d, dtype, g)
    sk = _sinks(sinks, h, g)
    out, lse = merge_attn_states(out_a, lse_a, out_b, lse_b, sk)
    want_out, want_lse = merge_f64(out_a, lse_a, out_b, lse_b, sk)
    _check(out, lse, want_out, want_lse, dtype, f"seed {rng_seed} sinks={sinks} {dtype}")


def test_merge_cpu_special_rows():
    h = 4
    out_a = torch.arange(8.0).view(1, 1, h, 2) + 1
    out_b = -torch.arange(8.0).view(1, 1, h, 2) - 1
    # head 0: both parts empty, no sink            -> out 0, lse -inf
    # head 1: both parts empty, sink 2.0          -> out 0, lse 2.0
    # head 2: a empty (NaN out), b lse 0, sink -inf -> out = out_b exactly, lse 0
    # head 3: lse 0 / 0, sink +30                 -> weights exp(-30)-ish, lse ~ 30
    lse_a = torch.tensor([NEG_INF, NEG_INF, NEG_INF, 0.0]).view(1, h, 1)
    lse_b = torch.tensor([NEG_INF, NEG_INF, 0.0, 0.0]).view(1, h, 1)
    out_a[0, 0, 2] = float("nan")
    out_a[0, 0, 0] = float("nan")
    out_b[0, 0, 0] = float("inf")
    sinks = torch.tensor([NEG_INF, 2.0, NEG_INF, 30.0])
    out, lse = merge_attn_states(out_a, lse_a, out_b, lse_b, sinks)
    assert out[0, 0, 0].tolist() == [0.0, 0.0] and out[0, 0, 1].tolist() == [0.0, 0.0]
    assert lse[0, 0, 0].item() == NEG_INF and lse[0, 1, 0].item() == 2.0
    assert torch.equal(out[0, 0, 2], out_b[0, 0, 2]) and lse[0, 2, 0].item() == 0.0
    w = 1.0 / (2.0 + math.exp(30.0))
    torch.testing.assert_close(out[0, 0, 3].double(), (w * (out_a[0, 0, 3] + out_b[0, 0, 3])).double(),
                               rtol=1e-5, atol=1e-30)
    assert abs(lse[0, 3, 0].item() - math.log(2.0 + math.exp(30.0))) < 1e-5
    # without sinks at all the same as sinks = -inf everywhere
    o1, l1 = merge_attn_states(out_a, lse_a, out_b, lse_b)
    o2, l2 = merge_attn_states(out_a, lse_a, out_b, lse_b, torch.full((h,), NEG_INF))
    assert torch.equal(o1, o2) and torch.equal(l1, l2)


def test_merge_equals_attention_over_the_union(rng_seed):
    """Split one attention row's keys in two, merge: equals attention over all keys with the sink."""
    g = torch.Generator().manual_seed(rng_seed)
    b, h, s, d, n = 1, 2, 3, 8, 11
    scores = torch.randn(b, h, s, n, generator=g, dtype=torch.float64) * 2
    v = torch.randn(b, h, n, d, generator=g, dtype=torch.float64)
    sinks = torch.randn(h, generator=g, dtype=torch.float64)

    def part(sl):
        lse = torch.logsumexp(scores[..., sl], -1)
        out = torch.einsum("bhsn,bhnd->bshd", torch.softmax(scores[..., sl], -1), v[:, :, sl])
        return out.float(), lse.float()

    oa, la = part(slice(0, 4))
    ob, lb = part(slice(4, n))
    out, lse = merge_attn_states(oa, la, ob, lb, sinks.float())
    full = torch.cat([scores, sinks.view(1, h, 1, 1).expand(b, h, s, 1)], -1)
    want_lse = torch.logsumexp(full, -1)
    want_out = torch.einsum("bhsn,bhnd->bshd", torch.exp(scores - want_lse[..., None]), v)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.double(), want_out, rtol=1e-5, atol=1e-5)


def test_merge_strided_inputs(rng_seed):
    g = torch.Generator().manual_seed(rng_seed)
    b, s, h, d = 2, 5, 3, 16
    big = torch.randn(b, h, s, 2 * d, generator=g)
    out_a = big[..., :d].transpose(1, 2)          # (b, s, h, d), last dim contiguous, others not
    out_b = big[..., d:].transpose(1, 2)
    lse_a = torch.randn(b, s, h, generator=g).transpose(1, 2)  # (b, h, s), non-contiguous
    lse_b = torch.randn(b, h, s, generator=g)
    sinks = torch.randn(2 * h, generator=g)[::2]
    out, lse = merge_attn_states(out_a, lse_a, out_b, lse_b, sinks)
    want_out, want_lse = merge_f64(out_a, lse_a, out_b, lse_b, sinks)
    _check(out, lse, want_out, want_lse, torch.float32, f"seed {rng_seed} strided")
    assert out.is_contiguous() and lse.is_contiguous()


def test_merge_sinks_dtypes_and_lse_dtype():
    g = torch.Generator().manual_seed(0)
    out_a, lse_a, out_b, lse_b = _inputs(1, 4, 2, 8, torch.bfloat16, g, empty_frac=0.0)
    for sd in (torch.float32, torch.bfloat16, torch.float16):
        sk = torch.tensor([0.5, -1.25]).to(sd)
        out, lse = merge_attn_states(out_a, lse_a, out_b, lse_b, sk)
        want_out, want_lse = merge_f64(out_a, lse_a, out_b, lse_b, sk.float())
        _check(out, lse, want_out, want_lse, torch.bfloat16, f"sinks {sd}")
    # lse given in float64 still comes back float32
    out, lse = merge_attn_states(out_a, lse_a.double(), out_b, lse_b.double())
    assert lse.dtype == torch.float32


def test_merge_custom_op_and_fake():
    assert hasattr(torch.ops.sinkattn, "merge_attn_states")
    g = torch.Generator().manual_seed(1)
    args = _inputs(1, 3, 2, 8, torch.float32, g, empty_frac=0.0)
    torch.library.opcheck(torch.ops.sinkattn.merge_attn_states, (*args, torch.zeros(2)),
                          test_utils=("test_schema", "test_faketensor"))


def test_merge_reference_matches_public_entry():
    g = torch.Generator().manual_seed(2)
    args = _inputs(2, 3, 2, 8, torch.float16, g)
    o1, l1 = merge_reference(*args, torch.ones(2))
    o2, l2 = merge_attn_states(*args, torch.ones(2))
    assert torch.equal(o1, o2) and torch.equal(l1, l2)


@pytest.mark.needs_ext
def test_merge_plus_inf_lse_no_nan_and_same_as_kernel_math():
    out_a = torch.ones(1, 1, 1, 4)
    out_b = torch.full((1, 1, 1, 4), 2.0)
    lse_a = torch.full((1, 1, 1), math.inf)
    lse_b = torch.zeros(1, 1, 1)
    out, lse = merge_attn_states(out_a, lse_a, out_b, lse_b)
    wa, wb, wl = sinkattn._ext._C.merge_weights(lse_a.view(-1), lse_b.view(-1), torch.tensor(NEG_INF))
    assert not torch.isnan(out).any()
    assert torch.equal(out.view(-1), wa * out_a.view(-1) + wb * out_b.view(-1)) and lse.item() == wl.item()


# ---- errors name the argument -------------------------------------------------------------------------------
def _err(exc, *args, **kw):
    with pytest.raises(exc) as e:
        merge_attn_states(*args, **kw)
    assert isinstance(e.value, SinkattnError), f"{type(e.value).__name__} is not a SinkattnError"
    return str(e.value)


def test_merge_errors():
    o = torch.zeros(1, 2, 3, 4)
    l = torch.zeros(1, 3, 2)
    msg = _err(TypeError, o.numpy(), l, o, l)
    assert "out_a" in msg and "Tensor" in msg
    msg = _err(TypeError, o, l, o, [0.0])
    assert "lse_b" in msg
    msg = _err(ValueError, o, l, o[:, :1], l)
    assert "out_a" in msg and "out_b" in msg and "(1, 1, 3, 4)" in msg
    msg = _err(ValueError, o[0], l, o[0], l)
    assert "out_a" in msg and "(batch, seqlen, nheads, headdim)" in msg
    msg = _err(TypeError, o, l, o.half(), l)
    assert "out_a" in msg and "float16" in msg and "float32" in msg
    msg = _err(TypeError, o.to(torch.float64), l, o.to(torch.float64), l)
    assert "float64" in msg and "bfloat16" in msg
    msg = _err(ValueError, o, l.transpose(1, 2), o, l)
    assert "lse_a" in msg and "(1, 3, 2)" in msg and "(1, 2, 3)" in msg
    msg = _err(ValueError, o, l, o, l[:, :2])
    assert "lse_b" in msg and "(1, 2, 2)" in msg
    msg = _err(TypeError, o, l, o, l.long())
    assert "lse_b" in msg and "int64" in msg
    msg = _err(ValueError, o, l, o, l, torch.zeros(4))
    assert "sinks" in msg and "(3,)" in msg and "(4,)" in msg
    msg = _err(ValueError, o, l, o, l, sinks=[0.0, 0.0, 0.0])
    assert "sinks" in msg and "list" in msg
    msg = _err(ValueError, o, l, o, l, torch.zeros(3, device="meta"))
    assert "device" in msg and "meta" in msg
    strided = torch.zeros(1, 2, 3, 8)[..., ::2]
    msg = _err(ValueError, strided, l, o, l)
    assert "out_a" in msg and "contiguous" in msg


def test_merge_integer_sinks_rejected():
    o = torch.zeros(1, 2, 3, 4)
    l = torch.zeros(1, 3, 2)
    msg = _err(TypeError, o, l, o, l, torch.zeros(3, dtype=torch.int64))
    assert "sinks" in msg


# ---- GPU: the CUDA kernel -------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("sinks", [None, NEG_INF, 30.0, "random"])
def test_merge_cuda_kernel_against_reference(dtype, sinks, rng_seed):
    C = sinkattn._ext.require()
    g = torch.Generator().manual_seed(rng_seed)
    b, s, h, d = 3, 37, 5, 72  # head dim not a multiple of 32; batch*seqlen*heads not a multiple of 4
    out_a, lse_a, out_b, lse_b = _inputs(b, s, h, d, dtype, g, device="cuda")
    sk = _sinks(sinks, h, g)
    sk = None if sk is None else sk.cuda()
    out, lse = C.merge_states(out_a, lse_a, out_b, lse_b, sk)  # the kernel itself, not the dispatch
    want_out, want_lse = merge_f64(out_a.cpu(), lse_a.cpu(), out_b.cpu(), lse_b.cpu(), None if sk is None else sk.cpu())
    _check(out, lse, want_out, want_lse, dtype, f"seed {rng_seed} cuda {dtype} sinks={sinks}")
    ref_out, ref_lse = merge_reference(out_a, lse_a, out_b, lse_b, sk)
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=TOL[dtype][0], atol=TOL[dtype][1])
    # the public entry takes the kernel on CUDA tensors and agrees
    o2, l2 = merge_attn_states(out_a, lse_a, out_b, lse_b, sk)
    assert torch.equal(o2, out) and torch.equal(l2, lse)


@pytest.mark.gpu
def test_merge_cuda_strided_and_large():
    C = sinkattn._ext.require()
    g = torch.Generator().manual_seed(3)
    b, s, h, d = 2, 4099, 3, 64
    big = torch.randn(b, h, s, 2 * d, generator=g).cuda().bfloat16()
    out_a, out_b = big[..., :d].transpose(1, 2), big[..., d:].transpose(1, 2)
    lse_a = torch.randn(b, s, h, generator=g).cuda().transpose(1, 2)
    lse_b = torch.randn(b, h, s, generator=g).cuda()
    sinks = torch.randn(h, generator=g).cuda().bfloat16()
    out, lse = C.merge_states(out_a, lse_a, out_b, lse_b, sinks)
    want_out, want_lse = merge_f64(out_a.cpu(), lse_a.cpu(), out_b.cpu(), lse_b.cpu(), sinks.cpu().float())
    _check(out, lse, want_out, want_lse, torch.bfloat16, "cuda strided")


@pytest.mark.gpu
def test_merge_cuda_skips_kernel_that_cannot_run(monkeypatch):
    cc = torch.cuda.get_device_capability()
    foreign = "sm_86" if cc[0] != 8 else "sm_90a"  # SASS that cannot load on this device
    reg = tuple(dict(k, archs=foreign) if k["op"] == "merge" else k for k in sinkattn._ext.registry())
    monkeypatch.setattr(sinkattn._ext, "registry", lambda: reg)

    class NoKernel:
        def merge_states(self, *a):
            raise AssertionError("the merge kernel was launched although none of its archs runs on this device")

    monkeypatch.setattr(sinkattn._ext, "require", lambda: NoKernel())
    g = torch.Generator().manual_seed(4)
    args = _inputs(1, 3, 2, 8, torch.bfloat16, g, device="cuda")
    out, lse = merge_attn_states(*args)
    want_out, want_lse = merge_f64(*[t.cpu() for t in args])
    _check(out, lse, want_out, want_lse, torch.bfloat16, "fallback")
