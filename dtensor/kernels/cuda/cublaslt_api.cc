#include "dtensor/kernels/cuda/cublaslt_api.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "dtensor/kernels/cuda/dl_library.h"
#include "dtensor/tensor/status.h"

namespace dtensor::internal {
namespace {

#define DT_STRINGIFY_(x) #x
#define DT_STRINGIFY(x) DT_STRINGIFY_(x)
constexpr const char* kLibrary = "libcublasLt.so." DT_STRINGIFY(CUBLAS_VER_MAJOR);
#undef DT_STRINGIFY
#undef DT_STRINGIFY_

absl::StatusOr<const CublasLtApi*> Load() {
  DT_ASSIGN_OR_RETURN(
      void* lib, OpenLibrary("cuBLASLt", kLibrary, "fused matrix multiply epilogues need the CUDA Toolkit's cuBLASLt"));
  static CublasLtApi api;
  std::string missing;
  ResolveSymbol(lib, "cublasLtCreate", &api.create, &missing);
  ResolveSymbol(lib, "cublasLtDestroy", &api.destroy, &missing);
  ResolveSymbol(lib, "cublasLtMatmulDescCreate", &api.desc_create, &missing);
  ResolveSymbol(lib, "cublasLtMatmulDescDestroy", &api.desc_destroy, &missing);
  ResolveSymbol(lib, "cublasLtMatmulDescSetAttribute", &api.desc_set, &missing);
  ResolveSymbol(lib, "cublasLtMatrixLayoutCreate", &api.layout_create, &missing);
  ResolveSymbol(lib, "cublasLtMatrixLayoutDestroy", &api.layout_destroy, &missing);
  ResolveSymbol(lib, "cublasLtMatmulPreferenceCreate", &api.pref_create, &missing);
  ResolveSymbol(lib, "cublasLtMatmulPreferenceDestroy", &api.pref_destroy, &missing);
  ResolveSymbol(lib, "cublasLtMatmulPreferenceSetAttribute", &api.pref_set, &missing);
  ResolveSymbol(lib, "cublasLtMatmulAlgoGetHeuristic", &api.heuristic, &missing);
  ResolveSymbol(lib, "cublasLtMatmul", &api.matmul, &missing);
  if (!missing.empty()) return MissingSymbols("cuBLASLt", kLibrary, missing);
  return &api;
}

}  // namespace

const char* CublasLtLibraryName() { return kLibrary; }

absl::StatusOr<const CublasLtApi*> CublasLt() {
  static const absl::StatusOr<const CublasLtApi*> api = Load();
  return api;
}

}  // namespace dtensor::internal
