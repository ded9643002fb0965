// CUDA Copy, Fill and FillRandom.
//
// This file is compiled with --fmad=false (CMakeLists.txt): FillRandom evaluates philox.h's
// double-precision expressions without fused multiply-adds, exactly as the host does, so
// uniform values are bit-identical to the CPU backend's (normal values use the device's log
// and cos, which may differ from glibc's in the last double bit: equal after rounding to float
// in all but vanishingly rare cases).
#include "dtensor/kernels/cuda/device_common.cuh"
#include "dtensor/kernels/philox.h"

namespace dtensor::internal::gpu {
namespace {

// Same dtype: moves bits, never values (NaN payloads and -0 survive).
template <typename B>
__global__ void CopyBitsKernel(B* dst, Layout dl, const B* src, Layout sl, int64_t n) {
  for (int64_t i = GlobalThread(); i < n; i += GridThreads()) dst[Offset(dl, i)] = src[Offset(sl, i)];
}

// One element in transit: float types as float, integers and bool as int64.
struct Value {
  bool is_float;
  float f;
  int64_t i;
};

__device__ Value LoadAny(DType t, const void* base, int64_t off) {
  switch (t) {
    case DType::kFloat32:
      return {true, static_cast<const float*>(base)[off], 0};
    case DType::kBFloat16:
      return {true, ToFloat(static_cast<const __nv_bfloat16*>(base)[off]), 0};
    case DType::kFloat16:
      return {true, ToFloat(static_cast<const __half*>(base)[off]), 0};
    case DType::kFloat8E4M3:
      return {true, ToFloat(static_cast<const F8E4M3*>(base)[off]), 0};
    case DType::kFloat8E5M2:
      return {true, ToFloat(static_cast<const F8E5M2*>(base)[off]), 0};
    case DType::kInt32:
      return {false, 0.0f, static_cast<const int32_t*>(base)[off]};
    case DType::kInt64:
      return {false, 0.0f, static_cast<const int64_t*>(base)[off]};
    case DType::kBool:
      return {false, 0.0f, static_cast<const uint8_t*>(base)[off] != 0 ? 1 : 0};
  }
  return {true, 0.0f, 0};
}

// As the CPU's CastElement: integer -> float rounds to float first; float -> integer
// truncates with saturation (NaN -> 0); integer -> integer wraps; anything -> bool is != 0.
template <typename D>
__device__ __forceinline__ D CastValue(const Value& v) {
  if constexpr (std::is_same_v<D, bool>) {
    return v.is_float ? v.f != 0.0f : v.i != 0;
  } else if constexpr (kIsInt<D>) {
    return v.is_float ? FloatToInt<D>(v.f) : static_cast<D>(v.i);
  } else {
    return FromFloat<D>(v.is_float ? v.f : static_cast<float>(v.i));
  }
}

__device__ void StoreAny(DType t, void* base, int64_t off, const Value& v) {
  switch (t) {
    case DType::kFloat32:
      static_cast<float*>(base)[off] = CastValue<float>(v);
      return;
    case DType::kBFloat16:
      static_cast<__nv_bfloat16*>(base)[off] = CastValue<__nv_bfloat16>(v);
      return;
    case DType::kFloat16:
      static_cast<__half*>(base)[off] = CastValue<__half>(v);
      return;
    case DType::kFloat8E4M3:
      static_cast<F8E4M3*>(base)[off] = CastValue<F8E4M3>(v);
      return;
    case DType::kFloat8E5M2:
      static_cast<F8E5M2*>(base)[off] = CastValue<F8E5M2>(v);
      return;
    case DType::kInt32:
      static_cast<int32_t*>(base)[off] = CastValue<int32_t>(v);
      return;
    case DType::kInt64:
      static_cast<int64_t*>(base)[off] = CastValue<int64_t>(v);
      return;
    case DType::kBool:
      static_cast<uint8_t*>(base)[off] = CastValue<bool>(v) ? 1 : 0;
      return;
  }
}

// Casting copy. The dtype switches are uniform across the grid (no divergence) and keep this
// to one kernel instead of 56 (src, dst) instantiations; a cast is memory bound anyway.
__global__ void CastKernel(DType dt, void* dst, Layout dl, DType st, const void* src, Layout sl, int64_t n) {
  for (int64_t i = GlobalThread(); i < n; i += GridThreads()) {
    StoreAny(dt, dst, Offset(dl, i), LoadAny(st, src, Offset(sl, i)));
  }
}

template <typename B>
__global__ void FillKernel(B* dst, Layout dl, int64_t n, B v) {
  for (int64_t i = GlobalThread(); i < n; i += GridThreads()) dst[Offset(dl, i)] = v;
}

template <typename T>
__global__ void FillRandomKernel(T* dst, Layout gl, int64_t base, int64_t n, bool normal, uint64_t seed, double a,
                                 double b) {
  for (int64_t i = GlobalThread(); i < n; i += GridThreads()) {
    const auto g = static_cast<uint64_t>(base + Offset(gl, i));
    const double x = normal ? RandomNormalAt(seed, g, a, b) : RandomUniformAt(seed, g, a, b);
    dst[i] = FromDouble<T>(x);
  }
}

template <typename B>
cudaError_t CopyBits(void* dst, const Layout& dl, const void* src, const Layout& sl, int64_t n) {
  CopyBitsKernel<B>
      <<<GridFor(n), kThreads, 0, cudaStreamPerThread>>>(static_cast<B*>(dst), dl, static_cast<const B*>(src), sl, n);
  return cudaGetLastError();
}

template <typename B>
cudaError_t FillBits(void* dst, const Layout& dl, int64_t n, uint64_t bits) {
  FillKernel<B><<<GridFor(n), kThreads, 0, cudaStreamPerThread>>>(static_cast<B*>(dst), dl, n, static_cast<B>(bits));
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchCopy(DType dst_dtype, void* dst, const Layout& dl, DType src_dtype, const void* src, const Layout& sl,
                       int64_t n) {
  if (n <= 0) return cudaSuccess;
  if (dst_dtype == src_dtype) {
    switch (ElementSize(dst_dtype)) {
      case 1:
        return CopyBits<uint8_t>(dst, dl, src, sl, n);
      case 2:
        return CopyBits<uint16_t>(dst, dl, src, sl, n);
      case 4:
        return CopyBits<uint32_t>(dst, dl, src, sl, n);
      case 8:
        return CopyBits<uint64_t>(dst, dl, src, sl, n);
      default:
        return cudaErrorInvalidValue;
    }
  }
  CastKernel<<<GridFor(n), kThreads, 0, cudaStreamPerThread>>>(dst_dtype, dst, dl, src_dtype, src, sl, n);
  return cudaGetLastError();
}

cudaError_t LaunchFill(void* dst, const Layout& dl, int64_t n, size_t elem_bytes, uint64_t bits) {
  if (n <= 0) return cudaSuccess;
  switch (elem_bytes) {
    case 1:
      return FillBits<uint8_t>(dst, dl, n, bits);
    case 2:
      return FillBits<uint16_t>(dst, dl, n, bits);
    case 4:
      return FillBits<uint32_t>(dst, dl, n, bits);
    case 8:
      return FillBits<uint64_t>(dst, dl, n, bits);
    default:
      return cudaErrorInvalidValue;
  }
}

cudaError_t LaunchFillRandom(DType dtype, void* dst, const Layout& gl, int64_t base, int64_t n, bool normal,
                             uint64_t seed, double a, double b) {
  if (n <= 0) return cudaSuccess;
  return DispatchAll(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    FillRandomKernel<T>
        <<<GridFor(n), kThreads, 0, cudaStreamPerThread>>>(static_cast<T*>(dst), gl, base, n, normal, seed, a, b);
    return cudaGetLastError();
  });
}

}  // namespace dtensor::internal::gpu
