// Embedding lookup and its scatter-add backward on the CPU backend against float64 references.
#include <cmath>
#include <string>
#include <vector>

#include "dtensor/ops/ops.h"
#include "gtest/gtest.h"
#include "tests/testing/test_util.h"

namespace dtensor {
namespace {

using testing::Unwrap;
using testing::Values;

constexpr DType kFloatTypes[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16};

// ids as a tensor of `dtype` (int32 or int64).
Tensor Ids(const std::vector<int64_t>& ids, IntSpan shape, DType dtype) {
  if (dtype == DType::kInt32) {
    std::vector<int32_t> v(ids.begin(), ids.end());
    return Unwrap(Tensor::FromVector<int32_t>(v, shape));
  }
  return Unwrap(Tensor::FromVector<int64_t>(ids, shape));
}

// Deterministic pseudo-random ids in [0, v), with repeats.
std::vector<int64_t> MakeIds(int64_t n, int64_t v, uint64_t seed) {
  std::vector<int64_t> ids;
  uint64_t s = seed * 2654435761u + 12345;
  for (int64_t i = 0; i < n; ++i) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    ids.push_back(static_cast<int64_t>((s >> 33) % static_cast<uint64_t>(v)));
  }
  return ids;
}

struct Case {
  int64_t v, c;
  Shape ids_shape;
};
const Case kCases[] = {{3, 1, {4}},   {3, 5, {2, 3}},  {101, 127, {17}},
                       {101, 5, {1}}, {50, 768, {64}}, {7, 3, {3, 1, 5}}};

TEST(CpuEmbeddingTest, ForwardCopiesRows) {
  for (DType d : kFloatTypes) {
    for (DType id_type : {DType::kInt32, DType::kInt64}) {
      for (const Case& k : kCases) {
        const Tensor w = testing::Random({k.v, k.c}, d, 1);
        const std::vector<int64_t> ids = MakeIds(NumElements(k.ids_shape), k.v, 2);
        const Tensor out = Unwrap(Embedding(w, Ids(ids, k.ids_shape, id_type)));
        Shape want = k.ids_shape;
        want.push_back(k.c);
        ASSERT_EQ(out.shape(), IntSpan(want));
        ASSERT_EQ(out.dtype(), d);
        const std::vector<double> wv = Values(w);
        std::vector<double> ref;
        for (int64_t id : ids) ref.insert(ref.end(), wv.begin() + id * k.c, wv.begin() + (id + 1) * k.c);
        EXPECT_EQ(Values(out), ref) << DTypeName(d) << " " << ShapeString(k.ids_shape) << " C " << k.c;
      }
    }
  }
}

TEST(CpuEmbeddingTest, ForwardFromNonContiguousWeight) {
  const Tensor w = testing::NonContiguous(testing::Random({6, 5}, DType::kFloat32, 3));
  ASSERT_FALSE(w.is_contiguous());
  const Tensor out = Unwrap(Embedding(w, Ids({5, 0, 5, 2}, {4}, DType::kInt64)));
  const std::vector<double> wv = Values(w);
  std::vector<double> ref;
  for (int64_t id : {5, 0, 5, 2}) ref.insert(ref.end(), wv.begin() + id * 5, wv.begin() + (id + 1) * 5);
  EXPECT_EQ(Values(out), ref);
}

TEST(CpuEmbeddingTest, OutOfRangeIdIsInvalidArgument) {
  const Tensor w = testing::Random({3, 4}, DType::kFloat32, 4);
  for (DType id_type : {DType::kInt32, DType::kInt64}) {
    for (int64_t bad : {int64_t{3}, int64_t{-1}, int64_t{1000}}) {
      const auto out = Embedding(w, Ids({0, 2, bad, 1}, {4}, id_type));
      ASSERT_FALSE(out.ok()) << bad;
      EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument);
      EXPECT_NE(out.status().message().find(std::to_string(bad)), std::string::npos) << out.status();
      EXPECT_EQ(out.status().message().rfind("[Embedding]", 0), 0u) << out.status();
    }
  }
}

TEST(CpuEmbeddingTest, BackwardAccumulatesRepeatedIds) {
  for (DType d : kFloatTypes) {
    for (DType id_type : {DType::kInt32, DType::kInt64}) {
      for (const Case& k : kCases) {
        const int64_t n = NumElements(k.ids_shape);
        const std::vector<int64_t> ids = MakeIds(n, k.v, 5);
        Shape dout_shape = k.ids_shape;
        dout_shape.push_back(k.c);
        const Tensor dout = testing::Random(dout_shape, d, 6);
        const Tensor dweight = testing::Random({k.v, k.c}, d, 7);  // existing values are kept
        std::vector<double> ref = Values(dweight);
        const std::vector<double> dv = Values(dout);
        for (int64_t i = 0; i < n; ++i) {
          for (int64_t j = 0; j < k.c; ++j) ref[ids[i] * k.c + j] += dv[i * k.c + j];
        }
        ASSERT_TRUE(EmbeddingBackward_(dweight, dout, Ids(ids, k.ids_shape, id_type)).ok());
        // bf16/f16 round after each add; allow for a few roundings of the largest sums.
        const testing::Tolerance tol = d == DType::kFloat32
                                           ? testing::Tolerance{1e-5, 1e-5}
                                           : testing::Tolerance{testing::Tol(d).rtol * 2, testing::Tol(d).atol * 4};
        testing::ExpectNear(Values(dweight), ref, tol,
                            std::string(DTypeName(d)) + " " + ShapeString(k.ids_shape) + " C " + std::to_string(k.c));
      }
    }
  }
}

TEST(CpuEmbeddingTest, BackwardAllIdsEqualAndDeterministic) {
  // Every row hits the same id: a long chain of adds into one row, split over column blocks.
  const int64_t n = 200, c = 300;
  const Tensor dout = testing::Random({n, c}, DType::kFloat32, 8);
  const Tensor ids = Ids(std::vector<int64_t>(n, 1), {n}, DType::kInt32);
  const Tensor d1 = Unwrap(Zeros({3, c}, DType::kFloat32));
  const Tensor d2 = Unwrap(Zeros({3, c}, DType::kFloat32));
  ASSERT_TRUE(EmbeddingBackward_(d1, dout, ids).ok());
  ASSERT_TRUE(EmbeddingBackward_(d2, dout, ids).ok());
  EXPECT_EQ(Values(d1), Values(d2));
  std::vector<double> ref(3 * c, 0.0);
  const std::vector<double> dv = Values(dout);
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < c; ++j) ref[c + j] += dv[i * c + j];
  }
  testing::ExpectNear(Values(d1), ref, {1e-5, 1e-5}, "all ids 1");
  // Rows are summed in id order: the float32 result equals a sequential float32 sum exactly.
  std::vector<float> seq(c, 0.0f);
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < c; ++j) seq[j] += static_cast<float>(dv[i * c + j]);
  }
  const std::vector<double> got = Values(d1);
  for (int64_t j = 0; j < c; ++j) ASSERT_EQ(got[c + j], static_cast<double>(seq[j])) << j;
}

TEST(CpuEmbeddingTest, BackwardSkipsOutOfRangeIds) {
  const Tensor dout = testing::Random({4, 3}, DType::kFloat32, 9);
  const Tensor dweight = testing::Random({2, 3}, DType::kFloat32, 10);
  std::vector<double> ref = Values(dweight);
  const std::vector<double> dv = Values(dout);
  for (int64_t j = 0; j < 3; ++j) ref[3 + j] += dv[3 + j];  // only row 1 (id 1) is in range
  ASSERT_TRUE(EmbeddingBackward_(dweight, dout, Ids({-1, 1, 2, 99}, {4}, DType::kInt64)).ok());
  testing::ExpectNear(Values(dweight), ref, {1e-6, 1e-6}, "skip");
}

}  // namespace
}  // namespace dtensor
