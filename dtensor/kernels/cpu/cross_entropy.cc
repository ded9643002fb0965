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

// Whether row [V] holds a NaN (of either sign).
bool HasNaN(const float* row, int64_t v) {
  for (int64_t i = 0; i < v; ++i) {
    if (std::isnan(row[i])) return true;
  }
  return false;
}

// A row's logsumexp as max + log(sum(exp(x - max))), the two terms kept apart: rounding their
// sum to float32 costs an absolute error of half an ulp of the max (~1e-3 at 2e4), which every
// log-probability (x - max) - log_s would inherit.
struct RowStats {
  float m;
  float log_s;
  float Lse() const { return m + log_s; }
};

// Statistics of row [V], V >= 1; log_s is NaN where the row holds one (as torch's).
DT_ROW_CLONES RowStats LogSumExp(const float* row, int64_t v) {
  const float m = RowMaxKeyed(row, v);
  // All -inf (-inf), or an +inf logit (+inf). The keyed max passes over a NaN with the sign bit
  // set (what x86 arithmetic makes: inf - inf, 0 * inf), which the sum below turns into NaN in
  // a finite row; an infinite max skips that sum, so it looks for one here.
  if (std::isinf(m)) return {m, HasNaN(row, v) ? std::numeric_limits<float>::quiet_NaN() : 0.0f};
  // float sums over blocks (vectorised), blocks summed in double: a plain float sum over
  // V = 50257 terms loses ~1e-5 relative.
  double s = 0.0;
  for (int64_t b = 0; b < v; b += kSumBlock) {
    const int64_t e = std::min(v, b + kSumBlock);
    float bs = 0.0f;
#pragma omp simd reduction(+ : bs)
    for (int64_t i = b; i < e; ++i) bs += ExpKeyClamped(row[i] - m);
    s += bs;
  }
  return {m, static_cast<float>(std::log(s))};
}

// The loss of a row for target t: logsumexp - row[t].
float RowLoss(const float* row, RowStats st, int64_t t) { return st.log_s - (row[t] - st.m); }

// d[j] = g * exp(row[j] - lse) for j < v: g times the softmax of the row.
DT_ROW_CLONES void ScaledSoftmax(const float* row, int64_t v, RowStats st, float g, float* d) {
  const float m = st.m, log_s = st.log_s;
#pragma omp simd
  for (int64_t j = 0; j < v; ++j) d[j] = g * ExpKeyClamped((row[j] - m) - log_s);
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
      const RowStats st = LogSumExp(row, v);
      const int64_t t = static_cast<int64_t>(targets[i]);
      lse[i] = st.Lse();
      const bool ok = t != ignore_index;
      valid[i] = ok ? 1.0f : 0.0f;
      losses[i] = ok ? RowLoss(row, st, t) : 0.0f;
    }
  }
}

// out = g * (softmax(row) - onehot(t)) for a counted row (ok), zeros otherwise; row: the
// float32 logits (unused when !ok); scratch: v floats unless T is float.
template <typename T>
void StoreRowGrad(const float* row, int64_t v, RowStats st, float g, bool ok, int64_t t, T* out, float* scratch) {
  float* d;
  if constexpr (std::is_same_v<T, float>) {
    d = out;
  } else {
    d = scratch;
  }
  if (!ok) {
    for (int64_t j = 0; j < v; ++j) d[j] = 0.0f;
  } else {
    ScaledSoftmax(row, v, st, g, d);
    d[t] -= g;
  }
  if constexpr (!std::is_same_v<T, float>) {
    StoreRow(d, out, v);
  }
}

// dlogits for each row, and with losses != nullptr the forward's losses too, in one visit of the
// row (converted once, it stays in cache from its statistics to its gradient; same arithmetic as
// Forward, so the same values). The statistics are recomputed rather than read from the
// forward's saved logsumexp, which is rounded at the magnitude of the row max.
template <typename T, typename I>
void Backward(const T* logits, const I* targets, const float* grad, int64_t grad_stride, int64_t n, int64_t v,
              int64_t ignore_index, T* dlogits, float* losses = nullptr) {
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
      const float* row = ok || losses != nullptr ? RowF32(logits + i * v, v, sx.data()) : nullptr;
      RowStats st{};
      if (row != nullptr) st = LogSumExp(row, v);
      if (losses != nullptr) losses[i] = ok ? RowLoss(row, st, t) : 0.0f;
      StoreRowGrad(row, v, st, ok ? grad[i * grad_stride] : 0.0f, ok, t, dlogits + i * v, sd.data());
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

absl::Status CpuBackend::CrossEntropyBackward(const Tensor& logits, const Tensor& targets, const Tensor& /*lse*/,
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
      Backward(logits.data<T>(), tp, grad.data<float>(), grad_stride, n, v, ignore_index, dlogits.data<T>());
      return absl::OkStatus();
    });
  });
}

absl::Status CpuBackend::CountTargets(const Tensor& targets, int64_t ignore_index, int64_t v, const Tensor& count) {
  const int64_t n = targets.numel();
  return VisitIndex("CountTargets", targets.dtype(), [&](auto itag) {
    using I = decltype(itag);
    const I* tp = targets.data<I>();
    DT_RETURN_IF_ERROR(CheckTargets("CountTargets", tp, n, v, ignore_index));
    int64_t c = 0;
    for (int64_t i = 0; i < n; ++i) c += static_cast<int64_t>(tp[i]) != ignore_index ? 1 : 0;
    count.data<float>()[0] = static_cast<float>(c);
    return absl::OkStatus();
  });
}

absl::Status CpuBackend::CrossEntropyWithGrad(const Tensor& logits, const Tensor& targets, int64_t ignore_index,
                                              const Tensor& grad, const Tensor& losses, const Tensor& dlogits) {
  const int64_t n = targets.numel();
  const int64_t v = logits.size(-1);
  // No classes: only ignored targets (checked below); the forward's special case applies.
  if (v == 0) return Kernels::CrossEntropyWithGrad(logits, targets, ignore_index, grad, losses, dlogits);
  const int64_t grad_stride = grad.dim() == 0 ? 0 : grad.stride(0);
  return VisitIndex("CrossEntropyWithGrad", targets.dtype(), [&](auto itag) {
    using I = decltype(itag);
    const I* tp = targets.data<I>();
    DT_RETURN_IF_ERROR(CheckTargets("CrossEntropyWithGrad", tp, n, v, ignore_index));
    if (n == 0) return absl::OkStatus();
    return DispatchFloat("CrossEntropyWithGrad", logits.dtype(), [&](auto tag) {
      using T = decltype(tag);
      Backward(logits.data<T>(), tp, grad.data<float>(), grad_stride, n, v, ignore_index, dlogits.data<T>(),
               losses.data<float>());
      return absl::OkStatus();
    });
  });
}

absl::Status CpuBackend::ScaleByRatio(const Tensor& x, const Tensor& num, const Tensor& den) {
  const float a = num.data<float>()[0], b = den.data<float>()[0];
  if (a == b) return absl::OkStatus();
  const float r = a / b;
  const int64_t n = x.numel();
  return DispatchFloat("ScaleByRatio", x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    T* p = x.data<T>();
    ParallelFor(n, kParallelGrain, [&](int64_t begin, int64_t end) {
      if constexpr (std::is_same_v<T, float>) {
        for (int64_t i = begin; i < end; ++i) p[i] *= r;
      } else {
        constexpr int64_t kChunk = 1024;
        float buf[kChunk];
        for (int64_t i = begin; i < end; i += kChunk) {
          const int64_t m = std::min(kChunk, end - i);
          LoadRow(p + i, buf, m);
          for (int64_t j = 0; j < m; ++j) buf[j] *= r;
          StoreRow(buf, p + i, m);
        }
      }
    });
    return absl::OkStatus();
  });
}

}  // namespace dtensor::internal
