"""Hugging Face transformers integration: the "sinkattn" attention implementation and SinkCache.

    import sinkattn.integrations.transformers as sat
    sat.register()                                   # adds "sinkattn" to transformers' registries
    model = AutoModelForCausalLM.from_pretrained("openai/gpt-oss-20b", attn_implementation="sinkattn")
    # or: model.set_attn_implementation("sinkattn")

    # StreamingLLM: generate past the context with a fixed-size cache
    cache = sat.SinkCache.from_model(model, capacity=1024, sink_tokens=4)
    model.generate(input_ids, past_key_values=cache, max_new_tokens=20_000)

    # StreamingLLM's mask (first 4 tokens + a 508-token window) on any model, no cache needed
    sat.set_streaming(model, sink_tokens=4, window=508)

The attention function reads what transformers' attention modules pass: `s_aux` (gpt-oss's learnable
sinks, a parameter: its gradient flows), `sliding_window`, `scaling`, `softcap`, the causality
(`is_causal` or `module.is_causal`) and the attention mask. Masks are built by transformers' SDPA
mask builder (registered under the same name). No mask means plain causal (or full) attention,
aligned bottom-right, which the kernels run directly. A boolean or additive 4-D mask is checked: when
it is the causal/sliding-window pattern over padded sequences (left or right padding, as `generate`
and padded training batches produce), the padding is packed away and the kernels run varlen; any
other mask (an additive bias, a custom pattern) runs a dense PyTorch fallback that computes the same
thing, with a one-time MaskFallbackWarning. Dropout is not supported (the attention is exact).

Supported transformers releases: 5.24 and later; tested on 5.24.0, the release `make deps` pins. SinkCache
refuses any release before 5.24 with a SinkattnRuntimeError naming the upgrade (`pip install
"transformers>=5.24"`): there the models ignore `cache=` and build their own growing cache, a silent no-op
(transformers_streaming.py). The attention implementation and set_streaming import on any 5.x, but only
5.24 is tested (their tests also passed on 5.19.0, run once by hand). SinkCache refuses padded batches (left padding would become the sink tokens); the attention
implementation and set_streaming handle them.

transformers is imported by this module only; `import sinkattn` never needs it.
"""
from __future__ import annotations


import torch
import torch.nn.functional as F

try:
    import transformers  # noqa: F401
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    from transformers.modeling_utils import AttentionInterface
except ImportError as _e:  # pragma: no cover - exercised only without transformers
    raise ImportError("sinkattn.integrations.transformers needs Hugging Face transformers >= 5.24: "
                      "pip install 'transformers>=5.24,<6'") from _e

from .. import reference
from .._checks import default_scale
from ..mask import Mask, visible_rectangle
from ..errors import SinkattnValueError, warn_once
from ..interface import flash_attn_varlen_with_sinks, flash_attn_with_sinks
from ..layout import acc_dtype
from .transformers_streaming import (STREAM_KWARG, SinkCache, SinkCacheLayer, chunk_attention,  # noqa: F401
                                     needs_chunk_path)

NAME = "sinkattn"
__all__ = ["NAME", "register", "set_streaming", "sinkattn_attention_forward", "SinkCache", "SinkCacheLayer",
           "MaskFallbackWarning"]
# Config attributes read by the attention function (any model): StreamingLLM's mask without a cache.
SINK_TOKENS_ATTR, WINDOW_ATTR = "sinkattn_sink_tokens", "sinkattn_window"


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
    rows and keys of each row that can see anything are cut out (mask.visible_rectangle) and run as
    one varlen call per distinct window."""
    b, sq, h, d = q.shape
    sk = k.shape[1]
    groups = {}
    for bi, (first, end) in enumerate(ranges):
        rect = visible_rectangle(sq, end - first, (sk - sq) - first, left, right) if end > first else None
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
    warn_once(_warned, f"sinkattn (transformers): {reason}; computing attention with a dense PyTorch fallback",
              MaskFallbackWarning, stacklevel=3)


def _dense(q, k, v, sinks, mask, scale, softcap):
    """Exact attention under an arbitrary 4-D mask (bool: True = visible; float: added to the scores,
    <= finfo.min / 2 = masked), in PyTorch (fp32 math, float64 for float64)."""
    acc = acc_dtype(q.dtype)
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


def set_streaming(model, sink_tokens: int = 4, window: int | None = None):
    """StreamingLLM's attention pattern for any model (Llama passes no window of its own), for prefill and
    generation: each query sees the first `sink_tokens` tokens and the `window` most recent ones up to itself
    (sinkattn's window_size=(window - 1, 0), sink_tokens), at the model's own positions (section 1 of the
    design). Stored on the config (so save_pretrained keeps it) as `sinkattn_sink_tokens` / `sinkattn_window`,
    which the "sinkattn" attention function reads; this also registers and selects that function. A model
    with its own sliding window keeps the narrower of the two. For a bounded cache with positions inside it,
    use SinkCache instead (or as well). Returns the model."""
    for name, val, low in (("sink_tokens", sink_tokens, 0), ("window", 1 if window is None else window, 1)):
        if isinstance(val, bool) or not isinstance(val, int) or val < low:
            raise SinkattnValueError(f"set_streaming: {name} must be an int >= {low}; got {val!r}")
    register()
    configs = [model.config] + ([model.config.get_text_config()] if hasattr(model.config, "get_text_config") else [])
    for cfg in configs:
        setattr(cfg, SINK_TOKENS_ATTR, sink_tokens)
        setattr(cfg, WINDOW_ATTR, window)
    model.set_attn_implementation(NAME)
    return model


def _streaming_dense(q, k, v, s_aux, mask, left, right, n_sink, scale, cap):
    """A padded or custom mask intersected with the sink-token window: each row's sink tokens are its first
    n_sink valid keys (left padding moves them), the window is counted in key indices (bottom-right)."""
    sq, sk = q.shape[1], k.shape[1]
    m = _as_bool(mask, q.shape[2])
    valid = (m if m is not None else mask[:, 0] > torch.finfo(mask.dtype).min / 2).expand(q.shape[0], sq, sk).any(1)
    sink_col = valid & (valid.long().cumsum(-1) <= n_sink)
    band = _visible(sq, sk, left, right, q.device)
    near = band[None] | (sink_col[:, None, :] & _visible(sq, sk, -1, right, q.device)[None])
    if m is not None:
        return _dense(q, k, v, s_aux, (m & near)[:, None], scale, cap)
    return _dense(q, k, v, s_aux, mask.masked_fill(~near[:, None], torch.finfo(mask.dtype).min), scale, cap)


def _attend(q, k, v, s_aux, kw):
    """flash_attn_with_sinks, except that CPU inference calls of decode size go straight to the reference
    backend (its direct path): CPU tensors run that backend anyway, and at one query the op wrapper's checks
    and dispatch cost as much as the attention itself (measured: bench/studies/cpu_decode.py)."""
    if q.device.type == "cpu" and q.shape[1] <= reference.DIRECT_MAX_ROWS and not torch.is_grad_enabled() \
            and not torch.compiler.is_compiling():
        left, right = kw["window_size"]
        mask = Mask(kw["softmax_scale"], left, right, kw.get("sink_tokens", 0), kw["softcap"])
        return reference.attention_fwd(q, k, v, s_aux, mask, need_lse=False)[0]
    return flash_attn_with_sinks(q, k, v, s_aux, **kw)


def sinkattn_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                               sliding_window=None, softcap=None, s_aux=None, is_causal=None, **kwargs):
    """transformers attention interface: query (b, h, sq, d), key/value (b, hk, sk, d) ->
    (attn_output (b, sq, h, d), None). Also reads the config's sinkattn_sink_tokens / sinkattn_window
    (set_streaming) and, for a chunk through a SinkCache past its capacity, computes per-token StreamingLLM."""
    if dropout:
        raise SinkattnValueError(f"sinkattn (transformers): attention dropout ({dropout}) is not supported; set "
                                 f"config.attention_dropout = 0.0")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    b, h, sq, d = query.shape
    sk = key.shape[2]
    if sliding_window:
        left, right = (int(sliding_window) - 1, 0) if causal else (int(sliding_window), int(sliding_window))
    else:
        left, right = (-1, 0) if causal else (-1, -1)
    cap = float(softcap) if softcap else 0.0
    scale = float(scaling) if scaling is not None else default_scale(d)
    stream = kwargs.get(STREAM_KWARG)
    if stream is not None and needs_chunk_path(stream, module.layer_idx):
        # (SinkCache streams equal-length rows without padding, so the mask is the causal band: not read)
        return chunk_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), s_aux, stream,
                               module.layer_idx, scale, cap, left), None
    # StreamingLLM's mask from the config (set_streaming), on top of the model's own pattern
    config = getattr(module, "config", None)
    window = getattr(config, WINDOW_ATTR, None)
    n_sink = int(getattr(config, SINK_TOKENS_ATTR, 0) or 0) if window else 0
    s_left = left if not window else (window - 1 if left < 0 else min(left, window - 1))
    if attention_mask is None and query.device.type == "cpu" and not torch.is_grad_enabled() \
            and not torch.compiler.is_compiling():
        # CPU inference of decode size, straight on transformers' layout (see reference.decode_bhsd)
        out = reference.decode_bhsd(query, key, value, s_aux, Mask(scale, s_left, right, n_sink, cap))
        if out is not None:
            return out, None
    kw = dict(softmax_scale=scale, window_size=(s_left, right), softcap=cap)
    if n_sink:
        kw["sink_tokens"] = n_sink
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    if attention_mask is None:
        return _attend(q, k, v, s_aux, kw), None
    plan = _plan(attention_mask, b, sq, sk, left, right, h)
    if plan[0] == "full":
        return _attend(q, k, v, s_aux, kw), None
    if plan[0] == "varlen" and not n_sink:
        return _run_ranges(q, k, v, s_aux, plan[1], s_left, right, kw), None
    if plan[0] == "dense":
        _warn_once("the attention mask is not the causal/sliding-window pattern over (left- or right-) padded "
                   "sequences (an additive bias, a per-head mask, packed sequences or a custom pattern)")
    if window:
        return _streaming_dense(q, k, v, s_aux, attention_mask, s_left, right, n_sink, scale, cap), None
    return _dense(q, k, v, s_aux, attention_mask, scale, cap), None
