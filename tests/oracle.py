"""A naive float64 oracle for docs/DESIGN.md section 1, written straight from the contract.

Other test files, the kernel tests, the benchmarks and the integrations import these names; keep
them stable:

    visible(seqlen_q, seqlen_k, window_left=-1, window_right=-1, sink_tokens=0) -> bool (sq, sk)
        Which key j query i may see (bottom-right alignment, -1 = unbounded side).
    attention_oracle(q, k, v, sinks=None, *, softmax_scale=None, causal=False, window_size=(-1, -1),
                     sink_tokens=0, softcap=0.0, compute_dtype=torch.float64) -> (out, lse)
        q (b, sq, h, d), k/v (b, sk, hk, d); out (b, sq, h, d), lse (b, h, sq), both in compute_dtype.
        Differentiable (autograd gives the reference gradients, incl. sinks). compute_dtype=bf16/fp16
        gives "the same math done in PyTorch at that dtype", the baseline of the tolerance rule.
    attention_oracle_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, sinks=None, **kw) -> (out, lse)
        Packed q (total_q, h, d), k/v (total_k, hk, d); lse (h, total_q). Rows past cu_seqlens_q[-1]
        get out 0, lse -inf.
    rotary_oracle(x, cos, sin, positions, interleaved) -> x rotated
        x (b, s, h, d), positions (b, s); rotates the first 2*cos.shape[1] dims (GPT-NeoX halves, or
        GPT-J interleaved pairs), the rest pass through.
    tolerance_check(name, got, ref, baseline, atol) -> None
        FlashAttention's rule: max|got - ref| <= 2 * max|baseline - ref| + atol, with a readable error.
    single_thread
        A pytest fixture; import it into a test module to run each test on one torch thread (tests use
        tiny tensors, and two OpenMP threads on two cores shared with compilers wait on each other).

Nothing here tiles, skips blocks or uses an online softmax: the point is to be obviously right.
"""
from __future__ import annotations

import math

import pytest
import torch


@pytest.fixture(autouse=True)
def single_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def visible(seqlen_q: int, seqlen_k: int, window_left: int = -1, window_right: int = -1,
            sink_tokens: int = 0, device=None) -> torch.Tensor:
    i = torch.arange(seqlen_q, device=device)[:, None]
    j = torch.arange(seqlen_k, device=device)[None, :]
    off = seqlen_k - seqlen_q
    right_ok = (j <= i + off + window_right) if window_right >= 0 else torch.ones_like(i == j)
    left_ok = ((j >= i + off - window_left) | (j < sink_tokens)) if window_left >= 0 else torch.ones_like(i == j)
    return right_ok & left_ok


def _window(causal: bool, window_size) -> tuple[int, int]:
    left, right = window_size
    return left, (0 if causal else right)


def attention_oracle(q, k, v, sinks=None, *, softmax_scale=None, causal=False, window_size=(-1, -1),
                     sink_tokens=0, softcap=0.0, compute_dtype=torch.float64):
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    left, right = _window(causal, window_size)
    q, k, v = (t.to(compute_dtype) for t in (q, k, v))
    k = k.repeat_interleave(h // hk, dim=2)
    v = v.repeat_interleave(h // hk, dim=2)
    s = torch.einsum("bihd,bjhd->bhij", q, k) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    mask = visible(sq, sk, left, right, sink_tokens, device=q.device)
    s = s.masked_fill(~mask, float("-inf"))
    sink_col = (torch.full((h,), float("-inf"), dtype=compute_dtype, device=q.device) if sinks is None
                else sinks.to(compute_dtype))
    logits = torch.cat([s, sink_col.view(1, h, 1, 1).expand(b, h, sq, 1)], dim=-1)
    # A row with nothing above -inf (no visible key, no sink) has lse -inf and out 0. Compute those rows on
    # zeros and select them away with where(): where's backward sends them no gradient, so no NaN leaks.
    live = (logits != -math.inf).any(-1).detach()  # a +inf sink alone is an answer too: lse +inf, out 0
    safe = torch.where(live[..., None], logits, torch.zeros_like(logits))
    lse_safe = torch.logsumexp(safe, dim=-1)
    p = torch.exp(safe - lse_safe[..., None])[..., :sk]
    p = torch.where(live[..., None], p, torch.zeros_like(p))
    out = torch.einsum("bhij,bjhd->bihd", p, v)
    lse = torch.where(live, lse_safe, torch.full_like(lse_safe, float("-inf")))
    return out, lse


def attention_oracle_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, sinks=None, **kw):
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    dtype = kw.get("compute_dtype", torch.float64)
    out_parts, lse_parts = [], []
    for b in range(len(cq) - 1):
        o, l = attention_oracle(q[None, cq[b]:cq[b + 1]], k[None, ck[b]:ck[b + 1]], v[None, ck[b]:ck[b + 1]],
                                sinks, **kw)
        out_parts.append(o[0])
        lse_parts.append(l[0])
    tail, h = q.shape[0] - cq[-1], q.shape[1]
    out_parts.append(torch.zeros((tail, h, v.shape[-1]), dtype=dtype))
    lse_parts.append(torch.full((h, tail), float("-inf"), dtype=dtype))
    return torch.cat(out_parts, 0), torch.cat(lse_parts, 1)


def rotary_oracle(x, cos, sin, positions, interleaved: bool):
    rd = 2 * cos.shape[1]
    c = cos.double()[positions][:, :, None, :]
    s = sin.double()[positions][:, :, None, :]
    xr = x[..., :rd].double()
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        rot = torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).flatten(-2)
    else:
        x1, x2 = xr[..., : rd // 2], xr[..., rd // 2:]
        rot = torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1)
    return torch.cat([rot, x[..., rd:].double()], dim=-1)


def _finite_err(got, ref):
    """max |got - ref| where inf entries must match exactly (an -inf lse is an answer, not an error)."""
    got, ref = got.double(), ref.double()
    same_inf = torch.isinf(ref) & (got == ref)
    if (torch.isinf(ref) & ~same_inf).any() or (torch.isinf(got) & ~same_inf).any() or torch.isnan(got).any():
        return float("inf")
    diff = torch.where(same_inf, torch.zeros_like(ref), got - ref)
    return diff.abs().max().item() if diff.numel() else 0.0


def tolerance_check(name, got, ref, baseline, atol, seed=None):
    err = _finite_err(got, ref)
    base = _finite_err(baseline, ref) if baseline is not None else 0.0
    if base == float("inf"):
        base = 0.0  # the low-precision baseline overflowed; hold the result to atol alone
    bound = 2 * base + atol
    if not err <= bound:
        raise AssertionError(f"{name}: max error {err:.3g} > 2 * baseline error {base:.3g} + atol {atol:g}"
                             + ("" if seed is None else f" (seed {seed})"))
