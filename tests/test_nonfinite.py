"""Non-finite values (docs/semantics.md, "Non-finite values").

Masked keys never leak: a K/V row a query may not see because of its sequence's extent (the next varlen
sequence, a padded page, a cache slot past cache_seqlens, rows past seqlen_k of a strided view) can hold
inf or NaN and the query's out and lse are bit for bit those of a run where the row holds 0; in the backward the
same holds for dq, dk and dv, with the next sequence's Q and dO rows poisoned too. The check is backend-agnostic
(same backend, same tiling, only the poisoned values differ), so it runs unchanged on the reference, on the sm80
and sm90 kernels under host emulation and (marked gpu) on the real sm80 and sm90 kernels, forward and backward.

Inside a sequence's own key range (keys hidden by causal / window), a masked non-finite K is exact
everywhere (scores are replaced by -inf, not added to); a masked non-finite V is exact on the reference
only: the kernels multiply P = 0 by it inside the tile's P.V matmul (0 * inf = NaN).
"""
from __future__ import annotations

import functools

import pytest
import torch

import sinkattn
from sinkattn import _ext

INF, NAN = float("inf"), float("nan")
POISONS = [INF, -INF, NAN]
EMU = any(k["family"] == "sm80-emulated" and k["headdim"] == 64 and k["dtype"] == "bf16" for k in _ext.registry())
SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)

REF = pytest.param(("reference", "cpu"), id="reference")
EMULATED = pytest.param(("sm80-emulated", "cpu"), id="sm80-emulated",
                        marks=pytest.mark.skipif(not EMU, reason="no emulated hd64 bf16 kernel in this build"))
SM80 = pytest.param(("sm80", "cuda"), id="sm80", marks=pytest.mark.gpu)
SM90_P = pytest.param(("sm90", "cuda"), id="sm90", marks=[pytest.mark.gpu, pytest.mark.skipif(not SM90, reason="cc 9.0")])
# The sm90 kernels' bodies under host emulation (csrc/emu/sm90_prims.h): every sm90 case runs in CI without a GPU.
EMU90 = any(k["family"] == "sm90-emulated" and k["headdim"] == 64 and k["dtype"] == "bf16" for k in _ext.registry())
SM90_EMU = pytest.param(("sm90-emulated", "cpu"), id="sm90-emulated",
                        marks=pytest.mark.skipif(not EMU90, reason="no emulated sm90 hd64 bf16 kernel in this build"))
# The sm90 kernels load varlen K/V through one TMA box over the packed tensor: a key block that runs past its
# sequence's end holds the next sequence's rows (masked to p = 0). Both zero those V rows before P.V reads them
# (csrc/sm90/fwd_kernel.cuh VTail, bwd_kernel.cuh zero_tail); before, a non-finite V there made P.V NaN (0 * inf).


def _poison(t, idx, value):
    t = t.clone()
    t[idx] = value
    return t


def _assert_same(got, want, what):
    assert torch.equal(got, want), f"{what}: differs from the run with finite values there " \
                                   f"({(got != want).sum().item()} elements, non-finite: {(~torch.isfinite(got)).sum().item()})"


# ------------------------------------------------------------------------------------------------ varlen
LQ, LK = [17, 9, 30], [30, 23, 45]   # sequence 1 is poisoned; 0 and 2 must not notice


def _varlen(backend, device, k, v, sinks, grad=False, lq=LQ, **kw):
    cu_q = torch.tensor([0, *torch.tensor(lq).cumsum(0).tolist()], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, *torch.tensor(LK).cumsum(0).tolist()], dtype=torch.int32, device=device)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(sum(lq), 4, 64, generator=gen).to(torch.bfloat16).to(device)
    k, v = k.to(device), v.to(device)
    if grad:
        q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = sinkattn.flash_attn_varlen_with_sinks(q, k, v, cu_q, cu_k, max(lq), max(LK), sinks.to(device),
                                                     return_lse=True, backend=backend, **kw)
    if not grad:
        return out.cpu(), lse.cpu()
    do = torch.randn(out.shape, generator=gen).to(out.dtype).to(device)
    torch.autograd.backward([out, lse], [do, torch.ones_like(lse)])
    return out.cpu(), lse.cpu(), q.grad.cpu(), k.grad.cpu(), v.grad.cpu()


def _kv(total):
    gen = torch.Generator().manual_seed(2)
    return (torch.randn(total, 2, 64, generator=gen).to(torch.bfloat16),
            torch.randn(total, 2, 64, generator=gen).to(torch.bfloat16))


MASKS = [dict(), dict(causal=True, window_size=(6, 0), sink_tokens=2)]


@pytest.mark.parametrize("mask", MASKS, ids=["full", "causal-window-sinktok"])
@pytest.mark.parametrize("which", ["k", "v"])
@pytest.mark.parametrize("poison", POISONS, ids=str)
@pytest.mark.parametrize("bk", [REF, EMULATED, SM80, SM90_P, SM90_EMU])
def test_varlen_next_sequence_never_leaks(bk, poison, which, mask):
    backend, device = bk
    k, v = _kv(sum(LK))
    sinks = torch.randn(4)
    rows = slice(LK[0], LK[0] + LK[1])
    clean = _varlen(backend, device, k, v, sinks, **mask)
    bad = _varlen(backend, device, *((_poison(k, rows, poison), v) if which == "k" else (k, _poison(v, rows, poison))),
                  sinks, **mask)
    for s, (q0, q1) in ((0, (0, LQ[0])), (2, (LQ[0] + LQ[1], sum(LQ)))):
        _assert_same(bad[0][q0:q1], clean[0][q0:q1], f"out of sequence {s}")
        _assert_same(bad[1][:, q0:q1], clean[1][:, q0:q1], f"lse of sequence {s}")


@pytest.mark.parametrize("poison", POISONS, ids=str)
@pytest.mark.parametrize("bk", [REF, EMULATED, SM80, SM90_P, SM90_EMU])
def test_varlen_backward_never_reads_an_unseen_sequence(bk, poison):
    """Sequence 1 has keys but no queries: nothing sees it, so every gradient (and dsinks) stays exact. Sequence 0's
    last key block holds sequence 1's keys and values, which the sm90 kernels zero (csrc/sm90/fwd_kernel.cuh VTail,
    bwd_kernel.cuh zero_tail): before, P V and dQ = dS K took 0 * inf there."""
    backend, device = bk
    lq = [17, 0, 30]
    k, v = _kv(sum(LK))
    rows = slice(LK[0], LK[0] + LK[1])
    sinks = torch.randn(4)
    got = []
    for kk, vv in ((k, v), (_poison(k, rows, poison), _poison(v, rows, poison))):
        s = sinks.clone().requires_grad_()
        res = _varlen(backend, device, kk, vv, s, grad=True, lq=lq, causal=True, window_size=(9, 0))
        got.append((*res, s.grad))
    names = ["out", "lse", "dq", "dk", "dv", "dsinks"]
    keep = torch.ones(sum(LK), dtype=torch.bool)
    keep[rows] = False
    for name, a, b in zip(names, got[0], got[1]):
        if name in ("dk", "dv"):
            a, b = a[keep], b[keep]
        _assert_same(b, a, name)


def varlen_grads(backend, device, poisoned=None, value=0.0, headdim=64, dtype=torch.bfloat16, lq=(17, 9, 30),
                 lk=(30, 23, 45), **mask):
    """out, lse, dq, dk, dv of a deterministic varlen backward (4 query heads, 2 KV heads, sinks) with sequence 1's
    rows of `poisoned` ("q", "k", "v" or "dout") set to `value`. Shared with tests/test_gpu_sm90_backward.py."""
    cu_q = torch.tensor([0, *torch.tensor(lq).cumsum(0).tolist()], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, *torch.tensor(lk).cumsum(0).tolist()], dtype=torch.int32, device=device)
    gen = torch.Generator().manual_seed(14)
    t = {"q": torch.randn(sum(lq), 4, headdim, generator=gen), "k": torch.randn(sum(lk), 2, headdim, generator=gen),
         "v": torch.randn(sum(lk), 2, headdim, generator=gen), "dout": torch.randn(sum(lq), 4, headdim, generator=gen)}
    t = {name: x.to(dtype) for name, x in t.items()}
    if poisoned is not None:
        bounds = lq if poisoned in ("q", "dout") else lk
        t[poisoned] = _poison(t[poisoned], slice(bounds[0], bounds[0] + bounds[1]), value)
    q, k, v = (t[n].to(device).requires_grad_() for n in ("q", "k", "v"))
    out, lse = sinkattn.flash_attn_varlen_with_sinks(q, k, v, cu_q, cu_k, max(lq), max(lk),
                                                     torch.linspace(-1, 1, 4, device=device), return_lse=True,
                                                     deterministic=True, backend=backend, **mask)
    torch.autograd.backward([out, lse], [t["dout"].to(device), torch.ones_like(lse)])
    return [x.detach().cpu() for x in (out, lse, q.grad, k.grad, v.grad)]


@functools.lru_cache(maxsize=None)
def _clean_grads(backend, device, headdim, dtype, lq, lk, **mask):
    """The clean run of varlen_grads, computed once per kernel and mask: it is deterministic (fixed inputs,
    deterministic=True), and each poisoned case compares against it (read only)."""
    return varlen_grads(backend, device, None, 0.0, headdim, dtype, lq, lk, **mask)


def check_rows_past_a_sequence_never_leak(backend, device, which, poison, headdim=64, dtype=torch.bfloat16,
                                          lq=(17, 9, 30), lk=(30, 23, 45), **mask):
    """Sequence 1's rows of `which` hold `poison`: sequences 0 and 2 (out, lse, dq, dk, dv) are bit for bit those
    of the clean run. Sequence 0's last M tile holds sequence 1's query rows (q, dout) and its last key block
    sequence 1's keys (k, v) whenever the tiles are longer than sequence 0."""
    clean = _clean_grads(backend, device, headdim, dtype, tuple(lq), tuple(lk), **mask)
    bad = varlen_grads(backend, device, which, poison, headdim, dtype, lq, lk, **mask)
    q_rows = [(0, lq[0]), (lq[0] + lq[1], sum(lq))]
    k_rows = [(0, lk[0]), (lk[0] + lk[1], sum(lk))]
    for s, (q0, q1), (k0, k1) in zip((0, 2), q_rows, k_rows):
        rows = {"out": (slice(q0, q1),), "lse": (slice(None), slice(q0, q1)), "dq": (slice(q0, q1),),
                "dk": (slice(k0, k1),), "dv": (slice(k0, k1),)}
        for (name, sl), a, b in zip(rows.items(), clean, bad):
            _assert_same(b[sl], a[sl], f"{name} of sequence {s} ({which} of sequence 1 = {poison})")


@pytest.mark.parametrize("mask", MASKS, ids=["full", "causal-window-sinktok"])
@pytest.mark.parametrize("which", ["q", "k", "v", "dout"])
@pytest.mark.parametrize("poison", POISONS, ids=str)
@pytest.mark.parametrize("bk", [REF, EMULATED, SM80, SM90_P, SM90_EMU])
def test_varlen_backward_rows_past_a_sequence_never_leak(bk, poison, which, mask):
    """The tiles run past a sequence's end into the next sequence's rows (sm90: one TMA box over the packed tensors;
    both sm90 kernels zero them, as the sm80 kernels' loads zero-fill them). Before, an inf in sequence 1's K, Q, V
    or dO turned sequence 0's out / dQ / dK / dV into NaN (0 * inf inside the products)."""
    backend, device = bk
    check_rows_past_a_sequence_never_leak(backend, device, which, poison, **mask)


# ------------------------------------------------------------------------------------------------ KV cache
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged16"])
@pytest.mark.parametrize("poison", POISONS, ids=str)
@pytest.mark.parametrize("bk", [REF, EMULATED, SM80])
def test_cache_slots_past_seqlens_never_leak(bk, poison, paged):
    """Slots past cache_seqlens + new tokens, padded slots of a sequence's last page, pages no sequence uses,
    and block-table columns past a sequence's pages (pointing at a poisoned page) hold `poison`."""
    backend, device = bk
    b, hk, h, d, cap, page = 3, 2, 8, 64, 96, 16
    lens, sn = [5, 40, 0], 1
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(b, 1, h, d, generator=gen).to(torch.bfloat16)
    kn, vn = (torch.randn(b, sn, hk, d, generator=gen).to(torch.bfloat16) for _ in range(2))
    dense_k, dense_v = (torch.randn(b, cap, hk, d, generator=gen).to(torch.bfloat16) for _ in range(2))
    results = []
    for value in (0.0, poison):
        if not paged:
            kc, vc, bt = dense_k.clone(), dense_v.clone(), None
            for bi, n in enumerate(lens):
                kc[bi, n + sn:] = value
                vc[bi, n + sn:] = value
        else:
            per = cap // page
            kc = torch.full((b * per + 1, page, hk, d), value).to(torch.bfloat16)
            vc = kc.clone()
            bt = torch.full((b, per), b * per, dtype=torch.int32)  # unused columns: the all-poison spare page
            for bi, n in enumerate(lens):
                for p in range((n + sn + page - 1) // page):
                    dst = bi * per + (per - 1 - p)  # pages in reverse order, so neighbours are not the next page
                    bt[bi, p] = dst
                    kc[dst] = dense_k[bi, p * page:(p + 1) * page]
                    vc[dst] = dense_v[bi, p * page:(p + 1) * page]
                    used = min(page, n + sn - p * page)
                    kc[dst, used:] = value
                    vc[dst, used:] = value
        dev = lambda t: None if t is None else t.to(device)  # noqa: E731
        out, lse = sinkattn.flash_attn_with_kvcache(
            dev(q), dev(kc), dev(vc), dev(torch.linspace(-1, 1, h)), k=dev(kn), v=dev(vn),
            cache_seqlens=dev(torch.tensor(lens, dtype=torch.int32)), block_table=dev(bt), causal=True,
            return_lse=True, num_splits=2, backend=backend)
        results.append((out.cpu(), lse.cpu()))
    _assert_same(results[1][0], results[0][0], "out")
    _assert_same(results[1][1], results[0][1], "lse")


# ------------------------------------------------------------------------------------------------ tails
@pytest.mark.parametrize("poison", POISONS, ids=str)
@pytest.mark.parametrize("bk", [REF, EMULATED, SM80, SM90_P, SM90_EMU])
def test_rows_past_seqlen_k_of_a_view_never_leak(bk, poison):
    """k, v are views of the first 70 of 128 rows: a key block's tail lies inside the allocation."""
    backend, device = bk
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(2, 50, 4, 64, generator=gen).to(torch.bfloat16).to(device)
    big_k, big_v = (torch.randn(2, 128, 2, 64, generator=gen).to(torch.bfloat16) for _ in range(2))
    res = []
    for value in (0.0, poison):
        bk_, bv_ = big_k.clone(), big_v.clone()
        bk_[:, 70:] = value
        bv_[:, 70:] = value
        bk_, bv_ = bk_.to(device), bv_.to(device)
        out, lse = sinkattn.flash_attn_with_sinks(q, bk_[:, :70], bv_[:, :70], torch.zeros(4, device=device),
                                                  causal=True, return_lse=True, backend=backend)
        res.append((out.cpu(), lse.cpu()))
    _assert_same(res[1][0], res[0][0], "out")
    _assert_same(res[1][1], res[0][1], "lse")


# ------------------------------------------------------------------------------------------------ inside the sequence
def _causal_pair(backend, device, k, v, grad=False):
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(1, 40, 4, 64, generator=gen).to(torch.bfloat16).to(device)
    k, v = k.to(device), v.to(device)
    if grad:
        q.requires_grad_()
    out, lse = sinkattn.flash_attn_with_sinks(q, k, v, torch.zeros(4, device=device), causal=True,
                                              return_lse=True, backend=backend)
    if not grad:
        return out.cpu(), lse.cpu()
    out.backward(torch.ones_like(out))
    return out.cpu(), lse.cpu(), q.grad.cpu()


@pytest.mark.parametrize("poison", POISONS, ids=str)
@pytest.mark.parametrize("bk", [REF, EMULATED, SM80, SM90_P, SM90_EMU])
def test_causally_masked_nonfinite_k_is_exact(bk, poison):
    """Key 30 holds `poison` in K: rows 0..29 (which may not see it) are exact, rows 30.. see it."""
    backend, device = bk
    gen = torch.Generator().manual_seed(6)
    k, v = (torch.randn(1, 40, 2, 64, generator=gen).to(torch.bfloat16) for _ in range(2))
    clean = _causal_pair(backend, device, k, v)
    bad = _causal_pair(backend, device, _poison(k, (0, 30), poison), v)
    _assert_same(bad[0][:, :30], clean[0][:, :30], "out of rows 0..29")
    _assert_same(bad[1][..., :30], clean[1][..., :30], "lse of rows 0..29")


@pytest.mark.parametrize("poison", POISONS, ids=str)
def test_reference_masked_nonfinite_v_is_exact_and_visible_ones_propagate(poison):
    """The reference backend: a non-finite V entry reaches exactly the (row, head, dim) entries that see it,
    forward and dq; rows that may not see it are bit for bit unchanged."""
    gen = torch.Generator().manual_seed(7)
    k, v = (torch.randn(1, 40, 2, 64, generator=gen).to(torch.bfloat16) for _ in range(2))
    clean = _causal_pair("reference", "cpu", k, v, grad=True)
    bad = _causal_pair("reference", "cpu", k, _poison(v, (0, 30, 1, 5), poison), grad=True)
    for name, a, b in zip(("out", "lse", "dq"), clean, bad):
        sl = (slice(None), slice(0, 30)) if name != "lse" else (Ellipsis, slice(0, 30))
        _assert_same(b[sl], a[sl], f"{name} of rows 0..29")
    # KV head 1 serves query heads 2 and 3: only their dim 5 turns non-finite, in every row that sees key 30.
    nonfinite = ~torch.isfinite(bad[0].float())
    want = torch.zeros_like(nonfinite)
    want[0, 30:, 2:, 5] = True
    assert torch.equal(nonfinite, want)
    assert torch.equal(bad[1], clean[1])  # lse does not read V


@pytest.mark.parametrize("bk", [EMULATED, SM80, SM90_P, SM90_EMU])
def test_kernel_masked_nonfinite_v_stays_in_its_key_block(bk):
    """The kernels' documented limit: a masked inf in V can reach (as NaN) rows whose key blocks include it
    (P = 0 times inf inside P.V), never rows whose visited blocks do not. With window (5, 0) and 300 keys, key
    10's V poisoned: the sm80 kernels' 64-row tiles from row 192 on visit only key blocks from 128 on; the sm90
    forward's 128-row tile of rows 128..255 visits key block 0 for row 128 (keys 123..127), so every row of that
    tile may be NaN, and its tiles from row 256 on visit only blocks from 128 on (found by the sm90 emulation)."""
    backend, device = bk
    first_clean = 256 if backend.startswith("sm90") else 200
    gen = torch.Generator().manual_seed(8)
    q = torch.randn(1, 300, 2, 64, generator=gen).to(torch.bfloat16).to(device)
    k, v = (torch.randn(1, 300, 2, 64, generator=gen).to(torch.bfloat16) for _ in range(2))
    res = []
    for vv in (v, _poison(v, (0, 10), INF)):
        out, lse = sinkattn.flash_attn_with_sinks(q, k.to(device), vv.to(device), causal=True, window_size=(5, 0),
                                                  return_lse=True, backend=backend)
        res.append((out.cpu(), lse.cpu()))
    _assert_same(res[1][0][:, first_clean:], res[0][0][:, first_clean:], "out of rows whose blocks exclude key 10")
    assert torch.equal(res[1][1], res[0][1])  # lse never reads V
    assert not torch.isfinite(res[1][0][:, 10:16].float()).all()  # the rows that see key 10


# ------------------------------------------------------------------------------------------------ sinks
# Found by these tests: the kernels' finalize (csrc/common/softmax.h finalize_row, shared by the sm80 and sm90
# forward and decode), the split-KV combine (split.h combine_lse) and the backward's sink probability
# (bwd_prepost.h) took exp(sink - max) = exp(inf - inf) = NaN. Now all three give the contract's answer: all the
# weight on the sink, out 0, lse +inf, and the row's dsinks term dlse_i - D_i.


def _sink_run(backend, device, sinks):
    gen = torch.Generator().manual_seed(9)
    q = torch.randn(1, 20, 4, 64, generator=gen).to(torch.bfloat16).to(device)
    k, v = (torch.randn(1, 30, 4, 64, generator=gen).to(torch.bfloat16).to(device) for _ in range(2))
    return [t.cpu() for t in sinkattn.flash_attn_with_sinks(q, k, v, None if sinks is None else sinks.to(device),
                                                             causal=True, return_lse=True, backend=backend)]


@pytest.mark.parametrize("bk", [REF, EMULATED, SM80, SM90_P, SM90_EMU])
def test_plus_inf_sink_takes_all_the_weight(bk):
    backend, device = bk
    out, lse = _sink_run(backend, device, torch.tensor([0.5, INF, 0.0, INF]))
    assert torch.equal(out[:, :, 1::2], torch.zeros_like(out[:, :, 1::2]))
    assert torch.isposinf(lse[:, 1::2]).all()
    ref_out, ref_lse = _sink_run(backend, device, torch.tensor([0.5, 0.0, 0.0, 0.0]))
    _assert_same(out[:, :, 0::2], ref_out[:, :, 0::2], "out of the finite-sink heads")


@pytest.mark.parametrize("bk", [REF, EMULATED, SM80])
def test_plus_inf_sink_through_split_decode(bk):
    """The split-KV combine adds the sink once: a +inf sink there gives out 0 and lse +inf, not inf - inf."""
    backend, device = bk
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(2, 1, 4, 64, generator=gen).to(torch.bfloat16).to(device)
    kc, vc = (torch.randn(2, 200, 2, 64, generator=gen).to(torch.bfloat16).to(device) for _ in range(2))
    lens = torch.tensor([200, 57], dtype=torch.int32, device=device)

    def run(sinks, splits):
        return [t.cpu() for t in sinkattn.flash_attn_with_kvcache(
            q, kc, vc, torch.tensor(sinks, device=device), cache_seqlens=lens, num_splits=splits, return_lse=True,
            backend=backend)]
    out, lse = run([INF, 0.5, INF, -1.0], 3)
    assert torch.equal(out[:, :, 0::2], torch.zeros_like(out[:, :, 0::2])) and torch.isposinf(lse[:, 0::2]).all()
    ref_out, ref_lse = run([0.0, 0.5, 0.0, -1.0], 3)
    _assert_same(out[:, :, 1::2], ref_out[:, :, 1::2], "out of the finite-sink heads")
    _assert_same(lse[:, 1::2], ref_lse[:, 1::2], "lse of the finite-sink heads")


@pytest.mark.parametrize("bk", [REF, EMULATED, SM80, SM90_P, SM90_EMU])
def test_plus_inf_sink_gradients(bk):
    """A +inf sink head passes no gradient to q, k, v (every p is 0) and its dsinks is the sum of the rows'
    dlse (p_sink = 1, D = 0 since out = 0); the finite head is unaffected."""
    backend, device = bk
    gen = torch.Generator().manual_seed(12)
    q, k, v = (torch.randn(1, 24, 2, 64, generator=gen).to(torch.bfloat16).to(device).requires_grad_()
               for _ in range(3))
    sinks = torch.tensor([INF, 0.5], device=device, requires_grad=True)
    out, lse = sinkattn.flash_attn_with_sinks(q, k, v, sinks, causal=True, return_lse=True, backend=backend)
    g = torch.randn(out.shape, generator=gen).to(out.dtype).to(device)
    w = torch.randn(lse.shape, generator=gen).to(device)
    torch.autograd.backward([out, lse], [g, w])
    for name, t in (("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
        assert torch.equal(t[:, :, 0], torch.zeros_like(t[:, :, 0])), f"{name} of the +inf-sink head is not 0"
        assert torch.isfinite(t).all() and t[:, :, 1].abs().sum() > 0, name
    want = w[0, 0].sum()
    assert torch.isfinite(sinks.grad).all()
    assert abs(sinks.grad[0].item() - want.item()) <= 1e-4 * (1 + abs(want.item())), (sinks.grad, want)


@pytest.mark.parametrize("bk", [REF, EMULATED, SM80, SM90_P, SM90_EMU])
def test_nonfinite_sinks(bk):
    """sinks per head: -inf is plain attention, NaN gives NaN (out and lse) for that head only; finite heads are
    unchanged (+inf: the test above)."""
    backend, device = bk
    gen = torch.Generator().manual_seed(9)
    q = torch.randn(1, 20, 4, 64, generator=gen).to(torch.bfloat16).to(device)
    k, v = (torch.randn(1, 30, 4, 64, generator=gen).to(torch.bfloat16).to(device) for _ in range(2))
    sinks = torch.tensor([0.5, -INF, 0.0, NAN], device=device)
    out, lse = (t.cpu() for t in sinkattn.flash_attn_with_sinks(q, k, v, sinks, causal=True, return_lse=True,
                                                                backend=backend))
    ref_out, ref_lse = (t.cpu() for t in sinkattn.flash_attn_with_sinks(
        q, k, v, torch.tensor([0.5, -INF, 0.0, 0.0], device=device), causal=True, return_lse=True, backend=backend))
    plain_out, plain_lse = (t.cpu() for t in sinkattn.flash_attn_with_sinks(q, k, v, causal=True, return_lse=True,
                                                                            backend=backend))
    _assert_same(out[:, :, :2], ref_out[:, :, :2], "out of the finite-sink and -inf-sink heads")
    _assert_same(lse[:, :2], ref_lse[:, :2], "lse of the finite-sink and -inf-sink heads")
    _assert_same(out[:, :, 1], plain_out[:, :, 1], "-inf sink vs no sink")
    assert torch.isnan(out[:, :, 3].float()).all() and torch.isnan(lse[:, 3]).all()
    assert torch.equal(plain_lse[:, 1], lse[:, 1])


@pytest.mark.parametrize("poison", POISONS)
def test_decode_sized_calls_keep_masked_v_out(poison):
    """Calls of at most 16 query rows take the reference backend's direct path (one pass, no tiles): a masked V
    row holding inf/NaN must not reach the rows that do not see it there either (found by merging the decode
    fast path with these tests: p @ v multiplied p = 0 by inf). Keys past the window's right edge (causal) and
    left of its left edge (window) are poisoned; only the last query sees key 9. Reference only: inside a
    sequence's key range the kernels may turn a block's rows into NaN (docs/semantics.md, "Non-finite values")."""
    backend, device = "reference", "cpu"
    gen = torch.Generator().manual_seed(13)
    q = torch.randn(1, 3, 2, 64, generator=gen).to(torch.bfloat16).to(device)
    k, v = (torch.randn(1, 10, 2, 64, generator=gen).to(torch.bfloat16).to(device) for _ in range(2))
    bad = _poison(v, (0, 9), poison)
    bad = _poison(bad, (0, 0), poison)  # left of every row's window (4 keys)
    kw = dict(causal=True, window_size=(3, 0), return_lse=True, backend=backend)
    out, lse = (t.cpu() for t in sinkattn.flash_attn_with_sinks(q, k, bad, **kw))
    ref_out, ref_lse = (t.cpu() for t in sinkattn.flash_attn_with_sinks(q, k, _poison(_poison(v, (0, 9), 0.0),
                                                                                        (0, 0), 0.0), **kw))
    _assert_same(out[:, :2], ref_out[:, :2], "out of the rows that do not see key 9")
    _assert_same(lse, ref_lse, "lse")
    assert not torch.isfinite(out[:, 2].float()).all()  # the row that sees it
