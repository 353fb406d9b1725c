"""The tuning-sweep runner (bench/sweep/runner.py, `make gpu-sweep`) on the CPU: its phase-1 check against planted bugs,
the ranking, the deadline, features, and a whole `python -m bench.sweep --cpu` run over the emulated default kernel;
then what a hung, crashing or faulting variant costs: the journal's resume, the watchdog ending a hung process,
and gpu_sweep.sh's relaunch loop.

Injected variants wrap the real "sm80-emulated" forward kernel; the plants each break its result in one way the
check must see. The hang/fault tests use tests/sweep_fakes.py (pure Python, any build). The CUDA paths (L2 flush,
events, the wrap case) wait for a GPU day."""
from __future__ import annotations

import csv
import json
import math
import os
import re
import subprocess
import sys
import time

import pytest
import torch

from oracle import single_thread  # noqa: F401 - one torch thread per test

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import sweep_fakes  # noqa: E402
from bench.sweep import runner as sweep  # noqa: E402
from sinkattn import _ext, kernels  # noqa: E402
from sinkattn.mask import Mask

EMU64 = any(k["family"] == "sm80-emulated" and k["op"] == "fwd" and k["headdim"] == 64 and k["dtype"] == "bf16"
            for k in _ext.registry())
needs_emu64 = pytest.mark.skipif(not EMU64, reason="needs sinkattn._C with the sm80-emulated hd64 bf16 forward "
                                 f"kernel (extension: {_ext.IMPORT_ERROR or 'loaded, kernel not built'})")

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


@needs_emu64
def test_check_passes_the_kernel_fails_each_plant_and_plants_are_not_ranked():
    plants = [_variant("correct", _emu), _variant("scaled-1.01", _scaled), _variant("sink-ignored", _sink_ignored),
              _variant("lse+0.01", _lse_off), _variant("poison-row", _poison_row)]
    verdicts = sweep.check(plants, CPU, sweep.Clock(300), **QUIET)
    ok = verdicts["correct"]
    assert ok.status == "PASS" and ok.checked == [c.name for c in sweep.CHECKS if not c.cuda_only], ok
    # Each plant, and the assertion of the check that catches it. The bf16 baseline of docs/DESIGN.md's rule alone
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


@needs_emu64
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


@needs_emu64
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
    assert len(calls) == 1 and calls[0]["mask"].softcap == 0 and calls[0]["mask"].window_left < 0
    rows = sweep.time_shapes([plain], {plain.name: verdict}, _one_shape("gptoss-sliding"), CPU, sweep.Clock(300),
                             {"budget_ms": 1, "max_reps": 1, "min_reps": 1}, **QUIET)
    (row,) = [r for r in rows if r["variant"] == plain.name]
    assert row["status"] == "n/a" and row["note"] == "lacks window" and not row.get("rank")
    assert len(calls) == 1  # never called on the windowed shape
    # A variant no check case fits is not called PASS.
    bare = _variant("no-features", recording, features=set())
    v = sweep.check([bare], CPU, sweep.Clock(300), checks=checks[1:], **QUIET)[bare.name]
    assert v.status == "NOT RUN" and "no check case" in v.detail


@needs_emu64
def test_deadline_cuts_the_run_lists_what_did_not_run_and_exits_2(tmp_path):
    fake = _variant("sweep_fake", _sleeper(1))
    assert sweep.main(["--cpu", "--headdims", "64", "--deadline-s", "0", "--out", str(tmp_path)],
                      variants=[fake, _default()]) == 2
    summary = (tmp_path / "summary.txt").read_text()
    not_run = summary.split("## NOT RUN")[1].split("##")[0]
    assert "sweep_fake: deadline" in not_run and "fwd_emu_hdim64_bf16: deadline" in not_run
    assert sorted(os.listdir(tmp_path)) == ["journal.jsonl", "results.csv", "results.md", "summary.txt"]
    # Checks done, timing cut: each (shape, variant) that did not run has its row and reason.
    clock = sweep.Clock(0)
    rows = sweep.time_shapes([fake], {fake.name: sweep.Verdict("PASS")}, _one_shape(), CPU, clock,
                             {"budget_ms": 1, "max_reps": 1}, **QUIET)
    assert clock.cut and {(r["variant"], r["status"], r["note"]) for r in rows} == {
        ("sweep_fake", "NOT RUN", "deadline"), ("sdpa-flash", "NOT RUN", "deadline")}
    assert sweep.winners(rows, _one_shape()) == ["winner hd64-full: none, nothing was timed (see NOT RUN)"]
    assert "- NOT RUN: sweep_fake: deadline" in sweep.tables(rows, _one_shape())


def _calls(path) -> dict[str, int]:
    """sweep_fakes' call log: {"<variant> <phase>": calls}."""
    counts: dict[str, int] = {}
    if os.path.exists(path):
        for line in open(path).read().splitlines():
            counts[line] = counts.get(line, 0) + 1
    return counts


FAST = ["--cpu", "--headdims", "64", "--max-reps", "1", "--budget-ms", "1"]
HD64 = [label for label, c in sweep.TARGETS if c.headdim == 64]


def _journal(path) -> list[dict]:
    return [json.loads(line) for line in open(path).read().splitlines()]


def test_a_lost_cuda_context_stops_the_run_exits_3_and_the_next_run_resumes_after_it(tmp_path, monkeypatch):
    monkeypatch.setenv("SWEEP_FAKE_CALLS", str(tmp_path / "calls"))
    variants = [sweep_fakes.fake("sweep_faulty", fault_in="check"), sweep_fakes.fake("sweep_after"),
                sweep_fakes.fake("sweep_faulty_timing", fault_in="time")]
    out = ["--out", str(tmp_path / "out")]
    # 1st process: the fault in phase 1 loses the context; the rest is NOT RUN here, exit 3 (gpu_sweep.sh relaunches).
    assert sweep.main(FAST + out, variants=variants) == 3
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert "FAIL    sweep_faulty: odd-noncausal: RuntimeError: CUDA error: an illegal memory access" in summary
    assert "NOT RUN sweep_after: CUDA context lost earlier (sweep_faulty:" in summary
    assert "check sweep_faulty: lost the CUDA context: odd-noncausal: RuntimeError" in summary
    verdict = next(r for r in _journal(tmp_path / "out" / "journal.jsonl") if r["event"] == "verdict")
    assert (verdict["unit"], verdict["status"], verdict["incident"]) == ("sweep_faulty", "FAIL", "fault")
    # 2nd: resumes after it (not rerun), checks the rest; the timing fault loses the context again: exit 3.
    assert sweep.main(FAST + out, variants=variants) == 3
    # 3rd: the faulting timing unit is recorded, and that variant is not timed on the later shapes.
    assert sweep.main(FAST + out, variants=variants) == 0
    calls = _calls(tmp_path / "calls")
    assert calls["sweep_faulty check"] == 1 and calls["sweep_faulty_timing time"] == 1
    assert calls["sweep_after check"] == 6 and calls["sweep_after time"] == 2 * len(HD64)  # warm-up + 1 run each
    with open(tmp_path / "out" / "results.csv") as f:
        rows = {(r["shape"], r["variant"]): r for r in csv.DictReader(f)}
    assert all(rows[(s, "sweep_after")]["rank"] == "1" for s in HD64)
    assert rows[(HD64[0], "sweep_faulty_timing")]["note"].startswith("error while timing: RuntimeError: CUDA error")
    assert all(rows[(s, "sweep_faulty_timing")]["note"] == f"not run: it lost the CUDA context on {HD64[0]}"
               for s in HD64[1:])
    # No variant at all: the harness has nothing to do, which is an error, not a pass.
    assert sweep.main(["--cpu", "--out", str(tmp_path / "none")], variants=[]) == 1
    assert "harness error: RuntimeError: no default kernel" in (tmp_path / "none" / "summary.txt").read_text()


def test_resume_takes_recorded_units_and_fails_the_one_in_flight(tmp_path, monkeypatch):
    """A journal as a killed process leaves it: finished units, then one "start" without a result."""
    monkeypatch.setenv("SWEEP_FAKE_CALLS", str(tmp_path / "calls"))
    fake = sweep_fakes.fake
    config = {"device": "cpu", "headdims": [64], "filter": None}

    def journal(folder, *records):
        folder.mkdir()
        with open(folder / "journal.jsonl", "w") as f:
            for r in ({"event": "run", "config": config},) + records:
                f.write(json.dumps(r) + "\n")
        return ["--out", str(folder)]

    # Phase 1: fake_a done, fake_hang in flight (the 1st process died there), fake_b not reached.
    out = journal(tmp_path / "p1",
                  {"event": "start", "phase": "check", "unit": "fake_a", "watchdog_s": 30.0},
                  {"event": "verdict", "unit": "fake_a", "status": "PASS", "checked": ["odd-noncausal"]},
                  {"event": "start", "phase": "check", "unit": "fake_hang", "watchdog_s": 30.0})
    assert sweep.main(FAST + out, variants=[fake("fake_a"), fake("fake_hang"), fake("fake_b")]) == 0
    calls = _calls(tmp_path / "calls")
    assert "fake_a check" not in calls and "fake_hang check" not in calls and calls["fake_b check"] == 6
    assert "fake_hang time" not in calls and calls["fake_a time"] == calls["fake_b time"] == 2 * len(HD64)
    summary = (tmp_path / "p1" / "summary.txt").read_text()
    note = "hung or crashed the process (no result within the watchdog's 30 s)"
    assert f"FAIL    fake_hang: {note}" in summary
    assert "PASS    fake_a (checked: odd-noncausal)" in summary  # as recorded, not rerun
    assert "## hung, crashed or faulted a process" in summary and f"check fake_hang: {note}" in summary
    last = _journal(tmp_path / "p1" / "journal.jsonl")
    assert last[-1] == {"event": "end", "status": 0} and last[-2]["event"] == "row"
    assert any(r["event"] == "verdict" and r["unit"] == "fake_hang" and r["incident"] == "hung" for r in last)

    # Phase 2: both checked; on the first shape SDPA and fake_a timed, fake_b in flight.
    (tmp_path / "calls").unlink()
    label, case = HD64[0], sweep.tiny(dict(sweep.TARGETS)[HD64[0]])
    flops = sweep.comparators.case_fwd_flops(case)
    base = dict(is_default=False, flops=flops)
    timed = dict(status="ok", median_ms=123.0, p10_ms=120.0, p90_ms=130.0, reps=1, method="perf_counter",
                 tflops=flops / 0.123 / 1e12)
    out = journal(tmp_path / "p2",
                  {"event": "verdict", "unit": "fake_a", "status": "PASS", "checked": ["odd-noncausal"]},
                  {"event": "verdict", "unit": "fake_b", "status": "PASS", "checked": ["odd-noncausal"]},
                  {"event": "row", "unit": f"{label} / sdpa-flash",
                   "row": sweep._row(label, case, "sdpa-flash", "sdpa", family="torch", **base, **timed)},
                  {"event": "row", "unit": f"{label} / fake_a",
                   "row": sweep._row(label, case, "fake_a", "variant", family="fake-sweep", **base, **timed)},
                  {"event": "start", "phase": "time", "unit": f"{label} / fake_b", "watchdog_s": 60.0,
                   "row": sweep._row(label, case, "fake_b", "variant", family="fake-sweep", **base)})
    assert sweep.main(FAST + out, variants=[fake("fake_a"), fake("fake_b")]) == 0
    calls = _calls(tmp_path / "calls")
    assert "fake_a check" not in calls and "fake_b check" not in calls
    assert calls["fake_a time"] == 2 * (len(HD64) - 1) and "fake_b time" not in calls
    with open(tmp_path / "p2" / "results.csv") as f:
        rows = {(r["shape"], r["variant"]): r for r in csv.DictReader(f)}
    assert rows[(label, "fake_a")]["median_ms"] == "123" and rows[(label, "fake_a")]["rank"] == "1"
    assert rows[(label, "fake_b")]["status"] == "NOT RUN"
    assert rows[(label, "fake_b")]["note"] == "hung or crashed the process (no result within the watchdog's 60 s)"
    for s in HD64[1:]:  # a variant that hung a process is not timed again; the others are
        assert rows[(s, "fake_b")]["note"] == f"not run: it hung or crashed the process on {label}"
        assert rows[(s, "fake_a")]["rank"] == "1"
    assert f"time {label} / fake_b: hung or crashed" in (tmp_path / "p2" / "summary.txt").read_text()


def _env(tmp_path, **kw) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    return dict(env, SWEEP_FAKE_CALLS=str(tmp_path / "calls"), **kw)


def test_a_hung_variant_ends_the_process_and_the_next_run_reports_it(tmp_path):
    """`python -m bench.sweep` with a variant that hangs in phase 1 (a Python sleep: faulthandler's watchdog ends
    the process from its own C thread whatever the main thread is doing, as it would in a stuck CUDA call)."""
    cmd = [sys.executable, "-m", "bench.sweep", *FAST, "--watchdog-s", "5", "--out", str(tmp_path / "out")]
    env = _env(tmp_path, BENCH_SWEEP_TEST_VARIANTS="sweep_fakes:hang_in_check")
    try:
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=90)
    except subprocess.TimeoutExpired:
        pytest.fail("the hung variant was not ended by the watchdog")
    assert r.returncode == 1, r.stdout + r.stderr  # faulthandler's _exit(1)
    assert "Timeout (0:00:05)!" in r.stderr and "sweep_fakes.py" in r.stderr  # the traceback names the culprit
    assert not (tmp_path / "out" / "results.csv").exists()
    last = _journal(tmp_path / "out" / "journal.jsonl")[-1]
    assert (last["event"], last["phase"], last["unit"]) == ("start", "check", "fake_hang")
    # The second run over the same --out resumes: the hung variant is FAIL, the others are checked and ranked.
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=90)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "the last process stopped in: check fake_hang" in r.stdout
    calls = _calls(tmp_path / "calls")
    assert calls == {"fake_a check": 6, "fake_hang check": 1, "fake_b check": 6,
                     "fake_a time": 2 * len(HD64), "fake_b time": 2 * len(HD64)}
    summary = (tmp_path / "out" / "summary.txt").read_text()
    note = "hung or crashed the process (no result within the watchdog's 5 s)"
    assert f"FAIL    fake_hang: {note}" in summary and f"check fake_hang: {note}" in summary
    md = (tmp_path / "out" / "results.md").read_text()
    for label in HD64:
        table = md.split(f"### {label}:")[1].split("###")[0]
        assert {line.split("|")[2].strip() for line in table.splitlines() if line.startswith(("| 1 |", "| 2 |"))} \
            == {"fake_a", "fake_b"}, table


def test_gpu_sweep_sh_relaunches_after_a_fault_and_a_hang_and_ends_with_the_tables(tmp_path):
    """bench/sweep/gpu_sweep.sh on the CPU (GPU_SWEEP_SKIP_BUILD=1, the fakes by the test hook): run 1 exits 3 (a CUDA
    fault in phase 1), run 2 is ended by the watchdog (a hang while timing), run 3 finishes."""
    out = tmp_path / "out"
    env = _env(tmp_path, OUT=str(out), PYTHON=sys.executable, GPU_SWEEP_SKIP_BUILD="1", GPU_SWEEP_TOTAL="150",
               GPU_SWEEP_ARGS="--headdims 64 --watchdog-s 5 --max-reps 1 --budget-ms 1",
               BENCH_SWEEP_TEST_VARIANTS="sweep_fakes:fault_then_hang_in_time")
    r = subprocess.run(["bash", os.path.join(ROOT, "bench", "sweep", "gpu_sweep.sh")], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=180)
    run_txt = (out / "run.txt").read_text()
    assert r.returncode == 0, run_txt + r.stdout[-3000:] + r.stderr[-3000:]
    assert "run 1 ended abnormally: a kernel fault lost the CUDA context" in run_txt
    assert "run 2 ended abnormally: the watchdog ended it in time hd64-full / fake_slow" in run_txt
    assert "exit 0 " in run_txt and "after 3 run(s)" in run_txt
    log = (out / "sweep.log").read_text()
    assert log.count("== gpu-sweep: run ") == 3 and "Timeout (0:00:05)!" in log
    assert r.stdout.rstrip().endswith(run_txt.rstrip().splitlines()[-1])
    assert log.rstrip().splitlines()[-1].startswith(f"winner {HD64[-1]}: ")  # the tables, last
    files = sorted(os.listdir(out))
    assert files == ["journal.jsonl", "results.csv", "results.md", "run.txt", "summary.txt", "sweep.log"]
    summary = (out / "summary.txt").read_text()
    lost = summary.split("## hung, crashed or faulted")[1].split("##")[0]
    assert "check fake_fault: lost the CUDA context: odd-noncausal: RuntimeError: CUDA error" in lost
    assert "time hd64-full / fake_slow: hung or crashed the process (no result within the watchdog's 5 s)" in lost
    calls = _calls(tmp_path / "calls")
    assert calls["fake_fault check"] == 1 and calls["fake_slow time"] == 1 and calls["fake_a check"] == 6
    md = (out / "results.md").read_text()
    for label in HD64:
        assert "- NOT RUN: fake_slow: " in md.split(f"### {label}:")[1].split("###")[0]
        assert "| 2 | fake_" in md.split(f"### {label}:")[1].split("###")[0]


def _hd64_emulated(family):
    return next((k["name"] for k in _ext.registry() if k["family"] == family and k["op"] == "fwd"
                 and k["headdim"] == 64 and k["dtype"] == "bf16"), None)


@needs_emu64
def test_cli_cpu_run_end_to_end(tmp_path):
    """`python -m bench.sweep --cpu` checks and times both emulated families' defaults and their sweep variants'
    twins (one sm90 twin here, by --filter: each is about as costly as a default on the CPU)."""
    sm90_default, twin = _hd64_emulated("sm90-emulated"), _hd64_emulated("sm90-emulated-sweep")
    cmd = [sys.executable, "-m", "bench.sweep", "--cpu", "--headdims", "64", "--max-reps", "2", "--out", str(tmp_path)]
    r = subprocess.run(cmd + (["--filter", twin] if twin else []), cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert sorted(os.listdir(tmp_path)) == ["journal.jsonl", "results.csv", "results.md", "summary.txt"]
    out = r.stdout
    assert sweep.CPU_NOTE in out and sweep.CPU_NOTE in (tmp_path / "results.md").read_text()
    ranked_kernels = ["fwd_emu_hdim64_bf16"] + [n for n in (sm90_default, twin) if n]
    for name in ranked_kernels:
        assert re.search(rf"sweep: check {name}: PASS \(\d+ cases\)", out), (name, out)
    hd64 = [label for label, c in sweep.TARGETS if c.headdim == 64]
    # Last: one winner line per shape of head dim 64, after the ranked tables.
    assert [line.split(":")[0] for line in out.strip().splitlines()[-len(hd64):]] == [f"winner {s}" for s in hd64]
    md = (tmp_path / "results.md").read_text()
    for label in hd64:
        table = md.split(f"### {label}:")[1].split("###")[0]
        rows = {cells[1]: cells for cells in ([c.strip() for c in line.split("|")[1:-1]]
                                              for line in table.splitlines() if re.match(r"\| \d+ \|", line))}
        # The CPU run's default is the sm80 emulation (where "auto" means the reference backend): x default 1.
        default = rows["fwd_emu_hdim64_bf16 (default)"]
        assert float(default[2]) > 0 and float(default[3]) > 0 and default[4] == "1", table
        for name in ranked_kernels[1:]:
            assert float(rows[name][2]) > 0 and float(rows[name][4]) > 0, table
    with open(tmp_path / "results.csv") as f:
        rows = list(csv.DictReader(f))
    for name in ranked_kernels:
        ours = [r for r in rows if r["variant"] == name]
        assert [r["shape"] for r in ours] == hd64 and all(r["status"] == "ok" and float(r["tflops"]) > 0
                                                           for r in ours), (name, ours)
    sliding = next(r for r in rows if r["shape"] == "gptoss-sliding" and r["variant"] == "sdpa-flash")
    assert sliding["status"] == "n/a" and "sliding window" in sliding["note"]
    summary = (tmp_path / "summary.txt").read_text()
    assert "PASS    fwd_emu_hdim64_bf16 (checked: odd-noncausal, causal-sq<sk" in summary
    if twin:  # the other twins are named as left out by --filter, not silently missing
        assert f"--filter {twin!r}" in summary
    assert '"exit_status": 0' in summary


# ---- the emulation build's own variant, through the real variant:<name> backend (api.cpp) ----------------------
SMOKE = next((k for k in _ext.registry() if k["family"] == "sm80-emulated-sweep" and k["op"] == "fwd"), None)
needs_smoke = pytest.mark.skipif(SMOKE is None, reason="needs an emulation build of sinkattn._C (it holds one "
                                 f"emulated tuning variant; extension: {_ext.IMPORT_ERROR or 'loaded, none built'})")


@needs_smoke
def test_the_emulation_builds_variant_passes_phase_1_through_its_backend():
    """discover() finds it, phase 1 runs it as backend variant:<name> against the oracle on every case its
    features serve, and softcap (compiled out) is left to the cases it does not serve."""
    variants, _ = sweep.discover("cpu", [SMOKE["headdim"]], SMOKE["name"])
    (v,) = [v for v in variants if v.name == SMOKE["name"]]
    verdict = sweep.check([v], CPU, sweep.Clock(300), **QUIET)[v.name]
    assert verdict.status == "PASS", verdict
    assert verdict.checked == [c.name for c in sweep.CHECKS if not c.cuda_only and c.softcap == 0], verdict
    assert any(s.startswith("softcap") for s in verdict.skipped), verdict


@needs_smoke
def test_the_variant_backend_refuses_what_it_does_not_serve():
    d = SMOKE["headdim"]

    def call(name, headdim=d, softcap=0.0):
        q = torch.randn(1, 5, 2, headdim, dtype=torch.bfloat16)
        out, lse = torch.empty_like(q), torch.empty(1, 2, 5)
        kernels.launch_fwd("variant:" + name, q, q, q, None, out, lse, mask=Mask(0.1, -1, -1, 0, softcap))
        return out

    with pytest.raises(RuntimeError, match="no tuning-grid forward variant named 'nope'"):
        call("nope")
    default = next(k["name"] for k in _ext.registry() if k["family"] == "sm80-emulated" and k["op"] == "fwd")
    with pytest.raises(RuntimeError, match="no tuning-grid forward variant named"):
        call(default)  # a default kernel is not a variant
    with pytest.raises(RuntimeError, match=f"serves head dim {d} bf16, not {d // 2}"):
        call(SMOKE["name"], headdim=d // 2)
    with pytest.raises(RuntimeError, match="compiled without softcap"):
        call(SMOKE["name"], softcap=5.0)
    assert torch.isfinite(call(SMOKE["name"])).all()
