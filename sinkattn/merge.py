"""merge_attn_states: combine two partial attention results over disjoint key sets, adding the sink once.

Split-KV decode and context parallelism compute attention over parts of the keys, each part normalised
over its own keys and holding no sink. With lse_x the natural-log sum of exp(scores) over part x:

    lse = log(exp(lse_a) + exp(lse_b) + exp(sink))
    out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b

A part that saw no key has lse -inf and contributes nothing (its out is ignored, even if NaN).
"""
from __future__ import annotations

import torch

from . import _device, _ext, registry
from .errors import SinkattnTypeError, SinkattnValueError
from .layout import acc_dtype


def check_merge_args(out_a, lse_a, out_b, lse_b, sinks):
    for name, t in (("out_a", out_a), ("lse_a", lse_a), ("out_b", out_b), ("lse_b", lse_b)):
        if not isinstance(t, torch.Tensor):
            raise SinkattnTypeError(f"merge_attn_states: {name} must be a torch.Tensor, got {type(t).__name__}")
    if out_a.dim() != 4 or out_a.shape != out_b.shape:
        raise SinkattnValueError(f"merge_attn_states: out_a and out_b must both be (batch, seqlen, nheads, headdim); "
                                 f"got {tuple(out_a.shape)} and {tuple(out_b.shape)}")
    if out_a.dtype != out_b.dtype or out_a.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise SinkattnTypeError(f"merge_attn_states: out_a/out_b must share a dtype among float32, bfloat16, float16; "
                                f"got {out_a.dtype} and {out_b.dtype}")
    b, s, h, _ = out_a.shape
    for name, t in (("lse_a", lse_a), ("lse_b", lse_b)):
        if tuple(t.shape) != (b, h, s):
            raise SinkattnValueError(f"merge_attn_states: {name} must be (batch, nheads, seqlen) = {(b, h, s)}; "
                                     f"got {tuple(t.shape)}")
        if not t.is_floating_point():
            raise SinkattnTypeError(f"merge_attn_states: {name} must be floating point (float32), got {t.dtype}")
    if sinks is not None:
        if isinstance(sinks, torch.Tensor) and sinks.dtype not in (torch.float32, torch.bfloat16, torch.float16,
                                                                    torch.float64):
            raise SinkattnTypeError(f"merge_attn_states: sinks must be float32, bfloat16 or float16; got {sinks.dtype}")
        if not isinstance(sinks, torch.Tensor) or sinks.shape != (h,):
            raise SinkattnValueError(f"merge_attn_states: sinks must be a tensor of shape (nheads,) = ({h},); got "
                                     f"{tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__}")
    devices = {t.device for t in (out_a, lse_a, out_b, lse_b) + ((sinks,) if sinks is not None else ())}
    if len(devices) > 1:
        raise SinkattnValueError(f"merge_attn_states: all tensors must be on one device; got {sorted(map(str, devices))}")
    if out_a.stride(-1) != 1 or out_b.stride(-1) != 1:
        raise SinkattnValueError("merge_attn_states: out_a/out_b need a contiguous last dimension")


def merge_reference(out_a, lse_a, out_b, lse_b, sinks=None):
    """The merge in PyTorch (fp32 math, float64 for float64 inputs); out (batch, seqlen, nheads, d),
    lse (batch, nheads, seqlen)."""
    acc = acc_dtype(out_a.dtype)
    la, lb = lse_a.to(acc), lse_b.to(acc)
    if sinks is None:
        ls = torch.full_like(la, float("-inf"))
    else:
        ls = sinks.to(acc).view(1, -1, 1).expand_as(la)
    m = torch.maximum(torch.maximum(la, lb), ls)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    ea, eb, es = (torch.exp(x - m_safe) for x in (la, lb, ls))
    # Infinite mass (an overflow upstream) is shared evenly between the infinite parts, as the kernel does.
    inf_row = m == float("inf")
    ea, eb, es = (torch.where(inf_row, (x == float("inf")).float(), e) for x, e in ((la, ea), (lb, eb), (ls, es)))
    total = ea + eb + es
    empty = total == 0
    denom = torch.where(empty, torch.ones_like(total), total)
    wa = (ea / denom).transpose(1, 2).unsqueeze(-1)  # (batch, seqlen, nheads, 1)
    wb = (eb / denom).transpose(1, 2).unsqueeze(-1)
    pa = torch.where(wa != 0, wa * out_a.to(acc), torch.zeros((), dtype=acc, device=out_a.device))
    pb = torch.where(wb != 0, wb * out_b.to(acc), torch.zeros((), dtype=acc, device=out_b.device))
    lse = torch.where(empty, torch.full_like(m, float("-inf")), m_safe + torch.log(denom))
    lse = torch.where(inf_row, m, lse)
    return (pa + pb).to(out_a.dtype), lse


@torch.library.custom_op("sinkattn::merge_attn_states", mutates_args=())
def _merge_op(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor,
              sinks: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    if out_a.is_cuda and _ext.loaded() and registry.merge_kernel_runs(out_a.dtype,
                                                                      _device.capability(out_a.device.index or 0)):
        out, lse = _ext.require().merge_states(out_a, lse_a.float(), out_b, lse_b.float(), sinks)
        return out, lse
    out, lse = merge_reference(out_a, lse_a, out_b, lse_b, sinks)
    return out.contiguous(), lse.contiguous()


@_merge_op.register_fake
def _(out_a, lse_a, out_b, lse_b, sinks):
    return torch.empty_like(out_a, memory_format=torch.contiguous_format), torch.empty_like(
        lse_a, dtype=acc_dtype(out_a.dtype), memory_format=torch.contiguous_format)


# Autograd (context-parallel training backpropagates through the merges). With lse the merged lse,
# w_x = exp(lse_x - lse) for x in {a, b} and w_s = exp(sink - lse):
#   out = w_a out_a + w_b out_b,  lse = log(exp(lse_a) + exp(lse_b) + exp(sink))
#   dout_x = w_x dout
#   dlse_x = w_x (D_x + dlse),            D_x = rowsum(dout * (out_x - out))
#   dsink  = sum_{batch, rows} w_s (dlse - rowsum(dout * out))
# A part with zero weight (lse_x = -inf, or an empty row) gets zero gradients even when its out_x is NaN.
def _merge_setup(ctx, inputs, output):
    out_a, lse_a, out_b, lse_b, sinks = inputs
    out, lse = output
    ctx.save_for_backward(out_a, lse_a, out_b, lse_b, sinks, out, lse)


def _merge_backward(ctx, dout, dlse):
    out_a, lse_a, out_b, lse_b, sinks, out, lse = ctx.saved_tensors
    acc = acc_dtype(out_a.dtype)
    total = lse.to(acc)
    live = torch.isfinite(total)
    total_safe = torch.where(live, total, torch.zeros_like(total))
    zero = torch.zeros((), dtype=acc, device=out_a.device)

    def weight(lse_x):  # (batch, nheads, seqlen)
        lx = lse_x.to(acc)
        ok = live & (lx > float("-inf"))
        return torch.where(ok, torch.exp(torch.where(ok, lx, total_safe) - total_safe), zero)

    o = out.to(acc)
    do = torch.zeros_like(o) if dout is None else dout.to(acc)
    dl = torch.zeros_like(total) if dlse is None else dlse.to(acc)
    grads = []
    for out_x, lse_x in ((out_a, lse_a), (out_b, lse_b)):
        w = weight(lse_x)
        w4 = w.transpose(1, 2).unsqueeze(-1)  # (batch, seqlen, nheads, 1)
        d_x = (do * (out_x.to(acc) - o)).sum(-1).transpose(1, 2)  # (batch, nheads, seqlen)
        d_x = torch.where(w != 0, d_x, zero)
        dlse_x = torch.where(w != 0, w * (d_x + dl), zero)
        dout_x = torch.where(w4 != 0, w4 * do, zero)
        grads += [dout_x.to(out_x.dtype), dlse_x.to(lse_x.dtype)]
    dsinks = None
    if sinks is not None:
        ws = weight(sinks.view(1, -1, 1).expand_as(total))
        d_o = (do * o).sum(-1).transpose(1, 2)
        dsinks = torch.where(ws != 0, ws * (dl - d_o), zero).sum(dim=(0, 2)).to(sinks.dtype)
    return grads[0], grads[1], grads[2], grads[3], dsinks


torch.library.register_autograd("sinkattn::merge_attn_states", _merge_backward, setup_context=_merge_setup)


def merge_attn_states(out_a, lse_a, out_b, lse_b, sinks=None):
    """Merge two partial attention states computed without sinks over disjoint key sets.

    out_a, out_b: (batch, seqlen, nheads, headdim), same dtype; lse_a, lse_b: (batch, nheads, seqlen), natural
    log, without the sink. sinks: optional (nheads,) logits in scaled-score units, counted once here.
    Returns (out, lse) with lse including the sink. Differentiable in every input. (The op itself,
    torch.ops.sinkattn.merge_attn_states, also merges float64 states in float64: gradcheck and the
    float64 context-parallel path use it directly.)"""
    check_merge_args(out_a, lse_a, out_b, lse_b, sinks)
    return _merge_op(out_a, lse_a, out_b, lse_b, sinks)
