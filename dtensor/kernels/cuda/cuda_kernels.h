// The CUDA backend of Kernels: cuBLAS for matrix multiplies, dtensor's own kernels for the
// rest, all issued on the calling thread's stream (cudaStreamPerThread). Compiled whenever the
// CUDA Toolkit is found (sm_80 and sm_90); without it, a stub whose CudaKernels() says so.
#ifndef DTENSOR_KERNELS_CUDA_CUDA_KERNELS_H_
#define DTENSOR_KERNELS_CUDA_CUDA_KERNELS_H_

#include "absl/status/statusor.h"
#include "dtensor/kernels/kernels.h"

namespace dtensor {

// The backend of CUDA device `index`. FailedPrecondition when this build has no CUDA or the
// device is not visible (naming the index and the device count).
absl::StatusOr<Kernels*> CudaKernels(int index);

}  // namespace dtensor

#endif  // DTENSOR_KERNELS_CUDA_CUDA_KERNELS_H_
