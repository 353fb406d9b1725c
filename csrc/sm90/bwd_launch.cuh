// bwd_launch.cuh: the host side of the sm90 backward: TMA descriptors, the grid, and the three steps (nvcc only,
// no torch).
#pragma once
#include <cuda_runtime.h>
#include <stdexcept>
#include <string>

#include "build_info.h"
#include "common/bwd_prepost_launch.cuh"
#include "params.h"
#include "sm90/bwd_kernel.cuh"

// What the sm90 backward serves (recorded in the registry, shown by the report): all of the sm80 backward's.
#define SINKATTN_BWD_SM90_FEATURES "sinks,sink_tokens,causal,window,softcap,gqa,varlen,deterministic"

namespace sinkattn {

namespace sm90 {

template <class Tile, class Element>
void launch_bwd(BwdParams const& p, cudaStream_t stream) {
  using namespace cute;
  using Kt = BwdTraits<Tile, Element>;
  // One CTA per (key block, query head, sequence), key blocks from the first up (common/tile_order.h: the
  // deterministic mode's order needs it).
  BwdTileOrder const grid{(p.seqlen_k + Kt::kBlockN - 1) / Kt::kBlockN, 1, p.nheads, p.batch};
  if (grid.count() == 0) return;
  if (grid.count() > int64_t(0x7fffffff)) throw std::runtime_error("sinkattn bwd: over 2^31 - 1 CTAs");
  bool const varlen = p.cu_seqlens_q != nullptr;
  auto tensor = [&](void const* ptr, int rows, int heads, int64_t rs, int64_t hs, int64_t bs) {
    return tma_gmem_tensor<Element>(p, ptr, rows, heads, rs, hs, bs);
  };
  int const rows_q = varlen ? p.total_q : p.seqlen_q, rows_k = varlen ? p.total_k : p.seqlen_k;
  // No query row (seqlen_q == 0, or every varlen sequence empty) or no key: no CTA would find an M tile, and the
  // empty tensor would get a TMA descriptor. dk_accum / dv_accum / dq_accum stay the zeros they were made as, and
  // the postprocess (run_bwd_steps) still turns them into dk / dv / dq and dsinks.
  if (rows_q == 0 || rows_k == 0) return;
  auto const gQ = tensor(p.q, rows_q, p.nheads, p.q_row_stride, p.q_head_stride, p.q_batch_stride);
  auto const gdO = tensor(p.dout, rows_q, p.nheads, p.o_row_stride, p.o_head_stride, p.o_batch_stride);
  auto const gK = tensor(p.k, rows_k, p.nheads_k, p.k_row_stride, p.k_head_stride, p.k_batch_stride);
  auto const gV = tensor(p.v, rows_k, p.nheads_k, p.v_row_stride, p.v_head_stride, p.v_batch_stride);
  auto const q_tile = take<0, 2>(typename Kt::SmemLayoutQ{});
  BwdTmaParams<Kt> const tma{checked_tma(GpuPrims::make_tma_load(gQ, q_tile), "q"),
                             checked_tma(GpuPrims::make_tma_load(gdO, q_tile), "dout"),
                             checked_tma(GpuPrims::make_tma_load(gK, typename Kt::SmemLayoutKV{}), "k"),
                             checked_tma(GpuPrims::make_tma_load(gV, typename Kt::SmemLayoutKV{}), "v")};
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
