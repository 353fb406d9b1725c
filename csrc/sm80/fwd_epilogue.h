// fwd_epilogue.h: where the sm80 forward's finished rows go: O and the LSE (store_out_lse); under split-KV
// split_epilogue.h stores partial states instead.
#pragma once
#include <cstdint>
#include <cute/tensor.hpp>
#include "common/defs.h"
#include "params.h"
#include "sm80/gemm.h"
#include "sm80/layout_utils.h"

namespace sinkattn::sm80 {

using namespace cute;

// Which query head and query a row of the tile holds, and where its output goes. A GQA-packed tile (group > 1)
// holds the G query heads of KV head `head` for each query: row r is query r / G of head head * G + r % G.
template <class Element>
struct FwdRows {
  int m0, head, group;
  Element* o_seq;  // out at this sequence
  int64_t o_row_stride, o_head_stride;

  SA_DEVICE int head_of(int r) const { return group == 1 ? head : head * group + (m0 + r) % group; }
  SA_DEVICE int query_of(int r) const { return group == 1 ? m0 + r : (m0 + r) / group; }
  SA_DEVICE Element* out_row(int r) const {
    return o_seq + int64_t(query_of(r)) * o_row_stride + int64_t(head_of(r)) * o_head_stride;
  }
};

// O: registers -> shared (Q's space: sO, free once every thread is done with Q) -> global in 16-byte vectors,
// rows below `rows` only (the tile's real rows), columns below the real head dim. The LSE: the lane holding
// column 0 of a row writes it at lse_seq + head * lse_head_stride + query. holds_rows: this thread's
// accumulators are the tile's (false for key groups 1.., which still join the barriers and the stores).
template <class Kt, class TiledMma, class Acc, class CoordsO, class SO, class Vec, int kRows>
SA_DEVICE void store_out_lse(FwdParams const& p, FwdRows<typename Kt::Element> const& at, int rows, TiledMma const& mma,
                             int mma_tid, int tid, Acc const& acc_o, CoordsO const& tOcO, float const (&lse)[kRows],
                             bool holds_rows, int64_t lse_seq, SO& sO, Vec const& vec) {
  using Element = typename Kt::Element;
  using Prims = typename Kt::Prims;
  Prims::sync_threads();  // no thread still reads sQ
  if (holds_rows) {
    Tensor rO = convert<Element>(acc_o);
    auto smem_copy_o = make_tiled_copy_C(typename Kt::SmemCopyAtomO{}, mma);
    auto smem_thr_o = smem_copy_o.get_thread_slice(mma_tid);
    copy(smem_copy_o, smem_thr_o.retile_S(rO), smem_thr_o.partition_D(sO));
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      int const row = get<0>(tOcO(r, 0));
      if (get<1>(tOcO(r, 0)) == 0 && at.m0 + row < rows) {
        p.lse[lse_seq + int64_t(at.head_of(row)) * p.lse_head_stride + at.query_of(row)] = lse[r];
      }
    }
  }

  Prims::sync_threads();
  typename Kt::GmemTiledCopyStore gmem_store;
  auto store_thr = gmem_store.get_thread_slice(tid);
  Tensor tOsO = store_thr.partition_S(sO);
  Tensor tOcOst = store_thr.partition_D(make_identity_tensor(Shape<Int<Kt::kBlockM>, Int<Kt::kHeadDim>>{}));
  CUTE_UNROLL
  for (int m = 0; m < size<1>(tOsO); ++m) {
    int const row = get<0>(tOcOst(0, m, 0));
    if (at.m0 + row >= rows) continue;
    Element* dst = at.out_row(row);
    CUTE_UNROLL
    for (int k = 0; k < size<2>(tOsO); ++k) {
      int const col = get<1>(tOcOst(0, m, k));
      if (col < p.headdim) copy(gmem_store, tOsO(_, m, k), make_tensor(make_gmem_ptr(dst + col), vec));
    }
  }
}

}  // namespace sinkattn::sm80
