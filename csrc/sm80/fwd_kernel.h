// fwd_kernel.h: the body of the sm80 forward kernel (FlashAttention-2 structure) for one (M tile, batch, head).
//
// The same code runs on the GPU (called from the __global__ in fwd_launch.cuh with GpuPrims) and on the CPU
// under host emulation (emu/fwd_sm80_emu.h with EmuPrims): everything arch-facing goes through Kt::Prims.
//
// Per CTA: Q tile (kBlockM x d) once; K/V blocks chosen by the mask policy (window blocks from the last down,
// then sink-token blocks), double-buffered through shared memory with cp.async; S = Q K^T and O += P V on
// mma.sync m16n8k16 with fp32 accumulation; online softmax in exp2 units; the learnable sink joins once per
// row in the finalize; O goes out through shared memory in 16-byte stores; the LSE per row.
#pragma once
#include <cmath>
#include <cute/tensor.hpp>

#include "common/defs.h"
#include "common/mask.h"
#include "common/softmax.h"
#include "params.h"
#include "sm80/fwd_traits.h"
#include "sm80/layout_utils.h"

#if defined(__CUDACC__)
#define SA_DEVICE __device__ __forceinline__
#else
#define SA_DEVICE inline
#endif

namespace sinkattn::sm80 {

using namespace cute;

// Copies a (rows x d) tile global -> shared with the tiled cp.async copy. Vectors outside the valid rows or
// beyond the real head dim are zero-filled in shared memory: K/V tails then give finite scores (masked later)
// and zero contributions, whatever lies past the end of the tensors.
template <class Kt, class TG, class TS, class TC>
SA_DEVICE void load_tile(TG const& tXgX, TS&& tXsX, TC const& tXcX, int valid_rows, int headdim) {
  typename Kt::GmemTiledCopyLoad tiled_copy;
  CUTE_UNROLL
  for (int m = 0; m < size<1>(tXsX); ++m) {
    CUTE_UNROLL
    for (int k = 0; k < size<2>(tXsX); ++k) {
      if (get<0>(tXcX(0, m, k)) < valid_rows && get<1>(tXcX(0, m, k)) < headdim) {
        copy(tiled_copy, tXgX(_, m, k), tXsX(_, m, k));
      } else {
        Kt::Prims::zero_fill(tXsX(_, m, k));
      }
    }
  }
}

// acc += A * B over the K mode, A and B both staged from shared memory one K slice ahead of the MMA.
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

// Sum or max over the 4 lanes of a quad, which hold the columns of the same accumulator rows (m16n8 C layout:
// lane / 4 picks the row, lane % 4 the column pair).
template <class Prims>
SA_DEVICE float quad_max(float x) {
  x = fmaxf(x, Prims::shfl_xor(x, 1));
  return fmaxf(x, Prims::shfl_xor(x, 2));
}
template <class Prims>
SA_DEVICE float quad_sum(float x) {
  x += Prims::shfl_xor(x, 1);
  return x + Prims::shfl_xor(x, 2);
}

template <class Kt>
SA_DEVICE void fwd_block(FwdParams const& p, char* smem, int tid, int m_block, int bidb, int bidh) {
  using Element = typename Kt::Element;
  using Prims = typename Kt::Prims;
  constexpr int kBlockM = Kt::kBlockM, kBlockN = Kt::kBlockN, kHeadDim = Kt::kHeadDim;

  // ---- this sequence's extent (varlen: packed rows from cu_seqlens) --------------------------------------
  bool const varlen = p.cu_seqlens_q != nullptr;
  int64_t const q_start = varlen ? p.cu_seqlens_q[bidb] : 0;
  int64_t const k_start = varlen ? p.cu_seqlens_k[bidb] : 0;
  int const seqlen_q = varlen ? int(p.cu_seqlens_q[bidb + 1] - q_start) : p.seqlen_q;
  int const seqlen_k = varlen ? int(p.cu_seqlens_k[bidb + 1] - k_start) : p.seqlen_k;
  if (m_block * kBlockM >= seqlen_q) return;  // uniform per CTA: the grid covers the longest sequence
  int const bidh_k = bidh / (p.nheads / p.nheads_k);

  TileMask const tile_mask{MaskPolicy{seqlen_q, seqlen_k, p.window_left, p.window_right, p.sink_tokens}, kBlockM, kBlockN};
  BlockRange const range = tile_mask.range(m_block);

  // ---- global tensors -------------------------------------------------------------------------------------
  int64_t const q_off = (varlen ? q_start * p.q_row_stride : bidb * p.q_batch_stride) + bidh * p.q_head_stride +
                        int64_t(m_block) * kBlockM * p.q_row_stride;
  int64_t const k_off = (varlen ? k_start * p.k_row_stride : bidb * p.k_batch_stride) + bidh_k * p.k_head_stride;
  int64_t const v_off = (varlen ? k_start * p.v_row_stride : bidb * p.v_batch_stride) + bidh_k * p.v_head_stride;
  int64_t const o_off = (varlen ? q_start * p.o_row_stride : bidb * p.o_batch_stride) + bidh * p.o_head_stride +
                        int64_t(m_block) * kBlockM * p.o_row_stride;
  Tensor gQ = make_tensor(make_gmem_ptr(static_cast<Element const*>(p.q) + q_off),
                          Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_stride(p.q_row_stride, _1{}));
  Tensor gO = make_tensor(make_gmem_ptr(static_cast<Element*>(p.out) + o_off),
                          Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_stride(p.o_row_stride, _1{}));
  Element const* k_base = static_cast<Element const*>(p.k) + k_off;
  Element const* v_base = static_cast<Element const*>(p.v) + v_off;
  auto gK_block = [&](int n) {
    return make_tensor(make_gmem_ptr(k_base + int64_t(n) * kBlockN * p.k_row_stride),
                       Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_stride(p.k_row_stride, _1{}));
  };
  auto gV_block = [&](int n) {
    return make_tensor(make_gmem_ptr(v_base + int64_t(n) * kBlockN * p.v_row_stride),
                       Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_stride(p.v_row_stride, _1{}));
  };

  // ---- shared memory: Q, then K stages, then V stages ---------------------------------------------------
  Element* smem_q = reinterpret_cast<Element*>(smem);
  Element* smem_k = smem_q + cosize_v<typename Kt::SmemLayoutQ>;
  Element* smem_v = smem_k + Kt::kStages * cosize_v<typename Kt::SmemLayoutKV>;
  Tensor sQ = make_tensor(make_smem_ptr(smem_q), typename Kt::SmemLayoutQ{});
  auto sK_stage = [&](int s) {
    return make_tensor(make_smem_ptr(smem_k + s * cosize_v<typename Kt::SmemLayoutKV>), typename Kt::SmemLayoutKV{});
  };
  auto sV_stage = [&](int s) {
    return make_tensor(make_smem_ptr(smem_v + s * cosize_v<typename Kt::SmemLayoutKV>), typename Kt::SmemLayoutKV{});
  };
  auto sVt_stage = [&](int s) {
    return make_tensor(make_smem_ptr(smem_v + s * cosize_v<typename Kt::SmemLayoutKV>), typename Kt::SmemLayoutVt{});
  };

  // ---- global -> shared copies -----------------------------------------------------------------------------
  typename Kt::GmemTiledCopyLoad gmem_copy;
  auto gmem_thr = gmem_copy.get_thread_slice(tid);
  Tensor cQ = make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{});
  Tensor cKV = make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{});
  Tensor tQcQ = gmem_thr.partition_S(cQ);
  Tensor tKVcKV = gmem_thr.partition_S(cKV);
  auto load_kv = [&](int t) {
    int n = range.block(t), s = t % Kt::kStages;
    int rows = seqlen_k - n * kBlockN;
    Tensor tKsK = gmem_thr.partition_D(sK_stage(s));
    Tensor tVsV = gmem_thr.partition_D(sV_stage(s));
    load_tile<Kt>(gmem_thr.partition_S(gK_block(n)), tKsK, tKVcKV, rows, p.headdim);
    load_tile<Kt>(gmem_thr.partition_S(gV_block(n)), tVsV, tKVcKV, rows, p.headdim);
  };

  int const n_visit = range.count();
  {
    Tensor tQsQ = gmem_thr.partition_D(sQ);
    load_tile<Kt>(gmem_thr.partition_S(gQ), tQsQ, tQcQ, seqlen_q - m_block * kBlockM, p.headdim);
  }
  if (n_visit > 0) load_kv(0);
  Prims::cp_async_fence();

  // ---- MMA partitions ----------------------------------------------------------------------------------------
  typename Kt::TiledMma tiled_mma;
  auto thr_mma = tiled_mma.get_thread_slice(tid);
  Tensor tSrQ = thr_mma.partition_fragment_A(sQ);
  Tensor tSrK = thr_mma.partition_fragment_B(sK_stage(0));
  Tensor tOrVt = thr_mma.partition_fragment_B(sVt_stage(0));
  Tensor acc_o = partition_fragment_C(tiled_mma, Shape<Int<kBlockM>, Int<kHeadDim>>{});
  clear(acc_o);

  auto smem_copy_q = make_tiled_copy_A(typename Kt::SmemCopyAtom{}, tiled_mma);
  auto smem_copy_k = make_tiled_copy_B(typename Kt::SmemCopyAtom{}, tiled_mma);
  auto smem_copy_v = make_tiled_copy_B(typename Kt::SmemCopyAtomT{}, tiled_mma);
  Tensor tSsQ = smem_copy_q.get_thread_slice(tid).partition_S(sQ);

  // (row, col) coordinates of this thread's S elements, for the mask and the LSE.
  Tensor tScS = rowcol_view(thr_mma.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{})));
  constexpr int kRows = 2 * kBlockM / (16 * Kt::kNWarps);  // m16n8 tiles: 2 rows per thread per 16-row slice
  float row_max[kRows], row_sum[kRows];
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) { row_max[r] = -INFINITY; row_sum[r] = 0.f; }

  // With softcap the scores are first bounded, s = softcap * tanh(scale * qk / softcap), then used unscaled.
  bool const softcap = p.softcap > 0.f;
  float const scale_nat = softcap ? 1.f : p.softmax_scale;
  float const scale_log2 = scale_nat * float(M_LOG2E);
  float const tanh_in_scale = softcap ? p.softmax_scale / p.softcap : 0.f;
  int const m0 = m_block * kBlockM;

  for (int t = 0; t < n_visit; ++t) {
    int const n = range.block(t), s = t % Kt::kStages;
    if (t + 1 < n_visit) {
      load_kv(t + 1);  // into the other stage, freed by the barrier that ended iteration t - 1
      Prims::cp_async_fence();
      Prims::template cp_async_wait<1>();
    } else {
      Prims::template cp_async_wait<0>();
    }
    Prims::sync_threads();  // stage s (and Q) written by every thread's copies

    Tensor acc_s = partition_fragment_C(tiled_mma, Shape<Int<kBlockM>, Int<kBlockN>>{});
    clear(acc_s);
    Tensor tSsK = smem_copy_k.get_thread_slice(tid).partition_S(sK_stage(s));
    gemm_smem_smem(tiled_mma, acc_s, tSrQ, tSrK, tSsQ, tSsK, smem_copy_q, smem_copy_k, tid);

    Tensor scores = rowcol_view(acc_s);
    static_assert(decltype(size<0>(scores))::value == kRows);
    if (softcap) {
      CUTE_UNROLL
      for (int i = 0; i < size(acc_s); ++i) acc_s(i) = p.softcap * tanhf(acc_s(i) * tanh_in_scale);
    }
    if (tile_mask.needs_mask(m_block, n)) {
      CUTE_UNROLL
      for (int r = 0; r < size<0>(scores); ++r) {
        CUTE_UNROLL
        for (int c = 0; c < size<1>(scores); ++c) {
          auto coord = tScS(r, c);
          if (!tile_mask.p.visible(m0 + get<0>(coord), n * kBlockN + get<1>(coord))) scores(r, c) = -INFINITY;
        }
      }
    }

    // Online softmax: rebase each row on its new max, rescale what O and the sum hold so far.
    Tensor out_rows = rowcol_view(acc_o);
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      float m = row_max[r];
      CUTE_UNROLL
      for (int c = 0; c < size<1>(scores); ++c) m = fmaxf(m, scores(r, c));
      m = quad_max<Prims>(m);
      // A row that has seen only masked keys keeps max -inf; rebasing on 0 then gives p = 0 instead of NaN.
      float const m_scaled = m == -INFINITY ? 0.f : m * scale_log2;
      float const correction = exp2f(row_max[r] * scale_log2 - m_scaled);
      row_max[r] = m;
      row_sum[r] *= correction;
      CUTE_UNROLL
      for (int c = 0; c < size<1>(out_rows); ++c) out_rows(r, c) *= correction;
      CUTE_UNROLL
      for (int c = 0; c < size<1>(scores); ++c) {
        float e = exp2f(scores(r, c) * scale_log2 - m_scaled);
        scores(r, c) = e;
        row_sum[r] += e;
      }
    }

    // P in the input precision, reused in registers as the A operand of O += P V.
    Tensor rP = make_tensor<Element>(acc_s.layout());
    CUTE_UNROLL
    for (int i = 0; i < size(acc_s); ++i) rP(i) = Element(acc_s(i));
    Tensor tOrP = make_tensor(rP.data(), acc_as_a_operand(rP.layout()));
    Tensor tOsVt = smem_copy_v.get_thread_slice(tid).partition_S(sVt_stage(s));
    gemm_reg_smem(tiled_mma, acc_o, tOrP, tOrVt, tOsVt, smem_copy_v, tid);

    Prims::sync_threads();  // every read of stage s done before iteration t + 1 refills it
  }

  // ---- finalize: the sink joins the denominator once per row ----------------------------------------------
  float const sink = p.sinks ? p.sinks[bidh] : -INFINITY;
  Tensor out_rows = rowcol_view(acc_o);
  float lse[kRows];
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    float sum = quad_sum<Prims>(row_sum[r]);
    float max_nat = row_max[r] == -INFINITY ? -INFINITY : row_max[r] * scale_nat;
    RowFinal f = finalize_row(max_nat, sum, sink);
    lse[r] = f.lse;
    CUTE_UNROLL
    for (int c = 0; c < size<1>(out_rows); ++c) out_rows(r, c) *= f.out_scale;
  }

  // ---- epilogue: registers -> shared (reusing Q's space) -> global in 16-byte vectors ----------------------
  if (n_visit == 0) Prims::template cp_async_wait<0>();
  Prims::sync_threads();  // no thread still reads sQ
  Tensor rO = make_tensor<Element>(acc_o.layout());
  CUTE_UNROLL
  for (int i = 0; i < size(acc_o); ++i) rO(i) = Element(acc_o(i));
  Tensor sO = make_tensor(make_smem_ptr(smem_q), typename Kt::SmemLayoutQ{});
  auto smem_copy_o = make_tiled_copy_C(typename Kt::SmemCopyAtomO{}, tiled_mma);
  auto smem_thr_o = smem_copy_o.get_thread_slice(tid);
  copy(smem_copy_o, smem_thr_o.retile_S(rO), smem_thr_o.partition_D(sO));

  // LSE: the lane holding column 0 of a row writes it.
  int64_t const lse_base = (varlen ? q_start : 0) + int64_t(bidb) * p.lse_batch_stride + int64_t(bidh) * p.lse_head_stride;
  Tensor tOcO = rowcol_view(thr_mma.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{})));
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    int row = get<0>(tOcO(r, 0));
    if (get<1>(tOcO(r, 0)) == 0 && m0 + row < seqlen_q) p.lse[lse_base + m0 + row] = lse[r];
  }

  Prims::sync_threads();
  typename Kt::GmemTiledCopyStore gmem_store;
  auto store_thr = gmem_store.get_thread_slice(tid);
  Tensor tOsO = store_thr.partition_S(sO);
  Tensor tOgO = store_thr.partition_D(gO);
  Tensor tOcOst = store_thr.partition_D(cQ);
  CUTE_UNROLL
  for (int m = 0; m < size<1>(tOgO); ++m) {
    CUTE_UNROLL
    for (int k = 0; k < size<2>(tOgO); ++k) {
      if (m0 + get<0>(tOcOst(0, m, k)) < seqlen_q && get<1>(tOcOst(0, m, k)) < p.headdim) {
        copy(gmem_store, tOsO(_, m, k), tOgO(_, m, k));
      }
    }
  }
}

}  // namespace sinkattn::sm80
