// The compiler that builds the kernels says its own version here, not a string passed in by setup.py.
#include <string>
#include <cutlass/version.h>
#include "build_info.h"

namespace sinkattn {

#define SA_STR2(...) #__VA_ARGS__
#define SA_STR(...) SA_STR2(__VA_ARGS__)

std::string nvcc_version() {
  return std::to_string(__CUDACC_VER_MAJOR__) + "." + std::to_string(__CUDACC_VER_MINOR__) + "." +
         std::to_string(__CUDACC_VER_BUILD__);
}

std::string cutlass_version() {
  return std::to_string(CUTLASS_MAJOR) + "." + std::to_string(CUTLASS_MINOR) + "." + std::to_string(CUTLASS_PATCH);
}

std::string cuda_arch_list() {
#ifdef __CUDA_ARCH_LIST__
  return SA_STR(__CUDA_ARCH_LIST__);
#else
  return "";
#endif
}

}  // namespace sinkattn
