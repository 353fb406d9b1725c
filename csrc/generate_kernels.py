"""The one source of the instantiation grid.

Every compiled kernel is listed here: its family (which decides the gencode flags it is built with),
its op, head dim and dtype. `generate(out_dir, grid)` writes one translation unit per kernel into
csrc/instantiations/ and returns the list of (source, family) pairs the build compiles. Each
translation unit registers itself in the binary's kernel registry (csrc/build_info.h) with the archs
it was really compiled for, so the capability report reads what the binary holds, not this file.

Environment knobs (read by setup.py and passed in as `Grid`):
    SINKATTN_CUDA_ARCHS  "80;90a" (default), or "native": the archs of the GPUs visible at build time
                         (setup.py asks torch). 80/86/89 build sm_8x SASS; 90a builds the sm90 family
                         for sm_90a and the sm80 family for sm_90 (the portable path on Hopper);
                         100/120 build native SASS of the portable families for Blackwell. The sm80
                         family also embeds compute_80 PTX, which the driver JIT-compiles on any
                         newer GPU that has no SASS of its own in the build.
    SINKATTN_HEADDIMS    "64,128,256" (default)
    SINKATTN_DTYPES      "bf16,fp16" (default)
    SINKATTN_EMULATION   "0" (default): the host-emulated sm80 kernels are a test facility (the CPU tests run
                         the kernels' logic through them); `make test` builds them with "1". An emulation build
                         also holds SWEEP_EMU_SMOKE, the one emulated tuning variant the CPU tests run the sweep with.
    SINKATTN_SWEEP       "0" (default): no tuning variants. "1": the whole tuning grid of `make gpu-sweep`
                         (SWEEP_SM90, SWEEP_SM80 below, at the grid's head dims and dtypes; with emulation on,
                         the sm80 variants' emulated twins too); or comma-separated substrings: only the variants
                         whose name holds one of them (e.g. "sm90_hdim128"). Variants are registered by name
                         (family "<family>-sweep") and never picked by dispatch; bench/sweep.py runs them.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

ALL_HEADDIMS = (64, 128, 256)
ALL_DTYPES = ("bf16", "fp16")
KNOWN_ARCHS = ("80", "86", "89", "90a", "100", "120")
TRUE_WORDS, FALSE_WORDS = ("1", "true", "on", "yes"), ("0", "false", "off", "no")
CPP_DTYPE = {"bf16": "cutlass::bfloat16_t", "fp16": "cutlass::half_t", "fp32": "float"}


@dataclass
class Grid:
    archs: list[str]
    headdims: list[int]
    dtypes: list[str]
    emulation: bool = False
    sweep: list[str] = field(default_factory=list)  # SINKATTN_SWEEP: [] off, [""] everything, else name substrings
    families: list[str] = field(default_factory=lambda: ["common", "sm80", "sm90"])
    # With SINKATTN_CUDA_ARCHS=native: (GPU name, (major, minor), arch) of each GPU the archs came from.
    native: list[tuple[str, tuple[int, int], str]] = field(default_factory=list)


def arch_of_capability(major: int, minor: int) -> str | None:
    """The arch in KNOWN_ARCHS whose SASS runs natively on compute capability major.minor, or None.

    SASS runs on the same major revision at an equal or higher minor one, so sm_80 code serves cc 8.7 as
    well; 90a is the Hopper build (sm90 kernels as sm_90a, sm80 kernels as sm_90)."""
    if major == 8:
        return {6: "86", 9: "89"}.get(minor, "80")
    if major == 9:
        return "90a"
    if major == 10:
        return "100"
    if major == 12:
        return "120"
    return None


def native_string(grid: Grid) -> str:
    """What build_info records of a native build: the GPUs the archs came from ("" for named archs)."""
    # (a C string literal in a -D define: no double quotes or backslashes from a device name)
    return ", ".join(f"{name} (cc {cc[0]}.{cc[1]}: {arch})".replace('"', "'").replace("\\", "/")
                     for name, cc, arch in grid.native)


def parse_grid(env=os.environ, native=None) -> Grid:
    """The grid the environment asks for. `native` is a callable giving (GPU name, (major, minor)) of each
    visible GPU, used only for SINKATTN_CUDA_ARCHS=native (setup.py passes one that asks torch)."""
    def split(var, default):
        raw = env.get(var, default)
        items = list(dict.fromkeys(x.strip() for x in raw.replace(";", ",").split(",") if x.strip()))
        if not items:
            raise SystemExit(f"sinkattn build: {var}={raw!r} names nothing; leave it unset for the default {default!r}")
        return items

    archs = split("SINKATTN_CUDA_ARCHS", "80;90a")
    found = []
    if "native" in archs:
        if native is None:
            raise SystemExit("sinkattn build: SINKATTN_CUDA_ARCHS=native needs the build to see the GPUs "
                             "(setup.py asks torch); name the archs here, e.g. 80;90a")
        for name, cc in native():
            arch = arch_of_capability(*cc)
            if arch is None:
                raise SystemExit(f"sinkattn build: SINKATTN_CUDA_ARCHS=native: {name} has compute capability "
                                 f"{cc[0]}.{cc[1]}, which no compiled family targets natively; build with "
                                 "SINKATTN_CUDA_ARCHS=80 (its compute_80 PTX runs there through the driver's JIT)")
            found.append((name, tuple(cc), arch))
        if not found:
            raise SystemExit("sinkattn build: SINKATTN_CUDA_ARCHS=native found no GPU; name the archs, e.g. 80;90a")
        rest = [a for a in archs if a != "native"]
        archs = list(dict.fromkeys(rest + sorted({a for _, _, a in found}, key=KNOWN_ARCHS.index)))
    for a in archs:
        if a not in KNOWN_ARCHS:
            raise SystemExit(f"sinkattn build: SINKATTN_CUDA_ARCHS holds {a!r}; accepted: {', '.join(KNOWN_ARCHS)}"
                             " or native (write 90a, not 90: the Hopper kernels need the arch-specific sm_90a target)")
    headdims = []
    for h in split("SINKATTN_HEADDIMS", ",".join(map(str, ALL_HEADDIMS))):
        if not h.isdigit() or int(h) not in ALL_HEADDIMS:
            raise SystemExit(f"sinkattn build: SINKATTN_HEADDIMS holds {h!r}; compiled head dims are "
                             f"{', '.join(map(str, ALL_HEADDIMS))} (other head dims are served by the next compiled one)")
        headdims.append(int(h))
    dtypes = split("SINKATTN_DTYPES", ",".join(ALL_DTYPES))
    for d in dtypes:
        if d not in ALL_DTYPES:
            raise SystemExit(f"sinkattn build: SINKATTN_DTYPES holds {d!r}; accepted: {', '.join(ALL_DTYPES)}")
    emu = env.get("SINKATTN_EMULATION", "0").strip().lower()
    if emu not in TRUE_WORDS + FALSE_WORDS:
        raise SystemExit(f"sinkattn build: SINKATTN_EMULATION={emu!r}; accepted: 1/true/on/yes or 0/false/off/no")
    sweep_raw = env.get("SINKATTN_SWEEP", "0").strip()
    if sweep_raw.lower() in FALSE_WORDS + ("",):
        sweep = []
    elif sweep_raw.lower() in TRUE_WORDS + ("all",):
        sweep = [""]
    else:
        sweep = [x.strip() for x in sweep_raw.split(",") if x.strip()]
    return Grid(archs=archs, headdims=sorted(set(headdims)), dtypes=sorted(set(dtypes)), emulation=emu in TRUE_WORDS,
                sweep=sweep, native=found)


def family_targets(family: str, archs: list[str]) -> list[tuple[str, str]]:
    """(virtual arch, real arch) pairs a family is compiled for, given the requested archs."""
    targets = []
    for a in archs:
        if family == "sm90":
            if a == "90a":
                targets.append(("compute_90a", "sm_90a"))
        elif family == "sm80":
            # sm_8x SASS does not run on cc 9.0, so the portable path on Hopper is compute_80 code
            # compiled to sm_90 SASS.
            targets.append(("compute_80", "sm_90") if a == "90a" else (f"compute_{a}", f"sm_{a}"))
        else:
            targets.append((f"compute_{a}", f"sm_{a}"))
    return targets


def ptx_target(family: str, archs: list[str]) -> str | None:
    """The PTX a family embeds for GPUs newer than its SASS (the portable path elsewhere, docs/DESIGN.md section 2)."""
    return "compute_80" if family in ("sm80", "common") and archs else None


def gencode_flags(family: str, archs: list[str]) -> list[str]:
    flags = [f"-gencode=arch={v},code={r}" for v, r in family_targets(family, archs)]
    ptx = ptx_target(family, archs)
    if ptx:
        flags.append(f"-gencode=arch={ptx},code={ptx}")
    return flags


def arch_list_string(family: str, archs: list[str]) -> str:
    """What the registry records: the real archs with SASS, then the embedded PTX (compute_XX)."""
    targets = [r for _, r in family_targets(family, archs)]
    ptx = ptx_target(family, archs)
    return ",".join(targets + ([ptx] if ptx else []))


@dataclass
class Unit:
    name: str       # file stem in csrc/instantiations/
    family: str     # "common", "sm80", "sm90" or "emu" (host code compiled by the C++ compiler)
    text: str
    registers: bool = True  # False: a part of a kernel whose launcher (and registry entry) is in another unit


# The attention kernel units: (header, launcher, its params and launch argument, registry family, features
# macro, build family). Each unit instantiates one (head dim, dtype) of a launcher and registers it.
_KERNEL_UNITS = {
    "fwd_sm80": ("sm80/fwd_launch.cuh", "run_fwd_sm80", "FwdParams", "cudaStream_t", "sm80",
                 "SINKATTN_FWD_FEATURES", "sm80"),
    "fwd_sm90": ("sm90/fwd_launch.cuh", "run_fwd_sm90", "FwdParams", "cudaStream_t", "sm90",
                 "SINKATTN_FWD_SM90_FEATURES", "sm90"),
    "fwd_emu": ("emu/fwd_sm80_emu.h", "run_fwd_sm80_emulated", "FwdParams", "EmuLaunch const&", "sm80-emulated",
                "SINKATTN_FWD_FEATURES", "emu"),
    "bwd_sm80": ("sm80/bwd_launch.cuh", "run_bwd_sm80", "BwdParams", "cudaStream_t", "sm80",
                 "SINKATTN_BWD_FEATURES", "sm80"),
    "bwd_sm90": ("sm90/bwd_launch.cuh", "run_bwd_sm90", "BwdParams", "cudaStream_t", "sm90",
                 "SINKATTN_BWD_SM90_FEATURES", "sm90"),
    "bwd_emu": ("emu/bwd_sm80_emu.h", "run_bwd_sm80_emulated", "BwdParams", "EmuLaunch const&", "sm80-emulated",
                "SINKATTN_BWD_FEATURES", "emu"),
}

# The registry's smem_bytes of each kind: the smallest tile of the head dim's table (sm80/fwd_tiles.h,
# sm80/bwd_tiles.h, sm90/fwd_tiles.h), read from the table itself so that dispatch never repeats it.
_SMEM_BYTES = {
    "fwd_sm80": "sm80::fwd_min_smem<{hdim}>()",
    "fwd_emu": "sm80::fwd_min_smem<{hdim}>()",
    "bwd_sm80": "sm80::bwd_min_smem<{hdim}>()",
    "bwd_emu": "sm80::bwd_min_smem<{hdim}>()",
    "fwd_sm90": "sm90::fwd_min_smem<{hdim}>()",
    "bwd_sm90": "sm90::bwd_min_smem<{hdim}>()",
}

# Head dims a kind has no tile for (the others' kernels serve them; the capability report says which): the sm90
# backward's dK and dV alone would take 256 registers per thread at head dim 256 (sm90/bwd_tiles.h).
_NO_TILE = {"bwd_sm90": (256,)}


# The sm80 kernels' tile configurations are compiled in parts (FwdUnit / BwdUnit in sm80/fwd_config.h and
# bwd_config.h; fwd_launch.cuh says how): the first part rides with the launcher's unit, each other part gets a
# unit of its own, named with its suffix, which the build compiles in parallel. Per kind: the launcher's part
# template, the enum, and per head dim the parts beyond the first as (enumerator, unit name suffix).
_PARTS = {
    "fwd_sm80": ("sm80::launch_fwd_part", "sm80::FwdUnit", "FwdParams",
                 {h: (("kKeyGroups", "_keys"), ("kSoftcap", "_softcap")) for h in ALL_HEADDIMS}),
    "bwd_sm80": ("sm80::launch_bwd_part", "sm80::BwdUnit", "BwdParams",
                 {h: ((("kSmallSmem", "_small"),) if h == 128 else ()) + (("kSoftcap", "_softcap"),)
                  for h in ALL_HEADDIMS}),
    "fwd_emu": ("sm80::launch_fwd_part_emulated", "sm80::FwdUnit", "FwdParams",
                {h: (("kKeyGroups", "_keys"), ("kSoftcap", "_softcap")) for h in ALL_HEADDIMS}),
}


def _part_fn(kind: str, hdim: int, dtype: str, part: str) -> str:
    fn, enum, params, _ = _PARTS[kind]
    return f"{fn}<{hdim}, {CPP_DTYPE[dtype]}, {enum}::{part}>({params} const&, {_KERNEL_UNITS[kind][3]})"


def _parts(kind: str, hdim: int) -> tuple:
    return _PARTS[kind][3].get(hdim, ()) if kind in _PARTS else ()


def _part_unit(kind: str, hdim: int, dtype: str, part: str, suffix: str) -> Unit:
    header = _KERNEL_UNITS[kind][0]
    name = f"{kind}_hdim{hdim}_{dtype}"
    text = f"""// Generated by csrc/generate_kernels.py: do not edit.
// {name}{suffix}: the {part} tiles of {name}, which launches them.
#include "{header}"
namespace sinkattn {{
template void {_part_fn(kind, hdim, dtype, part)};
}}  // namespace sinkattn
"""
    return Unit(name + suffix, _KERNEL_UNITS[kind][6], text, registers=False)


def _kernel_unit(kind: str, hdim: int, dtype: str) -> Unit:
    header, launcher, params, launch_arg, registry_family, features, family = _KERNEL_UNITS[kind]
    name = f"{kind}_hdim{hdim}_{dtype}"
    fn = f"{launcher}<{hdim}, {CPP_DTYPE[dtype]}>"
    elsewhere = "".join(f"extern template void {_part_fn(kind, hdim, dtype, part)};  // in {name}{suffix}\n"
                        for part, suffix in _parts(kind, hdim))
    text = f"""// Generated by csrc/generate_kernels.py: do not edit.
#include "{header}"
namespace sinkattn {{
{elsewhere}template void {fn}({params} const&, {launch_arg});
SINKATTN_REGISTER_KERNEL({name}, "{registry_family}", "{kind[:3]}", {hdim}, "{dtype}", {features},
                         {_SMEM_BYTES[kind].format(hdim=hdim)}, ({fn}))
}}  // namespace sinkattn
"""
    return Unit(name, family, text)


def _merge_unit(dtype: str) -> Unit:
    text = f"""// Generated by csrc/generate_kernels.py: do not edit.
#include "common/merge_launch.cuh"
namespace sinkattn {{
template void run_merge<{CPP_DTYPE[dtype]}>(MergeParams const&, cudaStream_t);
SINKATTN_REGISTER_KERNEL(merge_{dtype}, "common", "merge", 0, "{dtype}", "sinks", 0, (run_merge<{CPP_DTYPE[dtype]}>))
}}  // namespace sinkattn
"""
    return Unit(f"merge_{dtype}", "common", text)


# ---- the tuning grid of `make gpu-sweep` (issue 17 item 4, docs/DESIGN.md section 8) --------------------------------
# Kernel variants beside the default tables, each its own unit (they build in parallel), registered by name and
# run by bench/sweep.py, which checks every one against the oracle and times them all on the target shapes. Off
# by default: every unit costs every build. A round's winners move into the tables (sm90/fwd_tiles.h,
# sm80/fwd_tiles.h); the grid stays for the next round. Each entry states why it is here.
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

    def features(self) -> str:  # what its registry entry says it serves (and needs: a tile counter)
        return "SINKATTN_FWD_SM90_FEATURES" + (' ",tile_counter"' if self.dynamic_tiles else "")

    def smem_bytes(self) -> int:  # FwdTile::smem_bytes, for the static checks in tests
        return (self.q_buffers * self.block_m + 2 * self.stages * self.block_n) * self.head_dim * 2 + 1024

    def cpp(self) -> str:
        return (f"sm90::FwdTile{{.head_dim = {self.head_dim}, .block_n = {self.block_n}, .stages = {self.stages}, "
                f".producer_regs = {self.producer_regs}, .consumer_regs = {self.consumer_regs}, "
                f".block_m = {self.block_m}, .pingpong = {str(self.pingpong).lower()}, .q_buffers = {self.q_buffers}, "
                f".dynamic_tiles = {str(self.dynamic_tiles).lower()}}}")


@dataclass(frozen=True)
class Sm80Variant:
    """An sm80 forward tile (sm80/fwd_tiles.h FwdTile), softcap compiled out."""
    head_dim: int
    block_m: int
    block_n: int
    warps: int
    stages: int = 2

    def tag(self) -> str:
        return f"m{self.block_m}n{self.block_n}w{self.warps}" + (f"s{self.stages}" if self.stages != 2 else "")

    def smem_bytes(self) -> int:
        return (self.block_m + 2 * self.stages * self.block_n) * self.head_dim * 2

    def features(self) -> str:
        return "SINKATTN_FWD_VARIANT_FEATURES"

    def cpp(self) -> str:
        return (f"sm80::FwdTile{{.head_dim = {self.head_dim}, .block_m = {self.block_m}, .block_n = {self.block_n}, "
                f".warps = {self.warps}, .stages = {self.stages}}}")


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
    # hd256 (table: m128 n48 s2 r24x240; 470 / 307, FA3 756 / 642).
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
    # hd64 (table: Hd64Rows m128 n64 w4).
    Sm80Variant(64, 128, 128, 4),   # FlashAttention-2's hd64 tile (S 128 registers per thread; ptxas: 164 B spill)
    Sm80Variant(64, 128, 64, 8),    # 8 warps x 16 rows
    Sm80Variant(64, 128, 64, 4, 3),  # a third K/V stage
    # hd128 (table: Hd128Rows m128 n64 w8; static: 0.56 LDSM per HMMA against FA2's 0.31, peer_sass).
    Sm80Variant(128, 128, 64, 4),   # FlashAttention-2's tile on sm80/sm90: 0.31 LDSM/HMMA (ptxas: 48 B spill on sm_90)
    Sm80Variant(128, 128, 32, 4),   # 4 x 32 rows with half the S registers (255 registers, no spill on sm_90)
    Sm80Variant(128, 128, 128, 8),  # 160 KB: longer key blocks, fewer rescale rounds
    Sm80Variant(128, 64, 64, 4),    # 64 rows: twice the CTAs
    Sm80Variant(128, 128, 64, 8, 3),  # a third stage (128 KB)
    # hd256 (table: Hd256Rows m64 n64 w4).
    Sm80Variant(256, 128, 32, 8),   # 128 rows with 32-key blocks (128 KB)
    Sm80Variant(256, 64, 32, 4, 3),  # 32-key blocks, 3 stages (128 KB)
]

# The emulated variant every emulation build holds (the CPU tests run the sweep's variant path through it):
# FlashAttention-2's hd128 tile, issue 15's open question, so its correctness is checked on the CPU too.
SWEEP_EMU_SMOKE = Sm80Variant(128, 128, 64, 4)


def variant_name(family: str, v, dtype: str) -> str:
    return f"sweep_fwd_{family}_hdim{v.head_dim}_{dtype}_{v.tag()}"


# Per build family of a variant: the namespace of its FwdTile, the header and launcher template it instantiates,
# the launcher's second argument, and its registry family.
_VARIANT_KINDS = {
    "sm90": ("sm90", "sm90/fwd_launch.cuh", "sm90::launch_fwd", "cudaStream_t", "sm90-sweep"),
    "sm80": ("sm80", "sm80/fwd_launch.cuh", "sm80::launch_fwd_variant", "cudaStream_t", "sm80-sweep"),
    "emu": ("sm80", "emu/fwd_sm80_emu.h", "sm80::launch_fwd_variant_emulated", "EmuLaunch const&",
            "sm80-emulated-sweep"),
}


def _variant_unit(family: str, v, dtype: str) -> Unit:
    name = variant_name(family, v, dtype)
    arch, header, fn_template, launch_arg, registry_family = _VARIANT_KINDS[family]
    features = v.features()
    tile = f"SweepTile_{name}"
    fn = f"{fn_template}<{tile}, {CPP_DTYPE[dtype]}>"
    text = f"""// Generated by csrc/generate_kernels.py: do not edit.
// A tuning-grid variant (SINKATTN_SWEEP): registered by name, run by bench/sweep.py, never picked by dispatch.
#include "{header}"
namespace sinkattn {{
struct {tile} {{ static constexpr {arch}::FwdTile tile = {v.cpp()}; }};
template void {fn}(FwdParams const&, {launch_arg});
SINKATTN_REGISTER_KERNEL({name}, "{registry_family}", "fwd", {v.head_dim}, "{dtype}", {features},
                         {tile}::tile.smem_bytes(), ({fn}))
}}  // namespace sinkattn
"""
    return Unit(name, family, text)


def sweep_units(grid: Grid) -> list[Unit]:
    """The tuning variants the grid asks for (SINKATTN_SWEEP), at its head dims and dtypes, plus the emulation
    build's smoke variant."""
    want = lambda name: any(pat in name for pat in grid.sweep)  # noqa: E731
    out = []
    for family, table, on in (("sm90", SWEEP_SM90, "sm90" in grid.families and family_targets("sm90", grid.archs)),
                              ("sm80", SWEEP_SM80, "sm80" in grid.families and family_targets("sm80", grid.archs)),
                              ("emu", SWEEP_SM80, grid.emulation)):
        if not on:
            continue
        for v in table:
            for d in grid.dtypes:
                if v.head_dim in grid.headdims and want(variant_name(family, v, d)):
                    out.append(_variant_unit(family, v, d))
    if grid.emulation and SWEEP_EMU_SMOKE.head_dim in grid.headdims:
        smoke = _variant_unit("emu", SWEEP_EMU_SMOKE, grid.dtypes[0])
        if smoke.name not in {u.name for u in out}:
            out.append(smoke)
    return out


def units(grid: Grid) -> list[Unit]:
    out = [_merge_unit(d) for d in (*grid.dtypes, "fp32")]
    kinds = []
    if "sm80" in grid.families and family_targets("sm80", grid.archs):
        kinds += ["fwd_sm80", "bwd_sm80"]
    if "sm90" in grid.families and family_targets("sm90", grid.archs):
        kinds += ["fwd_sm90", "bwd_sm90"]
    if grid.emulation:
        kinds += ["fwd_emu", "bwd_emu"]
    out += [_kernel_unit(kind, h, d) for kind in kinds for h in grid.headdims for d in grid.dtypes
            if h not in _NO_TILE.get(kind, ())]
    out += [_part_unit(kind, h, d, part, suffix) for kind in kinds for h in grid.headdims for d in grid.dtypes
            for part, suffix in _parts(kind, h)]
    return out + sweep_units(grid)


def generate(out_dir: str, grid: Grid) -> list[tuple[str, str]]:
    os.makedirs(out_dir, exist_ok=True)
    written = []
    keep = set()
    for u in units(grid):
        ext = ".cpp" if u.family == "emu" else ".cu"
        path = os.path.join(out_dir, u.name + ext)
        keep.add(path)
        # Rewrite only on change so ninja/ccache keep their work.
        if not os.path.exists(path) or open(path).read() != u.text:
            with open(path, "w") as f:
                f.write(u.text)
        written.append((path, u.family))
    for stale in os.listdir(out_dir):
        p = os.path.join(out_dir, stale)
        if p not in keep and (stale.endswith(".cu") or stale.endswith(".cpp")):
            os.remove(p)
    return written


if __name__ == "__main__":
    g = parse_grid()
    for path, fam in generate(os.path.join(os.path.dirname(os.path.abspath(__file__)), "instantiations"), g):
        print(fam, path)
