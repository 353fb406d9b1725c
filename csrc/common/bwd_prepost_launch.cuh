// bwd_prepost_launch.cuh: the backward's pre- and postprocess (common/bwd_prepost.h) as CUDA kernels, and the
// three-step launch every backward shares: preprocess, the arch's main kernel, postprocess (params.h).
#pragma once
#include <cstdint>
#include <cuda_runtime.h>
#include <stdexcept>
#include <string>

#include "common/bwd_prepost.h"
#include "params.h"

namespace sinkattn {

namespace bwd_prepost {

// One thread per (sequence, head, row).
template <class Element>
__global__ void preprocess_kernel(__grid_constant__ const BwdParams p) {
  int64_t const rows = int64_t(p.batch) * p.nheads * p.seqlen_q;
  for (int64_t r = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; r < rows; r += int64_t(gridDim.x) * blockDim.x) {
    int const i = int(r % p.seqlen_q), h = int((r / p.seqlen_q) % p.nheads), b = int(r / (int64_t(p.seqlen_q) * p.nheads));
    bwd_preprocess_row<Element>(p, b, h, i);
  }
}

template <class Element>
__global__ void postprocess_kernel(__grid_constant__ const BwdParams p) {
  int64_t const nq = int64_t(p.total_q) * p.nheads * p.headdim, nk = int64_t(p.total_k) * p.nheads_k * p.headdim;
  int64_t const stride = int64_t(gridDim.x) * blockDim.x;
  int64_t const first = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t e = first; e < nq; e += stride) bwd_convert_dq<Element>(p, e);
  for (int64_t e = first; e < nk; e += stride) bwd_convert_dkv<Element>(p, e);
  if (p.dsinks)
    for (int64_t h = first; h < p.nheads; h += stride) bwd_sum_dsinks(p, int(h));
}

inline unsigned elementwise_blocks(int64_t n) {
  int64_t b = (n + 255) / 256;
  return unsigned(b < 1 ? 1 : b > (1 << 16) ? (1 << 16) : b);
}

}  // namespace bwd_prepost

// Preprocess, main(p, stream), postprocess. The main kernel adds dQ over whole dq_accum rows of kHeadDim columns.
template <int kHeadDim, class Element, class Main>
void run_bwd_steps(BwdParams const& p, cudaStream_t stream, Main&& main) {
  if (p.headdim_rounded != kHeadDim)
    throw std::runtime_error("sinkattn bwd: headdim_rounded " + std::to_string(p.headdim_rounded) +
                             " is not the kernel's head dim " + std::to_string(kHeadDim));
  int64_t const rows = int64_t(p.batch) * p.nheads * p.seqlen_q;
  if (rows > 0)
    bwd_prepost::preprocess_kernel<Element><<<bwd_prepost::elementwise_blocks(rows), 256, 0, stream>>>(p);
  main(p, stream);
  int64_t const n = int64_t(p.total_q) * p.nheads * p.headdim;
  int64_t const nk = int64_t(p.total_k) * p.nheads_k * p.headdim;
  bwd_prepost::postprocess_kernel<Element><<<bwd_prepost::elementwise_blocks(n > nk ? n : nk), 256, 0, stream>>>(p);
}

}  // namespace sinkattn
