// Layout ops of the public API (Cat, Stack, Reshape, Contiguous, Clone, To, Cast, Arange,
// Copy_ with broadcasting and overlap), checked element by element against index arithmetic.
#include <numeric>
#include <vector>

#include "dtensor/ops/ops.h"
#include "gtest/gtest.h"
#include "tests/testing/test_util.h"

namespace dtensor {
namespace {

using testing::Unwrap;
using testing::Values;

Tensor Iota(IntSpan shape, DType dtype = DType::kFloat32, double start = 0) {
  std::vector<double> v(static_cast<size_t>(NumElements(shape)));
  std::iota(v.begin(), v.end(), start);
  return testing::FromDoubles(v, shape, dtype);
}

TEST(OpsLayoutTest, CatAlongEachDimMatchesIndexArithmetic) {
  for (DType dt : {DType::kFloat32, DType::kBFloat16, DType::kInt64}) {
    Tensor a = Iota({2, 3, 1}, dt), b = Iota({2, 3, 4}, dt, 100);
    Tensor c = Unwrap(Cat(std::vector<Tensor>{a, b}, -1));
    ASSERT_EQ(c.size(2), 5);
    const auto va = Values(a), vb = Values(b), vc = Values(c);
    for (int i = 0; i < 2; ++i)
      for (int j = 0; j < 3; ++j)
        for (int k = 0; k < 5; ++k) {
          const double want = k == 0 ? va[i * 3 + j] : vb[(i * 3 + j) * 4 + (k - 1)];
          EXPECT_EQ(vc[(i * 3 + j) * 5 + k], want) << i << j << k;
        }
    // dim 0 of non-contiguous pieces (one transposed) and an empty piece.
    Tensor t = Unwrap(Iota({3, 2}, dt, 50).Transpose(0, 1));  // [2, 3]
    Tensor e = Unwrap(Tensor::Empty({0, 3}, dt));
    Tensor d = Unwrap(Cat(std::vector<Tensor>{Iota({1, 3}, dt), e, t}, 0));
    EXPECT_EQ(Values(d), (std::vector<double>{0, 1, 2, 50, 52, 54, 51, 53, 55}));
  }
}

TEST(OpsLayoutTest, StackInsertsADim) {
  Tensor a = Iota({2, 3}), b = Iota({2, 3}, DType::kFloat32, 10);
  Tensor s1 = Unwrap(Stack(std::vector<Tensor>{a, b}, 1));  // [2, 2, 3]: s1[i][k][j]
  ASSERT_EQ(s1.size(1), 2);
  const auto v = Values(s1);
  for (int i = 0; i < 2; ++i)
    for (int k = 0; k < 2; ++k)
      for (int j = 0; j < 3; ++j) EXPECT_EQ(v[(i * 2 + k) * 3 + j], i * 3 + j + 10 * k);
  Tensor s_last = Unwrap(Stack(std::vector<Tensor>{a, b}, -1));  // [2, 3, 2]
  EXPECT_EQ(s_last.size(2), 2);
  EXPECT_EQ(Values(s_last)[1], 10.0);
}

TEST(OpsLayoutTest, CatAndStackErrorsNameTheShapes) {
  auto bad = Cat(std::vector<Tensor>{Iota({2, 3}), Iota({2, 4})}, 0);
  ASSERT_FALSE(bad.ok());
  EXPECT_TRUE(absl::IsInvalidArgument(bad.status()));
  EXPECT_NE(bad.status().message().find("[Cat]"), std::string::npos) << bad.status();
  EXPECT_NE(bad.status().message().find("[2, 4]"), std::string::npos) << bad.status();
  EXPECT_TRUE(absl::IsInvalidArgument(Cat(std::vector<Tensor>{Iota({2}), Iota({2}, DType::kInt32)}, 0).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(Cat(std::vector<Tensor>{}, 0).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(Cat(std::vector<Tensor>{Iota({2})}, 1).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(Stack(std::vector<Tensor>{Iota({2}), Iota({3})}, 0).status()));
}

TEST(OpsLayoutTest, ReshapeContiguousCloneCast) {
  Tensor x = Iota({3, 4});
  Tensor t = Unwrap(x.Transpose(0, 1));  // [4, 3], not contiguous
  Tensor c = Unwrap(Contiguous(t));
  EXPECT_TRUE(c.is_contiguous());
  EXPECT_NE(c.raw_data(), t.raw_data());
  EXPECT_EQ(Values(c), Values(t));
  EXPECT_EQ(Unwrap(Contiguous(x)).raw_data(), x.raw_data());  // already contiguous: no copy
  Tensor r = Unwrap(Reshape(t, {2, -1}));
  EXPECT_EQ(Values(r), Values(t));
  Tensor clone = Unwrap(Clone(x));
  ASSERT_TRUE(Fill_(clone, 0).ok());
  EXPECT_EQ(Values(x)[5], 5.0);  // the clone owns its memory
  Tensor h = Unwrap(Cast(Iota({5}, DType::kFloat32, 0.25), DType::kInt32));
  EXPECT_EQ(Values(h), (std::vector<double>{0, 1, 2, 3, 4}));  // truncation toward zero
  EXPECT_EQ(Unwrap(To(x, Device::Cpu())).raw_data(), x.raw_data());
  EXPECT_TRUE(absl::IsInvalidArgument(Reshape(x, {5, -1}).status()));
}

TEST(OpsLayoutTest, ArangeAndFull) {
  EXPECT_EQ(Values(Unwrap(Arange(5, DType::kInt64))), (std::vector<double>{0, 1, 2, 3, 4}));
  EXPECT_EQ(Values(Unwrap(Arange(3, DType::kBFloat16))), (std::vector<double>{0, 1, 2}));
  EXPECT_EQ(Values(Unwrap(Full({2}, 2.5, DType::kFloat16))), (std::vector<double>{2.5, 2.5}));
  EXPECT_TRUE(absl::IsInvalidArgument(Arange(-1, DType::kInt64).status()));
}

TEST(OpsLayoutTest, CopyBroadcastsAndHandlesOverlap) {
  Tensor dst = Unwrap(Zeros({2, 3}, DType::kFloat32));
  ASSERT_TRUE(Copy_(dst, Iota({3})).ok());
  EXPECT_EQ(Values(dst), (std::vector<double>{0, 1, 2, 0, 1, 2}));
  EXPECT_TRUE(absl::IsInvalidArgument(Copy_(dst, Iota({2}))));
  // Overlapping views of one buffer: dst = x[1:], src = x[:-1] (a shift), as a memmove would.
  Tensor x = Iota({6});
  ASSERT_TRUE(Copy_(Unwrap(x.Narrow(0, 1, 5)), Unwrap(x.Narrow(0, 0, 5))).ok());
  EXPECT_EQ(Values(x), (std::vector<double>{0, 0, 1, 2, 3, 4}));
}

TEST(OpsLayoutTest, CudaTargetsFailCleanlyWithoutAGpu) {
  if (CudaDeviceCount() > 0) GTEST_SKIP() << "a GPU is visible; the GPU suite covers transfers";
  auto moved = To(Iota({3}), Device::Cuda(0));
  ASSERT_FALSE(moved.ok());
  EXPECT_TRUE(absl::IsFailedPrecondition(moved.status())) << moved.status();
  EXPECT_TRUE(absl::IsFailedPrecondition(Zeros({2}, DType::kFloat32, Device::Cuda(0)).status()));
}

}  // namespace
}  // namespace dtensor
