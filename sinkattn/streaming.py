"""StreamingLLM: a fixed-size KV cache that keeps the first tokens forever and a rolling window.

`SinkKVCache` holds, per layer, at most `capacity` tokens: the first `sink_tokens` tokens of the
stream (the "attention sinks" of StreamingLLM, Xiao et al. 2023), kept forever, and the most recent
`capacity - sink_tokens` tokens. Memory is allocated once and never grows, however long the stream.

Semantics (those of StreamingLLM's reference implementation):

- A step appends `s` new tokens. If they do not fit, the oldest window tokens are evicted first to
  make room ("evict for space"); then the new tokens join the cache and attend causally over
  everything the cache holds: every retained token, plus the new tokens up to themselves.
- Positions are assigned inside the cache, not in the original text: the cached tokens, in stream
  order, get positions 0..L-1 (the sink tokens 0..n-1, then the window), the new tokens L, L+1, ...
  Keys are stored *before* RoPE and rotated at these positions when they are read, so a token's
  position changes as the window slides, and positions never exceed `capacity - 1`.
- A chunk longer than the window is split into window-sized pieces, processed in order.

Storage. Per layer, k and v are (batch, capacity, nheads_k, headdim): slots [0, n) hold the sink
tokens, slots [n, capacity) are a ring of W = capacity - n entries; window token u (u >= n, counted
from the start of the stream) lives in ring slot (u - n) mod W. Appending a token writes its slot and
nothing else: O(1) per token, the window is never shifted or re-copied. The cache state is a single
number per layer, the tokens seen; everything else (which slots are live, their order) follows.

Reading (why a rotated view, not the ring itself). The kernels take a contiguous cache in logical
order with the keys already rotated: `flash_attn_with_kvcache` rotates only q and the *new* k. Keys
stored before RoPE therefore need one rotation pass per read at their current positions, whatever
the layout; we write that pass into a per-layer scratch cache (allocated once) in logical order,
which also hides the ring's wrap-around, and hand the new tokens to `flash_attn_with_kvcache` with
the rotary tables, so q and the new keys are rotated and appended by the op itself. The pass costs
O(capacity) per step, the same order as the attention, which reads every cached key anyway, so
throughput stays flat. The rotated sink keys never change and are written once.
Without RoPE (no rotary tables) nothing needs rotating and the ring is used in place, zero-copy,
whenever its order cannot matter: until the cache first fills (physical order == logical order,
and the op appends straight into the ring), and for single-token decode afterwards (one query sees
every cached key, so key order is irrelevant). Other cases (a multi-token chunk over a wrapped ring)
gather into the scratch cache.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ._checks import check_bool, check_int, check_no_grad_needed, check_rotary_tables
from .errors import SinkattnTypeError, SinkattnValueError
from .interface import flash_attn_with_kvcache
from .rotary import apply_rotary


@dataclass(frozen=True)
class StreamStats:
    """Counters of a SinkKVCache (layer 0; all layers move in lockstep)."""
    tokens_seen: int      # tokens appended since the start (or the last reset)
    evicted: int          # tokens dropped from the window
    length: int           # tokens held now: min(tokens_seen, capacity)
    capacity: int
    sink_tokens: int

    @property
    def occupancy(self) -> float:
        """Fraction of the capacity in use (1.0 once the cache has filled)."""
        return self.length / self.capacity


def ring_slots(tokens: torch.Tensor, sink_tokens: int, window: int) -> torch.Tensor:
    """Storage slot of each stream token index (tokens currently held): sink token u < n in slot u,
    window token u in ring slot n + (u - n) mod window. Shared with the transformers SinkCache."""
    n = sink_tokens
    return torch.where(tokens < n, tokens, n + (tokens - n) % window)


class SinkKVCache:
    """A StreamingLLM KV cache for `num_layers` layers (see the module docstring).

    Args:
        capacity: tokens held per layer (sink tokens + window); must exceed sink_tokens.
        sink_tokens: the first tokens of the stream, kept forever (StreamingLLM uses 4).
        num_layers, batch_size, num_kv_heads, head_dim, dtype, device: the cache tensors.
        rotary_cos, rotary_sin: optional RoPE tables (max_position, rotary_dim / 2), FlashAttention's
            layout; positions inside the cache reach capacity - 1, so the tables need >= capacity rows.
            Without them no rotation is applied (models without RoPE, or keys rotated elsewhere).
        rotary_interleaved: GPT-J pairs (True) or GPT-NeoX halves (False, the Llama/gpt-oss layout).

    Use: for each step and each layer in order, `out = cache.attend(layer, q, k, v, sinks=...)` with
    q (batch, s, nheads, head_dim) and k, v (batch, s, nheads_k, head_dim), all *before* RoPE. It
    appends k/v and returns the attention output (batch, s, nheads, head_dim) (and the lse with
    return_lse=True). The batch's streams advance together.
    """

    def __init__(self, capacity: int, sink_tokens: int = 4, *, num_layers: int, batch_size: int,
                 num_kv_heads: int, head_dim: int, dtype: torch.dtype = torch.float32, device=None,
                 rotary_cos: torch.Tensor | None = None, rotary_sin: torch.Tensor | None = None,
                 rotary_interleaved: bool = False):
        for name, value, minimum in (("capacity", capacity, 1), ("sink_tokens", sink_tokens, 0),
                                     ("num_layers", num_layers, 1), ("batch_size", batch_size, 1),
                                     ("num_kv_heads", num_kv_heads, 1), ("head_dim", head_dim, 1)):
            check_int(name, value, minimum, who="SinkKVCache")
        if capacity <= sink_tokens:
            raise SinkattnValueError(
                f"SinkKVCache: capacity ({capacity}) must exceed sink_tokens ({sink_tokens}): the cache keeps "
                f"{sink_tokens} sink tokens forever and needs at least one more slot for the rolling window; "
                f"accepted: capacity >= {sink_tokens + 1}")
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise SinkattnTypeError(f"SinkKVCache: dtype must be a floating torch.dtype; got {dtype!r}")
        check_bool("rotary_interleaved", rotary_interleaved, who="SinkKVCache")
        device = torch.device(device) if device is not None else torch.device("cpu")
        check_rotary_tables(rotary_cos, rotary_sin, head_dim, who="SinkKVCache")
        if rotary_cos is not None:
            if rotary_cos.shape[0] < capacity:
                raise SinkattnValueError(
                    f"SinkKVCache: position overflow: the rotary tables have {rotary_cos.shape[0]} positions but "
                    f"the cache assigns positions up to capacity - 1 = {capacity - 1}; accepted: tables with at "
                    f"least {capacity} rows (or a smaller capacity)")
            rotary_cos, rotary_sin = rotary_cos.to(device), rotary_sin.to(device)
        self.capacity, self.sink_tokens, self.window = capacity, sink_tokens, capacity - sink_tokens
        self.num_layers, self.batch_size = num_layers, batch_size
        self.num_kv_heads, self.head_dim, self.dtype, self.device = num_kv_heads, head_dim, dtype, device
        self.rotary_cos, self.rotary_sin, self.rotary_interleaved = rotary_cos, rotary_sin, rotary_interleaved
        shape = (num_layers, batch_size, capacity, num_kv_heads, head_dim)
        # Pre-RoPE keys and values, ring layout (see the module docstring).
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        # The rotated, logically ordered view handed to the kernel (allocated on first need).
        self._scratch_k: torch.Tensor | None = None
        self._scratch_v: torch.Tensor | None = None
        self._scratch_sinks_ready = [0] * num_layers  # rotated sink keys already in the scratch
        self._seen = [0] * num_layers
        self.last_read = None  # "zero-copy" or "rotated-view" / "gathered-view": how the last step read

    # ---- state --------------------------------------------------------------------------------
    def tokens_seen(self, layer: int = 0) -> int:
        return self._seen[layer]

    def length(self, layer: int = 0) -> int:
        """Tokens held by `layer` now."""
        return min(self._seen[layer], self.capacity)

    def stats(self) -> StreamStats:
        seen = self._seen[0]
        return StreamStats(tokens_seen=seen, evicted=seen - min(seen, self.capacity), length=min(seen, self.capacity),
                           capacity=self.capacity, sink_tokens=self.sink_tokens)

    @property
    def nbytes(self) -> int:
        """Bytes held by the cache's tensors (constant once the first step has run)."""
        tensors = [self.k, self.v, self._scratch_k, self._scratch_v]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def held_tokens(self, layer: int = 0) -> list[int]:
        """Stream indices of the tokens `layer` holds, in cache (position) order."""
        seen = self._seen[layer]
        n_s = min(seen, self.sink_tokens)
        w = self.length(layer) - n_s
        return list(range(n_s)) + list(range(seen - w, seen))

    def reset(self) -> None:
        """Forget every stream (the memory stays allocated)."""
        self._seen = [0] * self.num_layers
        self._scratch_sinks_ready = [0] * self.num_layers

    # ---- slots ----------------------------------------------------------------------------------
    def _slots(self, first: int, count: int) -> torch.Tensor:
        """Storage slots of the stream tokens first .. first+count-1 (all currently held)."""
        return ring_slots(torch.arange(first, first + count, device=self.device), self.sink_tokens, self.window)

    def _write(self, layer: int, first: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store tokens first.. (pre-RoPE) in their slots: O(s), nothing else moves."""
        slots = self._slots(first, k.shape[1])
        self.k[layer].index_copy_(1, slots, k)
        self.v[layer].index_copy_(1, slots, v)

    # ---- the step -------------------------------------------------------------------------------
    def _check_step(self, layer, q, k, v):
        check_int("layer", layer, 0, who="SinkKVCache")
        if layer >= self.num_layers:
            raise SinkattnValueError(f"SinkKVCache: layer {layer} out of range; this cache was built for "
                                     f"num_layers={self.num_layers} (layers 0..{self.num_layers - 1})")
        for name, t in (("q", q), ("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4:
                raise SinkattnValueError(
                    f"SinkKVCache: {name} must be a 4-D tensor (batch, seqlen, heads, head_dim); got "
                    + (f"shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__))
        b, s = q.shape[:2]
        want = (self.batch_size, s, self.num_kv_heads, self.head_dim)
        for name, t in (("k", k), ("v", v)):
            if tuple(t.shape) != want:
                raise SinkattnValueError(
                    f"SinkKVCache: {name} has shape {tuple(t.shape)}; this cache holds (batch, seqlen, nheads_k, "
                    f"head_dim) = {want} (mismatched layers or a cache built for another model?)")
            if t.dtype != self.dtype or t.device != self.device:
                raise SinkattnTypeError(f"SinkKVCache: {name} is {t.dtype} on {t.device}; this cache holds "
                                        f"{self.dtype} on {self.device}")
        if b != self.batch_size or q.shape[-1] != self.head_dim or q.shape[2] % self.num_kv_heads:
            raise SinkattnValueError(
                f"SinkKVCache: q has shape {tuple(q.shape)}; accepted: (batch={self.batch_size}, seqlen, nheads, "
                f"head_dim={self.head_dim}) with nheads a multiple of num_kv_heads={self.num_kv_heads}")
        seen = self._seen[layer]
        if layer == 0:
            behind = [i for i in range(1, self.num_layers) if self._seen[i] != seen]
            if behind:
                raise SinkattnValueError(
                    f"SinkKVCache: mismatched layers: layer 0 starts a new step but layer {behind[0]} has seen "
                    f"{self._seen[behind[0]]} tokens and layer 0 {seen}; every step must run layers 0.."
                    f"{self.num_layers - 1} in order with the same tokens")
        elif seen + s != self._seen[layer - 1]:
            raise SinkattnValueError(
                f"SinkKVCache: mismatched layers: layer {layer} has seen {seen} tokens and gets {s} more, but "
                f"layer {layer - 1} has seen {self._seen[layer - 1]}; every step must run layers 0.."
                f"{self.num_layers - 1} in order with the same tokens")

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks=None, *,
               softmax_scale=None, softcap: float = 0.0, return_lse: bool = False, backend: str = "auto",
               s_aux=None):
        """Append k, v (pre-RoPE) to `layer` and attend with q (pre-RoPE) over the cache.

        q (batch, s, nheads, head_dim); k, v (batch, s, nheads_k, head_dim); sinks / s_aux (nheads,)
        learnable sink logits (optional). Returns out (batch, s, nheads, head_dim), or (out, lse) with
        lse float32 (batch, nheads, s). Query i of the step sits at cache position L + i, where L is the
        number of tokens kept after making room, and sees every kept token and new tokens <= i.
        """
        self._check_step(layer, q, k, v)
        # Before any write: a refused call must not have overwritten a slot of the ring (it would lose a token).
        check_no_grad_needed("SinkKVCache.attend", {"q": q, "k": k, "v": v, "sinks": sinks, "s_aux": s_aux})
        s = q.shape[1]
        if s == 0:
            out = q.new_zeros(q.shape)
            return (out, torch.zeros((q.shape[0], q.shape[2], 0), dtype=torch.float32, device=q.device)) \
                if return_lse else out
        outs, lses = [], []
        for i0 in range(0, s, self.window):  # a chunk longer than the window: window-sized pieces
            i1 = min(s, i0 + self.window)
            out, lse = self._step(layer, q[:, i0:i1], k[:, i0:i1], v[:, i0:i1], sinks, s_aux, softmax_scale,
                                  softcap, backend)
            outs.append(out)
            lses.append(lse)
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        if not return_lse:
            return out
        return out, (lses[0] if len(lses) == 1 else torch.cat(lses, dim=2))

    def _step(self, layer, q, k, v, sinks, s_aux, softmax_scale, softcap, backend):
        s = q.shape[1]
        seen, cap = self._seen[layer], self.capacity
        kept = min(seen, cap) - max(0, min(seen, cap) + s - cap)  # old tokens kept after making room
        kw = dict(sinks=sinks, s_aux=s_aux, softmax_scale=softmax_scale, causal=True, softcap=softcap,
                  return_lse=True, backend=backend)
        kl, vl = self.k[layer], self.v[layer]
        if self.rotary_cos is None and seen + s <= cap:
            # Not yet full: slots == stream order; the op appends straight into the ring.
            self.last_read = "zero-copy"
            out, lse = flash_attn_with_kvcache(q, kl, vl, k=k, v=v, cache_seqlens=seen, **kw)
        elif self.rotary_cos is None and s == 1:
            # One query sees every cached key: order is irrelevant, attend over the ring as it lies.
            self.last_read = "zero-copy"
            self._write(layer, seen, k, v)
            out, lse = flash_attn_with_kvcache(q, kl, vl, cache_seqlens=cap, **kw)
        else:
            self.last_read = "rotated-view" if self.rotary_cos is not None else "gathered-view"
            sk, sv = self._view(layer, seen, kept)
            rot = {} if self.rotary_cos is None else dict(rotary_cos=self.rotary_cos, rotary_sin=self.rotary_sin,
                                                           rotary_interleaved=self.rotary_interleaved)
            # q and the new keys are rotated at positions kept + i and appended to the view by the op.
            out, lse = flash_attn_with_kvcache(q, sk, sv, k=k, v=v, cache_seqlens=kept, **rot, **kw)
            self._write(layer, seen, k, v)
        self._seen[layer] = seen + s
        return out, lse

    def _view(self, layer, seen, kept):
        """Fill the scratch cache with the `kept` retained tokens in position order (keys rotated)."""
        if self._scratch_k is None:
            shape = (self.num_layers, self.batch_size, self.capacity, self.num_kv_heads, self.head_dim)
            self._scratch_k = torch.zeros(shape, dtype=self.dtype, device=self.device)
            self._scratch_v = torch.zeros(shape, dtype=self.dtype, device=self.device)
        sk, sv = self._scratch_k[layer], self._scratch_v[layer]
        n_s = min(seen, self.sink_tokens)
        w = kept - n_s
        done = self._scratch_sinks_ready[layer]
        if done < n_s:  # sink keys: rotated once at their fixed positions 0..n-1
            self._put(sk, sv, layer, first=done, count=n_s - done, pos0=done)
            self._scratch_sinks_ready[layer] = n_s
        if w > 0:  # the window: its positions shift as it slides, so it is rotated on every read
            self._put(sk, sv, layer, first=seen - w, count=w, pos0=n_s)
        return sk, sv

    def _put(self, sk, sv, layer, first, count, pos0):
        slots = self._slots(first, count)
        keys = self.k[layer].index_select(1, slots)
        if self.rotary_cos is not None:
            pos = torch.arange(pos0, pos0 + count, device=self.device)
            keys = apply_rotary(keys, self.rotary_cos, self.rotary_sin, pos, self.rotary_interleaved)
        sk[:, pos0:pos0 + count].copy_(keys)
        sv[:, pos0:pos0 + count].copy_(self.v[layer].index_select(1, slots))
