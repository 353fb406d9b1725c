// fwd_host.h: the host side of the sm90 forward that the GPU launcher (sm90/fwd_launch.cuh) and the host emulation's
// (emu/fwd_sm90_emu.h) share: the tile order, the checks of what the kernel needs, and the TMA descriptors, made
// through the implementation's make_tma_load (Prims: GpuPrims encodes through the driver, EmuPrims writes the host
// emulation's own description). No CUDA runtime, no torch.
#pragma once
#include <cstdint>
#include <stdexcept>
#include <string>

#include "common/seq_extent.h"
#include "common/tile_order.h"
#include "params.h"
#include "sm90/fwd_traits.h"
#include "sm90/tma_gmem.h"

namespace sinkattn::sm90 {

// Tiles (M block, head, sequence). Packed (the serving call, FwdParams::packed_tiles): M blocks numbered over every
// sequence (common/seq_extent.h packed_tile), their count from the padded total_q and batch alone, so the grid does
// not depend on the batch's mix (a CUDA graph captured at one size replays any batch of it).
// GQA-packed (FwdParams::pack_gqa): heads are the KV heads, and a sequence's rows are its queries times the group.
// Split-KV (num_splits > 1): each M block's splits are consecutive blocks of the order (fwd_kernel.cuh TileWork), so
// the split count multiplies the blocks (a 32-bit division in a tile's decode, not a 64-bit split dimension's).
template <class Kt>
PersistentTileOrder fwd_schedule(FwdParams const& p) {
  int const group = p.pack_gqa ? p.nheads / p.nheads_k : 1, heads = p.pack_gqa ? p.nheads_k : p.nheads;
  int const splits = p.num_splits > 1 ? p.num_splits : 1;
  int64_t const blocks = splits * (p.packed_tiles ? packed_tile_count(p.total_q, group, Kt::kBlockM, p.batch)
                                                  : (int64_t(p.seqlen_q) * group + Kt::kBlockM - 1) / Kt::kBlockM);
  if (blocks > int64_t(INT32_MAX))
    throw std::invalid_argument("sinkattn fwd: too many query rows (times key splits) for the sm90 forward's tile index");
  return PersistentTileOrder{int(blocks), 1, heads, p.packed_tiles ? 1 : p.batch};
}

// A call over q/k/v, or over a cache in q's dtype, as the kernel's parameters (FwdFp8Params, which one kernel takes for
// both entries: kv_fp8 0, no descales). The GPU and the emulated launchers' launch_fwd both pass through it.
inline FwdFp8Params fwd_kernel_params(FwdParams const& p) {
  FwdFp8Params fp;
  static_cast<FwdParams&>(fp) = p;
  return fp;
}

// Whether the forward has anything to write: no tile or no query row means no launch, and no descriptor is encoded
// (q would be an empty tensor). Throws where the kernel would fault.
template <class Kt>
bool fwd_has_work(FwdFp8Params const& p) {
  // The dynamic-tile kernels draw every tile after a CTA's first from this counter (fwd_kernel.cuh TileWalk); api.cpp
  // allocates it for kernels whose registry entry lists "tile_counter". Checked here too: a null counter would be
  // a fault on the GPU, not an error.
  if (Kt::kDynamicTiles && p.tile_counter == nullptr)
    throw std::invalid_argument("sinkattn fwd: this sm90 kernel draws its tiles from a global counter "
                                "(dynamic tiles) and needs p.tile_counter, a zeroed int32 on the device; got null");
  // A page pool is read in boxes of kPageRows rows of one page, or, for other page sizes, gathered by the producer
  // warpgroup (fwd_kernel.cuh PageRows, KvGather), which the dynamic tile walk does not allow.
  if (p.block_table != nullptr && p.page_size < 1)
    throw std::invalid_argument("sinkattn fwd: a page pool needs pages of at least one row (got " +
                                std::to_string(p.page_size) + ")");
  if (p.block_table != nullptr && p.page_size % Kt::kPageRows != 0 && !Kt::kCanGather)
    throw std::invalid_argument("sinkattn fwd: the sm90 forward at head dim " + std::to_string(Kt::kHeadDim) +
                                " reads pages only in boxes of " + std::to_string(Kt::kPageRows) +
                                " rows and needs a page size that is a multiple of " + std::to_string(Kt::kPageRows) +
                                " (got " + std::to_string(p.page_size) + "); backend='sm80' takes any page size");
  if (p.kv_fp8 != kFp8None && !Kt::kCanGatherFp8)
    throw std::invalid_argument("sinkattn fwd: the sm90 forward at head dim " + std::to_string(Kt::kHeadDim) +
                                " reads no FP8 cache (its producer does not gather); backend='sm80' reads them at "
                                "head dims 64 and 128, backend='reference' at any");
  if (p.num_splits > 1 && (p.out_accum == nullptr || p.lse_accum == nullptr))
    throw std::invalid_argument("sinkattn fwd: split-KV (num_splits > 1) writes its partial results to p.out_accum "
                                "and p.lse_accum (common/combine.h), which are null");
  int const rows_q = p.cu_seqlens_q != nullptr ? p.total_q : p.seqlen_q;
  return fwd_schedule<Kt>(p).count() > 0 && rows_q > 0;
}

// The descriptors of q, k and v, and of k and v in page boxes (fwd_has_work(p) must hold).
template <class Kt, class Prims>
TmaParams<Kt> fwd_tma_params(FwdFp8Params const& p) {
  using namespace cute;
  using Element = typename Kt::Element;
  GmemExtent const eq = q_extent(p), ekv = kv_extent(p);
  auto tensor = [&](void const* ptr, GmemExtent e, int heads, int64_t rs, int64_t hs, int64_t bs) {
    return tma_gmem_tensor<Element>(p, ptr, e.rows, heads, rs, hs, bs, e.batch);
  };
  auto const gQ = tensor(p.q, eq, p.nheads, p.q_row_stride, p.q_head_stride, p.q_batch_stride);
  // No key (seqlen_k == 0, every varlen sequence's keys empty, an empty pool): every tile's block range is empty, so
  // K and V are never loaded; their descriptors describe one row of q instead of an empty tensor (the kernel
  // prefetches them). A KV cache always has its capacity (p.seqlen_k) or its pool to describe.
  // An FP8 cache is never a TMA source either (the producer warpgroup gathers and decodes it): described so, its
  // byte strides would be read as Element strides.
  bool const any_key = p.kv_fp8 == kFp8None && (p.block_table != nullptr ? p.num_pages > 0
                                                : (p.cu_seqlens_k != nullptr ? p.total_k : p.seqlen_k) > 0);
  auto const stand_in = tensor(p.q, GmemExtent{1, 1}, 1, p.q_row_stride, p.q_head_stride, p.q_batch_stride);
  auto const gK = any_key ? tensor(p.k, ekv, p.nheads_k, p.k_row_stride, p.k_head_stride, p.k_batch_stride) : stand_in;
  auto const gV = any_key ? tensor(p.v, ekv, p.nheads_k, p.v_row_stride, p.v_head_stride, p.v_batch_stride) : stand_in;
  auto const block = take<0, 2>(typename Kt::SmemLayoutKV{});
  auto const page = typename Kt::SmemLayoutKVPage{};
  return TmaParams<Kt>{checked_tma(Prims::make_tma_load(gQ, typename Kt::SmemLayoutQ{}), "q"),
                       checked_tma(Prims::make_tma_load(gK, block), "k"),
                       checked_tma(Prims::make_tma_load(gV, block), "v"),
                       checked_tma(Prims::make_tma_load(gK, page), "k (page boxes)"),
                       checked_tma(Prims::make_tma_load(gV, page), "v (page boxes)")};
}

}  // namespace sinkattn::sm90
