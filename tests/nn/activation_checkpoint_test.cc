// Activation checkpointing of a GPT (nn/parallel/activation_checkpoint.h) against the same
// training without it: losses, every parameter's gradient at every step and the parameters
// after AdamW steps are bit-identical on 1 rank, under FSDP over 2 thread ranks (with the same
// collectives, and gradient accumulation) and under tensor parallelism over 2 (with sequence
// parallelism), with dropout on and off, for full, selective-layer and selective-op modes;
// the peak of the allocator's bytes in use falls in the order none > selective > full; the
// mode parser reads TorchTitan's names and names what it refuses.
#include "dtensor/nn/parallel/activation_checkpoint.h"

#include <cstdio>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "dtensor/autograd/ops.h"
#include "dtensor/collectives/threads/threads_communicator.h"
#include "dtensor/core/comm_counter.h"
#include "dtensor/nn/gpt.h"
#include "dtensor/nn/optim.h"
#include "dtensor/nn/parallel/fully_shard.h"
#include "dtensor/nn/parallel/gpt_plan.h"
#include "dtensor/nn/parallel/parallelize.h"
#include "dtensor/tensor/allocator.h"
#include "gtest/gtest.h"
#include "tests/testing/test_util.h"

namespace dtensor {
namespace {

using testing::Unwrap;

// ---- The parser ----

TEST(ParseAcMode, ReadsTorchTitansModes) {
  using M = nn::AcOptions::Mode;
  struct Case {
    std::string text;
    M mode;
    int64_t every;
    std::string printed;
  };
  for (const Case& c : {Case{"none", M::kNone, 2, "none"}, Case{"full", M::kFull, 2, "full"},
                        Case{"selective", M::kSelectiveLayer, 2, "selective:2"},
                        Case{"selective:3", M::kSelectiveLayer, 3, "selective:3"},
                        Case{"selective:1", M::kSelectiveLayer, 1, "selective:1"},
                        Case{"selective:op", M::kSelectiveOp, 2, "selective:op"}}) {
    nn::AcOptions o = Unwrap(nn::ParseAcMode(c.text), c.text.c_str());
    EXPECT_EQ(o.mode, c.mode) << c.text;
    EXPECT_EQ(o.every, c.every) << c.text;
    EXPECT_EQ(o.ToString(), c.printed) << c.text;
    EXPECT_EQ(Unwrap(nn::ParseAcMode(o.ToString())), o) << c.text;
  }
}

TEST(ParseAcMode, NamesTheBadValue) {
  for (const std::string bad : {"", "Full", "partial", "selective:", "selective:0", "selective:-2", "selective:x",
                                "selective2", "selective:op:2", "full "}) {
    absl::StatusOr<nn::AcOptions> o = nn::ParseAcMode(bad);
    ASSERT_FALSE(o.ok()) << "'" << bad << "' was accepted";
    EXPECT_EQ(o.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(o.status().message().find("'" + bad + "'"), std::string::npos) << o.status();
  }
}

TEST(ApplyActivationCheckpointing, ChoosesBlocksAndRefusesTwice) {
  using M = nn::AcOptions::Mode;
  EXPECT_EQ(nn::CheckpointedBlocks(5, {.mode = M::kNone}), std::vector<int64_t>{});
  EXPECT_EQ(nn::CheckpointedBlocks(5, {.mode = M::kFull}), (std::vector<int64_t>{0, 1, 2, 3, 4}));
  EXPECT_EQ(nn::CheckpointedBlocks(5, {.mode = M::kSelectiveLayer, .every = 2}), (std::vector<int64_t>{1, 3}));
  EXPECT_EQ(nn::CheckpointedBlocks(7, {.mode = M::kSelectiveLayer, .every = 3}), (std::vector<int64_t>{2, 5}));
  EXPECT_EQ(nn::CheckpointedBlocks(3, {.mode = M::kSelectiveOp}), (std::vector<int64_t>{0, 1, 2}));

  auto model = Unwrap(nn::GPT::Create({.vocab_size = 16, .block_size = 4, .n_layer = 3, .n_head = 2, .n_embd = 8}));
  ASSERT_TRUE(nn::ApplyActivationCheckpointing(*model, {.mode = M::kSelectiveLayer, .every = 2}).ok());
  EXPECT_FALSE(model->block(0)->has_forward_wrapper());
  EXPECT_TRUE(model->block(1)->has_forward_wrapper());
  absl::Status again = nn::ApplyActivationCheckpointing(*model, {.mode = M::kFull});
  EXPECT_EQ(again.code(), absl::StatusCode::kFailedPrecondition) << again;
  EXPECT_NE(again.message().find("transformer.h.1"), std::string::npos) << again;
  EXPECT_EQ(nn::ApplyActivationCheckpointing(*model, {.mode = M::kSelectiveLayer, .every = 0}).code(),
            absl::StatusCode::kInvalidArgument);
}

// A second call whose mode picks none of the blocks the first wrapped is refused too: on 4
// blocks selective:2 wraps 1 and 3, selective:3 would add 2 (before, it was accepted and
// blocks 1, 2 and 3 were checkpointed, which neither mode asks for).
TEST(ApplyActivationCheckpointing, RefusesASecondCallOnOtherBlocks) {
  using M = nn::AcOptions::Mode;
  auto model = Unwrap(nn::GPT::Create({.vocab_size = 16, .block_size = 4, .n_layer = 4, .n_head = 2, .n_embd = 8}));
  ASSERT_TRUE(nn::ApplyActivationCheckpointing(*model, {.mode = M::kSelectiveLayer, .every = 2}).ok());
  absl::Status again = nn::ApplyActivationCheckpointing(*model, {.mode = M::kSelectiveLayer, .every = 3});
  EXPECT_EQ(again.code(), absl::StatusCode::kFailedPrecondition) << again;
  EXPECT_NE(again.message().find("transformer.h.1"), std::string::npos) << again;
  for (int64_t i = 0; i < 4; ++i) EXPECT_EQ(model->block(i)->has_forward_wrapper(), i == 1 || i == 3) << "block " << i;
}

// ---- Training with and without checkpointing ----

enum class Par { kSingle, kFsdp2, kTp2 };
std::string ParName(Par p) { return p == Par::kSingle ? "single" : p == Par::kFsdp2 ? "fsdp2" : "tp2"; }

// 4 heads of 4 (C = 16), 4 layers (selective:2 checkpoints 2 of them), V = 37.
nn::GPTConfig Config(double dropout) {
  return {.vocab_size = 37,
          .block_size = 8,
          .n_layer = 4,
          .n_head = 4,
          .n_embd = 16,
          .dropout = dropout,
          .dropout_seed = 3};
}
constexpr int64_t kBatch = 4, kSeq = 8;

std::pair<Tensor, Tensor> Batch(int step) {
  std::vector<int32_t> x, y;
  for (int64_t i = 0; i < kBatch * kSeq; ++i) {
    x.push_back(static_cast<int32_t>((i * 7 + step * 13 + i / 5) % 37));
    y.push_back(static_cast<int32_t>((i * 11 + step * 3 + 1) % 37));
  }
  return {Unwrap(Tensor::FromVector<int32_t>(x, {kBatch, kSeq})),
          Unwrap(Tensor::FromVector<int32_t>(y, {kBatch, kSeq}))};
}

struct TrainRun {
  std::vector<std::vector<double>> losses;                                      // per step, per micro-batch
  std::vector<std::vector<std::pair<std::string, std::vector<double>>>> grads;  // per step: full gradients
  std::vector<std::pair<std::string, std::vector<double>>> params;              // after the last step
  std::vector<std::string> comms;                                               // per step: rank 0's CommCounter
  std::vector<int64_t> peak_unsharded;  // per step: FSDP's peak of gathered bytes (rank 0)
};

TrainRun Train(Par par, const nn::AcOptions& ac, double dropout, int grad_accum = 1, int steps = 3) {
  TrainRun out;
  const int world = par == Par::kSingle ? 1 : 2;
  auto comms = Unwrap(MakeThreadGroup(world, absl::Seconds(60)));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      const nn::GPTConfig cfg = Config(dropout);
      auto model = Unwrap(nn::GPT::Create(cfg));
      ASSERT_TRUE(model->InitWeights(5).ok());
      ASSERT_TRUE(nn::ApplyActivationCheckpointing(*model, ac).ok());  // before the parallelism
      DeviceMesh mesh;
      Layout batch_layout;
      if (par == Par::kFsdp2) {
        mesh = Unwrap(DeviceMesh::Create(*comms[static_cast<size_t>(r)], {2}));
        for (int64_t i = 0; i < cfg.n_layer; ++i) {
          ASSERT_TRUE(nn::FullyShard(*model->block(i), mesh, {.reshard_after_forward = i + 1 < cfg.n_layer}).ok());
        }
        ASSERT_TRUE(nn::FullyShard(*model, mesh).ok());
        batch_layout = Layout({Shard(0)});
      } else if (par == Par::kTp2) {
        mesh = Unwrap(DeviceMesh::Create(*comms[static_cast<size_t>(r)], {2}, {"tp"}));
        absl::Status tp = nn::ParallelizeModule(*model, mesh, nn::GptTensorParallelPlan(true), "tp");
        ASSERT_TRUE(tp.ok()) << tp;
        batch_layout = Layout({Replicate()});
      }
      // Counts the block outputs a checkpoint produced (the hook sees the block's output).
      int64_t checkpointed = 0;
      for (int64_t i = 0; i < cfg.n_layer; ++i) {
        model->block(i)->RegisterForwardOutputHook([&checkpointed](nn::Module&, Variable& y) {
          if (y.grad_fn() != nullptr && std::string(y.grad_fn()->name()) == "Checkpoint") ++checkpointed;
          return absl::OkStatus();
        });
      }
      nn::AdamW opt(model->Parameters(), {.lr = 3e-3, .eps = 1e-5, .weight_decay = 0.1});
      for (int step = 0; step < steps; ++step) {
        checkpointed = 0;
        CommCounter counter;
        if (mesh.defined()) SetCommCounter(mesh, &counter);
        if (nn::FsdpGroup* g = nn::FsdpGroupOf(*model)) g->ResetPeakUnshardedBytes();
        auto [inputs, targets] = Batch(step);
        const int64_t micro = kBatch / grad_accum;
        std::vector<double> losses;
        for (int k = 0; k < grad_accum; ++k) {
          Value x = Unwrap(inputs.Narrow(0, k * micro, micro)), y = Unwrap(targets.Narrow(0, k * micro, micro));
          if (mesh.defined()) {
            x = Unwrap(DTensor::Distribute(x.local(), mesh, batch_layout, {.src_rank = std::nullopt}));
            y = Unwrap(DTensor::Distribute(y.local(), mesh, batch_layout, {.src_rank = std::nullopt}));
          }
          nn::GPT::Output o = Unwrap(model->Forward(Variable::Constant(x), Variable::Constant(y)));
          Variable loss = grad_accum == 1 ? o.loss : Unwrap(Scale(o.loss, 1.0 / grad_accum));
          absl::Status b = Backward(loss);
          ASSERT_TRUE(b.ok()) << b;
          Value l = o.loss.value();
          if (l.is_dtensor()) l = Unwrap(l.dtensor().Redistribute(Layout({Replicate()})));
          losses.push_back(testing::Values(l.local())[0]);
        }
        EXPECT_EQ(checkpointed, grad_accum * static_cast<int64_t>(nn::CheckpointedBlocks(cfg.n_layer, ac).size()));
        if (par == Par::kTp2) {
          ASSERT_TRUE(nn::ReduceGradients(model->Parameters()).ok());
        }
        if (mesh.defined()) SetCommCounter(mesh, nullptr);
        std::vector<std::pair<std::string, std::vector<double>>> grads;
        for (auto& [name, p] : model->NamedParameters()) {
          const Value& g = p->grad();
          ASSERT_TRUE(g.defined()) << name;
          const Tensor full = g.is_dtensor() ? Unwrap(g.dtensor().FullTensor()) : g.local();
          grads.emplace_back(name, testing::Values(full));
        }
        ASSERT_TRUE(opt.Step().ok());
        opt.ZeroGrad();
        if (r == 0) {
          out.losses.push_back(losses);
          out.grads.push_back(std::move(grads));
          out.comms.push_back(counter.ToString());
          if (nn::FsdpGroup* g = nn::FsdpGroupOf(*model)) out.peak_unsharded.push_back(g->tree_peak_unsharded_bytes());
        }
      }
      auto state = Unwrap(model->StateDict());
      if (r == 0) {
        for (auto& [name, t] : state) out.params.emplace_back(name, testing::Values(t));
      }
    });
  }
  for (auto& t : threads) t.join();
  return out;
}

void ExpectBitIdentical(const TrainRun& got, const TrainRun& want, const std::string& what) {
  ASSERT_EQ(got.losses.size(), want.losses.size()) << what;
  ASSERT_FALSE(want.losses.empty()) << what;
  for (size_t s = 0; s < want.losses.size(); ++s) {
    EXPECT_EQ(got.losses[s], want.losses[s]) << what << ", losses of step " << s;
    ASSERT_EQ(got.grads[s].size(), want.grads[s].size()) << what;
    for (size_t i = 0; i < want.grads[s].size(); ++i) {
      EXPECT_EQ(got.grads[s][i].first, want.grads[s][i].first) << what;
      EXPECT_TRUE(got.grads[s][i].second == want.grads[s][i].second)
          << what << ", gradient of " << want.grads[s][i].first << " at step " << s;
    }
  }
  ASSERT_EQ(got.params.size(), want.params.size()) << what;
  for (size_t i = 0; i < want.params.size(); ++i) {
    EXPECT_TRUE(got.params[i].second == want.params[i].second) << what << ", parameter " << want.params[i].first;
  }
}

using Combo = std::tuple<Par, std::string, double>;  // parallelism, mode, dropout

class AcTraining : public ::testing::TestWithParam<Combo> {};

TEST_P(AcTraining, BitIdenticalToNoCheckpointing) {
  const auto& [par, mode, dropout] = GetParam();
  const std::string what = absl::StrCat(ParName(par), " ", mode, " dropout ", dropout);
  const TrainRun want = Train(par, {}, dropout);
  const TrainRun got = Train(par, Unwrap(nn::ParseAcMode(mode)), dropout);
  ExpectBitIdentical(got, want, what);
  // The reference itself moves: dropout and training change the losses from step to step.
  ASSERT_EQ(want.losses.size(), 3u);
  EXPECT_NE(want.losses[0], want.losses[2]) << what;
  if (par == Par::kFsdp2) {
    // The same collectives, and the reshard after forward still frees: no more parameters
    // gathered at once than without checkpointing.
    EXPECT_EQ(got.comms, want.comms) << what;
    EXPECT_EQ(got.peak_unsharded, want.peak_unsharded) << what;
  }
  if (par == Par::kTp2) {
    // selective:op keeps the hooks' redistributions: the same collectives. The other modes run
    // the hooks' collectives again in the recomputation.
    for (size_t s = 0; s < want.comms.size(); ++s) {
      if (mode == "selective:op") {
        EXPECT_EQ(got.comms[s], want.comms[s]) << what << ", step " << s;
      } else {
        EXPECT_NE(got.comms[s], want.comms[s]) << what << ", step " << s;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(All, AcTraining,
                         ::testing::Combine(::testing::Values(Par::kSingle, Par::kFsdp2, Par::kTp2),
                                            ::testing::Values(std::string("full"), std::string("selective:2"),
                                                              std::string("selective:op")),
                                            ::testing::Values(0.0, 0.1)),
                         [](const ::testing::TestParamInfo<Combo>& info) {
                           std::string mode = std::get<1>(info.param);
                           for (char& c : mode) {
                             if (c == ':') c = '_';
                           }
                           return absl::StrCat(ParName(std::get<0>(info.param)), "_", mode,
                                               std::get<2>(info.param) > 0 ? "_dropout" : "");
                         });

TEST(AcTraining, GradientAccumulationUnderFsdpIsBitIdentical) {
  const TrainRun want = Train(Par::kFsdp2, {}, 0.1, /*grad_accum=*/2, /*steps=*/3);
  for (const std::string mode : {"full", "selective:op"}) {
    const TrainRun got = Train(Par::kFsdp2, Unwrap(nn::ParseAcMode(mode)), 0.1, 2, 3);
    ExpectBitIdentical(got, want, "fsdp2 grad_accum 2 " + mode);
    EXPECT_EQ(got.comms, want.comms) << mode;
  }
}

// ---- Memory ----

// Peak bytes the allocator held above what was live before one forward + backward (the
// activations, the gradients and the transients), on 1 rank.
int64_t PeakStepBytes(const nn::AcOptions& ac) {
  // Blocks dominate: 4 layers of C = 64 on B T = 4 x 64 tokens; a small vocabulary.
  const nn::GPTConfig cfg = {.vocab_size = 64, .block_size = 64, .n_layer = 4, .n_head = 4, .n_embd = 64};
  auto model = Unwrap(nn::GPT::Create(cfg));
  EXPECT_TRUE(model->InitWeights(1).ok());
  EXPECT_TRUE(nn::ApplyActivationCheckpointing(*model, ac).ok());
  std::vector<int32_t> ids(4 * 64);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>((i * 7) % 64);
  Tensor x = Unwrap(Tensor::FromVector<int32_t>(ids, {4, 64}));
  Allocator& alloc = DefaultAllocator(Device::Cpu());
  const int64_t before = alloc.Stats().bytes_in_use;
  alloc.ResetPeakStats();
  {
    nn::GPT::Output o = Unwrap(model->Forward(Variable::Constant(x), Variable::Constant(x)));
    EXPECT_TRUE(Backward(o.loss).ok());
  }
  return alloc.Stats().peak_bytes_in_use - before;
}

TEST(AcMemory, PeakFallsNoneSelectiveFull) {
  using M = nn::AcOptions::Mode;
  const int64_t none = PeakStepBytes({});
  const int64_t layer = PeakStepBytes({.mode = M::kSelectiveLayer, .every = 2});
  const int64_t op = PeakStepBytes({.mode = M::kSelectiveOp});
  const int64_t full = PeakStepBytes({.mode = M::kFull});
  EXPECT_GT(none, layer);
  EXPECT_GT(layer, full);
  EXPECT_GT(none, op);
  EXPECT_GT(op, full);
  // Full keeps one [B, T, C] input per block instead of every activation: well under 60%
  // (without checkpointing the MLP keeps its pre-activation but not gelu of it, which its
  // backward rebuilds, so "none" keeps [B, T, 4C] less per block than a plain Linear + GELU).
  EXPECT_LT(5 * full, 3 * none) << "none " << none << ", full " << full;
  std::printf("peak step bytes: none %lld, selective:op %lld, selective:2 %lld, full %lld\n",
              static_cast<long long>(none), static_cast<long long>(op), static_cast<long long>(layer),
              static_cast<long long>(full));
}

}  // namespace
}  // namespace dtensor
