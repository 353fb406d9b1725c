// fp8_kv.h: the sm80 decode tiles over FP8 KV caches (docs/DESIGN.md section 4): their traits, and the pass that
// converts an FP8 K or V block in shared memory into the kernel's Element for the existing ldmatrix / mma path.
//
// K/V blocks come to shared memory as FP8 codes with the same 16-byte cp.async (16 codes a vector, half the bytes of
// a bf16 block), kStages deep, in plain row-major stages. After a block's copies land (the wait and barrier of the
// key-block loop), every thread converts its share of the block's 16-code vectors into one K and one V block of
// Element in the swizzled layout the MMAs read (fwd_traits.h SmemLayoutKV), then a barrier; the MMAs read those.
// The conversion is exact (common/fp8.h). Dequantization scales never enter the loop: k_descale[b, hk] multiplies
// the softmax scale, v_descale[b, hk] the output's 1 / row sum (fwd_kernel.h); the sink is added unscaled.
#pragma once
#include <cstdint>
#include <cute/tensor.hpp>

#include "common/defs.h"
#include "common/fp8.h"
#include "params.h"
#include "sm80/fwd_traits.h"

namespace sinkattn::sm80 {

using namespace cute;

// 16 bytes of shared memory, as the conversion pass moves them (Prims::smem_load_vec / smem_store_vec).
struct alignas(16) Vec16 {
  uint32_t w[4];
};

// Softcap is a run-time flag in every decode tile (only prefill tiles compile it out, fwd_tiles.h kPrefill), so
// here too.
template <class Tile_, class Element_, class Prims_>
struct FwdFp8Traits : FwdTraits<Tile_, Element_, Prims_, Softcap::kRunTime> {
  using Base = FwdTraits<Tile_, Element_, Prims_, Softcap::kRunTime>;
  static constexpr bool kFp8 = true;
  using Params = FwdFp8Params;
  static constexpr int kHeadDim = Base::kHeadDim, kBlockN = Base::kBlockN, kNThreads = Base::kNThreads;
  static constexpr int kStages = Base::kStages;
  static_assert(kHeadDim % 16 == 0, "16 FP8 codes per 16-byte vector");
  static constexpr int kFp8StageBytes = kBlockN * kHeadDim;  // one FP8 K (or V) block
  // Q, the FP8 K stages, the FP8 V stages, then the Element K and V blocks the MMAs read (one each).
  static constexpr int kSmemBytes = Base::kSmemQ + 2 * kStages * kFp8StageBytes + 2 * Base::kSmemKV;
  static_assert(kSmemBytes == fwd_fp8_smem_bytes(Base::kTile), "the table's FP8 size is the layouts' size");
  // Split keys: the key groups' merge (key_groups.h) uses the K/V region after the last block.
  static_assert(Base::kMergeFloats * 4 <= 2 * kStages * kFp8StageBytes + 2 * Base::kSmemKV);

  // Global -> shared: 16-byte vectors of codes, kHeadDim / 16 threads per row, row-major stages.
  static constexpr int kFp8ThreadsPerRow = kHeadDim / 16;
  static_assert(kNThreads % kFp8ThreadsPerRow == 0 && kBlockN % (kNThreads / kFp8ThreadsPerRow) == 0);
  using Fp8ThreadLayout = Layout<Shape<Int<kNThreads / kFp8ThreadsPerRow>, Int<kFp8ThreadsPerRow>>,
                                 Stride<Int<kFp8ThreadsPerRow>, _1>>;
  using SmemLayoutFp8 = Layout<Shape<Int<kBlockN>, Int<kHeadDim>>, Stride<Int<kHeadDim>, _1>>;
  // What row_loader.h's load_rows / load_tile read of their Kt, for the FP8 copies.
  struct Fp8Load {
    using Prims = Prims_;
    using GmemTiledCopyLoad = decltype(make_tiled_copy(Copy_Atom<typename Prims_::GmemCopyAsync, uint8_t>{},
                                                       Fp8ThreadLayout{}, Layout<Shape<_1, _16>>{}));
  };
  // The loader's view (fwd_traits.h): codes, their copy, the row-major FP8 stages.
  using CacheElement = uint8_t;
  using KvLoad = Fp8Load;
  using SmemLayoutKvLoad = SmemLayoutFp8;
};

// 16 FP8 codes -> 16 Elements (two 16-byte halves), exact. kFormat: common/fp8.h Fp8Format.
template <class Element, int kFormat>
SA_DEVICE void convert_fp8_vec(Vec16 const& in, Vec16 (&out)[2]) {
  uint16_t h[16];
  SA_UNROLL
  for (int k = 0; k < 16; ++k) {
    uint32_t const code = (in.w[k / 4] >> (8 * (k % 4))) & 0xffu;
    if constexpr (kFormat == kFp8E5M2 && std::is_same_v<Element, cutlass::half_t>) {
      h[k] = e5m2_fp16_bits(code);  // the top byte of an fp16: no arithmetic at all
    } else {
      h[k] = Element(kFormat == kFp8E5M2 ? e5m2_to_float(code) : e4m3_to_float(code)).raw();
    }
  }
  SA_UNROLL
  for (int k = 0; k < 8; ++k) out[k / 4].w[k % 4] = uint32_t(h[2 * k]) | (uint32_t(h[2 * k + 1]) << 16);
}

// One FP8 block (row-major codes at src) -> the Element block at dst (Kt::SmemLayoutKV), this thread's vectors:
// vector i is row i / (d / 16), columns (i % (d / 16)) * 16 .., whole 8-element chunks of the swizzled layout.
template <class Kt, int kFormat>
SA_DEVICE void convert_fp8_block(uint8_t const* src, typename Kt::Element* dst, int tid) {
  using Prims = typename Kt::Prims;
  constexpr int kVecsPerRow = Kt::kHeadDim / 16, kVecs = Kt::kBlockN * kVecsPerRow;
  static_assert(kVecs % Kt::kNThreads == 0);
  typename Kt::SmemLayoutKV const layout;
  CUTE_UNROLL
  for (int j = 0; j < kVecs / Kt::kNThreads; ++j) {
    int const i = tid + j * Kt::kNThreads, row = i / kVecsPerRow, col = i % kVecsPerRow * 16;
    Vec16 out[2];
    convert_fp8_vec<typename Kt::Element, kFormat>(Prims::smem_load_vec(reinterpret_cast<Vec16 const*>(src) + i), out);
    Prims::smem_store_vec(reinterpret_cast<Vec16*>(dst + layout(row, col)), out[0]);
    Prims::smem_store_vec(reinterpret_cast<Vec16*>(dst + layout(row, col + 8)), out[1]);
  }
}

// Stage `s` of the FP8 K and V stages -> the Element K and V blocks, in the call's format (uniform per CTA).
template <class Kt>
SA_DEVICE void convert_fp8_stage(uint8_t const* f8_k, uint8_t const* f8_v, int s, typename Kt::Element* k,
                                 typename Kt::Element* v, int tid, int format) {
  uint8_t const* src_k = f8_k + s * Kt::kFp8StageBytes;
  uint8_t const* src_v = f8_v + s * Kt::kFp8StageBytes;
  if (format == kFp8E5M2) {
    convert_fp8_block<Kt, kFp8E5M2>(src_k, k, tid);
    convert_fp8_block<Kt, kFp8E5M2>(src_v, v, tid);
  } else {
    convert_fp8_block<Kt, kFp8E4M3>(src_k, k, tid);
    convert_fp8_block<Kt, kFp8E4M3>(src_v, v, tid);
  }
}

}  // namespace sinkattn::sm80
