// fwd_config.h: from a problem to the sm80 forward's kernel type and grid. The tile comes from the one table
// and rule in fwd_tiles.h; shared by the GPU launcher and the host emulation, so the emulated kernel runs
// exactly the configurations and blocks the GPU runs.
#pragma once
#include <cstdint>
#include "common/seq_extent.h"
#include "common/tile_order.h"
#include "params.h"
#include "sm80/fwd_tiles.h"
#include "sm80/fwd_traits.h"

// What every sm80 forward kernel serves (recorded in the registry, shown by the report, read by dispatch).
#define SINKATTN_FWD_FEATURES "sinks,sink_tokens,causal,window,softcap,gqa,varlen,kvcache,paged,paged16,split_kv,broadcast_strides"
// What the FP8-cache decode kernels serve (sm80/fp8_kv.h; registry op "fwd_fp8": KV-cache calls over FP8 caches only).
#define SINKATTN_FWD_FP8_FEATURES "sinks,sink_tokens,causal,window,softcap,gqa,kvcache,paged,paged16,split_kv,fp8_kv,broadcast_strides"
// What a tuning-grid variant of it serves (fwd_launch.cuh launch_fwd_variant: one tile, softcap compiled out,
// the plain forward only).
#define SINKATTN_FWD_VARIANT_FEATURES "sinks,sink_tokens,causal,window,gqa,varlen,broadcast_strides"

namespace sinkattn::sm80 {

// Which translation unit compiles a tile configuration (fwd_launch.cuh, kFwdParts below): the row
// tiles (prefill with softcap compiled out, few-row decode tiles), the key-group tiles, and the prefill tiles
// that serve softcap; each a part of the compile time that builds in parallel with the others.
enum class FwdUnit { kRows, kKeyGroups, kSoftcap };
// The parts each head dim's tiles fill beyond the launcher's own (kRows), one translation unit each: the generator
// reads this list (a strict parser: one {head dim, FwdUnit::kPart} per entry, parts in unit order) to write the
// part units and the launcher unit's extern declarations. A part left out here is compiled in the launcher's
// unit (it links, but the split is lost); a part listed with no tile in it compiles to an empty unit.
struct FwdPart { int head_dim; FwdUnit unit; };
inline constexpr FwdPart kFwdParts[] = {
    {64, FwdUnit::kKeyGroups},  {64, FwdUnit::kSoftcap},
    {128, FwdUnit::kKeyGroups}, {128, FwdUnit::kSoftcap},
    {256, FwdUnit::kKeyGroups}, {256, FwdUnit::kSoftcap},
};
template <class Kt>
inline constexpr FwdUnit fwd_unit_of =
    Kt::kSplitKeys ? FwdUnit::kKeyGroups
    : kPrefill<typename Kt::TileTag> && Kt::kCap == Softcap::kRunTime ? FwdUnit::kSoftcap
                                                                           : FwdUnit::kRows;

// Calls f.template operator()<Traits>() with the kernel traits of the tile this problem takes under this
// shared-memory limit (choose_fwd_tile); a prefill tile (kPrefill) without softcap takes its kernel
// with softcap compiled out.
template <int kHeadDim, class Element, class Prims, class F>
void with_fwd_config(FwdParams const& p, int max_smem_per_block, F&& f) {
  with_fwd_tile<kHeadDim>(choose_fwd_tile(kHeadDim, fwd_shape(p), max_smem_per_block), [&]<class Tile>() {
    if constexpr (kPrefill<Tile>) {
      if (!(p.softcap > 0.f)) return f.template operator()<FwdTraits<Tile, Element, Prims, Softcap::kOff>>();
    }
    f.template operator()<FwdTraits<Tile, Element, Prims, Softcap::kRunTime>>();
  });
}

// The grid: one CTA per (M tile, split, head, batch); with GQA packing "head" is the KV head.
template <int kBlockM>
FwdTileOrder fwd_tile_order(FwdParams const& p) {
  int const group = p.pack_gqa ? p.nheads / p.nheads_k : 1;
  int const heads = p.pack_gqa ? p.nheads_k : p.nheads;
  if (p.packed_tiles)  // every sequence's M tiles in one index (common/seq_extent.h packed_tile)
    return FwdTileOrder{int(packed_tile_count(p.total_q, group, kBlockM, p.batch)), p.num_splits, heads, 1};
  return FwdTileOrder{(p.seqlen_q * group + kBlockM - 1) / kBlockM, p.num_splits, heads, p.batch};
}

}  // namespace sinkattn::sm80
