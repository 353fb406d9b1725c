// fwd_epilogue.cuh: the sm90 forward's epilogue: one consumer warpgroup's 64 rows of O out through shared memory
// in 16-byte stores, predicated on the sequence's rows (varlen rows past the end belong to the next sequence),
// and the LSE per row (a GQA-packed tile's rows each to their own query head); under split-KV, each split's fp32
// partial rows instead. Its shared-memory loads and named barrier go through Prims (sm90/prims_gpu.cuh GpuPrims).
#pragma once
#include <cstdint>
#include <cuda_runtime.h>
#include <cute/tensor.hpp>

#include "common/combine.h"
#include "common/seq_extent.h"
#include "params.h"
#include "sm90/pipeline.cuh"

namespace sinkattn::sm90 {

using namespace cute;

// O (finalized, in registers) into warpgroup wg's 64 rows of this tile's Q buffer `smem_q` (its own wgmmas
// were their last readers and have completed), the LSE of its rows, then 16-byte stores of the rows inside
// the sequence. tid: the thread's index in its warpgroup. O's shared-memory loads are 16-byte loads through 32-bit
// shared addresses (Prims::lds128: a generic pointer would hold 64 bits per precomputed address, which the epilogue
// then spilled).
// Work: the tile (fwd_kernel.cuh TileWork): its M block, sequence, extent, and where a row goes (query_of, head_of:
// a GQA-packed tile's rows are (query, query head) pairs, each row its own address; otherwise one head's rows).
template <class Kt, class Prims, class ThrMma, class AccO, class CoordsO, int kRows, class Work>
__device__ __forceinline__ void store_out_lse(FwdParams const& p, typename Kt::Element* smem_q, ThrMma const& thr_o,
                                              AccO const& tOrO, CoordsO const& tOcO, float const (&lse)[kRows],
                                              Work const& w, int wg, int tid) {
  using Element = typename Kt::Element;
  constexpr int kBlockM = Kt::kBlockM, kHeadDim = Kt::kHeadDim;
  SeqExtent const& ext = w.ext;
  int const batch = w.batch, head = w.head;
  int const m0 = w.m_block * kBlockM;
  Tensor sO = make_tensor(make_smem_ptr(smem_q), typename Kt::SmemLayoutQ{});
  Tensor tOsO = thr_o.partition_C(sO);
  CUTE_UNROLL
  for (int i = 0; i < size(tOrO); ++i) tOsO(i) = Element(tOrO(i));

  // lse: (batch, heads, seqlen_q), or (heads, total_q) when varlen; rows contiguous.
  if (w.group > 1) {
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      int const row = get<0>(tOcO(r, 0)), i = w.query_of(row);
      if (get<1>(tOcO(r, 0)) == 0 && i < ext.seqlen_q)
        p.lse[ext.q_row(batch, p.lse_batch_stride, 1, p.lse_head_stride, w.head_of(row), i)] = lse[r];
    }
  } else {
    int64_t const lse_head = ext.q_row(batch, p.lse_batch_stride, 1, p.lse_head_stride, head);
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      int const row = get<0>(tOcO(r, 0));
      if (get<1>(tOcO(r, 0)) == 0 && m0 + row < ext.seqlen_q) p.lse[lse_head + m0 + row] = lse[r];
    }
  }

  Prims::named_sync(128, FwdNamedBarriers<Kt::kConsumerWarpgroups>::own(wg));
  constexpr int kVecsPerRow = kHeadDim / 8;
  constexpr int kVecs = 64 * kVecsPerRow;
  if (w.group > 1) {
#pragma unroll 1
    for (int v = tid; v < kVecs; v += 128) {
      int const row = wg * 64 + v / kVecsPerRow, col = (v % kVecsPerRow) * 8, i = w.query_of(row);
      if (i < ext.seqlen_q && col < p.headdim) {
        uint4 const val = Prims::lds128(&sO(row, col));
        *reinterpret_cast<uint4*>(static_cast<Element*>(p.out) + col +
                                  ext.q_row(batch, p.o_batch_stride, p.o_row_stride, p.o_head_stride, w.head_of(row), i)) =
            val;
      }
    }
    return;
  }
  Element* o_seq =
      static_cast<Element*>(p.out) + ext.q_row(batch, p.o_batch_stride, p.o_row_stride, p.o_head_stride, head);
#pragma unroll 1  // unrolled, the compiler keeps every iteration's shared address live across tiles
  for (int v = tid; v < kVecs; v += 128) {
    int const row = wg * 64 + v / kVecsPerRow, col = (v % kVecsPerRow) * 8;
    if (m0 + row < ext.seqlen_q && col < p.headdim) {
      uint4 const val = Prims::lds128(&sO(row, col));
      *reinterpret_cast<uint4*>(o_seq + int64_t(m0 + row) * p.o_row_stride + col) = val;
    }
  }
}

// Split-KV (FwdParams::num_splits > 1): this split's rows, normalised over its own keys and without the sink, in fp32
// straight from registers at common/combine.h partial_row (decode tiles write few rows, and the combine reads them
// once), which the combine merges with the sink counted once. Rows past the sequence's queries are not written; a row
// whose share of the keys is empty gets lse -inf (weight 0 in the combine).
template <class OutRows, class CoordsO, int kRows, class Work>
__device__ __forceinline__ void store_split_partials(FwdParams const& p, OutRows const& out_rows, CoordsO const& tOcO,
                                                     float const (&lse)[kRows], Work const& w) {
  int64_t const split0 = int64_t(w.split) * partial_split_stride(p);
  int64_t const q0 = w.ext.varlen ? w.ext.q_start : 0;
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    int const row = get<0>(tOcO(r, 0)), i = w.query_of(row);
    if (i >= w.ext.seqlen_q) continue;
    int64_t const idx = split0 + partial_row(p, w.batch, w.head_of(row), q0 + i);
    float* const o = p.out_accum + idx * p.headdim_rounded;
    CUTE_UNROLL
    for (int c = 0; c < size<1>(out_rows); ++c) {
      int const col = get<1>(tOcO(r, c));
      if (col < p.headdim) o[col] = out_rows(r, c);
    }
    if (get<1>(tOcO(r, 0)) == 0) p.lse_accum[idx] = lse[r];
  }
}

}  // namespace sinkattn::sm90
