#include "dtensor/tensor/device_info.h"

#include "dtensor/tensor/device.h"

#ifdef DTENSOR_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace dtensor {

namespace {

#ifdef DTENSOR_WITH_CUDA
bool Properties(int index, cudaDeviceProp* prop) {
  if (index < 0 || index >= CudaDeviceCount()) return false;
  if (cudaGetDeviceProperties(prop, index) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return true;
}
#endif

}  // namespace

std::string CudaDeviceName(int index) {
#ifdef DTENSOR_WITH_CUDA
  cudaDeviceProp prop{};
  if (Properties(index, &prop)) return prop.name;
#endif
  (void)index;
  return "";
}

int64_t CudaDeviceTotalMemory(int index) {
#ifdef DTENSOR_WITH_CUDA
  cudaDeviceProp prop{};
  if (Properties(index, &prop)) return static_cast<int64_t>(prop.totalGlobalMem);
#endif
  (void)index;
  return 0;
}

}  // namespace dtensor
