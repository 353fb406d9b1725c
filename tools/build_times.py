"""`make build-times`: the per-unit build-time table from ninja's log (build/kernels/.ninja_log).

Each unit's latest build, slowest first, with its share of the total, then the wall time the same units
would take on 2, 8 and 32 cores (longest-first scheduling, which is how setup.py orders the ninja file).
Times are what the last build measured: a unit served by ccache shows its cache-hit time, so read this
after a build without ccache (CCACHE_DISABLE=1) for the real cost.
"""
from __future__ import annotations

import argparse
import heapq
import os
import sys

LIMIT_S = 120.0  # the budget of one unit: a heavier one should be split (so a many-core build stays short)


def read_log(path: str) -> dict[str, float]:
    """Unit name -> seconds of its latest build (ninja log v5: start_ms end_ms mtime output hash)."""
    last: dict[str, tuple[int, float]] = {}
    with open(path) as f:
        for i, line in enumerate(f):
            parts = line.rstrip("\n").split("\t")
            if line.startswith("#") or len(parts) < 5:
                continue
            start, end, out = int(parts[0]), int(parts[1]), parts[3]
            name = os.path.basename(out)
            for suffix in (".o",):
                if name.endswith(suffix):
                    name = name[: -len(suffix)]
            last[name] = (i, (end - start) / 1000.0)
    return {k: v[1] for k, v in last.items()}


def wall_time(costs: list[float], cores: int) -> float:
    """Longest-processing-time-first schedule of the units on `cores` workers."""
    workers = [0.0] * max(1, cores)
    heapq.heapify(workers)
    for c in sorted(costs, reverse=True):
        heapq.heappush(workers, heapq.heappop(workers) + c)
    return max(workers)


def table(times: dict[str, float]) -> str:
    total = sum(times.values()) or 1.0
    rows = sorted(times.items(), key=lambda kv: -kv[1])
    width = max(len(n) for n in times)
    lines = [f"{'unit':<{width}}  {'seconds':>8}  {'share':>6}", "-" * (width + 18)]
    for name, s in rows:
        flag = "  <- over the 120 s budget of one unit" if s > LIMIT_S else ""
        lines.append(f"{name:<{width}}  {s:8.1f}  {100 * s / total:5.1f}%{flag}")
    lines.append("-" * (width + 18))
    lines.append(f"{len(times)} units, {total:.0f} CPU-seconds; wall time at " + ", ".join(
        f"{c} cores {wall_time(list(times.values()), c) / 60:.1f} min" for c in (2, 8, 32)))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("log", nargs="?", default=os.path.join("build", "kernels", ".ninja_log"))
    args = ap.parse_args(argv)
    if not os.path.isfile(args.log):
        print(f"build-times: no ninja log at {args.log}; build first (make install)", file=sys.stderr)
        return 1
    times = read_log(args.log)
    if not times:
        print(f"build-times: {args.log} lists no unit", file=sys.stderr)
        return 1
    print(table(times))
    return 0


if __name__ == "__main__":
    sys.exit(main())
