"""The project's SASS reader (tools/sass.py), report (tools/sass_report.py) and performance model
(tools/perf_model.py), without a GPU: on a fixture of cuobjdump text whose control bits are decoded by hand, and on
a small kernel compiled here (needs nvcc and cuobjdump: the toolkit and the triton wheel)."""
from __future__ import annotations

import importlib.util
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import sass  # noqa: E402

# Two instructions as cuobjdump -sass prints them (an sm_90 MUFU.EX2 and the FMUL that reads its result).
# The high words' top 23 bits, decoded by hand:
#   0x000e620000000800 >> 41 = 0x731: stall 1, yield 1, write scoreboard 1, read scoreboard 7 (none), wait 0
#   0x002fca0000400000 >> 41 = 0x17e5: stall 5, yield 0, write 7, read 7, wait mask 0b000010 (scoreboard 1)
FIXTURE = """
	code for sm_90
		Function : _Z4demoPf
	.headerflags	@"EF_CUDA_TEXMODE_UNIFIED EF_CUDA_64BIT_ADDRESS EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0000*/                   MUFU.EX2 R5, R4 ;                              /* 0x0000000400057308 */
                                                                                  /* 0x000e620000000800 */
        /*0010*/                   FMUL R7, R5, 0.5 ;                             /* 0x3f00000005077820 */
                                                                                  /* 0x002fca0000400000 */
        /*0020*/              @!P0 BRA 0x0 ;                                      /* 0xfffffff400f80947 */
                                                                                  /* 0x000fea000383ffff */
        /*0030*/                   EXIT ;                                         /* 0x000000000000794d */
                                                                                  /* 0x000fea0003800000 */
"""


def test_control_bits_decode_as_documented():
    funcs = sass.parse_sass(FIXTURE, default_arch="sm_90")
    (key, insns), = funcs.items()
    assert key == ("sm_90", "_Z4demoPf") and [i.op for i in insns] == ["MUFU.EX2", "FMUL", "BRA", "EXIT"]
    mufu, fmul, bra, _ = insns
    assert (mufu.stall, mufu.yield_bit, mufu.wbar, mufu.rbar, mufu.wait) == (1, 1, 1, 7, 0)
    assert (fmul.stall, fmul.yield_bit, fmul.wbar, fmul.rbar, fmul.wait) == (5, 0, 7, 7, 0b10)
    assert bra.pred == "@!P0" and bra.target == 0
    # the branch back to 0 makes a loop of the first three instructions; it holds no MMA, so no hot loop
    (idx, _, _), = sass.loops(insns)
    assert idx == [0, 1, 2] and sass.hot_loop(insns) is None
    assert sass.class_counts(insns)["MUFU.EX2"] == 1 and sass.class_counts(insns)["MUFU"] == 0


def test_resource_lines_parse():
    text = """
 Resource usage:
 Common:
  GLOBAL:0
 Function _Z4demoPf:
  REG:40 STACK:16 SHARED:1024 LOCAL:8 CONSTANT[0]:904 TEXTURE:0 SURFACE:0 SAMPLER:0
"""
    assert sass.parse_resources(text, "sm_80") == {("sm_80", "_Z4demoPf"): {"reg": 40, "stack": 16, "shared": 1024, "local": 8}}


def test_missing_tool_says_how_to_get_it(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    monkeypatch.delenv("NVDISASM", raising=False)
    monkeypatch.setattr(sass.sys, "path", [str(tmp_path)])
    monkeypatch.setattr(sass.sysconfig, "get_paths", lambda: {"purelib": str(tmp_path), "platlib": str(tmp_path)})
    monkeypatch.setattr(sass.os.path, "isfile", lambda p: False)
    assert sass.find_tool("nvdisasm", required=False) is None
    with pytest.raises(SystemExit) as e:
        sass.find_tool("nvdisasm")
    assert "nvidia-cuda-nvdisasm" in str(e.value) and "triton" in str(e.value) and "$NVDISASM" in str(e.value)


# A kernel with one of each class the report counts: ldmatrix (LDSM), mma.sync (HMMA), cp.async (LDGSTS), a
# barrier (BAR), exp2 (MUFU.EX2), and a stack array indexed at run time (LDL/STL: local memory).
KERNEL = r"""
#include <cuda_bf16.h>
__global__ void demo(const float4* g, float* out, int k) {
  __shared__ __align__(16) unsigned short s[16 * 16 * 2];
  unsigned sa = static_cast<unsigned>(__cvta_generic_to_shared(s + threadIdx.x * 8));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" :: "r"(sa), "l"(g + threadIdx.x));
  asm volatile("cp.async.wait_all;\n" ::);
  __syncthreads();
  unsigned a0, a1, a2, a3;
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(a0), "=r"(a1), "=r"(a2), "=r"(a3) : "r"(sa));
  float c[4] = {0, 0, 0, 0};
  for (int i = 0; i < k; ++i)
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n" : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(a0), "r"(a1));
  float local[32];
  for (int i = 0; i < 32; ++i) local[i] = exp2f(c[i & 3] * i);
  out[threadIdx.x] = local[k & 31];
}
"""


@pytest.fixture(scope="module")
def cubin(tmp_path_factory):
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    if not pathlib.Path(nvcc).exists():
        pytest.skip("no nvcc")
    if sass.find_tool("cuobjdump", required=False) is None:
        pytest.skip("no cuobjdump (the triton wheel or nvidia-cuda-cuobjdump carries one)")
    d = tmp_path_factory.mktemp("cubin")
    (d / "demo.cu").write_text(KERNEL)
    out = d / "demo.sm_80.cubin"
    subprocess.run([nvcc, "-cubin", "-O3", "-arch=sm_80", "-o", str(out), str(d / "demo.cu")], check=True,
                   capture_output=True, timeout=300)
    return out


def test_report_on_a_compiled_cubin(cubin):
    spec = importlib.util.spec_from_file_location("sass_report", ROOT / "tools" / "sass_report.py")
    rep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rep)
    (r,) = rep.rows(str(cubin))
    assert r["arch"] == "sm_80" and r["kernel"].startswith("demo(")
    assert r["HMMA"] >= 1 and r["LDSM"] == 1 and r["LDGSTS"] == 1 and r["BAR"] >= 1 and r["MUFU.EX2"] >= 1
    assert r["HGMMA"] == 0 and r["UTMALDG"] == 0
    assert r["shared"] == 1024 and 0 < r["reg"] <= 255
    # the run-time-indexed array lives in local memory: the report flags it and exits 1 unless allowed
    # (an array indexed at run time lives in the stack frame: cuobjdump counts it as STACK, LOCAL stays 0)
    assert r["stack"] >= 128 and r["STL"] >= 1 and rep.flagged(r)
    assert rep.main([str(cubin)]) == 1 and rep.main([str(cubin), "--allow-local"]) == 0


def test_hot_loop_and_scoreboards_on_a_compiled_cubin(cubin):
    ((arch, name), insns), = sass.disassemble(str(cubin)).items()
    idx, _, _ = sass.hot_loop(insns)
    loop = [insns[i] for i in idx]
    assert any(i.op.startswith("HMMA") for i in loop) and loop[-1].base == "BRA"
    # every encoding was read; the MUFU.EX2 results are waited on through the scoreboard they set
    assert all(i.ctrl >= 0 for i in insns)
    mufu = [i for i in insns if i.op.startswith("MUFU.EX2")]
    assert mufu and all(i.wbar < 6 for i in mufu)
    assert any(i.wait & (1 << mufu[0].wbar) for i in insns if i.addr > mufu[0].addr)


def _line(addr: int, text: str) -> str:
    return (f"        /*{addr:04x}*/                   {text} ;    /* 0x0000000000000000 */\n"
            "                                                  /* 0x000fea0003800000 */\n")


# A loop whose interior iteration runs both MMAs and skips the mask (the diagonal block's FSELs) and, in the last
# iteration, the next block's load.
LOOP_FIXTURE = "\tcode for sm_90\n\t\tFunction : _Z4loopv\n" + "".join(_line(a, t) for a, t in (
    (0x00, "HMMA.16816.F32.BF16 R0, R4, R8, R0"), (0x10, "@P0 BRA 0x40"), (0x20, "FSEL R1, R1, -INF, P1"),
    (0x30, "FSEL R2, R2, -INF, P1"), (0x40, "@P2 BRA 0x60"), (0x50, "LDGSTS.E.BYPASS.128 [R10], [R12.64]"),
    (0x60, "HMMA.16816.F32.BF16 R0, R4, R8, R0"), (0x70, "@P3 BRA 0x0"), (0x80, "EXIT")))


def test_hot_path_is_the_interior_iteration():
    (insns,) = sass.parse_sass(LOOP_FIXTURE, default_arch="sm_90").values()
    loop = sass.hot_loop(insns)
    assert loop[0] == list(range(8))  # the natural loop: every branch of the body
    assert sass.hot_path(insns, loop) == [0, 1, 4, 6, 7]  # both MMAs, no mask, no load
    assert sass.hot_path(insns, loop, with_loads=True) == [0, 1, 4, 5, 6, 7]  # and the next block's load


def test_profile_path_follows_the_emulated_line_counts(tmp_path):
    """tools/perf_counts.py: the loop's blocks weighed by the line counts of the statements their instructions come
    from (the innermost frame in the kernel body); the interior iteration skips the mask nobody ran, takes the next
    block's load that most iterations ran, and runs the mask where every iteration did."""
    import json
    import perf_counts
    (insns,) = sass.parse_sass(LOOP_FIXTURE, default_arch="sm_90").values()
    loop = sass.hot_loop(insns)
    body = "sm80/fwd_kernel.h"
    line_of = {0x00: 10, 0x10: 10, 0x20: 20, 0x30: 20, 0x40: 30, 0x50: 40, 0x60: 50, 0x70: 50}
    # the mask block's instructions were inlined from a helper: the body frame is the call site, not the innermost
    chains = {a: ([("common/mask.h", 7)] if n == 20 else []) + [(body, n), ("sm80/fwd_launch.cuh", 22)]
              for a, n in line_of.items()}
    # ... or from a lambda of the body (line 15, which gcov did not count) called at line 20: the call site speaks
    lambda_chains = {a: c[:1] + [(body, 15)] + c[1:] if line_of[a] == 20 else c for a, c in chains.items()}
    cov = tmp_path / "cov.json"

    def path(mask_runs, counted=(10, 20, 30, 40, 50), chains=chains):
        runs = {10: 100, 20: mask_runs, 30: 100, 40: 99, 50: 100}
        lines = [{"line_number": n, "count": runs[n], "function_name": "_ZN8sinkattn4sm809fwd_blockINS0_9FwdTraitsILi64E"}
                 for n in counted]
        lines.append({"line_number": 20, "count": 100, "function_name": "_ZN8sinkattn4sm809fwd_blockINS0_5OtherE"})
        cov.write_text(json.dumps({"files": [{"file": "/x/csrc/" + body, "lines": lines}]}))
        counts = perf_counts.gcov_counts(str(cov), "FwdTraitsILi64E", body)
        assert counts[20] == (mask_runs if 20 in counted else 0)  # another instantiation's counts stay out
        blocks, succ, weights = perf_counts.block_weights(insns, chains, counts, body)
        return perf_counts.dominant_path(loop, blocks, succ, weights)

    assert path(0) == [0, 1, 4, 5, 6, 7]  # no mask (none ran), the load (99 of 100 iterations)
    assert path(100) == [0, 1, 2, 3, 4, 5, 6, 7]  # a mask every iteration ran
    assert path(100, chains=lambda_chains) == [0, 1, 2, 3, 4, 5, 6, 7]
    assert path(0, chains=lambda_chains) == [0, 1, 4, 5, 6, 7]
    # no count for either side of the mask's branch: the edge that skips it (no evidence that the block runs)
    assert path(100, counted=(10, 40, 50)) == [0, 1, 4, 5, 6, 7]
    # the same rules on a CFG whose conditional block is the first successor: header 0 -> block 1 or its join 2,
    # 1 -> 2, 2 -> latch 3 -> 0
    blocks, succ, loop = [(i, i) for i in range(4)], [[1, 2], [2], [3], [0]], ([0, 1, 2, 3], [0, 1, 2, 3], 0)
    assert perf_counts.dominant_path(loop, blocks, succ, [100, 100, 100, 100]) == [0, 1, 2, 3]  # it runs: entered
    assert perf_counts.dominant_path(loop, blocks, succ, [100, None, None, 100]) == [0, 2, 3]  # no count: skipped
    assert perf_counts.dominant_path(loop, blocks, succ, [100, 2, 100, 100]) == [0, 2, 3]  # 2 of 100: skipped


# The sm90 hd128 tile's loads (fwd_kernel.h, branch_free_loads): header H tests whether K(t + 2) needs the loader
# (line 213); T, the K loader's branch, holds KvLoader's set-up (line 69, also after the loop) and the stage index
# (line 202, also in the join J) that ptxas sank into it; U tests V the same way (line 213, and the K call's hoisted
# line 215) before V's loader branch Vl or the bare jump S; J holds the predicated copies and the MMAs and ends the
# iteration. The emulation ran neither loader call (lines 215, 218).
BRANCH_FREE_FIXTURE = "\tcode for sm_90\n\t\tFunction : _Z4loopv\n" + "".join(_line(16 * i, t) for i, t in enumerate((
    "IADD3 R1, R1, 0x1, RZ", "@P0 BRA 0x60",  # H
    "ISETP.GE.AND P1, PT, R6, R5, PT", "UIADD3 UR4, UR4, 0x1, URZ", "@P1 BRA 0xb0",  # U
    "BRA 0xe0",  # S
    "IMAD R2, R2, R3, RZ", "IMAD R4, R4, R3, RZ", "ISETP.GE.AND P1, PT, R4, R5, PT", "IMAD R9, R9, R3, RZ",
    "BRA 0xe0",  # T
    "IMAD R7, R7, R3, RZ", "LDGSTS.E.BYPASS.128 [R10], [R12.64]", "BRA 0xe0",  # Vl
    "@P2 LDGSTS.E.BYPASS.128 [R10], [R12.64]", "IMAD R4, R4, R3, RZ", "HMMA.16816.F32.BF16 R0, R4, R8, R0",
    "@P3 BRA 0x0",  # J
    "IMAD R2, R2, R3, RZ", "EXIT")))


def test_profile_path_skips_a_never_run_branch_that_holds_sunk_code():
    """tools/perf_counts.py block_weights with the loop: a set-up line and a line the join holds too say nothing of
    the branch ptxas sank them into; a block whose lines all ran 0 times ranks below a bare jump no count speaks for;
    and where no count says that either side runs, the path takes the one nearer the join."""
    import perf_counts
    (insns,) = sass.parse_sass(BRANCH_FREE_FIXTURE, default_arch="sm_90").values()
    loop = sass.hot_loop(insns)
    body = "sm80/fwd_kernel.h"
    lines = [210, 213, 213, 215, 213, 213, 69, 202, 215, 215, 215, 69, 218, 218, 221, 202, 231, 201, 69, 69]
    chains = {ins.addr: [(body, n)] for ins, n in zip(insns, lines)}
    counts = {210: 64, 213: 32, 69: 2, 202: 32, 215: 0, 218: 0, 221: 32, 231: 32, 201: 34}
    blocks, succ, weights = perf_counts.block_weights(insns, chains, counts, body, loop)
    h, u, skip, t, vl, j = range(6)
    assert [a for a, _ in blocks] == [0, 2, 5, 6, 11, 14, 18] and succ[h] == [t, u] and succ[u] == [vl, skip]
    pd = perf_counts.post_dominators(succ, set(loop[1]), loop[2])
    assert pd[h] == {h, j} and pd[u] == {u, j} and pd[t] == {t, j}  # the join runs whichever way a test goes
    assert (weights[t], weights[u], weights[vl], weights[skip]) == (0, 0, 0, None)
    interior = [0, 1, 2, 3, 4, 5, 14, 15, 16, 17]
    assert perf_counts.dominant_path(loop, blocks, succ, weights) == interior
    # without the loop, the stage index's count weighs the K loader's branch as run on every iteration
    blocks, succ, weights = perf_counts.block_weights(insns, chains, counts, body)
    assert weights[t] == 32
    assert perf_counts.dominant_path(loop, blocks, succ, weights) == [0, 1, 6, 7, 8, 9, 10, 14, 15, 16, 17]
    # a loader that ran on every iteration (a paged cache) is taken, set-up and sunk lines aside (U without the
    # hoisted instruction: with it, U would weigh as much, and equal weights above 0 do not say which side runs)
    chains[insns[3].addr] = [(body, 213)]
    blocks, succ, weights = perf_counts.block_weights(insns, chains, {**counts, 215: 32}, body, loop)
    assert weights[t] == 32 and weights[u] is None
    assert perf_counts.dominant_path(loop, blocks, succ, weights) == [0, 1, 6, 7, 8, 9, 10, 14, 15, 16, 17]


# A loader branch T that ran never (line 215), into which ptxas sank the stage index (line 202), which it also
# put into the MMA block M: M is not on every path of the iteration (the warp-active test J1 may skip it), so the
# join rule cannot speak for 202, but M's own line 231 ran on every iteration.
SUNK_OFF_JOIN_FIXTURE = "\tcode for sm_90\n\t\tFunction : _Z4loopv\n" + "".join(_line(16 * i, t) for i, t in enumerate((
    "IADD3 R1, R1, 0x1, RZ", "@P0 BRA 0x30",  # H
    "BRA 0x50",  # S
    "IMAD R9, R9, R3, RZ", "LDGSTS.E.BYPASS.128 [R10], [R12.64]",  # T
    "@P1 BRA 0x80",  # J1
    "IMAD R4, R4, R3, RZ", "HMMA.16816.F32.BF16 R0, R4, R8, R0",  # M
    "@P3 BRA 0x0",  # latch
    "EXIT")))


def test_a_line_a_block_run_every_iteration_holds_says_nothing_of_a_never_run_branch():
    """tools/perf_counts.py block_weights: the stage index's count belongs to the MMA block that runs on every
    iteration by a line of its own, not to the never-run loader branch ptxas also sank it into (the sm90 hd128
    tile with its copies issued after S's first MMAs took that branch as the path, 16 copies a block for 8)."""
    import perf_counts
    (insns,) = sass.parse_sass(SUNK_OFF_JOIN_FIXTURE, default_arch="sm_90").values()
    loop = sass.hot_loop(insns)
    body = "sm80/fwd_kernel.h"
    lines = [210, 213, 213, 202, 215, 225, 202, 231, 201, 201]
    chains = {ins.addr: [(body, n)] for ins, n in zip(insns, lines)}
    counts = {210: 64, 213: 32, 202: 32, 215: 0, 225: 32, 231: 32, 201: 34}
    blocks, succ, weights = perf_counts.block_weights(insns, chains, counts, body, loop)
    h, skip, t, j1, m = range(5)
    assert [a for a, _ in blocks][:6] == [0, 2, 3, 5, 6, 8] and succ[h] == [t, skip] and succ[j1] == [5, m]
    assert m not in perf_counts.post_dominators(succ, set(loop[1]), loop[2])[h]
    assert (weights[t], weights[skip], weights[m]) == (0, None, 32)
    assert perf_counts.dominant_path(loop, blocks, succ, weights) == [0, 1, 2, 5, 6, 7, 8]
    # had M's own line not run on most iterations, nothing would speak against T
    blocks, succ, weights = perf_counts.block_weights(insns, chains, {**counts, 231: 2}, body, loop)
    assert weights[t] == 32


def test_profile_path_leaves_out_blocks_the_emulation_never_ran():
    """tools/perf_counts.py dead_blocks: an if/else inside an inlined helper, both sides inlined from one line of the
    kernel body (KvLoader's whole-tile copy against its bounds-checked one), so the body's counts cannot tell them
    apart; the helpers' own lines, counted per instantiation, can. A line two instantiations share with different
    counts (the row loader called for Q and for a tail block) defers to its caller's line."""
    import types
    import perf_counts
    body, t = "/x/csrc/sm80/fwd_kernel.h", "FwdTraitsILi64E"
    # header 0 -> whole-tile copy 1 or checked copy 2; both -> join 3 -> latch 4 -> 0
    blocks, succ = [(i, i) for i in range(5)], [[2, 1], [3], [3], [4], [0]]
    loop = ([0, 1, 2, 3, 4], [0, 1, 2, 3, 4], 0)
    insns = [types.SimpleNamespace(addr=16 * i) for i in range(5)]
    chains = {0: [(body, 10)], 16: [("/x/csrc/sm80/row_loader.h", 52), ("/x/csrc/sm80/kv_loader.h", 72), (body, 90)],
              32: [("/x/csrc/sm80/row_loader.h", 23), ("/x/csrc/sm80/kv_loader.h", 77), (body, 90)],
              48: [(body, 90)], 64: [(body, 120)]}
    inst = {("sm80/row_loader.h", 52): [4096], ("sm80/kv_loader.h", 72): [512],
            ("sm80/row_loader.h", 23): [128, 0],  # Q's instantiation ran it, the tail's did not: ask the caller
            ("sm80/kv_loader.h", 77): [0], ("sm80/fwd_kernel.h", 90): [512]}
    weights = [512, None, None, 512, 512]  # one body line for both copies: no weight speaks for either side
    assert perf_counts.dead_blocks(insns, blocks, chains, inst) == {2}
    assert perf_counts.dominant_path(loop, blocks, succ, weights) == [0, 2, 3, 4]  # without: the first successor
    assert perf_counts.dominant_path(loop, blocks, succ, weights, {2}) == [0, 1, 3, 4]
    # the shared line's caller ran (the checked copy called from the whole-tile side): not dead
    assert perf_counts.dead_blocks(insns, blocks, {**chains, 32: chains[32][:1] + chains[16][1:]}, inst) == set()
    # if-converted code that never ran, in one block with code that ran (instructions 1 and 2 one block): not dead
    assert perf_counts.dead_blocks(insns, [(0, 0), (1, 2), (3, 3), (4, 4)], chains, inst) == set()
    assert perf_counts.dead_blocks(insns, blocks, chains, {}) == set()  # no counts: nothing is known dead
    # a tile's set-up (body line 5, also before the loop: instruction 5) rematerialized in the never-run block is no
    # evidence that it runs; without the loop it is
    remat = {**chains, 40: [("/x/csrc/common/mask.h", 70), (body, 5)], 80: [(body, 5)]}
    insns7 = insns[:3] + [types.SimpleNamespace(addr=40)] + insns[3:] + [types.SimpleNamespace(addr=80)]
    blocks7, inst7 = [(0, 0), (1, 1), (2, 3), (4, 4), (5, 5), (6, 6)], {**inst, ("common/mask.h", 70): [64]}
    loop7 = ([0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4], 0)
    assert perf_counts.dead_blocks(insns7, blocks7, remat, inst7, loop7) == {2}
    assert perf_counts.dead_blocks(insns7, blocks7, remat, inst7) == set()
    # ... but a loop statement (line 90, run as often as the loop's header: loop_count) that ptxas hoisted part of out
    # of the loop (instruction 5) still speaks for its block: the whole-tile copy (block 1) beside a speculated,
    # never-run line of the loader (the paged offset, instruction 2) is alive; set-up run once per tile is not
    spec = {**chains, 32: [("/x/csrc/sm80/kv_loader.h", 53), ("/x/csrc/sm80/kv_loader.h", 78), (body, 90)],
            80: [("/x/csrc/sm80/kv_loader.h", 40), (body, 90)]}
    insns6 = insns + [types.SimpleNamespace(addr=80)]
    blocks6, inst6 = [(0, 0), (1, 2), (3, 3), (4, 4)], {**inst, ("sm80/kv_loader.h", 53): [0]}
    loop6 = ([0, 1, 2, 3, 4], [0, 1, 2, 3], 0)
    assert perf_counts.dead_blocks(insns6, blocks6, spec, inst6, loop6) == {1}  # the rule without the loop's count
    assert perf_counts.dead_blocks(insns6, blocks6, spec, inst6, loop6, loop_count=512) == set()
    assert perf_counts.dead_blocks(insns6, blocks6, spec, inst6, loop6, loop_count=513) == {1}
    # outside the loop a line's own count speaks: the epilogue block that ran (line 5) beside never-run split-KV code
    insns8 = [types.SimpleNamespace(addr=a) for a in (0, 16, 32)]
    chains8 = {0: [(body, 10)], 16: [(body, 5)], 32: [("/x/csrc/sm80/split_epilogue.h", 20), (body, 7)]}
    inst8 = {("sm80/fwd_kernel.h", 5): [16], ("sm80/split_epilogue.h", 20): [0], ("sm80/fwd_kernel.h", 10): [100]}
    assert perf_counts.dead_blocks(insns8, [(0, 0), (1, 2)], chains8, inst8, ([0], [0], 0)) == set()
    assert perf_counts.dead_blocks(insns8, [(0, 0), (1, 1), (2, 2)], chains8, inst8, ([0], [0], 0)) == {2}


def test_a_lambda_body_line_speaks_through_the_lambda_s_first_line(tmp_path):
    """gcov records a multi-line lambda's body under the lambda's first line (`auto load_kv = [&](int t) {`, the
    body on the next line has no count of its own); a frame at the body line takes that count, so the call
    `if (t + 2 < t_end) load_kv(t + 2);`, whose test its predecessor block holds, still weighs what the load ran."""
    import json
    import perf_counts
    body, t = "sm80/fwd_kernel.h", "FwdTraitsILi64E"
    fn = "_ZN8sinkattn4sm809fwd_blockINS0_9FwdTraitsILi64E"
    cov = tmp_path / "cov.json"
    cov.write_text(json.dumps({"files": [{"file": "/x/csrc/" + body, "lines": [
        {"line_number": 90, "count": 128, "function_name": fn},
        {"line_number": 92, "count": 128, "function_name": fn},
        {"line_number": 92, "count": 8192, "function_name": fn + "ENKUliE1_clEi"},
        {"line_number": 269, "count": 8192, "function_name": fn}],
        "functions": [{"name": fn, "start_line": 40, "end_line": 363, "execution_count": 128},
                      {"name": fn + "ENKUliE1_clEi", "start_line": 92, "end_line": 92, "execution_count": 8192}]}]}))
    counts = perf_counts.gcov_counts(str(cov), t, body)
    assert counts[92] == 8320 and counts.lambdas == {92}
    assert perf_counts.lambda_line(93, counts) == 92 and perf_counts.lambda_line(94, counts) == 92
    assert perf_counts.lambda_line(91, counts) is None  # below line 90, a statement of the kernel: no lambda
    assert perf_counts.lambda_line(270, counts) is None
    # header 0 (the test, line 269) -> the load 1 (inlined from the lambda's body line 93, called at 269) or the
    # join 2 -> latch 3
    (insns,) = sass.parse_sass("\tcode for sm_90\n\t\tFunction : _Z4loopv\n" + "".join(_line(16 * i, x) for i, x in enumerate((
        "@P0 BRA 0x20", "LDGSTS.E.BYPASS.128 [R10], [R12.64]", "HMMA.16816.F32.BF16 R0, R4, R8, R0",
        "@P3 BRA 0x0", "EXIT"))), default_arch="sm_90").values()
    loop = sass.hot_loop(insns)
    chains = {0: [(body, 269)], 16: [("/x/csrc/sm80/kv_loader.h", 80), (body, 93), (body, 269)],
              32: [(body, 297)], 48: [(body, 269)], 64: [(body, 300)]}
    counts[297] = 8192
    blocks, succ, weights = perf_counts.block_weights(insns, chains, counts, body, loop)
    assert weights[1] == 8320
    assert perf_counts.dominant_path(loop, blocks, succ, weights) == [0, 1, 2, 3]
    counts.lambdas = set()  # without the lambda's line the load's block has no count and the path skips it
    blocks, succ, weights = perf_counts.block_weights(insns, chains, counts, body, loop)
    assert weights[1] is None and perf_counts.dominant_path(loop, blocks, succ, weights) == [0, 2, 3]


def _timed(addr: int, text: str, stall: int) -> str:
    hi = (0x7f0 | stall) << 41  # yield, no scoreboard written or read, no wait; the stall count in the low 4 bits
    return (f"        /*{addr:04x}*/                   {text} ;    /* 0x0000000000000000 */\n"
            f"                                                  /* 0x{hi | 0x3800000:016x} */\n")


def test_warps_of_one_cta_leave_a_cta_barrier_together():
    """Two warps on one SMSP, each iteration 10 MMAs, then 60 integer instructions, then a barrier. Free to drift
    apart (warps of two CTAs), they do, iteration by iteration, until one warp's integer phase hides under the
    other's MMAs. Warps of one CTA at a __syncthreads start every iteration together, so at least one integer
    phase falls outside the MMAs each iteration: what FA2's 8-warp backward and our 8-warp forward pay and FA2's
    4-warp, 2-CTA forward does not. A named barrier (warp-specialized kernels) couples nothing here."""
    import perf_model as pm
    dev = pm.DEVICES["h200"]

    def loop_with(barrier):
        ops = ["HMMA.16816.F32.BF16 R0, R4, R8, R0"] * 10 + ["IADD3 R1, R1, 0x1, RZ"] * 60 + [barrier]
        text = "\tcode for sm_90\n\t\tFunction : _Z4loopv\n" + "".join(_timed(16 * a, t, 1) for a, t in enumerate(ops))
        text += _timed(16 * len(ops), "@P3 BRA 0x0", 5) + _timed(16 * len(ops) + 16, "EXIT", 5)
        (insns,) = sass.parse_sass(text, default_arch="sm_90").values()
        return insns, sass.hot_loop(insns)[0]

    insns, idx = loop_with("BAR.SYNC.DEFER_BLOCKING 0x0")
    tensor = 2 * 10 * pm.mma_fma(insns[0]) / dev.hmma  # both warps' MMAs: 2 x 10 x 8.8 cycles on an H200
    free = pm.simulate(insns, idx, dev, 2, iters=16, cta_warps=1)
    coupled = pm.simulate(insns, idx, dev, 2, iters=16, cta_warps=2)
    assert coupled >= tensor + 60 and free <= coupled - 60
    named, idx_named = loop_with("BAR.SYNC.DEFER_BLOCKING 0x1")
    assert pm.simulate(named, idx_named, dev, 2, iters=16, cta_warps=2) == pytest.approx(free)


def test_warp_waits_account_for_every_cycle_and_name_what_was_waited_for(monkeypatch):
    """warp_waits (tools/perf_model.py) and perf_predict --trace's stretches: one warp's steady iteration is the sum
    of its waits; an MMA behind the previous one waits for the tensor pipe, the FMUL behind a MUFU result for its
    scoreboard (the MUFU's latency), and the 60 integer instructions between two groups of MMAs make the one stretch
    without an MMA. With a second warp of the same CTA some waits become the issue slot's."""
    import perf_model as pm
    import perf_predict as pp
    dev = pm.DEVICES["h200"]
    monkeypatch.setattr(pm, "ITERS", 3)
    mma = "HMMA.16816.F32.BF16 R0, R4, R8, R0"
    text = "\tcode for sm_90\n\t\tFunction : _Z4loopv\n"
    ops = [mma] * 5 + ["IADD3 R1, R1, 0x1, RZ"] * 60
    text += "".join(_timed(16 * a, t, 1) for a, t in enumerate(ops))
    at = 16 * len(ops)
    # the MUFU writes scoreboard 1, the FMUL waits on it (FIXTURE's control words)
    text += (f"        /*{at:04x}*/                   MUFU.EX2 R5, R4 ;    /* 0x0000000400057308 */\n"
             f"                                                  /* 0x000e620000000800 */\n"
             f"        /*{at + 16:04x}*/                   FMUL R7, R5, 0.5 ;    /* 0x3f00000005077820 */\n"
             f"                                                  /* 0x002fca0000400000 */\n")
    rest = [mma] * 5
    text += "".join(_timed(at + 32 + 16 * a, t, 1) for a, t in enumerate(rest))
    end = at + 32 + 16 * len(rest)
    text += _timed(end, "@P3 BRA 0x0", 5) + _timed(end + 16, "EXIT", 5)
    (insns,) = sass.parse_sass(text, default_arch="sm_90").values()
    idx = sass.hot_loop(insns)[0]
    r = pm.warp_waits(insns, idx, dev, 1)
    assert len(r["steps"]) == len(idx) == 73
    assert sum(cyc for _, _, cyc, _ in r["waits"]) == pytest.approx(r["span"])
    assert r["span"] == pytest.approx(pm.simulate(insns, idx, dev, 1))
    assert r["tensor_busy"] == pytest.approx(10 * pm.mma_fma(insns[0]) / dev.hmma)
    by = {(why, op): (cyc, cnt) for why, op, cyc, cnt in r["waits"]}
    # every MMA but the first after the integer stretch (the iteration's first waits for the last one's MMAs)
    assert by[("pipe:tensor", "HMMA")][1] == 9
    fmul = next(st for st in r["steps"] if st["op"] == "FMUL")
    assert fmul["why"] == "scoreboard" and fmul["wait"] == pytest.approx(dev.lat["mufu"])
    (stretch,) = pp.mma_stretches(r["steps"], 50)
    assert stretch[2] == 62 and stretch[1] - stretch[0] >= 60 + dev.lat["mufu"]
    assert pp.mma_stretches(r["steps"], stretch[1] - stretch[0]) == []
    two = pm.warp_waits(insns, idx, dev, 2, cta_warps=2)
    assert any(why == "slot" for why, _, _, _ in two["waits"]) and two["cta_warps"] == 2


def _loop_text(ops: list[str], stall: int = 1) -> str:
    """A function whose whole body is one loop: ops, then a branch back to the first."""
    text = "\tcode for sm_90\n\t\tFunction : _Z4loopv\n" + "".join(_timed(16 * a, t, stall) for a, t in enumerate(ops))
    return text + _timed(16 * len(ops), "@P3 BRA 0x0", 5) + _timed(16 * len(ops) + 16, "EXIT", 5)


def test_wgmma_shape_is_read_and_its_groups_run_behind_the_warp(monkeypatch):
    """HGMMA.64x128x16 (a lower-case x in the opcode) is one opcode, a warp's quarter of 64 x 128 x 16 FMAs: 64
    cycles at an H200's 512 FMA/clk/SMSP. A warp issues its HGMMAs into the tensor pipe's queue and goes on (the
    FMULs after them issue while the group runs); WARPGROUP.DEPBAR.LE gsb0, 0 holds it until its group is done;
    gsb0, 1 lets the last group run on, under the next iteration's work."""
    import perf_model as pm
    dev = pm.DEVICES["h200"]
    monkeypatch.setattr(pm, "ITERS", 4)
    (insns,) = sass.parse_sass(_loop_text(["HGMMA.64x128x16.F32.BF16 R88, gdesc[UR20], R88, gsb0"]),
                               default_arch="sm_90").values()
    assert (insns[0].op, insns[0].args) == ("HGMMA.64x128x16.F32.BF16", "R88, gdesc[UR20], R88, gsb0")
    assert pm.mma_fma(insns[0]) == 16 * 128 * 16 and pm.mma_fma(insns[0]) / dev.hgmma == 64
    mma = "HGMMA.64x128x16.F32.BF16 R88, gdesc[UR20], R88"

    def loop(wait: int):
        ops = (["WARPGROUP.ARRIVE"] + [mma] * 7 + [mma + ", gsb0"] + ["FMUL R7, R5, 0.5"] * 40
               + [f"WARPGROUP.DEPBAR.LE gsb0, 0x{wait}"] + ["FMUL R9, R88, 0.5"] * 10)
        (insns,) = sass.parse_sass(_loop_text(ops), default_arch="sm_90").values()
        return insns, sass.hot_loop(insns)[0]

    tensor = 8 * 64
    insns, idx = loop(0)
    assert [pm.wgmma_wait_count(insns[i]) for i in idx].count(0) == 1
    waited = pm.simulate(insns, idx, dev, 1)
    assert tensor < waited < tensor + 40  # the 40 FMULs under the group, the 10 after it
    r = pm.warp_waits(insns, idx, dev, 1)
    (depbar,) = [st for st in r["steps"] if st["op"].startswith("WARPGROUP.DEPBAR")]
    assert depbar["why"] == "wgmma" and depbar["wait"] > tensor - 60
    assert not any(why == "pipe:tensor" for why, _, _, _ in r["waits"])  # HGMMAs never wait for the pipe
    insns, idx = loop(1)
    assert pm.simulate(insns, idx, dev, 1) < waited
    # bound by the tensor pipe alone (reached from below: the first iterations find the pipe empty)
    assert tensor - 4 < pm.simulate(insns, idx, dev, 1, iters=24) <= tensor


def test_wgmma_reads_its_shared_memory_operands_through_the_shared_pipe(monkeypatch):
    """A warp's quarter of an m64nNk16 wgmma reads N x 16 of B from shared memory, and 64 x 16 of A too when A is a
    descriptor (SS) rather than registers (RS). At 48 keys an SS wgmma's reads (3.5 KB, 28 cycles of an SM's 128
    bytes a clock) outlast its tensor work (24 cycles at 512 FMA/clk/SMSP): a loop of them is bound by the reads; the
    RS form (1.5 KB, 12 cycles) by the tensor pipe."""
    import perf_model as pm
    dev = pm.DEVICES["h200"]
    monkeypatch.setattr(pm, "ITERS", 12)
    ss = "HGMMA.64x48x16.F32.BF16 R24, gdesc[UR20], R24"
    rs = "HGMMA.64x48x16.F32.BF16 R24, R176, gdesc[UR16].tnspB, R24"

    def loop(op):
        (insns,) = sass.parse_sass(_loop_text([op] * 7 + [op + ", gsb0", "WARPGROUP.DEPBAR.LE gsb0, 0x1"]),
                                   default_arch="sm_90").values()
        return insns, sass.hot_loop(insns)[0]

    insns, idx = loop(ss)
    assert pm.wgmma_smem_bytes(insns[0]) == (64 * 16 + 48 * 16) * 2 // 4
    assert pm.simulate(insns, idx, dev, 1) == pytest.approx(8 * 28, rel=0.03)
    insns, idx = loop(rs)
    assert pm.wgmma_smem_bytes(insns[0]) == 48 * 16 * 2 // 4
    assert pm.simulate(insns, idx, dev, 1) == pytest.approx(8 * 24, rel=0.03)


def test_innermost_hot_loop_is_a_persistent_kernel_s_key_block_loop():
    """A tile loop around a key-block loop holds more MMAs (the inner loop's and a peeled first block's); the
    sm90 forward's model costs the inner one per key block (sass.hot_loop(innermost=True))."""
    mma = "HMMA.16816.F32.BF16 R0, R4, R8, R0"
    ops = [mma, mma, "IADD3 R1, R1, 0x1, RZ", mma, "@P0 BRA 0x30", "IADD3 R2, R2, 0x1, RZ"]
    text = "\tcode for sm_90\n\t\tFunction : _Z4loopv\n" + "".join(_timed(16 * a, t, 1) for a, t in enumerate(ops))
    text += _timed(16 * len(ops), "@P3 BRA 0x0", 5) + _timed(16 * len(ops) + 16, "EXIT", 5)
    (insns,) = sass.parse_sass(text, default_arch="sm_90").values()
    outer, inner = sass.hot_loop(insns), sass.hot_loop(insns, innermost=True)
    assert sum(sass.is_mma(insns[i]) for i in outer[0]) == 3 and sorted(inner[0]) == [3, 4]


def test_hot_path_then_keeps_the_atomics_an_interior_step_issues():
    """The sm90 backward's `mma` path: among paths with the most MMAs the shortest skips dQ's fp32 atomics (a tail
    tile's branch is shorter); hot_path(then=) takes the one that holds them."""
    ops = ["HMMA.16816.F32.BF16 R0, R4, R8, R0", "@P0 BRA 0x40",
           "ATOMG.E.ADD.F32x2.FTZ.RN.STRONG.GPU PT, RZ, desc[UR38][R10.64], R152", "IADD3 R1, R1, 0x1, RZ",
           "IADD3 R2, R2, 0x1, RZ"]
    (insns,) = sass.parse_sass(_loop_text(ops), default_arch="sm_90").values()
    loop = sass.hot_loop(insns)
    assert 2 not in sass.hot_path(insns, loop)
    assert 2 in sass.hot_path(insns, loop, then=lambda i: i.base == "ATOMG" and ".F32" in i.op)


def test_phased_cycles_average_two_ctas_starts_and_leave_one_cta_alone(monkeypatch):
    """PERF_PHASES: warps of two CTAs, started apart, keep apart; phased_cycles is the mean of those starts' runs.
    One CTA's warps start together whatever PHASES says; PHASES=0 is the in-phase run alone. PERF_ITERS: how long
    each run is."""
    import perf_model as pm
    dev = pm.DEVICES["h200"]
    ops = ["HMMA.16816.F32.BF16 R0, R4, R8, R0"] * 10 + ["IADD3 R1, R1, 0x1, RZ"] * 60
    text = "\tcode for sm_90\n\t\tFunction : _Z4loopv\n" + "".join(_timed(16 * a, t, 1) for a, t in enumerate(ops))
    text += _timed(16 * len(ops), "@P3 BRA 0x0", 5) + _timed(16 * len(ops) + 16, "EXIT", 5)
    (insns,) = sass.parse_sass(text, default_arch="sm_90").values()
    idx = sass.hot_loop(insns)[0]
    monkeypatch.setattr(pm, "ITERS", 3)
    t0 = pm.simulate(insns, idx, dev, 2, cta_warps=1)
    apart = pm.simulate(insns, idx, dev, 2, cta_warps=1, start=[0.0, t0 / 2])
    assert apart < t0  # one warp's integer phase under the other's MMAs
    monkeypatch.setattr(pm, "PHASES", 0)
    assert pm.phased_cycles(insns, idx, dev, 2, 1) == t0
    monkeypatch.setattr(pm, "PHASES", 2)
    runs = [pm.simulate(insns, idx, dev, 2, cta_warps=1, start=[0.0, 1 + t0 * f]) for f in (0.25, 0.75)]
    assert pm.phased_cycles(insns, idx, dev, 2, 1) == pytest.approx(sum(runs) / 2)
    assert pm.phased_cycles(insns, idx, dev, 2, 2) == pm.simulate(insns, idx, dev, 2, cta_warps=2)
    # PERF_ITERS: every one of those runs that long (this loop's in-phase run is still settling at 3 iterations)
    monkeypatch.setattr(pm, "ITERS", 12)
    long_t0 = pm.simulate(insns, idx, dev, 2, iters=12, cta_warps=1)
    assert long_t0 < t0 - 30
    runs = [pm.simulate(insns, idx, dev, 2, iters=12, cta_warps=1, start=[0.0, 1 + long_t0 * f]) for f in (0.25, 0.75)]
    assert pm.phased_cycles(insns, idx, dev, 2, 1) == pytest.approx(sum(runs) / 2)
    monkeypatch.setattr(pm, "PHASES", 0)
    assert pm.phased_cycles(insns, idx, dev, 2, 1) == long_t0
