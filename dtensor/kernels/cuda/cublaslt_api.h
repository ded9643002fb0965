// CublasLtApi: the cuBLASLt functions dtensor calls, loaded with dlopen on first use (internal).
//
//   DT_ASSIGN_OR_RETURN(const CublasLtApi* lt, CublasLt());   // FailedPrecondition: not installed
//   lt->matmul(handle, desc, &alpha, a, a_layout, ...);
//
// As cuBLAS (cublas_api.h): the cuda component links no cuBLASLt; the first matrix multiply with
// an epilogue (Kernels::GemmBias, GemmBiasGrad, GemmDgelu) loads libcublasLt.so.<major> and
// resolves the functions below, or fails naming the library, and those then run unfused. Each
// pointer's type is the header's declaration.
#ifndef DTENSOR_KERNELS_CUDA_CUBLASLT_API_H_
#define DTENSOR_KERNELS_CUDA_CUBLASLT_API_H_

#include <cublasLt.h>

#include "absl/status/statusor.h"

namespace dtensor::internal {

struct CublasLtApi {
  decltype(&::cublasLtCreate) create = nullptr;
  decltype(&::cublasLtDestroy) destroy = nullptr;
  decltype(&::cublasLtMatmulDescCreate) desc_create = nullptr;
  decltype(&::cublasLtMatmulDescDestroy) desc_destroy = nullptr;
  decltype(&::cublasLtMatmulDescSetAttribute) desc_set = nullptr;
  decltype(&::cublasLtMatrixLayoutCreate) layout_create = nullptr;
  decltype(&::cublasLtMatrixLayoutDestroy) layout_destroy = nullptr;
  decltype(&::cublasLtMatmulPreferenceCreate) pref_create = nullptr;
  decltype(&::cublasLtMatmulPreferenceDestroy) pref_destroy = nullptr;
  decltype(&::cublasLtMatmulPreferenceSetAttribute) pref_set = nullptr;
  decltype(&::cublasLtMatmulAlgoGetHeuristic) heuristic = nullptr;
  decltype(&::cublasLtMatmul) matmul = nullptr;
};

// The loaded functions (loaded once per process; a failure is remembered).
absl::StatusOr<const CublasLtApi*> CublasLt();

// The library file name dlopen is asked for ("libcublasLt.so.13").
const char* CublasLtLibraryName();

}  // namespace dtensor::internal

#endif  // DTENSOR_KERNELS_CUDA_CUBLASLT_API_H_
