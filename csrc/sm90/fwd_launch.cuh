// fwd_launch.cuh: the host side of the sm90 forward kernel: tile configuration, TMA descriptors, the
// persistent grid (nvcc only, no torch).
//
// Serves what api.cpp routes here: padded or varlen q/k/v, every mask, sinks, softcap, GQA. KV caches
// (seqused_k, paged), split-KV and GQA packing stay on the sm80 kernel (decode is memory-bound; the
// capability report says so).
#pragma once
#include <cuda_runtime.h>
#include <stdexcept>

#include "build_info.h"
#include "params.h"
#include "sm90/fwd_kernel.cuh"

// What the sm90 forward serves (recorded in the registry, shown by the report).
#define SINKATTN_FWD_SM90_FEATURES "sinks,sink_tokens,causal,window,softcap,gqa,varlen"

namespace sinkattn {

namespace sm90 {

inline int sm_count() {
  int dev = 0, n = 0;
  cudaGetDevice(&dev);
  static int cached[64] = {};
  if (dev < 64 && cached[dev]) return cached[dev];
  cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev);
  if (dev < 64) cached[dev] = n;
  return n;
}

// The kernel of one tile: the table's (run_fwd_sm90 below) or a tuning-grid variant's (registered by name,
// never picked by dispatch; sweep_grid.py SWEEP_SM90).
template <class Tile, class Element>
void launch_fwd(FwdParams const& p, cudaStream_t stream) {
  using namespace cute;
  using Kt = FwdTraits<Tile, Element>;
  bool const varlen = p.cu_seqlens_q != nullptr;
  // The dynamic-tile kernels draw every tile after a CTA's first from this counter (fwd_kernel.cuh TileWalk); api.cpp
  // allocates it for kernels whose registry entry lists "tile_counter". Checked here too: a null counter would be
  // a fault on the GPU, not an error.
  if (Kt::kDynamicTiles && p.tile_counter == nullptr)
    throw std::invalid_argument("sinkattn fwd: this sm90 kernel draws its tiles from a global counter "
                                "(dynamic tiles) and needs p.tile_counter, a zeroed int32 on the device; got null");
  PersistentTileOrder const sched{(p.seqlen_q + Kt::kBlockM - 1) / Kt::kBlockM, 1, p.nheads, p.batch};
  int64_t const tiles = sched.count();
  int const rows_q = varlen ? p.total_q : p.seqlen_q, rows_k = varlen ? p.total_k : p.seqlen_k;
  // No tile or no query row: nothing to write, and no descriptor is encoded (q would be an empty tensor).
  if (tiles == 0 || rows_q == 0) return;
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
  TmaParams<Kt> const tma{
      checked_tma(GpuPrims::make_tma_load(gQ, typename Kt::SmemLayoutQ{}), "q"),
      checked_tma(GpuPrims::make_tma_load(gK, take<0, 2>(typename Kt::SmemLayoutKV{})), "k"),
      checked_tma(GpuPrims::make_tma_load(gV, take<0, 2>(typename Kt::SmemLayoutKV{})), "v")};

  int const sms = sm_count();
  int const grid = int(tiles < sms ? tiles : sms);
  auto kernel = fwd_kernel<Kt>;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Kt::kSmemBytes);
  kernel<<<grid, Kt::kNThreads, Kt::kSmemBytes, stream>>>(p, tma, sched);
}

}  // namespace sm90

template <int kHeadDim, class Element>
void run_fwd_sm90(FwdParams const& p, cudaStream_t stream) {
  sm90::launch_fwd<sm90::FwdTileOf<kHeadDim>, Element>(p, stream);
}

}  // namespace sinkattn
