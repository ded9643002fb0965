// CUDA cross-entropy over the last dim, forward and backward.
//
// Legend: logits, dlogits [N, V] contiguous; targets [N] int32/int64; losses, valid, lse
// float32 [N]; grad float32 [N] with stride grad_stride (0 broadcasts one value).
// One block per row. The forward reads the row once, keeping a running max and a running sum
// of exp(x - max) per thread (rescaled when the max grows), merged across the block; a 50257-
// wide GPT-2 row is one pass over memory. A target equal to ignore_index or outside [0, V)
// makes the row ignored: loss 0, valid 0, zero gradient (no device assert).
#include "dtensor/kernels/cuda/device_common.cuh"

namespace dtensor::internal::gpu {
namespace {

__device__ __forceinline__ bool TargetOk(int64_t t, int64_t ignore_index, int64_t v) {
  return t != ignore_index && t >= 0 && t < v;
}

template <typename T, typename I>
__global__ void CrossEntropyKernel(const T* logits, const I* targets, int64_t ignore_index, float* losses, float* valid,
                                   float* lse, int64_t n, int64_t v) {
  __shared__ float smem[64];
  for (int64_t r = blockIdx.x; r < n; r += gridDim.x) {
    const T* row = logits + r * v;
    MaxSum ms = EmptyMaxSum();
    for (int64_t j = threadIdx.x; j < v; j += blockDim.x) ms = MaxSumAdd(ms, ToFloat(row[j]));
    ms = BlockMaxSum(ms, smem);
    if (threadIdx.x == 0) {
      const auto t = static_cast<int64_t>(targets[r]);
      const bool ok = TargetOk(t, ignore_index, v);
      lse[r] = LogSumExp(ms);
      valid[r] = ok ? 1.0f : 0.0f;
      losses[r] = ok ? RowLoss(ms, ToFloat(row[t])) : 0.0f;
    }
  }
}

// The loss and gradient of each row in one visit: its max and sum, then (while the row is still
// in L2) its gradient; the logits are read from DRAM once and never stored as probabilities.
// losses may be null (CrossEntropyBackward): the statistics are recomputed rather than read
// from the forward's saved logsumexp, which is rounded at the magnitude of the row max.
template <typename T, typename I>
__global__ void CrossEntropyWithGradKernel(const T* logits, const I* targets, int64_t ignore_index, const float* grad,
                                           int64_t grad_stride, float* losses, T* dlogits, int64_t n, int64_t v) {
  __shared__ float smem[64];
  for (int64_t r = blockIdx.x; r < n; r += gridDim.x) {
    const T* row = logits + r * v;
    MaxSum ms = EmptyMaxSum();
    for (int64_t j = threadIdx.x; j < v; j += blockDim.x) ms = MaxSumAdd(ms, ToFloat(row[j]));
    ms = BlockMaxSum(ms, smem);  // every thread gets the row's result
    const float m = ms.m, log_s = LogSum(ms);
    const auto t = static_cast<int64_t>(targets[r]);
    const bool ok = TargetOk(t, ignore_index, v);
    if (losses != nullptr && threadIdx.x == 0) losses[r] = ok ? RowLoss(ms, ToFloat(row[t])) : 0.0f;
    const float g = ok ? grad[r * grad_stride] : 0.0f;
    T* out = dlogits + r * v;
    for (int64_t j = threadIdx.x; j < v; j += blockDim.x) {
      const float d = ok ? g * expf((ToFloat(row[j]) - m) - log_s) - (j == t ? g : 0.0f) : 0.0f;
      out[j] = FromFloat<T>(d);
    }
  }
}

// One block: count = the targets that are in [0, v) and not ignore_index.
template <typename I>
__global__ void CountTargetsKernel(const I* targets, int64_t ignore_index, int64_t v, float* count, int64_t n) {
  __shared__ float smem[32];
  float c = 0.0f;  // exact: a thread counts far fewer than 2^24
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x)
    c += TargetOk(static_cast<int64_t>(targets[i]), ignore_index, v) ? 1.0f : 0.0f;
  c = BlockSum(c, smem);
  if (threadIdx.x == 0) *count = c;
}

// x *= num / den; every thread returns at once when num == den.
template <typename T>
__global__ void ScaleByRatioKernel(T* x, const float* num, const float* den, int64_t n) {
  const float a = *num, b = *den;
  if (a == b) return;
  const float r = a / b;
  for (int64_t i = GlobalThread(); i < n; i += GridThreads()) x[i] = FromFloat<T>(ToFloat(x[i]) * r);
}

}  // namespace

cudaError_t LaunchCrossEntropy(DType dtype, const void* logits, DType target_dtype, const void* targets,
                               int64_t ignore_index, float* losses, float* valid, float* lse, int64_t n, int64_t v) {
  if (n <= 0) return cudaSuccess;
  return DispatchFloat(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    return DispatchIndex(target_dtype, [&](auto itag) {
      using I = typename decltype(itag)::type;
      CrossEntropyKernel<T, I><<<GridForRows(n), RowThreads(v), 0, cudaStreamPerThread>>>(
          static_cast<const T*>(logits), static_cast<const I*>(targets), ignore_index, losses, valid, lse, n, v);
      return cudaGetLastError();
    });
  });
}

cudaError_t LaunchCrossEntropyBackward(DType dtype, const void* logits, DType target_dtype, const void* targets,
                                       const float* grad, int64_t grad_stride, int64_t ignore_index, void* dlogits,
                                       int64_t n, int64_t v) {
  if (n <= 0 || v <= 0) return cudaSuccess;
  return LaunchCrossEntropyWithGrad(dtype, logits, target_dtype, targets, ignore_index, grad, grad_stride, nullptr,
                                    dlogits, n, v);
}

cudaError_t LaunchCrossEntropyWithGrad(DType dtype, const void* logits, DType target_dtype, const void* targets,
                                       int64_t ignore_index, const float* grad, int64_t grad_stride, float* losses,
                                       void* dlogits, int64_t n, int64_t v) {
  if (n <= 0) return cudaSuccess;
  return DispatchFloat(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    return DispatchIndex(target_dtype, [&](auto itag) {
      using I = typename decltype(itag)::type;
      CrossEntropyWithGradKernel<T, I><<<GridForRows(n), RowThreads(v), 0, cudaStreamPerThread>>>(
          static_cast<const T*>(logits), static_cast<const I*>(targets), ignore_index, grad, grad_stride, losses,
          static_cast<T*>(dlogits), n, v);
      return cudaGetLastError();
    });
  });
}

cudaError_t LaunchCountTargets(DType target_dtype, const void* targets, int64_t ignore_index, int64_t v, float* count,
                               int64_t n) {
  return DispatchIndex(target_dtype, [&](auto itag) {
    using I = typename decltype(itag)::type;
    CountTargetsKernel<I>
        <<<1, 1024, 0, cudaStreamPerThread>>>(static_cast<const I*>(targets), ignore_index, v, count, n);
    return cudaGetLastError();
  });
}

cudaError_t LaunchScaleByRatio(DType dtype, void* x, const float* num, const float* den, int64_t n) {
  if (n <= 0) return cudaSuccess;
  return DispatchFloat(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    ScaleByRatioKernel<T><<<GridFor(n), kThreads, 0, cudaStreamPerThread>>>(static_cast<T*>(x), num, den, n);
    return cudaGetLastError();
  });
}

}  // namespace dtensor::internal::gpu
