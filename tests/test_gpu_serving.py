"""The serving call on the GPU (marked gpu): mixed batches of packed queries over paged caches in one launch
(tests/serving_cases.py), the same cases as the emulation runs, plus gpt-oss's shape at long contexts; FP8 caches
in both formats. bench/gpu/check.sh runs this file first, in its own time box: the packed-tile launch has never
run on a GPU."""
import pytest
import torch

from serving_cases import FP8_SERVING_CASES, SERVING_CASES, run_serving

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name,reqs,kw", SERVING_CASES, ids=[c[0] for c in SERVING_CASES])
def test_sm80_serving_matches_oracle(name, reqs, kw, rng_seed):
    run_serving("sm80", "cuda", rng_seed, reqs, **kw)


@pytest.mark.parametrize("fmt", ["e4m3fn", "e5m2"])
@pytest.mark.parametrize("scales", ["per_head", "tensor"])
@pytest.mark.parametrize("name,reqs,kw", FP8_SERVING_CASES, ids=[c[0] for c in FP8_SERVING_CASES])
def test_sm80_serving_fp8(name, reqs, kw, fmt, scales, rng_seed):
    run_serving("sm80", "cuda", rng_seed, reqs, fp8=fmt, scales=scales, **kw)


@pytest.mark.parametrize("window", [(127, 0), (-1, -1)], ids=["win128", "full"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_sm80_serving_gpt_oss_mixed_step(window, dtype, rng_seed):
    """vLLM's mixed step at gpt-oss's shape: decodes at 8k beside a prefill chunk over a cached prefix."""
    reqs = [(1, 8192)] * 6 + [(4, 3000), (1, 17), (0, 0), (512, 2048), (300, 300)]
    run_serving("sm80", "cuda", rng_seed, reqs, h=64, hk=8, d=64, dtype=dtype, causal=True, window_size=window)
