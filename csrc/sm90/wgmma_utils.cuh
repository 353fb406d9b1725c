// wgmma_utils.cuh: what the sm90 kernels (forward and backward) share about wgmma: issuing one product over its
// K mode, and the register layouts of an accumulator (its rows and columns; S or dS as the A operand of the next
// product).
#pragma once
#include <cute/tensor.hpp>
#include <cute/arch/mma_sm90_gmma.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>

namespace sinkattn::sm90 {

using namespace cute;

// acc (+)= A * B over the K mode on wgmma, committed as one batch; the caller waits with warpgroup_wait.
template <bool kZeroInit, class TiledMma, class TA, class TB, class TC>
__device__ __forceinline__ void wgmma(TiledMma& mma, TA const& a, TB const& b, TC& acc) {
  warpgroup_fence_operand(acc);
  warpgroup_arrive();
  mma.accumulate_ = kZeroInit ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
  CUTE_UNROLL
  for (int k = 0; k < size<2>(a); ++k) {
    gemm(mma, a(_, _, k), b(_, _, k), acc);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
}

// ((2 cols, 2 row halves, N/8), M, N) -> ((2 row halves, M), (2 cols, N/8, N)): rows and columns of a
// wgmma accumulator (each thread holds 2 rows; the 4 lanes of a quad share them).
template <class L>
__host__ __device__ constexpr auto acc_rowcol(L const& l) {
  return make_layout(make_layout(get<0, 1>(l), get<1>(l)), make_layout(get<0, 0>(l), get<0, 2>(l), get<2>(l)));
}
template <class T>
__host__ __device__ auto rowcol_view(T&& t) {
  return make_tensor(t.data(), acc_rowcol(t.layout()));
}

// The S accumulator ((2, 2, N/8), M, N) as the register A operand of m64nXk16: ((2, 2, 2), M, (N/16, N)).
// The value order of a k16 A fragment (2 cols, 2 row halves, 2 k halves) is two adjacent n8 accumulator
// groups, so this is a view, not a shuffle.
template <class L>
__host__ __device__ constexpr auto acc_as_a_operand(L const& l) {
  auto v = logical_divide(get<0>(l), Shape<Underscore, Underscore, _2>{});  // (2, 2, (2, N/16))
  return make_layout(make_layout(get<0>(v), get<1>(v), get<2, 0>(v)), get<1>(l), make_layout(get<2, 1>(v), get<2>(l)));
}

}  // namespace sinkattn::sm90
