// Elementwise ops on the CPU backend against float64 references: broadcasting, odd and
// non-contiguous shapes, bf16/f16 tolerances, exact integer arithmetic, and backward kernels
// against central finite differences.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numbers>
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

double RefBinary(BinaryOp op, double a, double b) {
  switch (op) {
    case BinaryOp::kAdd:
      return a + b;
    case BinaryOp::kSub:
      return a - b;
    case BinaryOp::kMul:
      return a * b;
    case BinaryOp::kDiv:
      return a / b;
    case BinaryOp::kMax:
      return (std::isnan(a) || std::isnan(b)) ? std::nan("") : std::max(a, b);
    case BinaryOp::kMin:
      return (std::isnan(a) || std::isnan(b)) ? std::nan("") : std::min(a, b);
  }
  return 0;
}

int64_t RefIntBinary(BinaryOp op, int64_t a, int64_t b) {
  switch (op) {
    case BinaryOp::kAdd:
      return a + b;
    case BinaryOp::kSub:
      return a - b;
    case BinaryOp::kMul:
      return a * b;
    case BinaryOp::kDiv:
      return b == 0 ? 0 : a / b;  // C++ truncates toward zero
    case BinaryOp::kMax:
      return std::max(a, b);
    case BinaryOp::kMin:
      return std::min(a, b);
  }
  return 0;
}

double RefUnary(UnaryOp op, double x) {
  switch (op) {
    case UnaryOp::kNeg:
      return -x;
    case UnaryOp::kExp:
      return std::exp(x);
    case UnaryOp::kLog:
      return std::log(x);
    case UnaryOp::kSqrt:
      return std::sqrt(x);
    case UnaryOp::kRsqrt:
      return 1.0 / std::sqrt(x);
    case UnaryOp::kRelu:
      return x > 0 ? x : 0.0;
    case UnaryOp::kGelu:
      return 0.5 * x * (1.0 + std::tanh(std::sqrt(2.0 / std::numbers::pi) * (x + 0.044715 * x * x * x)));
    case UnaryOp::kTanh:
      return std::tanh(x);
    case UnaryOp::kAbs:
      return std::fabs(x);
    case UnaryOp::kSquare:
      return x * x;
  }
  return 0;
}

const char* Name(BinaryOp op) {
  const char* names[] = {"add", "sub", "mul", "div", "max", "min"};
  return names[static_cast<int>(op)];
}
const char* Name(UnaryOp op) {
  const char* names[] = {"neg", "exp", "log", "sqrt", "rsqrt", "relu", "gelu", "tanh", "abs", "square"};
  return names[static_cast<int>(op)];
}

constexpr BinaryOp kBinaryOps[] = {BinaryOp::kAdd, BinaryOp::kSub, BinaryOp::kMul,
                                   BinaryOp::kDiv, BinaryOp::kMax, BinaryOp::kMin};

// Linear index into a tensor of `in` shape broadcast (NumPy rules) to `out` shape.
int64_t BroadcastIndex(IntSpan out, IntSpan in, int64_t linear) {
  int64_t idx = 0, stride = 1;
  const int64_t off = static_cast<int64_t>(out.size() - in.size());
  for (int64_t d = static_cast<int64_t>(out.size()) - 1; d >= 0; --d) {
    const int64_t c = linear % out[d];
    linear /= out[d];
    if (d >= off) {
      const int64_t s = in[d - off];
      if (s != 1) idx += c * stride;
      stride *= s;
    }
  }
  return idx;
}

std::string Describe(DType d, IntSpan a, IntSpan b, const char* op, bool nc) {
  return std::string(op) + " " + std::string(DTypeName(d)) + " " + ShapeString(a) + " x " + ShapeString(b) +
         (nc ? " (non-contiguous)" : "");
}

TEST(CpuElementwiseTest, BinaryBroadcastFloatTypes) {
  const std::vector<std::pair<Shape, Shape>> shapes = {{{3, 1, 17}, {5, 1}},  {{127}, {127}},   {{1}, {4, 33}},
                                                       {{2, 3, 4}, {}},       {{6, 1}, {1, 7}}, {{300, 200}, {200}},
                                                       {{257, 130}, {257, 1}}};
  for (DType d : kFloatTypes) {
    for (const auto& [sa, sb] : shapes) {
      for (bool nc : {false, true}) {
        Tensor a = testing::Random(sa, d, 1, -2.0, 2.0);
        Tensor b = testing::Random(sb, d, 2, 0.5, 2.0);  // away from 0 for kDiv
        const std::vector<double> va = testing::Values(a), vb = testing::Values(b);
        if (nc) {
          a = testing::NonContiguous(a);
          b = testing::NonContiguous(b);
        }
        const Shape so = Unwrap(BroadcastShapes("test", sa, sb));
        for (BinaryOp op : kBinaryOps) {
          const Tensor out = Unwrap(Binary(op, a, b));
          ASSERT_EQ(out.shape(), IntSpan(so));
          std::vector<double> ref(static_cast<size_t>(NumElements(so)));
          for (int64_t i = 0; i < static_cast<int64_t>(ref.size()); ++i) {
            ref[i] = RefBinary(op, va[BroadcastIndex(so, sa, i)], vb[BroadcastIndex(so, sb, i)]);
          }
          testing::ExpectNear(testing::Values(out), ref, testing::Tol(d), Describe(d, sa, sb, Name(op), nc));
        }
      }
    }
  }
}

TEST(CpuElementwiseTest, MaximumMinimumPropagateNaN) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (DType d : kFloatTypes) {
    const Tensor a =
        Unwrap(Cast(Unwrap(Tensor::FromVector<float>(std::vector<float>{nan, 1.0f, 2.0f, nan, -0.5f}, {5})), d));
    const Tensor b =
        Unwrap(Cast(Unwrap(Tensor::FromVector<float>(std::vector<float>{0.0f, nan, 1.0f, nan, -0.25f}, {5})), d));
    const std::vector<double> mx = testing::Values(Unwrap(Maximum(a, b)));
    const std::vector<double> mn = testing::Values(Unwrap(Minimum(a, b)));
    for (int i : {0, 1, 3}) {
      EXPECT_TRUE(std::isnan(mx[i])) << i;
      EXPECT_TRUE(std::isnan(mn[i])) << i;
    }
    EXPECT_EQ(mx[2], 2.0);
    EXPECT_EQ(mn[2], 1.0);
    EXPECT_EQ(mx[4], -0.25);
    EXPECT_EQ(mn[4], -0.5);
    const std::vector<double> ms = testing::Values(Unwrap(BinaryScalar(BinaryOp::kMax, a, 1.5)));
    EXPECT_TRUE(std::isnan(ms[0]));
    EXPECT_EQ(ms[2], 2.0);
    EXPECT_EQ(ms[4], 1.5);
  }
}

template <typename I>
void CheckIntBinary() {
  const DType d = DTypeOf<I>::value;
  std::vector<I> av, bv;
  for (int i = 0; i < 37; ++i) {
    av.push_back(static_cast<I>((i * 7919) % 201 - 100));
    bv.push_back(static_cast<I>((i * 104729) % 23 - 11));  // includes 0 and negatives
  }
  const Tensor a = Unwrap(Tensor::FromVector<I>(av, {37}));
  const Tensor b = Unwrap(Tensor::FromVector<I>(bv, {37}));
  const Tensor b_nc = testing::NonContiguous(b);
  for (BinaryOp op : kBinaryOps) {
    const std::vector<int64_t> out = Unwrap(ToInt64Vector(Unwrap(Binary(op, a, b_nc))));
    for (int i = 0; i < 37; ++i) {
      EXPECT_EQ(out[i], RefIntBinary(op, av[i], bv[i]))
          << DTypeName(d) << " " << Name(op) << " " << av[i] << ", " << bv[i];
    }
  }
  // Broadcast a row against a column.
  const Tensor row = Unwrap(a.View({1, 37}));
  const Tensor col = Unwrap(Unwrap(Tensor::FromVector<I>(std::vector<I>{3, -4, 0}, {3})).View({3, 1}));
  const std::vector<int64_t> prod = Unwrap(ToInt64Vector(Unwrap(Mul(row, col))));
  const std::vector<int64_t> quot = Unwrap(ToInt64Vector(Unwrap(Div(row, col))));
  const int64_t cv[] = {3, -4, 0};
  for (int r = 0; r < 3; ++r) {
    for (int c = 0; c < 37; ++c) {
      EXPECT_EQ(prod[r * 37 + c], av[c] * cv[r]);
      EXPECT_EQ(quot[r * 37 + c], cv[r] == 0 ? 0 : av[c] / cv[r]);
    }
  }
  // Overflow wraps (two's complement); min / -1 wraps too instead of trapping.
  const I mx = std::numeric_limits<I>::max(), mn = std::numeric_limits<I>::min();
  const Tensor edge = Unwrap(Tensor::FromVector<I>(std::vector<I>{mx, mn}, {2}));
  const Tensor one = Unwrap(Tensor::FromVector<I>(std::vector<I>{1, -1}, {2}));
  const Tensor sum = Unwrap(Add(edge, one));
  EXPECT_EQ(sum.data<I>()[0], mn);
  EXPECT_EQ(sum.data<I>()[1], mx);
  const Tensor q = Unwrap(Div(edge, Unwrap(Tensor::FromVector<I>(std::vector<I>{-1, -1}, {2}))));
  EXPECT_EQ(q.data<I>()[0], -mx);
  EXPECT_EQ(q.data<I>()[1], mn);
}

TEST(CpuElementwiseTest, IntegerBinaryIsExact) {
  CheckIntBinary<int32_t>();
  CheckIntBinary<int64_t>();
}

TEST(CpuElementwiseTest, BinaryScalarBothOrders) {
  for (DType d : kFloatTypes) {
    Tensor a = testing::NonContiguous(testing::Random({4, 19}, d, 9, 0.5, 3.0));
    const std::vector<double> va = testing::Values(a);
    for (BinaryOp op : kBinaryOps) {
      for (bool first : {false, true}) {
        const double s = 0.75;
        const std::vector<double> got = testing::Values(Unwrap(BinaryScalar(op, a, s, first)));
        std::vector<double> ref;
        for (double x : va) ref.push_back(first ? RefBinary(op, s, x) : RefBinary(op, x, s));
        testing::ExpectNear(
            got, ref, testing::Tol(d),
            std::string(Name(op)) + " scalar " + (first ? "first " : "second ") + std::string(DTypeName(d)));
      }
    }
  }
  // Integers: integral scalars are exact; fractional ones compute in double and truncate.
  const std::vector<int64_t> iv = {-7, -1, 0, 3, 10, 1000000007};
  for (DType d : {DType::kInt32, DType::kInt64}) {
    const Tensor a = Unwrap(Cast(Unwrap(Tensor::FromVector<int64_t>(iv, {6})), d));
    const std::vector<int64_t> div = Unwrap(ToInt64Vector(Unwrap(BinaryScalar(BinaryOp::kDiv, a, 2.0))));
    const std::vector<int64_t> rdiv = Unwrap(ToInt64Vector(Unwrap(BinaryScalar(BinaryOp::kDiv, a, 20.0, true))));
    const std::vector<int64_t> sub = Unwrap(ToInt64Vector(Unwrap(BinaryScalar(BinaryOp::kSub, a, 5.0, true))));
    const std::vector<int64_t> half = Unwrap(ToInt64Vector(Unwrap(Scale(a, 0.5))));
    const std::vector<int64_t> mx = Unwrap(ToInt64Vector(Unwrap(BinaryScalar(BinaryOp::kMax, a, 2.0))));
    for (size_t i = 0; i < iv.size(); ++i) {
      EXPECT_EQ(div[i], iv[i] / 2);
      EXPECT_EQ(rdiv[i], iv[i] == 0 ? 0 : 20 / iv[i]);
      EXPECT_EQ(sub[i], 5 - iv[i]);
      EXPECT_EQ(half[i], static_cast<int64_t>(std::trunc(static_cast<double>(iv[i]) * 0.5)));
      EXPECT_EQ(mx[i], std::max<int64_t>(iv[i], 2));
    }
  }
}

TEST(CpuElementwiseTest, InPlaceAddAndScale) {
  for (DType d : kFloatTypes) {
    const Tensor a = Unwrap(Clone(testing::Random({33, 65}, d, 4)));
    const Tensor b = testing::Random({65}, d, 5);
    const std::vector<double> va = testing::Values(a), vb = testing::Values(b);
    ASSERT_TRUE(Add_(a, b).ok());
    ASSERT_TRUE(Scale_(a, -3.0).ok());
    std::vector<double> ref;
    for (size_t i = 0; i < va.size(); ++i) ref.push_back(-3.0 * (va[i] + vb[i % 65]));
    // Two roundings (after the add and after the scale) for 16-bit types.
    testing::Tolerance tol = testing::Tol(d);
    tol.rtol *= 2;
    tol.atol *= 2;
    testing::ExpectNear(testing::Values(a), ref, tol, "Add_ then Scale_ " + std::string(DTypeName(d)));
  }
}

constexpr UnaryOp kUnaryOps[] = {UnaryOp::kNeg,  UnaryOp::kExp,  UnaryOp::kLog,  UnaryOp::kSqrt, UnaryOp::kRsqrt,
                                 UnaryOp::kRelu, UnaryOp::kGelu, UnaryOp::kTanh, UnaryOp::kAbs,  UnaryOp::kSquare};

bool PositiveDomain(UnaryOp op) { return op == UnaryOp::kLog || op == UnaryOp::kSqrt || op == UnaryOp::kRsqrt; }

TEST(CpuElementwiseTest, UnaryFloatTypes) {
  for (DType d : kFloatTypes) {
    for (const Shape& shape : {Shape{1}, Shape{3, 17}, Shape{2, 5, 13}, Shape{211, 201}}) {
      for (bool nc : {false, true}) {
        for (UnaryOp op : kUnaryOps) {
          Tensor x =
              PositiveDomain(op) ? testing::Random(shape, d, 21, 0.1, 4.0) : testing::Random(shape, d, 21, -4.0, 4.0);
          const std::vector<double> vx = testing::Values(x);
          if (nc) x = testing::NonContiguous(x);
          const Tensor y = Unwrap(Unary(op, x));
          std::vector<double> ref;
          for (double v : vx) ref.push_back(RefUnary(op, v));
          testing::ExpectNear(
              testing::Values(y), ref, testing::Tol(d),
              std::string(Name(op)) + " " + std::string(DTypeName(d)) + " " + ShapeString(shape) + (nc ? " nc" : ""));
        }
      }
    }
  }
}

// The CPU backend evaluates exp and tanh with its own vectorized polynomials; they must stay
// within a few ulp of the float64 functions over the whole useful range.
TEST(CpuElementwiseTest, Float32ExpAndTanhWithinFewUlp) {
  const int64_t n = 400001;
  std::vector<double> xe(static_cast<size_t>(n)), xt(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    xe[i] = -87.0 + 175.7 * static_cast<double>(i) / static_cast<double>(n - 1);  // e^x normal and finite
    xt[i] = -12.0 + 24.0 * static_cast<double>(i) / static_cast<double>(n - 1);
  }
  const Tensor te = testing::FromDoubles(xe, {n}, DType::kFloat32);
  const Tensor tt = testing::FromDoubles(xt, {n}, DType::kFloat32);
  const std::vector<double> ve = testing::Values(te), vt = testing::Values(tt);  // rounded inputs
  std::vector<double> re, rt;
  for (double v : ve) re.push_back(std::exp(v));
  for (double v : vt) rt.push_back(std::tanh(v));
  const testing::Tolerance three_ulp = {3.6e-7, 1e-37};
  testing::ExpectNear(testing::Values(Unwrap(Exp(te))), re, three_ulp, "exp");
  testing::ExpectNear(testing::Values(Unwrap(Tanh(tt))), rt, three_ulp, "tanh");
}

// Float64 gelu (tanh approximation) and its derivative in the sigmoid form 0.5 (1 + tanh(u)) =
// 1 / (1 + e^{-2u}), accurate in the left tail where 1 + tanh(u) cancels.
double RefGeluTail(double x) {
  const double u = std::sqrt(2.0 / std::numbers::pi) * (x + 0.044715 * x * x * x);
  return x / (1.0 + std::exp(-2.0 * u));
}
// gelu'(x) = s + x r with s the sigmoid; *scale = |s| + |x r|, the size of the terms (gelu'
// crosses zero near x = -0.75, so its error is measured against the terms it sums).
double RefGeluGrad(double x, double* scale) {
  const double k = std::sqrt(2.0 / std::numbers::pi), c = 0.044715;
  const double e = std::exp(-2.0 * k * (x + c * x * x * x));
  const double s = 1.0 / (1.0 + e);
  const double xr = 2.0 * x * s * (e * s) * k * (1.0 + 3.0 * c * x * x);
  *scale = s + std::fabs(xr);
  return s + xr;
}

// Dense float32 sweep of gelu and its derivative over [-10, 10] against float64. The kernel
// computes the exponent argument t = 2 sqrt(2/pi) (x + 0.044715 x^3) in float, whose rounding
// (a few ulp of t) is amplified by |t| in e^t: the bound is 4 ulp plus |t| * 3 ulp relative,
// which is 4 ulp near 0 and for all x > 0 (where the sigmoid saturates).
TEST(CpuElementwiseTest, GeluFloat32DenseSweep) {
  const int64_t n = 400001;
  std::vector<double> xs(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) xs[i] = -10.0 + 20.0 * static_cast<double>(i) / static_cast<double>(n - 1);
  const Tensor x = testing::FromDoubles(xs, {n}, DType::kFloat32);
  const Tensor dy = Unwrap(Ones({n}, DType::kFloat32));
  const std::vector<double> xr = testing::Values(x);
  const std::vector<double> y = testing::Values(Unwrap(Gelu(x)));
  const std::vector<double> g = testing::Values(Unwrap(UnaryBackward(UnaryOp::kGelu, dy, x)));
  const double ulp = std::ldexp(1.0, -24);
  double worst_y = 0, worst_g = 0, worst_pos = 0;
  int bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double v = xr[i];
    const double t = std::fabs(2.0 * std::sqrt(2.0 / std::numbers::pi) * (v + 0.044715 * v * v * v));
    double scale = 0;
    const double ry = RefGeluTail(v), rg = RefGeluGrad(v, &scale);
    const double ey = std::fabs(y[i] - ry) / (std::fabs(ry) * ulp + 1e-45);
    const double eg = std::fabs(g[i] - rg) / (scale * ulp + 1e-45);
    // Where gelu is below 1e-30 (x < -9.2) it may be flushed towards zero.
    if (std::fabs(ry) < 1e-30) {
      bad += std::fabs(y[i]) > 1e-30;
      continue;
    }
    const double bound = 4.0 + 3.0 * t;
    bad += (ey > bound) + (eg > bound + 4.0);
    worst_y = std::max(worst_y, ey / bound);
    worst_g = std::max(worst_g, eg / (bound + 4.0));
    if (v >= 0) worst_pos = std::max(worst_pos, ey);
  }
  EXPECT_EQ(bad, 0) << "worst gelu error / bound " << worst_y << ", gelu' " << worst_g;
  EXPECT_LE(worst_pos, 4.0) << "gelu ulp error for x >= 0";
}

TEST(CpuElementwiseTest, GeluLargeAndSpecialInputs) {
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<float> xv = {inf, -inf, std::nanf(""), 1e30f, -1e30f, 3e38f, -3e38f, 11.0f, -11.0f, 0.0f, -0.0f};
  const Tensor x = Unwrap(Tensor::FromVector<float>(xv, {static_cast<int64_t>(xv.size())}));
  const std::vector<double> y = testing::Values(Unwrap(Gelu(x)));
  EXPECT_EQ(y[0], INFINITY);
  EXPECT_EQ(y[1], 0.0);
  EXPECT_TRUE(std::isnan(y[2]));
  EXPECT_EQ(y[3], 1e30f);
  EXPECT_EQ(y[4], 0.0);
  EXPECT_EQ(y[5], 3e38f);
  EXPECT_EQ(y[6], 0.0);
  EXPECT_EQ(y[7], 11.0);
  EXPECT_EQ(y[8], 0.0);
  EXPECT_EQ(y[9], 0.0);
  EXPECT_EQ(y[10], 0.0);
  const Tensor dy = Unwrap(Ones({static_cast<int64_t>(xv.size())}, DType::kFloat32));
  const std::vector<double> g = testing::Values(Unwrap(UnaryBackward(UnaryOp::kGelu, dy, x)));
  EXPECT_EQ(g[0], 1.0);
  EXPECT_EQ(g[1], 0.0);
  EXPECT_TRUE(std::isnan(g[2]));
  EXPECT_EQ(g[3], 1.0);
  EXPECT_EQ(g[4], 0.0);
  EXPECT_EQ(g[5], 1.0);
  EXPECT_EQ(g[6], 0.0);
  EXPECT_EQ(g[7], 1.0);
  EXPECT_EQ(g[8], 0.0);
  EXPECT_EQ(g[9], 0.5);
}

// bfloat16 / float16 exp, log, tanh and gelu on every one of the 65536 inputs (the CPU backend
// answers large 16-bit inputs from a lookup table) equal the float32 op rounded to the 16-bit
// type, contiguous and strided.
TEST(CpuElementwiseTest, SixteenBitUnaryMatchesFloat32Rounded) {
  for (DType d : {DType::kBFloat16, DType::kFloat16}) {
    std::vector<uint16_t> bits(65536);
    for (uint32_t b = 0; b < 65536; ++b) bits[b] = static_cast<uint16_t>(b);
    Tensor x = Unwrap(Tensor::Empty({65536}, d));
    std::memcpy(x.raw_data(), bits.data(), bits.size() * sizeof(uint16_t));
    const Tensor x32 = Unwrap(Cast(x, DType::kFloat32));
    for (UnaryOp op : {UnaryOp::kExp, UnaryOp::kLog, UnaryOp::kTanh, UnaryOp::kGelu}) {
      const Tensor want = Unwrap(Cast(Unwrap(Unary(op, x32)), d));
      for (bool strided : {false, true}) {
        const Tensor in = strided ? testing::NonContiguous(x) : x;
        const Tensor got = Unwrap(Contiguous(Unwrap(Unary(op, in))));
        const auto* w = static_cast<const uint16_t*>(want.raw_data());
        const auto* g = static_cast<const uint16_t*>(got.raw_data());
        const std::vector<double> wv = testing::Values(want), gv = testing::Values(got);
        int mismatches = 0, first = -1;
        for (int i = 0; i < 65536; ++i) {
          const bool same = w[i] == g[i] || (std::isnan(wv[i]) && std::isnan(gv[i]));
          if (!same && first < 0) first = i;
          mismatches += !same;
        }
        EXPECT_EQ(mismatches, 0) << DTypeName(d) << " " << Name(op) << (strided ? " strided" : "") << " first at bits "
                                 << first;
      }
    }
  }
}

TEST(CpuElementwiseTest, UnarySpecialValues) {
  const float inf = std::numeric_limits<float>::infinity();
  const Tensor x = Unwrap(Tensor::FromVector<float>(std::vector<float>{0.0f, -1.0f, 100.0f, -inf, inf}, {5}));
  const std::vector<double> lg = testing::Values(Unwrap(Log(x)));
  EXPECT_EQ(lg[0], -INFINITY);
  EXPECT_TRUE(std::isnan(lg[1]));
  const std::vector<double> ex = testing::Values(Unwrap(Exp(x)));
  EXPECT_EQ(ex[2], INFINITY);
  EXPECT_EQ(ex[3], 0.0);
  // Gelu saturates: x for large x, (-)0 for very negative x (the tanh formula gives NaN at
  // -inf itself, as PyTorch's).
  const std::vector<double> ge =
      testing::Values(Unwrap(Gelu(Unwrap(Tensor::FromVector<float>(std::vector<float>{100.0f, -100.0f}, {2})))));
  EXPECT_EQ(ge[0], 100.0);
  EXPECT_EQ(ge[1], 0.0);
  const std::vector<double> th = testing::Values(Unwrap(Tanh(x)));
  EXPECT_EQ(th[3], -1.0);
  EXPECT_EQ(th[4], 1.0);
  const Tensor n = Unwrap(Tensor::FromVector<float>(std::vector<float>{std::nanf("")}, {1}));
  EXPECT_TRUE(std::isnan(testing::Values(Unwrap(Relu(n)))[0]));
}

TEST(CpuElementwiseTest, IntegerUnary) {
  const std::vector<int64_t> v = {-5, -1, 0, 1, 7, 40000};
  for (DType d : {DType::kInt32, DType::kInt64}) {
    const Tensor x = testing::NonContiguous(Unwrap(Cast(Unwrap(Tensor::FromVector<int64_t>(v, {2, 3})), d)));
    const std::vector<int64_t> neg = Unwrap(ToInt64Vector(Unwrap(Neg(x))));
    const std::vector<int64_t> ab = Unwrap(ToInt64Vector(Unwrap(Unary(UnaryOp::kAbs, x))));
    const std::vector<int64_t> sq = Unwrap(ToInt64Vector(Unwrap(Unary(UnaryOp::kSquare, x))));
    const std::vector<int64_t> re = Unwrap(ToInt64Vector(Unwrap(Relu(x))));
    for (size_t i = 0; i < v.size(); ++i) {
      EXPECT_EQ(neg[i], -v[i]);
      EXPECT_EQ(ab[i], std::abs(v[i]));
      EXPECT_EQ(sq[i], d == DType::kInt32 ? static_cast<int32_t>(static_cast<uint32_t>(v[i] * v[i])) : v[i] * v[i]);
      EXPECT_EQ(re[i], std::max<int64_t>(v[i], 0));
    }
  }
  // Ops without an integer meaning are rejected by the kernel too.
  const Tensor i = Unwrap(Tensor::FromVector<int32_t>(std::vector<int32_t>{1, 2}, {2}));
  Tensor o = Unwrap(Tensor::Empty({2}, DType::kInt32));
  EXPECT_FALSE(CpuKernels()->Unary(UnaryOp::kExp, i, o).ok());
}

// ---- Backward against central finite differences of the float64 forward ----

constexpr UnaryOp kBackwardOps[] = {UnaryOp::kGelu, UnaryOp::kRelu, UnaryOp::kTanh,
                                    UnaryOp::kExp,  UnaryOp::kLog,  UnaryOp::kSqrt};

// Inputs for op's backward test, away from kinks (relu at 0) and domain edges.
std::vector<double> BackwardInputs(UnaryOp op, DType d, int64_t n, uint64_t seed) {
  std::vector<double> x = testing::Values(PositiveDomain(op) ? testing::Random({n}, d, seed, 0.2, 3.0)
                                                             : testing::Random({n}, d, seed, -3.0, 3.0));
  for (double& v : x) {
    if (op == UnaryOp::kRelu && std::fabs(v) < 0.05) v = 0.5;
  }
  return x;
}

TEST(CpuElementwiseTest, UnaryBackwardMatchesFiniteDifferences) {
  for (DType d : kFloatTypes) {
    for (UnaryOp op : kBackwardOps) {
      const int64_t n = 29;
      const std::vector<double> xv = BackwardInputs(op, d, n, 31);
      const Tensor x = testing::FromDoubles(xv, {n}, d);
      const Tensor dy = testing::Random({n}, d, 32, -1.5, 1.5);
      const std::vector<double> dyv = testing::Values(dy);
      const std::vector<double> xr = testing::Values(x);  // exactly the rounded inputs
      const auto loss = [&](const std::vector<double>& xs) {
        double s = 0;
        for (size_t i = 0; i < xs.size(); ++i) s += dyv[i] * RefUnary(op, xs[i]);
        return s;
      };
      const std::vector<double> fd = testing::FiniteDifference(loss, xr, 1e-6);
      const Tensor dx = Unwrap(UnaryBackward(op, dy, x));
      testing::Tolerance tol = testing::Tol(d);
      if (d == DType::kFloat32) tol = {1e-4, 1e-5};  // FD truncation/rounding error
      testing::ExpectNear(testing::Values(dx), fd, tol, std::string("d") + Name(op) + " " + std::string(DTypeName(d)));
    }
  }
}

TEST(CpuElementwiseTest, UnaryBackwardLargeAndKernelExtras) {
  // Above the parallel threshold; per-element central differences (the loss is separable).
  const int64_t n = 50021;
  for (UnaryOp op : kBackwardOps) {
    const std::vector<double> xv = BackwardInputs(op, DType::kFloat32, n, 41);
    const Tensor x = testing::FromDoubles(xv, {n}, DType::kFloat32);
    const Tensor dy = testing::Random({n}, DType::kFloat32, 42);
    const std::vector<double> xr = testing::Values(x), dyv = testing::Values(dy);
    std::vector<double> fd(static_cast<size_t>(n));
    const double h = 1e-6;
    for (int64_t i = 0; i < n; ++i) fd[i] = dyv[i] * (RefUnary(op, xr[i] + h) - RefUnary(op, xr[i] - h)) / (2 * h);
    testing::ExpectNear(testing::Values(Unwrap(UnaryBackward(op, dy, x))), fd, {1e-4, 1e-5},
                        std::string("large d") + Name(op));
  }
  // The CPU kernel also differentiates neg, abs, square and rsqrt.
  for (UnaryOp op : {UnaryOp::kNeg, UnaryOp::kAbs, UnaryOp::kSquare, UnaryOp::kRsqrt}) {
    const int64_t m = 17;
    const std::vector<double> xv = BackwardInputs(UnaryOp::kLog, DType::kFloat32, m, 50);  // positive
    std::vector<double> xs = xv;
    if (op != UnaryOp::kRsqrt) {
      for (size_t i = 0; i < xs.size(); i += 2) xs[i] = -xs[i];
    }
    const Tensor x = testing::FromDoubles(xs, {m}, DType::kFloat32);
    const Tensor dy = testing::Random({m}, DType::kFloat32, 51);
    Tensor dx = Unwrap(Tensor::Empty({m}, DType::kFloat32));
    ASSERT_TRUE(CpuKernels()->UnaryBackward(op, dy, x, dx).ok());
    const std::vector<double> xr = testing::Values(x), dyv = testing::Values(dy);
    const auto loss = [&](const std::vector<double>& v) {
      double s = 0;
      for (size_t i = 0; i < v.size(); ++i) s += dyv[i] * RefUnary(op, v[i]);
      return s;
    };
    testing::ExpectNear(testing::Values(dx), testing::FiniteDifference(loss, xr, 1e-6), {1e-4, 1e-5},
                        std::string("kernel d") + Name(op));
  }
}

}  // namespace
}  // namespace dtensor
