"""The serving call (flash_attn_with_kvcache with cu_seqlens_q: packed queries of a mixed batch over a paged cache
that already holds every key, one kernel launch) against the float64 oracle: shared by the emulated (CPU) and GPU
tests.

A batch is a list of (query rows, keys) per request, vLLM's mix: decodes at long contexts, speculative rows (1 + k),
prefill chunks over a cached prefix, requests with no query rows or no keys, keys ending inside a page, and padding
rows past the last request (which must come back as out 0, lse -inf). The expected result of request b is the oracle
of its queries over its first keys[b] keys, bottom-right aligned; the cache must be unchanged.
"""
from __future__ import annotations

import torch

import sinkattn
from oracle import attention_oracle, tolerance_check

FP8_DTYPES = {"e4m3fn": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


class PagedBatch:
    """A paged cache (shuffled pages, spare pages poisoned with NaN) holding each request's keys, and its packed
    queries. fp8: the cache holds FP8 codes of the keys divided by per-(request, KV head) scales."""

    def __init__(self, reqs, *, h, hk, d, page_size, dtype, pad_rows=0, fp8=None, scales="per_head", device="cpu"):
        self.reqs = list(reqs)
        self.q_lens = [a for a, _ in self.reqs]
        self.k_lens = [n for _, n in self.reqs]
        b = len(self.reqs)
        pages = [max(1, -(-n // page_size)) for n in self.k_lens]
        max_pages = max(pages) + 1  # a spare column: the block table is wider than any request needs
        num_pages = sum(pages) + 5
        perm = torch.randperm(num_pages)
        cache_dtype = dtype if fp8 is None else FP8_DTYPES[fp8]
        shape = (num_pages, page_size, hk, d)
        self.k_cache = torch.full(shape, float("nan"), dtype=torch.float32).to(cache_dtype)
        self.v_cache = torch.full(shape, float("nan"), dtype=torch.float32).to(cache_dtype)
        # Unused block-table entries point at a poisoned page, as vLLM's null block could hold anything.
        self.block_table = torch.full((b, max_pages), int(perm[-1]), dtype=torch.int32)
        self.keys, self.values = [], []  # what the oracle reads: the cache's values (dequantized for FP8)
        self.descales = None
        if fp8 is not None:
            if scales == "per_head":
                self.descales = (torch.rand(b, hk) + 0.5, torch.rand(b, hk) + 0.5)
            else:
                self.descales = (torch.full((b, hk), 0.75), torch.full((b, hk), 1.25))
        used = 0
        for r, n in enumerate(self.k_lens):
            k = torch.randn(n, hk, d)
            v = torch.randn(n, hk, d)
            if fp8 is not None:
                kd, vd = self.descales[0][r], self.descales[1][r]
                kc, vc = (k / kd[:, None]).to(cache_dtype), (v / vd[:, None]).to(cache_dtype)
                k, v = kc.float() * kd[:, None], vc.float() * vd[:, None]
            else:
                kc, vc = k.to(dtype), v.to(dtype)
                k, v = kc, vc
            self.keys.append(k)
            self.values.append(v)
            for p in range(pages[r]):
                page = int(perm[used])
                used += 1
                self.block_table[r, p] = page
                sl = slice(p * page_size, min(n, (p + 1) * page_size))
                rows = sl.stop - sl.start
                self.k_cache[page, :rows] = kc[sl]
                self.v_cache[page, :rows] = vc[sl]
        starts = [0]
        for a in self.q_lens:
            starts.append(starts[-1] + a)
        self.cu_seqlens_q = torch.tensor(starts, dtype=torch.int32)
        self.total = starts[-1] + pad_rows
        self.q = torch.randn(self.total, h, d).to(dtype)
        self.seqused_k = torch.tensor(self.k_lens, dtype=torch.int32)
        self.device = device

    def on(self, t):
        return None if t is None else t.to(self.device)


def run_serving(backend: str, device: str, seed, reqs, *, h=8, hk=1, d=64, page_size=16, dtype=torch.bfloat16,
                pad_rows=3, sinks="random", fp8=None, scales="per_head", num_splits=0, max_seqlen_q=None, **kw):
    """One serving call on `backend` -> (out, lse), each request checked against the oracle (the cache's values:
    dequantized codes for FP8, so the kernel's own error is measured)."""
    pb = PagedBatch(reqs, h=h, hk=hk, d=d, page_size=page_size, dtype=dtype, pad_rows=pad_rows, fp8=fp8,
                    scales=scales, device=device)
    s = {"random": torch.randn(h), "none": None, "+30": torch.full((h,), 30.0)}[sinks]
    k_before, v_before = pb.k_cache.clone(), pb.v_cache.clone()
    extra = {}
    if pb.descales is not None:
        extra = dict(k_descale=pb.on(pb.descales[0]), v_descale=pb.on(pb.descales[1]))
    out, lse = sinkattn.flash_attn_with_kvcache(
        pb.on(pb.q), pb.on(pb.k_cache), pb.on(pb.v_cache), pb.on(s), cache_seqlens=pb.on(pb.seqused_k),
        block_table=pb.on(pb.block_table), cu_seqlens_q=pb.on(pb.cu_seqlens_q),
        max_seqlen_q=max(pb.q_lens) if max_seqlen_q is None else max_seqlen_q, return_lse=True,
        num_splits=num_splits, backend=backend, **extra, **kw)
    out, lse = out.cpu(), lse.cpu()
    assert out.shape == pb.q.shape and lse.shape == (h, pb.total)
    starts = pb.cu_seqlens_q.tolist()
    for r, (a, n) in enumerate(pb.reqs):
        if a == 0:
            continue
        rows = slice(starts[r], starts[r + 1])
        q = pb.q[None, rows]
        k, v = pb.keys[r][None], pb.values[r][None]
        ref_out, ref_lse = attention_oracle(q, k, v, s, **kw)
        base_out, base_lse = attention_oracle(q, k.to(dtype), v.to(dtype), s, compute_dtype=dtype, **kw)
        tag = f"{backend} req {r} (q {a}, keys {n}) page {page_size} splits {num_splits} fp8 {fp8}"
        tolerance_check(f"{tag} out", out[None, rows], ref_out, base_out, 1e-3, seed)
        tolerance_check(f"{tag} lse", lse[None, :, rows], ref_lse, base_lse.float(), 1e-4, seed)
    pad = slice(starts[-1], pb.total)
    assert (out[pad] == 0).all() and (lse[:, pad] == float("-inf")).all(), f"{backend}: the padding rows"
    assert torch.equal(pb.k_cache.view(torch.uint8), k_before.view(torch.uint8)), "the call wrote into k_cache"
    assert torch.equal(pb.v_cache.view(torch.uint8), v_before.view(torch.uint8)), "the call wrote into v_cache"
    return out, lse


# (name, requests [(query rows, keys)], kwargs): vLLM's batches, small enough for the emulation.
SERVING_CASES = [
    # decodes first (vLLM's reorder), a speculative request, two prefill chunks over cached prefixes, an empty
    # request between them (a padding request: no rows, no keys), keys ending inside pages
    ("mixed-gqa8-page16", [(1, 300), (1, 45), (4, 70), (0, 0), (37, 120), (19, 19)], dict(causal=True)),
    ("mixed-window-cuts-pages-sinktok", [(1, 250), (1, 17), (4, 200), (23, 90)],
     dict(causal=True, window_size=(40, 0), sink_tokens=3)),
    # decode-only and speculative-only batches: max_seqlen_q * 8 rows pick the key-group decode tiles (8 and 24
    # rows), the padded call's own, through the packed grid; with split-KV and without
    ("decode-only-keygroups", [(1, 300), (1, 45), (1, 0), (1, 130), (0, 0)], dict(causal=True)),
    ("decode-only-split4", [(1, 500), (1, 1), (1, 260)], dict(causal=True, num_splits=4, window_size=(127, 0),
                                                              sink_tokens=2)),
    ("spec3-only", [(3, 200), (3, 3), (3, 77)], dict(causal=True, num_splits=2)),
    ("page1", [(1, 33), (3, 9), (6, 6)], dict(page_size=1, causal=True)),
    ("page64-whole-blocks", [(1, 200), (1, 64), (30, 129)], dict(page_size=64, causal=True)),
    ("page256-long-decode", [(1, 700), (2, 300), (0, 5)], dict(page_size=256, causal=True, window_size=(127, 0))),
    ("odd-page5", [(1, 41), (7, 23)], dict(page_size=5, causal=True)),
    ("split3-mixed", [(1, 260), (1, 130), (5, 140)], dict(causal=True, num_splits=3)),
    ("keys0-and-more-queries-than-keys", [(1, 0), (3, 0), (6, 2), (1, 1)], dict(causal=True, num_splits=2)),
    ("no-gqa-softcap-sinks+30", [(1, 60), (9, 40)], dict(h=2, hk=2, causal=True, softcap=8.0, sinks="+30")),
    ("gqa4-not-causal", [(1, 50), (5, 30)], dict(h=8, hk=2, window_size=(-1, -1))),
    ("no-sinks", [(2, 80), (1, 3)], dict(causal=True, sinks="none")),
    # max_seqlen_q only picks the tile: an understated or overstated value is exact as well
    ("max-seqlen-understated", [(1, 90), (40, 100)], dict(causal=True, max_seqlen_q=1)),
    ("max-seqlen-overstated", [(1, 90), (2, 100)], dict(causal=True, max_seqlen_q=500)),
]

# FP8 caches (both formats, per-head and per-tensor scales) on the mixed batch
FP8_SERVING_CASES = [
    ("fp8-mixed", [(1, 200), (1, 31), (4, 60), (0, 0), (21, 80)], dict(causal=True)),
    ("fp8-window-split2", [(1, 150), (6, 70)], dict(causal=True, window_size=(50, 0), sink_tokens=2,
                                                    num_splits=2)),
    ("fp8-decode-only", [(1, 300), (1, 2), (1, 0)], dict(causal=True, num_splits=3)),
]


# The sm90 forward over a paged cache (csrc/sm90/fwd_kernel.cuh PageRows, TileWork): the shared cases it serves
# (GQA-packed wherever h > hk), and the shapes of its own path: several 128-row M tiles per request (packed over the
# batch), pages of two boxes (32), pages that are not a power of two (48: divisions), pages holding whole key blocks
# (128, 256), keys ending inside a page box, a window whose left edge cuts a page, and GQA groups of 6 and 3.
# The shared cases run as they are (split-KV included: each split's partials, then the combine); pages of a multiple
# of 16 rows arrive in 16-row TMA boxes, the others (page1, odd-page5) through the producer warpgroup's gather.
SM90_SERVING_CASES = SERVING_CASES + [
    ("sm90-m-tiles-page32", [(1, 300), (200, 260), (0, 0), (130, 500), (3, 19)],
     dict(page_size=32, causal=True)),
    ("sm90-page48-window-sinktok", [(70, 400), (1, 97), (129, 129)],
     dict(page_size=48, causal=True, window_size=(100, 0), sink_tokens=5)),
    ("sm90-page128-gqa4-not-causal", [(9, 300), (140, 257)], dict(page_size=128, h=8, hk=2, window_size=(-1, -1))),
    ("sm90-page256-softcap", [(33, 600), (1, 255)], dict(page_size=256, causal=True, softcap=20.0)),
    # GQA packing's row -> (query, head) map at groups that do not divide the 128-row tile: a tile's rows start
    # mid-query
    ("sm90-gqa6-decode-and-chunk", [(1, 300), (50, 120), (3, 40)], dict(h=6, hk=1, causal=True)),
    ("sm90-gqa3-window-sinktok", [(1, 200), (70, 170), (0, 9)],
     dict(h=12, hk=4, page_size=32, causal=True, window_size=(60, 0), sink_tokens=2)),
    # pages the producer warpgroup gathers (csrc/sm90/fwd_kernel.cuh KvGather): a key block of 128 rows from 11 to
    # 128 pages, keys ending inside a page, several M tiles, a window that cuts pages, sink tokens, GQA 8:1
    ("sm90-gather-page3-gqa8", [(1, 300), (1, 2), (4, 100), (0, 0), (150, 170)], dict(page_size=3, causal=True)),
    ("sm90-gather-page8-window-sinktok", [(1, 260), (70, 200), (9, 9)],
     dict(page_size=8, h=4, hk=2, causal=True, window_size=(70, 0), sink_tokens=4)),
    ("sm90-gather-page12-not-causal-softcap", [(5, 140), (130, 257)],
     dict(page_size=12, h=2, hk=2, window_size=(-1, -1), softcap=15.0)),
    ("sm90-gather-page24-sinks+30", [(1, 500), (33, 33)], dict(page_size=24, causal=True, sinks="+30")),
]
