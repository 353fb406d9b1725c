"""The sm80 decode tiles over FP8 KV caches (csrc/sm80/fp8_kv.h) run on the CPU under host emulation, against the
float64 oracle on the dequantized cache (codes * descale), so what is measured is the kernel's own error, apart
from the quantization's (docs/DESIGN.md sections 1 and 4).

Both formats, per-tensor and per-(batch, KV head) scales, contiguous and paged caches (pages that cut blocks, odd
page sizes, whole-block pages), split-KV 1 and > 1, GQA packing (1, 4, 8 heads per KV head, 3 queries x 8), windows,
sink tokens, learnable sinks (random, -inf, +30), softcap, odd lengths, cache_seqlens 0 and 1, a chunked prefill
over the cache, poisoned outputs, NaN codes in the cache (the kernel does what the reference does), and e4m3fn's NaN
0x7f / 0xff; every code of both formats decoded as torch decodes it.
"""
import math

import pytest
import torch

import sinkattn
from decode_cases import FP8_DECODE_CASES, FP8_FORMATS, run_fp8_decode
from oracle import attention_oracle, tolerance_check
from sinkattn import _ext, kernels
from sinkattn.mask import Mask

FP8 = sorted({(k["headdim"], k["dtype"]) for k in _ext.registry()
              if k["family"] == "sm80-emulated" and k["op"] == "fwd_fp8"})
pytestmark = pytest.mark.skipif(not any(h == 64 and d == "bf16" for h, d in FP8),
                                reason="no emulated hdim64 bf16 FP8-cache kernel in this build")
FORMAT_CODE = {"e4m3fn": 1, "e5m2": 2}


@pytest.mark.parametrize("fmt", list(FP8_FORMATS))
def test_every_code_decodes_as_torch_does(fmt):
    """common/fp8.h, the decode the kernels run, on all 256 codes: the same floats as torch's own conversion
    (signed zeros, subnormals, the largest values, +-inf of e5m2), NaN exactly where torch has NaN (e4m3fn: 0x7f and
    0xff only)."""
    codes = torch.arange(256, dtype=torch.uint8)
    got = _ext._C.fp8_decode(codes, FORMAT_CODE[fmt])
    want = codes.view(FP8_FORMATS[fmt]).float()
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    if fmt == "e4m3fn":
        assert torch.isnan(got).nonzero().flatten().tolist() == [0x7f, 0xff]
    finite = ~torch.isnan(want)
    assert torch.equal(got[finite].view(torch.int32), want[finite].view(torch.int32))


@pytest.mark.parametrize("fmt", list(FP8_FORMATS))
@pytest.mark.parametrize("scales", ["per_head", "tensor"])
@pytest.mark.parametrize("name,kw", FP8_DECODE_CASES, ids=[c[0] for c in FP8_DECODE_CASES])
def test_emulated_fp8_decode_matches_oracle(name, kw, fmt, scales, rng_seed):
    run_fp8_decode("sm80-emulated", "cpu", rng_seed, fmt=fmt, scales=scales, **kw)


@pytest.mark.parametrize("fmt", list(FP8_FORMATS))
def test_emulated_fp8_no_scales(fmt, rng_seed):
    run_fp8_decode("sm80-emulated", "cpu", rng_seed, fmt=fmt, scales="none", causal=True, num_splits=2)


@pytest.mark.skipif(not any(h == 64 and d == "fp16" for h, d in FP8), reason="no emulated hdim64 fp16 FP8 kernel")
@pytest.mark.parametrize("fmt", list(FP8_FORMATS))
def test_emulated_fp8_fp16_queries(fmt, rng_seed):
    """fp16 q / out: e5m2 converts by a byte shift (the top byte of an fp16), e4m3fn through a float."""
    run_fp8_decode("sm80-emulated", "cpu", rng_seed, fmt=fmt, dtype=torch.float16, h=8, hk=1, causal=True,
                   window_size=(60, 0), sink_tokens=2, page_size=16, num_splits=2)


@pytest.mark.skipif(not any(h == 128 and d == "bf16" for h, d in FP8), reason="no emulated hdim128 bf16 FP8 kernel")
@pytest.mark.parametrize("fmt", list(FP8_FORMATS))
@pytest.mark.parametrize("kw", [dict(h=16, hk=2, capacity=300, lens=(250, 7, 0), page_size=16, num_splits=3),
                                dict(h=8, hk=2, sq=9, sn=9, capacity=200, lens=(150, 64, 1))], ids=["gqa8", "rows"])
def test_emulated_fp8_hdim128(fmt, kw, rng_seed):
    run_fp8_decode("sm80-emulated", "cpu", rng_seed, fmt=fmt, d=128, causal=True, **kw)


def test_emulated_fp8_small_tiles(rng_seed):
    """Under a 74 KB shared-memory limit the 2-stage FP8 tiles run (fwd_tiles.h choose_fwd_fp8_tile: Hd64Keys2Small
    68 KB, Hd64FewSmall 72 KB; their 3-stage siblings take 84 and 88 KB)."""
    with sinkattn.sm80_smem_limit(74 * 1024):
        run_fp8_decode("sm80-emulated", "cpu", rng_seed, h=8, hk=1, sq=3, sn=3, causal=True, page_size=16,
                       capacity=200, lens=(150, 5, 0), num_splits=2)
        run_fp8_decode("sm80-emulated", "cpu", rng_seed, h=8, hk=1, sq=9, sn=9, causal=True, capacity=200,
                       lens=(150, 64, 1))


def test_emulated_fp8_head_dim_served_by_the_next(rng_seed):
    """Head dim 48 runs on the hdim64 tiles: columns past it are zero-filled, never read from the cache."""
    run_fp8_decode("sm80-emulated", "cpu", rng_seed, d=48, causal=True, window_size=(30, 0), page_size=16)


def _bridge_call(fmt, *, lens=(5, 90), d=64, h=8, hk=2, capacity=128, sinks=True):
    """The kernel bridge itself (no append), with NaN-poisoned out and lse and NaN guards after out."""
    g = torch.Generator().manual_seed(7)
    b, dt = len(lens), FP8_FORMATS[fmt]
    kc = torch.randn(b, capacity, hk, d, generator=g).to(dt)
    vc = torch.randn(b, capacity, hk, d, generator=g).to(dt)
    q = torch.randn(b, 1, h, d, generator=g).to(torch.bfloat16)
    kd, vd = torch.rand(b, hk, generator=g) + 0.1, torch.rand(b, hk, generator=g) + 0.1
    s = torch.randn(h, generator=g) if sinks else None
    storage = torch.full((q.numel() + 256,), float("nan"), dtype=q.dtype)
    out, guard = storage[: q.numel()].view(q.shape), storage[q.numel():]
    lse = torch.full((b, h, 1), float("nan"))
    kernels.launch_kvcache("sm80-emulated", q, kc, vc, s, out, lse, cache_seqlens=torch.tensor(lens, dtype=torch.int32),
                           block_table=None, mask=Mask(1 / math.sqrt(d), -1, 0, 0, 0.0), num_splits=2, k_descale=kd,
                           v_descale=vd)
    return q, kc, vc, kd, vd, s, out, guard, lse


@pytest.mark.parametrize("fmt", list(FP8_FORMATS))
def test_emulated_fp8_poisoned_outputs(fmt):
    """Every output element is written (out and lse start as NaN), nothing past out is."""
    q, kc, vc, kd, vd, s, out, guard, lse = _bridge_call(fmt)
    assert torch.isnan(guard).all(), "the kernel wrote past the end of out"
    for bi, n in enumerate((5, 90)):
        k = kc[bi:bi + 1, :n].double() * kd[bi].double()[None, None, :, None]
        v = vc[bi:bi + 1, :n].double() * vd[bi].double()[None, None, :, None]
        want, want_lse = attention_oracle(q[bi:bi + 1], k, v, s, causal=True)
        base, _ = attention_oracle(q[bi:bi + 1], k.bfloat16(), v.bfloat16(), s, causal=True,
                                   compute_dtype=torch.bfloat16)
        tolerance_check(f"{fmt} b{bi} out", out[bi:bi + 1], want, base, 1e-3)
        torch.testing.assert_close(lse[bi:bi + 1].double(), want_lse, rtol=0, atol=1e-4)


def _nan_case(fmt, backend, plant, **kw):
    torch.manual_seed(11)  # the same cache and queries for both backends
    return run_fp8_decode(backend, "cpu", 11, fmt=fmt, plant=plant, **kw)


NAN = {"e4m3fn": (0x7f, 0xff), "e5m2": (0x7f, 0xfe)}
CASE = dict(h=8, hk=2, lens=(30, 200, 70), capacity=256, causal=True, window_size=(40, 0), sink_tokens=2, num_splits=2)


@pytest.mark.parametrize("fmt", list(FP8_FORMATS))
@pytest.mark.parametrize("where", ["k-visible", "v-visible", "k-window-hidden", "past-seqlen"])
@pytest.mark.parametrize("variant", [dict(), dict(sinks="none", num_splits=3), dict(num_splits=1)],
                         ids=["sinks-split2", "nosinks-split3", "split1"])
def test_emulated_fp8_nan_in_the_cache_as_the_reference(fmt, where, variant):
    """NaN codes in the cache (e4m3fn 0x7f and 0xff, e5m2's): in a visible K or V row they turn the rows that see it
    into NaN on both backends (out and lse, split or not, with or without a sink); in a K row hidden by the window (inside a visited key block) or past a sequence's
    length they change nothing, on both. (A hidden non-finite V inside a visited block is the documented exception
    of section 1, not tested here.)"""
    a, b = NAN[fmt]
    plant = {"k-visible": {("k", 1, 190, 0, 3): a, ("k", 2, 1, 1, 60): b},  # seq 2 key 1: a sink token
             "v-visible": {("v", 1, 195, 1, 0): a, ("v", 0, 12, 0, 63): b},
             "k-window-hidden": {("k", 1, 100, 0, 5): a, ("k", 2, 20, 1, 7): b},
             "past-seqlen": {("k", 0, 40, 0, 0): a, ("v", 0, 41, 1, 2): b, ("k", 1, 230, 0, 9): a}}[where]
    case = {**CASE, **variant}
    got, got_lse = _nan_case(fmt, "sm80-emulated", plant, **case)
    want, want_lse = _nan_case(fmt, "reference", plant, **case)
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    assert torch.equal(torch.isnan(got_lse), torch.isnan(want_lse))
    if where in ("k-visible", "v-visible"):
        assert torch.isnan(got).any()
    else:
        assert not torch.isnan(got).any() and not torch.isnan(got_lse).any()
    finite = ~torch.isnan(want)
    torch.testing.assert_close(got[finite].float(), want[finite].float(), rtol=0, atol=3e-2)


def test_fp8_kernels_refuse_what_they_do_not_serve():
    """Head dims with no FP8 tile, and head dims that are not multiples of 16, stay on the reference: the forced
    kernel backend refuses and says why."""
    from sinkattn import SinkattnRuntimeError
    for d, words in ((256, "head dims 64, 128 only"), (40, "multiple of 16")):
        q = torch.randn(1, 1, 2, d, dtype=torch.bfloat16)
        kc = torch.zeros(1, 32, 1, d, dtype=torch.float8_e4m3fn)
        with pytest.raises(SinkattnRuntimeError) as e:
            sinkattn.flash_attn_with_kvcache(q, kc, kc.clone(), cache_seqlens=3, backend="sm80-emulated")
        assert words in str(e.value), str(e.value)
