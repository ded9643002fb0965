// CudaHooks: how dtensor_tensor and dtensor_kernels reach CUDA without linking it (internal;
// not installed).
//
//   const internal::CudaHooks* cuda = internal::GetCudaHooks();
//   if (cuda == nullptr) return ...;           // this program has no CUDA code linked in
//   int n = cuda->device_count();
//
// The CPU components (tensor, kernels and everything above them) call no CUDA function and
// link no CUDA library: a program that does not link dtensor's cuda component
// (dtensor_kernels_cuda, `dtensor::cuda`, dtensor-cuda.pc) has no CUDA code at all. That
// component defines the extern "C" function dtensor_cuda_hooks_v1(), which dtensor_tensor
// declares weak: linked in (its link options name the symbol, so the linker takes its object
// from the archive), it returns the table below; not linked, the weak reference is null and
// every CUDA request fails with a message saying so. The component itself links the CUDA
// runtime statically and loads cuBLAS and NCCL with dlopen on first use, so a program that
// links everything still starts, and runs on CPU, where no CUDA library is installed.
#ifndef DTENSOR_TENSOR_CUDA_HOOKS_H_
#define DTENSOR_TENSOR_CUDA_HOOKS_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace dtensor {

class Kernels;

namespace internal {

struct CudaHooks {
  // Devices visible to this process; 0 without a driver or a GPU. Never fails.
  int (*device_count)() = nullptr;
  // cudaMalloc / cudaFree of `device` (made current for the call).
  absl::StatusOr<void*> (*malloc)(int device, size_t bytes) = nullptr;
  void (*free)(int device, void* p) = nullptr;
  // Page-locked host memory usable by every device (cudaHostAlloc, portable / cudaFreeHost).
  absl::StatusOr<void*> (*host_malloc)(size_t bytes) = nullptr;
  void (*host_free)(void* p) = nullptr;
  // The device's name and memory; "" / 0 when it cannot be told.
  std::string (*device_name)(int device) = nullptr;
  int64_t (*total_memory)(int device) = nullptr;
  // The Kernels backend of `device` (dtensor/kernels/cuda/cuda_kernels.h).
  absl::StatusOr<Kernels*> (*kernels)(int device) = nullptr;
};

// The cuda component's hooks; nullptr when it is not linked into this program.
const CudaHooks* GetCudaHooks();

// What a CUDA request without the hooks says: dtensor built without CUDA, or the program
// linked without the cuda component.
std::string CudaNotLinkedMessage();

}  // namespace internal
}  // namespace dtensor

// Defined by the cuda component (dtensor/kernels/cuda/cuda_hooks.cc).
extern "C" const dtensor::internal::CudaHooks* dtensor_cuda_hooks_v1(void);

#endif  // DTENSOR_TENSOR_CUDA_HOOKS_H_
