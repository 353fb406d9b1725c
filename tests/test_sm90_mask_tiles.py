"""The sm90 forward's tile shapes under the mask policy's block rules (csrc/common/mask.h), on the host.

The sm90 forward asks TileMask::mask_test(m).needs(n) per key block (the sm80 forward's rule; it asked needs_mask
per block before). mask_test has its own arithmetic (floor divisions by the block size), so it is checked
here at the block sizes the sm90 kernels compile: the table's (128 x 128, and 128 x 48 at head dim 256, a block
size that is no power of two) and the tuning grid's (csrc/sweep_grid.py SWEEP_SM90: 192-row tiles, 32 to 192 keys).
The host entry mask_tile_blocks fails when mask_test and needs_mask disagree on any block; check_tiles holds the
visited blocks and the needs-mask flags to the contract (tests/test_mask_policy.py)."""
from __future__ import annotations

import pytest

import sinkattn
from test_mask_policy import _edge_problems, check_tiles

C = sinkattn._ext._C
pytestmark = pytest.mark.skipif(C is None, reason=f"no compiled extension: {sinkattn._ext.IMPORT_ERROR}")

SM90_FWD_BLOCKS = [(128, 128), (128, 48), (192, 128), (128, 176), (128, 192), (128, 144), (128, 96), (128, 64),
                   (128, 80), (128, 32)]


@pytest.mark.parametrize("bm,bn", SM90_FWD_BLOCKS, ids=lambda x: str(x))
def test_sm90_forward_blocks_mask_test_agrees(bm, bn):
    masked = 0
    for (sq, sk, wl, wr, ns) in _edge_problems():
        masked += check_tiles(sq, sk, wl, wr, ns, bm, bn, where="sm90 forward tile: ")[1]
    assert masked > 0  # the problems do reach blocks that need the mask at this block size
