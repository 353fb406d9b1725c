#!/usr/bin/env python3
"""Per-kernel evidence from a compiled extension, object or cubin, without a GPU.

For every kernel of every arch in the file: registers, static shared memory, stack and local memory (cuobjdump's
resource usage), and counts of the instructions that say whether a kernel runs on its fast path: HGMMA (wgmma),
HMMA (mma.sync), UTMALDG/UTMASTG (TMA), LDGSTS (cp.async), LDSM (ldmatrix), LDL/STL (local memory: spills or
dynamically indexed arrays), BAR, MUFU.EX2 and the other MUFU functions.

    python3 tools/sass_report.py sinkattn/_C*.so [--arch sm_90a] [--filter fwd] [--json] [--allow-local]

The disassemblers are found by tools/sass.py (PATH, $CUDA_HOME/bin, the triton wheel, the nvidia-cuda-* wheels;
it says how to get them when missing). Exit status 1 if any kernel touches local memory or keeps a stack frame
(unless --allow-local).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sass  # noqa: E402

COLS = ["reg", "shared", "stack", "local"] + sass.CLASSES


def rows(path: str, arch: str | None = None, name_filter: str = "") -> list[dict]:
    usage = sass.resources(path)
    code = sass.disassemble(path, arch)
    names = sass.demangle(sorted({f for _, f in usage} | {f for _, f in code}))
    out = []
    for key in sorted(set(usage) | set(code)):
        a, fn = key
        if (arch and a != arch) or name_filter not in names[fn]:
            continue
        u = usage.get(key, dict.fromkeys(["reg", "stack", "shared", "local"], 0))
        out.append({"arch": a, "kernel": names[fn], "mangled": fn, **u, **sass.class_counts(code.get(key, []))})
    return out


def flagged(r: dict) -> bool:
    """A kernel that touches local memory: a spill or a stack-resident array costs a round trip to L1/L2."""
    return bool(r["local"] or r["stack"] or r["LDL"] or r["STL"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="+", help=".so, .o or .cubin files")
    ap.add_argument("--arch", help="only this arch, e.g. sm_80 or sm_90a")
    ap.add_argument("--filter", default="", help="only kernels whose demangled name contains this")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--allow-local", action="store_true", help="do not fail on local memory / stack")
    args = ap.parse_args(argv)
    table = [r for p in args.paths for r in rows(p, args.arch, args.filter)]
    bad = [r for r in table if flagged(r)]
    if args.json:
        print(json.dumps(table, indent=1))
    else:
        print(f"{'arch':7} " + " ".join(f"{c[:8]:>8}" for c in COLS) + "  kernel")
        for r in table:
            k = r["kernel"] if len(r["kernel"]) < 160 else r["kernel"][:157] + "..."
            print(f"{r['arch']:7} " + " ".join(f"{r.get(c, 0):>8}" for c in COLS) + "  " + k)
        print(f"{len(table)} kernels, {len(bad)} with local memory or a stack frame")
    return 1 if bad and not args.allow_local else 0


if __name__ == "__main__":
    sys.exit(main())
