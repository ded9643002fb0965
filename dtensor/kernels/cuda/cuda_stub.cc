// Built instead of the CUDA backend when the CUDA Toolkit is not found.
#include "absl/strings/str_cat.h"
#include "dtensor/kernels/cuda/cuda_kernels.h"

namespace dtensor {

absl::StatusOr<Kernels*> CudaKernels(int index) {
  return absl::FailedPreconditionError(
      absl::StrCat("[CudaKernels] cuda:", index, " requested but dtensor was built without CUDA"));
}

}  // namespace dtensor
