"""`python -m sinkattn.report` / `sinkattn-report`: the capability report for people (or --json)."""
from __future__ import annotations

import argparse
import json
import sys

from .capability import capabilities


def _kernel_table(kernels: list[dict]) -> list[str]:
    if not kernels:
        return ["  (none)"]
    groups: dict[tuple, list] = {}
    for k in kernels:
        groups.setdefault((k["family"], k["op"], k["archs"], k["features"]), []).append(
            f"{k['dtype']}" + (f"/hdim{k['headdim']}" if k["headdim"] else ""))
    rows = [("family", "op", "archs", "variants", "features")]
    rows += [(f, o, a, ", ".join(sorted(v)), feat) for (f, o, a, feat), v in sorted(groups.items())]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(r[:4], widths)) + "  " + r[4] for r in rows]


def render(cap: dict) -> str:
    b = cap["build"]
    lines = [f"sinkattn {cap['sinkattn_version']}  (python {cap['python']}, torch {cap['torch_version']}, "
             f"torch CUDA {cap['torch_cuda']})", ""]
    if cap["extension"]["loaded"]:
        lines += ["Build (read from the binary):",
                  f"  nvcc {b['nvcc_version']}, CUTLASS {b['cutlass_version']}, torch at build {b['torch_version_at_build']}",
                  f"  requested archs: {b['requested_archs']}"]
        if b.get("native_gpus"):
            lines.append(f"  built for the GPUs present (SINKATTN_CUDA_ARCHS=native): {b['native_gpus']}")
        if b.get("diagnostic"):
            lines.append("  DIAGNOSTIC build (SINKATTN_DIAGNOSTIC=1): every sm90 barrier wait is bounded and a hang "
                         "traps with who waited on what; slower, for a GPU round's first run only (rebuild without it)")
        if cap.get("wider_build"):
            lines.append("  a wider build (SINKATTN_CUDA_ARCHS) would add:")
            lines += [f"    {a}: {what}" for a, what in cap["wider_build"].items()]
    else:
        lines += [f"Build: no compiled extension ({cap['extension']['error']}).",
                  "  Every call is served by the PyTorch reference backend."]
    rt = cap["runtime"]
    lines += [f"Runtime now: CUDA runtime {rt['cuda_runtime'] or 'n/a'}, driver {rt['cuda_driver'] or 'none'}", "",
              "Compiled kernels:"] + _kernel_table(cap["kernels"]) + [""]
    smem_cap = cap.get("sm80_smem_cap")
    if smem_cap:
        lines += [f"sm80 shared-memory cap: {smem_cap['bytes'] / 1024:g} KB ({smem_cap['bytes']} bytes) per block, set by "
                  f"{smem_cap['set_by']}",
                  "  the sm80 kernels pick their tiles as on a device with that limit (cc 8.6/8.9 allow 99 KB) and are "
                  "declined where none fits", ""]
    if not cap["devices"]:
        # backend='sm80-emulated' is named only where the registry holds emulated kernels (SINKATTN_EMULATION=1)
        emulated = [f for f in ("sm80-emulated", "sm90-emulated") if any(k["family"] == f for k in cap["kernels"])]
        lines += ["GPUs: none visible. CPU tensors are served by the reference backend" +
                  (" (and " + " / ".join(f"backend='{f}'" for f in emulated) + " run" + ("s" if len(emulated) == 1 else "")
                   + " the " + " / ".join(f.split("-")[0] for f in emulated) + " kernel" + ("" if len(emulated) == 1 else "s")
                   + " under host emulation, for tests)." if emulated else ".")]
    for d in cap["devices"]:
        smem = f", {d['smem_per_block_optin'] // 1024} KB smem/block" if d["smem_per_block_optin"] else ""
        sms = f", {d['sm_count']} SMs" if d["sm_count"] else ""
        lines.append(f"GPU {d['index']}: {d['name']} (cc {d['capability']}{sms}{smem})")
        for feature, path in d["paths"].items():
            lines.append(f"  {feature:<16} -> {path['backend']}: {path.get('kernel', '')}")
            for backend, reason in path["declined"].items():
                lines.append(f"  {'':<16}    not {backend}: {reason}")
    if cap["mismatches"]:
        lines += ["", "Problems found:"]
        for m in cap["mismatches"]:
            lines += [f"  ! {m['problem']}", f"    fix: {m['fix']}"]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="sinkattn-report", description="sinkattn's compile-time capability report")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    cap = capabilities()
    print(json.dumps(cap, indent=2) if args.json else render(cap))
    return 0


if __name__ == "__main__":
    sys.exit(main())
