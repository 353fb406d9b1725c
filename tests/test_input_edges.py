"""Bad input everywhere a user can reach, and calls that write only their outputs (issue 19, item 6).

tests/test_errors.py holds the table of malformed arguments per public function; this file adds the cases
found by probing every argument (flags given as strings, int32 overflow, caches whose memory is shared),
merge_attn_states, and checks that a call writes nothing but its outputs (and the appended cache slots).
"""
import pytest
import torch

import sinkattn
from sinkattn import SinkattnError, SinkattnTypeError, SinkattnValueError, _ext
from oracle import single_thread  # noqa: F401  (autouse: one torch thread per test)

B, S, H, HK, D = 2, 8, 4, 2, 32
EMU = any(k["family"] == "sm80-emulated" and k["headdim"] == 64 and k["dtype"] == "bf16" for k in _ext.registry())
BACKENDS = ["reference", pytest.param("sm80-emulated", marks=pytest.mark.skipif(not EMU, reason="no emulated kernels"))]


def i32(*xs):
    return torch.tensor(xs, dtype=torch.int32)


q0, k0, v0 = torch.randn(B, S, H, D), torch.randn(B, S, HK, D), torch.randn(B, S, HK, D)
A, VL, KV, M = (sinkattn.flash_attn_with_sinks, sinkattn.flash_attn_varlen_with_sinks, sinkattn.flash_attn_with_kvcache,
                sinkattn.merge_attn_states)
LSE = torch.zeros(B, H, S)

CASES = [
    # (id, call, exception type, words the message must contain)
    ("return-lse-str", lambda: A(q0, k0, v0, return_lse="yes"), SinkattnTypeError, ["return_lse", "bool", "'yes'"]),
    ("deterministic-str", lambda: A(q0, k0, v0, deterministic="no"), SinkattnTypeError, ["deterministic", "bool"]),
    ("varlen-deterministic-int", lambda: VL(q0[0], k0[0], v0[0], i32(0, 8), i32(0, 8), 8, 8, deterministic=1),
     SinkattnTypeError, ["deterministic"]),
    ("kvcache-return-lse-none", lambda: KV(q0[:, :1], k0, v0, cache_seqlens=3, return_lse=None), SinkattnTypeError,
     ["return_lse"]),
    ("varlen-max-seqlen-past-int32", lambda: VL(q0[0], k0[0], v0[0], i32(0, 8), i32(0, 8), 2**40, 8),
     SinkattnValueError, ["max_seqlen_q", "2147483647"]),
    ("varlen-cu-negative", lambda: VL(q0[0], k0[0], v0[0], i32(0, -2), i32(0, 8), 8, 8), SinkattnValueError,
     ["cu_seqlens_q", "non-decreasing"]),
    ("kvcache-broadcast-cache-append", lambda: KV(q0[:, :1], k0[:1].expand(B, -1, -1, -1), v0, k=k0[:, :1],
                                                 v=v0[:, :1], cache_seqlens=i32(1, 2)),
     SinkattnValueError, ["k_cache", "sharing memory"]),
    ("kvcache-same-cache-twice", lambda: KV(q0[:, :1], k0, k0, k=k0[:, :1], v=v0[:, :1], cache_seqlens=i32(1, 2)),
     SinkattnValueError, ["k_cache", "v_cache", "same memory"]),
    ("kvcache-cache-seqlens-list", lambda: KV(q0[:, :1], k0, v0, cache_seqlens=[1, 2]), SinkattnTypeError,
     ["cache_seqlens"]),
    ("kvcache-block-table-1d", lambda: KV(q0[:, :1], torch.randn(4, 4, HK, D), torch.randn(4, 4, HK, D),
                                         cache_seqlens=i32(1, 1), block_table=i32(0, 1)),
     SinkattnValueError, ["block_table", "2-D"]),
    ("kvcache-pages-past-table", lambda: KV(q0[:, :1], torch.randn(4, 4, HK, D), torch.randn(4, 4, HK, D),
                                           k=k0[:, :1], v=v0[:, :1], cache_seqlens=i32(4, 1),
                                           block_table=i32(0, 1).view(2, 1)),
     SinkattnValueError, ["cache_seqlens[0]", "capacity of 4"]),
    ("merge-lse-int", lambda: M(q0, LSE.int(), q0, LSE), SinkattnTypeError, ["lse_a", "int32"]),
    ("merge-out-3d", lambda: M(q0[0], LSE[0], q0[0], LSE[0]), SinkattnValueError, ["out_a", "out_b"]),
    ("merge-lse-shape", lambda: M(q0, LSE[:, :, :3], q0, LSE), SinkattnValueError, ["lse_a", "(2, 4, 8)"]),
    ("merge-device", lambda: M(q0, LSE.to("meta"), q0, LSE), SinkattnValueError, ["one device", "meta"]),
    ("merge-out-dtype", lambda: M(q0, LSE, q0.half(), LSE), SinkattnTypeError, ["out_a", "float16"]),
    ("merge-sinks-shape", lambda: M(q0, LSE, q0, LSE, torch.zeros(3)), SinkattnValueError, ["sinks", "(4,)"]),
    ("merge-sinks-int", lambda: M(q0, LSE, q0, LSE, torch.zeros(H, dtype=torch.int64)), SinkattnTypeError,
     ["sinks", "int64"]),
    ("merge-not-tensor", lambda: M(q0, None, q0, LSE), SinkattnTypeError, ["lse_a", "NoneType"]),
]


@pytest.mark.parametrize("call,exc,words", [pytest.param(*c[1:], id=c[0]) for c in CASES])
def test_error(call, exc, words):
    with pytest.raises(exc) as info:
        call()
    assert isinstance(info.value, SinkattnError)
    for w in words:
        assert w in str(info.value), f"{w!r} not in message: {info.value}"


def test_interleaved_kv_views_may_share_an_allocation():
    """kv[:, :, 0] and kv[:, :, 1] (one allocation, disjoint elements) are separate caches: appending works."""
    kv = torch.randn(B, S, 2, HK, D)
    kn, vn = torch.randn(B, 1, HK, D), torch.randn(B, 1, HK, D)
    out = KV(q0[:, :1], kv[:, :, 0], kv[:, :, 1], k=kn, v=vn, cache_seqlens=i32(2, 5))
    assert torch.equal(kv[0, 2, 0], kn[0, 0]) and torch.equal(kv[1, 5, 1], vn[1, 0]) and out.isfinite().all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_bounds_past_int32_mean_unbounded(backend):
    """Windows and sink-token counts past INT32_MAX are clamped (positions are int32, so nothing changes):
    the kernels never see an overflowing int."""
    dt = torch.bfloat16 if backend != "reference" else torch.float32
    q, k, v = (t.to(dt) for t in (torch.randn(1, 40, 2, 64), torch.randn(1, 50, 2, 64), torch.randn(1, 50, 2, 64)))
    want = A(q, k, v, causal=True, backend=backend)
    assert torch.equal(A(q, k, v, causal=True, window_size=(2**40, 0), backend=backend), want)
    assert torch.equal(A(q, k, v, causal=True, window_size=(3, 0), sink_tokens=2**40, backend=backend), want)


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
