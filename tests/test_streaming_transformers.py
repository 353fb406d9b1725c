"""StreamingLLM through transformers on tiny random Llama and GptOss models (nothing downloaded).

SinkCache: positions stay inside the cache however long the stream (also under `generate`, which passes
growing position_ids), the output does not depend on how long the stream has run, chunked prefill equals
token-by-token decoding, and both equal SinkKVCache (an independent per-token StreamingLLM on pre-RoPE
q/k). set_streaming: the sink-token window through transformers equals the float64 oracle.
"""
import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.24")  # SinkCache refuses older
from transformers import DynamicCache  # noqa: E402

import sinkattn.integrations.transformers as sat  # noqa: E402
from sinkattn.errors import SinkattnRuntimeError, SinkattnValueError  # noqa: E402
from sinkattn.rotary import rotate_halves  # noqa: E402
from sinkattn.streaming import SinkKVCache  # noqa: E402
from tests.oracle import attention_oracle  # noqa: E402
from tests.test_transformers_integration import VOCAB, pair  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning"),
              pytest.mark.usefixtures("one_thread")]
CAP, SINKS = 16, 4  # gpt-oss's sliding layers use a window of 8 < capacity: both paths of the chunk code run
# transformers computes RoPE angles in fp32 even for a float64 model, and a kept key is re-rotated by the
# exact (float64) difference of positions: the two paths agree to fp32 angle rounding, not float64
CLOSE = dict(rtol=1e-6, atol=1e-6)


def _model(kind, impl=sat.NAME):
    eager, fused = pair(kind, dtype=torch.float64)
    return fused if impl == sat.NAME else eager


def _positions_seen(model):
    """Record every position the rotary embedding is asked for."""
    seen = []
    rot = model.model.rotary_emb
    rot.register_forward_pre_hook(lambda mod, args, kw: seen.append(kw.get("position_ids", args[-1]).clone()),
                                  with_kwargs=True)
    return seen


def _stream(model, cache, ids, chunks):
    """Feed ids (1, T) in chunks of the given sizes; the logits of every token (1, T, vocab)."""
    out, i = [], 0
    with torch.no_grad():
        for s in chunks:
            out.append(model(ids[:, i:i + s], past_key_values=cache, use_cache=True).logits)
            i += s
    assert i == ids.shape[1]
    return torch.cat(out, 1)


def _ids(n, seed):
    return torch.randint(1, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind", ["llama", "gptoss"])
def test_chunked_prefill_equals_token_by_token(kind):
    model = _model(kind)
    ids = _ids(70, 1)
    one = _stream(model, sat.SinkCache.from_model(model, CAP, SINKS), ids, [1] * 70)
    for chunks in ([70], [3, 30, 1, 2, 9, 25], [17, 17, 17, 19]):
        got = _stream(model, sat.SinkCache.from_model(model, CAP, SINKS), ids, chunks)
        torch.testing.assert_close(got, one, **CLOSE)
    # the phenomenon is there: past the capacity the stream differs from dense attention
    dense = _stream(model, DynamicCache(config=model.config), ids, [70])
    torch.testing.assert_close(dense[:, :CAP], one[:, :CAP], rtol=1e-9, atol=1e-9)
    assert (dense[:, CAP + 4:] - one[:, CAP + 4:]).abs().max() > 1e-3


@pytest.mark.parametrize("kind", ["llama", "gptoss"])
def test_positions_stay_inside_the_cache(kind):
    model = _model(kind)
    seen = _positions_seen(model)
    cache = sat.SinkCache.from_model(model, CAP, SINKS)
    _stream(model, cache, _ids(300, 2), [1] * 300)
    assert max(int(p.max()) for p in seen) == CAP - 1 and len(seen) == 300
    seen.clear()
    with torch.no_grad():  # generate numbers tokens 0, 1, 2, ... itself; the hook overrides it
        out = model.generate(_ids(5, 3), past_key_values=sat.SinkCache.from_model(model, CAP, SINKS),
                             max_new_tokens=100, min_new_tokens=100, do_sample=False,
                             pad_token_id=0)
    assert out.shape[1] == 105 and max(int(p.max()) for p in seen) == CAP - 1
    seen.clear()  # a chunk past the capacity: its tokens follow the W - 1 kept ones
    cache = sat.SinkCache.from_model(model, CAP, SINKS)
    _stream(model, cache, _ids(200, 4), [20] * 10)
    assert [int(p.max()) for p in seen] == [19] + [CAP - 2 + 20] * 9


@pytest.mark.parametrize("kind", ["llama", "gptoss"])
def test_output_does_not_depend_on_how_long_the_stream_has_run(kind):
    model = _model(kind)
    ids = _ids(60, 5)
    a, b = (sat.SinkCache.from_model(model, CAP, SINKS) for _ in range(2))
    _stream(model, a, ids[:, :30], [30])
    _stream(model, b, ids[:, :30], [30])
    b.fast_forward(2 ** 23 + 3)  # as if 2^23 + 3 more tokens had streamed past, window kept
    assert b.stats()["tokens_seen"] == 2 ** 23 + 33
    la = _stream(model, a, ids[:, 30:], [1] * 10 + [20])
    lb = _stream(model, b, ids[:, 30:], [1] * 10 + [20])
    assert torch.equal(la, lb)


def test_reset_cache_streams_like_a_new_one():
    model = _model("llama")
    ids = _ids(50, 12)
    cache = sat.SinkCache.from_model(model, CAP, SINKS)
    _stream(model, cache, ids, [1] * 50)  # arrivals of decode steps
    cache.reset()
    got = _stream(model, cache, ids, [49, 1])  # other arrivals, first in-place step at the same count
    want = _stream(model, sat.SinkCache.from_model(model, CAP, SINKS), ids, [49, 1])
    assert torch.equal(got, want)


def test_cache_without_the_hook_is_refused():
    model = _model("llama")
    rot = model.model.rotary_emb
    cache = sat.SinkCache(CAP, SINKS, num_layers=model.config.num_hidden_layers, inv_freq=rot.inv_freq)
    with pytest.raises(SinkattnRuntimeError, match="from_model"):
        _stream(model, cache, _ids(3, 6), [3])


def test_eager_streams_token_by_token_and_refuses_long_chunks():
    eager, fused = pair("llama", dtype=torch.float64)
    ids = _ids(40, 7)
    want = _stream(fused, sat.SinkCache.from_model(fused, CAP, SINKS), ids, [10] + [1] * 30)
    got = _stream(eager, sat.SinkCache.from_model(eager, CAP, SINKS), ids, [10] + [1] * 30)
    torch.testing.assert_close(got, want, **CLOSE)
    with pytest.raises(SinkattnValueError, match="attn_implementation='sinkattn'"):
        _stream(eager, sat.SinkCache.from_model(eager, CAP, SINKS), ids, [40])


def test_layer_equals_sinkkvcache_token_by_token():
    """SinkCacheLayer + the attention function on keys rotated at the hook's positions, fed in chunks, equals
    SinkKVCache (pre-RoPE q/k, its own rotation, evict-for-space) fed token by token."""
    _, fused = pair("llama", dtype=torch.float64)
    inv = fused.model.rotary_emb.inv_freq.double()
    cap, n, hk, h, d = 10, 3, 2, 4, 16
    cache = sat.SinkCache(cap, n, num_layers=1, inv_freq=inv)
    cache.positioned = True  # positions come from this test (the hook's rule: kept + i)
    ref = SinkKVCache(cap, n, num_layers=1, batch_size=1, num_kv_heads=hk, head_dim=d, dtype=torch.float64)
    ang = torch.arange(64, dtype=torch.float64)[:, None] * inv[None]
    ref.rotary_cos, ref.rotary_sin = ang.cos(), ang.sin()
    module = type("Attn", (), {"layer_idx": 0, "is_causal": True, "config": None})()
    g = torch.Generator().manual_seed(11)
    sinks = torch.randn(h, generator=g, dtype=torch.float64)
    for s in (2, 4, 1, 13, 1, 3, 1, 25, 6):
        q, k, v = (torch.randn(1, s, nh, d, generator=g, dtype=torch.float64) for nh in (h, hk, hk))
        pos = cache.positions(s)
        rq = rotate_halves(q, pos[None, :, None, None] * inv)
        rk = rotate_halves(k, pos[None, :, None, None] * inv)
        keys, vals = cache.update(rk.transpose(1, 2), v.transpose(1, 2), 0)
        out, _ = sat.sinkattn_attention_forward(module, rq.transpose(1, 2), keys, vals, None, s_aux=sinks,
                                                sinkattn_stream=cache)
        want = torch.cat([ref.attend(0, q[:, i:i + 1], k[:, i:i + 1], v[:, i:i + 1], sinks) for i in range(s)], 1)
        torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)  # SinkKVCache rotates q in fp32
    assert int(pos.max()) == cap - 2 + 6  # a chunk's positions follow the W - 1 kept tokens


@pytest.mark.parametrize("kind", ["llama", "gptoss"])
def test_set_streaming_mask_equals_oracle(kind, monkeypatch):
    """set_streaming(sink_tokens=3, window=6) on a model that has no such window: every attention call of a
    prefill and of decode steps (DynamicCache) equals the float64 oracle's sink-token window."""
    model = _model(kind)
    sat.set_streaming(model, sink_tokens=3, window=6)
    assert model.config.sinkattn_window == 6 and model.config._attn_implementation == sat.NAME
    calls = []
    real = sat.sinkattn_attention_forward

    def spy(module, q, k, v, mask, **kw):
        out, _ = real(module, q, k, v, mask, **kw)
        calls.append((q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), kw, out))
        return out, None

    monkeypatch.setitem(transformers.AttentionInterface._global_mapping, sat.NAME, spy)
    cache = DynamicCache(config=model.config)
    _stream(model, cache, _ids(24, 8), [20, 1, 1, 1, 1])
    assert len(calls) == 5 * model.config.num_hidden_layers
    sliding = 0
    for q, k, v, kw, out in calls:
        left = 5 if not kw.get("sliding_window") else min(5, kw["sliding_window"] - 1)
        sliding += bool(kw.get("sliding_window"))
        want, _ = attention_oracle(q, k, v, kw.get("s_aux"), softmax_scale=kw["scaling"], causal=True,
                                   window_size=(left, 0), sink_tokens=3)
        torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
        if k.shape[1] == 24 and not kw.get("sliding_window"):  # the sink tokens matter: 3 keys beyond the window
            plain, _ = attention_oracle(q, k, v, kw.get("s_aux"), softmax_scale=kw["scaling"], causal=True,
                                        window_size=(left, 0))
            assert (plain - want).abs().max() > 1e-3
    assert sliding == (5 if kind == "gptoss" else 0)


def test_set_streaming_rejects_bad_values():
    model = _model("llama")
    with pytest.raises(SinkattnValueError, match="window"):
        sat.set_streaming(model, sink_tokens=4, window=0)
    with pytest.raises(SinkattnValueError, match="sink_tokens"):
        sat.set_streaming(model, sink_tokens=-1, window=8)


@pytest.mark.parametrize("sq,sk,window,sink_tokens,softcap,sinks", [
    (1, 300, (-1, 0), 0, 0.0, "randn"), (1, 300, (63, 0), 4, 0.0, "randn"), (3, 40, (7, 0), 2, 5.0, None),
    (16, 16, (-1, 0), 0, 0.0, "-inf"), (2, 9, (0, 0), 0, 0.0, "+30"), (4, 20, (2, 1), 1, 0.0, "randn")])
def test_reference_direct_decode_path_equals_oracle(monkeypatch, sq, sk, window, sink_tokens, softcap, sinks):
    """Decode-sized calls take the reference backend's direct path (one pass over the batch); it computes
    the contract: windows, sink tokens, softcap, GQA, learnable sinks incl. -inf and +30."""
    from sinkattn import flash_attn_with_sinks, reference
    taken = []
    real = reference._forward_direct
    monkeypatch.setattr(reference, "_forward_direct", lambda *a: taken.append(1) or real(*a))
    g = torch.Generator().manual_seed(sq * 1000 + sk)
    q = torch.randn(3, sq, 6, 32, generator=g)
    k, v = (torch.randn(3, sk, 2, 32, generator=g) for _ in range(2))
    s = {None: None, "randn": torch.randn(6, generator=g), "-inf": torch.full((6,), float("-inf")),
         "+30": torch.full((6,), 30.0)}[sinks]
    out, lse = flash_attn_with_sinks(q, k, v, s, window_size=window, sink_tokens=sink_tokens, softcap=softcap,
                                     return_lse=True)
    want, want_lse = attention_oracle(q.double(), k.double(), v.double(), None if s is None else s.double(),
                                      window_size=window, sink_tokens=sink_tokens, softcap=softcap)
    assert taken
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sq,sk,window,sink_tokens,sinks", [
    (1, 300, (-1, 0), 0, "randn"), (1, 40, (63, 0), 0, None), (1, 300, (63, 0), 0, "randn"),
    (1, 7, (-1, 0), 0, "+30"), (1, 7, (-1, 0), 0, "-inf"), (3, 40, (-1, -1), 0, "randn")])
def test_decode_on_transformers_layout_equals_oracle(monkeypatch, sq, sk, window, sink_tokens, sinks):
    """A CPU inference step with no attention mask (decode) runs reference.decode_bhsd straight on transformers'
    (b, h, s, d) tensors, with learnable sinks (-inf, +30) and GQA; a mask that hides keys goes elsewhere."""
    import types
    from sinkattn import reference
    taken = []
    real = reference.decode_bhsd
    monkeypatch.setattr(reference, "decode_bhsd", lambda *a: taken.append(real(*a)) or taken[-1])
    g = torch.Generator().manual_seed(sq * 1000 + sk)
    q = torch.randn(2, 6, sq, 32, generator=g)
    k, v = (torch.randn(2, 2, sk, 32, generator=g) for _ in range(2))
    s = {None: None, "randn": torch.randn(6, generator=g), "-inf": torch.full((6,), float("-inf")),
         "+30": torch.full((6,), 30.0)}[sinks]
    module = types.SimpleNamespace(is_causal=window[1] == 0, layer_idx=0, config=None)
    with torch.no_grad():
        out, _ = sat.sinkattn_attention_forward(module, q, k, v, None, scaling=0.125, s_aux=s,
                                                sliding_window=window[0] + 1 if window[0] >= 0 else None)
    want, _ = attention_oracle(q.transpose(1, 2).double(), k.transpose(1, 2).double(), v.transpose(1, 2).double(),
                               None if s is None else s.double(), softmax_scale=0.125,
                               window_size=window, sink_tokens=sink_tokens)
    assert out.shape == (2, sq, 6, 32)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    # fully visible calls take it; a sliding window shorter than the keys hides some of them and does not
    assert [t is not None for t in taken] == [window[0] < 0 or window[0] >= sk]


def test_set_streaming_left_padded_batch_equals_each_row_alone():
    """Padding takes the dense path with the sink tokens moved to each row's first real tokens."""
    model = _model("llama")
    sat.set_streaming(model, sink_tokens=2, window=5)
    rows = [_ids(14, 13)[0], _ids(9, 14)[0]]
    ids = torch.zeros(2, 14, dtype=torch.long)
    mask = torch.zeros(2, 14, dtype=torch.long)
    for r, row in enumerate(rows):
        ids[r, 14 - len(row):], mask[r, 14 - len(row):] = row, 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        both = model(ids, attention_mask=mask, position_ids=pos).logits
        for r, row in enumerate(rows):
            alone = model(row[None]).logits
            torch.testing.assert_close(both[r, 14 - len(row):], alone[0], rtol=1e-9, atol=1e-9)
    plain = _model("llama")  # without the window the padded row differs: the test sees the streaming mask
    with torch.no_grad():
        assert (plain(ids, attention_mask=mask, position_ids=pos).logits[0] - both[0]).abs().max() > 1e-3



# ---- the pinned release's call forms; padded batches (no silent no-op, no silent wrong result) -----
def test_cache_and_past_key_values_both_stream_through_the_sink_cache():
    """On the pinned release (5.24) `model(ids, cache=c)` (docs/streaming.md's form) and `past_key_values=c` both run
    through the SinkCache: it holds the tokens, evicts, is the cache returned, and the logits are the stream's."""
    model = _model("llama")
    ids = _ids(40, 21)
    logits, caches = {}, {}
    for kw in ("cache", "past_key_values"):
        cache = caches[kw] = sat.SinkCache.from_model(model, CAP, SINKS)
        out = []
        with torch.no_grad():
            for i, s in ((0, 12), *((t, 1) for t in range(12, 40))):
                step = model(ids[:, i:i + s], **{kw: cache}, use_cache=True)
                assert step.past_key_values is cache
                out.append(step.logits)
        logits[kw] = torch.cat(out, 1)
        st = cache.stats()
        assert (st["tokens_seen"], st["length"], st["evicted"]) == (40, CAP, 40 - CAP), kw
        assert all(int(layer.seen) == 40 and layer.keys.shape[2] == CAP for layer in cache.layers)
    assert torch.equal(logits["cache"], logits["past_key_values"])
    want = _stream(model, sat.SinkCache.from_model(model, CAP, SINKS), ids, [1] * 40)  # token by token
    torch.testing.assert_close(logits["cache"], want, **CLOSE)
    dense = _stream(model, DynamicCache(config=model.config), ids, [40])  # and it is not the dense model
    assert (dense[:, CAP + 4:] - logits["cache"][:, CAP + 4:]).abs().max() > 1e-3


def test_generate_streams_through_the_sink_cache():
    model = _model("gptoss")
    cache = sat.SinkCache.from_model(model, CAP, SINKS)
    with torch.no_grad():
        out = model.generate(_ids(6, 22), past_key_values=cache, max_new_tokens=30, min_new_tokens=30,
                             do_sample=False, pad_token_id=0)
    assert out.shape[1] == 36
    st = cache.stats()  # generate feeds the prompt and 29 generated tokens (the last one is only sampled)
    assert (st["tokens_seen"], st["length"], st["evicted"]) == (35, CAP, 35 - CAP)


def _left_padded(rows, width):
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for r, row in enumerate(rows):
        ids[r, width - len(row):], mask[r, width - len(row):] = row, 1
    return ids, mask


def test_left_padded_batch_is_refused():
    """The sink tokens are the cache's first tokens, shared by the rows: a left-padded row's padding would
    become its sinks after the first eviction. Every way of passing the padding is refused, naming what to do."""
    model = _model("llama")
    rows = [_ids(20, 23)[0], _ids(13, 24)[0]]
    ids, mask = _left_padded(rows, 20)
    with pytest.raises(SinkattnValueError, match=r"row\(s\) \[1\] of this batch are padded.*one at a time"):
        with torch.no_grad():
            model(ids, attention_mask=mask, cache=sat.SinkCache.from_model(model, CAP, SINKS))
    cache = sat.SinkCache.from_model(model, CAP, SINKS)
    with pytest.raises(SinkattnValueError, match="padded"), torch.no_grad():
        model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=3, pad_token_id=0)
    assert cache.stats()["tokens_seen"] == 0  # refused before anything was stored
    pos = (mask.cumsum(-1) - 1).clamp(min=0)  # the position_ids of a padded batch, without a mask
    with pytest.raises(SinkattnValueError, match="position_ids"), torch.no_grad():
        model(ids, position_ids=pos, past_key_values=sat.SinkCache.from_model(model, CAP, SINKS))
    with pytest.raises(SinkattnValueError, match="2-D"), torch.no_grad():
        model(ids, attention_mask=torch.ones(2, 1, 20, 20, dtype=torch.bool),
              past_key_values=sat.SinkCache.from_model(model, CAP, SINKS))


def test_unpadded_batch_equals_each_row_alone():
    """What the refusal leaves: a batch of equal-length rows with an all-ones mask (what generate passes) streams
    past the capacity exactly as each row alone (float64)."""
    model = _model("gptoss")
    rows = torch.cat([_ids(30, 25), _ids(30, 26)])
    ones = torch.ones_like(rows)
    cache = sat.SinkCache.from_model(model, CAP, SINKS)
    got, i = [], 0
    with torch.no_grad():
        for s in (10, 1, 1, 18):
            got.append(model(rows[:, i:i + s], attention_mask=ones[:, :i + s], past_key_values=cache).logits)
            i += s
    got = torch.cat(got, 1)
    assert cache.stats()["evicted"] == 30 - CAP
    for r in range(2):
        alone = _stream(model, sat.SinkCache.from_model(model, CAP, SINKS), rows[r:r + 1], [10, 1, 1, 18])
        torch.testing.assert_close(got[r:r + 1], alone, rtol=1e-9, atol=1e-9)
