"""flash_attn_varlen_with_sinks against the oracle, including empty sequences and padding rows."""
import pytest
import torch

import sinkattn
from sinkattn import reference
from oracle import attention_oracle, attention_oracle_varlen, tolerance_check
from oracle import single_thread  # noqa: F401  (autouse: one torch thread per test)


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    monkeypatch.setattr(reference, "KEY_TILE", 32)
    monkeypatch.setattr(reference, "ROW_CHUNK", 24)


def cu(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)


CASES = [
    # (q lengths, k lengths, kwargs)
    ([5, 0, 40, 1, 17], [9, 3, 40, 0, 60], dict(causal=True)),
    ([0, 0, 0], [0, 4, 0], dict()),
    ([33, 7], [33, 70], dict(causal=True, window_size=(8, 0), sink_tokens=2)),
    ([50, 50, 1], [20, 80, 100], dict(window_size=(5, 3), softcap=4.0)),
    ([64], [64], dict(causal=True, window_size=(127, 0))),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lq,lk,kw", CASES)
def test_varlen_vs_oracle(lq, lk, kw, dtype, rng_seed):
    h, hk, d = 8, 2, 64
    q = torch.randn(sum(lq) + 3, h, d).to(dtype)  # 3 padding rows past cu_seqlens_q[-1]
    k = torch.randn(sum(lk), hk, d).to(dtype)
    v = torch.randn(sum(lk), hk, d).to(dtype)
    sinks = torch.randn(h)
    sinks[1] = float("-inf")
    cq, ck = cu(lq), cu(lk)
    out, lse = sinkattn.flash_attn_varlen_with_sinks(q, k, v, cq, ck, max(lq), max(lk), sinks, **kw,
                                                      return_lse=True)
    assert out.shape == q.shape and lse.shape == (h, q.shape[0]) and lse.dtype == torch.float32
    ref_out, ref_lse = attention_oracle_varlen(q, k, v, cq, ck, sinks, **kw)
    if dtype == torch.float32:
        base_out = base_lse = None
        atol = 1e-5
    else:
        base_out, base_lse = attention_oracle_varlen(q, k, v, cq, ck, sinks, **kw, compute_dtype=dtype)
        atol = 1e-3
    tolerance_check("out", out, ref_out, base_out, atol, rng_seed)
    tolerance_check("lse", lse, ref_lse, base_lse, atol * 10, rng_seed)
    assert (out[-3:] == 0).all() and (lse[:, -3:] == float("-inf")).all()


def test_varlen_matches_batched(rng_seed):
    """Equal lengths packed are the same computation as the batched API."""
    b, s, h, d = 3, 29, 4, 32
    q, k, v = (torch.randn(b, s, h, d) for _ in range(3))
    sinks = torch.randn(h)
    kw = dict(causal=True, window_size=(6, 0), sink_tokens=1)
    out, lse = sinkattn.flash_attn_with_sinks(q, k, v, sinks, **kw, return_lse=True)
    cus = torch.arange(0, (b + 1) * s, s, dtype=torch.int32)
    vout, vlse = sinkattn.flash_attn_varlen_with_sinks(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cus, cus,
                                                        s, s, sinks, **kw, return_lse=True)
    assert torch.equal(vout.view(b, s, h, d), out)
    assert torch.equal(vlse.view(h, b, s).transpose(0, 1), lse)


def test_varlen_grads_vs_oracle(rng_seed):
    lq, lk = [6, 0, 20], [10, 5, 20]
    h, hk, d = 4, 2, 32
    q = torch.randn(sum(lq), h, d, dtype=torch.float64, requires_grad=True)
    k = torch.randn(sum(lk), hk, d, dtype=torch.float64, requires_grad=True)
    v = torch.randn(sum(lk), hk, d, dtype=torch.float64, requires_grad=True)
    sinks = torch.randn(h, dtype=torch.float64, requires_grad=True)
    cq, ck = cu(lq), cu(lk)
    kw = dict(causal=True, window_size=(4, 0), sink_tokens=1)
    out, lse = sinkattn.flash_attn_varlen_with_sinks(q, k, v, cq, ck, 20, 20, sinks, **kw, return_lse=True)
    ref_out, ref_lse = attention_oracle_varlen(q, k, v, cq, ck, sinks, **kw)
    gout, glse = torch.randn_like(out), torch.randn_like(lse)
    got = torch.autograd.grad((out * gout).sum() + (lse * glse).sum(), (q, k, v, sinks))
    want = torch.autograd.grad((ref_out * gout).sum() + (ref_lse * glse).sum(), (q, k, v, sinks))
    for name, a, b in zip("q k v sinks".split(), got, want):
        tolerance_check(f"d{name}", a, b, None, 1e-10, rng_seed)
    # The empty sequence contributes its sink term only through the rows it does not have: nothing.
    assert (got[1][10:15] == 0).all() and (got[2][10:15] == 0).all()
