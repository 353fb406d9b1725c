"""The kernels' host-visible mask policy and softmax/merge math (csrc/common/), called through _C.

Checked against docs/DESIGN.md section 1 written out again here (`spec_visible`), independently of the code
under test and of tests/oracle.py (which is cross-checked too when it is importable):

  (a) `mask_visible` equals the contract's visibility exactly;
  (b) per M tile, the union of the element-visible pairs over the visited n-blocks is the tile's full
      visibility: no visible pair outside a visited block, no block visited twice by one tile;
  (c) a block reported needs_mask == 0 has every (valid row, column) pair visible;
  (d) needs_mask is exact: a block reported 1 holds an invisible pair (valid rows x its columns), or
      reaches past seqlen_k;
  (e) every visited block holds at least one visible pair (the CTA visits sink and window blocks only).

`finalize_rows` and `merge_weights` are compared with float64 math.
"""
from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

import sinkattn

C = sinkattn._ext._C
pytestmark = pytest.mark.skipif(C is None, reason=f"no compiled extension: {sinkattn._ext.IMPORT_ERROR}")

BLOCKS = [(128, 64), (64, 64), (64, 32), (128, 128), (16, 16)]


# ---- the contract, written out again -------------------------------------------------------------------
def spec_visible(sq: int, sk: int, left: int, right: int, ns: int) -> np.ndarray:
    """docs/DESIGN.md section 1: right_ok and left_ok (sink tokens relax the left edge only), j < sk."""
    i = np.arange(sq)[:, None]
    j = np.arange(sk)[None, :]
    off = sk - sq
    right_ok = (right < 0) | (j <= i + off + right)
    left_ok = (left < 0) | (j >= i + off - left) | (j < ns)
    return np.broadcast_to(right_ok & left_ok, (sq, sk)).copy()


def test_spec_visible_by_hand():
    # causal, sq == sk: lower triangle
    assert (spec_visible(3, 3, -1, 0, 0) == np.tril(np.ones((3, 3), bool))).all()
    # bottom-right alignment: sq=2, sk=4 causal -> row 0 sees keys 0..2, row 1 all four
    assert spec_visible(2, 4, -1, 0, 0).tolist() == [[True, True, True, False], [True, True, True, True]]
    # sq > sk causal: the first sq - sk rows see nothing
    assert spec_visible(4, 2, -1, 0, 0).tolist() == [[False, False], [False, False], [True, False], [True, True]]
    # window (1, 0) with one sink token on 5x5
    v = spec_visible(5, 5, 1, 0, 1)
    assert v[4].tolist() == [True, False, False, True, True]
    assert v[0].tolist() == [True, False, False, False, False]
    # a sink token never lets a query see past its right edge
    assert not spec_visible(5, 5, 1, 0, 5)[0, 1]


def _oracle_visible():
    try:
        import oracle  # tests/oracle.py, written by another engineer
        return oracle.visible
    except Exception:  # pragma: no cover - not there yet
        return None


# ---- problem generation -------------------------------------------------------------------------------
def _edge_problems():
    """Hand-picked corners: empty, one token, sq > sk and sq < sk, windows narrower than a block,
    right > 0, sink tokens 0 / 1 / 4 / beyond seqlen_k."""
    out = []
    seqs = [(0, 0), (0, 5), (5, 0), (1, 1), (1, 300), (300, 1), (17, 300), (300, 17), (128, 128), (129, 63),
            (64, 200), (200, 64), (257, 255), (33, 97)]
    windows = [(-1, -1), (-1, 0), (0, 0), (3, 0), (127, 0), (5, 7), (-1, 9), (40, -1), (0, 65), (200, 3)]
    for (sq, sk) in seqs:
        for (wl, wr) in windows:
            for ns in (0, 1, 4, sk + 3):
                out.append((sq, sk, wl, wr, ns))
    return out


def _random_problems(rnd: random.Random, n: int):
    out = []
    for _ in range(n):
        sq, sk = rnd.randint(0, 300), rnd.randint(0, 300)
        kind = rnd.choice(["full", "causal", "window", "window_right", "left_only", "right_only", "narrow"])
        wl, wr = {
            "full": (-1, -1),
            "causal": (-1, 0),
            "window": (rnd.randint(0, 300), 0),
            "window_right": (rnd.randint(0, 300), rnd.randint(1, 100)),
            "left_only": (rnd.randint(0, 300), -1),
            "right_only": (-1, rnd.randint(0, 100)),
            "narrow": (rnd.randint(0, 12), rnd.randint(0, 12)),
        }[kind]
        ns = rnd.choice([0, 1, 4, rnd.randint(0, 300), sk + rnd.randint(1, 50)])
        out.append((sq, sk, wl, wr, ns))
    return out


# ---- (a) element visibility ---------------------------------------------------------------------------
def test_mask_visible_matches_contract(rng_seed):
    rnd = random.Random(rng_seed)
    ov = _oracle_visible()
    problems = _edge_problems()[::3] + _random_problems(rnd, 120)
    for (sq, sk, wl, wr, ns) in problems:
        got = C.mask_visible(sq, sk, wl, wr, ns)
        assert got.dtype == torch.bool and tuple(got.shape) == (sq, sk)
        want = spec_visible(sq, sk, wl, wr, ns)
        bad = np.argwhere(got.numpy() != want)
        assert bad.size == 0, (f"seed {rng_seed}: mask_visible{(sq, sk, wl, wr, ns)} differs from docs/DESIGN.md at "
                               f"(i, j) = {bad[:5].tolist()} (want {want[tuple(bad[0])]})")
        if ov is not None:
            assert (ov(sq, sk, wl, wr, ns).numpy() == want).all(), f"tests/oracle.visible{(sq, sk, wl, wr, ns)}"


# ---- (b)-(e) the blocks a tile visits -----------------------------------------------------------------
def check_tiles(sq, sk, wl, wr, ns, bm, bn, where=""):
    """Returns (blocks visited, blocks with needs_mask=1); raises AssertionError with the first violation."""
    tag = f"{where}mask_tile_blocks{(sq, sk, wl, wr, ns, bm, bn)}"
    vis = spec_visible(sq, sk, wl, wr, ns)
    rows = C.mask_tile_blocks(sq, sk, wl, wr, ns, bm, bn)
    assert rows.dtype == torch.int32 and rows.dim() == 2 and rows.shape[1] == 3, tag
    rows = rows.numpy()
    m_blocks = -(-sq // bm)
    n_blocks_total = -(-sk // bn)
    seen = set()
    covered = np.zeros((sq, sk), dtype=np.int32)
    masked = 0
    for m, n, need in rows.tolist():
        assert 0 <= m < m_blocks, f"{tag}: m_block {m} out of range [0, {m_blocks})"
        assert 0 <= n < n_blocks_total, f"{tag}: m_block {m} visits n_block {n}, keys end at block {n_blocks_total}"
        assert need in (0, 1), f"{tag}: needs_mask {need}"
        assert (m, n) not in seen, f"{tag}: m_block {m} visits n_block {n} twice"
        seen.add((m, n))
        r0, r1 = m * bm, min(m * bm + bm, sq)
        c0, c1 = n * bn, min(n * bn + bn, sk)
        blk = vis[r0:r1, c0:c1]
        covered[r0:r1, c0:c1] += blk
        # (e) no wasted block
        assert blk.any(), f"{tag}: m_block {m} visits n_block {n}, which holds no visible pair"
        # (c) / (d) needs_mask is exact
        has_hidden = (not blk.all()) or (n * bn + bn > sk)
        if need == 0:
            hidden = np.argwhere(~blk)
            assert not has_hidden, (f"{tag}: block (m={m}, n={n}) reported needs_mask=0 but pair "
                                    f"(i, j) = {(r0 + hidden[0][0], c0 + hidden[0][1]) if hidden.size else 'tail'} "
                                    f"is not visible")
        else:
            masked += 1
            assert has_hidden, f"{tag}: block (m={m}, n={n}) reported needs_mask=1 but every pair is visible"
    # (b) union == visibility, each pair once
    assert covered.max(initial=0) <= 1, f"{tag}: a pair is covered twice"
    missing = np.argwhere(vis & (covered == 0))
    assert missing.size == 0, (f"{tag}: visible pair (i, j) = {tuple(missing[0])} lies in no visited block "
                               f"(m_block {missing[0][0] // bm}, n_block {missing[0][1] // bn})")
    assert ((covered == 1) == vis).all(), tag
    return len(rows), masked


@pytest.mark.parametrize("bm,bn", BLOCKS)
def test_tile_blocks_edge_cases(bm, bn):
    for (sq, sk, wl, wr, ns) in _edge_problems():
        check_tiles(sq, sk, wl, wr, ns, bm, bn)


def test_tile_blocks_random(rng_seed):
    rnd = random.Random(rng_seed)
    totals = {}
    for (sq, sk, wl, wr, ns) in _random_problems(rnd, 250):
        bm, bn = rnd.choice(BLOCKS)
        visited, masked = check_tiles(sq, sk, wl, wr, ns, bm, bn, where=f"seed {rng_seed}: ")
        t = totals.setdefault((bm, bn), [0, 0])
        t[0] += visited
        t[1] += masked
    # (d), reported: needs_mask is exact (asserted per block above), so the masked fraction is what the
    # problems demand; it is printed for the record (pytest -s).
    for (bm, bn), (v, m) in sorted(totals.items()):
        print(f"blocks {bm}x{bn}: {v} visited, {m} with the element mask ({m / max(v, 1):.0%})")


def test_tile_blocks_exhaustive_small():
    """Every small problem: seqlens 0..9 against tiny blocks, all window shapes, sink tokens 0..3 + beyond."""
    for sq in range(0, 10):
        for sk in range(0, 10):
            for wl in (-1, 0, 1, 3):
                for wr in (-1, 0, 1, 4):
                    for ns in (0, 1, 3, 12):
                        for bm, bn in ((2, 2), (4, 2), (2, 4), (3, 5)):
                            check_tiles(sq, sk, wl, wr, ns, bm, bn)


def test_tile_blocks_skip_whole_blocks():
    """Block skipping is real: a narrow window with sink tokens on a long sequence visits the sink block and
    the window blocks only, and interior causal blocks run without the element mask."""
    rows = C.mask_tile_blocks(1024, 1024, 127, 0, 4, 128, 64).numpy()
    per_tile = {}
    for m, n, _ in rows.tolist():
        per_tile.setdefault(m, []).append(n)
    # the last tile: rows 896..1023 see keys [769, 1023] plus keys 0..3 -> blocks 12..15 and block 0
    assert sorted(per_tile[7]) == [0, 12, 13, 14, 15]
    assert len(rows) < 8 * 16 // 2
    causal = C.mask_tile_blocks(512, 512, -1, 0, 0, 128, 64).numpy()
    full_blocks = [(m, n) for m, n, need in causal.tolist() if need == 0]
    # tile m covers rows [128m, 128m+127]: blocks n with 64n+63 <= 128m are unmasked
    want = [(m, n) for m in range(4) for n in range(8) if 64 * n + 63 <= 128 * m]
    assert sorted(full_blocks) == sorted(want)
    # no window at all: every block visited, none masked when the sizes divide
    full = C.mask_tile_blocks(256, 256, -1, -1, 0, 128, 64).numpy()
    assert len(full) == 2 * 4 and (full[:, 2] == 0).all()
    # a key tail always needs the mask
    tail = C.mask_tile_blocks(128, 100, -1, -1, 0, 128, 64).numpy()
    assert tail[:, 1].tolist() in ([1, 0], [0, 1]) and dict(zip(tail[:, 1].tolist(), tail[:, 2].tolist())) == {0: 0, 1: 1}


# ---- softmax finalize ---------------------------------------------------------------------------------
def finalize_f64(row_max: float, row_sum: float, sink: float):
    """out_scale = 1 / (sum_j exp(s_j) + exp(sink)) * exp(row_max); lse = log(that denominator)."""
    if row_max == -math.inf or not row_sum > 0:
        return 0.0, sink
    if sink == -math.inf:
        return 1.0 / row_sum, row_max + math.log(row_sum)
    m = max(row_max, sink)
    denom = row_sum * math.exp(row_max - m) + math.exp(sink - m)
    return math.exp(row_max - m) / denom, m + math.log(denom)


def _assert_close_f32(got, want, what, rtol=2e-6, atol=1e-30):
    got = float(got)
    if math.isinf(want) or want == 0:
        assert got == want, f"{what}: got {got}, want {want}"
    else:
        assert abs(got - want) <= rtol * abs(want) + atol, f"{what}: got {got!r}, want {want!r}"


@pytest.mark.parametrize("sink", [-math.inf, 0.0, 30.0, -30.0, "random"])
def test_finalize_rows_against_float64(sink, rng_seed):
    g = torch.Generator().manual_seed(rng_seed)
    n = 257
    row_max = torch.randn(n, generator=g, dtype=torch.float64) * 8
    row_sum = torch.rand(n, generator=g, dtype=torch.float64) * 300 + 1.0  # >= 1 (the max term is exp(0))
    sinks = (torch.randn(n, generator=g, dtype=torch.float64) * 10 if sink == "random"
             else torch.full((n,), sink, dtype=torch.float64))
    # values representable in fp32 so the comparison is of the math, not of the input rounding
    row_max, row_sum, sinks = row_max.float(), row_sum.float(), sinks.float()
    scale, lse = C.finalize_rows(row_max, row_sum, sinks)
    assert scale.dtype == torch.float32 and lse.dtype == torch.float32 and scale.shape == row_max.shape
    assert not torch.isnan(scale).any() and not torch.isnan(lse).any()
    for i in range(n):
        ws, wl = finalize_f64(float(row_max[i]), float(row_sum[i]), float(sinks[i]))
        _assert_close_f32(scale[i], ws, f"seed {rng_seed} row {i} out_scale (max {row_max[i]}, sum {row_sum[i]}, sink {sinks[i]})",
                          rtol=5e-6)
        _assert_close_f32(lse[i], wl, f"seed {rng_seed} row {i} lse", rtol=2e-6, atol=2e-6)


def test_finalize_rows_is_the_softmax_with_a_sink():
    """End to end on one row of scores: out_scale * sum_j exp(s_j - row_max) v_j equals the float64 contract."""
    s = torch.tensor([1.5, -2.0, 0.25, 3.0], dtype=torch.float64)
    v = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
    for sink in (-math.inf, 0.0, 30.0, 2.0):
        lse_want = torch.logsumexp(torch.cat([s, torch.tensor([sink], dtype=torch.float64)]), 0).item()
        out_want = (torch.exp(s - lse_want) * v).sum().item()
        mx = s.max()
        scale, lse = C.finalize_rows(mx.float().view(1), torch.exp(s - mx).sum().float().view(1),
                                     torch.tensor([sink], dtype=torch.float32))
        out = scale.item() * (torch.exp(s - mx) * v).sum().item()
        assert abs(lse.item() - lse_want) <= 1e-6 * max(1, abs(lse_want)), (sink, lse.item(), lse_want)
        assert abs(out - out_want) <= 1e-6 * max(1e-30, abs(out_want)) + 1e-30, (sink, out, out_want)
    # a +30 sink dwarfs scores near 0: the output shrinks by exp(-30) and does not overflow
    scale, lse = C.finalize_rows(torch.tensor([0.0]), torch.tensor([4.0]), torch.tensor([30.0]))
    assert 0 < scale.item() < 1e-12 and abs(lse.item() - math.log(4 + math.exp(30))) < 1e-5


def test_finalize_rows_empty_rows():
    n = 6
    row_max = torch.full((n,), -math.inf)
    row_sum = torch.tensor([0.0, 0.0, 0.0, 0.0, float("nan"), 0.0])
    sinks = torch.tensor([-math.inf, 0.0, 30.0, -7.5, 2.0, math.inf])
    scale, lse = C.finalize_rows(row_max, row_sum, sinks)
    assert scale.tolist() == [0.0] * n
    assert lse.tolist() == sinks.tolist(), "an empty row has lse = sink (-inf without one)"
    # a zero sum with a finite max (no key survived) is empty too
    scale, lse = C.finalize_rows(torch.tensor([3.0]), torch.tensor([0.0]), torch.tensor([1.25]))
    assert scale.item() == 0.0 and lse.item() == 1.25
    # sink == -inf is bit for bit the plain-attention math
    mx, sm = torch.tensor([0.75, -3.0]), torch.tensor([5.5, 1.0])
    scale, lse = C.finalize_rows(mx, sm, torch.tensor([-math.inf]))
    assert torch.equal(scale, 1.0 / sm) and torch.equal(lse, mx + torch.log(sm))


def test_finalize_rows_never_nan_on_extremes():
    vals = [-math.inf, -1e30, -100.0, -30.0, 0.0, 30.0, 88.0, 100.0, 1e30]
    mx, sk = zip(*[(a, b) for a in vals for b in vals])
    mx, sk = torch.tensor(mx), torch.tensor(sk)
    sm = torch.ones_like(mx)
    scale, lse = C.finalize_rows(mx, sm, sk)
    assert not torch.isnan(scale).any(), [(a, b) for a, b, s in zip(mx.tolist(), sk.tolist(), scale.tolist()) if s != s]
    assert not torch.isnan(lse).any()
    assert ((scale >= 0) & (scale <= 1)).all()


# ---- merge weights ------------------------------------------------------------------------------------
def merge_f64(la: float, lb: float, sink: float):
    terms = [x for x in (la, lb, sink) if x != -math.inf]
    if not terms:
        return 0.0, 0.0, -math.inf
    m = max(terms)
    total = sum(math.exp(x - m) for x in terms)
    lse = m + math.log(total)
    return math.exp(la - lse), math.exp(lb - lse), lse


@pytest.mark.parametrize("sink", [None, -math.inf, 0.0, 30.0, "random"])
def test_merge_weights_against_float64(sink, rng_seed):
    g = torch.Generator().manual_seed(rng_seed)
    n = 200
    la = (torch.randn(n, generator=g) * 6)
    lb = (torch.randn(n, generator=g) * 6)
    la[:20] = -math.inf                 # partial a saw no key
    lb[10:30] = -math.inf               # partial b saw no key (rows 10..19: neither did)
    la[30:35] = 80.0                    # large but finite
    if sink is None:
        sk = torch.full((n,), -math.inf)
    elif sink == "random":
        sk = torch.randn(n, generator=g) * 6
        sk[40:45] = -math.inf
    else:
        sk = torch.full((n,), float(sink))
    wa, wb, lse = C.merge_weights(la, lb, sk)
    for t in (wa, wb, lse):
        assert t.dtype == torch.float32 and t.shape == la.shape and not torch.isnan(t).any()
    for i in range(n):
        a, b, l = merge_f64(float(la[i]), float(lb[i]), float(sk[i]))
        what = f"seed {rng_seed} row {i} (lse_a {float(la[i])}, lse_b {float(lb[i])}, sink {float(sk[i])})"
        _assert_close_f32(wa[i], a, what + " wa", rtol=1e-5, atol=1e-7)
        _assert_close_f32(wb[i], b, what + " wb", rtol=1e-5, atol=1e-7)
        _assert_close_f32(lse[i], l, what + " lse", rtol=2e-6, atol=2e-6)
    # a partial with lse -inf gets weight exactly 0 (so its out, even NaN, can be skipped)
    assert (wa[:20] == 0).all() and (wb[10:30] == 0).all()
    if sink is None or sink == -math.inf:
        assert (lse[10:20] == -math.inf).all()
        assert torch.equal(wb[:10], torch.ones(10)), "b alone carries rows where a saw no key"


def test_merge_weights_scalar_sink_broadcasts():
    la, lb = torch.tensor([0.0, 1.0, -math.inf]), torch.tensor([0.0, -math.inf, -math.inf])
    wa, wb, lse = C.merge_weights(la, lb, torch.tensor(math.log(2.0)))
    # exp(0) + exp(0) + 2 = 4
    assert abs(wa[0].item() - 0.25) < 1e-7 and abs(wb[0].item() - 0.25) < 1e-7
    assert abs(lse[0].item() - math.log(4.0)) < 1e-6
    assert abs(wa[1].item() - math.e / (math.e + 2)) < 1e-6 and wb[1].item() == 0.0
    assert wa[2].item() == 0.0 and wb[2].item() == 0.0 and abs(lse[2].item() - math.log(2.0)) < 1e-6


@pytest.mark.skipif(C is None or not hasattr(C, "bwd_lse"), reason="no compiled extension with bwd_lse")
def test_bwd_lse_turns_an_empty_rows_lse_into_plus_inf():
    """The lse every backward recomputes P = exp(s - lse) with: the forward's, except the -inf of a row that saw no
    key and has no sink (finalize_rows gives it), which becomes +inf so P = 0 there and not NaN."""
    lse = torch.tensor([-math.inf, math.inf, 0.0, -30.5, 88.0, -1e30, 1e-30])
    got = C.bwd_lse(lse)
    assert got.dtype == torch.float32
    assert got.tolist() == [math.inf] + lse[1:].tolist(), "only -inf changes, every other lse is kept bit for bit"
    _, empty = C.finalize_rows(torch.tensor([-math.inf]), torch.tensor([0.0]), torch.tensor([-math.inf]))
    p = torch.exp(torch.tensor([-math.inf, 3.0]) - C.bwd_lse(empty))
    assert p.tolist() == [0.0, 0.0], "an empty row's P is 0 for masked and unmasked scores alike"
