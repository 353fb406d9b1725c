// fwd_sm90_emu.h: the sm90 forward kernel body (sm90/fwd_kernel.cuh fwd_cta) run on the CPU under host emulation
// (emu/sm90_prims.h EmuPrims; compiled by the host C++ compiler: no CUDA, no torch). Same tiles, tile order and
// descriptors as sm90/fwd_launch.cuh launch_fwd (both through sm90/fwd_host.h), on a persistent grid of
// EmuLaunch::sm_count CTAs, then the split-KV combine on the host.
#pragma once
#include "emu/sm90_prims.h"  // first: CuTe reads its host __cvta_generic_to_shared when first parsed

#include "build_info.h"
#include "common/combine.h"
#include "emu/emu_launch.h"
#include "params.h"
#include "sm90/fwd_host.h"
#include "sm90/fwd_kernel.cuh"

namespace sinkattn {

namespace sm90 {

template <class Tile, class Element>
void launch_fwd_kernel_emulated(FwdFp8Params const& p, EmuLaunch const& launch) {
  using Kt = FwdTraits<Tile, Element>;
  if (!fwd_has_work<Kt>(p)) return;
  PersistentTileOrder const sched = fwd_schedule<Kt>(p);
  TmaParams<Kt> const tma = fwd_tma_params<Kt, emu90::EmuPrims>(p);
  int64_t const grid = sched.count() < launch.sm_count ? sched.count() : launch.sm_count;
  emu90::launch_cta_grid(grid, Kt::kNThreads, Kt::kSmemBytes,
                         [&](char* smem) { fwd_cta<Kt, emu90::EmuPrims>(p, tma, sched, smem); });
  if (p.num_splits > 1) combine_on_host<Element>(p);
}
template <class Tile, class Element>
void launch_fwd_emulated(FwdParams const& p, EmuLaunch const& launch) {
  launch_fwd_kernel_emulated<Tile, Element>(fwd_kernel_params(p), launch);
}

}  // namespace sm90

template <int kHeadDim, class Element>
void run_fwd_sm90_emulated(FwdParams const& p, EmuLaunch const& launch) {
  sm90::launch_fwd_emulated<sm90::FwdTileOf<kHeadDim>, Element>(p, launch);
}
template <int kHeadDim, class Element>
void run_fwd_fp8_sm90_emulated(FwdFp8Params const& p, EmuLaunch const& launch) {
  sm90::launch_fwd_kernel_emulated<sm90::FwdTileOf<kHeadDim>, Element>(p, launch);
}

}  // namespace sinkattn
