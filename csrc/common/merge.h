// merge.h: merging partial attention states computed over disjoint key sets.
//
// Each partial (out_x, lse_x) is normalised over its own keys and holds no sink; the sink is counted
// once, here. Shared by merge_attn_states, the split-KV combine and context parallelism.
#pragma once
#include <cmath>
#include "common/defs.h"

namespace sinkattn {

struct MergeWeights {
  float wa, wb;  // out = wa * out_a + wb * out_b
  float lse;
};

SA_HOST_DEVICE MergeWeights merge_weights(float lse_a, float lse_b, float sink) {
  float m = fmaxf(fmaxf(lse_a, lse_b), sink);
  if (m == -INFINITY) return MergeWeights{0.f, 0.f, -INFINITY};
  if (m == INFINITY) {  // infinite mass (a caller's overflow upstream): share it evenly, never NaN
    float na = lse_a == INFINITY ? 1.f : 0.f, nb = lse_b == INFINITY ? 1.f : 0.f;
    float n = na + nb + (sink == INFINITY ? 1.f : 0.f);
    return MergeWeights{na / n, nb / n, INFINITY};
  }
  float ea = expf(lse_a - m), eb = expf(lse_b - m), es = expf(sink - m);
  float sum = ea + eb + es;
  return MergeWeights{ea / sum, eb / sum, m + logf(sum)};
}

}  // namespace sinkattn
