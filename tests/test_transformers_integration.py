"""transformers integration: the "sinkattn" attention implementation and SinkCache (StreamingLLM).

Tiny randomly initialised GptOss and Llama models built from configs (nothing is downloaded); the
reference is the same model with transformers' eager attention. Skipped when transformers is absent or older than
5.24 (the supported range: sinkattn/integrations/transformers.py).
"""
import copy
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.24")  # SinkCache refuses older
from transformers import DynamicCache, GptOssConfig, GptOssForCausalLM, LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward as gptoss_eager  # noqa: E402

import sinkattn.integrations.transformers as sat  # noqa: E402

sat.register()
VOCAB = 128
# transformers 5.24 renamed past_key_values= to cache=; the old name still works (deprecated) and these tests use
# it; test_streaming_transformers.py checks that both reach the SinkCache.
pytestmark = [pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning"),
              pytest.mark.usefixtures("one_thread")]


def gptoss_config(**kw):
    args = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                layer_types=["sliding_attention", "full_attention"], max_position_embeddings=131072,
                experts_implementation="eager", pad_token_id=0)
    args.update(kw)
    return GptOssConfig(**args)


def llama_config(**kw):
    args = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, pad_token_id=0)
    args.update(kw)
    return LlamaConfig(**args)


def pair(kind, dtype=torch.float32, seed=0):
    """(eager model, sinkattn model) with identical weights; gpt-oss sinks made large enough to matter."""
    torch.manual_seed(seed)
    cls, cfg = (GptOssForCausalLM, gptoss_config()) if kind == "gptoss" else (LlamaForCausalLM, llama_config())
    eager = cls(cfg).to(dtype).eval()
    with torch.no_grad():
        for name, p in eager.named_parameters():
            if name.endswith("self_attn.sinks"):
                p.copy_(torch.randn_like(p) * 1.5)
    eager.set_attn_implementation("eager")
    fused = copy.deepcopy(eager)
    fused.set_attn_implementation(sat.NAME)
    assert fused.config._attn_implementation == sat.NAME and eager.config._attn_implementation == "eager"
    return eager, fused


@pytest.fixture
def calls(monkeypatch):
    """Counts the calls of the sinkattn attention function (proves the fused model runs it)."""
    seen = []
    real = sat.sinkattn_attention_forward

    def spy(*args, **kwargs):
        seen.append(kwargs.get("s_aux") is not None)
        return real(*args, **kwargs)

    monkeypatch.setitem(transformers.AttentionInterface._global_mapping, sat.NAME, spy)
    return seen


TOL = dict(rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["gptoss", "llama"])
def test_prefill_and_32_decode_steps_match_eager(kind, calls):
    eager, fused = pair(kind)
    torch.manual_seed(1)
    ids = torch.randint(1, VOCAB, (2, 20))  # longer than gpt-oss's sliding window (8)
    ce, cf = DynamicCache(config=eager.config), DynamicCache(config=fused.config)
    with torch.no_grad():
        le = eager(ids, past_key_values=ce, use_cache=True).logits
        lf = fused(ids, past_key_values=cf, use_cache=True).logits
        torch.testing.assert_close(lf, le, **TOL)
        nxt = le[:, -1:].argmax(-1)
        for step in range(32):  # teacher-forced on eager's greedy tokens
            le = eager(nxt, past_key_values=ce, use_cache=True).logits
            lf = fused(nxt, past_key_values=cf, use_cache=True).logits
            torch.testing.assert_close(lf, le, **TOL, msg=lambda m, step=step: f"decode step {step}: {m}")
            nxt = le[:, -1:].argmax(-1)
    assert ce.get_seq_length() == 20 + 32
    assert len(calls) == 2 * 33 and all(calls) == (kind == "gptoss")  # 2 layers x 33 forwards; s_aux for gpt-oss


def test_generate_gptoss_float64_same_tokens():
    eager, fused = pair("gptoss", dtype=torch.float64)
    ids = torch.randint(1, VOCAB, (1, 6), generator=torch.Generator().manual_seed(3))
    kw = dict(max_new_tokens=32, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    with torch.no_grad():
        ge, gf = eager.generate(ids, **kw), fused.generate(ids, **kw)
    assert torch.equal(ge.sequences, gf.sequences)
    torch.testing.assert_close(torch.stack(gf.logits), torch.stack(ge.logits), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("kind", ["gptoss", "llama"])
def test_left_and_right_padding_use_varlen_and_match_eager(kind):
    eager, fused = pair(kind)
    ids = torch.randint(1, VOCAB, (3, 14), generator=torch.Generator().manual_seed(4))
    mask = torch.ones(3, 14, dtype=torch.long)
    mask[1, :5] = 0   # left padding
    mask[2, 10:] = 0  # right padding
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", sat.MaskFallbackWarning)  # padding must not need the dense fallback
        le = eager(ids, attention_mask=mask).logits
        lf = fused(ids, attention_mask=mask).logits
    valid = mask.bool()
    torch.testing.assert_close(lf[valid], le[valid], **TOL)


def test_gptoss_training_step_sinks_gradient_equals_eager():
    eager, fused = pair("gptoss")
    eager.train()
    fused.train()
    ids = torch.randint(1, VOCAB, (2, 16), generator=torch.Generator().manual_seed(5))
    for m in (eager, fused):
        m(ids, labels=ids).loss.backward()
    fp = dict(fused.named_parameters())
    checked = 0
    for name, p in eager.named_parameters():
        if name.endswith("self_attn.sinks") or name.endswith("q_proj.weight") or name.endswith("k_proj.weight"):
            assert fp[name].grad is not None and p.grad.abs().sum() > 0
            torch.testing.assert_close(fp[name].grad, p.grad, rtol=1e-4, atol=1e-5,
                                       msg=lambda m, name=name: f"grad of {name}: {m}")
            checked += name.endswith("sinks")
    assert checked == 2
    # one optimizer step moves both models the same way
    for m in (eager, fused):
        torch.optim.SGD(m.parameters(), lr=0.1).step()
    torch.testing.assert_close(fused.model.layers[0].self_attn.sinks, eager.model.layers[0].self_attn.sinks)


# ---- the attention function on its own, against gpt-oss's eager attention ------------------------------
class _Module(torch.nn.Module):
    def __init__(self, h, hk):
        super().__init__()
        self.sinks = torch.nn.Parameter(torch.randn(h))
        self.num_key_value_groups = h // hk
        self.is_causal = True
        self.training = False


def _qkv(b=2, h=4, hk=2, sq=7, sk=7, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, h, sq, d, generator=g), torch.randn(b, hk, sk, d, generator=g),
            torch.randn(b, hk, sk, d, generator=g))


def _float_mask(allowed):
    return torch.where(allowed, 0.0, torch.finfo(torch.float32).min)


def test_custom_mask_takes_the_dense_fallback_and_is_exact():
    mod = _Module(4, 2)
    q, k, v = _qkv()
    allowed = torch.rand(2, 1, 7, 7, generator=torch.Generator().manual_seed(1)) > 0.4
    allowed[..., 0] = True  # gpt-oss's eager cannot represent an all-masked row the same way
    ref, _ = gptoss_eager(mod, q, k, v, _float_mask(allowed), scaling=0.25)
    sat._warned.clear()
    with pytest.warns(sat.MaskFallbackWarning, match="not the causal/sliding-window pattern"):
        out, _ = sat.sinkattn_attention_forward(mod, q, k, v, allowed, scaling=0.25, s_aux=mod.sinks)
    torch.testing.assert_close(out, ref, **TOL)
    out2, _ = sat.sinkattn_attention_forward(mod, q, k, v, _float_mask(allowed), scaling=0.25, s_aux=mod.sinks)
    torch.testing.assert_close(out2, ref, **TOL)


def test_sliding_window_float_mask_runs_fused_and_matches_eager():
    mod = _Module(4, 2)
    q, k, v = _qkv(sq=3, sk=12)
    i = torch.arange(3)[:, None] + 9
    j = torch.arange(12)[None, :]
    allowed = ((j <= i) & (j > i - 5)).expand(2, 1, 3, 12)
    ref, _ = gptoss_eager(mod, q, k, v, _float_mask(allowed), scaling=0.25)
    with warnings.catch_warnings():
        warnings.simplefilter("error", sat.MaskFallbackWarning)
        out, _ = sat.sinkattn_attention_forward(mod, q, k, v, _float_mask(allowed), scaling=0.25, sliding_window=5,
                                                s_aux=mod.sinks)
    torch.testing.assert_close(out, ref, **TOL)


def test_dropout_is_refused():
    mod = _Module(4, 2)
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="dropout"):
        sat.sinkattn_attention_forward(mod, q, k, v, None, dropout=0.1)


# ---- SinkCache (StreamingLLM) -----------------------------------------------------------------------------
def _decode(model, cache, ids, steps, feed=None):
    logits = []
    with torch.no_grad():
        out = model(ids, past_key_values=cache, use_cache=True).logits
        logits.append(out[:, -1])
        nxt = out[:, -1:].argmax(-1)
        for t in range(steps):
            tok = nxt if feed is None else feed[:, t:t + 1]
            out = model(tok, past_key_values=cache, use_cache=True).logits
            logits.append(out[:, -1])
            nxt = out[:, -1:].argmax(-1)
    return torch.stack(logits, 1)


@pytest.mark.parametrize("kind", ["gptoss", "llama"])
def test_sink_cache_equals_dynamic_cache_until_it_evicts(kind):
    _, fused = pair(kind)
    ids = torch.randint(1, VOCAB, (1, 10), generator=torch.Generator().manual_seed(6))
    feed = torch.randint(1, VOCAB, (1, 13), generator=torch.Generator().manual_seed(7))
    sink = sat.SinkCache.from_model(fused, capacity=24, sink_tokens=4)
    want = _decode(fused, DynamicCache(config=fused.config), ids, 13, feed)
    got = _decode(fused, sink, ids, 13, feed)  # 10 + 13 = 23 tokens <= 24: nothing evicted
    torch.testing.assert_close(got, want, **TOL)
    assert sink.stats()["evicted"] == 0


@pytest.mark.parametrize("kind", ["gptoss", "llama"])
def test_sink_cache_streams_past_capacity_same_as_eager(kind):
    eager, fused = pair(kind)
    ids = torch.randint(1, VOCAB, (2, 9), generator=torch.Generator().manual_seed(8))
    feed = torch.randint(1, VOCAB, (2, 40), generator=torch.Generator().manual_seed(9))
    caches = [sat.SinkCache.from_model(m, capacity=16, sink_tokens=4) for m in (eager, fused)]
    le = _decode(eager, caches[0], ids, 40, feed)
    lf = _decode(fused, caches[1], ids, 40, feed)
    torch.testing.assert_close(lf, le, **TOL)
    st = caches[1].stats()
    assert (st["tokens_seen"], st["length"], st["evicted"]) == (49, 16, 33)
    assert all(layer.keys.shape[2] == 16 for layer in caches[1].layers)  # fixed memory


def test_sink_cache_generate_past_capacity():
    eager, fused = pair("gptoss", dtype=torch.float64)
    ids = torch.randint(1, VOCAB, (1, 5), generator=torch.Generator().manual_seed(10))
    kw = dict(max_new_tokens=30, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        ge = eager.generate(ids, past_key_values=sat.SinkCache.from_model(eager, 12, 4), **kw)
        cache = sat.SinkCache.from_model(fused, 12, 4)
        gf = fused.generate(ids, past_key_values=cache, **kw)
    assert torch.equal(ge, gf) and gf.shape[1] == 35
    assert cache.stats()["length"] == 12

# SinkCache's positions, per-token chunks and equality with SinkKVCache: tests/test_streaming_transformers.py
