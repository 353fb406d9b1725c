// smem_utils.cuh: what the sm90 kernels (forward and backward) share about plain shared-memory accesses beside the
// mbarrier pipeline: the zeroing of a tile's rows past its sequence (docs/DESIGN.md section 6, "varlen tails"),
// its stores through the seam (Prims: sm90/prims_gpu.cuh GpuPrims).
#pragma once
#include <cstdint>
#include <cute/tensor.hpp>

namespace sinkattn::sm90 {

// Rows [valid, rows) of two (rows, head dim) tiles in shared memory set to zero by the kThreads threads that `tid`
// numbers, one 16-byte store per 8 columns. A 128-byte swizzle permutes whole 16-byte chunks, so 8 columns from a
// multiple of 8 are 8 adjacent elements (tests/layout_facts/sm90_bwd.cu checks it for the backward's Q, dO, K and
// V tiles). The caller then makes the stores visible to the async proxy (wgmma reads the tiles) and syncs the
// threads before any of them issues a product over them.
//
// Why: a TMA box zero-fills only past the tensor it was encoded over. Varlen packs every sequence into one tensor,
// so the rows of a key block or M tile past its sequence's end are the next sequence's (or, past the last
// sequence, the allocation's) rows, and they enter the products: they get zero weight by multiplication, and
// 0 * inf is NaN. Zeroed, they contribute exact zeros, as the sm80 kernels' zero-filled loads give.
template <class Prims, int kThreads, class TileA, class TileB>
__device__ __forceinline__ void zero_tail_rows(TileA const& a, TileB const& b, int valid, int tid) {
  using namespace cute;
  constexpr int kRows = decltype(size<0>(a))::value, kVecs = decltype(size<1>(a))::value / 8;
  static_assert(decltype(size<1>(a))::value % 8 == 0 && decltype(size<0>(b))::value == kRows &&
                decltype(size<1>(b))::value == kVecs * 8);
#pragma unroll 1
  for (int v = valid * kVecs + tid; v < kRows * kVecs; v += kThreads) {
    int const r = v / kVecs, c = v % kVecs * 8;
    Prims::sts128_zero2(Prims::smem_address(&a(r, c)), Prims::smem_address(&b(r, c)));
  }
}

// Rows [valid, rows) of one such tile, two 16-byte stores at a time (a row holds an even number of 16-byte
// chunks at every head dim the kernels have, so both stores of a pair are in one row). Same contract as above.
template <class Prims, int kThreads, class Tile>
__device__ __forceinline__ void zero_tail_rows(Tile const& a, int valid, int tid) {
  using namespace cute;
  constexpr int kRows = decltype(size<0>(a))::value, kVecs = decltype(size<1>(a))::value / 8;
  static_assert(decltype(size<1>(a))::value % 8 == 0 && kVecs % 2 == 0);
#pragma unroll 1
  for (int v = valid * kVecs + 2 * tid; v < kRows * kVecs; v += 2 * kThreads) {
    int const r = v / kVecs, c = v % kVecs * 8;
    Prims::sts128_zero2(Prims::smem_address(&a(r, c)), Prims::smem_address(&a(r, c + 8)));
  }
}

}  // namespace sinkattn::sm90
