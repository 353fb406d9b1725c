// combine_launch.cuh: the split-KV combine on the GPU (nvcc only, no torch), run after a forward of either family
// (sm80, sm90) that split its keys: one warp per output row (common/combine.h; the host emulation runs the same rows
// through combine_on_host).
#pragma once
#include <cuda_runtime.h>

#include "common/combine.h"
#include "params.h"

namespace sinkattn {

template <class Element>
__global__ void combine_kernel(__grid_constant__ const FwdParams p) {
  int64_t const rows = combine_rows(p);
  int64_t const warps = int64_t(gridDim.x) * (blockDim.x / 32);
  for (int64_t r = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32; r < rows; r += warps)
    combine_row_at<Element>(p, r, threadIdx.x % 32, 32);
}

template <class Element>
void launch_fwd_combine(FwdParams const& p, cudaStream_t stream) {
  int64_t const rows = combine_rows(p);
  int const blocks = int(rows / 4 + 1 < (1 << 20) ? rows / 4 + 1 : (1 << 20));
  combine_kernel<Element><<<blocks, 128, 0, stream>>>(p);
}

}  // namespace sinkattn
