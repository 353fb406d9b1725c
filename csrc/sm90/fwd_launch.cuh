// fwd_launch.cuh: the host side of the sm90 forward kernel: tile configuration, TMA descriptors, the
// persistent grid (nvcc only, no torch).
//
// Serves what api.cpp routes here: padded or varlen q/k/v, every mask, sinks, softcap, GQA; and attention over a KV
// cache (seqused_k; contiguous, or a page pool: 16-row TMA boxes, or the producer warpgroup's gather for other page
// sizes where the tile allows it), padded queries or the serving call's packed ones (one launch per batch),
// GQA-packed over caches. Split-KV and FP8 caches stay on the sm80 kernels (docs/DESIGN.md section 4).
#pragma once
#include <cuda_runtime.h>
#include <stdexcept>

#include "build_info.h"
#include "params.h"
#include "sm90/fwd_host.h"
#include "sm90/fwd_kernel.cuh"


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
  using Kt = FwdTraits<Tile, Element>;
  if (!fwd_has_work<Kt>(p)) return;
  PersistentTileOrder const sched = fwd_schedule<Kt>(p);
  int64_t const tiles = sched.count();
  TmaParams<Kt> const tma = fwd_tma_params<Kt, GpuPrims>(p);

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
