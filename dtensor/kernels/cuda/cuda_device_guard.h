// DeviceGuard: makes a CUDA device current for a scope (internal; CUDA builds only; not
// installed). Used by the cuda component's hooks (the caching allocator's device memory), the
// CUDA kernels and the NCCL backend.
//
//   DeviceGuard guard(index_);                         // cudaSetDevice; see below for the exit
//   if (!guard.ok()) return ToStatus(guard.error(), "Softmax", index_);
//
// On exit the previous device is made current again only when its primary context already
// exists. A thread that never chose a device reads device 0, and setting device 0 back would
// create a context there (cudaSetDevice initialises the primary context since CUDA 12): about
// 0.5 GiB of GPU 0 taken by every rank process of a multi-GPU node whose rank works on
// cuda:3. PyTorch's MaybeSetDevice makes the same check. Where the check cannot be made (a
// driver without the entry point), the previous device is restored as before.
#ifndef DTENSOR_KERNELS_CUDA_CUDA_DEVICE_GUARD_H_
#define DTENSOR_KERNELS_CUDA_CUDA_DEVICE_GUARD_H_

#include <cuda.h>  // driver API types only: the functions are looked up through the runtime
#include <cuda_runtime_api.h>

namespace dtensor::internal {

// Whether the primary context of CUDA device `device` exists (true when it cannot be told).
// Creates no context.
inline bool CudaPrimaryContextActive(int device) {
#if CUDART_VERSION < 12000
  // Before CUDA 12, cudaSetDevice creates no context, so restoring a device is harmless (and
  // cudaGetDriverEntryPoint has another signature, or does not exist).
  (void)device;
  return true;
#else
  struct Driver {
    CUresult (*device_get)(CUdevice*, int) = nullptr;
    CUresult (*get_state)(CUdevice, unsigned int*, int*) = nullptr;
  };
  static const Driver driver = [] {
    Driver d;
    void* get = nullptr;
    void* state = nullptr;
    cudaDriverEntryPointQueryResult q1 = cudaDriverEntryPointSymbolNotFound;
    cudaDriverEntryPointQueryResult q2 = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
    const bool found =
        cudaGetDriverEntryPointByVersion("cuDeviceGet", &get, 2000, cudaEnableDefault, &q1) == cudaSuccess &&
        cudaGetDriverEntryPointByVersion("cuDevicePrimaryCtxGetState", &state, 7000, cudaEnableDefault, &q2) ==
            cudaSuccess;
#else
    const bool found =
        cudaGetDriverEntryPoint("cuDeviceGet", &get, cudaEnableDefault, &q1) == cudaSuccess &&
        cudaGetDriverEntryPoint("cuDevicePrimaryCtxGetState", &state, cudaEnableDefault, &q2) == cudaSuccess;
#endif
    if (found && q1 == cudaDriverEntryPointSuccess && q2 == cudaDriverEntryPointSuccess) {
      d.device_get = reinterpret_cast<CUresult (*)(CUdevice*, int)>(get);
      d.get_state = reinterpret_cast<CUresult (*)(CUdevice, unsigned int*, int*)>(state);
    } else {
      cudaGetLastError();  // not sticky, but leave no error behind for the next check
    }
    return d;
  }();
  if (driver.get_state == nullptr) return true;  // not known: restore
  CUdevice dev = 0;
  unsigned int flags = 0;
  int active = 0;
  if (driver.device_get(&dev, device) != CUDA_SUCCESS) return true;
  if (driver.get_state(dev, &flags, &active) != CUDA_SUCCESS) return true;
  return active != 0;
#endif
}

// Makes `device` current for the guard's lifetime; see the top of this file for what is
// restored after.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    if (cudaGetDevice(&prev_) != cudaSuccess) prev_ = -1;
    if (prev_ != device) {
      error_ = cudaSetDevice(device);
      changed_ = error_ == cudaSuccess && prev_ >= 0 && CudaPrimaryContextActive(prev_);
    }
  }
  ~DeviceGuard() {
    if (changed_) cudaSetDevice(prev_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

  bool ok() const { return error_ == cudaSuccess; }
  cudaError_t error() const { return error_; }

 private:
  int prev_ = -1;
  bool changed_ = false;
  cudaError_t error_ = cudaSuccess;
};

}  // namespace dtensor::internal

#endif  // DTENSOR_KERNELS_CUDA_CUDA_DEVICE_GUARD_H_
