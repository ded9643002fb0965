#include "dtensor/kernels/cuda/cudnn_api.h"

#include <array>
#include <string>

#include "absl/strings/str_cat.h"
#include "dtensor/kernels/cuda/dl_library.h"
#include "dtensor/tensor/status.h"

namespace dtensor::internal {
namespace {

#define DT_STRINGIFY_(x) #x
#define DT_STRINGIFY(x) DT_STRINGIFY_(x)
constexpr const char* kLibrary = "libcudnn.so." DT_STRINGIFY(CUDNN_MAJOR);
#undef DT_STRINGIFY
#undef DT_STRINGIFY_

absl::StatusOr<const CudnnApi*> Load() {
  DT_ASSIGN_OR_RETURN(void* lib, OpenLibrary("cuDNN", kLibrary, "fused attention then runs dtensor's own kernels"));
  static CudnnApi api;
  std::string missing;
  ResolveSymbol(lib, "cudnnGetVersion", &api.version, &missing);
  ResolveSymbol(lib, "cudnnGetErrorString", &api.error_string, &missing);
  ResolveSymbol(lib, "cudnnGetLastErrorString", &api.last_error, &missing);
  ResolveSymbol(lib, "cudnnCreate", &api.create, &missing);
  ResolveSymbol(lib, "cudnnDestroy", &api.destroy, &missing);
  ResolveSymbol(lib, "cudnnSetStream", &api.set_stream, &missing);
  ResolveSymbol(lib, "cudnnBackendCreateDescriptor", &api.create_desc, &missing);
  ResolveSymbol(lib, "cudnnBackendDestroyDescriptor", &api.destroy_desc, &missing);
  ResolveSymbol(lib, "cudnnBackendSetAttribute", &api.set, &missing);
  ResolveSymbol(lib, "cudnnBackendGetAttribute", &api.get, &missing);
  ResolveSymbol(lib, "cudnnBackendFinalize", &api.finalize, &missing);
  ResolveSymbol(lib, "cudnnBackendExecute", &api.execute, &missing);
  if (!missing.empty()) return MissingSymbols("cuDNN", kLibrary, missing);
  // The graph API this file uses (SDPA patterns, device properties) needs 9.8 or newer.
  const size_t version = api.version();
  if (version < 90800) {
    return absl::FailedPreconditionError(
        absl::StrCat("[cuDNN] ", kLibrary, " is version ", version, "; dtensor's fused attention needs 9.8 or newer"));
  }
  return &api;
}

bool NotSupported(cudnnStatus_t s) {
  return static_cast<int>(s) / 1000 == static_cast<int>(CUDNN_STATUS_NOT_SUPPORTED) / 1000;  // 3000-3999
}

}  // namespace

absl::Status CudnnApi::Check(cudnnStatus_t status, const char* what) const {
  if (status == CUDNN_STATUS_SUCCESS) return absl::OkStatus();
  std::array<char, 512> last{};
  last_error(last.data(), last.size());
  std::string msg = absl::StrCat("[cuDNN] ", what, ": ", error_string(status));
  if (last[0] != '\0') absl::StrAppend(&msg, " (", last.data(), ")");
  return NotSupported(status) ? absl::UnimplementedError(msg) : absl::InternalError(msg);
}

const char* CudnnLibraryName() { return kLibrary; }

absl::StatusOr<const CudnnApi*> Cudnn() {
  static const absl::StatusOr<const CudnnApi*> api = Load();
  return api;
}

}  // namespace dtensor::internal
