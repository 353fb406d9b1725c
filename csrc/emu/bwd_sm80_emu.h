// bwd_sm80_emu.h: the sm80 backward (preprocess, main kernel body, postprocess) run on the CPU under host
// emulation. Same configurations, grid order and block indices as run_bwd_sm80.
#pragma once
#include "build_info.h"
#include "emu/bwd_emu_steps.h"
#include "emu/emu_launch.h"
#include "emu/sm80_prims.h"
#include "params.h"
#include "sm80/bwd_config.h"
#include "sm80/bwd_kernel.h"

namespace sinkattn {

template <int kHeadDim, class Element>
void run_bwd_sm80_emulated(BwdParams const& p, EmuLaunch const& launch) {
  run_bwd_steps_on_host<kHeadDim, Element>(p, [&] {
    sm80::with_bwd_config<kHeadDim, Element, emu80::EmuPrims>(launch.max_smem_per_block, p.softcap, [&]<class Kt>() {
      BwdTileOrder const grid = sm80::bwd_tile_order<Kt::kBlockN>(p);
      emu80::launch(grid.count(), Kt::kNThreads, Kt::kSmemBytes, [&](int64_t bid, int tid, char* smem) {
        int n_block, split, head, batch;
        grid.decode(bid, n_block, split, head, batch);
        sm80::bwd_block<Kt>(p, smem, tid, n_block, batch, head);
      });
    });
  });
}

}  // namespace sinkattn
