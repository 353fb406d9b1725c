"""Writing results: results.csv (every row), results.md (tables), env.json (machine, versions, clocks,
ceilings) and plots.png (one figure, one panel per case variant; needs matplotlib).

Everything is written into one folder. Four files at most, so a results folder stays within 8 files
together with the logs of `make gpu-check`.
"""
from __future__ import annotations

import csv
import json
import math
import os
from collections import OrderedDict

from .run import ROW_FIELDS

CPU_DISCLAIMER = ("Measured on a CPU through sinkattn's PyTorch reference backend: this exercises the harness "
                  "and is not a performance claim.")


def write_csv(rows: list[dict], path: str) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=ROW_FIELDS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: _csv_val(r.get(k)) for k in ROW_FIELDS})


def _csv_val(v):
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.6g}"
    return v


def read_csv(path: str) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _num(v) -> float | None:
    if v is None or v == "":
        return None
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(x) else x


def _fmt(v, digits=3) -> str:
    x = _num(v)
    if x is None:
        return ""
    if x == 0:
        return "0"
    if abs(x) >= 100:
        return f"{x:.0f}"
    return f"{x:.{digits}g}"


def _metric(row: dict) -> tuple[str, str]:
    """(column key, unit) of the headline metric: GB/s for decode (memory-bound), TFLOP/s otherwise."""
    return ("gbps", "GB/s") if row.get("kind") == "decode" else ("tflops", "TFLOP/s")


def _comparators(rows):
    return list(OrderedDict.fromkeys(r["comparator"] for r in rows))


def _cases(rows):
    out = OrderedDict()
    for r in rows:
        out.setdefault(r["id"], []).append(r)
    return out


def _cell(r: dict) -> str:
    if r.get("status") != "ok":
        st = r.get("status") or "?"
        return st
    key, _ = _metric(r)
    s = _fmt(r.get(key))
    sp = _num(r.get("sinkattn_speedup"))
    if r["comparator"] != "sinkattn" and sp is not None:
        s += f" ({sp:.2f}x)"
    if r.get("sink_handling") == "no sink":
        s += " [no sink]"
    return s


def markdown(rows: list[dict], env: dict) -> str:
    lines = ["# sinkattn benchmark results", ""]
    lines += _env_lines(env)
    lines += ["", "How to read: each case is one attention call. Per comparator the headline is TFLOP/s "
              "(FLOPs = 4 * batch * nheads * headdim * visible (query, key) pairs, x2.5 for backward) or, for "
              "decode, GB/s (fewest bytes: K and V of the visible keys once per KV head, plus q and out), from "
              "the median time. '(1.30x)' after a comparator's number is its time divided by sinkattn's on "
              "the same case: above 1, sinkattn is faster. '[no sink]': the comparator cannot add the "
              "learnable sink there (SDPA backward), so it did less than the same math. Status n/a: the "
              "comparator cannot do this case's math; see the details table for why.", ""]
    comps = _comparators(rows)
    cases = _cases(rows)
    by_grid = OrderedDict()
    for cid, rs in cases.items():
        by_grid.setdefault(rs[0]["grid"], []).append(rs)
    for grid, case_rows in by_grid.items():
        lines += [f"## {grid}", ""]
        lines.append("| case | batch | seqlen_q | seqlen_k | unit | " + " | ".join(comps) +
                     " | sinkattn backend | sinkattn % of matmul / copy ceiling |")
        lines.append("|" + "---|" * (5 + len(comps) + 2))
        for rs in case_rows:
            r0 = rs[0]
            _, unit = _metric(r0)
            byc = {r["comparator"]: r for r in rs}
            cells = [_cell(byc[c]) if c in byc else "" for c in comps]
            p = byc.get("sinkattn", {})
            frac = ""
            if p.get("status") == "ok":
                fm, fc = _num(p.get("frac_matmul_ceiling")), _num(p.get("frac_copy_ceiling"))
                frac = " / ".join("" if x is None else f"{100 * x:.1f}%" for x in (fm, fc))
            lines.append(f"| {r0['variant']} | {r0['batch']} | {r0['seqlen_q']} | {r0['seqlen_k']} | {unit} | "
                         + " | ".join(cells) + f" | {p.get('backend') or ''} | {frac} |")
        lines.append("")
    lines += ["## Details", "",
              "| case | comparator | backend | sink | status | median ms | p10-p90 ms | reps | TFLOP/s | GB/s | "
              "rel err vs sinkattn | reason / note |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        spread = ""
        if _num(r.get("p10_ms")) is not None:
            spread = f"{_fmt(r.get('p10_ms'))}-{_fmt(r.get('p90_ms'))}"
        why = "; ".join(x for x in (r.get("reason"), r.get("note")) if x)
        why = why.replace("|", "/")
        lines.append(f"| {r['id']} | {r['comparator']} | {r.get('backend') or ''} | {r.get('sink_handling') or ''} | "
                     f"{r.get('status')} | {_fmt(r.get('median_ms'), 4)} | {spread} | {r.get('reps') or ''} | "
                     f"{_fmt(r.get('tflops'))} | {_fmt(r.get('gbps'))} | {_fmt(r.get('rel_err_vs_sinkattn'), 2)} | "
                     f"{why} |")
    lines.append("")
    return "\n".join(lines)


def _env_lines(env: dict) -> list[str]:
    dev = env.get("device", {})
    ceil = env.get("ceilings", {})
    out = []
    if dev.get("type") != "cuda":
        out += [f"> {CPU_DISCLAIMER}", ""]
    out += [f"- date: {env.get('date')}",
            f"- device: {dev.get('name')} (cc {dev.get('capability')}, {dev.get('sm_count')} SMs, L2 "
            f"{dev.get('l2_bytes')} B)" if dev.get("type") == "cuda" else f"- device: CPU ({dev.get('name')})",
            f"- torch {env.get('torch')}, CUDA {env.get('torch_cuda')}, driver {env.get('driver')}, "
            f"sinkattn {env.get('sinkattn')} (git {env.get('git_commit')})",
            f"- grid: {env.get('grid')} (filter {env.get('filter')!r}), {env.get('n_cases')} cases, "
            f"{env.get('elapsed_s', 0):.0f} s"]
    for when in ("gpu_state_before", "gpu_state_after"):
        st = env.get(when) or {}
        if st and "clocks.sm" in st:
            out.append(f"- {when.replace('_', ' ')}: SM {st.get('clocks.sm')} MHz (max {st.get('clocks.max.sm')}), "
                       f"mem {st.get('clocks.mem')} MHz, power {st.get('power.draw')} W of limit "
                       f"{st.get('power.limit')} W, {st.get('temperature.gpu')} C, pstate {st.get('pstate')}, "
                       f"throttle reasons {st.get('clocks_event_reasons.active')}")
    if ceil:
        out.append(f"- ceilings measured in this run: copy {_fmt(ceil.get('copy_GBps'))} GB/s (read + write), "
                   f"{ceil.get('matmul_dtype', '').replace('torch.', '')} matmul n={ceil.get('matmul_n')} "
                   f"{_fmt(ceil.get('matmul_TFLOPs'))} TFLOP/s")
    return out


def plot(rows: list[dict], path: str, env: dict | None = None) -> str | None:
    """One PNG: a panel per variant (decode: per variant and batch), the headline metric against seqlen_k
    for each comparator, the measured ceiling dashed. None (and nothing written) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    ok = [r for r in rows if r.get("status") == "ok"]
    panels = OrderedDict()
    for r in ok:
        key = f"{r['grid']}: {r['variant']}" + (f" b{r['batch']}" if r.get("kind") == "decode" else "")
        panels.setdefault(key, []).append(r)
    if not panels:
        return None
    n = len(panels)
    cols = min(4, n)
    nrows = math.ceil(n / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.6 * cols, 3.4 * nrows), squeeze=False)
    ceil = (env or {}).get("ceilings", {})
    cpu = (env or {}).get("device", {}).get("type") != "cuda"
    for ax, (title, rs) in zip(axes.flat, panels.items()):
        key, unit = _metric(rs[0])
        for comp in _comparators(rs):
            pts = sorted((int(r["seqlen_k"]), _num(r[key])) for r in rs if r["comparator"] == comp)
            pts = [(x, y) for x, y in pts if y is not None]
            if pts:
                nosink = any(r.get("sink_handling") == "no sink" for r in rs if r["comparator"] == comp)
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3,
                        label=comp + (" (no sink)" if nosink else ""))
        c = _num(ceil.get("copy_GBps" if key == "gbps" else "matmul_TFLOPs"))
        top = max((_num(r[key]) or 0) for r in rs)
        if c and c <= 1.5 * top:
            ax.axhline(c, ls="--", lw=0.8, color="gray", label="measured ceiling")
        elif c:  # far above the data (CPU runs): say it rather than squash the curves
            title += f"\n(measured ceiling {_fmt(c)} {unit}, off the scale)"
        ax.set_ylim(bottom=0)
        ax.set_xscale("log", base=2)
        ax.set_title(title, fontsize=7)
        ax.set_xlabel("seqlen_k", fontsize=7)
        ax.set_ylabel(unit, fontsize=7)
        ax.tick_params(labelsize=6)
        ax.legend(fontsize=5)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    if cpu:
        fig.suptitle("CPU run (reference backend): harness check, not a performance claim", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_all(rows: list[dict], env: dict, out_dir: str, plots: bool = True) -> dict:
    os.makedirs(out_dir, exist_ok=True)
    paths = {"csv": os.path.join(out_dir, "results.csv"), "md": os.path.join(out_dir, "results.md"),
             "env": os.path.join(out_dir, "env.json")}
    write_csv(rows, paths["csv"])
    with open(paths["md"], "w") as f:
        f.write(markdown(rows, env))
    with open(paths["env"], "w") as f:
        json.dump(env, f, indent=2, default=str)
    if plots:
        p = plot(rows, os.path.join(out_dir, "plots.png"), env)
        if p:
            paths["png"] = p
    return paths


def summary_table(rows: list[dict], width: int = 130) -> str:
    """A short fixed-width table for the end of the console output."""
    out = [f"{'case':<64} {'comparator':<14} {'status':<8} {'ms':>9} {'metric':>17} {'speedup':>8}"]
    for r in rows:
        key, unit = _metric(r)
        m = _num(r.get(key))
        sp = _num(r.get("sinkattn_speedup"))
        out.append(f"{r['id'][-64:]:<64} {r['comparator']:<14} {r.get('status', ''):<8} "
                   f"{_fmt(r.get('median_ms'), 4):>9} {('' if m is None else _fmt(m) + ' ' + unit):>17} "
                   f"{'' if sp is None else f'{sp:.2f}x':>8}")
    return "\n".join(line[:width] for line in out)
