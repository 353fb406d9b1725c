"""flash_attn_with_kvcache: contiguous and paged caches, in-place appends, rotary, against the oracle.

The expected result is built the obvious way: rotate q and the new k in float64 at positions
cache_seqlens + i, write the new tokens into a dense copy of each sequence, and run the oracle on it.
"""
import pytest
import torch

import sinkattn
from sinkattn import reference
from oracle import attention_oracle, rotary_oracle, tolerance_check
from oracle import single_thread  # noqa: F401  (autouse: one torch thread per test)


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    monkeypatch.setattr(reference, "KEY_TILE", 32)
    monkeypatch.setattr(reference, "ROW_CHUNK", 24)


def rotary_tables(max_pos, rot_dim):
    inv = 1.0 / (10000 ** (torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim))
    ang = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv[None, :]
    return ang.cos().float(), ang.sin().float()


class Cache:
    """A KV cache with known contents per sequence, stored contiguously or in shuffled pages."""

    def __init__(self, b, hk, d, capacity, lens, dtype, page_size=None):
        self.lens = lens
        self.dense_k = torch.randn(b, capacity, hk, d).to(dtype)
        self.dense_v = torch.randn(b, capacity, hk, d).to(dtype)
        self.page_size = page_size
        if page_size is None:
            self.k, self.v, self.block_table = self.dense_k.clone(), self.dense_v.clone(), None
            return
        pages_per_seq = capacity // page_size
        num_pages = b * pages_per_seq + 3  # spare pages stay untouched
        perm = torch.randperm(num_pages)[: b * pages_per_seq]
        self.block_table = perm.view(b, pages_per_seq).to(torch.int32)
        self.k = torch.randn(num_pages, page_size, hk, d).to(dtype)
        self.v = torch.randn(num_pages, page_size, hk, d).to(dtype)
        for bi in range(b):
            for p in range(pages_per_seq):
                sl = slice(p * page_size, (p + 1) * page_size)
                self.k[self.block_table[bi, p]] = self.dense_k[bi, sl]
                self.v[self.block_table[bi, p]] = self.dense_v[bi, sl]

    def read(self, bi, n):
        """The first n tokens of sequence bi as stored in the cache now."""
        if self.page_size is None:
            return self.k[bi, :n], self.v[bi, :n]
        pos = torch.arange(n)
        page = self.block_table[bi].long()[pos // self.page_size]
        return self.k[page, pos % self.page_size], self.v[page, pos % self.page_size]


def run_case(rng_seed, *, b=3, h=8, hk=2, d=64, capacity=96, lens=(0, 37, 80), sq=5, sn=5, page_size=None,
             rotary=None, dtype=torch.float32, sinks=True, **kw):
    lens = list(lens)
    cache = Cache(b, hk, d, capacity, lens, dtype, page_size)
    q = torch.randn(b, sq, h, d).to(dtype)
    k_new = torch.randn(b, sn, hk, d).to(dtype) if sn else None
    v_new = torch.randn(b, sn, hk, d).to(dtype) if sn else None
    s = torch.randn(h) if sinks else None
    cos = sin = None
    if rotary is not None:
        cos, sin = rotary_tables(capacity + sq, rotary["dim"])
    seqlens = torch.tensor(lens, dtype=torch.int32)
    other_pages = None
    if page_size is not None:
        used = set(cache.block_table.flatten().tolist())
        spare = [p for p in range(cache.k.shape[0]) if p not in used]
        other_pages = cache.k[spare].clone()
    out, lse = sinkattn.flash_attn_with_kvcache(
        q, cache.k, cache.v, s, k=k_new, v=v_new, cache_seqlens=seqlens, block_table=cache.block_table,
        rotary_cos=cos, rotary_sin=sin, rotary_interleaved=bool(rotary and rotary["interleaved"]),
        return_lse=True, **kw)
    assert out.shape == q.shape and lse.shape == (b, h, sq)
    for bi in range(b):
        n = lens[bi]
        qb, kb = q[bi:bi + 1].double(), k_new[bi:bi + 1].double() if sn else None
        if rotary is not None:
            qb = rotary_oracle(qb, cos, sin, n + torch.arange(sq)[None], rotary["interleaved"])
            if sn:
                kb = rotary_oracle(kb, cos, sin, n + torch.arange(sn)[None], rotary["interleaved"])
        want_k = cache.dense_k[bi, : n + sn].double().clone()
        want_v = cache.dense_v[bi, : n + sn].double().clone()
        if sn:
            want_k[n:] = kb[0]
            want_v[n:] = v_new[bi].double()
        got_k, got_v = cache.read(bi, n + sn)
        # The append: old tokens untouched, new ones (rotated k) in place, rounded to the cache dtype.
        tolerance_check(f"k_cache[{bi}]", got_k, want_k, None, 1e-6 if dtype == torch.float32 else 1e-2, rng_seed)
        assert torch.equal(got_v, want_v.to(dtype)), f"v_cache[{bi}] (seed {rng_seed})"
        ref_out, ref_lse = attention_oracle(qb, want_k[None], want_v[None], s, **kw)
        if dtype == torch.float32:
            base_out = base_lse = None
            atol = 2e-5
        else:
            base_out, base_lse = attention_oracle(qb.to(dtype), want_k[None].to(dtype), want_v[None].to(dtype), s,
                                                  **kw, compute_dtype=dtype)
            atol = 1e-3
        tolerance_check(f"out[{bi}]", out[bi:bi + 1], ref_out, base_out, atol, rng_seed)
        tolerance_check(f"lse[{bi}]", lse[bi:bi + 1], ref_lse, base_lse, atol, rng_seed)
    if other_pages is not None:
        assert torch.equal(cache.k[spare], other_pages), "pages outside block_table were written"
    return out


def test_contiguous_decode(rng_seed):
    run_case(rng_seed, sq=1, sn=1, causal=True)


def test_contiguous_chunked_prefill_window_sinks(rng_seed):
    run_case(rng_seed, sq=9, sn=9, causal=True, window_size=(20, 0), sink_tokens=4)


def test_no_append(rng_seed):
    run_case(rng_seed, sq=3, sn=0, causal=True, lens=(1, 50, 96))


def test_queries_past_new_tokens(rng_seed):
    """seqlen_q > seqlen_new: the first queries see fewer keys (bottom-right alignment); empty rows are 0."""
    run_case(rng_seed, sq=7, sn=2, causal=True, lens=(0, 3, 60))


@pytest.mark.parametrize("page_size", [16, 5, 1])
def test_paged_shuffled_pages_crossing_boundaries(page_size, rng_seed):
    # lens chosen so the appended tokens straddle page boundaries for every page size
    run_case(rng_seed, capacity=80, lens=(14, 33, 0), sq=6, sn=6, page_size=page_size, causal=True,
             window_size=(30, 0), sink_tokens=2)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("paged", [False, True])
def test_rotary(interleaved, paged, rng_seed):
    run_case(rng_seed, sq=4, sn=4, causal=True, rotary=dict(dim=32, interleaved=interleaved),
             page_size=8 if paged else None, capacity=96)


def test_rotary_full_dim_decode(rng_seed):
    run_case(rng_seed, d=32, sq=1, sn=1, causal=True, rotary=dict(dim=32, interleaved=False))


def test_bf16_paged_gqa8(rng_seed):
    run_case(rng_seed, dtype=torch.bfloat16, h=8, hk=1, page_size=16, capacity=96, sq=3, sn=3, causal=True,
             window_size=(40, 0), softcap=5.0)


def test_int_and_none_cache_seqlens(rng_seed):
    b, h, d = 2, 4, 32
    kc, vc = torch.randn(b, 20, h, d), torch.randn(b, 20, h, d)
    q = torch.randn(b, 1, h, d)
    full = sinkattn.flash_attn_with_kvcache(q, kc, vc, causal=True)
    ref, _ = attention_oracle(q, kc, vc, causal=True)
    tolerance_check("out (cache_seqlens=None)", full, ref, None, 1e-5, rng_seed)
    part = sinkattn.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=7, causal=True)
    ref, _ = attention_oracle(q, kc[:, :7], vc[:, :7], causal=True)
    tolerance_check("out (cache_seqlens=7)", part, ref, None, 1e-5, rng_seed)


def test_num_splits_is_accepted(rng_seed):
    b, h, d = 1, 2, 16
    kc, vc, q = torch.randn(b, 10, h, d), torch.randn(b, 10, h, d), torch.randn(b, 1, h, d)
    a = sinkattn.flash_attn_with_kvcache(q, kc, vc, num_splits=4)
    assert torch.equal(a, sinkattn.flash_attn_with_kvcache(q, kc, vc))
