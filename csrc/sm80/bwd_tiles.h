// bwd_tiles.h: the tile table of the sm80 backward and the rule that picks one (no CuTe, no CUDA: the kernels,
// launchers, host emulation, api.cpp, which sizes the deterministic mode's counters by the tile's M, and the
// registry read it).
//
// Shared memory: Q and dO (per stage), K, V, P and dS, 2-byte elements.
#pragma once
#include "sm80/fwd_tiles.h"  // TileList, min_smem, with_tile_in

namespace sinkattn::sm80 {

struct BwdTile {
  int head_dim, block_m, block_n;
  int warps_m, warps_n;  // one warp layout for all five GEMMs (bwd_traits.h)
  int stages;            // Q/dO buffers: 2 = the next M tile loads while this one computes

  constexpr int smem_bytes() const {
    return (stages * 2 * block_m * head_dim + 2 * block_n * head_dim + 2 * block_m * block_n) * 2;
  }
  constexpr bool operator==(BwdTile const&) const = default;
};

namespace bwd_tiles {
#define SINKATTN_BWD_TILE(name, ...) struct name { static constexpr BwdTile tile{__VA_ARGS__}; }
SINKATTN_BWD_TILE(Hd64, 64, 64, 64, 4, 1, 2);          // 64 KB
SINKATTN_BWD_TILE(Hd128, 128, 64, 128, 4, 2, 2);       // 160 KB: sm80, sm90
SINKATTN_BWD_TILE(Hd128Softcap, 128, 64, 64, 4, 2, 2); // 112 KB: sm80, sm90 with softcap
SINKATTN_BWD_TILE(Hd128Small, 128, 64, 64, 4, 2, 1);   // 80 KB: sm86 / sm89
SINKATTN_BWD_TILE(Hd256, 256, 64, 64, 2, 4, 1);      // 144 KB: sm80, sm90 only (the registry says so)
#undef SINKATTN_BWD_TILE
}  // namespace bwd_tiles

// The head dims specialized here are those the sm80 backward is compiled for (generate_kernels.py reads them as
// it reads fwd_tiles.h's FwdTilesOf).
template <int kHeadDim> struct BwdTilesOf;
template <> struct BwdTilesOf<64> { using type = TileList<bwd_tiles::Hd64>; };
template <> struct BwdTilesOf<128> { using type = TileList<bwd_tiles::Hd128, bwd_tiles::Hd128Softcap, bwd_tiles::Hd128Small>; };
template <> struct BwdTilesOf<256> { using type = TileList<bwd_tiles::Hd256>; };
template <int... kHeadDims>  // (over a pack, as fwd_tiles.h's: generate_kernels.py reads this file too)
constexpr bool distinct_bwd_tiles() { return (distinct_tiles(typename BwdTilesOf<kHeadDims>::type{}) && ...); }
static_assert(distinct_bwd_tiles<64, 128, 256>(), "two equal tiles in one head dim's list");

template <int kHeadDim>
constexpr int bwd_min_smem() { return min_smem(typename BwdTilesOf<kHeadDim>::type{}); }

// The tile for a head dim, shared-memory limit and softcap: the biggest that fits (the hd256 tile is the only one
// and needs 144 KB; launch_bwd_tile refuses it below that, and dispatch declines such a device first). Head dim
// 128 without softcap takes 128-key blocks: each M tile's fixed costs (its Q and dO copies, row statistics, dQ's
// adds, three barriers) spread over twice the MMAs of the 64-key tile (by tools/perf_model.py on the H200, 4995
// cycles an M tile of 64 keys -> 8779 of 128, 0.86-0.89x -> 0.96-1.02x of FlashAttention-2). With softcap the
// same tile spills (ptxas: 16 bytes on sm_80, 4 on sm_90, reloaded in the loop), so softcap keeps 64 keys.
constexpr BwdTile choose_bwd_tile(int head_dim, int max_smem, bool softcap) {
  using namespace bwd_tiles;
  if (head_dim == 64) return Hd64::tile;
  if (head_dim == 128) {
    BwdTile const big = softcap ? Hd128Softcap::tile : Hd128::tile;
    return max_smem >= big.smem_bytes() ? big : Hd128Small::tile;
  }
  return Hd256::tile;
}

// Whether choose_bwd_tile picks tile t for some shared-memory limit, with (softcap) or without softcap: the
// kernels compiled are exactly those (bwd_config.h). Its answer changes only at a tile's size.
template <class... Tiles>
constexpr bool chosen_in(BwdTile t, bool softcap, TileList<Tiles...>) {
  return ((choose_bwd_tile(t.head_dim, Tiles::tile.smem_bytes(), softcap) == t) || ... ||
          (choose_bwd_tile(t.head_dim, 1 << 30, softcap) == t));
}
template <int kHeadDim>
constexpr bool bwd_tile_chosen(BwdTile t, bool softcap) {
  return chosen_in(t, softcap, typename BwdTilesOf<kHeadDim>::type{});
}

template <int kHeadDim, class F>
void with_bwd_tile(BwdTile t, F&& f) {
  with_tile_in(t, f, typename BwdTilesOf<kHeadDim>::type{});
}

}  // namespace sinkattn::sm80
