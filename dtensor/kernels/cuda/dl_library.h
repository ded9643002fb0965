// Loading an optional CUDA library with dlopen (internal): cuBLAS, cuBLASLt and cuDNN are
// loaded this way on first use (cublas_api.h, cublaslt_api.h, cudnn_api.h), so a program built
// with the CUDA components starts, and runs on the CPU, where they are not installed.
//
//   DT_ASSIGN_OR_RETURN(void* lib, OpenLibrary("cuDNN", "libcudnn.so.9", "attention runs ..."));
//   std::string missing;
//   ResolveSymbol(lib, "cudnnCreate", &api.create, &missing);
//   if (!missing.empty()) return MissingSymbols("cuDNN", "libcudnn.so.9", missing);
#ifndef DTENSOR_KERNELS_CUDA_DL_LIBRARY_H_
#define DTENSOR_KERNELS_CUDA_DL_LIBRARY_H_

#include <dlfcn.h>

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace dtensor::internal {

// dlopen(file, RTLD_NOW | RTLD_LOCAL), never closed (handles and functions from it stay in use
// until the process exits); FailedPrecondition "[tag] file could not be loaded (dlerror):
// `consequence`" when it fails.
absl::StatusOr<void*> OpenLibrary(const char* tag, const char* file, const char* consequence);

// *out = the function `name` of `lib`, cast to the header's declared type; where `lib` lacks
// it, *out is left alone and the name is appended to *missing (comma separated).
template <typename F>
void ResolveSymbol(void* lib, const char* name, F* out, std::string* missing) {
  void* p = dlsym(lib, name);
  if (p == nullptr) {
    absl::StrAppend(missing, missing->empty() ? "" : ", ", name);
    return;
  }
  *out = reinterpret_cast<F>(p);
}

// FailedPrecondition "[tag] file lacks `missing` (an older tag than the headers dtensor was
// built with?)".
absl::Status MissingSymbols(const char* tag, const char* file, const std::string& missing);

}  // namespace dtensor::internal

#endif  // DTENSOR_KERNELS_CUDA_DL_LIBRARY_H_
