// CUDA elementwise kernels: Binary, BinaryScalar, Unary, UnaryBackward and the fused AdamW.
//
// Grid-stride loops over the contiguous output; inputs are read through their (coalesced)
// layouts. One kernel per dtype with the op as a grid-uniform switch: the kernels are memory
// bound, and this keeps nvcc's work to a handful of instantiations. Float dtypes compute in
// float; int32/int64 in their own type with wrapping arithmetic (kDiv truncates, x / 0 = 0),
// as the CPU backend.
#include "dtensor/kernels/cuda/device_common.cuh"

namespace dtensor::internal::gpu {
namespace {

// Compute type: float for the float dtypes, the type itself for integers.
template <typename T>
using Compute = std::conditional_t<kIsComputeFloat<T>, float, T>;

template <typename T>
__device__ __forceinline__ Compute<T> LoadC(const T* p) {
  if constexpr (kIsComputeFloat<T>) {
    return ToFloat(*p);
  } else {
    return *p;
  }
}
template <typename T>
__device__ __forceinline__ void StoreC(T* p, Compute<T> v) {
  if constexpr (kIsComputeFloat<T>) {
    *p = FromFloat<T>(v);
  } else {
    *p = v;
  }
}

// a (op) b in C (float, double or an integer type). Integers wrap; NaN propagates through
// max/min (torch.maximum).
template <typename C>
__device__ __forceinline__ C ApplyBinary(BinOp op, C a, C b) {
  if constexpr (std::is_integral_v<C>) {
    using U = std::make_unsigned_t<C>;
    switch (op) {
      case BinOp::kAdd:
        return static_cast<C>(static_cast<U>(a) + static_cast<U>(b));
      case BinOp::kSub:
        return static_cast<C>(static_cast<U>(a) - static_cast<U>(b));
      case BinOp::kMul:
        return static_cast<C>(static_cast<U>(a) * static_cast<U>(b));
      case BinOp::kDiv:
        if (b == 0) return 0;
        if (b == -1) return static_cast<C>(U{0} - static_cast<U>(a));  // min / -1 overflows
        return a / b;
      case BinOp::kMax:
        return a > b ? a : b;
      case BinOp::kMin:
        return a < b ? a : b;
    }
    return a;
  } else {
    switch (op) {
      case BinOp::kAdd:
        return a + b;
      case BinOp::kSub:
        return a - b;
      case BinOp::kMul:
        return a * b;
      case BinOp::kDiv:
        return a / b;
      case BinOp::kMax:
        return (a != a || a > b) ? a : b;
      case BinOp::kMin:
        return (a != a || a < b) ? a : b;
    }
    return a;
  }
}

template <typename T>
__global__ void BinaryKernel(BinOp op, T* out, const T* a, Layout al, const T* b, Layout bl, int64_t n) {
  for (int64_t i = GlobalThread(); i < n; i += GridThreads()) {
    StoreC(out + i, ApplyBinary(op, LoadC(a + Offset(al, i)), LoadC(b + Offset(bl, i))));
  }
}

// out = a (op) s or s (op) a, computed in C: float for float dtypes; int64 (then narrowed,
// wrapping) for integer dtypes with an integral scalar; double (then truncated with
// saturation) for integer dtypes with a fractional scalar.
template <typename T, typename C>
__global__ void ScalarKernel(BinOp op, T* out, const T* a, Layout al, int64_t n, C s, bool scalar_first) {
  for (int64_t i = GlobalThread(); i < n; i += GridThreads()) {
    const T x = a[Offset(al, i)];
    C v;
    if constexpr (kIsComputeFloat<T>) {
      v = ToFloat(x);
    } else {
      v = static_cast<C>(x);
    }
    const C r = scalar_first ? ApplyBinary(op, s, v) : ApplyBinary(op, v, s);
    if constexpr (kIsComputeFloat<T>) {
      out[i] = FromFloat<T>(r);
    } else if constexpr (std::is_integral_v<C>) {
      out[i] = static_cast<T>(r);
    } else {
      out[i] = DoubleToInt<T>(r);
    }
  }
}

constexpr float kGeluK = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluC = 0.044715f;

__device__ __forceinline__ float Gelu(float x) { return 0.5f * x * (1.0f + tanhf(kGeluK * (x + kGeluC * x * x * x))); }
__device__ __forceinline__ float GeluGrad(float x) {
  const float x2 = x * x;
  const float t = tanhf(kGeluK * (x + kGeluC * x2 * x));
  return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * kGeluK * (1.0f + 3.0f * kGeluC * x2);
}

__device__ __forceinline__ float ApplyUnaryFloat(UnOp op, float x) {
  switch (op) {
    case UnOp::kNeg:
      return -x;
    case UnOp::kExp:
      return expf(x);
    case UnOp::kLog:
      return logf(x);
    case UnOp::kSqrt:
      return sqrtf(x);
    case UnOp::kRsqrt:
      return 1.0f / sqrtf(x);
    case UnOp::kRelu:
      return x < 0.0f ? 0.0f : x;  // NaN stays NaN
    case UnOp::kGelu:
      return Gelu(x);
    case UnOp::kTanh:
      return tanhf(x);
    case UnOp::kAbs:
      return fabsf(x);
    case UnOp::kSquare:
      return x * x;
  }
  return x;
}

template <typename I>
__device__ __forceinline__ I ApplyUnaryInt(UnOp op, I x) {
  using U = std::make_unsigned_t<I>;
  const I neg = static_cast<I>(U{0} - static_cast<U>(x));
  switch (op) {
    case UnOp::kNeg:
      return neg;
    case UnOp::kAbs:
      return x < 0 ? neg : x;
    case UnOp::kSquare:
      return static_cast<I>(static_cast<U>(x) * static_cast<U>(x));
    case UnOp::kRelu:
      return x < 0 ? I{0} : x;
    default:
      return x;  // not reached: the host rejects the other ops for integers
  }
}

template <typename T>
__global__ void UnaryKernel(UnOp op, T* out, const T* a, Layout al, int64_t n) {
  for (int64_t i = GlobalThread(); i < n; i += GridThreads()) {
    const T x = a[Offset(al, i)];
    if constexpr (kIsComputeFloat<T>) {
      out[i] = FromFloat<T>(ApplyUnaryFloat(op, ToFloat(x)));
    } else {
      out[i] = ApplyUnaryInt(op, x);
    }
  }
}

__device__ __forceinline__ float UnaryGrad(UnOp op, float g, float x) {
  switch (op) {
    case UnOp::kGelu:
      return g * GeluGrad(x);
    case UnOp::kRelu:
      return x > 0.0f ? g : 0.0f;
    case UnOp::kTanh: {
      const float t = tanhf(x);
      return g * (1.0f - t * t);
    }
    case UnOp::kExp:
      return g * expf(x);
    case UnOp::kLog:
      return g / x;
    case UnOp::kSqrt:
      return g * 0.5f / sqrtf(x);
    case UnOp::kRsqrt:
      return g * -0.5f / (x * sqrtf(x));
    case UnOp::kNeg:
      return -g;
    case UnOp::kAbs:
      return x > 0.0f ? g : (x < 0.0f ? -g : 0.0f);
    case UnOp::kSquare:
      return 2.0f * x * g;
  }
  return g;
}

template <typename T>
__global__ void UnaryBackwardKernel(UnOp op, T* dx, const T* dy, const T* x, int64_t n) {
  for (int64_t i = GlobalThread(); i < n; i += GridThreads()) {
    dx[i] = FromFloat<T>(UnaryGrad(op, ToFloat(dy[i]), ToFloat(x[i])));
  }
}

// PyTorch AdamW: p *= 1 - lr wd; m, v updated; p -= lr * mhat / (sqrt(v) / sqrt(1 - beta2^t) + eps)
// (sqrt before the bias correction, as torch: v / (1 - beta2^t) overflows once |g| > ~1.8e19).
template <typename P, typename G>
__device__ __forceinline__ void AdamWElement(P* param, const G* grad, float* m, float* v, int64_t i, const AdamWArgs& h,
                                             float gscale) {
  const float g = ToFloat(grad[i]) * gscale;
  const float mi = h.beta1 * m[i] + (1.0f - h.beta1) * g;
  const float vi = h.beta2 * v[i] + (1.0f - h.beta2) * g * g;
  m[i] = mi;
  v[i] = vi;
  const float p = ToFloat(param[i]) * h.decay;
  param[i] = FromFloat<P>(p - h.lr * (mi * h.inv_bc1) / (sqrtf(vi) * h.inv_sqrt_bc2 + h.eps));
}

template <typename P, typename G>
__global__ void AdamWKernel(P* param, const G* grad, float* m, float* v, int64_t n, AdamWArgs h) {
  const float gscale = h.grad_scale != nullptr ? *h.grad_scale : 1.0f;
  for (int64_t i = GlobalThread(); i < n; i += GridThreads()) AdamWElement(param, grad, m, v, i, h, gscale);
}

// AdamWMultiKernel: block b updates elements [c * kAdamWChunk, (c + 1) * kAdamWChunk) of the
// tensor whose blocks (first[i] <= b < first[i + 1]) hold it, chunk c = b - first[i].
constexpr int64_t kAdamWChunk = 8 * kThreads;
struct AdamWBlocks {
  int first[kAdamWMultiMax + 1];
};

template <typename P, typename G>
__global__ void __launch_bounds__(kThreads)
    AdamWMultiKernel(const AdamWMultiList list, const AdamWBlocks blocks, AdamWArgs h) {
  int i = 0;
  while (i + 1 < list.count && blocks.first[i + 1] <= static_cast<int>(blockIdx.x)) ++i;
  h.inv_bc1 = list.inv_bc1[i];
  h.inv_sqrt_bc2 = list.inv_sqrt_bc2[i];
  const int64_t begin = static_cast<int64_t>(blockIdx.x - blocks.first[i]) * kAdamWChunk;
  const int64_t end = min(list.n[i], begin + kAdamWChunk);
  const float gscale = h.grad_scale != nullptr ? *h.grad_scale : 1.0f;
  for (int64_t j = begin + threadIdx.x; j < end; j += blockDim.x) {
    AdamWElement(static_cast<P*>(list.param[i]), static_cast<const G*>(list.grad[i]), list.m[i], list.v[i], j, h,
                 gscale);
  }
}

bool IsIntegerDType(DType t) { return t == DType::kInt32 || t == DType::kInt64; }

}  // namespace

cudaError_t LaunchBinary(BinOp op, DType dtype, void* out, const void* a, const Layout& al, const void* b,
                         const Layout& bl, int64_t n) {
  if (n <= 0) return cudaSuccess;
  return DispatchNumeric(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    BinaryKernel<T><<<GridFor(n), kThreads, 0, cudaStreamPerThread>>>(
        op, static_cast<T*>(out), static_cast<const T*>(a), al, static_cast<const T*>(b), bl, n);
    return cudaGetLastError();
  });
}

cudaError_t LaunchBinaryScalar(BinOp op, DType dtype, void* out, const void* a, const Layout& al, int64_t n,
                               double scalar, bool scalar_first) {
  if (n <= 0) return cudaSuccess;
  return DispatchNumeric(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    auto launch = [&](auto s) {
      using C = decltype(s);
      ScalarKernel<T, C><<<GridFor(n), kThreads, 0, cudaStreamPerThread>>>(
          op, static_cast<T*>(out), static_cast<const T*>(a), al, n, s, scalar_first);
      return cudaGetLastError();
    };
    if constexpr (kIsComputeFloat<T>) {
      return launch(static_cast<float>(scalar));
    } else {
      // Same rule as the CPU backend: an integral scalar computes exactly in int64.
      if (std::trunc(scalar) == scalar && std::fabs(scalar) < 9.2233720368547758e18) {
        return launch(static_cast<int64_t>(scalar));
      }
      return launch(scalar);
    }
  });
}

cudaError_t LaunchUnary(UnOp op, DType dtype, void* out, const void* a, const Layout& al, int64_t n) {
  if (n <= 0) return cudaSuccess;
  if (IsIntegerDType(dtype) && op != UnOp::kNeg && op != UnOp::kAbs && op != UnOp::kSquare && op != UnOp::kRelu) {
    return cudaErrorInvalidValue;
  }
  return DispatchNumeric(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    UnaryKernel<T>
        <<<GridFor(n), kThreads, 0, cudaStreamPerThread>>>(op, static_cast<T*>(out), static_cast<const T*>(a), al, n);
    return cudaGetLastError();
  });
}

cudaError_t LaunchUnaryBackward(UnOp op, DType dtype, void* dx, const void* dy, const void* x, int64_t n) {
  if (n <= 0) return cudaSuccess;
  return DispatchFloat(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    UnaryBackwardKernel<T><<<GridFor(n), kThreads, 0, cudaStreamPerThread>>>(
        op, static_cast<T*>(dx), static_cast<const T*>(dy), static_cast<const T*>(x), n);
    return cudaGetLastError();
  });
}

cudaError_t LaunchAdamW(DType param_dtype, void* param, DType grad_dtype, const void* grad, float* m, float* v,
                        int64_t n, const AdamWArgs& args) {
  if (n <= 0) return cudaSuccess;
  return DispatchFloat(param_dtype, [&](auto ptag) {
    using P = typename decltype(ptag)::type;
    return DispatchFloat(grad_dtype, [&](auto gtag) {
      using G = typename decltype(gtag)::type;
      AdamWKernel<P, G><<<GridFor(n), kThreads, 0, cudaStreamPerThread>>>(static_cast<P*>(param),
                                                                          static_cast<const G*>(grad), m, v, n, args);
      return cudaGetLastError();
    });
  });
}

cudaError_t LaunchAdamWMulti(DType param_dtype, DType grad_dtype, const AdamWMultiList& list, const AdamWArgs& args) {
  if (list.count <= 0 || list.count > kAdamWMultiMax) return list.count == 0 ? cudaSuccess : cudaErrorInvalidValue;
  AdamWBlocks blocks;
  int64_t total = 0;
  for (int i = 0; i < list.count; ++i) {
    blocks.first[i] = static_cast<int>(total);
    total += (list.n[i] + kAdamWChunk - 1) / kAdamWChunk;
  }
  blocks.first[list.count] = static_cast<int>(total);
  if (total == 0) return cudaSuccess;
  if (total > 0x7fffffff) return cudaErrorInvalidValue;
  return DispatchFloat(param_dtype, [&](auto ptag) {
    using P = typename decltype(ptag)::type;
    return DispatchFloat(grad_dtype, [&](auto gtag) {
      using G = typename decltype(gtag)::type;
      AdamWMultiKernel<P, G><<<static_cast<unsigned>(total), kThreads, 0, cudaStreamPerThread>>>(list, blocks, args);
      return cudaGetLastError();
    });
  });
}

}  // namespace dtensor::internal::gpu
