// bwd_sm90_emu.h: the sm90 backward (preprocess, the main kernel body sm90/bwd_kernel.cuh bwd_cta, postprocess) run
// on the CPU under host emulation (emu/sm90_prims.h EmuPrims; host C++ compiler, no CUDA, no torch). Same tile,
// grid order and descriptors as sm90/bwd_launch.cuh (both through sm90/bwd_host.h); the pre- and postprocess are
// the host steps the sm80 emulation runs (emu/bwd_emu_steps.h).
#pragma once
#include "emu/sm90_prims.h"  // first: CuTe reads its host __cvta_generic_to_shared when first parsed

#include "build_info.h"
#include "emu/bwd_emu_steps.h"
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
  BwdTmaParams<Kt> const tma = bwd_tma_params<Kt, emu90::EmuPrims>(p);
  // CTAs run one after another in grid order (key blocks from the first up): the deterministic mode's turns come
  // in the order they are waited for.
  emu90::launch_cta_grid(grid.count(), Kt::kNThreads, Kt::kSmemBytes, [&](char* smem) {
    if (p.softcap > 0.f) bwd_cta<Kt, emu90::EmuPrims, true>(p, tma, grid, smem);
    else bwd_cta<Kt, emu90::EmuPrims, false>(p, tma, grid, smem);
  });
}

}  // namespace sm90

template <int kHeadDim, class Element>
void run_bwd_sm90_emulated(BwdParams const& p, EmuLaunch const&) {
  run_bwd_steps_on_host<kHeadDim, Element>(p, [&] {
    sm90::launch_bwd_emulated<sm90::BwdTileOf<kHeadDim>, Element>(p);
  });
}

}  // namespace sinkattn
