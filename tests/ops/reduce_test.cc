// Reductions on the CPU backend against a float64 reference: every dim subset of odd shapes,
// keepdim, non-contiguous inputs, large rows and columns (split/partial paths), integers
// exact, NaN propagation and empty reductions.
#include <omp.h>

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

constexpr ReduceOp kOps[] = {ReduceOp::kSum, ReduceOp::kMean, ReduceOp::kMax, ReduceOp::kMin};

const char* Name(ReduceOp op) {
  const char* names[] = {"sum", "mean", "max", "min"};
  return names[static_cast<int>(op)];
}

struct RefResult {
  Shape shape;
  std::vector<double> values;
};

// Naive float64 reduction of row-major `x` of `shape` over `dims` (empty = all).
RefResult RefReduce(ReduceOp op, const std::vector<double>& x, IntSpan shape, std::vector<int64_t> dims, bool keepdim) {
  const int64_t nd = static_cast<int64_t>(shape.size());
  std::vector<bool> red(static_cast<size_t>(nd), dims.empty());
  for (int64_t d : dims) red[static_cast<size_t>(d < 0 ? d + nd : d)] = true;
  RefResult r;
  Shape kept;
  for (int64_t d = 0; d < nd; ++d) {
    if (!red[d]) kept.push_back(shape[d]);
    if (!red[d] || keepdim) r.shape.push_back(red[d] ? 1 : shape[d]);
  }
  const int64_t nout = NumElements(kept);
  const double init = op == ReduceOp::kMax ? -INFINITY : op == ReduceOp::kMin ? INFINITY : 0.0;
  r.values.assign(static_cast<size_t>(nout), init);
  std::vector<int64_t> count(static_cast<size_t>(nout), 0);
  std::vector<int64_t> idx(static_cast<size_t>(nd), 0);
  for (size_t i = 0; i < x.size(); ++i) {
    int64_t o = 0;
    for (int64_t d = 0; d < nd; ++d) {
      if (!red[d]) o = o * shape[d] + idx[d];
    }
    double& acc = r.values[o];
    const double v = x[i];
    if (op == ReduceOp::kMax) {
      acc = (std::isnan(v) || std::isnan(acc)) ? std::nan("") : std::max(acc, v);
    } else if (op == ReduceOp::kMin) {
      acc = (std::isnan(v) || std::isnan(acc)) ? std::nan("") : std::min(acc, v);
    } else {
      acc += v;
    }
    ++count[o];
    for (int64_t d = nd - 1; d >= 0; --d) {
      if (++idx[d] < shape[d]) break;
      idx[d] = 0;
    }
  }
  if (op == ReduceOp::kMean) {
    for (int64_t o = 0; o < nout; ++o) r.values[o] /= static_cast<double>(count[o]);
  }
  return r;
}

void CheckReduce(DType d, const Shape& shape, const std::vector<int64_t>& dims, bool keepdim, bool nc, uint64_t seed) {
  Tensor x = testing::Random(shape, d, seed, -1.0, 1.0);
  const std::vector<double> vx = testing::Values(x);
  if (nc) x = testing::NonContiguous(x);
  for (ReduceOp op : kOps) {
    const Tensor y = Unwrap(Reduce(op, x, dims, keepdim));
    const RefResult ref = RefReduce(op, vx, shape, dims, keepdim);
    const std::string what = std::string(Name(op)) + " " + std::string(DTypeName(d)) + " " + ShapeString(shape) +
                             " dims " + ShapeString(dims) + (keepdim ? " keepdim" : "") + (nc ? " nc" : "");
    EXPECT_EQ(y.shape(), IntSpan(ref.shape)) << what;
    testing::ExpectNear(testing::Values(y), ref.values, testing::Tol(d), what);
  }
}

TEST(CpuReduceTest, EveryDimSubsetOfOddShapes) {
  const std::vector<std::vector<int64_t>> dim_sets = {{}, {0}, {1}, {2}, {-1}, {0, 2}, {0, 1, 2}, {1, 2}, {0, 1}};
  for (DType d : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    for (const auto& dims : dim_sets) {
      for (bool keepdim : {false, true}) {
        CheckReduce(d, {3, 17, 5}, dims, keepdim, /*nc=*/false, 1);
      }
      CheckReduce(d, {4, 1, 9}, dims, false, /*nc=*/true, 2);
    }
    CheckReduce(d, {127}, {0}, false, false, 3);
    CheckReduce(d, {1}, {}, true, false, 4);
    CheckReduce(d, {}, {}, false, false, 5);
  }
}

TEST(CpuReduceTest, LargeRowsAndColumns) {
  struct Case {
    Shape shape;
    std::vector<int64_t> dims;
  };
  const Case cases[] = {
      {{1, 200003}, {1}},    // one long row: split into blocks, partials combined
      {{100003, 3}, {0}},    // long narrow columns: split reduce dim with inner > 1
      {{5, 40000, 7}, {1}},  // middle dim
      {{300, 301}, {0}},     // many column blocks
      {{300, 301}, {1}},     // many rows
      {{2, 70001}, {}},      // everything
  };
  for (DType d : {DType::kFloat32, DType::kBFloat16}) {
    for (const Case& c : cases) CheckReduce(d, c.shape, c.dims, false, false, 7);
  }
  CheckReduce(DType::kFloat32, {257, 263}, {0}, false, /*nc=*/true, 8);
}

TEST(CpuReduceTest, Float32SumAccumulatesInDouble) {
  // 2^24 + many ones: a float accumulator would stall at 2^24.
  const int64_t n = 100001;
  std::vector<float> v(static_cast<size_t>(n), 1.0f);
  v[0] = 16777216.0f;
  const Tensor x = Unwrap(Tensor::FromVector<float>(v, {n}));
  const double s = testing::Values(Unwrap(Sum(x)))[0];
  EXPECT_EQ(s, static_cast<double>(static_cast<float>(16777216.0 + (n - 1))));
}

// SumOfSquares (a gradient norm's piece): against float64 for every float dtype, sizes around
// its chunk (2^16 elements) and several chunks; a strided view; empty; the same bits on one
// thread and on all; the default kernel (square, then sum) within float32 rounding; an integer
// tensor is refused naming the op.
TEST(CpuReduceTest, SumOfSquaresMatchesFloat64) {
  for (DType d : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{65535}, int64_t{65536}, int64_t{65537}, int64_t{200003}}) {
      const Tensor x = testing::Random({n}, d, static_cast<uint64_t>(n));
      double want = 0;
      for (double v : testing::Values(x)) want += v * v;
      const Tensor got = Unwrap(SumOfSquares(x));
      ASSERT_EQ(got.dtype(), DType::kFloat32);
      ASSERT_EQ(got.numel(), 1);
      EXPECT_NEAR(testing::Values(got)[0], want, 1e-6 * want) << DTypeName(d) << " n " << n;
      // The unfused default (Mul into a temporary, Sum, cast): float32 squares.
      Tensor dflt = Unwrap(Tensor::Empty({1}, DType::kFloat32));
      ASSERT_TRUE(CpuKernels()->Kernels::SumOfSquares(x, dflt).ok());
      EXPECT_NEAR(testing::Values(dflt)[0], want, (d == DType::kFloat32 ? 1e-5 : 1e-2) * want) << DTypeName(d);
    }
  }
  const Tensor m = testing::Random({300, 517}, DType::kFloat32, 5);
  const Tensor mt = Unwrap(m.Transpose(0, 1));
  EXPECT_EQ(testing::Values(Unwrap(SumOfSquares(mt)))[0], testing::Values(Unwrap(SumOfSquares(m)))[0]);
  const Tensor big = testing::Random({1000003}, DType::kFloat32, 6);
  const int threads = omp_get_max_threads();
  const double all = testing::Values(Unwrap(SumOfSquares(big)))[0];
  omp_set_num_threads(1);
  const double one = testing::Values(Unwrap(SumOfSquares(big)))[0];
  omp_set_num_threads(threads);
  EXPECT_EQ(one, all);
  EXPECT_EQ(testing::Values(Unwrap(SumOfSquares(Unwrap(Tensor::Empty({0}, DType::kFloat32)))))[0], 0.0);
  const absl::StatusOr<Tensor> ints = SumOfSquares(Unwrap(Tensor::Empty({3}, DType::kInt32)));
  ASSERT_FALSE(ints.ok());
  EXPECT_NE(ints.status().message().find("SumOfSquares"), std::string::npos) << ints.status();
}

template <typename I>
void CheckIntReduce() {
  const DType d = DTypeOf<I>::value;
  const int64_t rows = 37, cols = 1001;
  std::vector<I> v;
  const int64_t scale = d == DType::kInt64 ? 1000000000000LL : 1000;
  for (int64_t i = 0; i < rows * cols; ++i) v.push_back(static_cast<I>(((i * 7919) % 2001 - 1000) * scale / 1000));
  const Tensor x = Unwrap(Tensor::FromVector<I>(v, {rows, cols}));
  for (int64_t dim : {0, 1}) {
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax, ReduceOp::kMin}) {
      const std::vector<int64_t> got = Unwrap(ToInt64Vector(Unwrap(Reduce(op, x, {dim}))));
      const int64_t nout = dim == 0 ? cols : rows, nred = dim == 0 ? rows : cols;
      ASSERT_EQ(static_cast<int64_t>(got.size()), nout);
      for (int64_t o = 0; o < nout; ++o) {
        int64_t acc = op == ReduceOp::kSum ? 0 : v[dim == 0 ? o : o * cols];
        for (int64_t r = 0; r < nred; ++r) {
          const int64_t e = v[dim == 0 ? r * cols + o : o * cols + r];
          acc = op == ReduceOp::kSum ? acc + e : op == ReduceOp::kMax ? std::max(acc, e) : std::min(acc, e);
        }
        ASSERT_EQ(got[o], acc) << DTypeName(d) << " " << Name(op) << " dim " << dim << " index " << o;
      }
    }
  }
}

TEST(CpuReduceTest, IntegersAreExact) {
  CheckIntReduce<int32_t>();
  CheckIntReduce<int64_t>();
  // The kernel's integer mean truncates toward zero.
  const Tensor x = Unwrap(Tensor::FromVector<int32_t>(std::vector<int32_t>{-7, 0, 0, 5, 6, 8}, {2, 3}));
  Tensor out = Unwrap(Tensor::Empty({2}, DType::kInt32));
  ASSERT_TRUE(CpuKernels()->Reduce(ReduceOp::kMean, x, 2, 3, 1, out).ok());
  EXPECT_EQ(out.data<int32_t>()[0], -2);
  EXPECT_EQ(out.data<int32_t>()[1], 6);
}

TEST(CpuReduceTest, NaNPropagates) {
  for (DType d : {DType::kFloat32, DType::kBFloat16}) {
    std::vector<double> v(40, 1.0);
    v[13] = std::nan("");
    const Tensor x = testing::FromDoubles(v, {2, 20}, d);
    for (ReduceOp op : kOps) {
      const std::vector<double> y = testing::Values(Unwrap(Reduce(op, x, {1})));
      EXPECT_FALSE(std::isnan(y[1])) << Name(op);
      EXPECT_TRUE(std::isnan(y[0])) << Name(op);
    }
  }
}

TEST(CpuReduceTest, EmptyReductions) {
  const Tensor x = Unwrap(Tensor::Empty({3, 0, 2}, DType::kFloat32));
  const std::vector<double> s = testing::Values(Unwrap(Sum(x, {1})));
  const std::vector<double> m = testing::Values(Unwrap(Mean(x, {1})));
  ASSERT_EQ(s.size(), 6u);
  for (double v : s) EXPECT_EQ(v, 0.0);
  for (double v : m) EXPECT_TRUE(std::isnan(v));
  EXPECT_FALSE(Max(x, {1}).ok());  // rejected by the ops layer
  // Also where the output is empty too (PyTorch: "Expected reduction dim 1 to have non-zero
  // size"), as the DTensor op refuses it.
  const Tensor none = Unwrap(Tensor::Empty({0, 0, 5}, DType::kFloat32));
  EXPECT_TRUE(absl::IsInvalidArgument(Max(none, {1}).status())) << Max(none, {1}).status();
  EXPECT_TRUE(absl::IsInvalidArgument(Min(none, {0, 1}).status()));
  EXPECT_TRUE(Sum(none, {1}).ok());
  Tensor out = Unwrap(Tensor::Empty({3, 2}, DType::kBFloat16));
  const Tensor xb = Unwrap(Tensor::Empty({3, 0, 2}, DType::kBFloat16));
  ASSERT_TRUE(CpuKernels()->Reduce(ReduceOp::kMax, xb, 3, 0, 2, out).ok());
  for (double v : testing::Values(out)) EXPECT_EQ(v, -INFINITY);
  ASSERT_TRUE(CpuKernels()->Reduce(ReduceOp::kMin, xb, 3, 0, 2, out).ok());
  for (double v : testing::Values(out)) EXPECT_EQ(v, INFINITY);
}

// A 0-d tensor reduced over dim 0 or -1, keepdim or not, is itself (torch.tensor(3.).sum(0),
// .mean(-1), .max(0).values); a dim named twice (0 and -1 on a 0-d tensor, 1 and -1 on a 2-d
// one) is an error, as torch's "dim 0 appears multiple times in the list of dims".
TEST(CpuReduceTest, ZeroDimOverDimZeroIsItselfAndRepeatedDimsAreErrors) {
  const Tensor s = testing::FromDoubles({2.5}, {}, DType::kFloat32);
  for (ReduceOp op : kOps) {
    for (int64_t d : {0, -1}) {
      for (bool keepdim : {false, true}) {
        const Tensor r = Unwrap(Reduce(op, s, std::vector<int64_t>{d}, keepdim));
        EXPECT_EQ(r.dim(), 0) << Name(op) << " " << d;
        EXPECT_EQ(testing::Values(r), testing::Values(s)) << Name(op) << " " << d;
      }
    }
    EXPECT_TRUE(absl::IsInvalidArgument(Reduce(op, s, std::vector<int64_t>{0, -1}).status())) << Name(op);
    EXPECT_TRUE(absl::IsInvalidArgument(Reduce(op, s, std::vector<int64_t>{1}).status())) << Name(op);
    const Tensor m = testing::FromDoubles({1, 2, 3, 4, 5, 6}, {2, 3}, DType::kFloat32);
    EXPECT_TRUE(absl::IsInvalidArgument(Reduce(op, m, std::vector<int64_t>{1, -1}).status())) << Name(op);
  }
}

TEST(CpuReduceTest, KernelRejectsMismatchedLayout) {
  const Tensor x = Unwrap(Tensor::Empty({4, 5}, DType::kFloat32));
  Tensor out = Unwrap(Tensor::Empty({4}, DType::kFloat32));
  EXPECT_EQ(CpuKernels()->Reduce(ReduceOp::kSum, x, 4, 4, 1, out).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace dtensor
