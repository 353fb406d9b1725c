// fwd_launch.cuh: the __global__ wrapper and launcher of the sm80 forward kernel (nvcc only, no torch).
#pragma once
#include <cuda_runtime.h>

#include "build_info.h"
#include "common/combine.h"
#include "params.h"
#include "sm80/fwd_config.h"
#include "sm80/fwd_grid.h"
#include "sm80/fwd_kernel.h"
#include "sm80/prims_gpu.cuh"

namespace sinkattn {

namespace sm80 {

template <class Kt>
__global__ void __launch_bounds__(Kt::kNThreads) fwd_kernel(__grid_constant__ const FwdParams p, FwdGrid const grid) {
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

}  // namespace sm80

template <int kHeadDim, class Element>
void run_fwd_sm80(FwdParams const& p, cudaStream_t stream) {
  sm80::with_fwd_config<kHeadDim, Element, sm80::GpuPrims>(p, p.max_smem_per_block, [&]<class Kt>() {
    sm80::FwdGrid const grid = sm80::fwd_grid<Kt::kBlockM>(p);
    if (grid.size(p.batch) == 0) return;
    auto kernel = sm80::fwd_kernel<Kt>;
    if (Kt::kSmemBytes > 48 * 1024) {
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Kt::kSmemBytes);
    }
    kernel<<<dim3(unsigned(grid.size(p.batch))), dim3(Kt::kNThreads), Kt::kSmemBytes, stream>>>(p, grid);
  });
  if (p.num_splits > 1) {
    int64_t const rows = int64_t(p.batch) * p.nheads * p.seqlen_q;
    int const blocks = int(rows / 4 + 1 < (1 << 20) ? rows / 4 + 1 : (1 << 20));
    sm80::combine_kernel<Element><<<blocks, 128, 0, stream>>>(p);
  }
}

}  // namespace sinkattn
