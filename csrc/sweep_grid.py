"""The tuning grid of `make gpu-sweep` (docs/DESIGN.md section 8): kernel variants beside the
default tile tables, which csrc/generate_kernels.py compiles with SINKATTN_SWEEP (each its own unit, registered by
name in a "<family>-sweep" family that dispatch never picks) and bench/sweep/runner.py runs, checks against the oracle
and times on the target shapes. Off by default: every unit costs every build. A round's winners move into the
tables (sm90/fwd_tiles.h, sm80/fwd_tiles.h); the grid stays for the next round. Each entry states why it is here.

Pure data and naming: no file I/O, nothing of the build (the generator owns the units' text).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Sm90Variant:
    """An sm90 forward tile (sm90/fwd_tiles.h FwdTile): the defaults are the table's."""
    head_dim: int
    block_n: int
    stages: int
    block_m: int = 128
    producer_regs: int = 40
    consumer_regs: int = 232
    pingpong: bool = True
    q_buffers: int = 1
    dynamic_tiles: bool = False

    def tag(self) -> str:
        t = f"m{self.block_m}n{self.block_n}s{self.stages}"
        if (self.producer_regs, self.consumer_regs) != (40, 232):
            t += f"r{self.producer_regs}x{self.consumer_regs}"
        return (t + ("" if self.pingpong else "_nopp") + ("_q2" if self.q_buffers == 2 else "")
                + ("_dyn" if self.dynamic_tiles else ""))

    def features(self) -> str:  # what its registry entry says it serves (and needs: a tile counter); {tile}: its struct
        return "sm90::fwd_features({tile}::tile)"

    def smem_bytes(self) -> int:  # FwdTile::smem_bytes, for the static checks in tests
        return (self.q_buffers * self.block_m + 2 * self.stages * self.block_n) * self.head_dim * 2 + 1024

    def cpp(self) -> str:
        return (f"sm90::FwdTile{{.head_dim = {self.head_dim}, .block_n = {self.block_n}, .stages = {self.stages}, "
                f".producer_regs = {self.producer_regs}, .consumer_regs = {self.consumer_regs}, "
                f".block_m = {self.block_m}, .pingpong = {str(self.pingpong).lower()}, .q_buffers = {self.q_buffers}, "
                f".dynamic_tiles = {str(self.dynamic_tiles).lower()}}}")


@dataclass(frozen=True)
class Sm80Variant:
    """An sm80 forward prefill tile (sm80/fwd_tiles.h FwdTile, prefill 1), softcap compiled out."""
    head_dim: int
    block_m: int
    block_n: int
    warps: int
    stages: int = 2
    q_regs: int = 0  # FwdTile::q_regs: Q fragments held in registers across the key blocks
    s_ahead: int = 0  # FwdTile::s_ahead: S of the next key block computed beside this block's softmax
    branch_free_loads: int = 0  # FwdTile::branch_free_loads: interior K/V blocks through predicated copies
    ctas_per_sm: int = 0  # FwdTile::ctas_per_sm: the CTAs per SM the launch bounds ask for (a register cap)

    def tag(self) -> str:
        return (f"m{self.block_m}n{self.block_n}w{self.warps}" + (f"s{self.stages}" if self.stages != 2 else "")
                + ("q" if self.q_regs else "") + ("a" if self.s_ahead else "") + ("b" if self.branch_free_loads else "")
                + (f"c{self.ctas_per_sm}" if self.ctas_per_sm else ""))

    def smem_bytes(self) -> int:
        return (self.block_m + 2 * self.stages * self.block_n) * self.head_dim * 2

    def features(self) -> str:  # (no {tile}: every variant serves the same)
        return "SINKATTN_FWD_VARIANT_FEATURES"

    def cpp(self) -> str:
        return (f"sm80::FwdTile{{.head_dim = {self.head_dim}, .block_m = {self.block_m}, .block_n = {self.block_n}, "
                f".warps = {self.warps}, .stages = {self.stages}, .q_regs = {self.q_regs}, .s_ahead = {self.s_ahead}, "
                f".branch_free_loads = {self.branch_free_loads}, .ctas_per_sm = {self.ctas_per_sm}, .prefill = 1}}")


_R3 = dict(block_m=192, producer_regs=24, consumer_regs=160)  # three consumer warpgroups: 128 * (24 + 3 * 160) = 64512
SWEEP_SM90 = [
    # hd64 (table: m128 n128 s3; 446 / 381 TFLOP/s non-causal / causal on the H200, FA3 on an H100 497 / 473).
    Sm90Variant(64, 128, 3, q_buffers=2),         # the next tile's Q loads during this tile's main loop
    Sm90Variant(64, 128, 4),                      # deeper K/V pipeline
    Sm90Variant(64, 176, 2), Sm90Variant(64, 192, 2), Sm90Variant(64, 192, 3),  # longer key blocks: fewer softmax rounds
    Sm90Variant(64, 128, 3, pingpong=False),      # is the turn-taking worth its barriers at hd64?
    Sm90Variant(64, 128, 3, **_R3, pingpong=False),  # FA4's sm90 hd64 M tile (192 rows)
    Sm90Variant(64, 128, 3, **_R3),               # ... with a three-way ping-pong
    Sm90Variant(64, 128, 2, **_R3, q_buffers=2, pingpong=False),
    Sm90Variant(64, 128, 3, dynamic_tiles=True),  # tiles drawn from a global counter: the causal tail balanced
    # hd128 (table: m128 n128 s2; 618 / 545, FA3 648 / 616).
    Sm90Variant(128, 128, 2, q_buffers=2),        # 193 KB
    Sm90Variant(128, 176, 2, producer_regs=24, consumer_regs=240),  # FA3's hd128 tile (213 KB; ptxas: 20 B spill)
    Sm90Variant(128, 144, 2, q_buffers=2, producer_regs=24, consumer_regs=240),  # 212 KB
    Sm90Variant(128, 128, 3),                     # 225 KB
    Sm90Variant(128, 96, 4),                      # 225 KB: shorter blocks, deeper pipeline (windows, causal edges)
    Sm90Variant(128, 128, 2, pingpong=False),
    Sm90Variant(128, 128, 2, dynamic_tiles=True),
    Sm90Variant(128, 128, 2, q_buffers=2, dynamic_tiles=True),
    # (192 rows at hd128 were dropped: O 64 + S 48 + P 24 registers spill 56/72 B at 160 per thread, n96 s2.)
    # hd256 (table: m128 n48 s2 r40x224 since 2026-12-06, so that its producer gathers pages and FP8 caches; measured
    # as r24x240, the table before it: 470 / 307, FA3 756 / 642, which the first variant keeps).
    Sm90Variant(256, 48, 2, producer_regs=24, consumer_regs=240),   # 161 KB: the table's tile before 2026-12-06
    Sm90Variant(256, 64, 2, producer_regs=24, consumer_regs=240),   # 193 KB; O 128 + S 32 + P 16 registers
    Sm90Variant(256, 80, 2, producer_regs=24, consumer_regs=240),   # 225 KB (ptxas: 12 B spill)
    Sm90Variant(256, 48, 2, producer_regs=24, consumer_regs=240, q_buffers=2),  # 225 KB
    Sm90Variant(256, 32, 4, producer_regs=24, consumer_regs=240),   # 193 KB: short blocks, 4 in flight
    Sm90Variant(256, 64, 2, producer_regs=24, consumer_regs=240, pingpong=False),
    # hd256 has the fewest tiles per CTA (nheads 8: 7.75 per SM at 16k), so the causal tail weighs most there.
    # The drawing producer spills ~100 B at 24 registers, so these keep 40 / 232 (no spill), beside their control:
    Sm90Variant(256, 48, 2),
    Sm90Variant(256, 48, 2, dynamic_tiles=True),
    Sm90Variant(256, 64, 2, dynamic_tiles=True),
]

SWEEP_SM80 = [
    # hd64 (table: Hd64RowsTwoCtas m128 n64 w4 s3, two CTAs per SM, on sm80 and sm90; Hd64Rows, two stages, on sm86).
    Sm80Variant(64, 128, 64, 4),    # Hd64Rows (sm86 / sm89's): the third stage measured on one GPU
    Sm80Variant(64, 64, 64, 4, q_regs=1, ctas_per_sm=3),  # sm80's and sm90's table tile before Hd64RowsTwoCtas
    Sm80Variant(64, 128, 128, 4),   # FlashAttention-2's hd64 tile (S 128 registers per thread; ptxas: 164 B spill)
    Sm80Variant(64, 128, 64, 8),    # 8 warps x 16 rows
    # hd128 (table: Hd128Rows m128 n64 w8 with Q in registers and S ahead, sm86 / sm89; on sm90 the same with
    # branch-free loads; on sm80 Hd128RowsTwoCtas m128 n32 w4 s3, two CTAs per SM; static: 0.56 LDSM per HMMA against
    # FA2's 0.31, peer_sass, 0.50 with Q in registers).
    # On sm90 the table's tile loads its interior K/V blocks branch-free (Hd128RowsSm90); this is it with the loader's
    # branches, the sm8x tile (Hd128Rows), which sm90 ran before: the change measured on one GPU.
    Sm80Variant(128, 128, 64, 8, q_regs=1, s_ahead=1),
    Sm80Variant(128, 128, 64, 8, q_regs=1),  # the table's tile without S ahead (before s_ahead)
    Sm80Variant(128, 128, 64, 8),   # ... and reading Q from shared memory every key block (before q_regs)
    Sm80Variant(128, 128, 64, 4),   # FlashAttention-2's rows and keys, double-buffered (96 KB; ptxas: 28 B spill on sm_90)
    # FlashAttention-2's hd128 tile on sm80 / sm90 itself: one K and one V buffer loaded staggered, 64 KB, two CTAs per
    # SM. By the SASS model on an H200 it leads the table's tile with the two CTAs' warps out of phase (0.98-1.00x of
    # FA2 against 0.88-0.96x) and trails it in phase on causal rows (0.97 against 0.99-1.02); ptxas spills 64 B on
    # sm_90 (76 on sm_80): LDSM addresses of K, reloaded once a key block.
    Sm80Variant(128, 128, 64, 4, 1, ctas_per_sm=2),
    Sm80Variant(128, 128, 32, 4),   # 4 x 32 rows with half the S registers (255 registers, no spill on sm_90)
    Sm80Variant(128, 128, 128, 8),  # 160 KB: longer key blocks, fewer rescale rounds
    Sm80Variant(128, 128, 32, 4, 3, ctas_per_sm=2),  # sm80's table tile (Hd128RowsTwoCtas), timed on an sm90 GPU
    Sm80Variant(128, 64, 64, 4, q_regs=1, s_ahead=1),  # sm80's table tile before Hd128RowsTwoCtas (64 rows, two CTAs)
    Sm80Variant(128, 128, 64, 8, 3),  # a third stage (128 KB)
    # hd256 (table: one K and one V buffer loaded staggered, Hd256Staggered m64 n64 w4 where two CTAs fit (sm90),
    # Hd256Rows m128 n64 w8 on sm80).
    Sm80Variant(256, 64, 64, 4),    # double-buffered, 160 KB, one CTA per SM: sm80's tile before Hd256Rows
    Sm80Variant(256, 128, 64, 8, 1),  # sm80's table tile (Hd256Rows, 128 KB), measured where the GPU is an sm90
    Sm80Variant(256, 64, 32, 4, 3),  # 32-key blocks, 3 stages (128 KB)
]

# The emulated variant every emulation build holds (the CPU tests run the sweep's variant path through it):
# FlashAttention-2's hd128 tile (whether ours should take it is open until a GPU round), so its correctness is
# checked on the CPU too.
SWEEP_EMU_SMOKE = Sm80Variant(128, 128, 64, 4)

# Which kernel kind (generate_kernels.py KINDS) compiles which list, in the order the units are written: the sm80
# variants also have emulated twins in an emulation build.
VARIANTS = (("fwd_sm90", SWEEP_SM90), ("fwd_sm80", SWEEP_SM80), ("fwd_emu", SWEEP_SM80), ("fwd_emu90", SWEEP_SM90))
SMOKE_KIND = "fwd_emu"  # the kind that compiles SWEEP_EMU_SMOKE, in every emulation build
# Every emulation build also holds the emulated twin of each SWEEP_SM90 variant at its head dims (first dtype): the
# variants have never run on a GPU, and the CPU tests run each against the oracle (tests/test_sm90_emulated.py).
EMU90_KIND = "fwd_emu90"


def variant_name(family: str, v, dtype: str) -> str:
    """The unit's (and registry entry's) name of variant `v` compiled in build family `family` for `dtype`."""
    return f"sweep_fwd_{family}_hdim{v.head_dim}_{dtype}_{v.tag()}"
