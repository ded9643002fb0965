// Helpers shared by dtensor's tests: deterministic inputs, float64 reference comparisons,
// non-contiguous copies and central finite differences.
//
//   Tensor x = testing::Random({3, 17}, DType::kBFloat16, /*seed=*/1);
//   std::vector<double> ref = ...naive float64 loop over testing::Values(x)...;
//   testing::ExpectNear(testing::Values(y), ref, testing::Tol(DType::kBFloat16), "gelu");
#ifndef DTENSOR_TESTS_TESTING_TEST_UTIL_H_
#define DTENSOR_TESTS_TESTING_TEST_UTIL_H_

#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "dtensor/ops/ops.h"
#include "gtest/gtest.h"

namespace dtensor::testing {

// Unwraps a StatusOr in a test: ADD_FAILURE()s with the status message and returns T{} on error.
template <typename T>
T Unwrap(absl::StatusOr<T> v, const char* what = "") {
  if (!v.ok()) {
    ADD_FAILURE() << what << ": " << v.status();
    return T{};
  }
  return *std::move(v);
}

// How much slower than a plain build this test binary is allowed to run: the factor in
// DTENSOR_TEST_TIME_SCALE (>= 1; 1 when unset or unreadable). Checks that a run "waited for a
// timeout" multiply their limit by it, as the sanitizer builds of scripts/test.sh set it.
inline double TimeScale() {
  const char* v = std::getenv("DTENSOR_TEST_TIME_SCALE");
  if (v == nullptr) return 1.0;
  char* end = nullptr;
  const double f = std::strtod(v, &end);
  return end != v && f >= 1.0 ? f : 1.0;
}

// How many of an exhaustive sweep's cases a test runs: every k-th, k from
// DTENSOR_TEST_SWEEP_STRIDE (>= 1; 1 when unset or unreadable). The sanitizer builds of
// scripts/test.sh set it (their checks make the sweeps 8-20x slower; every code path a sweep
// reaches is still reached by a sample), while the plain build runs every case.
inline int64_t SweepStride() {
  const char* v = std::getenv("DTENSOR_TEST_SWEEP_STRIDE");
  if (v == nullptr) return 1;
  char* end = nullptr;
  const long long k = std::strtoll(v, &end, 10);
  return end != v && k >= 1 ? static_cast<int64_t>(k) : 1;
}

// Uniform values in [lo, hi) on `device`, rounded to `dtype` (seeded, reproducible).
Tensor Random(IntSpan shape, DType dtype, uint64_t seed, double lo = -1.0, double hi = 1.0,
              Device device = Device::Cpu());
// All elements of x as float64 in row-major order (any dtype, device, strides).
std::vector<double> Values(const Tensor& x);
// A CPU tensor of `dtype` and `shape` holding `values` (rounded to dtype).
Tensor FromDoubles(const std::vector<double>& values, IntSpan shape, DType dtype);
// The same values in a non-contiguous layout: a strided view into a larger buffer (last dim
// every other element, dims reversed in memory).
Tensor NonContiguous(const Tensor& x);

// Tolerances for comparing a kernel in `dtype` with a float64 reference.
struct Tolerance {
  double rtol;
  double atol;
};
Tolerance Tol(DType dtype);
// EXPECTs |a[i] - b[i]| <= atol + rtol * |b[i]| for all i (NaN matches NaN), reporting the
// first few mismatches with their index and `what`.
void ExpectNear(const std::vector<double>& actual, const std::vector<double>& expected, Tolerance tol,
                const std::string& what);

// EXPECTs the relative error of the whole tensor, ||a - b||_2 <= rtol * ||b||_2, reporting it
// and the worst element. For results of long computations that an optimizer that normalises
// each element's step (AdamW) amplifies element-wise rounding in (elements whose gradient is
// near zero move by O(lr) either way), where the tensor as a whole still agrees closely.
void ExpectNormNear(const std::vector<double>& actual, const std::vector<double>& expected, double rtol,
                    const std::string& what);
// Central finite differences of a scalar function f at x: g[i] = (f(x+h e_i) - f(x-h e_i)) / 2h.
std::vector<double> FiniteDifference(const std::function<double(const std::vector<double>&)>& f, std::vector<double> x,
                                     double h = 1e-4);

// Row-major index helpers for naive references.
std::vector<int64_t> StridesOf(IntSpan shape);

// A fresh directory under GoogleTest's temp dir (prefix `name`), removed with its contents at
// the end of the scope. path() is empty (and the test has failed) when it cannot be made.
class ScopedTempDir {
 public:
  explicit ScopedTempDir(const std::string& name = "dtensor");
  ~ScopedTempDir();
  ScopedTempDir(const ScopedTempDir&) = delete;
  ScopedTempDir& operator=(const ScopedTempDir&) = delete;
  const std::string& path() const { return path_; }
  std::string Path(const std::string& file) const { return path_ + "/" + file; }

 private:
  std::string path_;
};

// Writes `bytes` to `path` (ADD_FAILURE on error).
void WriteBytes(const std::string& path, const std::string& bytes);

// The contents of `path`; empty when it cannot be read (callers check what they expect in it).
std::string ReadBytes(const std::string& path);

}  // namespace dtensor::testing

#endif  // DTENSOR_TESTS_TESTING_TEST_UTIL_H_
