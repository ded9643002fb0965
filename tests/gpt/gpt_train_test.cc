// The trainer end to end: data-parallel runs (2 and 4 thread ranks, an uneven batch; 2 UCX
// processes under dtrun) report the same loss at every step as the single-rank run on the same
// global batches, and the loss falls.
#include <cmath>
#include <cstdint>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "autograd/ops.h"
#include "dtensor/kernels/cpu/blas_core.h"
#include "dtensor/tensor/device.h"
#include "examples/gpt/data.h"
#include "examples/gpt/llmc.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "nn/gpt.h"
#include "nn/safetensors.h"
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
  EXPECT_NE(device.out.find("--device auto|cpu|cuda"), std::string::npos) << device.out;
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
