// fwd_launch.cuh: the host side of the sm90 forward kernel: tile configuration, TMA descriptors, the
// persistent grid (nvcc only, no torch).
//
// Serves what api.cpp routes here: padded or varlen q/k/v, every mask, sinks, softcap, GQA; and attention over a KV
// cache (seqused_k; contiguous, or a page pool: 16-row TMA boxes, or the producer warpgroup's gather for other page
// sizes where the tile allows it), padded queries or the serving call's packed ones (one launch per batch),
// GQA-packed over caches, FP8 caches decoded by the gather, split-KV (each split's partials, then the combine of
// common/combine_launch.cuh, shared with the sm80 forward).
#pragma once
#include <cuda_runtime.h>
#include <stdexcept>

#include "build_info.h"
#include "common/combine_launch.cuh"
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
void launch_fwd_kernel(FwdFp8Params const& p, cudaStream_t stream) {
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
  if (p.num_splits > 1) launch_fwd_combine<Element>(p, stream);
}

// The kernel's parameters are FwdFp8Params (FP8 caches: their format and descales), so one kernel serves both
// entries: q/k/v and caches in q's dtype through launch_fwd / run_fwd_sm90 (kv_fp8 0), FP8 caches through
// run_fwd_fp8_sm90. (Two names, not two overloads: the tuning grid registers &launch_fwd<Tile, Element>.)
template <class Tile, class Element>
void launch_fwd(FwdParams const& p, cudaStream_t stream) {
  launch_fwd_kernel<Tile, Element>(fwd_kernel_params(p), stream);
}

}  // namespace sm90

template <int kHeadDim, class Element>
void run_fwd_sm90(FwdParams const& p, cudaStream_t stream) {
  sm90::launch_fwd<sm90::FwdTileOf<kHeadDim>, Element>(p, stream);
}
template <int kHeadDim, class Element>
void run_fwd_fp8_sm90(FwdFp8Params const& p, cudaStream_t stream) {
  sm90::launch_fwd_kernel<sm90::FwdTileOf<kHeadDim>, Element>(p, stream);
}

}  // namespace sinkattn
