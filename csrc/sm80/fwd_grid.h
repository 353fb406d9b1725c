// fwd_grid.h: how the sm80 forward grid maps block indices to work; shared by the GPU launcher and the
// host emulation so both run the same blocks.
#pragma once
#include <cstdint>
#include "common/defs.h"
#include "params.h"

namespace sinkattn::sm80 {

// The grid: one CTA per (M tile, split, head, batch), flattened to 1-D (no 65535 limit on batch * heads).
// M tiles vary fastest so neighbouring CTAs share K/V in L2, and the last M tiles (the heaviest under a
// causal mask) start first. With GQA packing "head" is the KV head.
struct FwdGrid {
  int m_blocks, splits, heads;
  SA_HOST_DEVICE int64_t size(int batch) const { return int64_t(m_blocks) * splits * heads * batch; }
  SA_HOST_DEVICE void decode(int64_t bid, int& m_block, int& split, int& head, int& batch) const {
    m_block = m_blocks - 1 - int(bid % m_blocks);
    bid /= m_blocks;
    split = int(bid % splits);
    bid /= splits;
    head = int(bid % heads);
    batch = int(bid / heads);
  }
};

template <int kBlockM>
FwdGrid fwd_grid(FwdParams const& p) {
  int const group = p.pack_gqa ? p.nheads / p.nheads_k : 1;
  return FwdGrid{(p.seqlen_q * group + kBlockM - 1) / kBlockM, p.num_splits, p.pack_gqa ? p.nheads_k : p.nheads};
}

}  // namespace sinkattn::sm80
