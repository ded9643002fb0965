// CublasApi: the cuBLAS functions dtensor calls, loaded with dlopen on first use (internal).
//
//   DT_ASSIGN_OR_RETURN(const CublasApi* cublas, Cublas());   // FailedPrecondition: not installed
//   cublas->create(&handle);
//
// The cuda component links no cuBLAS: a program built with it starts, and runs on CPU, where
// libcublas is not installed; the first GPU matrix multiply loads libcublas.so.<major> (the
// major version of the headers dtensor was built with) and resolves the functions below, or
// fails naming the library and the loader's reason. Each pointer's type is checked against
// the header's declaration at compile time.
#ifndef DTENSOR_KERNELS_CUDA_CUBLAS_API_H_
#define DTENSOR_KERNELS_CUDA_CUBLAS_API_H_

#include <cublas_v2.h>

#include "absl/status/statusor.h"

namespace dtensor::internal {

struct CublasApi {
  decltype(&::cublasCreate_v2) create = nullptr;
  decltype(&::cublasDestroy_v2) destroy = nullptr;
  decltype(&::cublasSetStream_v2) set_stream = nullptr;
  decltype(&::cublasGetStatusName) status_name = nullptr;
  decltype(&::cublasGetStatusString) status_string = nullptr;
  // The header also has an inline overload of this name; this is the exported function.
  cublasStatus_t (*gemm_strided_batched_ex)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int,
                                            const void*, const void*, cudaDataType, int, long long int, const void*,
                                            cudaDataType, int, long long int, const void*, void*, cudaDataType, int,
                                            long long int, int, cublasComputeType_t, cublasGemmAlgo_t) = nullptr;
};

// The loaded functions (loaded once per process; a failure is remembered).
absl::StatusOr<const CublasApi*> Cublas();

// The library file name dlopen is asked for ("libcublas.so.13").
const char* CublasLibraryName();

}  // namespace dtensor::internal

#endif  // DTENSOR_KERNELS_CUDA_CUBLAS_API_H_
