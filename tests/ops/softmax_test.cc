// Softmax / log_softmax on the CPU backend against float64 references, and their backward
// against central finite differences of the float64 forward.
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "dtensor/kernels/cpu/cpu_kernels.h"
#include "dtensor/ops/ops.h"
#include "gtest/gtest.h"
#include "tests/testing/test_util.h"

namespace dtensor {
namespace {

using testing::Unwrap;

constexpr DType kFloatTypes[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16};

// Softmax (or log_softmax) of each row of row-major [rows, n] in float64.
std::vector<double> RefSoftmax(const std::vector<double>& x, int64_t n, bool log) {
  std::vector<double> y(x.size());
  for (size_t r = 0; r < x.size() / static_cast<size_t>(n); ++r) {
    const double* xr = &x[r * n];
    double m = -INFINITY;
    for (int64_t i = 0; i < n; ++i) m = std::max(m, xr[i]);
    double s = 0;
    for (int64_t i = 0; i < n; ++i) s += std::exp(xr[i] - m);
    for (int64_t i = 0; i < n; ++i) y[r * n + i] = log ? xr[i] - m - std::log(s) : std::exp(xr[i] - m) / s;
  }
  return y;
}

// Values of x with `dim` moved last (row-major), for references over any dim.
std::vector<double> MoveDimLast(const Tensor& x, int64_t dim) {
  return testing::Values(Unwrap(x.Transpose(dim, x.dim() - 1)));
}

std::string What(const char* op, DType d, IntSpan shape, int64_t dim, bool nc) {
  return std::string(op) + " " + std::string(DTypeName(d)) + " " + ShapeString(shape) + " dim " + std::to_string(dim) +
         (nc ? " nc" : "");
}

TEST(CpuSoftmaxTest, ForwardMatchesReference) {
  struct Case {
    Shape shape;
    int64_t dim;
  };
  const Case cases[] = {{{5, 17}, -1}, {{3, 1}, -1},     {{2, 3, 127}, -1}, {{2, 3, 7}, 1},
                        {{9, 4}, 0},   {{300, 200}, -1}, {{1, 5003}, -1}};
  for (DType d : kFloatTypes) {
    for (const Case& c : cases) {
      for (bool nc : {false, true}) {
        for (bool log : {false, true}) {
          Tensor x = testing::Random(c.shape, d, 3, -4.0, 4.0);
          if (nc) x = testing::NonContiguous(x);
          const Tensor y = Unwrap(log ? LogSoftmax(x, c.dim) : Softmax(x, c.dim));
          ASSERT_EQ(y.shape(), x.shape());
          const int64_t dim = c.dim < 0 ? c.dim + x.dim() : c.dim;
          const std::vector<double> ref = RefSoftmax(MoveDimLast(x, dim), c.shape[dim], log);
          testing::ExpectNear(MoveDimLast(y, dim), ref, testing::Tol(d),
                              What(log ? "log_softmax" : "softmax", d, c.shape, c.dim, nc));
        }
      }
    }
  }
}

TEST(CpuSoftmaxTest, StableForLargeAndInfiniteLogits) {
  const float inf = std::numeric_limits<float>::infinity();
  const Tensor x = Unwrap(
      Tensor::FromVector<float>(std::vector<float>{1000.0f, 1001.0f, -inf, 999.0f, -1e30f, 0.0f, 1.0f, -inf}, {2, 4}));
  const std::vector<double> y = testing::Values(Unwrap(Softmax(x)));
  const std::vector<double> ly = testing::Values(Unwrap(LogSoftmax(x)));
  const std::vector<double> ref = RefSoftmax({1000, 1001, -INFINITY, 999, -1e30, 0, 1, -INFINITY}, 4, false);
  const std::vector<double> lref = RefSoftmax({1000, 1001, -INFINITY, 999, -1e30, 0, 1, -INFINITY}, 4, true);
  testing::ExpectNear(y, ref, {1e-5, 1e-6}, "softmax large");
  EXPECT_EQ(y[2], 0.0);
  EXPECT_EQ(ly[2], -INFINITY);
  EXPECT_EQ(ly[7], -INFINITY);
  testing::ExpectNear({ly[0], ly[1], ly[3], ly[5], ly[6]}, {lref[0], lref[1], lref[3], lref[5], lref[6]}, {1e-5, 1e-5},
                      "log_softmax large");
  // A row with a NaN is NaN (as PyTorch).
  const Tensor n = Unwrap(Tensor::FromVector<float>(std::vector<float>{1.0f, std::nanf(""), 2.0f}, {1, 3}));
  for (double v : testing::Values(Unwrap(Softmax(n)))) EXPECT_TRUE(std::isnan(v));
}

// Log-probabilities are (x - max) - log(sum), as torch's: x - (max + log(sum)) rounds the sum at
// the max's magnitude (half an ulp of 2e4 is ~1e-3; of 1e30, everything below it).
TEST(CpuSoftmaxTest, LogSoftmaxKeepsPrecisionForLargeLogits) {
  const std::vector<double> x = {20000.5, 20000, 19999, 19990, 1e30, 1e30, -1e30, 0};
  for (DType d : {DType::kFloat32, DType::kBFloat16}) {
    const Tensor xt = testing::FromDoubles(x, {2, 4}, d);
    const std::vector<double> xv = testing::Values(xt);  // as rounded to d
    std::vector<double> want;
    for (int r = 0; r < 2; ++r) {
      const double* row = &xv[static_cast<size_t>(r * 4)];
      const double m = *std::max_element(row, row + 4);
      double s = 0;
      for (int j = 0; j < 4; ++j) s += std::exp(row[j] - m);
      for (int j = 0; j < 4; ++j) want.push_back((row[j] - m) - std::log(s));
    }
    testing::ExpectNear(testing::Values(Unwrap(LogSoftmax(xt))), want,
                        d == DType::kFloat32 ? testing::Tolerance{1e-6, 1e-6} : testing::Tol(d),
                        std::string("log_softmax ") + DTypeName(d));
  }
}

TEST(CpuSoftmaxTest, BackwardMatchesFiniteDifferences) {
  for (DType d : kFloatTypes) {
    for (bool log : {false, true}) {
      for (const Shape& shape : {Shape{3, 7}, Shape{2, 1}, Shape{1, 13}}) {
        const int64_t n = shape.back();
        const Tensor x = testing::Random(shape, d, 11, -2.0, 2.0);
        const Tensor dy = testing::Random(shape, d, 12, -1.0, 1.0);
        const std::vector<double> xv = testing::Values(x), dyv = testing::Values(dy);
        const Tensor y = Unwrap(log ? LogSoftmax(x) : Softmax(x));
        const Tensor dx = Unwrap(log ? LogSoftmaxBackward(dy, y) : SoftmaxBackward(dy, y));
        const auto loss = [&](const std::vector<double>& xs) {
          const std::vector<double> ys = RefSoftmax(xs, n, log);
          double s = 0;
          for (size_t i = 0; i < ys.size(); ++i) s += dyv[i] * ys[i];
          return s;
        };
        const std::vector<double> fd = testing::FiniteDifference(loss, xv, 1e-6);
        testing::Tolerance tol = testing::Tol(d);
        if (d == DType::kFloat32) tol = {1e-4, 1e-5};
        testing::ExpectNear(testing::Values(dx), fd, tol,
                            What(log ? "d log_softmax" : "d softmax", d, shape, -1, false));
      }
    }
  }
}

TEST(CpuSoftmaxTest, BackwardLargeAgainstAnalyticReference) {
  // Many rows (parallel path), f32; the reference is the float64 closed form on the same y.
  const int64_t rows = 257, n = 301;
  for (bool log : {false, true}) {
    const Tensor x = testing::Random({rows, n}, DType::kFloat32, 21, -3.0, 3.0);
    const Tensor dy = testing::Random({rows, n}, DType::kFloat32, 22);
    const Tensor y = Unwrap(log ? LogSoftmax(x) : Softmax(x));
    const std::vector<double> yv = testing::Values(y), dyv = testing::Values(dy);
    std::vector<double> ref(yv.size());
    for (int64_t r = 0; r < rows; ++r) {
      double s = 0;
      for (int64_t i = 0; i < n; ++i) s += log ? dyv[r * n + i] : dyv[r * n + i] * yv[r * n + i];
      for (int64_t i = 0; i < n; ++i) {
        const size_t k = static_cast<size_t>(r * n + i);
        ref[k] = log ? dyv[k] - std::exp(yv[k]) * s : yv[k] * (dyv[k] - s);
      }
    }
    testing::ExpectNear(testing::Values(Unwrap(log ? LogSoftmaxBackward(dy, y) : SoftmaxBackward(dy, y))), ref,
                        {1e-5, 1e-6}, log ? "large d log_softmax" : "large d softmax");
  }
}

TEST(CpuSoftmaxTest, KernelRejectsIntegerDTypes) {
  const Tensor x = Unwrap(Tensor::FromVector<int32_t>(std::vector<int32_t>{1, 2}, {1, 2}));
  Tensor y = Unwrap(Tensor::Empty({1, 2}, DType::kInt32));
  EXPECT_EQ(CpuKernels()->Softmax(x, y, false).code(), absl::StatusCode::kUnimplemented);
}

}  // namespace
}  // namespace dtensor
