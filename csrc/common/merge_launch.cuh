// merge_launch.cuh: the merge of two partial (out, lse) states as a CUDA kernel (every arch).
#pragma once
#include <cuda_runtime.h>
#include <cutlass/numeric_types.h>
#include "build_info.h"
#include "common/merge.h"
#include "params.h"

namespace sinkattn {

// One warp per (batch, row, head): the lse pair is read once per warp, lanes stride over the head dim.
template <class T>
__global__ void merge_kernel(MergeParams p) {
  int64_t const rows = int64_t(p.batch) * p.seqlen * p.nheads;
  int lane = threadIdx.x % 32;
  int64_t warps_total = int64_t(gridDim.x) * (blockDim.x / 32);
  for (int64_t r = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32; r < rows; r += warps_total) {
    int h = int(r % p.nheads);
    int64_t bs = r / p.nheads;
    int s = int(bs % p.seqlen);
    int b = int(bs / p.seqlen);
    float la = p.lse_a[b * p.la_batch_stride + h * p.la_head_stride + s * p.la_row_stride];
    float lb = p.lse_b[b * p.lb_batch_stride + h * p.lb_head_stride + s * p.lb_row_stride];
    float sink = p.sinks ? p.sinks[h] : -INFINITY;
    MergeWeights w = merge_weights(la, lb, sink);
    T const* oa = static_cast<T const*>(p.out_a) + b * p.oa_batch_stride + s * p.oa_row_stride + h * p.oa_head_stride;
    T const* ob = static_cast<T const*>(p.out_b) + b * p.ob_batch_stride + s * p.ob_row_stride + h * p.ob_head_stride;
    T* o = static_cast<T*>(p.out) + b * p.o_batch_stride + s * p.o_row_stride + h * p.o_head_stride;
    for (int d = lane; d < p.headdim; d += 32) {
      // A zero weight must not pick up NaN/inf from a partial that saw no key.
      float va = w.wa != 0.f ? w.wa * float(oa[d]) : 0.f;
      float vb = w.wb != 0.f ? w.wb * float(ob[d]) : 0.f;
      o[d] = T(va + vb);
    }
    if (lane == 0) p.lse[b * p.l_batch_stride + h * p.l_head_stride + s * p.l_row_stride] = w.lse;
  }
}

template <class T>
void run_merge(MergeParams const& p, cudaStream_t stream) {
  int64_t rows = int64_t(p.batch) * p.seqlen * p.nheads;
  if (rows == 0) return;
  constexpr int kWarps = 4;
  int64_t blocks = (rows + kWarps - 1) / kWarps;
  int grid = int(blocks < (1 << 20) ? blocks : (1 << 20));  // grid-stride beyond that
  merge_kernel<T><<<grid, kWarps * 32, 0, stream>>>(p);
}

}  // namespace sinkattn
