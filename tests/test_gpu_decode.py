"""The decode path on the GPU (marked gpu): contiguous and paged caches with shuffled pages, empty and
length-1 caches, appends crossing pages, every num_splits from 1 to 64, windows and sink tokens; and the same over
FP8 caches (csrc/sm80/fp8_kv.h: both formats, both scale forms, hd64 and hd128, bf16 and fp16) against the oracle on
the dequantized cache."""
import pytest
import torch

from decode_cases import DECODE_CASES, FP8_DECODE_CASES, FP8_FORMATS, run_decode, run_fp8_decode

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name,kw", DECODE_CASES, ids=[c[0] for c in DECODE_CASES])
def test_sm80_decode_matches_oracle(name, kw, rng_seed):
    run_decode("sm80", "cuda", rng_seed, **kw)


@pytest.mark.parametrize("num_splits", list(range(1, 65)))
def test_every_num_splits(num_splits, rng_seed):
    run_decode("sm80", "cuda", rng_seed, b=2, h=64, hk=8, d=64, capacity=1100, lens=(1000, 777), sq=1, sn=1,
               page_size=16, causal=True, window_size=(127, 0), sink_tokens=4, num_splits=num_splits)


def test_gptoss_long_cache_auto_splits(rng_seed):
    run_decode("sm80", "cuda", rng_seed, b=2, h=64, hk=8, d=64, capacity=8192, lens=(8000, 123), sq=1, sn=1,
               causal=True, num_splits=0)


@pytest.mark.parametrize("fmt", list(FP8_FORMATS))
@pytest.mark.parametrize("scales", ["per_head", "tensor"])
@pytest.mark.parametrize("name,kw", FP8_DECODE_CASES, ids=[c[0] for c in FP8_DECODE_CASES])
def test_sm80_fp8_decode_matches_oracle(name, kw, fmt, scales, rng_seed):
    run_fp8_decode("sm80", "cuda", rng_seed, fmt=fmt, scales=scales, **kw)


@pytest.mark.parametrize("fmt", list(FP8_FORMATS))
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_sm80_fp8_gptoss_long_cache(fmt, d, dtype, rng_seed):
    """gpt-oss's decode shape (64 query heads over 8 KV heads, one query, a 127-key window with 4 sink tokens and a
    full-attention layer), both formats, both head dims and query dtypes, auto splits, over a long paged cache."""
    for mask in (dict(window_size=(127, 0), sink_tokens=4), {}):
        run_fp8_decode("sm80", "cuda", rng_seed, fmt=fmt, b=2, h=64, hk=8, d=d, capacity=4096, lens=(4000, 123),
                       page_size=16, dtype=dtype, causal=True, num_splits=0, **mask)


@pytest.mark.parametrize("num_splits", [1, 2, 7, 64])
def test_sm80_fp8_num_splits(num_splits, rng_seed):
    run_fp8_decode("sm80", "cuda", rng_seed, b=2, h=64, hk=8, d=64, capacity=1100, lens=(1000, 777), page_size=16,
                   causal=True, window_size=(127, 0), sink_tokens=4, num_splits=num_splits)
