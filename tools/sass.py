"""The project's SASS reader: finds the disassemblers, reads a cubin / object / shared object into instructions with
their control bits, resources per kernel, instruction classes, and the hot loop. Used by tools/sass_report.py,
tools/peer_sass/compare.py and tools/perf_model.py. No GPU needed.

cuobjdump and nvdisasm are not part of every CUDA toolkit install (CUDA 13.0's nvcc-only install has neither).
They are looked up in $CUOBJDUMP / $NVDISASM, PATH, $CUDA_HOME/bin, the triton wheel that torch installs
(triton/backends/nvidia/bin) and the nvidia-cuda-nvdisasm / nvidia-cuda-cuobjdump wheels.

Control bits (Volta and later: the top 23 bits of each 128-bit instruction word; layout as documented by
CuAssembler's "Control codes" notes and Jia et al., "Dissecting the NVIDIA Volta GPU Architecture via
Microbenchmarking", 2018, section 2): bits 105-108 stall cycles, 109 yield, 110-112 the scoreboard this instruction
sets when its result is written (7: none), 113-115 the scoreboard set when its sources are read, 116-121 the mask of
scoreboards it waits on before issuing, 122-125 the operand reuse flags.
"""
from __future__ import annotations

import collections
import dataclasses
import glob
import os
import re
import shutil
import subprocess
import sys
import sysconfig

HOW_TO_GET = ("{tool} was not found (${env}, PATH, $CUDA_HOME/bin, the triton wheel's triton/backends/nvidia/bin, "
              "the nvidia-cuda-{wheel} wheel). CUDA 13.0's toolkit does not ship it: install torch (its triton "
              "wheel carries cuobjdump and nvdisasm) or `pip install nvidia-cuda-{wheel}`, or set ${env}.")


def find_tool(name: str, required: bool = True) -> str | None:
    """Path of cuobjdump or nvdisasm; exits with how to get it when missing (or None when not required)."""
    env = name.upper()
    cands = [os.environ.get(env), shutil.which(name)]
    if os.environ.get("CUDA_HOME"):
        cands.append(os.path.join(os.environ["CUDA_HOME"], "bin", name))
    cands.append(os.path.join("/usr/local/cuda/bin", name))
    roots = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], *sys.path}
    for root in sorted(r for r in roots if r and os.path.isdir(r)):
        cands += glob.glob(os.path.join(root, "triton", "backends", "nvidia", "bin", name))
        cands += glob.glob(os.path.join(root, "nvidia", "*", "bin", name))
        cands += glob.glob(os.path.join(root, "nvidia", "*", "*", "bin", name))
    for c in cands:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    if required:
        sys.exit(HOW_TO_GET.format(tool=name, env=env, wheel=name))
    return None


@dataclasses.dataclass
class Insn:
    addr: int
    pred: str
    op: str
    args: str
    ctrl: int = -1          # the 23 control bits, -1 when no encoding was read
    target: int | None = None  # branch target address

    @property
    def stall(self) -> int:
        return self.ctrl & 0xF if self.ctrl >= 0 else 1

    @property
    def yield_bit(self) -> int:
        return (self.ctrl >> 4) & 1

    @property
    def wbar(self) -> int:  # scoreboard set on result write; 7 = none
        return (self.ctrl >> 5) & 7 if self.ctrl >= 0 else 7

    @property
    def rbar(self) -> int:  # scoreboard set on source read; 7 = none
        return (self.ctrl >> 8) & 7 if self.ctrl >= 0 else 7

    @property
    def wait(self) -> int:  # mask of scoreboards waited on
        return (self.ctrl >> 11) & 0x3F if self.ctrl >= 0 else 0

    @property
    def reuse(self) -> int:
        return (self.ctrl >> 17) & 0xF if self.ctrl >= 0 else 0

    @property
    def base(self) -> str:
        return self.op.split(".")[0]


def control_bits(hi: int) -> int:
    """The 23 control bits from the high 64-bit word of a 128-bit instruction."""
    return (hi >> 41) & 0x7FFFFF


# `/*0a30*/  @!P0 BRA 0x1230 ;  /* 0x0000... */` then `/* 0x... */` on the next line (cuobjdump -sass; nvdisasm -hex)
# The opcode with its modifiers: capitals, digits, dots, and wgmma's shape (HGMMA.64x128x16.F32.BF16: lower-case x)
_INSN = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*(?:x[0-9][A-Z0-9_.x]*)?)\s*(.*?)\s*;\s*(?:/\*\s*0x([0-9a-f]{16})\s*\*/)?")
_HEX = re.compile(r"^\s*/\*\s*0x([0-9a-f]{16})\s*\*/\s*$")
_FUNC = re.compile(r"^\s*Function : (\S+)")
_ARCH = re.compile(r"^\s*(?:arch =|code for) (sm_\w+)")
_NVD_FUNC = re.compile(r"^\s*\.section\s+\.text\.([^,\s]+)")
_LABEL = re.compile(r"^(\.L_x_\d+):")
_BRA_ADDR = re.compile(r"(?:^|[\s,])(0x[0-9a-f]+)\s*$")
_BRA_LABEL = re.compile(r"`\((\.L_x_\d+)\)")


def parse_sass(text: str, default_arch: str = "?") -> dict[tuple[str, str], list[Insn]]:
    """{(arch, mangled name): [Insn]} from cuobjdump -sass or nvdisasm -hex text."""
    funcs: dict[tuple[str, str], list[Insn]] = {}
    arch, cur, pending, labels, label_of = default_arch, None, None, [], {}
    for line in text.splitlines():
        m = _ARCH.match(line)
        if m:
            arch = m.group(1)
            continue
        m = _FUNC.match(line) or _NVD_FUNC.match(line)
        if m:
            cur = funcs.setdefault((arch, m.group(1)), [])
            pending = None
            continue
        if cur is None:
            continue
        m = _LABEL.match(line)
        if m:
            labels.append(m.group(1))
            continue
        m = _INSN.match(line)
        if m:
            ins = Insn(int(m.group(1), 16), (m.group(2) or "").strip(), m.group(3), m.group(4))
            for lab in labels:
                label_of[(id(cur), lab)] = ins.addr
            labels = []
            if ins.base in ("BRA", "BRX", "CALL", "JMP", "BSSY", "BREAK", "SSY", "PBK"):
                t = _BRA_ADDR.search(ins.args)
                if t:
                    ins.target = int(t.group(1), 16)
                else:
                    t = _BRA_LABEL.search(ins.args)
                    if t:
                        ins.target = ("label", t.group(1))  # resolved below
            cur.append(ins)
            pending = ins if m.group(5) else None
            continue
        m = _HEX.match(line)
        if m and pending is not None:
            pending.ctrl = control_bits(int(m.group(1), 16))
            pending = None
    for insns in funcs.values():
        for ins in insns:
            if isinstance(ins.target, tuple):
                ins.target = label_of.get((id(insns), ins.target[1]))
    return funcs


def disassemble(path: str, arch: str | None = None) -> dict[tuple[str, str], list[Insn]]:
    """SASS with control bits of every kernel in a .so / .o (cuobjdump) or a .cubin (cuobjdump, else nvdisasm)."""
    cuobjdump = find_tool("cuobjdump", required=not path.endswith(".cubin"))
    if cuobjdump:
        cmd = [cuobjdump, "-sass", path] + (["-arch", arch] if arch else [])
        text = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        return parse_sass(text)
    nvdisasm = find_tool("nvdisasm")
    text = subprocess.run([nvdisasm, "-hex", path], capture_output=True, text=True, check=True).stdout
    return parse_sass(text, default_arch=cubin_arch(path))


def cubin_arch(path: str) -> str:
    """sm_XY from a cubin's ELF header (e_flags holds the SM version: low byte before CUDA 12.8's layout, bits
    8-15 in the newer one)."""
    with open(path, "rb") as f:
        head = f.read(64)
    flags = int.from_bytes(head[48:52], "little")
    for sm in ((flags >> 8) & 0xFF, flags & 0xFF):
        if 30 <= sm <= 130:
            return f"sm_{sm}" + ("a" if flags & 0x8 and sm >= 90 else "")
    return "?"


def resources(path: str) -> dict[tuple[str, str], dict[str, int]]:
    """{(arch, mangled name): {reg, stack, shared, local}} from cuobjdump -res-usage (static shared memory only)."""
    cuobjdump = find_tool("cuobjdump")
    text = subprocess.run([cuobjdump, "-res-usage", path], capture_output=True, text=True, check=True).stdout
    # A lone cubin's listing names no arch (a fatbin's does): its ELF header does, as for its SASS (disassemble).
    return parse_resources(text, default_arch=cubin_arch(path))


def parse_resources(text: str, default_arch: str = "?") -> dict[tuple[str, str], dict[str, int]]:
    usage, arch, fn = {}, default_arch, None
    for line in text.splitlines():
        m = re.match(r"\s*arch = (\S+)", line)
        if m:
            arch = m.group(1)
        m = re.match(r"\s*Function (\S+):", line)
        if m:
            fn = m.group(1)
        m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", line)
        if m and fn:
            reg, stack, shared, local = map(int, m.groups())
            usage[(arch, fn)] = {"reg": reg, "stack": stack, "shared": shared, "local": local}
            fn = None
    return usage


# Instruction classes of the report (prefix match on the opcode; LDGSTS before LDG, LDSM before LDS).
CLASSES = ["HGMMA", "HMMA", "UTMALDG", "UTMASTG", "LDGSTS", "LDSM", "LDL", "STL", "BAR", "MUFU.EX2", "MUFU"]


def class_counts(insns: list[Insn]) -> dict[str, int]:
    c = dict.fromkeys(CLASSES, 0)
    for ins in insns:
        for k in CLASSES:
            if ins.op.startswith(k):
                c[k] += 1
                if k != "MUFU.EX2":
                    break
    c["MUFU"] -= c["MUFU.EX2"]  # "MUFU": the other MUFU functions (tanh, rcp, lg2)
    return c


def demangle(names) -> dict[str, str]:
    names = list(names)
    cxxfilt = shutil.which("c++filt")
    if not cxxfilt or not names:
        return {n: n for n in names}
    out = subprocess.run([cxxfilt], input="\n".join(names), capture_output=True, text=True).stdout.splitlines()
    return dict(zip(names, out)) if len(out) == len(names) else {n: n for n in names}


# -- control flow -------------------------------------------------------------------------------------------------

_ENDS = ("BRA", "BRX", "EXIT", "RET", "JMP", "JMX")


def cfg(insns: list[Insn]):
    """Basic blocks [(first, last) index], successor lists, and the block of each instruction index."""
    at = {ins.addr: i for i, ins in enumerate(insns)}
    starts = {0}
    for i, ins in enumerate(insns):
        if ins.base in _ENDS and i + 1 < len(insns):
            starts.add(i + 1)
        if ins.base in ("BRA", "BRX", "JMP") and ins.target in at:
            starts.add(at[ins.target])
    s = sorted(starts)
    blocks = [(a, (s[k + 1] - 1) if k + 1 < len(s) else len(insns) - 1) for k, a in enumerate(s)]
    block_of = {}
    for b, (a, e) in enumerate(blocks):
        for i in range(a, e + 1):
            block_of[i] = b
    succ = []
    for b, (a, e) in enumerate(blocks):
        last = insns[e]
        uncond = last.pred in ("", "@PT")
        out = []
        if last.base in ("BRA", "JMP"):
            if last.target in at:
                out.append(block_of[at[last.target]])
            if not uncond and b + 1 < len(blocks):
                out.append(b + 1)
        elif last.base in ("EXIT", "RET", "BRX", "JMX"):
            if not uncond and b + 1 < len(blocks):
                out.append(b + 1)
        elif b + 1 < len(blocks):
            out.append(b + 1)
        succ.append(out)
    return blocks, succ, block_of


def _dominators(succ):
    pred = collections.defaultdict(list)
    for b, ss in enumerate(succ):
        for t in ss:
            pred[t].append(b)
    order, seen, stack = [], {0}, [(0, iter(succ[0]))] if succ else []
    while stack:
        x, it = stack[-1]
        nxt = next(it, None)
        if nxt is None:
            order.append(x)
            stack.pop()
        elif nxt not in seen:
            seen.add(nxt)
            stack.append((nxt, iter(succ[nxt])))
    rpo = order[::-1]
    num = {x: k for k, x in enumerate(rpo)}
    idom = {0: 0}
    changed = True
    while changed:  # Cooper, Harvey, Kennedy: "A Simple, Fast Dominance Algorithm"
        changed = False
        for x in rpo[1:]:
            ps = [q for q in pred[x] if q in idom]
            if not ps:
                continue
            new = ps[0]
            for q in ps[1:]:
                a, b = q, new
                while a != b:
                    while num[a] > num[b]:
                        a = idom[a]
                    while num[b] > num[a]:
                        b = idom[b]
                new = a
            if idom.get(x) != new:
                idom[x] = new
                changed = True
    return idom, pred


def natural_loops(blocks, succ):
    """Every natural loop of a CFG (blocks as (first, last) index ranges, successor lists): (instruction indices
    sorted, body blocks sorted, header block, latch block) per back edge, an edge b -> h whose h dominates b. (An
    address-backward branch is not enough: an out-of-line block placed after a loop jumps back into its middle.)"""
    if not blocks:
        return []
    idom, pred = _dominators(succ)

    def dominates(h, b):
        while True:
            if b == h:
                return True
            if b == 0 or b not in idom:
                return False
            b = idom[b]

    out = []
    for b, ss in enumerate(succ):
        if b not in idom:
            continue
        for h in ss:
            if not dominates(h, b):
                continue
            body, stack = {h, b}, [b]
            while stack:
                x = stack.pop()
                if x == h:
                    continue
                for p in pred[x]:
                    if p not in body:
                        body.add(p)
                        stack.append(p)
            idx = sorted(i for x in body for i in range(blocks[x][0], blocks[x][1] + 1))
            out.append((idx, sorted(body), h, b))
    return out


def loops(insns: list[Insn]):
    """Every natural loop: (instruction indices sorted, body blocks, header block) per back edge."""
    blocks, succ, _ = cfg(insns)
    return [(idx, body, h) for idx, body, h, _ in natural_loops(blocks, succ)]


def hot_path(insns: list[Insn], loop, key=None, with_loads: bool = False, then=None) -> list[int]:
    """The instructions one interior iteration of `loop` (hot_loop's (indices, body blocks, header)) issues: the path
    from the header to a back edge through the body's other edges that holds the most `key` instructions (default
    MMAs), then (with_loads) the most global loads (an interior iteration loads the next block, the last one does
    not), then the fewest instructions. Branches the interior iterations skip (a mask's diagonal block, a tail, a
    wait loop) are off it; a loop body costed whole charges them to every iteration. Which branches an interior
    iteration really takes depends on run-time values the SASS does not hold: the two rules bracket it. then: a
    predicate whose instructions the path holds the most of after the MMAs (and loads), before the fewest
    instructions (the sm90 backward: dQ's atomics, which an interior step issues and a shorter path skips)."""
    key = key or is_mma
    blocks, succ, _ = cfg(insns)
    _, body, h = loop
    inside = set(body)
    # The body without its back edges (edges to the header, and edges closing an inner loop: found by a DFS from h).
    fwd, state = {b: [] for b in body}, {}
    latch = set()
    stack = [(h, iter(succ[h]))]
    state[h] = 1
    while stack:
        x, it = stack[-1]
        nxt = next(it, None)
        if nxt is None:
            state[x] = 2
            stack.pop()
            continue
        if nxt == h:
            latch.add(x)
        elif nxt in inside and state.get(nxt) != 1:
            fwd[x].append(nxt)
            if nxt not in state:
                state[nxt] = 1
                stack.append((nxt, iter(succ[nxt])))
    score = {}

    def best(b):  # ((MMAs, loads, -instructions) from b to a back edge, the next block on that path)
        if b in score:
            return score[b]
        a, e = blocks[b]
        own = (sum(1 for i in range(a, e + 1) if key(insns[i])),
               sum(1 for i in range(a, e + 1) if insns[i].base in ("LDGSTS", "UTMALDG", "LDG"))
               if with_loads else 0,
               sum(1 for i in range(a, e + 1) if then(insns[i])) if then else 0,
               -(e - a + 1))
        options = [(own, None)] if b in latch else []
        for t in fwd[b]:
            rest, _ = best(t)
            options.append((tuple(x + y for x, y in zip(own, rest)), t))
        score[b] = max(options, key=lambda o: o[0]) if options else ((own[0], own[1], own[2], own[3] - 10**9), None)
        return score[b]
    path, b = [], h
    while b is not None:
        path.extend(range(blocks[b][0], blocks[b][1] + 1))
        b = best(b)[1]
    return path


def is_mma(ins: Insn) -> bool:
    return ins.op.startswith("HMMA") or ins.op.startswith("HGMMA") or ins.op.startswith("IMMA") or ins.op.startswith("QGMMA")


def hot_loop(insns: list[Insn], key=is_mma, innermost: bool = False):
    """The natural loop holding the most `key` instructions, the tightest such one: (indices, blocks, header) or
    None when no loop holds one. innermost: among the loops holding a `key` instruction that hold no other such
    loop (a persistent kernel's key-block loop, not its tile loop around it, which holds more MMAs: the inner
    loop's and a peeled first iteration's)."""
    every = [(idx, body, h) for idx, body, h in loops(insns) if any(key(insns[i]) for i in idx)]
    if innermost:
        every = [(idx, body, h) for idx, body, h in every
                 if not any(h2 != h and set(b2) < set(body) for _, b2, h2 in every)]
    best = None
    for idx, body, h in every:
        n = sum(1 for i in idx if key(insns[i]))
        k = (n, -len(idx))
        if n and (best is None or k > best[0]):
            best = (k, (idx, body, h))
    return best[1] if best else None
