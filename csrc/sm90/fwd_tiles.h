// fwd_tiles.h: the tile table of the sm90 forward (no CuTe, no CUDA: the kernel's traits, the launcher and the
// registry read it). One tile per head dim: M 128 (two consumer warpgroups of 64 rows).
#pragma once

namespace sinkattn::sm90 {

struct FwdTile {
  int head_dim, block_n, stages;
  // setmaxnreg budgets, 128 * producer + 256 * consumer <= 64512 registers per SM (one CTA per SM). The
  // producer only computes block ranges and TMA coordinates; the consumers hold S, P and O.
  int producer_regs = 40, consumer_regs = 232;

  static constexpr int kBlockM = 128;
  // Q, then `stages` K and V blocks, each 1024-byte aligned, and one more 1024 bytes for the barriers.
  constexpr int smem_bytes() const { return (kBlockM + 2 * stages * block_n) * head_dim * 2 + 1024; }
};

// Shared memory 113 / 161 / 193 KB for head dim 64 / 128 / 256; a block of 48 keys at head dim 256 keeps O
// (128 fp32 registers per thread) and S within the consumers' 240 registers.
template <int kHeadDim> struct FwdTileOf;
template <> struct FwdTileOf<64> { static constexpr FwdTile tile{64, 128, 3}; };
template <> struct FwdTileOf<128> { static constexpr FwdTile tile{128, 128, 2}; };
template <> struct FwdTileOf<256> { static constexpr FwdTile tile{256, 48, 2, 24, 240}; };

template <int kHeadDim>
constexpr int fwd_min_smem() { return FwdTileOf<kHeadDim>::tile.smem_bytes(); }

}  // namespace sinkattn::sm90
