// fwd_config.h: the tile configurations of the sm80 forward kernel, chosen at run time from the device's
// shared-memory limit per block (sm80: 163 KB; sm86/sm89: 99 KB). Shared by the GPU launcher and the
// host emulation, so the emulated kernel runs exactly the configurations the GPU runs.
#pragma once
#include "sm80/fwd_traits.h"

// What every sm80 forward kernel serves (recorded in the registry, shown by the report).
#define SINKATTN_FWD_FEATURES "sinks,sink_tokens,causal,window,softcap,gqa,varlen,kvcache,paged,split_kv"

namespace sinkattn::sm80 {

// Calls f.template operator()<Traits>() with the configuration for this head dim and shared-memory limit.
template <int kHeadDim, class Element, class Prims, class F>
void with_fwd_config(int max_smem_per_block, F&& f) {
  if constexpr (kHeadDim == 64) {
    // 8 warps of 16 rows: with 4 warps of 32 rows the accumulators need more than 255 registers and spill
    // (seen for sm_90 code generated from compute_80).
    f.template operator()<FwdTraits<64, 128, 64, 8, Element, Prims>>();      // 48 KB
  } else if constexpr (kHeadDim == 128) {
    f.template operator()<FwdTraits<128, 128, 64, 8, Element, Prims>>();     // 96 KB: fits sm86 too
  } else {
    static_assert(kHeadDim == 256);
    using Big = FwdTraits<256, 64, 64, 4, Element, Prims>;                   // 160 KB: sm80 only
    using Small = FwdTraits<256, 64, 32, 4, Element, Prims>;                 // 96 KB: sm86 / sm89
    if (max_smem_per_block >= Big::kSmemBytes) f.template operator()<Big>();
    else f.template operator()<Small>();
  }
}

}  // namespace sinkattn::sm80
