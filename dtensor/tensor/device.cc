#include "dtensor/tensor/device.h"

#include "absl/strings/str_cat.h"

#ifdef DTENSOR_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace dtensor {

std::string Device::ToString() const { return is_cpu() ? std::string("cpu") : absl::StrCat("cuda:", index); }

std::ostream& operator<<(std::ostream& os, const Device& d) { return os << d.ToString(); }

bool CudaBuilt() {
#ifdef DTENSOR_WITH_CUDA
  return true;
#else
  return false;
#endif
}

int CudaDeviceCount() {
#ifdef DTENSOR_WITH_CUDA
  static const int count = [] {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
      cudaGetLastError();
      return 0;
    }
    return n;
  }();
  return count;
#else
  return 0;
#endif
}

}  // namespace dtensor
