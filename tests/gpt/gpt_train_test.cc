// The trainer end to end: data-parallel runs — FSDP (the default), DDP, HSDP, gradient
// accumulation; threads, UCX processes under dtrun and mpirun — report the same loss at every
// step as the single-rank run on the same global batches and end with the same parameters,
// and the loss falls.
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <random>
#include <regex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "dtensor/autograd/ops.h"
#include "dtensor/checkpoint/checkpoint.h"
#include "dtensor/kernels/cpu/blas_core.h"
#include "dtensor/nn/gpt.h"
#include "dtensor/nn/safetensors.h"
#include "dtensor/tensor/device.h"
#include "examples/gpt/data.h"
#include "examples/gpt/llmc.h"
#include "examples/gpt/tokenizer.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/testing/run_process.h"
#include "tests/testing/test_util.h"

namespace dtensor {
namespace {

using testing::ProcessOptions;
using testing::ProcessRun;

std::vector<std::string> Words(const std::string& s) { return absl::StrSplit(s, ' ', absl::SkipEmpty()); }

// Each test's files live in a directory of its own, removed at its end.
class GptTrainTest : public ::testing::Test {
 protected:
  std::string Path(const std::string& name) const { return dir_.Path(name); }

  // A few KB of English text (fixed, so the test needs no package).
  std::string Corpus() const {
    const std::string path = Path("corpus.txt");
    std::string text;
    for (int i = 0; i < 40; ++i) {
      text +=
          "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
          "foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of Light.\n";
    }
    testing::WriteBytes(path, text);
    return path;
  }

  // `launcher` (words before the trainer, e.g. dtrun's), the trainer, then `flags`; stdout and
  // stderr together in out. The run is killed after 5 minutes (a hang fails, never blocks).
  ProcessRun Train(const std::string& launcher, const std::string& flags, ProcessOptions options = {}) const {
    std::vector<std::string> argv = Words(launcher);
    argv.push_back(GPT_TRAIN_PATH);
    for (std::string& w : Words(flags)) argv.push_back(std::move(w));
    options.merge_output = true;
    options.timeout = absl::Minutes(5);
    return testing::RunProcess(argv, options);
  }

  // The loss at each step of the 2-layer model on the corpus, read from --metrics.
  std::vector<double> RunLosses(const std::string& launcher, const std::string& flags, const std::string& tag) const {
    const std::string metrics = Path(tag + ".jsonl");
    const ProcessRun run = Train(launcher, "--text " + Corpus() +
                                               " --n-layer 2 --n-head 2 --n-embd 32 --seq 16 --steps 6 --lr 3e-3"
                                               " --sample-tokens 0 --metrics " +
                                               metrics + " " + flags);
    EXPECT_EQ(run.code, 0) << launcher << " " << flags << ":\n" << run.out;
    std::vector<double> losses;
    std::ifstream in(metrics);
    std::string line;
    while (std::getline(in, line)) {
      auto j = nlohmann::json::parse(line);
      EXPECT_TRUE(j.contains("tokens_per_s"));
      losses.push_back(j.at("loss").get<double>());
    }
    return losses;
  }

 private:
  testing::ScopedTempDir dir_{"gpt_train_test"};
};

// 20 steps of the 2-layer model on 12-row batches (2, 3, 4 ranks and 2, 4 micro-batches
// divide them; C = 32 does not divide by 3): the losses and the final parameters.
struct Final {
  std::vector<double> losses;
  NamedTensors params;
};

void ExpectSame(const std::vector<double>& a, const std::vector<double>& b);

class GptFsdpTest : public GptTrainTest {
 protected:
  Final RunFinal(const std::string& launcher, const std::string& flags, const std::string& tag) const {
    Final out;
    const std::string params = Path(tag + ".safetensors");
    // --eps 1e-5: see fully_shard_test.cc (AdamW's eps and elements whose gradient is ~0).
    out.losses =
        RunLosses(launcher, "--batch 12 --steps 20 --eps 1e-5 --device cpu --save-final " + params + " " + flags, tag);
    auto file = ReadSafetensors(params);
    EXPECT_TRUE(file.ok()) << tag << ": " << file.status();
    if (file.ok()) out.params = *std::move(file);
    return out;
  }
  const Final& One() {
    if (one_.losses.empty()) one_ = RunFinal("", "--ranks 1", "one");
    return one_;
  }
  // rtol: 1e-5 for data parallelism; tensor parallelism sums partial matmuls in another order
  // (first step 1e-5, later steps and parameters 1e-4).
  void ExpectSameRun(const Final& got, const std::string& what, double rtol = 1e-5) {
    SCOPED_TRACE(what);
    ASSERT_EQ(got.losses.size(), One().losses.size());
    EXPECT_NEAR(got.losses[0], One().losses[0], 1e-5 * One().losses[0]) << "first step";
    for (size_t i = 0; i < got.losses.size(); ++i) {
      EXPECT_NEAR(got.losses[i], One().losses[i], rtol * One().losses[i]) << "step " << i;
    }
    ASSERT_EQ(got.params.tensors.size(), One().params.tensors.size());
    for (const auto& [name, t] : One().params.tensors) {
      const Tensor* g = got.params.Find(name);
      ASSERT_NE(g, nullptr) << name;
      testing::ExpectNormNear(testing::Values(*g), testing::Values(t), rtol, name);
    }
  }

 private:
  Final one_;
};

void ExpectSame(const std::vector<double>& a, const std::vector<double>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], b[i], 1e-5 * std::abs(b[i])) << "step " << i;
}

TEST_F(GptTrainTest, DataParallelLossesEqualSingleRank) {
  const std::vector<double> one = RunLosses("", "--batch 6 --ranks 1 --device cpu", "r1");
  ASSERT_EQ(one.size(), 6u);
  EXPECT_LT(one.back(), one.front() - 0.3) << "loss did not fall";
  ExpectSame(RunLosses("", "--batch 6 --ranks 2 --device cpu", "r2"), one);
  ExpectSame(RunLosses("", "--batch 6 --ranks 4 --device cpu", "r4"), one);  // 6 rows over 4 ranks: 2, 2, 2, 0
}

TEST_F(GptFsdpTest, FsdpOnTwoThreeAndFourThreadRanksEqualsOneRank) {
  ASSERT_EQ(One().losses.size(), 20u);
  EXPECT_LT(One().losses.back(), One().losses.front() - 0.3) << "loss did not fall";
  ExpectSameRun(RunFinal("", "--ranks 2", "f2"), "FSDP 2 ranks");
  ExpectSameRun(RunFinal("", "--ranks 3", "f3"), "FSDP 3 ranks");
  ExpectSameRun(RunFinal("", "--ranks 4", "f4"), "FSDP 4 ranks");
}

TEST_F(GptFsdpTest, NoReshardHsdpAndDdpEqualOneRank) {
  ExpectSameRun(RunFinal("", "--ranks 2 --reshard-after-forward false", "nr2"), "FSDP 2, no reshard after forward");
  ExpectSameRun(RunFinal("", "--ranks 4 --dp-replicate 2", "h4"), "HSDP 2x2");
  ExpectSameRun(RunFinal("", "--ranks 2 --dp-shard 1 --dp-replicate 2", "d2"), "DDP 2");
}

TEST_F(GptFsdpTest, GradientAccumulationEqualsOneBatch) {
  ExpectSameRun(RunFinal("", "--ranks 1 --grad-accum 2", "a1x2"), "1 rank, 2 micro-batches");
  ExpectSameRun(RunFinal("", "--ranks 1 --grad-accum 4", "a1x4"), "1 rank, 4 micro-batches");
  ExpectSameRun(RunFinal("", "--ranks 2 --grad-accum 2", "a2x2"), "FSDP 2, 2 micro-batches");
  ExpectSameRun(RunFinal("", "--ranks 2 --grad-accum 4 --grad-sync last", "a2x4l"),
                "FSDP 2, 4 micro-batches, reduce-scatter on the last");
  ExpectSameRun(RunFinal("", "--ranks 2 --dp-shard 1 --dp-replicate 2 --grad-accum 2", "ad2x2"),
                "DDP 2, 2 micro-batches");
}

TEST_F(GptFsdpTest, FsdpOnUcxProcessesUnderDtrunAndMpirunEqualsOneRank) {
  ExpectSameRun(RunFinal(std::string(DTRUN_PATH) + " --nproc-per-node 2", "", "u2"), "FSDP 2 UCX processes (dtrun)");
  const ProcessRun which = testing::RunProcess({"/bin/sh", "-c", "command -v mpirun"});
  const std::string mpirun(absl::StripTrailingAsciiWhitespace(which.out));
  if (which.code != 0 || mpirun.empty()) GTEST_SKIP() << "mpirun is not installed";
  ExpectSameRun(RunFinal(mpirun + " --allow-run-as-root --oversubscribe -np 2", "", "m2"),
                "FSDP 2 UCX processes (mpirun)");
}

// bfloat16 gathers and compute (float32 master weights and reduction): 2 ranks track the
// 1-rank run of the same policy (1e-3) and float32 (2e-2) over 20 steps.
TEST_F(GptFsdpTest, Bfloat16PolicyTracksOneRankAndFloat32) {
  const Final bf1 = RunFinal("", "--ranks 1 --param-dtype bf16", "b1");
  const Final bf2 = RunFinal("", "--ranks 2 --param-dtype bf16", "b2");
  ASSERT_EQ(bf1.losses.size(), 20u);
  ASSERT_EQ(bf2.losses.size(), 20u);
  for (size_t i = 0; i < 20; ++i) {
    EXPECT_NEAR(bf2.losses[i], bf1.losses[i], 1e-3 * bf1.losses[i]) << "step " << i;
    EXPECT_NEAR(bf2.losses[i], One().losses[i], 2e-2 * One().losses[i]) << "step " << i;
  }
}

// Memory per rank with the allocator's own counters (UCX processes: one allocator each), 4
// blocks of C = 128 (blocks dominate): at rest (after the update) FSDP's parameters, gradients
// and AdamW state are half of one rank's, and the allocator holds little else; its peak in a
// step stays below DDP's by what FSDP saved at rest, give or take two gathered blocks.
TEST_F(GptFsdpTest, MemoryAtRestIsHalfAndThePeakFollows) {
  auto last = [&](const std::string& launcher, const std::string& flags, const std::string& tag) {
    const std::string metrics = Path(tag + ".jsonl");
    const ProcessRun run = Train(launcher, "--text " + Corpus() +
                                               " --n-layer 4 --n-head 4 --n-embd 128 --seq 32 --batch 8 --steps 2"
                                               " --sample-tokens 0 --device cpu --metrics " +
                                               metrics + " " + flags);
    EXPECT_EQ(run.code, 0) << run.out;
    std::ifstream in(metrics);
    std::string line, prev;
    while (std::getline(in, line)) prev = line;
    return prev.empty() ? nlohmann::json::object() : nlohmann::json::parse(prev);
  };
  auto state = [](const nlohmann::json& m) {
    return m.value("param_bytes", int64_t{0}) + m.value("grad_bytes", int64_t{0}) + m.value("optim_bytes", int64_t{0});
  };
  const std::string dtrun2 = std::string(DTRUN_PATH) + " --nproc-per-node 2";
  const nlohmann::json one = last(std::string(DTRUN_PATH) + " --nproc-per-node 1", "", "mem1");
  const nlohmann::json ddp = last(dtrun2, "--dp-shard 1 --dp-replicate 2", "memddp");
  const nlohmann::json fsdp = last(dtrun2, "", "memfsdp");
  ASSERT_GT(state(one), 0);
  EXPECT_EQ(state(ddp), state(one));
  EXPECT_EQ(state(fsdp), state(one) / 2);  // C = 128, V = 256, T = 32: every dim 0 is even
  const int64_t slack = 1 << 20;           // the loader's tensors, the loss, allocator rounding
  EXPECT_LE(fsdp.value("bytes_in_use", int64_t{0}), state(fsdp) + slack) << fsdp.dump();
  const int64_t block = 4 * (12 * 128 * 128 + 13 * 128);  // one block's parameters, gathered
  EXPECT_LE(fsdp.value("peak_bytes", int64_t{0}),
            ddp.value("peak_bytes", int64_t{0}) - (state(ddp) - state(fsdp)) + 2 * block)
      << "FSDP " << fsdp.dump() << "\nDDP " << ddp.dump();
  EXPECT_LT(fsdp.value("peak_bytes", int64_t{0}), ddp.value("peak_bytes", int64_t{0}));
}

// Tensor parallelism in the trainer: the GPT plan with and without sequence parallel, its JSON
// twin (--plan), FSDP x TP on threads, and TP over 2 UCX processes.
TEST_F(GptFsdpTest, TensorParallelRunsEqualOneRank) {
  ExpectSameRun(RunFinal("", "--ranks 2 --tp 2", "t2"), "TP 2 + SP", 1e-4);
  ExpectSameRun(RunFinal("", "--ranks 2 --tp 2 --sequence-parallel false", "t2n"), "TP 2", 1e-4);
  ExpectSameRun(
      RunFinal("", "--ranks 2 --plan " + std::string(DTENSOR_SOURCE_DIR) + "/examples/gpt/plans/gpt_tp.json", "t2p"),
      "TP 2 from the plan file", 1e-4);
  ExpectSameRun(RunFinal("", "--ranks 4 --tp 2", "ft4"), "FSDP x TP 2x2", 1e-4);
  ExpectSameRun(RunFinal("", "--ranks 8 --tp 2 --dp-replicate 2", "hft8"), "DDP x FSDP x TP 2x2x2", 1e-4);
}

TEST_F(GptFsdpTest, TensorParallelOverUcxProcessesEqualsOneRank) {
  ExpectSameRun(RunFinal(std::string(DTRUN_PATH) + " --nproc-per-node 2", "--tp 2", "tu2"), "TP 2, UCX processes",
                1e-4);
}

// --explain against one real step of the same configuration: every phase's collectives (kind,
// calls, bytes: the mesh's CommCounter in the step's metrics), the bytes of parameters,
// gradients and optimizer state, and the peak of FSDP's gathered parameters must be what the
// explanation computed from the layouts, for data, tensor and 3-D parallelism.
TEST_F(GptTrainTest, ExplainMatchesOneRealStep) {
  const std::string plan = std::string(DTENSOR_SOURCE_DIR) + "/examples/gpt/plans/gpt_tp.json";
  const std::vector<std::pair<std::string, std::string>> configs = {
      {"", "--ranks 1"},
      {"", "--ranks 2 --dp-shard 1 --dp-replicate 2"},                                   // DDP
      {"", "--ranks 2 --n-layer 3"},                                                     // FSDP
      {"", "--ranks 4 --dp-replicate 2 --reshard-after-forward false"},                  // HSDP
      {"", "--ranks 2 --tp 2"},                                                          // TP + SP
      {"", "--ranks 2 --tp 2 --sequence-parallel false"},                                // TP
      {"", "--ranks 2 --plan " + plan},                                                  // the plan file
      {"", "--ranks 3 --tp 3 --n-head 6 --n-embd 48 --vocab 250"},                       // uneven vocabulary shards
      {"", "--ranks 4 --tp 2"},                                                          // FSDP x TP
      {"", "--ranks 4 --tp 2 --dp-shard 1 --dp-replicate 2 --sequence-parallel false"},  // DDP x TP
      {"", "--ranks 8 --tp 2 --dp-replicate 2"},                                         // DDP x FSDP x TP
      {"", "--ranks 4 --tp 2 --grad-accum 2 --grad-sync last --param-dtype bf16"},
      // Activation checkpointing: a recomputed block's tp collectives run again in backward.
      {"", "--ranks 2 --tp 2 --ac full"},
      {"", "--ranks 4 --tp 2 --sequence-parallel false --ac selective:2"},
      {"", "--ranks 2 --tp 2 --ac selective:op"},
      {std::string(DTRUN_PATH) + " --nproc-per-node 2", "--tp 2 --device cpu"},  // UCX processes
      {std::string(DTRUN_PATH) + " --nproc-per-node 2", "--device cpu"},
  };
  for (const auto& [launcher, flags] : configs) {
    SCOPED_TRACE(launcher + " " + flags);
    const std::string common =
        "--text " + Corpus() + " --n-layer 2 --n-head 4 --n-embd 32 --seq 16 --batch 8 --steps 1 --sample-tokens 0 ";
    const std::string explained = Path("explain.json"), measured = Path("step.jsonl");
    const ProcessRun e = Train(launcher, common + "--explain --metrics " + explained + " " + flags);
    ASSERT_EQ(e.code, 0) << e.out;
    EXPECT_NE(e.out.find("collectives per step"), std::string::npos) << e.out;
    const ProcessRun r = Train(launcher, common + "--metrics " + measured + " " + flags);
    ASSERT_EQ(r.code, 0) << r.out;
    std::ifstream ein(explained), min(measured);
    std::string eline, mline;
    ASSERT_TRUE(std::getline(ein, eline));
    ASSERT_TRUE(std::getline(min, mline));
    const nlohmann::json x = nlohmann::json::parse(eline), m = nlohmann::json::parse(mline);
    EXPECT_EQ(x.at("comm"), m.at("comm"))
        << "explained " << x.at("comm").dump() << "\nmeasured  " << m.at("comm").dump() << "\n"
        << e.out;
    for (const char* key : {"param_bytes", "grad_bytes", "optim_bytes", "peak_unsharded_bytes"}) {
      EXPECT_EQ(x.at(key), m.at(key)) << key;
    }
    // One rank per process: the allocator holds the state at rest and little else.
    if (!launcher.empty()) {
      const int64_t state =
          x.at("param_bytes").get<int64_t>() + x.at("grad_bytes").get<int64_t>() + x.at("optim_bytes").get<int64_t>();
      EXPECT_GE(m.at("bytes_in_use").get<int64_t>(), state);
      EXPECT_LE(m.at("bytes_in_use").get<int64_t>(), state + (1 << 20));
    }
    const std::string tp =
        flags.find("--tp") != std::string::npos || flags.find("--plan") != std::string::npos ? "tp=S(0)" : "";
    if (!tp.empty()) {
      EXPECT_NE(e.out.find(tp), std::string::npos) << e.out;  // wte's vocabulary shard
    }
  }
  // A plan with a style the explanation does not model is refused, naming it.
  const std::string odd = Path("odd.json");
  std::ifstream twin(plan);
  std::string text((std::istreambuf_iterator<char>(twin)), std::istreambuf_iterator<char>());
  const std::string rules = "\"rules\": [";
  ASSERT_NE(text.find(rules), std::string::npos);
  text.replace(
      text.find(rules), rules.size(),
      rules + R"j({"module": "transformer.h.*.mlp", "style": "PrepareModuleOutput(output=S(1), desired=S(1))"},)j");
  testing::WriteBytes(odd, text);
  const ProcessRun bad = Train("", "--text " + Corpus() +
                                       " --ranks 2 --n-layer 1 --n-head 2 --n-embd 16 --seq 8 "
                                       "--explain --plan " +
                                       odd);
  EXPECT_NE(bad.code, 0);
  EXPECT_NE(bad.out.find("PrepareModuleOutput"), std::string::npos) << bad.out;
  // So is a plan that leaves sublayers replicated beside split ones (their weight gradients
  // come out Partial on tp: reductions the explanation does not count).
  const std::string attn_only = Path("attn_only.json");
  testing::WriteBytes(attn_only, R"j({"mesh": {"dp_replicate": 1, "dp_shard": 1, "tp": 2}, "every_parameter": false,
    "rules": [{"module": "transformer.h.*.attn.c_attn", "style": "ColwiseParallel(fused=3)"},
              {"module": "transformer.h.*.attn.c_proj", "style": "RowwiseParallel"}]})j");
  const ProcessRun partial = Train("", "--text " + Corpus() +
                                           " --ranks 2 --n-layer 1 --n-head 2 --n-embd 16 --seq 8 "
                                           "--explain --plan " +
                                           attn_only);
  EXPECT_NE(partial.code, 0);
  EXPECT_NE(partial.out.find("the plan splits transformer.h.0.attn.c_attn but not transformer.wte"), std::string::npos)
      << partial.out;
}

// Checkpoints in the trainer: a run stopped at step 10 and resumed (--resume) under the same
// parallelism reports bit-identical losses to the uninterrupted run; resumed under another
// parallelism each time (a chain through FSDP, FSDP x TP, TP, one rank, 3-D), it follows the
// one-rank run.
TEST_F(GptFsdpTest, ResumeUnderTheSameParallelismIsBitIdentical) {
  const std::string common = "--batch 12 --eps 1e-5 --device cpu ";
  // (--dropout: each layer's dropout call count, which picks its next mask, is saved too.)
  for (const std::string flags :
       {"--ranks 1", "--ranks 2 --dp-shard 1 --dp-replicate 2", "--ranks 4", "--ranks 2 --tp 2", "--ranks 4 --tp 2",
        "--ranks 4 --ckpt-async true", "--ranks 2 --dropout 0.1"}) {
    SCOPED_TRACE(flags);
    const std::string id = std::to_string(std::hash<std::string>()(flags));
    const std::string dir = Path("ckpt" + id);
    const std::vector<double> whole = RunLosses("", common + "--steps 20 " + flags, "whole" + id);
    const std::vector<double> first =
        RunLosses("", common + "--steps 10 --ckpt-every 10 --ckpt-dir " + dir + " " + flags, "first" + id);
    // (Its own --metrics file: a resumed run appends to the one it is given.)
    const std::vector<double> rest =
        RunLosses("", common + "--steps 20 --resume --ckpt-dir " + dir + " " + flags, "rest" + id);
    ASSERT_EQ(whole.size(), 20u);
    ASSERT_EQ(first.size(), 10u);
    ASSERT_EQ(rest.size(), 10u);
    for (size_t i = 0; i < 10; ++i) {
      EXPECT_EQ(first[i], whole[i]) << "step " << i;
      EXPECT_EQ(rest[i], whole[10 + i]) << "step " << 10 + i;
    }
  }
}

// One rank's load fails (a flipped byte in its file): every rank stops with an error, the
// failing one naming the checksum, instead of the others waiting for it in the next
// collective (thread ranks: the job hung, its error never printed).
TEST_F(GptFsdpTest, ALoadThatFailsOnOneRankStopsEveryRank) {
  const std::string dir = Path("bad_load");
  const std::string common = "--text " + Corpus() +
                             " --n-layer 1 --n-head 2 --n-embd 16 --seq 8 --batch 4 --sample-tokens 0 --device cpu"
                             " --ranks 2 --ckpt-dir " +
                             dir + " ";
  ASSERT_EQ(Train("", common + "--steps 2 --ckpt-every 2").code, 0);
  const std::string file = dir + "/step-00000002/rank-00001.bin";
  std::string bytes = testing::ReadBytes(file);
  ASSERT_GT(bytes.size(), 8u);
  bytes[5] ^= 0x10;
  testing::WriteBytes(file, bytes);
  const auto t0 = std::chrono::steady_clock::now();
  const ProcessRun run = Train("", common + "--steps 4 --resume");
  EXPECT_NE(run.code, 0) << run.out;
  EXPECT_NE(run.out.find("checksum mismatch in rank-00001.bin"), std::string::npos) << run.out;
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(60)) << run.out;
}

// A checkpoint's run and a resume that differ: a resume with --dropout of a checkpoint saved
// without it starts the masks there (it used to fail: train.dropout_calls not in the
// checkpoint); a model of another size is named as such (it used to fail on
// train.progress's shape); a run without --resume into a --ckpt-dir holding a checkpoint
// (here one of a name it would save) is refused before training (it used to train, then fail
// at that save).
TEST_F(GptFsdpTest, ResumesAcrossDropoutAndRefusesAnotherModelOrAnEarlierRunsFolder) {
  const std::string dir = Path("mixed");
  const std::string common = "--text " + Corpus() +
                             " --n-head 2 --n-embd 16 --seq 8 --batch 4 --sample-tokens 0 --device cpu"
                             " --ranks 2 --ckpt-every 2 --ckpt-dir " +
                             dir + " ";
  ProcessRun run = Train("", common + "--n-layer 2 --steps 2");
  ASSERT_EQ(run.code, 0) << run.out;
  run = Train("", common + "--n-layer 2 --steps 4 --resume --dropout 0.1");
  EXPECT_EQ(run.code, 0) << run.out;
  EXPECT_NE(run.out.find("resumed from " + dir + "/step-00000002: step 2"), std::string::npos) << run.out;
  run = Train("", common + "--n-layer 1 --steps 6 --resume");
  EXPECT_NE(run.code, 0) << run.out;
  EXPECT_NE(run.out.find("holds another model than this run's (1 layers, n_embd 16, vocab 256): parameters this "
                         "run lacks: model.transformer.h.1."),
            std::string::npos)
      << run.out;
  run = Train("", common + "--n-layer 2 --n-embd 32 --steps 6 --resume");
  EXPECT_NE(run.code, 0) << run.out;
  EXPECT_NE(run.out.find("(2 layers, n_embd 32, vocab 256): other shapes: model.transformer.h.0."), std::string::npos)
      << run.out;
  const auto t0 = std::chrono::steady_clock::now();
  run = Train("", common + "--n-layer 2 --steps 6");
  EXPECT_NE(run.code, 0) << run.out;
  EXPECT_NE(run.out.find("--ckpt-dir " + dir +
                         " holds checkpoints of another run (newest step-00000004): continue it with --resume or use "
                         "another folder"),
            std::string::npos)
      << run.out;
  EXPECT_EQ(run.out.find("loss:"), std::string::npos) << "trained before refusing:\n" << run.out;
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(60));
  // A folder named like a step but not as the trainer names it (step-2, not step-00000002) is
  // not in the way.
  const std::string other = Path("other");
  std::filesystem::create_directories(other + "/step-2");
  run = Train("", "--text " + Corpus() +
                      " --n-layer 1 --n-head 2 --n-embd 16 --seq 8 --batch 4 --sample-tokens 0 --device cpu --steps 2 "
                      "--ckpt-every 2 --ckpt-dir " +
                      other);
  EXPECT_EQ(run.code, 0) << run.out;
  // A --ckpt-dir that cannot be a folder (a file's path) is refused before training too (it
  // failed at the first save, after --ckpt-every steps).
  run = Train("", "--text " + Corpus() +
                      " --n-layer 1 --n-head 2 --n-embd 16 --seq 8 --batch 4 --sample-tokens 0 --device cpu --steps 4 "
                      "--ranks 2 --ckpt-every 3 --ckpt-dir " +
                      Corpus() + "/sub");
  EXPECT_NE(run.code, 0) << run.out;
  EXPECT_NE(run.out.find("--ckpt-dir " + Corpus() + "/sub is not a folder and cannot be made one"), std::string::npos)
      << run.out;
  EXPECT_EQ(run.out.find("loss:"), std::string::npos) << "trained before refusing:\n" << run.out;
}

// A run without --resume into a --ckpt-dir that holds another run's checkpoints, of names it
// would never save, is refused before training: it used to train, leave a folder whose
// --resume continues the other run, and prune that run's checkpoints with --ckpt-keep.
TEST_F(GptFsdpTest, AFreshRunRefusesAFolderHoldingAnotherRunsCheckpoints) {
  const std::string dir = Path("taken");
  const std::string common = "--text " + Corpus() +
                             " --n-layer 1 --n-head 2 --n-embd 16 --seq 8 --batch 4 --sample-tokens 0 --device cpu"
                             " --ranks 2 --ckpt-dir " +
                             dir + " ";
  ProcessRun run = Train("", common + "--steps 2 --ckpt-every 2");
  ASSERT_EQ(run.code, 0) << run.out;
  run = Train("", common + "--steps 4 --ckpt-every 4 --ckpt-keep 1");
  EXPECT_NE(run.code, 0) << run.out;
  EXPECT_NE(run.out.find("--ckpt-dir " + dir +
                         " holds checkpoints of another run (newest step-00000002): continue it with --resume or use "
                         "another folder"),
            std::string::npos)
      << run.out;
  EXPECT_EQ(run.out.find("loss:"), std::string::npos) << "trained before refusing:\n" << run.out;
  EXPECT_TRUE(std::filesystem::exists(dir + "/step-00000002/metadata.json"));
  EXPECT_FALSE(std::filesystem::exists(dir + "/step-00000004"));
  // Continuing it is what the folder is for.
  run = Train("", common + "--steps 4 --ckpt-every 4 --ckpt-keep 1 --resume");
  EXPECT_EQ(run.code, 0) << run.out;
  EXPECT_NE(run.out.find("resumed from " + dir + "/step-00000002: step 2"), std::string::npos) << run.out;
  EXPECT_EQ(testing::Unwrap(LatestCheckpoint(dir)), dir + "/step-00000004");
}

TEST_F(GptFsdpTest, ResumeUnderAnotherParallelismFollowsOneRank) {
  const std::string common = "--batch 12 --eps 1e-5 --device cpu --ckpt-every 4 --ckpt-dir " + Path("chain") + " ";
  const std::vector<double> one = RunLosses("", "--batch 12 --eps 1e-5 --device cpu --steps 20 --ranks 1", "one");
  ASSERT_EQ(one.size(), 20u);
  std::vector<double> chain;
  const std::vector<std::string> stages = {"--ranks 4", "--ranks 4 --tp 2", "--ranks 2 --tp 2", "--ranks 1",
                                           "--ranks 8 --tp 2 --dp-replicate 2"};
  for (size_t k = 0; k < stages.size(); ++k) {
    const std::string steps = "--steps " + std::to_string(4 * (k + 1)) + (k > 0 ? " --resume " : " ");
    const std::vector<double> part = RunLosses("", common + steps + stages[k], "stage" + std::to_string(k));
    EXPECT_EQ(part.size(), 4u) << stages[k];
    chain.insert(chain.end(), part.begin(), part.end());
  }
  ASSERT_EQ(chain.size(), one.size());
  for (size_t i = 0; i < one.size(); ++i) {
    EXPECT_NEAR(chain[i], one[i], 1e-5 * one[i]) << "step " << i << " (" << stages[i / 4] << ")";
  }
}

// Crash safety: a job of 2 UCX processes saving every step is killed (kill -9, the whole job
// or one rank) at a seeded random moment after its first checkpoint; --resume then finds a
// complete checkpoint and every later loss equals the uninterrupted run's. A few trials here;
// DTENSOR_CRASH_TRIALS=30 runs more.
TEST_F(GptTrainTest, KilledDuringSavesResumesFromACompleteCheckpoint) {
  const char* env = std::getenv("DTENSOR_CRASH_TRIALS");
  const int trials = env != nullptr ? std::atoi(env) : 4;
  const std::string dtrun = std::string(DTRUN_PATH) + " --nproc-per-node 2";
  const std::string common = "--text " + Corpus() +
                             " --n-layer 2 --n-head 2 --n-embd 32 --seq 16 --batch 8 --steps 30 --sample-tokens 0"
                             " --device cpu --ckpt-every 1 --ckpt-keep 2 ";
  auto losses = [](const std::string& path) {
    std::map<int64_t, double> by_step;
    std::ifstream in(path);
    std::string line;
    while (std::getline(in, line)) {
      const auto j = nlohmann::json::parse(line);
      by_step[j.at("step").get<int64_t>()] = j.at("loss").get<double>();
    }
    return by_step;
  };
  const ProcessRun whole = Train(dtrun, common + "--ckpt-dir " + Path("whole") + " --metrics " + Path("whole.jsonl"));
  ASSERT_EQ(whole.code, 0) << whole.out;
  const std::map<int64_t, double> reference = losses(Path("whole.jsonl"));
  ASSERT_EQ(reference.size(), 30u);
  const double run_s = absl::ToDoubleSeconds(whole.took);
  std::mt19937 rng(2026);
  int resumed_mid_run = 0, mid_save = 0;
  for (int t = 0; t < trials; ++t) {
    SCOPED_TRACE("trial " + std::to_string(t));
    const std::string dir = Path("crash" + std::to_string(t));
    const bool whole_job = t % 2 == 0;
    const double delay = std::uniform_real_distribution<double>(0.0, 0.6 * run_s)(rng);
    ProcessOptions kill;
    kill.during = [&](pid_t pid) {
      // After the first complete checkpoint, a random moment later: kill -9.
      const auto t0 = std::chrono::steady_clock::now();
      while (!std::filesystem::exists(dir + "/step-00000001/metadata.json") &&
             std::chrono::steady_clock::now() - t0 < std::chrono::seconds(60)) {
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
      std::this_thread::sleep_for(std::chrono::duration<double>(delay));
      if (whole_job) {
        ::kill(-pid, SIGKILL);
        return;
      }
      std::ifstream children("/proc/" + std::to_string(pid) + "/task/" + std::to_string(pid) + "/children");
      pid_t rank = 0;
      if (children >> rank) ::kill(rank, SIGKILL);  // one rank; dtrun stops the other
    };
    const ProcessRun killed = Train(dtrun, common + "--ckpt-dir " + dir, kill);
    for (const auto& e : std::filesystem::directory_iterator(dir)) {  // a save it interrupted
      if (e.path().filename().string().rfind(".tmp-", 0) == 0) ++mid_save;
    }
    const ProcessRun resumed =
        Train(dtrun, common + "--resume --ckpt-dir " + dir + " --metrics " + Path("resumed.jsonl"));
    ASSERT_EQ(resumed.code, 0) << "killed run:\n" << killed.out << "\nresumed:\n" << resumed.out;
    const std::map<int64_t, double> after = losses(Path("resumed.jsonl"));
    if (!after.empty() && after.begin()->first > 1) ++resumed_mid_run;
    for (const auto& [step, loss] : after) EXPECT_EQ(loss, reference.at(step)) << "step " << step;
    if (after.empty()) {  // the killed job had finished: its last checkpoint is the end
      EXPECT_EQ(testing::Unwrap(LatestCheckpoint(dir)), dir + "/step-00000030");
    } else {
      EXPECT_EQ(after.rbegin()->first, 29);
    }
  }
  std::printf("[ CRASH    ] %d trials: %d killed during a save, %d resumed before the last step\n", trials, mid_save,
              resumed_mid_run);
}

TEST_F(GptFsdpTest, BadParallelFlagsFailCleanly) {
  const ProcessRun dims = Train("", "--text " + Corpus() + " --ranks 4 --dp-shard 3 --steps 1");
  EXPECT_NE(dims.code, 0);
  EXPECT_NE(dims.out.find("dp_replicate 1 x dp_shard 3 x tp 1 does not make the world size 4"), std::string::npos)
      << dims.out;
  const ProcessRun heads = Train("", "--text " + Corpus() + " --ranks 4 --tp 4 --n-head 2 --n-embd 16 --steps 1");
  EXPECT_NE(heads.code, 0);
  EXPECT_NE(heads.out.find("2 heads do not divide over tp 4"), std::string::npos) << heads.out;
  const ProcessRun accum = Train("", "--text " + Corpus() + " --batch 6 --grad-accum 4 --steps 1");
  EXPECT_NE(accum.code, 0);
  EXPECT_NE(accum.out.find("--batch 6 must be a multiple of --grad-accum 4"), std::string::npos) << accum.out;
  EXPECT_NE(Train("", "--text x --param-dtype fp16").code, 0);
  EXPECT_NE(Train("", "--text x --reshard-after-forward perhaps").code, 0);
}

TEST_F(GptTrainTest, UcxProcessesMatchThreads) {
  const std::vector<double> one = RunLosses("", "--batch 5 --ranks 1 --device cpu", "u1");
  ExpectSame(RunLosses(std::string(DTRUN_PATH) + " --nproc-per-node 2", "--batch 5 --device cpu", "u2"), one);
}

// Two processes under dtrun, a GPU each over NCCL, train to one GPU's losses (1e-4: the
// all-reduce sums in another order).
TEST_F(GptTrainTest, TwoGpuProcessesMatchOneGpu) {
  if (CudaDeviceCount() < 2) GTEST_SKIP() << "needs 2 CUDA devices, " << CudaDeviceCount() << " visible";
  const std::vector<double> one = RunLosses("", "--batch 4 --ranks 1 --device cuda", "n1");
  const std::vector<double> two =
      RunLosses(std::string(DTRUN_PATH) + " --nproc-per-node 2", "--batch 4 --device cuda", "n2");
  ASSERT_EQ(two.size(), one.size());
  for (size_t i = 0; i < one.size(); ++i) EXPECT_NEAR(two[i], one[i], 1e-4 * std::abs(one[i])) << "step " << i;
}

// --init-llmc + --train-bin: the trainer starts from an llm.c checkpoint (here PyTorch's golden
// GPT written in llm.c's format) and its first loss equals the loss of nn::GPT loaded with the
// same tensors by name, on the first llm.c batch of the token file.
TEST_F(GptTrainTest, StartsFromAnLlmcCheckpoint) {
  using testing::Unwrap;
  NamedTensors golden = Unwrap(ReadSafetensors(std::string(DTENSOR_GOLDEN_DIR) + "/gpt2_tiny.safetensors"));
  nn::GPTConfig cfg{.vocab_size = 61, .block_size = 12, .n_layer = 2, .n_head = 2, .n_embd = 16};
  auto model = Unwrap(nn::GPT::Create(cfg));
  std::vector<std::pair<std::string, Tensor>> params;
  for (auto& [name, p] : model->NamedParameters()) params.emplace_back(name, *golden.Find(name));
  ASSERT_TRUE(model->LoadStateDict(params).ok());
  gpt::LlmcConfig lc{
      .max_seq_len = 12, .vocab_size = 61, .padded_vocab_size = 64, .num_layers = 2, .num_heads = 2, .channels = 16};
  const std::string ckpt = Path("tiny.llmc.bin"), bin = Path("tokens.bin");
  ASSERT_TRUE(gpt::WriteLlmcCheckpoint(ckpt, lc, params).ok());
  std::vector<uint16_t> stream;
  for (int i = 0; i < 200; ++i) stream.push_back(static_cast<uint16_t>((i * 37 + i / 7) % 61));
  ASSERT_TRUE(gpt::WriteLlmcTokens(bin, stream).ok());
  // Expected: batch 0 = rows of 10 tokens from position 0, targets shifted by one.
  std::vector<int32_t> in(stream.begin(), stream.begin() + 30), tg(stream.begin() + 1, stream.begin() + 31);
  Variable ids = Variable::Constant(Unwrap(Tensor::FromVector<int32_t>(in, {3, 10})));
  Variable targets = Variable::Constant(Unwrap(Tensor::FromVector<int32_t>(tg, {3, 10})));
  const double expected = testing::Values(Unwrap(model->Forward(ids, targets)).loss.value().local())[0];
  const std::string metrics = Path("llmc.jsonl");
  const ProcessRun run =
      Train("", "--train-bin " + bin + " --init-llmc " + ckpt +
                    " --seq 10 --batch 3 --steps 2 --ranks 2 --sample-tokens 5 --metrics " + metrics);
  ASSERT_EQ(run.code, 0) << run.out;
  std::ifstream f(metrics);
  std::string line;
  ASSERT_TRUE(std::getline(f, line));
  EXPECT_NEAR(nlohmann::json::parse(line).at("loss").get<double>(), expected, 1e-5 * expected);
  // Shape flags beside the checkpoint are refused, not ignored (--n-layer 6 trained its 2).
  const ProcessRun shaped = Train("", "--train-bin " + bin + " --init-llmc " + ckpt + " --seq 10 --n-layer 6");
  EXPECT_EQ(shaped.code, 2) << shaped.out;
  EXPECT_NE(shaped.out.find("--n-layer applies to a model from flags; --init-llmc takes its shape from the checkpoint"),
            std::string::npos)
      << shaped.out;
}

// The step lines and metrics report like TorchTitan: tokens/s and MFU per rank by the
// FLOPs-per-token formula, and validation loss on the held-out tail, checked against the final
// model evaluated here on those batches; the held-out tail is not trained on.
TEST_F(GptTrainTest, ReportsMfuAndValidationLoss) {
  using testing::Unwrap;
  const std::string corpus = Corpus(), metrics = Path("report.jsonl"), final_params = Path("final.safetensors");
  const std::string model_flags = " --n-layer 2 --n-head 2 --n-embd 32 --seq 16 --batch 4 --lr 3e-3 --sample-tokens 0";
  const ProcessRun run =
      Train("", "--text " + corpus + model_flags +
                    " --steps 6 --ranks 2 --val-every 3 --val-batches 2 --peak-flops 1e12 --progress true --metrics " +
                    metrics + " --save-final " + final_params);
  ASSERT_EQ(run.code, 0) << run.out;
  EXPECT_NE(run.out.find("mfu:"), std::string::npos) << run.out;
  EXPECT_NE(run.out.find("6/6"), std::string::npos) << run.out;  // the progress bar's last state
  EXPECT_NE(run.out.find("left"), std::string::npos) << run.out;

  // The data: bytes; the last 5% of them (rounded down) held out for validation.
  std::vector<uint16_t> tokens = Unwrap(gpt::LoadTextTokens(corpus));
  const size_t keep = tokens.size() - static_cast<size_t>(static_cast<double>(tokens.size()) * 0.05);
  const std::vector<uint16_t> val(tokens.begin() + static_cast<std::ptrdiff_t>(keep), tokens.end());

  const nn::GPTConfig cfg{.vocab_size = 256, .block_size = 16, .n_layer = 2, .n_head = 2, .n_embd = 32};
  auto model = Unwrap(nn::GPT::Create(cfg));
  const double fpt = 6.0 * static_cast<double>(model->NumParameters() - 16 * 32) + 12.0 * 2 * 32 * 16;
  std::map<int64_t, double> val_loss, train_loss;
  std::ifstream in(metrics);
  std::string line;
  while (std::getline(in, line)) {
    const auto j = nlohmann::json::parse(line);
    const int64_t step = j.at("step").get<int64_t>();
    train_loss[step] = j.at("loss").get<double>();
    const double tps = j.at("tokens_per_s").get<double>(), per_rank = j.at("tokens_per_s_per_rank").get<double>();
    EXPECT_NEAR(per_rank, tps / 2, 1e-9 * tps) << line;
    EXPECT_NEAR(j.at("mfu").get<double>(), fpt * per_rank / 1e12, 1e-9) << line;
    EXPECT_GT(j.at("peak_bytes").get<int64_t>(), 0) << line;
    if (j.contains("val_loss")) val_loss[step] = j.at("val_loss").get<double>();
  }
  ASSERT_EQ(train_loss.size(), 6u);
  ASSERT_EQ(val_loss.size(), 2u);
  ASSERT_TRUE(val_loss.count(3) && val_loss.count(5));  // every 3 steps after the first, and at the end

  // The last validation, recomputed from the final parameters on the first 2 validation batches.
  NamedTensors trained = Unwrap(ReadSafetensors(final_params));
  ASSERT_TRUE(model->LoadStateDict(trained.tensors).ok());
  model->Eval();
  NoGradGuard no_grad;
  absl::StatusOr<gpt::TokenLoader> loader = gpt::TokenLoader::Create(val, 4, 16);
  ASSERT_TRUE(loader.ok()) << loader.status();
  double sum = 0;
  for (int k = 0; k < 2; ++k) {
    gpt::Batch b = loader->Next();
    Variable x = Variable::Constant(Unwrap(Tensor::FromVector<int32_t>(b.inputs, {4, 16})));
    Variable y = Variable::Constant(Unwrap(Tensor::FromVector<int32_t>(b.targets, {4, 16})));
    sum += testing::Values(Unwrap(model->Forward(x, y)).loss.value().local())[0];
  }
  EXPECT_NEAR(val_loss[5], sum / 2, 1e-5 * sum / 2);

  // Training saw only the first 95%: the same run on that prefix alone, without validation,
  // has the same losses.
  const std::string prefix = Path("prefix.txt");
  testing::WriteBytes(prefix, std::string(tokens.begin(), tokens.begin() + static_cast<std::ptrdiff_t>(keep)));
  const std::string prefix_metrics = Path("prefix.jsonl");
  ASSERT_EQ(Train("", "--text " + prefix + model_flags + " --steps 6 --ranks 2 --metrics " + prefix_metrics).code, 0);
  std::ifstream pin(prefix_metrics);
  for (int64_t step = 0; std::getline(pin, line); ++step) {
    EXPECT_EQ(nlohmann::json::parse(line).at("loss").get<double>(), train_loss.at(step)) << "step " << step;
  }
}

// --read-loss next reads each step's loss and grad norm once the next step is queued (steps
// that validate or checkpoint, and the last, at once): the log is the same, step for step, as
// reading at once, on one rank and two (FSDP, DDP), the metrics say which way ran, and the
// printed lines come in step order. The batches go through the two host buffers in turn
// either way, so a buffer refilled too early would change the losses of both runs against
// the one before this change; the first loss is checked against the model's own forward.
TEST_F(GptTrainTest, ReadingTheLossAStepLaterChangesNoNumber) {
  const std::string corpus = Corpus(), ckpt = Path("ckpt");
  struct Line {
    int64_t step;
    double loss, grad_norm, lr;
    std::string comm, read;
    bool val;
  };
  auto run = [&](const std::string& flags, const std::string& tag) {
    const std::string metrics = Path(tag + ".jsonl");
    const ProcessRun r = Train("", "--text " + corpus +
                                       " --n-layer 2 --n-head 2 --n-embd 32 --seq 16 --batch 4 --steps 7 --lr 3e-3"
                                       " --grad-clip 0.5 --sample-tokens 0 --val-every 3 --val-batches 1"
                                       " --ckpt-every 4 --ckpt-dir " +
                                       ckpt + "_" + tag + " --metrics " + metrics + " " + flags);
    EXPECT_EQ(r.code, 0) << flags << ":\n" << r.out;
    std::vector<Line> lines;
    std::ifstream in(metrics);
    std::string text;
    while (std::getline(in, text)) {
      const auto j = nlohmann::json::parse(text);
      lines.push_back({j.at("step").get<int64_t>(), j.at("loss").get<double>(), j.at("grad_norm").get<double>(),
                       j.at("lr").get<double>(), j.at("comm").dump(), j.at("loss_read").get<std::string>(),
                       j.contains("val_loss")});
    }
    // The printed lines, in order.
    std::vector<int64_t> printed;
    const std::regex step_line(R"(step:\s+(\d+)\s+loss:)");
    for (auto it = std::sregex_iterator(r.out.begin(), r.out.end(), step_line); it != std::sregex_iterator(); ++it) {
      printed.push_back(std::stoll((*it)[1].str()));
    }
    EXPECT_EQ(printed, std::vector<int64_t>({0, 1, 2, 3, 4, 5, 6})) << flags << ":\n" << r.out;
    return lines;
  };
  int runs = 0;
  for (const char* parallel : {"--ranks 1", "--ranks 2", "--ranks 2 --dp-shard 1 --dp-replicate 2"}) {
    SCOPED_TRACE(parallel);
    ++runs;
    const std::vector<Line> now = run(std::string(parallel) + " --read-loss now", absl::StrCat("now", runs));
    const std::vector<Line> next = run(std::string(parallel) + " --read-loss next", absl::StrCat("next", runs));
    const std::vector<Line> cpu_auto = run(parallel, absl::StrCat("auto", runs));
    ASSERT_EQ(now.size(), 7u);
    ASSERT_EQ(next.size(), now.size());
    ASSERT_EQ(cpu_auto.size(), now.size());
    for (size_t i = 0; i < now.size(); ++i) {
      EXPECT_EQ(next[i].step, static_cast<int64_t>(i));
      EXPECT_EQ(next[i].loss, now[i].loss) << "step " << i;
      EXPECT_EQ(next[i].grad_norm, now[i].grad_norm) << "step " << i;
      EXPECT_EQ(next[i].lr, now[i].lr) << "step " << i;
      EXPECT_EQ(next[i].comm, now[i].comm) << "step " << i;  // the loss's all_reduce counted in its step
      EXPECT_EQ(next[i].val, now[i].val) << "step " << i;
      EXPECT_EQ(cpu_auto[i].loss, now[i].loss) << "step " << i;
      EXPECT_EQ(now[i].read, "now");
      EXPECT_EQ(next[i].read, "next");
      EXPECT_EQ(cpu_auto[i].read, "now");  // auto: at once on the CPU
      if (i > 0) {
        EXPECT_NE(now[i].loss, now[i - 1].loss) << "step " << i;  // every step its own batch
      }
    }
  }
  // The first step's loss is the initial model's on the first batch (no buffer mixed up).
  std::vector<uint16_t> tokens = testing::Unwrap(gpt::LoadTextTokens(corpus));
  const size_t keep = tokens.size() - static_cast<size_t>(static_cast<double>(tokens.size()) * 0.05);
  tokens.resize(keep);
  absl::StatusOr<gpt::TokenLoader> loader = gpt::TokenLoader::Create(tokens, 4, 16);
  ASSERT_TRUE(loader.ok()) << loader.status();
  const nn::GPTConfig cfg{.vocab_size = 256, .block_size = 16, .n_layer = 2, .n_head = 2, .n_embd = 32};
  auto model = testing::Unwrap(nn::GPT::Create(cfg));
  ASSERT_TRUE(model->InitWeights(1337).ok());  // gpt_train's --seed
  NoGradGuard no_grad;
  const gpt::Batch b = loader->Next();
  Variable x = Variable::Constant(testing::Unwrap(Tensor::FromVector<int32_t>(b.inputs, {4, 16})));
  Variable y = Variable::Constant(testing::Unwrap(Tensor::FromVector<int32_t>(b.targets, {4, 16})));
  const double first = testing::Values(testing::Unwrap(model->Forward(x, y)).loss.value().local())[0];
  const std::vector<Line> again = run("--ranks 1 --read-loss next", "again");
  ASSERT_FALSE(again.empty());
  EXPECT_NEAR(again[0].loss, first, 1e-5 * first);
}

// --ac: activation checkpointing changes memory, not numbers: the losses of every mode equal
// the run without it bit for bit, on one rank and under FSDP 2 and TP 2 thread ranks.
TEST_F(GptTrainTest, ActivationCheckpointingKeepsLossesBitwise) {
  for (const char* parallel : {"--ranks 1", "--ranks 2", "--ranks 2 --tp 2"}) {
    const std::vector<double> plain = RunLosses("", std::string(parallel) + " --dropout 0.1", "ac_none");
    for (const char* mode : {"full", "selective", "selective:op"}) {
      const std::vector<double> ac =
          RunLosses("", absl::StrCat(parallel, " --dropout 0.1 --ac ", mode), absl::StrCat("ac_", mode));
      ASSERT_EQ(ac.size(), plain.size()) << parallel << " --ac " << mode;
      for (size_t i = 0; i < ac.size(); ++i)
        EXPECT_EQ(ac[i], plain[i]) << parallel << " --ac " << mode << " step " << i;
    }
  }
  const ProcessRun bad = Train("", "--text " + Corpus() + " --ac sometimes");
  EXPECT_NE(bad.code, 0);
  EXPECT_NE(bad.out.find("--ac sometimes"), std::string::npos) << bad.out;
}

// --tokenizer gpt2: the text goes through GPT-2's BPE (vocabulary padded to 50304), and the
// first loss is the one this test computes from the same tokens on the same initial model;
// the sample is decoded text. --model presets set the architecture; flags given override them.
TEST_F(GptTrainTest, TrainsOnGpt2TokensAndPresets) {
  using testing::Unwrap;
  absl::StatusOr<gpt::Gpt2Tokenizer> tok = gpt::Gpt2Tokenizer::Load(gpt::Gpt2Tokenizer::DefaultDir());
  if (!tok.ok()) GTEST_SKIP() << "GPT-2's encoder files are not installed (scripts/setup.sh): " << tok.status();
  const std::string corpus = Corpus(), metrics = Path("gpt2tok.jsonl");
  const ProcessRun run = Train("", "--text " + corpus +
                                       " --tokenizer gpt2 --n-layer 1 --n-head 2 --n-embd 16 --seq 16 --batch 2 "
                                       "--steps 1 --ranks 2 --sample-tokens 12 --metrics " +
                                       metrics);
  ASSERT_EQ(run.code, 0) << run.out;
  EXPECT_NE(run.out.find("V=50304"), std::string::npos) << run.out;
  EXPECT_FALSE(std::regex_search(run.out, std::regex("<[0-9]+>"))) << run.out;  // text, not "<id>"s

  const std::vector<int32_t> ids = tok->Encode(testing::ReadBytes(corpus));
  std::vector<int32_t> in(ids.begin(), ids.begin() + 32), tg(ids.begin() + 1, ids.begin() + 33);
  nn::GPTConfig cfg{.vocab_size = 50304, .block_size = 16, .n_layer = 1, .n_head = 2, .n_embd = 16};
  auto model = Unwrap(nn::GPT::Create(cfg));
  ASSERT_TRUE(model->InitWeights(1337).ok());
  Variable x = Variable::Constant(Unwrap(Tensor::FromVector<int32_t>(in, {2, 16})));
  Variable y = Variable::Constant(Unwrap(Tensor::FromVector<int32_t>(tg, {2, 16})));
  const double expected = testing::Values(Unwrap(model->Forward(x, y)).loss.value().local())[0];
  std::ifstream f(metrics);
  std::string line;
  ASSERT_TRUE(std::getline(f, line));
  EXPECT_NEAR(nlohmann::json::parse(line).at("loss").get<double>(), expected, 1e-5 * expected);

  // Presets: GPT-2 124M (124,439,808 parameters with vocab 50257 and 1024 positions), and the
  // same with 2 layers given on the command line.
  const ProcessRun gpt2 = Train("", "--text " + corpus + " --model gpt2 --seq 16 --batch 1 --explain");
  ASSERT_EQ(gpt2.code, 0) << gpt2.out;
  EXPECT_NE(gpt2.out.find("124439808 parameters, 12 layers, 12 heads, C=768, V=50257"), std::string::npos) << gpt2.out;
  const int64_t per_block = 12 * 768 * 768 + 13 * 768;  // c_attn, c_proj, c_fc, c_proj; biases, 2 LayerNorms
  const ProcessRun two = Train("", "--text " + corpus + " --model gpt2 --n-layer 2 --seq 16 --batch 1 --explain");
  ASSERT_EQ(two.code, 0) << two.out;
  EXPECT_NE(two.out.find(absl::StrCat(124439808 - 10 * per_block, " parameters, 2 layers")), std::string::npos)
      << two.out;
  const ProcessRun unknown = Train("", "--text " + corpus + " --model gpt5");
  EXPECT_NE(unknown.code, 0);
  EXPECT_NE(unknown.out.find("--model gpt5"), std::string::npos) << unknown.out;
}

// A byte-level model with a vocabulary padded past 256 samples bytes only, printed as text (an
// untrained model drew ids 256-511 about half the time, printed as "<357>").
TEST_F(GptTrainTest, AByteModelSamplesBytesWhateverItsVocabulary) {
  const ProcessRun run = Train("", "--text " + Corpus() +
                                       " --vocab 512 --n-layer 1 --n-head 2 --n-embd 16 --seq 16 --batch 2 --steps 1 "
                                       "--sample-tokens 200");
  ASSERT_EQ(run.code, 0) << run.out;
  const size_t at = run.out.find("---- sample ----");
  ASSERT_NE(at, std::string::npos) << run.out;
  EXPECT_FALSE(std::regex_search(run.out.substr(at), std::regex("<[0-9]{3}>"))) << run.out;
}

// The same binary started by Open MPI's mpirun (OMPI_COMM_WORLD_* rendezvous) is a UCX rank.
TEST_F(GptTrainTest, MpirunProcessesMatchThreads) {
  const ProcessRun which = testing::RunProcess({"/bin/sh", "-c", "command -v mpirun"});
  const std::string mpirun(absl::StripTrailingAsciiWhitespace(which.out));
  if (which.code != 0 || mpirun.empty()) GTEST_SKIP() << "mpirun is not installed";
  const std::vector<double> one = RunLosses("", "--batch 5 --ranks 1 --device cpu", "m1");
  ExpectSame(RunLosses(mpirun + " --allow-run-as-root --oversubscribe -np 2", "--batch 5 --device cpu", "m2"), one);
}

TEST_F(GptTrainTest, BadFlagsFailCleanly) {
  EXPECT_NE(Train("", "--text /nonexistent/file --steps 1").code, 0);
  EXPECT_NE(Train("", "--text x --n-embd 30 --n-head 4").code, 0);
  const ProcessRun device = Train("", "--text x --device tpu");
  EXPECT_NE(device.code, 0);
  EXPECT_NE(device.out.find("--device tpu: auto|cpu|cuda"), std::string::npos) << device.out;
  // absl::flags: unknown flags and bad values are refused naming them; --help lists the flags
  // (spelled with dashes or underscores alike).
  const ProcessRun unknown = Train("", "--text x --stepz 3");
  EXPECT_NE(unknown.code, 0);
  EXPECT_NE(unknown.out.find("'stepz'"), std::string::npos) << unknown.out;
  const ProcessRun value = Train("", "--text x --n-layer two");
  EXPECT_NE(value.code, 0);
  EXPECT_NE(value.out.find("'two'"), std::string::npos) << value.out;
  EXPECT_NE(value.out.find("n_layer"), std::string::npos) << value.out;
  const ProcessRun stray = Train("", "--text x --prefetch maybe");
  EXPECT_NE(stray.code, 0);
  EXPECT_NE(stray.out.find("unexpected argument 'maybe'"), std::string::npos) << stray.out;
  const ProcessRun help = Train("", "--help");
  EXPECT_EQ(help.code, 1) << help.out;  // absl's --help exits 1 after printing
  for (const char* flag : {"--ckpt_dir", "--tokenizer", "--val_every", "--peak_flops", "--ac", "--model"}) {
    EXPECT_NE(help.out.find(flag), std::string::npos) << flag << "\n" << help.out;
  }
  const ProcessRun read = Train("", "--text x --read-loss later");
  EXPECT_NE(read.code, 0);
  EXPECT_NE(read.out.find("--read-loss later: auto|now|next"), std::string::npos) << read.out;
  const ProcessRun val = Train("", "--text x --val-every 2 --val-fraction 1.5");
  EXPECT_NE(val.code, 0);
  EXPECT_NE(val.out.find("--val-fraction 1.5"), std::string::npos) << val.out;
  // A --metrics file rank 0 cannot open stops every rank at once (the others used to wait for
  // rank 0 in the first all-reduce until the timeout).
  const ProcessRun metrics = Train("",
                                   "--text " + Corpus() +
                                       " --ranks 2 --n-layer 1 --n-head 2 --n-embd 16 --seq 8 --steps 2"
                                       " --metrics /nonexistent/dir/m.jsonl",
                                   {.env = {"DTENSOR_TIMEOUT_S=60"}});
  EXPECT_NE(metrics.code, 0);
  EXPECT_LT(metrics.took, absl::Seconds(30));
  EXPECT_NE(metrics.out.find("cannot open --metrics /nonexistent/dir/m.jsonl"), std::string::npos) << metrics.out;
  // Flags that mean something only beside another are refused alone (they were ignored), and
  // values that would train silently wrong are refused.
  const std::vector<std::pair<std::string, std::string>> refused = {
      {"--val-bin v.bin", "--val-bin applies with --val-every N > 0"},
      {"--warmup 5", "--warmup applies to --lr-schedule cosine"},
      {"--lr-schedule cosine --lr 0.001 --min-lr 0.01", "--min-lr 0.01: must be <= --lr 0.001"},
      {"--plan p.json --tp 2", "--tp applies without --plan"},
      {"--fortunes f.txt", "give one of --fortunes"},
      {"--dropout nan", "--dropout nan: must be in [0, 1)"},
      {"--peak-flops nan", "--peak-flops nan: must be >= 0"},
      {"--sample-tokens -5", "--sample-tokens -5: must be >= 0"},
      {"--save-final /nonexistent/dir/x.safetensors", "its folder /nonexistent/dir does not exist"},
  };
  for (const auto& [flags, needle] : refused) {
    const ProcessRun r = Train("", "--text x " + flags);
    EXPECT_EQ(r.code, 2) << flags << ": " << r.out;
    EXPECT_NE(r.out.find(needle), std::string::npos) << flags << ": " << r.out;
  }
  // A checkpoint flag without saving (a command line rerun without --ckpt-every) is said.
  const ProcessRun note = Train("", "--text " + Corpus() +
                                        " --n-layer 1 --n-head 2 --n-embd 16 --seq 8 --steps 1 --sample-tokens 0"
                                        " --ckpt-async true --ckpt-dir " +
                                        Path("unused"));
  EXPECT_EQ(note.code, 0) << note.out;
  EXPECT_NE(note.out.find("note: --ckpt-dir applies with --ckpt-every N > 0 or --resume: nothing is saved"),
            std::string::npos)
      << note.out;
  EXPECT_NE(note.out.find("note: --ckpt-async applies with --ckpt-every N > 0"), std::string::npos) << note.out;
  // --ranks under a launcher (each process is a rank of its own) is refused, not dropped.
  const ProcessRun launched =
      Train("", "--text x --ranks 4", {.env = {"WORLD_SIZE=1", "RANK=0", "LOCAL_RANK=0", "LOCAL_WORLD_SIZE=1"}});
  EXPECT_EQ(launched.code, 2) << launched.out;
  EXPECT_NE(launched.out.find("drop --ranks"), std::string::npos) << launched.out;
}

// --save-final that rank 0 cannot write once training is done (here a folder stands at the
// path) stops every rank at once; the others went on into sampling and waited for rank 0 until
// the timeout. A resumed run appends to its --metrics file, resuming past --steps says so, and
// a checkpoint of another head count is refused.
TEST_F(GptTrainTest, EndOfRunAndResumeAgreeAndSayWhatTheyDo) {
  const std::string common =
      "--text " + Corpus() + " --n-layer 1 --n-head 2 --n-embd 16 --seq 8 --batch 4 --device cpu --sample-tokens 0 ";
  const std::string taken = Path("a_folder");
  std::filesystem::create_directories(taken);
  const ProcessRun save = Train("", common + "--ranks 2 --steps 1 --sample-tokens 5 --save-final " + taken,
                                {.env = {"DTENSOR_TIMEOUT_S=60"}});
  EXPECT_NE(save.code, 0) << save.out;
  EXPECT_LT(save.took, absl::Seconds(30)) << save.out;
  EXPECT_NE(save.out.find("writing --save-final " + taken + " failed on rank(s) 0; rank 0: "), std::string::npos)
      << save.out;

  auto lines = [](const std::string& path) {
    std::ifstream in(path);
    int n = 0;
    for (std::string line; std::getline(in, line);) ++n;
    return n;
  };
  const std::string ck = "--ckpt-dir " + Path("ck") + " --metrics " + Path("m.jsonl") + " ";
  ASSERT_EQ(Train("", common + ck + "--steps 4 --ckpt-every 2").code, 0);
  EXPECT_EQ(lines(Path("m.jsonl")), 4);
  const ProcessRun more = Train("", common + ck + "--steps 6 --resume");
  ASSERT_EQ(more.code, 0) << more.out;
  EXPECT_EQ(lines(Path("m.jsonl")), 6);  // steps 0-3, then 4-5
  const ProcessRun none = Train("", common + ck + "--steps 2 --resume");
  EXPECT_EQ(none.code, 0) << none.out;
  EXPECT_NE(none.out.find("nothing to train: the checkpoint is at step 4 and --steps is 2"), std::string::npos)
      << none.out;
  const ProcessRun heads =
      Train("", absl::StrReplaceAll(common, {{"--n-head 2", "--n-head 4"}}) + ck + "--steps 8 --resume");
  EXPECT_NE(heads.code, 0) << heads.out;
  EXPECT_NE(heads.out.find("was saved with 2 heads; this run has --n-head 4"), std::string::npos) << heads.out;
}

// The trainer runs OpenBLAS's fastest kernel set for this CPU even where OpenBLAS, loading,
// fell back to generic ones (it restarts itself with OPENBLAS_CORETYPE), and keeps a set the
// user names. The banner says which set runs.
TEST_F(GptTrainTest, RunsTheFastestBlasKernelsForThisCpu) {
  if (!BlasChoosesCoreAtLoad()) GTEST_SKIP() << "OpenBLAS built for one core: nothing to choose";
  const auto core_of_trainer = [&](const ProcessOptions& options) -> std::string {
    const ProcessRun run = Train(
        "",
        "--text " + Corpus() + " --n-layer 1 --n-head 2 --n-embd 16 --seq 8 --steps 1 --sample-tokens 0 --device cpu",
        options);
    EXPECT_EQ(run.code, 0) << run.out;
    const size_t at = run.out.find("OpenBLAS ");
    if (at == std::string::npos) {
      ADD_FAILURE() << "no OpenBLAS core in the banner:\n" << run.out;
      return "";
    }
    const size_t begin = at + 9;
    return run.out.substr(begin, run.out.find_first_of("),", begin) - begin);
  };
  const std::string core = core_of_trainer({.unset = {"OPENBLAS_CORETYPE"}});
  EXPECT_EQ(FasterBlasCoreType(core, HostVectorIsa()), "") << "trainer ran OpenBLAS's " << core << " kernels";
  EXPECT_EQ(core_of_trainer({.env = {"OPENBLAS_CORETYPE=Prescott"}}), "Prescott");
}

// Two processes on a host with one GPU fail at once on every rank with a message that says
// so: ours where nothing hands each process its own GPU, NCCL's where CUDA_VISIBLE_DEVICES says
// it does but both masks name the same GPU. Never a hang.
TEST_F(GptTrainTest, TwoProcessesOnOneGpuFailClearly) {
  if (CudaDeviceCount() != 1) GTEST_SKIP() << "needs exactly 1 CUDA device, " << CudaDeviceCount() << " visible";
  for (const bool mask : {false, true}) {
    ProcessOptions options{.env = {"DTENSOR_TIMEOUT_S=60"}};
    if (mask) {
      options.env.push_back("CUDA_VISIBLE_DEVICES=0");
    } else {
      options.unset.push_back("CUDA_VISIBLE_DEVICES");
    }
    const ProcessRun run =
        Train(std::string(DTRUN_PATH) + " --nproc-per-node 2",
              "--text " + Corpus() + " --n-layer 1 --n-head 2 --n-embd 16 --seq 8 --steps 1 --device cuda", options);
    EXPECT_NE(run.code, 0) << run.out;
    EXPECT_LT(run.took, absl::Seconds(45)) << "CUDA_VISIBLE_DEVICES " << (mask ? "=0" : "unset");
    const bool ours = run.out.find("2 processes on this host but 1 CUDA device(s) visible") != std::string::npos;
    const bool nccls = run.out.find("Duplicate GPU") != std::string::npos;
    EXPECT_TRUE(mask ? nccls : ours) << "CUDA_VISIBLE_DEVICES " << (mask ? "=0" : "unset") << ":\n" << run.out;
  }
}

// One rank on cuda:0 trains to the CPU's losses (float32 on both; GPU reductions run in
// another order).
TEST_F(GptTrainTest, OneGpuMatchesCpu) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device visible";
  const std::vector<double> cpu = RunLosses("", "--batch 4 --ranks 1 --device cpu", "c1");
  const std::vector<double> gpu = RunLosses("", "--batch 4 --ranks 1 --device cuda", "g1");
  ASSERT_EQ(gpu.size(), cpu.size());
  for (size_t i = 0; i < cpu.size(); ++i) EXPECT_NEAR(gpu[i], cpu[i], 1e-4 * std::abs(cpu[i])) << "step " << i;
}

}  // namespace
}  // namespace dtensor
