// Cross-entropy over the last dim, forward and backward (CPU).
//
// Legend: logits, dlogits [N, V] contiguous; targets [N] int32/int64; losses, valid, lse
// float32 [N]; grad float32 [N] with any stride. Rows are split over OpenMP threads. Each row
// takes two passes (max, then sum of exp) over values that stay in cache; exp is ExpF below,
// which vectorises.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "dtensor/kernels/cpu/cpu_backend.h"
#include "dtensor/kernels/cpu/cpu_internal.h"
#include "dtensor/tensor/status.h"

namespace dtensor::internal {
namespace {

// Elements per float partial sum of a row's exponentials.
constexpr int64_t kSumBlock = 512;

// When the build targets baseline x86-64 (DTENSOR_NATIVE=OFF), the row functions below also get
// an AVX2+FMA clone, picked at load time from the CPU: their exp loops run ~3x faster with it.
// A native build (-march=native on an AVX2 machine) needs no clones.
#if defined(__x86_64__) && !defined(__AVX2__) && (defined(__GNUC__) || defined(__clang__))
#define DT_ROW_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define DT_ROW_CLONES
#endif

// Order-preserving map between float bits and int32 (its own inverse): comparing keys as
// integers compares the floats, so a clamp needs no float compare.
constexpr int32_t FloatKey(int32_t bits) { return bits ^ ((bits >> 31) & 0x7fffffff); }

// exp(x) for float, written so that GCC and clang vectorise the loops calling it: no libm call
// (expf is not vectorised without -ffast-math) and no float compare (under the default
// -ftrapping-math GCC will not if-convert one). x is clamped to [-88, 88.3] on integer keys;
// x = n ln2 + r with |r| <= ln2/2; exp(r) by Cephes' degree-6 polynomial; 2^n is built in the
// exponent bits, and n = -127 gives 0, so x below about -87.7 (-inf included) flushes to 0.
// Within 1.5 ulp of exp on [-87.3, 88]; NaN gives NaN. Callers pass x <= ~0.
inline float ExpF(float x) {
  constexpr int32_t kLo = FloatKey(std::bit_cast<int32_t>(-88.0f));
  constexpr int32_t kHi = FloatKey(std::bit_cast<int32_t>(88.3f));
  const int32_t xi = std::bit_cast<int32_t>(x);
  int32_t k = FloatKey(xi);
  k = k < kLo ? kLo : k;
  k = k > kHi ? kHi : k;
  const float xc = std::bit_cast<float>(FloatKey(k));
  const float shift = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const float t = xc * 1.44269504088896341f + shift;
  const float n = t - shift;
  const float r = (xc - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  // t's low mantissa bits hold n: read it as an integer without a float->int conversion.
  const int32_t ni = std::bit_cast<int32_t>(t) - std::bit_cast<int32_t>(shift);
  const int32_t yi = std::bit_cast<int32_t>(p * std::bit_cast<float>((ni + 127) << 23));
  const int32_t nan_mask = (0x7f800000 - (xi & 0x7fffffff)) >> 31;  // all ones iff x is NaN
  return std::bit_cast<float>(yi | (nan_mask & 0x7fc00000));
}

// max(row[0..n)) for n >= 1, as an integer max over FloatKey (so both compilers vectorise it
// without fast-math). A NaN may or may not win; callers' sums of exp then turn NaN anyway.
inline float RowMax(const float* row, int64_t n) {
  constexpr int32_t kMinusInf = FloatKey(std::bit_cast<int32_t>(-std::numeric_limits<float>::infinity()));
  int32_t k = kMinusInf;
#pragma omp simd reduction(max : k)
  for (int64_t i = 0; i < n; ++i) k = std::max(k, FloatKey(std::bit_cast<int32_t>(row[i])));
  return std::bit_cast<float>(FloatKey(k));
}

template <typename F>
absl::Status VisitIndex(const char* op, DType t, F&& f) {
  switch (t) {
    case DType::kInt32:
      return f(int32_t{});
    case DType::kInt64:
      return f(int64_t{});
    default:
      return InvalidArg(op, "targets must be int32 or int64, got ", DTypeName(t));
  }
}

// InvalidArgument for the first target outside [0, V) that is not ignore_index.
template <typename I>
absl::Status CheckTargets(const char* op, const I* targets, int64_t n, int64_t v, int64_t ignore_index) {
  for (int64_t i = 0; i < n; ++i) {
    const int64_t t = static_cast<int64_t>(targets[i]);
    if (t != ignore_index && (t < 0 || t >= v)) {
      return InvalidArg(op, "target ", t, " at row ", i, " is outside [0, ", v, ") and is not ignore_index ",
                        ignore_index);
    }
  }
  return absl::OkStatus();
}

template <typename T>
const float* RowF32(const T* src, int64_t n, float* scratch) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else {
    LoadRow(src, scratch, n);
    return scratch;
  }
}

// logsumexp of row [V], V >= 1.
DT_ROW_CLONES float LogSumExp(const float* row, int64_t v) {
  const float m = RowMax(row, v);
  if (std::isinf(m)) return m;  // all -inf (-inf), or an +inf logit (+inf)
  // float sums over blocks (vectorised), blocks summed in double: a plain float sum over
  // V = 50257 terms loses ~1e-5 relative.
  double s = 0.0;
  for (int64_t b = 0; b < v; b += kSumBlock) {
    const int64_t e = std::min(v, b + kSumBlock);
    float bs = 0.0f;
#pragma omp simd reduction(+ : bs)
    for (int64_t i = b; i < e; ++i) bs += ExpF(row[i] - m);
    s += bs;
  }
  return m + static_cast<float>(std::log(s));
}

// d[j] = g * exp(row[j] - lse) for j < v: g times the softmax of the row.
DT_ROW_CLONES void ScaledSoftmax(const float* row, int64_t v, float lse, float g, float* d) {
#pragma omp simd
  for (int64_t j = 0; j < v; ++j) d[j] = g * ExpF(row[j] - lse);
}

template <typename T, typename I>
void Forward(const T* logits, const I* targets, int64_t n, int64_t v, int64_t ignore_index, float* losses, float* valid,
             float* lse) {
#pragma omp parallel if (n > 1 && n * v >= kParallelGrainExpensive)
  {
    std::vector<float> scratch(std::is_same_v<T, float> ? 0 : static_cast<size_t>(v));
#pragma omp for schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      const float* row = RowF32(logits + i * v, v, scratch.data());
      const float l = LogSumExp(row, v);
      const int64_t t = static_cast<int64_t>(targets[i]);
      lse[i] = l;
      const bool ok = t != ignore_index;
      valid[i] = ok ? 1.0f : 0.0f;
      losses[i] = ok ? l - row[t] : 0.0f;
    }
  }
}

template <typename T, typename I>
void Backward(const T* logits, const I* targets, const float* lse, const float* grad, int64_t grad_stride, int64_t n,
              int64_t v, int64_t ignore_index, T* dlogits) {
#pragma omp parallel if (n > 1 && n * v >= kParallelGrainExpensive)
  {
    std::vector<float> sx, sd;
    if constexpr (!std::is_same_v<T, float>) {
      sx.resize(v);
      sd.resize(v);
    }
#pragma omp for schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      const int64_t t = static_cast<int64_t>(targets[i]);
      const bool ok = t != ignore_index;
      const float g = ok ? grad[i * grad_stride] : 0.0f;
      const float l = lse[i];
      T* out = dlogits + i * v;
      float* d;
      if constexpr (std::is_same_v<T, float>) {
        d = out;
      } else {
        d = sd.data();
      }
      if (!ok) {
        for (int64_t j = 0; j < v; ++j) d[j] = 0.0f;
      } else {
        const float* row = RowF32(logits + i * v, v, sx.data());
        ScaledSoftmax(row, v, l, g, d);
        d[t] -= g;
      }
      if constexpr (!std::is_same_v<T, float>) {
        StoreRow(d, out, v);
      }
    }
  }
}

}  // namespace

absl::Status CpuBackend::CrossEntropy(const Tensor& logits, const Tensor& targets, int64_t ignore_index,
                                      const Tensor& losses, const Tensor& valid, const Tensor& lse) {
  const int64_t n = targets.numel();
  const int64_t v = logits.size(-1);
  return VisitIndex("CrossEntropy", targets.dtype(), [&](auto itag) {
    using I = decltype(itag);
    const I* tp = targets.data<I>();
    DT_RETURN_IF_ERROR(CheckTargets("CrossEntropy", tp, n, v, ignore_index));
    if (n == 0) return absl::OkStatus();
    return DispatchFloat("CrossEntropy", logits.dtype(), [&](auto tag) {
      using T = decltype(tag);
      if (v == 0) {  // every target is ignored (checked above): an empty logsumexp is -inf
        for (int64_t i = 0; i < n; ++i) {
          losses.data<float>()[i] = valid.data<float>()[i] = 0.0f;
          lse.data<float>()[i] = -std::numeric_limits<float>::infinity();
        }
        return absl::OkStatus();
      }
      Forward(logits.data<T>(), tp, n, v, ignore_index, losses.data<float>(), valid.data<float>(), lse.data<float>());
      return absl::OkStatus();
    });
  });
}

absl::Status CpuBackend::CrossEntropyBackward(const Tensor& logits, const Tensor& targets, const Tensor& lse,
                                              const Tensor& grad, int64_t ignore_index, const Tensor& dlogits) {
  const int64_t n = targets.numel();
  const int64_t v = logits.size(-1);
  const int64_t grad_stride = grad.dim() == 0 ? 0 : grad.stride(0);
  return VisitIndex("CrossEntropyBackward", targets.dtype(), [&](auto itag) {
    using I = decltype(itag);
    const I* tp = targets.data<I>();
    DT_RETURN_IF_ERROR(CheckTargets("CrossEntropyBackward", tp, n, v, ignore_index));
    if (n == 0 || v == 0) return absl::OkStatus();
    return DispatchFloat("CrossEntropyBackward", logits.dtype(), [&](auto tag) {
      using T = decltype(tag);
      Backward(logits.data<T>(), tp, lse.data<float>(), grad.data<float>(), grad_stride, n, v, ignore_index,
               dlogits.data<T>());
      return absl::OkStatus();
    });
  });
}

}  // namespace dtensor::internal
