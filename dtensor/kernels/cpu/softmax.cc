// CPU softmax / log_softmax over the last dim of contiguous [rows, n] tensors, and their
// backward. Rows are independent and split across threads; within a row the max is taken in
// float (NaN propagates, so a row holding NaN gives NaN), exponentials use the vectorized
// FastExp (1 ulp), and the sum of exponentials and the backward dot products accumulate in
// double.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "dtensor/kernels/cpu/cpu_backend.h"
#include "dtensor/kernels/cpu/cpu_internal.h"
#include "dtensor/tensor/status.h"

namespace dtensor::internal {
namespace {

// sum over i < n of f(i) (a float) in double, with eight independent accumulators so that
// the loop vectorizes.
template <typename F>
double SumOf(int64_t n, F&& f) {
  double acc[8] = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int j = 0; j < 8; ++j) acc[j] += static_cast<double>(f(i + j));
  }
  for (; i < n; ++i) acc[0] += static_cast<double>(f(i));
  double s = 0.0;
  for (double a : acc) s += a;
  return s;
}

// Rows per parallel chunk so that a chunk holds at least ~kParallelGrainExpensive elements.
int64_t RowGrain(int64_t n) { return std::max<int64_t>(1, kParallelGrainExpensive / std::max<int64_t>(n, 1)); }

template <typename T>
void SoftmaxTyped(const T* x, T* y, int64_t rows, int64_t n, bool log) {
  ParallelFor(rows, RowGrain(n), [&](int64_t begin, int64_t end) {
    // Exponentials of one row: written straight into y for float32, a float scratch otherwise.
    std::vector<float> scratch(std::is_same_v<T, float> ? 0 : static_cast<size_t>(n));
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * n;
      T* yr = y + r * n;
      float* e;
      if constexpr (std::is_same_v<T, float>) {
        e = yr;
      } else {
        e = scratch.data();
      }
      const float m = ExtremeOf</*kMax=*/true>(xr, n);
      for (int64_t i = 0; i < n; ++i) e[i] = FastExp(ToFloat(xr[i]) - m);
      const double s = SumOf(n, [&](int64_t i) { return e[i]; });
      if (log) {
        const float shift = m + static_cast<float>(std::log(s));
        for (int64_t i = 0; i < n; ++i) yr[i] = FromFloat<T>(ToFloat(xr[i]) - shift);
      } else {
        const auto inv = static_cast<float>(1.0 / s);
        for (int64_t i = 0; i < n; ++i) yr[i] = FromFloat<T>(e[i] * inv);
      }
    }
  });
}

template <typename T>
void SoftmaxBackwardTyped(const T* dy, const T* y, T* dx, int64_t rows, int64_t n, bool log) {
  ParallelFor(rows, RowGrain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* dyr = dy + r * n;
      const T* yr = y + r * n;
      T* dxr = dx + r * n;
      if (log) {  // dx = dy - exp(y) * sum(dy)
        const auto s = static_cast<float>(SumOf(n, [&](int64_t i) { return ToFloat(dyr[i]); }));
        for (int64_t i = 0; i < n; ++i) dxr[i] = FromFloat<T>(ToFloat(dyr[i]) - FastExp(ToFloat(yr[i])) * s);
      } else {  // dx = y * (dy - sum(dy * y))
        const auto s = static_cast<float>(SumOf(n, [&](int64_t i) { return ToFloat(dyr[i]) * ToFloat(yr[i]); }));
        for (int64_t i = 0; i < n; ++i) dxr[i] = FromFloat<T>(ToFloat(yr[i]) * (ToFloat(dyr[i]) - s));
      }
    }
  });
}

// [rows, n] of a tensor whose last dim is the softmax dim (a 0-d tensor is one row of one).
void RowsAndCols(const Tensor& t, int64_t* rows, int64_t* n) {
  *n = t.dim() == 0 ? 1 : t.size(-1);
  *rows = *n == 0 ? 0 : t.numel() / *n;
}

}  // namespace

absl::Status CpuBackend::Softmax(const Tensor& x, const Tensor& y, bool log) {
  if (y.numel() == 0) return absl::OkStatus();
  int64_t rows, n;
  RowsAndCols(y, &rows, &n);
  return DispatchFloat("Softmax", y.dtype(), [&](auto tag) {
    using T = decltype(tag);
    SoftmaxTyped<T>(static_cast<const T*>(x.raw_data()), static_cast<T*>(y.raw_data()), rows, n, log);
    return absl::OkStatus();
  });
}

absl::Status CpuBackend::SoftmaxBackward(const Tensor& dy, const Tensor& y, const Tensor& dx, bool log) {
  if (dx.numel() == 0) return absl::OkStatus();
  int64_t rows, n;
  RowsAndCols(dx, &rows, &n);
  return DispatchFloat("SoftmaxBackward", dx.dtype(), [&](auto tag) {
    using T = decltype(tag);
    SoftmaxBackwardTyped<T>(static_cast<const T*>(dy.raw_data()), static_cast<const T*>(y.raw_data()),
                            static_cast<T*>(dx.raw_data()), rows, n, log);
    return absl::OkStatus();
  });
}

}  // namespace dtensor::internal
