// fwd_config.h: the tile configurations of the sm80 forward kernel, chosen at run time from the problem
// (few rows per tile: decode) and the device's shared-memory limit per block (sm80: 163 KB; sm86/sm89: 99 KB).
// Shared by the GPU launcher and the host emulation, so the emulated kernel runs exactly the configurations
// the GPU runs.
#pragma once
#include <cstdint>
#include "params.h"
#include "sm80/fwd_traits.h"

// What every sm80 forward kernel serves (recorded in the registry, shown by the report).
#define SINKATTN_FWD_FEATURES "sinks,sink_tokens,causal,window,softcap,gqa,varlen,kvcache,paged,split_kv"

namespace sinkattn::sm80 {

// Few rows per (sequence, head or head group): decode, GQA-packed (seqlen_q * group <= 64), or split-KV. Such
// a tile is mostly padding rows, whose warps skip the MMAs (fwd_kernel.h), so the kernel is bound by the bytes
// of K and V it keeps in flight: a 64-row tile of 4 warps, small, with more K/V stages.
inline bool fwd_few_rows(FwdParams const& p) {
  int const group = p.pack_gqa && p.nheads_k > 0 ? p.nheads / p.nheads_k : 1;
  return p.num_splits > 1 || int64_t(p.seqlen_q) * group <= 64;
}

// Key groups of a decode tile (fwd_traits.h): with at most 16 real rows per (sequence, head or head group),
// all 4 warps take the same 16 rows and split the keys of each key block; with 17-32, two groups of two warps.
// With rows split alone, one warp did all the math of a decode step (gpt-oss: 8 query heads per KV head, one
// query) while three only loaded: the H200 measured 62.8% of its copy bandwidth so for hd64, where a key
// block carries the most softmax work per byte.
inline int fwd_key_groups(FwdParams const& p) {
  int const group = p.pack_gqa && p.nheads_k > 0 ? p.nheads / p.nheads_k : 1;
  int64_t const rows = int64_t(p.seqlen_q) * group;
  return rows <= 16 ? 4 : rows <= 32 ? 2 : 1;
}

// Which translation unit compiles a tile configuration (fwd_launch.cuh, generate_kernels.py _PARTS):
// the row tiles (prefill, few-row decode tiles) and the key-group tiles, about half the compile time each.
enum class FwdUnit { kRows, kKeyGroups };
template <class Kt>
inline constexpr FwdUnit fwd_unit_of = Kt::kSplitKeys ? FwdUnit::kKeyGroups : FwdUnit::kRows;

// f with Big where it fits the device's shared memory per block, else with Small.
template <class Big, class Small, class F>
void with_fitting(int max_smem_per_block, F&& f) {
  if (max_smem_per_block >= Big::kSmemBytes) f.template operator()<Big>();
  else f.template operator()<Small>();
}

// Calls f.template operator()<Traits>() with the configuration for this head dim, problem and shared-memory
// limit. Sizes: Q kBlockM x d, plus kStages x (K + V) of kBlockN x d, in 2-byte elements.
template <int kHeadDim, class Element, class Prims, class F>
void with_fwd_config(FwdParams const& p, int max_smem_per_block, F&& f) {
  bool const few_rows = fwd_few_rows(p);
  int const key_groups = fwd_key_groups(p);
  if constexpr (kHeadDim == 64) {
    if (key_groups == 4) {
      // 32 keys per warp per block. 98 KB: fits every arch (sm86/sm89 allow 99 KB per block), and two CTAs
      // an sm90 SM.
      using Keys = FwdTraits<64, 16, 128, 4, Element, Prims, 3, 4>;
      static_assert(Keys::kSmemBytes <= 99 * 1024);
      f.template operator()<Keys>();
    } else if (key_groups == 2) {
      // 64 keys per group of two warps per block.
      using Big = FwdTraits<64, 32, 128, 4, Element, Prims, 3, 2>;           // 100 KB, 64 KB in flight: sm80, sm90
      using Small = FwdTraits<64, 32, 128, 4, Element, Prims, 2, 2>;         // 68 KB, 32 KB in flight
      with_fitting<Big, Small>(max_smem_per_block, f);
    } else if (few_rows) {
      // kBlockN 128: with 64 the 3- and 4-stage tiles spill 4-16 bytes on sm_80 (at 168 registers).
      using Big = FwdTraits<64, 64, 128, 4, Element, Prims, 3>;               // 104 KB, 64 KB in flight: sm80, sm90
      using Small = FwdTraits<64, 64, 128, 4, Element, Prims, 2>;             // 72 KB, 32 KB in flight
      with_fitting<Big, Small>(max_smem_per_block, f);
    } else {
      // 4 warps of 32 rows: each K/V fragment read from shared memory feeds two 16-row MMA tiles (half the
      // ldmatrix traffic per FLOP of 8 warps of 16 rows). 255 registers, no spill since the element mask
      // compares against per-row bounds (TileMask::visible_cols); before, it spilled 24-32 bytes on sm_90.
      f.template operator()<FwdTraits<64, 128, 64, 4, Element, Prims>>();    // 48 KB
    }
  } else if constexpr (kHeadDim == 128) {
    if (key_groups > 1) {
      // 16 (32) keys per warp per block. Big: two CTAs fit an sm90 SM (228 KB), as with the 64-row tile.
      auto run = [&]<int kGroups>() {
        with_fitting<FwdTraits<128, 64 / kGroups, 64, 4, Element, Prims, 3, kGroups>,   // 100-104 KB: sm80, sm90
                     FwdTraits<128, 64 / kGroups, 64, 4, Element, Prims, 2, kGroups>>(  // 68-72 KB
            max_smem_per_block, f);
      };
      if (key_groups == 4) run.template operator()<4>();
      else run.template operator()<2>();
    } else if (few_rows) {
      using Big = FwdTraits<128, 64, 64, 4, Element, Prims, 3>;               // 112 KB, 64 KB in flight: sm80, sm90
      using Small = FwdTraits<128, 64, 32, 4, Element, Prims, 4>;             // 80 KB, 48 KB in flight
      with_fitting<Big, Small>(max_smem_per_block, f);
    } else {
      f.template operator()<FwdTraits<128, 128, 64, 8, Element, Prims>>();   // 96 KB: fits sm86 too
    }
  } else {
    static_assert(kHeadDim == 256);
    // Rows 17-32 keep the 64-row tile here: two key groups (32 of 64 keys each) would take 144 KB.
    using Keys = FwdTraits<256, 16, 64, 4, Element, Prims, 2, 4>;            // 136 KB, 16 keys per warp: sm80, sm90
    using Big = FwdTraits<256, 64, 64, 4, Element, Prims>;                   // 160 KB: sm80 only
    using Small = FwdTraits<256, 64, 32, 4, Element, Prims>;                 // 96 KB: sm86 / sm89
    if (key_groups == 4 && max_smem_per_block >= Keys::kSmemBytes) f.template operator()<Keys>();
    else with_fitting<Big, Small>(max_smem_per_block, f);
  }
}

}  // namespace sinkattn::sm80
