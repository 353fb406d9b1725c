// launch_tile.cuh: the launch of one tile configuration's kernel, shared by the sm80 forward and backward
// (nvcc only, no torch): a 1-D grid of `ctas` CTAs, checked against gridDim.x's limit, with the dynamic
// shared-memory opt-in a tile above 48 KB needs.
#pragma once
#include <cuda_runtime.h>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace sinkattn::sm80 {

template <class Kernel, class... Args>
void launch_tile_kernel(char const* op, Kernel kernel, int64_t ctas, int threads, int smem_bytes, cudaStream_t stream,
                        Args const&... args) {
  if (ctas == 0) return;
  if (ctas > 0x7fffffff) {  // gridDim.x holds at most 2^31 - 1 CTAs
    throw std::runtime_error(std::string("sinkattn ") + op + ": the problem needs " + std::to_string(ctas) +
                             " CTAs, past the 2^31 - 1 a grid holds; split the batch");
  }
  if (smem_bytes > 48 * 1024) {
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
  }
  kernel<<<dim3(unsigned(ctas)), dim3(threads), smem_bytes, stream>>>(args...);
}

}  // namespace sinkattn::sm80
