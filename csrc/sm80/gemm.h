// gemm.h: the two GEMM shapes of the sm80 kernels on mma.sync, with the shared -> register copies (ldmatrix)
// issued one K slice ahead of the MMAs that consume them.
#pragma once
#include <cute/tensor.hpp>
#include "common/defs.h"

namespace sinkattn::sm80 {

using namespace cute;

// acc += A * B over the K mode, A and B both staged from shared memory.
template <class TiledMma, class Acc, class RA, class RB, class SA, class SB, class CopyA, class CopyB>
SA_DEVICE void gemm_smem_smem(TiledMma const& mma, Acc& acc, RA& rA, RB& rB, SA const& sA, SB const& sB,
                              CopyA const& copy_a, CopyB const& copy_b, int tid) {
  auto thr_a = copy_a.get_thread_slice(tid);
  auto thr_b = copy_b.get_thread_slice(tid);
  auto rA_view = thr_a.retile_D(rA);
  auto rB_view = thr_b.retile_D(rB);
  copy(copy_a, sA(_, _, 0), rA_view(_, _, 0));
  copy(copy_b, sB(_, _, 0), rB_view(_, _, 0));
  CUTE_UNROLL
  for (int k = 0; k < size<2>(rA); ++k) {
    if (k + 1 < size<2>(rA)) {
      copy(copy_a, sA(_, _, k + 1), rA_view(_, _, k + 1));
      copy(copy_b, sB(_, _, k + 1), rB_view(_, _, k + 1));
    }
    gemm(mma, rA(_, _, k), rB(_, _, k), acc);
  }
}

// acc += A * B with A already in registers (P) and B staged from shared memory.
template <class TiledMma, class Acc, class RA, class RB, class SB, class CopyB>
SA_DEVICE void gemm_reg_smem(TiledMma const& mma, Acc& acc, RA const& rA, RB& rB, SB const& sB, CopyB const& copy_b, int tid) {
  auto thr_b = copy_b.get_thread_slice(tid);
  auto rB_view = thr_b.retile_D(rB);
  copy(copy_b, sB(_, _, 0), rB_view(_, _, 0));
  CUTE_UNROLL
  for (int k = 0; k < size<2>(rA); ++k) {
    if (k + 1 < size<2>(rA)) copy(copy_b, sB(_, _, k + 1), rB_view(_, _, k + 1));
    gemm(mma, rA(_, _, k), rB(_, _, k), acc);
  }
}

// A register tensor of Element holding acc converted (P, dS, O on their way to an MMA or to memory).
template <class Element, class Acc>
SA_DEVICE auto convert(Acc const& acc) {
  Tensor r = make_tensor<Element>(acc.layout());
  CUTE_UNROLL
  for (int i = 0; i < size(acc); ++i) r(i) = Element(acc(i));
  return r;
}

}  // namespace sinkattn::sm80
