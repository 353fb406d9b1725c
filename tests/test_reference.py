"""The reference backend against the float64 oracle over a sampled grid (docs/DESIGN.md section 6).

The grid is sampled, not a cartesian product: every value of every axis appears in at least one case,
usually next to the defaults, plus a handful of mixed cases. Tiles are shrunk (32 keys, 24 rows) so
short sequences still cross tiles, skip blocks and split query chunks.
"""
import math

import pytest
import torch

import sinkattn
from sinkattn import reference
from sinkattn.mask import Mask, key_ranges
from oracle import attention_oracle, tolerance_check, visible
from oracle import single_thread  # noqa: F401  (autouse: one torch thread per test)

BASE = dict(dtype=torch.float32, d=64, h=4, hk=4, b=2, sq=67, sk=93, causal=False, window=(-1, -1), n=0,
            sinks="random", softcap=0.0)


def case(**kw):
    c = dict(BASE, **kw)
    name = "-".join(f"{k}={v if not isinstance(v, torch.dtype) else str(v)[6:]}" for k, v in kw.items()) or "base"
    return pytest.param(c, id=name)


CASES = [
    case(),
    # dtypes (each also with a window, so low precision meets masking)
    case(dtype=torch.bfloat16), case(dtype=torch.float16),
    case(dtype=torch.bfloat16, causal=True, window=(20, 0), n=2),
    case(dtype=torch.float16, causal=True, sinks="+30"),
    # head dims
    case(d=32), case(d=80), case(d=128, causal=True), case(d=256, sq=40, sk=70),
    case(d=80, dtype=torch.bfloat16, causal=True),
    # GQA ratios 1, 4, 8
    case(h=8, hk=8), case(h=8, hk=2, causal=True), case(h=8, hk=1, window=(9, 0)),
    case(h=8, hk=1, dtype=torch.float16, sinks=None),
    # causal, windows
    case(causal=True), case(causal=True, sq=93),
    case(window=(127, 0), sq=300, sk=300), case(window=(127, 0), sq=40, sk=300, n=4),
    case(window=(5, 0)),              # narrower than a tile
    case(window=(3, 2)),              # right > 0, non-causal
    case(window=(-1, 4)), case(window=(10, -1)), case(window=(0, 0)),
    case(causal=True, window=(0, -1)),
    # sink tokens: 0 / 1 / 4 / more than seqlen; with and without a left bound
    case(causal=True, window=(8, 0), n=1), case(causal=True, window=(8, 0), n=4),
    case(causal=True, window=(8, 0), n=1000), case(n=4),
    case(window=(6, 3), n=4, sq=130, sk=130),
    # learnable sinks
    case(sinks=None), case(sinks="-inf"), case(sinks="+30"), case(sinks="mixed"),
    case(sinks="-inf", causal=True, sq=120, sk=30),
    # seqlen_q < seqlen_k and >, 0 and 1, odd
    case(sq=30, sk=200, causal=True), case(sq=150, sk=40, causal=True), case(sq=150, sk=40),
    case(sq=0), case(sk=0), case(sk=0, sinks=None), case(sq=1, sk=1), case(sq=1, sk=301, causal=True),
    case(sq=77, sk=1, causal=True), case(sq=1, sk=0),
    # softcap
    case(softcap=5.0), case(softcap=2.0, causal=True, window=(11, 0), dtype=torch.bfloat16),
    # mixed
    case(dtype=torch.bfloat16, d=128, h=8, hk=1, causal=True, window=(127, 0), n=4, sq=200, sk=260, sinks="+30"),
    case(dtype=torch.float16, d=32, h=8, hk=2, window=(4, 7), n=1000, sq=50, sk=45, softcap=3.0),
    case(d=256, h=8, hk=4, causal=True, window=(17, 0), n=3, sq=1, sk=160),
    case(dtype=torch.float16, b=3, sq=33, sk=1, sinks="mixed", window=(0, 0)),
]


def make_sinks(kind, h, gen=None):
    if kind is None:
        return None
    if kind == "random":
        return torch.randn(h) * 2
    if kind == "-inf":
        return torch.full((h,), float("-inf"))
    if kind == "+30":
        return torch.full((h,), 30.0)
    if kind == "mixed":  # -inf, +30 and ordinary values side by side
        s = torch.randn(h)
        s[0] = float("-inf")
        s[-1] = 30.0
        return s
    raise ValueError(kind)


@pytest.fixture
def small_tiles(monkeypatch):
    monkeypatch.setattr(reference, "KEY_TILE", 32)
    monkeypatch.setattr(reference, "ROW_CHUNK", 24)


def inputs(c):
    q = torch.randn(c["b"], c["sq"], c["h"], c["d"]).to(c["dtype"])
    k = torch.randn(c["b"], c["sk"], c["hk"], c["d"]).to(c["dtype"])
    v = torch.randn(c["b"], c["sk"], c["hk"], c["d"]).to(c["dtype"])
    return q, k, v, make_sinks(c["sinks"], c["h"])


def kwargs(c):
    return dict(causal=c["causal"], window_size=c["window"], sink_tokens=c["n"], softcap=c["softcap"])


def check_against_oracle(c, q, k, v, sinks, out, lse, seed):
    ref_out, ref_lse = attention_oracle(q, k, v, sinks, **kwargs(c))
    if c["dtype"] == torch.float32:
        base_out = base_lse = None
        atol_out, atol_lse = 1e-5, 1e-5 * max(1.0, ref_lse[torch.isfinite(ref_lse)].abs().max().item()
                                              if torch.isfinite(ref_lse).any() else 1.0)
    else:
        base_out, base_lse = attention_oracle(q, k, v, sinks, **kwargs(c), compute_dtype=c["dtype"])
        atol_out, atol_lse = 1e-3, 1e-3
    assert out.dtype == c["dtype"] and lse.dtype == torch.float32
    assert out.shape == q.shape and lse.shape == (c["b"], c["h"], c["sq"])
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), f"NaN (seed {seed})"
    tolerance_check("out", out, ref_out, base_out, atol_out, seed)
    tolerance_check("lse", lse, ref_lse, base_lse, atol_lse, seed)
    # Rows that see no key: out exactly 0, lse exactly the sink (or -inf).
    left, right = c["window"][0], 0 if c["causal"] else c["window"][1]
    empty = ~visible(c["sq"], c["sk"], left, right, c["n"]).any(-1)
    if empty.any():
        assert (out[:, empty] == 0).all()
        want = torch.full((c["h"],), float("-inf")) if sinks is None else sinks.float()
        assert (lse[:, :, empty] == want.view(1, -1, 1)).all(), f"empty rows' lse (seed {seed})"


@pytest.mark.parametrize("c", CASES)
def test_forward_vs_oracle(c, small_tiles, rng_seed):
    q, k, v, sinks = inputs(c)
    out, lse = sinkattn.flash_attn_with_sinks(q, k, v, sinks, **kwargs(c), return_lse=True, backend="reference")
    check_against_oracle(c, q, k, v, sinks, out, lse, rng_seed)


def test_default_tiles_long_window(rng_seed):
    """The shipped tile sizes (512 keys) with a window, sink tokens and more rows than one chunk."""
    c = dict(BASE, sq=700, sk=900, h=8, hk=2, causal=True, window=(127, 0), n=4)
    q, k, v, sinks = inputs(c)
    out, lse = sinkattn.flash_attn_with_sinks(q, k, v, sinks, **kwargs(c), return_lse=True)
    check_against_oracle(c, q, k, v, sinks, out, lse, rng_seed)


def test_s_aux_alias_and_default_scale(small_tiles, rng_seed):
    c = dict(BASE)
    q, k, v, sinks = inputs(c)
    a = sinkattn.flash_attn_with_sinks(q, k, v, sinks)
    b = sinkattn.flash_attn_with_sinks(q, k, v, s_aux=sinks, softmax_scale=1 / math.sqrt(c["d"]))
    assert torch.equal(a, b)
    c2 = sinkattn.flash_attn_with_sinks(q, k, v, sinks, softmax_scale=0.3)
    ref, _ = attention_oracle(q, k, v, sinks, softmax_scale=0.3)
    tolerance_check("out (scale 0.3)", c2, ref, None, 1e-5, rng_seed)


def test_sink_is_not_scaled(rng_seed):
    """A sink is a logit in scaled units: with scale s the denominator gets exp(sink), not exp(s*sink)."""
    q = torch.zeros(1, 1, 1, 8)
    k = torch.zeros(1, 1, 1, 8)  # one key with score 0: lse = log(1 + exp(sink))
    v = torch.ones(1, 1, 1, 8)
    sinks = torch.tensor([2.0])
    out, lse = sinkattn.flash_attn_with_sinks(q, k, v, sinks, softmax_scale=0.01, return_lse=True)
    assert lse.item() == pytest.approx(math.log(1 + math.exp(2.0)), abs=1e-6)
    assert out[0, 0, 0, 0].item() == pytest.approx(1 / (1 + math.exp(2.0)), abs=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_minus_inf_sink_is_bitwise_no_sink(dtype, small_tiles, rng_seed):
    c = dict(BASE, dtype=dtype, causal=True, window=(20, 0), n=2, h=8, hk=2)
    q, k, v, _ = inputs(c)
    sinks = torch.randn(8)
    sinks[::2] = float("-inf")
    plain_out, plain_lse = sinkattn.flash_attn_with_sinks(q, k, v, None, **kwargs(c), return_lse=True)
    out, lse = sinkattn.flash_attn_with_sinks(q, k, v, sinks, **kwargs(c), return_lse=True)
    assert torch.equal(out[:, :, ::2], plain_out[:, :, ::2]), f"seed {rng_seed}"
    assert torch.equal(lse[:, ::2], plain_lse[:, ::2]), f"seed {rng_seed}"
    assert not torch.equal(lse[:, 1::2], plain_lse[:, 1::2])
    all_inf = sinkattn.flash_attn_with_sinks(q, k, v, torch.full((8,), float("-inf")), **kwargs(c))
    assert torch.equal(all_inf, plain_out)


def test_non_contiguous_inputs(small_tiles, rng_seed):
    """Slices of a packed qkv tensor (strided heads and rows) give the same result as contiguous copies."""
    qkv = torch.randn(2, 50, 3, 4, 64)
    q, k, v = qkv.unbind(2)
    sinks = torch.randn(4)
    out = sinkattn.flash_attn_with_sinks(q, k, v, sinks, causal=True)
    ref = sinkattn.flash_attn_with_sinks(q.contiguous(), k.contiguous(), v.contiguous(), sinks, causal=True)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("trial", range(6))
def test_key_ranges_cover_the_mask_tightly(trial, rng_seed):
    """Every visible pair is inside the ranges a chunk visits, and each range ends on visible keys."""
    g = torch.Generator().manual_seed(rng_seed + trial)

    def pick(lo, hi):
        return int(torch.randint(lo, hi, (1,), generator=g))

    sq, sk = pick(1, 200), pick(0, 200)
    left, right = pick(-1, 40), pick(-1, 40)
    n = pick(0, 8)
    m = Mask(1.0, left, right, n, 0.0)
    vis = visible(sq, sk, left, right, n)
    rows = pick(1, 50)
    for i0 in range(0, sq, rows):
        i1 = min(sq, i0 + rows)
        ranges = key_ranges(i0, i1, sk, sk - sq, m)
        covered = torch.zeros(sk, dtype=torch.bool)
        for j0, j1 in ranges:
            assert 0 <= j0 < j1 <= sk
            covered[j0:j1] = True
            chunk = vis[i0:i1]
            assert chunk[:, j0].any() and chunk[:, j1 - 1].any(), (sq, sk, left, right, n, i0, i1, ranges)
        assert not (vis[i0:i1] & ~covered).any(), (sq, sk, left, right, n, i0, i1, ranges, rng_seed)


def test_narrow_window_skips_blocks():
    """With window (127, 0) on 32k keys a chunk visits ~rows+128 keys, not the prefix."""
    m = Mask(1.0, 127, 0, 4, 0.0)
    ranges = key_ranges(30000, 30256, 32768, 0, m)
    assert ranges == [(0, 4), (30000 - 127, 30256)]
    m_causal = Mask(1.0, -1, 0, 0, 0.0)
    assert key_ranges(100, 200, 32768, 32768 - 1000, m_causal) == [(0, 32768 - 1000 + 200)]
