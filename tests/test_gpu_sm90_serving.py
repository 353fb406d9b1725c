"""The sm90 forward over KV caches on the GPU (marked gpu; cc 9.0): the serving call's mixed batches over paged caches
and the padded decode / chunked-prefill calls, the same cases the emulation runs (tests/test_sm90_serving.py), plus
gpt-oss's shape at long contexts. Written and emulation-tested without a GPU: bench/gpu/check.sh runs this file
first, on the diagnostic build; set sinkattn.dispatch.SM90_CACHE_VALIDATED once it passes and the serving bench has
measured it beside the sm80 kernels (then "auto" runs cache calls on it on cc 9.0)."""
import pytest
import torch

from decode_cases import DECODE_CASES, FP8_DECODE_CASES, FP8_FORMATS, run_decode, run_fp8_decode
from serving_cases import FP8_SERVING_CASES, SM90_SERVING_CASES, run_serving

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                                 reason="the sm90 kernels run on cc 9.0")]


@pytest.mark.parametrize("name,reqs,kw", SM90_SERVING_CASES, ids=[c[0] for c in SM90_SERVING_CASES])
def test_sm90_serving_matches_oracle(name, reqs, kw, rng_seed):
    run_serving("sm90", "cuda", rng_seed, reqs, **kw)


@pytest.mark.parametrize("name,kw", DECODE_CASES, ids=[c[0] for c in DECODE_CASES])
def test_sm90_kvcache_matches_oracle(name, kw, rng_seed):
    run_decode("sm90", "cuda", rng_seed, **kw)


# FP8 caches: the GPU decode (cvt.rn.f16x2.e4m3x2 / e5m2x2, then fp32 to bf16) has only the emulation's decode
# (common/fp8.h) behind it so far: the byte order of its pairs is what these check first.
@pytest.mark.parametrize("fmt", list(FP8_FORMATS))
@pytest.mark.parametrize("name,reqs,kw", FP8_SERVING_CASES, ids=[c[0] for c in FP8_SERVING_CASES])
def test_sm90_fp8_serving_matches_oracle(name, reqs, kw, fmt, rng_seed):
    run_serving("sm90", "cuda", rng_seed, reqs, fp8=fmt, **kw)


@pytest.mark.parametrize("fmt", list(FP8_FORMATS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name,kw", FP8_DECODE_CASES, ids=[c[0] for c in FP8_DECODE_CASES])
def test_sm90_fp8_decode_matches_oracle(name, kw, fmt, dtype, rng_seed):
    run_fp8_decode("sm90", "cuda", rng_seed, fmt=fmt, dtype=dtype, **kw)


@pytest.mark.parametrize("window", [(127, 0), (-1, -1)], ids=["win128", "full"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_sm90_serving_gpt_oss_mixed_step(window, dtype, rng_seed):
    """vLLM's mixed step at gpt-oss's shape: decodes at 8k beside prefill chunks over cached prefixes, page 16."""
    reqs = [(1, 8192)] * 6 + [(4, 3000), (1, 17), (0, 0), (512, 2048), (300, 300)]
    run_serving("sm90", "cuda", rng_seed, reqs, h=64, hk=8, d=64, dtype=dtype, causal=True, window_size=window)


@pytest.mark.parametrize("num_splits", [0, 1, 7])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_sm90_split_kv_long_decode(d, num_splits, rng_seed):
    """Split-KV on the GPU: a few long decodes (one tile per KV head, so "auto" splits them across the SMs), GQA-packed,
    a window and sink tokens; the combine (common/combine_launch.cuh) adds the sink once."""
    reqs = [(1, 16000), (1, 3), (2, 9000)]
    run_serving("sm90", "cuda", rng_seed, reqs, h=8, hk=2, d=d, causal=True, window_size=(8000, 0), sink_tokens=4,
                num_splits=num_splits, page_size=7)


@pytest.mark.parametrize("fmt", list(FP8_FORMATS))
@pytest.mark.parametrize("d", [128, 256])
def test_sm90_fp8_other_head_dims(d, fmt, rng_seed):
    """FP8 caches at head dims 128 and 256 (hd256: one gathering thread per row of a 48-row block, 16 code vectors
    decoded over four 64-column atoms), paged 16 and gathered at page 5."""
    for page in (16, 5):
        run_serving("sm90", "cuda", rng_seed, [(1, 3000), (70, 500), (0, 0), (3, 40)], h=8, hk=2, d=d, fp8=fmt,
                    causal=True, window_size=(1000, 0), sink_tokens=2, page_size=page)
