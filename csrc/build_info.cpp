#include "build_info.h"

#include <iterator>

namespace sinkattn {

static std::vector<KernelInfo>& registry_storage() {
  static std::vector<KernelInfo> r;  // function-local: safe whatever the static-initialisation order
  return r;
}

int register_kernel(KernelInfo const& info) {
  registry_storage().push_back(info);
  return static_cast<int>(registry_storage().size());
}

std::vector<KernelInfo> const& kernel_registry() { return registry_storage(); }

std::vector<int> kernel_headdims() { return {std::begin(kKernelHeadDims), std::end(kKernelHeadDims)}; }

KernelInfo const* find_kernel(std::string const& family, std::string const& op, int headdim, std::string const& dtype) {
  for (auto const& k : registry_storage()) {
    if (family == k.family && op == k.op && headdim == k.headdim && dtype == k.dtype) return &k;
  }
  return nullptr;
}

}  // namespace sinkattn
