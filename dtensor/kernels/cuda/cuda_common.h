// Host-side helpers of the CUDA backend (internal; not installed): error conversion, the
// device guard (from dtensor/kernels/cuda/cuda_device_guard.h), and Tensor -> gpu::Layout conversion.
//
//   DeviceGuard guard(index_);                         // cudaSetDevice (see cuda_device_guard.h)
//   if (!guard.ok()) return ToStatus(guard.error(), "Softmax", index_);
//   DT_ASSIGN_OR_RETURN(auto l, Layouts<2>("Copy", dst.shape(), {dst.strides(), src.strides()}));
//   return ToStatus(gpu::LaunchCopy(..., l[0], ..., l[1], n), "Copy", index_);
#ifndef DTENSOR_KERNELS_CUDA_CUDA_COMMON_H_
#define DTENSOR_KERNELS_CUDA_CUDA_COMMON_H_

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <array>
#include <cstddef>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "dtensor/kernels/cuda/cublas_api.h"
#include "dtensor/kernels/cuda/cuda_device_guard.h"  // DeviceGuard
#include "dtensor/kernels/cuda/launch.h"
#include "dtensor/tensor/tensor.h"

namespace dtensor::internal {

static_assert(gpu::kMaxDims == kMaxDims, "launch.h's kMaxDims must equal tensor.h's");

// "[op] cuda:N: cudaErrorX (description)"; OK for cudaSuccess. Out of memory ->
// ResourceExhausted, a bad argument -> InvalidArgument, a missing/unusable device ->
// FailedPrecondition, an unsupported feature -> Unimplemented, anything else -> Internal
// (e.g. an illegal address reported by a later call: the context is then unusable).
inline absl::Status ToStatus(cudaError_t err, const char* op, int device) {
  if (err == cudaSuccess) return absl::OkStatus();
  const std::string msg =
      absl::StrCat("[", op, "] cuda:", device, ": ", cudaGetErrorName(err), " (", cudaGetErrorString(err), ")");
  switch (err) {
    case cudaErrorMemoryAllocation:
      return absl::ResourceExhaustedError(msg);
    case cudaErrorInvalidValue:
    case cudaErrorInvalidConfiguration:
    case cudaErrorInvalidDevicePointer:
    case cudaErrorInvalidMemcpyDirection:
      return absl::InvalidArgumentError(msg);
    case cudaErrorNoDevice:
    case cudaErrorInvalidDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorDevicesUnavailable:
    case cudaErrorNoKernelImageForDevice:
      return absl::FailedPreconditionError(msg);
    case cudaErrorNotSupported:
      return absl::UnimplementedError(msg);
    default:
      return absl::InternalError(msg);
  }
}

// "[op] cuda:N: cuBLAS CUBLAS_STATUS_X (description)"; OK for CUBLAS_STATUS_SUCCESS.
inline absl::Status ToStatus(cublasStatus_t st, const char* op, int device) {
  if (st == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  // A status comes from a loaded cuBLAS (cublas_api.h).
  const absl::StatusOr<const CublasApi*> cublas = Cublas();
  const std::string msg = cublas.ok()
                              ? absl::StrCat("[", op, "] cuda:", device, ": cuBLAS ", (*cublas)->status_name(st), " (",
                                             (*cublas)->status_string(st), ")")
                              : absl::StrCat("[", op, "] cuda:", device, ": cuBLAS status ", static_cast<int>(st));
  switch (st) {
    case CUBLAS_STATUS_ALLOC_FAILED:
      return absl::ResourceExhaustedError(msg);
    case CUBLAS_STATUS_INVALID_VALUE:
      return absl::InvalidArgumentError(msg);
    case CUBLAS_STATUS_NOT_INITIALIZED:
      return absl::FailedPreconditionError(msg);
    case CUBLAS_STATUS_NOT_SUPPORTED:
    case CUBLAS_STATUS_ARCH_MISMATCH:
      return absl::UnimplementedError(msg);
    default:
      return absl::InternalError(msg);
  }
}

// Runs `launch` (returning cudaError_t) with `device` current; a failure becomes a Status
// naming `op`.
template <typename F>
absl::Status OnDevice(int device, const char* op, F&& launch) {
  DeviceGuard guard(device);
  if (!guard.ok()) return ToStatus(guard.error(), op, device);
  return ToStatus(launch(), op, device);
}

// Layouts of N operands of one shape (each with its own strides) for an elementwise kernel:
// size-1 dims are dropped and neighbouring dims merged wherever every operand allows, keeping
// row-major element order (so a contiguous operand's offset of element i stays i).
// InvalidArgument naming `op` when more than kMaxDims dims remain.
template <size_t N>
absl::StatusOr<std::array<gpu::Layout, N>> Layouts(const char* op, IntSpan shape,
                                                   const std::array<IntSpan, N>& strides) {
  std::array<gpu::Layout, N> out;
  int nd = 0;
  for (size_t d = 0; d < shape.size(); ++d) {
    if (shape[d] == 1) continue;
    if (nd > 0) {
      bool merge = true;
      for (size_t k = 0; k < N; ++k) merge = merge && out[k].strides[nd - 1] == strides[k][d] * shape[d];
      if (merge) {
        for (size_t k = 0; k < N; ++k) {
          out[k].sizes[nd - 1] *= shape[d];
          out[k].strides[nd - 1] = strides[k][d];
        }
        continue;
      }
    }
    if (nd == gpu::kMaxDims) {
      return absl::InvalidArgumentError(absl::StrCat("[", op, "] shape ", ShapeString(shape), " has more than ",
                                                     gpu::kMaxDims, " dims that cannot be merged"));
    }
    for (size_t k = 0; k < N; ++k) {
      out[k].sizes[nd] = shape[d];
      out[k].strides[nd] = strides[k][d];
    }
    ++nd;
  }
  for (size_t k = 0; k < N; ++k) {
    if (nd == 0) {  // one element
      out[k].sizes[0] = 1;
      out[k].strides[0] = 0;
    }
    out[k].ndim = nd == 0 ? 1 : nd;
  }
  return out;
}

// A contiguous run of n elements.
inline gpu::Layout ContiguousLayout(int64_t n) {
  gpu::Layout l;
  l.ndim = 1;
  l.sizes[0] = n;
  l.strides[0] = 1;
  return l;
}

}  // namespace dtensor::internal

#endif  // DTENSOR_KERNELS_CUDA_CUDA_COMMON_H_
