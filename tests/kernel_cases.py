"""Problems that exercise the attention kernels, and the check of one kernel run against the oracle.

Shared by the emulated-kernel tests (CPU, every CI run) and the GPU tests (marked `gpu`), so both hold the
kernels to the same cases and the same tolerance rule (docs/DESIGN.md section 6): error <= 2x the error of the
same math done in PyTorch at the input dtype, plus a small atol.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from sinkattn.mask import Mask

from oracle import attention_oracle, attention_oracle_varlen, tolerance_check

NAN = float("nan")


@dataclass
class Case:
    name: str
    headdim: int = 64
    dtype: torch.dtype = torch.bfloat16
    batch: int = 1
    seqlen_q: int = 64
    seqlen_k: int = 64
    nheads: int = 2
    nheads_k: int = 2
    causal: bool = False
    window: tuple = (-1, -1)
    sink_tokens: int = 0
    sinks: str = "random"        # "none", "random", "-inf", "+30"
    softcap: float = 0.0
    varlen: list | None = None   # [(seqlen_q, seqlen_k), ...] per sequence
    max_smem: int = 0            # 0 = the device's / sm80's limit; 99 KB picks the sm86 configuration
    # > 0: key j scaled by 1 + key_gain * (seqlen_k - 1 - j) / 64. The kernels visit key blocks from the last
    # down (common/mask.h), so each row's max rises from block to block as they go (the forward's lazy rebase,
    # common/online_softmax.h: rises under and over its 2^8 bound). Not with varlen.
    key_gain: float = 0.0
    tags: list = field(default_factory=list)

    def __str__(self):
        return self.name


def make_sinks(kind: str, nheads: int, device) -> torch.Tensor | None:
    if kind == "none":
        return None
    if kind == "-inf":
        return torch.full((nheads,), -math.inf, device=device)
    if kind == "+30":
        return torch.full((nheads,), 30.0, device=device)
    if kind == "0":
        return torch.zeros((nheads,), device=device)
    return torch.randn(nheads, device=device)


def run_case(case: Case, backend: str, device: str, forward, seed: int | None = None):
    """Runs `forward` (the kernel bridge's signature) on fresh random inputs with poisoned outputs and checks
    out and lse against the float64 oracle."""
    h, hk, d = case.nheads, case.nheads_k, case.headdim
    left, right = case.window
    if case.causal:
        right = 0
    sinks = make_sinks(case.sinks, h, device)
    scale = 1.0 / math.sqrt(d)
    mask = Mask(scale, left, right, case.sink_tokens, case.softcap)
    kw = dict(softmax_scale=scale, causal=case.causal, window_size=case.window, sink_tokens=case.sink_tokens,
              softcap=case.softcap)
    if case.varlen is None:
        q = torch.randn(case.batch, case.seqlen_q, h, d, device=device, dtype=case.dtype)
        k = torch.randn(case.batch, case.seqlen_k, hk, d, device=device, dtype=case.dtype)
        if case.key_gain:
            gain = 1 + case.key_gain * torch.arange(case.seqlen_k - 1, -1, -1, device=device, dtype=torch.float32) / 64
            k = (k.float() * gain[None, :, None, None]).to(case.dtype)
        v = torch.randn(case.batch, case.seqlen_k, hk, d, device=device, dtype=case.dtype)
        out, guard = _guarded_like(q)
        lse = torch.full((case.batch, h, case.seqlen_q), NAN, device=device)
        forward(backend, q, k, v, sinks, out, lse, mask=mask, max_smem=case.max_smem)
        ref_out, ref_lse = attention_oracle(q.cpu(), k.cpu(), v.cpu(), None if sinks is None else sinks.cpu(), **kw)
        base_out, base_lse = attention_oracle(q.cpu(), k.cpu(), v.cpu(), None if sinks is None else sinks.cpu(),
                                              compute_dtype=case.dtype, **kw)
    else:
        assert not case.key_gain, "key_gain: not with varlen"
        lq = [a for a, _ in case.varlen]
        lk = [b for _, b in case.varlen]
        cu_q = torch.tensor([0] + list(torch.tensor(lq).cumsum(0)), dtype=torch.int32, device=device)
        cu_k = torch.tensor([0] + list(torch.tensor(lk).cumsum(0)), dtype=torch.int32, device=device)
        q = torch.randn(sum(lq), h, d, device=device, dtype=case.dtype)
        k = torch.randn(sum(lk), hk, d, device=device, dtype=case.dtype)
        v = torch.randn(sum(lk), hk, d, device=device, dtype=case.dtype)
        out, guard = _guarded_like(q)
        lse = torch.full((h, sum(lq)), NAN, device=device)
        forward(backend, q, k, v, sinks, out, lse, mask=mask, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                max_seqlen_q=max(lq), max_seqlen_k=max(lk), max_smem=case.max_smem)
        cs = None if sinks is None else sinks.cpu()
        ref_out, ref_lse = attention_oracle_varlen(q.cpu(), k.cpu(), v.cpu(), cu_q.cpu(), cu_k.cpu(), cs, **kw)
        base_out, base_lse = attention_oracle_varlen(q.cpu(), k.cpu(), v.cpu(), cu_q.cpu(), cu_k.cpu(), cs,
                                                     compute_dtype=case.dtype, **kw)
    if not torch.isnan(guard).all():
        raise AssertionError(f"{case}: the kernel wrote past the end of out")
    tolerance_check(f"{case} out", out.cpu(), ref_out, base_out, atol=1e-3, seed=seed)
    tolerance_check(f"{case} lse", lse.cpu(), ref_lse, base_lse.float(), atol=1e-4, seed=seed)
    return out, lse


def _guarded_like(q):
    """A NaN-poisoned output like q, followed by NaN guard elements that must stay untouched."""
    storage = torch.full((q.numel() + 256,), NAN, dtype=q.dtype, device=q.device)
    return storage[: q.numel()].view(q.shape), storage[q.numel():]


def kernel_cases(headdims, dtypes) -> list[Case]:
    """The grid: every feature and the tails, sampled so each case stays small."""
    cases = []
    for d in headdims:
        for dt in dtypes:
            t = "bf16" if dt == torch.bfloat16 else "fp16"
            cases += [
                Case(f"d{d}-{t}-plain", d, dt, batch=2, seqlen_q=130, seqlen_k=150, sinks="random"),
                Case(f"d{d}-{t}-causal-gqa", d, dt, seqlen_q=200, seqlen_k=200, nheads=4, nheads_k=1, causal=True),
            ]
        t = "bf16"
        cases += [
            Case(f"d{d}-window-cuts-blocks-sinktok", d, seqlen_q=190, seqlen_k=260, causal=True, window=(37, 0),
                 sink_tokens=5),
            Case(f"d{d}-window-right-sq>sk", d, seqlen_q=150, seqlen_k=90, window=(20, 7), sinks="+30"),
            Case(f"d{d}-window-right-random-sinks", d, seqlen_q=150, seqlen_k=90, window=(20, 7)),
            # A head dim served by the next compiled one: the stores must stop at the real head dim.
            Case(f"d{d - 24}-served-by-d{d}", d - 24, seqlen_q=70, seqlen_k=90, nheads=2, nheads_k=1, causal=True,
                 window=(30, 0), sink_tokens=2),
            Case(f"d{d}-causal-sq>sk-empty-rows", d, seqlen_q=100, seqlen_k=30, causal=True, sinks="random"),
            Case(f"d{d}-sinks-neginf", d, seqlen_q=65, seqlen_k=129, sinks="-inf"),
            Case(f"d{d}-no-sinks-softcap", d, seqlen_q=33, seqlen_k=97, sinks="none", softcap=15.0),
            # More than 64 rows: the prefill tile, whose softcap kernel is its own (softcap compiled out of the other).
            Case(f"d{d}-prefill-tile-softcap-window", d, seqlen_q=150, seqlen_k=170, causal=True, window=(90, 0),
                 sink_tokens=2, softcap=12.0),
            Case(f"d{d}-tiny", d, seqlen_q=1, seqlen_k=1),
            Case(f"d{d}-sinktok>seqlen", d, seqlen_q=50, seqlen_k=70, causal=True, window=(3, 0), sink_tokens=90),
            Case(f"d{d}-varlen-empty", d, varlen=[(17, 40), (0, 5), (70, 0), (129, 130), (1, 1)], nheads=4,
                 nheads_k=2, causal=True, window=(50, 0), sink_tokens=2),
            # At most 32 query rows: the sm80 tiles whose warps split each key block's keys (fwd_config.h). A
            # window and sink tokens that cut the warps' key ranges; keys that reach only the first warp's range;
            # rows that see no key at all; 17-32 rows (two key groups, a warp with 4 real rows).
            Case(f"d{d}-16rows-window-cuts-warps-sinktok", d, seqlen_q=16, seqlen_k=300, causal=True,
                 window=(37, 0), sink_tokens=5),
            Case(f"d{d}-5rows-two-sided-softcap", d, seqlen_q=5, seqlen_k=150, nheads=3, nheads_k=3, window=(20, 7),
                 softcap=10.0),
            Case(f"d{d}-3rows-12keys", d, batch=2, seqlen_q=3, seqlen_k=12),
            Case(f"d{d}-16rows-causal-sq>sk-empty-rows", d, seqlen_q=16, seqlen_k=5, causal=True),
            Case(f"d{d}-30rows-window-sinktok", d, seqlen_q=30, seqlen_k=300, causal=True, window=(45, 0),
                 sink_tokens=3),
            Case(f"d{d}-20rows-two-sided", d, seqlen_q=20, seqlen_k=90, window=(20, 7)),
        ]
    return cases
