"""Large and odd tensors.

Past 2^31 elements: the tensors are allocated with torch.empty, which on the CPU only reserves address space;
only the pages a call touches get memory. Each test puts the data it uses past element 2^31 (the last pages of a
paged cache, the second batch row of a K/V view with a huge batch stride, the tail of a packed varlen K/V),
so a 32-bit offset anywhere reads the wrong memory (or faults), and checks the resident memory stays small.
Marked `large` (about 10 GiB of address space at most, < 1 GiB resident; `-m 'not large'` deselects them).

Also: non-contiguous views in every argument the API takes (bit-for-bit equal to contiguous copies), a decode
at position one million with a StreamingLLM window, batch x heads beyond 65535 (reference; the kernels: gpu).
"""
from __future__ import annotations

import pytest
import torch

import sinkattn
from sinkattn import _ext
from oracle import attention_oracle, tolerance_check

EMU = any(k["family"] == "sm80-emulated" and k["headdim"] == 64 and k["dtype"] == "bf16" for k in _ext.registry())
BACKENDS = [pytest.param(("reference", "cpu"), id="reference"),
            pytest.param(("sm80-emulated", "cpu"), id="sm80-emulated",
                         marks=pytest.mark.skipif(not EMU, reason="no emulated kernels in this build")),
            pytest.param(("sm80", "cuda"), id="sm80", marks=pytest.mark.gpu)]
BIG = 2**31
GiB = 2**30


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _check(tag, got_out, got_lse, q, k, v, sinks, **kw):
    want = attention_oracle(q.cpu(), k.cpu(), v.cpu(), None if sinks is None else sinks.cpu(), **kw)
    base = attention_oracle(q.cpu(), k.cpu(), v.cpu(), None if sinks is None else sinks.cpu(),
                            compute_dtype=q.dtype, **kw)
    tolerance_check(f"{tag} out", got_out.cpu(), want[0], base[0], 1e-3)
    tolerance_check(f"{tag} lse", got_lse.cpu(), want[1], base[1].float(), 1e-4)


# ------------------------------------------------------------------------------------------------ past 2^31
@pytest.mark.large
@pytest.mark.parametrize("bk", BACKENDS)
def test_paged_decode_past_2_31_elements(bk):
    """A paged cache of 2^31 + 2^13 elements per K/V (4 GiB of bf16 each); the block table points at the
    last pages only. Decode appends into them (offsets past 2^31) and attends over them."""
    backend, device = bk
    page, hk, d = 16, 1, 64
    num_pages = BIG // (page * hk * d) + 8
    rss0 = _rss()
    kc = torch.empty(num_pages, page, hk, d, dtype=torch.bfloat16, device=device)
    vc = torch.empty_like(kc)
    assert kc.numel() > BIG
    g = torch.Generator().manual_seed(0)
    b, h, lens = 2, 4, [40, 70]
    bt = torch.tensor([[num_pages - 1, num_pages - 3, num_pages - 5, num_pages - 7, num_pages - 8],
                       [num_pages - 2, num_pages - 4, num_pages - 6, 0, 0]], dtype=torch.int32)
    used = sorted({int(x) for x in bt.flatten()})
    for p in used:  # only these pages are ever touched
        kc[p] = torch.randn(page, hk, d, generator=g).to(torch.bfloat16)
        vc[p] = torch.randn(page, hk, d, generator=g).to(torch.bfloat16)
    q = torch.randn(b, 1, h, d, generator=g).to(torch.bfloat16)
    kn, vn = (torch.randn(b, 1, hk, d, generator=g).to(torch.bfloat16) for _ in range(2))
    sinks = torch.randn(h, generator=g)
    dev = lambda t: t.to(device)  # noqa: E731
    out, lse = sinkattn.flash_attn_with_kvcache(dev(q), kc, vc, dev(sinks), k=dev(kn), v=dev(vn),
                                                cache_seqlens=dev(torch.tensor(lens, dtype=torch.int32)),
                                                block_table=dev(bt), causal=True, return_lse=True, num_splits=2,
                                                backend=backend)
    for bi, n in enumerate(lens):
        pos = torch.arange(n + 1)
        rows = bt[bi].long()[pos // page]
        rows, slots = rows.to(device), (pos % page).to(device)
        kk, vv = kc[rows, slots].cpu(), vc[rows, slots].cpu()
        assert torch.equal(kk[n], kn[bi, 0]) and torch.equal(vv[n], vn[bi, 0]), "append past 2^31"
        _check(f"seq {bi}", out[bi:bi + 1], lse[bi:bi + 1], q[bi:bi + 1], kk[None], vv[None], sinks, causal=True)
    if device == "cpu":
        assert _rss() - rss0 < GiB, "the call touched far more of the cache than its pages"


@pytest.mark.large
@pytest.mark.parametrize("bk", BACKENDS)
def test_forward_backward_with_a_batch_stride_past_2_31(bk):
    """k and v are (2, 100, 2, 64) views whose batch stride is 2^31 elements: batch row 1 starts past
    element 2^31 of a lazily allocated buffer. Forward and backward (dq, dk, dv, dsinks) against the oracle."""
    backend, device = bk
    sk, hk, d = 100, 2, 64
    rss0 = _rss()
    g = torch.Generator().manual_seed(1)
    views = []
    for _ in range(2):
        buf = torch.empty(BIG + sk * hk * d, dtype=torch.bfloat16, device=device)
        t = buf.as_strided((2, sk, hk, d), (BIG, hk * d, d, 1))
        t.copy_(torch.randn(2, sk, hk, d, generator=g).to(torch.bfloat16))
        views.append(t)
    k, v = views
    q = torch.randn(2, 70, 4, d, generator=g).to(torch.bfloat16).to(device)
    sinks = torch.randn(4, generator=g).to(device)
    leaves = [q.clone().requires_grad_(), k.requires_grad_(), v.requires_grad_(), sinks.clone().requires_grad_()]
    out, lse = sinkattn.flash_attn_with_sinks(*leaves, causal=True, window_size=(30, 0), sink_tokens=2,
                                              return_lse=True, backend=backend)
    kw = dict(causal=True, window_size=(30, 0), sink_tokens=2)
    _check("forward", out, lse, q, k.detach(), v.detach(), sinks, **kw)
    do = torch.randn(out.shape, generator=g).to(out.dtype).to(device)
    grads = torch.autograd.grad(out, leaves, do)
    ref_leaves = [t.detach().cpu().double().requires_grad_() for t in (q, k, v, sinks)]
    want = torch.autograd.grad(attention_oracle(*ref_leaves, **kw)[0], ref_leaves, do.cpu().double())
    low = [t.detach().cpu().to(torch.bfloat16).requires_grad_() for t in (q, k, v)]
    low_s = sinks.detach().cpu().double().requires_grad_()
    base = torch.autograd.grad(attention_oracle(*low, low_s, compute_dtype=torch.bfloat16, **kw)[0], low + [low_s],
                               do.cpu())
    for name, a, w, bl in zip(("dq", "dk", "dv", "dsinks"), grads, want, base):
        tolerance_check(name, a.cpu(), w, bl, 2e-2)
    if device == "cpu":
        assert _rss() - rss0 < GiB


@pytest.mark.large
@pytest.mark.parametrize("bk", BACKENDS)
def test_varlen_forward_past_2_31(bk):
    """Packed K/V of 2^25 + 200 tokens x 1 head x 64 (past 2^31 elements): the first sequence owns the first
    2^25 keys and has no query; the second sequence's 200 keys lie past element 2^31."""
    backend, device = bk
    d, first = 64, 2**25
    total_k = first + 200
    rss0 = _rss()
    k = torch.empty(total_k, 1, d, dtype=torch.bfloat16, device=device)
    v = torch.empty_like(k)
    assert k.numel() > BIG
    g = torch.Generator().manual_seed(2)
    k[first:] = torch.randn(200, 1, d, generator=g).to(torch.bfloat16)
    v[first:] = torch.randn(200, 1, d, generator=g).to(torch.bfloat16)
    q = torch.randn(50, 4, d, generator=g).to(torch.bfloat16).to(device)
    cu_q = torch.tensor([0, 0, 50], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, first, total_k], dtype=torch.int32, device=device)
    sinks = torch.randn(4, generator=g).to(device)
    out, lse = sinkattn.flash_attn_varlen_with_sinks(q, k, v, cu_q, cu_k, 50, first, sinks, causal=True,
                                                     window_size=(64, 0), return_lse=True, backend=backend)
    _check("varlen", out[None], lse[None], q[None], k[None, first:], v[None, first:], sinks, causal=True,
           window_size=(64, 0))
    if device == "cpu":
        assert _rss() - rss0 < GiB


# ------------------------------------------------------------------------------------------------ strides
def _same(a, b, what):
    assert torch.equal(a, b), f"{what}: a non-contiguous view gives a different result than its contiguous copy"


@pytest.mark.parametrize("bk", BACKENDS)
def test_noncontiguous_views_everywhere(bk):
    """Every tensor argument as a non-contiguous view (q/k/v permuted storage, a head slice of a wider cache,
    every other entry of sinks / cu_seqlens / cache_seqlens, every other column of the block table): the
    results are bit for bit those of contiguous copies, and appends land in the viewed cache."""
    backend, device = bk
    dt = torch.bfloat16
    g = torch.Generator().manual_seed(3)
    r = lambda *s: torch.randn(*s, generator=g).to(dt).to(device)  # noqa: E731
    every_other = lambda t: torch.stack([t, torch.zeros_like(t)], -1).flatten(-2)[..., ::2]  # noqa: E731
    # batched forward + backward
    q, k, v = r(2, 4, 33, 64).transpose(1, 2), r(2, 2, 45, 64).transpose(1, 2), r(2, 2, 45, 64).transpose(1, 2)
    sinks = every_other(torch.randn(4, generator=g).to(device))
    assert not any(t.is_contiguous() for t in (q, k, v, sinks))
    res = []
    for args in ((q, k, v, sinks), tuple(t.contiguous() for t in (q, k, v, sinks))):
        leaves = [t.detach().clone().requires_grad_() if t.is_contiguous() else t.detach().requires_grad_() for t in args]
        out, lse = sinkattn.flash_attn_with_sinks(*leaves, causal=True, window_size=(9, 0), return_lse=True,
                                                  backend=backend)
        res.append((out, lse, *torch.autograd.grad(out.float().square().sum(), leaves)))
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv", "dsinks"), *res):
        _same(a, b, name)
    # varlen
    qv, kv, vv = r(4, 30, 64).transpose(0, 1), r(2, 40, 64).transpose(0, 1), r(2, 40, 64).transpose(0, 1)
    cu_q = every_other(torch.tensor([0, 10, 30], dtype=torch.int32, device=device))
    cu_k = every_other(torch.tensor([0, 25, 40], dtype=torch.int32, device=device))
    a = sinkattn.flash_attn_varlen_with_sinks(qv, kv, vv, cu_q, cu_k, 20, 25, sinks, causal=True, return_lse=True,
                                              backend=backend)
    b = sinkattn.flash_attn_varlen_with_sinks(*(t.contiguous() for t in (qv, kv, vv, cu_q, cu_k)), 20, 25,
                                              sinks.contiguous(), causal=True, return_lse=True, backend=backend)
    _same(a[0], b[0], "varlen out")
    _same(a[1], b[1], "varlen lse")
    # paged KV cache: a head slice of a wider cache, every other block-table column, strided seqlens and new k/v
    wide_k, wide_v = r(12, 16, 4, 64), r(12, 16, 4, 64)
    kc, vc = wide_k[:, :, 1:3], wide_v[:, :, 1:3]
    bt = every_other(torch.randperm(12, generator=g)[:8].view(2, 4).to(torch.int32).to(device))
    lens = every_other(torch.tensor([20, 47], dtype=torch.int32, device=device))
    qd, kn, vn = r(2, 4, 2, 64).transpose(1, 2), r(2, 2, 2, 64).transpose(1, 2), r(2, 2, 2, 64).transpose(1, 2)
    kc2, vc2 = kc.contiguous(), vc.contiguous()
    a = sinkattn.flash_attn_with_kvcache(qd, kc, vc, sinks, k=kn, v=vn, cache_seqlens=lens, block_table=bt,
                                         causal=True, return_lse=True, backend=backend)
    b = sinkattn.flash_attn_with_kvcache(*(t.contiguous() for t in (qd,)), kc2, vc2, sinks.contiguous(),
                                         k=kn.contiguous(), v=vn.contiguous(), cache_seqlens=lens.contiguous(),
                                         block_table=bt.contiguous(), causal=True, return_lse=True, backend=backend)
    _same(a[0], b[0], "kvcache out")
    _same(a[1], b[1], "kvcache lse")
    _same(kc, kc2, "k appended through the view")
    _same(vc, vc2, "v appended through the view")
    assert torch.equal(wide_k[:, :, 0], wide_k[:, :, 0].clone())  # untouched heads stay (sanity of the view)


# ------------------------------------------------------------------------------------------------ long decode
@pytest.mark.parametrize("bk", BACKENDS)
def test_streaming_decode_at_one_million_tokens(bk):
    """A StreamingLLM step at position 2^20: 4 sink tokens + a 1024-token window over a 2^20-token cache. The keys
    between the sink tokens and the window hold 100.0 (finite: a kernel may load them in a key block and mask them,
    see docs/semantics.md "Non-finite values"); any of them wrongly seen would dominate the softmax."""
    backend, device = bk
    n, hk, h, d, sink, win = 2**20, 1, 8, 64, 4, 1023
    kc = torch.full((1, n + 1, hk, d), 100.0, dtype=torch.bfloat16, device=device)
    vc = torch.full_like(kc, 100.0)
    g = torch.Generator().manual_seed(4)
    lo = n + 1 - (win + 1)
    for sl in (slice(0, sink), slice(lo, n)):
        kc[0, sl] = torch.randn(kc[0, sl].shape, generator=g).to(torch.bfloat16)
        vc[0, sl] = torch.randn(vc[0, sl].shape, generator=g).to(torch.bfloat16)
    q = torch.randn(1, 1, h, d, generator=g).to(torch.bfloat16).to(device)
    kn, vn = (torch.randn(1, 1, hk, d, generator=g).to(torch.bfloat16).to(device) for _ in range(2))
    sinks = torch.randn(h, generator=g).to(device)
    out, lse = sinkattn.flash_attn_with_kvcache(q, kc, vc, sinks, k=kn, v=vn, cache_seqlens=n, causal=True,
                                                window_size=(win, 0), sink_tokens=sink, return_lse=True,
                                                backend=backend)
    keys = torch.cat([torch.arange(sink), torch.arange(lo, n + 1)])
    kk, vv = kc[0, keys.to(device)].cpu(), vc[0, keys.to(device)].cpu()
    # The visible keys, compacted: all of them visible to the one query (sink tokens + the window).
    _check("1M decode", out, lse, q, kk[None], vv[None], sinks)


# ------------------------------------------------------------------------------------------------ many CTAs
def test_batch_times_heads_beyond_65535_reference():
    """65,540 (batch x heads) rows of work; every one checked against the oracle."""
    g = torch.Generator().manual_seed(5)
    b, h, hk, d = 5, 13108, 2, 8  # 5 * 13108 = 65,540
    q = torch.randn(b, 2, h, d, generator=g)
    k, v = torch.randn(b, 3, hk, d, generator=g), torch.randn(b, 3, hk, d, generator=g)
    sinks = torch.randn(h, generator=g)
    out, lse = sinkattn.flash_attn_with_sinks(q, k, v, sinks, causal=True, return_lse=True, backend="reference")
    want = attention_oracle(q, k, v, sinks, causal=True)
    tolerance_check("out", out, want[0], None, 1e-5)
    tolerance_check("lse", lse, want[1], None, 1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["sm80", "sm90"])
def test_batch_times_heads_beyond_65535_gpu(backend):
    """The kernels' grids are 1-D (no 65535 limit on batch x heads): forward, decode (sm80) and backward (sm80)."""
    if backend == "sm90" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("cc 9.0")
    g = torch.Generator().manual_seed(6)
    b, h, hk, d = 1040, 64, 8, 64  # 66,560 (batch x heads), 8,320 (batch x KV heads)
    dev = "cuda"
    q = torch.randn(b, 3, h, d, generator=g).to(torch.bfloat16).to(dev)
    k, v = (torch.randn(b, 5, hk, d, generator=g).to(torch.bfloat16).to(dev) for _ in range(2))
    sinks = torch.randn(h, generator=g).to(dev)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    out, lse = sinkattn.flash_attn_with_sinks(*leaves, causal=True, return_lse=True, backend=backend)
    pick = [0, 517, b - 1]
    for i in pick:
        _check(f"fwd batch {i}", out[i:i + 1], lse[i:i + 1], q[i:i + 1], k[i:i + 1], v[i:i + 1], sinks, causal=True)
    if backend == "sm80":
        dq, dk, dv, _ = torch.autograd.grad(out.float().sum(), leaves)
        for i in pick:
            ref = [t[i:i + 1].detach().cpu().double().requires_grad_() for t in (q, k, v)]
            want = torch.autograd.grad(attention_oracle(*ref, sinks.cpu(), causal=True)[0].sum(), ref)
            for name, a, w in zip(("dq", "dk", "dv"), (dq, dk, dv), want):
                tolerance_check(f"{name} batch {i}", a[i:i + 1].cpu(), w, None, 3e-2)
        kc, vc = torch.zeros(b, 8, hk, d, dtype=torch.bfloat16, device=dev), torch.zeros(b, 8, hk, d,
                                                                                          dtype=torch.bfloat16, device=dev)
        kc[:, :5], vc[:, :5] = k, v
        out_d, lse_d = sinkattn.flash_attn_with_kvcache(q, kc, vc, sinks, cache_seqlens=5, causal=True,
                                                        return_lse=True, num_splits=1, backend=backend)
        for i in pick:
            _check(f"decode batch {i}", out_d[i:i + 1], lse_d[i:i + 1], q[i:i + 1], k[i:i + 1], v[i:i + 1], sinks,
                   causal=True)


# ------------------------------------------------------------------------------------------------ limits
@pytest.mark.gpu
def test_out_of_memory_is_a_clear_error_and_the_device_stays_usable():
    """With the device full, a call whose output (256 MiB) cannot be allocated raises torch.OutOfMemoryError from
    inside sinkattn (no crash, no sticky CUDA error), and the next call works."""
    q = torch.randn(1, 2**14, 128, 64, device="cuda", dtype=torch.bfloat16)  # 256 MiB; out is as large
    k = torch.randn(1, 64, 8, 64, device="cuda", dtype=torch.bfloat16)
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    hog = torch.empty(max(0, free - 64 * 2**20), dtype=torch.uint8, device="cuda")
    try:
        with pytest.raises(torch.OutOfMemoryError):
            sinkattn.flash_attn_with_sinks(q, k, k, causal=True, backend="sm80")
    finally:
        del hog
        torch.cuda.empty_cache()
    out = sinkattn.flash_attn_with_sinks(q[:, :5], k, k, backend="sm80")
    assert out.isfinite().all()
