"""The process-wide cap on the shared memory the sm80 tile tables read (`sinkattn.sm80_smem_limit`,
SINKATTN_SM80_MAX_SMEM): the public API runs the tiles of a 99 KB device (A10, L4, RTX 4090)
on a bigger one, and dispatch declines what does not fit, naming the cap.

The tile a run took is observed through its bits: under host emulation a run is deterministic, and where the
capped tile differs from the uncapped one in its key-block size the results differ in the last bits, so the
public call under the cap must equal a direct kernels.launch_*(max_smem=99 KB) call bit for bit and differ from
the uncapped one. Where tiles differ only in pipelining (the head-dim-128 backward's stages) the bits cannot tell,
and the test reads the max_smem dispatch hands the bridge instead."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import sinkattn
from oracle import attention_oracle, single_thread, tolerance_check  # noqa: F401  (single_thread: autouse)
from sinkattn import _device, _ext, capability, dispatch, kernels, report
from sinkattn._problem import Problem
from sinkattn.mask import Mask
from sinkattn.errors import SinkattnRuntimeError, SinkattnTypeError, SinkattnValueError

KB = 1024
SM86 = 99 * KB
ROOT = Path(__file__).resolve().parents[1]
EMU = sorted({(k["headdim"], k["op"]) for k in _ext.registry() if k["family"] == "sm80-emulated" and k["dtype"] == "bf16"})
needs_emu = pytest.mark.skipif(not EMU, reason="no emulated kernels in this build")


@pytest.fixture(autouse=True)
def no_cap_leaks():
    before = _device.sm80_smem_cap()
    yield
    assert _device.sm80_smem_cap() == before, "a test left the sm80 shared-memory cap changed"


# ---- setting it ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("raw,want", [("99K", SM86), ("99k", SM86), (" 99K ", SM86), ("101376", SM86),
                                      ("163K", 163 * KB), ("1", 1), ("", None), ("  ", None)])
def test_env_values(raw, want):
    cap = _device._cap_from_env({_device.SM80_SMEM_ENV: raw})
    assert (cap and cap.nbytes) == want
    if want is not None:
        assert cap.source == f"SINKATTN_SM80_MAX_SMEM={raw.strip()}"
    assert _device._cap_from_env({}) is None


@pytest.mark.parametrize("raw", ["abc", "0", "0K", "-5", "99M", "99KB", "1.5K", "99 KiB", "K", "0x100", "٩٩"])
def test_bad_env_values_raise_a_clear_error(raw):
    with pytest.raises(SinkattnValueError) as e:
        _device._cap_from_env({_device.SM80_SMEM_ENV: raw})
    msg = str(e.value)
    assert f"SINKATTN_SM80_MAX_SMEM={raw!r}" in msg and "bytes (101376)" in msg and "K suffix (99K)" in msg


def test_bad_env_value_fails_the_import_with_that_error():
    env = dict(__import__("os").environ, SINKATTN_SM80_MAX_SMEM="99MB", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", "import sinkattn"], capture_output=True, text=True, env=env, cwd=ROOT,
                       timeout=120)
    assert r.returncode != 0
    assert r.stderr.strip().splitlines()[-1] == (
        "sinkattn.errors.SinkattnValueError: sinkattn: SINKATTN_SM80_MAX_SMEM='99MB' is not a shared-memory size; give "
        "a positive number of bytes (101376) or of KiB with a K suffix (99K)")


def test_env_value_is_the_process_cap_and_the_report_shows_it():
    env = dict(__import__("os").environ, SINKATTN_SM80_MAX_SMEM="99K", PYTHONPATH=str(ROOT))
    code = ("import sinkattn; print(sinkattn.get_sm80_smem_limit()); "
            "from sinkattn import report; report.main([])")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == str(SM86)
    assert "sm80 shared-memory cap: 99 KB (101376 bytes) per block, set by SINKATTN_SM80_MAX_SMEM=99K" in lines


def test_setter_and_context_manager():
    assert sinkattn.get_sm80_smem_limit() is None
    with sinkattn.sm80_smem_limit("99K") as outer:
        assert isinstance(outer, sinkattn.sm80_smem_limit)
        assert sinkattn.get_sm80_smem_limit() == SM86
        assert _device.sm80_smem_cap().source == "sinkattn.sm80_smem_limit('99K')"
        with sinkattn.sm80_smem_limit(64 * KB):
            assert sinkattn.get_sm80_smem_limit() == 64 * KB
            with sinkattn.sm80_smem_limit(None):
                assert sinkattn.get_sm80_smem_limit() is None
            assert sinkattn.get_sm80_smem_limit() == 64 * KB
        assert sinkattn.get_sm80_smem_limit() == SM86
    assert sinkattn.get_sm80_smem_limit() is None
    # A plain call sets it for the process until the next call.
    try:
        sinkattn.sm80_smem_limit(SM86)
        assert sinkattn.get_sm80_smem_limit() == SM86
    finally:
        sinkattn.sm80_smem_limit(None)
    assert sinkattn.get_sm80_smem_limit() is None
    # What each backend's launch is given: sm90 never reads it; the emulation never goes above the A100 it models.
    with sinkattn.sm80_smem_limit(SM86):
        assert [_device.sm80_max_smem(b) for b in ("sm80", "sm80-emulated", "sm90")] == [SM86, SM86, 0]
    with sinkattn.sm80_smem_limit(300 * KB):
        assert [_device.sm80_max_smem(b) for b in ("sm80", "sm80-emulated", "sm90")] == [300 * KB, 163 * KB, 0]
    assert [_device.sm80_max_smem(b) for b in ("sm80", "sm80-emulated", "sm90")] == [0, 0, 0]


@pytest.mark.parametrize("bad,err", [(99.0 * KB, SinkattnTypeError), (True, SinkattnTypeError),
                                     ([SM86], SinkattnTypeError), (0, SinkattnValueError), (-1, SinkattnValueError),
                                     ("99 MB", SinkattnValueError)])
def test_setter_rejects_bad_values_and_keeps_the_cap(bad, err):
    with pytest.raises(err, match="sinkattn.sm80_smem_limit"):
        sinkattn.sm80_smem_limit(bad)
    assert sinkattn.get_sm80_smem_limit() is None


# ---- what it changes -----------------------------------------------------------------------------------------
@pytest.mark.needs_ext
def test_the_cap_picks_other_tiles():
    """The C++ tile choosers: at 99 KB the tables give the sm86/sm89 tiles the runs below take."""
    C = _ext.require()
    big, small = C.fwd_tile(256, 70, False, 163 * KB), C.fwd_tile(256, 70, False, SM86)
    assert (big["smem_bytes"], big["block_m"], big["block_n"]) == (128 * KB, 128, 64)
    assert (small["smem_bytes"], small["block_m"], small["block_n"]) == (96 * KB, 64, 32)
    big, small = C.fwd_tile(128, 40, False, 163 * KB), C.fwd_tile(128, 40, False, SM86)
    assert (big["block_n"], small["block_n"]) == (64, 32)
    assert (C.bwd_tile(128, 163 * KB)["stages"], C.bwd_tile(128, SM86)["stages"]) == (2, 1)


def _direct_fwd(q, k, v, sinks, max_smem, scale, left, right):
    out = torch.full_like(q, float("nan"))
    lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("nan"))
    kernels.launch_fwd("sm80-emulated", q, k, v, sinks, out, lse, mask=Mask(scale, left, right, 0, 0.0),
                       max_smem=max_smem)
    return out, lse


def _same_bits(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.skipif((256, "fwd") not in EMU, reason="no emulated hdim256 forward in this build")
def test_capped_forward_runs_the_99k_tile(rng_seed):
    """Head dim 256, 70 rows: the 128 KB tile (128 rows, 64 keys per block) on an A100, 96 KB (64 x 32) under 99 KB."""
    q = torch.randn(1, 70, 2, 256, dtype=torch.bfloat16)
    k = torch.randn(1, 100, 2, 256, dtype=torch.bfloat16)
    v = torch.randn(1, 100, 2, 256, dtype=torch.bfloat16)
    sinks = torch.randn(2)
    scale = 1 / 16
    with sinkattn.sm80_smem_limit(SM86):
        got = sinkattn.flash_attn_with_sinks(q, k, v, sinks, causal=True, return_lse=True, backend="sm80-emulated")
    small = _direct_fwd(q, k, v, sinks, SM86, scale, -1, 0)
    big = _direct_fwd(q, k, v, sinks, 0, scale, -1, 0)
    assert not _same_bits(small, big), "the two tiles give the same bits here: this test cannot tell them apart"
    assert _same_bits(got, small), "the capped public call did not run the 99 KB tile"
    uncapped = sinkattn.flash_attn_with_sinks(q, k, v, sinks, causal=True, return_lse=True, backend="sm80-emulated")
    assert _same_bits(uncapped, big), "without a cap the public call runs the A100 tile"
    ref = attention_oracle(q, k, v, sinks, causal=True)
    base = attention_oracle(q, k, v, sinks, causal=True, compute_dtype=torch.bfloat16)
    tolerance_check("capped hd256 out", got[0], ref[0], base[0], atol=1e-3, seed=rng_seed)
    tolerance_check("capped hd256 lse", got[1], ref[1], base[1].float(), atol=1e-4, seed=rng_seed)


@pytest.mark.skipif((128, "fwd") not in EMU, reason="no emulated hdim128 forward in this build")
def test_capped_kvcache_runs_the_99k_tile(rng_seed):
    """KV cache, head dim 128, 40 query rows (the few-rows tiles): 112 KB (64 keys) vs 80 KB (32 keys, 4 stages);
    num_splits=0, so the split heuristic counts the capped tile's key blocks as well."""
    b, sq, h, d = 2, 40, 2, 128
    k_cache = torch.randn(b, 200, h, d, dtype=torch.bfloat16)
    v_cache = torch.randn(b, 200, h, d, dtype=torch.bfloat16)
    q = torch.randn(b, sq, h, d, dtype=torch.bfloat16)
    sinks = torch.randn(h)
    lens = torch.tensor([190, 77], dtype=torch.int32)

    def direct(max_smem):
        out, lse = torch.full_like(q, float("nan")), torch.full((b, h, sq), float("nan"))
        kernels.launch_kvcache("sm80-emulated", q, k_cache, v_cache, sinks, out, lse, cache_seqlens=lens,
                               block_table=None, mask=Mask(d ** -0.5, -1, 0, 0, 0.0), num_splits=0, max_smem=max_smem)
        return out, lse

    with sinkattn.sm80_smem_limit("99K"):
        got = sinkattn.flash_attn_with_kvcache(q, k_cache, v_cache, sinks, cache_seqlens=lens, causal=True,
                                               return_lse=True, backend="sm80-emulated")
    small, big = direct(SM86), direct(0)
    assert not _same_bits(small, big), "the two tiles give the same bits here: this test cannot tell them apart"
    assert _same_bits(got, small), "the capped public decode did not run the 99 KB tile"
    for i, n in enumerate(lens.tolist()):
        kw = dict(causal=True)
        ref = attention_oracle(q[i:i + 1], k_cache[i:i + 1, :n], v_cache[i:i + 1, :n], sinks, **kw)
        base = attention_oracle(q[i:i + 1], k_cache[i:i + 1, :n], v_cache[i:i + 1, :n], sinks,
                                compute_dtype=torch.bfloat16, **kw)
        tolerance_check(f"capped kvcache b{i} out", got[0][i:i + 1], ref[0], base[0], atol=1e-3, seed=rng_seed)
        tolerance_check(f"capped kvcache b{i} lse", got[1][i:i + 1], ref[1], base[1].float(), atol=1e-4,
                        seed=rng_seed)


def _bwd_op(backend, dout, q, k, v, sinks, out, lse, dlse, dq, dk, dv, dsinks, *, mask, deterministic, max_smem,
            **varlen):
    """The bridge's signature (tests/bwd_cases.py runs it) served by the op torch.ops.sinkattn.bwd, i.e. dispatch
    with whatever cap is in force; `max_smem` (the cases' direct override) must be 0."""
    assert max_smem == 0 and not varlen
    grads = torch.ops.sinkattn.bwd(dout, dlse, q, k, v, sinks, out, lse, None, None, 0, 0, *mask.kernel_args(),
                                   deterministic, backend)
    for dst, g in zip((dq, dk, dv, dsinks), grads):
        if dst is not None:
            dst.copy_(g)


@pytest.mark.skipif((128, "bwd") not in EMU, reason="no emulated hdim128 backward in this build")
def test_capped_backward_gets_the_cap(monkeypatch, rng_seed):
    """The head-dim-128 backward's 99 KB tile differs only in its stages (same bits), so the observable is the
    limit dispatch hands the bridge; the gradients match the float64 oracle's (bwd_cases' rule)."""
    from bwd_cases import BwdCase, run_bwd_case

    seen = []
    launch = kernels.launch_bwd

    def spy(*args, **kw):
        seen.append(kw["max_smem"])
        return launch(*args, **kw)
    monkeypatch.setattr(kernels, "launch_bwd", spy)
    case = BwdCase("d128-capped-99k", 128, seqlen_q=60, seqlen_k=70, nheads=2, nheads_k=1, causal=True,
                   window=(40, 0), sink_tokens=2)
    with sinkattn.sm80_smem_limit(SM86):
        run_bwd_case(case, "sm80-emulated", "cpu", _bwd_op, seed=rng_seed)
    assert seen == [SM86]
    # The public autograd path hands it on too, and without a cap the device's limit (0).
    q = torch.randn(1, 20, 2, 128, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, 20, 1, 128, dtype=torch.bfloat16, requires_grad=True)
    for cap, want in ((SM86, SM86), (None, 0)):
        with sinkattn.sm80_smem_limit(cap):
            sinkattn.flash_attn_with_sinks(q, k, k, causal=True, backend="sm80-emulated").sum().backward()
        assert seen[-1] == want


@pytest.mark.skipif((256, "bwd") not in EMU, reason="no emulated hdim256 backward in this build")
def test_capped_hd256_backward_is_declined_naming_the_cap(monkeypatch):
    """The hd256 backward's only tile needs 144 KB: under a 99 KB cap dispatch declines it, as on an A10/L4/4090."""
    monkeypatch.setattr(dispatch, "_warned", set())
    problem = Problem.of_call("bwd", torch.empty(1, 8, 2, 256, dtype=torch.bfloat16),
                              torch.empty(1, 8, 2, 256, dtype=torch.bfloat16), torch.zeros(2), Mask(0.125, -1, 0))
    assert dispatch.why_not("sm80-emulated", problem) is None
    with sinkattn.sm80_smem_limit("99K"):
        reason = dispatch.why_not("sm80-emulated", problem)
        assert reason == ("the sm80-emulated backward for head dim 256 needs 144 KB of shared memory per block; the "
                          "sm80 shared-memory cap sinkattn.sm80_smem_limit('99K') allows 99 KB; the reference backend "
                          "serves it")
        with pytest.raises(SinkattnRuntimeError, match=r"sm80_smem_limit\('99K'\) allows 99 KB"):
            dispatch.choose(problem, "sm80-emulated")
        # The forward fits (96 KB tile) and runs; its backward falls back to the reference with the reason.
        q = torch.randn(1, 8, 2, 256, dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(1, 8, 2, 256, dtype=torch.bfloat16, requires_grad=True)
        out = sinkattn.flash_attn_with_sinks(q, k, k, causal=True, backend="sm80-emulated")
        with pytest.warns(sinkattn.ReferenceFallbackWarning, match=r"needs 144 KB.*cap sinkattn.sm80_smem_limit"):
            out.sum().backward()
    # Caps at or above what the kernel needs decline nothing.
    with sinkattn.sm80_smem_limit(144 * KB):
        assert dispatch.why_not("sm80-emulated", problem) is None


def test_report_names_the_cap():
    h200 = _device.DeviceInfo(0, "NVIDIA H200", (9, 0), 132, 232448)
    cap = capability.capabilities(devices=[h200])
    assert cap["sm80_smem_cap"] is None and "shared-memory cap" not in report.render(cap)
    with sinkattn.sm80_smem_limit(SM86):
        cap = capability.capabilities(devices=[h200])
    assert cap["sm80_smem_cap"] == {"bytes": SM86, "set_by": f"sinkattn.sm80_smem_limit({SM86})"}
    text = report.render(cap)
    assert f"sm80 shared-memory cap: 99 KB ({SM86} bytes) per block, set by sinkattn.sm80_smem_limit({SM86})" in text


# ---- the bench column ----------------------------------------------------------------------------------------
def test_bench_comparator_is_listed_and_na_on_cpu():
    sys.path.insert(0, str(ROOT))
    from bench import __main__ as bench_main
    from bench.harness import comparators as C, grids

    assert "sinkattn-sm80-99k" in C.COMPARATORS and "sinkattn-sm80-99k" in C.__doc__
    assert bench_main.parse_args(["--comparators", "sinkattn,sinkattn-sm80,sinkattn-sm80-99k"]).comparators
    for case in grids.get("smoke"):
        x = C.make_inputs(case, torch.device("cpu"))
        with pytest.raises(C.Unsupported, match="needs a CUDA GPU"):
            C.COMPARATORS["sinkattn-sm80-99k"](case, x, torch.device("cpu"))
    # The timed callable sets the cap around the call only.
    run = C._capped(sinkattn.get_sm80_smem_limit, C.SM86_SMEM)
    assert run() == SM86 and sinkattn.get_sm80_smem_limit() is None
    assert C._capped(None, C.SM86_SMEM) is None


def test_bench_comparator_off_cc90_is_na(monkeypatch):
    """On a GPU other than cc 9.0 the column says why it does not run (the 'sinkattn' column already is the
    99 KB table on cc 8.6/8.9); prepared without touching CUDA."""
    sys.path.insert(0, str(ROOT))
    from bench.harness import comparators as C, grids

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 6))
    case = grids.get("smoke")[0]
    x = C.make_inputs(case, torch.device("cpu"))
    with pytest.raises(C.Unsupported, match="cc 9.0"):
        C.COMPARATORS["sinkattn-sm80-99k"](case, x, torch.device("cuda", 0))
