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

// Copies a whole tile, every row and column inside the tensor (an interior tile), whose element (0, 0) is at
// `tile` and whose rows are row_stride apart: no bounds, no zero-fill, no per-row pointers; this thread's rows
// are a pass of kNThreads / 8 rows apart and its columns immediate offsets (FlashAttention-2's even-block path:
// load_rows costs ~150 instructions per warp per tile). Nothing is held across tiles: holding per-thread
// pointers and pass offsets in registers made the 255-register hd64 prefill tile spill; recomputing them from
// the kernel parameters (constant bank) costs 26 integer instructions a tile on the hd128 prefill path (sm_80),
// which by the SASS model issue under the other warp's MMAs (docs/internals.md: held pointers were no faster).
template <class Kt, class TS, class TC, class Vec, class Element>
SA_DEVICE void load_tile(TS&& tXsX, TC const& tXcX, Vec const& vec, Element const* tile, int64_t row_stride) {
  typename Kt::GmemTiledCopyLoad tiled_copy;
  int const r0 = get<0>(tXcX(0, 0, 0)), c0 = get<1>(tXcX(0, 0, 0));
  Element const* src = tile + int64_t(r0) * row_stride + c0;
  CUTE_UNROLL
  for (int m = 0; m < size<1>(tXsX); ++m) {
    Element const* row = src + int64_t(get<0>(tXcX(0, m, 0)) - r0) * row_stride;  // a constant times row_stride
    CUTE_UNROLL
    for (int k = 0; k < size<2>(tXsX); ++k) {
      int const dc = get<1>(tXcX(0, m, k)) - c0;  // a constant
      copy(tiled_copy, make_tensor(make_gmem_ptr(row + dc), vec), tXsX(_, m, k));
    }
  }
}

// load_tile under a predicate, without a branch: every copy a predicated cp.async (Prims::cp_async_16_if), so the
// address work and the copies stay in the caller's basic block. The tile is rows row0.. of the tensor at `seq`, the
// thread's first row folded into the block's (one 64-bit product per tile: with the tile's pointer formed first, then
// the thread's offset, the sm90 hd128 tile took 252 registers instead of 250).
template <class Kt, class TS, class TC, class Element>
SA_DEVICE void load_tile_if(bool pred, TS&& tXsX, TC const& tXcX, Element const* seq, int row0, int64_t row_stride) {
  int const r0 = get<0>(tXcX(0, 0, 0)), c0 = get<1>(tXcX(0, 0, 0));
  int64_t const off = int64_t(row0 + r0) * row_stride + c0;
  CUTE_UNROLL
  for (int m = 0; m < size<1>(tXsX); ++m) {
    int64_t const row = off + int64_t(get<0>(tXcX(0, m, 0)) - r0) * row_stride;  // a constant times row_stride
    CUTE_UNROLL
    for (int k = 0; k < size<2>(tXsX); ++k) {
      Kt::Prims::cp_async_16_if(pred, seq + row + (get<1>(tXcX(0, m, k)) - c0), raw_pointer_cast(&tXsX(0, m, k)));
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
