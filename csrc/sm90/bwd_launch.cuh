// bwd_launch.cuh: the host side of the sm90 backward: TMA descriptors, the grid, and the three steps (nvcc only,
// no torch).
#pragma once
#include <cuda_runtime.h>
#include <stdexcept>
#include <string>

#include "build_info.h"
#include "common/bwd_prepost_launch.cuh"
#include "params.h"
#include "sm90/bwd_host.h"
#include "sm90/bwd_kernel.cuh"


namespace sinkattn {

namespace sm90 {

template <class Tile, class Element>
void launch_bwd(BwdParams const& p, cudaStream_t stream) {
  using Kt = BwdTraits<Tile, Element>;
  if (!bwd_has_work<Kt>(p)) return;
  BwdTileOrder const grid = bwd_grid<Kt>(p);
  BwdTmaParams<Kt> const tma = bwd_tma_params<Kt, GpuPrims>(p);
  auto kernel = p.softcap > 0.f ? bwd_kernel<Kt, true> : bwd_kernel<Kt, false>;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Kt::kSmemBytes);
  kernel<<<unsigned(grid.count()), Kt::kNThreads, Kt::kSmemBytes, stream>>>(p, tma, grid);
}

}  // namespace sm90

template <int kHeadDim, class Element>
void run_bwd_sm90(BwdParams const& p, cudaStream_t stream) {
  run_bwd_steps<kHeadDim, Element>(p, stream, [](BwdParams const& p, cudaStream_t stream) {
    sm90::launch_bwd<sm90::BwdTileOf<kHeadDim>, Element>(p, stream);
  });
}

}  // namespace sinkattn
