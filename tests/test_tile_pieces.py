"""The kernels' named pieces that the host can call (csrc/common/, csrc/sm80/*_tiles.h), through _C:
TileMask::apply (the element mask every kernel applies) against the mask contract, the tile order every grid
and schedule uses, and the one tile table the launchers, the split heuristic and the registry read."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import sinkattn

from test_mask_policy import spec_visible

C = sinkattn._ext._C
pytestmark = pytest.mark.skipif(C is None, reason=f"no compiled extension: {sinkattn._ext.IMPORT_ERROR}")
KB = 1024


# ---- TileMask::apply -----------------------------------------------------------------------------------
def _check_apply(sq, sk, wl, wr, ns, bm, bn, group=1):
    """Every tile of the problem (tails included): apply hides exactly the pairs the contract hides. Rows hold
    query r // group (GQA packing); keys at or past sk are always hidden."""
    vis = spec_visible(sq, sk, wl, wr, ns)
    rows = sq * group
    for m in range(-(-max(rows, 1) // bm)):
        for n in range(-(-max(sk, 1) // bn)):
            hidden = C.mask_apply(sq, sk, wl, wr, ns, bm, bn, group, m, n).numpy()
            for r in range(bm):
                row = m * bm + r
                if row >= rows:
                    continue  # rows past the problem: the kernels never store them
                want = np.ones(bn, bool)
                cols = np.arange(n * bn, n * bn + bn)
                inside = cols < sk
                want[inside] = ~vis[row // group, cols[inside]]
                bad = np.flatnonzero(hidden[r] != want)
                assert bad.size == 0, (f"mask_apply{(sq, sk, wl, wr, ns, bm, bn, group)} tile ({m}, {n}) row {row}: "
                                       f"key {n * bn + bad[0]} hidden={hidden[r][bad[0]]}, contract says "
                                       f"{want[bad[0]]}")


@pytest.mark.parametrize("sq,sk,wl,wr,ns", [
    (1, 1, -1, -1, 0), (7, 7, -1, 0, 0), (5, 37, -1, 0, 0), (37, 5, -1, 0, 0), (40, 40, 3, 0, 0),
    (40, 40, 3, 0, 4), (33, 70, 5, 2, 1), (20, 20, -1, 3, 0), (20, 20, 0, -1, 30), (9, 50, 200, 0, 2),
])
@pytest.mark.parametrize("bm,bn", [(16, 16), (32, 64), (8, 48)])
def test_mask_apply_matches_contract(sq, sk, wl, wr, ns, bm, bn):
    _check_apply(sq, sk, wl, wr, ns, bm, bn)


def test_mask_apply_gqa_packed_and_random(rng_seed):
    rnd = random.Random(rng_seed)
    _check_apply(3, 40, 5, 0, 2, 16, 16, group=8)  # gpt-oss decode shape: 8 query heads per KV head
    for _ in range(25):
        sq, sk = rnd.randint(1, 40), rnd.randint(1, 90)
        wl, wr = rnd.choice([(-1, -1), (-1, 0), (rnd.randint(0, 30), 0), (rnd.randint(0, 9), rnd.randint(0, 9))])
        _check_apply(sq, sk, wl, wr, rnd.choice([0, 1, 4, sk + 2]), rnd.choice([16, 32]), rnd.choice([16, 32, 64]),
                     group=rnd.choice([1, 2, 4]))


# ---- the tile order -------------------------------------------------------------------------------------
@pytest.mark.parametrize("last_first,splits", [(True, 3), (True, 1), (False, 1)])
def test_tile_order_covers_every_tile_once(last_first, splits):
    """The sm80 forward's order (last block first, with split-KV) and the backward's (first block first, no
    splits; the sm90 forward's persistent order is the forward's without splits)."""
    blocks, heads, batch = 5, 4, 2
    t = C.tile_order(blocks, splits, heads, batch, last_first).numpy()
    assert t.shape == (blocks * splits * heads * batch, 4)
    assert len({tuple(r) for r in t.tolist()}) == len(t), "a tile appears twice"
    assert t[:, 0].min() == 0 and t[:, 0].max() == blocks - 1
    assert set(t[:, 1]) == set(range(splits)) and set(t[:, 2]) == set(range(heads)) and set(t[:, 3]) == set(range(batch))
    # blocks vary fastest: heaviest first (forward: the last M block; backward: the first N block)
    first = [r[0] for r in t[:blocks].tolist()]
    assert first == (list(range(blocks - 1, -1, -1)) if last_first else list(range(blocks)))
    assert t[:blocks, 1:].tolist() == [[0, 0, 0]] * blocks
    # then splits, heads, batch
    if splits > 1:
        assert t[blocks, 1] == 1
    assert t[blocks * splits, 2] == 1 and t[blocks * splits * heads, 3] == 1


def test_tile_order_backward_has_no_splits():
    with pytest.raises(RuntimeError, match="no splits"):
        C.tile_order(2, 3, 1, 1, False)
    t = C.tile_order(2, 1, 3, 2, False).numpy()
    assert (t[:, 1] == 0).all() and t[:, 2].tolist() == [0, 0, 1, 1, 2, 2] * 2


# ---- the tile table -------------------------------------------------------------------------------------
SMEM = {"sm80": 163 * KB, "sm86": 99 * KB, "sm90": 227 * KB}


@pytest.mark.parametrize("device", list(SMEM))
@pytest.mark.parametrize("hd", [64, 128, 256])
@pytest.mark.parametrize("rows,split", [(1, False), (8, False), (24, False), (48, False), (100, True), (100, False),
                                        (4096, False)])
def test_fwd_tile_fits_and_follows_the_rule(device, hd, rows, split):
    t = C.fwd_tile(hd, rows, split, SMEM[device])
    assert t["head_dim"] == hd
    assert t["smem_bytes"] <= SMEM[device], f"{t} does not fit {device}"
    assert t["smem_bytes"] == (t["block_m"] + 2 * t["stages"] * t["block_n"]) * hd * 2
    few = split or rows <= 64
    if rows <= 16 and not (hd == 256 and device == "sm86"):
        assert t["key_groups"] == 4 and t["block_m"] == 16
    elif not few:
        assert t["key_groups"] == 1 and t["block_m"] >= 64, "prefill takes a row tile"
    else:
        assert t["block_m"] <= 64, "decode takes a small tile"


def test_fwd_tile_prefers_the_big_tile_where_it_fits():
    assert C.fwd_tile(128, 1, True, 163 * KB)["stages"] == 3
    assert C.fwd_tile(128, 40, True, 99 * KB)["block_n"] == 32  # the 80 KB 4-stage tile of sm86 / sm89
    assert C.fwd_tile(256, 4096, False, 163 * KB)["block_n"] == 64
    assert C.fwd_tile(256, 4096, False, 99 * KB)["block_n"] == 32
    # hd256, one K and one V buffer: sm90 (227 KB per block) 64 rows of 4 warps, 96 KB, two CTAs per SM; sm80 128 rows
    # of 8 warps, 128 KB; few rows on sm80 the double-buffered 64-row tile (160 KB)
    big = dict(stages=1, block_n=64, key_groups=1)
    assert C.fwd_tile(256, 4096, False, 227 * KB) == dict(C.fwd_tile(256, 4096, False, 227 * KB), **big, block_m=64,
                                                          warps=4, smem_bytes=96 * KB)
    assert C.fwd_tile(256, 4096, False, 163 * KB) == dict(C.fwd_tile(256, 4096, False, 163 * KB), **big, block_m=128,
                                                          warps=8, smem_bytes=128 * KB)
    for rows, split in ((48, False), (100, True)):
        t = C.fwd_tile(256, rows, split, 163 * KB)
        assert (t["block_m"], t["stages"], t["smem_bytes"]) == (64, 2, 160 * KB)
    # hd128 prefill: 8 warps of 16 rows, Q in registers and S ahead, on sm90 with branch-free interior K/V loads (sm_90
    # SASS); on sm80 4 warps of 32 rows over 32-key blocks in three stages (80 KB: two CTAs per SM), neither
    assert C.fwd_tile(128, 4096, False, 227 * KB) == dict(C.fwd_tile(128, 4096, False, 99 * KB), branch_free_loads=1)
    assert C.fwd_tile(128, 4096, False, 99 * KB)["warps"] == 8 and C.fwd_tile(128, 4096, False, 99 * KB)["block_m"] == 128
    assert C.fwd_tile(128, 4096, False, 163 * KB) == dict(C.fwd_tile(128, 4096, False, 99 * KB), block_n=32, warps=4,
                                                          stages=3, ctas_per_sm=2, smem_bytes=80 * KB)
    # hd64 prefill: 128 rows of 4 warps, on sm86 / sm89 double-buffered with no launch-bounds minimum; on sm80 and sm90
    # in three stages asking for two CTAs per SM (64 KB each: 130 KB with the 1 KB each reserves, of 164 or 228; sm86
    # has 100)
    assert (C.fwd_tile(64, 4096, False, 99 * KB)["block_m"], C.fwd_tile(64, 4096, False, 99 * KB)["ctas_per_sm"]) == (128, 0)
    for kb in (163, 227):
        assert C.fwd_tile(64, 4096, False, kb * KB) == dict(C.fwd_tile(64, 4096, False, 99 * KB), stages=3,
                                                            ctas_per_sm=2, smem_bytes=64 * KB)
    # the decode tiles ask for no minimum in the table (FwdTraits::kMinCtasPerSm gives them one)
    assert all(C.fwd_tile(hd, rows, False, 163 * KB)["ctas_per_sm"] == 0 for hd in (64, 128, 256) for rows in (1, 24, 48))


def test_bwd_tile_table():
    assert C.bwd_tile(128, 163 * KB)["stages"] == 2 and C.bwd_tile(128, 99 * KB)["stages"] == 1
    # head dim 128: 128-key blocks where 160 KB fit, 64-key blocks with softcap (the wide tile spills with it)
    for smem in (163 * KB, 227 * KB):
        assert (C.bwd_tile(128, smem)["block_n"], C.bwd_tile(128, smem)["smem_bytes"]) == (128, 160 * KB)
        assert C.bwd_tile(128, smem, softcap=True) == dict(C.bwd_tile(128, smem), block_n=64, smem_bytes=112 * KB)
    assert C.bwd_tile(128, 159 * KB) == C.bwd_tile(128, 99 * KB) == C.bwd_tile(128, 99 * KB, softcap=True)
    assert C.bwd_tile(128, 112 * KB, softcap=True)["stages"] == 2
    assert C.bwd_tile(256, 227 * KB)["smem_bytes"] == 144 * KB
    for hd in (64, 128, 256):
        t = C.bwd_tile(hd, 227 * KB)
        assert t["smem_bytes"] == (t["stages"] * 2 * t["block_m"] * hd + 2 * t["block_n"] * hd
                                   + 2 * t["block_m"] * t["block_n"]) * 2


def test_registry_records_each_kernels_smallest_tile():
    reg = [k for k in sinkattn._ext.registry() if k["op"] in ("fwd", "bwd")]
    assert reg, "no attention kernel in this build"
    for k in reg:
        assert k["smem_bytes"] > 0, k
        if k["family"] in ("sm80", "sm80-emulated") and k["op"] == "fwd":
            # the smallest over every problem shape on a 99 KB device is what the registry records
            smallest = min(C.fwd_tile(k["headdim"], rows, split, 99 * KB)["smem_bytes"]
                           for rows in (1, 24, 48, 4096) for split in (False, True))
            assert k["smem_bytes"] <= smallest, k
        if k["family"] in ("sm80", "sm80-emulated") and k["op"] == "bwd":
            assert k["smem_bytes"] == C.bwd_tile(k["headdim"], 99 * KB)["smem_bytes"], k
        if k["family"] in ("sm90", "sm90-emulated"):
            assert 100 * KB < k["smem_bytes"] <= 227 * KB, k
            # the forward reads KV caches: pages of a multiple of 16 rows in TMA boxes, any other page size where
            # its producer warpgroup gathers them (csrc/sm90/fwd_tiles.h gathers_pages: every table tile), split-KV;
            # FP8 caches are its "fwd_fp8" entries'
            feats = k["features"].split(",")
            assert ("kvcache" in feats) == ("paged16" in feats) == ("split_kv" in feats) == (k["op"] == "fwd"), k
            assert ("paged" in feats) == (k["op"] == "fwd"), k
            assert "fp8_kv" not in feats, k
        if k["family"] in ("sm90-sweep", "sm90-emulated-sweep"):
            # a variant's features follow its tile: a dynamic tile walk needs a counter and gathers no pages
            feats = k["features"].split(",")
            dynamic = k["name"].endswith("_dyn")
            assert ("tile_counter" in feats) == dynamic, k
            assert not ("paged" in feats and (dynamic or "r24x" in k["name"])), k
    # the sm90 forward's FP8-cache entries are the same kernels (csrc/sm90/fwd_tiles.h fwd_fp8_features): FP8 where the
    # tile's gather decodes it, every table tile
    for k in sinkattn._ext.registry():
        if k["family"] in ("sm90", "sm90-emulated") and k["op"] == "fwd_fp8":
            twin = [f for f in reg if f["family"] == k["family"] and f["op"] == "fwd" and f["headdim"] == k["headdim"]
                    and f["dtype"] == k["dtype"]]
            assert len(twin) == 1 and twin[0]["smem_bytes"] == k["smem_bytes"], k
            assert "fp8_kv" in k["features"].split(","), k
    bwd256 = [k for k in reg if k["op"] == "bwd" and k["headdim"] == 256]
    assert all(k["smem_bytes"] == 144 * KB for k in bwd256), "the hd256 backward needs 144 KB"


# ---- the sequence extent, its mask policy and row addresses ------------------------------------------------
@pytest.mark.skipif(C is None or not hasattr(C, "seq_extent"), reason="no compiled extension with seq_extent")
def test_seq_extent_mask_policy_and_row_addresses():
    """seq_extent + mask_policy (the one builder every kernel uses) and SeqExtent::q_row / k_row, against the
    layouts written out: padded rows b * batch_stride + row * row_stride + head * head_stride, packed (varlen) rows
    (cu_seqlens[b] + row) * row_stride + head * head_stride; a KV cache's seqused_k overrides seqlen_k."""
    qs, ks = [7000, 96, 8], [5000, 40, 8]  # (batch, row, head) strides of a q-like and a k-like tensor
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)
    # padded
    e = C.seq_extent(2, 30, 50, None, None, None, 7, 0, 4, qs, ks, 3, 11)
    assert (e["varlen"], e["q_start"], e["k_start"], e["seqlen_q"], e["seqlen_k"]) == (False, 0, 0, 30, 50)
    assert e["mask"] == [30, 50, 7, 0, 4]
    assert e["q_row"] == 2 * 7000 + 11 * 96 + 3 * 8 and e["k_row"] == 2 * 5000 + 11 * 40 + 3 * 8
    assert (e["q_rows_before"], e["k_rows_before"]) == (60, 100)
    assert e["lse_row"] == 2 * 7000 + 3 * 8 + 11, "lse rows are contiguous"
    # the sequence's base: row 0, head 0
    assert C.seq_extent(1, 30, 50, None, None, None, -1, -1, 0, qs, ks, 0, 0)["q_row"] == 7000
    # varlen: sequence 1 holds packed q rows [5, 12) and k rows [9, 30)
    cq, ck = i32([0, 5, 12]), i32([0, 9, 30])
    e = C.seq_extent(1, 64, 64, cq, ck, None, -1, 0, 0, [0, 96, 8], ks, 2, 4)  # a varlen lse has batch stride 0
    assert (e["varlen"], e["q_start"], e["k_start"], e["seqlen_q"], e["seqlen_k"]) == (True, 5, 9, 7, 21)
    assert e["mask"] == [7, 21, -1, 0, 0], "the mask is the sequence's, not the batch maximum"
    assert e["q_row"] == (5 + 4) * 96 + 2 * 8 and e["k_row"] == (9 + 4) * 40 + 2 * 8, "varlen ignores batch strides"
    assert (e["q_rows_before"], e["k_rows_before"]) == (5, 9)
    assert e["lse_row"] == 5 + 2 * 8 + 4, "varlen lse rows follow cu_seqlens_q"
    # a KV cache: sequence 1 holds 17 keys of a 64-key cache
    e = C.seq_extent(1, 3, 64, None, None, i32([40, 17]), 100, 0, 2, qs, ks, 1, 0)
    assert (e["seqlen_q"], e["seqlen_k"]) == (3, 17) and e["mask"] == [3, 17, 100, 0, 2]
    assert e["k_row"] == 5000 + 8
    # the serving form: packed queries (cu_seqlens_q) over a cache (no cu_seqlens_k): the keys' rows are the
    # cache's, sequence b at b * batch_stride, with seqused_k[b] keys
    e = C.seq_extent(1, 64, 64, cq, None, i32([40, 17]), -1, 0, 0, [0, 96, 8], ks, 2, 4)
    assert (e["varlen"], e["k_varlen"], e["q_start"], e["k_start"], e["seqlen_q"], e["seqlen_k"]) == \
        (True, False, 5, 0, 7, 17)
    assert e["q_row"] == (5 + 4) * 96 + 2 * 8 and e["k_row"] == 5000 + 4 * 40 + 2 * 8
    assert e["k_rows_before"] == 64


@pytest.mark.skipif(C is None or not hasattr(C, "packed_tiles"), reason="no compiled extension with packed_tiles")
@pytest.mark.parametrize("group,block_m", [(1, 64), (8, 16), (8, 128), (4, 48), (1, 1)])
def test_packed_tiles_cover_every_tile_once(group, block_m, rng_seed):
    """The serving entry's packed grid (common/seq_extent.h packed_tile): for random batches (empty requests,
    decodes, chunks, padding rows past the last request) every (sequence, M tile) with rows appears exactly once,
    and the other blocks have no rows (m_block * block_m >= rows: the CTA exits)."""
    g = torch.Generator().manual_seed(rng_seed)
    for _ in range(40):
        b = int(torch.randint(1, 12, (1,), generator=g))
        lens = [int(x) for x in torch.randint(0, 3, (b,), generator=g)]
        lens = [0 if x == 0 else (1 if x == 1 else int(torch.randint(2, 300, (1,), generator=g))) for x in lens]
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
        total = int(cu[-1]) + int(torch.randint(0, 20, (1,), generator=g))
        tiles = C.packed_tiles(cu, group, block_m, total).tolist()
        assert len(tiles) == total * group // block_m + b + 1
        seen = set()
        for seq, m in tiles:
            assert 0 <= seq < b and m >= 0
            if m * block_m < lens[seq] * group:
                assert (seq, m) not in seen, f"tile {(seq, m)} twice"
                seen.add((seq, m))
        want = {(s, m) for s, n in enumerate(lens) for m in range(-(-n * group // block_m))}
        assert seen == want, f"lens {lens}: missing {sorted(want - seen)[:5]}"
