// fwd_launch.cuh: the __global__ wrapper and launcher of the sm80 forward kernel (nvcc only, no torch).
#pragma once
#include <cuda_runtime.h>

#include "build_info.h"
#include "params.h"
#include "sm80/fwd_config.h"
#include "sm80/fwd_kernel.h"
#include "sm80/prims_gpu.cuh"

#define SINKATTN_FWD_FEATURES "sinks,sink_tokens,causal,window,softcap,gqa,varlen"

namespace sinkattn {

namespace sm80 {

// One CTA per (M tile, head, batch) in a 1-D grid (no 65535 limit on batch * heads). M tiles vary fastest so
// neighbouring CTAs share K/V in L2, and the last M tiles (the heaviest under a causal mask) start first.
template <class Kt>
__global__ void __launch_bounds__(Kt::kNThreads) fwd_kernel(__grid_constant__ const FwdParams p, int num_m_blocks) {
  extern __shared__ __align__(128) char smem[];
  int const bid = blockIdx.x;
  int const m_block = num_m_blocks - 1 - bid % num_m_blocks;
  int const bh = bid / num_m_blocks;
  fwd_block<Kt>(p, smem, threadIdx.x, m_block, bh / p.nheads, bh % p.nheads);
}

}  // namespace sm80

template <int kHeadDim, class Element>
void run_fwd_sm80(FwdParams const& p, cudaStream_t stream) {
  sm80::with_fwd_config<kHeadDim, Element, sm80::GpuPrims>(p.max_smem_per_block, [&]<class Kt>() {
    int const num_m_blocks = (p.seqlen_q + Kt::kBlockM - 1) / Kt::kBlockM;
    int64_t const grid = int64_t(num_m_blocks) * p.nheads * p.batch;
    if (grid == 0) return;
    auto kernel = sm80::fwd_kernel<Kt>;
    if (Kt::kSmemBytes > 48 * 1024) {
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Kt::kSmemBytes);
    }
    kernel<<<dim3(unsigned(grid)), dim3(Kt::kNThreads), Kt::kSmemBytes, stream>>>(p, num_m_blocks);
  });
}

}  // namespace sinkattn
