// CUDA reductions over the middle dim of [outer, reduce, inner], and softmax over rows.
//
// Reduce: accumulates in float for the float dtypes (NaN propagates through max/min) and in
// wrapping int64 for int32/int64 (mean truncates; an empty mean of ints is 0), as the CPU
// backend, except that float sums accumulate in float rather than double.
//   inner == 1: one warp per row (reduce <= 1024) or one block per row; a few long rows are
//               first split into chunks whose partial results go to `scratch`.
//   inner > 1:  32 x 32 blocks: 32 adjacent columns (coalesced), 32 threads down the reduce dim.
// SumOfSquares: double accumulation in a fixed number of blocks, then one block over their
// partial sums (deterministic, and no float32 temporary of x's size).
// Softmax: one block per row, a single pass for the (online) max and sum of exponentials,
// then one pass to write.
#include "dtensor/kernels/cuda/device_common.cuh"

namespace dtensor::internal::gpu {
namespace {

// Accumulator: float for the float dtypes, int64 for the integers.
template <typename T>
using Acc = std::conditional_t<kIsComputeFloat<T>, float, int64_t>;

template <typename A>
__device__ __forceinline__ A RedInit(RedOp op) {
  if constexpr (std::is_same_v<A, float>) {
    return op == RedOp::kMax ? -INFINITY : (op == RedOp::kMin ? INFINITY : 0.0f);
  } else {
    return op == RedOp::kMax ? std::numeric_limits<int64_t>::lowest()
                             : (op == RedOp::kMin ? std::numeric_limits<int64_t>::max() : int64_t{0});
  }
}

template <typename A>
__device__ __forceinline__ A RedMerge(RedOp op, A a, A v) {
  if constexpr (std::is_same_v<A, float>) {
    switch (op) {
      case RedOp::kMax:
        return NanMax(a, v);
      case RedOp::kMin:
        return NanMin(a, v);
      default:
        return a + v;
    }
  } else {
    switch (op) {
      case RedOp::kMax:
        return v > a ? v : a;
      case RedOp::kMin:
        return v < a ? v : a;
      default:
        return static_cast<int64_t>(static_cast<uint64_t>(a) + static_cast<uint64_t>(v));
    }
  }
}

// Element (or partial accumulator) -> accumulator.
template <typename A, typename In>
__device__ __forceinline__ A ToAcc(In v) {
  if constexpr (std::is_same_v<In, A>) {
    return v;
  } else if constexpr (std::is_same_v<A, float>) {
    return ToFloat(v);
  } else {
    return static_cast<A>(v);
  }
}

// The output element for accumulator a over `count` elements.
template <typename T, typename A>
__device__ __forceinline__ T RedFinish(RedOp op, A a, int64_t count) {
  if constexpr (std::is_same_v<A, float>) {
    return FromFloat<T>(op == RedOp::kMean ? a / static_cast<float>(count) : a);
  } else {
    if (op == RedOp::kMean) return static_cast<T>(count == 0 ? 0 : a / count);
    return static_cast<T>(a);
  }
}

template <typename A>
__device__ __forceinline__ A WarpReduce(RedOp op, A v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = RedMerge(op, v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Block-wide reduction; the result is valid in every thread.
template <typename A>
__device__ __forceinline__ A BlockReduce(RedOp op, A v, A* smem) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  v = WarpReduce(op, v);
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  A r = lane < warps ? smem[lane] : RedInit<A>(op);
  r = WarpReduce(op, r);
  __syncthreads();
  return r;
}

// out[r] = finish(reduce of x[r, 0:len]) for r < rows; x holds elements (In = T) or partial
// accumulators (In = A). `count` is the element count the mean divides by.
template <typename In, typename T, typename A>
__global__ void ReduceRowsKernel(RedOp op, const In* x, T* out, int64_t rows, int64_t len, int64_t count,
                                 bool warp_per_row) {
  __shared__ A smem[32];
  if (warp_per_row) {
    const int lane = threadIdx.x & 31;
    const int64_t warps = blockDim.x >> 5;
    for (int64_t r = blockIdx.x * warps + (threadIdx.x >> 5); r < rows; r += gridDim.x * warps) {
      const In* row = x + r * len;
      A acc = RedInit<A>(op);
      for (int64_t j = lane; j < len; j += 32) acc = RedMerge(op, acc, ToAcc<A>(row[j]));
      acc = WarpReduce(op, acc);
      if (lane == 0) out[r] = RedFinish<T>(op, acc, count);
    }
  } else {
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
      const In* row = x + r * len;
      A acc = RedInit<A>(op);
      for (int64_t j = threadIdx.x; j < len; j += blockDim.x) acc = RedMerge(op, acc, ToAcc<A>(row[j]));
      acc = BlockReduce(op, acc, smem);
      if (threadIdx.x == 0) out[r] = RedFinish<T>(op, acc, count);
    }
  }
}

// Stage one for a few long rows: block (chunk, row) reduces x[row, chunk*chunk_len : ...]
// into partial[row * chunks + chunk].
template <typename T, typename A>
__global__ void ReduceChunksKernel(RedOp op, const T* x, A* partial, int64_t rows, int64_t len, int64_t chunks,
                                   int64_t chunk_len) {
  __shared__ A smem[32];
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    for (int64_t c = blockIdx.x; c < chunks; c += gridDim.x) {
      const int64_t begin = c * chunk_len;
      const int64_t end = begin + chunk_len < len ? begin + chunk_len : len;
      const T* row = x + r * len;
      A acc = RedInit<A>(op);
      for (int64_t j = begin + threadIdx.x; j < end; j += blockDim.x) acc = RedMerge(op, acc, ToAcc<A>(row[j]));
      acc = BlockReduce(op, acc, smem);
      if (threadIdx.x == 0) partial[r * chunks + c] = acc;
    }
  }
}

// inner > 1: block (32, 32) owns 32 adjacent columns of one outer index at a time.
template <typename T, typename A>
__global__ void ReduceColsKernel(RedOp op, const T* x, T* out, int64_t outer, int64_t reduce, int64_t inner) {
  __shared__ A smem[32][33];
  const int64_t c = static_cast<int64_t>(blockIdx.x) * 32 + threadIdx.x;
  for (int64_t o = blockIdx.y; o < outer; o += gridDim.y) {
    A acc = RedInit<A>(op);
    if (c < inner) {
      const T* base = x + o * reduce * inner + c;
      for (int64_t r = threadIdx.y; r < reduce; r += 32) acc = RedMerge(op, acc, ToAcc<A>(base[r * inner]));
    }
    smem[threadIdx.y][threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.y == 0 && c < inner) {
      A a = smem[0][threadIdx.x];
      for (int y = 1; y < 32; ++y) a = RedMerge(op, a, smem[y][threadIdx.x]);
      out[o * inner + c] = RedFinish<T>(op, a, reduce);
    }
    __syncthreads();
  }
}

template <typename T>
__global__ void SoftmaxKernel(const T* x, T* y, int64_t rows, int64_t n, bool log) {
  __shared__ float smem[64];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * n;
    T* yr = y + r * n;
    MaxSum ms = EmptyMaxSum();
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) ms = MaxSumAdd(ms, ToFloat(xr[j]));
    ms = BlockMaxSum(ms, smem);
    if (log) {
      // (x - m) - log(s), as torch and the CPU kernel: x - (m + log(s)) rounds at m's magnitude.
      const float log_s = logf(ms.s);
      for (int64_t j = threadIdx.x; j < n; j += blockDim.x) yr[j] = FromFloat<T>((ToFloat(xr[j]) - ms.m) - log_s);
    } else {
      const float inv = 1.0f / ms.s;
      for (int64_t j = threadIdx.x; j < n; j += blockDim.x) yr[j] = FromFloat<T>(expf(ToFloat(xr[j]) - ms.m) * inv);
    }
  }
}

// softmax: dx = y * (dy - sum(dy * y)); log_softmax: dx = dy - exp(y) * sum(dy).
template <typename T>
__global__ void SoftmaxBackwardKernel(const T* dy, const T* y, T* dx, int64_t rows, int64_t n, bool log) {
  __shared__ float smem[32];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* dyr = dy + r * n;
    const T* yr = y + r * n;
    T* dxr = dx + r * n;
    float s = 0.0f;
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
      s += log ? ToFloat(dyr[j]) : ToFloat(dyr[j]) * ToFloat(yr[j]);
    }
    s = BlockSum(s, smem);
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
      const float g = ToFloat(dyr[j]), v = ToFloat(yr[j]);
      dxr[j] = FromFloat<T>(log ? g - expf(v) * s : v * (g - s));
    }
  }
}

// Sum of squares: 256 threads per block, up to kSquareBlocks blocks, each thread's elements
// grid-strided (coalesced), accumulated in double.
constexpr int kSquareThreads = 256;
constexpr int64_t kSquareBlocks = 1024;

// A block's doubles added in a fixed tree (blockDim.x == kSquareThreads); thread 0 gets the sum.
__device__ __forceinline__ double BlockSumDouble(double v, double* smem) {
  smem[threadIdx.x] = v;
  __syncthreads();
  for (int s = kSquareThreads / 2; s > 0; s >>= 1) {
    if (static_cast<int>(threadIdx.x) < s) smem[threadIdx.x] += smem[threadIdx.x + s];
    __syncthreads();
  }
  return smem[0];
}

template <typename T>
__global__ void SquarePartialsKernel(const T* x, int64_t n, double* partial) {
  __shared__ double smem[kSquareThreads];
  double acc = 0.0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kSquareThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kSquareThreads + threadIdx.x; i < n; i += stride) {
    const double v = ToFloat(x[i]);
    acc += v * v;
  }
  const double total = BlockSumDouble(acc, smem);
  if (threadIdx.x == 0) partial[blockIdx.x] = total;
}

__global__ void SquareTotalKernel(const double* partial, int64_t count, float* out) {
  __shared__ double smem[kSquareThreads];
  double acc = 0.0;
  for (int64_t i = threadIdx.x; i < count; i += kSquareThreads) acc += partial[i];
  const double total = BlockSumDouble(acc, smem);
  if (threadIdx.x == 0) out[0] = static_cast<float>(total);
}

// A row this long or longer, with few rows, is split into chunks first.
constexpr int64_t kChunkLen = 32768;
constexpr int64_t kFewRows = 128;

}  // namespace

int64_t ReduceScratchBytes(int64_t outer, int64_t reduce, int64_t inner) {
  if (inner != 1 || outer >= kFewRows || reduce < 2 * kChunkLen) return 0;
  const int64_t chunks = (reduce + kChunkLen - 1) / kChunkLen;
  return outer * chunks * static_cast<int64_t>(sizeof(int64_t));  // room for float or int64 partials
}

cudaError_t LaunchReduce(RedOp op, DType dtype, const void* x, void* out, int64_t outer, int64_t reduce, int64_t inner,
                         void* scratch) {
  if (outer <= 0 || inner <= 0) return cudaSuccess;
  return DispatchNumeric(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    using A = Acc<T>;
    const T* px = static_cast<const T*>(x);
    T* po = static_cast<T*>(out);
    if (inner > 1) {
      const dim3 grid(static_cast<unsigned>((inner + 31) / 32), static_cast<unsigned>(outer < 65535 ? outer : 65535));
      ReduceColsKernel<T, A><<<grid, dim3(32, 32), 0, cudaStreamPerThread>>>(op, px, po, outer, reduce, inner);
      return cudaGetLastError();
    }
    if (ReduceScratchBytes(outer, reduce, inner) > 0) {
      if (scratch == nullptr) return cudaErrorInvalidValue;
      const int64_t chunks = (reduce + kChunkLen - 1) / kChunkLen;
      A* partial = static_cast<A*>(scratch);
      const dim3 grid(static_cast<unsigned>(chunks < 65535 ? chunks : 65535), static_cast<unsigned>(outer));
      ReduceChunksKernel<T, A>
          <<<grid, 1024, 0, cudaStreamPerThread>>>(op, px, partial, outer, reduce, chunks, kChunkLen);
      ReduceRowsKernel<A, T, A><<<GridForRows(outer), RowThreads(chunks), 0, cudaStreamPerThread>>>(
          op, partial, po, outer, chunks, reduce, false);
      return cudaGetLastError();
    }
    if (reduce <= 1024) {  // one warp per row, 8 rows per block
      const int64_t blocks = (outer + 7) / 8;
      ReduceRowsKernel<T, T, A>
          <<<GridForRows(blocks), 256, 0, cudaStreamPerThread>>>(op, px, po, outer, reduce, reduce, true);
    } else {
      ReduceRowsKernel<T, T, A><<<GridForRows(outer), RowThreads(reduce), 0, cudaStreamPerThread>>>(
          op, px, po, outer, reduce, reduce, false);
    }
    return cudaGetLastError();
  });
}

int64_t SumOfSquaresPartials(int64_t n) {
  const int64_t per_block = int64_t{kSquareThreads} * 16;  // at least ~16 elements per thread
  const int64_t blocks = (n + per_block - 1) / per_block;
  return blocks < kSquareBlocks ? blocks : kSquareBlocks;
}

cudaError_t LaunchSumOfSquares(DType dtype, const void* x, int64_t n, double* partial, float* out) {
  const int64_t blocks = SumOfSquaresPartials(n);
  if (blocks > 0) {
    const cudaError_t err = DispatchFloat(dtype, [&](auto tag) {
      using T = typename decltype(tag)::type;
      SquarePartialsKernel<T><<<static_cast<unsigned>(blocks), kSquareThreads, 0, cudaStreamPerThread>>>(
          static_cast<const T*>(x), n, partial);
      return cudaGetLastError();
    });
    if (err != cudaSuccess) return err;
  }
  SquareTotalKernel<<<1, kSquareThreads, 0, cudaStreamPerThread>>>(partial, blocks, out);
  return cudaGetLastError();
}

cudaError_t LaunchSoftmax(DType dtype, const void* x, void* y, int64_t rows, int64_t n, bool log) {
  if (rows <= 0 || n <= 0) return cudaSuccess;
  return DispatchFloat(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    SoftmaxKernel<T><<<GridForRows(rows), RowThreads(n), 0, cudaStreamPerThread>>>(static_cast<const T*>(x),
                                                                                   static_cast<T*>(y), rows, n, log);
    return cudaGetLastError();
  });
}

cudaError_t LaunchSoftmaxBackward(DType dtype, const void* dy, const void* y, void* dx, int64_t rows, int64_t n,
                                  bool log) {
  if (rows <= 0 || n <= 0) return cudaSuccess;
  return DispatchFloat(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    SoftmaxBackwardKernel<T><<<GridForRows(rows), RowThreads(n), 0, cudaStreamPerThread>>>(
        static_cast<const T*>(dy), static_cast<const T*>(y), static_cast<T*>(dx), rows, n, log);
    return cudaGetLastError();
  });
}

}  // namespace dtensor::internal::gpu
