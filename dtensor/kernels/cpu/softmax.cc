// CPU softmax / log_softmax over the last dim of contiguous [rows, n] tensors, and their
// backward. Rows are independent and split across threads; within a row the max is taken in
// float (NaN propagates, so a row holding NaN gives NaN), exponentials use the vectorized
// FastExp (1 ulp), and the sum of exponentials and the backward dot products accumulate in
// double.
#include <algorithm>
#include <cmath>
#include <cstring>
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

// Largest element of a contiguous run as float, ignoring NaN (-inf when n == 0 or all NaN).
// Softmax needs no NaN propagation here: a NaN element makes its exponential, hence the sum
// and the whole row, NaN anyway. Sixteen independent lanes let the compiler emit plain vector
// max instructions (ExtremeOf's NaN-propagating merge costs twice the work).
template <typename T>
float RowMax(const T* p, int64_t n) {
  // GCC / Clang vector extensions, locals only (no vector-typed parameters, so no ABI notes
  // when the ISA lacks AVX: the compiler then splits each into two SSE operations).
  using V8F = float __attribute__((vector_size(32)));
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  V8F a0 = {kNegInf, kNegInf, kNegInf, kNegInf, kNegInf, kNegInf, kNegInf, kNegInf}, a1 = a0;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    V8F v0 = {}, v1 = {};
    if constexpr (std::is_same_v<T, float>) {
      std::memcpy(&v0, p + i, sizeof(v0));
      std::memcpy(&v1, p + i + 8, sizeof(v1));
    } else {
      for (int j = 0; j < 8; ++j) {
        v0[j] = ToFloat(p[i + j]);
        v1[j] = ToFloat(p[i + 8 + j]);
      }
    }
    a0 = v0 > a0 ? v0 : a0;  // NaN compares false: ignored
    a1 = v1 > a1 ? v1 : a1;
  }
  a0 = a1 > a0 ? a1 : a0;
  float m = kNegInf;
  for (int j = 0; j < 8; ++j) m = a0[j] > m ? a0[j] : m;
  for (; i < n; ++i) {
    const float v = ToFloat(p[i]);
    m = v > m ? v : m;
  }
  return m;
}

// e^v for v <= 0 (x - max): 0 below -87 (x = -inf included), NaN stays NaN.
inline float ExpNonPositive(float v) {
  constexpr float kLo = -87.0f;
  const bool under = v < kLo;
  return SelectF(under, 0.0f, ExpInRange(SelectF(under, kLo, v)));
}

// Sum over i < n of e^(x[i] - m), also stored to e[i] when kStore (else to a stack buffer).
// Blocks of kBlock elements: one vectorized loop computes the block's exponentials, a second
// sums them while they are in L1 (SumOf, in double); a fused loop would need a float
// reduction, which the compiler does not vectorize.
template <bool kStore, typename T>
double ExpSum(const T* x, float m, float* e, int64_t n) {
  constexpr int64_t kBlock = 1024;
  float buf[kStore ? 1 : kBlock];
  double total = 0.0;
  for (int64_t b = 0; b < n; b += kBlock) {
    const int64_t len = std::min(kBlock, n - b);
    float* eb = kStore ? e + b : buf;
    const T* xb = x + b;
    for (int64_t i = 0; i < len; ++i) eb[i] = ExpNonPositive(ToFloat(xb[i]) - m);
    total += SumOf(len, [&](int64_t i) { return eb[i]; });
  }
  return total;
}

// Per row: the max (one read of x), then e^(x - max) and its sum (a second read, from cache:
// a 50257-float row is 200 KB), then one normalising pass. For float32 the exponentials go
// straight into y and are scaled in place; log-softmax only sums and writes (x - max) - log(sum).
template <typename T>
void SoftmaxTyped(const T* x, T* y, int64_t rows, int64_t n, bool log) {
  ParallelFor(rows, RowGrain(n), [&](int64_t begin, int64_t end) {
    // Exponentials of one row: written straight into y for float32, a float scratch otherwise.
    std::vector<float> scratch(std::is_same_v<T, float> || log ? 0 : static_cast<size_t>(n));
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * n;
      T* yr = y + r * n;
      const float m = RowMax(xr, n);
      if (log) {
        const double s = ExpSum</*kStore=*/false>(xr, m, nullptr, n);
        // (x - m) - log(s), as torch: x - (m + log(s)) would round m + log(s) at m's magnitude.
        const auto log_s = static_cast<float>(std::log(s));
        for (int64_t i = 0; i < n; ++i) yr[i] = FromFloat<T>((ToFloat(xr[i]) - m) - log_s);
        continue;
      }
      float* e;
      if constexpr (std::is_same_v<T, float>) {
        e = yr;
      } else {
        e = scratch.data();
      }
      const double s = ExpSum</*kStore=*/true>(xr, m, e, n);
      const auto inv = static_cast<float>(1.0 / s);
      for (int64_t i = 0; i < n; ++i) yr[i] = FromFloat<T>(e[i] * inv);
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
