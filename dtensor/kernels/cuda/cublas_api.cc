#include "dtensor/kernels/cuda/cublas_api.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "dtensor/kernels/cuda/dl_library.h"
#include "dtensor/tensor/status.h"

namespace dtensor::internal {
namespace {

#define DT_STRINGIFY_(x) #x
#define DT_STRINGIFY(x) DT_STRINGIFY_(x)
constexpr const char* kLibrary = "libcublas.so." DT_STRINGIFY(CUBLAS_VER_MAJOR);
#undef DT_STRINGIFY
#undef DT_STRINGIFY_

absl::StatusOr<const CublasApi*> Load() {
  DT_ASSIGN_OR_RETURN(
      void* lib,
      OpenLibrary("cuBLAS", kLibrary,
                  "GPU matrix multiplies need the CUDA Toolkit's cuBLAS (its lib directory on the loader's path)"));
  static CublasApi api;
  std::string missing;
  ResolveSymbol(lib, "cublasCreate_v2", &api.create, &missing);
  ResolveSymbol(lib, "cublasDestroy_v2", &api.destroy, &missing);
  ResolveSymbol(lib, "cublasSetStream_v2", &api.set_stream, &missing);
  ResolveSymbol(lib, "cublasGetStatusName", &api.status_name, &missing);
  ResolveSymbol(lib, "cublasGetStatusString", &api.status_string, &missing);
  ResolveSymbol(lib, "cublasGemmStridedBatchedEx", &api.gemm_strided_batched_ex, &missing);
  if (!missing.empty()) return MissingSymbols("cuBLAS", kLibrary, missing);
  return &api;
}

// The declared signature of the exported function, as the header has it.
[[maybe_unused]] const auto kSignatureCheck =
    static_cast<decltype(CublasApi::gemm_strided_batched_ex)>(&::cublasGemmStridedBatchedEx);

}  // namespace

const char* CublasLibraryName() { return kLibrary; }

absl::StatusOr<const CublasApi*> Cublas() {
  static const absl::StatusOr<const CublasApi*> api = Load();
  return api;
}

}  // namespace dtensor::internal
