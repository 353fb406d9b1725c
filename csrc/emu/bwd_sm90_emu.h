// bwd_sm90_emu.h: the sm90 backward (preprocess, the main kernel body sm90/bwd_kernel.cuh bwd_cta, postprocess) run
// on the CPU under host emulation (emu/sm90_prims.h HostPrims; host C++ compiler, no CUDA, no torch). Same tile,
// grid order and descriptors as sm90/bwd_launch.cuh (both through sm90/bwd_host.h); the pre- and postprocess are
// the host loops the sm80 emulation runs (common/bwd_prepost.h).
#pragma once
#include "emu/sm90_prims.h"  // first: CuTe reads its host __cvta_generic_to_shared when first parsed

#include <stdexcept>
#include <string>

#include "build_info.h"
#include "common/bwd_prepost.h"
#include "emu/emu_launch.h"
#include "params.h"
#include "sm90/bwd_host.h"
#include "sm90/bwd_kernel.cuh"

namespace sinkattn {

namespace sm90 {

template <class Tile, class Element>
void launch_bwd_emulated(BwdParams const& p) {
  using Kt = BwdTraits<Tile, Element>;
  if (!bwd_has_work<Kt>(p)) return;
  BwdTileOrder const grid = bwd_grid<Kt>(p);
  BwdTmaParams<Kt> const tma = bwd_tma_params<Kt, emu90::HostPrims>(p);
  // CTAs run one after another in grid order (key blocks from the first up): the deterministic mode's turns come
  // in the order they are waited for.
  emu90::launch_cta_grid(grid.count(), Kt::kNThreads, Kt::kSmemBytes, [&](char* smem) {
    if (p.softcap > 0.f) bwd_cta<Kt, emu90::HostPrims, true>(p, tma, grid, smem);
    else bwd_cta<Kt, emu90::HostPrims, false>(p, tma, grid, smem);
  });
}

}  // namespace sm90

template <int kHeadDim, class Element>
void run_bwd_sm90_emulated(BwdParams const& p, EmuLaunch const&) {
  if (p.headdim_rounded != kHeadDim)  // the kernel adds dQ over whole dq_accum rows of kHeadDim columns
    throw std::runtime_error("sinkattn bwd: headdim_rounded " + std::to_string(p.headdim_rounded) +
                             " is not the kernel's head dim " + std::to_string(kHeadDim));
  for (int b = 0; b < p.batch; ++b)
    for (int h = 0; h < p.nheads; ++h)
      for (int i = 0; i < p.seqlen_q; ++i) bwd_preprocess_row<Element>(p, b, h, i);
  sm90::launch_bwd_emulated<sm90::BwdTileOf<kHeadDim>, Element>(p);
  for (int64_t e = 0; e < int64_t(p.total_q) * p.nheads * p.headdim; ++e) bwd_convert_dq<Element>(p, e);
  for (int64_t e = 0; e < int64_t(p.total_k) * p.nheads_k * p.headdim; ++e) bwd_convert_dkv<Element>(p, e);
  if (p.dsinks)
    for (int h = 0; h < p.nheads; ++h) bwd_sum_dsinks(p, h);
}

}  // namespace sinkattn
