// Device-side helpers shared by the CUDA kernels of this folder (internal; not installed):
// element <-> float conversions matching the CPU backend, strided offsets, dtype dispatch,
// launch sizes and warp/block reductions.
//
//   template <typename T>
//   __global__ void Scale(T* out, const T* a, gpu::Layout al, int64_t n, float s) {
//     for (int64_t i = GlobalThread(); i < n; i += GridThreads())
//       Store(out + i, s * Load(a[Offset(al, i)]));
//   }
//   return DispatchFloat(dtype, [&](auto tag) {
//     using T = typename decltype(tag)::type;
//     Scale<T><<<GridFor(n), kThreads, 0, cudaStreamPerThread>>>(...);
//     return cudaGetLastError();
//   });
//
// Conversions follow cpu_internal.h: float types compute in float and round once (nearest
// even); float -> integer truncates, saturates and maps NaN to 0; integer -> integer wraps;
// anything -> bool is != 0; float8 converts without saturation (e4m3 overflow -> NaN,
// e5m2 overflow -> inf), as dtype.h's host types do.
#ifndef DTENSOR_KERNELS_CUDA_DEVICE_COMMON_CUH_
#define DTENSOR_KERNELS_CUDA_DEVICE_COMMON_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "dtensor/kernels/cuda/launch.h"
#include "dtensor/kernels/cuda/max_sum.h"
#include "dtensor/tensor/dtype.h"

namespace dtensor::internal::gpu {

// ---------------------------------------------------------------------------------------
// Element types
// ---------------------------------------------------------------------------------------

// float8 storage on the device (one byte, no arithmetic).
struct F8E4M3 {
  uint8_t bits;
};
struct F8E5M2 {
  uint8_t bits;
};

template <typename T>
inline constexpr bool kIsComputeFloat =
    std::is_same_v<T, float> || std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>;
template <typename T>
inline constexpr bool kIsFloat8 = std::is_same_v<T, F8E4M3> || std::is_same_v<T, F8E5M2>;
template <typename T>
inline constexpr bool kIsInt = std::is_same_v<T, int32_t> || std::is_same_v<T, int64_t>;

// Any element -> float (exact for the float types; integers rounded to nearest).
template <typename T>
__device__ __forceinline__ float ToFloat(T v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __bfloat162float(v);
  } else if constexpr (std::is_same_v<T, __half>) {
    return __half2float(v);
  } else if constexpr (std::is_same_v<T, F8E4M3>) {
    return __half2float(__half(__nv_cvt_fp8_to_halfraw(v.bits, __NV_E4M3)));
  } else if constexpr (std::is_same_v<T, F8E5M2>) {
    return __half2float(__half(__nv_cvt_fp8_to_halfraw(v.bits, __NV_E5M2)));
  } else if constexpr (std::is_same_v<T, bool>) {
    return v ? 1.0f : 0.0f;
  } else {
    return static_cast<float>(v);
  }
}

// float -> integer: truncates toward zero, saturates at the type's range, NaN -> 0.
template <typename I>
__device__ __forceinline__ I FloatToInt(float f) {
  constexpr float kHi = -static_cast<float>(std::numeric_limits<I>::min());  // 2^31 or 2^63
  if (!(f == f)) return 0;
  if (f >= kHi) return std::numeric_limits<I>::max();
  if (f < -kHi) return std::numeric_limits<I>::min();
  return static_cast<I>(f);
}
template <typename I>
__device__ __forceinline__ I DoubleToInt(double d) {
  constexpr double kHi = -static_cast<double>(std::numeric_limits<I>::min());
  if (!(d == d)) return 0;
  if (d >= kHi) return std::numeric_limits<I>::max();
  if (d < -kHi) return std::numeric_limits<I>::min();
  return static_cast<I>(d);
}

// float -> any element, one rounding (nearest even) for the float types.
template <typename T>
__device__ __forceinline__ T FromFloat(float f) {
  if constexpr (std::is_same_v<T, float>) {
    return f;
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __float2bfloat16_rn(f);
  } else if constexpr (std::is_same_v<T, __half>) {
    return __float2half_rn(f);
  } else if constexpr (std::is_same_v<T, F8E4M3>) {
    return F8E4M3{static_cast<uint8_t>(__nv_cvt_float_to_fp8(f, __NV_NOSAT, __NV_E4M3))};
  } else if constexpr (std::is_same_v<T, F8E5M2>) {
    return F8E5M2{static_cast<uint8_t>(__nv_cvt_float_to_fp8(f, __NV_NOSAT, __NV_E5M2))};
  } else if constexpr (std::is_same_v<T, bool>) {
    return f != 0.0f;
  } else {
    return FloatToInt<T>(f);
  }
}

// double -> any element as the CPU's FromDouble: float types through float (two roundings
// for 16-bit types), integers truncate with saturation, bool is != 0.
template <typename T>
__device__ __forceinline__ T FromDouble(double d) {
  if constexpr (std::is_same_v<T, bool>) {
    return d != 0.0;
  } else if constexpr (kIsInt<T>) {
    return DoubleToInt<T>(d);
  } else {
    return FromFloat<T>(static_cast<float>(d));
  }
}

// Load/store in compute precision (float for the float types).
template <typename T>
__device__ __forceinline__ float Load(const T* p) {
  return ToFloat(*p);
}
template <typename T>
__device__ __forceinline__ void Store(T* p, float v) {
  *p = FromFloat<T>(v);
}

// ---------------------------------------------------------------------------------------
// dtype dispatch (host side of the .cu files)
// ---------------------------------------------------------------------------------------

template <typename T>
struct Tag {
  using type = T;
};

// f(Tag<T>{}) for the float compute types; cudaErrorInvalidValue otherwise.
template <typename F>
cudaError_t DispatchFloat(DType t, F&& f) {
  switch (t) {
    case DType::kFloat32:
      return f(Tag<float>{});
    case DType::kBFloat16:
      return f(Tag<__nv_bfloat16>{});
    case DType::kFloat16:
      return f(Tag<__half>{});
    default:
      return cudaErrorInvalidValue;
  }
}
// As DispatchFloat plus int32 and int64.
template <typename F>
cudaError_t DispatchNumeric(DType t, F&& f) {
  switch (t) {
    case DType::kInt32:
      return f(Tag<int32_t>{});
    case DType::kInt64:
      return f(Tag<int64_t>{});
    default:
      return DispatchFloat(t, static_cast<F&&>(f));
  }
}
// int32 / int64 index types.
template <typename F>
cudaError_t DispatchIndex(DType t, F&& f) {
  switch (t) {
    case DType::kInt32:
      return f(Tag<int32_t>{});
    case DType::kInt64:
      return f(Tag<int64_t>{});
    default:
      return cudaErrorInvalidValue;
  }
}
// Every dtype.
template <typename F>
cudaError_t DispatchAll(DType t, F&& f) {
  switch (t) {
    case DType::kBool:
      return f(Tag<bool>{});
    case DType::kFloat8E4M3:
      return f(Tag<F8E4M3>{});
    case DType::kFloat8E5M2:
      return f(Tag<F8E5M2>{});
    default:
      return DispatchNumeric(t, static_cast<F&&>(f));
  }
}

// ---------------------------------------------------------------------------------------
// Indexing and launch sizes
// ---------------------------------------------------------------------------------------

// Element offset of the i-th element (row-major over l.sizes) of an operand.
__device__ __forceinline__ int64_t Offset(const Layout& l, int64_t i) {
  if (l.ndim == 1) return i * l.strides[0];
  int64_t off = 0;
  for (int d = l.ndim - 1; d > 0; --d) {
    const int64_t size = l.sizes[d];
    const int64_t q = i / size;
    off += (i - q * size) * l.strides[d];
    i = q;
  }
  return off + i * l.strides[0];
}

__device__ __forceinline__ int64_t GlobalThread() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ int64_t GridThreads() { return static_cast<int64_t>(gridDim.x) * blockDim.x; }

// Threads per block of the elementwise (grid-stride) kernels.
inline constexpr int kThreads = 256;
// Blocks for a grid-stride loop over n items with `threads` per block: enough to fill any
// current GPU several times over; larger problems loop.
inline unsigned GridFor(int64_t n, int threads = kThreads) {
  constexpr int64_t kMaxBlocks = int64_t{1} << 16;
  int64_t blocks = (n + threads - 1) / threads;
  if (blocks > kMaxBlocks) blocks = kMaxBlocks;
  if (blocks < 1) blocks = 1;
  return static_cast<unsigned>(blocks);
}
// Blocks for a one-block-per-row kernel that loops over rows (grid-stride over rows).
inline unsigned GridForRows(int64_t rows) {
  constexpr int64_t kMaxBlocks = int64_t{1} << 20;
  return static_cast<unsigned>(rows < 1 ? 1 : (rows > kMaxBlocks ? kMaxBlocks : rows));
}
// Threads for a block that owns one row of n elements: ~8 elements per thread, a power of
// two in [32, 1024].
inline int RowThreads(int64_t n) {
  int t = 32;
  while (t < 1024 && int64_t{t} * 8 < n) t *= 2;
  return t;
}

// ---------------------------------------------------------------------------------------
// Reductions
// ---------------------------------------------------------------------------------------

__device__ __forceinline__ float WarpSum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
// Max that propagates NaN (as torch.max).
__device__ __forceinline__ float NanMax(float a, float b) { return (a != a || a > b) ? a : b; }
__device__ __forceinline__ float NanMin(float a, float b) { return (a != a || a < b) ? a : b; }
__device__ __forceinline__ float WarpMax(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = NanMax(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
// `smem` holds 32 floats; the trailing barrier makes back-to-back calls safe.
__device__ __forceinline__ float BlockSum(float v, float* smem) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  v = WarpSum(v);
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  float r = lane < warps ? smem[lane] : 0.0f;
  r = WarpSum(r);
  __syncthreads();
  return r;
}

// Online softmax state (max_sum.h) merged across a warp and a block.
__device__ __forceinline__ MaxSum WarpMaxSum(MaxSum v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    MaxSum other{__shfl_xor_sync(0xffffffffu, v.m, o), __shfl_xor_sync(0xffffffffu, v.s, o)};
    v = MaxSumMerge(v, other);
  }
  return v;
}
// Block-wide MaxSum; `smem` holds 64 floats.
__device__ __forceinline__ MaxSum BlockMaxSum(MaxSum v, float* smem) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  v = WarpMaxSum(v);
  if (lane == 0) {
    smem[warp] = v.m;
    smem[32 + warp] = v.s;
  }
  __syncthreads();
  MaxSum r = lane < warps ? MaxSum{smem[lane], smem[32 + lane]} : EmptyMaxSum();
  r = WarpMaxSum(r);
  __syncthreads();
  return r;
}

}  // namespace dtensor::internal::gpu

#endif  // DTENSOR_KERNELS_CUDA_DEVICE_COMMON_CUH_
