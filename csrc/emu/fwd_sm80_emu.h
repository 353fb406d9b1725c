// fwd_sm80_emu.h: the sm80 forward kernel body run on the CPU under host emulation (compiled by the host
// C++ compiler; no CUDA, no torch). Same configurations, grid order and block indices as run_fwd_sm80.
#pragma once
#include "build_info.h"
#include "common/combine.h"
#include "emu/emu_launch.h"
#include "emu/sm80_prims.h"
#include "params.h"
#include "sm80/fwd_config.h"
#include "sm80/fwd_kernel.h"

namespace sinkattn {

namespace sm80 {

// One kernel configuration's grid, as launch_fwd_tile launches it on the GPU.
template <class Kt>
void launch_fwd_tile_emulated(typename Kt::Params const& p) {
  FwdTileOrder const grid = fwd_tile_order<Kt::kBlockM>(p);
  emu80::launch(grid.count(), Kt::kNThreads, Kt::kSmemBytes, [&](int64_t bid, int tid, char* smem) {
    int m_block, split, head, batch;
    grid.decode(bid, m_block, split, head, batch);
    fwd_block<Kt>(p, smem, tid, m_block, batch, head, split);
  });
}

// The tiles of `kUnit` (fwd_config.h FwdUnit), compiled in their own translation unit as on the GPU
// (sm80/fwd_launch.cuh), so the emulated forward of one head dim and dtype builds in parallel parts.
template <int kHeadDim, class Element, FwdUnit kUnit>
void launch_fwd_part_emulated(FwdParams const& p, EmuLaunch const& launch) {
  with_fwd_config<kHeadDim, Element, emu80::EmuPrims>(p, launch.max_smem_per_block, [&]<class Kt>() {
    if constexpr (fwd_unit_of<Kt> == kUnit) launch_fwd_tile_emulated<Kt>(p);
  });
}

// A tuning-grid variant under emulation (sm80/fwd_launch.cuh launch_fwd_variant): its tile checked on the CPU.
template <class Tile, class Element>
void launch_fwd_variant_emulated(FwdParams const& p, EmuLaunch const&) {
  launch_fwd_tile_emulated<FwdTraits<Tile, Element, emu80::EmuPrims, Softcap::kOff>>(p);
}

}  // namespace sm80

template <int kHeadDim, class Element>
void run_fwd_sm80_emulated(FwdParams const& p, EmuLaunch const& launch) {
  sm80::with_fwd_config<kHeadDim, Element, emu80::EmuPrims>(p, launch.max_smem_per_block, [&]<class Kt>() {
    sm80::launch_fwd_part_emulated<kHeadDim, Element, sm80::fwd_unit_of<Kt>>(p, launch);
  });
  if (p.num_splits > 1) combine_on_host<Element>(p);
}

// Decode over FP8 KV caches under emulation (sm80/fwd_launch.cuh run_fwd_fp8_sm80): the same tiles and grid.
template <int kHeadDim, class Element>
void run_fwd_fp8_sm80_emulated(FwdFp8Params const& p, EmuLaunch const& launch) {
  sm80::with_fwd_fp8_tile<kHeadDim>(
      sm80::choose_fwd_fp8_tile(kHeadDim, sm80::fwd_shape(p).rows, launch.max_smem_per_block), [&]<class Tile>() {
        sm80::launch_fwd_tile_emulated<sm80::FwdFp8Traits<Tile, Element, emu80::EmuPrims>>(p);
      });
  if (p.num_splits > 1) combine_on_host<Element>(p);
}

}  // namespace sinkattn
