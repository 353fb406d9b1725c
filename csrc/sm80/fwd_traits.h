// fwd_traits.h: tile shapes, shared-memory layouts and atoms of the sm80 forward kernel.
//
// Prims names the hardware-facing pieces (MMA and copy atoms, barriers, shuffles, cp.async fences): the GPU
// build passes GpuPrims (sm80/prims_gpu.cuh), the host-emulation build EmuPrims (emu/sm80_prims.h), and the
// kernel body is the same code for both. No torch, no CUDA intrinsics here.
#pragma once
#include <cute/tensor.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cute/atom/copy_atom.hpp>
#include <cutlass/numeric_types.h>
#include <type_traits>

#include "common/online_softmax.h"
#include "sm80/fwd_tiles.h"

namespace sinkattn::sm80 {

using namespace cute;

// Tile: one of fwd_tiles.h's types; its FwdTile gives the shape. Cap: softcap compiled out or read at run time
// (common/online_softmax.h, Softcap; fwd_config.h picks it).
template <class Tile_, class Element_, class Prims_, Softcap kCap_>
struct FwdTraits {
  using TileTag = Tile_;
  using Element = Element_;
  using Prims = Prims_;
  static constexpr Softcap kCap = kCap_;
  // Caches in q's dtype; FwdFp8Traits (sm80/fp8_kv.h) reads FP8 caches, with its own params.
  static constexpr bool kFp8 = false;
  using Params = FwdParams;
  static constexpr FwdTile kTile = Tile_::tile;
  static constexpr int kHeadDim = kTile.head_dim;
  static constexpr int kBlockM = kTile.block_m;
  static constexpr int kBlockN = kTile.block_n;
  static constexpr int kNWarps = kTile.warps;
  static constexpr int kNThreads = kNWarps * 32;
  // CTAs per SM the kernel's launch bounds ask for (fwd_tiles.h FwdTile::ctas_per_sm; fwd_launch.cuh). The key-group
  // (decode) tiles ask for one: without it ptxas held their 128 threads to 168 registers and spilled 16-40 bytes;
  // their shared memory, not registers, bounds how many share an SM.
  static constexpr int kMinCtasPerSm = kTile.ctas_per_sm ? kTile.ctas_per_sm : kTile.key_groups > 1 ? 1 : 0;
  static_assert(kHeadDim % 64 == 0, "compiled head dims are multiples of 64");

  // How the warps share the work. By rows (one key group, the default): each warp owns 16-row slices of Q, S
  // and O, so the softmax of a row stays within the 4 lanes of one quad and no warp ever needs another's rows.
  // By keys too (decode: a tile of 16 or 32 real rows, where splitting rows alone would leave warps idle):
  // the warps form kKeyGroups groups of kMmaWarps warps; each group covers all kBlockM rows (16 per warp)
  // with its own kBlockNMma keys of each key block and keeps its own softmax state, as if it were a split of
  // the keys; the groups' states merge once at the end (fwd_kernel.h, merge_key_groups).
  static constexpr int kKeyGroups = kTile.key_groups;
  static constexpr bool kQInRegs = kTile.q_regs != 0;  // fwd_tiles.h FwdTile::q_regs
  static constexpr bool kSplitKeys = kKeyGroups > 1;
  static_assert(kNWarps % kKeyGroups == 0);
  static constexpr int kMmaWarps = kNWarps / kKeyGroups;  // warps of one TiledMma: one key group
  static constexpr int kBlockNMma = kBlockN / kKeyGroups;  // keys of one group's S tile
  static_assert(kBlockM % (16 * kMmaWarps) == 0, "each warp owns whole 16-row MMA tiles");
  static_assert(!kSplitKeys || kBlockM == 16 * kMmaWarps, "split keys: one 16-row slice per warp of a group");
  static_assert(kBlockNMma % 16 == 0, "a group's keys are whole k16 slices of P V");
  static_assert(!kQInRegs || !kSplitKeys, "Q in registers: the prefill row tiles only");
  // N tile 16 lets one ldmatrix.x4 feed two n8 atoms.
  using TiledMma = TiledMMA<MMA_Atom<typename Prims::template Mma<Element>>, Layout<Shape<Int<kMmaWarps>, _1, _1>>,
                            Tile<Int<16 * kMmaWarps>, _16, _16>>;

  // 64-element (128-byte) rows, XOR-swizzled in 16-byte chunks so both the row-wise cp.async writes and the
  // 8x8 ldmatrix reads (plain and transposed) hit 8 different bank groups.
  static constexpr int kBlockKSmem = 64;
  using SmemLayoutAtom = decltype(composition(Swizzle<3, 3, 3>{},
                                              Layout<Shape<_8, Int<kBlockKSmem>>, Stride<Int<kBlockKSmem>, _1>>{}));
  using SmemLayoutQ = decltype(tile_to_shape(SmemLayoutAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  using SmemLayoutKV = decltype(tile_to_shape(SmemLayoutAtom{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  // V read as the B operand of O = P V needs (d, n) indexing: the same bytes, transposed view.
  using SmemLayoutVt = decltype(composition(SmemLayoutKV{},
                                            make_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{}, GenRowMajor{})));
  // What one key group's MMAs read of a K/V stage: all of it, or under split keys the first kBlockNMma rows of
  // the stage's layout (same strides). Group g's keys start at element g * kBlockNMma * kBlockKSmem: whole 8-row
  // swizzle atoms (512 elements), which the XOR swizzle (bits 3-8 of the element offset) leaves alone, so a
  // pointer offset does.
  using SmemLayoutKMma = std::conditional_t<
      kSplitKeys,
      decltype(local_tile(make_tensor(make_smem_ptr(static_cast<Element*>(nullptr)), SmemLayoutKV{}),
                          Shape<Int<kBlockNMma>, Int<kHeadDim>>{}, make_coord(_0{}, _0{})).layout()),
      SmemLayoutKV>;
  using SmemLayoutVtMma = std::conditional_t<
      kSplitKeys,
      decltype(local_tile(make_tensor(make_smem_ptr(static_cast<Element*>(nullptr)), SmemLayoutVt{}),
                          Shape<Int<kHeadDim>, Int<kBlockNMma>>{}, make_coord(_0{}, _0{})).layout()),
      SmemLayoutVt>;
  static_assert(kBlockNMma % 8 == 0);

  static constexpr int kSmemQ = int(cosize_v<SmemLayoutQ>) * int(sizeof(Element));
  static constexpr int kSmemKV = int(cosize_v<SmemLayoutKV>) * int(sizeof(Element));
  // K/V stages in shared memory: while block t computes, blocks t+1 .. t+kStages-1 are in flight (2: double
  // buffering; more for decode, where a CTA computes little per byte and needs many bytes in flight).
  static constexpr int kStages = kTile.stages;
  // One stage: one K and one V buffer, loaded staggered (fwd_kernel.h): V of block t while S of block t computes,
  // K of block t + 1 while block t's softmax and P V do; half the shared memory of double buffering, each copy still
  // overlapping compute.
  static constexpr bool kStaggered = kStages == 1;
  // S ahead (fwd_tiles.h FwdTile::s_ahead): each iteration computes S of the next key block beside this block's
  // softmax and P V; K runs one block ahead of V through the same two stages.
  static constexpr bool kSAhead = kTile.s_ahead != 0;
  static_assert(!kSAhead || (kStages == 2 && kQInRegs && !kSplitKeys && !kFp8),
                "S ahead: the double-buffered prefill row tiles, Q in registers");
  // The prefill tiles without S ahead move the running max lazily (common/online_softmax.h rescale_lazy): O's
  // rescale becomes a branch most key blocks skip. Not with S ahead, whose softmax shares one basic block with the
  // next block's MMAs (a branch there would end that overlap), nor in the memory-bound decode tiles.
  static constexpr bool kLazyRebase = kPrefill<Tile_> && !kSAhead;
  // Interior K/V blocks through predicated copies, no branch (fwd_tiles.h FwdTile::branch_free_loads; S ahead only).
  static constexpr bool kBranchFreeLoads = kTile.branch_free_loads != 0;
  static_assert(!kBranchFreeLoads || kSAhead, "branch-free loads: the S-ahead loop");
  static_assert(kStages >= 1);
  static_assert(!kStaggered || !kSplitKeys, "staggered K/V: the prefill row tiles only");
  static constexpr int kSmemBytes = kSmemQ + 2 * kStages * kSmemKV;
  static_assert(kSmemBytes == kTile.smem_bytes(), "the table's size is the layouts' size");
  // Split keys: after the last key block the K/V stages hold the key groups' softmax states (max and sum per
  // row and group) and the O fragments of groups 1.. for group 0 to merge.
  static constexpr int kMergeFloats = 2 * kKeyGroups * kBlockM + (kKeyGroups - 1) * kBlockM * kHeadDim;
  static_assert(!kSplitKeys || kMergeFloats * 4 <= 2 * kStages * kSmemKV);

  // Global <-> shared: 16-byte vectors, 8 threads per 64-element row.
  static constexpr int kElemsPerVec = 16 / int(sizeof(Element));
  static constexpr int kThreadsPerRow = kBlockKSmem / kElemsPerVec;
  using GmemThreadLayout = Layout<Shape<Int<kNThreads / kThreadsPerRow>, Int<kThreadsPerRow>>, Stride<Int<kThreadsPerRow>, _1>>;
  using GmemTiledCopyLoad = decltype(make_tiled_copy(Copy_Atom<typename Prims::GmemCopyAsync, Element>{}, GmemThreadLayout{},
                                                     Layout<Shape<_1, Int<kElemsPerVec>>>{}));
  using GmemTiledCopyStore = decltype(make_tiled_copy(Copy_Atom<typename Prims::SmemLoad128, Element>{},
                                                      GmemThreadLayout{}, Layout<Shape<_1, Int<kElemsPerVec>>>{}));
  using SmemCopyAtom = Copy_Atom<typename Prims::LdsmN, Element>;
  using SmemCopyAtomT = Copy_Atom<typename Prims::LdsmT, Element>;
  using SmemCopyAtomO = Copy_Atom<typename Prims::SmemStore32, Element>;
  // The K/V stages as loaded (fwd_kernel.h's one loader): what the cache holds, the copy row_loader.h reads, the
  // stage's shared-memory layout. Here the MMAs read the stages themselves; fp8_kv.h loads FP8 codes instead.
  using CacheElement = Element;
  using KvLoad = FwdTraits;
  using SmemLayoutKvLoad = SmemLayoutKV;
};

}  // namespace sinkattn::sm80
