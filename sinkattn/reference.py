"""The PyTorch reference backend: docs/DESIGN.md section 1 computed tile by tile.

It serves every problem on CPU tensors and is the fallback on GPUs, so it has to scale: queries are
processed in row chunks and keys in tiles with an online softmax, so memory stays
O(rows x tile + output) and never O(seqlen_q x seqlen_k). Tiles the mask hides entirely are never
visited (see `key_ranges`). Low-precision inputs are upcast per tile and accumulated in fp32
(float64 inputs, used for gradcheck, accumulate in float64).

The backward recomputes the probabilities from the saved lse (FlashAttention-2 style) instead of
keeping the score matrix, and loops in a fixed order, so it is deterministic.

Sequences are the unit of work here: a plain batch is a loop over its rows, varlen a loop over
cu_seqlens, and the KV cache (`attention_kvcache`) a loop that fetches key tiles from (paged) caches.
Keys reach the core through a `fetch(t0, t1) -> (k_tile, v_tile)` callable, each (t1-t0, nheads_k, d),
so the core never needs the whole key sequence in one tensor.

Layer: dispatch calls `attention_fwd`, `attention_bwd` and `attention_kvcache` (beside the kernels' launch_*).
"""
from __future__ import annotations

import math

import torch

from . import fp8
from .layout import acc_dtype
from .mask import Mask, key_ranges
from .mask import fully_visible as _fully_visible
from .mask import visible as _visible

# Tile sizes, read at call time (tests shrink them to exercise tiling on short sequences).
KEY_TILE = 512
ROW_CHUNK = 256
# Upper bound on elements of one score tile (heads x rows x keys): 2^22 fp32 = 16 MiB, so many heads
# shrink the row chunk instead of the memory bound.
SCORE_BUDGET = 1 << 22


def _tiles(i0: int, i1: int, seqlen_k: int, off: int, m: Mask):
    """(t0, t1, needs_mask) for each key tile the chunk [i0, i1) must visit."""
    for j0, j1 in key_ranges(i0, i1, seqlen_k, off, m):
        for t0 in range(j0, j1, KEY_TILE):
            t1 = min(j1, t0 + KEY_TILE)
            yield t0, t1, not _fully_visible(i0, i1, t0, t1, off, m)


def _row_chunk(nheads: int) -> int:
    return max(1, min(ROW_CHUNK, SCORE_BUDGET // max(1, nheads * KEY_TILE)))


def _scores(qs, kt, i0, i1, t0, t1, off, m: Mask, needs_mask, nheads_k, group):
    """Scaled (softcapped, masked) scores (hk, g*rows, tile) and tanh(s/softcap) for the backward."""
    s = torch.bmm(qs, kt.permute(1, 2, 0))
    th = None
    if m.softcap > 0:
        th = torch.tanh(s / m.softcap)
        s = th * m.softcap
    if needs_mask:
        vis = _visible(i0, i1, t0, t1, off, m, s.device)
        s.view(nheads_k, group, i1 - i0, t1 - t0).masked_fill_(~vis, float("-inf"))
    return s, th


def _to_groups(x: torch.Tensor, nheads_k: int, dtype) -> torch.Tensor:
    """(rows, h, d) -> (hk, g*rows, d) in `dtype`: query head h = kh*g + gi reads KV head kh."""
    r, h, d = x.shape
    return x.to(dtype).permute(1, 0, 2).reshape(nheads_k, (h // nheads_k) * r, d)


def _from_groups(x: torch.Tensor, rows: int) -> torch.Tensor:
    """(hk, g*rows, ...) -> (rows, h, ...)."""
    hk, gr = x.shape[:2]
    return x.reshape(hk * (gr // rows), rows, *x.shape[2:]).transpose(0, 1)


def _forward_seq(q, fetch, seqlen_k: int, nheads_k: int, sink, out, lse, m: Mask) -> None:
    """One sequence: q (sq, h, d); sink (h,) in the accumulation dtype (-inf = none).

    Writes out (sq, h, d) and lse (h, sq) in place (they may be views into batched outputs).
    """
    sq, h, d = q.shape
    acc_t = acc_dtype(q.dtype)
    off = seqlen_k - sq
    hk, g = nheads_k, h // nheads_k
    rows = _row_chunk(h)
    for i0 in range(0, sq, rows):
        i1 = min(sq, i0 + rows)
        r = i1 - i0
        qs = _to_groups(q[i0:i1], hk, acc_t) * m.scale
        row_max = torch.full((hk, g * r), float("-inf"), dtype=acc_t, device=q.device)
        row_sum = torch.zeros((hk, g * r), dtype=acc_t, device=q.device)
        acc = torch.zeros((hk, g * r, d), dtype=acc_t, device=q.device)
        for t0, t1, needs_mask in _tiles(i0, i1, seqlen_k, off, m):
            kt, vt = fetch(t0, t1)
            s, _ = _scores(qs, kt.to(acc_t), i0, i1, t0, t1, off, m, needs_mask, hk, g)
            new_max = torch.maximum(row_max, s.amax(-1))
            # A row that has seen only masked keys keeps max -inf; shift it by 0 so exp() stays 0, not NaN.
            shift = new_max.masked_fill(new_max == float("-inf"), 0.0)
            p = torch.exp(s - shift[..., None])
            alpha = torch.exp(row_max - shift)
            row_sum = row_sum * alpha + p.sum(-1)
            acc = acc * alpha[..., None] + _pv(p, vt.to(acc_t), i0, i1, t0, t1, off, m, needs_mask, g)
            row_max = new_max
        out_c, lse_c = _finalize(row_max, row_sum, acc, sink, hk, g, r)
        out[i0:i1].copy_(_from_groups(out_c, r))
        lse[:, i0:i1].copy_(lse_c.reshape(h, r))


def _pv(p, vt, i0, i1, t0, t1, off, m: Mask, needs_mask: bool, g: int) -> torch.Tensor:
    """p @ v for one tile, (hk, g*rows, d), exact for masked keys whatever their values.

    A masked key has p = 0, but 0 * inf = NaN inside a matmul, so a non-finite V row would leak into rows
    that may not see it. Only tiles with masked pairs can have that problem, and only when V holds a
    non-finite value (checked once per such tile): then the non-finite entries are added for the visible
    pairs alone, so they still propagate to exactly the rows that see them (docs/semantics.md, "Non-finite values").
    """
    pv = torch.bmm(p, vt.transpose(0, 1))
    if not needs_mask or bool(torch.isfinite(vt).all()):
        return pv
    bad = ~torch.isfinite(vt)                                   # (t, hk, d)
    keys = bad.flatten(1).any(1).nonzero().flatten()            # the tile's keys holding a non-finite value
    pv = torch.bmm(p, vt.masked_fill(bad, 0.0).transpose(0, 1))
    vis = _visible(i0, i1, 0, 0, off, m, p.device, keys=t0 + keys)  # (rows, nbad)
    hk, gr, _ = p.shape
    pk = p[..., keys].view(hk, g, i1 - i0, -1)                   # (hk, g, rows, nbad)
    vk = torch.where(bad[keys], vt[keys], 0.0).transpose(0, 1)  # (hk, nbad, d): the non-finite part only
    term = pk[..., None] * vk[:, None, None]                    # (hk, g, rows, nbad, d)
    term = torch.where(vis[None, None, :, :, None], term, 0.0).sum(3)
    return pv + term.reshape(hk, gr, -1)


def _masked_nonfinite_grad(ds, kt, vt, i0, i1, t0, t1, off, m: Mask, needs_mask: bool, g: int):
    """(ds, k for dq) of one backward tile, with masked pairs exact whatever the masked keys hold.

    dP = dO . v is non-finite at a masked key with a non-finite V, and p = 0 there makes ds NaN; dq then sums
    ds * k, where a masked non-finite K meets ds = 0. Zero ds at masked pairs and take k's non-finite entries
    out of the dq product: a row that sees such a key already has a NaN ds there, so it still propagates.
    """
    if not needs_mask or (bool(torch.isfinite(vt).all()) and bool(torch.isfinite(kt).all())):
        return ds, kt
    hk, gr, t = ds.shape
    vis = _visible(i0, i1, t0, t1, off, m, ds.device)
    ds = torch.where(vis[None, None], ds.view(hk, g, i1 - i0, t), 0.0).view(hk, gr, t)
    return ds, torch.nan_to_num(kt, nan=0.0, posinf=0.0, neginf=0.0)


def _sink_rows(sink, hk: int, g: int, r: int) -> torch.Tensor:
    """(h,) -> (hk, g*rows): each query head's sink repeated over its rows."""
    return sink.view(hk, g, 1).expand(hk, g, r).reshape(hk, g * r)


def _finalize(row_max, row_sum, acc, sink, hk, g, r):
    """Fold the sink into the softmax denominator once, at the end (it has no value vector).

    The sink joins the running max before it joins the sum, so a sink far above the scores (+30)
    cannot overflow exp(). With sink = -inf this reduces exactly to lse = max + log(sum).
    """
    sink_rows = _sink_rows(sink, hk, g, r)
    top = torch.maximum(row_max, sink_rows)
    top = top.masked_fill(top == float("-inf"), 0.0)  # nothing visible and no sink: all weights are 0
    keys_w = torch.exp(row_max - top)
    # A +inf sink takes all the weight: exp(inf - inf) would be NaN, its weight relative to itself is 1.
    sink_w = torch.exp(sink_rows - top).masked_fill(torch.isposinf(sink_rows), 1.0)
    total = row_sum * keys_w + sink_w
    lse = top + torch.log(total)  # total == 0 (nothing visible, no sink) -> -inf
    # total == 0: nothing visible and no sink (out 0); a NaN sink makes total NaN and out NaN, not 0.
    factor = torch.where(total != 0, keys_w / total, torch.zeros_like(total))
    return acc * factor[..., None], lse


def _backward_seq(dout, dlse, q, fetch, seqlen_k: int, sink, out, lse, dq, dk_acc, dv_acc,
                  dsink_acc, m: Mask) -> None:
    """Gradients of one sequence by recomputation from lse.

    dq (sq, h, d) is written; dk_acc/dv_acc (hk, sk, d) and dsink_acc (h,) are accumulated (fp32/64).
    With p = exp(s - lse) and D_i = dO_i . out_i, dL/ds = p * (dP - D + dlse): the usual FA2 term plus
    dlse, because d lse_i / d s_ij = p_ij. The sink's probability exp(sink - lse_i) gets the same
    treatment with dP = 0 (no value vector): dsink = sum_i p_sink_i * (dlse_i - D_i).
    """
    sq, h, d = q.shape
    acc_t = acc_dtype(q.dtype)
    off = seqlen_k - sq
    rows = _row_chunk(h)
    hk = dk_acc.shape[0]
    g = h // hk
    for i0 in range(0, sq, rows):
        i1 = min(sq, i0 + rows)
        r = i1 - i0
        qs = _to_groups(q[i0:i1], hk, acc_t) * m.scale
        do = _to_groups(dout[i0:i1], hk, acc_t)
        o = _to_groups(out[i0:i1], hk, acc_t)
        # (h, rows) -> (hk, g*rows) is a plain reshape: head h = kh*g + gi.
        lse_c = lse[:, i0:i1].to(acc_t).reshape(hk, g * r)
        delta = (do * o).sum(-1)
        if dlse is not None:
            delta = delta - dlse[:, i0:i1].to(acc_t).reshape(hk, g * r)
        # Rows with lse = -inf see nothing; shifting them by 0 keeps exp(-inf - lse) at 0, not NaN.
        lse_safe = lse_c.masked_fill(lse_c == float("-inf"), 0.0)
        dqc = torch.zeros_like(qs)
        for t0, t1, needs_mask in _tiles(i0, i1, seqlen_k, off, m):
            kt, vt = fetch(t0, t1)
            kt, vt = kt.to(acc_t), vt.to(acc_t)
            s, th = _scores(qs, kt, i0, i1, t0, t1, off, m, needs_mask, hk, g)
            p = torch.exp(s - lse_safe[..., None])
            dv_acc[:, t0:t1] += torch.bmm(p.transpose(1, 2), do)
            dp = torch.bmm(do, vt.permute(1, 2, 0))
            ds = p * (dp - delta[..., None])
            if th is not None:
                ds = ds * (1 - th * th)  # d(c*tanh(u/c))/du
            ds, kt = _masked_nonfinite_grad(ds, kt, vt, i0, i1, t0, t1, off, m, needs_mask, g)
            dqc += torch.bmm(ds, kt.transpose(0, 1))
            dk_acc[:, t0:t1] += torch.bmm(ds.transpose(1, 2), qs)
        dq[i0:i1].copy_(_from_groups(dqc * m.scale, r))
        sink_rows = _sink_rows(sink, hk, g, r)
        p_sink = torch.exp(sink_rows - lse_safe).masked_fill(torch.isposinf(sink_rows), 1.0)
        dsink_acc += (-p_sink * delta).view(hk * g, r).sum(-1)


def _slicer(k, v):
    return lambda t0, t1: (k[t0:t1], v[t0:t1])


def _sink_vector(sinks, nheads: int, acc_t, device) -> torch.Tensor:
    if sinks is None:
        return torch.full((nheads,), float("-inf"), dtype=acc_t, device=device)
    return sinks.to(acc_t)


def _seq_bounds(cu_seqlens_q, cu_seqlens_k):
    """[(q0, q1, k0, k1)] per sequence: batch rows, or the cu_seqlens intervals for varlen."""
    if cu_seqlens_q is None:
        return None
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    return [(cq[b], cq[b + 1], ck[b], ck[b + 1]) for b in range(len(cq) - 1)]


# Decode-sized problems (a few query rows over all keys at once) skip the tiling and the per-row Python loop:
# the per-op overhead of the tiled path, not arithmetic, is what a single-token step costs on a CPU.
DIRECT_MAX_ROWS = 16


def _forward_direct(q, k, v, sink, m: Mask, need_lse: bool = True):
    """The whole batch in one pass: q (b, sq, h, d), k/v (b, sk, hk, d), sink (h,) or None -> (out, lse). The
    same math as _forward_seq with one key tile, in fewer ops: lse = logaddexp(logsumexp(scores), sink)
    (stable for any sink, -inf and +inf included), p = exp(s - lse), out = p @ v. None when a masked key holds
    a non-finite V (the caller takes the tiled path, which is exact there). need_lse=False lets the fused path return
lse None (the caller drops it)."""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    g = h // hk
    if _fused_applies(q, m):
        fused = _fused_forward(q, lambda ranges: (_take(k, ranges, 1), _take(v, ranges, 1)), sk, hk, sink, m,
                               need_lse)
        if fused is not None:
            return fused
    if sk > KEY_TILE * 16 or b * h * sq * sk > SCORE_BUDGET:
        return None  # the scores of one pass would not fit the memory bound: the tiled path
    acc_t = acc_dtype(q.dtype)
    qs = q.to(acc_t).view(b, sq, hk, g, d).permute(0, 2, 3, 1, 4).reshape(b * hk, g * sq, d)
    kt = k.to(acc_t).permute(0, 2, 3, 1).reshape(b * hk, d, sk)
    vt = v.to(acc_t).transpose(1, 2).reshape(b * hk, sk, d)
    s = torch.bmm(qs, kt).mul_(m.scale)
    if m.softcap > 0:
        s = torch.tanh(s / m.softcap) * m.softcap
    if not _fully_visible(0, sq, 0, sk, sk - sq, m):
        if not bool(torch.isfinite(vt).all()):
            return None  # a masked non-finite V would reach p @ v as 0 * inf: the tiled path keeps it out (_pv)
        s.view(b * hk, g, sq, sk).masked_fill_(~_visible(0, sq, 0, sk, sk - sq, m, s.device), float("-inf"))
    lse = torch.logsumexp(s, -1)
    if sink is not None:
        lse = torch.logaddexp(lse, _sink_rows(sink, hk, g, sq).repeat(b, 1))
    # nothing visible and no sink: lse = -inf, weights 0 (exp(-inf - 0)); a +inf sink: weights exp(s - inf) = 0
    p = torch.exp(s - lse.masked_fill(lse == float("-inf"), 0.0)[..., None])
    out = torch.bmm(p, vt).view(b, hk, g, sq, d).permute(0, 3, 1, 2, 4).reshape(b, sq, h, d).to(q.dtype)
    return out.contiguous(), lse.view(b, h, sq)


# The aten kernel SDPA runs on CPU tensors, through its C binding: torch.ops' overload object costs about 3 us more
# a call (measured at the tiny forward, where the kernel itself takes about 13 us; bench/studies/cpu_overhead.py).
_FLASH_CPU = torch._scaled_dot_product_flash_attention_for_cpu


def _fused_applies(q, m: Mask) -> bool:
    """Whether PyTorch's fused CPU attention can serve this call (fp32 CPU tensors, no softcap)."""
    return q.dtype == torch.float32 and m.softcap == 0 and q.is_cpu


def _fused_plan(sq: int, sk: int, g: int, m: Mask):
    """How the fused CPU kernel serves sq query rows (bottom-right aligned) over sk keys, g query heads per KV
    head: (ranges, mask) with `ranges` the key ranges to gather (key_ranges: the sink tokens and the window, so
    the keys no row sees are never read) and `mask` None when every row sees every gathered key (always so for
    one row: decode), else the additive (g * sq, gathered keys) float mask (0 / -inf), cached per shape. None
    when a row sees no key: the fused kernel would give it lse 0 instead of the contract's out 0, lse = sink."""
    off = sk - sq
    if sk <= 0 or sq <= 0 or not key_ranges(0, 1, sk, off, m):
        return None  # (row 0 sees the fewest keys: with a right bound, none when off + right < 0)
    ranges = tuple(key_ranges(0, sq, sk, off, m))
    if not ranges:
        return None
    if all(_fully_visible(0, sq, t0, t1, off, m) for t0, t1 in ranges):
        return ranges, None
    key = (sq, sk, g, ranges, m.visibility)
    mask = _MASKS.get(key)
    if mask is None:
        pos = torch.cat([torch.arange(t0, t1) for t0, t1 in ranges])
        if g * sq * pos.shape[0] > SCORE_BUDGET:
            return None
        vis = _visible(0, sq, 0, 0, off, m, "cpu", keys=pos)
        mask = torch.zeros(vis.shape).masked_fill_(~vis, float("-inf")).repeat(g, 1)
        if len(_MASKS) >= _MASKS_MAX:
            _MASKS.clear()
        _MASKS[key] = mask
    return ranges, mask


# (sq, sk, g, ranges, Mask.visibility) -> the additive mask of _fused_plan. The masks of a
# model's few shapes are built once; the cache is cleared when it holds _MASKS_MAX of them (at most 16 MiB each).
_MASKS: dict = {}
_MASKS_MAX = 32


def _take(x, ranges, dim: int):
    """The key ranges of x along `dim`, as a view for one range, else their concatenation."""
    if len(ranges) == 1:
        t0, t1 = ranges[0]
        return x if t0 == 0 and t1 == x.shape[dim] else x.narrow(dim, t0, t1 - t0)
    return torch.cat([x.narrow(dim, t0, t1 - t0) for t0, t1 in ranges], dim)


def _fused_forward(q, fetch, sk: int, hk: int, sink, m: Mask, need_lse: bool = True):
    """q (b, sq, h, d) over sk keys (hk heads) that fetch(ranges) -> (k, v) (b, keys, hk, d) gathers, on the
    fused CPU kernel (see _fused_plan) -> (out (b, sq, h, d), lse (b, h, sq)), contiguous like the op's fake
    outputs, or None where it does not apply (the caller takes another path). A mask hides keys by adding -inf
    to their scores: a masked non-finite K makes that score NaN (inf - inf), and the kernel's p @ v turns 0 * inf
    into NaN for a masked non-finite V; with a mask and a non-finite K or V, None too (the tiled path keeps such
    keys out exactly, see _pv). Without a mask the keys no row sees are not even gathered. need_lse=False: lse may
come back None."""
    b, sq, h, d = q.shape
    g = h // hk
    plan = _fused_plan(sq, sk, g, m)
    if plan is None:
        return None
    ranges, mask = plan
    k, v = fetch(ranges)
    # Plain causal attention (sq == sk, one query head per KV head: top-left and bottom-right alignment agree)
    # needs no mask tensor: the kernel's own causal mode, cheaper than an additive mask at small sizes.
    causal = mask is not None and g == 1 and sq == sk and len(ranges) == 1 and _plain_causal(m)
    if g == 1 and sq > 1:
        out, lse = _fused_rows(q, k, v, sink, m.scale, need_lse, None if causal else mask, causal)
    else:
        # (b, sq, h, d) <-> (b, hk, g * sq, d): a view at one query row, else a copy each way
        qs = q.view(b, hk, g, d) if sq == 1 else q.view(b, sq, hk, g, d).permute(0, 2, 3, 1, 4).reshape(b, hk, g * sq, d)
        out, lse = _flash_cpu_heads(qs, k.transpose(1, 2), v.transpose(1, 2), sink, m.scale, sq, need_lse=need_lse,
                                    mask=mask)
        if sq == 1:
            out = out.view(b, 1, h, d)
        else:  # (the kernel writes lse in (b, rows, hk) memory order, transposed: a copy makes it contiguous)
            out = out.view(b, hk, g, sq, d).permute(0, 3, 1, 2, 4).reshape(b, sq, h, d).contiguous()
            lse = None if lse is None else lse.contiguous()
    # A masked non-finite K or V can only show as NaN in out (a NaN score, or 0 * inf in p @ v, spreads over its
    # row), never as a wrong finite value; so one reduction of out after the call replaces isfinite(k), isfinite(v)
    # before it (two full passes and four ops). A non-finite sum (that, a huge legitimate out, or a visible NaN)
    # sends the call to the exact tiled path, which keeps masked keys out (_pv) and gives the same answer otherwise.
    if mask is not None and not math.isfinite(float(out.sum())):
        return None
    return out, lse


def _fused_rows(q, k, v, sink, scale, need_lse, mask, is_causal):
    """_fused_forward without GQA (one query head per KV head), in the fewest ops: the call's (b, s, h, d) tensors
    go to the kernel as (b, h, s, d) views, and the kernel writes out and lse in q's memory order, so out comes back
    as (b, sq, h, d) and lse as (b, sq, h), both contiguous: the sink step runs there with no copy. -> (out,
    lse (b, h, sq) contiguous, or None when not needed). (At a tiny call each op is about a microsecond, a good
    part of the time; bench/studies/cpu_overhead.py.)"""
    out, lse = _FLASH_CPU(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                          is_causal=is_causal, scale=scale)
    out, lse = out.transpose(1, 2), lse.transpose(1, 2)
    if sink is not None:
        w, lse = _sink_weight(lse, sink, need_lse)  # (b, sq, h) beside (h,)
        out = out * w.unsqueeze(-1)
    return out.contiguous(), (lse.transpose(1, 2).contiguous() if need_lse else None)


def _sink_weight(lse, sink, need_lse: bool):
    """The sink joining keys whose log-sum-exp is lse (elementwise, sink broadcast against it): -> (w, lse') with
    w = e^lse / (e^lse + e^sink) = sigmoid(lse - sink), the weight the keys keep (out' = out * w), and
    lse' = lse - log w = logaddexp(lse, sink), or None when not needed. logsigmoid is stable at every sink, -inf
    (w = 1) and +inf (w = 0, lse' = +inf) included; without lse, sigmoid is one op fewer."""
    x = lse - sink
    if need_lse:
        log_w = torch.nn.functional.logsigmoid(x)
        return log_w.exp(), lse - log_w
    return x.sigmoid_(), None


def _plain_causal(m: Mask) -> bool:
    """The mask is causal and nothing else: right edge 0, no left edge (sink tokens then change nothing)."""
    return m.causal and m.left_unbounded


def _flash_cpu_heads(qs, k, v, sink, scale, sq, need_lse=True, mask=None, is_causal=False):
    """qs (b, hk, g * sq, d): each KV head's query heads and rows as one block over its keys k, v (b, hk, sk, d),
    every query seeing every key (or those `mask`, additive (g * sq, sk), lets it see). PyTorch's fused CPU
    attention (the kernel SDPA runs) gives out and lse (natural log); the sink joins afterwards (_sink_weight).
    -> (out like qs, lse (b, h, sq), or None when not needed)."""
    b, hk, rows, _ = qs.shape
    if mask is not None:
        out, lse = _FLASH_CPU(qs, k, v, attn_mask=mask, scale=scale)
    else:
        out, lse = _FLASH_CPU(qs, k, v, is_causal=is_causal, scale=scale)
    if sink is None:
        return out, lse.reshape(b, hk * (rows // sq), sq) if need_lse else None
    # The sink step in lse's memory order, (b, rows, hk) with row gi * sq + i of KV head hk_i holding query head
    # hk_i * g + gi: there every op runs over contiguous memory (across layouts each op cost 2-3x: measured).
    g = rows // sq
    w, lse = _sink_weight(lse.transpose(1, 2).view(b, g, sq, hk), sink.view(hk, g).t().reshape(1, g, 1, hk), need_lse)
    if lse is not None:
        lse = lse.permute(0, 3, 1, 2).reshape(b, hk * g, sq)
    return out * w.view(b, rows, hk).transpose(1, 2).unsqueeze(-1), lse


def decode_bhsd(q, k, v, sinks, mask: Mask):
    """CPU inference of decode size on transformers' (b, h, s, d) layout, with no transposes either way: q (b, h,
    sq, d), k/v (b, hk, sk, d) -> out (b, sq, h, d), the same as attention_fwd's out; None where the fused
    path does not apply (not fp32 on the CPU, softcap, a mask that hides a key, more than DIRECT_MAX_ROWS rows),
    and the caller then takes the general path. At one query per step the per-call overhead is what a CPU decode
    step pays for (bench/studies/cpu_decode.py)."""
    b, h, sq, d = q.shape
    hk, sk = k.shape[1], k.shape[2]
    if not (q.device.type == "cpu" and q.dtype == torch.float32 and mask.softcap == 0 and 0 < sq <= DIRECT_MAX_ROWS
            and sk > 0 and _fully_visible(0, sq, 0, sk, sk - sq, mask)):
        return None
    sink = sinks if sinks is None or sinks.dtype == torch.float32 else sinks.to(torch.float32)
    out, _ = _flash_cpu_heads(q.reshape(b, hk, (h // hk) * sq, d), k, v, sink, mask.scale, sq, need_lse=False)
    if sq == 1:  # (b, hk, g, d) is already (b, 1, h, d)
        return out.reshape(b, 1, h, d)
    return out.view(b, hk, h // hk, sq, d).permute(0, 3, 1, 2, 4).reshape(b, sq, h, d)


def attention_fwd(q, k, v, sinks, mask: Mask, cu_seqlens_q=None, cu_seqlens_k=None, need_lse: bool = True):
    """Batched (q (b, sq, h, d)) or varlen (q (total_q, h, d) + cu_seqlens) forward -> (out, lse); with
    need_lse=False lse may be None (the fused CPU path then skips the work it takes)."""
    acc_t = acc_dtype(q.dtype)
    if cu_seqlens_q is None and 0 < q.shape[1] <= DIRECT_MAX_ROWS and k.shape[1] > 0:
        direct = _forward_direct(q, k, v, sinks if sinks is None or sinks.dtype == acc_t else sinks.to(acc_t), mask,
                                 need_lse)
        if direct is not None:
            return direct
    sink = _sink_vector(sinks, q.shape[-2], acc_t, q.device)
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    bounds = _seq_bounds(cu_seqlens_q, cu_seqlens_k)
    if bounds is None:
        b, sq, h, _ = q.shape
        lse = torch.empty((b, h, sq), dtype=acc_t, device=q.device)
        for bi in range(b):
            _forward_seq(q[bi], _slicer(k[bi], v[bi]), k.shape[1], k.shape[2], sink, out[bi], lse[bi], mask)
        return out, lse
    # Rows past cu_seqlens_q[-1] belong to no sequence: they keep out = 0 and lse = -inf.
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=acc_t, device=q.device)
    for q0, q1, k0, k1 in bounds:
        _forward_seq(q[q0:q1], _slicer(k[k0:k1], v[k0:k1]), k1 - k0, k.shape[1], sink, out[q0:q1],
                     lse[:, q0:q1], mask)
    return out, lse


def attention_bwd(dout, dlse, q, k, v, sinks, out, lse, mask: Mask, cu_seqlens_q=None, cu_seqlens_k=None):
    """-> (dq, dk, dv, dsinks): dq/dk/dv in the dtype of q/k/v, dsinks in the accumulation dtype."""
    acc_t = acc_dtype(q.dtype)
    h = q.shape[-2]
    sink = _sink_vector(sinks, h, acc_t, q.device)
    dq = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.zeros(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
    dsink = torch.zeros((h,), dtype=acc_t, device=q.device)

    def one(qs_, ks, vs, o_, lse_, dout_, dlse_, dq_, dk_, dv_):
        sk, hk, d = ks.shape
        dk_acc = torch.zeros((hk, sk, d), dtype=acc_t, device=q.device)
        dv_acc = torch.zeros((hk, sk, vs.shape[-1]), dtype=acc_t, device=q.device)
        _backward_seq(dout_, dlse_, qs_, _slicer(ks, vs), sk, sink, o_, lse_, dq_, dk_acc, dv_acc, dsink, mask)
        dk_.copy_(dk_acc.transpose(0, 1))
        dv_.copy_(dv_acc.transpose(0, 1))

    bounds = _seq_bounds(cu_seqlens_q, cu_seqlens_k)
    if bounds is None:
        for bi in range(q.shape[0]):
            one(q[bi], k[bi], v[bi], out[bi], lse[bi], dout[bi], None if dlse is None else dlse[bi],
                dq[bi], dk[bi], dv[bi])
    else:
        for q0, q1, k0, k1 in bounds:
            one(q[q0:q1], k[k0:k1], v[k0:k1], out[q0:q1], lse[:, q0:q1], dout[q0:q1],
                None if dlse is None else dlse[:, q0:q1], dq[q0:q1], dk[k0:k1], dv[k0:k1])
    return dq, dk, dv, dsink


def _paged_fetch(k_cache, v_cache, pages, page_size: int):
    def fetch(t0: int, t1: int):
        pos = torch.arange(t0, t1, device=pages.device)
        page, slot = pages[pos // page_size], pos % page_size
        return k_cache[page, slot], v_cache[page, slot]
    return fetch


def _paged_take(cache, pages, page_size: int, ranges):
    """The key ranges of one sequence of a paged cache (pages: its block_table row) -> (1, keys, hk, d): the pages
    each range touches, gathered (index_select) and cut to the range."""
    parts = []
    for t0, t1 in ranges:
        p0, p1 = t0 // page_size, (t1 - 1) // page_size + 1
        block = cache.index_select(0, pages[p0:p1]).flatten(0, 1)
        parts.append(block.narrow(0, t0 - p0 * page_size, t1 - t0))
    return (parts[0] if len(parts) == 1 else torch.cat(parts)).unsqueeze(0)


def _dequantizing(fetch, descales, dtype):
    """A fetch over an FP8 cache that returns its tiles dequantized to `dtype` (descales: this fetch's (k, v)
    descales, shaped as fp8.dequantize takes them); the fetch itself without descales."""
    if descales is None:
        return fetch
    kd, vd = descales

    def fetch_dq(*where):
        kt, vt = fetch(*where)
        return fp8.dequantize(kt, kd, dtype), fp8.dequantize(vt, vd, dtype)
    return fetch_dq


def attention_kvcache(q, k_cache, v_cache, sinks, seqlens_k, block_table, mask: Mask, descales=None):
    """q (b, sq, h, d) over a contiguous (b, capacity, hk, d) or paged (pages, page_size, hk, d) cache holding
    seqlens_k[b] keys per sequence (int32 (b,) read on the host, or those lengths as a list) -> (out, lse (b, h,
    sq)). Decode-sized fp32 calls on the CPU run the fused CPU kernel over the keys each sequence sees (the whole
    batch at once when a contiguous cache holds the same length for every sequence); the rest, the tiled path.
    descales: an FP8 cache's (k, v) descales, (b, hk) each (sinkattn.fp8): every key tile is dequantized as it is
    fetched, so the cache is never copied whole."""
    b, sq, h, _ = q.shape
    hk = k_cache.shape[2]
    acc_t = acc_dtype(q.dtype)
    lens = seqlens_k if isinstance(seqlens_k, list) else seqlens_k.tolist()
    fused = _fused_applies(q, mask) and 0 < sq <= DIRECT_MAX_ROWS
    sink_f = None if sinks is None else sinks.to(acc_t)

    def seq_descales(bi):
        return None if descales is None else (descales[0][bi], descales[1][bi])
    if fused and block_table is None and b > 0 and lens.count(lens[0]) == b:
        fetch = _dequantizing(lambda r: (_take(k_cache, r, 1), _take(v_cache, r, 1)),
                              None if descales is None else (descales[0][:, None], descales[1][:, None]), q.dtype)
        res = _fused_forward(q, fetch, lens[0], hk, sink_f, mask)
        if res is not None:
            return res
    sink = _sink_vector(sinks, h, acc_t, q.device)
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((b, h, sq), dtype=acc_t, device=q.device)
    for bi, n in enumerate(lens):
        if fused:
            if block_table is None:
                kc, vc = k_cache[bi:bi + 1], v_cache[bi:bi + 1]
                fetch = lambda r, kc=kc, vc=vc: (_take(kc, r, 1), _take(vc, r, 1))  # noqa: E731
            else:
                pages = block_table[bi]
                fetch = lambda r, p=pages: (_paged_take(k_cache, p, k_cache.shape[1], r),  # noqa: E731
                                            _paged_take(v_cache, p, k_cache.shape[1], r))
            res = _fused_forward(q[bi:bi + 1], _dequantizing(fetch, seq_descales(bi), q.dtype), n, hk, sink_f, mask)
            if res is not None:
                out[bi].copy_(res[0][0])
                lse[bi].copy_(res[1][0])
                continue
        if block_table is None:
            fetch = _slicer(k_cache[bi], v_cache[bi])
        else:
            fetch = _paged_fetch(k_cache, v_cache, block_table[bi].long(), k_cache.shape[1])
        _forward_seq(q[bi], _dequantizing(fetch, seq_descales(bi), acc_t), n, hk, sink, out[bi], lse[bi], mask)
    return out, lse


def attention_kvcache_varlen(q, k_cache, v_cache, sinks, seqlens_k, block_table, cu_seqlens_q, mask: Mask,
                             descales=None):
    """Packed q (total_q, h, d) with cu_seqlens_q (b + 1,) over a cache holding seqlens_k[b] keys per request (the
    serving form) -> (out (total_q, h, d), lse (h, total_q)); rows past cu_seqlens_q[-1] get out 0 and lse -inf.
    One attention_kvcache call per request (the offsets are read on the host, as the reference reads lengths)."""
    total, h, d = q.shape
    starts = cu_seqlens_q.tolist()
    lens = seqlens_k if isinstance(seqlens_k, list) else seqlens_k.tolist()
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.full((h, total), float("-inf"), dtype=acc_dtype(q.dtype), device=q.device)
    for b, n in enumerate(lens):
        r0, r1 = starts[b], starts[b + 1]
        if r1 == r0:
            continue
        bt = None if block_table is None else block_table[b:b + 1]
        kc, vc = (k_cache, v_cache) if block_table is not None else (k_cache[b:b + 1], v_cache[b:b + 1])
        ds = None if descales is None else (descales[0][b:b + 1], descales[1][b:b + 1])
        o, l = attention_kvcache(q[None, r0:r1], kc, vc, sinks, [n], bt, mask, ds)
        out[r0:r1] = o[0]
        lse[:, r0:r1] = l[0]
    return out, lse
