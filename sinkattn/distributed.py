"""Context parallelism: ring attention over torch.distributed, with learnable sinks counted once.

A sequence is split into equal contiguous chunks, one per rank of the process group, in rank order:
rank r holds queries, keys and values of tokens [r*S, (r+1)*S). `ring_attention` gives each rank the
attention output of its own queries over the *whole* sequence, as `flash_attn_with_sinks` would on
the concatenated sequence, forward and backward.

How. The key/value chunks travel around the ring (rank r sends to r+1 and receives from r-1, P-1
times), so at step t rank r holds the chunk of rank r-t. For each chunk it computes a partial
attention of its queries over those keys *without* sinks, (out_t, lse_t), and folds it into a
running state with `merge_attn_states`. The learnable sink enters once, in a final merge with an
empty state: lse = log(sum_t exp(lse_t) + exp(sink)). Counting it in every partial would add it P
times.

Masks are global: causal, window_size and sink_tokens are those of the full sequence. A chunk pair
is cut to the rectangle of rows and columns that can see anything (chunks entirely in the future or
out of the window are skipped without computing), and the rectangle's mask is expressed in the
kernel's own (bottom-right aligned) window terms; the global sink-token columns, which ignore the left
edge, are a separate rectangle. So every rank runs the fused kernels (or the reference on CPU).

Backward is autograd: the kernel's backward per chunk, merge_attn_states' backward, and a ring shift
whose backward sends the key/value gradients back the other way to the rank that owns the chunk.

Gradients of `sinks` (and of any parameter replicated over the group) are each rank's share: sum
them over the group (DistributedDataParallel over the context-parallel group does this) to get the
gradient of the whole sequence.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .errors import SinkattnRuntimeError, SinkattnTypeError, SinkattnValueError
from .interface import flash_attn_with_sinks
from .layout import acc_dtype
from ._checks import default_scale, resolve_sinks
from .mask import visible_rectangle, window_with_causal

_INF = float("inf")


def _merge(a, b, sinks=None):
    """merge_attn_states on (out, lse) pairs; None is the empty state. The op is used directly so
    float64 (tests) merges in float64; inputs here are built by this module."""
    if a is None:
        a, b = b, a
    if b is None:
        if sinks is None:
            return a
        b = (torch.zeros_like(a[0]), torch.full_like(a[1], -_INF))
    lse_dtype = acc_dtype(a[0].dtype)
    return torch.ops.sinkattn.merge_attn_states(a[0], a[1].to(lse_dtype), b[0], b[1].to(lse_dtype), sinks)


def _pair(q, k, v, q_start, k_start, opts):
    """Partial attention (no sinks) of q over one key chunk -> (out, lse) over all rows of q, or None."""
    left, right, n = opts["left"], opts["right"], opts["sink_tokens"]
    sq, sk = q.shape[1], k.shape[1]
    # Global sink-token columns ignore the left edge: a rectangle of their own.
    n_b = max(0, min(n - k_start, sk)) if left >= 0 else 0
    state = None
    for c_start, c_end, sub_left in ((0, n_b, -1), (n_b, sk, left)):
        if c_end <= c_start:
            continue
        rect = visible_rectangle(sq, c_end - c_start, q_start - (k_start + c_start), sub_left, right)
        if rect is None:
            continue
        r0, r1, c0, c1, wl, wr = rect
        out, lse = flash_attn_with_sinks(
            q[:, r0:r1], k[:, c_start + c0:c_start + c1], v[:, c_start + c0:c_start + c1],
            softmax_scale=opts["softmax_scale"], window_size=(wl, wr), softcap=opts["softcap"], return_lse=True,
            deterministic=opts["deterministic"], backend=opts["backend"])
        if r0 > 0 or r1 < sq:  # rows that see nothing here: out 0, lse -inf
            out = F.pad(out, (0, 0, 0, 0, r0, sq - r1))
            lse = F.pad(lse, (r0, sq - r1), value=-_INF)
        state = _merge(state, (out, lse))
    return state


def attend_chunks(q, q_start, chunks, sinks=None, **opts):
    """The per-rank computation, without communication: q (b, sq, h, d) holding global rows
    [q_start, q_start + sq) attends over `chunks`, an iterable of (k, v, k_start) that together
    hold every key of the sequence once; the sink is added once at the end. -> (out, lse).
    `ring_attention` feeds it the chunks arriving around the ring; tests feed it lists."""
    state = None
    for k, v, k_start in chunks:
        part = _pair(q, k, v, q_start, k_start, opts)
        if part is not None:
            state = _merge(state, part)
    if state is None:  # no row sees any key: out 0, lse -inf before the sink
        b, sq, h, _ = q.shape
        state = (torch.zeros_like(q), torch.full((b, h, sq), -_INF, dtype=acc_dtype(q.dtype), device=q.device))
    return _merge(state, None, sinks) if sinks is not None else state


class _RingShift(torch.autograd.Function):
    """y = the tensor of the previous rank (x goes to the next); backward sends gradients the other way."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _exchange(x, group, forward=True)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad, ctx.group, forward=False), None


class _Tie(torch.autograd.Function):
    """Returns (out, lse) unchanged but makes them depend on the last chunk that went around the ring,
    so every rank runs the backward of every ring shift (a rank that skipped its last chunk, e.g. the
    future under a causal mask, would otherwise leave its neighbours waiting)."""

    @staticmethod
    def forward(ctx, out, lse, anchor):
        ctx.anchor_shape, ctx.anchor_meta = anchor.shape, (anchor.dtype, anchor.device)
        return out.view_as(out), lse.view_as(lse)

    @staticmethod
    def backward(ctx, dout, dlse):
        dtype, device = ctx.anchor_meta
        return dout, dlse, torch.zeros(ctx.anchor_shape, dtype=dtype, device=device)


def _exchange(x, group, forward: bool):
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    send_to, recv_from = ((rank + 1) % world, (rank - 1) % world) if forward else ((rank - 1) % world,
                                                                                   (rank + 1) % world)
    if group is not None:
        send_to, recv_from = dist.get_global_rank(group, send_to), dist.get_global_rank(group, recv_from)
    x = x.contiguous()
    y = torch.empty_like(x)
    reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, x, send_to, group),
                                   dist.P2POp(dist.irecv, y, recv_from, group)])
    for r in reqs:
        r.wait()
    return y


def ring_attention(q, k, v, sinks=None, *, group=None, softmax_scale=None, causal=False, window_size=(-1, -1),
                   sink_tokens=0, softcap=0.0, return_lse=False, deterministic=False, backend="auto", s_aux=None):
    """Context-parallel `flash_attn_with_sinks` over the ranks of `group` (default: the world).

    q (batch, S, nheads, headdim), k, v (batch, S, nheads_k, headdim): this rank's chunk of one
    sequence of length S * world_size split contiguously in rank order (same S on every rank).
    sinks / s_aux (nheads,), the same on every rank, counted once. causal / window_size / sink_tokens
    / softcap / softmax_scale mean what they mean for the whole sequence (docs/DESIGN.md section 1).
    Returns this rank's out (batch, S, nheads, headdim), and lse (batch, nheads, S) with return_lse.
    Differentiable in q, k, v and sinks; the sinks gradient is this rank's share (sum it over the group).
    """
    if not dist.is_available() or not dist.is_initialized():
        raise SinkattnRuntimeError("sinkattn.ring_attention: torch.distributed is not initialized; call "
                                   "torch.distributed.init_process_group first (gloo on CPU, nccl on GPUs)")
    sinks = resolve_sinks(sinks, s_aux, who="sinkattn.ring_attention")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise SinkattnValueError(f"sinkattn.ring_attention: {name} must be a 4-D tensor (batch, S, heads, "
                                     f"headdim), this rank's chunk")
    if k.shape != v.shape or k.shape[1] != q.shape[1] or k.shape[0] != q.shape[0]:
        raise SinkattnValueError(f"sinkattn.ring_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v "
                                 f"{tuple(v.shape)}: each rank holds the same S tokens of q, k and v")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise SinkattnTypeError("sinkattn.ring_attention: q, k and v must share a dtype")
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise SinkattnValueError(f"sinkattn.ring_attention: window_size must be (left, right); got {window_size!r}")
    left, right = window_with_causal(int(window_size[0]), int(window_size[1]), bool(causal), strict=True,
                                     who="sinkattn.ring_attention")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    seqlen = q.shape[1]
    sizes = torch.tensor([seqlen, -seqlen], dtype=torch.int64, device=_comm_device(q, group))
    dist.all_reduce(sizes, op=dist.ReduceOp.MAX, group=group)
    if int(sizes[0]) != seqlen or -int(sizes[1]) != seqlen:
        raise SinkattnValueError(f"sinkattn.ring_attention: chunk lengths differ across ranks (this rank {seqlen}, "
                                 f"range {-int(sizes[1])}..{int(sizes[0])}); split the sequence into equal chunks")
    if softmax_scale is None:
        softmax_scale = default_scale(q.shape[-1])
    opts = dict(softmax_scale=softmax_scale, left=left, right=right, sink_tokens=int(sink_tokens),
                softcap=softcap, deterministic=deterministic, backend=backend)
    last = []

    def chunks():
        kv = torch.stack([k, v])
        for t in range(world):
            if t:
                kv = _RingShift.apply(kv, group)
            last[:] = [kv]
            yield kv[0], kv[1], ((rank - t) % world) * seqlen

    out, lse = attend_chunks(q, rank * seqlen, chunks(), sinks, **opts)
    if world > 1 and torch.is_grad_enabled():
        out, lse = _Tie.apply(out, lse, last[0])
    return (out, lse) if return_lse else out


def _comm_device(t, group):
    backend = dist.get_backend(group)
    return t.device if backend == "nccl" else torch.device("cpu")
