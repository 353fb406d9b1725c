"""StreamingLLM for transformers: SinkCache, with positions inside the cache and per-token semantics.

    cache = SinkCache.from_model(model, capacity=512, sink_tokens=4)   # also installs the position hook
    model(ids, past_key_values=cache)                                   # any chunk size; or model.generate(...)

Positions. StreamingLLM numbers tokens by their place in the cache, not in the text: the sink tokens sit
at 0..n-1, the kept window after them, the new tokens next, so a query never sits beyond the capacity
and a stream that has run for 2^23 tokens computes exactly what one that has run for 2^10 computes.
transformers rotates q and k itself, at `position_ids` it derives from the tokens seen (and `generate`
passes those growing numbers explicitly). So `from_model` installs a forward pre-hook on the base model
that, whenever a SinkCache is passed, replaces `position_ids` by the in-cache positions kept + i of this
step (the hook also hands the cache to the attention function, see below). Keys arrive rotated at those
positions; a kept key's position moves as the window slides, so on each read it is rotated by the
difference between its place now and the position it was rotated at (float64 angles, from the stored
key: rounding never accumulates). The slot layout (sinks first, then a ring) is SinkKVCache's
(sinkattn.streaming.ring_slots).

Per-token semantics for any chunk. Token t of the stream (capacity C = n + W) attends over the sink
tokens and the W most recent tokens up to itself, at in-cache positions: itself at min(t, C - 1). A step
of s tokens presents the sinks, the W - 1 tokens before the step and the step's tokens (the keys any of
its queries can see). For one token, or while nothing has been evicted, that is plain causal attention
over what is presented, which every attention implementation computes. A longer chunk past the capacity
needs each query to see only its own window and the sinks at its own distance; the sinkattn attention
function does that exactly (window keys through the kernel with a window, sink keys with the query
rotated to its per-token position, merged with the learnable sinks once), so chunked prefill equals
token-by-token decoding. Other attention implementations are refused for such chunks.

Supported transformers releases: 5.24 and later (tested: 5.24.0, the release `make deps` pins). 5.24 renamed
the models' `past_key_values=` argument to `cache=` (the old name still works there). On 5.13-5.23 a model
silently ignores `cache=` (it lands in **kwargs and the model builds its own growing DynamicCache, while
the hook still assigns in-cache positions: wrong logits, no error), and before 5.13 the cache-layer API
differs; so SinkCache refuses every release before 5.24 with a SinkattnRuntimeError naming the upgrade
(`_require_transformers`).

Batches: rows of equal length without padding. The sink tokens are the first tokens of the cache, shared
by the rows, so in a left-padded batch the padding would become a row's sink tokens after the first
eviction (logits off by ~0.2 against the row run alone). The hook refuses any padded row (an
attention_mask with a zero, rows whose position_ids differ) with a SinkattnValueError saying what to do.
"""
from __future__ import annotations

import re

import torch

import transformers
from transformers.cache_utils import Cache, CacheLayerMixin

from ..errors import SinkattnRuntimeError, SinkattnValueError
from ..interface import flash_attn_with_sinks
from .. import merge as _merge  # noqa: F401  (registers torch.ops.sinkattn.merge_attn_states)
from ..layout import acc_dtype
from ..rotary import halves_table, rotate_by_table, rotate_halves
from ..streaming import ring_slots

MIN_TRANSFORMERS = (5, 24)  # the first release whose models take cache= (module docstring)
STREAM_KWARG = "sinkattn_stream"  # the kwarg through which the hook hands the cache to the attention function
_HOOK_FLAG = "_sinkattn_stream_hook"


def _release(version: str) -> tuple[int, int]:
    """(major, minor) of a version string such as "5.24.0", "5.24.0.dev0" or "5.25.0rc1"."""
    m = re.match(r"(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def _require_transformers() -> None:
    """Refuse transformers releases on which SinkCache would be silently ignored (module docstring)."""
    have = transformers.__version__
    if _release(have) < MIN_TRANSFORMERS:
        want = ".".join(map(str, MIN_TRANSFORMERS))
        raise SinkattnRuntimeError(
            f"SinkCache needs transformers >= {want}; this is transformers {have}, whose models ignore cache= (it "
            f"lands in **kwargs and the model builds its own growing cache) or lack the cache-layer API SinkCache "
            f"implements. Upgrade: pip install \"transformers>={want}\"")


def _refuse_padding(kwargs) -> None:
    """SinkCache streams equal-length rows without padding; refuse a padded batch (module docstring)."""
    mask, pos = kwargs.get("attention_mask"), kwargs.get("position_ids")
    if isinstance(mask, torch.Tensor) and mask.dim() != 2:
        raise SinkattnValueError(
            f"SinkCache: attention_mask of shape {tuple(mask.shape)} given; SinkCache lays out the keys itself and "
            f"accepts only a 2-D (batch, tokens) mask of ones (or none). For a custom mask use a DynamicCache")
    checks = []
    if isinstance(mask, torch.Tensor) and mask.numel():
        checks.append((mask == 0).any(dim=-1))  # (batch,) padded rows
    if isinstance(pos, torch.Tensor) and pos.dim() == 2 and pos.shape[0] > 1:
        checks.append((pos != pos[:1]).any(dim=-1))  # rows at different positions: padding
    if not checks:
        return
    bad = checks[0] if len(checks) == 1 else checks[0] | checks[1]  # (batch,) or (1,), broadcast
    rows = bad.nonzero().flatten().tolist()  # one sync for both checks
    if rows:
        raise SinkattnValueError(
            f"SinkCache: row(s) {rows} of this batch are padded (attention_mask has zeros, or their position_ids "
            f"differ from row 0's); SinkCache streams rows of equal length without padding: its sink tokens are "
            f"the first tokens of the cache, so a row's left padding would become its sink tokens. Stream padded "
            f"prompts one at a time (batch size 1, no padding), or make the rows the same length; for a padded "
            f"batch without a bounded cache use set_streaming(model, sink_tokens, window) with a DynamicCache")


class SinkCacheLayer(CacheLayerMixin):
    """One layer of SinkCache: the first `sink_tokens` tokens kept forever plus a ring of the most recent
    `capacity - sink_tokens` (O(1) storage work per token, the window never shifted). Keys are stored as
    they arrived (rotated at `arrival[slot]`) and re-rotated to their in-cache position on read."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, capacity: int, sink_tokens: int, inv_freq: torch.Tensor, memo: dict | None = None):
        super().__init__()
        if capacity <= sink_tokens:
            raise SinkattnValueError(f"SinkCache: capacity ({capacity}) must exceed sink_tokens ({sink_tokens})")
        self.capacity, self.sink_tokens, self.window = capacity, sink_tokens, capacity - sink_tokens
        self.inv_freq = inv_freq.detach().to(torch.float64).cpu()
        self.seen = 0
        self.step = None  # (seen before, old tokens presented, new tokens) of the last update
        self._memo = {} if memo is None else memo  # rotation tables, shared by the layers (same positions)
        self.full_attention = True  # no window of the model's own on this layer (set by from_model)
        self.unordered = False  # key order may be anything (a full-attention layer, no set_streaming window)

    def lazy_initialization(self, key_states, value_states):
        b, hk, _, d = key_states.shape
        if 2 * self.inv_freq.numel() != d:
            raise SinkattnValueError(
                f"SinkCache: the rotary embedding rotates {2 * self.inv_freq.numel()} of {d} key dims; only full "
                f"rotary (the Llama / gpt-oss layout) is supported")
        self.device, self.dtype = key_states.device, key_states.dtype
        self.keys = torch.zeros(b, hk, self.capacity, d, dtype=key_states.dtype, device=self.device)
        self.values = torch.zeros(b, hk, self.capacity, value_states.shape[-1], dtype=value_states.dtype,
                                  device=self.device)
        self.arrival = torch.zeros(self.capacity, dtype=torch.long, device=self.device)
        self._angles = self.inv_freq.to(self.device)
        self.is_initialized = True

    def presented(self, s: int) -> tuple[int, int]:
        """(old tokens presented to a step of s new tokens, of which sink tokens): the sinks and the W - 1
        tokens before the step, the keys token seen .. seen+s-1 can see (per-token StreamingLLM)."""
        n_s = min(self.seen, self.sink_tokens)
        return n_s + min(self.seen - n_s, self.window - 1), n_s

    def _cos_sin(self, delta: torch.Tensor, kind: str):
        """cos/sin (len, d) of delta * inv_freq in the halves layout, computed once per step and shared by the
        layers (they see the same positions in lockstep; the deltas are compared to be sure)."""
        key = (kind, self.seen, delta.numel(), delta.device)
        hit = self._memo.get("rot")
        if hit is not None and hit[0] == key and torch.equal(hit[1], delta):
            return hit[2]
        table = halves_table(delta.to(torch.float64)[:, None] * self._angles[None, :], self.dtype)
        self._memo["rot"] = (key, delta, table)
        return table

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        s = key_states.shape[-2]
        if s == 1 and self.unordered and self.seen >= self.capacity:
            return self._decode_in_place(key_states, value_states)
        kept, n_s = self.presented(s)
        w = kept - n_s
        dev = self.device
        old = torch.cat([torch.arange(n_s, device=dev), torch.arange(self.seen - w, self.seen, device=dev)])
        slots = ring_slots(old, self.sink_tokens, self.window)
        keys_old = self.keys.index_select(2, slots)
        delta = torch.arange(kept, device=dev) - self.arrival.index_select(0, slots)  # in-cache place now - then
        if kept and bool(delta.any()):
            keys_old = rotate_by_table(keys_old, self._cos_sin(delta, "gather"))
        out_k = torch.cat([keys_old, key_states], dim=2)
        out_v = torch.cat([self.values.index_select(2, slots), value_states], dim=2)
        # store the new tokens that stay: the sink tokens among them and the last `window` of the rest
        new = torch.arange(self.seen, self.seen + s, device=dev)
        stay = (new < self.sink_tokens) | (new >= max(self.sink_tokens, self.seen + s - self.window))
        if bool(stay.any()):
            idx = stay.nonzero().flatten()
            where = ring_slots(new[idx], self.sink_tokens, self.window)
            self.keys.index_copy_(2, where, key_states.index_select(2, idx))
            self.values.index_copy_(2, where, value_states.index_select(2, idx))
            self.arrival.index_copy_(0, where, kept + idx)  # the hook rotated token i of the step at kept + i
        self.step = (self.seen, kept, s)
        self.seen += s
        return out_k, out_v

    def _decode_in_place(self, key_states, value_states):
        """One token into a full cache, where one query sees every held key so their order does not matter: the
        new token takes the evicted token's slot and the ring is presented as it lies (no gather, values
        zero-copy), keys rotated slot by slot to their in-cache positions."""
        n, W, C, seen = self.sink_tokens, self.window, self.capacity, self.seen
        slot = n + (seen - n) % W
        self.keys[:, :, slot] = key_states[:, :, 0]
        self.values[:, :, slot] = value_states[:, :, 0]
        self.arrival[slot] = C - 1  # the hook's position for it: kept = C - 1
        hit = self._memo.get("ring")
        if hit is None or hit[0] != (seen, self.device):
            # in-cache position of each slot's token: sinks 0..n-1, window token u at n + W - 1 - (seen - u);
            # every layer holds the same positions (they advance in lockstep), so once per step
            r = torch.arange(W, device=self.device)
            target = torch.cat([torch.arange(n, device=self.device), n + W - 1 - (seen - n - r) % W])
            hit = self._memo["ring"] = ((seen, self.device), self._cos_sin(target - self.arrival, "ring"))
        out_k = rotate_by_table(self.keys, hit[1])
        self.step = (seen, C - 1, 1)
        self.seen += 1
        return out_k, self.values

    def fast_forward(self, tokens: int) -> None:
        """Count `tokens` more tokens as streamed and evicted before the next step, keeping what is held (the
        sinks and the window, re-slotted for the new numbering). For checking that a stream's output does
        not depend on how long it has run (the window is kept, so the same text follows)."""
        if self.seen < self.capacity:
            raise SinkattnValueError(f"SinkCache.fast_forward: the cache holds {self.seen} of {self.capacity} "
                                     f"tokens; it needs a full window to stand for a longer stream")
        u = torch.arange(self.seen - self.window, self.seen, device=self.device)
        src = ring_slots(u, self.sink_tokens, self.window)
        dst = ring_slots(u + tokens, self.sink_tokens, self.window)
        for name in ("keys", "values"):
            t = getattr(self, name)
            t.index_copy_(2, dst, t.index_select(2, src).clone())
        self.arrival.index_copy_(0, dst, self.arrival.index_select(0, src).clone())
        self.seen += tokens

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        kept, _ = self.presented(query_length)
        return kept + query_length, self.seen - kept

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return self.capacity

    def reset(self) -> None:
        super().reset()
        self.seen, self.step = 0, None
        self._memo.clear()  # the per-step tables are keyed by tokens seen, which a reset repeats

    def crop(self, tokens_to_remove: int) -> None:
        raise SinkattnRuntimeError("SinkCache cannot be cropped (evicted tokens are gone); assisted decoding and "
                                   "other rollbacks need a DynamicCache")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self.keys = self.keys.repeat_interleave(repeats, dim=0)
            self.values = self.values.repeat_interleave(repeats, dim=0)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self.keys, self.values = self.keys[indices], self.values[indices]


class SinkCache(Cache):
    """StreamingLLM for transformers: every layer holds the first `sink_tokens` tokens and the most recent
    `capacity - sink_tokens`, memory fixed, positions inside the cache, per-token semantics for any chunk
    (module docstring). Build it with `from_model`, which installs the hook that assigns the positions.
    For batches of equal-length streams without padding (a padded row is refused). transformers >= 5.24."""

    def __init__(self, capacity: int, sink_tokens: int = 4, *, num_layers: int, inv_freq: torch.Tensor):
        _require_transformers()
        memo = {}
        super().__init__(layers=[SinkCacheLayer(capacity, sink_tokens, inv_freq, memo) for _ in range(num_layers)])
        self.capacity, self.sink_tokens = capacity, sink_tokens
        self.positioned = False  # set by the hook; a step without it would run at transformers' positions

    @classmethod
    def from_model(cls, model, capacity: int, sink_tokens: int = 4) -> "SinkCache":
        """Size the cache for `model` (a transformers causal LM with RoPE) and install the position hook on it
        (once per model; it acts only on calls that pass a SinkCache)."""
        rotary = next((m for m in model.modules() if isinstance(getattr(m, "inv_freq", None), torch.Tensor)), None)
        if rotary is None:
            raise SinkattnValueError("SinkCache.from_model: no rotary embedding (a module with `inv_freq`) in this "
                                     "model; SinkCache needs RoPE")
        rope_type = getattr(rotary, "rope_type", "default")
        if rope_type in ("dynamic", "longrope"):
            raise SinkattnValueError(f"SinkCache.from_model: rope_type {rope_type!r} changes its frequencies with the "
                                     f"sequence length; SinkCache supports fixed-frequency RoPE (default, linear, "
                                     f"yarn, llama3)")
        install_stream_hook(model)
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        cache = cls(capacity, sink_tokens, num_layers=config.num_hidden_layers, inv_freq=rotary.inv_freq)
        types = getattr(config, "layer_types", None)
        for i, layer in enumerate(cache.layers):
            layer.full_attention = types[i] == "full_attention" if types else not getattr(config, "sliding_window", None)
        return cache

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if not self.positioned:
            raise SinkattnRuntimeError(
                "SinkCache: this model call did not go through SinkCache's position hook, so the keys were rotated "
                "at transformers' positions instead of in-cache ones; build the cache with SinkCache.from_model(model) "
                "(it installs the hook on that model)")
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def positions(self, s: int) -> torch.Tensor:
        """The in-cache positions (s,) of the next step's s tokens."""
        kept, _ = self.layers[0].presented(s)
        return torch.arange(kept, kept + s)

    def fast_forward(self, tokens: int) -> None:
        """See SinkCacheLayer.fast_forward."""
        for layer in self.layers:
            layer.fast_forward(tokens)

    def stats(self) -> dict:
        layer = self.layers[0]
        held = min(layer.seen, layer.capacity)
        return {"tokens_seen": layer.seen, "evicted": layer.seen - held, "length": held, "capacity": layer.capacity,
                "occupancy": held / layer.capacity}


def install_stream_hook(model) -> None:
    """Install (once) the forward pre-hook that gives calls with a SinkCache their in-cache positions."""
    base = getattr(model, "base_model", model)
    if not getattr(base, _HOOK_FLAG, False):
        base.register_forward_pre_hook(_stream_pre_hook, with_kwargs=True)
        setattr(base, _HOOK_FLAG, True)


def _stream_pre_hook(module, args, kwargs):
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if not isinstance(cache, SinkCache):
        return None
    x = kwargs.get("input_ids")
    if x is None:
        x = kwargs.get("inputs_embeds") if kwargs.get("inputs_embeds") is not None else args[0]
    b, s = x.shape[0], x.shape[1]
    _refuse_padding(kwargs)
    layer = cache.layers[0]
    impl = getattr(module.config, "_attn_implementation", None)
    if s > 1 and layer.seen + s > layer.capacity and impl != "sinkattn":
        raise SinkattnValueError(
            f"SinkCache: a chunk of {s} tokens after {layer.seen} (capacity {layer.capacity}) needs per-token "
            f"StreamingLLM windows, which only attn_implementation='sinkattn' computes (this model uses {impl!r}); "
            f"call model.set_attn_implementation('sinkattn') after sinkattn.integrations.transformers.register(), "
            f"or feed such chunks token by token")
    ordered = bool(getattr(module.config, "sinkattn_window", None))  # set_streaming's window reads key order
    for each in cache.layers:
        each.unordered = each.full_attention and not ordered
    kept, _ = layer.presented(s)
    kwargs["position_ids"] = torch.arange(kept, kept + s, device=x.device).expand(b, s)
    kwargs[STREAM_KWARG] = cache
    cache.positioned = True
    return args, kwargs


def needs_chunk_path(stream, layer_idx) -> bool:
    """Whether this layer's step is a chunk whose queries see different windows (past the capacity)."""
    layer = stream.layers[layer_idx]
    if layer.step is None:
        return False
    seen, _, s = layer.step
    return s > 1 and seen + s > layer.capacity


def chunk_attention(q, k, v, s_aux, stream, layer_idx, scale, softcap, sliding_left):
    """Per-token StreamingLLM for a chunk: q (b, s, h, d) at in-cache positions kept + i, k/v (b, kept + s, hk, d)
    as SinkCacheLayer.update presented them. Query i (stream token t = seen + i) sees the non-sink keys of its
    window (the kernel, window W - 1, and the model's own sliding window if narrower) and the sink keys at
    distance min(t, C - 1) - j, its per-token position (q rotated back by the difference); the two partial
    results are merged with the learnable sinks counted once."""
    layer = stream.layers[layer_idx]
    seen, kept, s = layer.step
    n = min(layer.sink_tokens, kept + s)
    cap = layer.capacity
    left = layer.window - 1 if sliding_left < 0 else min(layer.window - 1, sliding_left)
    kw = dict(softmax_scale=scale, softcap=softcap, causal=True, window_size=(left, 0), return_lse=True)
    if n == 0:
        return flash_attn_with_sinks(q, k, v, s_aux, **{**kw, "return_lse": False})
    out_w, lse_w = flash_attn_with_sinks(q, k[:, n:], v[:, n:], None, **kw)
    t = torch.arange(seen, seen + s, device=q.device)
    delta = torch.clamp(t, max=cap - 1) - (kept + torch.arange(s, device=q.device))
    qs = rotate_halves(q, (delta.to(torch.float64)[:, None] * layer._angles[None, :])[:, None, :])
    acc = acc_dtype(q.dtype)
    g = q.shape[2] // k.shape[2]
    ks = k[:, :n].to(acc).repeat_interleave(g, dim=2)
    vs = v[:, :n].to(acc).repeat_interleave(g, dim=2)
    sc = torch.einsum("bihd,bjhd->bhij", qs.to(acc), ks) * scale
    if softcap > 0:
        sc = softcap * torch.tanh(sc / softcap)
    j = torch.arange(n, device=q.device)
    ok = j[None, :] <= t[:, None]  # causal (a sink token can be in this chunk)
    if sliding_left >= 0:
        ok &= torch.clamp(t, max=cap - 1)[:, None] - j[None, :] <= sliding_left
    sc = sc.masked_fill(~ok, float("-inf"))
    lse_s = torch.logsumexp(sc, dim=-1)  # (b, h, s), -inf where no sink token is visible
    p = torch.exp(sc - torch.where(torch.isfinite(lse_s), lse_s, torch.zeros_like(lse_s))[..., None])
    out_s = torch.einsum("bhij,bjhd->bihd", p, vs).to(q.dtype)
    # the op (not the public wrapper) also merges float64 states in float64
    return torch.ops.sinkattn.merge_attn_states(out_w, lse_w, out_s, lse_s.float(), s_aux)[0]
