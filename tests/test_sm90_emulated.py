"""The sm90 forward kernel (TMA + wgmma, warp-specialized, persistent) run on the CPU under host emulation.

The kernel body is the GPU's (sm90/fwd_kernel.cuh fwd_cta), run through the seam's host implementation
(csrc/emu/sm90_prims.h EmuPrims on csrc/emu/sm90_runtime.h): 384 or 512 real threads per CTA, blocking mbarrier
and named-barrier waits, TMA boxes described by the project's own tensor map (zero fill, the hardware's swizzle),
wgmma reading the real descriptors CuTe builds, in the hardware's fragment layouts, with deferred completion; a
deadlock detector and ordering checks fail a launch (docs/DESIGN.md section 6, "the sm90 host emulation").

Held to the same cases and tolerance as the sm80 kernel (tests/kernel_cases.py), plus pipeline shapes (several
tiles per CTA of the emulated 3-SM grid, key ranges that wrap the stage rings many times, wild varlen), every
tuning-grid variant the emulation build holds (never run on a GPU), and planted bugs in each protocol and layout
piece that must each fail a launch or a tolerance check.
"""
from __future__ import annotations

import math

import pytest
import torch

from kernel_cases import Case, kernel_cases, run_case
from sinkattn import _ext, kernels
from sinkattn.mask import Mask
from sinkattn.layout import kernel_headdim

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}
_REG = _ext.registry() if _ext.loaded() else []
EMU = sorted({(k["headdim"], k["dtype"]) for k in _REG if k["family"] == "sm90-emulated" and k["op"] == "fwd"})
VARIANTS = sorted((k["name"], k["headdim"], k["dtype"], k["features"]) for k in _REG
                  if k["family"] == "sm90-emulated-sweep")

pytestmark = pytest.mark.skipif(not EMU, reason="no emulated sm90 kernels in this build (SINKATTN_EMULATION=0, "
                                                "or no 90a in SINKATTN_CUDA_ARCHS, or no extension)")


def _served(c: Case) -> bool:
    return (kernel_headdim(c.headdim), NAMES[c.dtype]) in EMU


def _cases():
    hds = sorted({h for h, _ in EMU})
    dts = [DTYPES[d] for d in sorted({d for _, d in EMU})]
    cases = [c for c in kernel_cases(hds, dts) if _served(c)]
    for h, d in EMU:
        if d != "bf16":
            continue
        cases += [
            # 2 x 4 heads x 4 M tiles = 32 tiles on the emulated grid of 3 CTAs: each CTA walks ~11 tiles, its Q
            # buffer and K/V rings wrap across tiles.
            Case(f"d{h}-many-tiles-per-cta", h, batch=2, seqlen_q=450, seqlen_k=333, nheads=4, nheads_k=2,
                 causal=True, window=(150, 0), sink_tokens=4),
            # One tile whose key range runs through the stages many times.
            Case(f"d{h}-one-tile-long-keys", h, seqlen_q=77, seqlen_k=1500, nheads=1, nheads_k=1),
            Case(f"d{h}-varlen-wild", h, varlen=[(1, 1), (300, 420), (0, 9), (129, 700), (7, 0), (2, 260)],
                 nheads=2, nheads_k=1, causal=True),
            Case(f"d{h}-gqa8-softcap-sinks+30", h, batch=1, seqlen_q=140, seqlen_k=200, nheads=8, nheads_k=1,
                 softcap=30.0, sinks="+30"),
            Case(f"d{h}-sinks0-two-sided", h, seqlen_q=160, seqlen_k=300, window=(70, 20), sinks="0"),
        ]
    return cases


@pytest.mark.parametrize("case", _cases(), ids=str)
def test_sm90_emulated_forward_matches_oracle(case, rng_seed):
    run_case(case, "sm90-emulated", "cpu", kernels.launch_fwd, seed=rng_seed)


def _variant_case(hd: int) -> Case:
    # One case per variant (CI time: 26 variants): varlen sequences that end mid-tile, one empty and one with no
    # keys, GQA, causal with a window that cuts key blocks, sink tokens and softcap. What the variants change is
    # the pipeline (buffers, stages, warpgroups, ping-pong, the tile walk), which every sequence here runs through
    # several times; the batched (non-varlen) descriptors are the default tiles' cases.
    return Case(f"d{hd}-varlen-causal-window-sinktok-gqa-softcap", hd,
                varlen=[(129, 300), (0, 4), (250, 250), (3, 0), (70, 40)], nheads=2, nheads_k=1, causal=True,
                window=(200, 0), sink_tokens=3, softcap=20.0)


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v[0])
def test_sm90_emulated_sweep_variant_matches_oracle(variant, rng_seed):
    """Each never-run tuning variant (sweep_grid.py SWEEP_SM90: second Q buffer, 192-row tiles with three consumer
    warpgroups, ping-pong off, dynamic tiles from a counter, deep or long key pipelines) against the oracle."""
    name, hd, dt, _ = variant
    case = _variant_case(hd)
    case.dtype = DTYPES[dt]
    run_case(case, f"variant:{name}", "cpu", kernels.launch_fwd, seed=rng_seed)


def test_every_sm90_sweep_variant_has_an_emulated_twin():
    """An emulation build holds the twin of every SWEEP_SM90 variant at its head dims, so none waits for a GPU to
    be run at all."""
    import importlib.util
    import pathlib
    import sys

    path = pathlib.Path(__file__).resolve().parents[1] / "csrc" / "sweep_grid.py"
    spec = importlib.util.spec_from_file_location("sinkattn_sweep_grid_emu90", path)
    gen = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = gen  # dataclasses look their module up while the class is built
    spec.loader.exec_module(gen)
    hds = {h for h, _ in EMU}
    dt = sorted({d for _, d in EMU})[0]
    want = {gen.variant_name("emu90", v, dt) for v in gen.SWEEP_SM90 if v.head_dim in hds}
    assert want and want <= {v[0] for v in VARIANTS}, want - {v[0] for v in VARIANTS}


def test_sm90_emulated_no_query_or_no_key_rows():
    hd, dt = EMU[0]
    dtype = DTYPES[dt]
    # seqlen_q == 0: nothing to write and no descriptor over an empty q.
    q = torch.randn(2, 0, 2, hd, dtype=dtype)
    k = torch.randn(2, 50, 2, hd, dtype=dtype)
    out, lse = torch.empty_like(q), torch.empty(2, 2, 0)
    kernels.launch_fwd("sm90-emulated", q, k, k.clone(), None, out, lse, mask=Mask(0.1, -1, -1, 0, 0.0))
    # seqlen_k == 0: every row is empty; with a sink the output is 0 and the lse the sink's.
    q = torch.randn(1, 70, 2, hd, dtype=dtype)
    k = torch.randn(1, 0, 2, hd, dtype=dtype)
    sinks = torch.tensor([0.5, -1.0])
    out = torch.full_like(q, float("nan"))
    lse = torch.full((1, 2, 70), float("nan"))
    kernels.launch_fwd("sm90-emulated", q, k, k.clone(), sinks, out, lse, mask=Mask(0.1, -1, -1, 0, 0.0))
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.allclose(lse, sinks.view(1, 2, 1).expand(1, 2, 70))


def test_sm90_emulated_is_deterministic_and_sinks_neg_inf_is_plain_attention(rng_seed):
    hd, dt = EMU[0]
    dtype = DTYPES[dt]
    q = torch.randn(1, 200, 2, hd, dtype=dtype)
    k = torch.randn(1, 330, 2, hd, dtype=dtype)
    v = torch.randn(1, 330, 2, hd, dtype=dtype)
    outs = []
    for sinks in (None, torch.full((2,), float("-inf")), None):
        out = torch.full_like(q, float("nan"))
        lse = torch.full((1, 2, 200), float("nan"))
        kernels.launch_fwd("sm90-emulated", q, k, v, sinks, out, lse, mask=Mask(0.1, -1, 0, 0, 0.0))
        outs.append((out, lse))
    for o, l in outs[1:]:
        assert torch.equal(outs[0][0], o) and torch.equal(outs[0][1], l)


# A planted bug in each protocol and layout piece (csrc/emu/sm90_prims.h Mutation, SINKATTN_EMU90_MUTATE) must fail
# the launch with what went wrong, or (the layout pieces: both sides still agree with themselves) the oracle. Which
# check fires first depends on how far the threads got (the OS's interleaving), so each names what it may be.
_READ_EARLY = "before the TMA load into it completed|while a TMA load into it was in flight|in-flight wgmma"
MUTATIONS = {
    # an mbarrier counting one arrival fewer than the kernel's: a phase completes early and the last arrival
    # lands in the next one (or finds it full), or a stage is refilled while a consumer still reads it
    "arrival_count": "partial phase|past its count|" + _READ_EARLY,
    # a consumer waiting for the wrong phase of a full barrier reads the stage before it landed, or runs ahead far
    # enough that the producer's next load meets its wgmma still reading
    "parity": _READ_EARLY,
    "no_fence": "no fence.proxy.async",            # a generic-proxy access then TMA or wgmma over it, unfenced
    "expect_tx": "deadlock",                       # a phase expecting bytes that never come
    # wgmma_wait retiring one group too few: a stage released (and refilled) while its wgmma still reads it, or
    # the CTA ends with the group outstanding
    "early_release": "in-flight wgmma|wgmma group never waited for",
    "swizzle": None,                               # TMA lands unswizzled, wgmma reads swizzled
    "swap_lbo_sbo": None,                          # wgmma descriptors read with LBO and SBO swapped
}


def check_planted_bug(mutation, monkeypatch, run):
    """run() under the planted bug fails as MUTATIONS says (a RuntimeError naming the violation, or the oracle's
    AssertionError), and without it passes. Shared by the forward's and the backward's tests."""
    monkeypatch.setenv("SINKATTN_EMU90_MUTATE", mutation)
    want = MUTATIONS[mutation]
    with pytest.raises(AssertionError) if want is None else pytest.raises(RuntimeError, match=want):
        run()
    monkeypatch.delenv("SINKATTN_EMU90_MUTATE")
    run()  # and without it, the same case passes


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_a_planted_bug_fails(mutation, monkeypatch, rng_seed):
    hd, dt = EMU[0]
    case = Case(f"d{hd}-mutation-{mutation}", hd, DTYPES[dt], batch=2, seqlen_q=200, seqlen_k=300, causal=True)
    check_planted_bug(mutation, monkeypatch,
                      lambda: run_case(case, "sm90-emulated", "cpu", kernels.launch_fwd, seed=rng_seed))


def test_an_unknown_mutation_is_refused(monkeypatch):
    hd, dt = EMU[0]
    monkeypatch.setenv("SINKATTN_EMU90_MUTATE", "parity-typo")
    q = torch.randn(1, 10, 1, hd, dtype=DTYPES[dt])
    with pytest.raises(ValueError, match="not a mutation"):
        kernels.launch_fwd("sm90-emulated", q, q.clone(), q.clone(), None, torch.empty_like(q),
                           torch.empty(1, 1, 10), mask=Mask(1 / math.sqrt(hd), -1, -1, 0, 0.0))


def test_emulated_sm90_units_share_no_code_with_the_other_units():
    """The host-compiled sm90 units instantiate CuTe's and sm90::'s templates with the GPU units' arguments but other
    code (CuTe's driver encode and asm exist only under nvcc; its TMA copy is 256 bytes there, 192 here). The linker
    keeps one copy of each weak symbol, so any one shared with a GPU unit is a wrong launcher somewhere:
    emu/sm90_prims.h renames both namespaces in the emulated units. What they share with the GPU units may only be
    the C++ library's. With the emulated sm80 units (the same host compiler and flags, so the same definitions) they
    may share sinkattn's and CUTLASS's plain helpers, never CuTe's."""
    import pathlib
    import re
    import shutil
    import subprocess

    kernels = pathlib.Path(__file__).resolve().parents[1] / "build" / "kernels"
    ninja = kernels / "build.ninja"
    if not ninja.exists() or shutil.which("nm") is None:
        pytest.skip("no kernel build in build/kernels (a build made elsewhere) or no nm")
    # The objects this build made (build/kernels may hold stale ones of an earlier grid).
    objs = sorted(pathlib.Path(p) for p in re.findall(r"^build (\S+\.o): ", ninja.read_text(), re.M))
    objs = [o if o.is_absolute() else kernels / o for o in objs]
    emu90 = [o for o in objs if o.name.startswith("emu90")]
    if not emu90:
        pytest.skip("no emulated sm90 objects in this build")

    def weak(o):
        out = subprocess.run(["nm", "--defined-only", str(o)], capture_output=True, text=True, check=True).stdout
        return {f[2] for f in (line.split() for line in out.splitlines()) if len(f) == 3 and f[1] in "WVu"}

    mine, gpu, emu80 = set(), set(), set()
    for o in objs:
        (mine if o in emu90 else emu80 if o.name.startswith("emu") else gpu).update(weak(o))
    # Itanium mangling: St (std::), 9__gnu_cxx, and the library's own helpers; nothing of sinkattn, cute or cutlass.
    shared = {s for s in mine & gpu if any(n in s for n in ("8sinkattn", "4cute", "7cutlass"))}
    assert not shared, sorted(shared)[:5]
    assert not {s for s in mine & emu80 if "4cute" in s or "4sm90" in s}
    assert any("10cute_emu90" in s for s in mine), "the emulated units do not carry CuTe under its renamed namespace"
