// fwd_host.h: the host side of the sm90 forward that the GPU launcher (sm90/fwd_launch.cuh) and the host emulation's
// (emu/fwd_sm90_emu.h) share: the tile order, the checks of what the kernel needs, and the TMA descriptors, made
// through the implementation's make_tma_load (Prims: GpuPrims encodes through the driver, EmuPrims writes the host
// emulation's own description). No CUDA runtime, no torch.
#pragma once
#include <stdexcept>

#include "common/tile_order.h"
#include "params.h"
#include "sm90/fwd_traits.h"
#include "sm90/tma_gmem.h"

namespace sinkattn::sm90 {

template <class Kt>
PersistentTileOrder fwd_schedule(FwdParams const& p) {
  return PersistentTileOrder{(p.seqlen_q + Kt::kBlockM - 1) / Kt::kBlockM, 1, p.nheads, p.batch};
}

// Whether the forward has anything to write: no tile or no query row means no launch, and no descriptor is encoded
// (q would be an empty tensor). Throws where the kernel would fault.
template <class Kt>
bool fwd_has_work(FwdParams const& p) {
  // The dynamic-tile kernels draw every tile after a CTA's first from this counter (fwd_kernel.cuh TileWalk); api.cpp
  // allocates it for kernels whose registry entry lists "tile_counter". Checked here too: a null counter would be
  // a fault on the GPU, not an error.
  if (Kt::kDynamicTiles && p.tile_counter == nullptr)
    throw std::invalid_argument("sinkattn fwd: this sm90 kernel draws its tiles from a global counter "
                                "(dynamic tiles) and needs p.tile_counter, a zeroed int32 on the device; got null");
  int const rows_q = p.cu_seqlens_q != nullptr ? p.total_q : p.seqlen_q;
  return fwd_schedule<Kt>(p).count() > 0 && rows_q > 0;
}

// The descriptors of q, k and v (fwd_has_work(p) must hold).
template <class Kt, class Prims>
TmaParams<Kt> fwd_tma_params(FwdParams const& p) {
  using namespace cute;
  using Element = typename Kt::Element;
  bool const varlen = p.cu_seqlens_q != nullptr;
  int const rows_q = varlen ? p.total_q : p.seqlen_q, rows_k = varlen ? p.total_k : p.seqlen_k;
  auto tensor = [&](void const* ptr, int rows, int heads, int64_t rs, int64_t hs, int64_t bs) {
    return tma_gmem_tensor<Element>(p, ptr, rows, heads, rs, hs, bs);
  };
  auto const gQ = tensor(p.q, rows_q, p.nheads, p.q_row_stride, p.q_head_stride, p.q_batch_stride);
  // No key (seqlen_k == 0, or every varlen sequence's keys empty): every tile's block range is empty, so K and V
  // are never loaded; their descriptors describe one row of q instead of an empty tensor (the kernel prefetches
  // them).
  auto const gK = rows_k > 0 ? tensor(p.k, rows_k, p.nheads_k, p.k_row_stride, p.k_head_stride, p.k_batch_stride)
                             : tensor(p.q, 1, 1, p.q_row_stride, p.q_head_stride, p.q_batch_stride);
  auto const gV = rows_k > 0 ? tensor(p.v, rows_k, p.nheads_k, p.v_row_stride, p.v_head_stride, p.v_batch_stride)
                             : gK;
  return TmaParams<Kt>{checked_tma(Prims::make_tma_load(gQ, typename Kt::SmemLayoutQ{}), "q"),
                       checked_tma(Prims::make_tma_load(gK, take<0, 2>(typename Kt::SmemLayoutKV{})), "k"),
                       checked_tma(Prims::make_tma_load(gV, take<0, 2>(typename Kt::SmemLayoutKV{})), "v")};
}

}  // namespace sinkattn::sm90
