// What a device is, for reports (MFU's peak FLOP/s by GPU model, the trainer's banner).
//
//   std::string name = CudaDeviceName(0);     // "NVIDIA H100 80GB HBM3", or "" without that GPU
//   int64_t bytes = CudaDeviceTotalMemory(0);  // 0 without that GPU
#ifndef DTENSOR_TENSOR_DEVICE_INFO_H_
#define DTENSOR_TENSOR_DEVICE_INFO_H_

#include <cstdint>
#include <string>

namespace dtensor {

// The name of CUDA device `index` as the driver reports it, or "" when CUDA is not built or
// that device is not visible. Never fails.
std::string CudaDeviceName(int index);

// Total memory of CUDA device `index` in bytes, or 0 when CUDA is not built or that device is
// not visible. Never fails.
int64_t CudaDeviceTotalMemory(int index);

}  // namespace dtensor

#endif  // DTENSOR_TENSOR_DEVICE_INFO_H_
