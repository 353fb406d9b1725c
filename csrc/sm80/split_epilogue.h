// split_epilogue.h: the sm80 forward's epilogue under split-KV: each split's partial state, which the combine
// (common/combine.h) merges with the sink counted once.
#pragma once
#include <cstdint>
#include <cute/tensor.hpp>
#include "common/combine.h"
#include "common/defs.h"
#include "params.h"
#include "sm80/fwd_epilogue.h"  // FwdRows

namespace sinkattn::sm80 {

using namespace cute;

// Split-KV: this split's rows, normalised over its own keys and without the sink, in fp32 straight from
// registers (decode tiles are small and the combine reads them once), at common/combine.h partial_row: sequence
// bidb's query q0 + query (q0: its first packed row when the queries are packed, else 0).
template <class Kt, class Rows, class CoordsO, int kRows>
SA_DEVICE void store_split_partials(FwdParams const& p, FwdRows<typename Kt::Element> const& at, int rows, int split,
                                    int bidb, int64_t q0, Rows const& out_rows, CoordsO const& tOcO,
                                    float const (&lse)[kRows]) {
  int64_t const split0 = split * partial_split_stride(p);
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    int const row = get<0>(tOcO(r, 0));
    if (at.m0 + row >= rows) continue;
    int64_t const idx = split0 + partial_row(p, bidb, at.head_of(row), q0 + at.query_of(row));
    CUTE_UNROLL
    for (int c = 0; c < size<1>(out_rows); ++c) {
      int const col = get<1>(tOcO(r, c));
      if (col < p.headdim) p.out_accum[idx * p.headdim_rounded + col] = out_rows(r, c);
    }
    if (get<1>(tOcO(r, 0)) == 0) p.lse_accum[idx] = lse[r];
  }
}

}  // namespace sinkattn::sm80
