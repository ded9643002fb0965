// Views, shapes and errors of the local Tensor, checked element by element against index
// arithmetic done independently in the test.
#include "dtensor/tensor/tensor.h"

#include <numeric>

#include "dtensor/ops/ops.h"
#include "gtest/gtest.h"
#include "tests/testing/test_util.h"

namespace dtensor {
namespace {

using testing::Unwrap;
using testing::Values;

// An int64 tensor holding 0, 1, 2, ... in row-major order.
Tensor Iota(IntSpan shape) {
  std::vector<int64_t> v(static_cast<size_t>(NumElements(shape)));
  std::iota(v.begin(), v.end(), 0);
  return Unwrap(Tensor::FromVector<int64_t>(v, shape));
}

TEST(TensorTest, EmptyHasContiguousStrides) {
  Tensor t = Unwrap(Tensor::Empty({2, 3, 4}, DType::kBFloat16));
  EXPECT_EQ(t.dim(), 3);
  EXPECT_EQ(t.numel(), 24);
  EXPECT_EQ(t.nbytes(), 48u);
  EXPECT_EQ(std::vector<int64_t>(t.strides().begin(), t.strides().end()), (std::vector<int64_t>{12, 4, 1}));
  EXPECT_TRUE(t.is_contiguous());
  EXPECT_EQ(t.ToString(), "Tensor(bfloat16, cpu, [2, 3, 4])");
}

TEST(TensorTest, ZeroDimAndEmptyTensors) {
  Tensor s = Unwrap(Tensor::Empty({}, DType::kFloat32));
  EXPECT_EQ(s.dim(), 0);
  EXPECT_EQ(s.numel(), 1);
  Tensor e = Unwrap(Tensor::Empty({0, 4}, DType::kFloat32));
  EXPECT_EQ(e.numel(), 0);
  EXPECT_TRUE(e.is_contiguous());
  auto pieces = Unwrap(e.Chunk(3, 0));
  EXPECT_EQ(pieces.size(), 3u);  // torch.chunk of an empty dim: `chunks` empty pieces
}

// A 0-d tensor takes dim 0 / -1 only, as PyTorch: transpose and squeeze of those dims give the
// tensor itself, any other dim is an error (torch: "Dimension out of range (expected to be in
// range of [-1, 0], but got 5)"); narrow, split, chunk and select refuse a 0-d tensor.
TEST(TensorTest, ZeroDimTakesDimZeroOrMinusOneOnly) {
  const Tensor s = Unwrap(Tensor::FromVector<int64_t>({7}, {}));
  for (auto [a, b] : {std::pair<int64_t, int64_t>{0, 0}, {-1, -1}, {0, -1}}) {
    const Tensor t = Unwrap(s.Transpose(a, b));
    EXPECT_EQ(t.dim(), 0);
    EXPECT_EQ(Unwrap(t.ToVector<int64_t>()), std::vector<int64_t>{7});
  }
  EXPECT_EQ(Unwrap(s.Squeeze(0)).dim(), 0);
  EXPECT_EQ(Unwrap(s.Squeeze(-1)).dim(), 0);
  for (int64_t bad : {1, 5, -2}) {
    EXPECT_TRUE(absl::IsInvalidArgument(s.Transpose(0, bad).status())) << bad;
    EXPECT_TRUE(absl::IsInvalidArgument(s.Transpose(bad, bad).status())) << bad;
    EXPECT_TRUE(absl::IsInvalidArgument(s.Squeeze(bad).status())) << bad;
  }
  EXPECT_TRUE(absl::IsInvalidArgument(s.Narrow(0, 0, 1).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(s.Split(1, 0).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(s.Chunk(1, 0).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(s.Select(0, 0).status()));
}

// ToVector reads what a tensor shows, row-major, through any strides, and refuses a T that is
// not its dtype. The expectation is written out by hand.
TEST(TensorTest, ToVectorReadsRowMajorThroughStrides) {
  const Tensor x = testing::Unwrap(Tensor::FromVector<int64_t>({0, 1, 2, 3, 4, 5}, {2, 3}));
  EXPECT_EQ(testing::Unwrap(x.ToVector<int64_t>()), (std::vector<int64_t>{0, 1, 2, 3, 4, 5}));
  const Tensor xt = testing::Unwrap(x.Transpose(0, 1));  // [3, 2]
  EXPECT_EQ(testing::Unwrap(xt.ToVector<int64_t>()), (std::vector<int64_t>{0, 3, 1, 4, 2, 5}));
  const Tensor col = testing::Unwrap(xt.Narrow(1, 1, 1));  // [3, 1]: 3, 4, 5
  EXPECT_EQ(testing::Unwrap(col.ToVector<int64_t>()), (std::vector<int64_t>{3, 4, 5}));
  const absl::StatusOr<std::vector<float>> wrong = x.ToVector<float>();
  EXPECT_TRUE(absl::IsInvalidArgument(wrong.status())) << wrong.status();
  const Tensor empty = testing::Unwrap(Tensor::Empty({0, 3}, DType::kFloat32));
  EXPECT_TRUE(testing::Unwrap(empty.ToVector<float>()).empty());
}

TEST(TensorTest, BadShapesAreErrors) {
  auto neg = Tensor::Empty({2, -1}, DType::kFloat32);
  ASSERT_FALSE(neg.ok());
  EXPECT_TRUE(absl::IsInvalidArgument(neg.status()));
  EXPECT_NE(neg.status().message().find("[Empty]"), std::string::npos);
  EXPECT_NE(neg.status().message().find("[2, -1]"), std::string::npos);
  auto too_many = Tensor::Empty({1, 1, 1, 1, 1, 1, 1, 1, 1}, DType::kFloat32);
  EXPECT_TRUE(absl::IsInvalidArgument(too_many.status()));
  // An element count that would wrap int64 (2^62 x 32 is 0 after wrapping: a 0-byte buffer).
  auto wraps = Tensor::Empty({int64_t{1} << 62, 32}, DType::kFloat32);
  EXPECT_TRUE(absl::IsInvalidArgument(wraps.status())) << wraps.status();
  EXPECT_NE(wraps.status().message().find("2^60 elements"), std::string::npos) << wraps.status();
  EXPECT_TRUE(Tensor::Empty({int64_t{1} << 62, 0}, DType::kFloat32).ok());  // empty whatever the other sizes
}

TEST(TensorTest, CudaWithoutDeviceIsFailedPrecondition) {
  if (CudaDeviceCount() > 0) GTEST_SKIP() << "a CUDA device is visible; this checks the no-GPU error path";
  auto t = Tensor::Empty({4}, DType::kFloat32, Device::Cuda(0));
  ASSERT_FALSE(t.ok());
  EXPECT_TRUE(absl::IsFailedPrecondition(t.status())) << t.status();
  EXPECT_NE(t.status().message().find("cuda:0"), std::string::npos);
}

TEST(TensorTest, NarrowSliceSelect) {
  Tensor x = Iota({4, 5});
  Tensor n = Unwrap(x.Narrow(1, 1, 3));
  EXPECT_EQ(Values(n), (std::vector<double>{1, 2, 3, 6, 7, 8, 11, 12, 13, 16, 17, 18}));
  EXPECT_FALSE(n.is_contiguous());
  Tensor s = Unwrap(x.Slice(0, 1, 100, 2));  // rows 1 and 3; end clamps
  EXPECT_EQ(Values(s), (std::vector<double>{5, 6, 7, 8, 9, 15, 16, 17, 18, 19}));
  Tensor neg = Unwrap(x.Slice(-1, -2, 5));  // last two columns
  EXPECT_EQ(Values(neg), (std::vector<double>{3, 4, 8, 9, 13, 14, 18, 19}));
  Tensor sel = Unwrap(x.Select(1, -1));
  EXPECT_EQ(Values(sel), (std::vector<double>{4, 9, 14, 19}));
  EXPECT_TRUE(absl::IsInvalidArgument(x.Narrow(1, 3, 3).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(x.Select(0, 4).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(x.Narrow(2, 0, 1).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(x.Slice(0, 0, 2, 0).status()));
}

// torch.chunk: pieces of ceil(n/k); 5 over 4 gives 2,2,1 (three pieces), 10 over 4 gives 3,3,3,1.
TEST(TensorTest, ChunkMatchesTorchChunk) {
  struct Case {
    int64_t n, k;
    std::vector<int64_t> sizes;
  };
  for (const Case& c : {Case{5, 4, {2, 2, 1}}, Case{10, 4, {3, 3, 3, 1}}, Case{4, 4, {1, 1, 1, 1}}, Case{1, 3, {1}},
                        Case{7, 1, {7}}, Case{6, 4, {2, 2, 2}}}) {
    Tensor x = Iota({c.n});
    auto pieces = Unwrap(x.Chunk(c.k, 0));
    std::vector<int64_t> sizes;
    int64_t start = 0;
    for (const Tensor& p : pieces) {
      sizes.push_back(p.size(0));
      std::vector<double> want(static_cast<size_t>(p.size(0)));
      std::iota(want.begin(), want.end(), static_cast<double>(start));
      EXPECT_EQ(Values(p), want);
      start += p.size(0);
    }
    EXPECT_EQ(sizes, c.sizes) << c.n << " over " << c.k;
  }
  EXPECT_TRUE(absl::IsInvalidArgument(Iota({3}).Chunk(0, 0).status()));
}

TEST(TensorTest, SplitAndSplitWithSizes) {
  Tensor x = Iota({3, 7});
  auto parts = Unwrap(x.Split(3, 1));
  ASSERT_EQ(parts.size(), 3u);
  EXPECT_EQ(parts[2].size(1), 1);
  EXPECT_EQ(Values(parts[2]), (std::vector<double>{6, 13, 20}));
  auto sized = Unwrap(x.SplitWithSizes({1, 2}, 0));
  ASSERT_EQ(sized.size(), 2u);
  EXPECT_EQ(Values(sized[0]), (std::vector<double>{0, 1, 2, 3, 4, 5, 6}));
  auto bad = x.SplitWithSizes({1, 1}, 0);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("sum to 2"), std::string::npos) << bad.status();
}

TEST(TensorTest, TransposePermuteMatchIndexArithmetic) {
  Tensor x = Iota({2, 3, 4});
  Tensor p = Unwrap(x.Permute({2, 0, 1}));  // p[k][i][j] = x[i][j][k] = 12i + 4j + k
  std::vector<double> want;
  for (int k = 0; k < 4; ++k)
    for (int i = 0; i < 2; ++i)
      for (int j = 0; j < 3; ++j) want.push_back(12 * i + 4 * j + k);
  EXPECT_EQ(Values(p), want);
  Tensor t = Unwrap(x.Transpose(0, -1));
  EXPECT_EQ(t.size(0), 4);
  EXPECT_EQ(t.stride(0), 1);
  EXPECT_TRUE(absl::IsInvalidArgument(x.Permute({0, 0, 1}).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(x.Permute({0, 1}).status()));
}

TEST(TensorTest, ViewFollowsStrideRules) {
  Tensor x = Iota({2, 3, 4});
  Tensor v = Unwrap(x.View({6, -1}));
  EXPECT_EQ(v.size(1), 4);
  EXPECT_EQ(Values(v), Values(x));
  // A transposed tensor can be viewed only where the merged dims stay contiguous together.
  Tensor t = Unwrap(x.Transpose(1, 2));  // [2, 4, 3]
  auto merged = t.View({8, 3});
  EXPECT_FALSE(merged.ok());
  EXPECT_TRUE(absl::IsInvalidArgument(merged.status()));
  Tensor split = Unwrap(t.View({2, 2, 2, 3}));  // splitting a dim is always possible
  EXPECT_EQ(Values(split), Values(t));
  // Reshape copies when a view is impossible, and keeps row-major order of the logical tensor.
  Tensor r = Unwrap(Reshape(t, {8, 3}));
  EXPECT_EQ(Values(r), Values(t));
  EXPECT_TRUE(absl::IsInvalidArgument(x.View({5, -1}).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(x.View({-1, -1}).status()));
  Tensor flat = Unwrap(Unwrap(x.Narrow(0, 1, 1)).View({12}));  // elements 12..23
  Tensor one = Unwrap(Unwrap(flat.Narrow(0, 5, 1)).View({}));
  EXPECT_EQ(one.dim(), 0);
  EXPECT_EQ(Values(one), (std::vector<double>{17}));
}

TEST(TensorTest, ExpandUnsqueezeSqueeze) {
  Tensor x = Iota({3, 1});
  Tensor e = Unwrap(x.Expand({2, 3, 4}));
  EXPECT_EQ(e.stride(0), 0);
  EXPECT_EQ(e.stride(2), 0);
  std::vector<double> want;
  for (int a = 0; a < 2; ++a)
    for (int i = 0; i < 3; ++i)
      for (int j = 0; j < 4; ++j) want.push_back(i);
  EXPECT_EQ(Values(e), want);
  EXPECT_TRUE(absl::IsInvalidArgument(x.Expand({2, 4}).status()));
  Tensor u = Unwrap(x.Unsqueeze(0));
  EXPECT_EQ(u.dim(), 3);
  EXPECT_EQ(u.size(0), 1);
  Tensor sq = Unwrap(u.Squeeze(-1));
  EXPECT_EQ(std::vector<int64_t>(sq.shape().begin(), sq.shape().end()), (std::vector<int64_t>{1, 3}));
  EXPECT_EQ(Unwrap(sq.Squeeze(1)).dim(), 2);  // size 3: unchanged, as torch.squeeze(dim)
}

TEST(TensorTest, AsStridedChecksBounds) {
  Tensor x = Iota({10});
  Tensor w = Unwrap(x.AsStrided({4, 3}, {2, 1}, 1));  // sliding windows
  EXPECT_EQ(Values(w), (std::vector<double>{1, 2, 3, 3, 4, 5, 5, 6, 7, 7, 8, 9}));
  EXPECT_TRUE(absl::IsInvalidArgument(x.AsStrided({4, 3}, {3, 1}, 1).status()));
}

TEST(TensorTest, ViewsShareStorage) {
  Tensor x = Unwrap(Zeros({4, 4}, DType::kFloat32));
  Tensor row = Unwrap(x.Select(0, 2));
  ASSERT_TRUE(Fill_(row, 7.0).ok());
  auto v = Values(x);
  for (int i = 0; i < 16; ++i) EXPECT_EQ(v[i], i / 4 == 2 ? 7.0 : 0.0) << i;
}

TEST(TensorTest, FromBlobBorrowsMemory) {
  std::vector<float> buf = {1, 2, 3, 4, 5, 6};
  Tensor t = Unwrap(Tensor::FromBlob(buf.data(), {3, 2}, DType::kFloat32, Device::Cpu(), {1, 3}));
  EXPECT_EQ(Values(t), (std::vector<double>{1, 4, 2, 5, 3, 6}));
  buf[0] = 10;
  EXPECT_EQ(Values(t)[0], 10.0);
}

TEST(TensorTest, BroadcastShapes) {
  EXPECT_EQ(Unwrap(BroadcastShapes("t", {3, 1, 5}, {4, 1})), (Shape{3, 4, 5}));
  EXPECT_EQ(Unwrap(BroadcastShapes("t", {}, {2})), (Shape{2}));
  auto bad = BroadcastShapes("Add", {3, 2}, {3});
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("[Add]"), std::string::npos);
}

// An empty view at an offset into an empty tensor (a shard of a [0, 3] tensor, narrowed past
// row 0) has no memory to point into: its address is null, never null + offset.
TEST(TensorTest, EmptyViewAtAnOffsetHasNoAddress) {
  Tensor t = testing::Unwrap(Tensor::Empty({0, 3}, DType::kFloat32));
  Tensor v = testing::Unwrap(t.Narrow(1, 2, 1));
  EXPECT_EQ(v.numel(), 0);
  EXPECT_EQ(v.raw_data(), nullptr);
  EXPECT_EQ(v.data<float>(), nullptr);
}

// Release / Reallocate (FSDP's resize_(0) / resize_(n)): the memory goes back to the
// allocator while views keep their Storage, and comes back shared by every view.
TEST(StorageTest, ReleaseAndReallocateKeepViews) {
  Allocator& alloc = DefaultAllocator(Device::Cpu());
  Tensor t = testing::Unwrap(Tensor::Empty({256, 16}, DType::kFloat32));
  Tensor row = testing::Unwrap(t.Select(0, 3));
  const int64_t in_use = alloc.Stats().bytes_in_use;
  ASSERT_TRUE(t.storage()->Release().ok());
  EXPECT_TRUE(row.storage()->released());
  EXPECT_EQ(row.storage()->data(), nullptr);
  EXPECT_EQ(row.raw_data(), nullptr);  // not null + 3 rows (undefined; UBSan found it)
  EXPECT_EQ(alloc.Stats().bytes_in_use, in_use - 256 * 16 * 4);
  ASSERT_TRUE(t.storage()->Reallocate().ok());
  EXPECT_FALSE(t.storage()->released());
  EXPECT_EQ(alloc.Stats().bytes_in_use, in_use);
  ASSERT_TRUE(Fill_(t, 2.5).ok());
  EXPECT_EQ(testing::Values(row), std::vector<double>(16, 2.5));
  EXPECT_EQ(static_cast<char*>(row.raw_data()) - static_cast<char*>(t.raw_data()), 3 * 16 * 4);

  float borrowed[4] = {};
  Tensor b = testing::Unwrap(Tensor::FromBlob(borrowed, {4}, DType::kFloat32, Device::Cpu()));
  EXPECT_TRUE(absl::IsFailedPrecondition(b.storage()->Release()));
  EXPECT_TRUE(absl::IsFailedPrecondition(b.storage()->Reallocate()));
}

}  // namespace
}  // namespace dtensor
