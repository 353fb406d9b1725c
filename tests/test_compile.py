"""torch.library registration: opcheck of every op, and torch.compile(fullgraph=True) on the CPU,
forward and backward, matching eager."""
import pytest
import torch

import sinkattn
from oracle import single_thread  # noqa: F401  (autouse: one torch thread per test)


class SinkAttention(torch.nn.Module):
    """The gpt-oss shape of the call: learnable sinks, sliding window, GQA."""

    def __init__(self, heads, window):
        super().__init__()
        self.sinks = torch.nn.Parameter(torch.randn(heads))
        self.window = window

    def forward(self, q, k, v):
        out, lse = sinkattn.flash_attn_with_sinks(q, k, v, self.sinks, causal=True, window_size=(self.window, 0),
                                                  sink_tokens=1, return_lse=True)
        return out * 2 + lse.sum()


def _inputs(dtype=torch.float32):
    q = torch.randn(2, 17, 4, 32, dtype=dtype, requires_grad=True)
    k = torch.randn(2, 17, 2, 32, dtype=dtype, requires_grad=True)
    v = torch.randn(2, 17, 2, 32, dtype=dtype, requires_grad=True)
    return q, k, v


def _compare_compiled(backend, rng_seed):
    torch._dynamo.reset()
    m = SinkAttention(4, 5)
    q, k, v = _inputs()
    eager = m(q, k, v)
    g_eager = torch.autograd.grad(eager.sum(), (q, k, v, m.sinks))
    compiled = torch.compile(m, fullgraph=True, backend=backend)
    out = compiled(q, k, v)
    g = torch.autograd.grad(out.sum(), (q, k, v, m.sinks))
    torch.testing.assert_close(out, eager, msg=lambda s: f"{s} (seed {rng_seed})")
    for a, b in zip(g, g_eager):
        torch.testing.assert_close(a, b, msg=lambda s: f"{s} (seed {rng_seed})")


def test_compile_fullgraph_aot_eager(rng_seed):
    _compare_compiled("aot_eager", rng_seed)


def test_compile_fullgraph_inductor(rng_seed):
    _compare_compiled("inductor", rng_seed)


def test_compile_varlen_and_kvcache_fullgraph(rng_seed):
    torch._dynamo.reset()
    cu = torch.tensor([0, 3, 10], dtype=torch.int32)

    def varlen(q, k, v, s):
        return sinkattn.flash_attn_varlen_with_sinks(q, k, v, cu, cu, 7, 7, s, causal=True)

    q, k, v = (torch.randn(10, 2, 16) for _ in range(3))
    s = torch.randn(2)
    torch.testing.assert_close(torch.compile(varlen, fullgraph=True, backend="aot_eager")(q, k, v, s),
                               varlen(q, k, v, s))

    def decode(q, kc, vc, kn, vn, lens):
        return sinkattn.flash_attn_with_kvcache(q, kc, vc, s, k=kn, v=vn, cache_seqlens=lens, causal=True)

    kc, vc = torch.randn(2, 12, 2, 16), torch.randn(2, 12, 2, 16)
    kc2, vc2 = kc.clone(), vc.clone()
    qd, kn, vn = torch.randn(2, 1, 2, 16), torch.randn(2, 1, 2, 16), torch.randn(2, 1, 2, 16)
    lens = torch.tensor([3, 7], dtype=torch.int32)
    got = torch.compile(decode, fullgraph=True, backend="aot_eager")(qd, kc, vc, kn, vn, lens)
    want = decode(qd, kc2, vc2, kn, vn, lens)
    torch.testing.assert_close(got, want)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)  # the compiled call appended in place too
    assert torch.equal(kc[1, 7], kn[1, 0])


def _fwd_args(varlen):
    if varlen:
        cu = torch.tensor([0, 2, 6], dtype=torch.int32)
        q, k, v = (torch.randn(6, 2, 8) for _ in range(3))
        return (q, k, v, torch.randn(2), cu, cu, 4, 4, 0.35, 2, 0, 1, 0.0, False, "auto")
    q, k, v = torch.randn(1, 5, 4, 8), torch.randn(1, 6, 2, 8), torch.randn(1, 6, 2, 8)
    return (q, k, v, torch.randn(4), None, None, 0, 0, 0.35, -1, 0, 0, 3.0, False, "reference")


@pytest.mark.parametrize("varlen", [False, True])
def test_opcheck_fwd(varlen):
    args = list(_fwd_args(varlen))
    for i in range(4):
        args[i] = args[i].requires_grad_()
    torch.library.opcheck(torch.ops.sinkattn.fwd.default, tuple(args))


def test_opcheck_bwd_and_kvcache():
    q, k, v = torch.randn(1, 5, 4, 8), torch.randn(1, 6, 2, 8), torch.randn(1, 6, 2, 8)
    s = torch.randn(4)
    out, lse = torch.ops.sinkattn.fwd(q, k, v, s, None, None, 0, 0, 0.35, -1, 0, 0, 0.0, False, "auto")
    torch.library.opcheck(torch.ops.sinkattn.bwd.default,
                          (torch.randn_like(out), torch.randn_like(lse), q, k, v, s, out, lse, None, None, 0, 0,
                           0.35, -1, 0, 0, 0.0, False, "auto"))
    kc, vc = torch.randn(6, 4, 2, 8), torch.randn(6, 4, 2, 8)
    bt = torch.tensor([[3, 1], [0, 5]], dtype=torch.int32)
    torch.library.opcheck(torch.ops.sinkattn.kvcache_fwd.default,
                          (torch.randn(2, 1, 4, 8), kc, vc, s, torch.randn(2, 1, 2, 8), torch.randn(2, 1, 2, 8),
                           torch.tensor([2, 5], dtype=torch.int32), bt, None, None, True, 0.35, -1, 0, 0, 0.0, 0,
                           "auto"))


# ---- torch.compile(dynamic=True, fullgraph=True) on every op (every call died on math.isfinite of a
# SymFloat in _checks._check_float). Two shapes per op, both against eager; aot_eager keeps them fast (the op's
# fake implementations and autograd are what is traced; inductor is covered above).
def _dyn(fn):
    torch._dynamo.reset()
    return torch.compile(fn, dynamic=True, fullgraph=True, backend="aot_eager")


@pytest.mark.parametrize("shape", [(2, 7, 9, 4, 2, 16), (3, 1, 13, 8, 1, 32)])
def test_dynamic_forward_and_backward(shape, rng_seed):
    b, sq, sk, h, hk, d = shape

    def f(q, k, v, s):
        out, lse = sinkattn.flash_attn_with_sinks(q, k, v, s, causal=True, window_size=(3, 0), sink_tokens=1,
                                                  return_lse=True)
        return out * 2 + lse.transpose(1, 2)[..., None]

    leaves = [torch.randn(b, sq, h, d), torch.randn(b, sk, hk, d), torch.randn(b, sk, hk, d), torch.randn(h)]
    leaves = [t.requires_grad_() for t in leaves]
    compiled = _dyn(f)
    got = compiled(*leaves)
    want = f(*leaves)
    torch.testing.assert_close(got, want, msg=lambda m: f"{m} (seed {rng_seed})")
    gout = torch.randn_like(want)
    for a, w in zip(torch.autograd.grad(got, leaves, gout), torch.autograd.grad(want, leaves, gout)):
        torch.testing.assert_close(a, w, msg=lambda m: f"{m} (seed {rng_seed})")
    with torch.no_grad():  # inference through the same compiled function (the op, not the eager shortcut)
        torch.testing.assert_close(compiled(*leaves), want.detach())


def test_dynamic_scale_softcap_and_default_scale(rng_seed):
    """The default scale 1/sqrt(headdim) of a symbolic head dim, an explicit scale and softcap as inputs."""
    def f(q, k, v, scale):
        a = sinkattn.flash_attn_with_sinks(q, k, v)
        return a + sinkattn.flash_attn_with_sinks(q, k, v, softmax_scale=scale, softcap=4.0, causal=True)

    compiled = _dyn(f)
    for d, scale in ((16, 0.3), (32, 0.7)):
        q, k, v = torch.randn(1, 5, 2, d), torch.randn(1, 6, 2, d), torch.randn(1, 6, 2, d)
        torch.testing.assert_close(compiled(q, k, v, scale), f(q, k, v, scale))


def test_dynamic_varlen(rng_seed):
    def f(q, k, v, cu_q, cu_k, s):
        return sinkattn.flash_attn_varlen_with_sinks(q, k, v, cu_q, cu_k, 7, 9, s, causal=True, return_lse=True)

    compiled = _dyn(f)
    for lens_q, lens_k in (([3, 7], [4, 9]), ([1, 2, 5], [3, 2, 8])):
        cu_q = torch.tensor([0] + torch.tensor(lens_q).cumsum(0).tolist(), dtype=torch.int32)
        cu_k = torch.tensor([0] + torch.tensor(lens_k).cumsum(0).tolist(), dtype=torch.int32)
        q = torch.randn(sum(lens_q), 4, 16, requires_grad=True)
        k, v = (torch.randn(sum(lens_k), 2, 16, requires_grad=True) for _ in range(2))
        s = torch.randn(4, requires_grad=True)
        got, want = compiled(q, k, v, cu_q, cu_k, s), f(q, k, v, cu_q, cu_k, s)
        torch.testing.assert_close(got, want)
        ga = torch.autograd.grad(got[0].sum() + got[1].sum(), (q, k, v, s))
        gw = torch.autograd.grad(want[0].sum() + want[1].sum(), (q, k, v, s))
        for a, w in zip(ga, gw):
            torch.testing.assert_close(a, w)


@pytest.mark.parametrize("paged", [False, True])
def test_dynamic_kvcache_appends_in_place(paged, rng_seed):
    s = torch.randn(4)

    def f(q, kc, vc, kn, vn, lens, bt):
        return sinkattn.flash_attn_with_kvcache(q, kc, vc, s, k=kn, v=vn, cache_seqlens=lens, block_table=bt,
                                                causal=True, window_size=(5, 0), sink_tokens=1, return_lse=True)

    compiled = _dyn(f)
    for b, sn, lens in ((2, 1, [3, 7]), (3, 2, [0, 9, 4])):
        if paged:
            kc, vc = torch.randn(b * 3 + 1, 4, 2, 16), torch.randn(b * 3 + 1, 4, 2, 16)
            bt = torch.randperm(b * 3 + 1)[: b * 3].view(b, 3).to(torch.int32)
        else:
            kc, vc, bt = torch.randn(b, 12, 2, 16), torch.randn(b, 12, 2, 16), None
        kc2, vc2 = kc.clone(), vc.clone()
        q, kn, vn = torch.randn(b, sn, 4, 16), torch.randn(b, sn, 2, 16), torch.randn(b, sn, 2, 16)
        lens = torch.tensor(lens, dtype=torch.int32)
        got = compiled(q, kc, vc, kn, vn, lens, bt)
        want = f(q, kc2, vc2, kn, vn, lens, bt)
        torch.testing.assert_close(got, want)
        assert torch.equal(kc, kc2) and torch.equal(vc, vc2)  # the compiled call appended in place, as eager
        assert not torch.equal(kc, kc.clone().zero_())


def test_dynamic_merge_forward_and_backward(rng_seed):
    def f(oa, la, ob, lb, s):
        return sinkattn.merge_attn_states(oa, la, ob, lb, s)

    compiled = _dyn(f)
    for b, sq, h in ((2, 3, 4), (1, 5, 2)):
        leaves = [torch.randn(b, sq, h, 16), torch.randn(b, h, sq), torch.randn(b, sq, h, 16), torch.randn(b, h, sq),
                  torch.randn(h)]
        leaves = [t.requires_grad_() for t in leaves]
        got, want = compiled(*leaves), f(*leaves)
        torch.testing.assert_close(got, want)
        ga = torch.autograd.grad(got[0].sum() + got[1].sum(), leaves)
        gw = torch.autograd.grad(want[0].sum() + want[1].sum(), leaves)
        for a, w in zip(ga, gw):
            torch.testing.assert_close(a, w)


def test_non_finite_scale_still_raises_eager_and_compiled():
    q = torch.randn(1, 3, 2, 16)
    for bad in (float("inf"), float("nan"), float("-inf")):
        with pytest.raises(sinkattn.SinkattnValueError, match="softmax_scale"):
            sinkattn.flash_attn_with_sinks(q, q, q, softmax_scale=bad)
        with pytest.raises(sinkattn.SinkattnValueError, match="softcap"):
            sinkattn.flash_attn_with_sinks(q, q, q, softcap=bad)
    torch._dynamo.reset()
    compiled = torch.compile(lambda q: sinkattn.flash_attn_with_sinks(q, q, q, softmax_scale=float("inf")),
                             dynamic=True, backend="aot_eager")  # (not fullgraph: the raise ends the graph)
    with pytest.raises(sinkattn.SinkattnValueError, match="softmax_scale"):
        compiled(q)
