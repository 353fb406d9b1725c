// fwd_kernel.h: the body of the sm80 forward kernel (FlashAttention-2 structure) for one (M tile, batch, head).
//
// The same code runs on the GPU (called from the __global__ in fwd_launch.cuh with GpuPrims) and on the CPU
// under host emulation (emu/fwd_sm80_emu.h with EmuPrims): everything arch-facing goes through Kt::Prims.
//
// Per CTA: Q tile (kBlockM x d) once; K/V blocks chosen by the mask policy (window blocks from the last down,
// then sink-token blocks), kStages-buffered through shared memory with cp.async (or, with one stage, one K and one
// V buffer loaded staggered: V of a block during its S, K of the next during its softmax; or, S ahead, K one block
// ahead of V and S of the next block computed beside this block's softmax); S = Q K^T and O += P V on
// mma.sync m16n8k16 with fp32 accumulation; the online softmax in exp2 units (common/online_softmax.h); the
// learnable sink joins once per row in the finalize; then the epilogue (fwd_epilogue.h, or
// split_epilogue.h under split-KV). Over an FP8 cache (Kt::kFp8, sm80/fp8_kv.h) K/V blocks arrive as FP8 codes and
// are converted in shared memory before the MMAs; everything else is the same code.
#pragma once
#include <cmath>
#include <cute/tensor.hpp>

#include "common/defs.h"
#include "common/mask.h"
#include "common/online_softmax.h"
#include "common/seq_extent.h"
#include "common/split.h"
#include "params.h"
#include "sm80/fp8_kv.h"
#include "sm80/fwd_epilogue.h"
#include "sm80/fwd_traits.h"
#include "sm80/gemm.h"
#include "sm80/key_groups.h"
#include "sm80/kv_loader.h"
#include "sm80/layout_utils.h"
#include "sm80/row_loader.h"
#include "sm80/split_epilogue.h"

namespace sinkattn::sm80 {

using namespace cute;

// One CTA: M tile m_block of sequence bidb, query head bidh (or KV head bidh when GQA-packed), split `split`.
template <class Kt>
SA_DEVICE void fwd_block(typename Kt::Params const& p, char* smem, int tid, int m_block, int bidb, int bidh, int split) {
  using Element = typename Kt::Element;
  using Prims = typename Kt::Prims;
  constexpr int kBlockM = Kt::kBlockM, kBlockN = Kt::kBlockN, kHeadDim = Kt::kHeadDim;

  // ---- the tile: this sequence's extent (varlen: cu_seqlens; KV cache: seqused_k), its rows and key blocks ---
  int const group = p.pack_gqa ? p.nheads / p.nheads_k : 1;
  if (p.packed_tiles) packed_tile(p.cu_seqlens_q, p.batch, group, kBlockM, m_block, bidb, m_block);
  SeqExtent const ext = seq_extent(p, bidb);
  int const rows = ext.seqlen_q * group;  // rows of this (sequence, head or head group) problem
  if (m_block * kBlockM >= rows) return;  // uniform per CTA: the grid covers the longest sequence
  int const bidh_k = p.pack_gqa ? bidh : bidh / (p.nheads / p.nheads_k);
  int const m0 = m_block * kBlockM;
  // The output's base joins after the loop (fwd_block's epilogue).
  FwdRows<Element> at{m0, bidh, group, nullptr, p.o_row_stride, p.o_head_stride};

  TileMask const tile_mask{mask_policy(p, ext), kBlockM, kBlockN, group};
  BlockRange const range = tile_mask.range(m_block);
  TileMask::MaskTest const mask_test = tile_mask.mask_test(m_block);
  int t_begin = 0, t_end = range.count();
  if (p.num_splits > 1) split_share(range.count(), split, p.num_splits, t_begin, t_end);

  // ---- global rows: Q of tile row r (SeqExtent gives each sequence's base; a row adds row * row_stride + head *
  // head_stride); K and V rows: kv_loader.h ----------------------------------------------------------------------
  Element const* q_seq = static_cast<Element const*>(p.q) + ext.q_row(bidb, p.q_batch_stride, p.q_row_stride, p.q_head_stride);
  auto q_row = [&](int r) {
    return q_seq + int64_t(at.query_of(r)) * p.q_row_stride + int64_t(at.head_of(r)) * p.q_head_stride;
  };
  KvLoader<Kt> const load_block{p, ext, bidb, bidh_k};  // K and V rows, contiguous, packed or paged

  // ---- shared memory: Q, the K stages, the V stages as loaded (Kt::SmemLayoutKvLoad); over an FP8 cache then the
  // one K and one V block of Element the MMAs read (fp8_kv.h), otherwise the MMAs read the stages -----------------
  using Cache = typename Kt::CacheElement;  // Element, or the codes of an FP8 cache
  using KvStage = typename Kt::SmemLayoutKvLoad;
  Element* smem_q = reinterpret_cast<Element*>(smem);
  Cache* const stage_k = reinterpret_cast<Cache*>(smem_q + cosize_v<typename Kt::SmemLayoutQ>);
  Cache* const stage_v = stage_k + Kt::kStages * cosize_v<KvStage>;
  Element* const smem_k = reinterpret_cast<Element*>(Kt::kFp8 ? stage_v + Kt::kStages * cosize_v<KvStage> : stage_k);
  Element* const smem_v =
      Kt::kFp8 ? smem_k + cosize_v<typename Kt::SmemLayoutKV> : reinterpret_cast<Element*>(stage_v);
  Tensor sQ = make_tensor(make_smem_ptr(smem_q), typename Kt::SmemLayoutQ{});
  // Stage s of K or V (base smem_k or smem_v) from key row0 on (whole 8-row swizzle atoms), seen in `layout`.
  auto stage = [&](Element* base, int s, int row0, auto layout) {
    return make_tensor(make_smem_ptr(base + s * cosize_v<typename Kt::SmemLayoutKV> + row0 * Kt::kBlockKSmem), layout);
  };

  // ---- global -> shared copies -----------------------------------------------------------------------------
  typename Kt::GmemTiledCopyLoad gmem_copy;
  auto gmem_thr = gmem_copy.get_thread_slice(tid);
  Tensor tQcQ = gmem_thr.partition_S(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  auto const vec = gmem_vector<Element, kBlockN, kHeadDim>(gmem_thr);
  auto load_kv = [&](int t) {
    load_block(range.block(t), int(unsigned(t - t_begin) % Kt::kStages), stage_k, stage_v, tid);
  };
  // K of block t, or V of block t, into stage s (the staggered tiles' one stage, S ahead's two).
  auto load_k_at = [&](int t, int s) { load_block.template load<true, false>(range.block(t), s, stage_k, stage_v, tid); };
  auto load_v_at = [&](int t, int s) { load_block.template load<false, true>(range.block(t), s, stage_k, stage_v, tid); };
  // Staggered (one K and one V buffer): after the barrier that K(t) landed behind, V(t) loads during S = Q K(t);
  // after the one V(t) landed behind, K(t + 1) loads during the softmax and P V. Both barriers every warp takes.
  auto staggered_k_next = [&](int t) {
    Prims::template cp_async_wait<0>();  // V(t) landed
    Prims::sync_threads();               // ... for every thread; every read of K(t) done
    if (t + 1 < t_end) load_k_at(t + 1, 0);
    Prims::cp_async_fence();
  };

  // One cp.async group per key block, committed even when empty (past the last block), so the group of
  // block t is always the (t - t_begin)-th and one wait count serves every iteration. Q joins block t_begin's,
  // or under Kt::kQInRegs is a group of its own, older than every block's, waited for alone before the loop.
  // S ahead (Q in registers): K(t_begin), whose wait is Q's, then K(t_begin + 1) with V(t_begin); from then on the
  // one group in flight at the top of iteration t holds K(t + 1) and V(t).
  load_rows<Kt>(gmem_thr.partition_D(sQ), tQcQ, vec, rows - m0, p.headdim, q_row);
  if constexpr (Kt::kQInRegs) Prims::cp_async_fence();
  if constexpr (Kt::kSAhead) {
    if (t_end > t_begin) load_k_at(t_begin, 0);
    Prims::cp_async_fence();
    if (t_begin + 1 < t_end) load_k_at(t_begin + 1, 1);
    if (t_end > t_begin) load_v_at(t_begin, 0);
  } else if (t_end > t_begin) {
    if constexpr (Kt::kStaggered) load_k_at(t_begin, 0);
    else load_kv(t_begin);
  }
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
  if constexpr (Kt::kQInRegs) {
    // Q's group is the oldest: the kStages - 1 key-block groups issued after it may stay in flight. Read once here
    // (a copy inside the loop under `t == t_begin` was if-converted by ptxas into predicated ldmatrix issued
    // every block).
    Prims::template cp_async_wait<Kt::kStages - 1>();
    Prims::sync_threads();
    copy(smem_copy_q, tSsQ, smem_copy_q.get_thread_slice(mma_tid).retile_D(tSrQ));
  }

  // (row, col) coordinates of this thread's S elements (columns from key0), for the mask and the LSE.
  Tensor tScS = rowcol_view(thr_mma.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockNMma>>{})));
  constexpr int kRows = 2 * kBlockM / (16 * Kt::kMmaWarps);  // m16n8 tiles: 2 rows per thread per 16-row slice
  constexpr int kCols = decltype(size<1>(tScS))::value;
  // A warp whose first 16-row slice lies past the tile's real rows holds no real row at all (its other slices
  // lie further down): it skips the MMAs and the softmax and only loads and synchronises (and under split
  // keys hands an empty state to the merge). Decode tiles (GQA-packed: seqlen_q * group real rows) leave some
  // warps so. Uniform per warp.
  bool const warp_active = m0 + get<0>(tScS(0, 0)) / 16 * 16 < rows;
  float softmax_scale = p.softmax_scale;
  [[maybe_unused]] float v_descale = 1.f;
  if constexpr (Kt::kFp8) {  // the dequantization scales of this (sequence, KV head), out of the loop
    if (p.k_descale) softmax_scale *= p.k_descale[bidb * p.k_descale_batch_stride + bidh_k * p.k_descale_head_stride];
    if (p.v_descale) v_descale = p.v_descale[bidb * p.v_descale_batch_stride + bidh_k * p.v_descale_head_stride];
  }
  ScoreScale<Kt::kCap> const score{softmax_scale, p.softcap};
  OnlineSoftmax<kRows, Prims> softmax;

  // ---- the key blocks ----------------------------------------------------------------------------------------
  if constexpr (Kt::kSAhead) {
    // Stage s = (t - t_begin) % 2 holds K(t) and V(t); K(t + 1) sits in the other stage from the top of iteration t.
    // The steps are those of the loop below (the tiles without S ahead), in another order.
    auto qk = [&](auto& acc, int s) {  // S = Q K^T of the K block in stage s
      clear(acc);
      Tensor tSsK = smem_copy_k.get_thread_slice(mma_tid).partition_S(sK_mma(s));
      gemm_reg_smem(tiled_mma, acc, tSrQ, tSrK, tSsK, smem_copy_k, mma_tid);
    };
    Tensor acc_s = partition_fragment_C(tiled_mma, Shape<Int<kBlockM>, Int<kBlockNMma>>{});
    Tensor acc_next = partition_fragment_C(tiled_mma, Shape<Int<kBlockM>, Int<kBlockNMma>>{});
    Tensor scores = rowcol_view(acc_s);
    Tensor out_rows = rowcol_view(acc_o);
    // Block n's scores in acc_s bounded (softcap) and masked; for block t + 1 at the end of iteration t, so that
    // nothing branches between this block's softmax and the next block's S.
    auto bound_mask = [&](int n) {
      score.bound(acc_s);
      if (mask_test.needs(n)) {
        tile_mask.apply<kRows, kCols>(tScS, m0, n * kBlockN + key0, [&](int r, int c) { scores(r, c) = -INFINITY; });
      }
    };
    if (warp_active && t_end > t_begin) {
      qk(acc_s, 0);
      bound_mask(range.block(t_begin));
    }
    for (int t = t_begin; t < t_end; ++t) {
      int const s = int(unsigned(t - t_begin) % 2);
      Prims::template cp_async_wait<0>();  // K(t + 1) and V(t) landed
      // ... for every thread; every read of iteration t - 1 done: K(t) (read as iteration t - 1's S ahead) and
      // V(t - 1), whose stages take K(t + 2) and V(t + 1)
      Prims::sync_threads();
      if constexpr (Kt::kBranchFreeLoads) {
        // Interior blocks of a contiguous cache through predicated copies, in straight-line code; any other block
        // through the loader's branches, behind one test that interior iterations skip.
        int const nk = range.block(t + 2), nv = range.block(t + 1);
        bool const k_whole = t + 2 < t_end && load_block.whole_contiguous(nk);
        bool const v_whole = t + 1 < t_end && load_block.whole_contiguous(nv);
        if ((t + 2 < t_end && !k_whole) || (t + 1 < t_end && !v_whole)) {
          if (t + 2 < t_end && !k_whole) {
            load_block.template load<true, false>(nk, s, stage_k, stage_v, tid);
          }
          if (t + 1 < t_end && !v_whole) {
            load_block.template load<false, true>(nv, s ^ 1, stage_k, stage_v, tid);
          }
        }
        load_block.template load_whole_if<true>(k_whole, nk, s, stage_k, tid);
        load_block.template load_whole_if<false>(v_whole, nv, s ^ 1, stage_v, tid);
      } else {
        if (t + 2 < t_end) load_k_at(t + 2, s);
        if (t + 1 < t_end) load_v_at(t + 1, s ^ 1);
      }
      Prims::cp_async_fence();
      if (!warp_active) continue;
      // No branch from here to the copy below: ptxas interleaves the MMAs of S(t + 1) with this block's softmax.
      // The last iteration computes it from K(t) (stage s, which nothing refills then) and drops it.
      qk(acc_next, t + 1 < t_end ? s ^ 1 : s);
      float correction[kRows];
      softmax.rescale(scores, score.log2, correction);
      softmax.rescale_rows(out_rows, correction);
      Tensor rP = convert<Element>(acc_s);
      Tensor tOrP = make_tensor(rP.data(), acc_as_a_operand(rP.layout()));
      Tensor tOsVt = smem_copy_v.get_thread_slice(mma_tid).partition_S(sVt_mma(s));
      gemm_reg_smem(tiled_mma, acc_o, tOrP, tOrVt, tOsVt, smem_copy_v, mma_tid);
      CUTE_UNROLL
      for (int i = 0; i < size(acc_s); ++i) acc_s(i) = acc_next(i);
      if (t + 1 < t_end) bound_mask(range.block(t + 1));
    }
  } else {
    for (int t = t_begin; t < t_end; ++t) {
      int const n = range.block(t), s = int(unsigned(t - t_begin) % Kt::kStages);
      if constexpr (Kt::kStaggered) {
        Prims::template cp_async_wait<0>();  // K(t) (and Q) landed
        Prims::sync_threads();               // ... for every thread; every read of V(t - 1) done
        load_v_at(t, 0);
        Prims::cp_async_fence();
      } else if constexpr (Kt::kStages == 2) {
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
      if constexpr (Kt::kFp8) {
        // FP8 stage s (landed: the wait and barrier above) -> the Element K and V blocks, which every MMA read of
        // block t - 1 is done with (same barrier); a barrier before the MMAs read them. FP8 stage s is then free
        // for the loads issued after the next iteration's barrier, so no end-of-iteration barrier is needed.
        convert_fp8_stage<Kt>(stage_k, stage_v, s, smem_k, smem_v, tid, p.kv_fp8);
        Prims::sync_threads();
      }
      if (!warp_active) {
        // the barriers every warp takes
        if constexpr (Kt::kStaggered) staggered_k_next(t);
        if constexpr (Kt::kStages == 2 && !Kt::kFp8) Prims::sync_threads();
        continue;
      }

      // S = Q K^T, bounded (softcap) and masked.
      Tensor acc_s = partition_fragment_C(tiled_mma, Shape<Int<kBlockM>, Int<kBlockNMma>>{});
      clear(acc_s);
      Tensor tSsK = smem_copy_k.get_thread_slice(mma_tid).partition_S(sK_mma(Kt::kFp8 ? 0 : s));
      if constexpr (Kt::kQInRegs) {
        gemm_reg_smem(tiled_mma, acc_s, tSrQ, tSrK, tSsK, smem_copy_k, mma_tid);
      } else {
        gemm_smem_smem(tiled_mma, acc_s, tSrQ, tSrK, tSsQ, tSsK, smem_copy_q, smem_copy_k, mma_tid);
      }
      Tensor scores = rowcol_view(acc_s);
      static_assert(decltype(size<0>(scores))::value == kRows);
      score.bound(acc_s);
      if (mask_test.needs(n)) {
        tile_mask.apply<kRows, kCols>(tScS, m0, n * kBlockN + key0, [&](int r, int c) { scores(r, c) = -INFINITY; });
      }

      if constexpr (Kt::kStaggered) staggered_k_next(t);

      // P = exp(S - running max), O and the sums rescaled to the new max (with kLazyRebase only when it rises by more
      // than 2^8); O += P V with P in the input precision.
      Tensor out_rows = rowcol_view(acc_o);
      if constexpr (Kt::kLazyRebase) {
        softmax.rescale_lazy(scores, score.log2,
                             [&](auto const& correction) { softmax.rescale_rows(out_rows, correction); });
      } else {
        float correction[kRows];
        softmax.rescale(scores, score.log2, correction);
        softmax.rescale_rows(out_rows, correction);
      }
      Tensor rP = convert<Element>(acc_s);
      Tensor tOrP = make_tensor(rP.data(), acc_as_a_operand(rP.layout()));
      Tensor tOsVt = smem_copy_v.get_thread_slice(mma_tid).partition_S(sVt_mma(Kt::kFp8 ? 0 : s));
      gemm_reg_smem(tiled_mma, acc_o, tOrP, tOrVt, tOsVt, smem_copy_v, mma_tid);
      // every read of stage s done before t + 2 refills it
      if constexpr (Kt::kStages == 2 && !Kt::kFp8) Prims::sync_threads();
    }
  }
  Prims::template cp_async_wait<0>();  // the trailing empty groups (or the Q copy, when no key block was visited)

  // ---- the rows' final state: key groups merged, the sink in the denominator (in the combine when split) -----
  Tensor tOcO = rowcol_view(thr_mma.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{})));
  softmax.reduce_sums();
  // Split keys: from here on key group 0 alone holds the tile's rows; the others only join the barriers and
  // the 16-byte global stores of the epilogue.
  bool holds_rows = true;
  if constexpr (Kt::kSplitKeys) {
    int tile_rows[kRows];
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) tile_rows[r] = get<0>(tOcO(r, 0));
    holds_rows = merge_key_groups<Kt>(reinterpret_cast<char*>(stage_k), tid, score.log2, tile_rows, softmax.row_max,
                                      softmax.row_sum, acc_o);
  }
  bool const split_kv = p.num_splits > 1;
  Tensor out_rows = rowcol_view(acc_o);
  float lse[kRows];
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    float const sink = split_kv ? -INFINITY : p.sinks ? p.sinks[at.head_of(get<0>(tOcO(r, 0)))] : -INFINITY;
    RowFinal const f = softmax.finalize(r, sink, score.natural);
    lse[r] = f.lse;
    float out_scale = f.out_scale;
    if constexpr (Kt::kFp8) {
      out_scale *= v_descale;
      // A NaN code in a key the row sees makes its sum NaN, which finalize_row takes for "no visible key" (out 0);
      // the reference gives NaN there (docs/DESIGN.md section 1), and so does this kernel over an FP8 cache. A split's
      // partial lse is +inf then: the combine's max skips NaN but not +inf, and gives NaN out and lse.
      if (float_is_nan(softmax.row_sum[r])) {
        out_scale = NAN;
        lse[r] = split_kv ? INFINITY : NAN;
      }
    }
    CUTE_UNROLL
    for (int c = 0; c < size<1>(out_rows); ++c) out_rows(r, c) *= out_scale;
  }

  // ---- epilogue ------------------------------------------------------------------------------------------
  // The sequence's extent loaded again (a few cached loads once per CTA) and the output's base worked out here: held
  // across the loop, the first row, the row count and that base took registers the loop needs. At the three-CTA hd64
  // tile's 168 ptxas spilled them (8 bytes on sm_80, 20 on sm_90, outside the loop); now neither spills.
  SeqExtent const ext_out = seq_extent(p, bidb);
  int const rows_out = ext_out.seqlen_q * group;
  at.o_seq = static_cast<Element*>(p.out) + ext_out.q_row(bidb, p.o_batch_stride, p.o_row_stride, p.o_head_stride);
  if (split_kv) {
    if (holds_rows) {
      store_split_partials<Kt>(p, at, rows_out, split, bidb, ext_out.varlen ? ext_out.q_start : 0, out_rows, tOcO, lse);
    }
    return;
  }
  Tensor sO = make_tensor(make_smem_ptr(smem_q), typename Kt::SmemLayoutQ{});
  int64_t const lse_seq = ext_out.lse_row(bidb, p.lse_batch_stride, p.lse_head_stride);
  store_out_lse<Kt>(p, at, rows_out, tiled_mma, mma_tid, tid, acc_o, tOcO, lse, holds_rows, lse_seq, sO, vec);
}

}  // namespace sinkattn::sm80
