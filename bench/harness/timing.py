"""Timing (the performance protocol of docs/DESIGN.md section 7, as below).

On CUDA: warm-up first (module load, autotuning, torch.compile and handle creation stay out of the
numbers), then many timed runs, each bracketed by its own pair of CUDA events, with the L2 cache
flushed before each run by writing a buffer larger than L2 (outside the events); the statistic is the
median, with the 10th/90th percentiles reported as the spread. Optionally the function is captured
in a CUDA graph and its replays are timed (launch gaps of small decode calls shrink; a function that
cannot be captured falls back to eager, and the result says which was timed).

On the CPU: time.perf_counter around each run, median of the runs. CPU numbers exercise the harness;
they are not performance claims.

Machine state (clocks, power limit, temperature, throttle reasons, driver) is read with nvidia-smi
when it is there; a missing nvidia-smi or field is recorded as missing, never guessed.
"""
from __future__ import annotations

import math
import shutil
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass

import torch


@dataclass
class Timing:
    median_ms: float
    p10_ms: float
    p90_ms: float
    min_ms: float
    reps: int
    warmup: int
    method: str  # "cuda-events", "cuda-events+graph", "perf_counter"
    l2_flush: bool

    def as_dict(self) -> dict:
        return asdict(self)


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    pos = (len(xs) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(times_ms: list[float], warmup: int, method: str, l2_flush: bool) -> Timing:
    if not times_ms:
        raise ValueError("bench.harness.timing: no timed runs")
    return Timing(median_ms=statistics.median(times_ms), p10_ms=_percentile(times_ms, 0.1),
                  p90_ms=_percentile(times_ms, 0.9), min_ms=min(times_ms), reps=len(times_ms), warmup=warmup,
                  method=method, l2_flush=l2_flush)


class L2Flusher:
    """Writes a buffer of at least twice the L2 size (and 256 MiB) so no input stays cached between runs."""

    def __init__(self, device: torch.device):
        props = torch.cuda.get_device_properties(device)
        l2 = int(getattr(props, "L2_cache_size", 0) or 0) or (64 << 20)
        self.nbytes = max(2 * l2, 256 << 20)
        self.buf = torch.empty(self.nbytes // 4, dtype=torch.int32, device=device)

    def __call__(self):
        self.buf.fill_(0x5A5A5A5A)


def _reps_for(est_ms: float, budget_ms: float, min_reps: int, max_reps: int) -> int:
    if est_ms <= 0:
        return max_reps
    return int(max(min_reps, min(max_reps, budget_ms // max(est_ms, 1e-6))))


def bench_cuda(fn, *, warmup_ms: float = 50.0, min_warmup: int = 3, budget_ms: float = 1000.0,
               min_reps: int = 5, max_reps: int = 200, flush_l2: bool = True, use_graph: bool = False,
               flusher: L2Flusher | None = None) -> Timing:
    """Median time of fn() on the current CUDA stream (fn's outputs are discarded)."""
    device = torch.device("cuda", torch.cuda.current_device())
    flush = (flusher or L2Flusher(device)) if flush_l2 else None
    # Warm-up: at least min_warmup calls and warmup_ms of device time.
    fn()  # first call: compilation, autotuning and module load, kept out of the estimate below
    torch.cuda.synchronize()
    n_warm = 0
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    while True:
        fn()
        n_warm += 1
        end.record()
        end.synchronize()
        spent = start.elapsed_time(end)
        if spent >= warmup_ms and (n_warm >= min_warmup or spent / n_warm > warmup_ms):
            break  # enough warm-up; one slow call (longer than warmup_ms) after the first is enough
        if n_warm >= 1000:
            break
    est = spent / n_warm
    method = "cuda-events"
    run = fn
    if use_graph:
        graph = _try_capture(fn)
        if graph is not None:
            run = graph.replay
            method = "cuda-events+graph"
            for _ in range(min_warmup):
                run()
            torch.cuda.synchronize()
    if est * min_reps > 3 * budget_ms:  # slow calls (the reference backend): fewer runs, at least 3
        min_reps = max(3, min(min_reps, int(3 * budget_ms // max(est, 1e-6))))
    reps = _reps_for(est + (0.05 if flush else 0.0), budget_ms, min_reps, max_reps)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends):
        if flush is not None:
            flush()
        s.record()
        run()
        e.record()
    torch.cuda.synchronize()
    times = [s.elapsed_time(e) for s, e in zip(starts, ends)]
    return summarize(times, n_warm + 1, method, flush is not None)


def _try_capture(fn):
    """A CUDA graph of fn(), or None when fn cannot be captured (host syncs, CPU work, ...)."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()  # capture needs one warm call on the capturing stream
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        torch.cuda.synchronize()
        return graph
    except Exception:  # noqa: BLE001 - any failure means "not capturable"; eager timing is used instead
        torch.cuda.synchronize()
        return None


def bench_cpu(fn, *, warmup: int = 1, budget_ms: float = 300.0, min_reps: int = 3,
              max_reps: int = 50) -> Timing:
    """Median wall time of fn() with time.perf_counter (no cache flush on the CPU).

    warmup=0 is for a caller that has already called fn (the first timed run then sizes the rest)."""
    times = []
    for _ in range(max(0, warmup - 1)):
        fn()
    t0 = time.perf_counter()
    fn()  # the last warm-up call (or, with warmup=0, the first timed run) sizes the number of runs
    est = (time.perf_counter() - t0) * 1e3
    if warmup <= 0:
        times.append(est)
    reps = _reps_for(est, budget_ms, min_reps, max_reps)
    while len(times) < reps:
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return summarize(times, max(0, warmup), "perf_counter", False)


def bench(fn, device: torch.device, **kw) -> Timing:
    if device.type == "cuda":
        return bench_cuda(fn, **{k: v for k, v in kw.items() if k in _CUDA_KW})
    return bench_cpu(fn, **{k: v for k, v in kw.items() if k in _CPU_KW})


_CUDA_KW = {"warmup_ms", "min_warmup", "budget_ms", "min_reps", "max_reps", "flush_l2", "use_graph", "flusher"}
_CPU_KW = {"warmup", "budget_ms", "min_reps", "max_reps"}


# ---------------------------------------------------------------------------------------------- machine state

SMI_FIELDS = ("name", "driver_version", "pstate", "clocks.sm", "clocks.mem", "clocks.max.sm", "clocks.max.mem",
              "power.draw", "power.limit", "enforced.power.limit", "temperature.gpu", "utilization.gpu",
              "memory.used", "memory.total", "clocks_event_reasons.active")


def _smi(fields, index: int) -> list[str] | None:
    try:
        r = subprocess.run(["nvidia-smi", f"--id={index}", f"--query-gpu={','.join(fields)}",
                            "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.SubprocessError):
        return None
    if r.returncode != 0:
        return None
    parts = [p.strip() for p in r.stdout.strip().splitlines()[0].split(",")] if r.stdout.strip() else []
    return parts if len(parts) == len(fields) else None


def gpu_state(index: int = 0) -> dict:
    """Clocks (MHz), power (W), temperature and throttle reasons read by nvidia-smi; {} without it.

    Read only: nothing here changes the card's settings."""
    if shutil.which("nvidia-smi") is None:
        return {"nvidia_smi": "not found"}
    vals = _smi(SMI_FIELDS, index)
    if vals is not None:
        return dict(zip(SMI_FIELDS, vals))
    out = {}
    for f in SMI_FIELDS:  # an older/newer driver may not know one field name; keep the ones it does
        v = _smi((f,), index)
        if v is None and f == "clocks_event_reasons.active":
            v = _smi(("clocks_throttle_reasons.active",), index)
        out[f] = v[0] if v else None
    return out


def sm_clock_mhz(index: int = 0) -> float | None:
    """The current SM clock, cheaply (NVML if importable, else nvidia-smi); None when unreadable."""
    try:
        import pynvml  # nvidia-ml-py

        if not getattr(sm_clock_mhz, "_init", False):
            pynvml.nvmlInit()
            sm_clock_mhz._init = True
        h = pynvml.nvmlDeviceGetHandleByIndex(index)
        return float(pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM))
    except Exception:  # noqa: BLE001 - NVML missing or refused: fall back to nvidia-smi
        pass
    if shutil.which("nvidia-smi") is None:
        return None
    v = _smi(("clocks.sm",), index)
    try:
        return float(v[0]) if v else None
    except ValueError:
        return None
