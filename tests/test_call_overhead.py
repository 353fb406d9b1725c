"""The CPU call path's fast paths (bench/studies/cpu_overhead.py) against the float64 oracle.

- Eager inference calls run the op's body without the torch.library wrapper (ops.direct): the same results,
  and the wrapper still runs wherever it has work (autograd, torch.compile, modes, functorch transforms).
- Decode-sized fp32 CPU calls run PyTorch's fused CPU attention over the keys the mask keeps (reference
  _fused_plan): windows that cut, sink tokens, learnable sinks (-inf, +30), GQA, masked non-finite values, rows
  that see no key; through flash_attn_with_sinks and flash_attn_with_kvcache (cache lengths 0, 1, odd, equal and
  unequal per sequence, contiguous and paged).
- The checks that protect users still run on every call (nothing is remembered from an earlier good call).
"""
import pytest
import torch

import sinkattn
from sinkattn import SinkattnTypeError, SinkattnValueError, interface, ops, reference
from oracle import attention_oracle
from oracle import single_thread  # noqa: F401  (autouse: one torch thread per test)

SINKS = {None: None, "randn": lambda h, g: torch.randn(h, generator=g) * 2,
         "-inf": lambda h, g: torch.full((h,), float("-inf")), "+30": lambda h, g: torch.full((h,), 30.0),
         "mixed": lambda h, g: torch.tensor([float("-inf"), 30.0] + [0.5] * (h - 2))}


@pytest.fixture
def fused_calls(monkeypatch):
    """Counts the fused CPU kernel's calls: every Python fused path goes through reference._FLASH_CPU, and
    flash_attn_with_sinks's C++ front end (interface._CPU_FRONT, csrc/cpu_front.cpp) runs the same kernel where it
    serves the call (tests/test_cpu_front.py tests it on its own)."""
    calls = []
    real = reference._FLASH_CPU
    monkeypatch.setattr(reference, "_FLASH_CPU", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    front = interface._CPU_FRONT
    if front is not None:
        def counting_front(*args):
            served = front(*args)
            if served is not None:
                calls.append(1)
            return served
        monkeypatch.setattr(interface, "_CPU_FRONT", counting_front)
    return calls


def _sinks(kind, h, g):
    return None if kind is None else SINKS[kind](h, g)


def _check(out, lse, q, k, v, s, kw, atol=2e-5):
    want, want_lse = attention_oracle(q.double(), k.double(), v.double(), None if s is None else s.double(), **kw)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=atol)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=atol)


MASKS = [dict(), dict(causal=True), dict(causal=True, window_size=(127, 0)),
         dict(causal=True, window_size=(127, 0), sink_tokens=4), dict(causal=True, window_size=(5, 0), sink_tokens=3),
         dict(window_size=(3, 2)), dict(window_size=(4, -1), sink_tokens=2), dict(causal=True, window_size=(0, 0))]


@pytest.mark.parametrize("mask", MASKS, ids=lambda m: ",".join(f"{k}={v}" for k, v in m.items()) or "full")
@pytest.mark.parametrize("sq,sk,h,hk", [(1, 300, 8, 2), (1, 1, 4, 4), (1, 133, 6, 1), (5, 40, 8, 2),
                                        (16, 16, 4, 4), (3, 200, 4, 1)])
def test_fused_forward_equals_oracle(fused_calls, mask, sq, sk, h, hk):
    g = torch.Generator().manual_seed(sq * 7919 + sk * 31 + h)
    q = torch.randn(2, sq, h, 32, generator=g)
    k, v = (torch.randn(2, sk, hk, 32, generator=g) for _ in range(2))
    for sinks in (None, "randn", "mixed"):
        s = _sinks(sinks, h, g)
        fused_calls.clear()
        with torch.no_grad():
            out, lse = sinkattn.flash_attn_with_sinks(q, k, v, s, return_lse=True, **mask)
        _check(out, lse, q, k, v, s, mask)
        assert out.is_contiguous() and lse.is_contiguous()
        assert fused_calls, f"the fused CPU path did not run (sinks {sinks})"


def test_decode_reads_only_the_window_and_sink_tokens(fused_calls):
    """One query row: the keys it does not see are never read (NaN there changes nothing), and the kernel runs
    on exactly the window plus the sink tokens."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 1, 8, 64, generator=g)
    k, v = (torch.randn(1, 1000, 2, 64, generator=g) for _ in range(2))
    s = torch.randn(8, generator=g)
    kn, vn = k.clone(), v.clone()
    kn[:, 4:1000 - 128], vn[:, 4:1000 - 128] = float("nan"), float("inf")
    seen = []
    real = reference._FLASH_CPU
    reference._FLASH_CPU = lambda qs, kk, vv, **kw: seen.append(kk.shape[2]) or real(qs, kk, vv, **kw)
    try:
        out, lse = sinkattn.flash_attn_with_sinks(q, kn, vn, s, causal=True, window_size=(127, 0),
                                                  sink_tokens=4, return_lse=True)
    finally:
        reference._FLASH_CPU = real
    assert seen == [4 + 128]
    _check(out, lse, q, k, v, s, dict(causal=True, window_size=(127, 0), sink_tokens=4))


def test_masked_nonfinite_value_does_not_leak_and_empty_rows(fused_calls):
    """Several rows with a mask: a key holding inf/NaN in K or V must not reach rows that do not see it (the
    fused kernel would give NaN + -inf or 0 * inf = NaN: such calls take the exact path), and a row that sees no key gets
    out 0 and lse = sink (the fused kernel would give lse 0)."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 6, 4, 32, generator=g)
    k, v = (torch.randn(1, 20, 2, 32, generator=g) for _ in range(2))
    v[0, 2, 1, 3] = float("inf")
    v[0, 5, 0, 0] = float("nan")

    s = torch.randn(4, generator=g)
    kw = dict(causal=True, window_size=(4, 0))
    out, lse = sinkattn.flash_attn_with_sinks(q, k, v, s, return_lse=True, **kw)
    _check(out, lse, q, k, v.nan_to_num(0, 0, 0), s, kw)  # no row sees them: as if they were 0
    assert torch.isfinite(out).all()
    # a non-finite K that the last row sees and the others do not: only that row's heads of that KV head are NaN
    # (a masked score would be NaN + -inf = NaN in the fused kernel, so the call takes the exact path)
    k[0, 19, 0, 1] = float("nan")
    out, lse = sinkattn.flash_attn_with_sinks(q, k, v, s, return_lse=True, **kw)
    want, want_lse = attention_oracle(q.double(), k.double(), v.nan_to_num(0, 0, 0).double(), s.double(), **kw)
    assert torch.isnan(out[0, 5, :2]).all() and torch.isfinite(out[0, 5, 2:]).all()
    torch.testing.assert_close(out[0, :5].double(), want[0, :5], rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(lse[0, :, :5].double(), want_lse[0, :, :5], rtol=1e-5, atol=2e-5)
    # rows that see no key: seqlen_q > seqlen_k, causal
    q2 = torch.randn(1, 9, 4, 32, generator=g)
    k2, v2 = (torch.randn(1, 4, 2, 32, generator=g) for _ in range(2))
    out, lse = sinkattn.flash_attn_with_sinks(q2, k2, v2, s, causal=True, return_lse=True)
    _check(out, lse, q2, k2, v2, s, dict(causal=True))
    assert torch.equal(out[0, :5], torch.zeros_like(out[0, :5]))
    assert torch.equal(lse[0, :, :5], s[:, None].expand(4, 5))


@pytest.mark.parametrize("bad", ["k_nan", "k_inf", "v_inf", "v_nan"])
def test_plain_causal_uses_the_kernels_causal_mode_and_keeps_masked_nonfinite_keys_out(fused_calls, bad):
    """sq == sk, one query head per KV head, causal only: the fused kernel's own causal mode (no mask tensor). A
    non-finite value in the last key, which only the last row sees, must leave every other row exact: the call
    checks out after the kernel (one reduction) and takes the exact path when it is not finite."""
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(1, 16, 4, 64, generator=g) for _ in range(3))
    s = torch.randn(4, generator=g)
    out, lse = sinkattn.flash_attn_with_sinks(q, k, v, s, causal=True, return_lse=True)
    _check(out, lse, q, k, v, s, dict(causal=True))
    assert len(fused_calls) == 1  # served by the fused kernel
    t = k if bad.startswith("k") else v
    t[0, 15, 2, 7] = float("nan") if bad.endswith("nan") else float("inf")
    out, lse = sinkattn.flash_attn_with_sinks(q, k, v, s, causal=True, return_lse=True)
    clean_k, clean_v = k.clone(), v.clone()
    (clean_k if bad.startswith("k") else clean_v)[0, 15, 2, 7] = 0.0
    want, want_lse = attention_oracle(q.double(), clean_k.double(), clean_v.double(), s.double(), causal=True)
    torch.testing.assert_close(out[0, :15].double(), want[0, :15], rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(lse[0, :, :15].double(), want_lse[0, :, :15], rtol=1e-5, atol=2e-5)
    # the row that sees it: what the oracle gives with the value itself (NaN, or a weight of 0 for a -inf score)
    full, _ = attention_oracle(q.double(), k.double(), v.double(), s.double(), causal=True)
    torch.testing.assert_close(out[0, 15].double(), full[0, 15], rtol=1e-5, atol=2e-5, equal_nan=True)


@pytest.mark.parametrize("paged", [None, 5])
@pytest.mark.parametrize("lens,sn", [((1,), 0), ((37, 37, 37), 1), ((0, 1, 37), 1), ((200, 3, 129), 1),
                                     ((130, 0, 77), 3)])
@pytest.mark.parametrize("mask,sinks", [(dict(causal=True), None), (dict(causal=True), "mixed"),
                                        (dict(causal=True, window_size=(127, 0), sink_tokens=4), None),
                                        (dict(causal=True, window_size=(127, 0)), "randn"),
                                        (dict(causal=True, window_size=(9, 0), sink_tokens=2), "mixed")],
                         ids=["full", "full-sinks", "w127+4tok", "w127+sinks", "w9+2tok+sinks"])
def test_kvcache_fused_decode_equals_oracle(fused_calls, paged, lens, sn, mask, sinks):
    g = torch.Generator().manual_seed(sum(lens) * 13 + sn + (paged or 0))
    b, h, hk, d, cap = len(lens), 8, 2, 32, 240
    dense_k, dense_v = (torch.randn(b, cap, hk, d, generator=g) for _ in range(2))
    q = torch.randn(b, 1 if sn <= 1 else sn, h, d, generator=g)
    kn, vn = ((torch.randn(b, sn, hk, d, generator=g) for _ in range(2)) if sn else (None, None))
    s = _sinks(sinks, h, g)
    if paged is None:
        kc, vc, bt = dense_k.clone(), dense_v.clone(), None
    else:
        per = cap // paged
        bt = torch.randperm(b * per + 2, generator=g)[: b * per].view(b, per).to(torch.int32)
        kc, vc = (torch.randn(b * per + 2, paged, hk, d, generator=g) for _ in range(2))
        for bi in range(b):
            for p in range(per):
                kc[bt[bi, p]] = dense_k[bi, p * paged:(p + 1) * paged]
                vc[bt[bi, p]] = dense_v[bi, p * paged:(p + 1) * paged]
    with torch.inference_mode():
        out, lse = sinkattn.flash_attn_with_kvcache(q, kc, vc, s, k=kn, v=vn, block_table=bt, return_lse=True,
                                                    cache_seqlens=torch.tensor(lens, dtype=torch.int32), **mask)
    for bi, n in enumerate(lens):
        keys, vals = dense_k[bi:bi + 1, :n + sn].clone(), dense_v[bi:bi + 1, :n + sn].clone()
        if sn:
            keys[:, n:], vals[:, n:] = kn[bi:bi + 1], vn[bi:bi + 1]
        _check(out[bi:bi + 1], lse[bi:bi + 1], q[bi:bi + 1], keys, vals, s, mask)
        if paged is None:
            assert torch.equal(kc[bi, :n + sn], keys[0]) and torch.equal(vc[bi, :n + sn], vals[0])
    assert fused_calls, "the fused CPU path did not run"


def test_direct_call_equals_the_op_and_the_op_runs_where_it_has_work():
    g = torch.Generator().manual_seed(11)
    q = torch.randn(2, 3, 4, 16, generator=g)
    k, v = (torch.randn(2, 9, 2, 16, generator=g) for _ in range(2))
    s = torch.nn.Parameter(torch.randn(4, generator=g))
    kw = dict(causal=True, window_size=(4, 0), sink_tokens=1, return_lse=True)
    with torch.no_grad():
        assert ops.direct(q, k, v, s)
        a = sinkattn.flash_attn_with_sinks(q, k, v, s, **kw)
    b = torch.ops.sinkattn.fwd(q, k, v, s.detach(), None, None, 0, 0, 0.25, 4, 0, 1, 0.0, False, "auto")
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    # autograd needed: the op (its backward) runs, and gradients flow
    assert not ops.direct(q, k, v, s)
    out, lse = sinkattn.flash_attn_with_sinks(q, k, v, s, **kw)
    assert out.requires_grad and out.grad_fn is not None
    (out.sum() + lse.sum()).backward()
    assert s.grad is not None and torch.isfinite(s.grad).all()
    with torch.no_grad():
        assert not ops.direct(q.as_subclass(_Sub), k, v)
        with torch.device("cpu"):  # a torch function mode
            assert not ops.direct(q, k, v)
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as mode:
        fq, fk, fv = (mode.from_tensor(t) for t in (q, k, v))
        assert not ops.direct(fq, fk, fv)
        out = sinkattn.flash_attn_with_sinks(fq, fk, fv)
        assert out.shape == q.shape
    # a functorch transform: the op runs (its vmap rule is the op's business), not the body on batched tensors
    seen = []
    torch.vmap(lambda x: seen.append(ops.direct(x)) or x)(q)
    assert seen == [False]


class _Sub(torch.Tensor):
    pass


def test_checks_run_on_every_call():
    """A good call first, then the same shapes with one bad argument: each still raises (nothing is cached
    from the good call that would skip a check)."""
    q, k, v = torch.randn(1, 1, 4, 16), torch.randn(1, 5, 2, 16), torch.randn(1, 5, 2, 16)
    kc, vc = torch.randn(1, 8, 2, 16), torch.randn(1, 8, 2, 16)
    with torch.no_grad():
        for _ in range(2):
            sinkattn.flash_attn_with_sinks(q, k, v, causal=True)
            sinkattn.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=3, causal=True)
        for bad in (float("inf"), float("nan")):
            with pytest.raises(SinkattnValueError, match="softmax_scale"):
                sinkattn.flash_attn_with_sinks(q, k, v, softmax_scale=bad)
            with pytest.raises(SinkattnValueError, match="softcap"):
                sinkattn.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=3, softcap=bad)
        with pytest.raises(SinkattnTypeError, match="causal"):
            sinkattn.flash_attn_with_sinks(q, k, v, causal=1)
        with pytest.raises(SinkattnTypeError, match="dtype"):
            sinkattn.flash_attn_with_sinks(q, k.double(), v)
        with pytest.raises(SinkattnValueError, match="contiguous last dimension"):
            sinkattn.flash_attn_with_sinks(q, k, torch.randn(1, 5, 2, 32)[..., ::2])
        with pytest.raises(SinkattnValueError, match="cache_seqlens"):
            sinkattn.flash_attn_with_kvcache(q, kc, vc, k=k[:, :1], v=v[:, :1], cache_seqlens=8)
        with pytest.raises(SinkattnValueError, match="sinks"):
            sinkattn.flash_attn_with_kvcache(q, kc, vc, torch.zeros(3), cache_seqlens=3)
