// The CUDA softmax and cross-entropy kernels' online max/sum (dtensor/kernels/cuda/max_sum.h),
// run on the CPU as those kernels use it: each of a block's threads adds every blockDim-th
// element of a row, the threads' states merge as WarpMaxSum / BlockMaxSum do (an xor butterfly
// in each warp of 32, then one over the warps' results), and the outputs are the kernels'
// formulas (softmax e^(x - m) * (1 / s), log-softmax (x - m) - log s, the loss's LogSumExp).
// Checked against the CPU kernels, the reference, on rows holding NaN, +inf and -inf in
// changing places (NaN of either sign: the CPU's cross-entropy takes its max on integer keys,
// where the two signs sort apart), so that a special value falls in any thread's share; and on
// finite rows.
#include "dtensor/kernels/cuda/max_sum.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "dtensor/kernels/cpu/cpu_kernels.h"
#include "dtensor/kernels/kernels.h"
#include "gtest/gtest.h"
#include "tests/testing/test_util.h"

namespace dtensor {
namespace {

using internal::gpu::EmptyMaxSum;
using internal::gpu::LogSumExp;
using internal::gpu::MaxSum;
using internal::gpu::MaxSumAdd;
using internal::gpu::MaxSumMerge;
using testing::Unwrap;

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kNegNaN = -kNaN;  // sign bit set, as x86 arithmetic makes it (inf - inf, 0 * inf)

// Every lane of a warp merged with lane ^ o for o = 16, 8, 4, 2, 1 (__shfl_xor_sync), all lanes
// at once.
void WarpMerge(std::vector<MaxSum>& lanes) {
  for (int o = 16; o > 0; o >>= 1) {
    const std::vector<MaxSum> before = lanes;
    for (int l = 0; l < 32; ++l) lanes[l] = MaxSumMerge(before[l], before[l ^ o]);
  }
}

// The row's state as BlockMaxSum gives it to every thread of a block of `threads` (a multiple
// of 32), lane 0's result of the second butterfly.
MaxSum BlockState(const std::vector<float>& row, int threads) {
  std::vector<MaxSum> v(threads, EmptyMaxSum());
  for (size_t j = 0; j < row.size(); ++j) v[j % threads] = MaxSumAdd(v[j % threads], row[j]);
  const int warps = threads / 32;
  std::vector<MaxSum> firsts(32, EmptyMaxSum());
  for (int w = 0; w < warps; ++w) {
    std::vector<MaxSum> lanes(v.begin() + 32 * w, v.begin() + 32 * (w + 1));
    WarpMerge(lanes);
    firsts[w] = lanes[0];
  }
  WarpMerge(firsts);
  return firsts[0];
}

// NaN matches NaN, infinities match themselves, finite values match within float rounding.
bool Same(double got, double want) {
  if (std::isnan(want) || std::isnan(got)) return std::isnan(want) && std::isnan(got);
  if (std::isinf(want) || std::isinf(got)) return got == want;
  return std::fabs(got - want) <= 2e-5 + 2e-5 * std::fabs(want);
}

std::string RowString(const std::vector<float>& row) {
  if (row.size() > 12) return absl::StrCat(row.size(), " elements");
  return absl::StrCat("[", absl::StrJoin(row, ", "), "]");
}

// The rows: finite ones, and each special pattern at positions that fall in different threads.
std::vector<std::vector<float>> Rows() {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-6.0f, 6.0f);
  std::vector<std::vector<float>> rows;
  for (int n : {1, 2, 5, 33, 100, 1030, 2100}) {
    std::vector<float> base(n);
    for (float& x : base) x = u(rng);
    rows.push_back(base);
    std::vector<float> large = base;
    for (float& x : large) x += 1000.0f;
    rows.push_back(large);
    const std::vector<int> at = {0, n / 3, n - 1};
    for (int i : at) {
      for (float special : {kNaN, kNegNaN, kInf, -kInf}) {
        std::vector<float> r = base;
        r[i] = special;
        rows.push_back(r);
      }
      if (n > 1) {
        const int k = (i + n / 2 + 1) % n;  // a second special value elsewhere
        for (auto [a, b] : {std::pair{kInf, kInf}, std::pair{kInf, kNaN}, std::pair{kNaN, kInf}, std::pair{-kInf, kNaN},
                            std::pair{kNaN, -kInf}, std::pair{kInf, -kInf}, std::pair{kInf, kNegNaN},
                            std::pair{kNegNaN, kInf}, std::pair{-kInf, kNegNaN}}) {
          std::vector<float> r = base;
          r[i] = a;
          r[k] = b;
          rows.push_back(r);
        }
      }
    }
    rows.push_back(std::vector<float>(n, -kInf));
    rows.push_back(std::vector<float>(n, kNaN));
    rows.push_back(std::vector<float>(n, kNegNaN));
    for (float nan : {kNaN, kNegNaN}) {  // -inf but for one NaN
      std::vector<float> r(n, -kInf);
      r[n - 1] = nan;
      rows.push_back(r);
    }
    std::vector<float> all_but_one(n, -kInf);
    all_but_one[n / 2] = 1.5f;
    rows.push_back(all_but_one);
  }
  return rows;
}

TEST(MaxSumTest, SoftmaxAndLogSumExpMatchTheCpuKernelsWhateverTheSpecialValues) {
  Kernels* cpu = CpuKernels();
  int checked = 0;
  for (const std::vector<float>& row : Rows()) {
    const auto n = static_cast<int64_t>(row.size());
    const std::vector<double> values(row.begin(), row.end());
    const Tensor x = testing::FromDoubles(values, {1, n}, DType::kFloat32);
    Tensor y = Unwrap(Tensor::Empty({1, n}, DType::kFloat32));
    Tensor logy = Unwrap(Tensor::Empty({1, n}, DType::kFloat32));
    ASSERT_TRUE(cpu->Softmax(x, y, /*log=*/false).ok());
    ASSERT_TRUE(cpu->Softmax(x, logy, /*log=*/true).ok());
    const Tensor target = testing::FromDoubles({0.0}, {1}, DType::kInt64);
    Tensor losses = Unwrap(Tensor::Empty({1}, DType::kFloat32));
    Tensor valid = Unwrap(Tensor::Empty({1}, DType::kFloat32));
    Tensor lse = Unwrap(Tensor::Empty({1}, DType::kFloat32));
    ASSERT_TRUE(cpu->CrossEntropy(x, target, /*ignore_index=*/-100, losses, valid, lse).ok());
    const std::vector<double> want_y = testing::Values(y), want_logy = testing::Values(logy);
    const double want_lse = testing::Values(lse)[0];
    for (int threads : {32, 64, 256, 1024}) {
      const std::string what = absl::StrCat(RowString(row), ", ", threads, " threads");
      const MaxSum ms = BlockState(row, threads);
      EXPECT_TRUE(Same(LogSumExp(ms), want_lse)) << what << ": logsumexp " << LogSumExp(ms) << ", CPU " << want_lse;
      const float inv = 1.0f / ms.s, log_s = logf(ms.s);
      for (int64_t j = 0; j < n; ++j) {
        const float got = expf(row[j] - ms.m) * inv, got_log = (row[j] - ms.m) - log_s;
        ASSERT_TRUE(Same(got, want_y[j])) << what << ": softmax[" << j << "] " << got << ", CPU " << want_y[j];
        ASSERT_TRUE(Same(got_log, want_logy[j]))
            << what << ": log_softmax[" << j << "] " << got_log << ", CPU " << want_logy[j];
      }
      ++checked;
    }
  }
  EXPECT_GT(checked, 1000);
}

// The state's own contract, one element at a time and merged in both orders.
TEST(MaxSumTest, NaNIsStickyAndInfinitiesAreTheirOwnLogSumExp) {
  const MaxSum one = MaxSumAdd(EmptyMaxSum(), 2.0f);
  EXPECT_EQ(one.m, 2.0f);
  EXPECT_EQ(one.s, 1.0f);
  const MaxSum nan = MaxSumAdd(EmptyMaxSum(), kNaN);
  const MaxSum inf = MaxSumAdd(one, kInf);
  EXPECT_EQ(LogSumExp(inf), kInf);
  EXPECT_TRUE(std::isnan(inf.s));
  for (const MaxSum& other : {one, inf, EmptyMaxSum(), MaxSumAdd(EmptyMaxSum(), -kInf)}) {
    EXPECT_TRUE(std::isnan(LogSumExp(MaxSumMerge(nan, other))));
    EXPECT_TRUE(std::isnan(LogSumExp(MaxSumMerge(other, nan))));
    EXPECT_TRUE(std::isnan(LogSumExp(MaxSumAdd(other, kNaN))));
  }
  EXPECT_TRUE(std::isnan(LogSumExp(MaxSumAdd(nan, 1.0f))));
  EXPECT_EQ(LogSumExp(MaxSumAdd(EmptyMaxSum(), -kInf)), -kInf);
  EXPECT_EQ(LogSumExp(EmptyMaxSum()), -kInf);
  const MaxSum two = MaxSumMerge(one, MaxSumAdd(EmptyMaxSum(), 2.0f));
  EXPECT_FLOAT_EQ(LogSumExp(two), 2.0f + std::log(2.0f));
}

}  // namespace
}  // namespace dtensor
