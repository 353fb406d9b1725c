"""The accuracy cost of an FP8 KV cache: attention over an e4m3 / e5m2 cache against the same attention over the
bf16 cache, in float64 (the end-to-end half; docs/fp8.md holds the table).

    python -m bench.studies.fp8_accuracy [--contexts 4096,16384] [--queries 16] [--seed 0]

No model hub is reachable here, so the K/V are synthetic, built with the statistics reported for real K/V caches
(KIVI, KVQuant, "Massive activations", SmoothQuant on Llama-class models; gpt-oss's published shapes):
  - shapes: gpt-oss's attention (64 query heads over 8 KV heads, head dim 64, learnable sinks ~ N(1, 1)), a
    sliding-window layer (128 keys) and a full layer, decoding the last --queries positions of each context;
  - K before RoPE: per-channel scales log-normal (sigma 0.6), and per KV head 2 of the 64 channels outliers at 12x
    the median scale with a consistent sign (mean 8x the median scale), the per-channel structure K caches show;
    one early token (position 0, an attention-sink token) with a key 3x the typical norm along the outlier channels;
  - RoPE (GPT-NeoX halves, theta 150000, gpt-oss's) at the keys' absolute positions, so the outliers rotate into
    their pair channels at their (low) frequency, as a real cache stores them;
  - V: per-channel log-normal scales (sigma 0.3), no outlier channels (V caches have none), the sink token's value
    near zero;
  - Q: the same per-channel structure as K (the query projection's outliers share K's channels), RoPE'd at the query
    positions, scaled so the score's standard deviation is about 2.5 nats: sparse, peaked attention rows.
The model dtype is bf16: the reference is the bf16 cache (what `--kv-cache-dtype auto` stores), the FP8 caches are
quantized from it (x / scale, saturating, as vLLM's writers and sinkattn.fp8.quantize) with per-tensor scales chosen
as vLLM's calibration would (amax / 448 for e4m3, amax / 57344 for e5m2, over the layer's whole K or V), one per KV
head (compressed-tensors' attn_head, amax per head), and 1.0 (vLLM's default without checkpoint scales). All
attention is float64 on the dequantized cache (tests/oracle.py's visibility rule), so only the FP8 step is measured;
the last row per layer is sinkattn's own FP8 path (flash_attn_with_kvcache, bf16 queries, reference backend on the
CPU) against the same bf16-cache answer, which adds the bf16 arithmetic of the call.

A second profile, "gaussian" (i.i.d. N(0, 1) K/V, q N(0, 2.5^2): no channel structure, no RoPE), is the benign
bound: the gap between the two rows is what the channel structure costs.

Reported per layer and cache (with the bf16 logits' std and largest magnitude, which set the FP8 score error):
max and mean |out_fp8 - out_bf16|, the relative error ||out_fp8 - out_bf16|| /
||out_bf16|| (Frobenius, over all heads and rows), and the softmax's total variation 0.5 * sum |p_fp8 - p_bf16| per
(head, query) row (the sink's column included), mean and max; plus the fraction of cache values that saturated.
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import torch

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(_ROOT, "tests"))  # the oracle lives with the tests
from oracle import attention_oracle, visible  # noqa: E402

H, HK, D = 64, 8, 64
THETA = 150000.0
WINDOW = 128


def rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """GPT-NeoX rotary on x (s, h, d) at positions (s,)."""
    half = x.shape[-1] // 2
    inv = THETA ** (-torch.arange(half, dtype=torch.float64) / half)
    ang = positions.double()[:, None] * inv[None, :]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


def activations(seqlen: int, queries: int, g: torch.Generator, profile: str = "outliers"):
    """(q (queries, H, D), k (seqlen, HK, D), v (seqlen, HK, D), sinks (H,)), float64, as the module doc says;
    profile "gaussian": i.i.d. N(0, 1) K/V and q (no channel structure, no RoPE), the same score std."""
    if profile == "gaussian":
        k = torch.randn(seqlen, HK, D, generator=g, dtype=torch.float64)
        v = torch.randn(seqlen, HK, D, generator=g, dtype=torch.float64)
        q = torch.randn(queries, H, D, generator=g, dtype=torch.float64) * 2.5
        return q, k, v, torch.randn(H, generator=g, dtype=torch.float64) + 1.0
    scale_k = torch.exp(0.6 * torch.randn(HK, D, generator=g, dtype=torch.float64))
    mean_k = torch.zeros(HK, D, dtype=torch.float64)
    med = scale_k.median()
    for h in range(HK):
        ch = torch.randperm(D // 2, generator=g)[:2] + D // 2  # low-frequency half: outliers survive RoPE slowly
        scale_k[h, ch] = 12 * med
        mean_k[h, ch] = 8 * med * torch.sign(torch.randn(2, generator=g, dtype=torch.float64))
    k = mean_k + scale_k * torch.randn(seqlen, HK, D, generator=g, dtype=torch.float64)
    k[0] = mean_k * 3  # an attention-sink token: along the outlier channels, 3x
    k = rope(k, torch.arange(seqlen))
    scale_v = torch.exp(0.3 * torch.randn(HK, D, generator=g, dtype=torch.float64))
    v = scale_v * torch.randn(seqlen, HK, D, generator=g, dtype=torch.float64)
    v[0] *= 0.05  # the sink token's value is near zero
    group = H // HK
    q = (mean_k / med).repeat_interleave(group, 0) * 0.3 + (scale_k / med).repeat_interleave(group, 0) * \
        torch.randn(queries, H, D, generator=g, dtype=torch.float64)
    q = rope(q, torch.arange(seqlen - queries, seqlen))
    # Scores of std ~2.5 nats at softmax_scale D ** -0.5: rescale q once from a sample.
    s = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(group, 1)) * D ** -0.5
    q = q * (2.5 / s.std())
    sinks = torch.randn(H, generator=g, dtype=torch.float64) + 1.0
    return q, k, v, sinks


def probabilities(q, k, v, sinks, window_left):
    """float64 softmax rows (H, sq, sk + 1; the sink's column last) and out (sq, H, D), by the oracle's rule."""
    sq, sk = q.shape[0], k.shape[0]
    kk, vv = k.repeat_interleave(H // HK, 1), v.repeat_interleave(H // HK, 1)
    s = torch.einsum("qhd,khd->hqk", q, kk) * D ** -0.5
    s = s.masked_fill(~visible(sq, sk, window_left, 0), float("-inf"))
    logits = torch.cat([s, sinks.view(H, 1, 1).expand(H, sq, 1)], dim=-1)
    p = torch.softmax(logits, dim=-1)
    out = torch.einsum("hqk,khd->qhd", p[..., :sk], vv)
    return p, out


def quantize(x: torch.Tensor, scale: torch.Tensor, fmt: torch.dtype):
    """x (s, hk, d) in bf16 -> (dequantized float64, fraction saturated): x / scale in fp32, saturating."""
    big = torch.finfo(fmt).max
    y = x.float() / scale.float()
    sat = (y.abs() > big).double().mean().item()
    return (y.clamp(-big, big).to(fmt).double() * scale.double()), sat


def scales(x: torch.Tensor, fmt: torch.dtype, form: str) -> torch.Tensor:
    """A scale of `form` for x (s, hk, d): 'amax' per tensor, 'amax/head' (hk, 1), 'one'; broadcastable to x."""
    if form == "one":
        return torch.tensor(1.0)
    big = torch.finfo(fmt).max
    if form == "amax":
        return (x.float().abs().amax() / big)
    return (x.float().abs().amax(dim=(0, 2)) / big)[:, None]


CACHES = [("e4m3", torch.float8_e4m3fn, "amax"), ("e4m3", torch.float8_e4m3fn, "amax/head"),
          ("e4m3", torch.float8_e4m3fn, "one"), ("e5m2", torch.float8_e5m2, "amax"),
          ("e5m2", torch.float8_e5m2, "one")]


def metrics(p, out, p_ref, out_ref) -> dict:
    d = (out - out_ref).abs()
    tv = 0.5 * (p - p_ref).abs().sum(-1)
    return dict(max_abs=d.max().item(), mean_abs=d.mean().item(),
                rel=((out - out_ref).norm() / out_ref.norm()).item(), tv_mean=tv.mean().item(), tv_max=tv.max().item())


def study(contexts, queries, seed, profiles=("outliers", "gaussian")):
    rows = []
    for profile, sk in [(pr, c) for pr in profiles for c in contexts]:
        g = torch.Generator().manual_seed(seed + sk)
        q, k, v, sinks = activations(sk, queries, g, profile)
        q16, k16, v16 = q.to(torch.bfloat16), k.to(torch.bfloat16), v.to(torch.bfloat16)
        for layer, left in (("sliding 128", WINDOW - 1), ("full", -1)):
            p_ref, out_ref = probabilities(q16.double(), k16.double(), v16.double(), sinks, left)
            logits = torch.einsum("qhd,khd->hqk", q16.double(), k16.double().repeat_interleave(H // HK, 1)) * D ** -0.5
            if left >= 0:
                logits = logits[..., -(WINDOW + queries):]
            stats = dict(profile=profile, logit_std=logits.std().item(), logit_absmax=logits.abs().max().item())
            check, _ = attention_oracle(q16.double()[None], k16.double()[None], v16.double()[None], sinks,
                                        causal=True, window_size=(left, 0))
            assert torch.allclose(check[0], out_ref, rtol=0, atol=1e-12), "probabilities() left the oracle's rule"
            for name, fmt, form in CACHES:
                ks, vs = scales(k16, fmt, form), scales(v16, fmt, form)
                kq, k_sat = quantize(k16, ks, fmt)
                vq, v_sat = quantize(v16, vs, fmt)
                p, out = probabilities(q16.double(), kq, vq, sinks, left)
                rows.append(dict(context=sk, layer=layer, cache=f"{name}, scale {form}", **stats,
                                 k_scale=ks.max().item(), sat=max(k_sat, v_sat), **metrics(p, out, p_ref, out_ref)))
            rows.append(dict(sinkattn_row(sk, layer, left, q16, k16, v16, sinks, out_ref), **stats))
    return rows


def sinkattn_row(sk, layer, left, q16, k16, v16, sinks, out_ref) -> dict:
    """sinkattn's own path: an e4m3 cache written by flash_attn_with_kvcache's append (amax scale), bf16 queries."""
    import sinkattn
    fmt = torch.float8_e4m3fn
    ks, vs = scales(k16, fmt, "amax"), scales(v16, fmt, "amax")
    k_cache = torch.empty(1, sk, HK, D, dtype=fmt)
    v_cache = torch.empty(1, sk, HK, D, dtype=fmt)
    sq = q16.shape[0]
    with torch.no_grad():
        sinkattn.flash_attn_with_kvcache(q16[None, :1], k_cache, v_cache, k=k16[None, :sk - sq], v=v16[None, :sk - sq],
                                         cache_seqlens=0, causal=True, k_scale=ks, v_scale=vs)  # the prefix's writes
        out = sinkattn.flash_attn_with_kvcache(q16[None], k_cache, v_cache, sinks.float(), k=k16[None, sk - sq:],
                                               v=v16[None, sk - sq:], cache_seqlens=sk - sq, causal=True,
                                               window_size=(left, 0), k_scale=ks, v_scale=vs, backend="reference")
    out = out[0].double()
    d = (out - out_ref).abs()
    return dict(context=sk, layer=layer, cache="e4m3, scale amax: sinkattn (bf16 call)", k_scale=ks.item(), sat=0.0,
                max_abs=d.max().item(), mean_abs=d.mean().item(), rel=((out - out_ref).norm() / out_ref.norm()).item(),
                tv_mean=float("nan"), tv_max=float("nan"))


def table(rows) -> str:
    head = ("| K/V | context | layer (logit std / max) | cache | max abs | mean abs | rel (Frobenius) | TV mean | "
            "TV max | saturated |\n| --- | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    lines = [head]
    for r in rows:
        tv = ("-", "-") if math.isnan(r["tv_mean"]) else (f"{r['tv_mean']:.2e}", f"{r['tv_max']:.2e}")
        layer = f"{r['layer']} ({r['logit_std']:.1f} / {r['logit_absmax']:.0f})"
        lines.append(f"| {r['profile']} | {r['context']} | {layer} | "
                     f"{r['cache']} | {r['max_abs']:.2e} | {r['mean_abs']:.2e} | {r['rel']:.2e} | {tv[0]} | {tv[1]} | "
                     f"{r['sat']:.1e} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", default="4096,16384", help="comma-separated context lengths")
    p.add_argument("--queries", type=int, default=16, help="decoded positions at the end of each context")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profiles", default="outliers,gaussian", help="K/V statistics: outliers (the doc's), gaussian")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    rows = study([int(c) for c in a.contexts.split(",")], a.queries, a.seed, a.profiles.split(","))
    print(table(rows))


if __name__ == "__main__":
    main()
