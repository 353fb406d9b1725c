#!/usr/bin/env python3
"""Predicted figures for HEAD's kernels, from the SASS of a compiled extension or object, no GPU.

A bench case (the fields of bench/harness/grids.Case: kind, mode, batch, seqlen_q/k, nheads(_k), headdim, causal,
window, sink tokens, kv dtype) is mapped to the kernel that serves it and to that kernel's launch; tools/perf_model.py
costs the launch:

  sm80 forward, prefill   fwd_kernel<Hd{d}Rows, Softcap 0> (hd256 on sm90: Hd256Staggered): one CTA per (batch, head,
                          block_m rows), each walking
                          the key blocks its rows see (causal / window / sink tokens counted block by block)
  sm80 backward           bwd_kernel<Hd{d}, Softcap 0>: one CTA per (batch, head, block_n keys), each walking the
                          query blocks that see its keys. Only the main kernel: the dO.O preprocess, the dQ
                          postprocess (and dsinks) launches and the dQ fp32 atomics' L2 traffic are NOT costed
  sm80 decode (bf16/FP8)  the tile choose_fwd_tile picks (csrc/sm80/fwd_tiles.h), bound by bytes in flight
                          (perf_model.decode_gbs, Little's law) with perf_model.LOADED_LAT, which is NOT fitted yet;
                          split-KV assumed to fill every SM; launch latency not costed
  sm90 forward            fwd_kernel<FwdTileOf<d>> (csrc/sm90/fwd_tiles.h): persistent, one CTA per SM, two
                          consumer warpgroups run the loop, tiles of 128 rows x block_n keys dealt round-robin

The tile tables are read from the headers in csrc/ (one table, as the kernels read it); the device is the one whose
SASS is read: sm_80 -> A100, sm_90 / sm_90a -> H200 (perf_model.DEVICES).

    python3 tools/perf_predict.py sinkattn/_C*.so --device a100            # a markdown table
    python3 tools/perf_predict.py /path/fwd_sm90_hdim64_bf16.cu.o --device h200 --family sm90
    python3 tools/perf_predict.py <fwd_sm80_hdim{64,128,256}_bf16 object or the .so> --device h200 --counts DIR
        (DIR: `PERF_COUNTS_BWD=1 OUT=DIR bash tools/perf_counts.sh 64 128 256` on the same checkout; the sm80
        prefill and backward rows of bench/RESULTS.md by the profile rule; bwd_sm80_hdim{64,128,256}_bf16 for the
        backward's); --fa2 build/peer_sass/fa2_torch adds FlashAttention-2's figure by the same model and the ratio
    python3 tools/perf_predict.py <object> --device a100 --counts DIR --fa2 DIR2 --trace hd256/h8kv8/full [--gap 100]
        where one iteration of that case's loop spends its cycles, ours and FA2's (perf_model.warp_waits): the waits
        by reason and opcode, and the stretches without an MMA
"""
from __future__ import annotations

import argparse
import glob
import math
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, REPO)
import perf_model as pm  # noqa: E402
import sass  # noqa: E402
from bench.harness import flops as F  # noqa: E402  (no torch import: pure arithmetic)


# ---- the tile tables, from the headers -----------------------------------------------------------------------------

def _macro_table(path: str, macro: str, fields: list[str], defaults: dict) -> dict[str, dict]:
    """{tile name: {field: value}} from the `MACRO(Name, a, b, ...)` lines of a header."""
    out = {}
    for m in re.finditer(macro + r"\((\w+),\s*([-\d,\s]+)\)", open(path).read()):
        vals = [int(v) for v in m.group(2).replace(" ", "").split(",") if v]
        out[m.group(1)] = {**defaults, **dict(zip(fields, vals))}
    return out


def sm80_fwd_tiles(repo: str = REPO) -> dict[str, dict]:
    return _macro_table(os.path.join(repo, "csrc/sm80/fwd_tiles.h"), "SINKATTN_(?:FWD|PREFILL)_TILE",
                        ["head_dim", "block_m", "block_n", "warps", "stages", "key_groups", "q_regs", "s_ahead",
                         "branch_free_loads", "ctas_per_sm"],
                        {"stages": 2, "key_groups": 1, "q_regs": 0, "s_ahead": 0, "branch_free_loads": 0,
                         "ctas_per_sm": 0})


def sm80_bwd_tiles(repo: str = REPO) -> dict[str, dict]:
    return _macro_table(os.path.join(repo, "csrc/sm80/bwd_tiles.h"), "SINKATTN_BWD_TILE",
                        ["head_dim", "block_m", "block_n", "warps_m", "warps_n", "stages"], {})


def _sm90_tile_table(repo: str, header: str, struct: str, fields: list[str], defaults: list[int]) -> dict[int, dict]:
    """{head dim: tile} of a header's `template <> struct <struct><d> { ... tile{v0, v1, ...} }` lines: the leading
    values named by `fields`, those the line leaves out taken from `defaults` (the struct's, in field order)."""
    text = open(os.path.join(repo, "csrc/sm90", header)).read()
    out = {}
    for m in re.finditer(struct + r"<(\d+)>\s*\{[^{]*tile\{([\d,\s]+)\}", text):
        v = [int(x) for x in m.group(2).replace(" ", "").split(",") if x]
        v = (v + defaults[len(v) - (len(fields) - len(defaults)):])[:len(fields)]
        out[int(m.group(1))] = dict(zip(fields, v))
    return out


def sm90_bwd_tiles(repo: str = REPO) -> dict[int, dict]:
    """csrc/sm90/bwd_tiles.h: `BwdTileOf<d> { ... tile{d, block_m[, block_n, stages, ...]} }` (BwdTile's defaults:
    128 keys, two stages)."""
    return _sm90_tile_table(repo, "bwd_tiles.h", "struct BwdTileOf", ["head_dim", "block_m", "block_n", "stages"],
                            [128, 2])


def sm90_bwd_smem(t: dict) -> int:
    """BwdTile::smem_bytes (csrc/sm90/bwd_tiles.h): Q and dO per stage, K and V, dS twice, then the rows."""
    tiles = (2 * t["stages"] * t["block_m"] * t["head_dim"] + 2 * t["block_n"] * t["head_dim"]
             + 2 * t["block_m"] * t["block_n"]) * 2
    rows = t["stages"] * t["block_m"] * 2 * 4 + 256
    return tiles + (rows + 1023) // 1024 * 1024


def sm90_fwd_smem(t: dict) -> int:
    """FwdTile::smem_bytes (csrc/sm90/fwd_tiles.h) of a table tile (one Q buffer): Q, the stages' K and V, the
    barriers' 1024 bytes."""
    return (t["block_m"] + 2 * t["stages"] * t["block_n"]) * t["head_dim"] * 2 + 1024


def sm90_fwd_tiles(repo: str = REPO) -> dict[int, dict]:
    """csrc/sm90/fwd_tiles.h: `FwdTileOf<d> { ... tile{d, block_n, stages[, producer, consumer]} }`; 128 rows."""
    tiles = _sm90_tile_table(repo, "fwd_tiles.h", "struct FwdTileOf", ["head_dim", "block_n", "stages"], [])
    return {d: {**t, "block_m": 128} for d, t in tiles.items()}


def fwd_smem(t: dict) -> int:
    """FwdTile::smem_bytes of a table row: Q plus `stages` K and V blocks, 2-byte elements."""
    return (t["block_m"] + 2 * t["stages"] * t["block_n"]) * t["head_dim"] * 2


def fits_per_sm(t: dict, smem_cap: int, ctas: int) -> bool:
    """Whether the per-block limit says an SM holds `ctas` CTAs of this tile (1 KB reserved per CTA): choose_fwd_tile's
    fits_per_sm, for the tiles that want two CTAs per SM: sm90's hd256 staggered tile, the two-CTA hd64 (sm80, sm90)
    and hd128 (sm80) tiles."""
    return smem_cap >= ctas * (fwd_smem(t) + 1024)


def sm80_decode_tile(tiles: dict, hd: int, rows: int, smem_cap: int) -> str:
    """The name of the tile choose_fwd_tile (csrc/sm80/fwd_tiles.h) picks for a few-row (decode) problem."""
    kg = 4 if rows <= 16 else 2 if rows <= 32 else 1
    if hd == 256 and (kg != 4 or fwd_smem(tiles["Hd256Keys4"]) > smem_cap):
        # no two-group tile at hd256: 64 rows, staggered where two CTAs fit (sm90), else double-buffered
        if fits_per_sm(tiles["Hd256Staggered"], smem_cap, 2):
            return "Hd256Staggered"
        return "Hd256Few" if fwd_smem(tiles["Hd256Few"]) <= smem_cap else "Hd256RowsSmall"
    base = {4: "Keys4", 2: "Keys2", 1: "Few"}[kg]
    name = f"Hd{hd}{base}"
    if name in tiles and fwd_smem(tiles[name]) > smem_cap and f"{name}Small" in tiles:
        name += "Small"
    return name


def sm80_prefill_tile(tiles: dict, hd: int, smem_cap: int) -> str:
    """The name of the tile choose_fwd_tile picks for a prefill problem: Hd{d}Rows, except at hd256 the staggered
    tile where two of them fit the per-block limit (sm90), at hd128 the branch-free-loads tile above sm8x's 163 KB
    (sm90) and the two-CTA tile where two of it fit (sm80), at hd64 the two-CTA tile where two of it fit (sm80, sm90),
    and the Small one where Rows does not fit (sm86/89)."""
    if hd == 64 and "Hd64RowsTwoCtas" in tiles and fits_per_sm(tiles["Hd64RowsTwoCtas"], smem_cap, 2):
        return "Hd64RowsTwoCtas"
    if hd == 128 and "Hd128RowsSm90" in tiles and smem_cap > 163 * 1024:
        return "Hd128RowsSm90"
    if hd == 128 and "Hd128RowsTwoCtas" in tiles and fits_per_sm(tiles["Hd128RowsTwoCtas"], smem_cap, 2):
        return "Hd128RowsTwoCtas"
    if hd == 256 and "Hd256Staggered" in tiles and fits_per_sm(tiles["Hd256Staggered"], smem_cap, 2):
        return "Hd256Staggered"
    name = f"Hd{hd}Rows"
    if name in tiles and fwd_smem(tiles[name]) > smem_cap and f"{name}Small" in tiles:
        name += "Small"
    return name


# ---- the problem's iterations ----------------------------------------------------------------------------------------

def _window(case: dict) -> tuple[int, int]:
    return F.normalize_window(bool(case.get("causal")), (int(case.get("window_left", -1)),
                                                         int(case.get("window_right", -1))))


def _row_block_walk(sq: int, sk: int, bm: int, bn: int, wl: int, wr: int, st: int) -> list[tuple[int, int]]:
    """Per block of bm query rows: (key blocks it visits, of those the ones the mask cuts). Bottom-right aligned
    causal / window; sink tokens: the first block, added (and counted as cut) when the window leaves it out. A
    block is cut where some of the row block's (query, key) pairs are hidden: the causal diagonal's, the window's
    edges."""
    out = []
    off = sk - sq
    for i in range(-(-sq // bm)):
        r0, r1 = i * bm + off, min(sq, (i + 1) * bm) - 1 + off  # key index of the diagonal of the first, last row
        lo = 0 if wl < 0 else max(0, r0 - wl)
        hi = sk - 1 if wr < 0 else min(sk - 1, r1 + wr)
        n = max(0, hi // bn - lo // bn + 1) if hi >= lo else 0
        cut = sum(1 for j in range(lo // bn, lo // bn + n)
                  if (wr >= 0 and min(sk, (j + 1) * bn) - 1 > r0 + wr) or (wl >= 0 and j * bn < r1 - wl))
        sink = 1 if st and lo // bn > 0 else 0
        out.append((n + sink, cut + sink))
    return out


def key_blocks_per_row_block(sq: int, sk: int, bm: int, bn: int, wl: int, wr: int, st: int) -> list[int]:
    """Key blocks each block of bm query rows visits (_row_block_walk)."""
    return [n for n, _ in _row_block_walk(sq, sk, bm, bn, wl, wr, st)]


def masked_blocks_per_row_block(sq: int, sk: int, bm: int, bn: int, wl: int, wr: int, st: int) -> list[int]:
    """Of key_blocks_per_row_block's blocks, those the mask cuts (_row_block_walk)."""
    return [m for _, m in _row_block_walk(sq, sk, bm, bn, wl, wr, st)]


def query_blocks_per_key_block(sq: int, sk: int, bm: int, bn: int, wl: int, wr: int, st: int) -> list[int]:
    """Query blocks that see each block of bn keys (the backward's loop)."""
    off = sk - sq
    n_m = -(-sq // bm)
    out = []
    for j in range(-(-sk // bn)):
        k0, k1 = j * bn, min(sk, (j + 1) * bn) - 1
        n = 0
        for i in range(n_m):
            r0, r1 = i * bm + off, min(sq, (i + 1) * bm) - 1 + off
            lo = -1 if wl < 0 else r0 - wl
            hi = sk if wr < 0 else r1 + wr
            sees = (k0 <= hi and k1 >= lo) or (st and k0 < st)
            n += bool(sees)
        out.append(n)
    return out


# ---- reading the kernels -----------------------------------------------------------------------------------------

class Kernels:
    """The SASS and resources of one file, read once; find() by mangled-name fragments."""

    def __init__(self, path: str, dev: pm.Device):
        self.path, self.dev = path, dev
        self.code = sass.disassemble(path)
        self.res = sass.resources(path)

    def cubin_with(self, fn: str) -> str:
        """The cubin of this file (for the device's arch) that holds kernel fn: nvdisasm -gi reads cubins only."""
        import atexit
        import shutil
        import tempfile
        import perf_counts
        if not hasattr(self, "_cubins"):
            self._dir = tempfile.mkdtemp(prefix="sinkattn-cubins-")
            atexit.register(shutil.rmtree, self._dir, ignore_errors=True)  # extracted per object read: removed at exit
            perf_counts.cubin_of(self.path, self.dev.arch, self._dir)  # extracts every cubin of the file
            self._cubins = sorted(os.path.join(self._dir, f) for f in os.listdir(self._dir)
                                  if f.endswith(f".{self.dev.arch.rstrip('a')}.cubin"))
        return next(c for c in self._cubins if fn.encode() in open(c, "rb").read())

    def find(self, *needles: str):
        for (a, fn), insns in sorted(self.code.items()):
            if a.rstrip("a") != self.dev.arch.rstrip("a") or not all(n in fn for n in needles):
                continue
            loop = sass.hot_loop(insns)
            if loop is None:
                continue
            return a, fn, insns, loop, self.res.get((a, fn), {})
        return None


def _tile_needle(ns: str, name: str) -> str:
    return f"{ns}{len(name)}{name}E"  # Itanium mangling of sinkattn::sm80::fwd_tiles::Hd64Rows: 9fwd_tiles8Hd64RowsE


# ---- one case ---------------------------------------------------------------------------------------------------

NOTE_FWD = "HMMA/HGMMA rate and latencies of the device table; the whole loop body (masked path too) every iteration"
NOTE_PROFILE = ("the loop's path and a CTA's once-issued blocks from the emulated kernel's line counts "
                "(tools/perf_counts.py, --path profile)")


def counts_mismatch(counts_dir: str, dev: pm.Device, problem: str = "prefill") -> str | None:
    """Why the line counts in counts_dir cannot cost dev's kernels on `problem` ("prefill": the prefill forward and
    backward; "decode <page size>"), or None. The emulated problem ran the tile its shared memory per block picks
    (tools/perf_counts.sh PERF_COUNTS_SMEM_KB, recorded in smem_kb): an A100 costed on an H200's counts finds its
    tile's lines barely run (the other tile ran) and prints a figure for a path nobody ran. And a decode step's
    counts say nothing of a prefill's branches (recorded in `problem`)."""
    want = dev.smem_block // 1024
    page = problem.split()[1] if problem.startswith("decode") else None
    fix = (f"PERF_COUNTS_SMEM_KB={want} " + (f"PERF_COUNTS_DECODE={page} " if page else "") +
           f"OUT={counts_dir} bash tools/perf_counts.sh")
    rec, kind = os.path.join(counts_dir, "smem_kb"), os.path.join(counts_dir, "problem")
    if not os.path.exists(rec) or not os.path.exists(kind):
        return f"line counts in {counts_dir} do not say which tiles ran on which problem (smem_kb, problem): {fix}"
    have = int(open(rec).read().strip() or 0)
    if have != want:
        return f"line counts in {counts_dir} ran the tiles of {have} KB per block, {dev.name} allows {want} KB: {fix}"
    ran = open(kind).read().strip()
    if ran != problem:
        return f"line counts in {counts_dir} are of a {ran} problem, not of a {problem} one: {fix}"
    return None


def profile_of(ks: Kernels, fn: str, insns, loop, counts_dir: str, hd: int, name: str, op: str = "fwd"):
    """(path, outside) of an sm80 forward (op "fwd") or backward ("bwd") tile by the line counts in counts_dir
    (tools/perf_counts.sh of the same checkout; the backward's with PERF_COUNTS_BWD=1), or None without them."""
    import perf_counts
    cov = os.path.join(counts_dir, f"cov_hd{hd}.json")
    if not os.path.exists(cov):
        return None
    # the emulated instantiation of the same kernel: softcap compiled out (E0) or at run time (E1), as the GPU one
    cap = re.search(r"7SoftcapE(\d)E", fn)
    emu = _tile_needle(f"{op}_tiles", name)[1:] + \
        f"N7cutlass10bfloat16_tENS_5emu808EmuPrimsELNS_7SoftcapE{cap.group(1) if cap else 0}E"
    body = f"sm80/{op}_kernel.h"
    if not perf_counts.gcov_counts(cov, emu, body):
        return None
    return perf_counts.profile(ks.cubin_with(fn), fn, insns, loop, cov, emu, body)
NOTE_BWD = ("main kernel only: the preprocess/postprocess launches and dQ's fp32 atomics (L2) are not costed; "
            "on FA2 the same model was +13 to +48% high")
NOTE_FWD90 = ("wgmma queued, its operands read from shared memory; the key-block loop per block (PERF_SM90_PATH), cut "
              "blocks on the mask's path, the tile loop's rest once per tile, tiles dealt in the static schedule's "
              "order; the producer warp and the ping-pong barriers not modelled")
NOTE_BWD90 = ("wgmma queued, the M-step loop per step (PERF_SM90_PATH); main kernel only: the pre/postprocess "
              "launches and dQ's fp32 atomics (L2) are not costed; never run on a GPU (SM90_BWD_VALIDATED)")
NOTE_DEC = ("LOADED_LAT = {lat:.0f} ns is a placeholder, NOT fitted; split-KV assumed to fill every SM; launch "
            "latency not costed")


# What one trip of an sm90 kernel's loop issues (the forward's key-block loop, the backward's M-step loop): "loop",
# the loop whole (every branch each trip), or "mma", its interior path (sass.hot_path: the most MMAs, then the
# fewest instructions). docs/internals.md ("The sm90 kernels in the model") has 4d9dcbd's measured rows under both.
SM90_PATH = os.environ.get("PERF_SM90_PATH", "mma")


def sm90_fwd_kernel(fn, insns, loop, res, dev, smem: int, masked: bool = False) -> pm.Kernel:
    """The sm90 forward's model: persistent, so the loop holding the most MMAs (`loop`) is the tile loop around
    the key-block loop; the key-block loop is costed per block (SM90_PATH) and the rest of the tile loop's body
    once per tile (make_kernel's `outside`, charged per tile by kernel_time_s). The two consumer warpgroups run
    the loop (8 warps of the 384). masked: a block the mask cuts, by the longest path with the most MMAs (the
    mask's branch; no line counts say which branches it takes)."""
    inner = sass.hot_loop(insns, innermost=True) or loop
    idx = sass.hot_path(insns, inner, then=lambda i: True) if masked else None
    return pm.make_kernel(fn, insns, inner, res, dev, 384, smem, loop_warps=8, path=SM90_PATH, idx=idx,
                          outside=max(0, len(loop[0]) - len(inner[0])))


def predict_case(ks: Kernels, case: dict, family: str, repo: str = REPO, counts_dir: str | None = None) -> dict:
    """{value, unit, kernel, bound, note} for one case on one kernel family ('sm80' or 'sm90'), or {error}. With
    counts_dir (line counts of the emulated kernels, tools/perf_counts.sh; PERF_COUNTS_BWD=1 for the backward's) the
    sm80 prefill forward and backward are costed on the path they say (the `profile` rule); every other case has no
    such prediction ({error})."""
    dev = ks.dev
    hd, b, h, hk = int(case["headdim"]), int(case["batch"]), int(case["nheads"]), int(case["nheads_k"])
    sq, sk = int(case["seqlen_q"]), int(case["seqlen_k"])
    wl, wr = _window(case)
    st = int(case.get("sink_tokens") or 0)
    kind, mode = case["kind"], case["mode"]
    fp8 = str(case.get("kv_dtype", "auto")) not in ("auto", "")
    if family == "sm90" and counts_dir:
        return {"error": "the profile rule costs the sm80 prefill forward and backward only"}
    if family == "sm90":
        if kind != "attn":
            return {"error": "sm90: only attention's forward and backward are modelled"}
        if mode == "bwd":
            t = sm90_bwd_tiles(repo).get(hd)
            hit = t and ks.find("sm9010bwd_kernel", f"BwdTileOfILi{hd}EE")
            if not hit:
                return {"error": f"sm90 backward hd{hd}: not in this build" +
                        ("" if t else " (no sm90 backward tile: the sm80 backward serves it)")}
            a, fn, insns, loop, res = hit
            # a producer warpgroup and two consumer warpgroups of 64 keys each; the consumers run the M-step loop
            # the `mma` rule's interior step adds its dQ (fp32 atomics), which a shorter path skips; the deterministic
            # mode's turn (integer atomics on a semaphore) is off it
            idx = sass.hot_path(insns, loop, then=lambda i: i.base in ("ATOMG", "RED", "REDG") and ".F32" in i.op) \
                if SM90_PATH == "mma" else None
            k = pm.make_kernel(fn, insns, loop, res, dev, 384, sm90_bwd_smem(t), loop_warps=8, path=SM90_PATH, idx=idx)
            its = query_blocks_per_key_block(sq, sk, t["block_m"], t["block_n"], wl, wr, st) * (b * h)
            r = pm.kernel_time_s(k, dev, len(its), its)
            fl = F.attention_flops(b, h, hd, sq, sk, causal=bool(case.get("causal")), window_size=(wl, wr),
                                   sink_tokens=st, mode="bwd")
            return {"value": fl / r["time"] / 1e12, "unit": "TFLOP/s", "kernel": f"sm90 bwd BwdTileOf<{hd}>",
                    "bound": f"{r['bound']} (W={r['w']})", "note": NOTE_BWD90, "model": (k, r["w"])}
        t = sm90_fwd_tiles(repo).get(hd)
        hit = t and ks.find("sm9010fwd_kernel", f"FwdTileOfILi{hd}EE")
        if not hit:
            return {"error": f"sm90 forward hd{hd}: not in this build"}
        a, fn, insns, loop, res = hit
        smem = sm90_fwd_smem(t)
        k = sm90_fwd_kernel(fn, insns, loop, res, dev, smem)
        # a block the mask cuts takes the mask's path: in units of an interior block (`mma` rule only)
        cut = sm90_fwd_kernel(fn, insns, loop, res, dev, smem, masked=True) if SM90_PATH == "mma" else k
        w = math.ceil(k.loop_warps / 4)
        ratio = cut.iteration_cycles(w, dev) / k.iteration_cycles(w, dev)
        blocks = key_blocks_per_row_block(sq, sk, t["block_m"], t["block_n"], wl, wr, st)
        masked = masked_blocks_per_row_block(sq, sk, t["block_m"], t["block_n"], wl, wr, st)
        # the persistent schedule's tile order: each (batch, head)'s M blocks from the last down
        its = [n - m + m * ratio for n, m in zip(blocks, masked)][::-1] * (b * h)
        r = pm.kernel_time_s(k, dev, len(its), its, persistent=True)
        fl = F.attention_flops(b, h, hd, sq, sk, causal=bool(case.get("causal")), window_size=(wl, wr),
                               sink_tokens=st)
        return {"value": fl / r["time"] / 1e12, "unit": "TFLOP/s", "kernel": f"sm90 FwdTileOf<{hd}>",
                "bound": f"{r['bound']} (W={r['w']})", "note": NOTE_FWD90, "model": (k, r["w"])}
    fwd_t, bwd_t = sm80_fwd_tiles(repo), sm80_bwd_tiles(repo)
    if kind == "attn" and mode == "fwd" and sq * (h // max(hk, 1)) > 64:
        name = sm80_prefill_tile(fwd_t, hd, dev.smem_block)
        t = fwd_t.get(name)
        hit = t and (ks.find("sm8010fwd_kernel", _tile_needle("fwd_tiles", name), "SoftcapE0")
                     or ks.find("sm8010fwd_kernel", _tile_needle("fwd_tiles", name)))
        if not hit:
            return {"error": f"sm80 forward {name}: not in this build"}
        a, fn, insns, loop, res = hit
        if counts_dir and (err := counts_mismatch(counts_dir, dev)):
            return {"error": err}
        prof = profile_of(ks, fn, insns, loop, counts_dir, hd, name) if counts_dir else None
        if counts_dir and not prof:
            return {"error": f"no line counts for hd{hd} in {counts_dir}"}
        k = pm.make_kernel(fn, insns, loop, res, dev, 32 * t["warps"], fwd_smem(t),
                           idx=prof[0] if prof else None, outside=prof[1] if prof else None)
        its = key_blocks_per_row_block(sq, sk, t["block_m"], t["block_n"], wl, wr, st) * (b * h)
        r = pm.kernel_time_s(k, dev, len(its), its)
        fl = F.attention_flops(b, h, hd, sq, sk, causal=bool(case.get("causal")), window_size=(wl, wr),
                               sink_tokens=st)
        return {"value": fl / r["time"] / 1e12, "unit": "TFLOP/s", "kernel": f"sm80 fwd {name}",
                "bound": f"{r['bound']} (W={r['w']})", "note": NOTE_PROFILE if prof else NOTE_FWD, "model": (k, r["w"])}
    if kind == "attn" and mode == "bwd":
        name = f"Hd{hd}"
        t = bwd_t.get(name)
        hit = t and ks.find("sm8010bwd_kernel", _tile_needle("bwd_tiles", name), "SoftcapE0")
        if not hit:
            return {"error": f"sm80 backward {name}: not in this build"}
        a, fn, insns, loop, res = hit
        if counts_dir and (err := counts_mismatch(counts_dir, dev)):
            return {"error": err}
        prof = profile_of(ks, fn, insns, loop, counts_dir, hd, name, "bwd") if counts_dir else None
        if counts_dir and not prof:
            return {"error": f"no backward line counts for hd{hd} in {counts_dir} (PERF_COUNTS_BWD=1)"}
        warps = t["warps_m"] * t["warps_n"]
        smem = (t["stages"] * 2 * t["block_m"] * hd + 2 * t["block_n"] * hd + 2 * t["block_m"] * t["block_n"]) * 2
        k = pm.make_kernel(fn, insns, loop, res, dev, 32 * warps, smem, idx=prof[0] if prof else None,
                           outside=prof[1] if prof else None)
        its = query_blocks_per_key_block(sq, sk, t["block_m"], t["block_n"], wl, wr, st) * (b * h)
        r = pm.kernel_time_s(k, dev, len(its), its)
        fl = F.attention_flops(b, h, hd, sq, sk, causal=bool(case.get("causal")), window_size=(wl, wr),
                               sink_tokens=st, mode="bwd")
        return {"value": fl / r["time"] / 1e12, "unit": "TFLOP/s", "kernel": f"sm80 bwd {name}",
                "bound": f"{r['bound']} (W={r['w']})", "note": NOTE_BWD + ("; " + NOTE_PROFILE if prof else ""),
                "model": (k, r["w"])}
    if counts_dir and (fp8 or kind != "decode"):
        return {"error": "the profile rule costs the sm80 prefill forward and backward and the bf16/fp16 decode only"}
    # decode / few rows: memory-bound
    rows = sq * (h // max(hk, 1))
    name = sm80_decode_tile(fwd_t, hd, rows, dev.smem_block)
    t = fwd_t.get(name)
    kern = "sm8014fwd_fp8_kernel" if fp8 else "sm8010fwd_kernel"
    hit = t and ks.find(kern, _tile_needle("fwd_tiles", name))
    if not hit:
        return {"error": f"sm80 {'FP8 ' if fp8 else ''}decode {name}: not in this build"}
    a, fn, insns, loop, res = hit
    smem = (t["block_m"] * hd * 2 + 2 * t["stages"] * t["block_n"] * hd + 2 * t["block_n"] * hd * 2) if fp8 else \
        fwd_smem(t)
    if counts_dir:  # the decode step's own counts over this kind of cache: <counts>_decode_p<page size>
        return predict_decode_profile(ks, case, name, t, hit, smem, decode_counts(counts_dir, case))
    k = pm.make_kernel(fn, insns, loop, res, dev, 32 * t["warps"], smem)
    eb = 1 if fp8 else 2
    by = F.decode_bytes(b, h, hk, hd, sk, elem_bytes=eb, seqlen_q=sq, causal=bool(case.get("causal")),
                        window_size=(wl, wr), sink_tokens=st) + 2 * b * sq * h * hd * (2 - eb)
    n_ctas = max(b * hk * -(-rows // t["block_m"]), dev.sms)
    r = pm.decode_gbs(k, dev, n_ctas, by, pm.groups_in_flight(insns, loop[0]))
    return {"value": r["gbs"], "unit": "GB/s", "kernel": f"sm80 {'fp8 ' if fp8 else ''}decode {name}",
            "bound": f"{r['inflight_per_sm'] // 1024} KB in flight/SM", "note": NOTE_DEC.format(lat=pm.LOADED_LAT)}


def decode_counts(counts_dir: str, case: dict) -> str:
    """Where the line counts of a decode step over the case's kind of cache are (tools/perf_counts.sh
    PERF_COUNTS_DECODE=<page size>, 0 for a contiguous cache): beside the prefill's, `<counts>_decode_p<page>`."""
    import perf_counts
    paged = str(case.get("paged")) in ("True", "true", "1")
    return perf_counts.decode_dir(counts_dir, int(case.get("page_size") or 0) if paged else 0)


def predict_decode_profile(ks: Kernels, case: dict, name: str, t: dict, hit, smem: int, counts: str) -> dict:
    """A decode launch on the path its emulated step ran (perf_rows.predict_decode: the computing warps' loop against
    the copy ceiling; no split, one CTA per request and KV head; 4d9dcbd's contiguous rows: -21% to -1%)."""
    import perf_rows
    dev = ks.dev
    page = counts.rsplit("_p", 1)[1]
    err = counts_mismatch(counts, dev, f"decode {page}")
    if err:
        return {"error": err}
    a, fn, insns, loop, res = hit
    hd, b, hk, sk = int(case["headdim"]), int(case["batch"]), int(case["nheads_k"]), int(case["seqlen_k"])
    if int(case["seqlen_q"]) != 1 or int(case["nheads"]) != 8 * hk or case.get("window_left", -1) not in (-1, "-1"):
        return {"error": "the decode profile costs one query per request, 8 query heads per KV head, no window"}
    prof = profile_of(ks, fn, insns, loop, counts, hd, name)
    if not prof:
        return {"error": f"no decode line counts for hd{hd} in {counts}"}
    k = pm.make_kernel(fn, insns, loop, res, dev, 32 * t["warps"], smem, idx=prof[0], outside=prof[1])
    gbs, r = perf_rows.predict_decode(k, dev, b, hk, sk, hd, t["block_m"], t["block_n"])
    return {"value": gbs, "unit": "GB/s", "kernel": f"sm80 decode {name}", "bound": f"{r['bound']} (W={r['w']})",
            "note": "the computing warps' path from the emulated decode step's line counts (--path profile) against "
                    "the copy ceiling; launch and tail not costed"}


# ---- the cases of the measured rows ------------------------------------------------------------------------------

def case(kind, mode, b, sq, sk, h, hk, hd, causal=False, wl=-1, wr=-1, st=0, sinks=False, paged=False,
         kv_dtype="auto", page_size=256) -> dict:
    c = dict(kind=kind, mode=mode, batch=b, seqlen_q=sq, seqlen_k=sk, nheads=h, nheads_k=hk, headdim=hd,
             causal=causal, window_left=wl, window_right=wr, sink_tokens=st, sinks=sinks, paged=paged,
             kv_dtype=kv_dtype, page_size=page_size if paged else 0)
    mask = f"win{wl + 1}" if wl >= 0 else "causal" if causal else "full"
    c["variant"] = f"{kind}/{mode}/hd{hd}/h{h}kv{hk}/{mask}" + ("/sinks" if sinks else "") + \
        (f"/paged{page_size}" if paged else "") + (f"/{kv_dtype}" if kv_dtype != "auto" else "")
    return c


# The hd64 bf16 shapes of bench/RESULTS.md's measured rows (4d9dcbd, d6ddcbf) and of the check grid
# (bench/harness/grids.check), the head dim the narrow build holds.
HD64_CASES = [
    case("attn", "fwd", 2, 8192, 8192, 64, 8, 64, True, 127, 0, sinks=True),
    case("attn", "fwd", 2, 8192, 8192, 64, 8, 64, True, -1, 0, sinks=True),
    case("attn", "fwd", 2, 8192, 8192, 32, 32, 64),
    case("attn", "fwd", 2, 8192, 8192, 32, 32, 64, True, -1, 0),
    case("attn", "fwd", 2, 8192, 8192, 32, 32, 64, sinks=True),
    case("attn", "bwd", 2, 8192, 8192, 64, 8, 64, True, 127, 0, sinks=True),
    case("attn", "bwd", 2, 8192, 8192, 32, 32, 64),
    case("attn", "bwd", 2, 8192, 8192, 32, 32, 64, True, -1, 0),
    case("decode", "fwd", 1, 1, 8192, 64, 8, 64, True, -1, 0, sinks=True),
    case("decode", "fwd", 64, 1, 8192, 64, 8, 64, True, -1, 0, sinks=True),
    case("decode", "fwd", 64, 1, 32768, 64, 8, 64, True, -1, 0, sinks=True),
    case("decode", "fwd", 64, 3, 32768, 64, 8, 64, True, -1, 0, sinks=True),
    case("decode", "fwd", 16, 1, 8192, 64, 8, 64, True, 127, 0, sinks=True),
    case("decode", "fwd", 64, 1, 32768, 64, 8, 64, True, -1, 0, sinks=True, kv_dtype="fp8_e4m3"),
]


# The prefill, backward and decode rows bench/RESULTS.md predicts by the profile rule (4d9dcbd's measured shapes,
# tools/perf_rows.py FWD, BWD and DECODE; the paged decode at pages of 256, as measured, and of 16, vLLM's).
PROFILE_CASES = [case("attn", "fwd", b, s, s, h, h, hd, causal)
                 for hd, h, shapes in ((64, 32, ((2, 8192),)), (128, 16, ((8, 2048), (2, 8192))), (256, 8, ((2, 8192),)))
                 for b, s in shapes for causal in (False, True)] + \
                [case("attn", "bwd", b, s, s, 16, 16, 128, causal) for b, s in ((8, 2048), (2, 8192)) for causal in (False, True)] + \
                [case("attn", "bwd", 2, 8192, 8192, h, h, hd, causal) for hd, h in ((64, 32), (256, 8))
                 for causal in (False, True)] + \
                [case("decode", "fwd", 64, 1, sk, 64, 8, hd, True, -1, 0, sinks=True) for hd, sk in ((64, 8192), (64, 32768), (128, 16384))] + \
                [case("decode", "fwd", 64, 1, sk, 64, 8, 64, True, -1, 0, sinks=True, paged=True, page_size=ps)
                 for ps in (256, 16) for sk in (8192, 32768)]


# --family sm90 without counts: the hd64 rows, then the attention rows above at head dims 128 and 256 (the sm90
# forward and backward have no line counts: their loops by SM90_PATH)
SM90_CASES = HD64_CASES + [c for c in PROFILE_CASES if c["kind"] == "attn" and c["headdim"] != 64]


def fa2_figure(fa2_dir: str, dev, c: dict, model: bool = False):
    """FlashAttention-2's figure for an attention case (dense, even-sized, bf16), predicted by the same model from
    its cubins (tools/perf_fa2_cubins.sh: the FA2 inside torch, SDPA's flash backend): its kernels keep the whole
    loop's interior path (no line counts of FA2 exist). None where no cubin holds the kernel. model: (figure,
    (its Kernel, warps per SMSP)) instead, for --trace."""
    import perf_rows as R
    if c["kind"] != "attn" or c["window_left"] >= 0 or c["sink_tokens"] or c["nheads"] != c["nheads_k"]:
        return None
    files = sorted(glob.glob(os.path.join(fa2_dir, "*.cubin")))
    hd, causal, bwd = c["headdim"], bool(c["causal"]), c["mode"] == "bwd"
    k = R.fa2_kernel(files, dev, hd, causal, bwd, path="profile")
    if not k:
        return None
    kern, bm, bn = k
    b, h, s = c["batch"], c["nheads"], c["seqlen_q"]
    value, r = (R.predict_bwd if bwd else R.predict_fwd)(kern, dev, b, h, s, hd, causal, bm, bn)
    return (value, (kern, r["w"])) if model else value


def mma_stretches(steps: list[dict], gap: float) -> list[tuple[float, float, int]]:
    """(from, to, instructions issued between) for each stretch longer than gap cycles in which the warp issued
    no MMA: where a loop's tensor work stops for its own warp (the barrier, the copies, the softmax), the first
    from the iteration's first instruction."""
    out, last, n = [], 0.0, 0
    for st in steps:
        if st["op"].split(".")[0] in ("HMMA", "HGMMA"):
            if st["at"] - last > gap:
                out.append((last, st["at"], n))
            last, n = st["at"], 0
        else:
            n += 1
    return out


def print_trace(label: str, model, dev, gap: float) -> None:
    """One loop's warp_waits (tools/perf_model.py) as text: where warp 0's cycles go in one iteration."""
    kern, w = model
    r = kern.waits(w, dev)
    print(f"{label}: {r['span']:.0f} cycles an iteration of warp 0 (W={r['w']} warps per SMSP, {r['cta_warps']} of "
          f"one CTA), tensor pipe busy {r['tensor_busy']:.0f}, {len(r['steps'])} instructions")
    print("  waits before issue, by reason and opcode (cycles, instructions):")
    for why, op, cyc, cnt in r["waits"][:12]:
        print(f"    {why:12s} {op:10s} {cyc:7.0f} {cnt:5d}")
    print(f"  stretches of more than {gap:.0f} cycles without an MMA of warp 0 (from, to, cycles, instructions):")
    for a, b, n in mma_stretches(r["steps"], gap):
        print(f"    {a:7.0f} {b:7.0f} {b - a:6.0f} {n:5d}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path")
    ap.add_argument("--device", default="a100", choices=sorted(pm.DEVICES))
    ap.add_argument("--family", default="sm80", choices=("sm80", "sm90"),
                    help="sm90: the sm90 forward and backward (sm_90a objects), on the hd64 rows and the hd128 / hd256 "
                         "attention rows, each loop by PERF_SM90_PATH")
    ap.add_argument("--counts", help="line counts of this checkout's emulated forward (tools/perf_counts.sh): the sm80 "
                                     "prefill and backward rows (PROFILE_CASES) by the profile rule instead of the hd64 cases")
    ap.add_argument("--fa2", help="folder of FlashAttention-2's cubins (tools/perf_fa2_cubins.sh): its figure, predicted "
                                  "by the same model, and ours / FA2 beside each attention row")
    ap.add_argument("--trace", metavar="CASE", help="instead of the table: where one loop iteration's cycles go for "
                    "the first case whose name holds CASE (with --fa2, FA2's loop beside it)")
    ap.add_argument("--gap", type=float, default=100.0, help="--trace: the shortest stretch without an MMA listed")
    a = ap.parse_args(argv)
    dev = pm.DEVICES[a.device]
    ks = Kernels(a.path, dev)
    cases = PROFILE_CASES if a.counts else SM90_CASES if a.family == "sm90" else HD64_CASES
    if a.trace:
        c = next((c for c in cases if a.trace in c["variant"]), None)
        if c is None:
            ap.error(f"--trace: no case holds {a.trace!r}")
        p = predict_case(ks, c, a.family, counts_dir=a.counts)
        print(f"{c['variant']}, {c['batch']} x {c['seqlen_q']}, {dev.name}, {pm.ITERS} iterations in phase")
        if "error" in p:
            print(f"ours: not predicted: {p['error']}")
        else:
            print_trace(f"ours ({p['kernel']}, {p['value']:.3g} {p['unit']})", p["model"], dev, a.gap)
        f = fa2_figure(a.fa2, dev, c, model=True) if a.fa2 else None
        if f:
            print_trace(f"FA2 ({f[0]:.3g} TFLOP/s)", f[1], dev, a.gap)
        return 0
    fa2 = ("| FA2 (predicted) | ours / FA2 ", "|---|---") if a.fa2 else ("", "")
    print(f"| case | batch | seqlen_q | seqlen_k | predicted ({dev.name}) | unit {fa2[0]}| kernel | bound | rests on |")
    print(f"|---|---|---|---|---|---{fa2[1]}|---|---|---|")
    for c in cases:
        p = predict_case(ks, c, a.family, counts_dir=a.counts)
        if "error" in p:  # said, not skipped: a case with no figure is a question for whoever reads the table
            print(f"| {c['variant']} | {c['batch']} | {c['seqlen_q']} | {c['seqlen_k']} | - | {'| | ' if a.fa2 else ''}"
                  f"| | | not predicted: {p['error']} |")
            continue
        cols = ""
        if a.fa2:
            f = fa2_figure(a.fa2, dev, c)
            cols = f"| {f:.3g} | {p['value'] / f:.2f} " if f else "| - | - "
        print(f"| {c['variant']} | {c['batch']} | {c['seqlen_q']} | {c['seqlen_k']} | {p['value']:.3g} | {p['unit']} "
              f"{cols}| {p['kernel']} | {p['bound']} | {p['note']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
