#!/usr/bin/env python3
"""A model of our kernels' time from their SASS: no GPU, no profiler.

Per kernel (tools/sass.py reads the cubin inside a .so / .o / .cubin), the hot loop (the natural loop holding the
most HMMA/HGMMA) is costed per iteration on one SM sub-partition (SMSP: one warp scheduler, a quarter of the SM):

  issue    one instruction per cycle per SMSP, plus a cycle per register-bank conflict that no reuse flag covers
  pipes    tensor (HMMA / HGMMA by shape), FMA, ALU, MUFU, per SMSP; shared memory (LDSM/LDS/STS bytes, wgmma's
           shared-memory operands) and global copies (LDGSTS, LDG, STG, RED) per SM
  chain    one warp's own path through the loop: the stall counts of the control bits, plus, at each scoreboard
           wait, what is left of the producer's latency (the device's table) after the cycles issued since it
  T(W)     with W warps of the loop on each SMSP: max(W x issue, W x each pipe, chain), the bound reported; the
           time is simulate()'s, a per-warp event simulation over the same bits, a CTA's warps on one SMSP held
           together at its __syncthreads; different CTAs' warps started in phase (PERF_PHASES=N averages N starts
           spread over an iteration: phased_cycles), each run 3 iterations long (PERF_ITERS)

then occupancy (registers, shared memory, warps, CTAs per SM), wave quantization and the problem's iterations give
the kernel's time. Memory-bound kernels (decode) are bounded by bytes in flight per SM between the waits on them
(LDGSTS bytes between DEPBAR waits x the copy groups kept in flight x CTAs per SM), against loaded latency x
bandwidth (Little's law).

Device tables (cited, rounded):
  [A100]  NVIDIA A100 Tensor Core GPU Architecture whitepaper (2020): 108 SMs, 1410 MHz boost, 312 dense BF16 TFLOPS
          = 1024 FMA/clk/SM, 64 FP32 + 64 INT32 lanes/SM, 16 SFU/SM, 164 KB shared memory/SM (163 KB per block),
          64K registers/SM, 2039 GB/s HBM2e (80 GB SXM).
  [H100]  NVIDIA H100 Tensor Core GPU Architecture whitepaper (2022): 132 SMs (SXM5), 989 dense BF16 TFLOPS at
          1830 MHz = 2048 FMA/clk/SM for wgmma, 128 FP32 + 64 INT32 lanes/SM, 16 SFU/SM, 228 KB shared memory/SM
          (227 KB per block), 64K registers/SM. [H200] product brief: same SM, 4.8 TB/s HBM3e, 141 GB.
  [Jia21] Z. Jia, P. Van Sandt, "Dissecting the Ampere GPU Architecture through Microbenchmarking", GTC 2021 S33322;
          [Jia18] Z. Jia et al., "Dissecting the NVIDIA Volta GPU Architecture via Microbenchmarking", 2018 (control
          bits, two 64-bit register banks, reuse caches).
  [Luo24] W. Luo et al., "Benchmarking and Dissecting the Nvidia Hopper GPU Architecture", IPDPS 2024
          (arXiv 2402.13499), and "Dissecting the NVIDIA Hopper Architecture through Microbenchmarking and Multiple
          Level Analysis" (arXiv 2501.12084): shared memory, L2 and global latencies of A100/H800 of the same order as
          below; mma.sync on Hopper below wgmma's rate.
  Latencies below are order-of-magnitude figures of those papers (shared ~30 cycles, MUFU ~20, L2 ~200-270,
  DRAM ~450-600 unloaded), not fitted.

Fitted constants (two, each on one named measured point of bench/RESULTS.md, 4d9dcbd's H200 run):
  HMMA_SM90   mma.sync's tensor rate on sm_90 in FMA/clk/SMSP: fitted so FlashAttention-2's hd128 bf16 forward
              (SDPA's flash backend, attn/fwd/hd128/h16kv16/full 2 x 8192) predicts its 353 TFLOP/s: 232, i.e.
              mma.sync on an H200 runs at 0.9x of the A100's 256 per SMSP-clock, a quarter of wgmma's 512 [Luo24:
              mma.sync on Hopper well below wgmma].
  LOADED_LAT  the loaded DRAM latency in ns of a decode copy: NOT fitted. 4d9dcbd's decode rows (tools/perf_rows.py
              DECODE, built here) do not bind on bytes in flight (17 MB across the H200's SMs): the hd128 row sits at
              the copy ceiling, the hd64 rows at the computing warp's loop (docs/internals.md); a placeholder until a
              row that is latency-bound is measured.

    python3 tools/perf_model.py sinkattn/_C*.so --device h200 [--filter fwd] [--json]   # per kernel: loop costs
    python3 tools/perf_model.py --rows                                                  # the checked rows
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sass  # noqa: E402

HMMA_SM90 = 232.0   # FMA/clk/SMSP of mma.sync m16n8k16 bf16 on sm_90 (fitted, see the docstring; A100: 256)
# What one loop iteration issues (make_kernel's `path`, --rows --path): "loop", the whole natural loop (every branch
# of the body, each iteration: the default, what the predictions in bench/RESULTS.md used); "mma" / "mma+loads",
# the interior iteration's path by sass.hot_path's two rules; "profile", the path the emulated kernel's line counts
# say the iterations take (tools/perf_counts.py; our forward kernels in --rows, FA2's keep "loop", on which
# HMMA_SM90 was fitted). docs/internals.md has the rows under each.
PATH_RULES = ("loop", "mma", "mma+loads", "profile")
# Whether the simulation holds a CTA's warps together at its __syncthreads (simulate's cta_warps). PERF_CTA_BARRIERS=0
# gives the rows without it, as before 2026-12-06 (docs/internals.md compares both).
CTA_BARRIERS = os.environ.get("PERF_CTA_BARRIERS", "1") == "1"
LOADED_LAT = 1300.0  # ns: NOT fitted (4d9dcbd's decode rows are not latency-bound: docstring)


@dataclasses.dataclass(frozen=True)
class Device:
    name: str
    arch: str           # the SASS arch it runs for the sm80 family
    sms: int
    ghz: float          # SM clock the measurements ran at
    hmma: float         # FMA/clk/SMSP of mma.sync (bf16, fp32 accumulate)
    hgmma: float        # FMA/clk/SMSP of wgmma (0: none)
    fma_lanes: int      # FP32 lanes per SMSP
    alu_lanes: int      # INT32 / logic lanes per SMSP
    mufu_lanes: int     # SFU lanes per SMSP
    smem_bw: int        # shared memory bytes/clk/SM
    smem_sm: int        # shared memory per SM (bytes), per block cap below
    smem_block: int
    regs_sm: int
    max_warps: int
    max_ctas: int
    dram_gbs: float     # copy bandwidth, read + write
    lat: dict           # latency (cycles) of variable-latency producers, by class


LAT_COMMON = {"lds": 30, "ldsm": 30, "mufu": 20, "hmma": 32, "shfl": 30, "ldg": 500, "ldgsts": 500, "l2": 250,
              "red": 500, "s2r": 20, "other": 20, "bar": 20, "hgmma": 0, "tma": 500}
DEVICES = {
    # A100 80 GB SXM [A100]; sm_80 SASS
    "a100": Device("A100-SXM4-80GB", "sm_80", 108, 1.41, 256.0, 0.0, 16, 16, 4, 128, 167936, 166912, 65536, 64, 32,
                   2039.0 * 0.9, dict(LAT_COMMON)),
    # H200 SXM [H100][H200]; sm_90 SASS of the sm80 family, sm_90a of the sm90 kernels. Clock and copy ceiling as
    # measured in 4d9dcbd's bench run (1980 MHz, 4252 GB/s).
    "h200": Device("H200", "sm_90", 132, 1.98, HMMA_SM90, 512.0, 32, 16, 4, 128, 233472, 232448, 65536, 64, 32,
                   4252.0, dict(LAT_COMMON, lds=30, ldsm=30, mufu=18, hmma=30, l2=260, ldg=480, ldgsts=480)),
}

# ---- instruction costs ------------------------------------------------------------------------------------------

FMA_OPS = ("FFMA", "FMUL", "FADD", "HFMA2", "HMUL2", "HADD2", "IMAD", "FSWZADD", "DFMA")
ALU_OPS = ("ISETP", "FSETP", "LOP3", "SHF", "IADD3", "LEA", "SEL", "FSEL", "MOV", "PRMT", "FMNMX", "IMNMX", "F2FP",
           "IABS", "VIADD", "VIMNMX", "PLOP3", "P2R", "R2P", "FLO", "POPC", "BMSK", "SGXT", "LOP", "CS2R", "ISCADD",
           "FCHK", "HSETP2", "HMNMX2", "F2I", "I2F", "F2F", "I2FP", "F2IP", "FRND")


def wgmma_shape(ins: sass.Insn) -> tuple[int, int, int] | None:
    """(M, N, K) of a wgmma's opcode (HGMMA.64x128x16.F32.BF16), None for any other instruction."""
    m = re.search(r"\.(\d+)x(\d+)x(\d+)", ins.op)
    return (int(m.group(1)), int(m.group(2)), int(m.group(3))) if m else None


def mma_fma(ins: sass.Insn) -> int:
    """FMAs of one warp's MMA instruction (HGMMA: this warp's quarter of the warpgroup's 64 x N x K)."""
    if shape := wgmma_shape(ins):
        return shape[0] // 4 * shape[1] * shape[2]
    shape = ins.op.split(".")[1] if "." in ins.op else ""
    return {"16816": 2048, "1688": 1024, "16832": 4096, "884": 256}.get(shape, 2048)  # HMMA.16816: 16 x 8 x 16


def smem_bytes(ins: sass.Insn) -> int:
    """Shared-memory bytes one warp instruction moves."""
    op = ins.op
    if op.startswith("LDSM"):  # LDSM.16.M88.4: four 8 x 8 matrices of 16-bit = 512 bytes
        m = re.search(r"\.(\d)$", op)
        return 128 * int(m.group(1)) if m else 128
    if op.startswith(("LDS", "STS")):
        w = re.search(r"\.(128|64|U8|S8|U16|S16)", op)
        return 32 * {"128": 16, "64": 8}.get(w.group(1) if w else "", 4)
    return 0


def wgmma_smem_bytes(ins: sass.Insn) -> int:
    """Shared-memory bytes one warp's HGMMA reads, its quarter of the warpgroup's operands: B (N x K) always, A
    (64 x K) too when it comes from shared memory (a descriptor, not registers)."""
    shape = wgmma_shape(ins)
    if ins.base != "HGMMA" or not shape:
        return 0
    mm, nn, kk = shape
    a_smem = ins.args.split(",")[1].strip().startswith("gdesc") if "," in ins.args else True
    return ((mm * kk if a_smem else 0) + nn * kk) * 2 // 4


def gmem_bytes(ins: sass.Insn) -> int:
    op = ins.op
    if op.startswith(("LDGSTS", "LDG", "STG", "RED", "ATOMG", "ATOM")):
        w = re.search(r"\.(128|64)", op)
        return 32 * {"128": 16, "64": 8}.get(w.group(1) if w else "", 4)
    return 0


def pipe(ins: sass.Insn) -> str:
    b = ins.base
    if b in ("HMMA", "HGMMA", "IMMA", "QGMMA"):
        return "tensor"
    if b == "MUFU":
        return "mufu"
    if b in FMA_OPS:
        return "fma"
    if b in ALU_OPS:
        return "alu"
    if smem_bytes(ins) or b in ("SHFL",):
        return "shared"
    if gmem_bytes(ins) or b in ("UTMALDG", "UTMASTG"):
        return "gmem"
    return "issue"  # branches, barriers, uniform datapath, S2R: an issue slot and no modelled pipe


def lat_class(ins: sass.Insn) -> str:
    b = ins.base
    return {"LDSM": "ldsm", "LDS": "lds", "MUFU": "mufu", "HMMA": "hmma", "SHFL": "shfl", "LDG": "ldg",
            "LDGSTS": "ldgsts", "RED": "red", "ATOMG": "red", "S2R": "s2r", "S2UR": "s2r", "HGMMA": "hgmma",
            "UTMALDG": "tma", "LDL": "l2", "LDC": "lds", "ULDC": "lds"}.get(b, "other")


_REG = re.compile(r"(?<![\w.])R(\d+)(?:\.reuse)?")


def bank_conflicts(ins: sass.Insn) -> int:
    """Extra issue cycles from register-bank conflicts: [Jia18] two banks (register index mod 2); sources of one
    instruction on the same bank serialize unless the operand comes from the reuse cache (.reuse / reuse flags)."""
    if ins.base not in ("FFMA", "IMAD", "HFMA2", "FMUL", "FADD", "HMMA", "LOP3", "IADD3", "FSEL", "SEL"):
        return 0
    ops = [o.strip() for o in ins.args.split(",")][1:]  # sources
    banks = []
    for k, o in enumerate(ops):
        m = _REG.match(o.lstrip("-|"))
        if not m or ".reuse" in o or (ins.reuse >> k) & 1:
            continue
        banks.append(int(m.group(1)) % 2)
    return max(0, max(banks.count(0), banks.count(1)) - 1) if banks else 0


# ---- the loop's cost ----------------------------------------------------------------------------------------------

@dataclasses.dataclass
class LoopCost:
    n: int = 0
    mma: int = 0
    mma_fma: int = 0
    issue: float = 0.0
    tensor: float = 0.0
    fma: float = 0.0
    alu: float = 0.0
    mufu: float = 0.0
    shared_bytes: int = 0
    gmem_bytes: int = 0
    chain: float = 0.0
    stalls: int = 0
    waits: float = 0.0
    bank: int = 0
    bars: int = 0
    counts: dict = dataclasses.field(default_factory=dict)

    def cycles(self, w: float, warps_sm: float, dev: Device) -> tuple[float, str]:
        """Cycles per iteration on one SMSP with w warps of the loop on it (warps_sm on the SM)."""
        bounds = {"issue": w * self.issue, "tensor": w * self.tensor, "fma": w * self.fma, "alu": w * self.alu,
                  "mufu": w * self.mufu, "shared": warps_sm * self.shared_bytes / dev.smem_bw, "chain": self.chain}
        k = max(bounds, key=bounds.get)
        return bounds[k], k


def loop_cost(insns: list[sass.Insn], idx: list[int], dev: Device) -> LoopCost:
    c = LoopCost()
    loop = [insns[i] for i in idx]
    c.n = len(loop)
    # issue time per instruction of this warp: its stall count (the scheduler will not issue the warp's next
    # instruction before), at least 1
    t, when, last_set = 0.0, [], {}
    # two passes: the first sets the scoreboards the loop leaves pending into the next iteration
    for rnd in range(2):
        t, waits, stalls = 0.0, 0.0, 0
        for ins in loop:
            if ins.wait:
                ready = max((last_set[b] for b in range(6) if ins.wait >> b & 1 and b in last_set), default=0.0)
                if ready > t:
                    waits += ready - t
                    t = ready
            if ins.base == "BAR":
                t += dev.lat["bar"]
            lat = dev.lat[lat_class(ins)]
            if ins.base == "HGMMA":
                lat = mma_fma(ins) / dev.hgmma  # its own tensor time: asynchronous, waited on via WARPGROUP.DEPBAR
            if ins.wbar != 7:
                last_set[ins.wbar] = t + lat
            if ins.rbar != 7:
                last_set[ins.rbar] = max(last_set.get(ins.rbar, 0.0), t + min(lat, 12))
            s = max(1, ins.stall)
            stalls += s
            t += s
        if rnd == 0:
            last_set = {b: v - t for b, v in last_set.items()}
    c.chain, c.waits, c.stalls = t, waits, stalls
    for ins in loop:
        p = pipe(ins)
        c.counts[p] = c.counts.get(p, 0) + 1
        c.bank += bank_conflicts(ins)
        if p == "tensor":
            c.mma += 1
            f = mma_fma(ins)
            c.mma_fma += f
            c.tensor += f / (dev.hgmma if ins.base == "HGMMA" else dev.hmma)
        elif p == "fma":
            c.fma += 32 / dev.fma_lanes
        elif p == "alu":
            c.alu += 32 / dev.alu_lanes
        elif p == "mufu":
            c.mufu += 32 / dev.mufu_lanes
        c.shared_bytes += smem_bytes(ins) + wgmma_smem_bytes(ins) + (128 if ins.base == "SHFL" else 0)
        c.gmem_bytes += gmem_bytes(ins)
        c.bars += ins.base == "BAR"
    c.issue = c.n + c.bank
    return c


def simulate(insns: list[sass.Insn], idx: list[int], dev: Device, w: int, iters: int | None = None,
             cta_warps: int = 1, start: list[float] | None = None, trace: list | None = None) -> float:
    """Per-warp event simulation of one SMSP: w warps walk the loop's instructions; a warp issues when its previous
    instruction's stall count has passed, the scoreboards it waits on are released (producer issue + the device's
    latency of that class; HGMMA: its tensor time) and the instruction's pipe is free; one instruction per cycle,
    the ready warp that issued least recently first; an HGMMA (wgmma) does not wait for the tensor pipe but queues
    its work there (and its shared-memory operands' reads in the shared pipe, which its work cannot outrun), and
    WARPGROUP.DEPBAR.LE gsb0, N waits for all but the warp's last N groups. Warps k // cta_warps form one CTA: at a
    CTA-wide barrier (BAR.SYNC 0, __syncthreads) a warp waits until its CTA's other warps here have arrived, and all
    leave together after the barrier's latency (the other SMSPs' warps of the CTA run the same code and arrive
    alike). Without it, an 8-warp CTA's two warps on an SMSP drift apart, one warp's softmax and copies hiding under
    the other's MMAs as two CTAs' warps do; with it, they start every iteration together. Returns the steady-state
    cycles of one iteration of all w warps (the last iterations' mean) over iters iterations (default ITERS,
    PERF_ITERS). start: the cycle each warp issues its first instruction (default: warp k at cycle k, all in phase).
    trace: a list that gets (warp, step, cycle, why) for every issue, step counting the loop's instructions from 0
    across iterations and why what the warp waited for last: "stall" (its previous instruction's stall count, or a
    barrier's release), "scoreboard" (a producer's latency), "pipe:<name>" (the pipe busy with other work), "wgmma"
    (its own wgmma groups, at a WARPGROUP.DEPBAR), "slot" (the issue slot taken by another warp); warp_waits() reads
    it."""
    iters = ITERS if iters is None else iters
    loop = [insns[i] for i in idx]
    cost = []
    for ins in loop:
        p = pipe(ins)
        c = {"tensor": mma_fma(ins) / (dev.hgmma if ins.base == "HGMMA" else dev.hmma), "fma": 32 / dev.fma_lanes,
             "alu": 32 / dev.alu_lanes, "mufu": 32 / dev.mufu_lanes,
             "shared": 4 * (smem_bytes(ins) + (128 if ins.base == "SHFL" else 0)) / dev.smem_bw}.get(p, 0.0)
        lat = mma_fma(ins) / dev.hgmma if ins.base == "HGMMA" else dev.lat[lat_class(ins)]
        cost.append((p, c, lat, max(1, ins.stall), ins.wait, ins.wbar, ins.rbar, bank_conflicts(ins),
                     ins.base == "BAR"))
    operand_reads = [4 * wgmma_smem_bytes(ins) / dev.smem_bw for ins in loop]
    n = len(loop)
    # __syncthreads (barrier 0, every thread of the CTA), not the named barriers of warp-specialized kernels
    cta_bar = [ins.base == "BAR" and ".SYNC" in ins.op and ins.args.strip() in ("0x0", "0") for ins in loop]
    # wgmma groups: the HGMMA marked gsb0 closes one (wgmma.commit_group); WARPGROUP.DEPBAR.LE gsb0, N
    # (wgmma.wait_group N) holds the warp until at most N of its groups are still running on the tensor pipe
    # (issued into the tensor pipe's queue without waiting for it: the warp goes on, as wgmma is asynchronous)
    group_end = [ins.base == "HGMMA" and "gsb0" in ins.args for ins in loop]
    queued = [ins.base == "HGMMA" for ins in loop]
    depbar = [wgmma_wait_count(ins) for ins in loop]
    groups = [[] for _ in range(w)]  # per warp: the cycle each of its open groups' tensor work ends, oldest first
    pc = [0] * w
    ready_at = [float(x) for x in start] if start else [float(k) for k in range(w)]
    sb = [[0.0] * 6 for _ in range(w)]
    free = {}
    last = [0.0] * w
    t = 0.0
    marks = [[] for _ in range(w)]
    arrived, arrive_at = [0] * w, [0.0] * w
    total = n * iters
    while min(pc) < total:
        best, when = None, None
        for k in range(w):
            if pc[k] >= total:
                continue
            p, c, lat, st, wait, wb, rb, bank, bar = cost[pc[k] % n]
            r = ready_at[k]
            if wait:
                r = max([r] + [sb[k][b] for b in range(6) if wait >> b & 1])
            if c and not queued[pc[k] % n]:
                r = max(r, free.get(p, 0.0))
            g = depbar[pc[k] % n]
            if g is not None and len(groups[k]) > g:
                r = max(r, groups[k][len(groups[k]) - g - 1])
            r = max(r, t)
            if when is None or r < when or (r == when and last[k] < last[best]):
                best, when = k, r
        k = best
        if when == math.inf:
            raise RuntimeError("simulate: every warp waits at a barrier")
        p, c, lat, st, wait, wb, rb, bank, bar = cost[pc[k] % n]
        g = depbar[pc[k] % n]
        if trace is not None:
            sbw = max([0.0] + [sb[k][b] for b in range(6) if wait >> b & 1]) if wait else 0.0
            pf = free.get(p, 0.0) if c else 0.0
            gw = groups[k][len(groups[k]) - g - 1] if g is not None and len(groups[k]) > g else 0.0
            why = ("stall" if when <= ready_at[k] else "scoreboard" if when <= sbw else
                   f"pipe:{p}" if when <= pf else "wgmma" if when <= gw else "slot")
            trace.append((k, pc[k], when, why))
        if g is not None and len(groups[k]) > g:
            del groups[k][:len(groups[k]) - g]
        if c:
            free[p] = max(free.get(p, 0.0), when) + c
        rd = operand_reads[pc[k] % n]
        if rd:  # a wgmma's shared-memory operands, read through the SM's shared-memory pipe before it can finish
            free["shared"] = max(free.get("shared", 0.0), when) + rd
            free[p] = max(free[p], free["shared"])
        if group_end[pc[k] % n]:
            groups[k].append(free["tensor"])
        if bar and cta_warps > 1 and cta_bar[pc[k] % n]:
            # a CTA-wide barrier: the warp waits for its CTA's other warps on this SMSP (the other SMSPs' arrive
            # alike), then all of them leave together
            mates = range(k // cta_warps * cta_warps, min(w, (k // cta_warps + 1) * cta_warps))
            arrived[k] += 1
            arrive_at[k] = when
            ready_at[k] = math.inf
            if all(arrived[j] >= arrived[k] for j in mates):
                go = max(arrive_at[j] for j in mates) + dev.lat["bar"]
                for j in mates:
                    ready_at[j] = go
        else:
            if bar:
                when += dev.lat["bar"]
            if wb != 7:
                sb[k][wb] = when + lat
            if rb != 7:
                sb[k][rb] = max(sb[k][rb], when + min(lat, 12))
            ready_at[k] = when + st + bank
        last[k] = when
        t = when + 1
        pc[k] += 1
        if pc[k] % n == 0:
            marks[k].append(when)
    spans = [m[-1] - m[0] for m in marks if len(m) >= 2]
    return max(spans) / (iters - 1) if spans else t / iters


def wgmma_wait_count(ins: sass.Insn) -> int | None:
    """N of a WARPGROUP.DEPBAR.LE gsb0, N (wgmma.wait_group N); None for any other instruction."""
    if not ins.op.startswith("WARPGROUP.DEPBAR"):
        return None
    m = re.search(r"gsb0\s*,\s*(0x[0-9a-fA-F]+|\d+)", ins.args)
    return int(m.group(1), 0) if m else 0


def warp_waits(insns: list[sass.Insn], idx: list[int], dev: Device, w: int, cta_warps: int = 1,
               start: list[float] | None = None, iters: int | None = None) -> dict:
    """Where one warp's time goes in simulate(): warp 0's last iteration (span: its cycles), each instruction's
    wait before it issued (the cycles since the warp's previous issue) summed by (why, opcode) (simulate's trace),
    the tensor pipe's busy cycles in that window (every warp's MMAs issued in it), and each wait with its
    instruction in loop order. Read beside another loop's (FA2's) it says which stretch of ours is longer, the
    question the cycle totals leave open."""
    trace: list = []
    iters = max(2, ITERS if iters is None else iters)
    simulate(insns, idx, dev, w, iters=iters, cta_warps=cta_warps, start=start, trace=trace)
    n = len(idx)
    loop = [insns[i] for i in idx]
    it = iters - 1
    mine = [e for e in trace if e[0] == 0 and e[1] // n == it]
    # the iteration runs from the warp's last issue of the one before (its waits sum to this span)
    prev = next((e[2] for e in reversed(trace) if e[0] == 0 and e[1] // n == it - 1), mine[0][2])
    t0, t1, span = mine[0][2], mine[-1][2], mine[-1][2] - prev
    tensor = {"HMMA": dev.hmma, "HGMMA": dev.hgmma}
    busy = sum(mma_fma(loop[e[1] % n]) / tensor[loop[e[1] % n].base] for e in trace
               if loop[e[1] % n].base in tensor and t0 <= e[2] <= t1)
    waits: dict = {}
    steps = []
    for k, step, when, why in mine:
        ins = loop[step % n]
        gap = when - prev
        prev = when
        cyc, cnt = waits.get((why, ins.base), (0.0, 0))
        waits[(why, ins.base)] = (cyc + gap, cnt + 1)
        steps.append({"at": when - t0, "wait": gap, "why": why, "op": ins.op, "args": ins.args, "index": idx[step % n]})
    return {"span": span, "tensor_busy": busy, "w": w, "cta_warps": cta_warps,
            "waits": sorted(((why, op, cyc, cnt) for (why, op), (cyc, cnt) in waits.items()), key=lambda r: -r[2]),
            "steps": steps}


# ---- occupancy and a kernel's time --------------------------------------------------------------------------------

def ctas_per_sm(dev: Device, regs: int, threads: int, smem: int) -> int:
    """Resident CTAs per SM: registers (allocated per warp in 256-register units), shared memory (+1 KB reserved per
    CTA), warps, CTA slots."""
    warps = math.ceil(threads / 32)
    per_warp = math.ceil(max(regs, 1) * 32 / 256) * 256
    by_regs = dev.regs_sm // (per_warp * warps)
    by_smem = dev.smem_sm // (smem + 1024) if smem else dev.max_ctas
    return max(0, min(by_regs, by_smem, dev.max_warps // warps, dev.max_ctas))


@dataclasses.dataclass
class Kernel:
    name: str          # demangled (short)
    regs: int
    threads: int       # threads per CTA
    smem: int          # dynamic + static shared memory per CTA
    loop: LoopCost
    outside: int       # instructions outside the loop (prologue/epilogue, issued once per CTA and warp)
    loop_warps: int    # warps per CTA that run the loop (all for sm80; the consumer warpgroups' for sm90)
    insns: list = dataclasses.field(default_factory=list, repr=False)
    idx: list = dataclasses.field(default_factory=list, repr=False)
    _sim: dict = dataclasses.field(default_factory=dict, repr=False)

    def iteration_cycles(self, w: int, dev: Device, cta_warps: int | None = None) -> float:
        """Cycles of one loop iteration of w warps on one SMSP (simulate(), cached). cta_warps: how many of them
        belong to one CTA (its __syncthreads holds them together); default, as a CTA's warps are dealt to the four
        SMSPs in turn, a quarter of the CTA's loop warps (an 8-warp CTA puts 2 on each SMSP, a 4-warp one 1)."""
        cta_warps = self.cta_warps(w, cta_warps)
        key = (w, dev.name, dev.hmma, cta_warps, PHASES, ITERS)
        if key not in self._sim:
            self._sim[key] = phased_cycles(self.insns, self.idx, dev, max(1, w), cta_warps)
        return self._sim[key]

    def cta_warps(self, w: int, cta_warps: int | None = None) -> int:
        """How many of w warps on one SMSP belong to one CTA (iteration_cycles)."""
        if cta_warps is None:
            cta_warps = math.ceil(self.loop_warps / 4) if CTA_BARRIERS else 1
        return max(1, min(max(1, w), cta_warps))

    def waits(self, w: int, dev: Device, iters: int | None = None) -> dict:
        """warp_waits() of this loop as iteration_cycles runs it (in phase), w warps on one SMSP."""
        return warp_waits(self.insns, self.idx, dev, max(1, w), self.cta_warps(w), iters=iters)


# Warps of different CTAs on one SMSP share no barrier, so nothing sets their relative phase: the simulation keeps
# whichever it starts with. HEAD's hd128 sm80 forward at two CTAs per SM (A100) takes 3236 cycles per key block started
# in phase, 2929 / 2952 / 2680 started 300 / 800 / 1500 cycles apart, the same after 3, 6 or 12 iterations; FA2's
# 128 x 64 loop 6170 against 5474-5946. PERF_PHASES=N (N > 0) averages a kernel's time over N starts, CTA g's warps
# offset by (g x (s + 1/2) / N mod 1) of the in-phase iteration, where an SMSP holds warps of more than one CTA.
# Off by default: on 4d9dcbd's rows (docs/internals.md) it takes the hd128 ratios' errors from +6..+12% to +0..+6% but
# the hd64 ones from +7..+15% to +16..+22% and hd256 from -8..-13% to -14..-16%, so the phase the warps keep on a GPU
# is not known from these points. It is the spread to read beside a two-CTA kernel's figure.
PHASES = int(os.environ.get("PERF_PHASES", "0"))
# PERF_ITERS=N: the iterations each of those simulations runs, in phase or not (default 3). Two CTAs' warps started
# in phase drift over the first iterations (the A100's `Hd128RowsTwoCtas` loop, cycles per 64 keys: 5949 / 5881 /
# 5857 / 5846 at 3 / 6 / 12 / 24, FA2's 6170 / 6036 / 5987 / 5965), and a phased mean of a few starts samples a
# quantity that swings 10% with the offset coarsely (the same loops at 4 starts x 3 iterations 5838 / 5566, at 32 x 12
# 5732 / 5612). But 3 iterations in phase is the run 4d9dcbd's measured H200 rows check best: its ratio errors
# +6..+15% / -8..-13%, at 12 iterations its two-CTA hd64 tile +20 / +30%, with 32 starts of 12 +21 / +26%
# (docs/internals.md, "How long the simulation runs"). So the default stays; longer runs are a spread to read beside.
ITERS = int(os.environ.get("PERF_ITERS", "3"))


def phased_cycles(insns: list[sass.Insn], idx: list[int], dev: Device, w: int, cta_warps: int) -> float:
    """simulate()'s cycles per iteration of w warps on one SMSP, cta_warps of them per CTA, averaged over the CTAs'
    relative phases (PHASES, above)."""
    t0 = simulate(insns, idx, dev, w, cta_warps=cta_warps)
    ctas = math.ceil(w / cta_warps)
    if ctas < 2 or PHASES < 1:
        return t0
    runs = [simulate(insns, idx, dev, w, cta_warps=cta_warps,
                     start=[k + t0 * ((k // cta_warps) * (s + 0.5) / PHASES % 1.0) for k in range(w)])
            for s in range(PHASES)]
    return sum(runs) / len(runs)


def iteration_time_s(k: Kernel, dev: Device, ctas: int) -> tuple[float, str, float]:
    """Seconds of one loop iteration of every resident CTA on one SM, with ctas CTAs resident; the bound; W."""
    warps_sm = ctas * k.loop_warps
    w = math.ceil(warps_sm / 4)  # the busiest SMSP's warps
    _, bound = k.loop.cycles(w, warps_sm, dev)  # the analytic bound that dominates (reported)
    return k.iteration_cycles(w, dev) / (dev.ghz * 1e9), bound, w


def kernel_time_s(k: Kernel, dev: Device, n_ctas: int, iters: list[int] | int, persistent: bool = False) -> dict:
    """Time of a launch of n_ctas CTAs doing iters loop iterations each (an int, or one count per CTA)."""
    occ = ctas_per_sm(dev, k.regs, k.threads, k.smem)
    if occ == 0:
        raise ValueError(f"{k.name}: does not fit an SM of {dev.name} (regs {k.regs}, smem {k.smem})")
    its = [iters] * n_ctas if isinstance(iters, int) else list(iters)
    slots = dev.sms * occ
    if persistent:
        # one CTA per SM walks the tiles: the SM with the most iterations decides. Tiles are dealt round-robin in
        # the order given (the sm90 forward's static schedule: CTA c takes tiles c, c + grid, ... of its tile
        # order, common/tile_order.h), not sorted: under a causal mask that order is what balances the SMs or not
        per_sm = [0] * dev.sms
        for k_, it in enumerate(its):
            per_sm[k_ % dev.sms] += it
        t_it, bound, w = iteration_time_s(k, dev, 1)
        over = k.outside * math.ceil(len(its) / dev.sms) * w / (dev.ghz * 1e9)
        return {"time": max(per_sm) * t_it + over, "bound": bound, "occupancy": occ, "waves": len(its) / dev.sms, "w": w}
    # waves of occ CTAs per SM; a wave lasts as long as its longest CTA; the last wave has fewer CTAs per SM
    its.sort(reverse=True)
    total, bound, w = 0.0, "", 0.0
    for start in range(0, len(its), slots):
        wave = its[start:start + slots]
        resident = min(occ, math.ceil(len(wave) / dev.sms))
        t_it, b, w_ = iteration_time_s(k, dev, resident)
        if start == 0:
            bound, w = b, w_
        total += max(wave) * t_it + k.outside * w_ / (dev.ghz * 1e9)
    return {"time": total, "bound": bound, "occupancy": occ, "waves": len(its) / slots, "w": w}


def decode_gbs(k: Kernel, dev: Device, n_ctas: int, bytes_total: float, groups_in_flight: int) -> dict:
    """Memory-bound bound (Little's law): bytes in flight per SM = the loop's copy bytes per warp x warps x the copy
    groups kept in flight; bandwidth = min(device, SMs in use x in-flight bytes / loaded latency)."""
    occ = ctas_per_sm(dev, k.regs, k.threads, k.smem)
    resident = min(occ, math.ceil(n_ctas / dev.sms))
    sms_used = min(dev.sms, n_ctas)
    inflight = k.loop.gmem_bytes * k.loop_warps * resident * groups_in_flight
    bw = min(dev.dram_gbs, sms_used * inflight / (LOADED_LAT * 1e-9) / 1e9)
    return {"gbs": bw, "inflight_per_sm": inflight, "resident": resident, "time": bytes_total / (bw * 1e9)}


def groups_in_flight(insns: list[sass.Insn], idx: list[int]) -> int:
    """cp.async groups kept in flight: 1 + the N of the loop's `DEPBAR.LE SB0, N` waits (the smallest one)."""
    ns = []
    for i in idx:
        m = re.search(r"SB0,\s*(0x[0-9a-f]+|\d+)", insns[i].args) if insns[i].base == "DEPBAR" else None
        if m:
            ns.append(int(m.group(1), 0))
    return 1 + (min(ns) if ns else 0)


def read_kernels(path: str, dev: Device, arch: str | None = None) -> dict[str, tuple[list[sass.Insn], tuple]]:
    """{mangled name: (instructions, hot loop)} of the kernels of `arch` (default: the device's arch for the sm80
    family and sm_90a where present) in a file."""
    code = sass.disassemble(path)
    out = {}
    for (a, fn), insns in code.items():
        if arch and a != arch:
            continue
        if not arch and a not in (dev.arch, dev.arch + "a"):
            continue
        out[fn] = (a, insns, sass.hot_loop(insns))
    return out


def make_kernel(name: str, insns, loop, res: dict, dev: Device, threads: int, dyn_smem: int,
                loop_warps: int | None = None, path: str = "loop", idx: list[int] | None = None,
                outside: int | None = None) -> Kernel:
    """idx: the iteration's instructions when the caller has them (perf_counts.profile); else by `path`. outside:
    the instructions a CTA issues once besides the loop, when the caller knows them (perf_counts.profile); else
    every instruction outside the loop."""
    if idx is None:
        idx = loop[0] if path in ("loop", "profile") else sass.hot_path(insns, loop, with_loads=path == "mma+loads")
    lc = loop_cost(insns, idx, dev)
    return Kernel(name, res.get("reg", 255), threads, dyn_smem + res.get("shared", 0), lc,
                  len(insns) - len(loop[0]) if outside is None else outside, loop_warps or threads // 32, insns, idx)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="*")
    ap.add_argument("--device", default="h200", choices=sorted(DEVICES))
    ap.add_argument("--arch", help="SASS arch to read (default: the device's)")
    ap.add_argument("--filter", default="")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--rows", action="store_true", help="predict the checked rows (tools/perf_rows.py)")
    ap.add_argument("--ours", help="--rows: folder of 4d9dcbd objects (default build/peer_sass/4d9dcbd/out)")
    ap.add_argument("--fa2", help="--rows: folder of FA2 cubins")
    ap.add_argument("--counts", help="--rows --path profile: folder of cov_hd<d>.json line counts of the same commit's "
                                     "emulated kernels (tools/perf_counts.sh; default build/peer_sass/4d9dcbd/counts)")
    ap.add_argument("--path", default="loop", choices=PATH_RULES,
                    help="--rows: what one loop iteration issues: the whole loop, or the interior path (sass.hot_path)")
    a = ap.parse_args(argv)
    dev = DEVICES[a.device]
    if a.rows:
        import perf_rows
        return perf_rows.main(a)
    rows = []
    for p in a.paths:
        res = sass.resources(p)
        names = None
        for fn, (arch, insns, loop) in read_kernels(p, dev, a.arch).items():
            if loop is None:
                continue
            names = names or sass.demangle([f for _, f in res] + [fn])
            dn = names.get(fn, fn)
            if a.filter not in dn:
                continue
            lc = loop_cost(insns, loop[0], dev)
            r = res.get((arch, fn), {})
            rows.append({"arch": arch, "kernel": dn[:150], "regs": r.get("reg"), "loop_insns": lc.n, "mma": lc.mma,
                         "non_mma_per_mma": round((lc.n - lc.mma) / lc.mma, 2), "issue": lc.issue,
                         "tensor": round(lc.tensor, 1), "fma": lc.fma, "alu": lc.alu, "mufu": lc.mufu,
                         "shared_B": lc.shared_bytes, "gmem_B": lc.gmem_bytes, "chain": round(lc.chain),
                         "stalls": lc.stalls, "waits": round(lc.waits), "bank": lc.bank,
                         "cpi_w2": round(lc.cycles(2, 8, dev)[0]), "bound_w2": lc.cycles(2, 8, dev)[1]})
    if a.json:
        print(json.dumps(rows, indent=1))
    else:
        cols = ["arch", "regs", "loop_insns", "mma", "non_mma_per_mma", "issue", "tensor", "fma", "alu", "mufu",
                "shared_B", "chain", "waits", "bank", "cpi_w2", "bound_w2"]
        print(" ".join(f"{c[:9]:>9}" for c in cols) + "  kernel")
        for r in rows:
            print(" ".join(f"{str(r[c])[:9]:>9}" for c in cols) + "  " + r["kernel"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
