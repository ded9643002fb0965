// CudnnApi: the cuDNN (9.x) functions dtensor calls, loaded with dlopen on first use (internal).
//
//   DT_ASSIGN_OR_RETURN(const CudnnApi* dnn, Cudnn());   // FailedPrecondition: not installed
//   dnn->set(desc, CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid);
//
// cuDNN is optional twice over. At build time CMake looks for its headers beside the CUDA
// Toolkit (cudnn_graph.h, major version 9); without them the cuda component is built without
// this file and attention always runs dtensor's own kernels. At run time, as cuBLAS
// (cublas_api.h), nothing links cuDNN: the first attention that could use it loads
// libcudnn.so.<major> and resolves the backend (graph) API below, or fails naming the library,
// and attention then runs dtensor's own kernels. Each pointer's type is the header's declaration.
#ifndef DTENSOR_KERNELS_CUDA_CUDNN_API_H_
#define DTENSOR_KERNELS_CUDA_CUDNN_API_H_

#include <cudnn_graph.h>

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace dtensor::internal {

struct CudnnApi {
  decltype(&::cudnnGetVersion) version = nullptr;
  decltype(&::cudnnGetErrorString) error_string = nullptr;
  decltype(&::cudnnGetLastErrorString) last_error = nullptr;
  decltype(&::cudnnCreate) create = nullptr;
  decltype(&::cudnnDestroy) destroy = nullptr;
  decltype(&::cudnnSetStream) set_stream = nullptr;
  decltype(&::cudnnBackendCreateDescriptor) create_desc = nullptr;
  decltype(&::cudnnBackendDestroyDescriptor) destroy_desc = nullptr;
  decltype(&::cudnnBackendSetAttribute) set = nullptr;
  decltype(&::cudnnBackendGetAttribute) get = nullptr;
  decltype(&::cudnnBackendFinalize) finalize = nullptr;
  decltype(&::cudnnBackendExecute) execute = nullptr;

  // OK for CUDNN_STATUS_SUCCESS; otherwise an error naming `what`, the status and cuDNN's own
  // last message (kUnimplemented for the NOT_SUPPORTED family: the problem is outside what
  // cuDNN's engines take, which callers answer by running their own kernels).
  absl::Status Check(cudnnStatus_t status, const char* what) const;
};

// The loaded functions (loaded once per process; a failure is remembered).
absl::StatusOr<const CudnnApi*> Cudnn();

// The library file name dlopen is asked for ("libcudnn.so.9").
const char* CudnnLibraryName();

}  // namespace dtensor::internal

#endif  // DTENSOR_KERNELS_CUDA_CUDNN_API_H_
