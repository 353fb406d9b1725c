"""Gradients through sinkattn.merge_attn_states (needed by context-parallel training).

The public function accepts fp32/bf16/fp16; float64 (for gradcheck) goes through the op itself,
torch.ops.sinkattn.merge_attn_states, which merges float64 states in float64.
"""
import pytest
import torch

import sinkattn
from tests.oracle import attention_oracle

merge64 = torch.ops.sinkattn.merge_attn_states


def _states(b=2, s=3, h=4, d=8, dtype=torch.float64, requires_grad=True):
    mk = lambda *shape: torch.randn(*shape, dtype=dtype).requires_grad_(requires_grad)  # noqa: E731
    return mk(b, s, h, d), mk(b, h, s), mk(b, s, h, d), mk(b, h, s)


def _merge_explicit(out_a, lse_a, out_b, lse_b, sinks):
    """The merge written with plain differentiable torch ops (an independent formula)."""
    parts = [lse_a, lse_b] + ([sinks.view(1, -1, 1).expand_as(lse_a)] if sinks is not None else [])
    lse = torch.logsumexp(torch.stack(parts), dim=0)
    wa = torch.exp(lse_a - lse).transpose(1, 2).unsqueeze(-1)
    wb = torch.exp(lse_b - lse).transpose(1, 2).unsqueeze(-1)
    return wa * out_a + wb * out_b, lse


@pytest.mark.parametrize("with_sinks", [False, True])
def test_gradcheck_float64(with_sinks):
    out_a, lse_a, out_b, lse_b = _states()
    sinks = torch.randn(4, dtype=torch.float64, requires_grad=True) if with_sinks else None
    inputs = (out_a, lse_a, out_b, lse_b, sinks)
    assert torch.autograd.gradcheck(lambda *x: merge64(*x), inputs, eps=1e-6, atol=1e-8)


def test_backward_matches_explicit_formula():
    out_a, lse_a, out_b, lse_b = _states(b=3, s=5, h=2, d=16)
    sinks = torch.randn(2, dtype=torch.float64, requires_grad=True)
    dout, dlse = torch.randn(3, 5, 2, 16, dtype=torch.float64), torch.randn(3, 2, 5, dtype=torch.float64)
    inputs = (out_a, lse_a, out_b, lse_b, sinks)
    out, lse = merge64(*inputs)
    got = torch.autograd.grad((out * dout).sum() + (lse * dlse).sum(), inputs)
    ref_out, ref_lse = _merge_explicit(*inputs)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse)
    want = torch.autograd.grad((ref_out * dout).sum() + (ref_lse * dlse).sum(), inputs)
    for name, g, w in zip(("out_a", "lse_a", "out_b", "lse_b", "sinks"), got, want):
        torch.testing.assert_close(g, w, msg=lambda m, name=name: f"d{name}: {m}")


def test_empty_parts_give_zero_gradients_not_nan():
    out_a, lse_a, out_b, lse_b = _states(requires_grad=False)
    # part a saw no key on row 1 (lse -inf, out garbage NaN); row 2 is empty on both sides, no sink.
    lse_a[:, :, 1] = float("-inf")
    out_a[:, 1] = float("nan")
    lse_a[:, :, 2] = float("-inf")
    lse_b[:, :, 2] = float("-inf")
    out_a[:, 2] = float("nan")
    out_b[:, 2] = float("nan")
    inputs = [t.clone().requires_grad_() for t in (out_a, lse_a, out_b, lse_b)]
    out, lse = merge64(*inputs, None)
    assert not torch.isnan(out).any()
    assert torch.isinf(lse[:, :, 2]).all()
    (out.sum() + torch.where(torch.isfinite(lse), lse, 0).sum()).backward()
    for t in inputs:
        assert not torch.isnan(t.grad).any()
    assert (inputs[0].grad[:, 1:] == 0).all() and (inputs[1].grad[:, :, 1:] == 0).all()
    assert (inputs[2].grad[:, 2] == 0).all() and (inputs[3].grad[:, :, 2] == 0).all()
    # the live row of part b carries the whole gradient on row 1
    assert (inputs[2].grad[:, 1] == 1).all()


def test_split_keys_merge_equals_oracle_with_gradients():
    """Attention over two key halves merged with the sink once == attention over all keys (values and grads)."""
    torch.manual_seed(0)
    b, sq, sk, h, hk, d = 2, 5, 12, 4, 2, 16
    q = torch.randn(b, sq, h, d, dtype=torch.float64, requires_grad=True)
    k = torch.randn(b, sk, hk, d, dtype=torch.float64, requires_grad=True)
    v = torch.randn(b, sk, hk, d, dtype=torch.float64, requires_grad=True)
    sinks = torch.randn(h, dtype=torch.float64, requires_grad=True)
    oa, la = sinkattn.flash_attn_with_sinks(q, k[:, :7], v[:, :7], return_lse=True)
    ob, lb = sinkattn.flash_attn_with_sinks(q, k[:, 7:], v[:, 7:], return_lse=True)
    out, lse = merge64(oa, la, ob, lb, sinks)
    ref, ref_lse = attention_oracle(q, k, v, sinks)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(lse, ref_lse)
    g = torch.randn_like(ref)
    got = torch.autograd.grad((out * g).sum() + lse.sum(), (q, k, v, sinks))
    want = torch.autograd.grad((ref * g).sum() + ref_lse.sum(), (q, k, v, sinks))
    for name, a, w in zip("q k v sinks".split(), got, want):
        torch.testing.assert_close(a, w, msg=lambda m, name=name: f"d{name}: {m}")


def test_public_merge_float32_gradients():
    out_a, lse_a, out_b, lse_b = _states(dtype=torch.float32)
    sinks = torch.randn(4, requires_grad=True)
    inputs = (out_a, lse_a, out_b, lse_b, sinks)
    out, lse = sinkattn.merge_attn_states(*inputs)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    got = torch.autograd.grad(out.sum() + lse.sum(), inputs)
    ref_out, ref_lse = _merge_explicit(*[t.double() for t in inputs])
    want = torch.autograd.grad(ref_out.sum() + ref_lse.sum(), inputs)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w.float(), rtol=1e-5, atol=1e-5)
