#include "dtensor/tensor/device.h"

#include "absl/strings/str_cat.h"
#include "dtensor/tensor/cuda_hooks.h"

// Weak: null unless the cuda component is linked in (cuda_hooks.h).
extern "C" __attribute__((weak)) const dtensor::internal::CudaHooks* dtensor_cuda_hooks_v1(void);

namespace dtensor {

std::string Device::ToString() const { return is_cpu() ? std::string("cpu") : absl::StrCat("cuda:", index); }

std::ostream& operator<<(std::ostream& os, const Device& d) { return os << d.ToString(); }

namespace internal {

const CudaHooks* GetCudaHooks() {
  static const CudaHooks* hooks = dtensor_cuda_hooks_v1 != nullptr ? dtensor_cuda_hooks_v1() : nullptr;
  return hooks;
}

std::string CudaNotLinkedMessage() {
  return "this program has no CUDA support: dtensor was built without the CUDA Toolkit, or the program was "
         "linked without dtensor's cuda component (CMake: dtensor::cuda, or dtensor::dtensor; pkg-config: "
         "dtensor-cuda)";
}

}  // namespace internal

bool CudaBuilt() { return internal::GetCudaHooks() != nullptr; }

int CudaDeviceCount() {
  static const int count = [] {
    const internal::CudaHooks* cuda = internal::GetCudaHooks();
    return cuda == nullptr ? 0 : cuda->device_count();
  }();
  return count;
}

}  // namespace dtensor
