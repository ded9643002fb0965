#include "dtensor/collectives/nccl/nccl_api.h"

#include <dlfcn.h>

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace dtensor::internal {
namespace {

#define DT_STRINGIFY_(x) #x
#define DT_STRINGIFY(x) DT_STRINGIFY_(x)
constexpr const char* kLibrary = "libnccl.so." DT_STRINGIFY(NCCL_MAJOR);
#undef DT_STRINGIFY
#undef DT_STRINGIFY_

NcclApi api;

template <typename F>
void Resolve(void* lib, const char* name, F* out, std::string* missing) {
  void* p = dlsym(lib, name);
  if (p == nullptr) {
    absl::StrAppend(missing, missing->empty() ? "" : ", ", name);
    return;
  }
  *out = reinterpret_cast<F>(p);
}

absl::Status Load() {
  // Never closed: communicators use it until the process exits.
  void* lib = dlopen(kLibrary, RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* why = dlerror();
    return absl::FailedPreconditionError(
        absl::StrCat("[NCCL] ", kLibrary, " could not be loaded (", why != nullptr ? why : "no reason given",
                     "): the nccl backend needs NCCL installed (its directory on the loader's path)"));
  }
  std::string missing;
  Resolve(lib, "ncclAllGather", &api.ncclAllGather, &missing);
  Resolve(lib, "ncclAllReduce", &api.ncclAllReduce, &missing);
  Resolve(lib, "ncclBroadcast", &api.ncclBroadcast, &missing);
  Resolve(lib, "ncclCommAbort", &api.ncclCommAbort, &missing);
  Resolve(lib, "ncclCommCount", &api.ncclCommCount, &missing);
  Resolve(lib, "ncclCommDestroy", &api.ncclCommDestroy, &missing);
  Resolve(lib, "ncclCommFinalize", &api.ncclCommFinalize, &missing);
  Resolve(lib, "ncclCommGetAsyncError", &api.ncclCommGetAsyncError, &missing);
  Resolve(lib, "ncclCommInitRankConfig", &api.ncclCommInitRankConfig, &missing);
  Resolve(lib, "ncclCommSplit", &api.ncclCommSplit, &missing);
  Resolve(lib, "ncclCommUserRank", &api.ncclCommUserRank, &missing);
  Resolve(lib, "ncclGetErrorString", &api.ncclGetErrorString, &missing);
  Resolve(lib, "ncclGetLastError", &api.ncclGetLastError, &missing);
  Resolve(lib, "ncclGetUniqueId", &api.ncclGetUniqueId, &missing);
  Resolve(lib, "ncclGroupEnd", &api.ncclGroupEnd, &missing);
  Resolve(lib, "ncclGroupStart", &api.ncclGroupStart, &missing);
  Resolve(lib, "ncclRecv", &api.ncclRecv, &missing);
  Resolve(lib, "ncclReduce", &api.ncclReduce, &missing);
  Resolve(lib, "ncclReduceScatter", &api.ncclReduceScatter, &missing);
  Resolve(lib, "ncclSend", &api.ncclSend, &missing);
  if (!missing.empty()) {
    return absl::FailedPreconditionError(absl::StrCat("[NCCL] ", kLibrary, " lacks ", missing,
                                                      " (an older NCCL than the headers dtensor was built with?)"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status LoadNccl() {
  static const absl::Status loaded = Load();
  return loaded;
}

const NcclApi& Nccl() { return api; }

const char* NcclLibraryName() { return kLibrary; }

}  // namespace dtensor::internal
