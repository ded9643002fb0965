// Matrix multiply on the CPU backend (OpenBLAS sgemm) against a float64 reference: all four
// transpose combinations, batches with broadcast (stride-0) operands, padded leading dims,
// alpha/beta accumulation, bf16/f16, and the Gemm kernel interface directly.
#include <cmath>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "dtensor/kernels/cpu/cpu_kernels.h"
#include "dtensor/ops/ops.h"
#include "gtest/gtest.h"
#include "tests/testing/test_util.h"

namespace dtensor {
namespace {

using testing::Unwrap;

constexpr DType kFloatTypes[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16};

struct RefGemm {
  std::vector<double> c;    // alpha * a @ b + beta * c0
  std::vector<double> mag;  // |alpha| * |a| @ |b| + |beta * c0|: the scale rounding errors follow
};

// a: [batch, m, k], b: [batch, k, n] row-major float64 (batch broadcast when a or b has 1).
RefGemm Reference(const std::vector<double>& a, const std::vector<double>& b, int64_t batch_a, int64_t batch_b,
                  int64_t m, int64_t k, int64_t n, double alpha = 1.0, double beta = 0.0,
                  const std::vector<double>& c0 = {}) {
  const int64_t batch = std::max(batch_a, batch_b);
  RefGemm r;
  r.c.assign(static_cast<size_t>(batch * m * n), 0.0);
  r.mag.assign(r.c.size(), 0.0);
  for (int64_t p = 0; p < batch; ++p) {
    const double* ap = &a[(batch_a == 1 ? 0 : p) * m * k];
    const double* bp = &b[(batch_b == 1 ? 0 : p) * k * n];
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < n; ++j) {
        double s = 0, g = 0;
        for (int64_t q = 0; q < k; ++q) {
          s += ap[i * k + q] * bp[q * n + j];
          g += std::fabs(ap[i * k + q] * bp[q * n + j]);
        }
        const size_t o = static_cast<size_t>((p * m + i) * n + j);
        const double prev = c0.empty() ? 0.0 : beta * c0[o];
        r.c[o] = alpha * s + prev;
        r.mag[o] = std::fabs(alpha) * g + std::fabs(prev);
      }
    }
  }
  return r;
}

// |got - ref| <= rtol * mag + atol, with rtol from the dtype (float32: K-term accumulation).
void ExpectGemmNear(const std::vector<double>& got, const RefGemm& ref, DType d, const std::string& what) {
  ASSERT_EQ(got.size(), ref.c.size()) << what;
  const double rtol = d == DType::kFloat32 ? 2e-5 : testing::Tol(d).rtol;
  int bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!(std::fabs(got[i] - ref.c[i]) <= rtol * ref.mag[i] + 1e-6) && bad++ < 5) {
      ADD_FAILURE() << what << ": element " << i << " is " << got[i] << ", expected " << ref.c[i];
    }
  }
}

std::string What(DType d, int64_t m, int64_t k, int64_t n, bool ta, bool tb) {
  return std::string(DTypeName(d)) + " m" + std::to_string(m) + " k" + std::to_string(k) + " n" + std::to_string(n) +
         (ta ? " aT" : "") + (tb ? " bT" : "");
}

TEST(CpuMatmulTest, AllTransposeCombinations) {
  const int64_t shapes[][3] = {{1, 1, 1}, {3, 5, 7}, {17, 33, 9}, {64, 127, 31}, {1, 40, 1}, {29, 1, 3}};
  for (DType d : kFloatTypes) {
    for (const auto& s : shapes) {
      const int64_t m = s[0], k = s[1], n = s[2];
      for (bool ta : {false, true}) {
        for (bool tb : {false, true}) {
          const Tensor a = testing::Random(ta ? Shape{k, m} : Shape{m, k}, d, 1);
          const Tensor b = testing::Random(tb ? Shape{n, k} : Shape{k, n}, d, 2);
          const Tensor c = Unwrap(Matmul(a, b, ta, tb));
          ASSERT_EQ(c.shape(), IntSpan(Shape{m, n}));
          const std::vector<double> av = testing::Values(ta ? Unwrap(a.Transpose(0, 1)) : a);
          const std::vector<double> bv = testing::Values(tb ? Unwrap(b.Transpose(0, 1)) : b);
          ExpectGemmNear(testing::Values(c), Reference(av, bv, 1, 1, m, k, n), d, What(d, m, k, n, ta, tb));
        }
      }
    }
  }
}

TEST(CpuMatmulTest, BatchedAndBroadcastBatches) {
  const int64_t m = 7, k = 13, n = 5;
  for (DType d : kFloatTypes) {
    {  // same batch
      const Tensor a = testing::Random({4, m, k}, d, 3), b = testing::Random({4, k, n}, d, 4);
      ExpectGemmNear(testing::Values(Unwrap(Matmul(a, b))),
                     Reference(testing::Values(a), testing::Values(b), 4, 4, m, k, n), d, "batch 4");
    }
    {  // a broadcast over b's batch (batch stride 0), b transposed
      const Tensor a = testing::Random({1, m, k}, d, 5), b = testing::Random({3, n, k}, d, 6);
      const Tensor c = Unwrap(Matmul(a, b, false, true));
      ASSERT_EQ(c.shape(), IntSpan(Shape{3, m, n}));
      const std::vector<double> bv = testing::Values(Unwrap(b.Transpose(1, 2)));
      ExpectGemmNear(testing::Values(c), Reference(testing::Values(a), bv, 1, 3, m, k, n), d, "broadcast a");
    }
    {  // linear layer: [2, 3, m, k] @ [k, n]
      const Tensor a = testing::Random({2, 3, m, k}, d, 7), b = testing::Random({k, n}, d, 8);
      const Tensor c = Unwrap(Matmul(a, b));
      ASSERT_EQ(c.shape(), IntSpan(Shape{2, 3, m, n}));
      ExpectGemmNear(testing::Values(c), Reference(testing::Values(a), testing::Values(b), 1, 1, 6 * m, k, n), d,
                     "linear");
    }
    {  // non-contiguous operands
      const Tensor a = testing::NonContiguous(testing::Random({2, m, k}, d, 9));
      const Tensor b = testing::NonContiguous(testing::Random({2, k, n}, d, 10));
      ExpectGemmNear(testing::Values(Unwrap(Matmul(a, b))),
                     Reference(testing::Values(a), testing::Values(b), 2, 2, m, k, n), d, "non-contiguous");
    }
  }
}

TEST(CpuMatmulTest, AlphaBetaAccumulate) {
  const int64_t m = 9, k = 21, n = 11;
  for (DType d : kFloatTypes) {
    for (bool tb : {false, true}) {
      const Tensor a = testing::Random({m, k}, d, 11);
      const Tensor b = testing::Random(tb ? Shape{n, k} : Shape{k, n}, d, 12);
      const Tensor out = Unwrap(Clone(testing::Random({m, n}, d, 13)));
      const std::vector<double> c0 = testing::Values(out);
      ASSERT_TRUE(MatmulInto(a, b, out, false, tb, 0.5f, 2.0f).ok());
      const std::vector<double> bv = testing::Values(tb ? Unwrap(b.Transpose(0, 1)) : b);
      ExpectGemmNear(testing::Values(out), Reference(testing::Values(a), bv, 1, 1, m, k, n, 0.5, 2.0, c0), d,
                     "alpha 0.5 beta 2 " + std::string(DTypeName(d)));
      // beta = 0 ignores the old contents, NaN included.
      ASSERT_TRUE(Fill_(out, std::nan("")).ok());
      ASSERT_TRUE(MatmulInto(a, b, out, false, tb, -1.0f, 0.0f).ok());
      ExpectGemmNear(testing::Values(out), Reference(testing::Values(a), bv, 1, 1, m, k, n, -1.0), d,
                     "beta 0 over NaN " + std::string(DTypeName(d)));
    }
  }
}

// The kernel interface directly, with layouts the ops layer may or may not produce.
TEST(CpuMatmulTest, GemmKernelLayouts) {
  const int64_t m = 6, k = 10, n = 4, batch = 5;
  for (DType d : kFloatTypes) {
    const std::string dn(DTypeName(d));
    // a: one matrix broadcast over the batch (stride 0); b: padded leading dim (lda > n).
    const Tensor a2 = testing::Random({m, k}, d, 21);
    const Tensor a = Unwrap(Unwrap(a2.Unsqueeze(0)).Expand({batch, m, k}));
    const Tensor bbig = testing::Random({batch, k, n + 7}, d, 22);
    const Tensor b = Unwrap(bbig.Narrow(2, 3, n));
    Tensor c = Unwrap(Tensor::Empty({batch, m, n}, d));
    ASSERT_TRUE(CpuKernels()->Gemm(a, b, c, 1.0f, 0.0f).ok());
    ExpectGemmNear(testing::Values(c), Reference(testing::Values(a2), testing::Values(b), 1, batch, m, k, n), d,
                   "stride-0 batch, padded b " + dn);

    // a transposed with padding: stored [batch, k, m + 3], viewed [batch, m, k] (stride(1) == 1).
    const Tensor at_big = testing::Random({batch, k, m + 3}, d, 23);
    const Tensor at = Unwrap(Unwrap(at_big.Narrow(2, 1, m)).Transpose(1, 2));
    const Tensor b2 = testing::Random({batch, k, n}, d, 24);
    const Tensor c0 = Unwrap(Clone(testing::Random({batch, m, n}, d, 25)));
    const std::vector<double> c0v = testing::Values(c0);
    ASSERT_TRUE(CpuKernels()->Gemm(at, b2, c0, 2.0f, -1.0f).ok());
    ExpectGemmNear(testing::Values(c0),
                   Reference(testing::Values(at), testing::Values(b2), batch, batch, m, k, n, 2.0, -1.0, c0v), d,
                   "transposed padded a, alpha/beta " + dn);

    // Rows of a all the same (stride 0 in the middle dim): BLAS cannot describe it; packed.
    const Tensor row = testing::Random({1, 1, k}, d, 26);
    const Tensor arow = Unwrap(row.Expand({1, m, k}));
    const Tensor b3 = testing::Random({1, k, n}, d, 27);
    Tensor c3 = Unwrap(Tensor::Empty({1, m, n}, d));
    ASSERT_TRUE(CpuKernels()->Gemm(arow, b3, c3, 1.0f, 0.0f).ok());
    ExpectGemmNear(testing::Values(c3), Reference(testing::Values(arow), testing::Values(b3), 1, 1, m, k, n), d,
                   "stride-0 rows " + dn);

    // K == 0: c = beta * c.
    const Tensor ak = Unwrap(Tensor::Empty({1, m, 0}, d));
    const Tensor bk = Unwrap(Tensor::Empty({1, 0, n}, d));
    Tensor ck = Unwrap(Full({1, m, n}, 3.0, d));
    ASSERT_TRUE(CpuKernels()->Gemm(ak, bk, ck, 1.0f, 0.5f).ok());
    for (double v : testing::Values(ck)) EXPECT_EQ(v, 1.5);
    ASSERT_TRUE(Fill_(ck, std::nan("")).ok());
    ASSERT_TRUE(CpuKernels()->Gemm(ak, bk, ck, 1.0f, 0.0f).ok());
    for (double v : testing::Values(ck)) EXPECT_EQ(v, 0.0);
  }
}

TEST(CpuMatmulTest, ManySmallAndOneLargeMatrix) {
  // Many small matrices: the batch is split across threads.
  for (DType d : {DType::kFloat32, DType::kBFloat16}) {
    const Tensor a = testing::Random({64, 8, 12}, d, 31), b = testing::Random({64, 12, 16}, d, 32);
    ExpectGemmNear(testing::Values(Unwrap(Matmul(a, b, false, false))),
                   Reference(testing::Values(a), testing::Values(b), 64, 64, 8, 12, 16), d, "64 small");
  }
  // One large matrix: OpenBLAS threads the call.
  const Tensor a = testing::Random({192, 160}, DType::kFloat32, 33),
               b = testing::Random({160, 224}, DType::kFloat32, 34);
  ExpectGemmNear(testing::Values(Unwrap(Matmul(a, b))),
                 Reference(testing::Values(a), testing::Values(b), 1, 1, 192, 160, 224), DType::kFloat32, "large");
}

// beta = 0 on matrices large enough that the kernel clears C itself, split over threads, before
// accumulating (gemm.cc): old contents, NaN included, leave no trace, plain and with a
// transposed a (the weight gradient's dY^T X).
TEST(CpuMatmulTest, BetaZeroOverNaNInLargeMatrices) {
  const int64_t m = 700, k = 64, n = 900;
  const Tensor a = testing::Random({1, m, k}, DType::kFloat32, 41), b = testing::Random({1, k, n}, DType::kFloat32, 42);
  const Tensor at_store = testing::Random({1, k, m}, DType::kFloat32, 43);
  const Tensor at = Unwrap(at_store.Transpose(1, 2));
  for (const Tensor& lhs : {a, at}) {
    Tensor c = Unwrap(Full({1, m, n}, std::nan(""), DType::kFloat32));
    ASSERT_TRUE(CpuKernels()->Gemm(lhs, b, c, 0.5f, 0.0f).ok());
    ExpectGemmNear(testing::Values(c), Reference(testing::Values(lhs), testing::Values(b), 1, 1, m, k, n, 0.5),
                   DType::kFloat32, lhs.is_contiguous() ? "a" : "a^T");
  }
}

TEST(CpuMatmulTest, KernelRejectsBadArguments) {
  const Tensor a = Unwrap(Tensor::Empty({1, 2, 3}, DType::kFloat32));
  const Tensor b = Unwrap(Tensor::Empty({1, 3, 4}, DType::kBFloat16));
  Tensor c = Unwrap(Tensor::Empty({1, 2, 4}, DType::kFloat32));
  EXPECT_EQ(CpuKernels()->Gemm(a, b, c, 1.0f, 0.0f).code(), absl::StatusCode::kInvalidArgument);
  const Tensor ai = Unwrap(Tensor::Empty({1, 2, 3}, DType::kInt32));
  const Tensor bi = Unwrap(Tensor::Empty({1, 3, 4}, DType::kInt32));
  Tensor ci = Unwrap(Tensor::Empty({1, 2, 4}, DType::kInt32));
  EXPECT_EQ(CpuKernels()->Gemm(ai, bi, ci, 1.0f, 0.0f).code(), absl::StatusCode::kUnimplemented);
  const Tensor b5 = Unwrap(Tensor::Empty({1, 5, 4}, DType::kFloat32));
  EXPECT_EQ(CpuKernels()->Gemm(a, b5, c, 1.0f, 0.0f).code(), absl::StatusCode::kInvalidArgument);
}

// LinearBias (Kernels::GemmBias, nn.Linear's bias and bias + GELU epilogue): against a float64
// reference, and bit for bit against the unfused ops it replaces on the CPU (in float32).
TEST(CpuLinearBiasTest, MatchesReferenceAndTheUnfusedOps) {
  for (DType d : kFloatTypes) {
    for (bool gelu : {false, true}) {
      for (const auto& [m, k, n] : {std::tuple<int64_t, int64_t, int64_t>{5, 7, 3}, {64, 48, 40}, {1, 1, 1}}) {
        const std::string what = What(d, m, k, n, false, true) + (gelu ? " gelu" : "");
        const Tensor x = testing::Random({m, k}, d, 11), w = testing::Random({n, k}, d, 12),
                     b = testing::Random({n}, d, 13);
        Tensor pre;
        const Tensor y = Unwrap(LinearBias(x, w, b, gelu, &pre));
        // float64 reference of x w^T + b (and GELU's tanh form).
        const std::vector<double> xv = testing::Values(x), wv = testing::Values(w), bv = testing::Values(b);
        std::vector<double> wt(static_cast<size_t>(k * n));
        for (int64_t i = 0; i < n; ++i) {
          for (int64_t q = 0; q < k; ++q) wt[static_cast<size_t>(q * n + i)] = wv[static_cast<size_t>(i * k + q)];
        }
        RefGemm ref = Reference(xv, wt, 1, 1, m, k, n);
        for (size_t i = 0; i < ref.c.size(); ++i) {
          ref.c[i] += bv[i % static_cast<size_t>(n)];
          ref.mag[i] += std::fabs(bv[i % static_cast<size_t>(n)]);
        }
        ExpectGemmNear(testing::Values(gelu ? pre : y), ref, d, what + " (pre)");
        if (gelu) {
          std::vector<double> act(ref.c.size());
          for (size_t i = 0; i < act.size(); ++i) {
            const double v = ref.c[i];
            act[i] = 0.5 * v * (1.0 + std::tanh(0.7978845608028654 * (v + 0.044715 * v * v * v)));
          }
          testing::ExpectNear(testing::Values(y), act,
                              d == DType::kFloat32 ? testing::Tolerance{1e-4, 1e-5} : testing::Tol(d), what);
        }
        // The ops it replaces, bit for bit: in float32, then rounded once to a 16-bit dtype (the
        // 16-bit ops would round the product before adding the bias).
        auto f32 = [](const Tensor& t) { return Unwrap(Cast(t, DType::kFloat32)); };
        const Tensor unfused = Unwrap(Cast(Unwrap(Add(Unwrap(Matmul(f32(x), f32(w), false, true)), f32(b))), d));
        EXPECT_EQ(testing::Values(gelu ? pre : y), testing::Values(unfused)) << what;
        if (gelu) {
          EXPECT_EQ(testing::Values(y), testing::Values(Unwrap(Gelu(unfused)))) << what;
        }
      }
    }
  }
}

TEST(CpuLinearBiasTest, StridedInputsEmptyProductsAndErrors) {
  // x non-contiguous (a transposed view), K = 0 (the bias alone), M = 0.
  const Tensor xt = Unwrap(testing::Random({6, 4}, DType::kFloat32, 21).Transpose(0, 1));  // [4, 6]
  const Tensor w = testing::Random({3, 6}, DType::kFloat32, 22), b = testing::Random({3}, DType::kFloat32, 23);
  EXPECT_EQ(testing::Values(Unwrap(LinearBias(xt, w, b))),
            testing::Values(Unwrap(Add(Unwrap(Matmul(xt, w, false, true)), b))));
  const Tensor x0 = Unwrap(Zeros({2, 0}, DType::kFloat32)), w0 = Unwrap(Zeros({3, 0}, DType::kFloat32));
  Tensor pre;
  const Tensor g0 = Unwrap(LinearBias(x0, w0, b, true, &pre));
  EXPECT_EQ(testing::Values(pre),
            (std::vector<double>{testing::Values(b)[0], testing::Values(b)[1], testing::Values(b)[2],
                                 testing::Values(b)[0], testing::Values(b)[1], testing::Values(b)[2]}));
  EXPECT_EQ(testing::Values(g0), testing::Values(Unwrap(Gelu(pre))));
  EXPECT_EQ(Unwrap(LinearBias(Unwrap(Zeros({0, 6}, DType::kFloat32)), w, b)).numel(), 0);
  // Errors name the offending shapes / dtypes.
  const absl::Status bad_bias = LinearBias(xt, w, testing::Random({4}, DType::kFloat32, 24)).status();
  EXPECT_EQ(bad_bias.code(), absl::StatusCode::kInvalidArgument) << bad_bias;
  EXPECT_NE(bad_bias.message().find("[4]"), std::string::npos) << bad_bias;
  const absl::Status bad_k = LinearBias(testing::Random({4, 5}, DType::kFloat32, 25), w, b).status();
  EXPECT_EQ(bad_k.code(), absl::StatusCode::kInvalidArgument) << bad_k;
  const absl::Status bad_dtype = LinearBias(xt, w, testing::Random({3}, DType::kBFloat16, 26)).status();
  EXPECT_EQ(bad_dtype.code(), absl::StatusCode::kInvalidArgument) << bad_dtype;
  const absl::Status three_d = LinearBias(testing::Random({2, 4, 6}, DType::kFloat32, 27), w, b).status();
  EXPECT_EQ(three_d.code(), absl::StatusCode::kInvalidArgument) << three_d;
  EXPECT_NE(three_d.message().find("[LinearBias]"), std::string::npos) << three_d;
}

// 16-bit Linear: x w^T + b rounded once, as torch's addmm (and cuBLASLt's epilogue). With u the
// dtype's ulp at 1: x w^T = 1 + u/4 would round to 1, and 1 + b = 1 + u/2 is then a tie that
// rounds to 1 again; the exact 1 + 3u/4 rounds to 1 + u.
TEST(CpuLinearBiasTest, SixteenBitRoundsOnce) {
  for (DType d : {DType::kBFloat16, DType::kFloat16}) {
    const double u = d == DType::kBFloat16 ? 0x1p-7 : 0x1p-10;
    const Tensor x = testing::FromDoubles({1.0, 1.0}, {1, 2}, d);
    const Tensor w = testing::FromDoubles({1.0, u / 4, 0.5, 0.5}, {2, 2}, d);
    const Tensor b = testing::FromDoubles({u / 2, 0.25}, {2}, d);
    const std::vector<double> want = testing::Values(testing::FromDoubles({1.0 + 0.75 * u, 1.25}, {1, 2}, d));
    for (bool gelu : {false, true}) {
      Tensor pre;
      const Tensor y = Unwrap(LinearBias(x, w, b, gelu, &pre));
      EXPECT_EQ(testing::Values(gelu ? pre : y), want) << DTypeName(d) << (gelu ? " gelu" : "");
    }
  }
}

// LinearWeightBiasGrad (Kernels::GemmBiasGrad) and LinearInputGradGelu (Kernels::GemmDgelu), the
// backward products with their bias gradients: against float64 references, and bit for bit
// against the unfused ops they replace on the CPU.
TEST(CpuLinearBiasGradTest, MatchesReferenceAndTheUnfusedOps) {
  for (DType d : kFloatTypes) {
    for (const auto& [m, k, n] : {std::tuple<int64_t, int64_t, int64_t>{5, 7, 3}, {64, 48, 40}, {1, 1, 1}}) {
      const std::string what = What(d, m, k, n, true, false);
      // Weight and bias gradients: dy [m, n], x [m, k] -> dw [n, k], db [n].
      const Tensor dy = testing::Random({m, n}, d, 31), x = testing::Random({m, k}, d, 32);
      Tensor db;
      const Tensor dw = Unwrap(LinearWeightBiasGrad(dy, x, &db));
      const std::vector<double> dyv = testing::Values(dy), xv = testing::Values(x);
      std::vector<double> dyt(dyv.size());
      for (int64_t i = 0; i < m; ++i) {
        for (int64_t j = 0; j < n; ++j) dyt[static_cast<size_t>(j * m + i)] = dyv[static_cast<size_t>(i * n + j)];
      }
      ExpectGemmNear(testing::Values(dw), Reference(dyt, xv, 1, 1, n, m, k), d, what + " dw");
      std::vector<double> ones(static_cast<size_t>(m), 1.0);
      ExpectGemmNear(testing::Values(db), Reference(dyt, ones, 1, 1, n, m, 1), d, what + " db");
      EXPECT_EQ(testing::Values(dw), testing::Values(Unwrap(Matmul(dy, x, true, false)))) << what;
      EXPECT_EQ(testing::Values(db), testing::Values(Unwrap(Sum(dy, {0})))) << what;

      // Through GELU: dy [m, n], w [n, k], pre [m, k] -> dpre [m, k], db [k].
      const Tensor w = testing::Random({n, k}, d, 33), pre = testing::Random({m, k}, d, 34);
      Tensor dbg;
      const Tensor dpre = Unwrap(LinearInputGradGelu(dy, w, pre, &dbg));
      RefGemm ref = Reference(dyv, testing::Values(w), 1, 1, m, n, k);
      const std::vector<double> pv = testing::Values(pre);
      for (size_t i = 0; i < ref.c.size(); ++i) {
        const double v = pv[i], c = 0.7978845608028654, u = c * (v + 0.044715 * v * v * v);
        const double t = std::tanh(u);
        const double dg = 0.5 * (1 + t) + 0.5 * v * (1 - t * t) * c * (1 + 3 * 0.044715 * v * v);
        ref.c[i] *= dg;
        ref.mag[i] *= std::fabs(dg) + 1e-3;  // + the product's rounding before the multiply
      }
      const double rtol = d == DType::kFloat32 ? 2e-5 : 3 * testing::Tol(d).rtol;
      const std::vector<double> got = testing::Values(dpre);
      for (size_t i = 0; i < got.size(); ++i) {
        EXPECT_LE(std::fabs(got[i] - ref.c[i]), rtol * ref.mag[i] + 1e-6) << what << " dpre element " << i;
      }
      const Tensor unfused = Unwrap(UnaryBackward(UnaryOp::kGelu, Unwrap(Matmul(dy, w)), pre));
      EXPECT_EQ(got, testing::Values(unfused)) << what;
      EXPECT_EQ(testing::Values(dbg), testing::Values(Unwrap(Sum(unfused, {0})))) << what;
    }
  }
}

TEST(CpuLinearBiasGradTest, StridedInputsEmptyProductsAndErrors) {
  // Non-contiguous dy and x (transposed views): the same as the unfused ops.
  const Tensor dyt = Unwrap(testing::Random({3, 4}, DType::kFloat32, 41).Transpose(0, 1));  // [4, 3]
  const Tensor xt = Unwrap(testing::Random({6, 4}, DType::kFloat32, 42).Transpose(0, 1));   // [4, 6]
  Tensor db;
  EXPECT_EQ(testing::Values(Unwrap(LinearWeightBiasGrad(dyt, xt, &db))),
            testing::Values(Unwrap(Matmul(dyt, xt, true, false))));
  EXPECT_EQ(testing::Values(db), testing::Values(Unwrap(Sum(dyt, {0}))));
  const Tensor w = testing::Random({3, 6}, DType::kFloat32, 43);
  const Tensor pret = Unwrap(testing::Random({6, 4}, DType::kFloat32, 44).Transpose(0, 1));  // [4, 6]
  const Tensor dpre = Unwrap(LinearInputGradGelu(dyt, w, pret, &db));
  const Tensor unfused = Unwrap(UnaryBackward(UnaryOp::kGelu, Unwrap(Matmul(dyt, w)), pret));
  EXPECT_EQ(testing::Values(dpre), testing::Values(unfused));
  EXPECT_EQ(testing::Values(db), testing::Values(Unwrap(Sum(unfused, {0}))));
  // No rows: zeros; an empty contraction (N = 0): zeros.
  const Tensor dy0 = Unwrap(Zeros({0, 3}, DType::kFloat32)), x0 = Unwrap(Zeros({0, 6}, DType::kFloat32));
  const Tensor dw0 = Unwrap(LinearWeightBiasGrad(dy0, x0, &db));
  EXPECT_EQ(testing::Values(dw0), std::vector<double>(18, 0.0));
  EXPECT_EQ(testing::Values(db), std::vector<double>(3, 0.0));
  const Tensor dyn = Unwrap(Zeros({4, 0}, DType::kFloat32)), wn = Unwrap(Zeros({0, 6}, DType::kFloat32));
  EXPECT_EQ(testing::Values(Unwrap(LinearInputGradGelu(dyn, wn, pret, &db))), std::vector<double>(24, 0.0));
  EXPECT_EQ(testing::Values(db), std::vector<double>(6, 0.0));
  // Errors name the op and the offending shapes.
  const absl::Status rows = LinearWeightBiasGrad(dyt, testing::Random({5, 6}, DType::kFloat32, 45), &db).status();
  EXPECT_EQ(rows.code(), absl::StatusCode::kInvalidArgument) << rows;
  EXPECT_NE(rows.message().find("[LinearWeightBiasGrad]"), std::string::npos) << rows;
  EXPECT_EQ(LinearWeightBiasGrad(dyt, xt, nullptr).status().code(), absl::StatusCode::kInvalidArgument);
  const absl::Status bad_pre = LinearInputGradGelu(dyt, w, testing::Random({4, 5}, DType::kFloat32, 46), &db).status();
  EXPECT_EQ(bad_pre.code(), absl::StatusCode::kInvalidArgument) << bad_pre;
  EXPECT_NE(bad_pre.message().find("[4, 5]"), std::string::npos) << bad_pre;
  const absl::Status bad_dtype =
      LinearInputGradGelu(dyt, w, testing::Random({4, 6}, DType::kBFloat16, 47), &db).status();
  EXPECT_EQ(bad_dtype.code(), absl::StatusCode::kInvalidArgument) << bad_dtype;
  const absl::Status three_d =
      LinearInputGradGelu(testing::Random({2, 4, 3}, DType::kFloat32, 48), w, pret, &db).status();
  EXPECT_EQ(three_d.code(), absl::StatusCode::kInvalidArgument) << three_d;
}

}  // namespace
}  // namespace dtensor
