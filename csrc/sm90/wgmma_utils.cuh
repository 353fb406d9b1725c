// wgmma_utils.cuh: what the sm90 kernels (forward and backward) share about wgmma's register layouts: an
// accumulator's rows and columns, and S or dS as the register A operand of the next product (layouts only; issuing
// a product is the seam's, sm90/prims_gpu.cuh GpuPrims::wgmma).
#pragma once
#include <cute/tensor.hpp>
#include <cute/arch/mma_sm90_gmma.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>

namespace sinkattn::sm90 {

using namespace cute;

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
