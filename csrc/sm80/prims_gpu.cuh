// prims_gpu.cuh: the hardware pieces of the sm80 kernels on a real GPU (nvcc only).
#pragma once
#include <cute/arch/copy_sm75.hpp>
#include <cute/arch/copy_sm80.hpp>
#include <cute/arch/mma_sm80.hpp>
#include <type_traits>
#include <cutlass/numeric_types.h>

namespace sinkattn::sm80 {

struct GpuPrims {
  template <class Element>
  using Mma = std::conditional_t<std::is_same_v<Element, cutlass::bfloat16_t>, cute::SM80_16x8x16_F32BF16BF16F32_TN,
                                 cute::SM80_16x8x16_F32F16F16F32_TN>;
  using GmemCopyAsync = cute::SM80_CP_ASYNC_CACHEGLOBAL<cute::uint128_t>;
  using LdsmN = cute::SM75_U32x4_LDSM_N;
  using LdsmT = cute::SM75_U16x8_LDSM_T;
  using SmemStore32 = cute::UniversalCopy<uint32_t>;
  using SmemLoad128 = cute::UniversalCopy<cute::uint128_t>;

  static __device__ __forceinline__ void sync_threads() { __syncthreads(); }
  static __device__ __forceinline__ float shfl_xor(float x, int lane_mask) {
    return __shfl_xor_sync(0xffffffffu, x, lane_mask);
  }
  // Whether x holds on any lane of the warp (every lane must call it).
  static __device__ __forceinline__ bool any(bool x) { return __any_sync(0xffffffffu, x); }
  // x, through an instruction the front end cannot see into (no SASS beyond a register move, if any).
  static __device__ __forceinline__ int opaque(int x) {
    int y;
    asm("mov.b32 %0, %1;" : "=r"(y) : "r"(x));
    return y;
  }
  // Scalar shared-memory traffic outside the tiled copies (the split-keys merge of fwd_kernel.h).
  static __device__ __forceinline__ void smem_store(float* p, float x) { *p = x; }
  static __device__ __forceinline__ float smem_load(float const* p) { return *p; }
  // 16-byte shared-memory traffic of the FP8 conversion pass (sm80/fp8_kv.h).
  template <class V>
  static __device__ __forceinline__ void smem_store_vec(V* p, V const& x) { *p = x; }
  template <class V>
  static __device__ __forceinline__ V smem_load_vec(V const* p) { return *p; }
  // One 16-byte cp.async issued under a predicate (one predicated LDGSTS, no branch), so that ptxas can schedule
  // the copy and its address work in the caller's basic block.
  static __device__ __forceinline__ void cp_async_16_if(bool pred, void const* gmem, void* smem) {
    unsigned const s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    asm volatile(
        "{\n .reg .pred p;\n setp.ne.b32 p, %0, 0;\n @p cp.async.cg.shared.global [%1], [%2], 16;\n}\n" ::"r"(int(pred)),
        "r"(s), "l"(gmem));
  }
  static __device__ __forceinline__ void cp_async_fence() { cute::cp_async_fence(); }
  template <int N>
  static __device__ __forceinline__ void cp_async_wait() { cute::cp_async_wait<N>(); }
  template <class Tensor_>
  static __device__ __forceinline__ void zero_fill(Tensor_&& t) { cute::clear(t); }
  static __device__ __forceinline__ void atomic_add(float* p, float x) { atomicAdd(p, x); }
  // Counters of the deterministic backward (one thread of a CTA waits / signals).
  static __device__ __forceinline__ void wait_until_equal(int* p, int value) {
    while (atomicAdd(p, 0) != value) __nanosleep(32);
    __threadfence();
  }
  static __device__ __forceinline__ void thread_fence() { __threadfence(); }
  static __device__ __forceinline__ void signal(int* p, int value) { atomicExch(p, value); }
};

}  // namespace sinkattn::sm80
