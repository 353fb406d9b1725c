"""FP8 KV caches through flash_attn_with_kvcache (docs/DESIGN.md section 1, sinkattn/fp8.py).

The oracle runs on the dequantized cache (fp8 * scale in float64), so what is measured is the attention's own
error, apart from the quantization's. Both formats, both scale forms (per tensor as a float and as a 1-element
tensor, per (batch, KV head)), contiguous and paged caches with pages that cut the keys, appends with and without
rotary, windows, sink tokens, learnable sinks, GQA, decode and chunked prefill, fp32 and bf16 queries. The append
quantizes saturating (beyond the range, +-inf) and keeps NaN. These run on the reference backend; the sm80 kernels
that read FP8 caches are tested in tests/test_emulated_fp8.py (and tests/test_gpu_decode.py).
"""
import pytest
import torch

import sinkattn
from sinkattn import SinkattnRuntimeError, SinkattnTypeError, SinkattnValueError, fp8
from sinkattn.rotary import apply_rotary
from oracle import attention_oracle, rotary_oracle
from oracle import single_thread  # noqa: F401  (autouse: one torch thread per test)

FORMATS = [torch.float8_e4m3fn, torch.float8_e5m2]


def _scales(form, b, hk, g):
    """(kwargs for the call, k descale (b, hk), v descale (b, hk)) of a scale form."""
    if form == "none":
        one = torch.ones(b, hk)
        return {}, one, one
    if form == "float":
        return dict(k_scale=0.05, v_scale=0.02), torch.full((b, hk), 0.05), torch.full((b, hk), 0.02)
    if form == "tensor":
        return (dict(k_scale=torch.tensor([0.04]), v_scale=torch.tensor(0.03)), torch.full((b, hk), 0.04),
                torch.full((b, hk), 0.03))
    kd, vd = torch.rand(b, hk, generator=g) * 0.05 + 0.01, torch.rand(b, hk, generator=g) * 0.05 + 0.01
    return dict(k_descale=kd, v_descale=vd), kd, vd


def _quantize(x, descale, dtype):
    bound = torch.finfo(dtype).max
    return (x / descale[:, None, :, None]).clamp(-bound, bound).to(dtype)


def _to_pages(cache, page_size, g):
    """A contiguous (b, cap, hk, d) cache as shuffled pages + block_table."""
    b, cap = cache.shape[:2]
    per = cap // page_size
    perm = torch.randperm(b * per, generator=g)
    pages = torch.empty((b * per, page_size, *cache.shape[2:]), dtype=cache.dtype)
    pages[perm] = cache.reshape(b * per, page_size, *cache.shape[2:])
    return pages, perm.view(b, per).to(torch.int32)


CASES = [
    # (sq, seqlen_new, lens, h, hk, mask, page_size, rotary)
    (1, 1, (10, 33), 4, 2, dict(causal=True), None, False),
    (1, 1, (0, 47), 8, 2, dict(causal=True, window_size=(5, 0), sink_tokens=2), 16, False),
    (5, 5, (7, 20), 4, 4, dict(causal=True), 8, True),
    (3, 0, (9, 40), 6, 3, dict(window_size=(4, 1), sink_tokens=3), None, False),
    (1, 1, (63, 1), 4, 1, dict(causal=True, window_size=(127, 0)), 16, True),
]


@pytest.mark.parametrize("fmt", FORMATS, ids=["e4m3fn", "e5m2"])
@pytest.mark.parametrize("form", ["none", "float", "tensor", "per_head"])
@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("qdtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fp8_cache_equals_oracle_on_the_dequantized_cache(fmt, form, case, qdtype):
    sq, sn, lens, h, hk, mask, page_size, rotary = CASES[case]
    g = torch.Generator().manual_seed(case * 131 + FORMATS.index(fmt) * 7 + len(form))
    b, d, cap = len(lens), 32, 64
    kw, kd, vd = _scales(form, b, hk, g)
    kf, vf = torch.randn(b, cap, hk, d, generator=g) * 2, torch.randn(b, cap, hk, d, generator=g) * 2
    # the cache holds x / scale; keep it within the format for the "none" form too
    kc, vc = _quantize(kf * kd[:, None, :, None].sqrt(), kd, fmt), _quantize(vf * vd[:, None, :, None].sqrt(), vd, fmt)
    q = torch.randn(b, sq, h, d, generator=g).to(qdtype)
    knew = vnew = None
    if sn:
        knew, vnew = (torch.randn(b, sn, hk, d, generator=g).to(qdtype) for _ in range(2))
    sinks = torch.randn(h, generator=g) * 2
    cache_seqlens = torch.tensor(lens, dtype=torch.int32)
    rot = {}
    if rotary:
        pos = torch.arange(cap + sn, dtype=torch.float32)[:, None]
        inv = 1.0 / (10000 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
        rot = dict(rotary_cos=torch.cos(pos * inv), rotary_sin=torch.sin(pos * inv), rotary_interleaved=False)
    want_kc, want_vc = kc.clone(), vc.clone()  # the cache the call should leave: the old one + quantized new tokens
    if sn:
        kn = knew.float()
        if rotary:  # the library's rotary (tested against rotary_oracle in test_kvcache.py), then q's dtype: what is
            # quantized is exactly what a bf16/fp16 cache would have stored
            positions = cache_seqlens.long()[:, None] + torch.arange(sn)
            kn = apply_rotary(knew, rot["rotary_cos"], rot["rotary_sin"], positions, False).float()
        for bi, n in enumerate(lens):
            want_kc[bi, n:n + sn] = _quantize(kn[bi:bi + 1], kd[bi:bi + 1], fmt)[0]
            want_vc[bi, n:n + sn] = _quantize(vnew[bi:bi + 1].float(), vd[bi:bi + 1], fmt)[0]
    if page_size:
        kpages, bt = _to_pages(kc, page_size, g)
        vpages = torch.empty_like(kpages)
        vpages[bt.flatten().long()] = vc.reshape(-1, page_size, hk, d)
        k_arg, v_arg, extra = kpages, vpages, dict(block_table=bt)
    else:
        k_arg, v_arg, extra = kc, vc, {}
    with torch.no_grad():
        out, lse = sinkattn.flash_attn_with_kvcache(q, k_arg, v_arg, sinks, k=knew, v=vnew, cache_seqlens=cache_seqlens,
                                                    return_lse=True, **mask, **rot, **kw, **extra)
    if page_size:  # the pages back in sequence order
        k_arg, v_arg = k_arg[bt.flatten().long()].reshape(b, cap, hk, d), v_arg[bt.flatten().long()].reshape(b, cap, hk, d)
    assert torch.equal(k_arg.view(torch.uint8), want_kc.view(torch.uint8))
    assert torch.equal(v_arg.view(torch.uint8), want_vc.view(torch.uint8))
    qr = q.double()
    if rotary:
        positions = cache_seqlens.long()[:, None] + torch.arange(sq)
        qr = rotary_oracle(qr, rot["rotary_cos"].double(), rot["rotary_sin"].double(), positions, False)
    atol = 2e-5 if qdtype == torch.float32 else 3e-2
    for bi, n in enumerate(lens):
        n += sn
        kdq = want_kc[bi:bi + 1, :n].double() * kd[bi].double()[None, None, :, None]
        vdq = want_vc[bi:bi + 1, :n].double() * vd[bi].double()[None, None, :, None]
        want, want_lse = attention_oracle(qr[bi:bi + 1], kdq, vdq, sinks.double(), **mask)
        torch.testing.assert_close(out[bi:bi + 1].double(), want, rtol=0, atol=atol)
        torch.testing.assert_close(lse[bi:bi + 1].double(), want_lse, rtol=0, atol=2e-5 if qdtype == torch.float32
                                   else 2e-2)


@pytest.mark.parametrize("fmt", FORMATS, ids=["e4m3fn", "e5m2"])
def test_append_saturates_and_keeps_nan(fmt):
    """Beyond the format's range (and +-inf) the append stores the largest finite value with its sign, as vLLM's
    cache writer does; NaN stays NaN."""
    big = fp8.largest(fmt)
    kc, vc = torch.zeros(1, 4, 1, 8, dtype=fmt), torch.zeros(1, 4, 1, 8, dtype=fmt)
    knew = torch.tensor([3 * big, -3 * big, float("inf"), float("-inf"), float("nan"), 1.0, -0.5, 0.0])
    knew = knew.view(1, 1, 1, 8) * 0.5  # with k_scale 0.5 the stored values are knew / 0.5
    with torch.no_grad():
        sinkattn.flash_attn_with_kvcache(torch.zeros(1, 1, 1, 8), kc, vc, k=knew, v=torch.zeros(1, 1, 1, 8),
                                         cache_seqlens=0, k_scale=0.5, v_scale=1.0, causal=True)
    got = kc[0, 0, 0].float()
    assert got[:4].tolist() == [big, -big, big, -big]
    assert torch.isnan(got[4]) and got[5:].tolist() == [1.0, -0.5, 0.0]
    assert kc[0, 1:].float().abs().sum() == 0  # nothing else written


def _call(**kw):
    q = kw.pop("q", torch.randn(1, 1, 2, 8))
    kc = kw.pop("kc", torch.zeros(1, 4, 1, 8, dtype=torch.float8_e4m3fn))
    vc = kw.pop("vc", torch.zeros(1, 4, 1, 8, dtype=torch.float8_e4m3fn))
    with torch.no_grad():
        return sinkattn.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=2, **kw)


@pytest.mark.parametrize("kw,err,words", [
    (dict(kc=torch.zeros(1, 4, 1, 8), vc=torch.zeros(1, 4, 1, 8), k_scale=0.5), SinkattnValueError,
     "scales apply to FP8 caches only"),
    (dict(k_scale=0.5, k_descale=torch.ones(1, 1)), SinkattnValueError, "not both"),
    (dict(k_descale=torch.ones(2, 1)), SinkattnValueError, "(batch, nheads_k) = (1, 1)"),
    (dict(k_scale=0.0), SinkattnValueError, "a finite scale > 0"),
    (dict(v_scale=float("nan")), SinkattnValueError, "a finite scale > 0"),
    (dict(k_scale=torch.ones(2)), SinkattnValueError, "1-element"),
    (dict(k_scale="0.5"), SinkattnTypeError, "must be a float"),
    (dict(vc=torch.zeros(1, 4, 1, 8, dtype=torch.float8_e5m2)), SinkattnTypeError, "they must match"),
    (dict(q=torch.randn(1, 1, 2, 8, dtype=torch.float64)), SinkattnTypeError, "over an FP8 cache"),
])
def test_fp8_argument_errors(kw, err, words):
    with pytest.raises(err, match=None) as e:
        _call(**kw)
    assert words in str(e.value), str(e.value)


@pytest.mark.needs_ext
def test_forced_kernel_backend_refuses_an_fp8_cache_it_has_no_tile_for():
    """The FP8-cache kernels (csrc/sm80/fp8_kv.h; tests/test_emulated_fp8.py runs them) exist for head dims 64 and 128:
    a forced kernel backend refuses head dim 256 over an FP8 cache and says why (auto runs the reference there)."""
    with pytest.raises(SinkattnRuntimeError) as e:
        _call(q=torch.randn(1, 1, 2, 256, dtype=torch.bfloat16), kc=torch.zeros(1, 4, 1, 256, dtype=torch.float8_e4m3fn),
              vc=torch.zeros(1, 4, 1, 256, dtype=torch.float8_e4m3fn), backend="sm80-emulated")
    assert "FP8-cache decode kernels exist for head dims 64, 128 only" in str(e.value), str(e.value)


def test_a_scale_that_requires_grad_is_refused():
    """The op has no backward: a scale tensor that needs grad is refused like every other input (not an output whose
    .backward() fails inside torch)."""
    q = torch.randn(1, 1, 2, 8)
    kc, vc = torch.zeros(1, 4, 1, 8, dtype=torch.float8_e4m3fn), torch.zeros(1, 4, 1, 8, dtype=torch.float8_e4m3fn)
    with pytest.raises(SinkattnRuntimeError, match="no backward"):
        sinkattn.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=2, k_scale=torch.tensor([0.5], requires_grad=True))
