"""Rotary position embedding (RoPE), the one implementation: the KV-cache op rotates q and the new keys,
SinkKVCache re-rotates kept keys on read, the transformers SinkCache re-rotates by position deltas.

Math in the accumulation dtype (fp32, float64 for float64 x). Two layouts of the rotated pairs: interleaved
(GPT-J: (x[2i], x[2i+1])) and halves (GPT-NeoX, Llama, gpt-oss: (x[i], x[i + r/2])). Only the first r =
2 * cos.shape[-1] dims of x are rotated; the rest pass through.
"""
from __future__ import annotations

import torch

from .layout import acc_dtype


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """x (..., d) rotated by the angles whose cos/sin (..., r/2) broadcast against x[..., :r/2]."""
    acc = acc_dtype(x.dtype)
    rd = 2 * cos.shape[-1]
    c, s = cos.to(acc), sin.to(acc)
    xr = x[..., :rd].to(acc)
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        rot = torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).flatten(-2)
    else:
        x1, x2 = xr[..., : rd // 2], xr[..., rd // 2:]
        rot = torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1)
    if rd == x.shape[-1]:
        return rot.to(x.dtype)
    return torch.cat([rot.to(x.dtype), x[..., rd:]], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                 interleaved: bool) -> torch.Tensor:
    """x (b, s, h, d) rotated at `positions`, (b, s) or (s,), by FlashAttention's tables cos/sin
    (max_position, rotary_dim / 2)."""
    return rotate(x, cos[positions].unsqueeze(-2), sin[positions].unsqueeze(-2), interleaved)


def rotate_halves(x: torch.Tensor, angle: torch.Tensor) -> torch.Tensor:
    """x (..., d) rotated by `angle` (broadcastable to (..., d/2)) in the halves layout over all of d."""
    return rotate(x, angle.cos(), angle.sin(), interleaved=False)


def halves_table(angle: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, signed sin) tables (..., d) of `angle` (..., d/2) for `rotate_by_table` on x of `dtype`: computed
    once and applied to many tensors (every layer of a decode step)."""
    acc = acc_dtype(dtype)
    c, s = angle.cos().to(acc), angle.sin().to(acc)
    return torch.cat([c, c], -1), torch.cat([-s, s], -1)


def rotate_by_table(x: torch.Tensor, table: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """`rotate_halves` with a `halves_table`: x * cos + swap_halves(x) * sin, in place on the one new tensor."""
    half = x.shape[-1] // 2
    xa = x.to(table[0].dtype)
    out = torch.cat([xa[..., half:], xa[..., :half]], -1).mul_(table[1]).addcmul_(xa, table[0])
    return out.to(x.dtype)
