"""The build's progress lines (tools/build_progress.py) and the build-time table (tools/build_times.py).

The ninja runner is exercised on a small ninja file of `sleep` commands shaped like setup.py's (the rule touches
`$out.start` and names the unit in `description`), so the lines a user sees during a 20-minute build are checked
here in a second: every unit reported once as done with n of N, a line at least every tick while a unit runs
with the unit named, a summary, and a failure that says so.
"""
from __future__ import annotations

import importlib.util
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _load(name):
    spec = importlib.util.spec_from_file_location(f"sinkattn_tools_{name}", ROOT / "tools" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


bp = _load("build_progress")
bt = _load("build_times")
needs_ninja = pytest.mark.skipif(shutil.which("ninja") is None, reason="ninja is not installed")


def _ninja_file(tmp_path, units: dict[str, str]) -> str:
    """units: name -> shell command (before the touch of its output)."""
    lines = ["rule run", "  command = touch $out.start && $cmd && touch $out", "  description = $unit", ""]
    for name, cmd in units.items():
        lines += [f"build {tmp_path / (name + '.o')}: run", f"  unit = {name}", f"  cmd = {cmd}"]
    (tmp_path / "build.ninja").write_text("\n".join(lines) + "\n")
    return str(tmp_path)


@needs_ninja
def test_run_ninja_reports_each_unit_and_a_summary(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SINKATTN_PROGRESS_TTY", "0")
    monkeypatch.setattr(bp, "TICK_S", 0.5)
    d = _ninja_file(tmp_path, {"fwd_sm80_hdim64_bf16.cu": "sleep 3", "merge_fp32.cu": "sleep 0.2",
                               "emu80_bwd_hdim64.cpp": "sleep 0.4"})
    assert sorted(bp.planned_units(d)) == ["emu80_bwd_hdim64.cpp", "fwd_sm80_hdim64_bf16.cu", "merge_fp32.cu"]
    bp.run_ninja(d, 2)
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("sinkattn build: 3 kernel units to compile with 2 jobs")
    done = [l for l in out if " done " in l]
    assert len(done) == 3
    assert [re.search(r"\[(\d)/3\]", l).group(1) for l in done] == ["1", "2", "3"]
    assert any(re.search(r"done fwd_sm80_hdim64_bf16.cu in [34]s", l) for l in done), done
    # while the 3-second unit compiles alone, ticks name it with its running time
    ticks = [l for l in out if "; compiling " in l]
    assert ticks and all("elapsed, about" in l for l in ticks)
    assert any("fwd_sm80_hdim64_bf16.cu (" in l for l in ticks), ticks
    assert re.match(r"sinkattn build: 3 kernel units in \d+s wall with 2 jobs.*slowest fwd_sm80_hdim64_bf16.cu [34]s",
                    out[-1]), out[-1]
    # nothing left: one line says so
    bp.run_ninja(d, 2)
    assert capsys.readouterr().out.strip() == "sinkattn build: kernels up to date (nothing to compile)"


@needs_ninja
def test_run_ninja_failure_is_reported_and_raised(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SINKATTN_PROGRESS_TTY", "0")
    d = _ninja_file(tmp_path, {"a.cu": "echo 'a.cu(3): error: no such thing' && false", "b.cu": "true"})
    with pytest.raises(subprocess.CalledProcessError):
        bp.run_ninja(d, 1)
    out = capsys.readouterr().out
    assert "a.cu(3): error: no such thing" in out  # the compiler's message reaches the user
    assert "sinkattn build: FAILED after" in out


@pytest.mark.parametrize("name,kind", [("fwd_sm80_hdim64_bf16.cu", "fwd_sm80"), ("emu80_bwd_hdim256.cpp", "emu80_bwd"),
                                       ("fwd_sm80_hdim128_bf16_keys.cu", "fwd_sm80_keys"),
                                       ("merge_fp32.cu", "merge"), ("build_info_cuda.cu", "build_info")])
def test_unit_kind(name, kind):
    assert bp.unit_kind(name) == kind


def test_heartbeat_wrapper(tmp_path, monkeypatch):
    log = tmp_path / "logs" / "x.log"
    script = "import time\nprint('noise 1'); print('sinkattn build: [1/2] done'); time.sleep(1.5); print('end')"
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "build_progress.py"), "run", "--name", "step",
                        "--log", str(log), "--show", "sinkattn build", "--", sys.executable, "-c", script],
                       capture_output=True, text=True, env={"PATH": "/usr/bin:/bin", "SINKATTN_HEARTBEAT_S": "0.5"})
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert "sinkattn build: [1/2] done" in lines and "noise 1" not in lines
    assert "step: still running" in r.stdout  # the quiet 1.5 s got a heartbeat
    assert r.stdout.rstrip().splitlines()[-1].startswith("step: done in")
    assert log.read_text().splitlines() == ["noise 1", "sinkattn build: [1/2] done", "end"]
    # a failing command: its exit status, and the tail of its log
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "build_progress.py"), "run", "--name", "step",
                        "--log", str(log), "--show", "nothing", "--", sys.executable, "-c",
                        "print('the real error'); raise SystemExit(3)"], capture_output=True, text=True)
    assert r.returncode == 3
    assert "step: FAILED (exit 3)" in r.stdout and "the real error" in r.stdout


def test_build_times_table(tmp_path):
    log = tmp_path / ".ninja_log"
    log.write_text("# ninja log v5\n"
                   "0\t150000\t1\t/b/fwd_sm80_hdim64_bf16.cu.o\th\n"
                   "0\t30000\t1\t/b/merge_fp32.cu.o\th\n"
                   "0\t90000\t1\t/b/bwd_sm80_hdim64_bf16.cu.o\th\n"
                   "200000\t260000\t1\t/b/fwd_sm80_hdim64_bf16.cu.o\th\n")  # rebuilt: the latest entry counts
    times = bt.read_log(str(log))
    assert times == {"fwd_sm80_hdim64_bf16.cu": 60.0, "merge_fp32.cu": 30.0, "bwd_sm80_hdim64_bf16.cu": 90.0}
    text = bt.table(times)
    assert text.splitlines()[2].startswith("bwd_sm80_hdim64_bf16.cu")  # slowest first
    assert "3 units, 180 CPU-seconds" in text and "2 cores 1.5 min" in text and "32 cores 1.5 min" in text
    assert "over the 120 s budget" not in text
    assert bt.wall_time([100, 60, 50, 40], 2) == 140  # longest first: 100+40 | 60+50


def test_build_times_flags_heavy_units_and_missing_log(tmp_path, capsys):
    log = tmp_path / ".ninja_log"
    log.write_text("# ninja log v5\n0\t130000\t1\t/b/fwd.cu.o\th\n")
    assert "over the 120 s budget" in bt.table(bt.read_log(str(log)))
    assert bt.main([str(tmp_path / "none")]) == 1
    assert "no ninja log" in capsys.readouterr().err


def test_every_unit_of_the_grid_has_a_measured_cost():
    """The estimate of what is left and the heaviest-first order read UNIT_COST_S: a new kind of unit needs its
    measured cost there (else it is scheduled as an average unit)."""
    spec = importlib.util.spec_from_file_location("sinkattn_gen_for_costs", ROOT / "csrc" / "generate_kernels.py")
    gen = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = gen
    spec.loader.exec_module(gen)
    grid = gen.parse_grid({"SINKATTN_EMULATION": "1", "SINKATTN_CUDA_ARCHS": "80;90a"})
    kinds = {bp.unit_kind(u.name) for u in gen.translation_units(grid)} | {"build_info"}
    assert kinds <= set(bp.UNIT_COST_S), kinds - set(bp.UNIT_COST_S)
