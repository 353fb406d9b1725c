// bwd_kernel.h: the body of the sm80 backward kernel (FlashAttention-2 structure) for one (N tile, head,
// sequence). Same code on the GPU (bwd_launch.cuh, GpuPrims) and under host emulation (emu/bwd_sm80_emu.h).
//
// Per CTA: K_j and V_j (kBlockN x d) once; the M tiles the mask policy gives (TileMask::m_range, the
// transposed range) one after another: Q_i and dO_i into shared memory, S = Q K^T and dP = dO V^T recomputed,
// P = exp(S - lse) (lse includes the sink, so P is the forward's probabilities), dS = P * (dP - delta)
// (delta = rowsum(dO * O) - dlse from the preprocess; with softcap times 1 - tanh^2), P and dS staged in
// shared memory; dV += P^T dO and dK += dS^T Q in registers; dQ_i = dS K added in fp32 into dq_accum
// (Prims::atomic_add, unscaled: the postprocess applies softmax_scale; in increasing key-block order per M tile
// when deterministic). dK and dV go out in fp32 per query head; the postprocess sums the GQA group and converts.
//
// The pieces, as the forward's: the P/dS pass and P, dS staged (bwd_p_ds.h), the dQ adds and the deterministic
// turn (bwd_dq.h), the dK/dV store (bwd_epilogue.h). The body keeps the loads, the barriers and the products.
#pragma once
#include <cute/tensor.hpp>

#include "common/bwd_prepost.h"
#include "common/defs.h"
#include "common/mask.h"
#include "common/online_softmax.h"
#include "common/seq_extent.h"
#include "params.h"
#include "sm80/bwd_dq.h"
#include "sm80/bwd_epilogue.h"
#include "sm80/bwd_p_ds.h"
#include "sm80/bwd_traits.h"
#include "sm80/gemm.h"
#include "sm80/layout_utils.h"
#include "sm80/row_loader.h"

namespace sinkattn::sm80 {

using namespace cute;

template <class Kt>
SA_DEVICE void bwd_block(BwdParams const& p, char* smem, int tid, int n_block, int bidb, int bidh) {
  using Element = typename Kt::Element;
  using Prims = typename Kt::Prims;
  constexpr int kBlockM = Kt::kBlockM, kBlockN = Kt::kBlockN, kHeadDim = Kt::kHeadDim;

  SeqExtent const ext = seq_extent(p, bidb);
  int const seqlen_q = ext.seqlen_q, seqlen_k = ext.seqlen_k;
  int const j0 = n_block * kBlockN;
  if (j0 >= seqlen_k) return;  // uniform per CTA: the grid covers the longest sequence
  int const bidh_k = bidh / (p.nheads / p.nheads_k);

  TileMask const tile_mask{mask_policy(p, ext), kBlockM, kBlockN, 1};
  int m_begin, m_end;
  tile_mask.m_range(n_block, m_begin, m_end);

  // ---- global rows ------------------------------------------------------------------------------------------
  Element const* q_seq =
      static_cast<Element const*>(p.q) + ext.q_row(bidb, p.q_batch_stride, p.q_row_stride, p.q_head_stride, bidh);
  Element const* do_seq =
      static_cast<Element const*>(p.dout) + ext.q_row(bidb, p.o_batch_stride, p.o_row_stride, p.o_head_stride, bidh);
  Element const* k_seq =
      static_cast<Element const*>(p.k) + ext.k_row(bidb, p.k_batch_stride, p.k_row_stride, p.k_head_stride, bidh_k);
  Element const* v_seq =
      static_cast<Element const*>(p.v) + ext.k_row(bidb, p.v_batch_stride, p.v_row_stride, p.v_head_stride, bidh_k);
  int64_t const lse_seq = bwd_lse_index(p, bidb, bidh, 0);
  int64_t const q_row0 = ext.q_rows_before(bidb, p.seqlen_q);  // rows of the fp32 accumulators
  int64_t const k_row0 = ext.k_rows_before(bidb, p.seqlen_k);

  // ---- shared memory: Q, dO, K, V, P, dS, then Q and dO of the second stage ----------------------------------
  Element* smem_q = reinterpret_cast<Element*>(smem);
  Element* smem_do = smem_q + cosize_v<typename Kt::SmemLayoutQ>;
  Element* smem_k = smem_do + cosize_v<typename Kt::SmemLayoutQ>;
  Element* smem_v = smem_k + cosize_v<typename Kt::SmemLayoutKV>;
  Element* smem_p = smem_v + cosize_v<typename Kt::SmemLayoutKV>;
  Element* smem_ds = smem_p + cosize_v<typename Kt::SmemLayoutP>;
  Element* smem_q1 = smem_ds + cosize_v<typename Kt::SmemLayoutP>;  // used when kStages == 2
  Element* smem_do1 = smem_q1 + cosize_v<typename Kt::SmemLayoutQ>;
  auto q_stage = [&](int s) { return s == 0 ? smem_q : smem_q1; };
  auto do_stage = [&](int s) { return s == 0 ? smem_do : smem_do1; };
  Tensor sQ = make_tensor(make_smem_ptr(smem_q), typename Kt::SmemLayoutQ{});  // stage 0: fragment shapes
  Tensor sdO = make_tensor(make_smem_ptr(smem_do), typename Kt::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(smem_k), typename Kt::SmemLayoutKV{});
  Tensor sV = make_tensor(make_smem_ptr(smem_v), typename Kt::SmemLayoutKV{});
  Tensor sP = make_tensor(make_smem_ptr(smem_p), typename Kt::SmemLayoutP{});
  Tensor sdS = make_tensor(make_smem_ptr(smem_ds), typename Kt::SmemLayoutP{});
  Tensor sQt = make_tensor(make_smem_ptr(smem_q), typename Kt::SmemLayoutQt{});
  Tensor sdOt = make_tensor(make_smem_ptr(smem_do), typename Kt::SmemLayoutQt{});
  Tensor sKt = make_tensor(make_smem_ptr(smem_k), typename Kt::SmemLayoutKt{});
  Tensor sPt = make_tensor(make_smem_ptr(smem_p), typename Kt::SmemLayoutPt{});
  Tensor sdSt = make_tensor(make_smem_ptr(smem_ds), typename Kt::SmemLayoutPt{});

  // ---- global -> shared copies -----------------------------------------------------------------------------
  typename Kt::GmemTiledCopyLoad gmem_copy;
  auto gmem_thr = gmem_copy.get_thread_slice(tid);
  Tensor cQ = make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{});
  Tensor cKV = make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{});
  Tensor tQcQ = gmem_thr.partition_S(cQ);
  Tensor tKVcKV = gmem_thr.partition_S(cKV);
  auto const vec = gmem_vector<Element, kBlockN, kHeadDim>(gmem_thr);
  load_rows<Kt>(gmem_thr.partition_D(sK), tKVcKV, vec, seqlen_k - j0, p.headdim,
                [&](int r) { return k_seq + int64_t(j0 + r) * p.k_row_stride; });
  load_rows<Kt>(gmem_thr.partition_D(sV), tKVcKV, vec, seqlen_k - j0, p.headdim,
                [&](int r) { return v_seq + int64_t(j0 + r) * p.v_row_stride; });
  // Q and dO of an M tile: whole tiles (every row < seqlen_q, the kernel's whole head dim) through load_tile, as
  // the forward's interior key blocks; the tail tile and padded head dims through load_rows.
  auto load_qdo = [&](int m_block, int s) {
    int const i0 = m_block * kBlockM;
    auto tQsQ = gmem_thr.partition_D(make_tensor(make_smem_ptr(q_stage(s)), typename Kt::SmemLayoutQ{}));
    auto tdOsdO = gmem_thr.partition_D(make_tensor(make_smem_ptr(do_stage(s)), typename Kt::SmemLayoutQ{}));
    if (i0 + kBlockM <= seqlen_q && p.headdim == kHeadDim) {
      load_tile<Kt>(tQsQ, tQcQ, vec, q_seq + int64_t(i0) * p.q_row_stride, p.q_row_stride);
      load_tile<Kt>(tdOsdO, tQcQ, vec, do_seq + int64_t(i0) * p.o_row_stride, p.o_row_stride);
      return;
    }
    load_rows<Kt>(tQsQ, tQcQ, vec, seqlen_q - i0, p.headdim, [&](int r) { return q_seq + int64_t(i0 + r) * p.q_row_stride; });
    load_rows<Kt>(tdOsdO, tQcQ, vec, seqlen_q - i0, p.headdim,
                  [&](int r) { return do_seq + int64_t(i0 + r) * p.o_row_stride; });
  };
  if (m_end > m_begin) load_qdo(m_begin, 0);
  Prims::cp_async_fence();

  // ---- MMA partitions and shared -> register copies ---------------------------------------------------------
  typename Kt::TiledMma tiled_mma;
  auto thr_mma = tiled_mma.get_thread_slice(tid);
  auto copy_a = make_tiled_copy_A(typename Kt::SmemCopyAtom{}, tiled_mma);
  auto copy_b = make_tiled_copy_B(typename Kt::SmemCopyAtom{}, tiled_mma);
  auto copy_at = make_tiled_copy_A(typename Kt::SmemCopyAtomT{}, tiled_mma);
  auto copy_bt = make_tiled_copy_B(typename Kt::SmemCopyAtomT{}, tiled_mma);
  auto thr_a = copy_a.get_thread_slice(tid);
  auto thr_b = copy_b.get_thread_slice(tid);
  auto thr_at = copy_at.get_thread_slice(tid);
  auto thr_bt = copy_bt.get_thread_slice(tid);

  Tensor tSrQ = thr_mma.partition_fragment_A(sQ);
  Tensor tSrK = thr_mma.partition_fragment_B(sK);
  Tensor tdPrdO = thr_mma.partition_fragment_A(sdO);
  Tensor tdPrV = thr_mma.partition_fragment_B(sV);
  Tensor tdVrPt = thr_mma.partition_fragment_A(sPt);
  Tensor tdVrdOt = thr_mma.partition_fragment_B(sdOt);
  Tensor tdKrdSt = thr_mma.partition_fragment_A(sdSt);
  Tensor tdKrQt = thr_mma.partition_fragment_B(sQt);
  Tensor tdQrdS = thr_mma.partition_fragment_A(sdS);
  Tensor tSsK = thr_b.partition_S(sK);
  Tensor tdPsV = thr_b.partition_S(sV);
  Tensor tdVsPt = thr_at.partition_S(sPt);
  Tensor tdKsdSt = thr_at.partition_S(sdSt);
  Tensor tdQsdS = thr_a.partition_S(sdS);

  auto smem_copy_c = make_tiled_copy_C(typename Kt::SmemCopyAtomO{}, tiled_mma);
  auto smem_thr_c = smem_copy_c.get_thread_slice(tid);
  Tensor tPsP = smem_thr_c.partition_D(sP);
  Tensor tPsdS = smem_thr_c.partition_D(sdS);

  Tensor acc_dk = partition_fragment_C(tiled_mma, Shape<Int<kBlockN>, Int<kHeadDim>>{});
  Tensor acc_dv = partition_fragment_C(tiled_mma, Shape<Int<kBlockN>, Int<kHeadDim>>{});
  clear(acc_dk);
  clear(acc_dv);

  Tensor tScS = rowcol_view(thr_mma.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{})));
  auto dq = make_dq_accum<Kt>(p, thr_mma, q_row0 + int64_t(m_begin) * kBlockM, bidh);
  ScoreScale<Kt::kCap> const score{p.softmax_scale, p.softcap};

  for (int m_block = m_begin; m_block < m_end; ++m_block) {
    int const i0 = m_block * kBlockM;
    int const s = Kt::kStages == 2 ? (m_block - m_begin) % 2 : 0;
    // The rows' lse and delta, loaded now so that their latency passes behind the wait and the S and dP products
    // (bwd_p_ds.h load_row_stats). Not at hd256: its 255-register tile, holding them across the products, spilled
    // 4 bytes more on sm_90 (8 more with softcap); it loads them after the products, as all tiles did before.
    constexpr bool kStatsAhead = kHeadDim <= 128;
    RowStats<decltype(size<0>(tScS))::value> row_stats;
    if constexpr (kStatsAhead) row_stats = load_row_stats<decltype(size<0>(tScS))::value>(p, tScS, i0, seqlen_q, lse_seq);
    if (m_block > m_begin && Kt::kStages == 1) {
      load_qdo(m_block, 0);  // the buffer was freed by the barrier that ended the previous M tile
      Prims::cp_async_fence();
    }
    if (Kt::kStages == 2 && m_block + 1 < m_end) {
      load_qdo(m_block + 1, s ^ 1);  // into the other stage, freed by the barrier that ended the previous M tile
      Prims::cp_async_fence();
      Prims::template cp_async_wait<1>();
    } else {
      Prims::template cp_async_wait<0>();
    }
    Prims::sync_threads();  // this stage's Q, dO (and K, V on the first visit) written by every thread's copies

    Tensor sQs = make_tensor(make_smem_ptr(q_stage(s)), typename Kt::SmemLayoutQ{});
    Tensor sdOs = make_tensor(make_smem_ptr(do_stage(s)), typename Kt::SmemLayoutQ{});
    Tensor tSsQ = thr_a.partition_S(sQs);
    Tensor tdPsdO = thr_a.partition_S(sdOs);
    Tensor tdVsdOt = thr_bt.partition_S(make_tensor(make_smem_ptr(do_stage(s)), typename Kt::SmemLayoutQt{}));
    Tensor tdKsQt = thr_bt.partition_S(make_tensor(make_smem_ptr(q_stage(s)), typename Kt::SmemLayoutQt{}));

    // S = Q K^T and dP = dO V^T recomputed.
    Tensor acc_s = partition_fragment_C(tiled_mma, Shape<Int<kBlockM>, Int<kBlockN>>{});
    Tensor acc_dp = partition_fragment_C(tiled_mma, Shape<Int<kBlockM>, Int<kBlockN>>{});
    clear(acc_s);
    clear(acc_dp);
    bool const masked = tile_mask.needs_mask(m_block, n_block);  // before the product: its MMAs hide the test
    gemm_smem_smem(tiled_mma, acc_s, tSrQ, tSrK, tSsQ, tSsK, copy_a, copy_b, tid);
    // Between the two products, so that no branch separates dP's MMAs from the pass (ptxas can then overlap P's
    // exponentials with them). Here, not inside the pass, and the call on a line of its own: the model's branch
    // weights (tools/perf_counts.py) read this body's line counts.
    if (!kTestEach<Kt> && masked) {
      mask_raw_scores(tile_mask, tScS, i0, j0, acc_s);
    }
    gemm_smem_smem(tiled_mma, acc_dp, tdPrdO, tdPrV, tdPsdO, tdPsV, copy_a, copy_b, tid);

    // P and dS from S and dP (in place), staged in shared memory for the three products below.
    if constexpr (!kStatsAhead) row_stats = load_row_stats<decltype(size<0>(tScS))::value>(p, tScS, i0, seqlen_q, lse_seq);
    p_ds_pass<Kt>(p, tile_mask, score, tScS, masked, i0, j0, row_stats, acc_s, acc_dp);
    stage_p_ds<Element>(smem_copy_c, smem_thr_c, acc_s, acc_dp, tPsP, tPsdS);
    Prims::sync_threads();  // P and dS complete

    // dV += P^T dO and dK += dS^T Q in registers; dQ_i = dS K added to dq_accum, in n_block's turn when
    // deterministic. The turn is worked out before the products, under their MMAs; its test stands here, in the
    // body, for the same reason as the mask's.
    DqTurn turn{nullptr, 0};
    if (p.dq_semaphore) {
      turn = dq_turn(p, tile_mask, m_block, n_block, bidb, bidh);
    }
    gemm_smem_smem(tiled_mma, acc_dv, tdVrPt, tdVrdOt, tdVsPt, tdVsdOt, copy_at, copy_bt, tid);
    gemm_smem_smem(tiled_mma, acc_dk, tdKrdSt, tdKrQt, tdKsdSt, tdKsQt, copy_at, copy_bt, tid);
    dq_wait_turn<Prims>(turn, tid);
    dq.add_tile(tiled_mma, tdQrdS, tdQsdS, sKt, copy_a, copy_bt, tid, i0, seqlen_q);
    dq.next_tile();
    if (turn.sem) Prims::thread_fence();  // this thread's adds visible before the next key block's turn
    Prims::sync_threads();  // every read of this stage's Q, dO and of P, dS done before they are overwritten
    if (turn.sem && tid == 0) Prims::signal(turn.sem, turn.turn + 1);
  }
  if (m_end == m_begin) Prims::template cp_async_wait<0>();  // the K/V copy, when no M tile was visited

  store_dk_dv<Kt>(p, thr_mma, acc_dk, acc_dv, j0, seqlen_k, k_row0, bidh);
}

}  // namespace sinkattn::sm80
