// The cuda component's side of dtensor/tensor/cuda_hooks.h: the CUDA runtime calls the
// caching allocator and device queries need, and the CUDA Kernels backend. Linked in by the
// component's link options (--undefined=dtensor_cuda_hooks_v1), found by dtensor_tensor's
// weak reference.
#include "dtensor/tensor/cuda_hooks.h"

#include <cuda_runtime.h>

#include <string>

#include "absl/strings/str_cat.h"
#include "dtensor/kernels/cuda/cuda_common.h"
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

// A failed allocation's status: ResourceExhausted only where the memory ran out
// (cudaErrorMemoryAllocation), so that the caching allocator's release-and-retry and a caller's
// "out of memory" fallback (a smaller batch) do not take a kernel fault reported by this call
// (an illegal address: the context is lost, Internal) or a missing device (FailedPrecondition)
// for one.
absl::Status AllocFailure(cudaError_t err, const std::string& where, const char* call, size_t n) {
  cudaGetLastError();  // clear the (non-sticky) error state
  return absl::Status(ToStatus(err, "Allocate", 0).code(),
                      absl::StrCat("[Allocate] ", where, ": ", call, " of ", n,
                                   " bytes failed: ", cudaGetErrorName(err), " (", cudaGetErrorString(err), ")"));
}

absl::StatusOr<void*> Malloc(int device, size_t n) {
  DeviceGuard guard(device);
  void* p = nullptr;
  const cudaError_t err = guard.ok() ? cudaMalloc(&p, n) : guard.error();
  if (err != cudaSuccess) return AllocFailure(err, absl::StrCat("cuda:", device), "cudaMalloc", n);
  return p;
}

void Free(int device, void* p) {
  DeviceGuard guard(device);
  if (guard.ok()) cudaFree(p);
}

absl::StatusOr<void*> HostMalloc(size_t n) {
  void* p = nullptr;
  const cudaError_t err = cudaHostAlloc(&p, n, cudaHostAllocPortable);
  if (err != cudaSuccess) return AllocFailure(err, "pinned host memory", "cudaHostAlloc", n);
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
