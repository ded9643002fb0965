#include "dtensor/kernels/cuda/cublaslt_api.h"

#include <dlfcn.h>

#include <string>

#include "absl/strings/str_cat.h"

namespace dtensor::internal {
namespace {

#define DT_STRINGIFY_(x) #x
#define DT_STRINGIFY(x) DT_STRINGIFY_(x)
constexpr const char* kLibrary = "libcublasLt.so." DT_STRINGIFY(CUBLAS_VER_MAJOR);
#undef DT_STRINGIFY
#undef DT_STRINGIFY_

template <typename F>
void Resolve(void* lib, const char* name, F* out, std::string* missing) {
  void* p = dlsym(lib, name);
  if (p == nullptr) {
    absl::StrAppend(missing, missing->empty() ? "" : ", ", name);
    return;
  }
  *out = reinterpret_cast<F>(p);
}

absl::StatusOr<const CublasLtApi*> Load() {
  // Never closed: handles and the functions stay in use until the process exits.
  void* lib = dlopen(kLibrary, RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* why = dlerror();
    return absl::FailedPreconditionError(
        absl::StrCat("[cuBLASLt] ", kLibrary, " could not be loaded (", why != nullptr ? why : "no reason given",
                     "): fused matrix multiply epilogues need the CUDA Toolkit's cuBLASLt"));
  }
  static CublasLtApi api;
  std::string missing;
  Resolve(lib, "cublasLtCreate", &api.create, &missing);
  Resolve(lib, "cublasLtDestroy", &api.destroy, &missing);
  Resolve(lib, "cublasLtMatmulDescCreate", &api.desc_create, &missing);
  Resolve(lib, "cublasLtMatmulDescDestroy", &api.desc_destroy, &missing);
  Resolve(lib, "cublasLtMatmulDescSetAttribute", &api.desc_set, &missing);
  Resolve(lib, "cublasLtMatrixLayoutCreate", &api.layout_create, &missing);
  Resolve(lib, "cublasLtMatrixLayoutDestroy", &api.layout_destroy, &missing);
  Resolve(lib, "cublasLtMatmulPreferenceCreate", &api.pref_create, &missing);
  Resolve(lib, "cublasLtMatmulPreferenceDestroy", &api.pref_destroy, &missing);
  Resolve(lib, "cublasLtMatmulPreferenceSetAttribute", &api.pref_set, &missing);
  Resolve(lib, "cublasLtMatmulAlgoGetHeuristic", &api.heuristic, &missing);
  Resolve(lib, "cublasLtMatmul", &api.matmul, &missing);
  if (!missing.empty()) {
    return absl::FailedPreconditionError(absl::StrCat("[cuBLASLt] ", kLibrary, " lacks ", missing,
                                                      " (an older cuBLASLt than the headers dtensor was built with?)"));
  }
  return &api;
}

}  // namespace

const char* CublasLtLibraryName() { return kLibrary; }

absl::StatusOr<const CublasLtApi*> CublasLt() {
  static const absl::StatusOr<const CublasLtApi*> api = Load();
  return api;
}

}  // namespace dtensor::internal
