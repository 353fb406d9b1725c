// fwd_tile.cuh: the __global__ wrapper of the sm80 forward kernel, the launch of one tile configuration, and
// the split-KV combine (nvcc only, no torch). Which tile runs is fwd_launch.cuh's choice.
#pragma once
#include <cuda_runtime.h>

#include "common/combine.h"
#include "params.h"
#include "sm80/fwd_config.h"
#include "sm80/fwd_kernel.h"
#include "sm80/launch_tile.cuh"
#include "sm80/prims_gpu.cuh"

namespace sinkattn {

namespace sm80 {

// Key-group (decode) tiles declare at least one CTA per SM: without it ptxas held their 128 threads to 168
// registers and spilled 16-40 bytes; their shared memory, not registers, bounds how many CTAs share an SM.
template <class Kt>
__global__ void __launch_bounds__(Kt::kNThreads, Kt::kSplitKeys ? 1 : 0) fwd_kernel(__grid_constant__ const FwdParams p, FwdTileOrder const grid) {
  extern __shared__ __align__(128) char smem[];
  int m_block, split, head, batch;
  grid.decode(blockIdx.x, m_block, split, head, batch);
  fwd_block<Kt>(p, smem, threadIdx.x, m_block, batch, head, split);
}

// One warp per output row (batch, head, query).
template <class Element>
__global__ void combine_kernel(__grid_constant__ const FwdParams p) {
  int64_t const rows = int64_t(p.batch) * p.nheads * p.seqlen_q;
  int64_t const warps = int64_t(gridDim.x) * (blockDim.x / 32);
  for (int64_t r = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32; r < rows; r += warps) {
    int const i = int(r % p.seqlen_q), h = int((r / p.seqlen_q) % p.nheads), b = int(r / (int64_t(p.seqlen_q) * p.nheads));
    combine_row<Element>(p, b, h, i, threadIdx.x % 32, 32);
  }
}

// One tile configuration's launch.
template <class Kt>
void launch_fwd_tile(FwdParams const& p, cudaStream_t stream) {
  FwdTileOrder const grid = fwd_tile_order<Kt::kBlockM>(p);
  launch_tile_kernel("fwd", fwd_kernel<Kt>, grid.count(), Kt::kNThreads, Kt::kSmemBytes, stream, p, grid);
}

template <class Element>
void launch_fwd_combine(FwdParams const& p, cudaStream_t stream) {
  int64_t const rows = int64_t(p.batch) * p.nheads * p.seqlen_q;
  int const blocks = int(rows / 4 + 1 < (1 << 20) ? rows / 4 + 1 : (1 << 20));
  combine_kernel<Element><<<blocks, 128, 0, stream>>>(p);
}

}  // namespace sm80

}  // namespace sinkattn
