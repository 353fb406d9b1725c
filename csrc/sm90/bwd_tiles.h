// bwd_tiles.h: the tile table of the sm90 backward (no CuTe, no CUDA: the kernel's traits, the launcher, api.cpp's
// deterministic-mode counters and the registry read it).
#pragma once

// What the sm90 backward serves (recorded in the registry, shown by the report), on the GPU and under host emulation:
// all of the sm80 backward's.
#define SINKATTN_BWD_SM90_FEATURES "sinks,sink_tokens,causal,window,softcap,gqa,varlen,deterministic"

namespace sinkattn::sm90 {

struct BwdTile {
  int head_dim;
  int block_m;       // query rows per step (the M tiles of the key block's range, one after another)
  int block_n = 128;  // keys per CTA: two consumer warpgroups of 64 (a wgmma is 64 rows tall; S^T = K Q^T)
  int stages = 2;     // Q / dO / LSE / delta buffers in flight
  int producer_regs = 40, consumer_regs = 232;  // setmaxnreg: 128 * (40 + 2 * 232) = 64512 per SM

  // Q and dO (stages each), K and V, dS (two buffers), then LSE and delta (stages each), the barriers and the
  // CTA's work (256 bytes), rounded up to 1024 bytes.
  constexpr int smem_bytes() const {
    int const tiles = (2 * stages * block_m * head_dim + 2 * block_n * head_dim + 2 * block_m * block_n) * 2;
    int const rows = stages * block_m * 2 * 4 + 256;
    return tiles + (rows + 1023) / 1024 * 1024;
  }
};

// Registers per consumer thread (fp32 accumulators): dK and dV of its 64 keys (head_dim), S^T and dP^T
// (block_m / 2 each), dQ's share (32). Head dim 64 takes 128-query steps (the dQ product splits its M between
// the warpgroups); head dim 128 takes 64 (dQ splits its N). Head dim 256 has no tile: dK and dV alone would take
// 256 registers per thread; the sm80 backward serves it (the capability report says so).
// The head dims specialized here are those the sm90 backward is compiled for (generate_kernels.py reads them as
// it reads fwd_tiles.h's FwdTileOf): no hd256 unit is written.
template <int kHeadDim> struct BwdTileOf;
template <> struct BwdTileOf<64> { static constexpr BwdTile tile{64, 128, 128, 2, 24, 240}; };
template <> struct BwdTileOf<128> { static constexpr BwdTile tile{128, 64}; };

template <int kHeadDim>
constexpr int bwd_min_smem() { return BwdTileOf<kHeadDim>::tile.smem_bytes(); }

}  // namespace sinkattn::sm90
