#include "dtensor/kernels/cuda/cublas_api.h"

#include <dlfcn.h>

#include <string>

#include "absl/strings/str_cat.h"

namespace dtensor::internal {
namespace {

#define DT_STRINGIFY_(x) #x
#define DT_STRINGIFY(x) DT_STRINGIFY_(x)
constexpr const char* kLibrary = "libcublas.so." DT_STRINGIFY(CUBLAS_VER_MAJOR);
#undef DT_STRINGIFY
#undef DT_STRINGIFY_

template <typename F>
bool Resolve(void* lib, const char* name, F* out, std::string* missing) {
  void* p = dlsym(lib, name);
  if (p == nullptr) {
    absl::StrAppend(missing, missing->empty() ? "" : ", ", name);
    return false;
  }
  *out = reinterpret_cast<F>(p);
  return true;
}

absl::StatusOr<const CublasApi*> Load() {
  // Never closed: handles and the functions stay in use until the process exits.
  void* lib = dlopen(kLibrary, RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* why = dlerror();
    return absl::FailedPreconditionError(absl::StrCat(
        "[cuBLAS] ", kLibrary, " could not be loaded (", why != nullptr ? why : "no reason given",
        "): GPU matrix multiplies need the CUDA Toolkit's cuBLAS (its lib directory on the loader's path)"));
  }
  static CublasApi api;
  std::string missing;
  Resolve(lib, "cublasCreate_v2", &api.create, &missing);
  Resolve(lib, "cublasDestroy_v2", &api.destroy, &missing);
  Resolve(lib, "cublasSetStream_v2", &api.set_stream, &missing);
  Resolve(lib, "cublasGetStatusName", &api.status_name, &missing);
  Resolve(lib, "cublasGetStatusString", &api.status_string, &missing);
  Resolve(lib, "cublasGemmStridedBatchedEx", &api.gemm_strided_batched_ex, &missing);
  if (!missing.empty()) {
    return absl::FailedPreconditionError(absl::StrCat("[cuBLAS] ", kLibrary, " lacks ", missing,
                                                      " (an older cuBLAS than the headers dtensor was built with?)"));
  }
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
