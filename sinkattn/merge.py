"""merge_attn_states: combine two partial attention results over disjoint key sets, adding the sink once.

Split-KV decode and context parallelism compute attention over parts of the keys, each part normalised
over its own keys and holding no sink. With lse_x the natural-log sum of exp(scores) over part x:

    lse = log(exp(lse_a) + exp(lse_b) + exp(sink))
    out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b

A part that saw no key has lse -inf and contributes nothing (its out is ignored, even if NaN).
"""
from __future__ import annotations

import torch

from . import _ext
from .errors import SinkattnTypeError, SinkattnValueError


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
        if not isinstance(sinks, torch.Tensor) or sinks.shape != (h,):
            raise SinkattnValueError(f"merge_attn_states: sinks must be a tensor of shape (nheads,) = ({h},); got "
                                     f"{tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__}")
    devices = {t.device for t in (out_a, lse_a, out_b, lse_b) + ((sinks,) if sinks is not None else ())}
    if len(devices) > 1:
        raise SinkattnValueError(f"merge_attn_states: all tensors must be on one device; got {sorted(map(str, devices))}")
    if out_a.stride(-1) != 1 or out_b.stride(-1) != 1:
        raise SinkattnValueError("merge_attn_states: out_a/out_b need a contiguous last dimension")


def merge_reference(out_a, lse_a, out_b, lse_b, sinks=None):
    """The merge in PyTorch (fp32 math); out (batch, seqlen, nheads, d), lse (batch, nheads, seqlen)."""
    la, lb = lse_a.float(), lse_b.float()
    if sinks is None:
        ls = torch.full_like(la, float("-inf"))
    else:
        ls = sinks.float().view(1, -1, 1).expand_as(la)
    m = torch.maximum(torch.maximum(la, lb), ls)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    ea, eb, es = (torch.exp(x - m_safe) for x in (la, lb, ls))
    total = ea + eb + es
    empty = total == 0
    denom = torch.where(empty, torch.ones_like(total), total)
    wa = (ea / denom).transpose(1, 2).unsqueeze(-1)  # (batch, seqlen, nheads, 1)
    wb = (eb / denom).transpose(1, 2).unsqueeze(-1)
    pa = torch.where(wa != 0, wa * out_a.float(), torch.zeros((), dtype=torch.float32, device=out_a.device))
    pb = torch.where(wb != 0, wb * out_b.float(), torch.zeros((), dtype=torch.float32, device=out_b.device))
    lse = torch.where(empty, torch.full_like(m, float("-inf")), m_safe + torch.log(denom))
    return (pa + pb).to(out_a.dtype), lse


@torch.library.custom_op("sinkattn::merge_attn_states", mutates_args=())
def _merge_op(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor,
              sinks: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    if out_a.is_cuda and _ext.loaded() and any(
            k["op"] == "merge" and k["dtype"] == {torch.bfloat16: "bf16", torch.float16: "fp16",
                                                  torch.float32: "fp32"}.get(out_a.dtype) for k in _ext.registry()):
        out, lse = _ext.require().merge_states(out_a, lse_a.float(), out_b, lse_b.float(), sinks)
        return out, lse
    out, lse = merge_reference(out_a, lse_a, out_b, lse_b, sinks)
    return out.contiguous(), lse.contiguous()


@_merge_op.register_fake
def _(out_a, lse_a, out_b, lse_b, sinks):
    return torch.empty_like(out_a, memory_format=torch.contiguous_format), torch.empty_like(
        lse_a, dtype=torch.float32, memory_format=torch.contiguous_format)


def merge_attn_states(out_a, lse_a, out_b, lse_b, sinks=None):
    """Merge two partial attention states computed without sinks over disjoint key sets.

    out_a, out_b: (batch, seqlen, nheads, headdim), same dtype; lse_a, lse_b: (batch, nheads, seqlen), natural
    log, without the sink. sinks: optional (nheads,) logits in scaled-score units, counted once here.
    Returns (out, lse) with lse including the sink. Not differentiable (a serving primitive)."""
    check_merge_args(out_a, lse_a, out_b, lse_b, sinks)
    return _merge_op(out_a, lse_a, out_b, lse_b, sinks)
