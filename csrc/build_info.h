// build_info.h: the registry of compiled kernels and the versions baked in at build time.
//
// Each generated kernel translation unit registers itself with the archs it was really compiled for
// (SINKATTN_COMPILED_ARCHS comes from the same build rule that gives its -gencode flags), so the
// capability report lists what this binary holds. No torch here: kernels include this header.
#pragma once
#include <string>
#include <vector>

namespace sinkattn {

struct KernelInfo {
  const char* name;      // e.g. "fwd_sm80_hdim128_bf16"
  const char* family;    // "common", "sm80", "sm90", "sm80-emulated"
  const char* op;        // "fwd", "merge", ...
  int headdim;           // 0 when not applicable
  const char* dtype;     // "bf16", "fp16", "fp32"
  const char* features;  // comma-separated: what the kernel serves (dispatch reads it)
  int smem_bytes;        // shared memory per block its smallest tile needs: below it the kernel cannot run
  const char* archs;     // comma-separated real archs ("sm_80,sm_90") or "host"
  void* fn;              // the launcher; its signature is fixed per (family, op)
};

// The head dims the kernels are instantiated for, the one list of them: SINKATTN_HEADDIMS picks among these, and a
// call runs on the smallest one that holds its head dim (the kernels pad the rest). csrc/generate_kernels.py parses
// this declaration (keep it one line, of this form) and build_info()["kernel_headdims"] exports it, which
// sinkattn/layout.py reads.
inline constexpr int kKernelHeadDims[] = {64, 128, 256};
std::vector<int> kernel_headdims();  // kKernelHeadDims, for the extension's build_info

int register_kernel(KernelInfo const& info);
std::vector<KernelInfo> const& kernel_registry();
KernelInfo const* find_kernel(std::string const& family, std::string const& op, int headdim, std::string const& dtype);

// Baked into build_info_cuda.cu by nvcc itself.
std::string nvcc_version();
std::string cutlass_version();
std::string cuda_arch_list();  // __CUDA_ARCH_LIST__ of that translation unit

}  // namespace sinkattn

#ifndef SINKATTN_COMPILED_ARCHS
#define SINKATTN_COMPILED_ARCHS "unknown"
#endif
#define SINKATTN_REGISTER_KERNEL(id, family, op, hdim, dtype, features, smem_bytes, fn)                   \
  static const int sinkattn_registered_##id = ::sinkattn::register_kernel(                                \
      {#id, family, op, hdim, dtype, features, smem_bytes, SINKATTN_COMPILED_ARCHS, reinterpret_cast<void*>(&fn)});
