// Module bookkeeping and hooks, DistributeModule, and the optimizers/gradient utilities against
// naive references (single-rank values, hand-written update rules).
#include <cmath>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "dtensor/autograd/dispatch.h"
#include "dtensor/autograd/ops.h"
#include "dtensor/collectives/threads/threads_communicator.h"
#include "dtensor/nn/gpt.h"
#include "dtensor/nn/layers.h"
#include "dtensor/nn/optim.h"
#include "gtest/gtest.h"
#include "tests/testing/test_util.h"

namespace dtensor {
namespace {

using testing::Unwrap;

nn::GPTConfig Tiny() { return {.vocab_size = 13, .block_size = 8, .n_layer = 2, .n_head = 2, .n_embd = 8}; }

TEST(ModuleTest, NamesFollowPyTorchAndTiedWeightsAppearOnce) {
  auto m = Unwrap(nn::GPT::Create(Tiny()));
  auto named = m->NamedParameters();
  ASSERT_EQ(named.size(), 4u + 12u * 2);  // wte, wpe, ln_f.{w,b} + 12 per block
  EXPECT_EQ(named[0].first, "transformer.wte.weight");
  EXPECT_EQ(named[2].first, "transformer.h.0.ln_1.weight");
  EXPECT_NE(m->FindParameter("transformer.h.1.mlp.c_proj.bias"), nullptr);
  EXPECT_EQ(m->FindParameter("lm_head.weight"), nullptr);
  EXPECT_EQ(m->NumParameters(),
            13 * 8 + 8 * 8 + 2 * 8 + 2 * (4 * 8 + 3 * 8 * 8 + 3 * 8 + 8 * 8 + 8 + 4 * 8 * 8 * 2 + 4 * 8 + 8));
}

// GPTConfig::dtype reaches every parameter (it used to stop at wte, wpe and ln_f: the blocks
// stayed float32 and a bfloat16 model's forward failed at its first LayerNorm); a bfloat16
// model trains a step, its loss within bfloat16's precision of the float32 model's with the
// same weights (rounded).
TEST(ModuleTest, TheConfigsDtypeReachesEveryParameter) {
  nn::GPTConfig c = Tiny();
  auto f32 = Unwrap(nn::GPT::Create(c));
  ASSERT_TRUE(f32->InitWeights(5).ok());
  c.dtype = DType::kBFloat16;
  auto bf16 = Unwrap(nn::GPT::Create(c));
  for (auto& [name, p] : bf16->NamedParameters()) EXPECT_EQ(p->value().dtype(), DType::kBFloat16) << name;
  auto f32_state = Unwrap(f32->StateDict());
  std::vector<std::pair<std::string, Tensor>> rounded;
  for (auto& [name, t] : f32_state) rounded.emplace_back(name, Unwrap(Cast(t, DType::kBFloat16)));
  ASSERT_TRUE(bf16->LoadStateDict(rounded).ok());
  const Tensor x = Unwrap(Tensor::FromVector<int32_t>({1, 5, 7, 2, 12, 0, 3, 3}, {2, 4}));
  const Tensor y = Unwrap(Tensor::FromVector<int32_t>({5, 7, 2, 12, 0, 3, 3, 9}, {2, 4}));
  auto want = Unwrap(f32->Forward(Variable::Constant(Value(x)), Variable::Constant(Value(y))));
  auto got = Unwrap(bf16->Forward(Variable::Constant(Value(x)), Variable::Constant(Value(y))));
  const double w = testing::Values(want.loss.value().local())[0], g = testing::Values(got.loss.value().local())[0];
  EXPECT_NEAR(g, w, 2e-2 * w);
  ASSERT_TRUE(Backward(got.loss).ok());
  for (auto& [name, p] : bf16->NamedParameters()) {
    ASSERT_TRUE(p->grad().defined()) << name;
    EXPECT_EQ(p->grad().dtype(), DType::kBFloat16) << name;
  }
}

TEST(ModuleTest, LoadStateDictRejectsBadInput) {
  auto m = Unwrap(nn::GPT::Create(Tiny()));
  auto sd = Unwrap(m->StateDict());
  auto missing = sd;
  missing.pop_back();
  EXPECT_TRUE(absl::IsInvalidArgument(m->LoadStateDict(missing)));
  auto extra = sd;
  extra.emplace_back("nope.weight", Unwrap(Zeros({1}, DType::kFloat32)));
  EXPECT_TRUE(absl::IsInvalidArgument(m->LoadStateDict(extra)));
  auto bad = sd;
  bad[0].second = Unwrap(Zeros({2, 2}, DType::kFloat32));
  absl::Status s = m->LoadStateDict(bad);
  EXPECT_TRUE(absl::IsInvalidArgument(s));
  EXPECT_NE(s.message().find("transformer.wte.weight"), std::string::npos) << s;
  EXPECT_TRUE(absl::IsInvalidArgument(nn::GPT::Create({.vocab_size = 5, .n_head = 3, .n_embd = 8}).status()));
  // Sizes whose parameter count no machine holds (2^62 x 32 wrapped to a 0-byte wte and
  // crashed; 10^8 layers exhausted memory building the modules) are refused up front.
  for (const nn::GPTConfig& huge :
       {nn::GPTConfig{.vocab_size = int64_t{1} << 62, .n_head = 2, .n_embd = 32},
        nn::GPTConfig{.vocab_size = 64, .n_layer = 100'000'000, .n_head = 2, .n_embd = 32}}) {
    const absl::Status s = nn::GPT::Create(huge).status();
    EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
    EXPECT_NE(s.message().find("too many to allocate"), std::string::npos) << s;
  }
}

TEST(ModuleTest, HooksRunAroundForwardAndBeforeBackward) {
  nn::Linear lin(3, 2);
  std::vector<std::string> log;
  lin.RegisterForwardPreHook([&](nn::Module&) { return log.push_back("pre"), absl::OkStatus(); });
  lin.RegisterForwardHook([&](nn::Module&) { return log.push_back("post"), absl::OkStatus(); });
  lin.RegisterBackwardPreHook([&](nn::Module&) { return log.push_back("backward"), absl::OkStatus(); });
  Variable x = Variable::Leaf(testing::Random({4, 3}, DType::kFloat32, 1), true);
  Variable y = Unwrap(lin.Forward(x));
  EXPECT_EQ(log, (std::vector<std::string>{"pre", "post"}));
  ASSERT_TRUE(Backward(Unwrap(Sum(y))).ok());
  EXPECT_EQ(log, (std::vector<std::string>{"pre", "post", "backward"}));
  lin.RegisterForwardPreHook([](nn::Module&) { return absl::FailedPreconditionError("stop"); });
  EXPECT_TRUE(absl::IsFailedPrecondition(lin.Forward(x).status()));
}

// LayerNorm::ForwardAddResidual: without hooks one fused op (AddLayerNorm) with Add then
// Forward's values and gradients bit for bit; with a hook on the norm (as SequenceParallel
// installs) the unfused path, so the hook runs once and sees x + h as the module's input.
TEST(ModuleTest, LayerNormAddResidualFusesOnlyWithoutHooks) {
  const Tensor xt = testing::Random({2, 3, 8}, DType::kFloat32, 11),
               ht = testing::Random({2, 3, 8}, DType::kFloat32, 12);
  const Tensor wl = testing::Random({2, 3, 8}, DType::kFloat32, 13);
  struct Run {
    std::string node;
    std::vector<std::vector<double>> values;  // loss, dx, dh, dweight, dbias
  };
  auto run = [&](bool fused, bool hooked, int* hook_calls, std::vector<double>* hook_input) -> Run {
    nn::LayerNorm ln(8);
    ln.FindParameter("weight")->set_value(Value(testing::Random({8}, DType::kFloat32, 14, 0.5, 1.5)));
    ln.FindParameter("bias")->set_value(Value(testing::Random({8}, DType::kFloat32, 15)));
    if (hooked) {
      ln.RegisterForwardInputHook([=](nn::Module&, Variable& in) {
        ++*hook_calls;
        *hook_input = testing::Values(in.value().local());
        return absl::OkStatus();
      });
    }
    Variable x = Variable::Leaf(Value(xt), true), h = Variable::Leaf(Value(ht), true);
    ResidualNorm r;
    if (fused) {
      r = Unwrap(ln.ForwardAddResidual(x, h));
    } else {
      r.residual = Unwrap(Add(x, h));
      r.y = Unwrap(ln.Forward(r.residual));
    }
    Run o;
    o.node = r.y.grad_fn() ? r.y.grad_fn()->name() : "";
    const Variable out = Unwrap(Add(r.residual, Unwrap(Gelu(r.y))));
    const Variable loss = Unwrap(Sum(Unwrap(Mul(out, Variable::Constant(Value(wl))))));
    EXPECT_TRUE(Backward(loss).ok());
    o.values.push_back(testing::Values(loss.value().local()));
    for (const Variable* v : {&x, &h}) o.values.push_back(testing::Values(v->grad().local()));
    for (const char* p : {"weight", "bias"}) o.values.push_back(testing::Values(ln.FindParameter(p)->grad().local()));
    return o;
  };
  int calls = 0;
  std::vector<double> seen;
  const Run plain = run(false, false, &calls, &seen);
  const Run fused = run(true, false, &calls, &seen);
  EXPECT_EQ(fused.node, "AddLayerNorm");
  EXPECT_EQ(plain.node, "LayerNorm");
  EXPECT_EQ(fused.values, plain.values);
  const Run hooked = run(true, true, &calls, &seen);
  EXPECT_EQ(hooked.node, "LayerNorm");
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(seen, testing::Values(Unwrap(Add(xt, ht))));
  EXPECT_EQ(hooked.values, plain.values);
}

// A backward pass that outlives its module gets an error where the module's backward
// pre-hooks would run (they used to run on the destroyed module's memory).
TEST(ModuleTest, BackwardAfterTheModuleIsGoneIsAnError) {
  auto lin = std::make_unique<nn::Linear>(3, 2);
  int ran = 0;
  lin->RegisterBackwardPreHook([&](nn::Module&) { return ++ran, absl::OkStatus(); });
  Variable x = Variable::Leaf(testing::Random({4, 3}, DType::kFloat32, 1), true);
  Variable loss = Unwrap(Sum(Unwrap(lin->Forward(x))));
  lin.reset();
  const absl::Status s = Backward(loss);
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_EQ(ran, 0);
}

// Records the name of every dispatcher op this thread runs while installed.
class OpLog : public internal::DispatchObserver {
 public:
  OpLog() : prev_(internal::SetDispatchObserver(this)) {}
  ~OpLog() override { internal::SetDispatchObserver(prev_); }
  absl::StatusOr<std::optional<std::vector<Value>>> Replace(const OpDef&, absl::Span<const Value>,
                                                            const OpArgs&) override {
    return std::optional<std::vector<Value>>();
  }
  void Ran(const OpDef& op, absl::Span<const Value>, const OpArgs&, const std::vector<Value>&) override {
    names.insert(op.name);
  }
  std::set<std::string> names;

 private:
  internal::DispatchObserver* prev_;
};

// MLP runs as one op (mlp_gelu, its backward through linear_dx_gelu and linear_dw_bias) when
// its Linears have no hooks, and through the Linears' own Forwards (and hooks) when one has:
// the same output and gradients either way, bit for bit.
TEST(ModuleTest, MlpFusesItsLinearsOnlyWithoutHooks) {
  nn::MLP mlp(8);
  std::vector<std::pair<std::string, Tensor>> sd;
  uint64_t seed = 30;
  for (auto& [name, p] : mlp.NamedParameters()) {
    sd.emplace_back(name, testing::Random(p->value().shape(), DType::kFloat32, seed++));
  }
  ASSERT_TRUE(mlp.LoadStateDict(sd).ok());
  const Tensor x = testing::Random({2, 3, 8}, DType::kFloat32, 40);
  auto run = [&](std::set<std::string>* ops) {
    for (Variable* p : mlp.Parameters()) p->reset_grad();
    std::vector<std::vector<double>> out;
    OpLog log;
    Variable y = Unwrap(mlp.Forward(Variable::Constant(Value(x))));
    EXPECT_TRUE(Backward(Unwrap(Sum(Unwrap(Mul(y, y))))).ok());
    out.push_back(testing::Values(y.value().local()));
    for (Variable* p : mlp.Parameters()) out.push_back(testing::Values(p->grad().local()));
    *ops = log.names;
    return out;
  };
  std::set<std::string> fused_ops, hooked_ops;
  const auto fused = run(&fused_ops);
  EXPECT_TRUE(fused_ops.count("mlp_gelu") && fused_ops.count("linear_dx_gelu") && fused_ops.count("linear_dw_bias"));
  EXPECT_FALSE(fused_ops.count("linear_bias_gelu") || fused_ops.count("linear_bias"));
  int calls = 0;
  auto* c_fc = dynamic_cast<nn::Linear*>(mlp.NamedModules()[1].second);
  ASSERT_NE(c_fc, nullptr);
  ASSERT_EQ(mlp.NamedModules()[1].first, "c_fc");
  c_fc->RegisterForwardPreHook([&](nn::Module&) { return ++calls, absl::OkStatus(); });
  const auto hooked = run(&hooked_ops);
  EXPECT_EQ(calls, 1);
  EXPECT_TRUE(hooked_ops.count("linear_bias_gelu") && hooked_ops.count("linear_bias"));
  EXPECT_FALSE(hooked_ops.count("mlp_gelu"));
  EXPECT_EQ(fused, hooked);
}

TEST(OptimTest, AdamWAndSgdMatchTheirFormulas) {
  for (int which = 0; which < 2; ++which) {
    Variable p = Variable::Leaf(Unwrap(Tensor::FromVector<float>({1.0f, -2.0f, 0.5f}, {3})), true);
    const std::vector<double> g1 = {0.1, -0.3, 0.2}, g2 = {-0.2, 0.1, 0.05};
    std::vector<double> w = {1.0, -2.0, 0.5}, m(3, 0), v(3, 0), buf(3, 0);
    const double lr = 0.1, b1 = 0.9, b2 = 0.99, eps = 1e-8, wd = 0.05, mom = 0.8;
    nn::AdamW adam({&p}, {.lr = lr, .beta1 = b1, .beta2 = b2, .eps = eps, .weight_decay = wd});
    nn::SGD sgd({&p}, {.lr = lr, .momentum = mom, .weight_decay = wd});
    int t = 0;
    for (const auto& g : {g1, g2}) {
      ++t;
      p.set_grad(Value(testing::FromDoubles(g, {3}, DType::kFloat32)));
      ASSERT_TRUE(which == 0 ? adam.Step().ok() : sgd.Step().ok());
      for (size_t i = 0; i < 3; ++i) {
        if (which == 0) {
          w[i] *= 1 - lr * wd;
          m[i] = b1 * m[i] + (1 - b1) * g[i];
          v[i] = b2 * v[i] + (1 - b2) * g[i] * g[i];
          const double mh = m[i] / (1 - std::pow(b1, t)), vh = v[i] / (1 - std::pow(b2, t));
          w[i] -= lr * mh / (std::sqrt(vh) + eps);
        } else {
          const double gg = g[i] + wd * w[i];
          buf[i] = t == 1 ? gg : mom * buf[i] + gg;
          w[i] -= lr * buf[i];
        }
      }
    }
    testing::ExpectNear(testing::Values(p.value().local()), w, {1e-6, 1e-7}, which == 0 ? "adamw" : "sgd");
  }
}

TEST(OptimTest, WarmupCosineSchedule) {
  nn::CosineSchedule s{.max_lr = 1.0, .min_lr = 0.1, .warmup = 10, .total = 110};
  EXPECT_NEAR(nn::WarmupCosineLr(0, s), 0.1, 1e-12);
  EXPECT_NEAR(nn::WarmupCosineLr(9, s), 1.0, 1e-12);
  EXPECT_NEAR(nn::WarmupCosineLr(10, s), 1.0, 1e-12);
  EXPECT_NEAR(nn::WarmupCosineLr(60, s), 0.55, 1e-12);
  EXPECT_NEAR(nn::WarmupCosineLr(110, s), 0.1, 1e-12);
  EXPECT_NEAR(nn::WarmupCosineLr(500, s), 0.1, 1e-12);
}

// Gradients of a GPT under data parallelism: ReduceGradients issues few bucketed all_reduces
// and ClipGradNorm gives the single-rank norm; also for Shard(0)-laid-out parameters.
TEST(OptimTest, BucketedReductionAndGlobalNormOverRanks) {
  auto ref = Unwrap(nn::GPT::Create(Tiny()));
  ASSERT_TRUE(ref->InitWeights(5).ok());
  Tensor ids = Unwrap(Tensor::FromVector<int32_t>({1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 0, 1, 2, 3, 4, 5}, {3, 6}));
  Tensor tg = Unwrap(Tensor::FromVector<int32_t>({2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 0, 1, 2, 3, 4, 5, 6}, {3, 6}));
  ASSERT_TRUE(Backward(Unwrap(ref->Forward(Variable::Constant(ids), Variable::Constant(tg))).loss).ok());
  const double ref_norm = Unwrap(nn::ClipGradNorm(ref->Parameters(), 0.0));
  for (bool shard_params : {false, true}) {
    auto comms = Unwrap(MakeThreadGroup(2, absl::Seconds(20)));
    std::vector<std::thread> threads;
    for (int r = 0; r < 2; ++r) {
      threads.emplace_back([&, r] {
        DeviceMesh mesh = Unwrap(DeviceMesh::Create(*comms[static_cast<size_t>(r)], {2}));
        auto m = Unwrap(nn::GPT::Create(Tiny()));
        ASSERT_TRUE(m->InitWeights(5).ok());
        ASSERT_TRUE(nn::DistributeModule(*m, mesh, [&](const std::string&, const Variable& v) {
                      return shard_params && v.value().dim() == 2 ? Layout({Shard(0)}) : Layout({Replicate()});
                    }).ok());
        DTensor x = Unwrap(DTensor::Distribute(ids, mesh, {Shard(0)}, {.src_rank = std::nullopt}));
        DTensor y = Unwrap(DTensor::Distribute(tg, mesh, {Shard(0)}, {.src_rank = std::nullopt}));
        ASSERT_TRUE(Backward(Unwrap(m->Forward(Variable::Constant(x), Variable::Constant(y))).loss).ok());
        CommCounter counter;
        SetCommCounter(mesh, &counter);
        ASSERT_TRUE(nn::ReduceGradients(m->Parameters()).ok());
        SetCommCounter(mesh, nullptr);
        if (!shard_params) {
          EXPECT_EQ(counter.calls(CommKind::kAllReduce), 1) << counter.ToString();  // one bucket
        }
        for (Variable* p : m->Parameters()) EXPECT_EQ(p->grad().dtensor().layout(), p->value().dtensor().layout());
        const double norm = Unwrap(nn::ClipGradNorm(m->Parameters(), 0.0));
        EXPECT_NEAR(norm, ref_norm, 1e-5 * ref_norm);
        // Clipping to half the norm halves every gradient.
        const double clipped = Unwrap(nn::ClipGradNorm(m->Parameters(), norm / 2));
        EXPECT_NEAR(clipped, ref_norm, 1e-5 * ref_norm);
        EXPECT_NEAR(Unwrap(nn::ClipGradNorm(m->Parameters(), 0.0)), norm / 2, 1e-4 * norm);
        // The device-side form: the same norm (summed in float32), and the same clipping.
        const Tensor async_norm = Unwrap(nn::ClipGradNormAsync(m->Parameters(), 0.0));
        EXPECT_NEAR(testing::Values(async_norm)[0], norm / 2, 1e-4 * norm);
        std::vector<std::vector<double>> before;
        for (Variable* p : m->Parameters()) before.push_back(testing::Values(p->grad().local()));
        const Tensor clip_norm = Unwrap(nn::ClipGradNormAsync(m->Parameters(), norm / 8));
        EXPECT_NEAR(testing::Values(clip_norm)[0], norm / 2, 1e-4 * norm) << "the norm before clipping";
        EXPECT_NEAR(Unwrap(nn::ClipGradNorm(m->Parameters(), 0.0)), norm / 8, 1e-4 * norm);
        for (size_t i = 0; i < before.size(); ++i) {  // each gradient times 1/4
          const std::vector<double> after = testing::Values(m->Parameters()[i]->grad().local());
          for (size_t j = 0; j < after.size(); ++j)
            EXPECT_NEAR(after[j], before[i][j] / 4, 1e-5 * std::fabs(before[i][j]) + 1e-9);
        }
        // Below the threshold nothing changes, bit for bit (the factor is exactly 1).
        const std::vector<double> kept = testing::Values(m->Parameters()[0]->grad().local());
        ASSERT_TRUE(nn::ClipGradNormAsync(m->Parameters(), 1e9).ok());
        EXPECT_EQ(testing::Values(m->Parameters()[0]->grad().local()), kept);
      });
    }
    for (auto& t : threads) t.join();
  }
}

// Two copies of Tiny() (the same weights), each with its AdamW, on one rank with plain tensors
// (mesh null) or distributed over `mesh`: Shard(0) for 2-d parameters when shard_params, else
// Replicate.
struct ModelPair {
  std::unique_ptr<nn::GPT> m[2];
  std::optional<nn::AdamW> opt[2];
};
void MakePair(const DeviceMesh* mesh, bool shard_params, ModelPair& pair) {
  for (int k = 0; k < 2; ++k) {
    pair.m[k] = Unwrap(nn::GPT::Create(Tiny()));
    ASSERT_TRUE(pair.m[k]->InitWeights(5).ok());
    if (mesh != nullptr) {
      ASSERT_TRUE(nn::DistributeModule(*pair.m[k], *mesh, [&](const std::string&, const Variable& v) {
                    return shard_params && v.value().dim() == 2 ? Layout({Shard(0)}) : Layout({Replicate()});
                  }).ok());
    }
    pair.opt[k].emplace(pair.m[k]->Parameters(), nn::AdamWOptions{.lr = 0.01, .weight_decay = 0.1});
  }
}
// Forward and backward of one batch (sharded over the mesh's ranks where there is a mesh), and
// the gradients reduced to the parameters' layouts.
void ForwardBackward(nn::GPT& m, const DeviceMesh* mesh, const Tensor& ids, const Tensor& tg) {
  Variable x = Variable::Constant(ids), y = Variable::Constant(tg);
  if (mesh != nullptr) {
    x = Variable::Constant(Unwrap(DTensor::Distribute(ids, *mesh, {Shard(0)}, {.src_rank = std::nullopt})));
    y = Variable::Constant(Unwrap(DTensor::Distribute(tg, *mesh, {Shard(0)}, {.src_rank = std::nullopt})));
  }
  ASSERT_TRUE(Backward(Unwrap(m.Forward(x, y)).loss).ok());
  if (mesh != nullptr) {
    ASSERT_TRUE(nn::ReduceGradients(m.Parameters()).ok());
  }
}
// run(nullptr, false) on one rank, then run(&mesh, shard_params) on 2 thread ranks for
// Replicate and Shard(0) parameters.
void OnOneRankAndTwo(const std::function<void(const DeviceMesh*, bool)>& run) {
  run(nullptr, false);
  for (bool shard_params : {false, true}) {
    SCOPED_TRACE(shard_params ? "Shard(0)" : "Replicate");
    auto comms = Unwrap(MakeThreadGroup(2, absl::Seconds(20)));
    std::vector<std::thread> threads;
    for (int r = 0; r < 2; ++r) {
      threads.emplace_back([&, r] {
        DeviceMesh mesh = Unwrap(DeviceMesh::Create(*comms[static_cast<size_t>(r)], {2}));
        run(&mesh, shard_params);
      });
    }
    for (auto& t : threads) t.join();
  }
}
// The two models' parameters are the same, bit for bit.
void ExpectSameParameters(ModelPair& pair, const std::string& what) {
  const std::vector<Variable*> pa = pair.m[0]->Parameters(), pb = pair.m[1]->Parameters();
  for (size_t i = 0; i < pa.size(); ++i) {
    EXPECT_EQ(testing::Values(pb[i]->value().local()), testing::Values(pa[i]->value().local()))
        << pa[i]->name() << ", " << what;
  }
}

// AdamW::StepWithGradNorm(Async) against ClipGradNorm(Async)(params, 0) then Step() on a copy
// of the model: the same norm, bit for bit, the same parameters after two steps, and the same
// collectives; on one rank with plain tensors, and on 2 thread ranks with the parameters
// Replicate (DDP) and Shard(0) (FSDP-like: the squares add up over the ranks). The norm is the
// single-rank model's.
TEST(OptimTest, StepWithGradNormIsClipGradNormThenStep) {
  Tensor ids = Unwrap(Tensor::FromVector<int32_t>({1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 0, 1, 2, 3, 4, 5}, {3, 6}));
  Tensor tg = Unwrap(Tensor::FromVector<int32_t>({2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 0, 1, 2, 3, 4, 5, 6}, {3, 6}));
  auto ref = Unwrap(nn::GPT::Create(Tiny()));
  ASSERT_TRUE(ref->InitWeights(5).ok());
  ASSERT_TRUE(Backward(Unwrap(ref->Forward(Variable::Constant(ids), Variable::Constant(tg))).loss).ok());
  const double ref_norm = Unwrap(nn::ClipGradNorm(ref->Parameters(), 0.0));
  OnOneRankAndTwo([&](const DeviceMesh* mesh, bool shard_params) {
    ModelPair pair;
    MakePair(mesh, shard_params, pair);
    for (int step = 0; step < 2; ++step) {
      double norm[2] = {0, 0};
      int64_t reduces[2] = {0, 0};
      for (int k = 0; k < 2; ++k) {
        ForwardBackward(*pair.m[k], mesh, ids, tg);
        CommCounter counter;
        if (mesh != nullptr) SetCommCounter(*mesh, &counter);
        const std::vector<Variable*> params = pair.m[k]->Parameters();
        if (step == 0) {
          if (k == 0) {
            norm[k] = Unwrap(nn::ClipGradNorm(params, 0.0));
            ASSERT_TRUE(pair.opt[k]->Step().ok());
          } else {
            norm[k] = Unwrap(pair.opt[k]->StepWithGradNorm());
          }
        } else {
          if (k == 0) {
            norm[k] = testing::Values(Unwrap(nn::ClipGradNormAsync(params, 0.0)))[0];
            ASSERT_TRUE(pair.opt[k]->Step().ok());
          } else {
            norm[k] = testing::Values(Unwrap(pair.opt[k]->StepWithGradNormAsync()))[0];
          }
        }
        if (mesh != nullptr) SetCommCounter(*mesh, nullptr);
        reduces[k] = counter.calls(CommKind::kAllReduce);
        pair.opt[k]->ZeroGrad();
      }
      EXPECT_EQ(norm[1], norm[0]) << "step " << step;
      EXPECT_EQ(reduces[1], reduces[0]) << "step " << step;
      EXPECT_EQ(reduces[1], shard_params ? 1 : 0) << "step " << step;
      if (step == 0) {
        EXPECT_NEAR(norm[1], ref_norm, 1e-5 * ref_norm);
      }
      ExpectSameParameters(pair, absl::StrCat("step ", step));
    }
  });
}

// AdamW::StepWithClip(Async) against ClipGradNorm(Async)(params, max_norm) then Step() on a
// copy of the model: the same norm, the same parameters after each step, bit for bit, and the
// same collectives, with the gradients themselves left unscaled; steps that clip (max_norm half
// the norm) and one that does not, on one rank with plain tensors and on 2 thread ranks with
// the parameters Replicate and Shard(0).
// A NaN in one gradient makes the norm NaN, and clipping makes every gradient NaN, as torch's
// clip_grad_norm_ does (it scales by its NaN factor); an infinite norm zeroes the finite ones.
TEST(OptimTest, ClipGradNormWithANaNOrInfNormIsTorchs) {
  for (double bad : {std::nan(""), std::numeric_limits<double>::infinity()}) {
    Variable a = Variable::Leaf(Value(Unwrap(Zeros({3}, DType::kFloat32))), true, "a");
    Variable b = Variable::Leaf(Value(Unwrap(Zeros({1}, DType::kFloat32))), true, "b");
    a.set_grad(Value(testing::FromDoubles({1.0, bad, 2.0}, {3}, DType::kFloat32)));
    b.set_grad(Value(testing::FromDoubles({3.0}, {1}, DType::kFloat32)));
    const double norm = Unwrap(nn::ClipGradNorm({&a, &b}, 1.0));
    const std::vector<double> ga = testing::Values(a.grad().local()), gb = testing::Values(b.grad().local());
    if (std::isnan(bad)) {
      EXPECT_TRUE(std::isnan(norm));
      for (double g : {ga[0], ga[1], ga[2], gb[0]}) EXPECT_TRUE(std::isnan(g)) << g;
    } else {
      EXPECT_TRUE(std::isinf(norm));
      EXPECT_EQ(ga[0], 0.0);
      EXPECT_TRUE(std::isnan(ga[1]));  // inf * 0
      EXPECT_EQ(gb[0], 0.0);
    }
  }
}

TEST(OptimTest, StepWithClipIsClipGradNormThenStep) {
  Tensor ids = Unwrap(Tensor::FromVector<int32_t>({1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 0, 1, 2, 3, 4, 5}, {3, 6}));
  Tensor tg = Unwrap(Tensor::FromVector<int32_t>({2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 0, 1, 2, 3, 4, 5, 6}, {3, 6}));
  OnOneRankAndTwo([&](const DeviceMesh* mesh, bool shard_params) {
    ModelPair pair;
    MakePair(mesh, shard_params, pair);
    // Steps 0 and 1 clip, on the host and on the device; step 2's max_norm is above the norm.
    for (int step = 0; step < 3; ++step) {
      double norm[2] = {0, 0};
      int64_t reduces[2] = {0, 0};
      double max_norm = 0;
      for (int k = 0; k < 2; ++k) {
        ForwardBackward(*pair.m[k], mesh, ids, tg);
        const std::vector<Variable*> params = pair.m[k]->Parameters();
        if (k == 0) {
          const double unclipped = Unwrap(nn::ClipGradNorm(params, 0.0));
          max_norm = step < 2 ? unclipped / 2 : unclipped * 2;
        }
        std::vector<std::vector<double>> grads_before;
        for (Variable* p : params) grads_before.push_back(testing::Values(p->grad().local()));
        CommCounter counter;
        if (mesh != nullptr) SetCommCounter(*mesh, &counter);
        if (step != 1) {
          if (k == 0) {
            norm[k] = Unwrap(nn::ClipGradNorm(params, max_norm));
            ASSERT_TRUE(pair.opt[k]->Step().ok());
          } else {
            norm[k] = Unwrap(pair.opt[k]->StepWithClip(max_norm));
          }
        } else {
          if (k == 0) {
            norm[k] = testing::Values(Unwrap(nn::ClipGradNormAsync(params, max_norm)))[0];
            ASSERT_TRUE(pair.opt[k]->Step().ok());
          } else {
            norm[k] = testing::Values(Unwrap(pair.opt[k]->StepWithClipAsync(max_norm)))[0];
          }
        }
        if (mesh != nullptr) SetCommCounter(*mesh, nullptr);
        reduces[k] = counter.calls(CommKind::kAllReduce);
        if (k == 1) {
          for (size_t i = 0; i < params.size(); ++i) {
            EXPECT_EQ(testing::Values(params[i]->grad().local()), grads_before[i])
                << params[i]->name() << ": StepWithClip scaled the gradient itself, step " << step;
          }
        }
        pair.opt[k]->ZeroGrad();
      }
      EXPECT_EQ(norm[1], norm[0]) << "step " << step;
      EXPECT_GT(norm[0], 0.0);
      EXPECT_EQ(reduces[1], reduces[0]) << "step " << step;
      ExpectSameParameters(pair, absl::StrCat("step ", step));
    }
  });
}

// AdamW's bias correction counts each parameter's own updates (PyTorch's state['step']): a
// parameter whose first gradient comes at the second Step() moves by lr * g / |g| like any
// first step (with the shared count it moved 0.744 of that).
TEST(OptimTest, AdamWStepCountIsPerParameter) {
  Variable a = Variable::Leaf(Unwrap(Zeros({1}, DType::kFloat32)), true);
  Variable b = Variable::Leaf(Unwrap(Zeros({1}, DType::kFloat32)), true);
  nn::AdamW opt({&a, &b}, {.lr = 0.1, .weight_decay = 0.0});
  a.set_grad(Value(Unwrap(Full({1}, 2.0, DType::kFloat32))));
  ASSERT_TRUE(opt.Step().ok());
  EXPECT_NEAR(testing::Values(a.value().local())[0], -0.1, 1e-6);
  EXPECT_EQ(testing::Values(b.value().local())[0], 0.0) << "no gradient, no update";
  a.set_grad(Value(Unwrap(Full({1}, 2.0, DType::kFloat32))));
  b.set_grad(Value(Unwrap(Full({1}, 2.0, DType::kFloat32))));
  ASSERT_TRUE(opt.Step().ok());
  EXPECT_NEAR(testing::Values(b.value().local())[0], -0.1, 1e-6) << "b's first step";
  EXPECT_NEAR(testing::Values(a.value().local())[0], -0.2, 1e-6) << "a's second step (same gradient)";
  EXPECT_EQ(opt.step_count(), 2);
  EXPECT_EQ(opt.param_steps(), std::vector<int64_t>({2, 1}));
  // Counts set back (a resume's): each within [0, the optimizer's count], else refused unchanged.
  ASSERT_TRUE(opt.set_steps(5, {5, 3}).ok());
  EXPECT_EQ(opt.param_steps(), std::vector<int64_t>({5, 3}));
  for (const std::vector<int64_t>& bad : {std::vector<int64_t>{-1, 3}, std::vector<int64_t>{6, 3}}) {
    const absl::Status s = opt.set_steps(5, bad);
    EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
    EXPECT_NE(s.message().find("is outside [0, 5]"), std::string::npos) << s;
  }
  EXPECT_EQ(opt.param_steps(), std::vector<int64_t>({5, 3}));
}

// Parameters sharded over different sub-meshes of one 2x2 mesh: A = [1, 2, 3, 4] as S(0) on
// "dp", B = [1, 1, 1, 1] as S(0) on "tp". Their shards' squares add up over different groups
// of ranks; every rank must get the norm sqrt(30 + 4). (Grouping by mesh dim index alone put
// both in one group: ranks 0-1 got 3.742 and ranks 2-3 got 7.348.)
TEST(OptimTest, GlobalNormOverParametersOnDifferentSubMeshes) {
  auto comms = Unwrap(MakeThreadGroup(4, absl::Seconds(20)));
  std::vector<std::thread> threads;
  for (int r = 0; r < 4; ++r) {
    threads.emplace_back([&, r] {
      DeviceMesh mesh = Unwrap(DeviceMesh::Create(*comms[static_cast<size_t>(r)], {2, 2}, {"dp", "tp"}));
      DeviceMesh dp = Unwrap(mesh["dp"]), tp = Unwrap(mesh["tp"]);
      auto make = [](const DeviceMesh& m, std::vector<float> grad) {
        const Tensor g = Unwrap(Tensor::FromVector<float>(grad, {4}));
        Variable v = Variable::Leaf(
            Unwrap(DTensor::Distribute(Unwrap(Zeros({4}, DType::kFloat32)), m, {Shard(0)}, {.src_rank = std::nullopt})),
            true);
        v.set_grad(Unwrap(DTensor::Distribute(g, m, {Shard(0)}, {.src_rank = std::nullopt})));
        return v;
      };
      Variable a = make(dp, {1, 2, 3, 4}), b = make(tp, {1, 1, 1, 1});
      const double norm = Unwrap(nn::ClipGradNorm({&a, &b}, 0.0));
      EXPECT_NEAR(norm, std::sqrt(34.0), 1e-6) << "rank " << r;
      // And the other order of the parameters.
      EXPECT_NEAR(Unwrap(nn::ClipGradNorm({&b, &a}, 0.0)), std::sqrt(34.0), 1e-6) << "rank " << r;
      // And read in AdamW's own pass.
      nn::AdamW opt({&a, &b}, {});
      EXPECT_NEAR(Unwrap(opt.StepWithGradNorm()), std::sqrt(34.0), 1e-6) << "rank " << r;
    });
  }
  for (auto& t : threads) t.join();
}

}  // namespace
}  // namespace dtensor
