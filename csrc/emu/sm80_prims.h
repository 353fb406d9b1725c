// sm80_prims.h: EmuPrims, the host implementation of the sm80 kernels' seam (the `Kt::Prims` their bodies take; the
// GPU's is sm80/prims_gpu.cuh GpuPrims): the hardware pieces, emulated on the host.
//
// The MMA and ldmatrix atoms keep the real atoms' CuTe traits (thread/value layouts), so the kernel's
// partitioning is exactly the GPU's; only the execution is a warp-collective on host threads. cp.async is
// deferred to its wait; every shared-memory access is reported to the ordering check (sm80_runtime.h).
#pragma once
#include <cute/tensor.hpp>
#include <cute/atom/copy_traits_sm75.hpp>
#include <cute/atom/mma_traits_sm80.hpp>
#include <cutlass/numeric_types.h>
#include <atomic>
#include <type_traits>

#include "emu/sm80_runtime.h"

namespace sinkattn::emu80 {

template <class RealOp>
struct EmuMma : RealOp {};

// ldmatrix.x4: lanes 8q..8q+7 give the rows of 8x8 matrix q (16 bytes each). Each lane reads its own row into the
// warp's slot before the barrier, so shared memory is read when the instruction issues, as on the hardware, and no
// lane reads it after another lane of its warp has moved on; then lane l takes its register q from the rows
// (word(rows, q, l)).
template <class Word>
void ldsm_x4(cute::uint128_t const& src, uint32_t& d0, uint32_t& d1, uint32_t& d2, uint32_t& d3, Word const& word) {
  auto* rows = reinterpret_cast<char*>(warp_slot());
  on_smem_read(&src, 16);
  std::memcpy(rows + 16 * lane_id(), &src, 16);
  sync_warp();
  int const lane = lane_id();
  d0 = word(rows, 0, lane);
  d1 = word(rows, 1, lane);
  d2 = word(rows, 2, lane);
  d3 = word(rows, 3, lane);
}
// Lane l receives in register q the 32-bit word l % 4 of row l / 4 of matrix q.
struct EmuLdsmN {
  using SRegisters = cute::uint128_t[1];
  using DRegisters = uint32_t[4];
  static void copy(cute::uint128_t const& src, uint32_t& d0, uint32_t& d1, uint32_t& d2, uint32_t& d3) {
    ldsm_x4(src, d0, d1, d2, d3, [](char const* rows, int q, int lane) {
      uint32_t d;
      std::memcpy(&d, rows + 16 * (8 * q + lane / 4) + 4 * (lane % 4), 4);
      return d;
    });
  }
};

// .trans: lane l receives in register q the 16-bit elements (row 2(l%4), col l/4) and (row 2(l%4)+1, col l/4) of
// matrix q, low half first.
struct EmuLdsmT {
  using SRegisters = cute::uint128_t[1];
  using DRegisters = uint32_t[4];
  static void copy(cute::uint128_t const& src, uint32_t& d0, uint32_t& d1, uint32_t& d2, uint32_t& d3) {
    ldsm_x4(src, d0, d1, d2, d3, [](char const* rows, int q, int lane) {
      int const col = lane / 4, r0 = 2 * (lane % 4);
      uint16_t lo, hi;
      std::memcpy(&lo, rows + 16 * (8 * q + r0) + 2 * col, 2);
      std::memcpy(&hi, rows + 16 * (8 * q + r0 + 1) + 2 * col, 2);
      return uint32_t(lo) | (uint32_t(hi) << 16);
    });
  }
};

struct EmuCpAsync {
  using SRegisters = cute::uint128_t[1];
  using DRegisters = cute::uint128_t[1];
  static void copy(cute::uint128_t const& src, cute::uint128_t& dst) { cp_async_issue(&src, &dst); }
};

// Plain shared-memory stores and loads of the epilogue, reported to the ordering check.
struct EmuStore32 {
  using SRegisters = uint32_t[1];
  using DRegisters = uint32_t[1];
  static void copy(uint32_t const& src, uint32_t& dst) {
    on_smem_write(&dst, 4);
    dst = src;
  }
};
struct EmuLoad128 {
  using SRegisters = cute::uint128_t[1];
  using DRegisters = cute::uint128_t[1];
  static void copy(cute::uint128_t const& src, cute::uint128_t& dst) {
    on_smem_read(&src, 16);
    dst = src;
  }
};

struct EmuPrims {
  template <class Element>
  using Mma = EmuMma<std::conditional_t<std::is_same_v<Element, cutlass::bfloat16_t>,
                                        cute::SM80_16x8x16_F32BF16BF16F32_TN, cute::SM80_16x8x16_F32F16F16F32_TN>>;
  using GmemCopyAsync = EmuCpAsync;
  using LdsmN = EmuLdsmN;
  using LdsmT = EmuLdsmT;
  using SmemStore32 = EmuStore32;
  using SmemLoad128 = EmuLoad128;

  static void sync_threads() { emu80::sync_threads(); }
  static float shfl_xor(float x, int lane_mask) { return emu80::shfl_xor(x, lane_mask); }
  static bool any(bool x) { return emu80::any_sync(x); }
  static int opaque(int x) { return x; }
  static void smem_store(float* p, float x) {
    on_smem_write(p, sizeof(float));
    *p = x;
  }
  static float smem_load(float const* p) {
    on_smem_read(p, sizeof(float));
    return *p;
  }
  template <class V>
  static void smem_store_vec(V* p, V const& x) {
    on_smem_write(p, sizeof(V));
    *p = x;
  }
  template <class V>
  static V smem_load_vec(V const* p) {
    on_smem_read(p, sizeof(V));
    return *p;
  }
  static void cp_async_16_if(bool pred, void const* gmem, void* smem) {
    if (pred) cp_async_issue(gmem, smem);
  }
  static void cp_async_fence() { emu80::cp_async_fence(); }
  template <int N>
  static void cp_async_wait() { emu80::cp_async_wait(N); }
  // Global fp32 accumulation (dq_accum): a real atomic, as concurrent host threads may add to one word.
  static void atomic_add(float* p, float x) { std::atomic_ref<float>(*p).fetch_add(x, std::memory_order_relaxed); }
  // Counters of the deterministic backward. Blocks run one after another here, in grid order, so a turn is
  // due when its block starts: waiting would never end, so a counter that is not there is reported.
  static void wait_until_equal(int* p, int value) {
    int const now = std::atomic_ref<int>(*p).load(std::memory_order_acquire);
    if (now != value) {
      emu80::report("deterministic backward: waited for turn " + std::to_string(value) + " of a dq counter at " +
                  std::to_string(now) + " (an earlier key block skipped its turn, or blocks run out of order)");
    }
  }
  static void thread_fence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
  static void signal(int* p, int value) { std::atomic_ref<int>(*p).store(value, std::memory_order_release); }
  template <class Tensor_>
  static void zero_fill(Tensor_&& t) {
    using V = std::remove_cv_t<std::remove_reference_t<decltype(t(0))>>;
    for (int i = 0; i < cute::size(t); ++i) {
      on_smem_write(&t(i), sizeof(V));
      t(i) = V{};
    }
  }
};

}  // namespace sinkattn::emu80

namespace cute {

template <>
struct Copy_Traits<sinkattn::emu80::EmuCpAsync> : Copy_Traits<UniversalCopy<uint128_t>> {};
template <>
struct Copy_Traits<sinkattn::emu80::EmuStore32> : Copy_Traits<UniversalCopy<uint32_t>> {};
template <>
struct Copy_Traits<sinkattn::emu80::EmuLoad128> : Copy_Traits<UniversalCopy<uint128_t>> {};
template <>
struct Copy_Traits<sinkattn::emu80::EmuLdsmN> : Copy_Traits<SM75_U32x4_LDSM_N> {};
template <>
struct Copy_Traits<sinkattn::emu80::EmuLdsmT> : Copy_Traits<SM75_U16x8_LDSM_T> {};

template <class RealOp>
struct MMA_Traits<sinkattn::emu80::EmuMma<RealOp>> : MMA_Traits<RealOp> {};

// The MMA as a warp collective: every lane publishes its A and B values into the warp's slot at the (m, k) /
// (n, k) positions the real atom's layouts give them, then computes its own D values. Layouts map (lane, value)
// to a column-major index in the M x K, N x K and M x N tiles.
template <class RealOp, class TD, class DLayout, class TA, class ALayout, class TB, class BLayout, class TC, class CLayout>
void mma_unpack(MMA_Traits<sinkattn::emu80::EmuMma<RealOp>> const&, Tensor<TD, DLayout>& D,
                Tensor<TA, ALayout> const& A, Tensor<TB, BLayout> const& B, Tensor<TC, CLayout> const& C) {
  using T = MMA_Traits<RealOp>;
  constexpr int M = size<0>(typename T::Shape_MNK{});
  constexpr int N = size<1>(typename T::Shape_MNK{});
  constexpr int K = size<2>(typename T::Shape_MNK{});
  static_assert(M * K + N * K <= sinkattn::emu80::kWarpScratchFloats);
  float* buf = sinkattn::emu80::warp_slot();
  int lane = sinkattn::emu80::lane_id();
  for (int v = 0; v < size(A); ++v) buf[typename T::ALayout{}(lane, v)] = float(A(v));
  for (int v = 0; v < size(B); ++v) buf[M * K + typename T::BLayout{}(lane, v)] = float(B(v));
  sinkattn::emu80::sync_warp();
  float d[decltype(size(D))::value];
  for (int v = 0; v < size(D); ++v) {
    int idx = typename T::CLayout{}(lane, v);
    int m = idx % M, n = idx / M;
    float acc = C(v);
    for (int k = 0; k < K; ++k) acc += buf[m + M * k] * buf[M * K + n + N * k];
    d[v] = acc;
  }
  for (int v = 0; v < size(D); ++v) D(v) = d[v];  // D may be C: written once every value is computed
}

}  // namespace cute
