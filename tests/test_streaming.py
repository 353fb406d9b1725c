"""SinkKVCache (StreamingLLM) against an independent simulation built on the float64 oracle.

The expected result of every step is computed from the whole history of pre-RoPE q/k/v: a plain
list of the token indices the cache should hold (evict the oldest non-sink tokens until the new
chunk fits), positions 0..L-1 over that list, RoPE applied by the oracle, causal attention by the
oracle. Nothing of the ring layout is shared with the implementation.
"""
import math

import pytest
import torch

from sinkattn import SinkattnRuntimeError, SinkattnTypeError, SinkattnValueError
from sinkattn.streaming import SinkKVCache
from tests.oracle import attention_oracle, rotary_oracle


def rope_tables(max_pos, rotary_dim, base=10000.0, dtype=torch.float64):
    inv = 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    ang = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv[None, :]
    return ang.cos().to(dtype), ang.sin().to(dtype)


class Simulation:
    """What a StreamingLLM cache must compute, from the full history (one layer)."""

    def __init__(self, capacity, sink_tokens, cos, sin, interleaved):
        self.cap, self.n = capacity, sink_tokens
        self.cos, self.sin, self.interleaved = cos, sin, interleaved
        self.k, self.v, self.held = [], [], []

    def step(self, q, k, v, sinks):
        outs, lses = [], []
        window = self.cap - self.n
        for i0 in range(0, q.shape[1], window):
            o, l = self._piece(q[:, i0:i0 + window], k[:, i0:i0 + window], v[:, i0:i0 + window], sinks)
            outs.append(o)
            lses.append(l)
        return torch.cat(outs, 1), torch.cat(lses, 2)

    def _piece(self, q, k, v, sinks):
        s = q.shape[1]
        first = len(self.k)
        for i in range(s):
            self.k.append(k[:, i])
            self.v.append(v[:, i])
        while len(self.held) + s > self.cap:
            del self.held[self.n]  # the oldest token after the sinks
        self.held += list(range(first, first + s))
        keys = torch.stack([self.k[t] for t in self.held], 1)
        vals = torch.stack([self.v[t] for t in self.held], 1)
        L = len(self.held)
        qq = q
        if self.cos is not None:
            b = q.shape[0]
            pos = torch.arange(L).expand(b, L)
            keys = rotary_oracle(keys, self.cos, self.sin, pos, self.interleaved)
            qq = rotary_oracle(q, self.cos, self.sin, pos[:, L - s:], self.interleaved)
        return attention_oracle(qq, keys, vals, sinks, causal=True)


def _stream(chunks, *, capacity, sink_tokens, rotary, interleaved=False, dtype=torch.float64, layers=2,
            b=2, h=4, hk=2, d=16, learnable_sinks=True, tol=2e-5):
    gen = torch.Generator().manual_seed(1234)
    cos = sin = None
    if rotary:
        cos, sin = rope_tables(capacity, d // 2 if rotary == "full" else d // 4)
    cache = SinkKVCache(capacity, sink_tokens, num_layers=layers, batch_size=b, num_kv_heads=hk, head_dim=d,
                        dtype=dtype, rotary_cos=cos, rotary_sin=sin, rotary_interleaved=interleaved)
    sims = [Simulation(capacity, sink_tokens, cos, sin, interleaved) for _ in range(layers)]
    sinks = [torch.randn(h, generator=gen, dtype=torch.float64) if learnable_sinks else None for _ in range(layers)]
    reads = set()
    for s in chunks:
        for layer in range(layers):
            q, k, v = (torch.randn(b, s, nh, d, generator=gen, dtype=torch.float64) for nh in (h, hk, hk))
            out, lse = cache.attend(layer, q.to(dtype), k.to(dtype), v.to(dtype),
                                    None if sinks[layer] is None else sinks[layer].to(torch.float32),
                                    return_lse=True)
            ref, ref_lse = sims[layer].step(q, k, v, None if sinks[layer] is None else sinks[layer].float().double())
            torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
            torch.testing.assert_close(lse.double(), ref_lse, atol=tol, rtol=tol)
            reads.add(cache.last_read)
            assert cache.held_tokens(layer) == sims[layer].held
    return cache, reads


CHUNKS = [3, 1, 1, 5, 1, 1, 1, 7, 2, 1, 1, 13, 1, 1, 4, 1]  # 13 > window: split into window-sized pieces


@pytest.mark.parametrize("interleaved", [False, True])
def test_stream_with_rope_matches_oracle(interleaved):
    cache, reads = _stream(CHUNKS, capacity=12, sink_tokens=3, rotary="full", interleaved=interleaved)
    assert reads == {"rotated-view"}
    st = cache.stats()
    assert st.tokens_seen == sum(CHUNKS) and st.length == 12 and st.evicted == sum(CHUNKS) - 12
    assert st.occupancy == 1.0


def test_stream_partial_rotary_no_learnable_sinks():
    _stream([2, 1, 6, 1, 1, 9, 1], capacity=8, sink_tokens=2, rotary="partial", learnable_sinks=False)


def test_stream_without_rope_uses_the_ring_in_place():
    cache, reads = _stream(CHUNKS, capacity=12, sink_tokens=3, rotary=None)
    # filling up and single-token decode read the ring itself; multi-token chunks over a wrapped ring gather
    assert reads == {"zero-copy", "gathered-view"}


def test_zero_sink_tokens_is_a_plain_rolling_window():
    _stream([4, 1, 1, 6, 1, 3], capacity=6, sink_tokens=0, rotary="full", layers=1)


def test_float32_stream():
    _stream([5, 1, 1, 1, 8, 1], capacity=10, sink_tokens=4, rotary="full", dtype=torch.float32, layers=1, tol=2e-4)


def test_append_is_o1_and_memory_is_flat():
    b, hk, d, cap, n = 1, 2, 16, 16, 4
    cos, sin = rope_tables(cap, d // 2)
    cache = SinkKVCache(cap, n, num_layers=1, batch_size=b, num_kv_heads=hk, head_dim=d, rotary_cos=cos.float(),
                        rotary_sin=sin.float())
    ptrs = (cache.k.data_ptr(), cache.v.data_ptr())
    sizes = set()
    for t in range(3 * cap):
        before = cache.k.clone()
        q, k, v = torch.randn(b, 1, 4, d), torch.randn(b, 1, hk, d), torch.randn(b, 1, hk, d)
        cache.attend(0, q, k, v)
        changed = (cache.k != before).flatten(3).any(-1)[0, 0]  # per slot: was anything written?
        changed = changed.nonzero().flatten().tolist()
        slot = t if t < n else n + (t - n) % (cap - n)
        assert changed == [slot], f"token {t}: slots {changed} were written, expected only {slot}"
        torch.testing.assert_close(cache.k[0, :, slot], k[:, 0])  # stored before RoPE
        sizes.add(cache.nbytes)
    assert (cache.k.data_ptr(), cache.v.data_ptr()) == ptrs
    assert len(sizes) == 1
    st = cache.stats()
    assert (st.tokens_seen, st.evicted, st.length) == (3 * cap, 2 * cap, cap)
    assert cache.held_tokens() == list(range(n)) + list(range(3 * cap - (cap - n), 3 * cap))


def test_stats_before_full_and_reset():
    cache = SinkKVCache(10, 2, num_layers=1, batch_size=1, num_kv_heads=1, head_dim=8)
    assert cache.stats().occupancy == 0.0
    cache.attend(0, torch.randn(1, 4, 1, 8), torch.randn(1, 4, 1, 8), torch.randn(1, 4, 1, 8))
    st = cache.stats()
    assert (st.tokens_seen, st.evicted, st.length, st.occupancy) == (4, 0, 4, 0.4)
    cache.reset()
    assert cache.stats().tokens_seen == 0 and cache.held_tokens() == []


def _cache(**kw):
    args = dict(num_layers=2, batch_size=1, num_kv_heads=2, head_dim=16)
    args.update(kw)
    return SinkKVCache(args.pop("capacity", 8), args.pop("sink_tokens", 2), **args)


def test_errors():
    with pytest.raises(SinkattnValueError, match="capacity \\(3\\) must exceed sink_tokens \\(4\\)"):
        _cache(capacity=3, sink_tokens=4)
    with pytest.raises(SinkattnValueError, match="must exceed sink_tokens"):
        _cache(capacity=4, sink_tokens=4)
    with pytest.raises(SinkattnTypeError, match="capacity must be an int"):
        _cache(capacity=8.0)
    cos, sin = rope_tables(6, 8)
    with pytest.raises(SinkattnValueError, match="position overflow.*6 positions.*capacity - 1 = 7"):
        _cache(capacity=8, rotary_cos=cos, rotary_sin=sin)
    with pytest.raises(SinkattnValueError, match="given together"):
        _cache(rotary_cos=cos)
    cache = _cache()
    q, k, v = torch.randn(1, 1, 4, 16), torch.randn(1, 1, 2, 16), torch.randn(1, 1, 2, 16)
    with pytest.raises(SinkattnValueError, match="layer 2 out of range.*num_layers=2"):
        cache.attend(2, q, k, v)
    with pytest.raises(SinkattnValueError, match="mismatched layers: layer 1 has seen 0 tokens"):
        cache.attend(1, q, k, v)  # layer 0 has not run this step
    cache.attend(0, q, k, v)
    with pytest.raises(SinkattnValueError, match="mismatched layers: layer 0 starts a new step"):
        cache.attend(0, q, k, v)  # layer 1 has not caught up
    with pytest.raises(SinkattnValueError, match="k has shape \\(1, 1, 3, 16\\)"):
        cache.attend(1, torch.randn(1, 1, 3, 16), torch.randn(1, 1, 3, 16), torch.randn(1, 1, 3, 16))
    with pytest.raises(SinkattnTypeError, match="float64"):
        cache.attend(1, q.double(), k.double(), v.double())
    cache.attend(1, q, k, v)
    assert cache.stats().tokens_seen == 1 and cache.tokens_seen(1) == 1


def test_long_stream_keeps_sinks_and_positions_bounded():
    """After many tokens, the sink keys are the first tokens' and no position exceeds capacity - 1."""
    d, cap, n = 8, 6, 2
    cos, sin = rope_tables(cap, d // 2)
    cache = SinkKVCache(cap, n, num_layers=1, batch_size=1, num_kv_heads=1, head_dim=d, dtype=torch.float64,
                        rotary_cos=cos, rotary_sin=sin)
    first = []
    for t in range(40):
        k = torch.full((1, 1, 1, d), float(t), dtype=torch.float64)
        cache.attend(0, torch.randn(1, 1, 1, d, dtype=torch.float64), k, k.clone())
        if t < n:
            first.append(k)
    assert torch.equal(cache.k[0, :, :n], torch.cat(first, 1))
    assert math.isclose(cache.stats().occupancy, 1.0)


def test_long_stream_example_smoke(tmp_path):
    """examples/long_stream.py end to end on a short stream: memory flat, a plot written."""
    pytest.importorskip("matplotlib")
    import importlib.util
    import os
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "long_stream.py")
    spec = importlib.util.spec_from_file_location("long_stream_example", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    threads = torch.get_num_threads()
    try:
        summary = mod.main(["--tokens", "96", "--capacity", "32", "--every", "16", "--layers", "2",
                            "--out", str(tmp_path / "plot.png")])
    finally:
        torch.set_num_threads(threads)
    assert summary["cache_mib_range"][0] == summary["cache_mib_range"][1]
    assert summary["full_kv_cache_would_be_mib"] > summary["cache_mib"]
    assert (tmp_path / "plot.png").stat().st_size > 10_000


def test_attend_refuses_grad_before_writing_the_ring():
    """SinkKVCache.attend has no backward: an input that needs grad is refused before the ring is written, so a
    refused call loses no token (before: the full ring's oldest window slot was overwritten, then the op raised)."""
    cache = SinkKVCache(6, 2, num_layers=1, batch_size=1, num_kv_heads=1, head_dim=8)
    with torch.no_grad():
        for _ in range(8):  # past capacity: the next token would overwrite a window slot
            cache.attend(0, torch.randn(1, 1, 2, 8), torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8))
    k_before, v_before, stats = cache.k[0].clone(), cache.v[0].clone(), cache.stats()
    q = torch.randn(1, 1, 2, 8, requires_grad=True)
    with pytest.raises(SinkattnRuntimeError, match="no backward"):
        cache.attend(0, q, torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8))
    assert torch.equal(cache.k[0], k_before) and torch.equal(cache.v[0], v_before)
    assert cache.stats() == stats
    with torch.no_grad():  # the same call for inference goes through
        assert cache.attend(0, q, torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)).shape == (1, 1, 2, 8)
