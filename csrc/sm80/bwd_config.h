// bwd_config.h: from a problem to the sm80 backward's kernel type and grid (the tile from bwd_tiles.h; shared
// by the GPU launcher and the host emulation, so the emulated kernel runs exactly the configurations the GPU
// runs).
#pragma once
#include <stdexcept>
#include <type_traits>

#include "common/bwd_prepost.h"
#include "common/defs.h"
#include "common/tile_order.h"
#include "params.h"
#include "sm80/bwd_tiles.h"
#include "sm80/bwd_traits.h"

// What every sm80 backward kernel serves (recorded in the registry, shown by the report, read by dispatch).
#define SINKATTN_BWD_FEATURES "sinks,sink_tokens,causal,window,softcap,gqa,varlen,deterministic,broadcast_strides"

namespace sinkattn::sm80 {

// Which translation unit compiles a tile configuration (bwd_launch.cuh, kBwdParts below):
// the hd128 backward's two tiles took 126-129 s in one unit on the 2-core dev machine under load.
// The kernels that serve softcap (Softcap::kRunTime; the others have it compiled out) are a part of their own.
enum class BwdUnit { kMain, kSmallSmem, kSoftcap };
// The parts each head dim's tiles fill beyond the launcher's own (kMain), one translation unit each, read by the
// generator as fwd_config.h's kFwdParts is: kSmallSmem only where a head dim has a Small tile (Hd128Small).
struct BwdPart { int head_dim; BwdUnit unit; };
inline constexpr BwdPart kBwdParts[] = {
    {64, BwdUnit::kSoftcap},
    {128, BwdUnit::kSmallSmem}, {128, BwdUnit::kSoftcap},
    {256, BwdUnit::kSoftcap},
};
template <class Kt>
inline constexpr BwdUnit bwd_unit_of = Kt::kCap == Softcap::kRunTime ? BwdUnit::kSoftcap
                                       : std::is_same_v<typename Kt::TileTag, bwd_tiles::Hd128Small> ? BwdUnit::kSmallSmem
                                                                                                     : BwdUnit::kMain;

// Calls f.template operator()<Traits>() with the tile for this shared-memory limit and softcap; softcap 0 takes
// the kernel with softcap compiled out. Only the (tile, softcap) pairs choose_bwd_tile can pick are instantiated.
template <int kHeadDim, class Element, class Prims, class F>
void with_bwd_config(int max_smem_per_block, float softcap, F&& f) {
  bool const capped = softcap > 0.f;
  bool ran = false;
  with_bwd_tile<kHeadDim>(choose_bwd_tile(kHeadDim, max_smem_per_block, capped), [&]<class Tile>() {
    if (capped) {
      if constexpr (bwd_tile_chosen<kHeadDim>(Tile::tile, true)) {
        f.template operator()<BwdTraits<Tile, Element, Prims, Softcap::kRunTime>>();
        ran = true;
      }
    } else {
      if constexpr (bwd_tile_chosen<kHeadDim>(Tile::tile, false)) {
        f.template operator()<BwdTraits<Tile, Element, Prims, Softcap::kOff>>();
        ran = true;
      }
    }
  });
  // bwd_tile_chosen covers every answer of choose_bwd_tile by construction; a table edit that broke that would
  // otherwise leave the gradients unwritten
  if (!ran) throw std::logic_error("sinkattn bwd: no compiled sm80 backward kernel for this tile (sm80/bwd_tiles.h)");
}

// One CTA per (N tile, query head, sequence), N tiles from the first up (common/tile_order.h says why).
template <int kBlockN>
BwdTileOrder bwd_tile_order(BwdParams const& p) {
  return BwdTileOrder{(p.seqlen_k + kBlockN - 1) / kBlockN, 1, p.nheads, p.batch};
}

}  // namespace sinkattn::sm80
