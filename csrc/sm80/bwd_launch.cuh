// bwd_launch.cuh: the __global__ wrappers and launcher of the sm80 backward (nvcc only, no torch).
#pragma once
#include <cuda_runtime.h>
#include <stdexcept>
#include <string>

#include "build_info.h"
#include "common/bwd_prepost_launch.cuh"
#include "params.h"
#include "sm80/bwd_config.h"
#include "sm80/bwd_kernel.h"
#include "sm80/launch_tile.cuh"
#include "sm80/prims_gpu.cuh"

namespace sinkattn {

namespace sm80 {

template <class Kt>
__global__ void __launch_bounds__(Kt::kNThreads) bwd_kernel(__grid_constant__ const BwdParams p, BwdTileOrder const grid) {
  extern __shared__ __align__(128) char smem[];
  int n_block, split, head, batch;
  grid.decode(blockIdx.x, n_block, split, head, batch);
  bwd_block<Kt>(p, smem, threadIdx.x, n_block, batch, head);
}

template <class Kt>
void launch_bwd_tile(BwdParams const& p, cudaStream_t stream) {
  BwdTileOrder const grid = bwd_tile_order<Kt::kBlockN>(p);
  if (grid.count() == 0) return;
  if (Kt::kSmemBytes > p.max_smem_per_block) {  // head dim 256 on a 99 KB device (dispatch declines it first)
    throw std::runtime_error("sinkattn bwd: the sm80 backward for head dim " + std::to_string(Kt::kHeadDim) +
                             " needs " + std::to_string(Kt::kSmemBytes / 1024) +
                             " KB of shared memory per block; this device has " +
                             std::to_string(p.max_smem_per_block / 1024) + " KB");
  }
  launch_tile_kernel("bwd", bwd_kernel<Kt>, grid.count(), Kt::kNThreads, Kt::kSmemBytes, stream, p, grid);
}

// The tiles of `kUnit` for this problem. As in the forward (fwd_launch.cuh), the generator compiles each part
// of the tile table in its own translation unit and declares it extern in the launcher's.
template <int kHeadDim, class Element, BwdUnit kUnit>
void launch_bwd_part(BwdParams const& p, cudaStream_t stream) {
  with_bwd_config<kHeadDim, Element, GpuPrims>(p.max_smem_per_block, p.softcap, [&]<class Kt>() {
    if constexpr (bwd_unit_of<Kt> == kUnit) launch_bwd_tile<Kt>(p, stream);
  });
}

}  // namespace sm80

template <int kHeadDim, class Element>
void run_bwd_sm80(BwdParams const& p, cudaStream_t stream) {
  run_bwd_steps<kHeadDim, Element>(p, stream, [](BwdParams const& p, cudaStream_t stream) {
    sm80::with_bwd_config<kHeadDim, Element, sm80::GpuPrims>(p.max_smem_per_block, p.softcap, [&]<class Kt>() {
      sm80::launch_bwd_part<kHeadDim, Element, sm80::bwd_unit_of<Kt>>(p, stream);
    });
  });
}

}  // namespace sinkattn
