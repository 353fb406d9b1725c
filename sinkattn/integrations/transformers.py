"""Hugging Face transformers integration: the "sinkattn" attention implementation and SinkCache.

    import sinkattn.integrations.transformers as sat
    sat.register()                                   # adds "sinkattn" to transformers' registries
    model = AutoModelForCausalLM.from_pretrained("openai/gpt-oss-20b", attn_implementation="sinkattn")
    # or: model.set_attn_implementation("sinkattn")

    # StreamingLLM: generate past the context with a fixed-size cache
    cache = sat.SinkCache.from_model(model, capacity=1024, sink_tokens=4)
    model.generate(input_ids, past_key_values=cache, max_new_tokens=20_000)

The attention function reads what transformers' attention modules pass: `s_aux` (gpt-oss's learnable
sinks, a parameter: its gradient flows), `sliding_window`, `scaling`, `softcap`, the causality
(`is_causal` or `module.is_causal`) and the attention mask. Masks are built by transformers' SDPA
mask builder (registered under the same name). No mask means plain causal (or full) attention,
aligned bottom-right, which the kernels run directly. A boolean or additive 4-D mask is checked: when
it is the causal/sliding-window pattern over padded sequences (left or right padding, as `generate`
and padded training batches produce), the padding is packed away and the kernels run varlen; any
other mask (an additive bias, a custom pattern) runs a dense PyTorch fallback that computes the same
thing, with a one-time MaskFallbackWarning. Dropout is not supported (the attention is exact).

transformers is imported by this module only; `import sinkattn` never needs it.
"""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

try:
    import transformers  # noqa: F401
    from transformers.cache_utils import Cache, CacheLayerMixin
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    from transformers.modeling_utils import AttentionInterface
except ImportError as _e:  # pragma: no cover - exercised only without transformers
    raise ImportError("sinkattn.integrations.transformers needs Hugging Face transformers >= 5: "
                      "pip install 'transformers>=5,<6'") from _e

from ..distributed import _rectangle
from ..errors import SinkattnRuntimeError, SinkattnValueError
from ..interface import flash_attn_varlen_with_sinks, flash_attn_with_sinks

NAME = "sinkattn"
__all__ = ["NAME", "register", "sinkattn_attention_forward", "SinkCache", "SinkCacheLayer", "MaskFallbackWarning"]


class MaskFallbackWarning(UserWarning):
    """An attention mask was neither causal/sliding-window over padded sequences nor absent, so a dense
    PyTorch path computed the attention (correct, but not the fused kernels)."""


_warned = set()


def register(name: str = NAME) -> str:
    """Register the attention function and its mask builder under `name` (idempotent); returns name."""
    AttentionInterface.register(name, sinkattn_attention_forward)
    AttentionMaskInterface.register(name, _mask_builder)
    return name


def _mask_builder(*args, **kwargs):
    """transformers' SDPA mask (boolean, True = visible), except that "no mask" always means causal
    aligned bottom-right: SDPA also skips the mask for a prefill into an empty static cache (more keys
    than queries, aligned top-left), which we materialise instead."""
    mask = sdpa_mask(*args, **kwargs)
    q_length = kwargs.get("q_length", args[1] if len(args) > 1 else None)
    kv_length = kwargs.get("kv_length", args[2] if len(args) > 2 else None)
    if mask is None and kwargs.get("allow_is_causal_skip", True) and q_length is not None and kv_length is not None \
            and 1 < q_length < kv_length:
        mask = sdpa_mask(*args, **{**kwargs, "allow_is_causal_skip": False})
    return mask


def _visible(sq, sk, left, right, device):
    i = torch.arange(sq, device=device)[:, None]
    j = torch.arange(sk, device=device)[None, :]
    off = sk - sq
    ok = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if right >= 0:
        ok &= j <= i + off + right
    if left >= 0:
        ok &= j >= i + off - left
    return ok


def _as_bool(mask: torch.Tensor, nheads: int):
    """(batch, 1|h, sq, sk) bool (True = visible), or None when the mask carries more than visibility
    (an additive bias) or differs per head."""
    if mask.dtype != torch.bool:
        if not mask.is_floating_point():
            return None
        masked = mask <= torch.finfo(mask.dtype).min / 2
        if not torch.all((mask == 0) | masked | torch.isneginf(mask)):
            return None  # a bias, not a visibility mask
        mask = ~masked & ~torch.isneginf(mask)
    if mask.dim() != 4:
        return None
    if mask.shape[1] != 1:
        if not torch.equal(mask, mask[:, :1].expand_as(mask)):
            return None
    return mask[:, 0]


def _plan(mask, batch, sq, sk, left, right, nheads):
    """How to run a masked call.

    transformers' masks are the causal / sliding-window band over positions (bottom-right aligned for
    its caches) with padded keys removed: mask = band & key_valid[None, :]. When the mask has exactly
    that form and each row's valid keys are one contiguous range (left or right padding, or keys no
    query can see), the kernels run it: ("full",) when no key is dropped, else ("varlen", ranges) with
    ranges[b] = (first, end) of row b's keys. Padded query rows keep their positions, as in eager
    attention. Anything else: ("dense", None)."""
    m = _as_bool(mask, nheads)
    if m is None or m.shape[-2:] != (sq, sk) or m.shape[0] not in (1, batch):
        return ("dense", None)
    m = m.expand(batch, sq, sk)
    band = _visible(sq, sk, left, right, m.device)
    keys = m.any(1)  # (batch, sk)
    if not torch.equal(m, band[None] & keys[:, None, :]):
        return ("dense", None)
    if bool(keys.all()):
        return ("full",)
    ranges = []
    for row in keys:
        idx = row.nonzero().flatten()
        if idx.numel() == 0:
            ranges.append((0, 0))
            continue
        first, end = int(idx[0]), int(idx[-1]) + 1
        if end - first != idx.numel():
            return ("dense", None)  # holes: not padding
        ranges.append((first, end))
    return ("varlen", ranges)


def _run_ranges(q, k, v, sinks, ranges, left, right, kw):
    """Each row b attends over its keys ranges[b] with the band kept at its original positions: the
    rows and keys of each row that can see anything are cut out (distributed._rectangle) and run as
    one varlen call per distinct window."""
    b, sq, h, d = q.shape
    sk = k.shape[1]
    groups = {}
    for bi, (first, end) in enumerate(ranges):
        rect = _rectangle(sq, end - first, (sk - sq) - first, left, right) if end > first else None
        if rect is not None:
            r0, r1, c0, c1, wl, wr = rect
            groups.setdefault((wl, wr), []).append((bi, r0, r1, first + c0, first + c1))
    pieces = {}
    for (wl, wr), members in groups.items():
        qs = torch.cat([q[bi, r0:r1] for bi, r0, r1, _, _ in members])
        ks = torch.cat([k[bi, c0:c1] for bi, _, _, c0, c1 in members])
        vs = torch.cat([v[bi, c0:c1] for bi, _, _, c0, c1 in members])
        nq = [r1 - r0 for _, r0, r1, _, _ in members]
        nk = [c1 - c0 for _, _, _, c0, c1 in members]
        cu = lambda n: torch.tensor([0] + torch.tensor(n).cumsum(0).tolist(), dtype=torch.int32,  # noqa: E731
                                    device=q.device)
        out = flash_attn_varlen_with_sinks(qs, ks, vs, cu(nq), cu(nk), max(nq), max(nk), sinks,
                                           **{**kw, "window_size": (wl, wr)})
        for (bi, r0, r1, _, _), piece in zip(members, out.split(nq)):
            pieces[bi] = F.pad(piece, (0, 0, 0, 0, r0, sq - r1))
    zero = q.new_zeros((sq, h, d))
    return torch.stack([pieces.get(bi, zero) for bi in range(b)])


def _warn_once(reason):
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"sinkattn (transformers): {reason}; computing attention with a dense PyTorch fallback",
                      MaskFallbackWarning, stacklevel=3)


def _dense(q, k, v, sinks, mask, scale, softcap):
    """Exact attention under an arbitrary 4-D mask (bool: True = visible; float: added to the scores,
    <= finfo.min / 2 = masked), in PyTorch (fp32 math, float64 for float64)."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    b, sq, h, d = q.shape
    g = h // k.shape[2]
    kk = k.to(acc).repeat_interleave(g, dim=2)
    vv = v.to(acc).repeat_interleave(g, dim=2)
    s = torch.einsum("bihd,bjhd->bhij", q.to(acc), kk) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    if mask.dtype == torch.bool:
        ok = mask
    else:
        ok = mask > torch.finfo(mask.dtype).min / 2
        s = s + torch.where(ok, mask, torch.zeros((), dtype=mask.dtype, device=mask.device)).to(acc)
    s = s.masked_fill(~ok, float("-inf"))
    sink = torch.full((h,), float("-inf"), dtype=acc, device=q.device) if sinks is None else sinks.to(acc)
    logits = torch.cat([s, sink.view(1, h, 1, 1).expand(b, h, sq, 1)], dim=-1)
    live = torch.isfinite(logits).any(-1, keepdim=True)
    logits = torch.where(live, logits, torch.zeros_like(logits))
    p = torch.softmax(logits, dim=-1)[..., :-1]
    p = torch.where(live, p, torch.zeros_like(p))
    return torch.einsum("bhij,bjhd->bihd", p, vv).to(q.dtype)


def sinkattn_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                               sliding_window=None, softcap=None, s_aux=None, is_causal=None, **kwargs):
    """transformers attention interface: query (b, h, sq, d), key/value (b, hk, sk, d) ->
    (attn_output (b, sq, h, d), None)."""
    if dropout:
        raise SinkattnValueError(f"sinkattn (transformers): attention dropout ({dropout}) is not supported; set "
                                 f"config.attention_dropout = 0.0")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    b, sq, h, d = q.shape
    sk = k.shape[1]
    if sliding_window:
        left, right = (int(sliding_window) - 1, 0) if causal else (int(sliding_window), int(sliding_window))
    else:
        left, right = (-1, 0) if causal else (-1, -1)
    cap = float(softcap) if softcap else 0.0
    scale = float(scaling) if scaling is not None else d ** -0.5
    kw = dict(softmax_scale=scale, window_size=(left, right), softcap=cap)
    if attention_mask is None:
        return flash_attn_with_sinks(q, k, v, s_aux, **kw), None
    plan = _plan(attention_mask, b, sq, sk, left, right, h)
    if plan[0] == "full":
        return flash_attn_with_sinks(q, k, v, s_aux, **kw), None
    if plan[0] == "varlen":
        return _run_ranges(q, k, v, s_aux, plan[1], left, right, kw), None
    _warn_once("the attention mask is not the causal/sliding-window pattern over (left- or right-) padded "
               "sequences (an additive bias, a per-head mask, packed sequences or a custom pattern)")
    return _dense(q, k, v, s_aux, attention_mask, scale, cap), None


# ---- StreamingLLM cache ------------------------------------------------------------------------------------
def _rotate_halves(x, angle):
    """Rotate x (..., d) by `angle` (d/2,) in the GPT-NeoX (halves) layout transformers' RoPE uses."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    c, s = angle.cos().to(acc), angle.sin().to(acc)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].to(acc), x[..., half:].to(acc)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


class SinkCacheLayer(CacheLayerMixin):
    """One layer of SinkCache: `sink_tokens` first tokens kept forever plus a ring of the most recent
    `capacity - sink_tokens` (O(1) work per appended token, the window never shifted).

    transformers rotates keys before they reach the cache, at the original positions p (the cache
    reports all tokens seen, so `generate` and the model number them 0, 1, 2, ...). StreamingLLM wants
    positions inside the cache instead. Attention with RoPE depends only on query-key distances, and
    for the window those are the original ones (the window is contiguous and the query follows it),
    so window keys are used as stored. Only the sink keys must look closer than they are: each read
    rotates them forward by the number of evicted tokens, which puts them right before the window."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, capacity: int, sink_tokens: int, inv_freq: torch.Tensor):
        super().__init__()
        if capacity <= sink_tokens:
            raise SinkattnValueError(f"SinkCache: capacity ({capacity}) must exceed sink_tokens ({sink_tokens})")
        self.capacity, self.sink_tokens, self.window = capacity, sink_tokens, capacity - sink_tokens
        self.inv_freq = inv_freq.detach().to(torch.float64).cpu()
        self.seen = 0

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
        self._angles = self.inv_freq.to(self.device)
        self.is_initialized = True

    def _sizes(self, s):
        old = min(self.seen, self.capacity)
        n_s = min(self.seen, self.sink_tokens)
        evict = min(old - n_s, max(0, old + s - self.capacity))
        return old - evict, n_s  # tokens kept before the new ones, of which sink tokens

    def _slots(self, tokens):
        n = self.sink_tokens
        return torch.where(tokens < n, tokens, n + (tokens - n) % self.window)

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        s = key_states.shape[-2]
        kept, n_s = self._sizes(s)
        shift = self.seen - kept  # tokens evicted so far, this step's included
        w = kept - n_s
        dev = self.device
        old = torch.cat([torch.arange(n_s, device=dev), torch.arange(self.seen - w, self.seen, device=dev)])
        slots = self._slots(old)
        keys_old = self.keys.index_select(2, slots)
        if shift and n_s:
            keys_old = torch.cat([_rotate_halves(keys_old[:, :, :n_s], shift * self._angles), keys_old[:, :, n_s:]], 2)
        out_k = torch.cat([keys_old, key_states], dim=2)
        out_v = torch.cat([self.values.index_select(2, slots), value_states], dim=2)
        # store the new tokens that stay: the sink tokens among them and the last `window` of the rest
        new = torch.arange(self.seen, self.seen + s, device=dev)
        stay = (new < self.sink_tokens) | (new >= max(self.sink_tokens, self.seen + s - self.window))
        if bool(stay.any()):
            idx = stay.nonzero().flatten()
            self.keys.index_copy_(2, self._slots(new[idx]), key_states.index_select(2, idx))
            self.values.index_copy_(2, self._slots(new[idx]), value_states.index_select(2, idx))
        self.seen += s
        return out_k, out_v

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        kept, _ = self._sizes(query_length)
        return kept + query_length, self.seen - kept

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return self.capacity

    def reset(self) -> None:
        super().reset()
        self.seen = 0

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
    `capacity - sink_tokens`, memory fixed, positions inside the cache (see SinkCacheLayer).

    A step of s tokens first evicts the oldest window tokens to make room (s <= capacity - sink_tokens),
    then attends causally over what is kept plus the new tokens. A longer chunk (a long prompt) attends
    over the kept tokens and causally over the whole chunk, and only its last tokens are kept. For
    batches of equal-length streams without padding (positions must be 0, 1, 2, ... per row)."""

    def __init__(self, capacity: int, sink_tokens: int = 4, *, num_layers: int, inv_freq: torch.Tensor):
        super().__init__(layers=[SinkCacheLayer(capacity, sink_tokens, inv_freq) for _ in range(num_layers)])
        self.capacity, self.sink_tokens = capacity, sink_tokens

    @classmethod
    def from_model(cls, model, capacity: int, sink_tokens: int = 4) -> "SinkCache":
        """Size the cache for `model` (a transformers causal LM with RoPE)."""
        rotary = next((m for m in model.modules() if isinstance(getattr(m, "inv_freq", None), torch.Tensor)), None)
        if rotary is None:
            raise SinkattnValueError("SinkCache.from_model: no rotary embedding (a module with `inv_freq`) in this "
                                     "model; SinkCache needs RoPE")
        rope_type = getattr(rotary, "rope_type", "default")
        if rope_type in ("dynamic", "longrope"):
            raise SinkattnValueError(f"SinkCache.from_model: rope_type {rope_type!r} changes its frequencies with the "
                                     f"sequence length; SinkCache supports fixed-frequency RoPE (default, linear, "
                                     f"yarn, llama3)")
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        return cls(capacity, sink_tokens, num_layers=config.num_hidden_layers, inv_freq=rotary.inv_freq)

    def stats(self) -> dict:
        layer = self.layers[0]
        held = min(layer.seen, layer.capacity)
        return {"tokens_seen": layer.seen, "evicted": layer.seen - held, "length": held, "capacity": layer.capacity,
                "occupancy": held / layer.capacity}
