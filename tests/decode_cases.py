"""flash_attn_with_kvcache on a kernel backend against the oracle: shared by the emulated (CPU) and GPU tests.

The expected result is the float64 oracle over each sequence's keys after the append (bottom-right aligned).
"""
from __future__ import annotations

import torch

import sinkattn
from oracle import attention_oracle, tolerance_check
from test_kvcache import Cache


def run_decode(backend: str, device: str, seed, *, b=3, h=8, hk=2, d=64, capacity=160, lens=(0, 37, 120), sq=1,
               sn=1, page_size=None, dtype=torch.bfloat16, sinks="random", num_splits=0, **kw):
    lens = list(lens)
    cache = Cache(b, hk, d, capacity, lens, dtype, page_size)
    cache.k, cache.v = cache.k.to(device), cache.v.to(device)
    bt = None if cache.block_table is None else cache.block_table.to(device)
    q = torch.randn(b, sq, h, d).to(dtype)
    k_new = torch.randn(b, sn, hk, d).to(dtype) if sn else None
    v_new = torch.randn(b, sn, hk, d).to(dtype) if sn else None
    s = {"random": torch.randn(h), "none": None, "-inf": torch.full((h,), float("-inf")),
         "+30": torch.full((h,), 30.0)}[sinks]
    seqlens = torch.tensor(lens, dtype=torch.int32)
    dev = lambda t: None if t is None else t.to(device)  # noqa: E731
    out, lse = sinkattn.flash_attn_with_kvcache(
        dev(q), cache.k, cache.v, dev(s), k=dev(k_new), v=dev(v_new), cache_seqlens=dev(seqlens), block_table=bt,
        return_lse=True, num_splits=num_splits, backend=backend, **kw)
    out, lse = out.cpu(), lse.cpu()
    cache.k, cache.v = cache.k.cpu(), cache.v.cpu()
    for bi in range(b):
        n = lens[bi]
        want_k = cache.dense_k[bi, : n + sn].clone()
        want_v = cache.dense_v[bi, : n + sn].clone()
        if sn:
            want_k[n:] = k_new[bi]
            want_v[n:] = v_new[bi]
        got_k, got_v = cache.read(bi, n + sn)
        assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v), f"cache of sequence {bi} (seed {seed})"
        ref_out, ref_lse = attention_oracle(q[bi:bi + 1], want_k[None], want_v[None], s, **kw)
        base_out, base_lse = attention_oracle(q[bi:bi + 1], want_k[None], want_v[None], s, compute_dtype=dtype, **kw)
        tag = f"{backend} b{bi} n={n} splits={num_splits} page={page_size}"
        tolerance_check(f"{tag} out", out[bi:bi + 1], ref_out, base_out, 1e-3, seed)
        tolerance_check(f"{tag} lse", lse[bi:bi + 1], ref_lse, base_lse.float(), 1e-4, seed)
    return out, lse


# (name, kwargs): every feature of the decode path, small enough for the emulation.
DECODE_CASES = [
    ("contiguous-gqa-splits0", dict(sq=1, sn=1, causal=True)),
    ("contiguous-window-sinktok-split3", dict(sq=1, sn=1, causal=True, window_size=(40, 0), sink_tokens=4, num_splits=3)),
    ("paged16-shuffled-crossing", dict(sq=4, sn=4, causal=True, page_size=16, lens=(14, 33, 0), num_splits=2)),
    ("paged5-odd-pages", dict(sq=2, sn=2, causal=True, page_size=5, capacity=80, lens=(3, 40, 71))),
    ("empty-and-length1-caches", dict(sq=1, sn=0, lens=(0, 1, 0), causal=True, num_splits=4)),
    ("split64-more-than-blocks", dict(sq=1, sn=1, causal=True, num_splits=64, lens=(100, 5, 130))),
    ("chunked-prefill-mqa", dict(sq=9, sn=9, h=4, hk=1, causal=True, window_size=(20, 0), sink_tokens=2, num_splits=2)),
    ("no-gqa-sinks+30-softcap", dict(sq=3, sn=1, h=2, hk=2, sinks="+30", softcap=10.0, num_splits=5)),
    # gpt-oss's shape: 8 query heads per KV head, one query (8 rows: the tile whose warps split the keys).
    ("gqa8-window-sinktok", dict(h=8, hk=1, sq=1, sn=1, causal=True, window_size=(50, 0), sink_tokens=3,
                                 capacity=200, lens=(150, 37, 0))),
    ("gqa8-paged16-split2", dict(h=8, hk=1, sq=1, sn=1, causal=True, page_size=16, capacity=320, lens=(300, 3, 129),
                                 num_splits=2)),
    # Pages of 48 rows (not a power of two) under the decode tile's 128-key blocks: interior blocks row by row from
    # their pages, each row's page and slot by division (KvLoader::load_paged_rows).
    ("gqa8-paged48-divisions", dict(h=8, hk=1, sq=1, sn=1, causal=True, page_size=48, capacity=336, lens=(300, 129, 2))),
    # Speculative decoding's shape: 3 queries x 8 heads = 24 rows (two key groups of two warps).
    ("gqa8-3queries-paged16-split2", dict(h=8, hk=1, sq=3, sn=3, causal=True, page_size=16, capacity=200,
                                          lens=(150, 5, 0), num_splits=2)),
    ("sinks-neginf-paged64", dict(sq=1, sn=1, page_size=64, capacity=192, lens=(120, 64, 1), sinks="-inf", num_splits=0)),
    # Pages holding whole key blocks: interior blocks load as tiles from one page (sm80/fwd_kernel.h load_kv).
    # Decode tile (128 keys) over 128-key pages; a prefill chunk (10 x 8 rows: the 64-key row tile) over
    # 64-key pages; 192-key pages (whole blocks, not a power of two: divisions, not shifts).
    ("paged128-whole-blocks-split2", dict(sq=1, sn=1, causal=True, page_size=128, capacity=640, lens=(600, 128, 257),
                                          num_splits=2)),
    ("chunked-prefill-paged64-tiles", dict(h=8, hk=1, sq=10, sn=10, causal=True, page_size=64, capacity=384,
                                           lens=(300, 64, 200), window_size=(150, 0), sink_tokens=3)),
    ("chunked-prefill-paged192", dict(h=8, hk=1, sq=10, sn=10, causal=True, page_size=192, capacity=576,
                                      lens=(500, 192, 10))),
]


# ---- FP8 KV caches (csrc/sm80/fp8_kv.h): the kernels against the oracle on the dequantized cache -------------------
FP8_FORMATS = {"e4m3fn": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def fp8_quantize(x, descale, dtype):
    """x (b, s, hk, d) -> FP8 codes of x / descale (b, hk), saturating (the contract of sinkattn/fp8.py, written
    here independently)."""
    bound = torch.finfo(dtype).max
    return (x.float() / descale[:, None, :, None]).clamp(-bound, bound).to(dtype)


def fp8_scales(form, b, hk):
    """(kwargs of the call, k descale (b, hk), v descale (b, hk)) of a scale form."""
    if form == "none":
        return {}, torch.ones(b, hk), torch.ones(b, hk)
    if form == "tensor":  # per tensor, vLLM's form
        return (dict(k_scale=torch.tensor([0.07]), v_scale=0.3), torch.full((b, hk), 0.07), torch.full((b, hk), 0.3))
    kd, vd = torch.rand(b, hk) * 0.5 + 0.05, torch.rand(b, hk) * 2 + 0.1  # per (batch, KV head), FA3's form
    return dict(k_descale=kd, v_descale=vd), kd, vd


def run_fp8_decode(backend: str, device: str, seed, *, fmt="e4m3fn", scales="per_head", b=3, h=8, hk=2, d=64,
                   capacity=160, lens=(0, 37, 120), sq=1, sn=1, page_size=None, dtype=torch.bfloat16, sinks="random",
                   num_splits=0, plant=None, **kw):
    """flash_attn_with_kvcache over an FP8 cache on `backend`; the appended tokens must be stored quantized, and
    out / lse must match the float64 oracle on the dequantized cache (codes * descale) within section 6's rule.
    plant: {("k" or "v", sequence, position, KV head, column): code (a uint8)} written into the cache before the call
    (the result is then returned unchecked, for tests that compare it with the reference backend's)."""
    lens, fdt = list(lens), FP8_FORMATS[fmt]
    cache = Cache(b, hk, d, capacity, lens, fdt, page_size)  # N(0, 1) values as codes: the quantized cache
    for (which, bi, pos, hh, col), code in (plant or {}).items():
        dense, stored = (cache.dense_k, cache.k) if which == "k" else (cache.dense_v, cache.v)
        dense.view(torch.uint8)[bi, pos, hh, col] = code
        if page_size is None:
            stored.view(torch.uint8)[bi, pos, hh, col] = code
        else:
            stored.view(torch.uint8)[cache.block_table[bi, pos // page_size], pos % page_size, hh, col] = code
    cache.k, cache.v = cache.k.to(device), cache.v.to(device)
    bt = None if cache.block_table is None else cache.block_table.to(device)
    call_kw, kd, vd = fp8_scales(scales, b, hk)
    call_kw = {n: x.to(device) if isinstance(x, torch.Tensor) else x for n, x in call_kw.items()}
    q = torch.randn(b, sq, h, d).to(dtype)
    k_new = (torch.randn(b, sn, hk, d) * kd[:, None, :, None] * 2).to(dtype) if sn else None
    v_new = (torch.randn(b, sn, hk, d) * vd[:, None, :, None] * 2).to(dtype) if sn else None
    s = {"random": torch.randn(h) * 2, "none": None, "-inf": torch.full((h,), float("-inf")),
         "+30": torch.full((h,), 30.0)}[sinks]
    seqlens = torch.tensor(lens, dtype=torch.int32)
    dev = lambda t: None if t is None else t.to(device)  # noqa: E731
    out, lse = sinkattn.flash_attn_with_kvcache(
        dev(q), cache.k, cache.v, dev(s), k=dev(k_new), v=dev(v_new), cache_seqlens=dev(seqlens), block_table=bt,
        return_lse=True, num_splits=num_splits, backend=backend, **call_kw, **kw)
    out, lse = out.cpu(), lse.cpu()
    if plant:
        return out, lse
    cache.k, cache.v = cache.k.cpu(), cache.v.cpu()
    for bi in range(b):
        n = lens[bi]
        want_k = cache.dense_k[bi, : n + sn].clone()
        want_v = cache.dense_v[bi, : n + sn].clone()
        if sn:
            want_k[n:] = fp8_quantize(k_new[bi:bi + 1], kd[bi:bi + 1], fdt)[0]
            want_v[n:] = fp8_quantize(v_new[bi:bi + 1], vd[bi:bi + 1], fdt)[0]
        got_k, got_v = cache.read(bi, n + sn)
        assert torch.equal(got_k.view(torch.uint8), want_k.view(torch.uint8)), f"k cache of sequence {bi} (seed {seed})"
        assert torch.equal(got_v.view(torch.uint8), want_v.view(torch.uint8)), f"v cache of sequence {bi} (seed {seed})"
        k_dq = want_k.double() * kd[bi].double()[None, :, None]
        v_dq = want_v.double() * vd[bi].double()[None, :, None]
        ref_out, ref_lse = attention_oracle(q[bi:bi + 1], k_dq[None], v_dq[None], s, **kw)
        base_out, base_lse = attention_oracle(q[bi:bi + 1], k_dq[None].to(dtype), v_dq[None].to(dtype), s,
                                              compute_dtype=dtype, **kw)
        tag = f"{backend} {fmt} {scales} b{bi} n={n} splits={num_splits} page={page_size}"
        tolerance_check(f"{tag} out", out[bi:bi + 1], ref_out, base_out, 1e-3, seed)
        tolerance_check(f"{tag} lse", lse[bi:bi + 1], ref_lse, base_lse.float(), 1e-4, seed)
    return out, lse


# (name, kwargs): the FP8 decode tiles' features, small enough for the emulation (both formats and the scale forms
# are crossed with these by the tests).
FP8_DECODE_CASES = [
    ("gqa4-contiguous-splits0", dict(sq=1, sn=1, causal=True)),
    ("window-sinktok-split3", dict(sq=1, sn=1, causal=True, window_size=(40, 0), sink_tokens=4, num_splits=3)),
    ("paged16-crossing-split2", dict(sq=4, sn=4, causal=True, page_size=16, lens=(14, 33, 0), num_splits=2)),
    ("paged5-odd-pages", dict(sq=2, sn=2, causal=True, page_size=5, capacity=80, lens=(3, 40, 71))),
    ("empty-and-length1-caches", dict(sq=1, sn=0, lens=(0, 1, 0), causal=True, num_splits=4)),
    ("gqa8-window-sinktok", dict(h=8, hk=1, causal=True, window_size=(50, 0), sink_tokens=3, capacity=200,
                                 lens=(150, 37, 0))),
    ("gqa8-3queries-paged16-split2", dict(h=8, hk=1, sq=3, sn=3, causal=True, page_size=16, capacity=200,
                                          lens=(150, 5, 0), num_splits=2)),
    ("paged128-whole-blocks-split2", dict(causal=True, page_size=128, capacity=640, lens=(600, 128, 257),
                                          num_splits=2)),
    ("chunked-prefill-mqa-rows", dict(sq=9, sn=9, h=8, hk=1, causal=True, window_size=(20, 0), sink_tokens=2)),
    ("no-gqa-sinks+30-softcap-split5", dict(sq=3, sn=1, h=2, hk=2, sinks="+30", softcap=10.0, num_splits=5)),
    ("sinks-neginf-paged64", dict(page_size=64, capacity=192, lens=(120, 64, 1), sinks="-inf")),
    ("no-sinks-odd-lengths", dict(sinks="none", lens=(1, 77, 129), capacity=130, causal=True)),
]
