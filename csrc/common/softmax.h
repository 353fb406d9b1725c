// softmax.h: the per-row finalize of the online softmax, with the learnable sink folded in.
//
// The kernels keep, per row, the running max of the scaled scores (natural-log units) and the running
// sum of exp(s - max). The sink joins only here, once per row: it is one more term of the denominator
// with no value vector (DESIGN.md section 1). Re-basing on max(row_max, sink) keeps a large sink (say
// +30 against scores near 0) from overflowing, and a row that saw no key gives out = 0 and lse = sink
// (or -inf) instead of NaN.
#pragma once
#include <cmath>
#include "common/defs.h"

namespace sinkattn {

struct RowFinal {
  float out_scale;  // multiply the unnormalised output accumulator by this
  float lse;        // natural log, includes the sink
};

// row_max: max of the scaled scores seen (-inf if none); row_sum: sum of exp(s - row_max);
// sink: the sink logit, -inf when there is none.
SA_HOST_DEVICE RowFinal finalize_row(float row_max, float row_sum, float sink) {
  if (row_max == -INFINITY || !(row_sum > 0.f)) {
    return RowFinal{0.f, sink};  // no visible key: out = 0, lse = sink (-inf without one)
  }
  if (sink == INFINITY) {  // the sink takes all the weight: out = 0, lse = +inf (the rebase below would be inf - inf)
    return RowFinal{0.f, INFINITY};
  }
  if (sink == -INFINITY) {  // bit for bit the plain-attention math
    return RowFinal{1.f / row_sum, row_max + logf(row_sum)};
  }
  float m = fmaxf(row_max, sink);
  float sum = row_sum * expf(row_max - m) + expf(sink - m);
  return RowFinal{expf(row_max - m) / sum, m + logf(sum)};
}

}  // namespace sinkattn
