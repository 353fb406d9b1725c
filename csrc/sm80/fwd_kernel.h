// fwd_kernel.h: the body of the sm80 forward kernel (FlashAttention-2 structure) for one (M tile, batch, head).
//
// The same code runs on the GPU (called from the __global__ in fwd_launch.cuh with GpuPrims) and on the CPU
// under host emulation (emu/fwd_sm80_emu.h with EmuPrims): everything arch-facing goes through Kt::Prims.
//
// Per CTA: Q tile (kBlockM x d) once; K/V blocks chosen by the mask policy (window blocks from the last down,
// then sink-token blocks), kStages-buffered through shared memory with cp.async; S = Q K^T and O += P V on
// mma.sync m16n8k16 with fp32 accumulation; online softmax in exp2 units; the learnable sink joins once per
// row in the finalize; O goes out through shared memory in 16-byte stores; the LSE per row.
#pragma once
#include <cmath>
#include <cute/tensor.hpp>

#include "common/defs.h"
#include "common/mask.h"
#include "common/seq_extent.h"
#include "common/split.h"
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

// Copies a (rows x d) tile global -> shared with the tiled cp.async copy, row r read from row_ptr(r): rows
// may sit anywhere (pages of a paged cache, query heads of a GQA-packed tile). Vectors outside the valid rows
// or beyond the real head dim are zero-filled in shared memory: K/V tails then give finite scores (masked
// later) and zero contributions, whatever lies past the end of the tensors. vec is the layout of one
// 16-byte vector (contiguous columns).
template <class Kt, class TS, class TC, class Vec, class RowPtr>
SA_DEVICE void load_rows(TS&& tXsX, TC const& tXcX, Vec const& vec, int valid_rows, int headdim, RowPtr const& row_ptr) {
  typename Kt::GmemTiledCopyLoad tiled_copy;
  CUTE_UNROLL
  for (int m = 0; m < size<1>(tXsX); ++m) {
    int const r = get<0>(tXcX(0, m, 0));
    bool const row_ok = r < valid_rows;
    auto const* src = row_ok ? row_ptr(r) : nullptr;
    CUTE_UNROLL
    for (int k = 0; k < size<2>(tXsX); ++k) {
      int const c = get<1>(tXcX(0, m, k));
      if (row_ok && c < headdim) {
        copy(tiled_copy, make_tensor(make_gmem_ptr(src + c), vec), tXsX(_, m, k));
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

// Split keys: each key group holds the softmax state (max and sum per row) and O of its own keys, like a
// split of split-KV. Groups 1.. hand theirs to group 0 through the K/V stages, which rescales every state to
// the common max and adds them up; true for group 0's threads, which then hold the tile's result. A group
// that saw no visible key of a row has max -inf there and weighs 0. rows[r]: the tile row of the thread's
// r-th accumulator row; mma_tid: the thread's index in its group.
template <class Kt, class Acc, int kRows>
SA_DEVICE bool merge_key_groups(char* smem_kv, int tid, float scale_log2, int const (&rows)[kRows],
                                float (&row_max)[kRows], float (&row_total)[kRows], Acc& acc_o) {
  using Prims = typename Kt::Prims;
  constexpr int kGroups = Kt::kKeyGroups, kM = Kt::kBlockM, kGroupThreads = 32 * Kt::kMmaWarps;
  constexpr int kFrag = decltype(size(acc_o))::value;
  float* merge_max = reinterpret_cast<float*>(smem_kv);  // [group][row]
  float* merge_sum = merge_max + kGroups * kM;           // [group][row]
  float* merge_o = merge_sum + kGroups * kM;             // [group - 1][fragment value][mma_tid]: conflict-free
  int const group = tid / kGroupThreads, mma_tid = tid % kGroupThreads;
  Prims::sync_threads();  // every warp's reads of the K/V stages done (with 3+ stages no barrier ends the loop)
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    if (mma_tid % 4 == 0) {  // the quad's 4 lanes hold the same row state
      Prims::smem_store(&merge_max[group * kM + rows[r]], row_max[r]);
      Prims::smem_store(&merge_sum[group * kM + rows[r]], row_total[r]);
    }
  }
  if (group > 0) {
    CUTE_UNROLL
    for (int i = 0; i < kFrag; ++i)
      Prims::smem_store(&merge_o[((group - 1) * kFrag + i) * kGroupThreads + mma_tid], acc_o(i));
  }
  Prims::sync_threads();
  if (group > 0) return false;
  auto const rc = acc_rowcol(acc_o.layout());
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    float m = -INFINITY;
    CUTE_UNROLL
    for (int g = 0; g < kGroups; ++g) m = fmaxf(m, Prims::smem_load(&merge_max[g * kM + rows[r]]));
    float const m_scaled = m == -INFINITY ? 0.f : m * scale_log2;
    float total = 0.f;
    CUTE_UNROLL
    for (int g = 0; g < kGroups; ++g) {
      float const f = exp2f(Prims::smem_load(&merge_max[g * kM + rows[r]]) * scale_log2 - m_scaled);
      total += f * Prims::smem_load(&merge_sum[g * kM + rows[r]]);
      CUTE_UNROLL
      for (int c = 0; c < size<1>(rc); ++c) {
        int const i = rc(r, c);
        acc_o(i) = g == 0 ? acc_o(i) * f
                          : acc_o(i) + f * Prims::smem_load(&merge_o[((g - 1) * kFrag + i) * kGroupThreads + mma_tid]);
      }
    }
    row_max[r] = m;
    row_total[r] = total;
  }
  return true;
}

// One CTA: M tile m_block of sequence bidb, query head bidh (or KV head bidh when GQA-packed), split `split`.
template <class Kt>
SA_DEVICE void fwd_block(FwdParams const& p, char* smem, int tid, int m_block, int bidb, int bidh, int split) {
  using Element = typename Kt::Element;
  using Prims = typename Kt::Prims;
  constexpr int kBlockM = Kt::kBlockM, kBlockN = Kt::kBlockN, kHeadDim = Kt::kHeadDim;

  // ---- this sequence's extent (varlen: packed rows from cu_seqlens; KV cache: seqused_k) ------------------
  SeqExtent const ext = seq_extent(p, bidb);
  bool const varlen = ext.varlen;
  int64_t const q_start = ext.q_start, k_start = ext.k_start;
  int const seqlen_q = ext.seqlen_q, seqlen_k = ext.seqlen_k;
  int const group = p.pack_gqa ? p.nheads / p.nheads_k : 1;
  int const rows = seqlen_q * group;  // rows of this (sequence, head or head group) problem
  if (m_block * kBlockM >= rows) return;  // uniform per CTA: the grid covers the longest sequence
  int const bidh_k = p.pack_gqa ? bidh : bidh / (p.nheads / p.nheads_k);
  int const m0 = m_block * kBlockM;
  // The query head and query index of tile row r.
  auto head_of = [&](int r) { return group == 1 ? bidh : bidh * group + (m0 + r) % group; };
  auto query_of = [&](int r) { return group == 1 ? m0 + r : (m0 + r) / group; };

  TileMask const tile_mask{MaskPolicy{seqlen_q, seqlen_k, p.window_left, p.window_right, p.sink_tokens},
                           kBlockM, kBlockN, group};
  BlockRange const range = tile_mask.range(m_block);
  int t_begin = 0, t_end = range.count();
  if (p.num_splits > 1) split_share(range.count(), split, p.num_splits, t_begin, t_end);

  // ---- global rows ------------------------------------------------------------------------------------------
  Element const* q_seq = static_cast<Element const*>(p.q) + (varlen ? q_start * p.q_row_stride : bidb * p.q_batch_stride);
  Element* o_seq = static_cast<Element*>(p.out) + (varlen ? q_start * p.o_row_stride : bidb * p.o_batch_stride);
  auto q_row = [&](int r) { return q_seq + int64_t(query_of(r)) * p.q_row_stride + int64_t(head_of(r)) * p.q_head_stride; };
  auto o_row = [&](int r) { return o_seq + int64_t(query_of(r)) * p.o_row_stride + int64_t(head_of(r)) * p.o_head_stride; };
  // Key j of this sequence: contiguous, or slot j % page_size of page block_table[j / page_size].
  Element const* k_seq = static_cast<Element const*>(p.k) + int64_t(bidh_k) * p.k_head_stride +
                         (p.block_table || varlen ? k_start * p.k_row_stride : bidb * p.k_batch_stride);
  Element const* v_seq = static_cast<Element const*>(p.v) + int64_t(bidh_k) * p.v_head_stride +
                         (p.block_table || varlen ? k_start * p.v_row_stride : bidb * p.v_batch_stride);
  int const* pages = p.block_table ? p.block_table + bidb * p.block_table_batch_stride : nullptr;
  auto kv_row = [&](Element const* seq, int64_t page_stride, int64_t row_stride, int j) {
    if (pages) return seq + int64_t(pages[j / p.page_size]) * page_stride + int64_t(j % p.page_size) * row_stride;
    return seq + int64_t(j) * row_stride;
  };

  // ---- shared memory: Q, then K stages, then V stages ---------------------------------------------------
  Element* smem_q = reinterpret_cast<Element*>(smem);
  Element* smem_k = smem_q + cosize_v<typename Kt::SmemLayoutQ>;
  Element* smem_v = smem_k + Kt::kStages * cosize_v<typename Kt::SmemLayoutKV>;
  Tensor sQ = make_tensor(make_smem_ptr(smem_q), typename Kt::SmemLayoutQ{});
  // Stage s of K or V (base smem_k or smem_v) from key row0 on (whole 8-row swizzle atoms), seen in `layout`.
  auto stage = [&](Element* base, int s, int row0, auto layout) {
    return make_tensor(make_smem_ptr(base + s * cosize_v<typename Kt::SmemLayoutKV> + row0 * Kt::kBlockKSmem), layout);
  };

  // ---- global -> shared copies -----------------------------------------------------------------------------
  typename Kt::GmemTiledCopyLoad gmem_copy;
  auto gmem_thr = gmem_copy.get_thread_slice(tid);
  Tensor cQ = make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{});
  Tensor cKV = make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{});
  Tensor tQcQ = gmem_thr.partition_S(cQ);
  Tensor tKVcKV = gmem_thr.partition_S(cKV);
  // The layout of one thread's 16-byte vector in a row-major global tile (only its column stride matters).
  auto const vec = gmem_thr.partition_S(make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)),
                                                    Shape<Int<kBlockN>, Int<kHeadDim>>{}, GenRowMajor{}))(_, 0, 0).layout();
  auto load_kv = [&](int t) {
    int const n = range.block(t), s = (t - t_begin) % Kt::kStages, j0 = n * kBlockN;
    typename Kt::SmemLayoutKV const whole;
    load_rows<Kt>(gmem_thr.partition_D(stage(smem_k, s, 0, whole)), tKVcKV, vec, seqlen_k - j0, p.headdim,
                  [&](int r) { return kv_row(k_seq, p.k_batch_stride, p.k_row_stride, j0 + r); });
    load_rows<Kt>(gmem_thr.partition_D(stage(smem_v, s, 0, whole)), tKVcKV, vec, seqlen_k - j0, p.headdim,
                  [&](int r) { return kv_row(v_seq, p.v_batch_stride, p.v_row_stride, j0 + r); });
  };

  // One cp.async group per key block, committed even when empty (past the last block), so the group of
  // block t is always the (t - t_begin)-th and one wait count serves every iteration. Q joins block t_begin's.
  load_rows<Kt>(gmem_thr.partition_D(sQ), tQcQ, vec, rows - m0, p.headdim, q_row);
  if (t_end > t_begin) load_kv(t_begin);
  Prims::cp_async_fence();
  CUTE_UNROLL
  for (int i = 1; i < Kt::kStages - 1; ++i) {  // blocks t_begin + 1 .. t_begin + kStages - 2 in flight too
    if (t_begin + i < t_end) load_kv(t_begin + i);
    Prims::cp_async_fence();
  }

  // ---- MMA partitions ----------------------------------------------------------------------------------------
  // Split keys: each key group is a TiledMma of its own (index mma_tid) over its keys key0.. of every block.
  constexpr int kBlockNMma = Kt::kBlockNMma, kGroupThreads = 32 * Kt::kMmaWarps;
  int const mma_tid = tid % kGroupThreads;
  int const key0 = tid / kGroupThreads * kBlockNMma;
  auto sK_mma = [&](int s) { return stage(smem_k, s, key0, typename Kt::SmemLayoutKMma{}); };
  auto sVt_mma = [&](int s) { return stage(smem_v, s, key0, typename Kt::SmemLayoutVtMma{}); };
  typename Kt::TiledMma tiled_mma;
  auto thr_mma = tiled_mma.get_thread_slice(mma_tid);
  Tensor tSrQ = thr_mma.partition_fragment_A(sQ);
  Tensor tSrK = thr_mma.partition_fragment_B(sK_mma(0));
  Tensor tOrVt = thr_mma.partition_fragment_B(sVt_mma(0));
  Tensor acc_o = partition_fragment_C(tiled_mma, Shape<Int<kBlockM>, Int<kHeadDim>>{});
  clear(acc_o);

  auto smem_copy_q = make_tiled_copy_A(typename Kt::SmemCopyAtom{}, tiled_mma);
  auto smem_copy_k = make_tiled_copy_B(typename Kt::SmemCopyAtom{}, tiled_mma);
  auto smem_copy_v = make_tiled_copy_B(typename Kt::SmemCopyAtomT{}, tiled_mma);
  Tensor tSsQ = smem_copy_q.get_thread_slice(mma_tid).partition_S(sQ);

  // (row, col) coordinates of this thread's S elements (columns from key0), for the mask and the LSE.
  Tensor tScS = rowcol_view(thr_mma.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockNMma>>{})));
  constexpr int kRows = 2 * kBlockM / (16 * Kt::kMmaWarps);  // m16n8 tiles: 2 rows per thread per 16-row slice
  // A warp whose first 16-row slice lies past the tile's real rows holds no real row at all (its other slices
  // lie further down): it skips the MMAs and the softmax and only loads and synchronises (and under split
  // keys hands an empty state to the merge). Decode tiles (GQA-packed: seqlen_q * group real rows) leave some
  // warps so. Uniform per warp.
  bool const warp_active = m0 + get<0>(tScS(0, 0)) / 16 * 16 < rows;
  float row_max[kRows], row_sum[kRows];
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) { row_max[r] = -INFINITY; row_sum[r] = 0.f; }

  // With softcap the scores are first bounded, s = softcap * tanh(scale * qk / softcap), then used unscaled.
  bool const softcap = p.softcap > 0.f;
  float const scale_nat = softcap ? 1.f : p.softmax_scale;
  float const scale_log2 = scale_nat * float(M_LOG2E);
  float const tanh_in_scale = softcap ? p.softmax_scale / p.softcap : 0.f;
  for (int t = t_begin; t < t_end; ++t) {
    int const n = range.block(t), s = (t - t_begin) % Kt::kStages;
    if constexpr (Kt::kStages == 2) {
      // Two stages: block t + 1 goes into the other stage, freed by the barrier that ended iteration t - 1,
      // before the wait for block t, so its copy overlaps that wait too. (This order, with two barriers per
      // block, is the loop the H200 measured at 221 TFLOP/s for hd128; 208 with the one-barrier order below,
      // other changes landing in between.)
      if (t + 1 < t_end) {
        load_kv(t + 1);
        Prims::cp_async_fence();
        Prims::template cp_async_wait<1>();
      } else {
        Prims::template cp_async_wait<0>();
      }
      Prims::sync_threads();  // stage s (and Q) written by every thread's copies
    } else {
      Prims::template cp_async_wait<Kt::kStages - 2>();  // this thread's copies of block t (and Q) landed
      // Stage s (and Q) written by every thread's copies; every read of iteration t - 1 done, so its stage
      // takes block t + kStages - 1 while this one computes.
      Prims::sync_threads();
      if (t + Kt::kStages - 1 < t_end) load_kv(t + Kt::kStages - 1);
      Prims::cp_async_fence();
    }
    if (!warp_active) {
      if constexpr (Kt::kStages == 2) Prims::sync_threads();  // the end-of-iteration barrier every warp takes
      continue;
    }

    Tensor acc_s = partition_fragment_C(tiled_mma, Shape<Int<kBlockM>, Int<kBlockNMma>>{});
    clear(acc_s);
    Tensor tSsK = smem_copy_k.get_thread_slice(mma_tid).partition_S(sK_mma(s));
    gemm_smem_smem(tiled_mma, acc_s, tSrQ, tSrK, tSsQ, tSsK, smem_copy_q, smem_copy_k, mma_tid);

    Tensor scores = rowcol_view(acc_s);
    static_assert(decltype(size<0>(scores))::value == kRows);
    if (softcap) {
      CUTE_UNROLL
      for (int i = 0; i < size(acc_s); ++i) acc_s(i) = p.softcap * tanhf(acc_s(i) * tanh_in_scale);
    }
    if (tile_mask.needs_mask(m_block, n)) {
      // Per row the visible keys are [lo, hi) plus the sink tokens below hi: two compares per element.
      int const col0 = n * kBlockN + key0;  // key of this thread's S column 0
      int const sink_hi = p.sink_tokens - col0;
      CUTE_UNROLL
      for (int r = 0; r < size<0>(scores); ++r) {
        int lo, hi;
        tile_mask.visible_cols(m0 + get<0>(tScS(r, 0)), lo, hi);
        lo -= col0;  // in the thread's columns
        hi -= col0;
        CUTE_UNROLL
        for (int c = 0; c < size<1>(scores); ++c) {
          int const j = get<1>(tScS(r, c));
          if (!(j < hi && (j >= lo || j < sink_hi))) scores(r, c) = -INFINITY;
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
    Tensor tOsVt = smem_copy_v.get_thread_slice(mma_tid).partition_S(sVt_mma(s));
    gemm_reg_smem(tiled_mma, acc_o, tOrP, tOrVt, tOsVt, smem_copy_v, mma_tid);
    if constexpr (Kt::kStages == 2) Prims::sync_threads();  // every read of stage s done before t + 2 refills it
  }
  Prims::template cp_async_wait<0>();  // the trailing empty groups (or the Q copy, when no key block was visited)

  Tensor tOcO = rowcol_view(thr_mma.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{})));
  float row_total[kRows];
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) row_total[r] = quad_sum<Prims>(row_sum[r]);
  // Split keys: from here on key group 0 alone holds the tile's rows; the others only join the barriers and
  // the 16-byte global stores of the epilogue.
  bool holds_rows = true;
  if constexpr (Kt::kSplitKeys) {
    int tile_rows[kRows];
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) tile_rows[r] = get<0>(tOcO(r, 0));
    holds_rows = merge_key_groups<Kt>(reinterpret_cast<char*>(smem_k), tid, scale_log2, tile_rows, row_max,
                                       row_total, acc_o);
  }

  // ---- finalize: the sink joins the denominator once per row (in the combine when split) ------------------
  bool const split_kv = p.num_splits > 1;
  Tensor out_rows = rowcol_view(acc_o);
  float lse[kRows];
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    float max_nat = row_max[r] == -INFINITY ? -INFINITY : row_max[r] * scale_nat;
    float const sink = split_kv ? -INFINITY : p.sinks ? p.sinks[head_of(get<0>(tOcO(r, 0)))] : -INFINITY;
    RowFinal f = finalize_row(max_nat, row_total[r], sink);
    lse[r] = f.lse;
    CUTE_UNROLL
    for (int c = 0; c < size<1>(out_rows); ++c) out_rows(r, c) *= f.out_scale;
  }

  if (split_kv) {
    if (!holds_rows) return;
    // Partial results in fp32, straight from registers: decode tiles are small and the combine reads them once.
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      int const row = get<0>(tOcO(r, 0));
      if (m0 + row >= rows) continue;
      int64_t const idx = ((int64_t(split) * p.batch + bidb) * p.nheads + head_of(row)) * p.seqlen_q + query_of(row);
      CUTE_UNROLL
      for (int c = 0; c < size<1>(out_rows); ++c) {
        int const col = get<1>(tOcO(r, c));
        if (col < p.headdim) p.out_accum[idx * p.headdim_rounded + col] = out_rows(r, c);
      }
      if (get<1>(tOcO(r, 0)) == 0) p.lse_accum[idx] = lse[r];
    }
    return;
  }

  // ---- epilogue: registers -> shared (reusing Q's space) -> global in 16-byte vectors ----------------------
  Prims::sync_threads();  // no thread still reads sQ
  Tensor sO = make_tensor(make_smem_ptr(smem_q), typename Kt::SmemLayoutQ{});
  if (holds_rows) {
    Tensor rO = make_tensor<Element>(acc_o.layout());
    CUTE_UNROLL
    for (int i = 0; i < size(acc_o); ++i) rO(i) = Element(acc_o(i));
    auto smem_copy_o = make_tiled_copy_C(typename Kt::SmemCopyAtomO{}, tiled_mma);
    auto smem_thr_o = smem_copy_o.get_thread_slice(mma_tid);
    copy(smem_copy_o, smem_thr_o.retile_S(rO), smem_thr_o.partition_D(sO));

    // LSE: the lane holding column 0 of a row writes it.
    int64_t const lse_seq = (varlen ? q_start : 0) + int64_t(bidb) * p.lse_batch_stride;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      int const row = get<0>(tOcO(r, 0));
      if (get<1>(tOcO(r, 0)) == 0 && m0 + row < rows) {
        p.lse[lse_seq + int64_t(head_of(row)) * p.lse_head_stride + query_of(row)] = lse[r];
      }
    }
  }

  Prims::sync_threads();
  typename Kt::GmemTiledCopyStore gmem_store;
  auto store_thr = gmem_store.get_thread_slice(tid);
  Tensor tOsO = store_thr.partition_S(sO);
  Tensor tOcOst = store_thr.partition_D(cQ);
  CUTE_UNROLL
  for (int m = 0; m < size<1>(tOsO); ++m) {
    int const row = get<0>(tOcOst(0, m, 0));
    if (m0 + row >= rows) continue;
    Element* dst = o_row(row);
    CUTE_UNROLL
    for (int k = 0; k < size<2>(tOsO); ++k) {
      int const col = get<1>(tOcOst(0, m, k));
      if (col < p.headdim) copy(gmem_store, tOsO(_, m, k), make_tensor(make_gmem_ptr(dst + col), vec));
    }
  }
}

}  // namespace sinkattn::sm80
