// Bad input to every op family gives a clear absl::Status (never an abort): the code is
// InvalidArgument (or Unimplemented for storage-only dtypes) and the message starts with the
// operation and names the offending shapes or dtypes.
#include <string>
#include <vector>

#include "dtensor/ops/ops.h"
#include "gtest/gtest.h"
#include "tests/testing/test_util.h"

namespace dtensor {
namespace {

using testing::Unwrap;

Tensor F32(IntSpan shape) { return testing::Random(shape, DType::kFloat32, 1); }

// EXPECTs `s` to be InvalidArgument whose message contains every string of `parts`.
void ExpectInvalid(const absl::Status& s, std::vector<std::string> parts) {
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  for (const std::string& p : parts) EXPECT_NE(s.message().find(p), std::string::npos) << "'" << p << "' not in " << s;
}

TEST(OpsErrorsTest, ElementwiseShapeAndDTypeMismatch) {
  ExpectInvalid(Add(F32({3, 2}), F32({3})).status(), {"[Add]", "[3, 2]", "[3]"});
  ExpectInvalid(Mul(F32({2}), testing::Random({2}, DType::kBFloat16, 2)).status(), {"[Mul]", "float32", "bfloat16"});
  ExpectInvalid(Add_(F32({2}), F32({3})), {"[Add_]", "[3]", "[2]"});
  ExpectInvalid(Exp(Unwrap(Arange(3, DType::kInt64))).status(), {"[Exp]", "int64"});
  ExpectInvalid(UnaryBackward(UnaryOp::kGelu, F32({2, 3}), F32({3, 2})).status(), {"[UnaryBackward]", "[2, 3]"});
  auto f8 = Unwrap(Cast(F32({2}), DType::kFloat8E4M3));
  EXPECT_TRUE(absl::IsUnimplemented(Add(f8, f8).status()));
}

TEST(OpsErrorsTest, OutOfRangeDims) {
  ExpectInvalid(Sum(F32({2, 3}), {2}).status(), {"[Sum]", "dim 2"});
  ExpectInvalid(Softmax(F32({2, 3}), -3).status(), {"[Softmax]", "dim -3"});
  ExpectInvalid(Cat(std::vector<Tensor>{F32({2})}, 1).status(), {"[Cat]", "dim 1"});
  ExpectInvalid(Max(Unwrap(Tensor::Empty({0, 3}, DType::kFloat32)), {0}).status(), {"[Max]", "empty"});
}

TEST(OpsErrorsTest, MatmulShapes) {
  ExpectInvalid(Matmul(F32({3, 4}), F32({5, 2})).status(), {"[Matmul]", "[3, 4]", "[5, 2]"});
  ExpectInvalid(Matmul(F32({4}), F32({4, 2})).status(), {"[Matmul]", "[4]"});
  ExpectInvalid(Matmul(F32({2, 3, 4}), F32({3, 4, 5})).status(), {"[Matmul]", "[2]", "[3]"});
  Tensor out = Unwrap(Tensor::Empty({3, 3}, DType::kFloat32));
  ExpectInvalid(MatmulInto(F32({3, 4}), F32({4, 2}), out), {"[MatmulInto]", "[3, 2]", "[3, 3]"});
}

TEST(OpsErrorsTest, NormEmbeddingLossAttentionOptimizer) {
  ExpectInvalid(LayerNorm(F32({2, 5}), F32({4}), Tensor()).status(), {"[LayerNorm]", "[4]", "[2, 5]"});
  ExpectInvalid(RmsNorm(F32({2, 5}), F32({5, 1})).status(), {"[RmsNorm]", "[5, 1]"});
  ExpectInvalid(Embedding(F32({10, 4}), F32({3})).status(), {"[Embedding]", "float32"});
  Tensor ids = Unwrap(Tensor::FromVector<int64_t>({1, 12}, {2}));
  ExpectInvalid(Embedding(F32({10, 4}), ids).status(), {"[Embedding]", "12"});
  ExpectInvalid(CrossEntropy(F32({3, 7}), Unwrap(Arange(2, DType::kInt64))).status(),
                {"[CrossEntropy]", "[3, 7]", "[2]"});
  ExpectInvalid(CausalAttention(F32({1, 2, 3, 4}), F32({1, 2, 3, 4}), F32({1, 2, 4, 4})).status(),
                {"[CausalAttention]", "[1, 2, 4, 4]"});
  Tensor p = F32({4});
  Tensor m = Unwrap(Zeros({4}, DType::kFloat32)), v = Unwrap(Zeros({4}, DType::kFloat32));
  ExpectInvalid(AdamWStep_(p, F32({5}), m, v, AdamWParams{}), {"[AdamW]", "[5]"});
  AdamWParams bad;
  bad.beta1 = 1.5f;
  ExpectInvalid(AdamWStep_(p, F32({4}), m, v, bad), {"[AdamW]", "1.5"});
}

TEST(OpsErrorsTest, UndefinedTensorsAndBadRandomSpecs) {
  ExpectInvalid(Add(Tensor(), F32({2})).status(), {"[Add]", "undefined"});
  ExpectInvalid(Contiguous(Tensor()).status(), {"[Contiguous]"});
  ExpectInvalid(RandomUniform({2}, DType::kFloat32, 1, 1.0, 0.0).status(), {"[FillRandom]", "empty"});
  ExpectInvalid(RandomNormal({2}, DType::kInt32, 1).status(), {"[FillRandom]", "int32"});
  Tensor block = Unwrap(Tensor::Empty({2, 2}, DType::kFloat32));
  ExpectInvalid(FillRandom_(block, RandomSpec{}, {3, 3}, {2, 0}), {"[FillRandom]", "[3, 3]"});
}

}  // namespace
}  // namespace dtensor
