// bwd_config.h: the tile configurations of the sm80 backward kernel (shared by the GPU launcher and the host
// emulation, so the emulated kernel runs exactly the configurations the GPU runs).
#pragma once
#include "common/bwd_prepost.h"
#include "common/defs.h"
#include "params.h"
#include "sm80/bwd_traits.h"

#define SINKATTN_BWD_FEATURES "sinks,sink_tokens,causal,window,softcap,gqa,varlen,deterministic"

namespace sinkattn::sm80 {

// The head-dim-128 tile of 99 KB devices (sm86 / sm89), where sm80 / sm90 take a bigger one.
template <class Element, class Prims>
using BwdTraits128Small = BwdTraits<128, kBwdBlockM, kBwdBlockN, 4, 2, 1, Element, Prims>;  // 80 KB

// Which translation unit compiles a tile configuration (bwd_launch.cuh, generate_kernels.py _PARTS):
// the hd128 backward's two tiles took 126-129 s in one unit on the 2-core dev machine under load.
enum class BwdUnit { kMain, kSmallSmem };
template <class Kt>
inline constexpr BwdUnit bwd_unit_of = BwdUnit::kMain;
template <class Element, class Prims>
inline constexpr BwdUnit bwd_unit_of<BwdTraits128Small<Element, Prims>> = BwdUnit::kSmallSmem;

template <int kHeadDim, class Element, class Prims, class F>
void with_bwd_config(int max_smem_per_block, F&& f) {
  if constexpr (kHeadDim == 64) {
    f.template operator()<BwdTraits<64, kBwdBlockM, kBwdBlockN, 4, 1, 2, Element, Prims>>();    // 64 KB
  } else if constexpr (kHeadDim == 128) {
    using Big = BwdTraits<128, kBwdBlockM, kBwdBlockN, 4, 2, 2, Element, Prims>;               // 112 KB: sm80 / sm90
    using Small = BwdTraits128Small<Element, Prims>;
    if (max_smem_per_block >= Big::kSmemBytes) f.template operator()<Big>();
    else f.template operator()<Small>();
  } else {
    static_assert(kHeadDim == 256);
    f.template operator()<BwdTraits<256, kBwdBlockM, kBwdBlockN, 2, 4, 1, Element, Prims>>();  // 144 KB: sm80 / sm90 only
  }
}

// One CTA per (n-block, query head, sequence), flattened to 1-D; n-blocks vary fastest.
struct BwdGrid {
  int n_blocks, heads;
  SA_HOST_DEVICE int64_t size(int batch) const { return int64_t(n_blocks) * heads * batch; }
  SA_HOST_DEVICE void decode(int64_t bid, int& n_block, int& head, int& batch) const {
    n_block = int(bid % n_blocks);
    bid /= n_blocks;
    head = int(bid % heads);
    batch = int(bid / heads);
  }
};

template <int kBlockN>
BwdGrid bwd_grid(BwdParams const& p) {
  return BwdGrid{(p.seqlen_k + kBlockN - 1) / kBlockN, p.nheads};
}

}  // namespace sinkattn::sm80
