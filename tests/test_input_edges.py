"""Valid inputs at the edges give defined outputs on every backend (nothing visible, infinite sinks, empty batches,
windows and sink-token counts past int32, varlen rows past the last sequence), and a call writes nothing but its
outputs and the appended cache slots, refused calls included.

tests/test_argument_errors.py holds what the public functions refuse, with the messages."""
import pytest
import torch

import sinkattn
from sinkattn import SinkattnValueError, _ext
from oracle import single_thread  # noqa: F401  (autouse: one torch thread per test)

B, S, H, HK, D = 2, 8, 4, 2, 32
EMU = any(k["family"] == "sm80-emulated" and k["headdim"] == 64 and k["dtype"] == "bf16" for k in _ext.registry())
EMU90_BWD = any(k["family"] == "sm90-emulated" and k["op"] == "bwd" and k["headdim"] == 64 and k["dtype"] == "bf16"
                for k in _ext.registry())
BACKENDS = ["reference", pytest.param("sm80-emulated", marks=pytest.mark.skipif(not EMU, reason="no emulated kernels"))]
BWD_BACKENDS = BACKENDS + [pytest.param("sm90-emulated", marks=pytest.mark.skipif(
    not EMU90_BWD, reason="no emulated sm90 backward"))]


def i32(*xs):
    return torch.tensor(xs, dtype=torch.int32)


q0, k0, v0 = torch.randn(B, S, H, D), torch.randn(B, S, HK, D), torch.randn(B, S, HK, D)
A, VL, KV = sinkattn.flash_attn_with_sinks, sinkattn.flash_attn_varlen_with_sinks, sinkattn.flash_attn_with_kvcache


def test_no_nan_for_degenerate_inputs():
    """Nothing visible, sinks -inf or +inf, huge scores, empty sequences: outputs and gradients are never
    NaN (lse may be +-inf)."""
    q, k, v = q0, k0, v0
    attn = A
    for sinks in (None, torch.full((H,), float("-inf")), torch.full((H,), float("inf")), torch.zeros(H),
                  torch.tensor([float("-inf"), float("inf"), 0.0, 30.0])):
        for kw in (dict(window_size=(0, 0), sink_tokens=0), dict(causal=True), dict(softmax_scale=100.0)):
            out, lse = attn(q, k[:, :0], v[:, :0], sinks, return_lse=True, **kw)
            assert not out.isnan().any() and not lse.isnan().any() and (out == 0).all()
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            s = None if sinks is None else sinks.clone().requires_grad_()
            out, lse = attn(*leaves, s, return_lse=True, **kw)
            assert not out.isnan().any() and not lse.isnan().any()
            grads = torch.autograd.grad(out.sum(), leaves + ([s] if s is not None else []))
            assert not any(g.isnan().any() for g in grads), (kw, sinks)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bounds_past_int32_mean_unbounded(backend):
    """Windows and sink-token counts past INT32_MAX are clamped (positions are int32, so nothing changes):
    the kernels never see an overflowing int."""
    dt = torch.bfloat16 if backend != "reference" else torch.float32
    q, k, v = (t.to(dt) for t in (torch.randn(1, 40, 2, 64), torch.randn(1, 50, 2, 64), torch.randn(1, 50, 2, 64)))
    want = A(q, k, v, causal=True, backend=backend)
    assert torch.equal(A(q, k, v, causal=True, window_size=(2**40, 0), backend=backend), want)
    assert torch.equal(A(q, k, v, causal=True, window_size=(3, 0), sink_tokens=2**40, backend=backend), want)


@pytest.mark.parametrize("backend", BWD_BACKENDS)
def test_no_query_rows_over_keys_gives_zero_gradients(backend):
    """seqlen_q = 0 over 50 keys (GQA 8:1, sinks): an empty out and lse, and zero dk, dv, dsinks with no error. (The
    kernel backends refused it: out and dout, both empty, came with different strides, which .contiguous() keeps.)"""
    dt = torch.bfloat16 if backend != "reference" else torch.float32
    q = torch.randn(2, 0, 8, 64, dtype=dt, requires_grad=True)
    k, v = (torch.randn(2, 50, 1, 64, dtype=dt, requires_grad=True) for _ in range(2))
    sinks = torch.randn(8, requires_grad=True)
    out, lse = A(q, k, v, sinks, causal=True, return_lse=True, backend=backend)
    assert out.shape == q.shape and lse.shape == (2, 8, 0)
    (out.float().sum() + lse.sum()).backward()
    assert q.grad.shape == q.shape
    for t in (k, v, sinks):
        assert t.grad is not None and t.grad.shape == t.shape and not t.grad.any(), t.grad


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_batches_and_heads_dims_do_not_crash(backend):
    dt = torch.bfloat16 if backend != "reference" else torch.float32
    q, k, v = torch.randn(0, 5, 2, 64).to(dt), torch.randn(0, 7, 2, 64).to(dt), torch.randn(0, 7, 2, 64).to(dt)
    out, lse = A(q, k, v, return_lse=True, backend=backend)
    assert out.shape == q.shape and lse.shape == (0, 2, 5)
    # Varlen with every sequence empty: rows past cu_seqlens_q[-1] get out 0 and lse -inf.
    qv, kv = torch.randn(3, 2, 64).to(dt), torch.randn(0, 2, 64).to(dt)
    out, lse = VL(qv, kv, kv, i32(0, 0, 0), i32(0, 0, 0), 0, 0, return_lse=True, backend=backend)
    assert (out == 0).all() and torch.isneginf(lse).all()


# ------------------------------------------------------------------------------------------------ writes
def _snapshot(*ts):
    return [t.clone() for t in ts]


def test_failed_append_writes_nothing():
    kc, vc = torch.randn(B, 16, HK, D), torch.randn(B, 16, HK, D)
    before = kc.clone(), vc.clone()
    with pytest.raises(SinkattnValueError):
        sinkattn.flash_attn_with_kvcache(torch.randn(B, 2, H, D), kc, vc, k=torch.randn(B, 2, HK, D),
                                         v=torch.randn(B, 2, HK, D), cache_seqlens=i32(0, 15))
    assert torch.equal(kc, before[0]) and torch.equal(vc, before[1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_forward_and_backward_leave_their_inputs_alone(backend):
    dt = torch.bfloat16 if backend != "reference" else torch.float32
    q, k, v = (torch.randn(2, 30, 4, 64).to(dt), torch.randn(2, 40, 2, 64).to(dt), torch.randn(2, 40, 2, 64).to(dt))
    sinks = torch.randn(4)
    before = _snapshot(q, k, v, sinks)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    out, lse = A(*leaves[:3], leaves[3], causal=True, window_size=(9, 0), sink_tokens=2, return_lse=True,
                 backend=backend)
    do = torch.randn_like(out)
    snap_out = _snapshot(out, lse, do)
    torch.autograd.backward([out, lse], [do, torch.ones_like(lse)])
    for a, b in zip(before, leaves):
        assert torch.equal(a, b.detach())
    for a, b in zip(snap_out, (out, lse, do)):
        assert torch.equal(a, b.detach())


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_kvcache_writes_only_the_appended_slots(backend, paged):
    """Every byte of both caches is unchanged except the seqlen_new slots after each sequence's cache_seqlens
    (other sequences' pages and spare pages included); q, k, v and the index tensors are untouched."""
    dt = torch.bfloat16 if backend != "reference" else torch.float32
    b, hk, d, sn, page = 3, 2, 64, 3, 8
    lens = [0, 13, 29]
    if paged:
        kc, vc = torch.randn(14, page, hk, d).to(dt), torch.randn(14, page, hk, d).to(dt)
        bt = torch.randperm(12).to(torch.int32).view(b, 4)
    else:
        kc, vc, bt = torch.randn(b, 32, hk, d).to(dt), torch.randn(b, 32, hk, d).to(dt), None
    q, kn, vn = torch.randn(b, 2, 4, d).to(dt), torch.randn(b, sn, hk, d).to(dt), torch.randn(b, sn, hk, d).to(dt)
    seqlens = i32(*lens)
    inputs = _snapshot(q, kn, vn, seqlens) + ([bt.clone()] if paged else [])
    kc0, vc0 = kc.clone(), vc.clone()
    KV(q, kc, vc, k=kn, v=vn, cache_seqlens=seqlens, block_table=bt, causal=True, num_splits=2, backend=backend)
    written = torch.zeros(kc.shape[:2], dtype=torch.bool)
    for bi, n in enumerate(lens):
        for i in range(sn):
            pos = n + i
            row, slot = (int(bt[bi, pos // page]), pos % page) if paged else (bi, pos)
            written[row, slot] = True
            assert torch.equal(kc[row, slot], kn[bi, i]) and torch.equal(vc[row, slot], vn[bi, i])
    assert torch.equal(kc[~written], kc0[~written]) and torch.equal(vc[~written], vc0[~written])
    for a, t in zip(inputs, (q, kn, vn, seqlens, bt)):
        assert torch.equal(a, t)


@pytest.mark.parametrize("checks", ["1", "0"], ids=["value-checks", "no-host-reads"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_varlen_rows_past_the_last_sequence(backend, checks, monkeypatch):
    """q holds 9 rows more than cu_seqlens_q covers: they get out 0 and lse -inf on every backend (the kernels never
    write them; found here: they were left as torch.empty garbage). With SINKATTN_VALUE_CHECKS=0 (as under CUDA-graph
    capture) the bridge clears them without reading cu_seqlens on the host."""
    monkeypatch.setenv("SINKATTN_VALUE_CHECKS", checks)
    dt = torch.bfloat16 if backend != "reference" else torch.float32
    q, k = torch.randn(30, 4, 64).to(dt), torch.randn(25, 2, 64).to(dt)
    out, lse = VL(q, k, k, i32(0, 12, 21), i32(0, 10, 25), 12, 15, torch.zeros(4), causal=True, return_lse=True,
                  backend=backend)
    assert (out[21:] == 0).all() and torch.isneginf(lse[:, 21:]).all()
    assert out[:21].isfinite().all() and lse[:, :21].isfinite().all()
