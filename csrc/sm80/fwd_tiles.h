// fwd_tiles.h: the tile table of the sm80 forward, and the one rule that picks a tile for a problem. No CuTe,
// no CUDA: the kernels (FwdTraits<Tile, ...> reads its fields), the launchers, the host emulation, api.cpp (the
// split-KV heuristic counts key blocks of the tile decode will run) and the registry (the shared memory the
// smallest tile needs) all read this one table.
//
// Shared memory of a tile: Q (block_m x d) plus `stages` K and V blocks (block_n x d), 2-byte elements.
// sm80 and sm87 allow 163 KB per block, sm86/sm89 99 KB, sm90 227 KB.
#pragma once
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include "common/defs.h"
#include "params.h"

namespace sinkattn::sm80 {

struct FwdTile {
  int head_dim, block_m, block_n, warps;
  int stages = 2;      // K/V blocks in shared memory: 2 is double buffering; more keep more bytes in flight (decode)
  int key_groups = 1;  // > 1: the warps also split each key block's keys (decode tiles of <= 32 real rows)
  // 1: each warp reads its Q fragments from shared memory once per tile and holds them in registers, instead of
  // once per key block (fwd_kernel.h). For a tile whose loop is bound by shared-memory reads and whose registers
  // leave the room at the same occupancy: the 8-warp hd128 prefill tile (216 -> 239 registers, one CTA per SM
  // either way; Q was 8 of its 72 ldmatrix per key block).
  int q_regs = 0;
  // 1: each iteration issues S = Q K^T of key block t + 1 in the same straight-line code as block t's softmax and
  // P V (fwd_kernel.h), so a warp's MMAs overlap its own softmax instead of waiting for the other warps of its
  // scheduler to fill the tensor pipe; K is loaded one block ahead of V, in the same two stages. For the 8-warp
  // hd128 prefill tile, whose two warps per scheduler are held in step by the block's barriers: one more S
  // accumulator (239 -> 246 registers on sm_80 and sm_90, no spill).
  int s_ahead = 0;
  // 1 (with s_ahead): the loop loads interior K/V blocks of a contiguous cache through predicated copies in
  // straight-line code, other blocks through the loader's branches (fwd_kernel.h). For sm_90 SASS, where the SASS
  // model puts the hd128 tile at 2957 cycles per key block instead of 3160: the branches' ~150 instructions per warp
  // ran with no MMA in flight. Not for sm_8x SASS: ptxas takes that loop to 255 registers (246) and stops overlapping
  // the exponentials with P V, 3362 cycles instead of 3182 (docs/internals.md).
  int branch_free_loads = 0;
  // > 0: the kernel's __launch_bounds__ asks for this many CTAs per SM, so ptxas holds each thread to 64K registers /
  // (threads x ctas_per_sm) and spills past that; 0 asks nothing (a prefill tile then takes up to 255). The two-CTA
  // prefill tiles (fwd_tiles::Hd64RowsTwoCtas, Hd128RowsTwoCtas) ask for 2: at most 255 registers, which is what two
  // CTAs of 128 threads allow anyway, said where the tile is declared.
  int ctas_per_sm = 0;
  // 1: a prefill tile, bound by its instructions rather than by K/V bytes, so a run-time feature test left in its
  // key-block loop costs time. Such a tile is compiled once per softcap setting, softcap a constant (the others, the
  // decode tiles: once, softcap a run-time flag; fwd_config.h), moves the running max lazily (fwd_traits.h
  // kLazyRebase) and loads interior blocks as whole tiles, others through the checked row loads (kv_loader.h). Set by
  // SINKATTN_PREFILL_TILE below and by the sweep's variants (csrc/sweep_grid.py), every one of them a prefill tile.
  int prefill = 0;

  constexpr FwdTile as_prefill() const {
    FwdTile t = *this;
    t.prefill = 1;
    return t;
  }
  constexpr int smem_bytes() const { return (block_m + 2 * stages * block_n) * head_dim * 2; }
  constexpr bool operator==(FwdTile const&) const = default;
};

// The tiles, each a type (kernels are templates on it; the name says what it is for) holding its FwdTile.
namespace fwd_tiles {
#define SINKATTN_FWD_TILE(name, ...) struct name { static constexpr FwdTile tile{__VA_ARGS__}; }
#define SINKATTN_PREFILL_TILE(name, ...) \
  struct name { static constexpr FwdTile tile = FwdTile{__VA_ARGS__}.as_prefill(); }
// Head dim 64. Key groups: 32 keys per warp per block; 98 KB: fits every arch, and two CTAs on an sm90 SM.
SINKATTN_FWD_TILE(Hd64Keys4, 64, 16, 128, 4, 3, 4);
SINKATTN_FWD_TILE(Hd64Keys2, 64, 32, 128, 4, 3, 2);       // 100 KB, 64 KB in flight: sm80, sm90
SINKATTN_FWD_TILE(Hd64Keys2Small, 64, 32, 128, 4, 2, 2);  // 68 KB, 32 KB in flight
// Few rows: kBlockN 128; with 64 the 3- and 4-stage tiles spill 4-16 bytes on sm_80 (at 168 registers).
SINKATTN_FWD_TILE(Hd64Few, 64, 64, 128, 4, 3);            // 104 KB, 64 KB in flight: sm80, sm90
SINKATTN_FWD_TILE(Hd64FewSmall, 64, 64, 128, 4, 2);       // 72 KB, 32 KB in flight
// Prefill: 4 warps of 32 rows, each K/V fragment read from shared memory feeds two 16-row MMA tiles (half the
// ldmatrix traffic per FLOP of 8 warps of 16 rows). 255 registers, no spill since the element mask compares
// against per-row bounds (TileMask::apply); before, it spilled 24-32 bytes on sm_90.
SINKATTN_PREFILL_TILE(Hd64Rows, 64, 128, 64, 4);          // 48 KB
// The same 128 rows of 4 warps with a third K/V stage, two CTAs per SM (64 KB each): where an SM holds two (cc 8.0 and
// 9.0). Three stages take one barrier a key block where two take two (fwd_kernel.h), so the two warps a scheduler
// runs (one of each CTA) meet fewer barriers between their MMAs. It replaced three CTAs of 64 rows (16 a warp, Q in
// registers), whose warps read each K and V fragment for one 16-row MMA tile: 0.5 ldmatrix.x4 per HMMA, all of an
// A100's shared-memory bandwidth at the tensor pipe's full rate, where 32 rows a warp read 0.31. By the SASS model, 2 x
// 8192 full / causal, the CTAs' warps in phase / their phases averaged (PERF_PHASES=4), FA2 in brackets: on an A100
// (sm_80, 255 registers, no spill) 181 / 172 -> 184 / 171 TFLOP/s (183 / 155), 180 / 171 -> 209 / 193 (203 / 182);
// on an H200 (sm_90, 248, no spill) 314 / 296 -> 312 / 293 (284 / 286), 303 / 285 -> 343 / 321 (320 / 316).
SINKATTN_PREFILL_TILE(Hd64RowsTwoCtas, 64, 128, 64, 4, 3, 1, 0, 0, 0, 2);  // 64 KB: sm80, sm90
// Head dim 128. Key groups: 16 (32) keys per warp per block. Big: two CTAs fit an sm90 SM (228 KB).
SINKATTN_FWD_TILE(Hd128Keys4, 128, 16, 64, 4, 3, 4);      // 100 KB: sm80, sm90
SINKATTN_FWD_TILE(Hd128Keys4Small, 128, 16, 64, 4, 2, 4); // 68 KB
SINKATTN_FWD_TILE(Hd128Keys2, 128, 32, 64, 4, 3, 2);      // 104 KB: sm80, sm90
SINKATTN_FWD_TILE(Hd128Keys2Small, 128, 32, 64, 4, 2, 2); // 72 KB
SINKATTN_FWD_TILE(Hd128Few, 128, 64, 64, 4, 3);           // 112 KB, 64 KB in flight: sm80, sm90
SINKATTN_FWD_TILE(Hd128FewSmall, 128, 64, 32, 4, 4);      // 80 KB, 48 KB in flight
SINKATTN_PREFILL_TILE(Hd128Rows, 128, 128, 64, 8, 2, 1, 1, 1);  // 96 KB: fits sm86 too; Q in registers, S ahead
SINKATTN_PREFILL_TILE(Hd128RowsSm90, 128, 128, 64, 8, 2, 1, 1, 1, 1);  // the same, its interior loads branch-free: sm90
// 128 rows of 4 warps (32 a warp) over 32-key blocks in three stages, two CTAs per SM (80 KB each): where an SM holds
// two (cc 8.0). Each K and V fragment read from shared memory feeds two 16-row MMA tiles, Q read each key block (no
// room for it in registers beside O's 128), one barrier a block. It replaced the S-ahead loop over 64 rows of 4 warps
// (16 a warp, Q in registers): 663 -> 519 instructions and 73 -> 62 shared-memory instructions per 128 HMMA of a
// warp, and by the SASS model on an A100 (sm_80, 250 registers, no spill), 2 x 8192 full / causal, in phase 194 / 181
// -> 207 / 188 TFLOP/s (FA2 201 / 181), phases averaged 210 / 196 -> 210 / 192 (FA2 221 / 200). Not on sm90, where
// the model puts it behind the 8-warp tile in phase (causal 0.96x of FA2 against 1.02x).
SINKATTN_PREFILL_TILE(Hd128RowsTwoCtas, 128, 128, 32, 4, 3, 1, 0, 0, 0, 2);  // 80 KB: sm80
// Head dim 256. Rows 17-32 keep the 64-row tile: two key groups (32 of 64 keys each) would take 144 KB.
SINKATTN_FWD_TILE(Hd256Keys4, 256, 16, 64, 4, 2, 4);      // 136 KB, 16 keys per warp: sm80, sm90
// sm80: 128 rows of 8 warps, one K and one V buffer loaded staggered (FlashAttention-2's A100 hd256 tile): 128 KB,
// one CTA per SM with two warps per scheduler. The 64-row double-buffered tile of 4 warps it replaced (160 KB, one
// warp per scheduler) was bound by that warp's chain: by the SASS model on an A100, 2 x 8192 full / causal, 172 / 162
// -> 199 / 186 TFLOP/s (FA2 201 / 187), now bound by ldmatrix reads (K, V and Q each key block, 16 rows a warp).
SINKATTN_PREFILL_TILE(Hd256Rows, 256, 128, 64, 8, 1);     // 128 KB: sm80 only
// Few rows (17-64, or split-KV) on sm80: 64 rows, double-buffered, where the 128-row tile would be mostly padding.
SINKATTN_FWD_TILE(Hd256Few, 256, 64, 64, 4);              // 160 KB: sm80 only
SINKATTN_PREFILL_TILE(Hd256RowsSmall, 256, 64, 32, 4);    // 96 KB: sm86 / sm89
// One K and one V buffer, loaded staggered, 64 rows of 4 warps: 96 KB, so two CTAs share an sm90 SM (228 KB): two
// warps per scheduler that drift apart, not two of one CTA held together at its barriers.
SINKATTN_PREFILL_TILE(Hd256Staggered, 256, 64, 64, 4, 1); // 96 KB: sm90
#undef SINKATTN_FWD_TILE
#undef SINKATTN_PREFILL_TILE
}  // namespace fwd_tiles

// Whether a tile (a type holding its FwdTile) is a prefill tile (FwdTile::prefill).
template <class Tile> inline constexpr bool kPrefill = Tile::tile.prefill != 0;

template <class... Tiles>
struct TileList {};

// Whether a list's tiles are pairwise different: with_tile_in runs the kernel of the first tile equal to the chosen
// one, so of two equal tiles the second's kernel would be compiled and never run.
template <class First, class... Tiles>
constexpr bool distinct_tiles(TileList<First, Tiles...>) {
  decltype(First::tile) const t[] = {First::tile, Tiles::tile...};
  for (std::size_t i = 0; i < 1 + sizeof...(Tiles); ++i)
    for (std::size_t j = i + 1; j < 1 + sizeof...(Tiles); ++j)
      if (t[i] == t[j]) return false;
  return true;
}

// Every tile of a head dim, in no particular order (with_fwd_tile below instantiates each). The head dims
// specialized here are those the sm80 forward is compiled for: csrc/generate_kernels.py reads them, strictly
// (each `template <> struct FwdTilesOf<N> {` at a line's start), and writes no unit for any other.
template <int kHeadDim> struct FwdTilesOf;
template <> struct FwdTilesOf<64> {
  using type = TileList<fwd_tiles::Hd64Keys4, fwd_tiles::Hd64Keys2, fwd_tiles::Hd64Keys2Small, fwd_tiles::Hd64Few,
                        fwd_tiles::Hd64FewSmall, fwd_tiles::Hd64Rows, fwd_tiles::Hd64RowsTwoCtas>;
};
template <> struct FwdTilesOf<128> {
  using type = TileList<fwd_tiles::Hd128Keys4, fwd_tiles::Hd128Keys4Small, fwd_tiles::Hd128Keys2,
                        fwd_tiles::Hd128Keys2Small, fwd_tiles::Hd128Few, fwd_tiles::Hd128FewSmall, fwd_tiles::Hd128Rows,
                        fwd_tiles::Hd128RowsSm90, fwd_tiles::Hd128RowsTwoCtas>;
};
template <> struct FwdTilesOf<256> {
  using type = TileList<fwd_tiles::Hd256Keys4, fwd_tiles::Hd256Rows, fwd_tiles::Hd256Few, fwd_tiles::Hd256RowsSmall,
                        fwd_tiles::Hd256Staggered>;
};

// (Over a pack: generate_kernels.py reads every `FwdTilesOf<` and a digit in this file as a specialization.)
template <int... kHeadDims>
constexpr bool distinct_fwd_tiles() { return (distinct_tiles(typename FwdTilesOf<kHeadDims>::type{}) && ...); }
static_assert(distinct_fwd_tiles<64, 128, 256>(), "two equal tiles in one head dim's list");

// The smallest shared memory any tile of the head dim needs (the registry records it: below it nothing runs).
template <class... Tiles>
constexpr int min_smem(TileList<Tiles...>) {
  int m = 1 << 30;
  ((m = Tiles::tile.smem_bytes() < m ? Tiles::tile.smem_bytes() : m), ...);
  return m;
}
template <int kHeadDim>
constexpr int fwd_min_smem() { return min_smem(typename FwdTilesOf<kHeadDim>::type{}); }

// What the choice depends on: real rows per (sequence, head or GQA head group), and whether keys are split.
struct FwdShape {
  int64_t rows;  // seqlen_q, times the group size when GQA-packed
  bool split_kv;
};

inline FwdShape fwd_shape(FwdParams const& p) {
  int const group = p.pack_gqa && p.nheads_k > 0 ? p.nheads / p.nheads_k : 1;
  return FwdShape{int64_t(p.seqlen_q) * group, p.num_splits > 1};
}

// Whether the per-block limit says an SM holds `ctas` CTAs of tile t: 1 KB of each CTA's shared memory is the
// system's. The limit stands for the SM's size (per block / per SM: 99 / 100 KB on cc 8.6 and 8.9, 163 / 164 on 8.0,
// 227 / 228 on 9.0).
constexpr bool fits_per_sm(FwdTile t, int max_smem, int ctas) { return max_smem >= ctas * (t.smem_bytes() + 1024); }

// The tile for a head dim (64, 128, 256), problem and shared-memory limit per block.
// - Few rows (decode, GQA-packed seqlen_q * group <= 64, or split-KV): such a tile is mostly padding rows,
//   whose warps skip the MMAs (fwd_kernel.h), so the kernel is bound by the bytes of K and V it keeps in
//   flight: a 64-row tile of 4 warps with more K/V stages.
// - Key groups: with at most 16 real rows all 4 warps take the same 16 rows and split the keys of each block;
//   with 17-32, two groups of two warps. With rows split alone one warp did all the math of a decode step
//   (gpt-oss: 8 query heads per KV head, one query) while three only loaded: the H200 measured 62.8% of its
//   copy bandwidth so for hd64, where a key block carries the most softmax work per byte.
// - Where the big tile does not fit the limit, its Small sibling.
constexpr FwdTile choose_fwd_tile(int head_dim, FwdShape s, int max_smem) {
  using namespace fwd_tiles;
  bool const few_rows = s.split_kv || s.rows <= 64;
  int const key_groups = s.rows <= 16 ? 4 : s.rows <= 32 ? 2 : 1;
  auto fit = [&](FwdTile big, FwdTile small) { return max_smem >= big.smem_bytes() ? big : small; };
  if (head_dim == 64) {
    if (key_groups == 4) return Hd64Keys4::tile;
    if (key_groups == 2) return fit(Hd64Keys2::tile, Hd64Keys2Small::tile);
    if (few_rows) return fit(Hd64Few::tile, Hd64FewSmall::tile);
    // Two CTAs of three stages where an SM holds them (cc 8.0, 9.0); cc 8.6 / 8.9 hold two of two stages.
    if (fits_per_sm(Hd64RowsTwoCtas::tile, max_smem, 2)) return Hd64RowsTwoCtas::tile;
    return Hd64Rows::tile;
  }
  if (head_dim == 128) {
    if (key_groups == 4) return fit(Hd128Keys4::tile, Hd128Keys4Small::tile);
    if (key_groups == 2) return fit(Hd128Keys2::tile, Hd128Keys2Small::tile);
    if (few_rows) return fit(Hd128Few::tile, Hd128FewSmall::tile);
    // More than any sm8x allows per block (163 KB) is an sm90 (227 KB), which runs the sm_90 SASS: the tile whose
    // interior loads are branch-free (FwdTile::branch_free_loads). Where two 4-warp tiles fit (cc 8.0), those.
    if (max_smem > 163 * 1024) return Hd128RowsSm90::tile;
    if (fits_per_sm(Hd128RowsTwoCtas::tile, max_smem, 2)) return Hd128RowsTwoCtas::tile;
    return Hd128Rows::tile;
  }
  if (key_groups == 4 && max_smem >= Hd256Keys4::tile.smem_bytes()) return Hd256Keys4::tile;
  // Two staggered CTAs per SM where the per-block limit says the SM holds two of them (sm90: 227 KB per block of
  // 228 per SM). sm80's 163 of 164 holds one: the 128-row tile for prefill, the 64-row one for few rows.
  if (fits_per_sm(Hd256Staggered::tile, max_smem, 2)) return Hd256Staggered::tile;
  if (few_rows) return fit(Hd256Few::tile, Hd256RowsSmall::tile);
  return fit(Hd256Rows::tile, Hd256RowsSmall::tile);
}

static_assert(fwd_tiles::Hd64Keys4::tile.smem_bytes() <= 99 * 1024, "fits every sm8x device");
static_assert(fwd_tiles::Hd128Rows::tile.smem_bytes() <= 99 * 1024, "fits sm86 / sm89");
static_assert(fwd_tiles::Hd256RowsSmall::tile.smem_bytes() <= 99 * 1024, "fits sm86 / sm89");

// ---- FP8 KV caches (sm80/fp8_kv.h): the decode tiles read K/V caches of FP8 codes -----------------------------
// Shared memory of such a tile: Q, `stages` FP8 K and V blocks (1-byte codes, as cp.async brings them), and one K
// and one V block in the kernel's Element, which a pass converts each FP8 block into before the MMAs read it. Never
// more than the same tile over a bf16 cache (equal at 2 stages).
constexpr int fwd_fp8_smem_bytes(FwdTile t) {
  return t.block_m * t.head_dim * 2 + 2 * t.stages * t.block_n * t.head_dim + 2 * t.block_n * t.head_dim * 2;
}
// The FP8 tiles of a head dim: the few-row (decode, split-KV) tiles only, compiled once per (head dim, dtype), both
// formats in one kernel (the format is a run-time value, one uniform branch per key block). Head dims 64 and 128;
// 256 and the prefill row tiles stay on the reference backend (dispatch says so). csrc/generate_kernels.py reads
// these specializations as it reads FwdTilesOf's.
template <int kHeadDim> struct FwdFp8TilesOf;
template <> struct FwdFp8TilesOf<64> {
  using type = TileList<fwd_tiles::Hd64Keys4, fwd_tiles::Hd64Keys2, fwd_tiles::Hd64Keys2Small, fwd_tiles::Hd64Few,
                        fwd_tiles::Hd64FewSmall>;
};
template <> struct FwdFp8TilesOf<128> {
  using type = TileList<fwd_tiles::Hd128Keys4, fwd_tiles::Hd128Keys4Small, fwd_tiles::Hd128Keys2,
                        fwd_tiles::Hd128Keys2Small, fwd_tiles::Hd128Few, fwd_tiles::Hd128FewSmall>;
};

template <class... Tiles>
constexpr int min_fp8_smem(TileList<Tiles...>) {
  int m = 1 << 30;
  ((m = fwd_fp8_smem_bytes(Tiles::tile) < m ? fwd_fp8_smem_bytes(Tiles::tile) : m), ...);
  return m;
}
template <int kHeadDim>
constexpr int fwd_fp8_min_smem() { return min_fp8_smem(typename FwdFp8TilesOf<kHeadDim>::type{}); }

// The FP8 tile: choose_fwd_tile's key-group and few-row rule at any number of rows (a chunked prefill over an FP8
// cache runs on the 64-row few-row tile, not the prefill row tile), with the FP8 sizes deciding what fits.
constexpr FwdTile choose_fwd_fp8_tile(int head_dim, int64_t rows, int max_smem) {
  using namespace fwd_tiles;
  int const key_groups = rows <= 16 ? 4 : rows <= 32 ? 2 : 1;
  auto fit = [&](FwdTile big, FwdTile small) { return max_smem >= fwd_fp8_smem_bytes(big) ? big : small; };
  if (head_dim == 64) {
    if (key_groups == 4) return Hd64Keys4::tile;
    if (key_groups == 2) return fit(Hd64Keys2::tile, Hd64Keys2Small::tile);
    return fit(Hd64Few::tile, Hd64FewSmall::tile);
  }
  if (key_groups == 4) return fit(Hd128Keys4::tile, Hd128Keys4Small::tile);
  if (key_groups == 2) return fit(Hd128Keys2::tile, Hd128Keys2Small::tile);
  return fit(Hd128Few::tile, Hd128FewSmall::tile);
}
static_assert(fwd_fp8_smem_bytes(fwd_tiles::Hd128Few::tile) <= 99 * 1024, "every FP8 tile fits sm86 / sm89");

// Calls f.template operator()<Tile>() with the type among `tiles` whose tile is `t` (the table's value ->
// the kernels' template argument), for the forward's and the backward's tables alike. A tile the list lacks (a rule
// that answers with a tile no unit compiles) throws, where nothing would have run and the output stayed unwritten;
// tests/test_sm80_tile_lists.py checks every answer of the rules against the lists.
template <class Value, class F, class... Tiles>
void with_tile_in(Value const& t, F&& f, TileList<Tiles...>) {
  bool const ran = ((t == Tiles::tile && (f.template operator()<Tiles>(), true)) || ...);
  if (!ran) throw std::logic_error("sinkattn: the sm80 tile rule chose a tile its head dim's list does not compile "
                                   "(csrc/sm80/fwd_tiles.h, bwd_tiles.h)");
}
template <int kHeadDim, class F>
void with_fwd_tile(FwdTile t, F&& f) {
  with_tile_in(t, f, typename FwdTilesOf<kHeadDim>::type{});
}
template <int kHeadDim, class F>
void with_fwd_fp8_tile(FwdTile t, F&& f) {
  with_tile_in(t, f, typename FwdFp8TilesOf<kHeadDim>::type{});
}

}  // namespace sinkattn::sm80
