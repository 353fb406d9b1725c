// tile_order.h: the order in which a kernel's tiles are visited, one owner for every grid and schedule (the
// sm80 forward's and backward's 1-D grids, the sm90 forward's persistent schedule). Host-callable: the launchers
// size their grids with it and the host tests check it covers every tile once.
//
// Tile t -> (block, split, head, batch): blocks vary fastest (neighbouring CTAs share K/V, or Q and dO, in L2),
// then splits, heads, batch. A 1-D index has no 65535 limit on batch * heads. Heaviest first:
// - the forward visits M blocks from the last down (kLastBlockFirst): under a causal mask they see the most keys;
// - the backward visits N blocks from the first up: under a causal mask they see the most queries, and the
//   deterministic backward needs it (key blocks add their dQ in increasing order, so a lower key block must not
//   wait for launch behind a higher one that waits for it).
#pragma once
#include <cstdint>
#include "common/defs.h"

namespace sinkattn {

// kSplits: whether the order has a split dimension (the sm80 forward's split-KV); without one, `splits` must be
// 1 and no instruction is spent on it (a 64-bit division by a run-time value is a called subroutine in SASS,
// whose saved registers cost the hd256 backward stack space on sm_90).
template <bool kLastBlockFirst, bool kSplits>
struct TileOrder {
  int blocks, splits, heads, batch;

  SA_HOST_DEVICE int64_t count() const { return int64_t(blocks) * (kSplits ? splits : 1) * heads * batch; }

  SA_HOST_DEVICE void decode(int64_t t, int& block, int& split, int& head, int& b) const {
    block = int(t % blocks);
    if constexpr (kLastBlockFirst) block = blocks - 1 - block;
    t /= blocks;
    if constexpr (kSplits) {
      split = int(t % splits);
      t /= splits;
    } else {
      split = 0;
    }
    head = int(t % heads);
    b = int(t / heads);
  }
};

using FwdTileOrder = TileOrder<true, true>;         // the sm80 forward's grid
using PersistentTileOrder = TileOrder<true, false>;  // the sm90 forward's persistent schedule
using BwdTileOrder = TileOrder<false, false>;        // the sm80 backward's grid

}  // namespace sinkattn
