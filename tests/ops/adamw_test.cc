// Fused AdamW on the CPU backend against a float64 reference over several steps (PyTorch
// semantics: decoupled weight decay first, bias-corrected moments).
#include <omp.h>

#include <cmath>
#include <cstdint>
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

// x rounded to `dtype` (identity for float32, which the reference keeps in float64).
double RoundTo(DType dtype, double x) {
  switch (dtype) {
    case DType::kBFloat16:
      return static_cast<float>(BFloat16(static_cast<float>(x)));
    case DType::kFloat16:
      return static_cast<float>(Float16(static_cast<float>(x)));
    default:
      return x;
  }
}

struct RefState {
  std::vector<double> p, m, v;
};

// One AdamW step in float64; the parameter is rounded to its storage dtype afterwards.
void RefStep(RefState& s, const std::vector<double>& g, const AdamWParams& hp, DType param_dtype) {
  const double b1 = hp.beta1, b2 = hp.beta2;
  const double bc1 = 1.0 - std::pow(b1, static_cast<double>(hp.step));
  const double bc2 = 1.0 - std::pow(b2, static_cast<double>(hp.step));
  for (size_t i = 0; i < s.p.size(); ++i) {
    double p = s.p[i];
    p -= static_cast<double>(hp.lr) * hp.weight_decay * p;
    s.m[i] = b1 * s.m[i] + (1 - b1) * g[i];
    s.v[i] = b2 * s.v[i] + (1 - b2) * g[i] * g[i];
    const double mhat = s.m[i] / bc1, vhat = s.v[i] / bc2;
    p -= static_cast<double>(hp.lr) * mhat / (std::sqrt(vhat) + hp.eps);
    s.p[i] = RoundTo(param_dtype, p);
  }
}

// Runs `steps` steps on n parameters and compares param, m and v with the reference each step.
void RunSteps(DType param_dtype, DType grad_dtype, int64_t n, int steps, float weight_decay) {
  const std::string what = std::string("param ") + std::string(DTypeName(param_dtype)) + " grad " +
                           std::string(DTypeName(grad_dtype)) + " n " + std::to_string(n);
  const Tensor param = testing::Random({n}, param_dtype, 1, -2.0, 2.0);
  const Tensor m = Unwrap(Zeros({n}, DType::kFloat32));
  const Tensor v = Unwrap(Zeros({n}, DType::kFloat32));
  RefState ref{Values(param), std::vector<double>(n, 0.0), std::vector<double>(n, 0.0)};
  AdamWParams hp;
  hp.lr = 0.05f;
  hp.beta1 = 0.9f;
  hp.beta2 = 0.95f;
  hp.eps = 1e-8f;
  hp.weight_decay = weight_decay;
  for (int step = 1; step <= steps; ++step) {
    hp.step = step;
    // Gradients of mixed scale, some exactly zero (v stays 0 there at step 1).
    const Tensor grad = testing::Random({n}, grad_dtype, 100 + step, -1.0, 1.0);
    std::vector<double> gv = Values(grad);
    if (step == 1) {
      std::vector<double> zeroed = gv;
      for (size_t i = 0; i < zeroed.size(); i += 5) zeroed[i] = 0.0;
      gv = zeroed;
    }
    const Tensor g = testing::FromDoubles(gv, {n}, grad_dtype);
    // A bf16/f16 parameter rounds each step, and a rounding that lands one ulp away from the
    // reference (a near tie) carries into later steps as an absolute error: start each step of
    // the reference from the kernel's previous parameter so that every step is checked alone.
    if (param_dtype != DType::kFloat32) ref.p = Values(param);
    ASSERT_TRUE(AdamWStep_(param, g, m, v, hp).ok()) << what;
    RefStep(ref, Values(g), hp, param_dtype);
    const std::string at = what + " step " + std::to_string(step);
    // A bf16/f16 parameter may land one ulp away from the reference near a rounding tie.
    const testing::Tolerance ptol = param_dtype == DType::kFloat32    ? testing::Tolerance{2e-6, 2e-6}
                                    : param_dtype == DType::kBFloat16 ? testing::Tolerance{8e-3, 1e-6}
                                                                      : testing::Tolerance{1e-3, 1e-6};
    testing::ExpectNear(Values(param), ref.p, ptol, at + " param");
    testing::ExpectNear(Values(m), ref.m, {1e-5, 1e-7}, at + " m");
    testing::ExpectNear(Values(v), ref.v, {1e-5, 1e-8}, at + " v");
  }
}

TEST(CpuAdamWTest, Float32MatchesReferenceOverSteps) {
  for (int64_t n : {int64_t{1}, int64_t{3}, int64_t{17}, int64_t{127}})
    RunSteps(DType::kFloat32, DType::kFloat32, n, 5, 0.1f);
  RunSteps(DType::kFloat32, DType::kFloat32, 100003, 3, 0.01f);  // threaded
  RunSteps(DType::kFloat32, DType::kFloat32, 33, 4, 0.0f);       // no weight decay
}

TEST(CpuAdamWTest, HalfParamsWithFloat32State) {
  for (DType p : {DType::kBFloat16, DType::kFloat16}) {
    RunSteps(p, DType::kFloat32, 127, 5, 0.1f);  // float32 grads
    RunSteps(p, p, 127, 5, 0.1f);                // grads in the param's dtype
    RunSteps(p, p, 70001, 2, 0.1f);              // threaded
  }
}

TEST(CpuAdamWTest, FirstStepIsSignedLearningRate) {
  // Step 1 from zero state: mhat = g and vhat = g^2, so the update is lr * g / (|g| + eps).
  const Tensor p = testing::FromDoubles({1.0, 1.0, -3.0}, {3}, DType::kFloat32);
  const Tensor g = testing::FromDoubles({0.5, -4.0, 0.0}, {3}, DType::kFloat32);
  const Tensor m = Unwrap(Zeros({3}, DType::kFloat32));
  const Tensor v = Unwrap(Zeros({3}, DType::kFloat32));
  AdamWParams hp;
  hp.lr = 0.1f;
  hp.weight_decay = 0.5f;  // p *= 1 - 0.05 first
  hp.step = 1;
  ASSERT_TRUE(AdamWStep_(p, g, m, v, hp).ok());
  testing::ExpectNear(Values(p), {0.95 - 0.1, 0.95 + 0.1, -3.0 * 0.95}, {1e-6, 1e-6}, "first step");
}

// Gradients so large that v / (1 - beta2^t) overflows float32 (|g| > ~1.9e19 at step 1, v
// itself finite at 3e19) leave the parameter finite: the update goes to 0 (torch, which divides
// sqrt(v) by sqrt(1 - beta2^t), keeps it finite too); it was NaN. With eps = 0 a subnormal v
// (g = 1e-20) gives the signed learning rate within 1% (v itself is a 2-digit float32 subnormal;
// it was 68% off).
TEST(CpuAdamWTest, HugeAndSubnormalSecondMomentsStayExact) {
  const Tensor p = testing::FromDoubles({1.0, 1.0, 1.0}, {3}, DType::kFloat32);
  const Tensor g = testing::FromDoubles({3e19, 1e21, -1e-20}, {3}, DType::kFloat32);
  const Tensor m = Unwrap(Zeros({3}, DType::kFloat32));
  const Tensor v = Unwrap(Zeros({3}, DType::kFloat32));
  AdamWParams hp;
  hp.lr = 1e-3f;
  hp.eps = 0.0f;
  hp.step = 1;
  ASSERT_TRUE(AdamWStep_(p, g, m, v, hp).ok());
  const std::vector<double> got = Values(p);
  for (double x : got) EXPECT_TRUE(std::isfinite(x)) << x;
  EXPECT_GE(got[0], 0.999 - 1e-6);
  EXPECT_LE(got[0], 1.0);
  EXPECT_EQ(got[1], 1.0);
  EXPECT_NEAR(got[2], 1.0 + 1e-3, 1e-5);  // v = 1e-43 holds 2 digits in float32
}

// |g| > ~1.84e19 with v = (1 - beta2) g^2 still finite: sqrt(v) / sqrt(1 - beta2^t), as torch
// forms it, is finite, while v / (1 - beta2^t) would overflow (and the step be m / inf = 0).
TEST(CpuAdamWTest, HugeGradientsStillStep) {
  const Tensor p = testing::FromDoubles({1.0, 1.0, -2.0}, {3}, DType::kFloat32);
  const std::vector<double> gv = {1e19, 2e19, -1e20};
  const Tensor g = testing::FromDoubles(gv, {3}, DType::kFloat32);
  const Tensor m = Unwrap(Zeros({3}, DType::kFloat32));
  const Tensor v = Unwrap(Zeros({3}, DType::kFloat32));
  AdamWParams hp;
  hp.lr = 1e-3f;
  hp.step = 1;
  RefState ref{Values(p), {0, 0, 0}, {0, 0, 0}};
  RefStep(ref, Values(g), hp, DType::kFloat32);
  ASSERT_TRUE(AdamWStep_(p, g, m, v, hp).ok());
  testing::ExpectNear(Values(p), ref.p, {1e-6, 0}, "param");
}

TEST(CpuAdamWTest, KernelRejectsStepZero) {
  const Tensor p = Unwrap(Zeros({2}, DType::kFloat32));
  AdamWParams hp;
  hp.step = 0;
  const absl::Status s = CpuKernels()->AdamW(p, p, p, p, hp);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_EQ(AdamWStep_(p, p, Unwrap(Zeros({2}, DType::kFloat32)), Unwrap(Zeros({2}, DType::kFloat32)), hp).code(),
            absl::StatusCode::kInvalidArgument);
}

// An entry of random tensors (param, grad, m, v drawn from seed, seed + 1, ...; `seed` is
// advanced past them), and a copy of one sharing its grad (no grad_square_sum).
AdamWTensors RandomEntry(DType param, DType grad, int64_t n, int64_t step, uint64_t& seed) {
  return AdamWTensors{.param = testing::Random({n}, param, seed++),
                      .grad = testing::Random({n}, grad, seed++),
                      .m = testing::Random({n}, DType::kFloat32, seed++, -0.1, 0.1),
                      .v = testing::Random({n}, DType::kFloat32, seed++, 0.0, 0.01),
                      .step = step,
                      .grad_square_sum = Tensor()};
}
AdamWTensors CopyOf(const AdamWTensors& a) {
  return AdamWTensors{.param = Unwrap(Clone(a.param)),
                      .grad = a.grad,
                      .m = Unwrap(Clone(a.m)),
                      .v = Unwrap(Clone(a.v)),
                      .step = a.step,
                      .grad_square_sum = Tensor()};
}

// AdamWStepMulti_ over parameters of mixed dtypes, sizes (empty too) and step counts against
// AdamWStep_ on copies of the same tensors, one by one: bit for bit, since each entry is the same
// kernel with that entry's step.
TEST(CpuAdamWTest, MultiMatchesOneByOne) {
  struct Entry {
    DType param, grad;
    int64_t n, step;
  };
  const Entry entries[] = {{DType::kFloat32, DType::kFloat32, 33, 1},
                           {DType::kBFloat16, DType::kFloat32, 127, 4},
                           {DType::kFloat32, DType::kFloat32, 0, 2},
                           {DType::kFloat16, DType::kFloat16, 70001, 7},
                           {DType::kFloat32, DType::kFloat32, 5000, 3}};
  AdamWParams hp;
  hp.lr = 1e-2f;
  hp.weight_decay = 0.1f;
  hp.step = 99;  // not used by the multi-tensor form
  std::vector<AdamWTensors> multi, single;
  uint64_t seed = 1;
  for (const Entry& e : entries) {
    const AdamWTensors a = RandomEntry(e.param, e.grad, e.n, e.step, seed);
    multi.push_back(a);
    single.push_back(CopyOf(a));
  }
  ASSERT_TRUE(AdamWStepMulti_(multi, hp).ok());
  for (size_t i = 0; i < single.size(); ++i) {
    AdamWParams one = hp;
    one.step = single[i].step;
    ASSERT_TRUE(AdamWStep_(single[i].param, single[i].grad, single[i].m, single[i].v, one).ok());
    const std::string what = "entry " + std::to_string(i);
    EXPECT_EQ(Values(multi[i].param), Values(single[i].param)) << what;
    EXPECT_EQ(Values(multi[i].m), Values(single[i].m)) << what;
    EXPECT_EQ(Values(multi[i].v), Values(single[i].v)) << what;
  }
  // The entries' own steps matter: the same tensors under another step give other values.
  AdamWParams other = hp;
  other.step = 1;
  const Tensor p = Unwrap(Clone(single[1].param));
  ASSERT_TRUE(AdamWStep_(p, single[1].grad, Unwrap(Clone(single[1].m)), Unwrap(Clone(single[1].v)), other).ok());
  EXPECT_NE(Values(p), Values(single[1].param));
}

TEST(CpuAdamWTest, MultiRefusesABadEntryAndUpdatesNothing) {
  const Tensor p0 = testing::Random({4}, DType::kFloat32, 1);
  const Tensor before = Unwrap(Clone(p0));
  const Tensor z4 = Unwrap(Zeros({4}, DType::kFloat32));
  std::vector<AdamWTensors> list = {
      {.param = p0, .grad = testing::Random({4}, DType::kFloat32, 2), .m = z4, .v = Unwrap(Clone(z4)), .step = 1},
      {.param = Unwrap(Zeros({5}, DType::kFloat32)),
       .grad = Unwrap(Zeros({4}, DType::kFloat32)),
       .m = Unwrap(Zeros({5}, DType::kFloat32)),
       .v = Unwrap(Zeros({5}, DType::kFloat32)),
       .step = 1}};
  const absl::Status s = AdamWStepMulti_(list, AdamWParams{});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("entry 1 of 2"), std::string::npos) << s;
  EXPECT_NE(s.message().find("[5]"), std::string::npos) << s;
  EXPECT_EQ(Values(p0), Values(before)) << "the valid entry must not move when another is refused";
  list[1].step = 0;
  list[1].grad = Unwrap(Zeros({5}, DType::kFloat32));
  const absl::Status z = AdamWStepMulti_(list, AdamWParams{});
  EXPECT_EQ(z.code(), absl::StatusCode::kInvalidArgument) << z;
  EXPECT_NE(z.message().find("step"), std::string::npos) << z;
}

// grad_square_sum: the gradient's sum of squares read in the update's own pass. The same bits
// as SumOfSquares (and within float32 rounding of a float64 loop), on 1 thread as on all, and
// the update itself unchanged, around and across the 64K-element chunks; an empty entry gets 0.
TEST(CpuAdamWTest, MultiSumsTheGradientsSquaresInTheSamePass) {
  struct Entry {
    DType param, grad;
    int64_t n;
  };
  const Entry entries[] = {{DType::kFloat32, DType::kFloat32, 7},      {DType::kFloat32, DType::kFloat32, 0},
                           {DType::kFloat32, DType::kFloat32, 65536},  {DType::kFloat32, DType::kFloat32, 65537},
                           {DType::kFloat32, DType::kFloat32, 200003}, {DType::kBFloat16, DType::kFloat32, 131075},
                           {DType::kFloat16, DType::kFloat16, 70001},  {DType::kBFloat16, DType::kBFloat16, 9}};
  AdamWParams hp;
  hp.lr = 1e-2f;
  hp.weight_decay = 0.1f;
  const int threads = omp_get_max_threads();
  struct RestoreThreads {
    int n;
    ~RestoreThreads() { omp_set_num_threads(n); }
  } restore{threads};  // also when an ASSERT returns early
  for (const int nthreads : {threads, 1}) {
    omp_set_num_threads(nthreads);
    std::vector<AdamWTensors> fused, plain;
    uint64_t seed = 100;
    for (const Entry& e : entries) {
      AdamWTensors a = RandomEntry(e.param, e.grad, e.n, /*step=*/3, seed);
      a.grad_square_sum = testing::Random({1}, DType::kFloat32, seed++);
      fused.push_back(a);
      plain.push_back(CopyOf(a));
    }
    ASSERT_TRUE(AdamWStepMulti_(fused, hp).ok());
    ASSERT_TRUE(AdamWStepMulti_(plain, hp).ok());
    for (size_t i = 0; i < fused.size(); ++i) {
      const std::string what = "entry " + std::to_string(i) + ", " + std::to_string(nthreads) + " thread(s)";
      EXPECT_EQ(Values(fused[i].param), Values(plain[i].param)) << what;
      EXPECT_EQ(Values(fused[i].m), Values(plain[i].m)) << what;
      EXPECT_EQ(Values(fused[i].v), Values(plain[i].v)) << what;
      const double got = Values(fused[i].grad_square_sum)[0];
      EXPECT_EQ(got, Values(Unwrap(SumOfSquares(fused[i].grad)))[0]) << what;
      double want = 0;
      for (double g : Values(fused[i].grad)) want += g * g;
      EXPECT_NEAR(got, want, 1e-6 * want) << what;
      if (entries[i].n == 0) {
        EXPECT_EQ(got, 0.0) << what;
      }
    }
  }
}

// A bad grad_square_sum in the second entry: refused with its dtype and shape named, and the
// valid first entry (param and its sum) untouched; through the ops layer and the backend.
TEST(CpuAdamWTest, MultiRefusesABadSquareSumAndUpdatesNothing) {
  const Tensor p0 = testing::Random({4}, DType::kFloat32, 1), p1 = testing::Random({4}, DType::kFloat32, 3);
  const Tensor before0 = Unwrap(Clone(p0)), before1 = Unwrap(Clone(p1));
  const Tensor sum0 = Unwrap(Full({1}, -1.0, DType::kFloat32));
  for (const Tensor& bad : {Unwrap(Zeros({1}, DType::kInt32)), Unwrap(Zeros({2}, DType::kFloat32))}) {
    auto entry = [](const Tensor& p, const Tensor& sum) {
      return AdamWTensors{.param = p,
                          .grad = testing::Random({4}, DType::kFloat32, 2),
                          .m = Unwrap(Zeros({4}, DType::kFloat32)),
                          .v = Unwrap(Zeros({4}, DType::kFloat32)),
                          .step = 1,
                          .grad_square_sum = sum};
    };
    const std::vector<AdamWTensors> list = {entry(p0, sum0), entry(p1, bad)};
    for (const bool backend : {false, true}) {
      const absl::Status s =
          backend ? CpuKernels()->AdamWMulti(list, AdamWParams{}) : AdamWStepMulti_(list, AdamWParams{});
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
      EXPECT_NE(s.message().find("grad_square_sum"), std::string::npos) << s;
      EXPECT_NE(s.message().find(ShapeString(bad.shape())), std::string::npos) << s;
      EXPECT_EQ(Values(p0), Values(before0)) << "the valid entry moved";
      EXPECT_EQ(Values(sum0)[0], -1.0) << "the valid entry's sum was written";
      EXPECT_EQ(Values(p1), Values(before1));
    }
  }
}

// grad_scale: the update reads the gradient times the factor (clipping, nn::AdamW::StepWithClip)
// and leaves the gradient as it is. Against plain entries whose float32 gradient is that
// product (AdamW takes a float32 gradient for any param dtype): bit for bit, for each param and
// grad dtype, entries sharing one factor, another factor, and none; grad_square_sum sums the
// gradient as stored. The base class's AdamWMulti (for backends without their own) gives the
// same bits.
TEST(CpuAdamWTest, MultiReadsTheGradientTimesItsScale) {
  struct Entry {
    DType param, grad;
    int64_t n;
    int scale;  // 0: none, 1 or 2: which factor
  };
  const Entry entries[] = {{DType::kFloat32, DType::kFloat32, 70001, 1}, {DType::kBFloat16, DType::kBFloat16, 131, 1},
                           {DType::kFloat16, DType::kFloat16, 257, 2},   {DType::kBFloat16, DType::kFloat32, 9, 2},
                           {DType::kFloat32, DType::kFloat32, 33, 0},    {DType::kFloat32, DType::kFloat32, 0, 1}};
  const Tensor factors[] = {Tensor(), Unwrap(Full({1}, 0.37, DType::kFloat32)),
                            Unwrap(Full({1}, 1e-3, DType::kFloat32))};
  AdamWParams hp;
  hp.lr = 1e-2f;
  hp.weight_decay = 0.1f;
  for (const bool base_class : {false, true}) {
    std::vector<AdamWTensors> scaled, plain;
    std::vector<std::vector<double>> grads_before;
    uint64_t seed = 300;
    for (const Entry& e : entries) {
      AdamWTensors a = RandomEntry(e.param, e.grad, e.n, /*step=*/2, seed);
      a.grad_scale = factors[e.scale];
      a.grad_square_sum = Unwrap(Full({1}, -1.0, DType::kFloat32));
      AdamWTensors b = CopyOf(a);
      b.grad = Unwrap(Cast(a.grad, DType::kFloat32));
      if (e.scale != 0) b.grad = Unwrap(Mul(b.grad, factors[e.scale]));
      grads_before.push_back(Values(a.grad));
      scaled.push_back(a);
      plain.push_back(b);
    }
    if (base_class) {
      ASSERT_TRUE(CpuKernels()->Kernels::AdamWMulti(scaled, hp).ok());
    } else {
      ASSERT_TRUE(AdamWStepMulti_(scaled, hp).ok());
    }
    ASSERT_TRUE(AdamWStepMulti_(plain, hp).ok());
    for (size_t i = 0; i < scaled.size(); ++i) {
      const std::string what = "entry " + std::to_string(i) + (base_class ? " (Kernels::AdamWMulti)" : "");
      EXPECT_EQ(Values(scaled[i].param), Values(plain[i].param)) << what;
      EXPECT_EQ(Values(scaled[i].m), Values(plain[i].m)) << what;
      EXPECT_EQ(Values(scaled[i].v), Values(plain[i].v)) << what;
      EXPECT_EQ(Values(scaled[i].grad), grads_before[i]) << what << ": the gradient was written";
      if (entries[i].n > 0) {
        EXPECT_EQ(Values(scaled[i].grad_square_sum)[0], Values(Unwrap(SumOfSquares(scaled[i].grad)))[0]) << what;
      }
    }
  }
  // The factor matters: the same entry without it moves otherwise.
  uint64_t seed = 300;
  AdamWTensors a = RandomEntry(DType::kFloat32, DType::kFloat32, 70001, 2, seed);
  AdamWTensors b = CopyOf(a);
  a.grad_scale = factors[1];
  ASSERT_TRUE(AdamWStepMulti_({a}, hp).ok());
  ASSERT_TRUE(AdamWStepMulti_({b}, hp).ok());
  EXPECT_NE(Values(a.m), Values(b.m));
}

// A bad grad_scale: refused with its dtype and shape named, nothing updated; through the ops
// layer and the backend.
TEST(CpuAdamWTest, MultiRefusesABadGradScaleAndUpdatesNothing) {
  const Tensor p0 = testing::Random({4}, DType::kFloat32, 1);
  const Tensor before = Unwrap(Clone(p0));
  for (const Tensor& bad : {Unwrap(Zeros({1}, DType::kBFloat16)), Unwrap(Zeros({2}, DType::kFloat32))}) {
    const std::vector<AdamWTensors> list = {{.param = p0,
                                             .grad = testing::Random({4}, DType::kFloat32, 2),
                                             .m = Unwrap(Zeros({4}, DType::kFloat32)),
                                             .v = Unwrap(Zeros({4}, DType::kFloat32)),
                                             .step = 1,
                                             .grad_square_sum = Tensor(),
                                             .grad_scale = bad}};
    for (const bool backend : {false, true}) {
      const absl::Status s =
          backend ? CpuKernels()->AdamWMulti(list, AdamWParams{}) : AdamWStepMulti_(list, AdamWParams{});
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
      EXPECT_NE(s.message().find("grad_scale"), std::string::npos) << s;
      EXPECT_NE(s.message().find(ShapeString(bad.shape())), std::string::npos) << s;
      EXPECT_EQ(Values(p0), Values(before)) << "refused, yet moved";
    }
  }
}

}  // namespace
}  // namespace dtensor
