"""Prediction beside measurement: run after the bench of `make gpu-check` (bench/gpu/check.sh).

    python bench/gpu/predict_check.py --out DIR [--so PATH] [--device a100|h200]

Reads DIR/results.csv (bench/harness/run.py ROW_FIELDS) and DIR/env.json (the device's name), runs tools/perf_model.py
through tools/perf_predict.py on the installed extension's SASS (cuobjdump from the triton wheel), and prints one line
per measured sinkattn row it can predict: predicted | measured | ratio (measured / predicted). Rows: the
`sinkattn-sm80` comparator (the sm80 kernels) and the `sinkattn` comparator on the family its `backend` column names.
With line counts of the emulated kernels (counts_dir: `make gpu-prebuilt` packs them) a second table costs the sm80
prefill and backward rows by the `profile` rule, the one bench/RESULTS.md's sm80 predictions use, and a third the
same rows with the relative phases of two CTAs' warps averaged (perf_model.PHASES), which the GPU's figures decide.

It never fails the round: on any error it prints why and exits 0 (the GPU's time is for the measurements; the model
is checked by reading this table).
"""
from __future__ import annotations

import argparse
import csv
import glob
import json
import os
import sys
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "tools"))
sys.path.insert(0, REPO)

FAMILY_OF = {"sinkattn-sm80": "sm80"}  # comparator -> kernel family; "sinkattn": its backend column


def measured_rows(csv_path: str) -> list[dict]:
    """The ok rows of sinkattn's own columns, each with its family and measured value (TFLOP/s or GB/s)."""
    out = []
    with open(csv_path, newline="") as f:
        for r in csv.DictReader(f):
            comp = r.get("comparator", "")
            if comp not in ("sinkattn", "sinkattn-sm80") or r.get("status", "ok") != "ok":
                continue
            fam = FAMILY_OF.get(comp) or r.get("backend", "")
            if fam not in ("sm80", "sm90"):
                continue
            unit = "GB/s" if r.get("kind") == "decode" else "TFLOP/s"
            val = r.get("gbps") if unit == "GB/s" else r.get("tflops")
            try:
                val = float(val)
            except (TypeError, ValueError):
                continue
            case = {k: r.get(k) for k in ("kind", "mode", "batch", "seqlen_q", "seqlen_k", "nheads", "nheads_k",
                                          "headdim", "window_left", "window_right", "sink_tokens", "paged",
                                          "page_size", "variant", "id")}
            case["causal"] = str(r.get("causal")).lower() in ("true", "1")
            case["kv_dtype"] = "fp8" if "fp8" in (r.get("variant") or "") else "auto"
            if r.get("dtype") not in (None, "", "bf16"):
                continue  # the model's kernels are found by bf16 names
            out.append({"case": case, "family": fam, "comparator": comp, "measured": val, "unit": unit})
    return out


def device_of(out_dir: str) -> str:
    """a100 or h200 from env.json's device name (the model's tables); h200 for any sm90 part."""
    try:
        env = json.load(open(os.path.join(out_dir, "env.json")))
        name = json.dumps(env.get("device", env)).upper()
    except (OSError, ValueError):
        name = ""
    return "a100" if "A100" in name else "h200"


def table(rows: list[dict], predict) -> list[dict]:
    """predict(case, family) -> {value, unit, ...} or {error}; one line per row: the figures and the ratio."""
    lines = []
    for r in rows:
        try:
            p = predict(r["case"], r["family"])
        except Exception as e:  # noqa: BLE001  (one row's failure is reported on its line)
            p = {"error": f"{type(e).__name__}: {e}"}
        line = {"id": r["case"].get("id") or r["case"].get("variant"), "comparator": r["comparator"],
                "family": r["family"], "measured": r["measured"], "unit": r["unit"]}
        if "error" in p or not p.get("value"):
            line.update(predicted=None, ratio=None, why=p.get("error", "no prediction"))
        else:
            line.update(predicted=p["value"], ratio=r["measured"] / p["value"], why=p.get("note", ""))
        lines.append(line)
    return lines


def render(lines: list[dict], model_commit: str, device: str) -> str:
    out = [f"prediction vs measurement (tools/perf_model.py at {model_commit}, device table {device}); "
           "ratio = measured / predicted",
           "| case | comparator | kernel family | predicted | measured | unit | ratio | note |",
           "|---|---|---|---|---|---|---|---|"]
    for ln in lines:
        pred = f"{ln['predicted']:.3g}" if ln["predicted"] else "-"
        ratio = f"{ln['ratio']:.2f}" if ln["ratio"] else "-"
        out.append(f"| {ln['id']} | {ln['comparator']} | {ln['family']} | {pred} | {ln['measured']:.3g} | "
                   f"{ln['unit']} | {ratio} | {ln['why']} |")
    return "\n".join(out)


def counts_dir() -> str | None:
    """Line counts of this checkout's emulated forward (tools/perf_counts.sh): packed by `make gpu-prebuilt` into
    .prebuilt/perf_counts, or made here into build/perf_counts; None without either."""
    for d in (os.path.join(REPO, ".prebuilt", "perf_counts"), os.path.join(REPO, "build", "perf_counts")):
        if glob.glob(os.path.join(d, "cov_hd*.json")):
            return d
    return None


def model_commit() -> str:
    import subprocess
    try:
        return subprocess.run(["git", "-C", REPO, "log", "-1", "--format=%h", "--", "tools/perf_model.py"],
                              capture_output=True, text=True, timeout=10).stdout.strip() or "unknown"
    except Exception:  # noqa: BLE001
        return "unknown"


def run(out_dir: str, so: str | None, device: str | None) -> None:
    csv_path = os.path.join(out_dir, "results.csv")
    if not os.path.isfile(csv_path):
        print(f"predict-check: no {csv_path} (the bench wrote no results): nothing to compare")
        return
    rows = measured_rows(csv_path)
    if not rows:
        print("predict-check: no ok bf16 row of sinkattn's columns in results.csv: nothing to compare")
        return
    so = so or next(iter(sorted(glob.glob(os.path.join(REPO, "sinkattn", "_C*.so")))), None)
    if not so:
        print("predict-check: no built extension (sinkattn/_C*.so): the model has no SASS to read")
        return
    import perf_model as pm
    import perf_predict as pp
    dev = pm.DEVICES[device or device_of(out_dir)]
    ks = pp.Kernels(so, dev)
    commit = model_commit()

    def print_table(counts_dir=None):
        print(render(table(rows, lambda case, fam: pp.predict_case(ks, case, fam, counts_dir=counts_dir)),
                     commit, dev.name))

    # In phase first (whatever PERF_PHASES says), then averaged over PERF_PHASES starts (default 32: 4 sample the
    # swing with the offset coarsely, tools/perf_model.py ITERS; well under a second of simulation a kernel).
    saved = pm.PHASES
    try:
        pm.PHASES = 0
        print_table()
        counts = counts_dir()
        if counts:  # the same rows by the profile rule (the sm80 prefill forward and backward), as bench/RESULTS.md
            print(f"\nthe same rows by the emulated kernel's line counts ({counts}; --path profile):")
            print_table(counts)
            # The model keeps two CTAs' warps in the phase it starts them in; which one a GPU keeps is open
            # (docs/internals.md, "The warps' phase"): the same rows with the phases averaged, beside the above.
            pm.PHASES = saved or 32
            print(f"\nthe same, the phases of two CTAs' warps on a scheduler averaged (PERF_PHASES={pm.PHASES}, "
                  f"PERF_ITERS={pm.ITERS}):")
            print_table(counts)
    finally:
        pm.PHASES = saved

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="the gpu-check folder holding results.csv and env.json")
    ap.add_argument("--so", help="the extension to read (default: sinkattn/_C*.so of this checkout)")
    ap.add_argument("--device", choices=("a100", "h200"))
    try:
        a = ap.parse_args(argv)
        run(a.out, a.so, a.device)
    except SystemExit as e:  # sass.find_tool exits with how to get cuobjdump; argparse on bad arguments
        print(f"predict-check: not run ({e})")
    except BaseException as e:  # noqa: BLE001  (never fail the round)
        print(f"predict-check: not run ({type(e).__name__}: {e})")
        traceback.print_exc(limit=3, file=sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
