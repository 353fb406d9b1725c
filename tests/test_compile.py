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
