// row_loader.h: global -> shared copies of row tiles for the sm80 kernels (forward and backward, GPU and host
// emulation alike: the copy atom comes from Kt::Prims).
#pragma once
#include <cute/tensor.hpp>
#include "common/defs.h"

namespace sinkattn::sm80 {

using namespace cute;

// Copies a (rows x d) tile global -> shared with the tiled cp.async copy, row r read from row_ptr(r): rows
// may sit anywhere (pages of a paged cache, query heads of a GQA-packed tile). Vectors outside the valid rows
// or beyond the real head dim are zero-filled in shared memory: K/V tails then give finite scores (masked
// later) and zero contributions, whatever lies past the end of the tensors. vec is the layout of one
// 16-byte vector (contiguous columns).
template <class Kt, class TS, class TC, class Vec, class RowPtr>
SA_DEVICE void load_rows(TS&& tXsX, TC const& tXcX, Vec const& vec, int valid_rows, int headdim, RowPtr const& row_ptr) {
  typename Kt::GmemTiledCopyLoad tiled_copy;
  CUTE_UNROLL
  for (int m = 0; m < size<1>(tXsX); ++m) {
    int const r = get<0>(tXcX(0, m, 0));
    bool const row_ok = r < valid_rows;
    auto const* src = row_ok ? row_ptr(r) : nullptr;
    CUTE_UNROLL
    for (int k = 0; k < size<2>(tXsX); ++k) {
      int const c = get<1>(tXcX(0, m, k));
      if (row_ok && c < headdim) {
        copy(tiled_copy, make_tensor(make_gmem_ptr(src + c), vec), tXsX(_, m, k));
      } else {
        Kt::Prims::zero_fill(tXsX(_, m, k));
      }
    }
  }
}

// Where one thread's copies of a whole (rows x d) tile of a row-major matrix read, relative to the tile's
// first element: its first vector at `first`, vector (m, k) at first + row[m] + its column offset (a
// constant). Computed once per CTA (tile_plan), so that each interior tile costs a pointer add and its copies.
template <int kM>
struct TilePlan {
  int64_t first;
  int64_t row[kM];
};

template <class TC>
SA_DEVICE auto tile_plan(TC const& tXcX, int64_t row_stride) {
  constexpr int kM = decltype(size<1>(tXcX))::value;
  TilePlan<kM> plan;
  int const r0 = get<0>(tXcX(0, 0, 0));
  plan.first = int64_t(r0) * row_stride + get<1>(tXcX(0, 0, 0));
  CUTE_UNROLL
  for (int m = 0; m < kM; ++m) plan.row[m] = int64_t(get<0>(tXcX(0, m, 0)) - r0) * row_stride;
  return plan;
}

// Copies a whole tile, every row and column inside the tensor (an interior key block), from `src`, this thread's
// first vector (the tile's first element + plan.first): no bounds, no zero-fill, no per-row pointers; columns are
// immediate offsets (FlashAttention-2's even-block path: load_rows costs ~150 instructions per warp per tile).
template <class Kt, class TS, class TC, class Vec, class Element, class Plan>
SA_DEVICE void load_tile(TS&& tXsX, TC const& tXcX, Vec const& vec, Element const* src, Plan const& plan) {
  typename Kt::GmemTiledCopyLoad tiled_copy;
  CUTE_UNROLL
  for (int m = 0; m < size<1>(tXsX); ++m) {
    Element const* row = src + plan.row[m];
    CUTE_UNROLL
    for (int k = 0; k < size<2>(tXsX); ++k) {
      int const dc = get<1>(tXcX(0, m, k)) - get<1>(tXcX(0, 0, 0));  // a constant
      copy(tiled_copy, make_tensor(make_gmem_ptr(row + dc), vec), tXsX(_, m, k));
    }
  }
}

// The layout of one thread's 16-byte vector in a row-major global tile of (rows x d) (only its column stride
// matters), for load_rows and the 16-byte stores of the epilogues.
template <class Element, int kRows, int kHeadDim, class GmemThr>
SA_DEVICE auto gmem_vector(GmemThr const& gmem_thr) {
  return gmem_thr.partition_S(make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)),
                                          Shape<Int<kRows>, Int<kHeadDim>>{}, GenRowMajor{}))(_, 0, 0).layout();
}

}  // namespace sinkattn::sm80
