"""Test-only fake variants for the sweep runner (tests/test_sweep.py).

`BENCH_SWEEP_TEST_VARIANTS=sweep_fakes:<function>` makes `python -m bench.sweep` (and so bench/sweep/gpu_sweep.sh) run
the Variants <function> returns instead of the extension's (tests/ is on the sweep's sys.path). They are pure
Python, the float32 oracle rounded to bf16 (exactly the check's fp32 baseline, so they PASS), and need no kernel:
the hang and crash tests run on any build. Each call appends "<variant> <phase>" to $SWEEP_FAKE_CALLS when set,
so a test counts what a resumed run reran. The phase is told apart by the shape: every phase-1 case has
seqlen_q != 128, every CPU target shape (bench.sweep.runner.tiny) has 128.
"""
from __future__ import annotations

import os
import time

import torch

from bench.sweep.runner import Variant
from oracle import attention_oracle

ALL = frozenset({"sinks", "sink_tokens", "causal", "window", "softcap", "gqa"})


def _phase(q) -> str:
    return "time" if q.shape[1] == 128 else "check"


def _log(name: str, q) -> None:
    path = os.environ.get("SWEEP_FAKE_CALLS")
    if path:
        with open(path, "a") as f:
            f.write(f"{name} {_phase(q)}\n")


def correct(q, k, v, sinks, out, lse, *, mask):
    o, l = attention_oracle(q, k, v, sinks, softmax_scale=mask.scale, window_size=(mask.window_left, mask.window_right),
                            sink_tokens=mask.sink_tokens, softcap=mask.softcap, compute_dtype=torch.float32)
    out.copy_(o.to(out.dtype))
    lse.copy_(l)


def fake(name: str, hang_in: str | None = None, fault_in: str | None = None) -> Variant:
    """A correct hd64 bf16 variant; `hang_in` / `fault_in` ("check" or "time") make it hang (sleep) or raise
    CUDA's illegal-address error in that phase."""
    def run(q, k, v, sinks, out, lse, **mask):
        _log(name, q)
        if _phase(q) == hang_in:
            time.sleep(1e6)  # the watchdog ends the process; no Python-level interrupt is needed
        if _phase(q) == fault_in:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        correct(q, k, v, sinks, out, lse, **mask)
    return Variant(name, 64, "bf16", ALL, "fake-sweep", run)


def hang_in_check():
    """`python -m bench.sweep` test: the second of three hangs in phase 1."""
    return [fake("fake_a"), fake("fake_hang", hang_in="check"), fake("fake_b")]


def fault_then_hang_in_time():
    """gpu_sweep.sh test: a CUDA fault in phase 1 (exit 3), then a hang while timing the first shape."""
    return [fake("fake_a"), fake("fake_fault", fault_in="check"), fake("fake_slow", hang_in="time"),
            fake("fake_b")]
