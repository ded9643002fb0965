// Prints what loading the CUDA libraries on first use gives (cublas_api.h, nccl_api.h) and what
// a CUDA request says in this process. Run by cuda_libs_test.cmake twice: as is, and with the
// CUDA libraries hidden from the loader.
#include <cstdio>

#include "dtensor/collectives/nccl/nccl_api.h"
#include "dtensor/kernels/cuda/cublas_api.h"
#include "dtensor/tensor/device.h"
#include "dtensor/tensor/tensor.h"

int main() {
  const auto cublas = dtensor::internal::Cublas();
  std::printf("cublas: %s\n", cublas.ok() ? "loaded" : cublas.status().ToString().c_str());
  const absl::Status nccl = dtensor::internal::LoadNccl();
  std::printf("nccl: %s\n", nccl.ok() ? "loaded" : nccl.ToString().c_str());
  std::printf("cuda built: %d, devices: %d\n", dtensor::CudaBuilt() ? 1 : 0, dtensor::CudaDeviceCount());
  const auto t = dtensor::Tensor::Empty({4}, dtensor::DType::kFloat32, dtensor::Device::Cuda(0));
  std::printf("cuda tensor: %s\n", t.ok() ? "made" : t.status().ToString().c_str());
  const auto c = dtensor::Tensor::Empty({4}, dtensor::DType::kFloat32, dtensor::Device::Cpu());
  std::printf("cpu tensor: %s\n", c.ok() ? "made" : c.status().ToString().c_str());
  return c.ok() ? 0 : 1;
}
