// combine.h: the split-KV combine of one output row, shared by the GPU kernel and the host emulation.
#pragma once
#include <cstdint>
#include "common/defs.h"
#include "common/split.h"
#include "params.h"

namespace sinkattn {

// The split partials (FwdParams::out_accum rows, lse_accum): split s holds nheads * total_q rows (total_q is
// batch * seqlen_q when padded) from s * partial_split_stride; in it, padded problems order (batch, head, query),
// varlen queries (head, packed row), which needs no sequence index (b is then unused).
SA_HOST_DEVICE int64_t partial_split_stride(FwdParams const& p) {
  return int64_t(p.nheads) * (p.cu_seqlens_q ? int64_t(p.total_q) : int64_t(p.batch) * p.seqlen_q);
}
SA_HOST_DEVICE int64_t partial_row(FwdParams const& p, int b, int h, int64_t i) {
  return p.cu_seqlens_q ? int64_t(h) * p.total_q + i : (int64_t(b) * p.nheads + h) * p.seqlen_q + i;
}

// Output row (b, h, i) from the num_splits partials (varlen queries: b 0 and i the packed row; their out and lse
// batch strides are 0); lanes [lane, lane + lanes, ...) of the head dim.
template <class Element>
SA_HOST_DEVICE void combine_row(FwdParams const& p, int b, int h, int64_t i, int lane, int lanes) {
  int64_t const row = partial_row(p, b, h, i);
  int64_t const split_stride = partial_split_stride(p);
  float const sink = p.sinks ? p.sinks[h] : -INFINITY;
  float const lse = combine_lse(p.lse_accum + row, split_stride, p.num_splits, sink);
  Element* o = static_cast<Element*>(p.out) + int64_t(b) * p.o_batch_stride + i * p.o_row_stride +
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

// The rows the combine writes: (batch, head, query) padded; (head, packed row) for varlen queries, rows past the
// last sequence's (cu_seqlens_q[batch], a caller's padding) untouched as the attention kernel leaves them.
SA_HOST_DEVICE int64_t combine_rows(FwdParams const& p) {
  return p.cu_seqlens_q ? int64_t(p.nheads) * p.total_q : int64_t(p.batch) * p.nheads * p.seqlen_q;
}
template <class Element>
SA_HOST_DEVICE void combine_row_at(FwdParams const& p, int64_t r, int lane, int lanes) {
  if (p.cu_seqlens_q) {
    int64_t const i = r % p.total_q;
    if (i < p.cu_seqlens_q[p.batch]) combine_row<Element>(p, 0, int(r / p.total_q), i, lane, lanes);
    return;
  }
  int const i = int(r % p.seqlen_q), h = int((r / p.seqlen_q) % p.nheads), b = int(r / (int64_t(p.seqlen_q) * p.nheads));
  combine_row<Element>(p, b, h, i, lane, lanes);
}

// Every row, one after another: the host emulation's combine (common/combine_launch.cuh is the GPU's).
template <class Element>
void combine_on_host(FwdParams const& p) {
  for (int64_t r = 0; r < combine_rows(p); ++r) combine_row_at<Element>(p, r, 0, 1);
}

}  // namespace sinkattn
