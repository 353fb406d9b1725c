// bwd_kernel.cuh: the sm90 backward kernel (warp-specialized TMA + wgmma), one CTA per (key block, query head,
// sequence), the main step of the three in params.h (the pre- and postprocess are common/bwd_prepost_launch.cuh's:
// delta and the sink gradient's rows before, dq / dk / dv conversion, the GQA sum and dsinks after; the sink never
// enters this loop).
//
// Warpgroup 0 produces: its thread 0 loads K and V of the block once, then for each M tile of the mask policy's
// range (TileMask::m_range) Q and dO (TMA), and its warp 1 writes the tile's LSE / delta rows (plain loads), into a
// kStages-deep pipeline. Warpgroups 1 and 2 consume, 64 keys each (bwd_traits.h has the products):
//   S^T, dP^T on wgmma -> P^T = exp2(S^T scale log2e - lse log2e) and dS^T = P^T (dP^T - delta) in registers
//   (the element mask from TileMask::key_rows: a thread holds two keys, so two bounds per step) -> dS^T into
//   shared memory -> dV += P^T dO, dK += dS^T Q on wgmma from registers -> both warpgroups' dS^T in (a named
//   barrier) -> dQ = dS K on wgmma -> added in fp32 into dq_accum (float2 atomics; in increasing key-block order
//   per M tile when deterministic, as the sm80 backward).
// dK (times softmax_scale) and dV go out in fp32 per query head, as the sm80 kernel's: the postprocess sums the
// GQA group. Varlen: the consumers zero the rows of a sequence's last key block and last M tile that lie past its
// end (the next sequence's, which TMA loads with them), as the sm80 backward's zero-filled loads (zero_tail).
// Every hardware primitive goes through Prims (sm90/prims_gpu.cuh GpuPrims on the GPU), the ring positions, barrier ids
// and warp roles are sm90/pipeline.cuh's.
#pragma once
#include <cmath>
#include <cuda_runtime.h>

#include <cute/tensor.hpp>

#include "common/bwd_prepost.h"
#include "common/defs.h"
#include "common/mask.h"
#include "common/online_softmax.h"
#include "common/seq_extent.h"
#include "common/tile_order.h"
#include "params.h"
#include "sm90/bwd_traits.h"
#include "sm90/pipeline.cuh"
#include "sm90/prims_gpu.cuh"
#include "sm90/smem_utils.cuh"
#include "sm90/wgmma_utils.cuh"

namespace sinkattn::sm90 {

using namespace cute;

namespace bwd {

// The consumer thread index (0-255), read from %tid.x each time (Prims::thread_index_reread): a value the compiler
// cannot keep live across a loop, so what is derived from it is recomputed where used instead of held in a register
// (or spilled).
template <class Prims>
SA_DEVICE int consumer_tid() {
  return WarpRoles::consumer_thread(Prims::thread_index_reread());
}

// Varlen only: rows [valid, rows) of two tiles TMA has just filled (the block's K and V, or a stage's Q and dO) are
// the next sequence's, so the 256 consumers zero them (sm90/smem_utils.cuh says why), make the stores visible to
// wgmma and sync before either warpgroup's product reads them. Called where a tile runs past its sequence's end:
// a sequence's last key block (once per CTA) and its last M tile, never on the common path. (Padded batches need
// none: each sequence has its own rows in the descriptor, and TMA zero-fills past them.)
template <class Prims, class TileA, class TileB>
SA_DEVICE void zero_tail(TileA const& a, TileB const& b, int valid) {
  zero_tail_rows<Prims, 256>(a, b, valid, consumer_tid<Prims>());
  Prims::fence_async_shared();
  Prims::named_sync(256, id_of(NamedBarrier::kBwdTail));
}

// The producer: one thread (warp 0, lane 0) issues every TMA load; warp 1 writes each step's LSE and delta rows.
// Both walk the same M tiles through the same stages: q_full[s] completes when the TMA bytes have landed and the
// 32 lanes of warp 1 have arrived (each arrival releases that lane's rows). Two warps, not one: at hd64's 24
// producer registers, one warp doing both spilled.
template <class Kt, class Prims>
SA90_DEVICE void produce_tma(BwdParams const& p, BwdTmaParams<Kt> const& tma, typename Kt::SharedStorage& ss,
                             Work const& w) {
  constexpr int kBlockM = Kt::kBlockM, kBlockN = Kt::kBlockN, kHeadDim = Kt::kHeadDim, kStages = Kt::kStages;
  bool const varlen = p.cu_seqlens_q != nullptr;
  int const bdim = varlen ? 1 : p.batch, b = varlen ? 0 : w.batch, hk = w.head / (p.nheads / p.nheads_k);
  int const rows_k = max_i(varlen ? p.total_k : p.seqlen_k, 1);
  {
    Tensor sK = make_tensor(make_smem_ptr(ss.k), typename Kt::SmemLayoutKV{});
    Tensor sV = make_tensor(make_smem_ptr(ss.v), typename Kt::SmemLayoutKV{});
    Tensor mK = tma.k.get_tma_tensor(make_shape(rows_k, p.headdim, p.nheads_k, bdim));
    Tensor mV = tma.v.get_tma_tensor(make_shape(rows_k, p.headdim, p.nheads_k, bdim));
    Tensor gK = local_tile(domain_offset(make_coord(int(w.ext.k_start), _0{}), mK(_, _, hk, b)),
                           Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(w.n_block, _0{}));
    Tensor gV = local_tile(domain_offset(make_coord(int(w.ext.k_start), _0{}), mV(_, _, hk, b)),
                           Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(w.n_block, _0{}));
    auto [tKgK, tKsK] = tma_partition(tma.k, _0{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
    auto [tVgV, tVsV] = tma_partition(tma.v, _0{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gV));
    Prims::arrive_expect_tx(&ss.kv_full, 2 * Kt::kKVBytes);
    Prims::tma_load(tma.k, ss.kv_full, tKgK, tKsK);
    Prims::tma_load(tma.v, ss.kv_full, tVgV, tVsV);
  }
  // Q and dO of each step: the views are rebuilt every step from p (parameter space) and w (shared memory, reread
  // after the previous step's TMA asm, which clobbers memory), so nothing but the loop counters lives across steps
  // (built once before the loop, the TMA coordinates spilled 44 bytes at hd64's 24 producer registers).
  PipelineState<kStages> s;  // the Q / dO stages, one step per M tile
  for (int m = w.m_begin; m < w.m_end; ++m, s.advance()) {
    int const st = s.index();
    wait_empty<Prims>(ss.q_empty, s, BarrierId::kQEmpty);
    bool const varlen_now = p.cu_seqlens_q != nullptr;
    int const bdim_now = varlen_now ? 1 : p.batch, b_now = varlen_now ? 0 : w.batch;
    int const rows_now = max_i(varlen_now ? p.total_q : p.seqlen_q, 1);
    Tensor sQ = make_tensor(make_smem_ptr(ss.q), typename Kt::SmemLayoutQ{});  // (M, d, stage)
    Tensor sdO = make_tensor(make_smem_ptr(ss.dout), typename Kt::SmemLayoutQ{});
    Tensor mQ = tma.q.get_tma_tensor(make_shape(rows_now, p.headdim, p.nheads, bdim_now));
    Tensor mdO = tma.dout.get_tma_tensor(make_shape(rows_now, p.headdim, p.nheads, bdim_now));
    Tensor gQ = local_tile(domain_offset(make_coord(int(w.ext.q_start), _0{}), mQ(_, _, w.head, b_now)),
                           Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(m, _0{}));
    Tensor gdO = local_tile(domain_offset(make_coord(int(w.ext.q_start), _0{}), mdO(_, _, w.head, b_now)),
                            Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(m, _0{}));
    auto [tQgQ, tQsQ] = tma_partition(tma.q, _0{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
    auto [tdOgdO, tdOsdO] = tma_partition(tma.dout, _0{}, Layout<_1>{}, group_modes<0, 2>(sdO), group_modes<0, 2>(gdO));
    Prims::arrive_expect_tx(&ss.q_full[st], 2 * Kt::kQBytes);
    Prims::tma_load(tma.q, ss.q_full[st], tQgQ, tQsQ(_, st));
    Prims::tma_load(tma.dout, ss.q_full[st], tdOgdO, tdOsdO(_, st));
  }
}

template <class Kt, class Prims>
SA90_DEVICE void produce_rows(BwdParams const& p, typename Kt::SharedStorage& ss, Work const& w, int lane) {
  constexpr int kBlockM = Kt::kBlockM, kStages = Kt::kStages;
  float const log2e = float(M_LOG2E);
  PipelineState<kStages> s;  // the same stages as produce_tma's
  for (int m = w.m_begin; m < w.m_end; ++m, s.advance()) {
    int const st = s.index();
    wait_empty<Prims>(ss.q_empty, s, BarrierId::kQEmpty);
    // The rows' offset is recomputed every step from w in shared memory (the fence makes the compiler reread it):
    // held across steps, it and its pointers spilled at hd64's 24 producer registers.
    Prims::compiler_fence();
    int64_t const row0 = bwd_lse_index(p, w.batch, w.head, 0) + int64_t(m) * kBlockM;
    int const rows = w.ext.seqlen_q - m * kBlockM;
#pragma unroll 1
    for (int r = lane; r < kBlockM; r += 32) {
      float lse = INFINITY, delta = 0.f;
      if (r < rows) {
        lse = bwd_lse(p.lse[row0 + r]);  // common/online_softmax.h: a row that saw nothing gets P = 0, never NaN
        delta = p.delta[row0 + r];
      }
      ss.lse_log2[st][r] = lse * log2e;
      ss.delta[st][r] = delta;
    }
    // The stores above must not move past the arrival (it is what releases them to the consumers).
    Prims::compiler_fence();
    Prims::arrive(&ss.q_full[st]);
  }
}

template <class Kt, class Prims, bool kSoftcap>
SA90_DEVICE void consume(BwdParams const& p, typename Kt::SharedStorage& ss, Work const& w_smem, int ctid) {
  // In registers: read from shared memory at each use instead, ptxas spilled 108 bytes here, not 36. (The mask's
  // block sizes are then run-time values; rebuilding it with compile-time ones spilled 56 bytes, not 16: ptxas
  // hoisted more of the mask's work out of the loop.)
  Work const w = w_smem;
  TileMask const& mask = w.mask;
  using Element = typename Kt::Element;
  constexpr int kBlockM = Kt::kBlockM, kBlockN = Kt::kBlockN, kHeadDim = Kt::kHeadDim, kStages = Kt::kStages;

  typename Kt::TiledMmaSdP mma_sdp;
  typename Kt::TiledMmadKV mma_dkv;
  typename Kt::TiledMmadQ mma_dq;
  auto thr_sdp = mma_sdp.get_thread_slice(ctid);
  auto thr_dkv = mma_dkv.get_thread_slice(ctid);
  auto thr_dq = mma_dq.get_thread_slice(ctid);

  Tensor sQ = make_tensor(make_smem_ptr(ss.q), typename Kt::SmemLayoutQ{});
  Tensor sdO = make_tensor(make_smem_ptr(ss.dout), typename Kt::SmemLayoutQ{});
  Tensor sQt = make_tensor(make_smem_ptr(ss.q), typename Kt::SmemLayoutQt{});
  Tensor sdOt = make_tensor(make_smem_ptr(ss.dout), typename Kt::SmemLayoutQt{});
  Tensor sK = make_tensor(make_smem_ptr(ss.k), typename Kt::SmemLayoutKV{});
  Tensor sV = make_tensor(make_smem_ptr(ss.v), typename Kt::SmemLayoutKV{});
  Tensor sKt = make_tensor(make_smem_ptr(ss.k), typename Kt::SmemLayoutKt{});
  Tensor sdS = make_tensor(make_smem_ptr(ss.ds), typename Kt::SmemLayoutdS{});
  Tensor sdSt = make_tensor(make_smem_ptr(ss.ds), typename Kt::SmemLayoutdSt{});

  Tensor tSrK = thr_sdp.partition_fragment_A(sK);     // wgmma descriptors (MMA, MMA_M, MMA_K)
  Tensor tSrQ = thr_sdp.partition_fragment_B(sQ);     // (MMA, MMA_N, MMA_K, stage)
  Tensor tdPrV = thr_sdp.partition_fragment_A(sV);
  Tensor tdPrdO = thr_sdp.partition_fragment_B(sdO);
  Tensor tdVrdO = thr_dkv.partition_fragment_B(sdOt);  // (MMA, MMA_N, MMA_K, stage)
  Tensor tdKrQ = thr_dkv.partition_fragment_B(sQt);
  Tensor tdQrdS = thr_dq.partition_fragment_A(sdS);   // (MMA, MMA_M, MMA_K, buffer)
  Tensor tdQrK = thr_dq.partition_fragment_B(sKt);
  Tensor tdSsdS = thr_sdp.partition_C(sdSt);          // this thread's dS^T elements in shared memory (.., buffer)

  Tensor tSrS = partition_fragment_C(mma_sdp, Shape<Int<kBlockN>, Int<kBlockM>>{});
  Tensor tdPrdP = partition_fragment_C(mma_sdp, Shape<Int<kBlockN>, Int<kBlockM>>{});
  Tensor acc_dk = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
  Tensor acc_dv = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
  Tensor acc_dq = partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<kHeadDim>>{});
  // P^T and dS^T in the input precision, read by the dV and dK products as their A operands.
  Tensor rP = make_tensor<Element>(tSrS.layout());
  Tensor rdS = make_tensor<Element>(tdPrdP.layout());
  Tensor tdVrP = make_tensor(rP.data(), acc_as_a_operand(rP.layout()));
  Tensor tdKrdS = make_tensor(rdS.data(), acc_as_a_operand(rdS.layout()));
  clear(acc_dk);
  clear(acc_dv);

  Tensor scores = rowcol_view(tSrS);
  Tensor dps = rowcol_view(tdPrdP);
  Tensor probs_in = rowcol_view(rP);
  Tensor dss_in = rowcol_view(rdS);
  constexpr int kRows = decltype(size<0>(scores))::value, kCols = decltype(size<1>(scores))::value;
  static_assert(kRows == 2);
  int64_t const dq_row_stride = int64_t(p.nheads) * p.headdim_rounded;
  bool const varlen = w.ext.varlen;
  int64_t const q_row0 = w.ext.q_rows_before(w.batch, p.seqlen_q);  // rows of the fp32 accumulators
  int64_t const k_row0 = w.ext.k_rows_before(w.batch, p.seqlen_k);
  float* const dq_head = p.dq_accum + q_row0 * dq_row_stride + int64_t(w.head) * p.headdim_rounded;

  ScoreScale<kSoftcap ? Softcap::kRunTime : Softcap::kOff> const score{p.softmax_scale, p.softcap};
  // scale_log2 is ScoreScale's log2 without softcap, written from the parameter again: read from `score`, the
  // softcap kernel at hd64 spilled one more word (sm_90a: 5 LDL / 5 STL instead of 4 / 4).
  float const log2e = float(M_LOG2E), scale_log2 = p.softmax_scale * log2e;
  int const j0 = w.n_block * kBlockN;

  // kv_full completes once (phase 0): K and V stay for the whole CTA.
  Prims::wait(&ss.kv_full, 0, BarrierId::kKVFull, 0);
  if (varlen && j0 + kBlockN > w.ext.seqlen_k) zero_tail<Prims>(sK, sV, w.ext.seqlen_k - j0);
  PipelineState<kStages> s;  // the Q / dO stages
  for (int m = w.m_begin; m < w.m_end; ++m, s.advance()) {
    PipelineState<2> const ds{s.count};  // the two dS buffers, a ring that steps with the stages'
    int const st = s.index(), buf = ds.index();
    int const i0 = m * kBlockM;
    wait_full<Prims>(ss.q_full, s, BarrierId::kQFull);
    // The stage's LSE / delta rows (plain stores of warp 1, released by its arrivals on q_full) are read below:
    // no load of them may move above the wait.
    Prims::compiler_fence();
    if (varlen && i0 + kBlockM > w.ext.seqlen_q) zero_tail<Prims>(sQ(_, _, st), sdO(_, _, st), w.ext.seqlen_q - i0);
    Prims::template wgmma<true>(mma_sdp, tSrK, tSrQ(_, _, _, st), tSrS);
    Prims::template wgmma<true>(mma_sdp, tdPrV, tdPrdO(_, _, _, st), tdPrdP);
    Prims::template wgmma_wait<1>();  // S^T in; dP^T may still run
    Prims::fence_operand(tSrS);

    // P^T element by element, while the dP^T product runs. Columns are queries: the LSE of column c is the
    // stage's row. Hidden pairs get P = 0 from the key's row bounds; rows past the sequence have lse = +inf.
    // S^T keeps P times d score / d (scale q.k) (the softcap's 1 - tanh^2; P itself without softcap) for dS.
    float const* lse_log2 = ss.lse_log2[st];
    // (key, query) of each S^T element within the block and the M tile, from the thread index read afresh: held
    // through the loop, the thread's offsets were what ptxas spilled (16 bytes), and recomputing them is a few
    // integer instructions per step.
    Tensor tScS = rowcol_view(mma_sdp.get_thread_slice(consumer_tid<Prims>())
                                  .partition_C(make_identity_tensor(Shape<Int<kBlockN>, Int<kBlockM>>{})));
    // Columns outside, the thread's two rows inside: each query's LSE is read once and dies at once (rows outside,
    // ptxas kept every column's LSE live across both rows).
    auto probs = [&]<bool kMasked, bool kCap>() {
      TileMask::KeyRows keys[kRows];
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) keys[r] = kMasked ? mask.key_rows(j0 + get<0>(tScS(r, 0)), i0) : TileMask::KeyRows{0, 0};
      CUTE_UNROLL
      for (int c = 0; c < kCols; ++c) {
        int const i = get<1>(tScS(0, c));
        float const lse = lse_log2[i];
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) {
          float prob, dtanh = 1.f;
          if constexpr (kCap) {
            prob = exp2f(score.score(scores(r, c), dtanh) * log2e - lse);
          } else {
            prob = exp2f(scores(r, c) * scale_log2 - lse);
          }
          if constexpr (kMasked) prob = keys[r].visible(i) ? prob : 0.f;
          probs_in(r, c) = Element(prob);
          scores(r, c) = kCap ? prob * dtanh : prob;
        }
      }
    };
    bool const masked = mask.needs_mask(m, w.n_block);
    if (score.on()) {
      // With softcap (a tanh per element) the pass does not fit beside dP^T's in-flight registers: it waits.
      Prims::template wgmma_wait<0>();
      if (masked) probs.template operator()<true, true>();
      else probs.template operator()<false, true>();
    } else {
      if (masked) probs.template operator()<true, false>();
      else probs.template operator()<false, false>();
    }
    Prims::template wgmma_wait<0>();
    Prims::fence_operand(tdPrdP);
    // dS^T = P^T (dP^T - delta) (times the softcap's derivative, already in S^T).
    float const* delta = ss.delta[st];
    CUTE_UNROLL
    for (int c = 0; c < kCols; ++c) {
      float const dl = delta[get<1>(tScS(0, c))];
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) dss_in(r, c) = Element(scores(r, c) * (dps(r, c) - dl));
    }
    // dS^T into shared memory for dQ, before the register products below are issued (they read rdS). Registers
    // e and e + 1 are adjacent queries of one key, the two halves of one 4-byte word of dS (queries contiguous;
    // tests/layout_facts checks it): one st.shared.b32 per pair through a 32-bit shared address. (Element by
    // element through the tensor, they compiled to generic 2-byte stores with 64-bit addresses.)
    Tensor tdSsdS_b = tdSsdS(_, _, _, buf);
    uint32_t const ds_base = Prims::smem_address(ss.ds);
    CUTE_UNROLL
    for (int e = 0; e < size(rdS); e += 2) {
      uint32_t const offset = uint32_t(&tdSsdS_b(e) - ss.ds);  // elements from dS's start (the swizzle included)
      uint32_t const pair = uint32_t(rdS(e).raw()) | (uint32_t(rdS(e + 1).raw()) << 16);
      Prims::sts32(ds_base + offset * 2, pair);
    }
    Prims::fence_async_shared();  // generic-proxy writes, read by wgmma (the async proxy)

    Prims::fence_operand(rP);
    Prims::fence_operand(rdS);
    Prims::template wgmma<false>(mma_dkv, tdVrP, tdVrdO(_, _, _, st), acc_dv);
    Prims::template wgmma<false>(mma_dkv, tdKrdS, tdKrQ(_, _, _, st), acc_dk);

    Prims::named_sync(256, id_of(NamedBarrier::kBwdDs));  // both warpgroups' dS^T written
    Prims::template wgmma<true>(mma_dq, tdQrdS(_, _, _, buf), tdQrK, acc_dq);
    Prims::template wgmma_wait<1>();  // dV and dK done: Q, dO and the stage's rows are free
    Prims::fence_operand(acc_dv);
    Prims::fence_operand(acc_dk);
    Prims::fence_operand(rP);
    Prims::fence_operand(rdS);
    Prims::arrive(&ss.q_empty[st]);
    Prims::template wgmma_wait<0>();
    Prims::fence_operand(acc_dq);

    // Deterministic: this key block's turn on the M tile (the visitors are the forward's block range of that
    // tile; they add in increasing order, so the rank of n_block among them is its turn).
    int* sem = nullptr;
    int turn = 0;
    if (p.dq_semaphore) {
      turn = mask.range(m).rank(w.n_block);
      sem = p.dq_semaphore + (int64_t(w.batch) * p.nheads + w.head) * p.dq_m_blocks + m;
      if (WarpRoles::first_consumer(ctid)) Prims::wait_until_equal(sem, turn);
      Prims::named_sync(256, id_of(NamedBarrier::kBwdDqTurn));
    }
    // dQ (unscaled) into dq_accum, two adjacent columns per atomic; the tail tile's rows past the sequence are
    // skipped (varlen: they are the next sequence's). Columns past headdim add the zeros of K's zero-filled
    // columns, which the postprocess never reads.
    bool const dq_full = i0 + kBlockM <= w.ext.seqlen_q;
    // (query, column) of each dQ element: this thread's first, the rest a compile-time offset from it.
    Tensor tdQcdQ = mma_dq.get_thread_slice(consumer_tid<Prims>())
                        .partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
    int const dq_r0 = get<0>(tdQcdQ(0)), dq_c0 = get<1>(tdQcdQ(0));
    float* dq_tile = dq_head + (int64_t(i0) + dq_r0) * dq_row_stride + dq_c0;
    CUTE_UNROLL
    for (int e = 0; e < size(acc_dq); e += 2) {
      int const r = get<0>(tdQcdQ(e)) - dq_r0, c = get<1>(tdQcdQ(e)) - dq_c0;
      if (dq_full || i0 + dq_r0 + r < w.ext.seqlen_q) {
        Prims::atomic_add(reinterpret_cast<float2*>(dq_tile + r * dq_row_stride + c),
                          make_float2(acc_dq(e), acc_dq(e + 1)));
      }
    }
    if (sem) {
      Prims::thread_fence();  // this thread's adds visible before the next key block's turn
      Prims::named_sync(256, id_of(NamedBarrier::kBwdDqTurn));
      if (WarpRoles::first_consumer(ctid)) Prims::signal(sem, turn + 1);
    }
  }

  // dK (times softmax_scale) and dV of this query head, fp32, two adjacent columns per store.
  Tensor tdKcdK = thr_dkv.partition_C(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  CUTE_UNROLL
  for (int e = 0; e < size(acc_dk); e += 2) {
    int const j = j0 + get<0>(tdKcdK(e)), c = get<1>(tdKcdK(e));
    if (j < w.ext.seqlen_k && c < p.headdim) {
      int64_t const a = ((k_row0 + j) * p.nheads + w.head) * p.headdim_rounded + c;
      *reinterpret_cast<float2*>(p.dk_accum + a) = make_float2(acc_dk(e) * p.softmax_scale, acc_dk(e + 1) * p.softmax_scale);
      *reinterpret_cast<float2*>(p.dv_accum + a) = make_float2(acc_dv(e), acc_dv(e + 1));
    }
  }
}

}  // namespace bwd

// One CTA of the backward, on whatever implements the primitives (Prims).
template <class Kt, class Prims, bool kSoftcap>
SA_DEVICE void bwd_cta(BwdParams const& p, BwdTmaParams<Kt> const& tma, BwdTileOrder const& grid, char* smem) {
  auto& ss = *reinterpret_cast<typename Kt::SharedStorage*>(smem);
  unsigned const tid = Prims::thread_index();
  if (WarpRoles::initializer(tid)) {
    ss.work = bwd::Work::make<Kt>(p, grid, Prims::block_index());
    Prims::barrier_init(&ss.kv_full, 1);
    CUTE_UNROLL
    for (int s = 0; s < Kt::kStages; ++s) {
      Prims::barrier_init(&ss.q_full[s], 1 + 32);  // the TMA thread and warp 1's lanes
      Prims::barrier_init(&ss.q_empty[s], 128 * Kt::kConsumerWarpgroups);
    }
    Prims::prefetch_tma(tma.q);
    Prims::prefetch_tma(tma.dout);
    Prims::prefetch_tma(tma.k);
    Prims::prefetch_tma(tma.v);
  }
  Prims::fence_barrier_init();
  Prims::sync_threads();
  bwd::Work const& w = ss.work;
  // No M tile sees a key of this block (or the block is past its sequence): dk_accum / dv_accum are zero-filled
  // and nothing is added to dq_accum. Uniform per CTA.
  if (w.m_end <= w.m_begin) return;

  if (WarpRoles::producer(tid)) {
    Prims::template setmaxnreg_dec<Kt::kProducerRegs>();
    if (WarpRoles::tma_thread(tid)) bwd::produce_tma<Kt, Prims>(p, tma, ss, w);
    else if (WarpRoles::rows_warp(tid)) bwd::produce_rows<Kt, Prims>(p, ss, w, WarpRoles::rows_lane(tid));
  } else {
    Prims::template setmaxnreg_inc<Kt::kConsumerRegs>();
    bwd::consume<Kt, Prims, kSoftcap>(p, ss, w, WarpRoles::consumer_thread(tid));
  }
}

// kSoftcap: softcap compiled in (the launcher picks this kernel when softcap > 0); a tanh per element takes
// registers the plain kernel's passes then do not have to share.
#if defined(__CUDACC__)  // the GPU's kernel; the host emulation runs bwd_cta<Kt, EmuPrims, ...>
template <class Kt, bool kSoftcap>
__global__ void __launch_bounds__(Kt::kNThreads, 1)
    bwd_kernel(__grid_constant__ const BwdParams p, __grid_constant__ const BwdTmaParams<Kt> tma, BwdTileOrder const grid) {
  extern __shared__ __align__(1024) char smem[];
  bwd_cta<Kt, GpuPrims, kSoftcap>(p, tma, grid, smem);
}
#endif

}  // namespace sinkattn::sm90
