// Counter-based random fills on the CPU backend: reproducibility, the Philox definition,
// sharding invariance (a block equals the slice of the full tensor, bit for bit) and
// distribution statistics.
#include <cmath>
#include <cstring>
#include <vector>

#include "dtensor/kernels/cpu/cpu_kernels.h"
#include "dtensor/kernels/philox.h"
#include "dtensor/ops/ops.h"
#include "gtest/gtest.h"
#include "tests/testing/test_util.h"

namespace dtensor {
namespace {

using testing::Unwrap;

// Raw element bits of a contiguous tensor (for bit-exact comparisons).
std::vector<uint8_t> Bytes(const Tensor& t) {
  const auto* p = static_cast<const uint8_t*>(t.raw_data());
  return std::vector<uint8_t>(p, p + t.nbytes());
}

TEST(CpuRandomTest, SameSeedSameValuesOtherSeedOtherValues) {
  for (DType d : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    const Tensor a = Unwrap(RandomNormal({13, 29}, d, 42));
    const Tensor b = Unwrap(RandomNormal({13, 29}, d, 42));
    const Tensor c = Unwrap(RandomNormal({13, 29}, d, 43));
    EXPECT_EQ(Bytes(a), Bytes(b)) << DTypeName(d);
    const std::vector<double> va = testing::Values(a), vc = testing::Values(c);
    int same = 0;
    for (size_t i = 0; i < va.size(); ++i) same += va[i] == vc[i];
    EXPECT_LT(same, 20) << DTypeName(d);
  }
}

TEST(CpuRandomTest, ElementIsPhiloxOfItsGlobalIndex) {
  const uint64_t seed = 0x1234567890abcdefULL;
  const Tensor u = Unwrap(RandomUniform({5, 7}, DType::kFloat32, seed, -3.0, 2.0));
  const Tensor n = Unwrap(RandomNormal({5, 7}, DType::kBFloat16, seed, 0.5, 2.0));
  for (uint64_t g = 0; g < 35; ++g) {
    const float eu = static_cast<float>(internal::RandomUniformAt(seed, g, -3.0, 2.0));
    EXPECT_EQ(std::memcmp(&u.data<float>()[g], &eu, 4), 0) << g;
    const BFloat16 en(static_cast<float>(internal::RandomNormalAt(seed, g, 0.5, 2.0)));
    EXPECT_EQ(n.data<BFloat16>()[g].bits, en.bits) << g;
  }
}

// Every block of a global tensor, filled on its own with its offset, equals the matching
// slice of the full tensor bit for bit.
TEST(CpuRandomTest, BlockAtOffsetEqualsSliceOfFullTensor) {
  struct Case {
    Shape global, block, offset;
  };
  const Case cases[] = {
      {{7, 13, 5}, {3, 4, 5}, {2, 6, 0}},  {{7, 13, 5}, {7, 5, 2}, {0, 3, 3}},
      {{7, 13, 5}, {1, 1, 1}, {6, 12, 4}}, {{97}, {40}, {57}},
      {{64, 257}, {33, 129}, {31, 128}},  // large enough for the parallel path
      {{64, 257}, {64, 257}, {0, 0}},
  };
  for (DType d : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    for (RandomSpec::Kind kind : {RandomSpec::Kind::kNormal, RandomSpec::Kind::kUniform}) {
      const RandomSpec spec{kind, 99, -1.0, 3.0};
      for (const Case& c : cases) {
        Tensor full = Unwrap(Tensor::Empty(c.global, d));
        ASSERT_TRUE(FillRandom_(full, spec, c.global, Shape(c.global.size(), 0)).ok());
        Tensor block = Unwrap(Tensor::Empty(c.block, d));
        ASSERT_TRUE(FillRandom_(block, spec, c.global, c.offset).ok());
        Tensor slice = full;
        for (size_t i = 0; i < c.global.size(); ++i) {
          slice = Unwrap(slice.Narrow(static_cast<int64_t>(i), c.offset[i], c.block[i]));
        }
        const Tensor expected = Unwrap(Clone(slice));
        EXPECT_EQ(Bytes(block), Bytes(expected))
            << DTypeName(d) << " block " << ShapeString(c.block) << " at " << ShapeString(c.offset);
      }
    }
  }
}

TEST(CpuRandomTest, KernelFillsZeroDimAndRejectsBadBlocks) {
  Tensor s = Unwrap(Tensor::Empty({}, DType::kFloat32));
  const RandomSpec spec{RandomSpec::Kind::kUniform, 5, 0.0, 1.0};
  ASSERT_TRUE(CpuKernels()->FillRandom(s, spec, {}, {}).ok());
  EXPECT_EQ(s.data<float>()[0], static_cast<float>(internal::RandomUniformAt(5, 0, 0.0, 1.0)));
  Tensor b = Unwrap(Tensor::Empty({4}, DType::kFloat32));
  const int64_t global[] = {6}, offset[] = {3};
  EXPECT_EQ(CpuKernels()->FillRandom(b, spec, global, offset).code(), absl::StatusCode::kInvalidArgument);
}

TEST(CpuRandomTest, UniformStatistics) {
  const int64_t n = 200000;
  const std::vector<double> v = testing::Values(Unwrap(RandomUniform({n}, DType::kFloat32, 7, -2.0, 3.0)));
  double sum = 0, sq = 0, lo = 1e9, hi = -1e9;
  for (double x : v) {
    sum += x;
    sq += x * x;
    lo = std::min(lo, x);
    hi = std::max(hi, x);
  }
  const double mean = sum / n, var = sq / n - mean * mean;
  EXPECT_GE(lo, -2.0);
  EXPECT_LE(hi, 3.0);
  EXPECT_LT(lo, -1.99);
  EXPECT_GT(hi, 2.99);
  EXPECT_NEAR(mean, 0.5, 5 * std::sqrt(25.0 / 12.0 / n));
  EXPECT_NEAR(var, 25.0 / 12.0, 0.02 * 25.0 / 12.0);
}

TEST(CpuRandomTest, NormalStatistics) {
  const int64_t n = 200000;
  const double mu = 1.5, sigma = 0.5;
  const std::vector<double> v = testing::Values(Unwrap(RandomNormal({n}, DType::kFloat32, 11, mu, sigma)));
  double sum = 0, sq = 0;
  int64_t within1 = 0, within2 = 0;
  for (double x : v) {
    sum += x;
    sq += (x - mu) * (x - mu);
    within1 += std::fabs(x - mu) < sigma;
    within2 += std::fabs(x - mu) < 2 * sigma;
  }
  const double mean = sum / n, stddev = std::sqrt(sq / n);
  EXPECT_NEAR(mean, mu, 5 * sigma / std::sqrt(static_cast<double>(n)));
  EXPECT_NEAR(stddev, sigma, 0.01 * sigma);
  EXPECT_NEAR(static_cast<double>(within1) / n, 0.6827, 0.01);
  EXPECT_NEAR(static_cast<double>(within2) / n, 0.9545, 0.005);
}

}  // namespace
}  // namespace dtensor
