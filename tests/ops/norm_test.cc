// LayerNorm / RmsNorm on the CPU backend against float64 references, and their backward
// against central finite differences of the float64 forward (L = sum(y * R)).
#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "dtensor/kernels/kernels.h"
#include "dtensor/ops/ops.h"
#include "gtest/gtest.h"
#include "tests/testing/test_util.h"

namespace dtensor {
namespace {

using testing::Unwrap;
using testing::Values;

constexpr DType kFloatTypes[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16};

struct RefNorm {
  std::vector<double> y, mean, rstd;
};

// LayerNorm (rms = false; b may be empty for no bias) or RmsNorm of row-major [rows, c].
RefNorm RefForward(const std::vector<double>& x, const std::vector<double>& w, const std::vector<double>& b, int64_t c,
                   double eps, bool rms) {
  const int64_t rows = static_cast<int64_t>(x.size()) / c;
  RefNorm o;
  o.y.resize(x.size());
  for (int64_t r = 0; r < rows; ++r) {
    const double* xr = &x[r * c];
    double mu = 0;
    if (!rms) {
      for (int64_t i = 0; i < c; ++i) mu += xr[i];
      mu /= static_cast<double>(c);
    }
    double var = 0;
    for (int64_t i = 0; i < c; ++i) var += (xr[i] - mu) * (xr[i] - mu);
    var /= static_cast<double>(c);
    const double rs = 1.0 / std::sqrt(var + eps);
    for (int64_t i = 0; i < c; ++i) o.y[r * c + i] = (xr[i] - mu) * rs * w[i] + (b.empty() ? 0.0 : b[i]);
    o.mean.push_back(mu);
    o.rstd.push_back(rs);
  }
  return o;
}

double Dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

// Up to `max` indices of [0, n), evenly spread, first and last included.
std::vector<size_t> Sample(size_t n, size_t max) {
  std::vector<size_t> idx;
  if (n <= max) {
    for (size_t i = 0; i < n; ++i) idx.push_back(i);
  } else {
    for (size_t k = 0; k < max; ++k) idx.push_back(k * (n - 1) / (max - 1));
  }
  return idx;
}

// Compares analytic[i] with the central difference of f at x along i, for i in idx.
void ExpectGradMatchesFd(const std::function<double(const std::vector<double>&)>& f, std::vector<double> x,
                         const std::vector<double>& analytic, const std::vector<size_t>& idx, testing::Tolerance tol,
                         const std::string& what) {
  std::vector<double> got, fd;
  const double h = 1e-4;
  for (size_t i : idx) {
    const double orig = x[i];
    x[i] = orig + h;
    const double fp = f(x);
    x[i] = orig - h;
    const double fm = f(x);
    x[i] = orig;
    fd.push_back((fp - fm) / (2 * h));
    got.push_back(analytic[i]);
  }
  testing::ExpectNear(got, fd, tol, what);
}

std::string What(const char* op, DType d, int64_t rows, int64_t c, bool bias) {
  return std::string(op) + " " + std::string(DTypeName(d)) + " rows " + std::to_string(rows) + " C " +
         std::to_string(c) + (bias ? " bias" : "");
}

// Backward tolerances: kernels compute in float32 and round the gradient once.
testing::Tolerance GradTol(DType d) { return d == DType::kFloat32 ? testing::Tolerance{2e-4, 2e-4} : testing::Tol(d); }

struct Case {
  int64_t rows, c;
};
constexpr Case kCases[] = {{1, 1}, {3, 5}, {17, 127}, {1, 768}, {64, 768}, {5, 3}};

TEST(CpuNormTest, LayerNormForwardMatchesReference) {
  for (DType d : kFloatTypes) {
    for (const Case& k : kCases) {
      for (bool bias : {true, false}) {
        const Tensor x = testing::Random({k.rows, k.c}, d, 1, -2.0, 3.0);
        const Tensor w = testing::Random({k.c}, d, 2, 0.5, 1.5);
        const Tensor b = bias ? testing::Random({k.c}, d, 3) : Tensor();
        const NormOutput o = Unwrap(LayerNorm(x, w, b, 1e-5f));
        const RefNorm ref =
            RefForward(Values(x), Values(w), bias ? Values(b) : std::vector<double>{}, k.c, 1e-5, false);
        const std::string what = What("LayerNorm", d, k.rows, k.c, bias);
        ASSERT_EQ(o.mean.dtype(), DType::kFloat32);
        testing::ExpectNear(Values(o.y), ref.y, testing::Tol(d), what + " y");
        testing::ExpectNear(Values(o.mean), ref.mean, {1e-5, 1e-6}, what + " mean");
        testing::ExpectNear(Values(o.rstd), ref.rstd, {1e-4, 1e-6}, what + " rstd");
      }
    }
  }
}

TEST(CpuNormTest, LayerNormLargeOffsetIsStable) {
  // A large common offset: a one-pass E[x^2] - E[x]^2 variance would lose most digits.
  std::vector<double> xv;
  for (int i = 0; i < 3 * 768; ++i) xv.push_back(1000.0 + std::sin(0.37 * i));
  const Tensor x = testing::FromDoubles(xv, {3, 768}, DType::kFloat32);
  const Tensor w = testing::Random({768}, DType::kFloat32, 5, 0.5, 1.5);
  const NormOutput o = Unwrap(LayerNorm(x, w, Tensor()));
  const RefNorm ref = RefForward(Values(x), Values(w), {}, 768, 1e-5, false);
  testing::ExpectNear(Values(o.y), ref.y, {2e-3, 2e-3}, "offset y");
  testing::ExpectNear(Values(o.rstd), ref.rstd, {2e-3, 0}, "offset rstd");
}

TEST(CpuNormTest, LayerNormLeadingDimsAndNonContiguous) {
  const Tensor x = testing::NonContiguous(testing::Random({2, 3, 7}, DType::kFloat32, 7));
  ASSERT_FALSE(x.is_contiguous());
  const Tensor w = testing::Random({7}, DType::kFloat32, 8, 0.5, 1.5);
  const Tensor b = testing::Random({7}, DType::kFloat32, 9);
  const NormOutput o = Unwrap(LayerNorm(x, w, b));
  ASSERT_EQ(o.y.shape(), x.shape());
  ASSERT_EQ(o.mean.numel(), 6);
  const RefNorm ref = RefForward(Values(x), Values(w), Values(b), 7, 1e-5, false);
  testing::ExpectNear(Values(o.y), ref.y, testing::Tol(DType::kFloat32), "nc y");
  // Backward through the strided views too.
  const Tensor dy = testing::NonContiguous(testing::Random({2, 3, 7}, DType::kFloat32, 10));
  const NormGrads g = Unwrap(LayerNormBackward(dy, x, w, o, true));
  const std::vector<double> rv = Values(dy);
  const std::vector<double> wv = Values(w), bv = Values(b);
  ExpectGradMatchesFd([&](const std::vector<double>& xs) { return Dot(RefForward(xs, wv, bv, 7, 1e-5, false).y, rv); },
                      Values(x), Values(g.dx), Sample(42, 42), GradTol(DType::kFloat32), "nc dx");
}

TEST(CpuNormTest, LayerNormBackwardMatchesFiniteDifferences) {
  for (DType d : kFloatTypes) {
    for (const Case& k : kCases) {
      for (bool bias : {true, false}) {
        const Tensor x = testing::Random({k.rows, k.c}, d, 11, -2.0, 3.0);
        const Tensor w = testing::Random({k.c}, d, 12, 0.5, 1.5);
        const Tensor b = bias ? testing::Random({k.c}, d, 13) : Tensor();
        const Tensor dy = testing::Random({k.rows, k.c}, d, 14);
        const NormOutput o = Unwrap(LayerNorm(x, w, b));
        const NormGrads g = Unwrap(LayerNormBackward(dy, x, w, o, bias));
        ASSERT_EQ(g.dbias.defined(), bias);
        const std::vector<double> xv = Values(x), wv = Values(w), bv = bias ? Values(b) : std::vector<double>{};
        const std::vector<double> rv = Values(dy);
        const std::string what = What("LayerNormBackward", d, k.rows, k.c, bias);
        const testing::Tolerance tol = GradTol(d);
        ExpectGradMatchesFd(
            [&](const std::vector<double>& xs) { return Dot(RefForward(xs, wv, bv, k.c, 1e-5, false).y, rv); }, xv,
            Values(g.dx), Sample(xv.size(), 150), tol, what + " dx");
        ExpectGradMatchesFd(
            [&](const std::vector<double>& ws) { return Dot(RefForward(xv, ws, bv, k.c, 1e-5, false).y, rv); }, wv,
            Values(g.dweight), Sample(wv.size(), 60), tol, what + " dweight");
        if (bias) {
          ExpectGradMatchesFd(
              [&](const std::vector<double>& bs) { return Dot(RefForward(xv, wv, bs, k.c, 1e-5, false).y, rv); }, bv,
              Values(g.dbias), Sample(bv.size(), 60), tol, what + " dbias");
        }
      }
    }
  }
}

TEST(CpuNormTest, LayerNormBackwardIsDeterministic) {
  // Weight/bias gradients sum per fixed row block, so repeated calls agree bit for bit.
  const Tensor x = testing::Random({300, 257}, DType::kFloat32, 21);
  const Tensor w = testing::Random({257}, DType::kFloat32, 22);
  const Tensor b = testing::Random({257}, DType::kFloat32, 23);
  const Tensor dy = testing::Random({300, 257}, DType::kFloat32, 24);
  const NormOutput o = Unwrap(LayerNorm(x, w, b));
  const NormGrads g1 = Unwrap(LayerNormBackward(dy, x, w, o));
  const NormGrads g2 = Unwrap(LayerNormBackward(dy, x, w, o));
  EXPECT_EQ(Values(g1.dweight), Values(g2.dweight));
  EXPECT_EQ(Values(g1.dbias), Values(g2.dbias));
  EXPECT_EQ(Values(g1.dx), Values(g2.dx));
  // dbias is the column sum of dy.
  std::vector<double> colsum(257, 0.0);
  const std::vector<double> dv = Values(dy);
  for (size_t i = 0; i < dv.size(); ++i) colsum[i % 257] += dv[i];
  testing::ExpectNear(Values(g1.dbias), colsum, {1e-5, 1e-4}, "dbias = sum(dy)");
}

TEST(CpuNormTest, RmsNormForwardMatchesReference) {
  for (DType d : kFloatTypes) {
    for (const Case& k : kCases) {
      const Tensor x = testing::Random({k.rows, k.c}, d, 31, -2.0, 3.0);
      const Tensor w = testing::Random({k.c}, d, 32, 0.5, 1.5);
      const NormOutput o = Unwrap(RmsNorm(x, w, 1e-6f));
      const RefNorm ref = RefForward(Values(x), Values(w), {}, k.c, 1e-6, true);
      const std::string what = What("RmsNorm", d, k.rows, k.c, false);
      testing::ExpectNear(Values(o.y), ref.y, testing::Tol(d), what + " y");
      testing::ExpectNear(Values(o.rstd), ref.rstd, {1e-4, 1e-6}, what + " rstd");
    }
  }
}

TEST(CpuNormTest, RmsNormBackwardMatchesFiniteDifferences) {
  for (DType d : kFloatTypes) {
    for (const Case& k : kCases) {
      const Tensor x = testing::Random({k.rows, k.c}, d, 41, -2.0, 3.0);
      const Tensor w = testing::Random({k.c}, d, 42, 0.5, 1.5);
      const Tensor dy = testing::Random({k.rows, k.c}, d, 43);
      const NormOutput o = Unwrap(RmsNorm(x, w, 1e-6f));
      const NormGrads g = Unwrap(RmsNormBackward(dy, x, w, o));
      EXPECT_FALSE(g.dbias.defined());
      const std::vector<double> xv = Values(x), wv = Values(w), rv = Values(dy);
      const std::string what = What("RmsNormBackward", d, k.rows, k.c, false);
      const testing::Tolerance tol = GradTol(d);
      ExpectGradMatchesFd(
          [&](const std::vector<double>& xs) { return Dot(RefForward(xs, wv, {}, k.c, 1e-6, true).y, rv); }, xv,
          Values(g.dx), Sample(xv.size(), 150), tol, what + " dx");
      ExpectGradMatchesFd(
          [&](const std::vector<double>& ws) { return Dot(RefForward(xv, ws, {}, k.c, 1e-6, true).y, rv); }, wv,
          Values(g.dweight), Sample(wv.size(), 60), tol, what + " dweight");
    }
  }
}

// The fused residual add + LayerNorm equals Add then LayerNorm bit for bit (the sum rounded to
// the dtype before it is normalised), row counts from 1 to OpenMP-split sizes.
TEST(CpuNormTest, AddLayerNormEqualsAddThenLayerNormBitForBit) {
  for (DType d : kFloatTypes) {
    for (const Case& k : kCases) {
      for (bool bias : {true, false}) {
        const Tensor x = testing::Random({k.rows, k.c}, d, 61, -2.0, 2.0);
        const Tensor h = testing::Random({k.rows, k.c}, d, 62, -2.0, 2.0);
        const Tensor w = testing::Random({k.c}, d, 63, 0.5, 1.5);
        const Tensor b = bias ? testing::Random({k.c}, d, 64) : Tensor();
        const AddNormOutput f = Unwrap(AddLayerNorm(x, h, w, b, 1e-5f));
        const Tensor sum = Unwrap(Add(x, h));
        const NormOutput o = Unwrap(LayerNorm(sum, w, b, 1e-5f));
        const std::string what = What("AddLayerNorm", d, k.rows, k.c, bias);
        EXPECT_EQ(f.residual.dtype(), d) << what;
        EXPECT_EQ(Values(f.residual), Values(sum)) << what;
        EXPECT_EQ(Values(f.norm.y), Values(o.y)) << what;
        EXPECT_EQ(Values(f.norm.mean), Values(o.mean)) << what;
        EXPECT_EQ(Values(f.norm.rstd), Values(o.rstd)) << what;
      }
    }
  }
}

// AddLayerNorm's backward in one pass equals LayerNormBackward then Add bit for bit (dx rounded
// to the dtype before the residual's gradient is added).
TEST(CpuNormTest, LayerNormBackwardAddEqualsBackwardThenAddBitForBit) {
  for (DType d : kFloatTypes) {
    for (const Case& k : kCases) {
      for (bool bias : {true, false}) {
        const Tensor x = testing::Random({k.rows, k.c}, d, 65, -2.0, 2.0);
        const Tensor w = testing::Random({k.c}, d, 66, 0.5, 1.5);
        const Tensor dy = testing::Random({k.rows, k.c}, d, 67), dres = testing::Random({k.rows, k.c}, d, 68);
        const NormOutput o = Unwrap(LayerNorm(x, w, Tensor()));
        const NormGrads f = Unwrap(LayerNormBackwardAdd(dy, x, w, o, dres, bias));
        const NormGrads g = Unwrap(LayerNormBackward(dy, x, w, o, bias));
        const std::string what = What("LayerNormBackwardAdd", d, k.rows, k.c, bias);
        EXPECT_EQ(Values(f.dx), Values(Unwrap(Add(g.dx, dres)))) << what;
        EXPECT_EQ(Values(f.dweight), Values(g.dweight)) << what;
        if (bias) {
          EXPECT_EQ(Values(f.dbias), Values(g.dbias)) << what;
        }
        EXPECT_EQ(f.dbias.defined(), bias) << what;
      }
    }
  }
  const Tensor x = testing::Random({3, 4}, DType::kFloat32, 69), w = testing::Random({4}, DType::kFloat32, 70);
  const NormOutput o = Unwrap(LayerNorm(x, w, Tensor()));
  EXPECT_FALSE(LayerNormBackwardAdd(x, x, w, o, Tensor()).ok());
  EXPECT_FALSE(LayerNormBackwardAdd(x, x, w, o, testing::Random({4, 3}, DType::kFloat32, 71)).ok());
}

// The CPU kernels equal the Kernels base class's defaults (Binary, then LayerNorm; and
// LayerNormBackward, then Binary), which other backends inherit.
TEST(CpuNormTest, AddLayerNormKernelsEqualDefaults) {
  Kernels* k = Unwrap(KernelsFor(Device::Cpu()));
  for (DType d : kFloatTypes) {
    const Tensor x = testing::Random({9, 40}, d, 71), h = testing::Random({9, 40}, d, 72);
    const Tensor w = testing::Random({40}, d, 73, 0.5, 1.5), b = testing::Random({40}, d, 74);
    Tensor out[2][4];
    for (auto& o : out) {
      o[0] = Unwrap(Tensor::Empty({9, 40}, d));
      o[1] = Unwrap(Tensor::Empty({9, 40}, d));
      o[2] = Unwrap(Tensor::Empty({9}, DType::kFloat32));
      o[3] = Unwrap(Tensor::Empty({9}, DType::kFloat32));
    }
    ASSERT_TRUE(k->AddLayerNorm(x, h, w, b, 1e-5f, out[0][0], out[0][1], out[0][2], out[0][3]).ok());
    ASSERT_TRUE(k->Kernels::AddLayerNorm(x, h, w, b, 1e-5f, out[1][0], out[1][1], out[1][2], out[1][3]).ok());
    for (int i = 0; i < 4; ++i) EXPECT_EQ(Values(out[0][i]), Values(out[1][i])) << DTypeName(d) << " output " << i;
    const Tensor dy = testing::Random({9, 40}, d, 75), dres = testing::Random({9, 40}, d, 76);
    Tensor grads[2][3];
    for (auto& g : grads) {
      g[0] = Unwrap(Tensor::Empty({9, 40}, d));
      g[1] = Unwrap(Tensor::Empty({40}, d));
      g[2] = Unwrap(Tensor::Empty({40}, d));
    }
    const Tensor& x1 = out[0][0];
    ASSERT_TRUE(
        k->LayerNormBackwardAdd(dy, x1, w, out[0][2], out[0][3], dres, grads[0][0], grads[0][1], grads[0][2]).ok());
    ASSERT_TRUE(
        k->Kernels::LayerNormBackwardAdd(dy, x1, w, out[0][2], out[0][3], dres, grads[1][0], grads[1][1], grads[1][2])
            .ok());
    for (int i = 0; i < 3; ++i) EXPECT_EQ(Values(grads[0][i]), Values(grads[1][i])) << DTypeName(d) << " grad " << i;
  }
}

// Leading dims and non-contiguous inputs; shapes and dtypes that differ are refused by name.
TEST(CpuNormTest, AddLayerNormLeadingDimsNonContiguousAndErrors) {
  const Tensor xt = testing::Random({6, 2, 3}, DType::kFloat32, 81);
  const Tensor x = Unwrap(xt.Transpose(0, 2));  // [3, 2, 6], not contiguous
  const Tensor h = testing::Random({3, 2, 6}, DType::kFloat32, 82);
  const Tensor w = testing::Random({6}, DType::kFloat32, 83), b = testing::Random({6}, DType::kFloat32, 84);
  const AddNormOutput f = Unwrap(AddLayerNorm(x, h, w, b));
  const NormOutput o = Unwrap(LayerNorm(Unwrap(Add(x, h)), w, b));
  EXPECT_EQ(f.norm.y.shape(), IntSpan(Shape{3, 2, 6}));
  EXPECT_EQ(Values(f.norm.y), Values(o.y));
  EXPECT_EQ(f.norm.mean.numel(), 6);

  const Tensor h_bad = testing::Random({3, 6}, DType::kFloat32, 85);
  absl::StatusOr<AddNormOutput> bad = AddLayerNorm(h, h_bad, w, b);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("AddLayerNorm"), std::string::npos) << bad.status();
  const Tensor h_bf16 = testing::Random({3, 2, 6}, DType::kBFloat16, 86);
  EXPECT_FALSE(AddLayerNorm(h, h_bf16, w, b).ok());
  const Tensor empty = Unwrap(Zeros({0, 6}, DType::kFloat32));
  const AddNormOutput e = Unwrap(AddLayerNorm(empty, empty, w, b));
  EXPECT_EQ(e.residual.numel(), 0);
  EXPECT_EQ(e.norm.mean.numel(), 0);
}

TEST(CpuNormTest, EmptyRowsGiveZeroParameterGradients) {
  const Tensor x = Unwrap(Zeros({0, 5}, DType::kFloat32));
  const Tensor w = testing::Random({5}, DType::kFloat32, 51);
  const Tensor b = testing::Random({5}, DType::kFloat32, 52);
  const NormOutput o = Unwrap(LayerNorm(x, w, b));
  EXPECT_EQ(o.y.numel(), 0);
  const NormGrads g = Unwrap(LayerNormBackward(x, x, w, o));
  EXPECT_EQ(Values(g.dweight), std::vector<double>(5, 0.0));
  EXPECT_EQ(Values(g.dbias), std::vector<double>(5, 0.0));
}

}  // namespace
}  // namespace dtensor
