"""tools/peer_sass.py finds what it compares in the tree as it is: every cold-code pattern matches one line, and
the tile names it mangles are the kernels this build holds (so a kernel or file change that would silently
break the peer comparison fails here instead)."""
from __future__ import annotations

import importlib.util
import pathlib
import re

import pytest

import sinkattn

ROOT = pathlib.Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("sinkattn_peer_sass", ROOT / "tools" / "peer_sass.py")
peer = importlib.util.module_from_spec(spec)
spec.loader.exec_module(peer)


def test_every_cold_pattern_matches_one_line():
    lines = peer.cold_lines()  # exits with a message when a pattern matches 0 or 2+ lines
    assert len(lines) == len(peer.COLD) + 2  # + the two include files (fill.hpp, device_atomic_functions.hpp)
    for rel, first, last in lines[:-2]:
        text = (ROOT / "csrc" / rel).read_text().splitlines()
        assert 1 <= first <= last <= len(text), (rel, first, last)


def test_tiles_parse_and_name_real_kernels():
    fwd = peer.tiles("fwd_tiles.h", "SINKATTN_(?:FWD|PREFILL)_TILE", ["head_dim", "block_m", "block_n", "warps"])
    bwd = peer.tiles("bwd_tiles.h", "SINKATTN_BWD_TILE", ["head_dim", "block_m", "block_n", "warps_m"])
    assert fwd["Hd128Rows"] == {"head_dim": 128, "block_m": 128, "block_n": 64, "warps": 8}
    assert bwd["Hd128"]["head_dim"] == 128 and len(fwd) >= 16 and len(bwd) >= 4
    so = sorted((ROOT / "sinkattn").glob("_C*.so"))
    if not so or not any(k["name"] == "fwd_sm80_hdim128_bf16" for k in sinkattn._ext.registry()):
        pytest.skip("no sm80 hd128 bf16 kernels in this build")
    names = set(re.findall(rb"_ZN8sinkattn4sm8010[fb]wd_kernel\w+", so[0].read_bytes()))
    for kind, name in (("fwd", "Hd128Rows"), ("bwd", "Hd128")):
        pattern = re.compile(peer.mangled(kind, name).encode())
        assert any(pattern.match(n) for n in names), f"no {kind} kernel matches {pattern.pattern!r}"
