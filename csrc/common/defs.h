// defs.h: qualifiers for code that compiles for the GPU and, unchanged, as host C++ (tests, emulation).
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
#else
#define SA_UNROLL
#endif
