"""The decode path of the sm80 kernel (KV cache, paged pages, GQA packing, split-KV + combine) run on the CPU
under host emulation, against the float64 oracle."""
import pytest

from decode_cases import DECODE_CASES, run_decode
from sinkattn import _ext, kernels

EMU = sorted({(k["headdim"], k["dtype"]) for k in _ext.registry() if k["family"] == "sm80-emulated"})
pytestmark = pytest.mark.skipif(not any(h == 64 and d == "bf16" for h, d in EMU),
                                reason="no emulated hdim64 bf16 kernel in this build")


@pytest.mark.parametrize("name,kw", DECODE_CASES, ids=[c[0] for c in DECODE_CASES])
def test_emulated_decode_matches_oracle(name, kw, rng_seed):
    run_decode("sm80-emulated", "cpu", rng_seed, **kw)


# Head dim 128 has its own decode tiles (64 rows, more K/V stages; kBlockN 64 or 32 by shared memory).
D128_CASES = [
    ("d128-gqa8-paged16-split3", dict(d=128, h=16, hk=2, capacity=300, lens=(250, 7, 0), page_size=16, causal=True,
                                      num_splits=3)),
    ("d128-gqa-window-sinktok", dict(d=128, capacity=400, lens=(390, 130, 64), causal=True, window_size=(100, 0),
                                     sink_tokens=4)),
    # 64-key pages hold whole blocks of the 64-key decode tile: interior blocks load as tiles from one page.
    ("d128-paged64-whole-blocks", dict(d=128, h=16, hk=2, capacity=384, lens=(330, 64, 129), page_size=64,
                                       causal=True)),
    # 70 new queries per sequence: the prefill tile (at 163 KB per block fwd_tiles.h Hd128RowsTwoCtas, 128 rows: one M
    # tile, two of its four warps without a row) over a cache, paged (pages of 16: row by row from their pages; of 64: whole blocks
    # inside one page) and contiguous.
    ("d128-prefill-rows-paged16", dict(d=128, capacity=400, lens=(250, 7, 0), sq=70, sn=70, page_size=16,
                                       causal=True)),
    ("d128-prefill-rows-paged64", dict(d=128, capacity=448, lens=(300, 64, 0), sq=70, sn=70, page_size=64,
                                       causal=True, window_size=(150, 0), sink_tokens=3)),
    ("d128-prefill-rows-contiguous", dict(d=128, capacity=448, lens=(300, 64, 0), sq=70, sn=70, causal=True)),
]


@pytest.mark.skipif(not any(h == 128 and d == "bf16" for h, d in EMU), reason="no emulated hdim128 bf16 kernel")
@pytest.mark.parametrize("name,kw", D128_CASES, ids=[c[0] for c in D128_CASES])
def test_emulated_decode_hdim128(name, kw, rng_seed):
    run_decode("sm80-emulated", "cpu", rng_seed, **kw)


@pytest.mark.skipif(not any(h == 128 and d == "bf16" for h, d in EMU), reason="no emulated hdim128 bf16 kernel")
@pytest.mark.parametrize("name,kw", [c for c in D128_CASES if "prefill-rows" in c[0]],
                         ids=[c[0] for c in D128_CASES if "prefill-rows" in c[0]])
@pytest.mark.parametrize("kb", [227, 99], ids=["sm90-tile", "sm86-tile"])
def test_emulated_prefill_rows_over_a_cache_other_tiles(name, kw, kb, rng_seed, monkeypatch):
    # The hd128 prefill tiles of other devices over the same caches. sm90's (227 KB per block, fwd_tiles.h
    # Hd128RowsSm90): interior blocks of a contiguous cache through predicated copies, paged blocks through the
    # loader's branches. sm86's (99 KB, Hd128Rows): 128 rows of 8 warps, the loader's branches.
    launch = kernels.launch_kvcache
    monkeypatch.setattr(kernels, "launch_kvcache", lambda *a, **k: launch(*a, **{**k, "max_smem": kb * 1024}))
    run_decode("sm80-emulated", "cpu", rng_seed, **kw)


def test_split_heuristic():
    C = _ext._C
    # Few CTAs and many key blocks: split to fill the SMs; never more splits than blocks.
    assert C.num_splits_heuristic(8, 132, 2048, 64) > 4
    assert C.num_splits_heuristic(8, 132, 3, 64) <= 3
    # Enough CTAs already: no split.
    assert C.num_splits_heuristic(1000, 132, 2048, 64) == 1
    assert C.num_splits_heuristic(8, 132, 1, 64) == 1
    for ctas in (1, 7, 16, 64, 100):
        s = C.num_splits_heuristic(ctas, 108, 512, 64)
        assert 1 <= s <= 64


@pytest.mark.parametrize("seqlen_k", [130, 1000, 4097, 70000])
def test_windowed_decode_reads_only_sink_and_window_blocks(seqlen_k):
    """A gpt-oss sliding-window layer (window (127, 0)) with 4 sink tokens, GQA-packed decode (8 query heads
    per KV head, one query): the key blocks visited are the sink block and the window's blocks only, so the
    pages read (and the time) do not grow with the cache."""
    block_n = 64
    rows = _ext._C.mask_tile_blocks(1, seqlen_k, 127, 0, 4, 128, block_n, 8)
    visited = set(rows[:, 1].tolist())
    lo = max(0, seqlen_k - 1 - 127)
    want = set(range(lo // block_n, (seqlen_k - 1) // block_n + 1)) | {0}
    assert visited == want
    assert len(visited) <= 128 // block_n + 2
