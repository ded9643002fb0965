// The cuda component's side of dtensor/tensor/cuda_hooks.h: the CUDA runtime calls the
// caching allocator and device queries need, and the CUDA Kernels backend. Linked in by the
// component's link options (--undefined=dtensor_cuda_hooks_v1), found by dtensor_tensor's
// weak reference.
#include "dtensor/tensor/cuda_hooks.h"

#include <cuda_runtime.h>

#include "absl/strings/str_cat.h"
#include "dtensor/kernels/cuda/cuda_device_guard.h"
#include "dtensor/kernels/cuda/cuda_kernels.h"

namespace dtensor::internal {
namespace {

int DeviceCount() {
  int n = 0;
  // Without a driver (libcuda.so.1, loaded by the static runtime) this fails: no devices.
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

absl::StatusOr<void*> Malloc(int device, size_t n) {
  DeviceGuard guard(device);
  void* p = nullptr;
  const cudaError_t err = guard.ok() ? cudaMalloc(&p, n) : guard.error();
  if (err != cudaSuccess) {
    cudaGetLastError();  // clear the (non-sticky) error state
    return absl::ResourceExhaustedError(
        absl::StrCat("[Allocate] cuda:", device, ": cudaMalloc of ", n, " bytes failed: ", cudaGetErrorString(err)));
  }
  return p;
}

void Free(int device, void* p) {
  DeviceGuard guard(device);
  if (guard.ok()) cudaFree(p);
}

absl::StatusOr<void*> HostMalloc(size_t n) {
  void* p = nullptr;
  const cudaError_t err = cudaHostAlloc(&p, n, cudaHostAllocPortable);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return absl::ResourceExhaustedError(absl::StrCat("[Allocate] pinned host memory: cudaHostAlloc of ", n,
                                                     " bytes failed: ", cudaGetErrorString(err)));
  }
  return p;
}

void HostFree(void* p) { cudaFreeHost(p); }

bool Properties(int device, cudaDeviceProp* prop) {
  if (cudaGetDeviceProperties(prop, device) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return true;
}

std::string DeviceName(int device) {
  cudaDeviceProp prop{};
  return Properties(device, &prop) ? std::string(prop.name) : std::string();
}

int64_t TotalMemory(int device) {
  cudaDeviceProp prop{};
  return Properties(device, &prop) ? static_cast<int64_t>(prop.totalGlobalMem) : 0;
}

const CudaHooks kHooks = {
    .device_count = DeviceCount,
    .malloc = Malloc,
    .free = Free,
    .host_malloc = HostMalloc,
    .host_free = HostFree,
    .device_name = DeviceName,
    .total_memory = TotalMemory,
    .kernels = CudaKernels,
};

}  // namespace
}  // namespace dtensor::internal

extern "C" const dtensor::internal::CudaHooks* dtensor_cuda_hooks_v1(void) { return &dtensor::internal::kHooks; }
