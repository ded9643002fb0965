// The CPU backend of Kernels: OpenMP-parallel loops (one thread pool, shared with OpenBLAS's
// OpenMP build) and OpenBLAS sgemm for matrix multiplies. It is the reference backend: every
// op exists here, and the CUDA backend is tested against it.
#ifndef DTENSOR_KERNELS_CPU_CPU_KERNELS_H_
#define DTENSOR_KERNELS_CPU_CPU_KERNELS_H_

#include "dtensor/kernels/kernels.h"

namespace dtensor {

// The process-wide CPU backend (stateless; never null).
Kernels* CpuKernels();

}  // namespace dtensor

#endif  // DTENSOR_KERNELS_CPU_CPU_KERNELS_H_
