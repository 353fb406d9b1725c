#!/usr/bin/env python3
"""Side-by-side SASS comparison of sinkattn's sm80-family hd128 bf16 kernels and FlashAttention-2's.

Reads the objects built by tools/peer_build_sinkattn.sh / tools/peer_build_fa2.sh (out/*.o, one ELF per arch inside), extracts the
cubins with cuobjdump -xelf, disassembles them with nvdisasm -c -g (line info: both builds use -lineinfo),
picks one kernel per side by its mangled name, and prints:
  * resources: registers, stack, spill stores/loads (ptxas -v logs out/*.ptxas.log), dynamic shared memory
    (from the traits: it is not in the cubin), local memory;
  * whole-kernel instruction counts by class;
  * the main loop: the backward branch (BRA to a lower address) whose body holds the most HMMAs (the
    tightest such loop), counted per iteration by class, HMMA per iteration, and non-MMA instructions per HMMA;
    static body counts, plus "hot" counts that drop basic blocks attributed only to source lines of
    run-time-disabled features (COLD_LINES below: softcap, per-element mask, paged K/V, tail zero-fill) --
    an estimate of the dense, non-causal, unmasked path;
  * optionally (--lines N) the top-N source lines of the main loop's non-MMA instructions per kernel.

Usage (through tools/peer_sass.py, which fills KERNELS and COLD_LINES from this tree):
  python3 tools/peer_sass.py [--out build/peer_sass/out] [--arch sm_80,sm_90] [--lines 15] [--pairs fwd,bwd,fwd_causal]
"""
import argparse
import collections
import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sass  # noqa: E402  (the project's SASS reader: finds cuobjdump / nvdisasm or says how to get them)

CUOBJDUMP = sass.find_tool("cuobjdump", required=False) or "cuobjdump"
NVDISASM = sass.find_tool("nvdisasm", required=False) or "nvdisasm"

# (label, object stem, mangled-name regex, dynamic smem bytes, threads, rows x keys per CTA tile)
KERNELS = {
    "fwd": [
        ("sinkattn", "sink_fwd",
         r"^_ZN8sinkattn4sm8010fwd_kernelINS0_9FwdTraitsILi128ELi128ELi64ELi8EN7cutlass10bfloat16_tENS0_8GpuPrimsELi2ELi1EEEEE",
         128 * 128 * 2 + 2 * 2 * 64 * 128 * 2, 256, "128x64, 8 warps x 16 rows, 2 K/V stages"),
        ("FA2", "fa2_fwd",
         r"^_ZN5flash16flash_fwd_kernelI23Flash_fwd_kernel_traitsILi128ELi128ELi64ELi4ELb0ELb0EN7cutlass10bfloat16_tE.*EELb0ELb0ELb0ELb0ELb1ELb1ELb0ELb0EEEv",
         128 * 128 * 2 + 2 * 64 * 128 * 2, 128, "128x64, 4 warps x 32 rows, 1 K + 1 V buffer"),
    ],
    "fwd_causal": [
        ("sinkattn", "sink_fwd",
         r"^_ZN8sinkattn4sm8010fwd_kernelINS0_9FwdTraitsILi128ELi128ELi64ELi8EN7cutlass10bfloat16_tENS0_8GpuPrimsELi2ELi1EEEEE",
         128 * 128 * 2 + 2 * 2 * 64 * 128 * 2, 256, "same kernel (causal is a run-time flag)"),
        ("FA2 causal", "fa2_fwd_causal",
         r"^_ZN5flash16flash_fwd_kernelI23Flash_fwd_kernel_traitsILi128ELi128ELi64ELi4ELb0ELb0EN7cutlass10bfloat16_tE.*EELb0ELb1ELb0ELb0ELb1ELb1ELb0ELb0EEEv",
         128 * 128 * 2 + 2 * 64 * 128 * 2, 128, "128x64, 4 warps, Is_causal=true"),
    ],
    "bwd": [
        ("sinkattn", "sink_bwd",
         r"^_ZN8sinkattn4sm8010bwd_kernelINS0_9BwdTraitsILi128ELi64ELi64ELi4ELi2ELi2EN7cutlass10bfloat16_tENS0_8GpuPrimsEEEEEv",
         2 * 2 * 64 * 128 * 2 + 2 * 64 * 128 * 2 + 2 * 64 * 64 * 2, 256, "N tile 64 keys, M tile 64, 4x2 warps, 2 Q/dO stages"),
        ("FA2", "fa2_bwd",
         r"^_ZN5flash44flash_bwd_dq_dk_dv_loop_seqk_parallel_kernelI23Flash_bwd_kernel_traitsILi128ELi64ELi128ELi8ELi2ELi4ELi2ELb0ELb0EN7cutlass10bfloat16_tE.*EELb0ELb0ELb0ELb0ELb1ELb1ELb0EEEv",
         3 * 64 * 128 * 2 + 2 * 128 * 128 * 2 + 64 * 128 * 2 + 64 * 128 * 2, 256, "N tile 128 keys, M tile 64, 8 warps (SdP 2x4, dKV 4x2, dQ 2x4), 2 Q/dO stages"),
    ],
}

# Source lines (file suffix, first, last) of code that a dense non-causal bf16 run never executes: basic blocks
# whose every line-attributed instruction falls in these are dropped from the "hot" loop count.
COLD_LINES = [
    ("sm80/fwd_kernel.h", 52, 52),     # load_rows: zero-fill of tail vectors
    ("sm80/fwd_kernel.h", 198, 198),   # kv_row: paged K/V (pages[j / page_size])
    ("sm80/fwd_kernel.h", 303, 304),   # !warp_active
    ("sm80/fwd_kernel.h", 315, 316),   # softcap tanh
    ("sm80/fwd_kernel.h", 319, 333),   # per-element mask (needs_mask false on interior blocks)
    ("sm80/bwd_kernel.h", 194, 197),   # softcap
    ("sm80/bwd_kernel.h", 201, 201),   # visible_row on masked blocks
    ("common/mask.h", 21, 27),         # MaskPolicy::visible (masked blocks only)
    ("common/mask.h", 71, 78),         # TileMask::visible_cols (masked blocks only)
    ("common/mask.h", 56, 56),         # query_of_row: r / group, branched around when group == 1
    ("sm80/bwd_kernel.h", 225, 231),   # deterministic dQ semaphore
    ("sm80/prims_gpu.cuh", 200, 205),  # wait_until_equal / signal
    ("include/device_atomic_functions.hpp", 0, 1 << 30),  # int atomics: only the dQ semaphore uses them
]

CLASSES = [
    ("HMMA", lambda o: o.startswith("HMMA")),
    ("LDSM", lambda o: o.startswith("LDSM")),
    ("LDGSTS", lambda o: o.startswith("LDGSTS")),
    ("LDGDEPBAR/DEPBAR", lambda o: o.startswith("LDGDEPBAR") or o.startswith("DEPBAR")),
    ("LDG", lambda o: o.startswith("LDG") and not o.startswith("LDGSTS") and not o.startswith("LDGDEPBAR")),
    ("STG", lambda o: o.startswith("STG")),
    ("RED/ATOM", lambda o: o.startswith("RED") or o.startswith("ATOM")),
    ("LDS", lambda o: o.startswith("LDS") and not o.startswith("LDSM")),
    ("STS", lambda o: o.startswith("STS")),
    ("LDL/STL (spill)", lambda o: o.startswith("LDL") or o.startswith("STL")),
    ("BAR", lambda o: o.startswith("BAR")),
    ("SHFL", lambda o: o.startswith("SHFL")),
    ("MUFU.EX2", lambda o: o.startswith("MUFU.EX2")),
    ("MUFU other", lambda o: o.startswith("MUFU") and not o.startswith("MUFU.EX2")),
    ("FMUL", lambda o: o.startswith("FMUL")),
    ("FFMA", lambda o: o.startswith("FFMA")),
    ("FADD", lambda o: o.startswith("FADD")),
    ("FMNMX", lambda o: o.startswith("FMNMX")),
    ("FSETP/FSEL", lambda o: o.startswith("FSETP") or o.startswith("FSEL")),
    ("F2F/F2FP/I2F/F2I", lambda o: o.split(".")[0] in ("F2F", "F2FP", "I2F", "F2I", "I2FP", "F2IP")),
    ("BRA/branch", lambda o: o.split(".")[0] in ("BRA", "BRX", "JMP", "JMX", "CALL", "RET", "EXIT", "BSSY", "BSYNC",
                                                 "BREAK", "BMOV", "WARPSYNC", "BPT")),
    ("ISETP", lambda o: o.startswith("ISETP")),
    ("IMAD", lambda o: o.startswith("IMAD")),
    ("LEA", lambda o: o.startswith("LEA")),
    ("IADD3/VIADD", lambda o: o.startswith("IADD3") or o.startswith("VIADD") or o.startswith("IADD")),
    ("LOP3/SHF/SEL/MOV/other int", lambda o: o.split(".")[0] in ("LOP3", "SHF", "SEL", "MOV", "PRMT", "P2R", "R2P",
                                                                 "PLOP3", "UMOV", "S2R", "S2UR", "CS2R", "IABS",
                                                                 "FLO", "POPC", "IMNMX", "VIMNMX", "UIADD3", "ULDC",
                                                                 "UIMAD", "ULEA", "USHF", "ULOP3", "UISETP", "LDC",
                                                                 "R2UR", "USEL", "UPRMT", "UFLO", "UPOPC", "ISCADD",
                                                                 "SGXT", "BMSK", "BREV", "VOTE", "VOTEU", "NOP") or
                                  o.startswith("U")),
]
INDEX_MATH = ("ISETP", "IMAD", "LEA", "IADD3/VIADD")
INSN_RE = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)\s*(.*?);")
LINE_RE = re.compile(r'//## File "([^"]+)", line (\d+)')
LABEL_RE = re.compile(r"^(\.L_x_\d+):")
TARGET_RE = re.compile(r"`\((\.L_x_\d+)\)")


def classify(op):
    for name, f in CLASSES:
        if f(op):
            return name
    return "other"


def run(cmd):
    for tool, name in ((CUOBJDUMP, "cuobjdump"), (NVDISASM, "nvdisasm")):
        if cmd[0] == tool and not os.path.isfile(tool):
            sass.find_tool(name)  # exits saying how to get it
    return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout


_disasm_cache = {}


def cubin_for(out, stem, arch):
    d = os.path.join(out, "cubin")
    os.makedirs(d, exist_ok=True)
    want = os.path.join(d, f"{stem}.{arch}.cubin")
    if not os.path.exists(want) or os.path.getmtime(want) < os.path.getmtime(os.path.join(out, stem + ".o")):
        tmp = os.path.join(d, "x_" + stem)
        os.makedirs(tmp, exist_ok=True)
        if not os.path.isfile(CUOBJDUMP):
            sass.find_tool("cuobjdump")
        subprocess.run([CUOBJDUMP, "-xelf", "all", os.path.abspath(os.path.join(out, stem + ".o"))], cwd=tmp,
                       capture_output=True, check=True)
        for f in os.listdir(tmp):
            m = re.search(r"\.(sm_\d+a?)\.cubin$", f)
            if m:
                os.replace(os.path.join(tmp, f), os.path.join(d, f"{stem}.{m.group(1)}.cubin"))
        os.rmdir(tmp)
    return want


def functions(cubin):
    """{mangled name: [insn dict]} of a cubin (insn: addr, op, pred, args, file, line, label)."""
    if cubin in _disasm_cache:
        return _disasm_cache[cubin]
    text = run([NVDISASM, "-c", "-g", cubin])
    funcs, cur, name = {}, None, None
    file_, line = None, None
    pending_labels = []
    for raw in text.splitlines():
        if raw.startswith("\t.section\t.text."):
            name = raw.split(".text.", 1)[1].split(",")[0]
            cur = funcs.setdefault(name, [])
            file_, line, pending_labels = None, None, []
            continue
        if cur is None:
            continue
        m = LINE_RE.search(raw)
        if m:
            file_, line = m.group(1), int(m.group(2))
            continue
        m = LABEL_RE.match(raw)
        if m:
            pending_labels.append(m.group(1))
            continue
        m = INSN_RE.match(raw)
        if m:
            cur.append(dict(addr=int(m.group(1), 16), pred=(m.group(2) or "").strip(), op=m.group(3),
                            args=m.group(4), file=file_, line=line, labels=pending_labels))
            pending_labels = []
    _disasm_cache[cubin] = funcs
    return funcs


def pick(funcs, regex):
    hits = [n for n in funcs if re.search(regex, n)]
    if len(hits) != 1:
        raise SystemExit(f"compare.py: {len(hits)} functions match {regex[:90]}...: {[h[:120] for h in hits][:6]}")
    return hits[0], funcs[hits[0]]


def ptxas_info(out, stem, arch, name):
    """(regs, stack, spill stores, spill loads) from the -Xptxas -v log."""
    path = os.path.join(out, stem + ".ptxas.log")
    if not os.path.exists(path):
        return None
    text = open(path, errors="ignore").read()
    pat = (r"Compiling entry function '" + re.escape(name) + r"' for '" + arch + r"'\s*\n"
           r"ptxas info\s*: Function properties for .*\n\s*(\d+) bytes stack frame, (\d+) bytes spill stores, "
           r"(\d+) bytes spill loads\s*\nptxas info\s*: Used (\d+) registers")
    m = re.search(pat, text)
    if not m:
        return None
    return int(m.group(4)), int(m.group(1)), int(m.group(2)), int(m.group(3))


def is_cold(insn):
    if insn["file"] is None:
        return False
    return any(insn["file"].endswith(f) and a <= insn["line"] <= b for f, a, b in COLD_LINES)


def cfg(insns):
    """Basic blocks of a function: (list of (first, last) index ranges, successor lists, block of index). Every
    label starts a block, BSSY's reconvergence labels too, where the project's reader (sass.cfg) starts them at
    branch targets only. The hot counts drop blocks mostly of cold lines, so the block boundaries decide a few
    branches: sass.cfg's moved the hd128 forward kernels' hot counts by 1-6 of 550-890 instructions, and the
    figures in docs/internals.md were made with these."""
    label_at = {}
    for i, ins in enumerate(insns):
        for l in ins["labels"]:
            label_at[l] = i
    starts = {0}
    for i, ins in enumerate(insns):
        if ins["labels"]:
            starts.add(i)
        if ins["op"].split(".")[0] in ("BRA", "BRX", "EXIT", "RET", "JMP") and i + 1 < len(insns):
            starts.add(i + 1)
    s = sorted(starts)
    blocks = [(a, (s[k + 1] - 1) if k + 1 < len(s) else len(insns) - 1) for k, a in enumerate(s)]
    block_of = {}
    for b, (a, e) in enumerate(blocks):
        for i in range(a, e + 1):
            block_of[i] = b
    succ = []
    for b, (a, e) in enumerate(blocks):
        last = insns[e]
        op = last["op"].split(".")[0]
        out = []
        uncond = not last["pred"] or last["pred"] in ("@PT",)
        if op == "BRA":
            m = TARGET_RE.search(last["args"])
            if m and m.group(1) in label_at:
                out.append(block_of[label_at[m.group(1)]])
            if not uncond and b + 1 < len(blocks):
                out.append(b + 1)
        elif op in ("EXIT", "RET"):
            if not uncond and b + 1 < len(blocks):
                out.append(b + 1)
        elif b + 1 < len(blocks):
            out.append(b + 1)
        succ.append(out)
    return blocks, succ, block_of


def main_loop(insns):
    """The natural loop (header + every block that reaches the back edge without passing the header) of the
    backward branch whose loop holds the most HMMAs, the tightest such one. Returns (sorted instruction
    indices, blocks, header address, latch address) or None. Out-of-line blocks (a conditional copy placed after
    the loop, as FA2's K prefetch) are part of the loop."""
    blocks, succ, _ = cfg(insns)
    best = None
    for idx, body, h, b in sass.natural_loops(blocks, succ):
        n_mma = sum(1 for i in idx if insns[i]["op"].startswith("HMMA"))
        key = (n_mma, -len(idx))
        if best is None or key > best[0]:
            best = (key, idx, body, insns[blocks[h][0]]["addr"], insns[blocks[b][1]]["addr"])
    if best is None or best[0][0] == 0:
        return None
    return best[1:]


def count(insns, idx):
    c = collections.Counter()
    for i in idx:
        c[classify(insns[i]["op"])] += 1
    c["TOTAL"] = len(idx)
    return c


def analyse(out, stem, regex, arch):
    cub = cubin_for(out, stem, arch)
    name, insns = pick(functions(cub), regex)
    # Drop the trailing self-loop and NOP padding.
    body = [i for i, ins in enumerate(insns) if ins["op"] != "NOP"]
    whole = count(insns, body)
    loop = main_loop(insns)
    res = dict(name=name, insns=insns, whole=whole, loop=None, hot=None, ptxas=ptxas_info(out, stem, arch, name))
    if loop:
        idx, body, head, latch = loop
        blocks, _, _ = cfg(insns)
        res["loop"] = count(insns, idx)
        res["loop_range"] = (head, latch)
        hot_idx = []
        for b in body:
            a, e = blocks[b]
            lines = [insns[k] for k in range(a, e + 1) if insns[k]["file"] is not None]
            if lines and sum(is_cold(x) for x in lines) * 2 > len(lines):
                continue  # a block mostly of run-time-disabled code: branched around in a dense run
            hot_idx += list(range(a, e + 1))
        hot_idx.sort()
        res["hot"] = count(insns, hot_idx)
        # Predicated (if-converted) code of disabled features inside hot blocks: issued every iteration anyway.
        res["hot"]["(of which predicated cold)"] = sum(1 for k in hot_idx if insns[k]["pred"] and is_cold(insns[k]))
        res["hot"]["(of which @!PT filler)"] = sum(1 for k in hot_idx if insns[k]["pred"] in ("@!PT", "@!UPT"))
        res["hot_idx"] = hot_idx
        res["loop_idx"] = idx
    return res


def fmt_ratio(c):
    h = c.get("HMMA", 0)
    return f"{(c['TOTAL'] - h) / h:.2f}" if h else "-"


def table(pair, arch, results, specs):
    cols = [s[0] for s in specs]
    w = 28
    print(f"\n=== {pair} / {arch} " + "=" * 60)
    for s, r in zip(specs, results):
        print(f"  {s[0]:>10}: {r['name'][:150]}")
        print(f"  {'':>10}  tile {s[5]}; threads {s[4]}; loop at {hex(r['loop_range'][0]) if r['loop'] else '-'}"
              f"..{hex(r['loop_range'][1]) if r['loop'] else '-'}")
    hdr = f"{'':<{w}}" + "".join(f"{c:>14}" for c in cols) + "".join(f"{'loop ' + c:>16}" for c in cols) + \
        "".join(f"{'hot ' + c:>14}" for c in cols)
    print(hdr)
    def row(label, vals):
        print(f"{label:<{w}}" + "".join(f"{v:>14}" for v in vals[:2]) + "".join(f"{v:>16}" for v in vals[2:4]) +
              "".join(f"{v:>14}" for v in vals[4:]))
    # resources
    for k, lab in ((0, "registers"), (1, "stack frame B"), (2, "spill stores B"), (3, "spill loads B")):
        row(lab, [str(r["ptxas"][k]) if r["ptxas"] else "?" for r in results] + [""] * 4)
    row("dyn smem B (traits)", [str(s[3]) if s[3] else "see FINDINGS" for s in specs] + [""] * 4)
    row("regs x threads / 64K RF", [f"{(r['ptxas'][0] if r['ptxas'] else 0) * s[4] / 65536:.2f}" for s, r in zip(specs, results)] + [""] * 4)
    keys = ["TOTAL"] + [c[0] for c in CLASSES] + ["other", "(of which predicated cold)", "(of which @!PT filler)"]
    for k in keys:
        vals = [str(r["whole"].get(k, 0)) for r in results]
        vals += [str(r["loop"].get(k, 0)) if r["loop"] else "-" for r in results]
        vals += [str(r["hot"].get(k, 0)) if r["hot"] else "-" for r in results]
        if k != "TOTAL" and all(v in ("0", "-") for v in vals):
            continue
        row(k, vals)
    for lab, fn in (("index math (ISETP+IMAD+LEA+IADD3)", lambda c: sum(c.get(x, 0) for x in INDEX_MATH)),
                    ("non-MMA per HMMA", None)):
        vals = []
        for part in ("whole", "loop", "hot"):
            for r in results:
                c = r[part]
                if c is None:
                    vals.append("-")
                elif fn:
                    vals.append(str(fn(c)))
                else:
                    vals.append(fmt_ratio(c))
        row(lab, vals)
    vals = []
    for part in ("whole", "loop", "hot"):
        for r in results:
            c = r[part]
            vals.append(f"{c.get('LDSM', 0) / c['HMMA']:.3f}" if c and c.get("HMMA") else "-")
    row("LDSM per HMMA", vals)


def top_lines(r, n, label):
    if not r.get("hot_idx"):
        return
    c = collections.Counter()
    for i in r["hot_idx"]:
        ins = r["insns"][i]
        if ins["op"].startswith("HMMA"):
            continue
        f = ins["file"] or "?"
        f = re.sub(r".*/(csrc/|src/|include/)", r"\1", f)
        c[(f, ins["line"])] += 1
    print(f"  -- {label}: top {n} source lines of non-HMMA instructions in the hot loop --")
    for (f, l), k in c.most_common(n):
        print(f"     {k:5d}  {f}:{l}")


def dump(r, path):
    if not r.get("loop_idx"):
        return
    hot = set(r["hot_idx"])
    with open(path, "w") as f:
        f.write(f"# {r['name']}\n# H = counted as hot, C = cold block (disabled feature)\n")
        for i in r["loop_idx"]:
            x = r["insns"][i]
            src = re.sub(r".*/(csrc/|src/|include/)", r"\1", x["file"] or "?") + ":" + str(x["line"])
            lab = " ".join(x["labels"])
            f.write(f"{'H' if i in hot else 'C'} {x['addr']:06x} {lab:>9} {x['pred']:>6} {x['op']:<28} {x['args'][:60]:<60} {src}\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.environ.get("PEER_SASS_DIR", "build/peer_sass"), "out"))
    ap.add_argument("--arch", default="sm_80,sm_90")
    ap.add_argument("--pairs", default="fwd,bwd,fwd_causal")
    ap.add_argument("--lines", type=int, default=0)
    ap.add_argument("--dump", action="store_true", help="write the main loops to out/listings/*.sass")
    a = ap.parse_args()
    for pair in a.pairs.split(","):
        specs = KERNELS[pair]
        if not all(os.path.exists(os.path.join(a.out, s[1] + ".o")) for s in specs):
            print(f"\n=== {pair}: missing objects ({[s[1] + '.o' for s in specs]}), skipped")
            continue
        for arch in a.arch.split(","):
            results = [analyse(a.out, s[1], s[2], arch) for s in specs]
            table(pair, arch, results, specs)
            if a.dump:
                os.makedirs(os.path.join(a.out, "listings"), exist_ok=True)
                for s, r in zip(specs, results):
                    dump(r, os.path.join(a.out, "listings", f"{pair}_{s[1]}_{arch}.sass"))
            if a.lines:
                for s, r in zip(specs, results):
                    top_lines(r, a.lines, f"{s[0]} {arch}")


if __name__ == "__main__":
    main()
