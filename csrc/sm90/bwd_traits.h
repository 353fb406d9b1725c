// bwd_traits.h: tile shapes, shared-memory layouts, wgmma and TMA types of the sm90 backward kernel.
//
// One CTA = 3 warpgroups for one key block of kBlockN = 128 keys: warpgroup 0 produces (one warp: TMA loads of
// K and V once, of Q and dO per step, and the step's LSE and delta rows), warpgroups 1 and 2 consume, each owning
// 64 keys. The products are computed transposed (keys as the M mode, as FlashAttention-3's swapAB), so that P^T
// and dS^T come out of the accumulators already laid out as the register A operands of dV += P^T dO and
// dK += dS^T Q:
//   S^T  = K Q^T    (64 x block_m per warpgroup, both operands from shared memory, K-major)
//   dP^T = V dO^T   (likewise)
//   dV  += P^T dO   (A from registers, dO read MN-major: the transposed view of its tile)
//   dK  += dS^T Q   (likewise)
//   dQ   = dS K     (dS^T of both warpgroups through shared memory, read MN-major; K read MN-major)
// No torch and no host-only code here.
#pragma once
#include <type_traits>
#include <utility>

#include <cute/tensor.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cute/atom/copy_atom.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cutlass/numeric_types.h>

#include "common/mask.h"
#include "common/seq_extent.h"
#include "common/tile_order.h"
#include "params.h"
#include "sm90/bwd_tiles.h"
#include "sm90/prims_gpu.cuh"
#include "sm90/tma_gmem.h"

namespace sinkattn::sm90 {

using namespace cute;

namespace bwd {

// The CTA's work, derived from the CTA's index once (thread 0, into SharedStorage::work) and read by every thread.
struct Work {
  int n_block, head, batch, m_begin, m_end;
  SeqExtent ext;
  TileMask mask;

  template <class Kt>
  static __device__ Work make(BwdParams const& p, BwdTileOrder const& grid, unsigned block) {
    Work w;
    int split;
    grid.decode(block, w.n_block, split, w.head, w.batch);
    w.ext = seq_extent(p, w.batch);
    w.mask = TileMask{mask_policy(p, w.ext), Kt::kBlockM, Kt::kBlockN, 1};
    w.m_begin = w.m_end = 0;
    if (w.n_block * Kt::kBlockN < w.ext.seqlen_k) w.mask.m_range(w.n_block, w.m_begin, w.m_end);
    return w;
  }
};

}  // namespace bwd

template <class Tile_, class Element_>
struct BwdTraits {
  using Element = Element_;
  static constexpr BwdTile kTile = Tile_::tile;
  static constexpr int kHeadDim = kTile.head_dim;
  static constexpr int kBlockM = kTile.block_m;
  static constexpr int kBlockN = kTile.block_n;
  static constexpr int kStages = kTile.stages;
  static constexpr int kConsumerWarpgroups = 2;
  static constexpr int kNThreads = 128 * (1 + kConsumerWarpgroups);
  static constexpr int kProducerRegs = kTile.producer_regs;
  static constexpr int kConsumerRegs = kTile.consumer_regs;
  static_assert(128 * (kProducerRegs + kConsumerWarpgroups * kConsumerRegs) <= 64512 && kProducerRegs % 8 == 0 &&
                kConsumerRegs % 8 == 0);
  static_assert(kBlockN == 64 * kConsumerWarpgroups, "each consumer warpgroup owns 64 keys");
  static_assert(kHeadDim % 64 == 0 && kHeadDim <= 128 && (kBlockM == 64 || kBlockM == 128));

  // The warpgroups split the keys (M) of S^T, dP^T, dK and dV.
  using AtomKeys = Layout<Shape<Int<kConsumerWarpgroups>, _1, _1>>;
  using TiledMmaSdP = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kBlockM>, Int<kHeadDim>>>(), AtomKeys{}));
  using TiledMmadKV = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, Shape<_64, Int<kHeadDim>, Int<kBlockM>>, GMMA::Major::K,
                           GMMA::Major::MN>(),
      AtomKeys{}));
  // dQ (block_m x head dim) = dS K over the block's 128 keys: with 128-query steps the warpgroups split the
  // queries (M); with 64 they split the head dim (N, 64 columns each: one 128-byte swizzle row of K^T).
  static constexpr bool kDqSplitM = kBlockM == 64 * kConsumerWarpgroups;
  static constexpr int kDqN = kDqSplitM ? kHeadDim : kHeadDim / kConsumerWarpgroups;
  static_assert(kDqN % 64 == 0);
  using AtomDq = std::conditional_t<kDqSplitM, Layout<Shape<Int<kConsumerWarpgroups>, _1, _1>>,
                                    Layout<Shape<_1, Int<kConsumerWarpgroups>, _1>>>;
  using TiledMmadQ = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kDqN>, Int<kBlockN>>, GMMA::Major::MN,
                           GMMA::Major::MN>(),
      AtomDq{}));

  // 128-byte swizzles throughout: what TMA writes and wgmma reads without bank conflicts.
  using SmemAtomK = GMMA::Layout_K_SW128_Atom<Element>;
  using SmemLayoutQ = decltype(tile_to_shape(SmemAtomK{}, Shape<Int<kBlockM>, Int<kHeadDim>, Int<kStages>>{}));  // Q, dO
  // Q and dO as the B operands of dK and dV, indexed (d, query, stage): the same bytes, first two modes swapped.
  using SmemLayoutQt = decltype(composition(
      SmemLayoutQ{}, make_ordered_layout(Shape<Int<kHeadDim>, Int<kBlockM>, Int<kStages>>{}, Step<_2, _1, _3>{})));
  using SmemLayoutKV = decltype(tile_to_shape(SmemAtomK{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  using SmemLayoutKt = decltype(composition(SmemLayoutKV{},
                                            make_ordered_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{}, Step<_2, _1>{})));
  // dS, (query, key, buffer), queries contiguous: the MN-major A operand of dQ = dS K. The consumers write it
  // through the transposed view (key, query, buffer), which matches their dS^T accumulators. Two buffers: a
  // warpgroup writes step t + 1's while the other may still read step t's (one barrier per step orders the rest).
  using SmemLayoutdS = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<Element>{}, Shape<Int<kBlockM>, Int<kBlockN>, _2>{}));
  using SmemLayoutdSt = decltype(composition(
      SmemLayoutdS{}, make_ordered_layout(Shape<Int<kBlockN>, Int<kBlockM>, _2>{}, Step<_2, _1, _3>{})));

  // Global tensors as TMA sees them: (rows, head dim, heads, batch), the head dim contiguous (varlen: batch 1).
  using GmemTensor = TmaGmemTensor<Element>;  // sm90/tma_gmem.h
  // The TMA load types (sm90/prims_gpu.cuh): one Q or dO stage, the K or V block.
  using TmaQ = TmaLoad<GmemTensor, decltype(take<0, 2>(SmemLayoutQ{}))>;
  using TmaKV = TmaLoad<GmemTensor, SmemLayoutKV>;

  static constexpr uint32_t kQBytes = kBlockM * kHeadDim * sizeof(Element);
  static constexpr uint32_t kKVBytes = kBlockN * kHeadDim * sizeof(Element);

  struct SharedStorage {
    alignas(1024) Element q[cosize_v<SmemLayoutQ>];
    alignas(1024) Element dout[cosize_v<SmemLayoutQ>];
    alignas(1024) Element k[cosize_v<SmemLayoutKV>];
    alignas(1024) Element v[cosize_v<SmemLayoutKV>];
    alignas(1024) Element ds[cosize_v<SmemLayoutdS>];
    // The step's rows: LSE in log2 units (+inf for rows past the sequence and rows that see nothing: P = 0 there)
    // and delta = rowsum(dO * O) - dlse.
    alignas(16) float lse_log2[kStages][kBlockM];
    float delta[kStages][kBlockM];
    // kv_full: K and V landed. q_full[s]: Q and dO of stage s landed (TMA bytes) and its LSE / delta rows written
    // (one arrival per producer lane). q_empty[s]: every consumer thread is done with stage s.
    alignas(8) uint64_t kv_full, q_full[kStages], q_empty[kStages];
    bwd::Work work;
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
  static_assert(kSmemBytes <= 227 * 1024, "over the sm90 shared-memory limit per block");
  static_assert(kSmemBytes == kTile.smem_bytes(), "the table's size is the layouts' size");
};

template <class Kt>
struct BwdTmaParams {
  typename Kt::TmaQ q, dout;
  typename Kt::TmaKV k, v;
};

}  // namespace sinkattn::sm90
