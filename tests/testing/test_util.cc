#include "tests/testing/test_util.h"

#include <stdlib.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <sstream>
#include <system_error>

namespace dtensor::testing {

Tensor Random(IntSpan shape, DType dtype, uint64_t seed, double lo, double hi, Device device) {
  return Unwrap(RandomUniform(shape, dtype, seed, lo, hi, device), "Random");
}

std::vector<double> Values(const Tensor& x) { return Unwrap(ToDoubleVector(x), "Values"); }

Tensor FromDoubles(const std::vector<double>& values, IntSpan shape, DType dtype) {
  std::vector<float> f(values.begin(), values.end());
  Tensor t = Unwrap(Tensor::FromVector<float>(f, shape), "FromDoubles");
  if (dtype == DType::kInt32 || dtype == DType::kInt64) {
    std::vector<int64_t> iv(values.size());
    for (size_t i = 0; i < values.size(); ++i) iv[i] = static_cast<int64_t>(std::llround(values[i]));
    Tensor it = Unwrap(Tensor::FromVector<int64_t>(iv, shape), "FromDoubles");
    return Unwrap(Cast(it, dtype), "FromDoubles");
  }
  return Unwrap(Cast(t, dtype), "FromDoubles");
}

Tensor NonContiguous(const Tensor& x) {
  // Allocate [d_{n-1}, ..., d_1, 2*d_0']: reversed dims, doubled last, then view it back.
  const int64_t n = x.dim();
  if (n == 0) return x;
  Shape big(x.shape().rbegin(), x.shape().rend());
  big.back() *= 2;  // the original dim 0 gets a gap between elements
  Tensor base = Unwrap(Full(big, std::nan(""), x.dtype(), x.device()), "NonContiguous");
  if (!base.defined()) return x;
  Tensor v = Unwrap(base.Slice(n - 1, 0, big.back(), 2), "NonContiguous");
  Shape perm(n);
  for (int64_t i = 0; i < n; ++i) perm[i] = n - 1 - i;
  v = Unwrap(v.Permute(perm), "NonContiguous");
  auto st = Copy_(v, x);
  if (!st.ok()) ADD_FAILURE() << "NonContiguous: " << st;
  return v;
}

Tolerance Tol(DType dtype) {
  switch (dtype) {
    case DType::kBFloat16:
      return {2e-2, 2e-2};
    case DType::kFloat16:
      return {4e-3, 4e-3};
    case DType::kFloat32:
      return {1e-5, 1e-5};
    default:
      return {0.0, 0.0};
  }
}

void ExpectNear(const std::vector<double>& actual, const std::vector<double>& expected, Tolerance tol,
                const std::string& what) {
  ASSERT_EQ(actual.size(), expected.size()) << what << ": sizes differ";
  int reported = 0;
  int bad = 0;
  for (size_t i = 0; i < actual.size(); ++i) {
    const double a = actual[i], e = expected[i];
    const bool ok =
        (std::isnan(a) && std::isnan(e)) || (a == e) || std::fabs(a - e) <= tol.atol + tol.rtol * std::fabs(e);
    if (!ok) {
      ++bad;
      if (reported++ < 5) {
        ADD_FAILURE() << what << ": element " << i << " is " << a << ", expected " << e << " (rtol " << tol.rtol
                      << ", atol " << tol.atol << ")";
      }
    }
  }
  if (bad > 5) ADD_FAILURE() << what << ": " << bad << " of " << actual.size() << " elements differ";
}

void ExpectNormNear(const std::vector<double>& actual, const std::vector<double>& expected, double rtol,
                    const std::string& what) {
  ASSERT_EQ(actual.size(), expected.size()) << what << ": sizes differ";
  double diff = 0, norm = 0, worst = -1;
  size_t at = 0;
  for (size_t i = 0; i < actual.size(); ++i) {
    const double d = actual[i] - expected[i];
    diff += d * d;
    norm += expected[i] * expected[i];
    if (std::fabs(d) > worst) worst = std::fabs(d), at = i;
  }
  diff = std::sqrt(diff);
  norm = std::sqrt(norm);
  EXPECT_LE(diff, rtol * norm) << what << ": relative error " << (norm > 0 ? diff / norm : diff) << " (rtol " << rtol
                               << "); worst element " << at << ": " << (at < actual.size() ? actual[at] : 0.0)
                               << ", expected " << (at < expected.size() ? expected[at] : 0.0);
}

std::vector<double> FiniteDifference(const std::function<double(const std::vector<double>&)>& f, std::vector<double> x,
                                     double h) {
  std::vector<double> g(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const double orig = x[i];
    x[i] = orig + h;
    const double fp = f(x);
    x[i] = orig - h;
    const double fm = f(x);
    x[i] = orig;
    g[i] = (fp - fm) / (2 * h);
  }
  return g;
}

std::vector<int64_t> StridesOf(IntSpan shape) {
  Shape s = ContiguousStrides(shape);
  return std::vector<int64_t>(s.begin(), s.end());
}

ScopedTempDir::ScopedTempDir(const std::string& name) {
  std::string tmpl = ::testing::TempDir() + name + "_XXXXXX";
  if (::mkdtemp(tmpl.data()) != nullptr) {
    path_ = tmpl;
  } else {
    ADD_FAILURE() << "mkdtemp(" << tmpl << ") failed";
  }
}

ScopedTempDir::~ScopedTempDir() {
  if (path_.empty()) return;
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

void WriteBytes(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!f.good()) ADD_FAILURE() << "cannot write " << path;
}

std::string ReadBytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

}  // namespace dtensor::testing
