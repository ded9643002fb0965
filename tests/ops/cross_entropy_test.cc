// Cross-entropy on the CPU backend against a float64 reference; its backward against central
// finite differences of the float64 mean loss; the fused form (CrossEntropyWithGrad) against
// the two ops, bit for bit, and against float64 for a given count.
#include <algorithm>
#include <cmath>
#include <functional>
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
using testing::Values;

constexpr DType kFloatTypes[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16};

Tensor Targets(const std::vector<int64_t>& t, IntSpan shape, DType dtype) {
  if (dtype == DType::kInt32) {
    std::vector<int32_t> v(t.begin(), t.end());
    return Unwrap(Tensor::FromVector<int32_t>(v, shape));
  }
  return Unwrap(Tensor::FromVector<int64_t>(t, shape));
}

// Targets in [0, v), every third row (starting at row 1) set to `ignore`.
std::vector<int64_t> MakeTargets(int64_t n, int64_t v, int64_t ignore) {
  std::vector<int64_t> t;
  for (int64_t i = 0; i < n; ++i) t.push_back(i % 3 == 1 ? ignore : (i * 7 + 3) % v);
  return t;
}

double LogSumExp(const double* row, int64_t v) {
  double m = -INFINITY;
  for (int64_t j = 0; j < v; ++j) m = std::max(m, row[j]);
  double s = 0;
  for (int64_t j = 0; j < v; ++j) s += std::exp(row[j] - m);
  return m + std::log(s);
}

// Mean over non-ignored rows of lse - logit[target] (NaN when every row is ignored).
double RefMeanLoss(const std::vector<double>& x, const std::vector<int64_t>& t, int64_t v, int64_t ignore) {
  double total = 0, count = 0;
  for (size_t i = 0; i < t.size(); ++i) {
    if (t[i] == ignore) continue;
    total += LogSumExp(&x[i * v], v) - x[i * v + t[i]];
    count += 1;
  }
  return total / count;
}

struct Case {
  Shape lead;  // leading dims of logits (targets' shape)
  int64_t v;
};
const Case kCases[] = {{{1}, 3}, {{3}, 101}, {{17}, 3}, {{17}, 101}, {{2, 3}, 5}, {{1}, 1}, {{64}, 1001}, {{2}, 50257}};

std::string What(DType d, const Case& k, DType td) {
  return std::string(DTypeName(d)) + " " + ShapeString(k.lead) + " V " + std::to_string(k.v) + " " +
         std::string(DTypeName(td));
}

TEST(CpuCrossEntropyTest, ForwardMatchesReference) {
  for (DType d : kFloatTypes) {
    for (DType td : {DType::kInt32, DType::kInt64}) {
      for (const Case& k : kCases) {
        for (int64_t ignore : {int64_t{-100}, int64_t{0}}) {
          Shape shape = k.lead;
          shape.push_back(k.v);
          const Tensor logits = testing::Random(shape, d, 1, -5.0, 5.0);
          const int64_t n = NumElements(k.lead);
          const std::vector<int64_t> t = MakeTargets(n, k.v, ignore);
          const CrossEntropyOutput o = Unwrap(CrossEntropy(logits, Targets(t, k.lead, td), ignore));
          const std::vector<double> x = Values(logits);
          std::vector<double> lse;
          double count = 0;
          for (int64_t i = 0; i < n; ++i) {
            lse.push_back(LogSumExp(&x[i * k.v], k.v));
            count += t[i] != ignore;
          }
          const std::string what = What(d, k, td) + " ignore " + std::to_string(ignore);
          // Inputs are exact in every dtype and the kernel computes in float32.
          testing::ExpectNear(Values(o.lse), lse, {2e-6, 2e-6}, what + " lse");
          testing::ExpectNear(Values(o.count), {count}, {0, 0}, what + " count");
          testing::ExpectNear(Values(o.loss), {RefMeanLoss(x, t, k.v, ignore)}, {1e-5, 1e-5}, what + " loss");
        }
      }
    }
  }
}

TEST(CpuCrossEntropyTest, LargeLogitsAreStable) {
  // Logits of +-1000: exp would overflow without the max shift.
  const Tensor logits = testing::Random({5, 33}, DType::kFloat32, 2, -1000.0, 1000.0);
  const std::vector<int64_t> t = {0, 5, 32, 7, 1};
  const CrossEntropyOutput o = Unwrap(CrossEntropy(logits, Targets(t, {5}, DType::kInt64)));
  const std::vector<double> x = Values(logits);
  testing::ExpectNear(Values(o.loss), {RefMeanLoss(x, t, 33, -100)}, {1e-6, 1e-3}, "large loss");
  std::vector<double> lse;
  for (int i = 0; i < 5; ++i) lse.push_back(LogSumExp(&x[i * 33], 33));
  testing::ExpectNear(Values(o.lse), lse, {1e-6, 1e-3}, "large lse");
}

// A row max of 2e4: m + log(sum) rounded to float32 is off by up to half its ulp (~1e-3), which
// the loss and every probability would inherit; the kernels keep m and log(sum) apart, as
// torch's (x - m) - log(sum). Against float64; the unfused backward and the fused one alike.
TEST(CpuCrossEntropyTest, LargeLogitsKeepPrecision) {
  const std::vector<double> x = {3000.25, 3000, 2999.5, 2990, 20000.5, 20000, 19999, 19990,
                                 1e30,    1e30, -1e30,  0,    -2e4,    -2e4,  -2e4,  -20000.5};
  const std::vector<int64_t> t = {0, 1, 1, 3};
  const int64_t n = 4, v = 4;
  const Tensor logits = testing::FromDoubles(x, {n, v}, DType::kFloat32);
  const Tensor targets = Targets(t, {n}, DType::kInt64);
  // float64 reference: mean loss and its gradient (softmax - onehot) / n, from m and s apart
  // (float64's m + log(s) loses log 2 at 1e30 too).
  std::vector<double> want;
  double want_loss = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double* row = &x[static_cast<size_t>(i * v)];
    const double m = *std::max_element(row, row + v);
    double s = 0;
    for (int64_t j = 0; j < v; ++j) s += std::exp(row[j] - m);
    want_loss += (std::log(s) - (row[t[static_cast<size_t>(i)]] - m)) / static_cast<double>(n);
    for (int64_t j = 0; j < v; ++j) {
      want.push_back((std::exp(row[j] - m) / s - (j == t[static_cast<size_t>(i)] ? 1 : 0)) / static_cast<double>(n));
    }
  }
  const CrossEntropyOutput o = Unwrap(CrossEntropy(logits, targets));
  testing::ExpectNear(Values(o.loss), {want_loss}, {1e-6, 1e-6}, "loss");
  const Tensor one = testing::FromDoubles({1.0}, {}, DType::kFloat32);
  testing::ExpectNear(Values(Unwrap(CrossEntropyBackward(one, logits, targets, o))), want, {1e-6, 1e-7}, "backward");
  const CrossEntropyWithGradOutput f = Unwrap(CrossEntropyWithGrad(logits, targets, one));
  testing::ExpectNear(Values(f.loss), {want_loss}, {1e-6, 1e-6}, "fused loss");
  testing::ExpectNear(Values(f.dlogits), want, {1e-6, 1e-7}, "fused dlogits");
}

TEST(CpuCrossEntropyTest, MinusInfinityLogitsAndNaN) {
  // -inf logits (masked classes) drop out of logsumexp and get zero gradient; a NaN logit
  // makes its row's loss NaN.
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<double> x = {0.5, -inf, 2.0, -inf, 1.0, -inf, -1.0, 0.0, -inf, 3.0, 0.25, -2.0};
  const Tensor logits = testing::FromDoubles(x, {2, 6}, DType::kFloat32);
  const std::vector<int64_t> t = {4, 1};
  const Tensor targets = Targets(t, {2}, DType::kInt64);
  const CrossEntropyOutput o = Unwrap(CrossEntropy(logits, targets));
  testing::ExpectNear(Values(o.lse), {LogSumExp(&x[0], 6), LogSumExp(&x[6], 6)}, {1e-6, 1e-6}, "-inf lse");
  testing::ExpectNear(Values(o.loss), {RefMeanLoss(x, t, 6, -100)}, {1e-6, 1e-6}, "-inf loss");
  const Tensor dl = testing::FromDoubles({1.0}, {}, DType::kFloat32);
  const std::vector<double> g = Values(Unwrap(CrossEntropyBackward(dl, logits, targets, o)));
  for (size_t i = 0; i < x.size(); ++i) {
    if (std::isinf(x[i])) {
      EXPECT_EQ(g[i], 0.0) << i;
    }
    EXPECT_TRUE(std::isfinite(g[i])) << i;
  }
  x[7] = std::nan("");
  const CrossEntropyOutput on = Unwrap(CrossEntropy(testing::FromDoubles(x, {2, 6}, DType::kFloat32), targets));
  EXPECT_FALSE(std::isnan(Values(on.lse)[0]));
  EXPECT_TRUE(std::isnan(Values(on.lse)[1]));
  EXPECT_TRUE(std::isnan(Values(on.loss)[0]));
}

TEST(CpuCrossEntropyTest, BackwardMatchesFiniteDifferences) {
  for (DType d : kFloatTypes) {
    for (const Case& k : kCases) {
      if (k.v > 2000) continue;  // covered by the forward test; finite differences too slow
      Shape shape = k.lead;
      shape.push_back(k.v);
      const Tensor logits = testing::Random(shape, d, 3, -3.0, 3.0);
      const int64_t n = NumElements(k.lead);
      const std::vector<int64_t> t = MakeTargets(n, k.v, -100);
      const Tensor targets = Targets(t, k.lead, DType::kInt64);
      const CrossEntropyOutput o = Unwrap(CrossEntropy(logits, targets));
      const double dloss = 0.7;
      const Tensor dl = testing::FromDoubles({dloss}, {}, DType::kFloat32);
      const Tensor dlogits = Unwrap(CrossEntropyBackward(dl, logits, targets, o));
      ASSERT_EQ(dlogits.shape(), logits.shape());
      ASSERT_EQ(dlogits.dtype(), d);
      const std::vector<double> x = Values(logits), got = Values(dlogits);
      const std::string what = What(d, k, DType::kInt64) + " backward";
      // Finite differences at a sample of logits, every ignored row included (must be 0).
      std::vector<double> fd, at;
      std::vector<double> xs = x;
      const size_t stride = std::max<size_t>(1, x.size() / 200);
      for (size_t i = 0; i < x.size(); i += stride) {
        const double h = 1e-4, orig = xs[i];
        xs[i] = orig + h;
        const double fp = RefMeanLoss(xs, t, k.v, -100);
        xs[i] = orig - h;
        const double fm = RefMeanLoss(xs, t, k.v, -100);
        xs[i] = orig;
        fd.push_back(dloss * (fp - fm) / (2 * h));
        at.push_back(got[i]);
      }
      const testing::Tolerance tol = d == DType::kFloat32 ? testing::Tolerance{1e-4, 1e-6} : testing::Tol(d);
      testing::ExpectNear(at, fd, tol, what);
      for (int64_t i = 0; i < n; ++i) {
        if (t[i] != -100) continue;
        for (int64_t j = 0; j < k.v; ++j) ASSERT_EQ(got[i * k.v + j], 0.0) << what << " ignored row " << i;
      }
    }
  }
}

TEST(CpuCrossEntropyTest, AllIgnoredGivesNanLossAndZeroGradient) {
  const Tensor logits = testing::Random({3, 4}, DType::kFloat32, 4);
  const Tensor targets = Targets({-100, -100, -100}, {3}, DType::kInt64);
  const CrossEntropyOutput o = Unwrap(CrossEntropy(logits, targets));
  EXPECT_TRUE(std::isnan(Values(o.loss)[0]));
  EXPECT_EQ(Values(o.count)[0], 0.0);
  const Tensor dl = testing::FromDoubles({1.0}, {}, DType::kFloat32);
  const Tensor g = Unwrap(CrossEntropyBackward(dl, logits, targets, o));
  EXPECT_EQ(Values(g), std::vector<double>(12, 0.0));
}

TEST(CpuCrossEntropyTest, OutOfRangeTargetIsInvalidArgument) {
  const Tensor logits = testing::Random({3, 4}, DType::kFloat32, 5);
  const CrossEntropyOutput ok = Unwrap(CrossEntropy(logits, Targets({0, 1, 2}, {3}, DType::kInt64)));
  const Tensor dl = testing::FromDoubles({1.0}, {}, DType::kFloat32);
  for (DType td : {DType::kInt32, DType::kInt64}) {
    for (int64_t bad : {int64_t{4}, int64_t{-1}, int64_t{-7}}) {
      const Tensor targets = Targets({0, bad, 2}, {3}, td);
      const auto fwd = CrossEntropy(logits, targets);
      ASSERT_FALSE(fwd.ok());
      EXPECT_EQ(fwd.status().code(), absl::StatusCode::kInvalidArgument);
      EXPECT_NE(fwd.status().message().find("target " + std::to_string(bad)), std::string::npos) << fwd.status();
      const auto bwd = CrossEntropyBackward(dl, logits, targets, ok);
      ASSERT_FALSE(bwd.ok());
      EXPECT_EQ(bwd.status().code(), absl::StatusCode::kInvalidArgument);
    }
  }
  // -1 is fine when it is the ignore_index.
  EXPECT_TRUE(CrossEntropy(logits, Targets({0, -1, 2}, {3}, DType::kInt64), -1).ok());
}

TEST(CpuCrossEntropyTest, KernelPerRowGradients) {
  // The kernel takes one upstream gradient per row (any stride); the ops layer broadcasts one.
  const int64_t n = 4, v = 6;
  const Tensor logits = testing::Random({n, v}, DType::kFloat32, 6);
  const Tensor targets = Targets({5, 0, -100, 3}, {n}, DType::kInt32);
  const Tensor losses = Unwrap(Tensor::Empty({n}, DType::kFloat32));
  const Tensor valid = Unwrap(Tensor::Empty({n}, DType::kFloat32));
  const Tensor lse = Unwrap(Tensor::Empty({n}, DType::kFloat32));
  Kernels* k = CpuKernels();
  ASSERT_TRUE(k->CrossEntropy(logits, targets, -100, losses, valid, lse).ok());
  EXPECT_EQ(Values(valid), (std::vector<double>{1, 1, 0, 1}));
  const std::vector<double> x = Values(logits);
  const std::vector<int64_t> t = {5, 0, -100, 3};
  std::vector<double> ref_loss;
  for (int64_t i = 0; i < n; ++i) ref_loss.push_back(t[i] < 0 ? 0.0 : LogSumExp(&x[i * v], v) - x[i * v + t[i]]);
  testing::ExpectNear(Values(losses), ref_loss, {1e-6, 1e-6}, "per-row losses");
  // grad = [g0, g1, g2, g3] taken every other element of a buffer (stride 2).
  const Tensor buf = testing::FromDoubles({0.5, 9, -2.0, 9, 3.0, 9, 1.5, 9}, {8}, DType::kFloat32);
  const Tensor grad = Unwrap(buf.Slice(0, 0, 8, 2));
  const double g[] = {0.5, -2.0, 3.0, 1.5};
  const Tensor dlogits = Unwrap(Tensor::Empty({n, v}, DType::kFloat32));
  ASSERT_TRUE(k->CrossEntropyBackward(logits, targets, lse, grad, -100, dlogits).ok());
  std::vector<double> ref(n * v, 0.0);
  for (int64_t i = 0; i < n; ++i) {
    if (t[i] < 0) continue;
    const double l = LogSumExp(&x[i * v], v);
    for (int64_t j = 0; j < v; ++j) ref[i * v + j] = g[i] * (std::exp(x[i * v + j] - l) - (j == t[i] ? 1.0 : 0.0));
  }
  testing::ExpectNear(Values(dlogits), ref, {1e-5, 1e-6}, "per-row dlogits");
}

TEST(CpuCrossEntropyTest, WithGradEqualsForwardThenBackward) {
  for (DType d : kFloatTypes) {
    for (DType td : {DType::kInt32, DType::kInt64}) {
      for (const Case& k : kCases) {
        for (double dl : {1.0, -0.37}) {
          Shape shape = k.lead;
          shape.push_back(k.v);
          const Tensor logits = testing::Random(shape, d, 11, -5.0, 5.0);
          const int64_t n = NumElements(k.lead);
          const Tensor targets = Targets(MakeTargets(n, k.v, -100), k.lead, td);
          const Tensor dloss = testing::FromDoubles({dl}, {}, DType::kFloat32);
          const CrossEntropyOutput o = Unwrap(CrossEntropy(logits, targets));
          const Tensor want = Unwrap(CrossEntropyBackward(dloss, logits, targets, o));
          const CrossEntropyWithGradOutput f = Unwrap(CrossEntropyWithGrad(logits, targets, dloss));
          const std::string what = What(d, k, td) + " dloss " + std::to_string(dl);
          // The same float32 arithmetic in the same order: equal, not close.
          EXPECT_EQ(Values(f.loss), Values(o.loss)) << what;
          EXPECT_EQ(Values(f.count), Values(o.count)) << what;
          ASSERT_EQ(f.dlogits.shape(), logits.shape()) << what;
          EXPECT_EQ(f.dlogits.dtype(), d) << what;
          EXPECT_EQ(Values(f.dlogits), Values(want)) << what;
        }
      }
    }
  }
}

TEST(CpuCrossEntropyTest, WithGradDividesByTheGivenCount) {
  // As one batch shard of several: the loss and gradient are divided by the global count.
  const int64_t n = 5, v = 13;
  const Tensor logits = testing::Random({n, v}, DType::kFloat32, 12, -4.0, 4.0);
  const std::vector<int64_t> t = {4, -100, 12, 0, 7};
  const Tensor count = testing::FromDoubles({10.0}, {}, DType::kFloat32);
  const Tensor dloss = testing::FromDoubles({0.5}, {}, DType::kFloat32);
  const CrossEntropyWithGradOutput f =
      Unwrap(CrossEntropyWithGrad(logits, Targets(t, {n}, DType::kInt64), dloss, -100, count));
  const std::vector<double> x = Values(logits);
  double total = 0;
  std::vector<double> ref(n * v, 0.0);
  for (int64_t i = 0; i < n; ++i) {
    if (t[i] < 0) continue;
    const double l = LogSumExp(&x[i * v], v);
    total += l - x[i * v + t[i]];
    for (int64_t j = 0; j < v; ++j) ref[i * v + j] = 0.5 / 10.0 * (std::exp(x[i * v + j] - l) - (j == t[i] ? 1 : 0));
  }
  testing::ExpectNear(Values(f.loss), {total / 10.0}, {1e-6, 1e-6}, "loss / given count");
  EXPECT_EQ(Values(f.count), std::vector<double>{10.0});
  testing::ExpectNear(Values(f.dlogits), ref, {1e-5, 1e-7}, "dlogits / given count");
}

TEST(CpuCrossEntropyTest, WithGradRejectsBadArguments) {
  const Tensor logits = testing::Random({3, 4}, DType::kFloat32, 13);
  const Tensor targets = Targets({0, 1, 2}, {3}, DType::kInt64);
  const Tensor one = testing::FromDoubles({1.0}, {}, DType::kFloat32);
  const Tensor two = testing::FromDoubles({1.0, 2.0}, {2}, DType::kFloat32);
  auto bad_dloss = CrossEntropyWithGrad(logits, targets, two);
  ASSERT_FALSE(bad_dloss.ok());
  EXPECT_NE(bad_dloss.status().message().find("dloss must be a float32 scalar"), std::string::npos)
      << bad_dloss.status();
  auto bad_count = CrossEntropyWithGrad(logits, targets, one, -100, two);
  ASSERT_FALSE(bad_count.ok());
  EXPECT_NE(bad_count.status().message().find("count must be a float32 scalar"), std::string::npos)
      << bad_count.status();
  auto bad_target = CrossEntropyWithGrad(logits, Targets({0, 9, 2}, {3}, DType::kInt64), one);
  ASSERT_FALSE(bad_target.ok());
  EXPECT_NE(bad_target.status().message().find("target 9 at row 1"), std::string::npos) << bad_target.status();
}

TEST(CpuCrossEntropyTest, CountTargets) {
  for (DType td : {DType::kInt32, DType::kInt64}) {
    const Tensor t = Targets({3, -100, 0, 2, -100, 1, 4}, {7}, td);
    EXPECT_EQ(Values(Unwrap(CountTargets(t, 5))), std::vector<double>{5.0});
    EXPECT_EQ(Values(Unwrap(CountTargets(Targets({3, 0, 2, 0, 1}, {5}, td), 5, 0))), std::vector<double>{3.0});
    auto bad = CountTargets(t, 5, 0);  // -100 is no longer ignored, and outside [0, 5)
    ASSERT_FALSE(bad.ok());
    EXPECT_NE(bad.status().message().find("target -100 at row 1"), std::string::npos) << bad.status();
  }
}

TEST(CpuCrossEntropyTest, ScaleByRatio) {
  for (DType d : kFloatTypes) {
    const Tensor x = testing::Random({5, 7}, d, 14, -2.0, 2.0);
    const std::vector<double> before = Values(x);
    // num == den: not touched, even where the ratio would be NaN (0 / 0).
    const Tensor zero = testing::FromDoubles({0.0}, {}, DType::kFloat32);
    ASSERT_TRUE(ScaleByRatio_(x, zero, zero).ok());
    EXPECT_EQ(Values(x), before) << DTypeName(d);
    const Tensor num = testing::FromDoubles({3.0}, {}, DType::kFloat32);
    const Tensor den = testing::FromDoubles({4.0}, {}, DType::kFloat32);
    ASSERT_TRUE(ScaleByRatio_(x, num, den).ok());
    std::vector<double> want;
    for (double v : before) want.push_back(0.75 * v);
    const double tol = d == DType::kFloat32 ? 1e-7 : 8e-3;
    testing::ExpectNear(Values(x), want, {tol, 1e-7}, std::string("x * 3/4 ") + DTypeName(d));
  }
  const Tensor x = testing::Random({4}, DType::kFloat32, 15);
  const Tensor one = testing::FromDoubles({1.0}, {}, DType::kFloat32);
  EXPECT_FALSE(ScaleByRatio_(x, x, one).ok());
  EXPECT_FALSE(ScaleByRatio_(Unwrap(x.Slice(0, 0, 4, 2)), one, one).ok()) << "x must be contiguous";
}

}  // namespace
}  // namespace dtensor
