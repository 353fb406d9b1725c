// defs.h: qualifiers for code that compiles for the GPU and, unchanged, as host C++ (tests, emulation).
#pragma once

#if defined(__CUDACC__)
#define SA_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define SA_HOST_DEVICE inline
#endif
