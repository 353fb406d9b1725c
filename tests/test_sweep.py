"""The tuning-sweep runner (bench/sweep.py, `make gpu-sweep`) on the CPU: its phase-1 check against planted bugs,
the ranking, the deadline, features, and a whole `python -m bench.sweep --cpu` run over the emulated default kernel.

Injected variants wrap the real "sm80-emulated" forward kernel; the plants each break its result in one way the
check must see. The CUDA paths (L2 flush, events, the wrap case) wait for a GPU day."""
from __future__ import annotations

import csv
import math
import os
import subprocess
import sys
import time

import pytest
import torch

from oracle import single_thread  # noqa: F401 - one torch thread per test

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench import sweep  # noqa: E402
from sinkattn import _ext, kernels  # noqa: E402

EMU64 = any(k["family"] == "sm80-emulated" and k["op"] == "fwd" and k["headdim"] == 64 and k["dtype"] == "bf16"
            for k in _ext.registry())
pytestmark = pytest.mark.skipif(not EMU64, reason="needs sinkattn._C with the sm80-emulated hd64 bf16 forward kernel "
                                f"(extension: {_ext.IMPORT_ERROR or 'loaded, kernel not built'})")

CPU = torch.device("cpu")
ALL = frozenset({"sinks", "sink_tokens", "causal", "window", "softcap", "gqa"})
QUIET = dict(log=lambda s: None)


def _emu(q, k, v, sinks, out, lse, **mask):
    kernels.launch_fwd("sm80-emulated", q, k, v, sinks, out, lse, **mask)


def _variant(name, run, features=ALL, backend=None):
    return sweep.Variant(name, 64, "bf16", frozenset(features), "sm80-emulated-sweep", run, backend)


def _scaled(q, k, v, sinks, out, lse, **mask):
    _emu(q, k, v, sinks, out, lse, **mask)
    out.mul_(1.01)


def _sink_ignored(q, k, v, sinks, out, lse, **mask):
    _emu(q, k, v, None, out, lse, **mask)


def _lse_off(q, k, v, sinks, out, lse, **mask):
    _emu(q, k, v, sinks, out, lse, **mask)
    lse.add_(0.01)


def _poison_row(q, k, v, sinks, out, lse, **mask):
    _emu(q, k, v, sinks, out, lse, **mask)
    out[0, -1, 0].fill_(math.nan)  # the last query row of head 0 left as the NaN the check poisoned it with


def _sleeper(ms):
    def run(q, k, v, sinks, out, lse, **mask):
        time.sleep(ms / 1e3)
    return run


def _one_shape(label="hd64-full"):
    return [(label, sweep.tiny(dict(sweep.TARGETS)[label]))]


def _default():
    variants, _ = sweep.discover("cpu", [64], None)
    return next(v for v in variants if v.backend == "sm80-emulated")


def test_check_passes_the_kernel_fails_each_plant_and_plants_are_not_ranked():
    plants = [_variant("correct", _emu), _variant("scaled-1.01", _scaled), _variant("sink-ignored", _sink_ignored),
              _variant("lse+0.01", _lse_off), _variant("poison-row", _poison_row)]
    verdicts = sweep.check(plants, CPU, sweep.Clock(300), **QUIET)
    ok = verdicts["correct"]
    assert ok.status == "PASS" and ok.checked == [c.name for c in sweep.CHECKS if not c.cuda_only], ok
    # Each plant, and the assertion of the check that catches it. The bf16 baseline of DESIGN.md's rule alone
    # bounds out by ~5e-2 and lse by ~5e-2 here: it passes the first two, so the fp32 baseline is what sees them,
    # and they are SUSPECT (timed, marked, never the winner), not FAIL.
    assert verdicts["scaled-1.01"].status == "SUSPECT"
    assert "out (fp32 baseline): max error" in verdicts["scaled-1.01"].detail
    assert verdicts["lse+0.01"].status == "SUSPECT"
    assert "odd-noncausal lse (fp32 baseline): max error" in verdicts["lse+0.01"].detail
    # The first case has no sinks, so ignoring them shows only from the next one on (lse moves by exp(sink - lse)).
    assert verdicts["sink-ignored"].status == "FAIL"
    assert "max error" in verdicts["sink-ignored"].detail and "odd-noncausal" not in verdicts["sink-ignored"].detail
    assert verdicts["poison-row"].status == "FAIL"
    assert "odd-noncausal out: max error inf" in verdicts["poison-row"].detail
    # Phase 2 times what passed and the SUSPECTs (marked); the FAILs are neither timed nor ranked, and no SUSPECT
    # is the winner even when it is the fastest.
    fast_suspect = _variant("lse+0.01", _sleeper(0))
    timed_ones = [plants[0], plants[1], fast_suspect, plants[2], plants[4]]
    rows = sweep.time_shapes(timed_ones, verdicts, _one_shape(), CPU, sweep.Clock(300),
                             {"budget_ms": 1, "max_reps": 1, "min_reps": 1}, **QUIET)
    assert {r["variant"] for r in rows} == {"correct", "scaled-1.01", "lse+0.01", "sdpa-flash"}
    ranked = sorted((r for r in rows if r.get("rank")), key=lambda r: r["rank"])
    assert ranked[0]["variant"] == "lse+0.01" and ranked[0]["suspect"]
    assert {r["variant"] for r in ranked if r.get("suspect")} == {"scaled-1.01", "lse+0.01"}
    assert not any(r.get("suspect") for r in rows if r["variant"] == "correct")
    (line,) = sweep.winners(rows, _one_shape())
    assert ": lse+0.01 " not in line and ": scaled-1.01 " not in line and ": correct " in line, line
    assert "lse+0.01 SUSPECT" in sweep.tables(rows, _one_shape())


def test_ranking_x_default_and_winner_line():
    default = _default()
    default.run = _sleeper(40)  # the emulated default's registry entry, timed as a 40 ms call
    variants = [_variant("slow", _sleeper(80)), default, _variant("fast", _sleeper(10))]
    verdicts = {v.name: sweep.Verdict("PASS") for v in variants}
    shapes = _one_shape()
    rows = sweep.time_shapes(variants, verdicts, shapes, CPU, sweep.Clock(300),
                             {"budget_ms": 1, "max_reps": 3, "min_reps": 3}, **QUIET)
    ranked = sorted((r for r in rows if r.get("rank")), key=lambda r: r["rank"])
    assert [r["variant"] for r in ranked] == ["fast", default.name, "slow"]
    by = {r["variant"]: r for r in ranked}
    assert by[default.name]["is_default"] and by[default.name]["x_default"] == 1.0
    assert 2.0 < by["fast"]["x_default"] < 5.0 and 0.3 < by["slow"]["x_default"] < 0.8
    assert all(r["x_sdpa"] > 0 for r in ranked)  # SDPA (flash on the CPU) is the anchor, measured, not ranked
    assert [r["tflops"] > 0 for r in ranked] == [True] * 3
    table = sweep.tables(rows, shapes)
    assert table.index("| 1 | fast |") < table.index(f"| 2 | {default.name} (default) |") < table.index("| 3 | slow |")
    assert "sdpa-flash (anchor)" in table
    (line,) = sweep.winners(rows, shapes)
    assert line.startswith("winner hd64-full: fast ") and f"x the default {default.name}" in line


def test_an_error_while_timing_is_listed_and_the_rest_still_runs():
    def broken(*a, **kw):
        raise ValueError("no tile fits")

    variants = [_variant("sweep_broken", broken), _variant("sweep_fine", _sleeper(1))]
    rows = sweep.time_shapes(variants, {v.name: sweep.Verdict("PASS") for v in variants}, _one_shape(), CPU,
                             sweep.Clock(300), {"budget_ms": 1, "max_reps": 1, "min_reps": 1}, **QUIET)
    by = {r["variant"]: r for r in rows}
    assert by["sweep_broken"]["status"] == "NOT RUN" and not by["sweep_broken"].get("rank")
    assert by["sweep_broken"]["note"] == "error while timing: ValueError: no tile fits"
    assert by["sweep_fine"]["rank"] == 1


def test_features_are_respected_in_checks_and_timing():
    calls = []

    def recording(q, k, v, sinks, out, lse, **mask):
        calls.append(mask)
        _emu(q, k, v, sinks, out, lse, **mask)

    plain = _variant("no-softcap-no-window", recording, features={"sinks", "sink_tokens", "causal", "gqa"})
    checks = [c for c in sweep.CHECKS if c.name in ("odd-noncausal", "window127-sinktok4-sinks", "softcap")]
    verdict = sweep.check([plain], CPU, sweep.Clock(300), checks=checks, **QUIET)[plain.name]
    assert verdict.status == "PASS" and verdict.checked == ["odd-noncausal"]
    assert verdict.skipped == ["window127-sinktok4-sinks: lacks window", "softcap: lacks softcap"]
    assert len(calls) == 1 and calls[0]["softcap"] == 0 and calls[0]["window_left"] < 0
    rows = sweep.time_shapes([plain], {plain.name: verdict}, _one_shape("gptoss-sliding"), CPU, sweep.Clock(300),
                             {"budget_ms": 1, "max_reps": 1, "min_reps": 1}, **QUIET)
    (row,) = [r for r in rows if r["variant"] == plain.name]
    assert row["status"] == "n/a" and row["note"] == "lacks window" and not row.get("rank")
    assert len(calls) == 1  # never called on the windowed shape
    # A variant no check case fits is not called PASS.
    bare = _variant("no-features", recording, features=set())
    v = sweep.check([bare], CPU, sweep.Clock(300), checks=checks[1:], **QUIET)[bare.name]
    assert v.status == "NOT RUN" and "no check case" in v.detail


def test_deadline_cuts_the_run_lists_what_did_not_run_and_exits_2(tmp_path):
    fake = _variant("sweep_fake", _sleeper(1))
    assert sweep.main(["--cpu", "--headdims", "64", "--deadline-s", "0", "--out", str(tmp_path)],
                      variants=[fake, _default()]) == 2
    summary = (tmp_path / "summary.txt").read_text()
    not_run = summary.split("## NOT RUN")[1].split("##")[0]
    assert "sweep_fake: deadline" in not_run and "fwd_emu_hdim64_bf16: deadline" in not_run
    assert sorted(os.listdir(tmp_path)) == ["results.csv", "results.md", "summary.txt"]
    # Checks done, timing cut: each (shape, variant) that did not run has its row and reason.
    clock = sweep.Clock(0)
    rows = sweep.time_shapes([fake], {fake.name: sweep.Verdict("PASS")}, _one_shape(), CPU, clock,
                             {"budget_ms": 1, "max_reps": 1}, **QUIET)
    assert clock.cut and {(r["variant"], r["status"], r["note"]) for r in rows} == {
        ("sweep_fake", "NOT RUN", "deadline"), ("sdpa-flash", "NOT RUN", "deadline")}
    assert sweep.winners(rows, _one_shape()) == ["winner hd64-full: none, nothing was timed (see NOT RUN)"]
    assert "- NOT RUN: sweep_fake: deadline" in sweep.tables(rows, _one_shape())


def test_a_lost_cuda_context_stops_the_run_and_exits_1(tmp_path):
    def fault(*a, **kw):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    variants = [_variant("sweep_faulty", fault), _variant("sweep_after", _emu)]
    assert sweep.main(["--cpu", "--headdims", "64", "--out", str(tmp_path)], variants=variants) == 1
    summary = (tmp_path / "summary.txt").read_text()
    assert "FAIL    sweep_faulty: odd-noncausal: RuntimeError: CUDA error: an illegal memory access" in summary
    assert "NOT RUN sweep_after: CUDA context lost earlier (sweep_faulty:" in summary
    # No variant at all: the harness has nothing to do, which is an error, not a pass.
    assert sweep.main(["--cpu", "--out", str(tmp_path / "none")], variants=[]) == 1
    assert "harness error: RuntimeError: no default kernel" in (tmp_path / "none" / "summary.txt").read_text()


def test_cli_cpu_run_end_to_end(tmp_path):
    r = subprocess.run([sys.executable, "-m", "bench.sweep", "--cpu", "--headdims", "64", "--max-reps", "2",
                        "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert sorted(os.listdir(tmp_path)) == ["results.csv", "results.md", "summary.txt"]
    out = r.stdout
    assert sweep.CPU_NOTE in out and sweep.CPU_NOTE in (tmp_path / "results.md").read_text()
    assert "sweep: check fwd_emu_hdim64_bf16: PASS (6 cases)" in out
    hd64 = [label for label, c in sweep.TARGETS if c.headdim == 64]
    # Last: one winner line per shape of head dim 64, after the ranked tables.
    assert [line.split(":")[0] for line in out.strip().splitlines()[-len(hd64):]] == [f"winner {s}" for s in hd64]
    md = (tmp_path / "results.md").read_text()
    for label in hd64:
        table = md.split(f"### {label}:")[1].split("###")[0]
        first = next(line for line in table.splitlines() if line.startswith("| 1 |"))
        cells = [c.strip() for c in first.split("|")[1:-1]]
        assert cells[1] == "fwd_emu_hdim64_bf16 (default)" and float(cells[2]) > 0 and float(cells[3]) > 0
        assert cells[4] == "1", first
    with open(tmp_path / "results.csv") as f:
        rows = list(csv.DictReader(f))
    ours = [r for r in rows if r["variant"] == "fwd_emu_hdim64_bf16"]
    assert [r["shape"] for r in ours] == hd64 and all(r["status"] == "ok" and float(r["tflops"]) > 0 for r in ours)
    sliding = next(r for r in rows if r["shape"] == "gptoss-sliding" and r["variant"] == "sdpa-flash")
    assert sliding["status"] == "n/a" and "sliding window" in sliding["note"]
    summary = (tmp_path / "summary.txt").read_text()
    assert "PASS    fwd_emu_hdim64_bf16 (checked: odd-noncausal, causal-sq<sk" in summary
    assert '"exit_status": 0' in summary
