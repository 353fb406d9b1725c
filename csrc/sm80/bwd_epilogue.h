// bwd_epilogue.h: where the sm80 backward's finished dK and dV go: fp32 per query head into dk_accum and
// dv_accum, which the postprocess (common/bwd_prepost.h) sums over the GQA group and converts.
#pragma once
#include <cstdint>
#include <cute/tensor.hpp>

#include "common/defs.h"
#include "params.h"

namespace sinkattn::sm80 {

using namespace cute;

// dK (times softmax_scale: dS is unscaled) and dV of the N tile whose row 0 is key j0, query head bidh, straight
// from the accumulators: keys below seqlen_k, columns below the real head dim. k_row0: the sequence's first row of
// the accumulators.
template <class Kt, class ThrMma, class AccDk, class AccDv>
SA_DEVICE void store_dk_dv(BwdParams const& p, ThrMma const& thr_mma, AccDk const& acc_dk, AccDv const& acc_dv, int j0,
                           int seqlen_k, int64_t k_row0, int bidh) {
  Tensor tdKcdK = thr_mma.partition_C(make_identity_tensor(Shape<Int<Kt::kBlockN>, Int<Kt::kHeadDim>>{}));
  CUTE_UNROLL
  for (int e = 0; e < size(acc_dk); ++e) {
    int const j = j0 + get<0>(tdKcdK(e)), c = get<1>(tdKcdK(e));
    if (j < seqlen_k && c < p.headdim) {
      int64_t const a = ((k_row0 + j) * p.nheads + bidh) * p.headdim_rounded + c;
      p.dk_accum[a] = acc_dk(e) * p.softmax_scale;
      p.dv_accum[a] = acc_dv(e);
    }
  }
}

}  // namespace sinkattn::sm80
