"""Problems that exercise the backward kernels, and the check of one backward run against the oracle.

Shared by the emulated backward tests (CPU) and the GPU backward tests (marked `gpu`), so both hold the
kernels to the same cases and the same tolerance rule (docs/DESIGN.md section 6): the reference gradients are
float64 autograd on the oracle, the baseline is autograd on the oracle computed at the input dtype, and
error <= 2 x baseline error + atol for dq, dk, dv and dsinks.

The loss is sum(out * dout) + sum(lse * dlse) (over rows whose lse is finite), so a returned lse used in the
loss (dlse != 0) is covered as well as the plain case (dlse None).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from sinkattn.mask import Mask

from kernel_cases import Case, make_sinks
from oracle import attention_oracle, attention_oracle_varlen, tolerance_check

NAN = float("nan")


@dataclass
class BwdCase(Case):
    """A forward kernel case plus whether the loss uses the returned lse (dlse != 0)."""
    dlse: bool = True


def bwd_cases(headdims, dtypes) -> list[BwdCase]:
    cases = []
    for d in headdims:
        for dt in dtypes:
            t = "bf16" if dt == torch.bfloat16 else "fp16"
            cases += [
                BwdCase(f"d{d}-{t}-plain", d, dt, batch=2, seqlen_q=130, seqlen_k=150, dlse=False),
                BwdCase(f"d{d}-{t}-causal-gqa4", d, dt, seqlen_q=140, seqlen_k=140, nheads=4, nheads_k=1, causal=True),
            ]
        cases += [
            BwdCase(f"d{d}-window-cuts-blocks-sinktok", d, seqlen_q=190, seqlen_k=260, causal=True, window=(37, 0),
                    sink_tokens=5),
            BwdCase(f"d{d}-causal-sq>sk-empty-rows", d, seqlen_q=100, seqlen_k=30, causal=True),
            BwdCase(f"d{d}-window-right-sq<sk-sink+30", d, seqlen_q=70, seqlen_k=150, window=(20, 7), sinks="+30"),
            BwdCase(f"d{d}-sinks-neginf", d, seqlen_q=65, seqlen_k=129, sinks="-inf"),
            BwdCase(f"d{d}-no-sinks-softcap", d, seqlen_q=33, seqlen_k=97, sinks="none", softcap=15.0, dlse=False),
            BwdCase(f"d{d}-softcap-sinks", d, seqlen_q=77, seqlen_k=77, causal=True, softcap=5.0),
            BwdCase(f"d{d}-varlen-empty", d, varlen=[(17, 40), (0, 5), (70, 0), (129, 130), (1, 1)], nheads=4,
                    nheads_k=2, causal=True, window=(50, 0), sink_tokens=2),
            # Only full M tiles (seqlen_q a multiple of every block_m): the unpredicated dQ adds reach the last row
            # of each sequence, next to the following sequence's rows.
            BwdCase(f"d{d}-even-tiles-gqa", d, batch=2, seqlen_q=128, seqlen_k=192, nheads=2, nheads_k=1, dlse=False),
            BwdCase(f"d{d}-tiny", d, seqlen_q=1, seqlen_k=1),
            BwdCase(f"d{d}-seqlen-q0", d, seqlen_q=0, seqlen_k=5),
            BwdCase(f"d{d}-seqlen-k0", d, seqlen_q=5, seqlen_k=0),
            BwdCase(f"d{d}-sinktok>seqlen", d, seqlen_q=50, seqlen_k=70, causal=True, window=(3, 0), sink_tokens=90),
        ]
    return cases


def _loss(out, lse, dout, dlse):
    loss = (out.double() * dout.double()).sum()
    if dlse is not None:
        loss = loss + (torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)).double() * dlse.double()).sum()
    return loss


def _oracle_grads(case, q, k, v, sinks, dout, dlse, cu, compute_dtype, kw):
    """(out, lse, dq, dk, dv, dsinks) of the oracle at compute_dtype, by autograd."""
    leaves = [t.detach().cpu().to(compute_dtype).requires_grad_() for t in (q, k, v)]
    s = None if sinks is None else sinks.detach().cpu().double().requires_grad_()
    sk = None if s is None else (s if compute_dtype == torch.float64 else s.float())
    if cu is None:
        out, lse = attention_oracle(*leaves, sk, compute_dtype=compute_dtype, **kw)
    else:
        out, lse = attention_oracle_varlen(*leaves, cu[0], cu[1], sk, compute_dtype=compute_dtype, **kw)
    loss = _loss(out, lse, dout.cpu(), None if dlse is None else dlse.cpu())
    grads = torch.autograd.grad(loss, leaves + ([s] if s is not None else []), allow_unused=True)
    ds = grads[3] if s is not None else None
    return out.detach(), lse.detach(), grads[0], grads[1], grads[2], ds


def make_inputs(case: BwdCase, device, gen_seed=None):
    h, hk, d = case.nheads, case.nheads_k, case.headdim
    sinks = make_sinks(case.sinks, h, device)
    if case.varlen is None:
        q = torch.randn(case.batch, case.seqlen_q, h, d, device=device, dtype=case.dtype)
        k = torch.randn(case.batch, case.seqlen_k, hk, d, device=device, dtype=case.dtype)
        v = torch.randn(case.batch, case.seqlen_k, hk, d, device=device, dtype=case.dtype)
        lse_shape = (case.batch, h, case.seqlen_q)
        cu = None
    else:
        lq = [a for a, _ in case.varlen]
        lk = [b for _, b in case.varlen]
        cu_q = torch.tensor([0] + list(torch.tensor(lq).cumsum(0)), dtype=torch.int32)
        cu_k = torch.tensor([0] + list(torch.tensor(lk).cumsum(0)), dtype=torch.int32)
        q = torch.randn(sum(lq), h, d, device=device, dtype=case.dtype)
        k = torch.randn(sum(lk), hk, d, device=device, dtype=case.dtype)
        v = torch.randn(sum(lk), hk, d, device=device, dtype=case.dtype)
        lse_shape = (h, sum(lq))
        cu = (cu_q, cu_k)
    dout = torch.randn_like(q)
    dlse = torch.randn(lse_shape, device=device) if case.dlse else None
    return q, k, v, sinks, dout, dlse, cu


def run_bwd_case(case: BwdCase, backend: str, device: str, backward, seed=None, deterministic=False, repeats=1):
    """Runs `backward` (the kernel bridge's signature) on fresh random inputs with poisoned outputs and checks
    dq, dk, dv, dsinks against float64 autograd on the oracle. Returns the list of (dq, dk, dv, dsinks) runs."""
    left, right = case.window
    if case.causal:
        right = 0
    scale = 1.0 / math.sqrt(case.headdim)
    kw = dict(softmax_scale=scale, causal=case.causal, window_size=case.window, sink_tokens=case.sink_tokens,
              softcap=case.softcap)
    q, k, v, sinks, dout, dlse, cu = make_inputs(case, device)
    ref = _oracle_grads(case, q, k, v, sinks, dout, dlse, cu, torch.float64, kw)
    base = _oracle_grads(case, q, k, v, sinks, dout, dlse, cu, case.dtype, kw)
    # The forward's results, as a kernel forward would hand them over: out in the input dtype, lse in fp32.
    out = ref[0].to(case.dtype).to(device)
    lse = ref[1].float().to(device)
    vl = {}
    if cu is not None:
        vl = dict(cu_seqlens_q=cu[0].to(device), cu_seqlens_k=cu[1].to(device),
                  max_seqlen_q=max(a for a, _ in case.varlen), max_seqlen_k=max(b for _, b in case.varlen))
    runs = []
    for _ in range(repeats):
        dq, dk, dv = (torch.full_like(t, NAN) for t in (q, k, v))
        dsinks = None if sinks is None else torch.full((case.nheads,), NAN, device=device)
        backward(backend, dout, q, k, v, sinks, out, lse, dlse, dq, dk, dv, dsinks,
                 mask=Mask(scale, left, right, case.sink_tokens, case.softcap), deterministic=deterministic,
                 max_smem=case.max_smem, **vl)
        runs.append((dq, dk, dv, dsinks))
    dq, dk, dv, dsinks = runs[0]
    # FlashAttention-2's backward takes D_i = rowsum(dO_i * O_i) from the forward's out in the input dtype;
    # that rounding is part of "the same math at the input dtype". It equals exact gradients with dlse
    # shifted by -rowsum(dO * (O_rounded - O)), so float64 autograd with that shift is the second baseline,
    # and each gradient is held to the worse of the two (a one-row case failed the autograd-only rule by
    # chance in CI dry runs: seeds 563261960 and 378672689).
    shift = (dout.cpu().double() * (out.cpu().double() - ref[0].double())).sum(-1)
    shift = shift.transpose(1, 2) if cu is None else shift.transpose(0, 1)
    dlse_rounded = (0 if dlse is None else dlse.cpu().double()) - shift
    base2 = _oracle_grads(case, q, k, v, sinks, dout, dlse_rounded, cu, torch.float64, kw)
    for i, (name, got) in enumerate((("dq", dq), ("dk", dk), ("dv", dv), ("dsinks", dsinks)), start=2):
        if got is None:
            continue
        tolerance_check(f"{case} {name}", got.cpu(), ref[i], _worse_baseline(ref[i], base[i], base2[i]), atol=2e-3,
                        seed=seed)
    return runs


def _worse_baseline(ref, *baselines):
    """The baseline whose error against ref is largest (both are 'the same math at the input dtype')."""
    return max(baselines, key=lambda b: (b.double() - ref.double()).abs().max().item() if b.numel() else 0.0)
