"""The facts the generator (csrc/generate_kernels.py) reads from the C++ tables instead of restating them: the head
dims (build_info.h kKernelHeadDims), which head dims each kind has a tile for (the tile tables' specializations)
and which head dims compile which extra parts (sm80/fwd_config.h kFwdParts, sm80/bwd_config.h kBwdParts). Its
readers are strict: today's tables read as the values below, and a declaration written any other way stops the
build with the file and what was expected. Also: sinkattn/layout.py's kernel head dims come from the binary's
build_info, which exports the same C++ list (and, without a binary, from a copy this file checks).

Pure Python: nothing here compiles (the extension test at the end skips without sinkattn._C).
"""
from __future__ import annotations

import importlib.util
import pathlib
import shutil
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
CSRC = ROOT / "csrc"


def _load_gen(csrc: pathlib.Path, name: str):
    spec = importlib.util.spec_from_file_location(name, csrc / "generate_kernels.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the class is built
    try:
        spec.loader.exec_module(mod)
    finally:
        if mod.__dict__.get("KINDS") is None:
            sys.modules.pop(spec.name, None)
    return mod


gen = _load_gen(CSRC, "sinkattn_gen_tables")


def _message(fn, *args) -> str:
    with pytest.raises(SystemExit) as e:
        fn(*args)
    return str(e.value)


# ---- today's tables -------------------------------------------------------------------------------------------
def test_todays_tables_read_as_they_are():
    assert gen.ALL_HEADDIMS == (64, 128, 256)
    assert gen.TILE_HEADDIMS == {"fwd_sm80": (64, 128, 256), "bwd_sm80": (64, 128, 256), "fwd_emu": (64, 128, 256),
                                 "bwd_emu": (64, 128, 256), "fwd_sm90": (64, 128, 256),
                                 # the sm90 backward has no hd256 tile (sm90/bwd_tiles.h): dK and dV alone would
                                 # take 256 registers per thread
                                 "bwd_sm90": (64, 128),
                                 # the FP8-cache decode tiles (FwdFp8TilesOf): head dims 64 and 128 only
                                 "fwd_fp8_sm80": (64, 128), "fwd_fp8_emu": (64, 128),
                                 # the sm90 kernels under host emulation: the GPU kinds' tables
                                 "fwd_emu90": (64, 128, 256), "bwd_emu90": (64, 128)}
    fwd = {h: ("kKeyGroups", "kSoftcap") for h in (64, 128, 256)}
    assert gen.PARTS == {"fwd_sm80": fwd, "fwd_emu": fwd,
                         "bwd_sm80": {64: ("kSoftcap",), 128: ("kSmallSmem", "kSoftcap"), 256: ("kSoftcap",)}}
    # every kind is in the one table, each once, in the order the units are written
    assert [k.name for k in gen.KINDS] == ["fwd_sm80", "bwd_sm80", "fwd_sm90", "bwd_sm90", "fwd_emu", "fwd_fp8_sm80",
                                           "fwd_fp8_emu", "fwd_emu90", "bwd_emu90", "bwd_emu"]
    assert {k.name for k in gen.KINDS} == set(gen.TILE_HEADDIMS)


def test_units_follow_the_tables():
    g = gen.parse_grid({"SINKATTN_EMULATION": "1"})
    names = {u.name for u in gen.units(g)}
    for kind in gen.KINDS:
        for h in gen.ALL_HEADDIMS:
            assert (f"{kind.name}_hdim{h}_bf16" in names) == (h in gen.TILE_HEADDIMS[kind.name]), (kind.name, h)
            for part, suffix in gen.PART_SUFFIX.items():
                want = part in gen.PARTS.get(kind.name, {}).get(h, ())
                assert (f"{kind.name}_hdim{h}_bf16{suffix}" in names) == want, (kind.name, h, part)


def test_contract_head_dim_max_is_the_largest_kernel_head_dim():
    from sinkattn import layout
    assert layout.HEADDIM_MAX == gen.ALL_HEADDIMS[-1]
    assert all(h % layout.HEADDIM_MULTIPLE == 0 for h in gen.ALL_HEADDIMS)


# ---- malformed declarations fail loudly -----------------------------------------------------------------------
HD_OK = "inline constexpr int kKernelHeadDims[] = {64, 128, 256};\n"


def test_headdims_reader():
    assert gen.parse_headdims(HD_OK) == (64, 128, 256)
    assert gen.parse_headdims("// kKernelHeadDims: the list\n" + HD_OK + "std::vector<int> f();  // kKernelHeadDims\n") \
        == (64, 128, 256)
    for bad, why in [("", "found 0"),
                     (HD_OK + HD_OK, "found 2"),
                     ("inline constexpr int kKernelHeadDims[] = {\n    64, 128, 256};\n", "expected one line"),
                     ("inline constexpr int kKernelHeadDims[] = {64, 128, H256};\n", "expected one line"),
                     ("constexpr std::array<int, 3> kKernelHeadDims = {64, 128, 256};\n", "expected one line"),
                     ("inline constexpr int kKernelHeadDims[] = {128, 64};\n", "ascending"),
                     ("inline constexpr int kKernelHeadDims[] = {64, 64};\n", "ascending")]:
        msg = _message(gen.parse_headdims, bad)
        assert "csrc/build_info.h" in msg and why in msg, (bad, msg)


TILES_OK = """template <int kHeadDim> struct BwdTileOf;
template <> struct BwdTileOf<64> { static constexpr BwdTile tile{64, 128}; };
template <> struct BwdTileOf<128> { static constexpr BwdTile tile{128, 64}; };
constexpr int bwd_min_smem() { return BwdTileOf<kHeadDim>::tile.smem_bytes(); }
"""


def test_tile_table_reader():
    assert gen.parse_tile_headdims(TILES_OK, "BwdTileOf", "sm90/bwd_tiles.h", (64, 128, 256)) == (64, 128)
    for bad, why in [
        # a specialization written another way would silently lose its head dim's units: it stops the build
        (TILES_OK + "template <>\nstruct BwdTileOf<256> { static constexpr BwdTile tile{256, 64}; };\n", "2 of 3"),
        (TILES_OK + "template<> struct BwdTileOf<256> {};\n", "2 of 3"),
        (TILES_OK.replace("BwdTileOf", "BwdTile_Of"), "0 of 0"),              # the table renamed
        (TILES_OK.replace("<128>", "<96>"), "BwdTileOf<96>"),                # a head dim the list lacks
        (TILES_OK + "template <> struct BwdTileOf<64> {};\n", "not once"),   # twice
    ]:
        msg = _message(gen.parse_tile_headdims, bad, "BwdTileOf", "sm90/bwd_tiles.h", (64, 128, 256))
        assert "csrc/sm90/bwd_tiles.h" in msg and why in msg, (bad, msg)


PARTS_OK = """enum class BwdUnit { kMain, kSmallSmem, kSoftcap };
struct BwdPart { int head_dim; BwdUnit unit; };
inline constexpr BwdPart kBwdParts[] = {
    {64, BwdUnit::kSoftcap},
    {128, BwdUnit::kSmallSmem}, {128, BwdUnit::kSoftcap},
};
"""


def test_parts_reader():
    read = lambda text: gen.parse_parts(text, "BwdUnit", "kBwdParts", "sm80/bwd_config.h", (64, 128, 256))  # noqa
    assert read(PARTS_OK) == {64: ("kSoftcap",), 128: ("kSmallSmem", "kSoftcap")}
    for bad, why in [
        (PARTS_OK.replace("{64, BwdUnit::kSoftcap},", "{64, BwdUnit::kSoftcap}"), "cannot read"),   # no comma
        (PARTS_OK.replace("{64, BwdUnit::kSoftcap},", "{64, kSoftcap},"), "cannot read"),
        (PARTS_OK.replace("{64, BwdUnit::kSoftcap},", "{64, BwdUnit::kSoftcap},  // softcap"), "cannot read"),
        (PARTS_OK.replace("{64, BwdUnit::kSoftcap},", "{64,BwdUnit::kSoftcap},"), "cannot read"),
        (PARTS_OK.replace("kBwdParts[] = {\n", "kBwdParts[] = {"), "expected one"),
        (PARTS_OK.replace("kBwdParts", "kBwdUnits"), "expected one"),
        (PARTS_OK + PARTS_OK.split("\n", 2)[2], "found 2"),
        (PARTS_OK.replace("enum class BwdUnit", "enum BwdUnit"), "enum class BwdUnit"),
        (PARTS_OK.replace("{64, BwdUnit::kSoftcap}", "{64, BwdUnit::kMain}"), "other than the launcher's kMain"),
        (PARTS_OK.replace("{64, BwdUnit::kSoftcap}", "{64, BwdUnit::kTiny}"), "kTiny is not a part"),
        (PARTS_OK.replace("{64, BwdUnit::kSoftcap}", "{96, BwdUnit::kSoftcap}"), "head dim 96"),
        (PARTS_OK.replace("{64, BwdUnit::kSoftcap}", "{128, BwdUnit::kSoftcap}"), "listed twice"),
    ]:
        msg = _message(read, bad)
        assert "csrc/sm80/bwd_config.h" in msg and why in msg, (bad, msg)


def _broken_copy(tmp_path, rel: str, old: str, new: str) -> pathlib.Path:
    """The generator and the headers it reads, copied, with one edit in `rel`."""
    csrc = tmp_path / "csrc"
    for f in ["generate_kernels.py", "sweep_grid.py", "build_info.h"] + sorted(
            {k.tiles for k in gen.KINDS} | {k.parts.declared for k in gen.KINDS if k.parts}):
        (csrc / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(CSRC / f, csrc / f)
    text = (csrc / rel).read_text()
    assert text.count(old) == 1, (rel, old)
    (csrc / rel).write_text(text.replace(old, new))
    return csrc


@pytest.mark.parametrize("rel, old, new, why", [
    ("build_info.h", "{64, 128, 256};", "{64, 128,\n    256};", "kKernelHeadDims"),
    ("sm90/bwd_tiles.h", "template <> struct BwdTileOf<64>", "template <>\nstruct BwdTileOf<64>", "BwdTileOf"),
    ("sm80/fwd_config.h", "{64, FwdUnit::kKeyGroups},", "{64, FwdUnit::kKeyGroup},", "kKeyGroup is not a part"),
    ("sm80/bwd_config.h", "enum class BwdUnit { kMain, kSmallSmem, kSoftcap };",
     "enum class BwdUnit { kMain, kSmallSmem, kSoftcap, kTiny };", None),
])
def test_a_broken_table_stops_the_generator(tmp_path, rel, old, new, why):
    """The build (setup.py imports the generator) stops at import, naming the file; a part with no unit name
    suffix too."""
    csrc = _broken_copy(tmp_path, rel, old, new)
    if why is None:  # a new part: fine until it is listed, then it needs a unit name
        assert _load_gen(csrc, "sinkattn_gen_new_part").PARTS["bwd_sm80"][128] == ("kSmallSmem", "kSoftcap")
        text = (csrc / rel).read_text().replace("{64, BwdUnit::kSoftcap},", "{64, BwdUnit::kSoftcap}, {64, "
                                                "BwdUnit::kTiny},")
        (csrc / rel).write_text(text)
        rel, why = rel, "kTiny has no unit name suffix"
    with pytest.raises(SystemExit) as e:
        _load_gen(csrc, "sinkattn_gen_broken")
    assert f"csrc/{rel}" in str(e.value) and why in str(e.value), str(e.value)
    sys.modules.pop("sinkattn_gen_broken", None)


# ---- layout.py reads the list from the binary --------------------------------------------------------------------
def test_layout_kernel_headdims_from_build_info():
    from sinkattn import layout
    assert layout.kernel_headdims_of({"kernel_headdims": [64, 128, 256], "requested_headdims": "128"}) == (64, 128, 256)
    assert layout.kernel_headdims_of({"kernel_headdims": [256, 128]}) == (128, 256)
    # no binary (a pure-Python build), or one built before build_info carried the list: the sources' list, which
    # is build_info.h's
    assert layout.kernel_headdims_of(None) == layout.kernel_headdims_of({"requested_headdims": "128"}) \
        == layout.SOURCE_HEADDIMS == gen.ALL_HEADDIMS
    assert [layout.kernel_headdim(d) for d in (8, 64, 72, 128, 136, 256, 264)] == [64, 64, 128, 128, 256, 256, None]


def test_layout_kernel_headdims_are_the_binarys():
    from sinkattn import _ext, layout
    if not _ext.loaded():
        pytest.skip(f"no sinkattn._C ({_ext.IMPORT_ERROR})")
    info = _ext.build_info()
    assert "kernel_headdims" in info, "this binary predates build_info's kernel_headdims: rebuild it"
    assert tuple(info["kernel_headdims"]) == layout.KERNEL_HEADDIMS == gen.ALL_HEADDIMS


def test_fp8_kv_headdims_are_the_tile_tables():
    """dispatch words its FP8 refusal with the head dims the C++ FP8 tile table defines, as the binary reports them
    (api.cpp table_headdims<FwdFp8TilesOf>); the generator reads the same table from the source."""
    from sinkattn import _ext, registry
    if not _ext.loaded():
        pytest.skip(f"no sinkattn._C ({_ext.IMPORT_ERROR})")
    assert registry.fp8_kv_headdims() == gen.TILE_HEADDIMS["fwd_fp8_sm80"] == (64, 128)
