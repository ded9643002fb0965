// FullyShard (FSDP2) against the single-rank model: a small GPT whose dims do not divide by 3
// (and whose wpe leaves rank 3 of 4 an empty shard) trains to the same losses and parameters
// on 2, 3 and 4 thread ranks, with and without resharding after forward, as HSDP on 2x2, with
// gradient accumulation, and in bfloat16; each step issues exactly the collectives FSDP
// promises, of exactly the analytical sizes; parameters, gradients and optimizer state are
// 1/N per rank.
#include "dtensor/nn/parallel/fully_shard.h"

#include <cmath>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "dtensor/autograd/ops.h"
#include "dtensor/collectives/threads/threads_communicator.h"
#include "dtensor/nn/gpt.h"
#include "dtensor/nn/layers.h"
#include "dtensor/nn/optim.h"
#include "dtensor/nn/parallel/activation_checkpoint.h"
#include "dtensor/ops/ops.h"
#include "dtensor/tensor/status.h"
#include "gtest/gtest.h"
#include "tests/testing/test_util.h"

namespace dtensor {
namespace {

using testing::Unwrap;

// C = 20 and 4C = 80 over 3 ranks, V = 61 over 2, 3, 4; wpe has 6 rows: 2, 2, 2, 0 over 4.
nn::GPTConfig Config() { return {.vocab_size = 61, .block_size = 6, .n_layer = 2, .n_head = 2, .n_embd = 20}; }
constexpr int64_t kBatch = 6, kSeq = 6;

// The global batch of step `step` (the same on every rank; steps 0 and 2 see the same one).
std::pair<Tensor, Tensor> Batch(int step) {
  step %= 2;
  std::vector<int32_t> x, y;
  for (int64_t i = 0; i < kBatch * kSeq; ++i) {
    x.push_back(static_cast<int32_t>((i * 7 + step * 13 + i / 5) % 61));
    y.push_back(static_cast<int32_t>((i * 11 + step * 3 + 1) % 61));
  }
  return {Unwrap(Tensor::FromVector<int32_t>(x, {kBatch, kSeq})),
          Unwrap(Tensor::FromVector<int32_t>(y, {kBatch, kSeq}))};
}

struct TrainRun {
  std::vector<double> losses;                                       // per step
  std::vector<std::pair<std::string, std::vector<double>>> grads;   // full gradients of the first step
  std::vector<double> norms;                                        // ClipGradNorm's, with sgd_clip
  std::vector<std::pair<std::string, std::vector<double>>> params;  // full values after the last step
};

struct Spec {
  int world = 1;
  std::vector<int64_t> mesh_shape = {};  // empty: plain tensors, no FSDP
  nn::FsdpOptions options = {};
  int grad_accum = 1;
  bool sync_last_only = false;                          // with grad_accum: reduce on the last micro-batch only
  bool all_reduce_last_only = false;                    // HSDP with grad_accum: all-reduce on the last micro-batch only
  std::function<void(nn::GPT&)> after_shard = nullptr;  // e.g. FSDP2's setters, once sharded
  bool sgd_clip = false;                                // SGD with momentum after ClipGradNorm(0.5), instead of AdamW
  // Before each step, a forward with grad enabled whose backward never runs (a logged loss).
  bool extra_forward = false;
  // In this step, after the first micro-batch, a forward that fails (a hook on block 1); then
  // zero_grad and the step's micro-batches again.
  int fail_forward_step = -1;
  int steps = 4;
  // Which modules to shard (default: each block, then the model).
  std::function<void(nn::GPT&, const DeviceMesh&, const nn::FsdpOptions&)> shard = nullptr;
  // Per rank and step, after the step (mesh, model, optimizer, counter of that step).
  std::function<void(int rank, int step, const DeviceMesh&, nn::GPT&, const nn::AdamW&, const CommCounter&)> check =
      nullptr;
};

// Trains Config() for s.steps AdamW steps; rank 0's losses and final parameters.
TrainRun Train(const Spec& s) {
  TrainRun out;
  auto comms = Unwrap(MakeThreadGroup(s.world, absl::Seconds(60)));
  std::vector<std::thread> threads;
  for (int r = 0; r < s.world; ++r) {
    threads.emplace_back([&, r] {
      DeviceMesh mesh;
      if (!s.mesh_shape.empty()) mesh = Unwrap(DeviceMesh::Create(*comms[static_cast<size_t>(r)], s.mesh_shape));
      auto model = Unwrap(nn::GPT::Create(Config()));
      ASSERT_TRUE(model->InitWeights(5).ok());
      if (mesh.defined() && s.shard) {
        s.shard(*model, mesh, s.options);
        if (s.after_shard) s.after_shard(*model);
      } else if (mesh.defined()) {
        for (int64_t i = 0; i < Config().n_layer; ++i) {
          ASSERT_TRUE(nn::FullyShard(*model->block(i), mesh, s.options).ok());
        }
        ASSERT_TRUE(nn::FullyShard(*model, mesh, s.options).ok());
        if (s.after_shard) s.after_shard(*model);
      }
      // eps 1e-5, not 1e-8: AdamW divides each element's gradient by its own magnitude, so an
      // element whose gradient is ~0 — the key bias's is exactly 0 (softmax ignores a shift
      // common to a row's scores), a few others nearly cancel — would move by O(lr) in a
      // direction set by rounding, different for every summation order.
      nn::AdamW opt(model->Parameters(), {.lr = 3e-3, .eps = 1e-5, .weight_decay = 0.1});
      nn::SGD sgd(model->Parameters(), {.lr = 0.05, .momentum = 0.9, .weight_decay = 0.01});
      const Layout batch_layout(Placements(s.mesh_shape.size(), Shard(0)));
      auto fail = std::make_shared<bool>(false);
      model->block(1)->RegisterForwardPreHook(
          [fail](nn::Module&) -> absl::Status { return *fail ? absl::InternalError("injected") : absl::OkStatus(); });
      for (int step = 0; step < s.steps; ++step) {
        CommCounter counter;
        if (mesh.defined()) SetCommCounter(mesh, &counter);
        auto [inputs, targets] = Batch(step);
        const int64_t micro = kBatch / s.grad_accum;
        std::vector<Value> losses;
        for (int attempt = 0; attempt < 2; ++attempt) {
          losses.clear();
          bool failed = false;
          for (int k = 0; k < s.grad_accum; ++k) {
            Value x = Unwrap(inputs.Narrow(0, k * micro, micro)), y = Unwrap(targets.Narrow(0, k * micro, micro));
            if (mesh.defined()) {
              x = Unwrap(DTensor::Distribute(x.local(), mesh, batch_layout, {.src_rank = std::nullopt}));
              y = Unwrap(DTensor::Distribute(y.local(), mesh, batch_layout, {.src_rank = std::nullopt}));
              if (s.sync_last_only) nn::SetRequiresGradientSync(*model, k + 1 == s.grad_accum);
              if (s.all_reduce_last_only) nn::SetRequiresAllReduce(*model, k + 1 == s.grad_accum);
            }
            if (step == s.fail_forward_step && attempt == 0 && k == 1) {
              *fail = true;
              EXPECT_EQ(model->Forward(Variable::Constant(x), Variable::Constant(y)).status().message(), "injected");
              *fail = false;
              failed = true;
              break;
            }
            nn::GPT::Output o = Unwrap(model->Forward(Variable::Constant(x), Variable::Constant(y)));
            Variable loss = s.grad_accum == 1 ? o.loss : Unwrap(Scale(o.loss, 1.0 / s.grad_accum));
            absl::Status b = Backward(loss);
            ASSERT_TRUE(b.ok()) << b;
            losses.push_back(o.loss.value());
          }
          if (!failed) break;
          opt.ZeroGrad();  // the user drops the failed step and runs it again
        }
        if (mesh.defined()) SetCommCounter(mesh, nullptr);
        if (step == 0) {
          for (auto& [name, p] : model->NamedParameters()) {
            const Value& g = p->grad();
            ASSERT_TRUE(g.defined()) << name;
            const Tensor full = g.is_dtensor() ? Unwrap(g.dtensor().FullTensor()) : g.local();
            if (r == 0) out.grads.emplace_back(name, testing::Values(full));
          }
        }
        double loss_sum = 0;
        for (Value l : losses) {  // Partial(sum) over the batch shards
          if (l.is_dtensor()) {
            l = Unwrap(l.dtensor().Redistribute(Layout(Placements(s.mesh_shape.size(), Replicate()))));
          }
          loss_sum += testing::Values(l.local())[0];
        }
        if (s.extra_forward) {
          Value x = inputs, y = targets;
          if (mesh.defined()) {
            x = Unwrap(DTensor::Distribute(inputs, mesh, batch_layout, {.src_rank = std::nullopt}));
            y = Unwrap(DTensor::Distribute(targets, mesh, batch_layout, {.src_rank = std::nullopt}));
          }
          ASSERT_TRUE(model->Forward(Variable::Constant(x), Variable::Constant(y)).ok());
        }
        if (s.sgd_clip) {
          // Clipped from a norm of about 1.5 (the global norm over every rank's shards).
          absl::StatusOr<double> norm = nn::ClipGradNorm(model->Parameters(), 0.5);
          ASSERT_TRUE(norm.ok()) << norm.status();
          if (r == 0) out.norms.push_back(*norm);
          ASSERT_TRUE(sgd.Step().ok());
          sgd.ZeroGrad();
        } else {
          ASSERT_TRUE(opt.Step().ok());
        }
        if (s.check) s.check(r, step, mesh, *model, opt, counter);
        opt.ZeroGrad();
        if (r == 0) out.losses.push_back(loss_sum / s.grad_accum);
      }
      auto state = Unwrap(model->StateDict());  // full tensors (collective)
      if (r == 0) {
        for (auto& [name, t] : state) out.params.emplace_back(name, testing::Values(t));
      }
    });
  }
  for (auto& t : threads) t.join();
  return out;
}

void ExpectSameTraining(const TrainRun& got, const TrainRun& want, double rtol, const std::string& what) {
  ASSERT_EQ(got.losses.size(), want.losses.size()) << what;
  for (size_t i = 0; i < want.losses.size(); ++i) {
    EXPECT_NEAR(got.losses[i], want.losses[i], rtol * std::abs(want.losses[i])) << what << ", step " << i;
  }
  // The first step's gradients and the trained parameters, each as a tensor (a bias's gradient
  // sums B*T terms that nearly cancel in some elements, and AdamW normalises each element's
  // step: see ExpectNormNear).
  ASSERT_EQ(got.grads.size(), want.grads.size()) << what;
  for (size_t i = 0; i < want.grads.size(); ++i) {
    EXPECT_EQ(got.grads[i].first, want.grads[i].first);
    testing::ExpectNormNear(got.grads[i].second, want.grads[i].second, rtol, what + " grad " + want.grads[i].first);
  }
  ASSERT_EQ(got.params.size(), want.params.size()) << what;
  for (size_t i = 0; i < want.params.size(); ++i) {
    EXPECT_EQ(got.params[i].first, want.params[i].first);
    testing::ExpectNormNear(got.params[i].second, want.params[i].second, rtol, what + " " + want.params[i].first);
  }
}

const TrainRun& Reference() {
  static const TrainRun* ref = new TrainRun(Train({}));
  return *ref;
}

TEST(FullyShardTest, MatchesSingleRankOn2And3And4Ranks) {
  ASSERT_EQ(Reference().losses.size(), 4u);
  EXPECT_LT(Reference().losses[2], Reference().losses[0] - 0.01) << "the reference does not learn";
  for (int n : {2, 3, 4}) {
    for (bool reshard : {true, false}) {
      Spec s{.world = n, .mesh_shape = {n}};
      s.options.reshard_after_forward = reshard;
      ExpectSameTraining(Train(s), Reference(), 1e-5,
                         absl::StrCat("FSDP on ", n, " ranks, reshard_after_forward ", reshard));
    }
  }
}

// shard_dim_fn: every matrix sharded on dim 1 (C = 20 and 4C = 80 over 3 ranks: uneven), the
// vectors on dim 0; one strided copy per rank instead of dim 0's contiguous chunks.
TEST(FullyShardTest, ShardingAnotherDimMatchesSingleRank) {
  for (int n : {2, 3}) {
    Spec s{.world = n, .mesh_shape = {n}};
    s.options.shard_dim_fn = [](const std::string&, const Value& v) -> int64_t { return v.dim() >= 2 ? 1 : 0; };
    s.check = [&](int, int, const DeviceMesh&, nn::GPT& model, const nn::AdamW&, const CommCounter&) {
      const Value& w = model.FindParameter("transformer.h.0.mlp.c_fc.weight")->value();  // [80, 20]
      EXPECT_EQ(w.dtensor().layout(), Layout({Shard(1)}));
      EXPECT_EQ(w.local().shape()[0], 80);
    };
    ExpectSameTraining(Train(s), Reference(), 1e-5, absl::StrCat("FSDP on dim 1, ", n, " ranks"));
  }
}

// SGD and ClipGradNorm run unchanged on sharded parameters: the global norm sums every rank's
// shards once, and the clipped SGD steps match one rank's.
TEST(FullyShardTest, SgdAndClipGradNormMatchSingleRank) {
  const TrainRun one = Train({.sgd_clip = true});
  ASSERT_EQ(one.norms.size(), 4u);
  EXPECT_GT(one.norms[0], 0.5) << "the clip must bite";
  for (int n : {2, 3}) {
    const TrainRun got = Train({.world = n, .mesh_shape = {n}, .sgd_clip = true});
    ExpectSameTraining(got, one, 1e-5, absl::StrCat("SGD + clipping, FSDP on ", n, " ranks"));
    ASSERT_EQ(got.norms.size(), one.norms.size());
    for (size_t i = 0; i < one.norms.size(); ++i) EXPECT_NEAR(got.norms[i], one.norms[i], 1e-5 * one.norms[i]);
  }
}

TEST(FullyShardTest, HsdpOn2x2MatchesSingleRank) {
  ExpectSameTraining(Train({.world = 4, .mesh_shape = {2, 2}}), Reference(), 1e-5, "HSDP 2x2");
}

TEST(FullyShardTest, PrefetchOffMatchesSingleRank) {
  Spec s{.world = 2, .mesh_shape = {2}};
  s.options.prefetch = false;
  ExpectSameTraining(Train(s), Reference(), 1e-5, "FSDP without prefetch");
}

// A forward with grad enabled and no backward between the backward and the step (a logged
// loss) leaves the root, and groups that keep their parameters after forward, gathered with the
// sharded gradients aside: the step still updates the shards (a review saw the root's wte,
// wpe and ln_f never move, or with reshard_after_forward false nothing at all, and an AdamW
// state sized from the gathered parameters when it came before the first step).
TEST(FullyShardTest, AForwardWithoutBackwardBeforeTheStepChangesNothing) {
  for (bool reshard : {true, false}) {
    for (bool sgd : {false, true}) {
      Spec s{.world = 2, .mesh_shape = {2}, .extra_forward = true};
      s.options.reshard_after_forward = reshard;
      s.sgd_clip = sgd;
      Spec one{.sgd_clip = sgd, .extra_forward = true};
      ExpectSameTraining(Train(s), sgd ? Train(one) : Reference(), 1e-5,
                         absl::StrCat("reshard_after_forward ", reshard, sgd ? ", SGD after ClipGradNorm" : ", AdamW"));
    }
  }
}

// A forward that fails in the middle of a step, then zero_grad and the step again: the
// gradients a gathered group kept aside, and the sums kept without gradient sync, go with
// zero_grad (a review saw the first micro-batch's gradients counted twice, 0.12-0.21 off).
TEST(FullyShardTest, AFailedForwardThenZeroGradAndARetryMatchesOneRank) {
  const TrainRun want = Train({.grad_accum = 2, .fail_forward_step = 1});
  ExpectSameTraining(Train({.world = 2, .mesh_shape = {2}, .grad_accum = 2, .fail_forward_step = 1}), want, 1e-5,
                     "FSDP 2");
  ExpectSameTraining(
      Train({.world = 2, .mesh_shape = {2}, .grad_accum = 2, .sync_last_only = true, .fail_forward_step = 1}), want,
      1e-5, "FSDP 2, gradient sync on the last micro-batch only");
  ExpectSameTraining(
      Train({.world = 4, .mesh_shape = {2, 2}, .grad_accum = 2, .all_reduce_last_only = true, .fail_forward_step = 1}),
      want, 1e-5, "HSDP 2x2, all-reduce on the last micro-batch only");
}

TEST(FullyShardTest, GradientAccumulationMatchesOneBatch) {
  ExpectSameTraining(Train({.grad_accum = 2}), Reference(), 1e-5, "1 rank, 2 micro-batches");
  ExpectSameTraining(Train({.world = 2, .mesh_shape = {2}, .grad_accum = 2}), Reference(), 1e-5,
                     "FSDP 2 ranks, 2 micro-batches");
  ExpectSameTraining(Train({.world = 3, .mesh_shape = {3}, .grad_accum = 2}), Reference(), 1e-5,
                     "FSDP 3 ranks, 2 micro-batches of 3 rows (1, 1, 1)");
  ExpectSameTraining(Train({.world = 2, .mesh_shape = {2}, .grad_accum = 2, .sync_last_only = true}), Reference(), 1e-5,
                     "FSDP 2 ranks, 2 micro-batches, reduce-scatter on the last only");
}

// The analytical collectives of one step: per group, one all_gather in forward, one more in
// backward when it reshards after forward (never the root), one reduce_scatter; bytes from
// the parameters' shapes: N blocks of sum over parameters of ceil(rows / N) * rest elements.
TEST(FullyShardTest, EachStepIssuesExactlyTheAnalyticalCollectives) {
  for (int n : {2, 3, 4}) {
    for (bool reshard : {true, false}) {
      const nn::GPTConfig c = Config();
      auto padded = [n](int64_t rows, int64_t rest) { return (rows + n - 1) / n * rest; };
      const int64_t C = c.n_embd;
      // A block: ln_1 (w, b), c_attn (w [3C, C], b), c_proj (w [C, C], b), ln_2, c_fc (w [4C, C], b),
      // mlp c_proj (w [C, 4C], b).
      const int64_t block = 4 * padded(C, 1) + padded(3 * C, C) + padded(3 * C, 1) + padded(C, C) + padded(C, 1) +
                            padded(4 * C, C) + padded(4 * C, 1) + padded(C, 4 * C) + padded(C, 1);
      const int64_t root = padded(c.vocab_size, C) + padded(c.block_size, C) + 2 * padded(C, 1);
      const int64_t groups = c.n_layer + 1;
      const int64_t gathers = groups + (reshard ? c.n_layer : 0);
      const int64_t gather_bytes = 4 * n * ((reshard ? 2 : 1) * c.n_layer * block + root);
      const int64_t scatter_bytes = 4 * n * (c.n_layer * block + root);
      Spec s{.world = n, .mesh_shape = {n}, .steps = 2};
      if (n == 3) {  // FSDP2's setter, after sharding, means the same as the option
        s.after_shard = [reshard](nn::GPT& model) { nn::SetReshardAfterForward(model, reshard); };
      } else {
        s.options.reshard_after_forward = reshard;
      }
      s.check = [&](int rank, int step, const DeviceMesh&, nn::GPT& model, const nn::AdamW&,
                    const CommCounter& counter) {
        const std::string where = absl::StrCat(n, " ranks, reshard ", reshard, ", rank ", rank, ", step ", step);
        // Nothing else moves but cross-entropy's count of targets (one 4-byte all_reduce): the
        // batch is distributed locally, the loss read after the counter stopped.
        EXPECT_EQ(counter.calls(CommKind::kAllGather), gathers) << where << ": " << counter.ToString();
        EXPECT_EQ(counter.bytes(CommKind::kAllGather), gather_bytes) << where;
        EXPECT_EQ(counter.calls(CommKind::kReduceScatter), groups) << where;
        EXPECT_EQ(counter.bytes(CommKind::kReduceScatter), scatter_bytes) << where;
        EXPECT_EQ(counter.calls(CommKind::kAllReduce), 1) << where;
        EXPECT_EQ(counter.bytes(CommKind::kAllReduce), 4) << where;
        EXPECT_EQ(counter.calls(CommKind::kAllToAll), 0) << where;
        EXPECT_EQ(nn::FsdpGroupOf(*model.block(0))->all_gather_bytes(), 4 * n * block);
        EXPECT_EQ(nn::FsdpGroupOf(model)->reduce_scatter_bytes(), 4 * n * root);
      };
      Train(s);
    }
  }
}

// Groups inside a checkpointed block (fully_shard on each block's attn and mlp, every block
// recomputed in backward): the recomputation gathers each group once more (its forward
// resharded it, as FSDP2's), and prefetches nothing: the next group in forward order has
// finished its backward by then, so a prefetch of it gathers parameters nobody uses and holds
// the all_gather's output until the next step (before the fix: 14 all_gathers a step, one more
// for each block but the last). Nothing stays gathered after backward. Trains as one rank.
TEST(FullyShardTest, GroupsInsideACheckpointedBlockGatherNothingForLater) {
  const nn::GPTConfig c = Config();
  Spec s{.world = 2, .mesh_shape = {2}, .steps = 4};
  s.shard = [](nn::GPT& model, const DeviceMesh& mesh, const nn::FsdpOptions& options) {
    for (auto& [name, m] : model.NamedModules()) {
      if (absl::EndsWith(name, ".attn") || absl::EndsWith(name, ".mlp")) {
        ASSERT_TRUE(nn::FullyShard(*m, mesh, options).ok()) << name;
      }
    }
    ASSERT_TRUE(nn::FullyShard(model, mesh, options).ok());
  };
  s.after_shard = [](nn::GPT& model) {
    ASSERT_TRUE(nn::ApplyActivationCheckpointing(model, Unwrap(nn::ParseAcMode("full"))).ok());
  };
  const int64_t inner = 2 * c.n_layer;  // attn and mlp per block
  s.check = [&](int rank, int step, const DeviceMesh&, nn::GPT& model, const nn::AdamW&, const CommCounter& counter) {
    const std::string where = absl::StrCat("rank ", rank, ", step ", step);
    // Per inner group: forward, recomputation, backward; the root once.
    EXPECT_EQ(counter.calls(CommKind::kAllGather), 3 * inner + 1) << where << ": " << counter.ToString();
    EXPECT_EQ(counter.calls(CommKind::kReduceScatter), inner + 1) << where;
    EXPECT_EQ(nn::FsdpGroupOf(model)->tree_unsharded_bytes(), 0) << where << ": gathered after backward";
  };
  ExpectSameTraining(Train(s), Reference(), 1e-5, "FSDP on attn and mlp, full activation checkpointing");
}

TEST(FullyShardTest, HsdpReducesOverTheReplicasOncePerGroup) {
  const int64_t groups = Config().n_layer + 1;
  Spec s{.world = 4, .mesh_shape = {2, 2}, .steps = 1};
  s.check = [&](int, int, const DeviceMesh&, nn::GPT&, const nn::AdamW&, const CommCounter& counter) {
    EXPECT_EQ(counter.calls(CommKind::kReduceScatter), groups) << counter.ToString();
    EXPECT_EQ(counter.calls(CommKind::kAllReduce), groups + 1) << counter.ToString();  // + the loss's count
    EXPECT_EQ(counter.calls(CommKind::kAllGather), groups + Config().n_layer) << counter.ToString();
  };
  Train(s);
}

// HSDP gradient accumulation over 2 micro-batches with set_requires_all_reduce false on the
// first (PyTorch's FSDP2 switch): a reduce_scatter per micro-batch, one all_reduce over the
// replicas per step (the first micro-batch's reduce-scattered sums wait on the group), training
// as one rank does.
TEST(FullyShardTest, HsdpAccumulationAllReducesOncePerStep) {
  const int64_t groups = Config().n_layer + 1;
  Spec hsdp{.world = 4, .mesh_shape = {2, 2}, .grad_accum = 2, .all_reduce_last_only = true};
  hsdp.check = [&](int rank, int step, const DeviceMesh&, nn::GPT&, const nn::AdamW&, const CommCounter& counter) {
    const std::string where = absl::StrCat("HSDP rank ", rank, ", step ", step, ": ", counter.ToString());
    EXPECT_EQ(counter.calls(CommKind::kReduceScatter), 2 * groups) << where;
    EXPECT_EQ(counter.calls(CommKind::kAllReduce), groups + 2) << where;  // + each micro-batch's count of targets
  };
  ExpectSameTraining(Train(hsdp), Reference(), 1e-5, "HSDP 2x2, 2 micro-batches, all_reduce on the last");
}

// a -> (b, when asked) -> c: a and b are FSDP groups, the root holds c.
// Fixed distinct values in every parameter: 0.5 cos(1.3 i + k) for element i of the k-th.
void FillWithCosines(nn::Module& m) {
  int k = 1;
  for (Variable* p : m.Parameters()) {
    std::vector<float> v;
    for (int64_t i = 0; i < p->value().numel(); ++i) v.push_back(static_cast<float>(0.5 * std::cos(1.3 * i + k)));
    ++k;
    EXPECT_TRUE(Copy_(p->value().local(), Unwrap(Tensor::FromVector<float>(v, p->value().shape()))).ok());
  }
}

class Branchy : public nn::Module {
 public:
  Branchy() {
    a = RegisterModule("a", std::make_unique<nn::Linear>(5, 5));
    b = RegisterModule("b", std::make_unique<nn::Linear>(5, 5));
    c = RegisterModule("c", std::make_unique<nn::Linear>(5, 3));
    FillWithCosines(*this);
  }
  absl::StatusOr<Variable> Forward(const Variable& x, bool use_b) {
    return WithHooks(x, [&, use_b](const Variable& in) -> absl::StatusOr<Variable> {
      DT_ASSIGN_OR_RETURN(Variable h, a->Forward(in));
      if (use_b) {
        DT_ASSIGN_OR_RETURN(h, b->Forward(h));
      }
      return c->Forward(h);
    });
  }
  absl::Status Shard(const DeviceMesh& mesh) {
    DT_RETURN_IF_ERROR(nn::FullyShard(*a, mesh).status());
    DT_RETURN_IF_ERROR(nn::FullyShard(*b, mesh).status());
    return nn::FullyShard(*this, mesh).status();
  }
  // Sum(Forward(x, use_b)) with x the same [4, 5] on every rank: plain gradients are averaged
  // over the ranks, so each equals one rank's.
  absl::Status Pass(bool use_b) {
    std::vector<float> v;
    for (int i = 0; i < 4 * 5; ++i) v.push_back(static_cast<float>(std::sin(0.7 * i + 0.3)));
    DT_ASSIGN_OR_RETURN(Tensor x, Tensor::FromVector<float>(v, {4, 5}));
    DT_ASSIGN_OR_RETURN(Variable y, Forward(Variable::Constant(x), use_b));
    DT_ASSIGN_OR_RETURN(Variable loss, Sum(y));
    return Backward(loss);
  }
  std::vector<double> Grad(const std::string& name) {
    const Value& g = FindParameter(name)->grad();
    if (!g.defined()) return {};
    return testing::Values(g.is_dtensor() ? Unwrap(g.dtensor().FullTensor()) : g.local());
  }
  nn::Linear *a, *b, *c;
};

// One rank's gradients of the passes `uses` (b used or not), summed.
std::map<std::string, std::vector<double>> BranchyGrads(const std::vector<bool>& uses) {
  Branchy m;
  for (bool u : uses) EXPECT_TRUE(m.Pass(u).ok());
  std::map<std::string, std::vector<double>> out;
  for (auto& [name, p] : m.NamedParameters()) out[name] = m.Grad(name);
  return out;
}

// Runs fn(rank, model) on thread ranks, each with a Branchy sharded over `mesh_shape` (2x2:
// HSDP).
void OnBranchy(const std::vector<int64_t>& mesh_shape, const std::function<void(int, Branchy&)>& fn) {
  int world = 1;
  for (int64_t n : mesh_shape) world *= static_cast<int>(n);
  auto comms = Unwrap(MakeThreadGroup(world, absl::Seconds(30)));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      DeviceMesh mesh = Unwrap(DeviceMesh::Create(*comms[static_cast<size_t>(r)], mesh_shape));
      Branchy m;
      ASSERT_TRUE(m.Shard(mesh).ok());
      fn(r, m);
    });
  }
  for (auto& t : threads) t.join();
}
void OnBranchyHsdp(const std::function<void(int, Branchy&)>& fn) { OnBranchy({2, 2}, fn); }

void ExpectGrads(Branchy& m, const std::map<std::string, std::vector<double>>& want, const std::string& where) {
  for (const auto& [name, g] : want) testing::ExpectNear(m.Grad(name), g, {1e-5, 1e-6}, where + " " + name);
}

// The same without HSDP: a group used in a micro-batch without gradient sync but not in the
// synchronised one still gets its kept sum reduce-scattered at that backward's end (before,
// b had no gradient after the step and twice its sum after the next).
TEST(FullyShardTest, KeptSumsReachAGroupUnusedInTheSyncedMicroBatch) {
  const auto want = BranchyGrads({true, false});
  const auto next = BranchyGrads({true});
  OnBranchy({2}, [&](int r, Branchy& m) {
    nn::SetRequiresGradientSync(m, false);
    ASSERT_TRUE(m.Pass(true).ok());
    nn::SetRequiresGradientSync(m, true);
    ASSERT_TRUE(m.Pass(false).ok());
    ExpectGrads(m, want, absl::StrCat("rank ", r));
    for (Variable* p : m.Parameters()) p->reset_grad();
    ASSERT_TRUE(m.Pass(true).ok());
    ExpectGrads(m, next, absl::StrCat("rank ", r, ", next step"));
  });
}

// A group that took part in a micro-batch without all_reduce but not in the one with it still
// gets its kept sum all-reduced at that backward's end (it was left for the next step's).
TEST(FullyShardTest, HsdpKeptSumsReachAGroupUnusedInTheLastMicroBatch) {
  const auto want = BranchyGrads({true, false});
  const auto once = BranchyGrads({true});
  OnBranchyHsdp([&](int r, Branchy& m) {
    nn::SetRequiresAllReduce(m, false);
    ASSERT_TRUE(m.Pass(true).ok());
    nn::SetRequiresAllReduce(m, true);
    ASSERT_TRUE(m.Pass(false).ok());
    ExpectGrads(m, want, absl::StrCat("rank ", r));
    for (Variable* p : m.Parameters()) p->reset_grad();
    ASSERT_TRUE(m.Pass(true).ok());  // the next step: nothing kept leaks into it
    ExpectGrads(m, once, absl::StrCat("rank ", r, ", next step,"));
  });
}

// Every rank runs the groups' post-backwards, and so their reduce_scatters, in one order,
// whatever nodes other threads record meanwhile. A group's forward start was the sequence
// number the next node would get, from a counter every thread shares: a's start tied the
// root's on a rank where no node was recorded between them anywhere, and was later on a rank
// where another thread's was, so the ranks ran the root's and a's reduce_scatters in
// different orders (a collective mismatch on most of these rounds before the fix).
TEST(FullyShardTest, PostBackwardRunsInTheSameOrderOnEveryRank) {
  const auto want = BranchyGrads({true});
  for (int round = 0; round < 10; ++round) {
    OnBranchyHsdp([&](int r, Branchy& m) {
      const absl::Status pass = m.Pass(true);
      ASSERT_TRUE(pass.ok()) << "round " << round << ", rank " << r << ": " << pass;
      ExpectGrads(m, want, absl::StrCat("round ", round, ", rank ", r));
    });
  }
}

// Parameters, gradients and AdamW's two moments at rest: each rank holds its torch.chunk rows
// of every parameter, so the sum over ranks is the single-rank size and each rank at most
// 1/N of it plus one row per parameter.
TEST(FullyShardTest, ParametersGradientsAndOptimizerStateAreOneNthPerRank) {
  int64_t single = 0, rows = 0;
  {
    auto model = Unwrap(nn::GPT::Create(Config()));
    for (Variable* p : model->Parameters()) {
      single += 4 * p->value().numel();
      rows += 4 * p->value().numel() / p->value().shape()[0];
    }
  }
  for (int n : {2, 4}) {
    std::vector<int64_t> total(3, 0);
    std::mutex mu;
    Spec s{.world = n, .mesh_shape = {n}, .steps = 1};
    s.check = [&](int rank, int, const DeviceMesh&, nn::GPT& model, const nn::AdamW& opt, const CommCounter&) {
      int64_t params = 0, grads = 0;
      for (Variable* p : model.Parameters()) {
        ASSERT_TRUE(p->value().is_dtensor());
        EXPECT_TRUE(p->value().dtensor().placements()[0].is_shard()) << p->name();
        params += static_cast<int64_t>(p->value().local().nbytes());
        ASSERT_TRUE(p->grad().defined()) << p->name();
        EXPECT_EQ(p->grad().dtensor().layout(), p->value().dtensor().layout()) << p->name();
        grads += static_cast<int64_t>(p->grad().local().nbytes());
      }
      const int64_t bound = single / n + rows;
      EXPECT_LE(params, bound) << "rank " << rank;
      EXPECT_LE(grads, bound) << "rank " << rank;
      EXPECT_LE(opt.StateBytes(), 2 * bound) << "rank " << rank;
      std::lock_guard<std::mutex> lock(mu);
      total[0] += params;
      total[1] += grads;
      total[2] += opt.StateBytes();
    };
    Train(s);
    EXPECT_EQ(total[0], single) << n << " ranks";
    EXPECT_EQ(total[1], single) << n << " ranks";
    EXPECT_EQ(total[2], 2 * single) << n << " ranks";
  }
}

// bfloat16 gathers and compute, float32 master parameters and reduction: the all_gather moves
// half the bytes; 2 ranks train to the 1-rank run of the same policy (1e-3) and stay near
// float32 (2e-2).
TEST(FullyShardTest, Bfloat16PolicyHalvesTheGatherAndTracksFloat32) {
  nn::FsdpOptions bf16;
  bf16.mp_policy.param_dtype = DType::kBFloat16;
  Spec one{.world = 1, .mesh_shape = {1}, .options = bf16};
  const TrainRun ref_bf16 = Train(one);
  int64_t fp32_bytes = 0, bf16_bytes = 0;
  Spec two{.world = 2, .mesh_shape = {2}, .options = bf16};
  two.check = [&](int rank, int step, const DeviceMesh&, nn::GPT& model, const nn::AdamW&, const CommCounter& c) {
    if (rank == 0 && step == 0) bf16_bytes = c.bytes(CommKind::kAllGather);
    EXPECT_EQ(model.Parameters()[0]->value().dtype(), DType::kFloat32) << "master parameters stay float32";
  };
  const TrainRun got = Train(two);
  Spec fp32{.world = 2, .mesh_shape = {2}, .steps = 1};
  fp32.check = [&](int rank, int, const DeviceMesh&, nn::GPT&, const nn::AdamW&, const CommCounter& c) {
    if (rank == 0) fp32_bytes = c.bytes(CommKind::kAllGather);
  };
  Train(fp32);
  EXPECT_EQ(2 * bf16_bytes, fp32_bytes);
  ASSERT_EQ(got.losses.size(), ref_bf16.losses.size());
  for (size_t i = 0; i < got.losses.size(); ++i) {
    EXPECT_NEAR(got.losses[i], ref_bf16.losses[i], 1e-3 * ref_bf16.losses[i]) << "step " << i;
    EXPECT_NEAR(got.losses[i], Reference().losses[i], 2e-2 * Reference().losses[i]) << "step " << i;
  }
}

// Two backward passes through one graph (retain_graph): the second gathers the released
// parameters again and its reduce-scatter adds to the sharded gradients: twice one pass's.
TEST(FullyShardTest, SecondBackwardThroughTheSameGraphAccumulates) {
  auto comms = Unwrap(MakeThreadGroup(2, absl::Seconds(30)));
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      DeviceMesh mesh = Unwrap(DeviceMesh::Create(*comms[static_cast<size_t>(r)], {2}));
      auto model = Unwrap(nn::GPT::Create(Config()));
      ASSERT_TRUE(model->InitWeights(5).ok());
      for (int64_t i = 0; i < Config().n_layer; ++i) ASSERT_TRUE(nn::FullyShard(*model->block(i), mesh).ok());
      ASSERT_TRUE(nn::FullyShard(*model, mesh).ok());
      auto [inputs, targets] = Batch(0);
      Value x = Unwrap(DTensor::Distribute(inputs, mesh, {Shard(0)}, {.src_rank = std::nullopt}));
      Value y = Unwrap(DTensor::Distribute(targets, mesh, {Shard(0)}, {.src_rank = std::nullopt}));
      nn::GPT::Output o = Unwrap(model->Forward(Variable::Constant(x), Variable::Constant(y)));
      ASSERT_TRUE(Backward(o.loss, /*retain_graph=*/true).ok());
      std::vector<std::vector<double>> once;
      for (Variable* p : model->Parameters()) once.push_back(testing::Values(Unwrap(p->grad().dtensor().FullTensor())));
      ASSERT_TRUE(Backward(o.loss).ok());
      size_t i = 0;
      for (Variable* p : model->Parameters()) {
        std::vector<double> twice = once[i++];
        for (double& v : twice) v *= 2;
        testing::ExpectNear(testing::Values(Unwrap(p->grad().dtensor().FullTensor())), twice, {1e-6, 1e-9}, p->name());
      }
    });
  }
  for (auto& t : threads) t.join();
}

// Two forwards before any backward (two micro-batches' losses, then one backward of their sum,
// or a backward of each in turn, either order): every gradient is reduced and equals one
// rank's. Each forward's output carries its own start to the group's post-backward: before,
// a group kept the last forward's only, so the first graph's backward ran on parameters its
// post-backward had already resharded (all three orders crashed in LayerNormBackward).
TEST(FullyShardTest, TwoForwardsThenTheirBackwardsMatchOneRank) {
  for (int mode = 0; mode < 3; ++mode) {  // 0: Backward(a + b); 1: Backward(a), Backward(b); 2: b then a
    auto run = [&](int world) {
      std::vector<std::vector<double>> grads;
      CommCounter counter0;
      auto comms = Unwrap(MakeThreadGroup(world, absl::Seconds(30)));
      std::vector<std::thread> threads;
      for (int r = 0; r < world; ++r) {
        threads.emplace_back([&, r] {
          DeviceMesh mesh = Unwrap(DeviceMesh::Create(*comms[static_cast<size_t>(r)], {world}));
          auto model = Unwrap(nn::GPT::Create(Config()));
          ASSERT_TRUE(model->InitWeights(5).ok());
          if (world > 1) {
            for (int64_t i = 0; i < Config().n_layer; ++i) ASSERT_TRUE(nn::FullyShard(*model->block(i), mesh).ok());
            ASSERT_TRUE(nn::FullyShard(*model, mesh).ok());
          }
          CommCounter counter;
          if (world > 1) SetCommCounter(mesh, &counter);
          std::vector<Variable> losses;
          for (int k = 0; k < 2; ++k) {
            auto [inputs, targets] = Batch(k);
            Value x = inputs, y = targets;
            if (world > 1) {
              x = Unwrap(DTensor::Distribute(inputs, mesh, {Shard(0)}, {.src_rank = std::nullopt}));
              y = Unwrap(DTensor::Distribute(targets, mesh, {Shard(0)}, {.src_rank = std::nullopt}));
            }
            losses.push_back(Unwrap(model->Forward(Variable::Constant(x), Variable::Constant(y))).loss);
          }
          if (mode == 0) {
            ASSERT_TRUE(Backward(Unwrap(Add(losses[0], losses[1]))).ok());
          } else {
            const int first = mode == 1 ? 0 : 1;
            ASSERT_TRUE(Backward(losses[static_cast<size_t>(first)]).ok());
            ASSERT_TRUE(Backward(losses[static_cast<size_t>(1 - first)]).ok());
          }
          if (world > 1) SetCommCounter(mesh, nullptr);
          std::vector<std::vector<double>> mine;
          for (Variable* p : model->Parameters()) {
            ASSERT_TRUE(p->grad().defined()) << p->name();
            const Value& g = p->grad();
            mine.push_back(testing::Values(g.is_dtensor() ? Unwrap(g.dtensor().FullTensor()) : g.local()));
          }
          if (r == 0) {
            grads = mine;
            counter0 = counter;
          }
        });
      }
      for (auto& t : threads) t.join();
      return std::make_pair(grads, counter0);
    };
    const auto [want, unused] = run(1);
    const auto [got, counter] = run(2);
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < want.size(); ++i) {
      testing::ExpectNormNear(got[i], want[i], 1e-5, absl::StrCat("mode ", mode, ", parameter ", i));
    }
    // Gathers: forward 3 + 2 (the root stays gathered); backward 5: each graph gathers its
    // blocks, and the root again for the graph the other's post-backward left (as FSDP2).
    // Reduce-scatters: each graph's post-backward reduces each group, in one backward pass
    // too, where the first finds no gradient yet (a parameter's accumulator waits for both
    // graphs') and reduce-scatters zeros: a rank runs the same collectives whatever gradients
    // it has (its peers may have some); two passes reduce twice.
    EXPECT_EQ(counter.calls(CommKind::kAllGather), 10) << "mode " << mode << ": " << counter.ToString();
    EXPECT_EQ(counter.calls(CommKind::kReduceScatter), 6) << "mode " << mode;
  }
}

// A backward pass that outlives its sharded module gets an error where the module's
// pre-backward would gather (the group went with the module).
TEST(FullyShardTest, BackwardAfterTheModuleIsGoneIsAnError) {
  auto comms = Unwrap(MakeThreadGroup(1, absl::Seconds(30)));
  DeviceMesh mesh = Unwrap(DeviceMesh::Create(*comms[0], {1}));
  auto lin = std::make_unique<nn::Linear>(3, 2);
  ASSERT_TRUE(nn::FullyShard(*lin, mesh).ok());
  Value x = Unwrap(
      DTensor::Distribute(testing::Random({4, 3}, DType::kFloat32, 1), mesh, {Shard(0)}, {.src_rank = std::nullopt}));
  Variable loss = Unwrap(Sum(Unwrap(lin->Forward(Variable::Leaf(x, true)))));
  lin.reset();
  const absl::Status s = Backward(loss);
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_NE(s.message().find("[FullyShard]"), std::string::npos) << s;
}

// A backward pass that fails part-way (a hook's error, on every rank) leaves nothing behind:
// no reduce-scatter in flight to land after the user's zero_grad, no group gathered, no
// post-backward still queued. The next step (a new forward, or the backward of a graph made
// before the failure) gets one rank's gradients. Before, the failed pass's last
// reduce-scatter was added at the next forward (block 1's gradients 2x), and a backward of the
// other graph reduced nothing for block 1 and left the root gathered.
TEST(FullyShardTest, AFailedBackwardLeavesNothingForTheNextStep) {
  auto loss = [](nn::GPT& m, int step, const DeviceMesh& mesh) {
    auto [inputs, targets] = Batch(step);
    Value x = inputs, y = targets;
    if (mesh.defined()) {
      x = Unwrap(DTensor::Distribute(inputs, mesh, {Shard(0)}, {.src_rank = std::nullopt}));
      y = Unwrap(DTensor::Distribute(targets, mesh, {Shard(0)}, {.src_rank = std::nullopt}));
    }
    return Unwrap(m.Forward(Variable::Constant(x), Variable::Constant(y))).loss;
  };
  // mode 0: fail, zero_grad, a new forward and backward; 1: two forwards, the first's backward
  // fails, zero_grad, the second's backward. Rank 0's full gradients.
  auto run = [&](int world, int mode) {
    std::vector<std::vector<double>> grads;
    auto comms = Unwrap(MakeThreadGroup(world, absl::Seconds(30)));
    std::vector<std::thread> threads;
    for (int r = 0; r < world; ++r) {
      threads.emplace_back([&, r] {
        DeviceMesh mesh;
        auto model = Unwrap(nn::GPT::Create(Config()));
        ASSERT_TRUE(model->InitWeights(5).ok());
        if (world > 1) {
          mesh = Unwrap(DeviceMesh::Create(*comms[static_cast<size_t>(r)], {world}));
          for (int64_t i = 0; i < Config().n_layer; ++i) ASSERT_TRUE(nn::FullyShard(*model->block(i), mesh).ok());
          ASSERT_TRUE(nn::FullyShard(*model, mesh).ok());
        }
        auto fail = std::make_shared<bool>(true);
        model->block(0)->RegisterBackwardPreHook(
            [fail](nn::Module&) -> absl::Status { return *fail ? absl::InternalError("injected") : absl::OkStatus(); });
        Variable first = loss(*model, 0, mesh);
        Variable second = mode == 1 ? loss(*model, 1, mesh) : Variable();
        const absl::Status s = Backward(first);
        EXPECT_EQ(s.message(), "injected");
        *fail = false;
        for (Variable* p : model->Parameters()) p->reset_grad();  // the user drops the failed step
        if (mode == 0) second = loss(*model, 0, mesh);
        ASSERT_TRUE(Backward(second).ok());
        if (world > 1) {
          EXPECT_EQ(nn::FsdpGroupOf(*model)->tree_unsharded_bytes(), 0) << "rank " << r;
        }
        std::vector<std::vector<double>> mine;
        for (Variable* p : model->Parameters()) {
          const Value& g = p->grad();
          mine.push_back(!g.defined()     ? std::vector<double>()
                         : g.is_dtensor() ? testing::Values(Unwrap(g.dtensor().FullTensor()))
                                          : testing::Values(g.local()));
        }
        if (r == 0) grads = mine;
      });
    }
    for (auto& t : threads) t.join();
    return grads;
  };
  for (int mode : {0, 1}) {
    const auto want = run(1, mode);
    const auto got = run(2, mode);
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < want.size(); ++i) {
      ASSERT_FALSE(want[i].empty());
      ASSERT_EQ(got[i].size(), want[i].size()) << "mode " << mode << ", parameter " << i << " has no gradient";
      testing::ExpectNormNear(got[i], want[i], 1e-5, absl::StrCat("mode ", mode, ", parameter ", i));
    }
  }
}

// A failed pass drops its step's sums kept from earlier micro-batches too (without gradient
// sync; HSDP's without all_reduce): one group may have moved its sum into a reduction the
// failure dropped while the others still hold theirs, so keeping them would make the retried
// step's gradients 2x for some groups and right for others (seen before: a and c 2x, b right).
// After zero_grad, the step retried as one synchronised pass equals one rank's.
TEST(FullyShardTest, AFailedBackwardDropsTheSumsKeptForItsStep) {
  const auto want = BranchyGrads({true});
  auto retry = [&](int r, Branchy& m, const std::function<void(bool)>& set_sync) {
    auto fail = std::make_shared<bool>(false);
    m.a->RegisterBackwardPreHook(
        [fail](nn::Module&) -> absl::Status { return *fail ? absl::InternalError("injected") : absl::OkStatus(); });
    set_sync(false);
    ASSERT_TRUE(m.Pass(true).ok());
    set_sync(true);
    *fail = true;
    EXPECT_EQ(m.Pass(true).message(), "injected");
    *fail = false;
    for (Variable* p : m.Parameters()) p->reset_grad();
    ASSERT_TRUE(m.Pass(true).ok());
    ExpectGrads(m, want, absl::StrCat("rank ", r));
  };
  OnBranchy({2}, [&](int r, Branchy& m) { retry(r, m, [&m](bool sync) { nn::SetRequiresGradientSync(m, sync); }); });
  OnBranchyHsdp([&](int r, Branchy& m) { retry(r, m, [&m](bool all) { nn::SetRequiresAllReduce(m, all); }); });
}

// A block of two Linears and a GELU (several nodes per use), used twice in one forward and
// once more without grad, then a Linear: x -> blk -> blk (-> blk, no grad) -> l2.
class TwoLinears : public nn::Module {
 public:
  TwoLinears() {
    a = RegisterModule("a", std::make_unique<nn::Linear>(5, 5));
    b = RegisterModule("b", std::make_unique<nn::Linear>(5, 5));
  }
  absl::StatusOr<Variable> Forward(const Variable& x) {
    return WithHooks(x, [&](const Variable& in) -> absl::StatusOr<Variable> {
      DT_ASSIGN_OR_RETURN(Variable h, a->Forward(in));
      DT_ASSIGN_OR_RETURN(h, Gelu(h));
      return b->Forward(h);
    });
  }
  nn::Linear* a;
  nn::Linear* b;
};
class TwiceUsed : public nn::Module {
 public:
  TwiceUsed() {
    blk = RegisterModule("blk", std::make_unique<TwoLinears>());
    l2 = RegisterModule("l2", std::make_unique<nn::Linear>(5, 3));
  }
  absl::StatusOr<Variable> Forward(const Variable& x) {
    return WithHooks(x, [&](const Variable& in) -> absl::StatusOr<Variable> {
      DT_ASSIGN_OR_RETURN(Variable h, blk->Forward(in));
      DT_ASSIGN_OR_RETURN(h, blk->Forward(h));
      {
        NoGradGuard no_grad;  // a look without grad: records nothing, must move nothing
        DT_RETURN_IF_ERROR(blk->Forward(h).status());
      }
      return l2->Forward(h);
    });
  }
  TwoLinears* blk;
  nn::Linear* l2;
};

// A module used twice in one forward, and the previous step's loss still held during the next
// forward (its graph keeps the parameters' accumulators alive): FSDP still reduce-scatters
// every gradient once per backward, in its group's post-backward. Each rank trains on its own
// rows as plain tensors (PyTorch's way: the reduction averages them), so a gradient left
// unreduced is wrong, not merely late: it must equal the gradient of the mean over ranks of
// each rank's summed output, computed on one rank. (Before the accumulators outranked other
// nodes and a second use kept the first's start, the twice-used module's gradients were each
// rank's own, up to 0.83 off; a later use without grad moved its start again.)
TEST(FullyShardTest, ModuleUsedTwiceAndAHeldEarlierLossReduceEveryGradient) {
  constexpr int kWorld = 2, kRows = 4, kSteps = 2;
  auto input = [](int64_t rows) {
    std::vector<float> v;
    for (int64_t i = 0; i < rows * 5; ++i) v.push_back(static_cast<float>(std::sin(0.7 * i + 0.3)));
    return Unwrap(Tensor::FromVector<float>(v, {rows, 5}));
  };
  // One rank, every row, the loss scaled by 1 / kWorld; gradients summed over kSteps passes.
  std::vector<std::vector<double>> want;
  {
    TwiceUsed m;
    FillWithCosines(m);
    for (int step = 0; step < kSteps; ++step) {
      Variable loss = Unwrap(Scale(Unwrap(Sum(Unwrap(m.Forward(Variable::Constant(input(kWorld * kRows)))))), 0.5));
      ASSERT_TRUE(Backward(loss).ok());
    }
    for (Variable* p : m.Parameters()) want.push_back(testing::Values(p->grad().local()));
  }
  auto comms = Unwrap(MakeThreadGroup(kWorld, absl::Seconds(30)));
  std::vector<std::thread> threads;
  for (int r = 0; r < kWorld; ++r) {
    threads.emplace_back([&, r] {
      DeviceMesh mesh = Unwrap(DeviceMesh::Create(*comms[static_cast<size_t>(r)], {kWorld}));
      TwiceUsed m;
      FillWithCosines(m);
      for (nn::Module* g : std::vector<nn::Module*>{m.blk, m.l2, &m}) ASSERT_TRUE(nn::FullyShard(*g, mesh).ok());
      const Tensor mine = Unwrap(Clone(Unwrap(input(kWorld * kRows).Narrow(0, r * kRows, kRows))));
      std::vector<Variable> held;  // every step's loss, kept (to log them later, say)
      for (int step = 0; step < kSteps; ++step) {
        held.push_back(Unwrap(Sum(Unwrap(m.Forward(Variable::Constant(mine))))));
        ASSERT_TRUE(Backward(held.back()).ok());
      }
      size_t i = 0;
      for (auto& [name, p] : m.NamedParameters()) {
        const DTensor g = p->grad().dtensor();
        // Reduced by FSDP: laid out as the parameter (not left R / P for the optimizer).
        EXPECT_EQ(g.layout(), p->value().dtensor().layout()) << name;
        testing::ExpectNear(testing::Values(Unwrap(g.FullTensor())), want[i++], {1e-5, 1e-6}, name);
      }
    });
  }
  for (auto& t : threads) t.join();
}

// Ranks that use different parameters of one group. The root holds a and c, the group blk
// holds p; what each rank's forward runs is its own (rank_use): a or c (or neither) first,
// then blk, which applies p or only scales (its parameters then unused on that rank).
class RankBranchy : public nn::Module {
 public:
  class Blk : public nn::Module {
   public:
    Blk() { p = RegisterModule("p", std::make_unique<nn::Linear>(5, 3)); }
    absl::StatusOr<Variable> Forward(const Variable& x, bool use_p) {
      return WithHooks(x, [&, use_p](const Variable& in) { return use_p ? p->Forward(in) : Scale(in, 2.0); });
    }
    nn::Linear* p;
  };
  struct Use {
    int lin = 0;  // 0: a, 1: c, -1: neither
    bool blk = false, use_p = false;
  };
  RankBranchy() {
    a = RegisterModule("a", std::make_unique<nn::Linear>(5, 5));
    c = RegisterModule("c", std::make_unique<nn::Linear>(5, 5));
    blk = RegisterModule("blk", std::make_unique<Blk>());
    FillWithCosines(*this);
  }
  absl::StatusOr<Variable> Forward(const Variable& x, Use use) {
    return WithHooks(x, [&, use](const Variable& in) -> absl::StatusOr<Variable> {
      Variable h = in;
      if (use.lin >= 0) {
        DT_ASSIGN_OR_RETURN(h, (use.lin == 0 ? a : c)->Forward(in));
      }
      if (use.blk) {
        DT_ASSIGN_OR_RETURN(h, blk->Forward(h, use.use_p));
      }
      return h;
    });
  }
  // `scale` times the mean of this rank's output on its own [3, 5] input. (Plain tensors: FSDP
  // averages the gradients over the ranks, so each rank's loss is its own mean, scale 1, and
  // the one-rank reference sums every rank's with scale 1 / world.)
  absl::StatusOr<Variable> Loss(int rank, int micro, Use use, double scale) {
    std::vector<float> v;
    for (int i = 0; i < 15; ++i) v.push_back(static_cast<float>(std::sin(0.7 * i + 0.3 * rank + 1.1 * micro)));
    DT_ASSIGN_OR_RETURN(Tensor x, Tensor::FromVector<float>(v, {3, 5}));
    DT_ASSIGN_OR_RETURN(Variable y, Forward(Variable::Constant(x), use));
    DT_ASSIGN_OR_RETURN(Variable loss, Mean(y));
    return Scale(loss, scale);
  }
  nn::Linear *a, *c;
  Blk* blk;
};

// Each micro-batch's uses by rank (2 ranks), and whether its backward syncs gradients.
struct RankUses {
  std::vector<std::vector<RankBranchy::Use>> uses;
  std::vector<bool> sync;
};

// Every rank's shard of every parameter gets the gradient of the global loss (the mean over
// the ranks of each one's loss, through what that rank used), as one rank computes it with
// every rank's branch: before, StartReduce zero-filled a parameter this rank had no gradient
// of but gave only those it had one of their reduced shards (the peers' sums were dropped),
// and a rank without any gradient in the group skipped the reduce_scatter its peers ran (or,
// after a micro-batch without sync, the kept sums' one): a collective mismatch.
void ExpectRankConditionalUseMatchesOneRank(const RankUses& s, const std::string& what) {
  constexpr int kWorld = 2;
  std::map<std::string, std::vector<double>> want;
  {
    RankBranchy m;
    for (size_t k = 0; k < s.uses.size(); ++k) {
      for (int r = 0; r < kWorld; ++r) {
        Variable loss = Unwrap(m.Loss(r, static_cast<int>(k), s.uses[k][static_cast<size_t>(r)], 1.0 / kWorld));
        ASSERT_TRUE(Backward(loss).ok());
      }
    }
    for (auto& [name, p] : m.NamedParameters()) {
      want[name] = p->grad().defined() ? testing::Values(p->grad().local()) : std::vector<double>{};
    }
  }
  auto comms = Unwrap(MakeThreadGroup(kWorld, absl::Seconds(10)));
  std::vector<std::thread> threads;
  for (int r = 0; r < kWorld; ++r) {
    threads.emplace_back([&, r] {
      DeviceMesh mesh = Unwrap(DeviceMesh::Create(*comms[static_cast<size_t>(r)], {kWorld}));
      RankBranchy m;
      ASSERT_TRUE(nn::FullyShard(*m.blk, mesh).ok());
      ASSERT_TRUE(nn::FullyShard(m, mesh).ok());
      for (size_t k = 0; k < s.uses.size(); ++k) {
        nn::SetRequiresGradientSync(m, s.sync[k]);
        Variable loss = Unwrap(m.Loss(r, static_cast<int>(k), s.uses[k][static_cast<size_t>(r)], 1.0));
        const absl::Status b = Backward(loss);
        ASSERT_TRUE(b.ok()) << what << ", rank " << r << ", micro-batch " << k << ": " << b;
      }
      for (auto& [name, p] : m.NamedParameters()) {
        const std::string where = absl::StrCat(what, ", rank ", r, ": ", name);
        const std::vector<double>& full = want[name];
        if (full.empty()) {  // no rank used it: no gradient, or zeros
          if (p->grad().defined()) {
            for (double g : testing::Values(p->grad().local())) EXPECT_EQ(g, 0.0) << where;
          }
          continue;
        }
        ASSERT_TRUE(p->grad().defined()) << where << ": the shard lost its gradient";
        const DTensor g = p->grad().dtensor();
        EXPECT_EQ(g.layout(), p->value().dtensor().layout()) << where;
        // This rank's rows of the one-rank gradient (slicing, no communication).
        const Tensor whole = Unwrap(Tensor::FromVector<float>(std::vector<float>(full.begin(), full.end()), g.shape()));
        const DTensor mine = Unwrap(DTensor::Distribute(whole, g.mesh(), g.layout(), {.src_rank = std::nullopt}));
        testing::ExpectNear(testing::Values(g.ToLocal()), testing::Values(mine.ToLocal()), {1e-5, 1e-6}, where);
      }
    });
  }
  for (auto& t : threads) t.join();
}

TEST(FullyShardTest, RanksUsingDifferentParametersOfAGroupGetEveryGradient) {
  using U = RankBranchy::Use;
  // Rank 0 uses a, rank 1 c, both of the root: each shard of each needs the other's sum.
  ExpectRankConditionalUseMatchesOneRank({{{U{.lin = 0}, U{.lin = 1}}}, {true}}, "a on rank 0, c on rank 1");
  // Rank 1 uses none of the root's parameters (only blk's): it still runs the root's
  // reduce_scatter, as rank 0 does.
  ExpectRankConditionalUseMatchesOneRank(
      {{{U{.lin = 0, .blk = true, .use_p = true}, U{.lin = -1, .blk = true, .use_p = true}}}, {true}},
      "a and p on rank 0, only p on rank 1");
  // Gradient accumulation: rank 1 runs blk without its parameters in the micro-batch without
  // sync, and no rank uses blk in the synchronised one; rank 0's sum kept for p still meets
  // rank 1's (zeros) in the reduce_scatter at that backward's end.
  ExpectRankConditionalUseMatchesOneRank(
      {{{U{.lin = 0, .blk = true, .use_p = true}, U{.lin = 1, .blk = true}}, {U{.lin = 0}, U{.lin = 0}}},
       {false, true}},
      "accumulation: p on rank 0 only, then no blk");
}

// StateDict while a group is gathered (the root's after a forward whose backward never runs,
// in bfloat16 param_dtype) returns the float32 parameters themselves, equal to the single-rank
// model's; before, the gathered bfloat16 copies. AdamW::InitState likewise makes moments of
// the shards' shape, not the gathered parameters'.
TEST(FullyShardTest, StateDictWhileGatheredIsTheFloat32Parameters) {
  std::vector<std::pair<std::string, Tensor>> want;
  {
    RankBranchy m;
    want = Unwrap(m.StateDict());
  }
  constexpr int kWorld = 2;
  auto comms = Unwrap(MakeThreadGroup(kWorld, absl::Seconds(10)));
  std::vector<std::thread> threads;
  for (int r = 0; r < kWorld; ++r) {
    threads.emplace_back([&, r] {
      DeviceMesh mesh = Unwrap(DeviceMesh::Create(*comms[static_cast<size_t>(r)], {kWorld}));
      RankBranchy m;
      nn::FsdpOptions o;
      o.mp_policy.param_dtype = DType::kBFloat16;
      ASSERT_TRUE(nn::FullyShard(*m.blk, mesh, o).ok());
      ASSERT_TRUE(nn::FullyShard(m, mesh, o).ok());
      Variable logged = Unwrap(m.Loss(r, 0, {.lin = 0, .blk = true, .use_p = true}, 1.0));  // no backward
      ASSERT_TRUE(nn::FsdpGroupOf(m)->unsharded());
      nn::AdamW opt(m.Parameters(), {});
      ASSERT_TRUE(opt.InitState().ok());
      size_t i = 0;
      for (auto& [name, p] : m.NamedParameters()) {
        // torch.chunk's rows over 2 ranks: ceil(rows / 2) on rank 0, the rest on rank 1.
        const int64_t rows = want[i].second.shape()[0];
        EXPECT_EQ(opt.exp_avg(i++).shape()[0], r == 0 ? (rows + 1) / 2 : rows / 2) << name;
        EXPECT_EQ(p->value().dtype(), DType::kFloat32) << name;
      }
      auto got = Unwrap(m.StateDict());
      ASSERT_EQ(got.size(), want.size());
      for (size_t k = 0; k < want.size(); ++k) {
        EXPECT_EQ(got[k].first, want[k].first);
        EXPECT_EQ(got[k].second.dtype(), DType::kFloat32) << want[k].first;
        EXPECT_EQ(testing::Values(got[k].second), testing::Values(want[k].second))
            << "rank " << r << ": " << want[k].first;
      }
    });
  }
  for (auto& t : threads) t.join();
}

// cast_forward_inputs (PyTorch's default): a float32 input meets bfloat16 parameters cast to
// bfloat16, and the output is bfloat16 (its values: the float32 Linear within bfloat16's
// rounding); off, the dtypes do not meet and the Linear says so.
TEST(FullyShardTest, ForwardInputsAreCastToTheParamDtype) {
  auto comms = Unwrap(MakeThreadGroup(1));
  DeviceMesh mesh = Unwrap(DeviceMesh::Create(*comms[0], {1}));
  const Tensor x = testing::Random({2, 4}, DType::kFloat32, 7, -1.0, 1.0);
  for (bool cast : {true, false}) {
    nn::Linear lin(4, 3);
    const std::vector<double> want = testing::Values(
        Unwrap(dtensor::Linear(Variable::Constant(Value(x)), *lin.weight(), *lin.bias())).value().local());
    nn::FsdpOptions o;
    o.mp_policy.param_dtype = DType::kBFloat16;
    o.mp_policy.cast_forward_inputs = cast;
    ASSERT_TRUE(nn::FullyShard(lin, mesh, o).ok());
    const Value xd = Unwrap(DTensor::Distribute(x, mesh, {Replicate()}, {.src_rank = std::nullopt}));
    absl::StatusOr<Variable> y = lin.Forward(Variable::Constant(xd));
    if (!cast) {
      EXPECT_FALSE(y.ok());
      EXPECT_NE(y.status().message().find("the dtypes differ"), std::string::npos) << y.status();
      continue;
    }
    ASSERT_TRUE(y.ok()) << y.status();
    EXPECT_EQ(y->value().dtype(), DType::kBFloat16);
    testing::ExpectNear(testing::Values(y->value().dtensor().ToLocal()), want, {2e-2, 2e-2}, "bf16 Linear");
  }
}

TEST(FullyShardTest, BadUseIsAnError) {
  auto comms = Unwrap(MakeThreadGroup(1));
  DeviceMesh mesh = Unwrap(DeviceMesh::Create(*comms[0], {1}, {"dp"}));
  auto model = Unwrap(nn::GPT::Create(Config()));
  ASSERT_TRUE(nn::FullyShard(*model->block(0), mesh).ok());
  absl::StatusOr<nn::FsdpGroup*> twice = nn::FullyShard(*model->block(0), mesh);
  EXPECT_TRUE(absl::IsInvalidArgument(twice.status())) << twice.status();
  EXPECT_NE(twice.status().message().find("ln_1.weight"), std::string::npos) << twice.status();
  EXPECT_NE(twice.status().message().find("sharded already"), std::string::npos) << twice.status();

  nn::FsdpOptions bad_dim{.shard_dim = "dp_shard"};
  absl::StatusOr<nn::FsdpGroup*> dim = nn::FullyShard(*model->block(1), mesh, bad_dim);
  EXPECT_TRUE(absl::IsInvalidArgument(dim.status())) << dim.status();
  EXPECT_NE(dim.status().message().find("dp_shard"), std::string::npos) << dim.status();

  auto comms8 = Unwrap(MakeThreadGroup(1));
  DeviceMesh mesh3 = Unwrap(DeviceMesh::Create(*comms8[0], {1, 1, 1}, {"a", "b", "c"}));
  absl::StatusOr<nn::FsdpGroup*> three = nn::FullyShard(*model->block(1), mesh3);
  EXPECT_TRUE(absl::IsInvalidArgument(three.status())) << three.status();
  EXPECT_NE(three.status().message().find("shard_dim"), std::string::npos) << three.status();

  class Scalar : public nn::Module {
   public:
    Scalar() { RegisterParameter("s", Unwrap(Zeros({}, DType::kFloat32))); }
  } scalar;
  absl::StatusOr<nn::FsdpGroup*> zero_d = nn::FullyShard(scalar, mesh);
  EXPECT_TRUE(absl::IsInvalidArgument(zero_d.status())) << zero_d.status();
  EXPECT_NE(zero_d.status().message().find("0-d"), std::string::npos) << zero_d.status();
}

// A parameter on a GPU with a CPU mesh is refused, naming both devices.
TEST(FullyShardTest, ParameterOnAnotherDeviceIsAnError) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device visible";
  auto comms = Unwrap(MakeThreadGroup(1));
  DeviceMesh mesh = Unwrap(DeviceMesh::Create(*comms[0], {1}));
  nn::Linear lin(4, 3);
  ASSERT_TRUE(lin.To(Device::Cuda(0)).ok());
  absl::StatusOr<nn::FsdpGroup*> g = nn::FullyShard(lin, mesh);
  EXPECT_TRUE(absl::IsInvalidArgument(g.status())) << g.status();
  EXPECT_NE(g.status().message().find("cuda:0"), std::string::npos) << g.status();
}

// Unshard / Reshard by hand: the gathered values are the full parameters; resharding releases
// the gathered buffer's memory, and gathering again fills it with the same values.
TEST(FullyShardTest, UnshardGathersAndReshardReleases) {
  auto comms = Unwrap(MakeThreadGroup(3, absl::Seconds(30)));
  std::vector<std::thread> threads;
  for (int r = 0; r < 3; ++r) {
    threads.emplace_back([&, r] {
      DeviceMesh mesh = Unwrap(DeviceMesh::Create(*comms[static_cast<size_t>(r)], {3}));
      nn::Linear lin(5, 7);  // weight [7, 5]: rows 3, 3, 1
      ASSERT_TRUE(FillRandom_(lin.weight()->value().local(), {.kind = RandomSpec::Kind::kNormal, .seed = 3},
                              lin.weight()->value().shape(), {0, 0})
                      .ok());
      const std::vector<double> full = testing::Values(lin.weight()->value().local());
      nn::FsdpGroup* g = Unwrap(nn::FullyShard(lin, mesh));
      EXPECT_EQ(lin.weight()->value().local().shape()[0], r < 2 ? 3 : 1);
      EXPECT_EQ(testing::Values(Unwrap(lin.weight()->value().dtensor().FullTensor())), full);
      for (int round = 0; round < 2; ++round) {
        ASSERT_TRUE(g->Unshard().ok());
        const Tensor gathered = lin.weight()->value().local();
        EXPECT_EQ(lin.weight()->value().dtensor().layout(), Layout({Replicate()}));
        EXPECT_EQ(testing::Values(gathered), full) << "round " << round;
        ASSERT_TRUE(g->Reshard().ok());
        EXPECT_TRUE(gathered.storage()->released());
        EXPECT_EQ(lin.weight()->value().local().shape()[0], r < 2 ? 3 : 1);
      }
    });
  }
  for (auto& t : threads) t.join();
}

}  // namespace
}  // namespace dtensor
