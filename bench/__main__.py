"""python -m bench: run a benchmark grid and write results.csv, results.md, env.json and plots.png.

    python -m bench                                   # --grid auto: smoke on a CPU, all on a GPU
    python -m bench --grid smoke                      # CPU: seconds, through the reference backend (CI)
    python -m bench --grid replication --filter hd128 --out bench/results/today
    python -m bench --grid all                        # on a GPU: every grid (long)
    python -m bench --grid gptoss --list              # print the cases, run nothing

--filter takes substrings (comma-separated, all must match) of a case id such as
`gptoss/attn/fwd/hd64/h64kv8/win128/sinks/b16/sq1024/sk1024/bf16`; a leading '~' negates one.
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

import torch

from .harness import ceilings as _ceilings
from .harness import comparators as C
from .harness import env as _env
from .harness import grids, report, run, timing

GRID_CHOICES = ["auto", "smoke", "check", "replication", "gptoss", "streaming", "decode", "all"]


def select(cases: list, flt: str | None) -> list:
    if not flt:
        return cases
    terms = [t.strip() for t in flt.split(",") if t.strip()]

    def keep(c):
        for t in terms:
            neg = t.startswith("~")
            hit = t.lstrip("~") in c.id
            if hit == neg:
                return False
        return True
    return [c for c in cases if keep(c)]


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--grid", default="auto", choices=GRID_CHOICES,
                   help="auto: smoke without a GPU, all with one (hours: narrow it with --filter)")
    p.add_argument("--filter", default=None, help="comma-separated substrings of case ids (all must match; ~x negates)")
    p.add_argument("--out", default=None, help="results folder (default: $OUT if set, else bench/results/<timestamp>)")
    p.add_argument("--comparators", default=",".join(C.COMPARATORS),
                   help=f"comma-separated subset of {','.join(C.COMPARATORS)} (sinkattn is always run)")
    p.add_argument("--device", default="auto", help="'auto' (cuda if available), 'cpu' or 'cuda[:i]'")
    p.add_argument("--budget-ms", type=float, default=None,
                   help="time spent timing each (case, comparator), sizing the number of runs "
                        "(default 1000 on a GPU, 150 on the CPU)")
    p.add_argument("--min-reps", type=int, default=None, help="fewest timed runs (default 10 GPU, 3 CPU)")
    p.add_argument("--max-reps", type=int, default=None, help="most timed runs (default 200 GPU, 20 CPU)")
    p.add_argument("--no-l2-flush", action="store_true", help="do not flush L2 between timed runs")
    p.add_argument("--graph", default="auto", choices=["auto", "on", "off"],
                   help="time CUDA-graph replays: auto = decode cases only")
    p.add_argument("--no-ceilings", action="store_true", help="skip measuring the copy and matmul ceilings")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--time-limit", type=float, default=None,
                   help="seconds after which no new case is started (the rest is reported 'not run')")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: 1 on a CPU run, where the shapes are tiny and the cores "
                        "often shared; torch's default on a GPU run)")
    p.add_argument("--list", action="store_true", help="print the selected cases and exit")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--verbose-errors", action="store_true", help="print tracebacks of failing comparators")
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.device == "auto":
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    else:
        device = torch.device(a.device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", 0)
    if a.grid == "auto":
        a.grid = "all" if device.type == "cuda" else "smoke"
    cases = select(grids.get(a.grid), a.filter)
    if a.list:
        for c in cases:
            print(c.id)
        print(f"{len(cases)} cases", file=sys.stderr)
        return 0
    if not cases:
        print(f"bench: no case of grid {a.grid!r} matches filter {a.filter!r}", file=sys.stderr)
        return 2
    names = [n.strip() for n in a.comparators.split(",") if n.strip()]
    unknown = [n for n in names if n not in C.COMPARATORS]
    if unknown:
        print(f"bench: unknown comparator(s) {unknown}; known: {list(C.COMPARATORS)}", file=sys.stderr)
        return 2
    names = [C.PRIMARY] + [n for n in names if n != C.PRIMARY]
    if device.type == "cuda":
        torch.cuda.set_device(device)
    gpu = device.type == "cuda"
    threads = a.threads if a.threads is not None else (None if gpu else 1)
    if threads:
        torch.set_num_threads(threads)
    out = a.out or os.environ.get("OUT") or os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "results",
        datetime.datetime.now().strftime("%Y%m%d-%H%M%S") + f"-{a.grid}")
    timing_kw = {"budget_ms": a.budget_ms or (1000.0 if gpu else 150.0),
                 "min_reps": a.min_reps or (10 if gpu else 3),
                 "max_reps": a.max_reps or (200 if gpu else 20),
                 "flush_l2": not a.no_l2_flush}
    t0 = time.time()
    env = _env.collect(device)
    env.update(grid=a.grid, filter=a.filter, n_cases=len(cases), comparators=names, argv=sys.argv[1:],
               timing=timing_kw, graph=a.graph)
    print(f"bench: grid {a.grid}, {len(cases)} cases x {len(names)} comparators on {env['device'].get('name')} "
          f"-> {out}", flush=True)
    if not gpu:
        print(f"bench: {report.CPU_DISCLAIMER}", flush=True)
    if not a.no_ceilings:
        env["ceilings"] = _ceilings.measure(device)
        print(f"bench: ceilings: copy {env['ceilings']['copy_GBps']:.1f} GB/s, matmul "
              f"{env['ceilings']['matmul_TFLOPs']:.2f} TFLOP/s", flush=True)
    else:
        env["ceilings"] = {}
    rows = run.run_grid(cases, names, device, ceilings=env["ceilings"], timing_kw=timing_kw, graph=a.graph,
                        time_limit_s=a.time_limit, progress=not a.no_progress, verbose_errors=a.verbose_errors)
    if gpu:
        env["gpu_state_after"] = timing.gpu_state(device.index or 0)
    env["elapsed_s"] = time.time() - t0
    paths = report.write_all(rows, env, out, plots=not a.no_plots)
    print(report.summary_table(rows))
    print("bench: wrote " + ", ".join(paths.values()) + f" in {env['elapsed_s']:.1f} s")
    errors = [r for r in rows if r.get("status") == "error"]
    if errors:
        print(f"bench: {len(errors)} (case, comparator) pairs failed; see the details table", file=sys.stderr)
        for r in errors[:10]:
            print(f"  {r['id']} {r['comparator']}: {r.get('reason')}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
