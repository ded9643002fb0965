#include "dtensor/kernels/kernels.h"

#include "dtensor/kernels/cpu/cpu_kernels.h"
#include "dtensor/kernels/cuda/cuda_kernels.h"

namespace dtensor {

absl::StatusOr<Kernels*> KernelsFor(Device device) {
  if (device.is_cpu()) return CpuKernels();
  return CudaKernels(device.index);
}

}  // namespace dtensor
