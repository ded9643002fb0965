// DT_HOST_DEVICE: a function of a header shared by the CPU and CUDA kernels, compiled for both
// the host and the device under nvcc and as a plain inline function elsewhere (philox.h,
// cuda/max_sum.h). Such headers include no CUDA header, so CPU code and its tests use them too.
#ifndef DTENSOR_KERNELS_HOST_DEVICE_H_
#define DTENSOR_KERNELS_HOST_DEVICE_H_

#if defined(__CUDACC__)
#define DT_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define DT_HOST_DEVICE inline
#endif

#endif  // DTENSOR_KERNELS_HOST_DEVICE_H_
