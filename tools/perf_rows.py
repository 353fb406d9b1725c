"""The measured rows tools/perf_model.py is checked against (bench/RESULTS.md: the H200 run at 4d9dcbd, 1980 MHz;
the backward rows from d6ddcbf's run: the sm80 backward kernel is the same source at both commits), and the kernel
each ran, found by its mangled name in the SASS given:

  ours   4d9dcbd's units, built by `SINKATTN_SRC=<4d9dcbd worktree> bash tools/peer_build_sinkattn.sh <unit>...`
         into --ours (default build/peer_sass/4d9dcbd/out: that script's out/ with
         PEER_SASS_DIR=build/peer_sass/4d9dcbd)
  FA2    SDPA's flash backend, the comparator measured: FlashAttention-2 inside torch's libtorch_cuda.so, whose sm_90
         cubins hold its kernels (extracted with `cuobjdump -xelf` into --fa2; tools/perf_fa2_cubins.sh)
  counts (--path profile) the line counts of 4d9dcbd's emulated forward, `SINKATTN_SRC=<4d9dcbd worktree>
         OUT=build/peer_sass/4d9dcbd/counts bash tools/perf_counts.sh 64 128`, into --counts; our forward kernels'
         iteration is then the path they say (tools/perf_counts.py), FA2's the whole loop; the decode rows' from a
         decode step over each kind of cache, `PERF_COUNTS_DECODE=<0 | 256> OUT=<counts>_decode_p<page> ...
         tools/perf_counts.sh 64 128` (perf_counts.decode_dir)

The forward and backward rows in TFLOP/s beside FA2's, then the decode rows (DECODE) in GB/s.

    python3 tools/perf_model.py --rows [--ours DIR] [--fa2 DIR] [--path loop|mma|mma+loads|profile] [--counts DIR]
"""
from __future__ import annotations

import glob
import os
import re
import sys

import perf_model as pm
import sass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.harness import flops as F  # noqa: E402  (no torch import: pure arithmetic)

# (case, batch, heads, seqlen, head dim, causal, measured TFLOP/s: ours sm80, FA2)
FWD = [
    ("attn/fwd/hd128/h16kv16/full", 8, 16, 2048, 128, False, 200, 347),
    ("attn/fwd/hd128/h16kv16/full", 2, 16, 8192, 128, False, 208, 353),
    ("attn/fwd/hd128/h16kv16/causal", 8, 16, 2048, 128, True, 172, 286),
    ("attn/fwd/hd128/h16kv16/causal", 2, 16, 8192, 128, True, 196, 315),
    ("attn/fwd/hd64/h32kv32/full", 2, 32, 8192, 64, False, 182, 308),
    ("attn/fwd/hd64/h32kv32/causal", 2, 32, 8192, 64, True, 176, 295),
    ("attn/fwd/hd256/h8kv8/full", 2, 8, 8192, 256, False, 173, 320),
    ("attn/fwd/hd256/h8kv8/causal", 2, 8, 8192, 256, True, 175, 291),
]
BWD = [  # d6ddcbf's run
    ("attn/bwd/hd128/h16kv16/full", 8, 16, 2048, 128, False, 83.8, 268),
    ("attn/bwd/hd128/h16kv16/full", 2, 16, 8192, 128, False, 92.4, 304),
    ("attn/bwd/hd128/h16kv16/causal", 8, 16, 2048, 128, True, 71.3, 219),
    ("attn/bwd/hd128/h16kv16/causal", 2, 16, 8192, 128, True, 87.6, 283),
]
FIT_POINT = ("attn/fwd/hd128/h16kv16/full", 2, "FA2")  # HMMA_SM90 is fitted here (perf_model's docstring)
# 4d9dcbd's decode rows (gpt-oss / Llama-70B heads: 64 query heads over 8 KV heads, one query per request, a contiguous
# cache or pages of 256 rows): (case, batch, seqlen_k, head dim, page size (0: contiguous), measured GB/s). Its decode
# tiles (csrc/sm80/fwd_config.h at 4d9dcbd): 64 rows x block_n keys, 4 warps, 3 stages; a request's 8 rows are warp
# 0's, the other three warps only load. The paged and contiguous loads are two branches of one kernel with the same
# MMAs and copies; the profile rule reads each row's path from the line counts of a decode step over its kind of
# cache (tools/perf_counts.sh PERF_COUNTS_DECODE), the other rules cost both rows alike. At 4d9dcbd the rule still
# takes the contiguous path for the paged rows: a row's address there is one line that tests, looks up and returns
# (docs/internals.md). The batch-1 and window rows are launch-bound.
DECODE = [
    ("decode/fwd/hd64/h64kv8/causal/sinks", 64, 8192, 64, 0, 2540),
    ("decode/fwd/hd64/h64kv8/causal/sinks", 64, 32768, 64, 0, 2672),
    ("decode/fwd/hd128/h64kv8/causal/sinks", 64, 16384, 128, 0, 3850),
    ("decode/fwd/hd64/h64kv8/causal/sinks/paged", 64, 8192, 64, 256, 1577),
    ("decode/fwd/hd64/h64kv8/causal/sinks/paged", 64, 32768, 64, 256, 1557),
]
OURS_DECODE = {64: ("FwdTraitsILi64ELi64ELi128ELi4EN7cutlass10bfloat16_tENS0_8GpuPrimsELi3E", 64, 128),
               128: ("FwdTraitsILi128ELi64ELi64ELi4EN7cutlass10bfloat16_tENS0_8GpuPrimsELi3E", 64, 64)}

# FA2's launch choice on an sm90 GPU (flash_fwd_launch_template.h / flash_bwd_launch_template.h of FlashAttention
# 2.x, read, not copied): (head dim -> traits prefix of the mangled name)
FA2_FWD = {64: "ILi64ELi128ELi128ELi4ELb0ELb0E", 128: "ILi128ELi128ELi64ELi4ELb0ELb0E",
           256: "ILi256ELi64ELi64ELi4ELb0ELb0E"}  # hd256: 64 x 64 where an SM holds two (>= 192 KB per SM)
FA2_FWD_A100 = {**FA2_FWD, 256: "ILi256ELi128ELi64ELi8ELb0ELb0E"}  # an A100's SM holds one: 128 x 64, 8 warps
FA2_BWD = {64: "ILi64ELi128ELi128ELi8ELi4ELi4ELi4ELb0ELb0E", 128: "ILi128ELi64ELi128ELi8ELi2ELi4ELi2ELb0ELb0E",
           256: "ILi256ELi64ELi64ELi8ELi4ELi2ELi2ELb0ELb0E"}
# ... and where a block has 144-176 KB (an A100), the one instance that differs: hd256 without double buffering
FA2_BWD_A100 = {**FA2_BWD, 256: "ILi256ELi64ELi64ELi8ELi4ELi2ELi2ELb0ELb1E"}
# 4d9dcbd's sm80 tiles on an sm90 GPU (its csrc/sm80/fwd_config.h; bwd_config.h): traits prefix, smem bytes
OURS_FWD = {64: ("FwdTraitsILi64ELi128ELi64ELi4E", (128 + 2 * 2 * 64) * 64 * 2),
            128: ("FwdTraitsILi128ELi128ELi64ELi8E", (128 + 2 * 2 * 64) * 128 * 2),
            256: ("FwdTraitsILi256ELi64ELi64ELi4E", (64 + 2 * 2 * 64) * 256 * 2)}
OURS_BWD = {128: ("BwdTraitsILi128ELi64ELi64ELi4ELi2ELi2E", (2 * 2 * 64 * 128 + 2 * 64 * 128 + 2 * 64 * 64) * 2)}


def fa2_bools(causal: bool, bwd: bool, hd: int = 128) -> str:
    # flash_fwd_kernel<Traits, Is_dropout, Is_causal, Is_local, Has_alibi, Is_even_MN, Is_even_K, Is_softcap,
    # Return_softmax>; the backward's: <Traits, Is_dropout, Is_causal, Is_local, Has_alibi, Is_even_MN, Is_even_K,
    # Is_softcap>: a dense, even-sized, bf16 run without dropout. FA2 compiles its even-MN instances only up to head
    # dim 128 (Is_even_MN = IsEvenMNConst && kHeadDim <= 128).
    c, mn = int(causal), int(hd <= 128)
    return f"ELb0ELb{c}ELb0ELb0ELb{mn}ELb1ELb0E" + ("EEv" if bwd else "Lb0EEEv")


_CODE: dict = {}


def find(files: list[str], dev: pm.Device, *needles: str):
    """(insns, hot loop, resources) of the one kernel whose mangled name holds every needle."""
    for f in files:
        if f not in _CODE:
            _CODE[f] = (sass.disassemble(f), sass.resources(f))
        code, res = _CODE[f]
        for (a, fn), insns in code.items():
            if a.rstrip("a") != dev.arch or not all(n in fn for n in needles):
                continue
            r = next((v for (a2, f2), v in res.items() if f2 == fn), {})
            return insns, sass.hot_loop(insns), r, fn
    return None


def traits(fn: str) -> list[int]:
    m = re.search(r"traitsI((?:Li\d+E)+)", fn, re.I) or re.search(r"TraitsI((?:Li\d+E)+)", fn)
    return [int(x) for x in re.findall(r"Li(\d+)E", m.group(1))] if m else []


def predict_fwd(kern, dev, b, h, s, hd, causal, bm, bn):
    """TFLOP/s of a forward launch: one CTA per (batch, head, block of bm rows), ceil(s / bn) key blocks each
    (causal: those up to the diagonal)."""
    n_m = -(-s // bm)
    its = []
    for i in range(n_m):
        last = min(s, (i + 1) * bm) if causal else s
        its.append(-(-last // bn))
    r = pm.kernel_time_s(kern, dev, b * h * n_m, its * (b * h))
    flops = 4 * b * h * s * s * hd * (0.5 if causal else 1.0)
    return flops / r["time"] / 1e12, r


def predict_bwd(kern, dev, b, h, s, hd, causal, bm, bn):
    """TFLOP/s (x2.5 FLOPs) of a backward launch: one CTA per (batch, head, block of bn keys), looping over query
    blocks (causal: from the diagonal on)."""
    n_n = -(-s // bn)
    its = []
    for j in range(n_n):
        first = j * bn if causal else 0
        its.append(-(-(s - first) // bm))
    r = pm.kernel_time_s(kern, dev, b * h * n_n, its * (b * h))
    flops = 2.5 * 4 * b * h * s * s * hd * (0.5 if causal else 1.0)
    return flops / r["time"] / 1e12, r


def predict_decode(kern, dev, b, hk, sk, hd, bm, bn):
    """GB/s of a decode launch (one CTA per request and KV head, no split: b x hk CTAs fill the SMs): the smaller of
    the copy ceiling and what the computing warps issue. Bytes in flight do not bind (3 stages of 64 rows: 64 KB per
    CTA, two CTAs per SM, 17 MB over the H200's SMs, 4 us of its bandwidth). A request's rows are one warp's, so the
    busiest sub-partition runs the loop of one warp per resident CTA (the CTAs' warp 0s share one, warp slots going
    round the four), every key block."""
    n_ctas = b * hk
    occ = pm.ctas_per_sm(dev, kern.regs, kern.threads, kern.smem)
    waves = -(-n_ctas // (dev.sms * occ))
    t_it = kern.iteration_cycles(occ, dev, cta_warps=1) / (dev.ghz * 1e9)  # the warp 0s of occ CTAs
    by = F.decode_bytes(b, hk * 8, hk, hd, sk, elem_bytes=2, seqlen_q=1, causal=True)
    t = max(waves * -(-sk // bn) * t_it, by / (dev.dram_gbs * 1e9))
    return by / t / 1e9, {"bound": "copy" if t * dev.dram_gbs * 1e9 <= by * 1.0001 else "warp", "w": occ}


def profile_idx(obj: str, fn: str, insns, loop, counts_dir: str, needle: str, dev: pm.Device):
    """Our forward loop's interior path by its emulated line counts (tools/perf_counts.py), or None without counts."""
    import perf_counts
    cov = os.path.join(counts_dir, f"cov_hd{traits(fn)[0]}.json")
    if not os.path.exists(cov):
        return None
    cubin = perf_counts.cubin_of(obj, dev.arch, os.path.join(counts_dir, "cubins", os.path.basename(obj)))
    return perf_counts.profile(cubin, fn, insns, loop, cov, needle)


def fa2_kernel(files: list[str], dev: pm.Device, hd: int, causal: bool, bwd: bool, path: str = "loop"):
    """(kernel, block_m, block_n) of the FA2 instance FA2 launches for this head dim on dev (its hd256 tiles depend on
    the shared memory: an sm90's >= 176 KB per block, an A100's 163), or None where no cubin holds it."""
    sm90 = dev.smem_block >= 176 * 1024
    pre = ((FA2_BWD if sm90 else FA2_BWD_A100) if bwd else (FA2_FWD if sm90 else FA2_FWD_A100)).get(hd)
    hit = pre and find(files, dev, "flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel" if bwd else "flash_fwd_kernel", pre,
                       fa2_bools(causal, bwd, hd))
    if not hit:
        return None
    insns, loop, r, fn = hit
    t = traits(fn)  # head dim, bm, bn, warps
    if bwd:  # Q (two buffers, one without double buffering), dO, K, V, P, dS
        q_bufs = 1 if pre.endswith("ELb1E") else 2
        smem = ((q_bufs + 1) * t[1] * t[0] + 2 * t[2] * t[0] + 2 * t[1] * t[2]) * 2
    else:  # Q, two stages of K and V
        smem = (t[1] + 2 * t[2]) * t[0] * 2
    return pm.make_kernel(fn, insns, loop, r, dev, 32 * t[3], smem, path=path), t[1], t[2]


def kernels(ours_dir: str, fa2_dir: str, dev: pm.Device, path: str = "loop", counts_dir: str | None = None):
    ours_files = sorted(glob.glob(os.path.join(ours_dir, "*.o")))
    fa2_files = sorted(glob.glob(os.path.join(fa2_dir, "*.cubin")))
    out = {}
    for hd in (64, 128, 256):
        for causal in (False, True):
            k = fa2_kernel(fa2_files, dev, hd, causal, False, path)
            if k:
                out[("fwd", hd, causal, "FA2")] = k
        pre, smem = OURS_FWD[hd]
        hit = find(ours_files, dev, "sm8010fwd_kernel", pre)
        if hit:
            insns, loop, r, fn = hit
            t = traits(fn)
            idx = None
            if path == "profile":
                obj = next(f for f in ours_files if any(key[1] == fn for key in _CODE[f][0]))
                prof = profile_idx(obj, fn, insns, loop, counts_dir or "build/peer_sass/4d9dcbd/counts", pre, dev)
                idx, outside = prof if prof else (None, None)
            else:
                outside = None
            if path != "profile" or idx is not None:
                k = (pm.make_kernel(fn, insns, loop, r, dev, 32 * t[3], smem, path=path, idx=idx, outside=outside),
                     t[1], t[2])
                out[("fwd", hd, False, "ours")] = out[("fwd", hd, True, "ours")] = k
    for causal in (False, True):
        k = fa2_kernel(fa2_files, dev, 128, causal, True, path)
        if k:
            out[("bwd", 128, causal, "FA2")] = k
    pre, smem = OURS_BWD[128]
    hit = find(ours_files, dev, "sm8010bwd_kernel", pre)
    if hit:
        insns, loop, r, fn = hit
        t = traits(fn)
        k = (pm.make_kernel(fn, insns, loop, r, dev, 32 * t[3] * t[4], smem, path=path), t[1], t[2])
        out[("bwd", 128, False, "ours")] = out[("bwd", 128, True, "ours")] = k
    for hd, (pre, bm, bn) in OURS_DECODE.items():
        hit = find(ours_files, dev, "sm8010fwd_kernel", pre)
        if hit:
            insns, loop, r, fn = hit
            smem = (bm + 2 * 3 * bn) * hd * 2
            for page in sorted({row[4] for row in DECODE if row[3] == hd}):
                idx, outside = None, None
                if path == "profile":  # the decode step's own counts, per kind of cache (perf_counts.decode_dir)
                    import perf_counts
                    obj = next(f for f in ours_files if any(key[1] == fn for key in _CODE[f][0]))
                    # the emulated instantiation of the same tile (4d9dcbd's emulation namespace is `emu`)
                    emu = pre.replace("NS0_8GpuPrimsE", "NS_3emu8EmuPrimsE")
                    prof = profile_idx(obj, fn, insns, loop,
                                       perf_counts.decode_dir(counts_dir or "build/peer_sass/4d9dcbd/counts", page),
                                       emu, dev)
                    if not prof:
                        continue
                    idx, outside = prof
                out[("decode", hd, page, "ours")] = (pm.make_kernel(fn, insns, loop, r, dev, 128, smem, path=path,
                                                                    idx=idx, outside=outside), bm, bn)
    return out


def table(ks, dev):
    rows = []
    for kind, rowset, fn in (("fwd", FWD, predict_fwd), ("bwd", BWD, predict_bwd)):
        for case, b, h, s, hd, causal, m_ours, m_fa2 in rowset:
            pred = {}
            for who in ("ours", "FA2"):
                k = ks.get((kind, hd, causal, who))
                if k:
                    pred[who] = fn(k[0], dev, b, h, s, hd, causal, k[1], k[2])
            rows.append((case, b, s, m_ours, m_fa2, pred))
    return rows


def main(a) -> int:
    dev = pm.DEVICES[a.device]
    ks = kernels(getattr(a, "ours", None) or "build/peer_sass/4d9dcbd/out",
                 getattr(a, "fa2", None) or "build/peer_sass/fa2_torch", dev, getattr(a, "path", "loop"),
                 getattr(a, "counts", None))
    print(f"| case | batch x seqlen | ours sm80 measured / predicted | FA2 measured / predicted | ratio measured / "
          f"predicted (error) | bound (W) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for case, b, s, m_o, m_f, pred in table(ks, dev):
        po = pred.get("ours", (None, {}))
        pf = pred.get("FA2", (None, {}))
        fo = f"{po[0]:.0f}" if po[0] else "not built"
        ff = f"{pf[0]:.0f}" if pf[0] else "not found"
        ratio = "-"
        if po[0] and pf[0]:
            mr, pr = m_o / m_f, po[0] / pf[0]
            ratio = f"{mr:.2f} / {pr:.2f} ({(pr / mr - 1) * 100:+.0f}%)"
        bound = " / ".join(f"{p[1]['bound']} ({p[1]['w']})" for p in (po, pf) if p[0])
        print(f"| {case} | {b} x {s} | {m_o} / {fo} | {m_f} / {ff} | {ratio} | {bound} |")
    print()
    print("| decode case (4d9dcbd) | batch x seqlen_k | measured GB/s | predicted (error) | bound (W) |")
    print("| --- | --- | --- | --- | --- |")
    for case, b, sk, hd, page, meas in DECODE:
        k = ks.get(("decode", hd, page, "ours"))
        if not k:
            print(f"| {case} | {b} x {sk} | {meas} | not built or no decode counts | |")
            continue
        gbs, r = predict_decode(k[0], dev, b, 8, sk, hd, k[1], k[2])
        print(f"| {case} | {b} x {sk} | {meas} | {gbs:.0f} ({gbs / meas - 1:+.0%}) | {r['bound']} ({r['w']}) |")
    return 0
