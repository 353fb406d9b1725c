// smem_utils.cuh: what the sm90 kernels (forward and backward) share about plain shared-memory accesses beside the
// mbarrier pipeline: the compiler fence that keeps them between a barrier's wait and arrive, and the zeroing of a
// tile's rows past its sequence (docs/DESIGN.md section 6, "varlen tails").
#pragma once
#include <cstdint>
#include <cute/tensor.hpp>

namespace sinkattn::sm90 {

// CUTLASS's mbarrier wait and arrive are asm volatile without a memory clobber, so the compiler may move a plain
// shared-memory load or store across them (asm volatile statements keep their order among themselves, memory
// accesses do not); the hardware's ordering (a wait acquires, an arrive releases) needs each access to stay on its
// side in the program. One of these after every wait whose data is then read, and before every arrive that
// publishes what was written.
__device__ __forceinline__ void compiler_fence() { asm volatile("" ::: "memory"); }

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
template <int kThreads, class TileA, class TileB>
__device__ __forceinline__ void zero_tail_rows(TileA const& a, TileB const& b, int valid, int tid) {
  using namespace cute;
  constexpr int kRows = decltype(size<0>(a))::value, kVecs = decltype(size<1>(a))::value / 8;
  static_assert(decltype(size<1>(a))::value % 8 == 0 && decltype(size<0>(b))::value == kRows &&
                decltype(size<1>(b))::value == kVecs * 8);
#pragma unroll 1
  for (int v = valid * kVecs + tid; v < kRows * kVecs; v += kThreads) {
    int const r = v / kVecs, c = v % kVecs * 8;
    asm volatile("st.shared.v4.u32 [%0], {%2, %2, %2, %2};\n"
                 "st.shared.v4.u32 [%1], {%2, %2, %2, %2};\n" ::"r"(cast_smem_ptr_to_uint(&a(r, c))),
                 "r"(cast_smem_ptr_to_uint(&b(r, c))), "r"(0u)
                 : "memory");
  }
}

}  // namespace sinkattn::sm90
