// Loss parallel: cross-entropy of vocab-sharded logits (Shard(-1)) with replicated targets
// gives the single-rank loss and gradient without gathering the logits (the chosen strategy
// moves nothing), alone and combined with batch sharding on a 2x2 mesh, from float32 and from
// bfloat16 logits.
#include <thread>

#include "dtensor/autograd/ops.h"
#include "dtensor/collectives/threads/threads_communicator.h"
#include "gtest/gtest.h"
#include "tests/testing/test_util.h"

namespace dtensor {
namespace {

using testing::Unwrap;

struct Case {
  Tensor logits, targets;
  std::vector<double> loss, grad;
};

Case MakeCase(DType dtype) {
  Case c;
  c.logits = testing::Random({3, 5, 11}, dtype, 7, -3, 3);
  std::vector<int64_t> t;
  for (int i = 0; i < 15; ++i) t.push_back(i % 4 == 3 ? -100 : (i * 7) % 11);  // some ignored
  c.targets = Unwrap(Tensor::FromVector<int64_t>(t, {3, 5}));
  Variable l = Variable::Leaf(Unwrap(Clone(c.logits)), true);
  Variable loss = Unwrap(CrossEntropy(l, Variable::Constant(c.targets)));
  EXPECT_TRUE(Backward(loss).ok());
  c.loss = testing::Values(loss.value().local());
  c.grad = testing::Values(l.grad().local());
  return c;
}

// bfloat16 logits: the loss and its reductions in float32 on both paths (the sharded one once
// rounded them to bfloat16, 4.15625 where one rank gave 4.146594), the gradient rounded once.
void Check(int world, std::vector<int64_t> mesh_shape, Layout logits_layout, Layout targets_layout,
           DType dtype = DType::kFloat32) {
  const Case ref = MakeCase(dtype);
  const testing::Tolerance grad_tol =
      dtype == DType::kFloat32 ? testing::Tolerance{1e-5, 1e-6} : testing::Tolerance{1e-2, 1e-3};
  auto comms = Unwrap(MakeThreadGroup(world, absl::Seconds(20)));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      DeviceMesh mesh = Unwrap(DeviceMesh::Create(*comms[static_cast<size_t>(r)], mesh_shape));
      DTensor lg = Unwrap(DTensor::Distribute(ref.logits, mesh, logits_layout, {.src_rank = std::nullopt}));
      DTensor tg = Unwrap(DTensor::Distribute(ref.targets, mesh, targets_layout, {.src_rank = std::nullopt}));
      CommCounter counter;
      SetCommCounter(mesh, &counter);
      Variable l = Variable::Leaf(Value(lg), true);
      Variable loss = Unwrap(CrossEntropy(l, Variable::Constant(Value(tg))));
      ASSERT_TRUE(Backward(loss).ok());
      SetCommCounter(mesh, nullptr);
      // Only [rows] vectors and counts move: max, sum of exponentials, target logit (and the
      // global count when the batch is sharded) — never logits-sized data.
      EXPECT_EQ(counter.total_calls(), counter.calls(CommKind::kAllReduce)) << counter.ToString();
      EXPECT_GE(counter.calls(CommKind::kAllReduce), 3);
      EXPECT_LE(counter.total_bytes(), 4 * 15 * 3 + 16) << counter.ToString();
      DTensor lr = Unwrap(loss.value().dtensor().Redistribute(
          Layout(absl::InlinedVector<Placement, 4>(mesh_shape.size(), Replicate()))));
      testing::ExpectNear(testing::Values(lr.ToLocal()), ref.loss, {1e-5, 1e-6}, "loss");
      EXPECT_EQ(l.grad().dtensor().layout(), lg.layout()) << "the gradient keeps the logits' layout";
      testing::ExpectNear(testing::Values(Unwrap(l.grad().dtensor().FullTensor())), ref.grad, grad_tol, "dlogits");
    });
  }
  for (auto& t : threads) t.join();
}

TEST(LossParallelTest, VocabShardedOverTwoAndFourRanks) {
  Check(2, {2}, {Shard(2)}, {Replicate()});
  Check(4, {4}, {Shard(2)}, {Replicate()});  // 11 over 4: 3, 3, 3, 2
}

TEST(LossParallelTest, BatchAndVocabShardedOn2x2) { Check(4, {2, 2}, {Shard(0), Shard(2)}, {Shard(0), Replicate()}); }

TEST(LossParallelTest, Bfloat16LogitsGiveTheFloat32LossOfOneRank) {
  Check(2, {2}, {Shard(2)}, {Replicate()}, DType::kBFloat16);
  Check(4, {2, 2}, {Shard(0), Shard(2)}, {Shard(0), Replicate()}, DType::kBFloat16);
}

}  // namespace
}  // namespace dtensor
