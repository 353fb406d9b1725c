// fwd_tiles.h: the tile table of the sm90 forward (no CuTe, no CUDA: the kernel's traits, the launcher and the
// registry read it). One tile per head dim; the tuning grid of `make gpu-sweep` (sweep_grid.py SWEEP_SM90)
// compiles other FwdTile values beside them, which dispatch never picks.
#pragma once

// What every sm90 forward tile serves (recorded in the registry, shown by the report), on the GPU and under host
// emulation; fwd_features below adds what a tile's own shape allows.
#define SINKATTN_FWD_SM90_FEATURES "sinks,sink_tokens,causal,window,softcap,gqa,varlen,kvcache,paged16,split_kv"

namespace sinkattn::sm90 {

struct FwdTile {
  int head_dim, block_n, stages;
  // setmaxnreg budgets, 128 * (producer + consumer warpgroups * consumer) <= 64512 registers per SM (one CTA per
  // SM). The producer only computes block ranges and TMA coordinates; the consumers hold S, P and O.
  int producer_regs = 40, consumer_regs = 232;
  // M rows: one consumer warpgroup per 64 (a wgmma is 64 rows tall, so a row's softmax stays in one warpgroup).
  int block_m = 128;
  // Consumer warpgroups take turns at the tensor cores (named barriers, round robin): one issues its GEMMs
  // while the others run their softmax. false: each issues when ready.
  bool pingpong = true;
  // Q buffers: with 2 the producer loads the next tile's Q while this tile's main loop still reads its own
  // (Q's buffer also carries the tile's O out, so with 1 the next Q waits for the epilogue).
  int q_buffers = 1;
  // Tiles after a CTA's first come from a global counter (the producer draws the next, the consumers read it from
  // shared memory), so a CTA that finishes early takes more; false: CTA c takes c, c + grid, c + 2 grid, ...
  bool dynamic_tiles = false;

  // Q (q_buffers of them), then `stages` K and V blocks, each 1024-byte aligned, and 1024 bytes for the barriers.
  constexpr int smem_bytes() const { return (q_buffers * block_m + 2 * stages * block_n) * head_dim * 2 + 1024; }
  constexpr int consumer_warpgroups() const { return block_m / 64; }
  // Whether the producer warpgroup gathers pages that are not a multiple of the 16-row TMA box (fwd_kernel.cuh
  // KvGather): a static tile walk (every producer thread walks it), 40 producer registers (within 24 the gather
  // spilled, and the TMA path with it; within 32 at hd256, 3 spill loads per key block), and whole rows per thread
  // (block_n a multiple of 128, or fewer rows than threads).
  constexpr bool gathers_pages() const {
    return !dynamic_tiles && producer_regs >= 40 && (block_n % 128 == 0 || block_n < 128);
  }
  // Whether that gather also decodes FP8 caches: each thread then owns whole rows (block_n a multiple of 128, or one
  // row per thread where 128 threads do not share the rows evenly), whose codes it decodes in place
  // (fwd_kernel.cuh KvGather::copy_fp8).
  constexpr bool gathers_fp8() const { return gathers_pages() && (block_n % 128 == 0 || 128 % block_n != 0); }
};

// A tile's registry features: every tile's, "paged" (any page size) where it gathers pages, "tile_counter" (it needs
// one) where its tiles are drawn dynamically.
constexpr char const* fwd_features(FwdTile t) {
  return t.dynamic_tiles ? SINKATTN_FWD_SM90_FEATURES ",tile_counter"
         : t.gathers_pages() ? SINKATTN_FWD_SM90_FEATURES ",paged"
                             : SINKATTN_FWD_SM90_FEATURES;
}
// The same kernel's registry entry for FP8 caches (op "fwd_fp8", run_fwd_fp8_sm90): the gather decodes them, so a tile
// that does not lists no "fp8_kv" (dispatch then names the sm80 kernels).
constexpr char const* fwd_fp8_features(FwdTile t) {
  return t.gathers_fp8() ? SINKATTN_FWD_SM90_FEATURES ",paged,fp8_kv" : SINKATTN_FWD_SM90_FEATURES;
}

// Shared memory 113 / 161 / 193 KB for head dim 64 / 128 / 256; a block of 48 keys at head dim 256 keeps O
// (128 fp32 registers per thread) and S within the consumers' registers: 224 of them (sm_90a: no spill, the key-block
// loop's path 582 instructions against 579 at 240), so that its producer has the 40 its gather needs (at 24 the
// gather spilled; at 40 it keeps 5 values of a tile in local memory, none per block).
// The head dims specialized here are those the sm90 forward is compiled for: csrc/generate_kernels.py reads
// them, strictly (each `template <> struct FwdTileOf<N> {` at a line's start), and writes no unit for any other.
template <int kHeadDim> struct FwdTileOf;
template <> struct FwdTileOf<64> { static constexpr FwdTile tile{64, 128, 3}; };
template <> struct FwdTileOf<128> { static constexpr FwdTile tile{128, 128, 2}; };
template <> struct FwdTileOf<256> { static constexpr FwdTile tile{256, 48, 2, 40, 224}; };

template <int kHeadDim>
constexpr int fwd_min_smem() { return FwdTileOf<kHeadDim>::tile.smem_bytes(); }

// The table's tile for a head dim the forward serves (64, 128 or 256 after rounding up): the host sizes the split-KV
// count with its block shape (api.cpp fwd_kvcache).
// (Through fwd_tile_of: csrc/generate_kernels.py reads each specialization's head dim from the text, strictly.)
template <int kHeadDim>
constexpr FwdTile fwd_tile_of() { return FwdTileOf<kHeadDim>::tile; }
constexpr FwdTile fwd_tile_for(int head_dim) {
  return head_dim <= 64 ? fwd_tile_of<64>() : head_dim <= 128 ? fwd_tile_of<128>() : fwd_tile_of<256>();
}

}  // namespace sinkattn::sm90
