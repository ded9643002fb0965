// Plan files: the GPT plan's JSON twin (examples/gpt/plans/gpt_tp.json) loads into the rules
// the code builds, gives every parameter the same placements and trains to the same losses;
// files that are wrong are refused with the rule's text; ParallelDims resolves -1 and refuses
// degrees that do not make the world.
#include "dtensor/nn/parallel/plan_file.h"

#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "dtensor/autograd/ops.h"
#include "dtensor/collectives/threads/threads_communicator.h"
#include "dtensor/nn/gpt.h"
#include "dtensor/nn/optim.h"
#include "dtensor/nn/parallel/gpt_plan.h"
#include "gtest/gtest.h"
#include "tests/testing/test_util.h"

namespace dtensor {
namespace {

using testing::Unwrap;

const std::string kPlanPath = std::string(DTENSOR_SOURCE_DIR) + "/examples/gpt/plans/gpt_tp.json";

nn::GPTConfig Config() { return {.vocab_size = 61, .block_size = 8, .n_layer = 2, .n_head = 4, .n_embd = 32}; }

TEST(PlanFileTest, TheGptPlanFileHoldsTheCodesRules) {
  const nn::PlanFile f = Unwrap(nn::ReadPlanFile(kPlanPath));
  EXPECT_EQ(f.dims, (nn::ParallelDims{.dp_replicate = 1, .dp_shard = -1, .tp = 2}));
  EXPECT_EQ(f.plan.rules, nn::GptTensorParallelPlan(true).rules) << f.plan.ToString();
  ASSERT_EQ(f.plan.params.size(), 1u);
  EXPECT_EQ(f.plan.params[0].pattern, "transformer.wpe.weight");
  EXPECT_TRUE(f.plan.every_parameter);
  // Written back and read again: the same plan.
  const nn::PlanFile back = Unwrap(nn::ParsePlanFile(nn::PlanFileToJson(f)));
  EXPECT_EQ(back.plan, f.plan);
  EXPECT_EQ(back.dims, f.dims);
  // A code plan (every_parameter false: parameters no rule names are Replicate) written out
  // reads back as the same plan, not as one that refuses wpe.
  const nn::PlanFile code{.dims = f.dims, .plan = nn::GptTensorParallelPlan(false)};
  ASSERT_FALSE(code.plan.every_parameter);
  EXPECT_EQ(Unwrap(nn::ParsePlanFile(nn::PlanFileToJson(code))).plan, code.plan);
}

// Per rank: every parameter's layout and the losses of 3 steps, under `plan`.
struct Outcome {
  std::vector<std::vector<std::string>> layouts;  // [rank][parameter]
  std::vector<double> losses;
};

Outcome TrainTp(const nn::ParallelizePlan& plan) {
  Outcome out;
  out.layouts.resize(2);
  auto comms = Unwrap(MakeThreadGroup(2, absl::Seconds(60)));
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      DeviceMesh mesh = Unwrap(DeviceMesh::Create(*comms[static_cast<size_t>(r)], {2}, {"tp"}));
      auto model = Unwrap(nn::GPT::Create(Config()));
      ASSERT_TRUE(model->InitWeights(3).ok());
      const absl::Status s = nn::ParallelizeModule(*model, mesh, plan, "tp");
      ASSERT_TRUE(s.ok()) << s;
      for (auto& [name, p] : model->NamedParameters()) {
        out.layouts[static_cast<size_t>(r)].push_back(absl::StrCat(name, " ", p->value().dtensor().ToString()));
      }
      nn::AdamW opt(model->Parameters(), {.lr = 3e-3});
      for (int step = 0; step < 3; ++step) {
        std::vector<int32_t> x, y;
        for (int i = 0; i < 32; ++i) {
          x.push_back((i * 7 + step) % 61);
          y.push_back((i * 5 + 1) % 61);
        }
        Value xv = Unwrap(DTensor::Distribute(Unwrap(Tensor::FromVector<int32_t>(x, {4, 8})), mesh, {Replicate()},
                                              {.src_rank = std::nullopt}));
        Value yv = Unwrap(DTensor::Distribute(Unwrap(Tensor::FromVector<int32_t>(y, {4, 8})), mesh, {Replicate()},
                                              {.src_rank = std::nullopt}));
        nn::GPT::Output o = Unwrap(model->Forward(Variable::Constant(xv), Variable::Constant(yv)));
        ASSERT_TRUE(Backward(o.loss).ok());
        ASSERT_TRUE(nn::ReduceGradients(model->Parameters()).ok());
        ASSERT_TRUE(opt.Step().ok());
        opt.ZeroGrad();
        const double l = testing::Values(Unwrap(o.loss.value().dtensor().Redistribute({Replicate()})).ToLocal())[0];
        if (r == 0) out.losses.push_back(l);
      }
    });
  }
  for (auto& t : threads) t.join();
  return out;
}

TEST(PlanFileTest, TheFileAndTheCodeGiveTheSameLayoutsAndLosses) {
  const Outcome code = TrainTp(nn::GptTensorParallelPlan(true));
  const Outcome file = TrainTp(Unwrap(nn::ReadPlanFile(kPlanPath)).plan);
  EXPECT_EQ(file.layouts, code.layouts);
  ASSERT_EQ(code.losses.size(), 3u);
  EXPECT_EQ(file.losses, code.losses);  // the same computation, bit for bit
}

TEST(PlanFileTest, WrongFilesAreRefusedWithTheRule) {
  auto parse_error = [](const std::string& json, const std::string& needle) {
    const absl::Status s = nn::ParsePlanFile(json, "p.json").status();
    EXPECT_TRUE(absl::IsInvalidArgument(s)) << json << ": " << s;
    EXPECT_NE(s.message().find(needle), std::string::npos) << s;
  };
  parse_error("{", "p.json: not a JSON object");
  parse_error(R"j({"mesh": {"pp": 2}, "rules": []})j", "unknown mesh dim \"pp\"");
  parse_error(R"j({"rules": [{"module": "x", "style": "Colwise"}]})j", R"j({"module":"x","style":"Colwise"})j");
  parse_error(R"j({"rules": [{"param": "x", "placements": {"ep": "R"}}]})j", "unknown mesh dim \"ep\"");
  parse_error(R"j({"rules": [{"param": "x", "placements": {"tp": "S"}}]})j", R"j("tp":"S")j");
  parse_error(R"j({"rules": [{"layer": "x"}]})j", "names neither");
  parse_error(R"j({"mode": 1, "rules": []})j", "unknown key \"mode\"");
  parse_error(R"j({"rules": [{"module": "lm_head", "module": "transformer.wte", "style": "RowwiseParallel"}]})j",
              "key \"module\" appears twice");
  parse_error(R"j({"every_parameter": 1, "rules": []})j", "must be true or false");
  // Degrees past int64 (they wrapped: 2^64 - 1 read as -1, "the ranks left over").
  parse_error(R"j({"mesh": {"tp": 18446744073709551615}, "rules": []})j",
              "mesh dim tp has degree 18446744073709551615, out of range");
  parse_error(R"j({"mesh": {"dp_shard": 9223372036854775808}, "rules": []})j", "out of range");
  parse_error(std::string(100000, '[') + std::string(100000, ']'), "nests deeper than 16 levels");

  // Applied: a shard of a dim the parameter lacks, a parameter no rule covers, a
  // data-parallel dim, each naming the rule or the parameter.
  auto comms = Unwrap(MakeThreadGroup(1));
  DeviceMesh mesh = Unwrap(DeviceMesh::Create(*comms[0], {1, 1}, {"dp_shard", "tp"}));
  auto apply_error = [&](const std::string& json, const std::string& needle) {
    auto model = Unwrap(nn::GPT::Create(Config()));
    const nn::PlanFile f = Unwrap(nn::ParsePlanFile(json));
    const absl::Status s = nn::ParallelizeModule(*model, mesh, f.plan, "tp");
    EXPECT_TRUE(absl::IsInvalidArgument(s)) << json << ": " << s;
    EXPECT_NE(s.message().find(needle), std::string::npos) << s;
  };
  apply_error(
      R"j({"rules": [{"param": "transformer.wpe.weight", "placements": {"tp": "S(2)"}}]})j",
      R"j(rule '{"param":"transformer.wpe.weight","placements":{"tp":"S(2)"}}' on parameter transformer.wpe.weight: S(2) of a 2-d tensor)j");
  apply_error(R"j({"rules": [{"module": "transformer.wte", "style": "RowwiseParallel"}]})j",
              "parameter transformer.wpe.weight ([8, 32]) is covered by no rule");
  apply_error(R"j({"rules": [{"param": "transformer.wpe.weight", "placements": {"dp_shard": "S(0)"}}]})j",
              "dp_shard is a data-parallel dim");

  EXPECT_EQ(Unwrap((nn::ParallelDims{.dp_replicate = 2, .dp_shard = -1, .tp = 2}).Resolve(8)),
            (nn::ParallelDims{.dp_replicate = 2, .dp_shard = 2, .tp = 2}));
  const absl::Status bad = (nn::ParallelDims{.dp_replicate = 1, .dp_shard = 3, .tp = 1}).Resolve(4).status();
  EXPECT_TRUE(absl::IsInvalidArgument(bad));
  EXPECT_NE(bad.message().find("dp_replicate 1 x dp_shard 3 x tp 1 does not make the world size 4"), std::string::npos)
      << bad;
  EXPECT_TRUE(
      absl::IsInvalidArgument((nn::ParallelDims{.dp_replicate = -1, .dp_shard = -1, .tp = 1}).Resolve(4).status()));
}

}  // namespace
}  // namespace dtensor
