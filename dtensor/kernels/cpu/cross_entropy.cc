// Cross-entropy over the last dim, forward and backward (CPU).
//
// Legend: logits, dlogits [N, V] contiguous; targets [N] int32/int64; losses, valid, lse
// float32 [N]; grad float32 [N] with any stride. Rows are split over OpenMP threads. Each row
// takes two passes (max, then sum of exp) over values that stay in cache; exp is a polynomial
// the compiler vectorises (libm's expf is not vectorised without -ffast-math), accurate to a
// couple of ulp.
#include <omp.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "dtensor/kernels/cpu/cpu_backend.h"
#include "dtensor/tensor/status.h"

namespace dtensor::internal {
namespace {

// Below this many elements a call stays on one thread.
constexpr int64_t kParallelMin = int64_t{1} << 15;

// exp(x) for float: x = n ln2 + r with |r| <= ln2/2, exp(r) by a degree-6 polynomial (Cephes
// coefficients), times 2^n built in the exponent bits. Branch-free so that loops vectorise.
// Returns 0 below -87.3 (where expf is subnormal), NaN for NaN; callers never pass x > 88.
inline float ExpF(float x) {
  const float xc = std::min(std::max(x, -87.3f), 88.3f);  // NaN passes through both
  const float shift = 12582912.0f;                         // 1.5 * 2^23: rounds to an integer
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
  const float scale = std::bit_cast<float>((ni + 127) << 23);
  return x < -87.3f ? 0.0f : p * scale;
}

template <typename F>
absl::Status VisitFloat(const char* op, DType t, F&& f) {
  switch (t) {
    case DType::kFloat32:
      return f(float{});
    case DType::kBFloat16:
      return f(BFloat16{});
    case DType::kFloat16:
      return f(Float16{});
    default:
      return InvalidArg(op, "unsupported logits dtype ", DTypeName(t));
  }
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
    for (int64_t i = 0; i < n; ++i) scratch[i] = static_cast<float>(src[i]);
    return scratch;
  }
}

// logsumexp of row [V], V >= 1.
float LogSumExp(const float* row, int64_t v) {
  float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
  for (int64_t i = 0; i < v; ++i) m = std::max(m, row[i]);
  if (std::isinf(m)) return m;  // all -inf (-inf), or an +inf logit (+inf)
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < v; ++i) s += ExpF(row[i] - m);
  return m + std::log(s);
}

template <typename T, typename I>
void Forward(const T* logits, const I* targets, int64_t n, int64_t v, int64_t ignore_index, float* losses,
             float* valid, float* lse) {
#pragma omp parallel if (n * v >= kParallelMin)
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
void Backward(const T* logits, const I* targets, const float* lse, const float* grad, int64_t grad_stride,
              int64_t n, int64_t v, int64_t ignore_index, T* dlogits) {
#pragma omp parallel if (n * v >= kParallelMin)
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
#pragma omp simd
        for (int64_t j = 0; j < v; ++j) d[j] = g * ExpF(row[j] - l);
        d[t] -= g;
      }
      if constexpr (!std::is_same_v<T, float>) {
        for (int64_t j = 0; j < v; ++j) out[j] = T(d[j]);
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
    return VisitFloat("CrossEntropy", logits.dtype(), [&](auto tag) {
      using T = decltype(tag);
      if (v == 0) {  // every target is ignored (checked above): an empty logsumexp is -inf
        for (int64_t i = 0; i < n; ++i) {
          losses.data<float>()[i] = valid.data<float>()[i] = 0.0f;
          lse.data<float>()[i] = -std::numeric_limits<float>::infinity();
        }
        return absl::OkStatus();
      }
      Forward(logits.data<T>(), tp, n, v, ignore_index, losses.data<float>(), valid.data<float>(),
              lse.data<float>());
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
    return VisitFloat("CrossEntropyBackward", logits.dtype(), [&](auto tag) {
      using T = decltype(tag);
      Backward(logits.data<T>(), tp, lse.data<float>(), grad.data<float>(), grad_stride, n, v, ignore_index,
               dlogits.data<T>());
      return absl::OkStatus();
    });
  });
}

}  // namespace dtensor::internal
