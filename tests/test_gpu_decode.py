"""The decode path on the GPU (marked gpu): contiguous and paged caches with shuffled pages, empty and
length-1 caches, appends crossing pages, every num_splits from 1 to 64, windows and sink tokens."""
import pytest
import torch

from decode_cases import DECODE_CASES, run_decode

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
