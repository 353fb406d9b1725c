"""FLOP and byte counting for the benchmarks (docs/DESIGN.md section 7).

Counts are exact, from the visibility rule of docs/DESIGN.md section 1 (bottom-right alignment,
window (left, right) with -1 = unbounded, causal = right 0, sink tokens relaxing only the left edge):

    visible(i, j) = (right < 0 or j <= i + off + right)
                    and (left < 0 or j >= i + off - left or j < sink_tokens),   off = seqlen_k - seqlen_q

Per query row the visible keys are one window interval [lo, hi] plus the sink tokens left of it, so
the count is closed-form per row and evaluated for all rows at once (int64 tensors; no O(sq * sk)
mask is ever built, so 128k x 128k costs a few milliseconds).

    forward FLOPs  = 4 * batch * nheads * headdim * visible_pairs   (QK^T and PV, 2 FLOPs per MAC)
    backward FLOPs = 2.5 * forward FLOPs                            (FlashAttention's convention)

Bytes are the fewest a kernel must move through device memory (each input read once, each output
written once): for decode, the K and V of every key visible to some query (once per KV head, GQA
does not multiply them), plus q and out.
"""
from __future__ import annotations

import torch

BWD_FACTOR = 2.5


def _rows(seqlen_q: int, seqlen_k: int, window_left: int, window_right: int, sink_tokens: int):
    """(lo, hi, n_sink_extra) per query row: window [lo, hi] (may be empty) and sink keys left of lo."""
    i = torch.arange(seqlen_q, dtype=torch.int64)
    pos = i + (seqlen_k - seqlen_q)  # the key position query i sits at
    if window_right >= 0:
        hi = torch.clamp(pos + window_right, max=seqlen_k - 1)
    else:
        hi = torch.full_like(pos, seqlen_k - 1)
    if window_left >= 0:
        lo = torch.clamp(pos - window_left, min=0)
        # Sink tokens are keys j < n that are not already in the window (j < lo) and not past the right edge.
        sink_extra = torch.clamp(torch.minimum(torch.minimum(lo, hi + 1), torch.full_like(lo, sink_tokens)), min=0)
    else:
        lo = torch.zeros_like(pos)
        sink_extra = torch.zeros_like(pos)
    return lo, hi, sink_extra


def _check_args(seqlen_q, seqlen_k, window_left, window_right, sink_tokens):
    for name, val in (("seqlen_q", seqlen_q), ("seqlen_k", seqlen_k), ("sink_tokens", sink_tokens)):
        if not isinstance(val, int) or val < 0:
            raise ValueError(f"bench.harness.flops: {name} must be an int >= 0; got {val!r}")
    for name, val in (("window_left", window_left), ("window_right", window_right)):
        if not isinstance(val, int) or val < -1:
            raise ValueError(f"bench.harness.flops: {name} must be an int >= -1 (-1 = unbounded); got {val!r}")


def normalize_window(causal: bool, window_size=(-1, -1)) -> tuple[int, int]:
    left, right = int(window_size[0]), int(window_size[1])
    if causal:
        if right > 0:
            raise ValueError(f"bench.harness.flops: causal=True with window_size right={right} > 0 is contradictory")
        right = 0
    return left, right


def visible_per_row(seqlen_q: int, seqlen_k: int, window_left: int = -1, window_right: int = -1,
                    sink_tokens: int = 0) -> torch.Tensor:
    """int64 (seqlen_q,): how many keys each query row sees."""
    _check_args(seqlen_q, seqlen_k, window_left, window_right, sink_tokens)
    if seqlen_q == 0:
        return torch.zeros(0, dtype=torch.int64)
    if seqlen_k == 0:
        return torch.zeros(seqlen_q, dtype=torch.int64)
    lo, hi, sink_extra = _rows(seqlen_q, seqlen_k, window_left, window_right, sink_tokens)
    window = torch.clamp(hi - lo + 1, min=0)
    return window + sink_extra


def visible_pairs(seqlen_q: int, seqlen_k: int, window_left: int = -1, window_right: int = -1,
                  sink_tokens: int = 0) -> int:
    """Number of visible (query, key) pairs of one head of one sequence."""
    return int(visible_per_row(seqlen_q, seqlen_k, window_left, window_right, sink_tokens).sum())


def visible_keys(seqlen_q: int, seqlen_k: int, window_left: int = -1, window_right: int = -1,
                 sink_tokens: int = 0) -> int:
    """Number of keys visible to at least one query row (the K/V a kernel must read at least once)."""
    _check_args(seqlen_q, seqlen_k, window_left, window_right, sink_tokens)
    if seqlen_q == 0 or seqlen_k == 0:
        return 0
    lo, hi, sink_extra = _rows(seqlen_q, seqlen_k, window_left, window_right, sink_tokens)
    # Union of the window intervals by a difference array over keys, then the sink tokens.
    nonempty = hi >= lo
    diff = torch.zeros(seqlen_k + 1, dtype=torch.int64)
    diff.index_add_(0, lo[nonempty], torch.ones_like(lo[nonempty]))
    diff.index_add_(0, hi[nonempty] + 1, -torch.ones_like(hi[nonempty]))
    covered = torch.cumsum(diff[:-1], 0) > 0
    # A sink key j is visible to row i iff j < sink_extra[i] (sink_extra counts keys 0..sink_extra-1).
    n_sink = int(sink_extra.max()) if sink_extra.numel() else 0
    if n_sink > 0:
        covered[:n_sink] = True
    return int(covered.sum())


def attention_flops(batch: int, nheads: int, headdim: int, seqlen_q: int, seqlen_k: int, *,
                    causal: bool = False, window_size=(-1, -1), sink_tokens: int = 0,
                    mode: str = "fwd") -> int:
    """FLOPs of one call: 4 * b * h * d * visible pairs (fwd); x2.5 (bwd); x3.5 (fwd+bwd)."""
    left, right = normalize_window(causal, window_size)
    fwd = 4 * batch * nheads * headdim * visible_pairs(seqlen_q, seqlen_k, left, right, sink_tokens)
    factor = {"fwd": 1.0, "bwd": BWD_FACTOR, "fwd_bwd": 1.0 + BWD_FACTOR}.get(mode)
    if factor is None:
        raise ValueError(f"bench.harness.flops: mode must be 'fwd', 'bwd' or 'fwd_bwd'; got {mode!r}")
    return int(round(fwd * factor))


def attention_bytes(batch: int, nheads: int, nheads_k: int, headdim: int, seqlen_q: int, seqlen_k: int, *,
                    elem_bytes: int, causal: bool = False, window_size=(-1, -1), sink_tokens: int = 0,
                    mode: str = "fwd") -> int:
    """Fewest bytes moved: fwd reads q, the visible k/v, writes out and lse (fp32); bwd reads q, k, v,
    out, dout, lse and writes dq, dk, dv (the visible keys only)."""
    left, right = normalize_window(causal, window_size)
    keys = visible_keys(seqlen_q, seqlen_k, left, right, sink_tokens)
    q_elems = batch * seqlen_q * nheads * headdim
    kv_elems = batch * keys * nheads_k * headdim
    lse = 4 * batch * nheads * seqlen_q
    if mode == "fwd":
        return (2 * q_elems + 2 * kv_elems) * elem_bytes + lse
    if mode == "bwd":
        return (4 * q_elems + 4 * kv_elems) * elem_bytes + lse  # q,out,dout,dq + k,v,dk,dv
    raise ValueError(f"bench.harness.flops: mode must be 'fwd' or 'bwd'; got {mode!r}")


def decode_bytes(batch: int, nheads: int, nheads_k: int, headdim: int, seqlen_k: int, *, elem_bytes: int,
                 seqlen_q: int = 1, causal: bool = True, window_size=(-1, -1), sink_tokens: int = 0) -> int:
    """Decode traffic per docs/DESIGN.md section 7: K and V of the visible keys (once per KV head) + q + out."""
    left, right = normalize_window(causal, window_size)
    keys = visible_keys(seqlen_q, seqlen_k, left, right, sink_tokens)
    kv = 2 * batch * keys * nheads_k * headdim
    qo = 2 * batch * seqlen_q * nheads * headdim
    return (kv + qo) * elem_bytes
