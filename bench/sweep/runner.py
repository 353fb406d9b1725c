"""The tuning sweep of `make gpu-sweep`: one call on the GPU machine covers a round of tuning.

    python -m bench.sweep [--filter SUBSTR] [--headdims 64,128] [--out DIR] [--deadline-s 540]
                          [--budget-ms MS] [--max-reps N] [--watchdog-s S] [--cpu] [--list]

Variants are the extra forward kernels the generator compiles into the extension when asked for a tuning grid
(registry families "sm90-sweep", "sm80-sweep", and on the CPU their host twins "sm90-emulated-sweep" and
"sm80-emulated-sweep"); each runs through the normal bridge as backend "variant:<name>" and serves one head dim
and dtype. The defaults (the kernels "auto" runs today) run beside them as backends "sm90" / "sm80" (CUDA) or
"sm80-emulated" / "sm90-emulated" (CPU).

    phase 1  every variant and default on small cases at its head dim (CHECKS): fresh random inputs, outputs
             poisoned with NaN, out and lse against the float64 oracle (tests/oracle.py). A variant that fails
             docs/DESIGN.md's rule on a case is FAIL, with the case and the error, and is not timed. One that passes
             it but not the tighter fp32 baseline (check_case) is SUSPECT: timed and ranked, marked, and never
             named winner (the fp32 bound has been measured on the emulated kernels only, so a too-tight bound
             must not cost a lease its timings; a 1% error must not win a round either).
    phase 2  every passing variant and default on the target shapes of its head dim (TARGETS), TFLOP/s over
             visible pairs, beside torch SDPA (flash) where it does the same math.

Last, a ranked table per shape and one line per shape naming the winner and its margin over the default (the
kernel dispatch's "auto" picks for that shape). Into --out: results.csv, results.md, summary.txt (verdicts,
what did not run and why, the machine) and journal.jsonl.

A hung kernel (a wrong barrier count deadlocks it) leaves the process stuck in a CUDA call that Python cannot
interrupt. So every unit of work (a variant's checks; a (shape, variant) timing) runs under a watchdog
(faulthandler's, --watchdog-s: 30 s a check, 60 s a timing on CUDA), which prints the tracebacks and ends the
process, and goes into journal.jsonl as it ends (Journal). A run over the same --out resumes from it: what has a
result is not rerun, and the unit a killed process was in is FAIL (phase 1) or NOT RUN (phase 2), "hung or
crashed the process"; a variant that hung, crashed or faulted is not timed on later shapes. gpu_sweep.sh (here)
relaunches until the run ends normally.

Everything runs against one deadline (--deadline-s): what does not fit is NOT RUN with the reason. Exit status:
0 every variant was checked (FAILs are results), 1 the harness broke (faulthandler's watchdog also exits 1: the
journal then ends in a "start"), 2 the deadline cut the run (the files still hold what ran), 3 a kernel fault
lost the CUDA context (the faulting unit is FAIL in the journal; a new process resumes after it).

Test hook: BENCH_SWEEP_TEST_VARIANTS=module:function (tests/sweep_fakes.py) replaces discovery by the Variants
that function returns, for tests/test_sweep.py's runs of `python -m bench.sweep` and of gpu_sweep.sh on the CPU.

--cpu (automatic without CUDA): emulated variants, tiny shapes, time.perf_counter; it exercises the harness
and is not a performance claim.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import datetime
import faulthandler
import importlib
import json
import math
import os
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Callable

_STARTED = time.monotonic()  # before torch's import (seconds): the CLI's deadline counts the whole process

import torch  # noqa: E402

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/sweep/ -> the repo
sys.path.insert(0, _ROOT)
sys.path.insert(0, os.path.join(_ROOT, "tests"))  # the oracle lives with the tests (it imports pytest)

from oracle import attention_oracle, tolerance_check  # noqa: E402

from bench.harness import comparators, timing  # noqa: E402
from bench.harness import env as _env  # noqa: E402
from bench.harness.grids import Case  # noqa: E402
from bench.harness.run import _FATAL, _first_line  # noqa: E402

CPU_NOTE = ("CPU run: emulated kernels on tiny shapes timed with time.perf_counter (the wrap-around check is CUDA "
            "only); this exercises the harness and is not a performance claim.")
# On the CPU both families' twins run: each SWEEP_SM90 variant's host twin (an emulation build holds all of them)
# is checked against the oracle before any GPU round times its GPU build.
SWEEP_FAMILIES = {"cuda": ("sm90-sweep", "sm80-sweep"), "cpu": ("sm90-emulated-sweep", "sm80-emulated-sweep")}
DEFAULT_BACKENDS = {"cuda": ("sm90", "sm80"), "cpu": ("sm90-emulated", "sm80-emulated")}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _target(batch, seqlen, nheads, nheads_k, headdim, causal=False, window_left=-1, sink_tokens=0, sinks=False):
    return Case("sweep", "attn", "fwd", batch, seqlen, seqlen, nheads, nheads_k, headdim, "bf16", causal=causal,
                window_left=window_left, window_right=0 if causal else -1, sink_tokens=sink_tokens, sinks=sinks)


# The tuning targets: bf16, 16k tokens, nheads = 2048 / headdim unless the model says otherwise.
TARGETS = [
    ("hd64-full", _target(1, 16384, 32, 32, 64)),              # FA3 paper shape; target 520 TFLOP/s
    ("hd64-causal", _target(1, 16384, 32, 32, 64, causal=True)),   # target 470
    ("hd128-full", _target(1, 16384, 16, 16, 128)),            # target 680
    ("hd128-causal", _target(1, 16384, 16, 16, 128, causal=True)),  # target 620
    ("hd256-full", _target(1, 16384, 8, 8, 256)),              # target 720: needs a real hd256 tile
    ("hd256-causal", _target(1, 16384, 8, 8, 256, causal=True)),    # target 620
    # gpt-oss sliding layer: 64 q / 8 kv heads, window 128, learnable sinks; target 200 over visible pairs
    ("gptoss-sliding", _target(1, 16384, 64, 8, 64, causal=True, window_left=127, sinks=True)),
    # gpt-oss full-attention layer: same heads, causal, sinks; target 450
    ("gptoss-full", _target(1, 16384, 64, 8, 64, causal=True, sinks=True)),
    # StreamingLLM: Llama-like 32 q / 8 kv heads, window 1024 + 4 sink tokens; target 480
    ("streamingllm", _target(1, 16384, 32, 8, 128, causal=True, window_left=1023, sink_tokens=4)),
]


def tiny(case: Case) -> Case:
    """A target shrunk for the CPU run (the emulation runs one std::thread per CUDA thread): same mask kind."""
    return dataclasses.replace(case, seqlen_q=128, seqlen_k=128, nheads=2,
                               nheads_k=1 if case.nheads_k < case.nheads else 2,
                               window_left=min(case.window_left, 31))


@dataclass(frozen=True)
class Check:
    name: str
    batch: int
    seqlen_q: int
    seqlen_k: int
    nheads: int
    nheads_k: int
    causal: bool = False
    window: tuple = (-1, -1)
    sink_tokens: int = 0
    sinks: str = "none"        # "none", "randn", or "mixed": +30, -inf, then randn per head
    softcap: float = 0.0
    cuda_only: bool = False


# Small enough for the emulation on 2 cores (~10 s per hd64 variant), shaped to hit the tile edges.
CHECKS = [
    Check("odd-noncausal", 1, 77, 131, 2, 2),                           # partial M and N tiles, no sinks
    Check("causal-sq<sk", 2, 150, 230, 2, 2, causal=True, sinks="randn"),  # bottom-right diagonal
    # gpt-oss's window with StreamingLLM's sink tokens, a +30 and a -inf sink among the heads
    Check("window127-sinktok4-sinks", 1, 300, 300, 4, 4, causal=True, window=(127, 0), sink_tokens=4,
          sinks="mixed"),
    Check("gqa-4:1", 1, 129, 257, 8, 2, sinks="randn"),
    Check("seqlen_q-1", 2, 1, 300, 4, 4, causal=True, sinks="randn"),
    Check("softcap", 1, 100, 140, 2, 2, causal=True, softcap=15.0, sinks="randn"),
    # 2 x 16 heads x 9 M tiles of 128 rows > 132 SMs: the persistent kernels wrap around their grid
    Check("wrap-tiles>SMs", 2, 1100, 1100, 16, 16, causal=True, sinks="randn", cuda_only=True),
]


@dataclass
class Variant:
    name: str
    headdim: int
    dtype: str                     # registry name: "bf16", "fp16"
    features: frozenset
    family: str
    run: Callable                  # run(q, k, v, sinks, out, lse, *, softmax_scale, window_left, window_right,
                                   #     sink_tokens, softcap): writes out and lse in place
    backend: str | None = None     # a default kernel: the dispatch backend it is ("sm90", ...); None for a variant


@dataclass
class Verdict:
    status: str                    # "PASS", "SUSPECT", "FAIL", "NOT RUN"
    detail: str = ""
    checked: list = field(default_factory=list)
    skipped: list = field(default_factory=list)   # "case: why" for cases the variant does not serve
    incident: str = ""             # "hung" (it hung or crashed a process), "fault" (it lost the CUDA context)


class Clock:
    """One deadline for the whole run. A unit of work starts only when the longest unit of its kind so far (or
    `floor`) still fits, with a reserve for writing the files."""

    RESERVE_S = 2.0

    def __init__(self, deadline_s: float, started: float | None = None):
        self.t0 = time.monotonic() if started is None else started
        self.end = self.t0 + deadline_s
        self.longest: dict[str, float] = {}
        self.cut = False           # set once something was NOT RUN for lack of time
        self.lost: str | None = None   # set when a kernel fault lost the CUDA context: nothing more runs

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def fits(self, kind: str, floor: float) -> bool:
        ok = self.end - time.monotonic() > max(floor, self.longest.get(kind, 0.0)) + self.RESERVE_S
        self.cut |= not ok
        return ok

    def took(self, kind: str, seconds: float) -> None:
        self.longest[kind] = max(self.longest.get(kind, 0.0), seconds)


# ---------------------------------------------------------------------------------------------- journal, watchdog

JOURNAL = "journal.jsonl"
HOOK_ENV = "BENCH_SWEEP_TEST_VARIANTS"
WATCHDOG_S = {"cuda": {"check": 30.0, "time": 60.0}, "cpu": {"check": 600.0, "time": 300.0}}
INCIDENT = {"hung": "hung or crashed the process", "fault": "lost the CUDA context"}


class JournalMismatch(RuntimeError):
    """--out holds the journal of a run with other settings: resuming it would mix two runs."""


def hung_note(start: dict) -> str:
    s = start.get("watchdog_s") or 0
    if not s:
        return f"{INCIDENT['hung']} (no result; the watchdog was off)"
    return (f"{INCIDENT['hung']} (no result within the watchdog's {s:g} s"
            + (", cut to the deadline)" if start.get("cut") else ")"))


class Journal:
    """<out>/journal.jsonl, one JSON object a line, each flushed and fsynced as it is written: "run" (a process
    began, with its settings), "start" (a unit begins: phase "check" and the variant, or phase "time" and the row
    it fills, with its watchdog's seconds), "verdict" / "row" (the unit's result), "end" (the exit status). A
    process killed in a unit leaves that unit's "start" last. Opened again (same --out, same settings) it
    resumes: results are taken as recorded, and each "start" without a result becomes the result "hung or
    crashed the process" (written at once, so the next process sees a result)."""

    def __init__(self, path: str, config: dict):
        self.path = path
        self.verdicts: dict[str, Verdict] = {}
        self.rows: dict[tuple[str, str], dict] = {}
        self.processes = 0               # before this one
        records = []
        if os.path.exists(path):
            with open(path) as f:
                for line in f:
                    try:
                        records.append(json.loads(line))
                    except ValueError:
                        pass             # a line torn by the kill
        runs = [r for r in records if r.get("event") == "run"]
        if runs and runs[0].get("config") != config:
            raise JournalMismatch(f"{path} is from a run with {runs[0].get('config')}, this one has {config}: "
                                  "resume it with the same settings, or use another --out")
        self.processes = len(runs)
        pending = {}
        for r in records:
            if r.get("event") == "start":
                pending[(r["phase"], r["unit"])] = r
            elif r.get("event") == "verdict":
                pending.pop(("check", r["unit"]), None)
                self.verdicts[r["unit"]] = Verdict(**{f.name: r[f.name] for f in dataclasses.fields(Verdict)
                                                      if f.name in r})
            elif r.get("event") == "row":
                pending.pop(("time", r["unit"]), None)
                self.rows[(r["row"]["shape"], r["row"]["variant"])] = r["row"]
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        torn = False
        if os.path.exists(path) and os.path.getsize(path) > 0:
            with open(path, "rb") as f:
                f.seek(-1, os.SEEK_END)
                torn = f.read(1) != b"\n"
        self._f = open(path, "a")
        if torn:
            self._f.write("\n")  # the torn line stays unreadable; this process's lines start on their own
        self._write(event="run", config=config, pid=os.getpid(),
                    date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
        self.resolved = []               # the units the killed processes were in, as "phase unit"
        for (phase, unit), start in pending.items():
            self.resolved.append(f"{phase} {unit}")
            if phase == "check":
                self.verdict(unit, Verdict("FAIL", hung_note(start), incident="hung"))
            else:
                self.row(dict(start["row"], status="NOT RUN", note=hung_note(start), incident="hung"))

    def _write(self, **rec) -> None:
        self._f.write(json.dumps(rec, default=str) + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())

    @staticmethod
    def time_unit(row: dict) -> str:
        return f"{row['shape']} / {row['variant']}"

    def start(self, phase: str, unit: str, **kw) -> None:
        self._write(event="start", phase=phase, unit=unit, **kw)

    def verdict(self, name: str, v: Verdict) -> None:
        self.verdicts[name] = v
        self._write(event="verdict", unit=name, **dataclasses.asdict(v))

    def row(self, row: dict) -> None:
        self.rows[(row["shape"], row["variant"])] = dict(row)
        self._write(event="row", unit=self.time_unit(row), row=row)

    def end(self, status: int) -> None:
        self._write(event="end", status=status)
        self._f.close()


class Watchdog:
    """faulthandler.dump_traceback_later around each unit (seconds per phase, 0 = off). Its C thread fires while
    the main thread is stuck in a CUDA call holding the GIL: it prints every thread's traceback to stderr and
    ends the process (_exit(1)); the journal's last "start" names the unit. The limit is cut to the deadline
    (+ GRACE_S), so a unit hung near the end leaves time for a relaunch to write the files."""

    GRACE_S = 3.0

    def __init__(self, seconds: dict[str, float], clock: Clock):
        self.seconds, self.clock = seconds, clock

    def limit(self, phase: str) -> tuple[float, bool]:
        s = self.seconds.get(phase) or 0.0
        if s <= 0:
            return 0.0, False
        left = max(1.0, self.clock.end - time.monotonic() + self.GRACE_S)
        return (round(left, 1), True) if left < s else (s, False)


@contextlib.contextmanager
def _unit(journal: Journal | None, watchdog: Watchdog | None, phase: str, unit: str, **start):
    """One unit of work: its "start" in the journal, the watchdog armed while it runs (cancelled after it)."""
    s, cut = watchdog.limit(phase) if watchdog else (0.0, False)
    if journal:
        journal.start(phase, unit, watchdog_s=s, cut=cut, **start)
    if s:
        faulthandler.dump_traceback_later(s, exit=True, file=sys.__stderr__ or sys.stderr)
    try:
        yield
    finally:
        if s:
            faulthandler.cancel_dump_traceback_later()


# ---------------------------------------------------------------------------------------------- discovery

def _bridge(backend: str, max_smem: int = 0) -> Callable:
    from sinkattn import kernels

    def run(q, k, v, sinks, out, lse, **mask):
        kernels.launch_fwd(backend, q, k, v, sinks, out, lse, max_smem=max_smem, **mask)
    return run


def discover(device_type: str, headdims: list[int], name_filter: str | None) -> tuple[list[Variant], list[str]]:
    """The defaults and the sweep variants of this device kind, and a line for each one left out (and why)."""
    from sinkattn import _device, _ext, dispatch, registry

    if not _ext.loaded():
        raise RuntimeError(f"sinkattn's extension is not loaded: {_ext.IMPORT_ERROR}")
    target_dtypes = {c.dtype for _, c in TARGETS}
    cap = torch.cuda.get_device_capability() if device_type == "cuda" else None
    found, left_out = [], []
    for backend in DEFAULT_BACKENDS[device_type]:
        gap = dispatch._device_gap(backend, cap) if cap else None
        for hd in headdims:
            k = registry.find(registry.BACKEND_FAMILY[backend], "fwd", hd, "bf16")
            if k is None or gap:
                left_out.append(f"default {backend} hd{hd}: {gap or 'not in this build'}")
                continue
            found.append(Variant(k["name"], hd, "bf16", registry.features(k), k["family"],
                                 _bridge(backend, _device.sm80_max_smem(backend)), backend=backend))
    for k in _ext.registry():
        if k["family"] not in SWEEP_FAMILIES[device_type] or k["op"] != "fwd":
            continue
        why = None
        if name_filter and name_filter not in k["name"]:
            why = f"--filter {name_filter!r}"
        elif k["headdim"] not in headdims:
            why = f"head dim {k['headdim']} not in --headdims"
        elif k["dtype"] not in target_dtypes:
            why = f"dtype {k['dtype']}: the target shapes are {', '.join(sorted(target_dtypes))}"
        elif cap and registry.how_it_runs(k["archs"], cap) is None:
            why = f"compiled for {k['archs']}, which does not run on cc {cap[0]}.{cap[1]}"
        if why:
            left_out.append(f"{k['name']}: {why}")
            continue
        found.append(Variant(k["name"], k["headdim"], k["dtype"], registry.features(k), k["family"],
                             _bridge("variant:" + k["name"])))
    return found, left_out


def _problem(device_type, dtype, headdim, nheads, nheads_k, left, right, sink_tokens, softcap, has_sinks):
    from sinkattn._problem import Problem
    from sinkattn.mask import Mask

    return Problem(kind="fwd", device_type=device_type, dtype=dtype, headdim=headdim, nheads=nheads, nheads_k=nheads_k,
                   mask=Mask(scale=headdim ** -0.5, window_left=left, window_right=right, sink_tokens=sink_tokens,
                             softcap=softcap),
                   has_sinks=has_sinks, device_index=0 if device_type == "cuda" else None)


def why_not(v: Variant, problem) -> str | None:
    """None when `v` serves `problem`. A variant's registry features decide (no softcap feature, no softcap
    case); a default kernel is asked through dispatch, as "auto" would ask it."""
    from sinkattn import dispatch, registry

    if problem.headdim != v.headdim or registry.dtype_name(problem.dtype) != v.dtype:
        return f"serves hd{v.headdim} {v.dtype} only"
    missing = [f for f in registry.needed_features(problem) if f not in v.features]
    if missing:
        return "lacks " + ", ".join(missing)
    return dispatch.why_not(v.backend, problem) if v.backend else None


def default_backend(problem) -> str:
    """The kernel a user gets for this shape: dispatch's "auto" on CUDA; on the CPU (where auto means the
    reference backend) the emulated sm80 kernel."""
    from sinkattn import dispatch

    if problem.device_type != "cuda":
        return "sm80-emulated"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return dispatch.choose(problem, "auto")


def _fault(e: BaseException, who: str, clock: Clock) -> None:
    """A kernel fault poisons the CUDA context: nothing after it in this process can be trusted."""
    if any(f in str(e) for f in _FATAL):
        clock.lost = f"{who}: {_first_line(e)}"


# ---------------------------------------------------------------------------------------------- phase 1

def _sinks(kind: str, h: int, device) -> torch.Tensor | None:
    if kind == "none":
        return None
    s = torch.randn(h, device=device)
    if kind == "mixed":
        s[0], s[1 % h] = 30.0, -math.inf
    return s


class Suspect(AssertionError):
    """Within docs/DESIGN.md's bound, beyond the fp32 baseline's (check_case)."""


def check_case(v: Variant, c: Check, device: torch.device) -> None:
    """Runs `v` on `c` with fresh inputs and NaN-poisoned outputs; raises AssertionError naming the case and
    the error when out or lse is off.

    Two baselines, both with FlashAttention's rule max|got - ref| <= 2 max|baseline - ref| + atol:
    - docs/DESIGN.md section 6's: the same math in PyTorch at the input dtype (tests/kernel_cases.py's atols);
    - the float32 oracle, its out rounded to the input dtype. The kernels compute scores, softmax and lse in
      fp32 and round P and out; the bf16 baseline rounds the scores before exp, which makes its bound loose
      enough (about 5e-2 on these cases, the kernels' own error ~5e-3) to pass an output off by 1% or an lse
      off by 0.01. Measured on the emulated sm80 kernel (20 runs of these cases, hd 64/128/256): its error is at
      most 0.59 of the fp32 bound on out and 0.01 on lse (0.21 and 1e-5 of the bf16 ones). Not applied with
      softcap: with --use_fast_math the device's tanhf may be approximate."""
    from sinkattn.mask import Mask
    dt = DTYPES[v.dtype]
    b, sq, sk, h, hk, d = c.batch, c.seqlen_q, c.seqlen_k, c.nheads, c.nheads_k, v.headdim
    q = torch.randn(b, sq, h, d, device=device, dtype=dt)
    k = torch.randn(b, sk, hk, d, device=device, dtype=dt)
    vv = torch.randn(b, sk, hk, d, device=device, dtype=dt)
    sinks = _sinks(c.sinks, h, device)
    storage = torch.full((q.numel() + 256,), math.nan, dtype=dt, device=device)
    out, guard = storage[: q.numel()].view(q.shape), storage[q.numel():]
    lse = torch.full((b, h, sq), math.nan, device=device)
    left, right = c.window[0], 0 if c.causal else c.window[1]
    v.run(q, k, vv, sinks, out, lse, mask=Mask(1.0 / math.sqrt(d), left, right, c.sink_tokens, c.softcap))
    if not bool(torch.isnan(guard).all()):
        raise AssertionError(f"{c.name}: the kernel wrote past the end of out")
    kw = dict(causal=c.causal, window_size=c.window, sink_tokens=c.sink_tokens, softcap=c.softcap)
    ref_out, ref_lse = attention_oracle(q, k, vv, sinks, **kw)
    low_out, low_lse = attention_oracle(q, k, vv, sinks, compute_dtype=dt, **kw)
    tolerance_check(f"{c.name} out", out, ref_out, low_out, atol=1e-3)
    tolerance_check(f"{c.name} lse", lse, ref_lse, low_lse.float(), atol=1e-4)
    if c.softcap == 0:
        f32_out, f32_lse = attention_oracle(q, k, vv, sinks, compute_dtype=torch.float32, **kw)
        try:
            tolerance_check(f"{c.name} out (fp32 baseline)", out, ref_out, f32_out.to(dt), atol=1e-3)
            tolerance_check(f"{c.name} lse (fp32 baseline)", lse, ref_lse, f32_lse, atol=1e-4)
        except AssertionError as e:
            raise Suspect(str(e)) from None


def check(variants: list[Variant], device: torch.device, clock: Clock, log=print,
          checks: list[Check] = CHECKS, journal: Journal | None = None,
          watchdog: Watchdog | None = None) -> dict[str, Verdict]:
    """Phase 1: a verdict per variant. A variant stops at its first failing case. A verdict in `journal` is
    taken as it is; each new one goes into it."""
    verdicts = {}
    cases = [c for c in checks if device.type == "cuda" or not c.cuda_only]
    floor = 5.0 if device.type == "cuda" else 10.0
    for v in variants:
        if journal and v.name in journal.verdicts:
            verdicts[v.name] = journal.verdicts[v.name]
            log(f"sweep: check {v.name}: {verdicts[v.name].status} (journal)")
            continue
        if clock.lost:
            verdicts[v.name] = Verdict("NOT RUN", f"CUDA context lost earlier ({clock.lost})")
            continue
        if not clock.fits("check", floor):
            verdicts[v.name] = Verdict("NOT RUN", "deadline: no time left for its checks")
            log(f"sweep: check {v.name}: NOT RUN (deadline)")
            continue
        t0 = time.monotonic()
        verdict = Verdict("PASS")
        with _unit(journal, watchdog, "check", v.name):
            for c in cases:
                reason = why_not(v, _problem(device.type, DTYPES[v.dtype], v.headdim, c.nheads, c.nheads_k,
                                             c.window[0], 0 if c.causal else c.window[1], c.sink_tokens, c.softcap,
                                             c.sinks != "none"))
                if reason:
                    verdict.skipped.append(f"{c.name}: {reason}")
                    continue
                try:
                    check_case(v, c, device)
                    verdict.checked.append(c.name)
                except Suspect as e:  # the other cases still run: a hard FAIL among them wins
                    verdict.checked.append(c.name)
                    if verdict.status == "PASS":
                        verdict.status, verdict.detail = "SUSPECT", str(e)
                except AssertionError as e:
                    verdict.status, verdict.detail = "FAIL", str(e)
                except Exception as e:  # noqa: BLE001 - a variant that raises is a FAIL, not a broken harness
                    _fault(e, v.name, clock)
                    verdict.status, verdict.detail = "FAIL", f"{c.name}: {_first_line(e)}"
                    verdict.incident = "fault" if clock.lost else ""
                if verdict.status == "FAIL":
                    break
        if verdict.status in ("PASS", "SUSPECT") and not verdict.checked:
            verdict = Verdict("NOT RUN", "no check case fits its features", skipped=verdict.skipped)
        verdicts[v.name] = verdict
        if journal:
            journal.verdict(v.name, verdict)
        dt = time.monotonic() - t0
        clock.took("check", dt)
        log(f"sweep: check {v.name}: {verdict.status}"
            + (f" ({len(verdict.checked)} cases" + (f", {len(verdict.skipped)} not served" if verdict.skipped else "")
               + ")" if verdict.status == "PASS" else f": {verdict.detail}") + f" [{dt:.1f} s]")
    return verdicts


def timed_statuses() -> tuple[str, ...]:
    return ("PASS", "SUSPECT")


def _suspects(verdicts: dict[str, Verdict]) -> set[str]:
    return {n for n, v in verdicts.items() if v.status == "SUSPECT"}


def mark_suspects(rows: list[dict], verdicts: dict[str, Verdict]) -> list[dict]:
    """Rows of SUSPECT variants say so (tables mark them, winners skip them)."""
    sus = _suspects(verdicts)
    for r in rows:
        if r["variant"] in sus:
            r["suspect"] = True
    return rows


# ---------------------------------------------------------------------------------------------- phase 2

def _row(label, case, name, kind, **kw) -> dict:
    return dict(shape=label, headdim=case.headdim, variant=name, kind=kind, **kw)


def time_shapes(variants: list[Variant], verdicts: dict[str, Verdict], shapes: list[tuple[str, Case]],
                device: torch.device, clock: Clock, timing_kw: dict, log=print, rows: list | None = None,
                journal: Journal | None = None, watchdog: Watchdog | None = None) -> list[dict]:
    """Phase 2: one row per (shape, variant of its head dim) and one for SDPA: status "ok" (timed), "n/a"
    (does not serve the shape), "NOT RUN" (deadline, an error while timing, or it hung, crashed or faulted a
    process: then on later shapes too). Rows go into `rows` as they come, so a caller keeps them when something
    breaks. A row in `journal` is taken as it is; each timed one (or error) goes into it."""
    from sinkattn.mask import Mask
    rows = [] if rows is None else rows
    cuda = device.type == "cuda"
    floor = 1.5 * (timing_kw.get("budget_ms", 300) + 100) / 1e3 if cuda else 1.0
    kw = dict(timing_kw)
    if cuda and kw.get("flush_l2", True):
        kw["flusher"] = timing.L2Flusher(device)
    recorded = journal.rows if journal else {}
    # A variant that hung, crashed or faulted a process is not run again: on a lease, the same pipeline bug
    # would cost the watchdog's limit and a relaunch per shape.
    banned = {}
    for r in recorded.values():
        if r.get("incident"):
            banned.setdefault(r["variant"], f"not run: it {INCIDENT[r['incident']]} on {r['shape']}")
    for label, case in shapes:
        mine = [v for v in variants if v.headdim == case.headdim and v.dtype == case.dtype
                and verdicts.get(v.name, Verdict("NOT RUN")).status in timed_statuses()]
        if not mine:
            continue
        if clock.lost:
            for name in [v.name for v in mine] + ["sdpa-flash"]:
                if (label, name) in recorded:
                    rows.append(dict(recorded[(label, name)]))
                elif name != "sdpa-flash":
                    rows.append(_row(label, case, name, "variant", status="NOT RUN", is_default=False, flops=0,
                                     note=f"CUDA context lost earlier ({clock.lost})"))
            continue
        problem = _problem(device.type, case.torch_dtype, case.headdim, case.nheads, case.nheads_k,
                           case.window_left, case.window_right, case.sink_tokens, 0.0, case.sinks)
        default = default_backend(problem)
        flops = comparators.case_fwd_flops(case)
        mask = dict(mask=Mask(1.0 / math.sqrt(case.headdim), case.window_left, case.window_right, case.sink_tokens,
                              0.0))
        x = out = lse = None
        no_inputs = None
        # The defaults first: each variant's "x default" needs them; then SDPA, the anchor, then the variants.
        order = sorted(mine, key=lambda v: v.backend is None)
        units = [(v.name, "default" if v.backend else "variant", v) for v in order]
        units.insert(sum(1 for v in order if v.backend), ("sdpa-flash", "sdpa", None))
        for name, kind, v in units:
            base = _row(label, case, name, kind, family=v.family if v else "torch", flops=flops,
                        is_default=bool(v and v.backend == default))
            if v is not None:
                reason = why_not(v, problem)
                if reason:
                    rows.append(dict(base, status="n/a", note=reason))
                    continue
            if (label, name) in recorded:
                rows.append(dict(recorded[(label, name)]))
                log(f"sweep: time {label} {name}: {rows[-1]['status']} (journal)")
                continue
            if name in banned:
                rows.append(dict(base, status="NOT RUN", note=banned[name]))
                continue
            if clock.lost:
                rows.append(dict(base, status="NOT RUN", note=f"CUDA context lost earlier ({clock.lost})"))
                continue
            if not clock.fits("time", floor):
                rows.append(dict(base, status="NOT RUN", note="deadline"))
                continue
            if x is None and no_inputs is None:
                try:
                    x = comparators.make_inputs(case, device)
                    out = torch.empty_like(x.q)
                    lse = torch.empty(case.batch, case.nheads, case.seqlen_q, device=device)
                except Exception as e:  # noqa: BLE001 - e.g. out of memory: this shape's rows say so, the next may fit
                    _fault(e, f"{label} inputs", clock)
                    no_inputs = f"inputs: {_first_line(e)}"
            if no_inputs:
                rows.append(dict(base, status="NOT RUN", note=no_inputs))
                continue
            t0 = time.monotonic()
            with _unit(journal, watchdog, "time", Journal.time_unit(base), row=base):
                try:
                    if v is None:
                        fn = comparators.prep_sdpa(case, x, device).fn
                    else:
                        def fn(v=v):
                            v.run(x.q, x.k, x.v, x.sinks, out, lse, **mask)
                    t = timing.bench(fn, device, **kw)
                    row = dict(base, status="ok", median_ms=t.median_ms, p10_ms=t.p10_ms, p90_ms=t.p90_ms,
                               reps=t.reps, method=t.method, tflops=flops / (t.median_ms * 1e-3) / 1e12)
                    log(f"sweep: time {label} {name}: {row['tflops']:.4g} TFLOP/s, {t.median_ms:.4g} ms "
                        f"({t.reps} runs)")
                except comparators.Unsupported as e:
                    row = dict(base, status="n/a", note=str(e))
                except Exception as e:  # noqa: BLE001 - one failing timing must not stop the sweep
                    _fault(e, f"{label} / {name}", clock)
                    row = dict(base, status="NOT RUN", note=f"error while timing: {_first_line(e)}")
                    if clock.lost:
                        row["incident"] = "fault"
                    log(f"sweep: time {label} {name}: {row['note']}")
            rows.append(row)
            if journal:
                journal.row(row)
            clock.took("time", time.monotonic() - t0)
        del x, out, lse
        if cuda and not clock.lost:
            torch.cuda.empty_cache()
    return rank(mark_suspects(rows, verdicts))


def rank(rows: list[dict]) -> list[dict]:
    """Ranks the timed kernels of each shape by median time (SDPA is the anchor, not ranked) and adds
    x_default (default's time / this one's: > 1 is faster than the default) and x_sdpa likewise."""
    for label in dict.fromkeys(r["shape"] for r in rows):
        mine = [r for r in rows if r["shape"] == label]
        timed = sorted((r for r in mine if r["status"] == "ok" and r["kind"] != "sdpa"), key=lambda r: r["median_ms"])
        ref = {"x_default": next((r["median_ms"] for r in timed if r["is_default"]), None),
               "x_sdpa": next((r["median_ms"] for r in mine if r["status"] == "ok" and r["kind"] == "sdpa"), None)}
        for i, r in enumerate(timed, 1):
            r["rank"] = i
            for col, t in ref.items():
                r[col] = t / r["median_ms"] if t else None
    return rows


# ---------------------------------------------------------------------------------------------- reports

def _f(x, fmt) -> str:
    return "" if x is None else format(x, fmt)


def tables(rows: list[dict], shapes: list[tuple[str, Case]]) -> str:
    """The ranked table of each shape (markdown), with what was not served / not run under it."""
    out = []
    for label, case in shapes:
        mine = [r for r in rows if r["shape"] == label]
        if not mine:
            continue
        mask = case.mask_name + ("+sinks" if case.sinks else "")
        out.append(f"### {label}: b{case.batch} s{case.seqlen_q} h{case.nheads}/{case.nheads_k} hd{case.headdim} "
                   f"{mask}, {mine[0]['flops'] / 1e12:.4g} TFLOP per call")
        out.append("")
        ranked = sorted((r for r in mine if r.get("rank")), key=lambda r: r["rank"])
        if ranked:
            out.append("| rank | variant | TFLOP/s | median ms | x default | x SDPA |")
            out.append("|---:|---|---:|---:|---:|---:|")
        for r in ranked:
            name = r["variant"] + (" (default)" if r["is_default"] else "") + (" SUSPECT" if r.get("suspect") else "")
            out.append(f"| {r['rank']} | {name} | {r['tflops']:.4g} | {r['median_ms']:.4g} | "
                       f"{_f(r['x_default'], '.3g')} | {_f(r['x_sdpa'], '.3g')} |")
        for r in mine:
            if r["kind"] == "sdpa" and r["status"] == "ok":
                out.append(f"| - | sdpa-flash (anchor) | {r['tflops']:.4g} | {r['median_ms']:.4g} | | |" if ranked
                           else f"- sdpa-flash (anchor): {r['tflops']:.4g} TFLOP/s, {r['median_ms']:.4g} ms")
        out.append("")
        for r in mine:
            if r["status"] not in ("ok",):
                out.append(f"- {r['status']}: {r['variant']}: {r.get('note', '')}")
        out.append("")
    return "\n".join(out)


def winners(rows: list[dict], shapes: list[tuple[str, Case]]) -> list[str]:
    lines = []
    for label, _ in shapes:
        ranked = sorted((r for r in rows if r["shape"] == label and r.get("rank")), key=lambda r: r["rank"])
        # A SUSPECT variant is ranked but never the winner; a SUSPECT default still anchors "x default".
        ranked = [r for r in ranked if not r.get("suspect") or r["is_default"]]
        if not ranked:
            if any(r["shape"] == label for r in rows):
                lines.append(f"winner {label}: none, nothing was timed (see NOT RUN)")
            continue
        w, default = ranked[0], next((r for r in ranked if r["is_default"]), None)
        if default is None:
            margin = "the default was not timed"
        elif w is default:
            margin = "the default itself"
            if len(ranked) > 1:
                margin += f"; next {ranked[1]['variant']} at {ranked[1]['x_default']:.3f}x the default"
        else:
            margin = f"{w['x_default']:.3f}x the default {default['variant']} ({default['tflops']:.4g} TFLOP/s)"
        lines.append(f"winner {label}: {w['variant']} {w['tflops']:.4g} TFLOP/s, {margin}")
    return lines


CSV_FIELDS = ["shape", "headdim", "rank", "variant", "kind", "family", "is_default", "status", "suspect", "tflops",
              "median_ms", "p10_ms", "p90_ms", "reps", "method", "x_default", "x_sdpa", "flops", "note"]


def incidents(rows: list[dict], verdicts: dict[str, Verdict]) -> list[str]:
    """The units that hung, crashed or faulted a process (each cost the run a relaunch)."""
    return ([f"check {n}: " + ("lost the CUDA context: " if v.incident == "fault" else "") + v.detail
             for n, v in verdicts.items() if v.incident]
            + [f"time {r['shape']} / {r['variant']}: {r['note']}" for r in rows if r.get("incident")])


def write(out_dir: str, rows, verdicts, left_out, not_run, shapes, env, head: list[str], table_md: str,
          win: list[str], lost: list[str] | None = None) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, n) for n in ("results.csv", "results.md", "summary.txt")]
    with open(paths[0], "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{r[k]:.6g}" if isinstance(r.get(k), float) else r.get(k, "")) for k in CSV_FIELDS})
    with open(paths[1], "w") as f:
        f.write("# Tuning sweep\n\n" + "\n".join(f"> {h}" if h == CPU_NOTE else h for h in head) + "\n\n"
                + table_md + "\n" + "\n".join(f"- {x}" for x in win) + "\n")
    lines = head + ["", "## phase 1: checks against the float64 oracle"]
    for name, v in verdicts.items():
        lines.append(f"{v.status:7s} {name}" + (f": {v.detail}" if v.detail else "")
                     + (f" (checked: {', '.join(v.checked)})" if v.checked else ""))
        lines += [f"          not served: {s}" for s in v.skipped]
    lines += ["", "## hung, crashed or faulted a process (the run resumed after each from journal.jsonl)"]
    lines += lost or ["(nothing)"]
    lines += ["", "## NOT RUN"] + (not_run or ["(nothing)"])
    lines += ["", "## left out before the run"] + (left_out or ["(nothing)"])
    lines += ["", "## winners"] + win + ["", "## env", json.dumps(env, indent=1, default=str)]
    with open(paths[2], "w") as f:
        f.write("\n".join(lines) + "\n")
    return paths


# ---------------------------------------------------------------------------------------------- main

def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.sweep", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--filter", default=None, help="only the sweep variants whose name contains SUBSTR")
    p.add_argument("--headdims", default=None, help="comma list (default: every head dim of the targets)")
    p.add_argument("--out", default=None, help="results folder (default: $OUT, else bench/results/sweep-<time>)")
    p.add_argument("--deadline-s", type=float, default=540.0, help="the whole run ends before this (default 540)")
    p.add_argument("--budget-ms", type=float, default=None, help="timed time per measurement (300 GPU, 200 CPU)")
    p.add_argument("--max-reps", type=int, default=None, help="most timed runs per measurement (50 GPU, 3 CPU)")
    p.add_argument("--watchdog-s", type=float, default=None,
                   help="a unit with no result after this long ends the process, named in journal.jsonl "
                        "(default: 30 s a check, 60 s a timing on CUDA; 600 / 300 on the CPU; 0: off)")
    p.add_argument("--cpu", action="store_true", help="emulated variants on tiny shapes (automatic without CUDA)")
    p.add_argument("--list", action="store_true", help="print the variants, checks and shapes, run nothing")
    return p.parse_args(argv)


def _hooked_variants() -> list[Variant] | None:
    """Test-only: BENCH_SWEEP_TEST_VARIANTS=module:function replaces discovery by function()'s Variants."""
    spec = os.environ.get(HOOK_ENV)
    if not spec:
        return None
    module, _, fn = spec.partition(":")
    return list(getattr(importlib.import_module(module), fn)())


def main(argv=None, variants: list[Variant] | None = None, started: float | None = None) -> int:
    """`variants` replaces discovery (tests inject their own); the deadline counts from `started` (default: now)."""
    a = parse_args(argv)
    clock = Clock(a.deadline_s, started)
    cuda = torch.cuda.is_available() and not a.cpu
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    headdims = sorted({int(h) for h in a.headdims.split(",")} if a.headdims else {c.headdim for _, c in TARGETS})
    shapes = [(label, c if cuda else tiny(c)) for label, c in TARGETS if c.headdim in headdims]
    out_dir = a.out or os.environ.get("OUT") or os.path.join(
        _ROOT, "bench", "results", "sweep-" + datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))
    seed = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    threads = torch.get_num_threads()
    if not cuda:
        torch.set_num_threads(1)  # tiny tensors; the emulation brings its own threads
    timing_kw = ({"budget_ms": a.budget_ms or 300.0, "max_reps": a.max_reps or 50, "min_reps": min(5, a.max_reps or 5)}
                 if cuda else
                 {"budget_ms": a.budget_ms or 200.0, "max_reps": a.max_reps or 3, "min_reps": min(2, a.max_reps or 2)})
    limits = (WATCHDOG_S[device.type] if a.watchdog_s is None
              else {"check": a.watchdog_s, "time": a.watchdog_s})
    watchdog = Watchdog(limits, clock) if any(s > 0 for s in limits.values()) else None
    head = [f"sweep: {device.type}, head dims {headdims}, filter {a.filter!r}, deadline {a.deadline_s:g} s, "
            f"seed {seed}, timing {timing_kw}, watchdog "
            + (f"{limits['check']:g} s a check, {limits['time']:g} s a timing" if watchdog else "off")]
    head += [] if cuda else [CPU_NOTE]
    rows, verdicts, left_out, env, status, journal = [], {}, [], {}, 0, None
    try:
        if variants is None:
            variants = _hooked_variants()
            if variants is not None:
                left_out.append(f"test hook {HOOK_ENV}={os.environ[HOOK_ENV]}: its variants replace discovery")
        if variants is None:
            variants, left_out = discover(device.type, headdims, a.filter)
        else:
            variants = [v for v in variants if v.headdim in headdims and (v.backend or not a.filter
                                                                         or a.filter in v.name)]
        if a.list:
            print("\n".join([f"{v.name} ({v.family}, hd{v.headdim} {v.dtype}): {','.join(sorted(v.features))}"
                             for v in variants] + [f"left out: {x}" for x in left_out]
                            + [f"check: {c}" for c in CHECKS] + [f"shape: {s} {c.id}" for s, c in shapes]))
            return 0
        if not variants:
            raise RuntimeError("no default kernel and no sweep variant to run (see 'left out')")
        journal = Journal(os.path.join(out_dir, JOURNAL),
                          {"device": device.type, "headdims": headdims, "filter": a.filter})
        if journal.processes:
            head.append(f"sweep: resumed from {JOURNAL} after {journal.processes} process(es): "
                        f"{len(journal.verdicts)} verdicts and {len(journal.rows)} timing rows recorded"
                        + (f"; the last process stopped in: {', '.join(journal.resolved)}" if journal.resolved
                           else ""))
        for line in head:
            print(line, flush=True)
        print(f"sweep: {sum(v.backend is None for v in variants)} variants and "
              f"{sum(v.backend is not None for v in variants)} defaults -> {out_dir}", flush=True)
        env = _env.collect(device)
        log = lambda s: print(s, flush=True)  # noqa: E731
        verdicts = check(variants, device, clock, log=log, journal=journal, watchdog=watchdog)
        time_shapes(variants, verdicts, shapes, device, clock, timing_kw, log=log, rows=rows, journal=journal,
                    watchdog=watchdog)
    except JournalMismatch as e:  # --out holds another run: write nothing over it
        print(f"sweep: {e}", file=sys.stderr)
        return 1
    except Exception:  # noqa: BLE001 - the harness broke: say so, still write what there is
        status = 1
        left_out.append("harness error: " + traceback.format_exc().strip().splitlines()[-1])
        traceback.print_exc()
    finally:
        faulthandler.cancel_dump_traceback_later()
        torch.set_num_threads(threads)
        rank(rows)
    for v in variants or []:
        verdicts.setdefault(v.name, Verdict("NOT RUN", "the run stopped before its checks"))
    not_run = [f"{n}: {v.detail}" for n, v in verdicts.items() if v.status == "NOT RUN"]
    not_run += [f"{r['shape']} / {r['variant']}: {r['note']}" for r in rows if r["status"] == "NOT RUN"]
    if clock.lost:
        status = 3
        print(f"sweep: CUDA context lost ({clock.lost}); what came after it is NOT RUN here; a new process over "
              "the same --out resumes after it (exit 3)", file=sys.stderr)
    if status == 0 and clock.cut:
        status = 2
    env["elapsed_s"], env["exit_status"] = round(clock.elapsed(), 1), status
    if journal:
        env["processes"] = journal.processes + 1
    table_md, win, lost = tables(rows, shapes), winners(rows, shapes), incidents(rows, verdicts)
    paths = write(out_dir, rows, verdicts, left_out, not_run, shapes, env, head, table_md, win, lost)
    if journal:
        journal.end(status)
        paths.append(journal.path)
    if not_run:
        print("sweep: NOT RUN:\n  " + "\n  ".join(not_run))
    if lost:
        print("sweep: hung, crashed or faulted a process:\n  " + "\n  ".join(lost))
    print(f"sweep: wrote {', '.join(paths)} in {clock.elapsed():.1f} s, exit status {status}")
    print(table_md)
    print("\n".join(win) if win else "sweep: nothing was timed")
    return status


def cli() -> int:
    """`python -m bench.sweep` (bench/sweep/__main__.py): the deadline counts from this module's import."""
    faulthandler.enable()  # a segfault prints the Python traceback too (the journal names the unit)
    return main(started=_STARTED)
