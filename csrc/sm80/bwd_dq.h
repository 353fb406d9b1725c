// bwd_dq.h: the sm80 backward's dQ: dQ_i = dS K of each visited M tile, added in fp32 into dq_accum (unscaled: the
// postprocess applies softmax_scale), and the turn a key block waits for when the adds are deterministic.
#pragma once
#include <cstdint>
#include <utility>
#include <cute/tensor.hpp>

#include "common/defs.h"
#include "common/mask.h"
#include "params.h"
#include "sm80/gemm.h"
#include "sm80/layout_utils.h"

namespace sinkattn::sm80 {

using namespace cute;

// dQ accumulation (FlashAttention-2's way): this thread's dq_accum address is computed once per CTA
// (make_dq_accum) and moved kBlockM rows per M tile (next_tile); each element's add goes to a row pointer (one
// per row of the thread's fragment, per M tile) plus a compile-time column offset. The rows and columns come
// from the identity partition (rows x cols view): the thread's part is coords(0, 0) = (r0, c0), the rest is its
// static layout. Every column is added: dq_accum's rows are the compiled head dim long (headdim_rounded ==
// kHeadDim, the launchers check), and columns at and past headdim get the zero-filled K columns' zeros, which
// the postprocess never reads. Full M tiles add every element unpredicated; the tail tile skips the rows past
// the sequence.
template <class Kt, class Coords>
struct DqAccum {
  Coords coords;   // (row, column) of this thread's elements of a kBlockM x kDqCols chunk
  int r0, c0;      // coords(0, 0)
  int row_stride;  // floats from one row of dq_accum to the next
  float* thr;      // at (the current M tile's row r0, column c0)

  // dQ_i = dS K of the M tile whose row 0 is query i0, in column chunks of kDqCols (the fp32 tile stays small
  // beside dK and dV), each added to dq_accum. tdQrdS, tdQsdS: dS as the A operand (registers, shared memory
  // partition of copy_a); sKt: K transposed in shared memory, read through copy_bt.
  template <class TiledMma, class RdS, class SdS, class SKt, class CopyA, class CopyBt>
  SA_DEVICE void add_tile(TiledMma const& mma, RdS& tdQrdS, SdS const& tdQsdS, SKt const& sKt, CopyA const& copy_a,
                          CopyBt const& copy_bt, int tid, int i0, int seqlen_q) const {
    using Prims = typename Kt::Prims;
    constexpr int kRows = decltype(size<0>(std::declval<Coords const&>()))::value;
    constexpr int kColsPerThr = decltype(size<1>(std::declval<Coords const&>()))::value;
    auto thr_mma = mma.get_thread_slice(tid);
    auto thr_bt = copy_bt.get_thread_slice(tid);
    bool const full = i0 + Kt::kBlockM <= seqlen_q;
    CUTE_UNROLL
    for (int ch = 0; ch < Kt::kHeadDim / Kt::kDqCols; ++ch) {
      Tensor sKt_ch = local_tile(sKt, Shape<Int<Kt::kDqCols>, Int<Kt::kBlockN>>{}, make_coord(ch, 0));
      Tensor tdQrKt = thr_mma.partition_fragment_B(sKt_ch);
      Tensor tdQsKt = thr_bt.partition_S(sKt_ch);
      Tensor acc_dq = partition_fragment_C(mma, Shape<Int<Kt::kBlockM>, Int<Kt::kDqCols>>{});
      clear(acc_dq);
      gemm_smem_smem(mma, acc_dq, tdQrdS, tdQrKt, tdQsdS, tdQsKt, copy_a, copy_bt, tid);
      Tensor dq = rowcol_view(acc_dq);
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        if (!full && i0 + get<0>(coords(r, 0)) >= seqlen_q) continue;  // the tail tile's rows past the sequence
        float* row = thr + (get<0>(coords(r, 0)) - r0) * row_stride + ch * Kt::kDqCols;
        CUTE_UNROLL
        for (int c = 0; c < kColsPerThr; ++c) Prims::atomic_add(row + (get<1>(coords(r, c)) - c0), dq(r, c));
      }
    }
  }

  SA_DEVICE void next_tile() { thr += int64_t(Kt::kBlockM) * row_stride; }
};

// This thread's DqAccum for query head bidh, at row first_row of dq_accum (the first visited M tile's row 0).
template <class Kt, class ThrMma>
SA_DEVICE auto make_dq_accum(BwdParams const& p, ThrMma const& thr_mma, int64_t first_row, int bidh) {
  auto coords = rowcol_view(thr_mma.partition_C(make_identity_tensor(Shape<Int<Kt::kBlockM>, Int<Kt::kDqCols>>{})));
  int const r0 = get<0>(coords(0, 0)), c0 = get<1>(coords(0, 0));
  int const row_stride = p.nheads * p.headdim_rounded;
  float* thr = p.dq_accum + (first_row + r0) * row_stride + int64_t(bidh) * p.headdim_rounded + c0;
  return DqAccum<Kt, decltype(coords)>{coords, r0, c0, row_stride, thr};
}

// Deterministic dQ (p.dq_semaphore set): the key blocks visiting M tile m_block add in increasing order, one
// semaphore per (sequence, head, M tile) counting the blocks done; n_block's turn is its rank among them
// (BlockRange::rank). sem is null when the adds are not ordered.
struct DqTurn {
  int* sem;
  int turn;
};

// n_block's turn on M tile m_block, in deterministic mode (p.dq_semaphore set; the caller tests it): worked out
// apart from the wait, so that the kernel can do it while the tensor pipe is busy.
SA_DEVICE DqTurn dq_turn(BwdParams const& p, TileMask const& tile_mask, int m_block, int n_block, int bidb,
                         int bidh) {
  return DqTurn{p.dq_semaphore + (int64_t(bidb) * p.nheads + bidh) * p.dq_m_blocks + m_block,
                tile_mask.range(m_block).rank(n_block)};
}

// Waits (thread 0, then the whole CTA) until it is the turn.
template <class Prims>
SA_DEVICE void dq_wait_turn(DqTurn const& t, int tid) {
  if (t.sem) {
    if (tid == 0) Prims::wait_until_equal(t.sem, t.turn);
    Prims::sync_threads();
  }
}

}  // namespace sinkattn::sm80
