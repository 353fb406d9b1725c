"""Progress of the long build steps, in a form that survives pip's output capture.

pip runs setup.py with its output captured and prints only "Building editable ... still running..." for
the twenty minutes a 2-core machine spends on the kernels. Two pieces fix that:

- `run_ninja(...)` (called by setup.py) runs the kernel build and prints, per unit, "[n/N] done X in T"
  and, every TICK_S seconds while nothing finishes, which units are compiling, for how long, the
  elapsed time and an estimate of what is left; at the end one summary line (units, wall time, ccache
  hits). The lines go to stdout and, when stdout is not a terminal (pip's capture), also to the
  controlling terminal (/dev/tty) where there is one. SINKATTN_PROGRESS_TTY=0 turns the terminal copy
  off (the wrapper below sets it, since it shows stdout itself).
- `python tools/build_progress.py run --name NAME --log FILE [--show REGEX] -- CMD...` (used by the
  Makefile for pip) runs CMD, writes all its output to FILE, shows the lines matching REGEX (all lines
  without it), prints a heartbeat with the elapsed time whenever nothing was shown for HEARTBEAT_S
  seconds, and on failure prints the tail of the log. Its exit status is CMD's.

No torch here: setup.py imports this before torch is needed, and the Makefile runs it with any Python.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import threading
import time

TICK_S = 20.0        # a line at least this often while units compile (the target is one per 30 s)
# Longer than TICK_S, so a wrapped kernel build (which ticks itself) gets no heartbeat between its ticks.
HEARTBEAT_S = float(os.environ.get("SINKATTN_HEARTBEAT_S", "25"))

# Expected seconds of one unit per kind, measured on the 2-core dev machine without ccache for the default grid
# (80;90a, 2026-12-01; `make build-times`): the front end dominates, so a narrower arch list costs about
# the same per unit (the *_softcap kinds: a clean clone's .ci/run, 2026-12-01; bwd_sm90: its first build, 2026-12-01,
# two kernels per unit, sm_90a only). Only the estimate of what is left
# uses them, rescaled by the pace of the finished units.
UNIT_COST_S = {"fwd_sm80": 40.0, "fwd_sm80_keys": 36.0, "fwd_sm80_softcap": 24.0, "bwd_sm80": 30.0,
               # fwd_sm90: the mean of CI's hd64 and hd256 units in a cold .ci/run at b99aece (2026-12-06)
               "bwd_sm80_small": 31.0, "bwd_sm80_softcap": 22.0, "fwd_sm90": 54.0, "bwd_sm90": 24.0,
               "merge": 4.0, "build_info": 2.0, "sweep_fwd_sm90": 16.0, "sweep_fwd_sm80": 25.0,
               # the FP8-cache decode units (2026-12-02: about the hd128 forward unit's time in the same build)
               "fwd_fp8_sm80": 40.0,
               # the emulated kernels, one translation unit per header and head dim (generate_kernels.py
               # PACK_NAME; the mean over CI's head dims in a cold clean-clone .ci/run, 2026-12-05, 3583a3e;
               # emu90_fwd at b99aece, 2026-12-06, after the sm90 forward's gather and FP8 decode: 59 / 65 / 69 s)
               "emu80_fwd": 81.0, "emu80_bwd": 42.0, "emu90_fwd": 64.0, "emu90_bwd": 31.0}
DEFAULT_COST_S = 30.0


def fmt_s(s: float) -> str:
    s = int(round(s))
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def unit_kind(name: str) -> str:
    """fwd_sm80_hdim64_bf16_keys -> fwd_sm80_keys; emu80_fwd_hdim64 -> emu80_fwd; merge_fp16 -> merge;
    build_info_cuda -> build_info."""
    stem = name.split(".")[0]
    base = re.sub(r"_hdim\d+(_(bf16|fp16))?", "", stem)
    if base.startswith("merge"):
        return "merge"
    if base.startswith("build_info"):
        return "build_info"
    if base.startswith("sweep_"):  # sweep_fwd_sm90_hdim128_bf16_m128n176s2 -> sweep_fwd_sm90
        return "_".join(base.split("_")[:3])
    return base


class _Out:
    """Writes progress lines to stdout and, under capture, to the terminal."""

    def __init__(self):
        self.tty = None
        if not sys.stdout.isatty() and os.environ.get("SINKATTN_PROGRESS_TTY", "1") != "0":
            try:
                self.tty = open("/dev/tty", "w")
            except OSError:
                self.tty = None
        self.lock = threading.Lock()

    def line(self, text: str) -> None:
        with self.lock:
            print(text, flush=True)
            if self.tty is not None:
                try:
                    self.tty.write(text + "\n")
                    self.tty.flush()
                except OSError:
                    self.tty = None


def _ccache_counts() -> tuple[int, int] | None:
    """(hits, misses) so far from `ccache --print-stats`, or None without ccache."""
    exe = shutil.which("ccache")
    if not exe:
        return None
    try:
        out = subprocess.run([exe, "--print-stats"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    stats = dict(line.split("\t", 1) for line in out.splitlines() if "\t" in line)
    try:
        hits = int(stats.get("direct_cache_hit", 0)) + int(stats.get("preprocessed_cache_hit", 0))
        return hits, int(stats.get("cache_miss", 0))
    except ValueError:
        return None


def planned_units(build_dir: str) -> list[str]:
    """The outputs ninja would build now (its dry run), as unit names (file stems)."""
    out = subprocess.run(["ninja", "-C", build_dir, "-n"], capture_output=True, text=True,
                         env={**os.environ, "NINJA_STATUS": "@@ "}).stdout
    return [line[3:].strip() for line in out.splitlines() if line.startswith("@@ ") and line[3:].strip()]


def run_ninja(build_dir: str, jobs: int) -> None:
    """Runs ninja in build_dir with progress lines; raises CalledProcessError when it fails.

    The ninja file's rules must set `description = <unit name>` and touch `$out.start` first: the
    start markers tell which units are compiling now.
    """
    out = _Out()
    todo = planned_units(build_dir)
    total = len(todo)
    if total == 0:
        out.line("sinkattn build: kernels up to date (nothing to compile)")
        return
    def expected(name: str) -> float:
        return UNIT_COST_S.get(unit_kind(name), DEFAULT_COST_S)

    t0 = time.time()
    cc0 = _ccache_counts()
    done: dict[str, float] = {}
    starts: dict[str, float] = {}
    state = {"last": t0, "scale": 1.0}
    lock = threading.Lock()

    def running() -> list[tuple[str, float]]:
        now = time.time()
        found = []
        for name in todo:
            if name in done:
                continue
            try:
                st = os.stat(os.path.join(build_dir, name + ".o.start")).st_mtime
            except OSError:
                continue
            if st >= t0 - 1:
                starts.setdefault(name, st)
                found.append((name, now - st))
        return found

    def left_s() -> float:
        # What is left, in CPU-seconds at the pace seen so far, spread over the jobs.
        rest = 0.0
        now = time.time()
        for name in todo:
            if name in done:
                continue
            exp = expected(name) * state["scale"]
            if name in starts:
                exp = max(exp - (now - starts[name]), 5.0)
            rest += exp
        return rest / max(1, jobs)

    def status(prefix: str) -> str:
        el = time.time() - t0
        return f"sinkattn build: [{len(done)}/{total}] {prefix}{fmt_s(el)} elapsed, about {fmt_s(left_s())} left"

    stop = threading.Event()

    def ticker():
        while not stop.wait(min(2.0, TICK_S / 2)):
            with lock:
                if time.time() - state["last"] < TICK_S:
                    continue
                now_running = running()
                what = ", ".join(f"{n} ({fmt_s(s)})" for n, s in now_running) or "starting"
                out.line(status("") + f"; compiling {what}")
                state["last"] = time.time()

    out.line(f"sinkattn build: {total} kernel units to compile with {jobs} jobs (about "
             f"{fmt_s(sum(map(expected, todo)) / max(1, jobs))} on a 2-core machine without ccache); "
             "a line at least every 30 s")
    tick = threading.Thread(target=ticker, daemon=True)
    tick.start()
    env = {**os.environ, "NINJA_STATUS": "@@sinkattn@@ "}
    proc = subprocess.Popen(["ninja", "-C", build_dir, "-j", str(jobs)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, bufsize=1)
    assert proc.stdout is not None
    slowest = ("", 0.0)
    for line in proc.stdout:
        line = line.rstrip("\n")
        if line.startswith("@@sinkattn@@ "):
            name = line[len("@@sinkattn@@ "):].strip()
            with lock:
                running()  # records start times of units that started and finished between ticks
                st = starts.get(name)
                took = time.time() - st if st else None
                done[name] = took or 0.0
                if took and took > slowest[1]:
                    slowest = (name, took)
                # Rescale the expected costs by the pace of the units finished so far (ccache hits included:
                # a build that hits the cache keeps hitting it, and the estimate should say so).
                fin = list(done.items())
                state["scale"] = max(0.01, sum(s for _, s in fin) / sum(expected(n) for n, _ in fin))
                out.line(status(f"done {name}" + (f" in {fmt_s(took)}" if took else "") + "; "))
                state["last"] = time.time()
        elif line.strip() and not line.startswith("ninja: Entering directory") and "no work to do" not in line:
            out.line(line)  # compiler warnings and errors pass through
    rc = proc.wait()
    stop.set()
    wall = time.time() - t0
    cc1 = _ccache_counts()
    cc = ""
    if os.environ.get("CCACHE_DISABLE", "") not in ("", "0", "false"):
        cc = ", ccache disabled"
    elif cc0 and cc1:
        cc = f", ccache {cc1[0] - cc0[0]} hits / {cc1[1] - cc0[1]} misses"
    elif cc1 is None:
        cc = ", no ccache"
    if rc != 0:
        out.line(f"sinkattn build: FAILED after {fmt_s(wall)} ({len(done)} of {total} units done); the "
                 "compiler's message is above")
        raise subprocess.CalledProcessError(rc, "ninja")
    out.line(f"sinkattn build: {total} kernel units in {fmt_s(wall)} wall with {jobs} jobs{cc}; slowest "
             f"{slowest[0]} {fmt_s(slowest[1])} (`make build-times` lists every unit)")


def run_with_heartbeat(name: str, log: str, show: str | None, cmd: list[str]) -> int:
    """Runs cmd, logging everything, showing matching lines, and a heartbeat when quiet."""
    os.makedirs(os.path.dirname(os.path.abspath(log)), exist_ok=True)
    pattern = re.compile(show) if show else None
    t0 = time.time()
    state = {"shown": t0, "last": ""}
    lock = threading.Lock()
    stop = threading.Event()

    def heartbeat():
        while not stop.wait(min(2.0, HEARTBEAT_S / 2)):
            with lock:
                if time.time() - state["shown"] >= HEARTBEAT_S:
                    last = state["last"][:100]
                    print(f"{name}: still running, {fmt_s(time.time() - t0)} elapsed"
                          + (f" (last output: {last})" if last else ""), flush=True)
                    state["shown"] = time.time()

    print(f"{name}: {' '.join(cmd)}  (full log: {log})", flush=True)
    env = {**os.environ, "SINKATTN_PROGRESS_TTY": "0", "PYTHONUNBUFFERED": "1"}
    hb = threading.Thread(target=heartbeat, daemon=True)
    hb.start()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                bufsize=1)
        assert proc.stdout is not None
        for line in proc.stdout:
            f.write(line)
            f.flush()
            line = line.rstrip("\n")
            with lock:
                if line.strip():
                    state["last"] = line.strip()
                if pattern is None or pattern.search(line):
                    print(line, flush=True)
                    state["shown"] = time.time()
        rc = proc.wait()
    stop.set()
    if rc != 0:
        with open(log) as f:
            tail = f.readlines()[-60:]
        print(f"{name}: FAILED (exit {rc}) after {fmt_s(time.time() - t0)}; the last lines of {log}:", flush=True)
        sys.stdout.write("".join(tail))
    else:
        print(f"{name}: done in {fmt_s(time.time() - t0)}", flush=True)
    return rc


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run a command with a heartbeat, its full output in a log")
    r.add_argument("--name", required=True)
    r.add_argument("--log", required=True)
    r.add_argument("--show", default=None, help="show only lines matching this regex (default: all)")
    r.add_argument("command", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        ap.error("run needs a command after --")
    return run_with_heartbeat(args.name, args.log, args.show, cmd)


if __name__ == "__main__":
    sys.exit(main())
