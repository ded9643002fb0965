#include "dtensor/kernels/kernels.h"

#include "absl/strings/str_cat.h"
#include "dtensor/kernels/cpu/cpu_kernels.h"
#include "dtensor/tensor/cuda_hooks.h"

namespace dtensor {

absl::StatusOr<Kernels*> KernelsFor(Device device) {
  if (device.is_cpu()) return CpuKernels();
  // The CUDA backend comes from the cuda component when it is linked in (cuda_hooks.h).
  const internal::CudaHooks* cuda = internal::GetCudaHooks();
  if (cuda == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("[KernelsFor] ", device.ToString(), " requested but ", internal::CudaNotLinkedMessage()));
  }
  return cuda->kernels(device.index);
}

}  // namespace dtensor
