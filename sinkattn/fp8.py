"""FP8 KV caches (docs/DESIGN.md section 1): the cache holds x / scale in float8_e4m3fn or float8_e5m2, attention
runs on fp8 * scale; q, the new k/v and out stay in q's dtype, and the sink is never quantized.

Scales come as vLLM passes them, per tensor (`k_scale`, `v_scale`: a python float or a 1-element tensor), or as
FlashAttention-3 takes them, per (batch, KV head) (`k_descale`, `v_descale`: (batch, nheads_k) tensors). Either
form becomes one (batch, nheads_k) float32 descale per cache (`descales`), without reading a tensor on the host (a
scale on a GPU stays there; no device synchronisation). Neither given: scale 1.

Appending quantizes the new tokens with the same scales, saturating as vLLM's cache writer does (its FP8
conversion saturates to the finite range): |x / scale| beyond the format's largest finite value (448 for e4m3fn,
57344 for e5m2) is stored as that value with its sign, +-inf too; NaN stays NaN (both formats hold it).
"""
from __future__ import annotations

import torch

from .errors import SinkattnTypeError, SinkattnValueError

DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# q (and the new k/v, and out) of an FP8-cache call; the kernels, once they read FP8, serve bf16 and fp16.
QUERY_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in DTYPES


def largest(dtype: torch.dtype) -> float:
    """The format's largest finite value (the saturation bound)."""
    return float(torch.finfo(dtype).max)


def _one_scale(name: str, value, batch: int, nheads_k: int, device) -> torch.Tensor:
    """A per-tensor scale (float or 1-element tensor) -> (batch, nheads_k) float32 on `device`, with no host read."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or not value.is_floating_point():
            raise SinkattnValueError(f"sinkattn: {name} must be a float or a 1-element floating tensor; got a tensor "
                                     f"of shape {tuple(value.shape)}, dtype {value.dtype}")
        if value.device != device:
            raise SinkattnValueError(f"sinkattn: {name} is on {value.device} but the caches are on {device}")
        return value.to(torch.float32).reshape(1, 1).expand(batch, nheads_k)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SinkattnTypeError(f"sinkattn: {name} must be a float or a 1-element tensor; got {type(value).__name__}")
    if not 0 < value < float("inf"):
        raise SinkattnValueError(f"sinkattn: {name} is {value}; accepted: a finite scale > 0")
    return torch.full((batch, nheads_k), float(value), dtype=torch.float32, device=device)


def _per_head(name: str, t, batch: int, nheads_k: int, device) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != (batch, nheads_k) or not t.is_floating_point():
        got = f"shape {tuple(t.shape)}, dtype {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise SinkattnValueError(f"sinkattn: {name} must be a floating tensor of shape (batch, nheads_k) = "
                                 f"({batch}, {nheads_k}); got {got}")
    if t.device != device:
        raise SinkattnValueError(f"sinkattn: {name} is on {t.device} but the caches are on {device}")
    return t.to(torch.float32)


def descales(cache_dtype: torch.dtype, batch: int, nheads_k: int, device, k_scale=None, v_scale=None,
             k_descale=None, v_descale=None):
    """The (k, v) descales, (batch, nheads_k) float32 each, of a call over caches of `cache_dtype`; (None, None)
    for a cache that is not FP8 (where passing any scale is an error: it would be ignored)."""
    given = {n: x for n, x in (("k_scale", k_scale), ("v_scale", v_scale), ("k_descale", k_descale),
                               ("v_descale", v_descale)) if x is not None}
    if not is_fp8(cache_dtype):
        if given:
            raise SinkattnValueError(
                f"sinkattn: {', '.join(given)} given for a {cache_dtype} cache; scales apply to FP8 caches only "
                f"(float8_e4m3fn, float8_e5m2); drop them")
        return None, None
    if (k_scale is not None or v_scale is not None) and (k_descale is not None or v_descale is not None):
        raise SinkattnValueError("sinkattn: pass per-tensor scales (k_scale, v_scale) or per-(batch, KV head) "
                                 "descales (k_descale, v_descale), not both")
    out = []
    for name, scale, name_d, desc in (("k_scale", k_scale, "k_descale", k_descale),
                                      ("v_scale", v_scale, "v_descale", v_descale)):
        if desc is not None:
            out.append(_per_head(name_d, desc, batch, nheads_k, device))
        else:
            out.append(_one_scale(name, 1.0 if scale is None else scale, batch, nheads_k, device))
    return out[0], out[1]


def quantize(x: torch.Tensor, descale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """New tokens x (b, s, hk, d) -> the cache's FP8 values x / descale, saturating (NaN stays NaN); descale
    (b, hk)."""
    bound = largest(dtype)
    return (x.to(torch.float32) / descale[:, None, :, None]).clamp_(-bound, bound).to(dtype)


def dequantize(tile: torch.Tensor, descale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cache values tile (..., hk, d) -> tile * descale in `dtype`; descale matches tile's dims up to hk: (hk,) for
    one sequence's keys, (b, 1, hk) for a batch's (b, keys, hk, d)."""
    return (tile.to(torch.float32) * descale.unsqueeze(-1)).to(dtype)
