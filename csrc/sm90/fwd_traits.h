// fwd_traits.h: tile shapes, shared-memory layouts, wgmma and TMA types of the sm90 forward kernel.
//
// One CTA = 1 + block_m / 64 warpgroups: warpgroup 0 produces (one thread issues every TMA load), the others
// consume, each owning 64 rows of the M tile (a wgmma is 64 rows tall, and a row's softmax then stays inside
// one warpgroup). No torch and no host-only code here: kernels and the launcher include it.
#pragma once
#include <utility>

#include <cute/tensor.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cute/atom/copy_atom.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cutlass/numeric_types.h>

#include "common/fp8.h"
#include "sm90/fwd_tiles.h"
#include "sm90/prims_gpu.cuh"
#include "sm90/tma_gmem.h"

namespace sinkattn::sm90 {

using namespace cute;

// Tile: FwdTileOf<head dim> (fwd_tiles.h) or a tuning-grid tile, whose FwdTile gives the shape.
template <class Tile_, class Element_>
struct FwdTraits {
  using Element = Element_;
  static constexpr FwdTile kTile = Tile_::tile;
  static constexpr int kHeadDim = kTile.head_dim;
  static constexpr int kBlockM = kTile.block_m;
  static constexpr int kBlockN = kTile.block_n;
  static constexpr int kStages = kTile.stages;
  static constexpr int kConsumerWarpgroups = kTile.consumer_warpgroups();
  static constexpr bool kPingPong = kTile.pingpong;
  static constexpr int kQBuffers = kTile.q_buffers;
  static constexpr bool kDynamicTiles = kTile.dynamic_tiles;
  static constexpr int kNThreads = 128 * (1 + kConsumerWarpgroups);
  static constexpr int kProducerRegs = kTile.producer_regs;
  static constexpr int kConsumerRegs = kTile.consumer_regs;
  static_assert(128 * (kProducerRegs + kConsumerWarpgroups * kConsumerRegs) <= 64512 && kProducerRegs % 8 == 0 &&
                kConsumerRegs % 8 == 0);
  static_assert(kHeadDim % 64 == 0 && kBlockN % 16 == 0 && kBlockN <= 256);
  static_assert(kBlockM % 64 == 0 && kConsumerWarpgroups >= 1 && kConsumerWarpgroups <= 3);
  static_assert(kQBuffers == 1 || kQBuffers == 2);

  // S = Q K^T: both operands from shared memory, K-major. O += P V: P from registers (the S accumulator
  // converted in place), V from shared memory read MN-major (the transposed view below).
  using AtomLayout = Layout<Shape<Int<kConsumerWarpgroups>, _1, _1>>;
  using TiledMmaS = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kBlockN>, Int<kHeadDim>>>(), AtomLayout{}));
  using TiledMmaO = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, Shape<_64, Int<kHeadDim>, Int<kBlockN>>, GMMA::Major::K,
                           GMMA::Major::MN>(),
      AtomLayout{}));

  // 128-byte swizzle: what both TMA and wgmma read without bank conflicts. Head dims are multiples of 64
  // elements, one swizzle row.
  using SmemAtom = GMMA::Layout_K_SW128_Atom<Element>;
  using SmemLayoutQ = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));  // one buffer
  using SmemLayoutQs = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>, Int<kQBuffers>>{}));
  using SmemLayoutKV = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockN>, Int<kHeadDim>, Int<kStages>>{}));
  // V as the B operand of P V is indexed (d, key): the same bytes with the first two modes swapped.
  using SmemLayoutVt = decltype(composition(
      SmemLayoutKV{}, make_ordered_layout(Shape<Int<kHeadDim>, Int<kBlockN>, Int<kStages>>{}, Step<_2, _1, _3>{})));

  // Global tensors as TMA sees them: (rows, head dim, heads, batch), the head dim contiguous. Varlen packs
  // every sequence in the rows with batch 1.
  using GmemTensor = TmaGmemTensor<Element>;  // sm90/tma_gmem.h
  // The TMA load types (sm90/prims_gpu.cuh): one Q tile, one K or V stage.
  using TmaQ = TmaLoad<GmemTensor, SmemLayoutQ>;
  using TmaKV = TmaLoad<GmemTensor, decltype(take<0, 2>(SmemLayoutKV{}))>;

  // A page pool's key block arrives as kBlockN / kPageRows boxes of kPageRows rows, each inside one page, into the
  // stage's rows [r * kPageRows, (r + 1) * kPageRows): the same swizzled bytes one whole-block box would write
  // (each box starts on a 1024-byte swizzle-atom boundary), so the consumers read a stage the same way either way.
  // 16 rows serve every page size that is a multiple of 16 (vLLM's FlashAttention backends take those only).
  static constexpr int kPageRows = 16;
  static_assert(kBlockN % kPageRows == 0 && kPageRows % 8 == 0);
  using SmemLayoutKVPage = decltype(composition(take<0, 2>(SmemLayoutKV{}),
                                                make_tile(Layout<Int<kPageRows>>{}, Layout<Int<kHeadDim>>{})));
  using TmaKVPage = TmaLoad<GmemTensor, SmemLayoutKVPage>;
  // Any other page size (1 up) is gathered by the producer warpgroup's threads with cp.async (fwd_kernel.cuh
  // KvGather), where the tile allows it (fwd_tiles.h gathers_pages); fwd_host.h refuses the rest, naming the sm80
  // kernels.
  static constexpr bool kCanGather = kTile.gathers_pages();
  static constexpr bool kCanGatherFp8 = kTile.gathers_fp8();  // and decodes FP8 caches in place (KvGather::copy_fp8)
  // Whether a call's K and V go through the gather: pages of other sizes, and FP8 caches (decoded on the way).
  static SA_HOST_DEVICE bool gathers(FwdFp8Params const& p) {
    if (p.kv_fp8 != kFp8None) return kCanGatherFp8;
    return kCanGather && p.block_table != nullptr && p.page_size % kPageRows != 0;
  }

  static constexpr uint32_t kQBytes = kBlockM * kHeadDim * sizeof(Element);
  static constexpr uint32_t kKVBytes = kBlockN * kHeadDim * sizeof(Element);

  struct SharedStorage {
    alignas(1024) Element q[cosize_v<SmemLayoutQs>];  // Q, then this tile's O on its way out
    alignas(1024) Element k[cosize_v<SmemLayoutKV>];
    alignas(1024) Element v[cosize_v<SmemLayoutKV>];
    alignas(8) uint64_t q_full[kQBuffers], q_empty[kQBuffers];
    uint64_t k_full[kStages], k_empty[kStages], v_full[kStages], v_empty[kStages];
    // kDynamicTiles: the producer's two-slot ring of tile indices for the consumers (full: written; empty: read
    // by every consumer thread). Within the 1024 bytes the table keeps for barriers.
    uint64_t tile_full[2], tile_empty[2];
    int64_t tile_index[2];
  };
  // Q buffer b starts at q + b * cosize(SmemLayoutQ) (the buffer mode is the outermost; the epilogue's O uses it).
  static_assert(cosize_v<SmemLayoutQs> == kQBuffers * cosize_v<SmemLayoutQ>);
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
  static_assert(kSmemBytes <= 227 * 1024, "over the sm90 shared-memory limit per block");
  static_assert(kSmemBytes == kTile.smem_bytes(), "the table's size is the layouts' size");
};

// The TMA descriptors, passed to the kernel as one __grid_constant__ parameter.
template <class Kt>
struct TmaParams {
  typename Kt::TmaQ q;
  typename Kt::TmaKV k, v;
  typename Kt::TmaKVPage k_page, v_page;  // page pools (FwdParams::block_table); else over k and v, never loaded
};

}  // namespace sinkattn::sm90
