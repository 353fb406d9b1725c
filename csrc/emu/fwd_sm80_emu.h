// fwd_sm80_emu.h: the sm80 forward kernel body run on the CPU under host emulation (compiled by the host
// C++ compiler; no CUDA, no torch). Same configurations, grid order and block indices as run_fwd_sm80.
#pragma once
#include "build_info.h"
#include "emu/emu_launch.h"
#include "emu/emu_prims.h"
#include "params.h"
#include "sm80/fwd_config.h"
#include "sm80/fwd_kernel.h"

#define SINKATTN_FWD_FEATURES "sinks,sink_tokens,causal,window,softcap,gqa,varlen"

namespace sinkattn {

template <int kHeadDim, class Element>
void run_fwd_sm80_emulated(FwdParams const& p, EmuLaunch const& launch) {
  sm80::with_fwd_config<kHeadDim, Element, emu::EmuPrims>(launch.max_smem_per_block, [&]<class Kt>() {
    int const num_m_blocks = (p.seqlen_q + Kt::kBlockM - 1) / Kt::kBlockM;
    int64_t const grid = int64_t(num_m_blocks) * p.nheads * p.batch;
    emu::launch(grid, Kt::kNThreads, Kt::kSmemBytes, [&](int64_t bid, int tid, char* smem) {
      int const m_block = num_m_blocks - 1 - int(bid % num_m_blocks);
      int const bh = int(bid / num_m_blocks);
      sm80::fwd_block<Kt>(p, smem, tid, m_block, bh / p.nheads, bh % p.nheads);
    });
  });
}

}  // namespace sinkattn
