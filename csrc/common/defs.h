// defs.h: qualifiers for code that compiles for the GPU and, unchanged, as host C++ (tests, emulation), and the
// integer helpers every tile computation shares.
#pragma once

#if defined(__CUDACC__)
#define SA_HOST_DEVICE __host__ __device__ __forceinline__
#define SA_DEVICE __device__ __forceinline__  // kernel code that the host emulation also compiles (as host code)
#else
#define SA_HOST_DEVICE inline
#define SA_DEVICE inline
#endif

// Full unrolling of a loop with a compile-time trip count, on the GPU (the host emulation leaves it to the
// compiler, as CuTe's CUTE_UNROLL does).
#if defined(__CUDA_ARCH__)
#define SA_UNROLL _Pragma("unroll")
#define SA_NO_UNROLL _Pragma("unroll 1")
#else
#define SA_UNROLL
#define SA_NO_UNROLL
#endif

namespace sinkattn {

// Integer helpers for block counts and bounds (host and device). Named min_i / max_i, not min / max: kernel code
// has `using namespace cute`, whose min / max (and std's) would be ambiguous with an unqualified call.
SA_HOST_DEVICE int ceil_div(int a, int b) { return (a + b - 1) / b; }
SA_HOST_DEVICE int max_i(int a, int b) { return a > b ? a : b; }
SA_HOST_DEVICE int min_i(int a, int b) { return a < b ? a : b; }

}  // namespace sinkattn
