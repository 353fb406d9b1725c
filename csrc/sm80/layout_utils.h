// layout_utils.h: views of MMA accumulators that the softmax and the P V product need.
//
// The m16n8 accumulator fragment of a thread has layout ((2 cols, 2 row halves), MMA_M, MMA_N). The softmax
// wants rows and columns; the P V product wants the same registers as an A operand of m16n8k16, whose value
// mode (2 cols, 2 row halves, 2 k halves) is exactly two adjacent n8 accumulator tiles. Both are pure layout
// algebra, so they are checked on the host by the emulated kernel.
#pragma once
#include <cute/tensor.hpp>

namespace sinkattn::sm80 {

using namespace cute;

// ((2,2), M, N) -> ((2, M), (2, N)): (row, col) indexing of an accumulator fragment.
template <class Layout_>
CUTE_HOST_DEVICE constexpr auto acc_rowcol(Layout_ const& l) {
  static_assert(decltype(rank(l))::value == 3);
  return make_layout(make_layout(get<0, 1>(l), get<1>(l)), make_layout(get<0, 0>(l), get<2>(l)));
}

// ((2,2), M, N) -> (((2,2),2), M, N/2): an accumulator fragment reused as the A operand of m16n8k16.
template <class Layout_>
CUTE_HOST_DEVICE constexpr auto acc_as_a_operand(Layout_ const& l) {
  auto d = logical_divide(l, Shape<Underscore, Underscore, _2>{});
  return make_layout(make_layout(get<0>(d), get<2, 0>(d)), get<1>(d), get<2, 1>(d));
}

template <class Tensor_>
CUTE_HOST_DEVICE auto rowcol_view(Tensor_&& t) {
  return make_tensor(t.data(), acc_rowcol(t.layout()));
}

}  // namespace sinkattn::sm80
