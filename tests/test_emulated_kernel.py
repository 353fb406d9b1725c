"""The sm80 forward kernel itself, run on the CPU under host emulation (docs/DESIGN.md section 6).

The kernel body is the GPU's code: same tiling, block ranges, masks, online softmax with the sink, layouts
of accumulators and shared memory, epilogue and LSE. Emulated atoms keep the real atoms' layouts, so only
the tensor cores and the copy engine's timing are not exercised here.
"""
from __future__ import annotations

import pytest
import torch

from kernel_cases import Case, kernel_cases, run_case
from sinkattn import _ext, kernels
from sinkattn.mask import Mask
from sinkattn.layout import kernel_headdim

EMU = sorted({(k["headdim"], k["dtype"]) for k in _ext.registry() if k["family"] == "sm80-emulated"})
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

pytestmark = pytest.mark.skipif(not EMU, reason="no emulated kernels in this build (SINKATTN_EMULATION=0 or no extension)")


# The row tiles' cases: one, two and three key blocks (S ahead's last iteration reads its own stage), a last M tile
# of a few rows (warps without a row take the barriers and load), blocks out of order (window blocks, then
# sink-token blocks), rows that see no key, GQA, softcap, varlen.
ROW_TILE_CASES = (
    ("one-block", dict(seqlen_q=130, seqlen_k=50, sinks="random")),
    ("two-blocks-causal", dict(seqlen_q=100, seqlen_k=128, causal=True)),
    ("three-blocks-gqa", dict(seqlen_q=129, seqlen_k=191, nheads=4, nheads_k=2, sinks="random")),
    ("window-tokens", dict(seqlen_q=200, seqlen_k=333, causal=True, window=(100, 0), sink_tokens=5)),
    ("q-longer-than-k-causal", dict(seqlen_q=150, seqlen_k=40, causal=True, sinks="random")),
    ("softcap-causal", dict(seqlen_q=97, seqlen_k=64, causal=True, softcap=30.0)),
    ("varlen", dict(varlen=[(70, 100), (3, 1), (129, 200), (0, 5)], causal=True)),
)
# Rows whose max rises from key block to key block: the tiles without S ahead move the running max lazily
# (common/online_softmax.h rescale_lazy). Gently, most blocks' rises stay under its 2^8 bound, so P runs above 1
# against a stale max and some warps rebase; steeply, every block rebases and a missed one overflows exp2.
RISING_MAX_CASES = (
    ("rising-max", dict(seqlen_q=100, seqlen_k=300, key_gain=2.0, sinks="random")),
    ("rising-max-steep-causal", dict(seqlen_q=70, seqlen_k=260, key_gain=12.0, causal=True)),
)


def _cases():
    hds = sorted({h for h, _ in EMU})
    dts = [DTYPES[d] for d in sorted({d for _, d in EMU})]
    cases = [c for c in kernel_cases(hds, dts) if (kernel_headdim(c.headdim), {torch.bfloat16: "bf16", torch.float16: "fp16"}[c.dtype]) in EMU]
    if (256, "bf16") in EMU:
        # Few rows at head dim 256 on sm80 (163 KB): the double-buffered 64-row tile (fwd_tiles.h Hd256Few), not the
        # 128-row prefill tile; two warps of four without a row.
        cases.append(Case("d256-few-rows-config", 256, seqlen_q=40, seqlen_k=300, causal=True, window=(150, 0),
                          sink_tokens=3, sinks="random"))
        # The sm86/sm89 configuration (99 KB of shared memory) differs from sm80's only at head dim 256.
        cases.append(Case("d256-sm86-config", 256, seqlen_q=70, seqlen_k=100, causal=True, window=(40, 0),
                          sink_tokens=3, max_smem=99 * 1024))
    if (256, "bf16") in EMU:
        # One K and one V buffer loaded staggered: the sm90 configuration (227 KB per block, fwd_tiles.h
        # Hd256Staggered: 64 rows of 4 warps) and the A100's (163 KB, the default here: Hd256Rows, 128 rows of 8
        # warps). Odd lengths, a window cutting blocks, sink tokens, a last M tile of 6 rows (sm90: three warps
        # without a row, they take both barriers and load; A100: 70 rows leave three of eight so, 129 seven), GQA,
        # learnable sinks, softcap, empty and one-key rows.
        for name, kw in (("causal-window-tokens", dict(seqlen_q=70, seqlen_k=333, causal=True, window=(100, 0),
                                                      sink_tokens=5)),
                         ("full-gqa-sinks", dict(seqlen_q=129, seqlen_k=191, nheads=4, nheads_k=2, sinks="random")),
                         ("softcap-causal", dict(seqlen_q=65, seqlen_k=64, causal=True, softcap=30.0)),
                         ("one-key", dict(seqlen_q=3, seqlen_k=1)),
                         ("q-longer-than-k-causal", dict(seqlen_q=90, seqlen_k=40, causal=True, sinks="random")),
                         ("varlen", dict(varlen=[(70, 100), (3, 1), (129, 200), (0, 5)], causal=True)),
                         *RISING_MAX_CASES):
            cases.append(Case(f"d256-sm90-config-{name}", 256, max_smem=227 * 1024, **kw))
            cases.append(Case(f"d256-rows-{name}", 256, **kw))
    if (64, "bf16") in EMU:
        # The hd64 prefill tiles: at 163 KB per block (the default here) fwd_tiles.h Hd64RowsTwoCtas, 128 rows of 4
        # warps of 32 over three K/V stages (sm90's 227 KB takes the same); at 99 KB (sm86) Hd64Rows, the same over two.
        for name, kw in ROW_TILE_CASES + RISING_MAX_CASES:
            cases.append(Case(f"d64-rows-{name}", 64, **kw))
            cases.append(Case(f"d64-rows-sm86-{name}", 64, max_smem=99 * 1024, **kw))
        cases.append(Case("d64-sm86-few-rows-config", 64, seqlen_q=30, seqlen_k=300, nheads=4, nheads_k=2, causal=True,
                          window=(200, 0), sink_tokens=2, max_smem=99 * 1024))
    if (128, "bf16") in EMU:
        # The hd128 prefill tiles (fwd_tiles.h Hd128RowsTwoCtas at 163 KB per block, the default here: 128 rows of 4
        # warps of 32 over 32-key blocks in three stages, the running max moved lazily).
        for name, kw in RISING_MAX_CASES:
            cases.append(Case(f"d128-rows-{name}", 128, **kw))
        for name, kw in ROW_TILE_CASES:
            cases.append(Case(f"d128-rows-{name}", 128, **kw))
            # sm90's tile (227 KB per block, fwd_tiles.h Hd128RowsSm90): 128 rows of 8 warps, S of the next key block
            # computed beside this one's softmax, K one block ahead of V, interior K/V blocks through predicated copies.
            cases.append(Case(f"d128-rows-sm90-{name}", 128, max_smem=227 * 1024, **kw))
            # sm86's (99 KB, Hd128Rows): the same loop, every K/V block through the loader's branches.
            cases.append(Case(f"d128-rows-sm86-{name}", 128, max_smem=99 * 1024, **kw))
        # A head dim below the kernel's: no key block is whole, so sm90's tile loads every block through the loader's
        # branches, behind the test its interior blocks skip.
        cases.append(Case("d128-rows-sm90-hd104-loader-branches", 104, seqlen_q=130, seqlen_k=333, causal=True,
                          window=(200, 0), sink_tokens=5, max_smem=227 * 1024))
        # Few rows (seqlen_q <= 64): the decode tiles; at head dim 128 the sm86/sm89 one (99 KB) differs.
        cases.append(Case("d128-sm86-few-rows-config", 128, seqlen_q=40, seqlen_k=300, causal=True, window=(150, 0),
                          sink_tokens=3, max_smem=99 * 1024))
        cases.append(Case("d128-sm86-few-rows-gqa", 128, seqlen_q=7, seqlen_k=230, nheads=4, nheads_k=2,
                          sinks="random", max_smem=99 * 1024))
    return cases


@pytest.mark.parametrize("case", _cases(), ids=str)
def test_emulated_forward_matches_oracle(case, rng_seed):
    run_case(case, "sm80-emulated", "cpu", kernels.launch_fwd, seed=rng_seed)


def test_sinks_neg_inf_is_plain_attention_bit_for_bit(rng_seed):
    hd, dt = EMU[0]
    dtype = DTYPES[dt]
    q = torch.randn(1, 70, 2, hd, dtype=dtype)
    k = torch.randn(1, 90, 2, hd, dtype=dtype)
    v = torch.randn(1, 90, 2, hd, dtype=dtype)
    outs = []
    for sinks in (None, torch.full((2,), float("-inf"))):
        out = torch.full_like(q, float("nan"))
        lse = torch.full((1, 2, 70), float("nan"))
        kernels.launch_fwd("sm80-emulated", q, k, v, sinks, out, lse, mask=Mask(0.1, -1, 0, 0, 0.0))
        outs.append((out, lse))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
