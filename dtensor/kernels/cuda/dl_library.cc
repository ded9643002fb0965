#include "dtensor/kernels/cuda/dl_library.h"

namespace dtensor::internal {

absl::StatusOr<void*> OpenLibrary(const char* tag, const char* file, const char* consequence) {
  void* lib = dlopen(file, RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* why = dlerror();
    return absl::FailedPreconditionError(absl::StrCat("[", tag, "] ", file, " could not be loaded (",
                                                      why != nullptr ? why : "no reason given", "): ", consequence));
  }
  return lib;
}

absl::Status MissingSymbols(const char* tag, const char* file, const std::string& missing) {
  return absl::FailedPreconditionError(absl::StrCat("[", tag, "] ", file, " lacks ", missing, " (an older ", tag,
                                                    " than the headers dtensor was built with?)"));
}

}  // namespace dtensor::internal
