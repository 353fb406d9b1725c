"""The one source of the instantiation grid.

Every compiled kernel kind is listed here (KINDS: its family, which decides the gencode flags it is built with,
its op, launcher and registry entry); which head dims it has, and which of them compile in parts, come from the
C++ tables themselves (read strictly below), and the tuning variants from sweep_grid.py. `units(grid)` lists one
unit per kernel (or part of one); `generate(out_dir, grid)` writes the translation units the build compiles into
csrc/instantiations/ (`translation_units`: a GPU unit each, the emulated ones packed per header and head dim) and
returns the list of (source, family) pairs. Each kernel registers itself in the binary's kernel registry
(csrc/build_info.h) with the archs it was really compiled for, so the capability report reads what the binary
holds, not this file.

Environment knobs (read by setup.py and passed in as `Grid`):
    SINKATTN_CUDA_ARCHS  "80;90a" (default), or "native": the archs of the GPUs visible at build time
                         (setup.py asks torch). 80/86/89 build sm_8x SASS; 90a builds the sm90 family
                         for sm_90a and the sm80 family for sm_90 (the portable path on Hopper);
                         100/120 build native SASS of the portable families for Blackwell. The sm80
                         family also embeds compute_80 PTX, which the driver JIT-compiles on any
                         newer GPU that has no SASS of its own in the build.
    SINKATTN_HEADDIMS    "64,128,256" (default: build_info.h kKernelHeadDims, the one list of them)
    SINKATTN_DTYPES      "bf16,fp16" (default)
    SINKATTN_GPU_HEADDIMS, SINKATTN_GPU_DTYPES   subsets of the two above (default: all of them) for the GPU units
                         alone; the emulated units keep the whole grid. A build without a GPU compiles its GPU
                         units only to check that they compile, and the emulated units already instantiate every
                         tile table (their static checks included) at every head dim and dtype, so CI narrows the
                         GPU units to head dims 64 and 256 in bf16: the fp16 units are the same templates at
                         another element type, and hd128's tiles sit between the two (one unit is about 2 min).
    SINKATTN_EMULATION   "0" (default): the host-emulated sm80 kernels are a test facility (the CPU tests run
                         the kernels' logic through them); `make test` builds them with "1". An emulation build
                         also holds SWEEP_EMU_SMOKE, the one emulated tuning variant the CPU tests run the sweep with.
    SINKATTN_DIAGNOSTIC  "0" (default). "1": the diagnostic GPU build: every sm90 mbarrier wait bounded, a hang
                         printed (block, warp, barrier, phase) and trapped (sm90/prims_gpu.cuh); slower (a printf
                         call serializes wgmma), for a GPU round's never-run kernels only.
    SINKATTN_SWEEP       "0" (default): no tuning variants. "1": the whole tuning grid of `make gpu-sweep`
                         (sweep_grid.py SWEEP_SM90, SWEEP_SM80, at the grid's head dims and dtypes; with emulation on,
                         the sm80 variants' emulated twins too); or comma-separated substrings: only the variants
                         whose name holds one of them (e.g. "sm90_hdim128"). Variants are registered by name
                         (family "<family>-sweep") and never picked by dispatch; bench/sweep/runner.py runs them.
"""
from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, field

CSRC = os.path.dirname(os.path.abspath(__file__))
if CSRC not in sys.path:  # the tuning grid beside this file (setup.py and the tests load this file by path)
    sys.path.insert(0, CSRC)
from sweep_grid import (EMU90_KIND, SMOKE_KIND, SWEEP_EMU_SMOKE, SWEEP_SM80, SWEEP_SM90, VARIANTS,  # noqa: E402,F401
                        Sm80Variant, Sm90Variant, variant_name)

ALL_DTYPES = ("bf16", "fp16")
KNOWN_ARCHS = ("80", "86", "89", "90a", "100", "120")
TRUE_WORDS, FALSE_WORDS = ("1", "true", "on", "yes"), ("0", "false", "off", "no")
CPP_DTYPE = {"bf16": "cutlass::bfloat16_t", "fp16": "cutlass::half_t", "fp32": "float"}


@dataclass
class Grid:
    archs: list[str]
    headdims: list[int]
    dtypes: list[str]
    # SINKATTN_GPU_HEADDIMS / SINKATTN_GPU_DTYPES: the GPU units' subsets of the two above (None: all of them).
    gpu_headdims_only: list[int] | None = None
    gpu_dtypes_only: list[str] | None = None
    emulation: bool = False
    # SINKATTN_DIAGNOSTIC: every sm90 mbarrier wait bounded, a hang printed and trapped (sm90/prims_gpu.cuh);
    # a compile define only (no unit changes), off by default.
    diagnostic: bool = False
    sweep: list[str] = field(default_factory=list)  # SINKATTN_SWEEP: [] off, [""] everything, else name substrings
    families: list[str] = field(default_factory=lambda: ["common", "sm80", "sm90"])
    # With SINKATTN_CUDA_ARCHS=native: (GPU name, (major, minor), arch) of each GPU the archs came from.
    native: list[tuple[str, tuple[int, int], str]] = field(default_factory=list)

    def headdims_of(self, family: str) -> list[int]:
        """The head dims a build family's units are compiled at (the emulated units: the whole grid's)."""
        return self.headdims if family == "emu" or self.gpu_headdims_only is None else self.gpu_headdims_only

    def dtypes_of(self, family: str) -> list[str]:
        return self.dtypes if family == "emu" or self.gpu_dtypes_only is None else self.gpu_dtypes_only


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
    diag = env.get("SINKATTN_DIAGNOSTIC", "0").strip().lower()
    if diag not in TRUE_WORDS + FALSE_WORDS:
        raise SystemExit(f"sinkattn build: SINKATTN_DIAGNOSTIC={diag!r}; accepted: 1/true/on/yes or 0/false/off/no")
    sweep_raw = env.get("SINKATTN_SWEEP", "0").strip()
    if sweep_raw.lower() in FALSE_WORDS + ("",):
        sweep = []
    elif sweep_raw.lower() in TRUE_WORDS + ("all",):
        sweep = [""]
    else:
        sweep = [x.strip() for x in sweep_raw.split(",") if x.strip()]
    headdims, dtypes = sorted(set(headdims)), sorted(set(dtypes))

    def subset(var, whole, kind):
        if not env.get(var, "").strip():
            return None
        items = [int(x) if kind is int and x.isdigit() else x for x in split(var, "")]
        stray = [x for x in items if x not in whole]
        if stray:
            raise SystemExit(f"sinkattn build: {var} holds {stray[0]!r}, which the grid does not ({whole}); the GPU "
                             f"units are a subset of the grid (SINKATTN_HEADDIMS / SINKATTN_DTYPES)")
        return sorted(set(items))
    return Grid(archs=archs, headdims=headdims, dtypes=dtypes, emulation=emu in TRUE_WORDS,
                diagnostic=diag in TRUE_WORDS, sweep=sweep, native=found,
                gpu_headdims_only=subset("SINKATTN_GPU_HEADDIMS", headdims, int),
                gpu_dtypes_only=subset("SINKATTN_GPU_DTYPES", dtypes, str))


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
    header: str = ""        # what it includes (an emulated unit is packed with the others of its header, head dim)
    headdim: int = 0
    twins: tuple[str, ...] = ()  # other registry entries of the same kernel it registers (Kind.fp8_twin)

    @property
    def registered(self) -> list[str]:
        """The registry names this unit adds."""
        return [self.name, *self.twins] if self.registers else []


# ---- the facts the C++ tables own, read from them -------------------------------------------------------------
# Strict readers of clearly marked declarations: anything that is not exactly of the declared form stops the build
# with the file and what was expected, so a table and the units cannot drift apart silently.
def _table_error(where: str, msg: str) -> SystemExit:
    return SystemExit(f"sinkattn build: csrc/{where}: {msg} (csrc/generate_kernels.py reads it; docs/DESIGN.md "
                      "section 3)")


def _read(rel: str) -> str:
    with open(os.path.join(CSRC, rel)) as f:
        return f.read()


def parse_headdims(text: str, where: str = "build_info.h") -> tuple[int, ...]:
    """kKernelHeadDims: `inline constexpr int kKernelHeadDims[] = {64, 128, 256};` on one line, ascending."""
    lines = [ln for ln in text.splitlines() if "constexpr" in ln and "kKernelHeadDims" in ln]
    m = re.fullmatch(r"inline constexpr int kKernelHeadDims\[\] = \{((?:\s*\d+\s*,)*\s*\d+\s*)\};(\s*//.*)?",
                     lines[0].strip()) if len(lines) == 1 else None
    if m is None:
        raise _table_error(where, f"expected one line `inline constexpr int kKernelHeadDims[] = {{64, 128, 256}};`, "
                                  f"found {len(lines)} declaration line(s): {lines!r}")
    hds = tuple(int(x) for x in m.group(1).split(","))
    if list(hds) != sorted(set(hds)):
        raise _table_error(where, f"kKernelHeadDims must be ascending without repeats (got {hds})")
    return hds


def parse_tile_headdims(text: str, table: str, where: str, known: tuple[int, ...]) -> tuple[int, ...]:
    """The head dims a tile table has: its specializations, each `template <> struct <table><N> {` at a line's
    start. Any other `<table><digit` in the file (a specialization written another way) stops the build."""
    strict = [int(h) for h in re.findall(rf"^template <> struct {table}<(\d+)> \{{", text, re.M)]
    mentions = len(re.findall(rf"\b{table}<\s*\d", text))
    if not strict or mentions != len(strict):
        raise _table_error(where, f"expected each specialization of {table} as `template <> struct {table}<N> {{` at "
                                  f"a line's start; {len(strict)} of {mentions} read")
    bad = [h for h in strict if h not in known] + [h for h in set(strict) if strict.count(h) > 1]
    if bad:
        raise _table_error(where, f"{table}<{bad[0]}>: not once, or not in build_info.h kKernelHeadDims {known}")
    return tuple(sorted(strict))


def parse_parts(text: str, enum: str, array: str, where: str, known: tuple[int, ...]) -> dict[int, tuple[str, ...]]:
    """A parts declaration: `enum class <enum> { kFirst, kPart, ... };` (kFirst: the launcher's own part) and
    `inline constexpr <T> <array>[] = { {N, <enum>::kPart}, ... };`. Per head dim, its other parts in order."""
    enums = re.findall(rf"^enum class {enum} \{{([^{{}}]*)\}};", text, re.M)
    names = [x.strip() for x in enums[0].split(",")] if len(enums) == 1 else []
    if not names or not all(re.fullmatch(r"k\w+", x) for x in names):
        raise _table_error(where, f"expected one line `enum class {enum} {{ kFirst, kOther, ... }};`")
    decls = re.findall(rf"^inline constexpr \w+ {array}\[\] = \{{\n(.*?)\n\}};$", text, re.M | re.S)
    if len(decls) != 1:
        raise _table_error(where, f"expected one `inline constexpr ... {array}[] = {{` ... `}};` (the closing line "
                                  "alone), found " + str(len(decls)))
    entry = rf"\{{(\d+), {enum}::(k\w+)\}},"
    body = decls[0]
    rest = re.sub(entry, "", body)
    if rest.strip():
        raise _table_error(where, f"{array}: cannot read {rest.strip()[:60]!r}; each entry is `{{N, {enum}::kPart}},`")
    out: dict[int, tuple[str, ...]] = {}
    for h, part in re.findall(entry, body):
        h = int(h)
        if h not in known:
            raise _table_error(where, f"{array}: head dim {h} is not in build_info.h kKernelHeadDims {known}")
        if part not in names[1:]:
            raise _table_error(where, f"{array}: {part} is not a part of enum {enum} other than the launcher's "
                                      f"{names[0]} (parts: {', '.join(names[1:])})")
        if part in out.get(h, ()):
            raise _table_error(where, f"{array}: {{{h}, {enum}::{part}}} is listed twice")
        out[h] = out.get(h, ()) + (part,)
    return out


ALL_HEADDIMS = parse_headdims(_read("build_info.h"))  # the head dims SINKATTN_HEADDIMS picks among


# ---- the kernel kinds: the one table ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Parts:
    """A kind whose tile configurations are compiled in parts (FwdUnit / BwdUnit in sm80/fwd_config.h and
    bwd_config.h; fwd_launch.cuh says how): the launcher's part rides with its unit, each other part the C++
    declaration lists for the head dim gets a unit of its own, named with its suffix, built in parallel."""
    template: str   # the part launcher template <head dim, element, part>
    enum: str       # the part enum (in the kind's namespace)
    declared: str   # the header declaring, next to the enum, which head dims have which parts
    array: str      # that declaration's name


# The unit name suffix of each part.
PART_SUFFIX = {"kKeyGroups": "_keys", "kSoftcap": "_softcap", "kSmallSmem": "_small"}


@dataclass(frozen=True)
class Kind:
    """One attention kernel kind. Each unit instantiates one (head dim, dtype) of its launcher and registers it; a
    head dim without a tile in the kind's table gets no unit (the other kinds serve it; the report says which)."""
    name: str               # "<op>_<backend>", the units' name prefix; op "fwd" or "bwd" (FwdParams / BwdParams)
    family: str             # build family: "sm80", "sm90" (nvcc, with its gencode flags) or "emu" (host C++)
    ns: str                 # namespace of its tile table and <op>_min_smem (the registry's smem_bytes)
    header: str             # what its units include
    launcher: str           # the registered launcher template <head dim, element>
    launch_arg: str         # the launcher's second parameter
    registry_family: str    # the registry's family (a tuning variant's: this + "-sweep")
    features: str           # what it serves (the registry records it, dispatch reads it): a macro, or an expression
                            # of the unit's {hdim}
    tiles: str              # the tile table's header, whose specializations of `table` name its head dims
    table: str
    parts: Parts | None = None
    variant_launcher: str | None = None  # the launcher template a tuning variant's tile instantiates (sweep_grid.py)
    # A kind that serves a subset of its op's calls with params of its own (the FP8-cache decode: registry op
    # "fwd_fp8", FwdFp8Params, its table's smallest FP8 tile): the registry op, the params type, the smem function.
    registry_op: str | None = None
    params_type: str | None = None
    min_smem: str | None = None
    # The family word of its variants' names (sweep_grid.py variant_name), when two kinds share a build family.
    variant_family: str | None = None
    # A second entry of the same kernel for FP8 caches (the sm90 forward: its params are FwdFp8Params either way):
    # (its launcher template, its features expression of {hdim}), registered as op "fwd_fp8" from the same unit.
    fp8_twin: tuple[str, str] | None = None

    @property
    def op(self) -> str:
        return self.name.split("_")[0]

    @property
    def reg_op(self) -> str:
        return self.registry_op or self.op

    @property
    def params(self) -> str:
        return self.params_type or f"{self.op.capitalize()}Params"

    def smem_bytes(self, hdim: int) -> str:
        """The registry's smem_bytes: the smallest tile of the head dim's table, read from the table itself."""
        return f"{self.ns}::{self.min_smem or self.op + '_min_smem'}<{hdim}>()"


_FWD_PARTS = dict(enum="FwdUnit", declared="sm80/fwd_config.h", array="kFwdParts")
KINDS = (
    Kind("fwd_sm80", "sm80", "sm80", "sm80/fwd_launch.cuh", "run_fwd_sm80", "cudaStream_t", "sm80",
         "SINKATTN_FWD_FEATURES", "sm80/fwd_tiles.h", "FwdTilesOf", Parts("sm80::launch_fwd_part", **_FWD_PARTS),
         "sm80::launch_fwd_variant"),
    Kind("bwd_sm80", "sm80", "sm80", "sm80/bwd_launch.cuh", "run_bwd_sm80", "cudaStream_t", "sm80",
         "SINKATTN_BWD_FEATURES", "sm80/bwd_tiles.h", "BwdTilesOf",
         Parts("sm80::launch_bwd_part", "BwdUnit", "sm80/bwd_config.h", "kBwdParts")),
    Kind("fwd_sm90", "sm90", "sm90", "sm90/fwd_launch.cuh", "run_fwd_sm90", "cudaStream_t", "sm90",
         "sm90::fwd_features(sm90::FwdTileOf<{hdim}>::tile)", "sm90/fwd_tiles.h", "FwdTileOf",
         variant_launcher="sm90::launch_fwd",
         fp8_twin=("run_fwd_fp8_sm90", "sm90::fwd_fp8_features(sm90::FwdTileOf<{hdim}>::tile)")),
    Kind("bwd_sm90", "sm90", "sm90", "sm90/bwd_launch.cuh", "run_bwd_sm90", "cudaStream_t", "sm90",
         "SINKATTN_BWD_SM90_FEATURES", "sm90/bwd_tiles.h", "BwdTileOf"),
    Kind("fwd_emu", "emu", "sm80", "emu/fwd_sm80_emu.h", "run_fwd_sm80_emulated", "EmuLaunch const&", "sm80-emulated",
         "SINKATTN_FWD_FEATURES", "sm80/fwd_tiles.h", "FwdTilesOf",
         Parts("sm80::launch_fwd_part_emulated", **_FWD_PARTS), "sm80::launch_fwd_variant_emulated"),
    # Decode over FP8 KV caches (sm80/fp8_kv.h): the decode tiles only, one unit per (head dim, dtype), head dims
    # from FwdFp8TilesOf (64, 128).
    Kind("fwd_fp8_sm80", "sm80", "sm80", "sm80/fwd_launch.cuh", "run_fwd_fp8_sm80", "cudaStream_t", "sm80",
         "SINKATTN_FWD_FP8_FEATURES", "sm80/fwd_tiles.h", "FwdFp8TilesOf", registry_op="fwd_fp8",
         params_type="FwdFp8Params", min_smem="fwd_fp8_min_smem"),
    Kind("fwd_fp8_emu", "emu", "sm80", "emu/fwd_sm80_emu.h", "run_fwd_fp8_sm80_emulated", "EmuLaunch const&",
         "sm80-emulated", "SINKATTN_FWD_FP8_FEATURES", "sm80/fwd_tiles.h", "FwdFp8TilesOf", registry_op="fwd_fp8",
         params_type="FwdFp8Params", min_smem="fwd_fp8_min_smem"),
    # The sm90 forward body under host emulation (emu/sm90_prims.h): the table's tiles, and in every emulation build
    # every SWEEP_SM90 variant's twin (sweep_units), so the never-run variants are checked on the CPU.
    Kind("fwd_emu90", "emu", "sm90", "emu/fwd_sm90_emu.h", "run_fwd_sm90_emulated", "EmuLaunch const&",
         "sm90-emulated", "sm90::fwd_features(sm90::FwdTileOf<{hdim}>::tile)", "sm90/fwd_tiles.h", "FwdTileOf",
         variant_launcher="sm90::launch_fwd_emulated", variant_family="emu90",
         fp8_twin=("run_fwd_fp8_sm90_emulated", "sm90::fwd_fp8_features(sm90::FwdTileOf<{hdim}>::tile)")),
    Kind("bwd_emu90", "emu", "sm90", "emu/bwd_sm90_emu.h", "run_bwd_sm90_emulated", "EmuLaunch const&",
         "sm90-emulated", "SINKATTN_BWD_SM90_FEATURES", "sm90/bwd_tiles.h", "BwdTileOf"),
    Kind("bwd_emu", "emu", "sm80", "emu/bwd_sm80_emu.h", "run_bwd_sm80_emulated", "EmuLaunch const&", "sm80-emulated",
         "SINKATTN_BWD_FEATURES", "sm80/bwd_tiles.h", "BwdTilesOf"),
)
KIND = {k.name: k for k in KINDS}


def _read_tables() -> tuple[dict, dict]:
    headdims, parts = {}, {}
    for k in KINDS:
        headdims[k.name] = parse_tile_headdims(_read(k.tiles), k.table, k.tiles, ALL_HEADDIMS)
        if k.parts:
            declared = parse_parts(_read(k.parts.declared), k.parts.enum, k.parts.array, k.parts.declared,
                                   ALL_HEADDIMS)
            for part in {p for ps in declared.values() for p in ps} - set(PART_SUFFIX):
                raise _table_error(k.parts.declared, f"{part} has no unit name suffix: add it to PART_SUFFIX in "
                                                     "csrc/generate_kernels.py")
            parts[k.name] = declared
    return headdims, parts


# Per kind: the head dims its table has a tile for, and per head dim its parts beyond the launcher's.
TILE_HEADDIMS, PARTS = _read_tables()


def _enabled(family: str, grid: Grid) -> bool:
    if family == "emu":
        return grid.emulation
    return family in grid.families and bool(family_targets(family, grid.archs))


def _part_fn(kind: Kind, hdim: int, dtype: str, part: str) -> str:
    return (f"{kind.parts.template}<{hdim}, {CPP_DTYPE[dtype]}, {kind.ns}::{kind.parts.enum}::{part}>"
            f"({kind.params} const&, {kind.launch_arg})")


def _parts(kind: Kind, hdim: int) -> tuple:
    return tuple((part, PART_SUFFIX[part]) for part in PARTS.get(kind.name, {}).get(hdim, ()))


def _part_unit(kind: Kind, hdim: int, dtype: str, part: str, suffix: str) -> Unit:
    name = f"{kind.name}_hdim{hdim}_{dtype}"
    text = f"""// Generated by csrc/generate_kernels.py: do not edit.
// {name}{suffix}: the {part} tiles of {name}, which launches them.
#include "{kind.header}"
namespace sinkattn {{
template void {_part_fn(kind, hdim, dtype, part)};
}}  // namespace sinkattn
"""
    return Unit(name + suffix, kind.family, text, registers=False, header=kind.header, headdim=hdim)


def _kernel_unit(kind: Kind, hdim: int, dtype: str) -> Unit:
    name = f"{kind.name}_hdim{hdim}_{dtype}"
    fn = f"{kind.launcher}<{hdim}, {CPP_DTYPE[dtype]}>"
    elsewhere = "".join(f"extern template void {_part_fn(kind, hdim, dtype, part)};  // in {name}{suffix}\n"
                        for part, suffix in _parts(kind, hdim))
    features = kind.features.format(hdim=hdim)
    twin, twins = "", ()
    if kind.fp8_twin:
        launcher, fp8_features = kind.fp8_twin
        fp8_fn = f"{launcher}<{hdim}, {CPP_DTYPE[dtype]}>"
        twins = (name.replace("fwd_", "fwd_fp8_", 1),)
        twin = (f"template void {fp8_fn}(FwdFp8Params const&, {kind.launch_arg});\n"
                f"SINKATTN_REGISTER_KERNEL({twins[0]}, \"{kind.registry_family}\", "
                f"\"fwd_fp8\", {hdim}, \"{dtype}\", {fp8_features.format(hdim=hdim)},\n"
                f"                         {kind.smem_bytes(hdim)}, ({fp8_fn}))\n")
    text = f"""// Generated by csrc/generate_kernels.py: do not edit.
#include "{kind.header}"
namespace sinkattn {{
{elsewhere}template void {fn}({kind.params} const&, {kind.launch_arg});
SINKATTN_REGISTER_KERNEL({name}, "{kind.registry_family}", "{kind.reg_op}", {hdim}, "{dtype}", {features},
                         {kind.smem_bytes(hdim)}, ({fn}))
{twin}}}  // namespace sinkattn
"""
    return Unit(name, kind.family, text, header=kind.header, headdim=hdim, twins=twins)


def _merge_unit(dtype: str) -> Unit:
    text = f"""// Generated by csrc/generate_kernels.py: do not edit.
#include "common/merge_launch.cuh"
namespace sinkattn {{
template void run_merge<{CPP_DTYPE[dtype]}>(MergeParams const&, cudaStream_t);
SINKATTN_REGISTER_KERNEL(merge_{dtype}, "common", "merge", 0, "{dtype}", "sinks", 0, (run_merge<{CPP_DTYPE[dtype]}>))
}}  // namespace sinkattn
"""
    return Unit(f"merge_{dtype}", "common", text)


# ---- the tuning grid's units (the grid itself: sweep_grid.py) ----------------------------------------------------
def _variant_unit(kind: Kind, v, dtype: str) -> Unit:
    name = variant_name(kind.variant_family or kind.family, v, dtype)
    tile = f"SweepTile_{name}"
    features = v.features().format(tile=tile)
    fn = f"{kind.variant_launcher}<{tile}, {CPP_DTYPE[dtype]}>"
    text = f"""// Generated by csrc/generate_kernels.py: do not edit.
// A tuning-grid variant (SINKATTN_SWEEP): registered by name, run by bench/sweep/runner.py, never picked by dispatch.
#include "{kind.header}"
namespace sinkattn {{
struct {tile} {{ static constexpr {kind.ns}::FwdTile tile = {v.cpp()}; }};
template void {fn}(FwdParams const&, {kind.launch_arg});
SINKATTN_REGISTER_KERNEL({name}, "{kind.registry_family}-sweep", "fwd", {v.head_dim}, "{dtype}", {features},
                         {tile}::tile.smem_bytes(), ({fn}))
}}  // namespace sinkattn
"""
    return Unit(name, kind.family, text, header=kind.header, headdim=v.head_dim)


def sweep_units(grid: Grid) -> list[Unit]:
    """The tuning variants the grid asks for (SINKATTN_SWEEP), at its head dims and dtypes, plus the emulation
    build's smoke variant."""
    want = lambda name: any(pat in name for pat in grid.sweep)  # noqa: E731
    out = []
    for kind, table in ((KIND[k], t) for k, t in VARIANTS):
        if not _enabled(kind.family, grid):
            continue
        for v in table:
            for d in grid.dtypes_of(kind.family):
                if v.head_dim in grid.headdims_of(kind.family) and want(variant_name(kind.variant_family or kind.family, v, d)):
                    out.append(_variant_unit(kind, v, d))
    if grid.emulation:
        always = [(KIND[SMOKE_KIND], SWEEP_EMU_SMOKE)] + [(KIND[EMU90_KIND], v) for v in SWEEP_SM90]
        for kind, v in always:
            unit = _variant_unit(kind, v, grid.dtypes[0])
            if v.head_dim in grid.headdims and unit.name not in {u.name for u in out}:
                out.append(unit)
    return out


def units(grid: Grid) -> list[Unit]:
    out = [_merge_unit(d) for d in (*grid.dtypes_of("common"), "fp32")]
    kinds = [k for k in KINDS if _enabled(k.family, grid)]
    out += [_kernel_unit(kind, h, d) for kind in kinds for h in grid.headdims_of(kind.family)
            for d in grid.dtypes_of(kind.family) if h in TILE_HEADDIMS[kind.name]]
    out += [_part_unit(kind, h, d, part, suffix) for kind in kinds for h in grid.headdims_of(kind.family)
            for d in grid.dtypes_of(kind.family) for part, suffix in _parts(kind, h)]
    return out + sweep_units(grid)


# ---- translation units ----------------------------------------------------------------------------------------------
# The GPU units are compiled one kernel (or one part of one) per translation unit, so a many-core build runs them in
# parallel: their device code generation, not the parse, is most of their cost. The emulated units are the other
# way round: g++ spends most of a unit on the first instantiation of the kernel body, its CuTe layouts and the
# emulator, which every kernel of the same header and head dim shares (measured on 2 cores, -O2: the hd64 bf16 sm80
# forward as its three units 46 + 44 + 33 s, as one 63 s; with fp16 beside it 72 s; an sm90 twin alone 22 s, three
# in one unit 29 s). So each emulation header's kernels at one head dim, both dtypes, every part and every twin,
# are one translation unit: PACK_NAME of the header, "_hdim", the head dim.
PACK_NAME = {"emu/fwd_sm80_emu.h": "emu80_fwd", "emu/bwd_sm80_emu.h": "emu80_bwd",
             "emu/fwd_sm90_emu.h": "emu90_fwd", "emu/bwd_sm90_emu.h": "emu90_bwd"}
_BODY = re.compile(r"^namespace sinkattn \{\n(.*)^\}  // namespace sinkattn\n\Z", re.M | re.S)


def _pack(members: list[Unit]) -> Unit:
    """One translation unit holding `members` (one header, one head dim): their bodies in order, the parts'
    `extern template` declarations dropped (the parts are instantiated in the same unit)."""
    first = members[0]
    if first.header not in PACK_NAME:
        raise SystemExit(f"sinkattn build: the emulated units of {first.header} have no translation-unit name: add "
                         "it to PACK_NAME in csrc/generate_kernels.py")
    name = f"{PACK_NAME[first.header]}_hdim{first.headdim}"
    bodies = []
    for u in members:
        m = _BODY.search(u.text)
        if m is None or u.header != first.header or u.headdim != first.headdim:
            raise SystemExit(f"sinkattn build: cannot pack {u.name} into {name}")
        bodies.append(f"// {u.name}\n" + "".join(ln for ln in m.group(1).splitlines(keepends=True)
                                                if not ln.startswith("extern template ")))
    text = (f"// Generated by csrc/generate_kernels.py: do not edit.\n// {name}: the emulated kernels of "
            f"{first.header} at head dim {first.headdim}, one translation unit (see PACK_NAME).\n"
            f'#include "{first.header}"\nnamespace sinkattn {{\n' + "".join(bodies) + "}  // namespace sinkattn\n")
    return Unit(name, "emu", text, header=first.header, headdim=first.headdim)


def translation_units(grid: Grid) -> list[Unit]:
    """What the build compiles: units(grid) with the emulated ones packed, one per (header, head dim)."""
    out, packs = [], {}
    for u in units(grid):
        if u.family == "emu":
            packs.setdefault((u.header, u.headdim), []).append(u)
        else:
            out.append(u)
    return out + [_pack(members) for _, members in sorted(packs.items())]


def generate(out_dir: str, grid: Grid) -> list[tuple[str, str]]:
    os.makedirs(out_dir, exist_ok=True)
    written = []
    keep = set()
    for u in translation_units(grid):
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
