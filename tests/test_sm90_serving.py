"""The sm90 forward over KV caches (csrc/sm90/fwd_kernel.cuh: packed M tiles over the serving call's requests, GQA
packing (the group's query heads in one tile, their Q rows loaded by the consumers), a contiguous cache's batch mode,
a page pool read in 16-row TMA boxes, or gathered by the producer warpgroup with cp.async when its pages are not a
multiple of 16 rows) run on the CPU under host emulation, against the float64 oracle: the serving call's mixed
batches (tests/serving_cases.py SM90_SERVING_CASES), the padded decode and chunked-prefill calls with their append
(tests/decode_cases.py), the same bits from a contiguous, a boxed and a gathered paged cache, one call per batch,
the planted bugs of the page lookup and of the gather's protocol, FP8 caches (both formats, per-tensor and
per-(sequence, KV head) scales, contiguous and paged, decoded in place by the gather), split-KV (each split's
partials and the combine: forced counts, more splits than key blocks, the count "auto" picks), at head dims 64, 96,
128 and 256.
"""
from __future__ import annotations

import pytest
import torch

import sinkattn
from decode_cases import DECODE_CASES, FP8_DECODE_CASES, FP8_FORMATS, run_decode, run_fp8_decode
from serving_cases import FP8_SERVING_CASES, SM90_SERVING_CASES, PagedBatch, run_serving
from sinkattn import _ext
from sinkattn.errors import SinkattnError
from test_sm90_emulated import MUTATIONS, check_planted_bug
from test_serving import _CountingModule

_REG = _ext.registry() if _ext.loaded() else []
pytestmark = pytest.mark.skipif(
    not any(k["family"] == "sm90-emulated" and k["op"] == "fwd" and k["headdim"] == 64 and k["dtype"] == "bf16"
            for k in _REG), reason="no emulated sm90 hdim64 bf16 forward in this build")



@pytest.mark.parametrize("name,reqs,kw", SM90_SERVING_CASES, ids=[c[0] for c in SM90_SERVING_CASES])
def test_sm90_emulated_serving_matches_oracle(name, reqs, kw, rng_seed):
    run_serving("sm90-emulated", "cpu", rng_seed, reqs, **kw)


@pytest.mark.parametrize("name,kw", DECODE_CASES, ids=[c[0] for c in DECODE_CASES])
def test_sm90_emulated_kvcache_matches_oracle(name, kw, rng_seed):
    run_decode("sm90-emulated", "cpu", rng_seed, **kw)


EMU_HEADDIMS = sorted({k["headdim"] for k in _REG if k["family"] == "sm90-emulated" and k["op"] == "fwd"
                       and k["dtype"] == "bf16"} - {64})


@pytest.mark.parametrize("page_size", [16, 32, 1, 7])
@pytest.mark.parametrize("d", EMU_HEADDIMS or [pytest.param(0, marks=pytest.mark.skip("no other emulated head dim"))])
def test_sm90_emulated_serving_other_head_dims(d, page_size, rng_seed):
    """Head dims 128 (128-key blocks, two 64-column boxes per page box; pages of 1 and 7 rows gathered, 16 chunks per
    thread) and 256 (48-key blocks: a block's three page boxes straddle pages of 16 and 32 rows; pages of 1 and 7 rows
    gathered by 48 of the 128 producer threads, one row and 32 chunks each, the other 80 only arriving) over a mixed
    batch."""
    reqs = [(1, 200), (130, 150), (0, 0), (9, 97)]
    run_serving("sm90-emulated", "cpu", rng_seed, reqs, h=4, hk=2, d=d, page_size=page_size, causal=True,
                window_size=(90, 0), sink_tokens=3)


@pytest.mark.skipif(128 not in EMU_HEADDIMS, reason="no emulated sm90 hdim128 forward in this build")
def test_sm90_emulated_padded_head_dim(rng_seed):
    """Head dim 96 on the 128 kernel: a GQA-packed tile's Q columns past 96 are zeroed by the loads that fill it (the
    TMA box of an unpacked one zero-fills them), and O's are not stored."""
    run_serving("sm90-emulated", "cpu", rng_seed, [(1, 150), (70, 90)], h=8, hk=2, d=96, causal=True)
    run_serving("sm90-emulated", "cpu", rng_seed, [(1, 150), (70, 90)], h=2, hk=2, d=96, causal=True)


def test_sm90_emulated_gpt_oss_shape(rng_seed):
    """gpt-oss-20b's attention on one rank (64 query heads over 8 KV heads, head dim 64, page 16, the sliding layer):
    decodes beside two prefill chunks, one launch."""
    reqs = [(1, 700), (1, 130), (2, 400), (150, 300), (33, 33)]
    run_serving("sm90-emulated", "cpu", rng_seed, reqs, h=64, hk=8, causal=True, window_size=(127, 0))


@pytest.mark.parametrize("page_size", [16, 5])
def test_sm90_contiguous_cache_serves_as_the_paged_one(page_size, rng_seed):
    """A contiguous cache (batch, capacity, hk, d) and a paged one holding the same keys give the same bits: the
    page boxes (page 16) and the producer warpgroup's gather (page 5) land a stage's bytes exactly where the
    whole-block box does."""
    reqs = [(1, 90), (140, 33), (0, 0), (20, 250)]
    pb = PagedBatch(reqs, h=4, hk=2, d=64, page_size=page_size, dtype=torch.bfloat16, pad_rows=2)
    cap = pb.block_table.shape[1] * page_size
    pos = torch.arange(cap)
    pages = pb.block_table.long()[:, pos // page_size]
    k_dense = pb.k_cache[pages, pos % page_size].contiguous()
    v_dense = pb.v_cache[pages, pos % page_size].contiguous()
    s = torch.randn(4)
    kw = dict(cache_seqlens=pb.seqused_k, cu_seqlens_q=pb.cu_seqlens_q, max_seqlen_q=140, causal=True,
              return_lse=True, backend="sm90-emulated")
    paged = sinkattn.flash_attn_with_kvcache(pb.q, pb.k_cache, pb.v_cache, s, block_table=pb.block_table, **kw)
    dense = sinkattn.flash_attn_with_kvcache(pb.q, k_dense, v_dense, s, **kw)
    assert torch.equal(paged[0], dense[0]) and torch.equal(paged[1], dense[1])


def test_sm90_one_call_per_batch(monkeypatch, rng_seed):
    counting = _CountingModule(_ext.require())
    monkeypatch.setattr(_ext, "require", lambda: counting)
    run_serving("sm90-emulated", "cpu", rng_seed, [(1, 100), (1, 50), (4, 80), (0, 0), (130, 60), (7, 90)],
                causal=True)
    assert len(counting.calls) == 1


@pytest.mark.parametrize("page_size", [16, 6])
def test_sm90_page_lookup_planted_bug_fails(page_size, monkeypatch, rng_seed):
    """The page lookup misread (every box or gathered row from the request's first page:
    SINKATTN_EMU90_MUTATE=page_table) fails the oracle; without it the same batch passes."""
    monkeypatch.setitem(MUTATIONS, "page_table", None)
    check_planted_bug("page_table", monkeypatch, lambda: run_serving(
        "sm90-emulated", "cpu", rng_seed, [(1, 100), (40, 70)], h=2, hk=1, causal=True, page_size=page_size))


# The gather's protocol (csrc/sm90/fwd_kernel.cuh produce_gathered): each producer thread's copies of a block one
# cp.async group, waited for (the next block's group left in flight at hd64), fenced for wgmma, then one arrival of 128
# on each full barrier.
GATHER_MUTATIONS = {
    # cp.async.wait_group returning early: the consumers' wgmma (or the thread's next copy) meets bytes not landed
    "cp_async_wait": "before the cp.async into it completed|while a cp.async into it was in flight|"
                     "cp.async never waited for",
    # the wait leaving one group more in flight than the block it publishes allows (the pipelining's off-by-one)
    "cp_async_group": "before the cp.async into it completed|while a cp.async into it was in flight|"
                      "cp.async never waited for",
    # no proxy fence after the copies: wgmma reads the producers' generic writes unfenced
    "no_fence": "no fence.proxy.async",
    # a full barrier counting 127 of the 128 gathering threads: a phase completes before the last thread's copies
    # landed, or its arrival finds the next phase
    "arrival_count": "partial phase|past its count|before the cp.async into it completed|while a cp.async|"
                     "in-flight wgmma|cp.async into shared bytes",
    # wgmma_wait retiring one group too few: the consumers release a stage their wgmma still reads, and the gather's
    # next cp.async into it is caught (a stage refilled before its release), or the group outlives the CTA
    "early_release": "cp.async into shared bytes|in-flight wgmma|wgmma group never waited for",
}


@pytest.mark.parametrize("mutation", sorted(GATHER_MUTATIONS))
def test_sm90_gather_planted_bugs_fail(mutation, monkeypatch, rng_seed):
    monkeypatch.setitem(MUTATIONS, mutation, GATHER_MUTATIONS[mutation])
    # early_release: keys enough that stages are refilled within a tile (8 blocks over 3 stages), so the gather's
    # refill meets the wgmma still reading (in 3 of 3 runs here; on 2 blocks the group outlived the CTA first)
    reqs = [(1, 1000), (200, 900)] if mutation == "early_release" else [(1, 100), (40, 70)]
    check_planted_bug(mutation, monkeypatch, lambda: run_serving(
        "sm90-emulated", "cpu", rng_seed, reqs, h=2, hk=1, causal=True, page_size=5))


@pytest.mark.parametrize("mutation", ["expect_tx", "parity", "no_fence"])
def test_sm90_protocol_planted_bugs_fail_over_pages(mutation, monkeypatch, rng_seed):
    """The pipeline's planted bugs fail on the paged, GQA-packed path too: its stages fill with several boxes each, and
    its Q rows are the consumers' own generic stores, which wgmma may read only after their proxy fence (no_fence)."""
    if mutation == "parity":
        # A packed tile's q_full carries no TMA bytes: a consumer waiting for the wrong phase of it may pass while
        # others wait, and its warpgroup's named barrier (load_packed_q) then never fills: a deadlock.
        monkeypatch.setitem(MUTATIONS, mutation, MUTATIONS[mutation] + "|deadlock")
    check_planted_bug(mutation, monkeypatch, lambda: run_serving(
        "sm90-emulated", "cpu", rng_seed, [(1, 100), (40, 70)], h=2, hk=1, causal=True))




@pytest.mark.parametrize("fmt", list(FP8_FORMATS))
@pytest.mark.parametrize("name,reqs,kw", FP8_SERVING_CASES, ids=[c[0] for c in FP8_SERVING_CASES])
def test_sm90_emulated_fp8_serving_matches_oracle(name, reqs, kw, fmt, rng_seed):
    """FP8 caches on the serving call: the gather lands a row's codes in its stage and decodes them in place; the
    oracle runs on the dequantized cache (codes * descale), so the kernel's own error is what is measured."""
    run_serving("sm90-emulated", "cpu", rng_seed, reqs, fp8=fmt, **kw)


@pytest.mark.parametrize("fmt", list(FP8_FORMATS))
@pytest.mark.parametrize("scales", ["per_head", "tensor"])
@pytest.mark.parametrize("name,kw", FP8_DECODE_CASES, ids=[c[0] for c in FP8_DECODE_CASES])
def test_sm90_emulated_fp8_decode_matches_oracle(name, kw, fmt, scales, rng_seed):
    """The padded decode and chunked-prefill calls over FP8 caches (contiguous ones too: the gather reads them when
    they are FP8), with their quantized append."""
    run_fp8_decode("sm90-emulated", "cpu", rng_seed, fmt=fmt, scales=scales, **kw)


@pytest.mark.parametrize("fmt", list(FP8_FORMATS))
def test_sm90_emulated_fp8_no_scales(fmt, rng_seed):
    """No descales (k_descale / v_descale null: both 1 in the consumers), paged and GQA-packed."""
    run_fp8_decode("sm90-emulated", "cpu", rng_seed, fmt=fmt, scales="none", h=8, hk=1, sq=3, sn=3, causal=True,
                   page_size=16, capacity=200, lens=(150, 5, 0))


@pytest.mark.parametrize("fmt", list(FP8_FORMATS))
def test_sm90_emulated_fp8_other_head_dims_and_fp16(fmt, rng_seed):
    """Head dim 128 (a row's 8 code vectors in the upper 64 columns, decoded into both 64-column atoms), head dim
    96 on it (codes past 96 zero-filled), fp16 queries over pages of 7 rows; head dim 256 (48 rows a block, one a
    thread, 16 code vectors a row decoded over its four 64-column atoms), which the sm80 FP8 tiles do not serve."""
    if 128 in EMU_HEADDIMS:
        run_fp8_decode("sm90-emulated", "cpu", rng_seed, fmt=fmt, d=128, h=8, hk=2, sq=9, sn=9, causal=True,
                       capacity=300, lens=(250, 64, 1), page_size=16)
        run_fp8_decode("sm90-emulated", "cpu", rng_seed, fmt=fmt, d=96, causal=True, capacity=200, lens=(150, 3, 0))
    run_fp8_decode("sm90-emulated", "cpu", rng_seed, fmt=fmt, dtype=torch.float16, h=8, hk=1, causal=True,
                   window_size=(60, 0), sink_tokens=2, page_size=7)
    if 256 in EMU_HEADDIMS:
        run_fp8_decode("sm90-emulated", "cpu", rng_seed, fmt=fmt, d=256, h=8, hk=2, sq=3, sn=3, causal=True,
                       window_size=(70, 0), sink_tokens=2, capacity=200, lens=(150, 49, 0), page_size=5)
        run_serving("sm90-emulated", "cpu", rng_seed, [(1, 120), (20, 60)], h=4, hk=1, d=256, fp8=fmt, causal=True,
                    page_size=16)


def test_sm90_fp8_gather_planted_bugs_fail(monkeypatch, rng_seed):
    """The FP8 gather's decode writes are generic stores: without the proxy fence wgmma reads them unfenced; with
    the wait for a block's cp.async group returning early, or leaving one group too many in flight, the decode reads
    codes not landed."""
    run = lambda: run_serving("sm90-emulated", "cpu", rng_seed, [(1, 100), (40, 70)], h=2, hk=1, causal=True,
                              fp8="e4m3fn")
    monkeypatch.setitem(MUTATIONS, "no_fence", "no fence.proxy.async")
    check_planted_bug("no_fence", monkeypatch, run)
    for mutation in ("cp_async_wait", "cp_async_group"):
        monkeypatch.setitem(MUTATIONS, mutation, "while a cp.async into it was in flight|cp.async never waited|"
                                                 "before the cp.async into it completed")
        check_planted_bug(mutation, monkeypatch, run)


@pytest.mark.parametrize("num_splits", [0, 3])
def test_sm90_split_kv_runs_and_matches_oracle(num_splits, rng_seed):
    """Split-KV on the sm90 forward: each split's partials (normalised over its share of the key blocks, no sink) and
    the combine (the sink once), against the oracle; num_splits 0 lets the host pick the count from the work (one
    request's decode: one tile, so it splits). That the split path ran: its bits differ from the unsplit call's (the
    partials round to fp32 and are merged in another order), and both match the oracle."""
    reqs = [(1, 900), (1, 1), (3, 400)]
    kw = dict(h=8, hk=1, causal=True, window_size=(600, 0), sink_tokens=3)
    split_out, split_lse = run_serving("sm90-emulated", "cpu", rng_seed, reqs, num_splits=num_splits, **kw)
    whole_out, whole_lse = run_serving("sm90-emulated", "cpu", rng_seed, reqs, num_splits=1, **kw)
    assert not torch.equal(split_out, whole_out) or not torch.equal(split_lse, whole_lse), \
        f"num_splits={num_splits} gave the unsplit call's bits: the keys were not split"


@pytest.mark.parametrize("d", EMU_HEADDIMS or [pytest.param(0, marks=pytest.mark.skip("no other emulated head dim"))])
def test_sm90_split_kv_other_head_dims(d, rng_seed):
    """Head dims 128 (128-key blocks) and 256 (48-key blocks: many blocks per split, a window and sink tokens whose
    blocks fall in different splits), over a GQA-packed decode batch with an empty request and more splits than some
    requests have blocks."""
    run_serving("sm90-emulated", "cpu", rng_seed, [(1, 500), (0, 0), (1, 40), (2, 300)], h=4, hk=2, d=d,
                causal=True, window_size=(250, 0), sink_tokens=2, num_splits=5)
