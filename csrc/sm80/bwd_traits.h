// bwd_traits.h: tile shapes, shared-memory layouts and atoms of the sm80 backward kernel.
//
// Same design as fwd_traits.h: Prims names the hardware-facing pieces (GpuPrims on the GPU, EmuPrims under
// host emulation) and the kernel body is the same code for both.
//
// One CTA owns an N tile of keys (kBlockN x d of K and V, dK and dV accumulated in registers) and visits M
// tiles of queries. Five GEMMs per visited M tile, all on one TiledMma (warps kWarpsM x kWarpsN):
//   S  = Q K^T     (M x N, k = d)   A: sQ          B: sK
//   dP = dO V^T    (M x N, k = d)   A: sdO         B: sV
//   dV += P^T dO   (N x d, k = M)   A: sPt  (P staged in shared memory, read transposed)   B: sdOt
//   dK += dS^T Q   (N x d, k = M)   A: sdSt                                                  B: sQt
//   dQ  = dS K     (M x d, k = N)   A: sdS                                                   B: sKt
// The transposed views are the same bytes under a composed layout (like the forward's Vt) and are read with
// ldmatrix.trans.
#pragma once
#include <cute/tensor.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cute/atom/copy_atom.hpp>
#include <cutlass/numeric_types.h>

#include "common/online_softmax.h"
#include "sm80/bwd_tiles.h"

namespace sinkattn::sm80 {

using namespace cute;

// Tile: one of bwd_tiles.h's types; its BwdTile gives the shape.
// Cap: softcap compiled out (kOff) or read at run time (every backward tile is compute-bound; bwd_config.h picks).
template <class Tile_, class Element_, class Prims_, Softcap kCap_>
struct BwdTraits {
  using TileTag = Tile_;
  using Element = Element_;
  using Prims = Prims_;
  static constexpr Softcap kCap = kCap_;
  static constexpr BwdTile kTile = Tile_::tile;
  static constexpr int kHeadDim = kTile.head_dim;
  static constexpr int kBlockM = kTile.block_m;
  static constexpr int kBlockN = kTile.block_n;
  static constexpr int kWarpsM = kTile.warps_m;
  static constexpr int kWarpsN = kTile.warps_n;
  static constexpr int kNWarps = kWarpsM * kWarpsN;
  // Q and dO buffers: 2 = the next M tile loads (cp.async) while this one computes; 1 where shared memory is short.
  static constexpr int kStages = kTile.stages;
  static_assert(kStages == 1 || kStages == 2);
  static constexpr int kNThreads = kNWarps * 32;
  static_assert(kHeadDim % 64 == 0, "compiled head dims are multiples of 64");
  static_assert(kBlockN % 64 == 0, "P and dS tiles are rows of 64-element swizzle atoms");
  // Every GEMM's M extent (kBlockM or kBlockN) and N extent (kBlockN or kHeadDim) must tile the warp grid.
  static_assert(kBlockM % (16 * kWarpsM) == 0 && kBlockN % (16 * kWarpsM) == 0, "M extents");
  static_assert(kBlockN % (16 * kWarpsN) == 0 && kHeadDim % (16 * kWarpsN) == 0, "N extents");

  using TiledMma = TiledMMA<MMA_Atom<typename Prims::template Mma<Element>>, Layout<Shape<Int<kWarpsM>, Int<kWarpsN>, _1>>,
                            Tile<Int<16 * kWarpsM>, Int<16 * kWarpsN>, _16>>;

  static constexpr int kBlockKSmem = 64;
  using SmemLayoutAtom = decltype(composition(Swizzle<3, 3, 3>{},
                                              Layout<Shape<_8, Int<kBlockKSmem>>, Stride<Int<kBlockKSmem>, _1>>{}));
  using SmemLayoutQ = decltype(tile_to_shape(SmemLayoutAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));   // Q, dO
  using SmemLayoutKV = decltype(tile_to_shape(SmemLayoutAtom{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));  // K, V
  using SmemLayoutP = decltype(tile_to_shape(SmemLayoutAtom{}, Shape<Int<kBlockM>, Int<kBlockN>>{}));    // P, dS
  using SmemLayoutQt = decltype(composition(SmemLayoutQ{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockM>>{}, GenRowMajor{})));
  using SmemLayoutKt = decltype(composition(SmemLayoutKV{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{}, GenRowMajor{})));
  using SmemLayoutPt = decltype(composition(SmemLayoutP{}, make_layout(Shape<Int<kBlockN>, Int<kBlockM>>{}, GenRowMajor{})));

  // dQ = dS K is computed in column chunks of kDqCols, so its fp32 tile stays small beside dK and dV.
  static constexpr int kDqCols = kHeadDim > 128 ? 64 : kHeadDim;

  static constexpr int kSmemQ = int(cosize_v<SmemLayoutQ>) * int(sizeof(Element));
  static constexpr int kSmemKV = int(cosize_v<SmemLayoutKV>) * int(sizeof(Element));
  static constexpr int kSmemP = int(cosize_v<SmemLayoutP>) * int(sizeof(Element));
  static constexpr int kSmemBytes = kStages * 2 * kSmemQ + 2 * kSmemKV + 2 * kSmemP;  // Q, dO (per stage), K, V, P, dS
  static_assert(kSmemBytes == kTile.smem_bytes(), "the table's size is the layouts' size");

  static constexpr int kElemsPerVec = 16 / int(sizeof(Element));
  static constexpr int kThreadsPerRow = kBlockKSmem / kElemsPerVec;
  using GmemThreadLayout = Layout<Shape<Int<kNThreads / kThreadsPerRow>, Int<kThreadsPerRow>>, Stride<Int<kThreadsPerRow>, _1>>;
  using GmemTiledCopyLoad = decltype(make_tiled_copy(Copy_Atom<typename Prims::GmemCopyAsync, Element>{}, GmemThreadLayout{},
                                                     Layout<Shape<_1, Int<kElemsPerVec>>>{}));
  using SmemCopyAtom = Copy_Atom<typename Prims::LdsmN, Element>;
  using SmemCopyAtomT = Copy_Atom<typename Prims::LdsmT, Element>;
  using SmemCopyAtomO = Copy_Atom<typename Prims::SmemStore32, Element>;
};

}  // namespace sinkattn::sm80
