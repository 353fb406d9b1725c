"""The backward's transposed block range (TileMask::m_range: the M tiles one key block visits), called through
_C.mask_col_blocks and checked against docs/DESIGN.md section 1 written out again (test_mask_policy.spec_visible):

  (b) per key block, the union of the visited M tiles covers every visible pair of the block's columns,
      no M tile visited twice;
  (c) a visit reported needs_mask == 0 has every (valid row, column) pair visible;
  (e) every visited (M tile, key block) holds a visible pair (block skipping is exact);
  (f) the visited pairs are exactly the forward's (mask_tile_blocks), which the deterministic dq order uses.
"""
from __future__ import annotations

import random

import numpy as np
import pytest

import sinkattn
from test_mask_policy import _edge_problems, _random_problems, spec_visible

C = sinkattn._ext._C
pytestmark = pytest.mark.skipif(C is None or not hasattr(C, "mask_col_blocks"),
                                reason="no compiled extension with the backward mask range")

BLOCKS = [(64, 64), (128, 64), (64, 128), (128, 128), (16, 16)]  # (128, 128): the sm90 backward's hd64 tile


def check_cols(sq, sk, wl, wr, ns, bm, bn, where=""):
    tag = f"{where}mask_col_blocks{(sq, sk, wl, wr, ns, bm, bn)}"
    vis = spec_visible(sq, sk, wl, wr, ns)
    rows = C.mask_col_blocks(sq, sk, wl, wr, ns, bm, bn).numpy()
    seen = set()
    covered = np.zeros((sq, sk), dtype=np.int32)
    for n, m, need in rows.tolist():
        assert 0 <= n < -(-sk // bn) and 0 <= m < -(-sq // bm), f"{tag}: (n={n}, m={m}) out of range"
        assert (n, m) not in seen, f"{tag}: key block {n} visits M tile {m} twice"
        seen.add((n, m))
        r0, r1, c0, c1 = m * bm, min(m * bm + bm, sq), n * bn, min(n * bn + bn, sk)
        blk = vis[r0:r1, c0:c1]
        assert blk.any(), f"{tag}: key block {n} visits M tile {m}, which holds no visible pair"
        if need == 0:
            assert blk.all() and c0 + bn <= sk, f"{tag}: (n={n}, m={m}) reported needs_mask=0 with a hidden pair"
        covered[r0:r1, c0:c1] += blk
    assert covered.max(initial=0) <= 1, f"{tag}: a pair is covered twice"
    missing = np.argwhere(vis & (covered == 0))
    assert missing.size == 0, f"{tag}: visible pair (i, j) = {tuple(missing[0])} lies in no visited block"
    # (f) the same (M tile, key block) pairs as the forward's range: the deterministic backward ranks a key
    # block among the visitors of an M tile with the forward's BlockRange.
    fwd = {(m, n) for m, n, _ in C.mask_tile_blocks(sq, sk, wl, wr, ns, bm, bn).tolist()}
    assert fwd == {(m, n) for n, m in seen}, f"{tag}: differs from mask_tile_blocks"


@pytest.mark.parametrize("bm,bn", BLOCKS)
def test_col_blocks_edge_cases(bm, bn):
    for (sq, sk, wl, wr, ns) in _edge_problems():
        check_cols(sq, sk, wl, wr, ns, bm, bn)


def test_col_blocks_random(rng_seed):
    rnd = random.Random(rng_seed)
    for (sq, sk, wl, wr, ns) in _random_problems(rnd, 250):
        bm, bn = rnd.choice(BLOCKS)
        check_cols(sq, sk, wl, wr, ns, bm, bn, where=f"seed {rng_seed}: ")


def test_col_blocks_exhaustive_small():
    for sq in range(0, 10):
        for sk in range(0, 10):
            for wl in (-1, 0, 1, 3):
                for wr in (-1, 0, 1, 4):
                    for ns in (0, 1, 3, 12):
                        for bm, bn in ((2, 2), (4, 2), (2, 4), (3, 5)):
                            check_cols(sq, sk, wl, wr, ns, bm, bn)


def test_col_blocks_skip_whole_blocks():
    """A narrow window with sink tokens: the sink-token key block is visited by every M tile below it, a
    window key block only by the M tiles its window reaches."""
    rows = C.mask_col_blocks(1024, 1024, 127, 0, 4, 64, 64).numpy()
    per_block = {}
    for n, m, _ in rows.tolist():
        per_block.setdefault(n, []).append(m)
    assert per_block[0] == list(range(16))          # holds the sink tokens
    assert per_block[5] == [5, 6, 7]                 # keys 320..383 seen by queries 320..510


def check_key_rows(sq, sk, wl, wr, ns, where=""):
    """TileMask::key_rows (the sm90 backward's per-key mask over its transposed S^T tiles): for every key j, the
    rows [lo, hi) it gives are exactly the queries that see j; keys outside [0, seqlen_k) are seen by none."""
    vis = spec_visible(sq, sk, wl, wr, ns)
    for j, lo, hi in C.mask_key_rows(sq, sk, wl, wr, ns).tolist():
        tag = f"{where}mask_key_rows{(sq, sk, wl, wr, ns)} key {j}"
        got = np.zeros(sq, dtype=bool)
        got[max(lo, 0):max(min(hi, sq), 0)] = True
        assert lo <= hi or (lo, hi) == (0, 0), f"{tag}: [{lo}, {hi})"
        assert 0 <= lo and hi <= sq or lo == hi, f"{tag}: [{lo}, {hi}) outside the rows"
        want = vis[:, j] if 0 <= j < sk else np.zeros(sq, dtype=bool)
        bad = np.argwhere(got != want)
        assert bad.size == 0, f"{tag}: row {int(bad[0][0])} is {'hidden' if want[bad[0][0]] else 'visible'} " \
                              f"by the contract, [{lo}, {hi}) says otherwise"


def test_key_rows_exhaustive_small():
    for sq in range(0, 9):
        for sk in range(0, 9):
            for wl in (-1, 0, 1, 3):
                for wr in (-1, 0, 1, 4):
                    for ns in (0, 1, 3, 12):
                        check_key_rows(sq, sk, wl, wr, ns)


def test_key_rows_edge_and_random(rng_seed):
    for (sq, sk, wl, wr, ns) in _edge_problems():
        check_key_rows(sq, sk, wl, wr, ns)
    rnd = random.Random(rng_seed)
    for (sq, sk, wl, wr, ns) in _random_problems(rnd, 150):
        check_key_rows(sq, sk, wl, wr, ns, where=f"seed {rng_seed}: ")


# ---- the deterministic backward's dQ turn (BlockRange::rank) -----------------------------------------------
def check_dq_turns(sq, sk, wl, wr, ns, bm, bn, where=""):
    """Per M tile, the key blocks that add into it (mask_col_blocks' visitors of that tile) take turns 0, 1, ...
    in increasing key-block order: the turn each waits for is its rank among them, so none waits forever."""
    tag = f"{where}dq_turns{(sq, sk, wl, wr, ns, bm, bn)}"
    visitors = {}
    for n, m, _ in C.mask_col_blocks(sq, sk, wl, wr, ns, bm, bn).tolist():
        visitors.setdefault(m, []).append(n)
    turns = {}
    for m, n, turn in C.dq_turns(sq, sk, wl, wr, ns, bm, bn).tolist():
        assert (m, n) not in turns, f"{tag}: M tile {m}, key block {n} twice"
        turns[(m, n)] = turn
    assert set(turns) == {(m, n) for m, ns_ in visitors.items() for n in ns_}, f"{tag}: visitors differ from m_range"
    for m, blocks in visitors.items():
        got = [turns[(m, n)] for n in sorted(blocks)]
        assert got == list(range(len(blocks))), f"{tag}: M tile {m}, key blocks {sorted(blocks)} take turns {got}"


@pytest.mark.skipif(C is None or not hasattr(C, "dq_turns"), reason="no compiled extension with dq_turns")
def test_dq_turns_are_ranks(rng_seed):
    check_dq_turns(64, 64, 3, 0, 20, 16, 16)  # sink blocks and window blocks with a gap between them
    for bm, bn in [(16, 16), (64, 128), (128, 64)]:  # small tiles (many visitors), and M tiles taller and shorter
        for (sq, sk, wl, wr, ns) in _edge_problems():
            check_dq_turns(sq, sk, wl, wr, ns, bm, bn)
    rnd = random.Random(rng_seed)
    for (sq, sk, wl, wr, ns) in _random_problems(rnd, 60):
        check_dq_turns(sq, sk, wl, wr, ns, *rnd.choice(BLOCKS), where=f"seed {rng_seed}: ")
