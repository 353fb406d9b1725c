// split_epilogue.h: the sm80 forward's epilogue under split-KV: each split's partial state, which the combine
// (common/combine.h) merges with the sink counted once.
#pragma once
#include <cstdint>
#include <cute/tensor.hpp>
#include "common/defs.h"
#include "params.h"
#include "sm80/fwd_epilogue.h"  // FwdRows

namespace sinkattn::sm80 {

using namespace cute;

// Split-KV: this split's rows, normalised over its own keys and without the sink, in fp32 straight from
// registers (decode tiles are small and the combine reads them once): out_accum[split, b, head, query, :] and
// lse_accum[split, b, head, query].
template <class Kt, class Rows, class CoordsO, int kRows>
SA_DEVICE void store_split_partials(FwdParams const& p, FwdRows<typename Kt::Element> const& at, int rows, int split,
                                    int bidb, Rows const& out_rows, CoordsO const& tOcO, float const (&lse)[kRows]) {
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    int const row = get<0>(tOcO(r, 0));
    if (at.m0 + row >= rows) continue;
    int64_t const idx = ((int64_t(split) * p.batch + bidb) * p.nheads + at.head_of(row)) * p.seqlen_q + at.query_of(row);
    CUTE_UNROLL
    for (int c = 0; c < size<1>(out_rows); ++c) {
      int const col = get<1>(tOcO(r, c));
      if (col < p.headdim) p.out_accum[idx * p.headdim_rounded + col] = out_rows(r, c);
    }
    if (get<1>(tOcO(r, 0)) == 0) p.lse_accum[idx] = lse[r];
  }
}

}  // namespace sinkattn::sm80
