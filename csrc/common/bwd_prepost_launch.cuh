// bwd_prepost_launch.cuh: the backward's pre- and postprocess (common/bwd_prepost.h) as CUDA kernels, and the
// three-step launch every backward shares: preprocess, the arch's main kernel, postprocess (params.h).
#pragma once
#include <cstdint>
#include <cuda_runtime.h>
#include <stdexcept>
#include <string>

#include <cutlass/cutlass.h>

#include "common/bwd_prepost.h"
#include "common/seq_extent.h"
#include "params.h"

namespace sinkattn {

namespace bwd_prepost {

// The preprocess, kHeadDim / 8 threads per row (16-byte loads of O and dO; a warp reads whole rows, coalesced), the
// group's partial dots summed by shuffles in a fixed tree (bitwise repeatable). One thread per row, as the host
// emulation does it, read each row's 2-byte elements in a stride across the warp's rows.
template <class Element, int kHeadDim>
__global__ void preprocess_kernel(__grid_constant__ const BwdParams p) {
  constexpr int kThreadsPerRow = kHeadDim / 8;
  static_assert(kThreadsPerRow >= 1 && kThreadsPerRow <= 32 && 32 % kThreadsPerRow == 0);
  int64_t const rows = int64_t(p.batch) * p.nheads * p.seqlen_q;
  int const sub = threadIdx.x % kThreadsPerRow, c0 = sub * 8;
  int64_t const step = int64_t(gridDim.x) * (blockDim.x / kThreadsPerRow);
  // Every lane of a warp runs the same number of iterations (the shuffles need the whole group): rows past the
  // end, or past their sequence, take part with a zero dot and write nothing.
  int64_t const first = int64_t(blockIdx.x) * (blockDim.x / kThreadsPerRow) + threadIdx.x / kThreadsPerRow;
  int64_t const iters = (rows + step - 1) / step;
  for (int64_t k = 0; k < iters; ++k) {
    int64_t const r = first + k * step;
    bool live = r < rows;
    int i = 0, h = 0, b = 0;
    float dot = 0.f;
    SeqExtent ext{};
    if (live) {
      i = int(r % p.seqlen_q), h = int((r / p.seqlen_q) % p.nheads), b = int(r / (int64_t(p.seqlen_q) * p.nheads));
      ext = seq_extent(p, b);
      live = i < ext.seqlen_q;
    }
    if (live && c0 < p.headdim) {
      int64_t const off = bwd_out_row_offset(p, ext, b, h, i) + c0;
      uint4 const ov = *reinterpret_cast<uint4 const*>(static_cast<Element const*>(p.out) + off);
      uint4 const dv = *reinterpret_cast<uint4 const*>(static_cast<Element const*>(p.dout) + off);
      Element const* oe = reinterpret_cast<Element const*>(&ov);
      Element const* de = reinterpret_cast<Element const*>(&dv);
      CUTLASS_PRAGMA_UNROLL
      for (int e = 0; e < 8; ++e) dot += float(oe[e]) * float(de[e]);
    }
    CUTLASS_PRAGMA_UNROLL
    for (int m = kThreadsPerRow / 2; m > 0; m /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, m);
    if (live && sub == 0) bwd_preprocess_finish(p, bwd_lse_index(p, b, h, i), h, dot);
  }
}

// dq, dk and dv converted, element by element.
template <class Element>
__global__ void postprocess_kernel(__grid_constant__ const BwdParams p) {
  int64_t const nq = int64_t(p.total_q) * p.nheads * p.headdim, nk = int64_t(p.total_k) * p.nheads_k * p.headdim;
  int64_t const stride = int64_t(gridDim.x) * blockDim.x;
  int64_t const first = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t e = first; e < nq; e += stride) bwd_convert_dq<Element>(p, e);
  for (int64_t e = first; e < nk; e += stride) bwd_convert_dkv<Element>(p, e);
}

// dsinks[h], a block of kSinkThreads per head: thread t sums rows t, t + kSinkThreads, ... of each sequence in
// order, then the block adds the threads' sums in a fixed tree (bitwise repeatable, no atomics). One thread per
// head, as before, read a head's rows one after another: 0.6 ms of the sm80 backward's 30 ms at 2 x 8192 tokens
// (bench/RESULTS.md, full vs full/sinks), a tenth of a backward at the sm90 target.
// (A template: every backward unit includes this header, and a template kernel links once.)
constexpr int kSinkThreads = 256;
template <int kThreads = kSinkThreads>
__global__ void __launch_bounds__(kThreads) dsinks_kernel(__grid_constant__ const BwdParams p) {
  __shared__ float part[kThreads];
  int const h = blockIdx.x, t = threadIdx.x;
  int const batches = p.cu_seqlens_q ? 1 : p.batch;
  int64_t const rows = p.cu_seqlens_q ? p.total_q : p.seqlen_q;
  float acc = 0.f;
  for (int b = 0; b < batches; ++b) {
    float const* r = p.dsink_rows + int64_t(b) * p.lse_batch_stride + int64_t(h) * p.lse_head_stride;
    for (int64_t i = t; i < rows; i += kThreads) acc += r[i];
  }
  part[t] = acc;
  __syncthreads();
  CUTLASS_PRAGMA_UNROLL
  for (int s = kThreads / 2; s > 0; s /= 2) {
    if (t < s) part[t] += part[t + s];
    __syncthreads();
  }
  if (t == 0) p.dsinks[h] = part[0];
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
  constexpr int kRowsPerBlock = 256 / (kHeadDim / 8);
  if (rows > 0)
    bwd_prepost::preprocess_kernel<Element, kHeadDim>
        <<<bwd_prepost::elementwise_blocks(rows * 256 / kRowsPerBlock), 256, 0, stream>>>(p);
  main(p, stream);
  int64_t const n = int64_t(p.total_q) * p.nheads * p.headdim;
  int64_t const nk = int64_t(p.total_k) * p.nheads_k * p.headdim;
  bwd_prepost::postprocess_kernel<Element><<<bwd_prepost::elementwise_blocks(n > nk ? n : nk), 256, 0, stream>>>(p);
  if (p.dsinks && p.nheads > 0) bwd_prepost::dsinks_kernel<><<<p.nheads, bwd_prepost::kSinkThreads, 0, stream>>>(p);
}

}  // namespace sinkattn
