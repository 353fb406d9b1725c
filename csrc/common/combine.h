// combine.h: the split-KV combine of one output row, shared by the GPU kernel and the host emulation.
#pragma once
#include <cstdint>
#include "common/defs.h"
#include "common/split.h"
#include "params.h"

namespace sinkattn {

// Row (b, h, i) of the output from the num_splits partials; lanes [lane, lane + lanes, ...) of the head dim.
template <class Element>
SA_HOST_DEVICE void combine_row(FwdParams const& p, int b, int h, int i, int lane, int lanes) {
  int64_t const row = (int64_t(b) * p.nheads + h) * p.seqlen_q + i;
  int64_t const split_stride = int64_t(p.batch) * p.nheads * p.seqlen_q;
  float const sink = p.sinks ? p.sinks[h] : -INFINITY;
  float const lse = combine_lse(p.lse_accum + row, split_stride, p.num_splits, sink);
  Element* o = static_cast<Element*>(p.out) + int64_t(b) * p.o_batch_stride + int64_t(i) * p.o_row_stride +
               int64_t(h) * p.o_head_stride;
  for (int d = lane; d < p.headdim; d += lanes) {
    float acc = 0.f;
    for (int s = 0; s < p.num_splits; ++s) {
      float w = split_weight(p.lse_accum[s * split_stride + row], lse);
      if (w != 0.f) acc += w * p.out_accum[(s * split_stride + row) * p.headdim_rounded + d];
    }
    o[d] = Element(acc);
  }
  if (lane == 0) p.lse[int64_t(b) * p.lse_batch_stride + int64_t(h) * p.lse_head_stride + i] = lse;
}

}  // namespace sinkattn
