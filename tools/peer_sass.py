#!/usr/bin/env python3
"""The peer comparison (tools/peer_compare.py: sinkattn's sm80-family hd128 bf16 kernels beside FlashAttention-2's,
instruction by instruction, no GPU) pointed at this tree.

The comparison names our kernels by mangled-name patterns and the source lines of run-time-disabled features by fixed
line numbers, both as the kernels stood when it was written; every change to the templates or files breaks them
(renaming the traits' template arguments to tile types did). This wrapper derives both from the tree: the
kernels from the tile tables (sm80/fwd_tiles.h, sm80/bwd_tiles.h: name, sizes, shared memory), the cold lines by
searching each file for the code they hold. Then it runs tools/peer_compare.py.

    bash tools/peer_build_sinkattn.sh   # after `make cutlass`: this tree's hd128 bf16 sm80 units, build flags
    bash tools/peer_build_fa2.sh        # FA2 2.8.3.post2 from its sdist (fetched at run time), 2-5 min per unit
    python3 tools/peer_sass.py [--lines 15] [--pairs fwd,bwd,fwd_causal] [--fwd-tile Hd128Rows] [--bwd-tile Hd128]
"""
from __future__ import annotations

import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Code that a dense, non-causal, unmasked bf16 run never executes, found by what it says (file, regex of its first
# line, lines after it that belong to it): peer_compare.py drops basic blocks attributed only to these lines from its
# "hot" loop count.
COLD = [
    # Interior tiles (key blocks of the forward, Q/dO tiles of the backward) load through load_tile; load_rows
    # and its zero-fill serve the tail tile, small pages and padded head dims only.
    ("sm80/row_loader.h", r"SA_DEVICE void load_rows\(", 15, "load_rows: tail tiles, small pages, padded head dims"),
    ("sm80/kv_loader.h", r"if \(pages\) \{", 4, "KvLoader::offset: the row loader's per-row offsets, paged K/V"),
    ("sm80/kv_loader.h", r"SA_DEVICE int page_of\(int j\)", 1, "KvLoader::page_of / slot_of: paged K/V"),
    ("sm80/fwd_kernel.h", r"if \(!warp_active\) \{", 3, "warps without real rows"),
    ("common/online_softmax.h", r"acc\(i\) = cap \* tanhf", 0, "softcap (forward)"),
    ("common/online_softmax.h", r"float const t = tanhf\(x \* tanh_in\)", 3, "softcap (backward)"),
    ("common/mask.h", r"SA_DEVICE void apply\(", 14, "TileMask::apply (masked blocks only)"),
    ("common/mask.h", r"SA_HOST_DEVICE bool visible\(int j\)", 0, "RowKeys::visible (masked blocks only)"),
    ("common/mask.h", r"SA_HOST_DEVICE RowKeys row_keys\(", 4, "TileMask::row_keys (masked blocks only)"),
    ("common/mask.h", r"SA_HOST_DEVICE bool visible\(int i, int j\)", 6, "MaskPolicy::visible"),
    ("common/mask.h", r"SA_HOST_DEVICE void visible_cols\(", 8, "TileMask::visible_cols (masked blocks only)"),
    ("common/mask.h", r"SA_HOST_DEVICE int query_of_row\(", 0, "query_of_row: r / group, branched around at group 1"),
    ("sm80/bwd_kernel.h", r"if \(p\.dq_semaphore\) \{", 2, "deterministic dQ turn: the test"),
    ("sm80/bwd_dq.h", r"SA_DEVICE DqTurn dq_turn\(", 4, "deterministic dQ turn"),
    ("sm80/bwd_dq.h", r"if \(t\.sem\) \{", 3, "deterministic dQ semaphore: the wait"),
    ("common/mask.h", r"SA_HOST_DEVICE int rank\(int n\)", 0, "BlockRange::rank: the deterministic dQ turn"),
    ("sm80/prims_gpu.cuh", r"void wait_until_equal\(", 6, "wait_until_equal / signal"),
]


def cold_lines() -> list[tuple[str, int, int]]:
    out = []
    for rel, pattern, after, what in COLD:
        lines = open(os.path.join(ROOT, "csrc", rel)).read().splitlines()
        hits = [i + 1 for i, line in enumerate(lines) if re.search(pattern, line)]
        if len(hits) != 1:
            sys.exit(f"peer_sass: {len(hits)} lines of csrc/{rel} match {pattern!r} ({what}); update COLD")
        out.append((rel, hits[0], hits[0] + after))
    out.append(("include/cute/algorithm/fill.hpp", 0, 1 << 30))  # zero-fill: only load_rows' tail vectors
    out.append(("include/device_atomic_functions.hpp", 0, 1 << 30))  # int atomics: only the dQ semaphore
    return out


def tiles(header: str, macro: str, fields: list[str]) -> dict[str, dict[str, int]]:
    text = open(os.path.join(ROOT, "csrc", "sm80", header)).read()
    out = {}
    for name, args in re.findall(rf"^{macro}\((\w+), ([\d, ]+)\);", text, re.M):
        out[name] = dict(zip(fields, map(int, args.split(","))))
    return out


def mangled(kind: str, name: str) -> str:
    traits, ns = ("9FwdTraits", "9fwd_tiles") if kind == "fwd" else ("9BwdTraits", "9bwd_tiles")
    # Softcap::kOff (the enum's 0): the kernel a run without softcap takes (common/online_softmax.h).
    return (rf"^_ZN8sinkattn4sm8010{kind}_kernelINS0_{traits}INS0_{ns}{len(name)}{name}EN7cutlass10bfloat16_tENS0_8GpuPrims"
            r"ELNS_7SoftcapE0E")


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)

    def take(flag, default):
        if flag in argv:
            i = argv.index(flag)
            value = argv[i + 1]
            del argv[i:i + 2]
            return value
        return default

    fwd_name, bwd_name = take("--fwd-tile", "Hd128Rows"), take("--bwd-tile", "Hd128")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import peer_compare as compare
    f = tiles("fwd_tiles.h", "SINKATTN_(?:FWD|PREFILL)_TILE", ["head_dim", "block_m", "block_n", "warps", "stages", "key_groups", "q_regs", "s_ahead", "branch_free_loads", "ctas_per_sm"])[fwd_name]
    b = tiles("bwd_tiles.h", "SINKATTN_BWD_TILE", ["head_dim", "block_m", "block_n", "warps_m", "warps_n", "stages"])[bwd_name]
    f.setdefault("stages", 2)
    f_smem = (f["block_m"] + 2 * f["stages"] * f["block_n"]) * f["head_dim"] * 2
    b_smem = (b["stages"] * 2 * b["block_m"] * b["head_dim"] + 2 * b["block_n"] * b["head_dim"]
              + 2 * b["block_m"] * b["block_n"]) * 2
    f_what = f"{f['block_m']}x{f['block_n']}, {f['warps']} warps, {f['stages']} K/V stages ({fwd_name})"
    b_what = (f"N tile {b['block_n']} keys, M tile {b['block_m']}, {b['warps_m']}x{b['warps_n']} warps, "
              f"{b['stages']} Q/dO stages ({bwd_name})")
    ours = {"fwd": ("sinkattn", "sink_fwd", mangled("fwd", fwd_name), f_smem, 32 * f["warps"], f_what),
            "bwd": ("sinkattn", "sink_bwd", mangled("bwd", bwd_name), b_smem, 32 * b["warps_m"] * b["warps_n"], b_what)}
    ours["fwd_causal"] = ours["fwd"][:5] + ("same kernel (causal is a run-time flag)",)
    for pair, specs in compare.KERNELS.items():
        compare.KERNELS[pair] = [ours[pair] if s[0] == "sinkattn" else s for s in specs]
    compare.COLD_LINES = cold_lines()
    sys.argv = [sys.argv[0]] + argv
    compare.main()


if __name__ == "__main__":
    main()
