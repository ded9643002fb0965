#include "dtensor/tensor/device_info.h"

#include "dtensor/tensor/cuda_hooks.h"
#include "dtensor/tensor/device.h"

namespace dtensor {

std::string CudaDeviceName(int index) {
  const internal::CudaHooks* cuda = internal::GetCudaHooks();
  if (cuda == nullptr || index < 0 || index >= CudaDeviceCount()) return "";
  return cuda->device_name(index);
}

int64_t CudaDeviceTotalMemory(int index) {
  const internal::CudaHooks* cuda = internal::GetCudaHooks();
  if (cuda == nullptr || index < 0 || index >= CudaDeviceCount()) return 0;
  return cuda->total_memory(index);
}

}  // namespace dtensor
