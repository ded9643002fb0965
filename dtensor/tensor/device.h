// Device: where a Tensor's memory lives — the host (CPU) or one CUDA GPU.
//
//   Device d = Device::Cuda(0);
//   if (CudaDeviceCount() == 0) d = Device::Cpu();   // no GPU visible: stay on the host
//   std::string s = d.ToString();                    // "cpu" or "cuda:0"
//
// Compute device and transport are separate axes: a Device says where bytes live, the
// collectives layer says how they move between ranks.
#ifndef DTENSOR_TENSOR_DEVICE_H_
#define DTENSOR_TENSOR_DEVICE_H_

#include <cstdint>
#include <ostream>
#include <string>

namespace dtensor {

enum class DeviceType : uint8_t { kCPU, kCUDA };

struct Device {
  DeviceType type = DeviceType::kCPU;
  int index = 0;  // GPU ordinal for kCUDA; always 0 for kCPU

  static constexpr Device Cpu() { return Device{DeviceType::kCPU, 0}; }
  static constexpr Device Cuda(int index = 0) { return Device{DeviceType::kCUDA, index}; }
  constexpr bool is_cpu() const { return type == DeviceType::kCPU; }
  constexpr bool is_cuda() const { return type == DeviceType::kCUDA; }
  std::string ToString() const;

  friend constexpr bool operator==(const Device& a, const Device& b) { return a.type == b.type && a.index == b.index; }
};

std::ostream& operator<<(std::ostream& os, const Device& d);

// True when this program has dtensor's CUDA support: built with the CUDA Toolkit and linked
// with the cuda component (dtensor::cuda, part of dtensor::dtensor). A program linked only
// with the CPU components has no CUDA code and needs no CUDA library.
bool CudaBuilt();

// Number of CUDA devices visible to this process; 0 when CUDA is not built or linked, no
// driver is installed or no GPU is present. Never fails.
int CudaDeviceCount();

}  // namespace dtensor

#endif  // DTENSOR_TENSOR_DEVICE_H_
