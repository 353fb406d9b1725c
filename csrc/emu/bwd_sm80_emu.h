// bwd_sm80_emu.h: the sm80 backward (preprocess, main kernel body, postprocess) run on the CPU under host
// emulation. Same configurations, grid order and block indices as run_bwd_sm80.
#pragma once
#include <stdexcept>
#include <string>

#include "build_info.h"
#include "common/bwd_prepost.h"
#include "emu/emu_launch.h"
#include "emu/emu_prims.h"
#include "params.h"
#include "sm80/bwd_config.h"
#include "sm80/bwd_kernel.h"

namespace sinkattn {

template <int kHeadDim, class Element>
void run_bwd_sm80_emulated(BwdParams const& p, EmuLaunch const& launch) {
  if (p.headdim_rounded != kHeadDim)  // the kernel adds dQ over whole dq_accum rows of kHeadDim columns
    throw std::runtime_error("sinkattn bwd: headdim_rounded " + std::to_string(p.headdim_rounded) +
                             " is not the kernel's head dim " + std::to_string(kHeadDim));
  for (int b = 0; b < p.batch; ++b)
    for (int h = 0; h < p.nheads; ++h)
      for (int i = 0; i < p.seqlen_q; ++i) bwd_preprocess_row<Element>(p, b, h, i);
  sm80::with_bwd_config<kHeadDim, Element, emu::EmuPrims>(launch.max_smem_per_block, p.softcap, [&]<class Kt>() {
    BwdTileOrder const grid = sm80::bwd_tile_order<Kt::kBlockN>(p);
    emu::launch(grid.count(), Kt::kNThreads, Kt::kSmemBytes, [&](int64_t bid, int tid, char* smem) {
      int n_block, split, head, batch;
      grid.decode(bid, n_block, split, head, batch);
      sm80::bwd_block<Kt>(p, smem, tid, n_block, batch, head);
    });
  });
  for (int64_t e = 0; e < int64_t(p.total_q) * p.nheads * p.headdim; ++e) bwd_convert_dq<Element>(p, e);
  for (int64_t e = 0; e < int64_t(p.total_k) * p.nheads_k * p.headdim; ++e) bwd_convert_dkv<Element>(p, e);
  if (p.dsinks)
    for (int h = 0; h < p.nheads; ++h) bwd_sum_dsinks(p, h);
}

}  // namespace sinkattn
