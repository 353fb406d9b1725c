// bwd_host.h: the host side of the sm90 backward's main step that the GPU launcher (sm90/bwd_launch.cuh) and the host
// emulation's (emu/bwd_sm90_emu.h) share: the grid, whether there is anything to do, and the TMA descriptors, made
// through the implementation's make_tma_load (Prims). No CUDA runtime, no torch.
#pragma once
#include <stdexcept>

#include "common/tile_order.h"
#include "params.h"
#include "sm90/bwd_traits.h"
#include "sm90/tma_gmem.h"

namespace sinkattn::sm90 {

// One CTA per (key block, query head, sequence), key blocks from the first up (common/tile_order.h: the
// deterministic mode's order needs it).
template <class Kt>
BwdTileOrder bwd_grid(BwdParams const& p) {
  return BwdTileOrder{(p.seqlen_k + Kt::kBlockN - 1) / Kt::kBlockN, 1, p.nheads, p.batch};
}

// No CTA, no query row (seqlen_q == 0, or every varlen sequence empty) or no key: no CTA would find an M tile, and
// the empty tensor would get a TMA descriptor. dk_accum / dv_accum / dq_accum stay the zeros they were made as, and
// the postprocess still turns them into dk / dv / dq and dsinks.
template <class Kt>
bool bwd_has_work(BwdParams const& p) {
  BwdTileOrder const grid = bwd_grid<Kt>(p);
  if (grid.count() > int64_t(0x7fffffff)) throw std::runtime_error("sinkattn bwd: over 2^31 - 1 CTAs");
  bool const varlen = p.cu_seqlens_q != nullptr;
  int const rows_q = varlen ? p.total_q : p.seqlen_q, rows_k = varlen ? p.total_k : p.seqlen_k;
  return grid.count() > 0 && rows_q > 0 && rows_k > 0;
}

template <class Kt, class Prims>
BwdTmaParams<Kt> bwd_tma_params(BwdParams const& p) {
  using namespace cute;
  using Element = typename Kt::Element;
  bool const varlen = p.cu_seqlens_q != nullptr;
  auto tensor = [&](void const* ptr, int rows, int heads, int64_t rs, int64_t hs, int64_t bs) {
    return tma_gmem_tensor<Element>(p, ptr, rows, heads, rs, hs, bs);
  };
  int const rows_q = varlen ? p.total_q : p.seqlen_q, rows_k = varlen ? p.total_k : p.seqlen_k;
  auto const gQ = tensor(p.q, rows_q, p.nheads, p.q_row_stride, p.q_head_stride, p.q_batch_stride);
  auto const gdO = tensor(p.dout, rows_q, p.nheads, p.o_row_stride, p.o_head_stride, p.o_batch_stride);
  auto const gK = tensor(p.k, rows_k, p.nheads_k, p.k_row_stride, p.k_head_stride, p.k_batch_stride);
  auto const gV = tensor(p.v, rows_k, p.nheads_k, p.v_row_stride, p.v_head_stride, p.v_batch_stride);
  auto const q_tile = take<0, 2>(typename Kt::SmemLayoutQ{});
  return BwdTmaParams<Kt>{checked_tma(Prims::make_tma_load(gQ, q_tile), "q"),
                          checked_tma(Prims::make_tma_load(gdO, q_tile), "dout"),
                          checked_tma(Prims::make_tma_load(gK, typename Kt::SmemLayoutKV{}), "k"),
                          checked_tma(Prims::make_tma_load(gV, typename Kt::SmemLayoutKV{}), "v")};
}

}  // namespace sinkattn::sm90
