// The trainer end to end: data-parallel runs (2 and 3 thread ranks, an uneven batch; 2 UCX
// processes under dtrun) report the same loss at every step as the single-rank run on the same
// global batches, and the loss falls.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "autograd/ops.h"
#include "dtensor/kernels/cpu/blas_core.h"
#include "dtensor/tensor/device.h"
#include "examples/gpt/data.h"
#include "examples/gpt/llmc.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "nn/gpt.h"
#include "nn/safetensors.h"
#include "tests/testing/test_util.h"

namespace dtensor {
namespace {

std::string TempPath(const std::string& name) {
  const char* dir = std::getenv("TEST_TMPDIR");
  return std::string(dir ? dir : "/tmp") + "/gpt_train_test_" + std::to_string(::getpid()) + "_" + name;
}

// A few KB of English text (fixed, so the test needs no package).
std::string WriteCorpus() {
  const std::string path = TempPath("corpus.txt");
  std::ofstream out(path);
  for (int i = 0; i < 40; ++i) {
    out << "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
           "foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of Light.\n";
  }
  return path;
}

std::vector<double> RunLosses(const std::string& launcher, const std::string& flags, const std::string& tag) {
  const std::string metrics = TempPath(tag + ".jsonl");
  const std::string cmd = launcher + std::string(GPT_TRAIN_PATH) + " --text " + WriteCorpus() +
                          " --n-layer 2 --n-head 2 --n-embd 32 --seq 16 --steps 6 --lr 3e-3 --sample-tokens 0" +
                          " --metrics " + metrics + " " + flags + " > " + TempPath(tag + ".log") + " 2>&1";
  EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
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

void ExpectSame(const std::vector<double>& a, const std::vector<double>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], b[i], 1e-5 * std::abs(b[i])) << "step " << i;
}

TEST(GptTrainTest, DataParallelLossesEqualSingleRank) {
  const std::vector<double> one = RunLosses("", "--batch 6 --ranks 1 --device cpu", "r1");
  ASSERT_EQ(one.size(), 6u);
  EXPECT_LT(one.back(), one.front() - 0.3) << "loss did not fall";
  ExpectSame(RunLosses("", "--batch 6 --ranks 2 --device cpu", "r2"), one);
  ExpectSame(RunLosses("", "--batch 6 --ranks 4 --device cpu", "r4"), one);  // 6 rows over 4 ranks: 2, 2, 2, 0
}

TEST(GptTrainTest, UcxProcessesMatchThreads) {
  const std::vector<double> one = RunLosses("", "--batch 5 --ranks 1 --device cpu", "u1");
  ExpectSame(RunLosses(std::string(DTRUN_PATH) + " --nproc-per-node 2 ", "--batch 5 --device cpu", "u2"), one);
}

// Two processes under dtrun, a GPU each over NCCL, train to one GPU's losses (1e-4: the
// all-reduce sums in another order).
TEST(GptTrainTest, TwoGpuProcessesMatchOneGpu) {
  if (CudaDeviceCount() < 2) GTEST_SKIP() << "needs 2 CUDA devices, " << CudaDeviceCount() << " visible";
  const std::vector<double> one = RunLosses("", "--batch 4 --ranks 1 --device cuda", "n1");
  const std::vector<double> two =
      RunLosses(std::string(DTRUN_PATH) + " --nproc-per-node 2 ", "--batch 4 --device cuda", "n2");
  ASSERT_EQ(two.size(), one.size());
  for (size_t i = 0; i < one.size(); ++i) EXPECT_NEAR(two[i], one[i], 1e-4 * std::abs(one[i])) << "step " << i;
}

// --init-llmc + --train-bin: the trainer starts from an llm.c checkpoint (here PyTorch's golden
// GPT written in llm.c's format) and its first loss equals the loss of nn::GPT loaded with the
// same tensors by name, on the first llm.c batch of the token file.
TEST(GptTrainTest, StartsFromAnLlmcCheckpoint) {
  using testing::Unwrap;
  NamedTensors golden = Unwrap(ReadSafetensors(std::string(DTENSOR_GOLDEN_DIR) + "/gpt2_tiny.safetensors"));
  nn::GPTConfig cfg{.vocab_size = 61, .block_size = 12, .n_layer = 2, .n_head = 2, .n_embd = 16};
  auto model = Unwrap(nn::GPT::Create(cfg));
  std::vector<std::pair<std::string, Tensor>> params;
  for (auto& [name, p] : model->NamedParameters()) params.emplace_back(name, *golden.Find(name));
  ASSERT_TRUE(model->LoadStateDict(params).ok());
  gpt::LlmcConfig lc{
      .max_seq_len = 12, .vocab_size = 61, .padded_vocab_size = 64, .num_layers = 2, .num_heads = 2, .channels = 16};
  const std::string ckpt = TempPath("tiny.llmc.bin"), bin = TempPath("tokens.bin");
  ASSERT_TRUE(gpt::WriteLlmcCheckpoint(ckpt, lc, params).ok());
  std::vector<uint16_t> stream;
  for (int i = 0; i < 200; ++i) stream.push_back(static_cast<uint16_t>((i * 37 + i / 7) % 61));
  ASSERT_TRUE(gpt::WriteLlmcTokens(bin, stream).ok());
  // Expected: batch 0 = rows of 10 tokens from position 0, targets shifted by one.
  std::vector<int32_t> in(stream.begin(), stream.begin() + 30), tg(stream.begin() + 1, stream.begin() + 31);
  Variable ids = Variable::Constant(Unwrap(Tensor::FromVector<int32_t>(in, {3, 10})));
  Variable targets = Variable::Constant(Unwrap(Tensor::FromVector<int32_t>(tg, {3, 10})));
  const double expected = testing::Values(Unwrap(model->Forward(ids, targets)).loss.value().local())[0];
  const std::string metrics = TempPath("llmc.jsonl");
  const std::string cmd = std::string(GPT_TRAIN_PATH) + " --train-bin " + bin + " --init-llmc " + ckpt +
                          " --seq 10 --batch 3 --steps 2 --ranks 2 --sample-tokens 5 --metrics " + metrics + " > " +
                          TempPath("llmc.log") + " 2>&1";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  std::ifstream f(metrics);
  std::string line;
  ASSERT_TRUE(std::getline(f, line));
  EXPECT_NEAR(nlohmann::json::parse(line).at("loss").get<double>(), expected, 1e-5 * expected);
}

// The same binary started by Open MPI's mpirun (OMPI_COMM_WORLD_* rendezvous) is a UCX rank.
TEST(GptTrainTest, MpirunProcessesMatchThreads) {
  if (std::system("command -v mpirun > /dev/null 2>&1") != 0) GTEST_SKIP() << "mpirun is not installed";
  const std::vector<double> one = RunLosses("", "--batch 5 --ranks 1 --device cpu", "m1");
  ExpectSame(RunLosses("mpirun --allow-run-as-root --oversubscribe -np 2 ", "--batch 5 --device cpu", "m2"), one);
}

TEST(GptTrainTest, BadFlagsFailCleanly) {
  const std::string cmd = std::string(GPT_TRAIN_PATH) + " --text /nonexistent/file --steps 1 > /dev/null 2>&1";
  EXPECT_NE(std::system(cmd.c_str()), 0);
  const std::string cmd2 = std::string(GPT_TRAIN_PATH) + " --text x --n-embd 30 --n-head 4 > /dev/null 2>&1";
  EXPECT_NE(std::system(cmd2.c_str()), 0);
  const std::string log = TempPath("bad_device.log");
  const std::string cmd3 = std::string(GPT_TRAIN_PATH) + " --text x --device tpu > " + log + " 2>&1";
  EXPECT_NE(std::system(cmd3.c_str()), 0);
  std::ifstream in(log);
  const std::string out((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_NE(out.find("--device auto|cpu|cuda"), std::string::npos) << out;
  // A --metrics file rank 0 cannot open stops every rank at once (the others used to wait for
  // rank 0 in the first all-reduce until the timeout).
  const std::string log4 = TempPath("bad_metrics.log");
  const std::string cmd4 = "DTENSOR_TIMEOUT_S=60 " + std::string(GPT_TRAIN_PATH) + " --text " + WriteCorpus() +
                           " --ranks 2 --n-layer 1 --n-head 2 --n-embd 16 --seq 8 --steps 2" +
                           " --metrics /nonexistent/dir/m.jsonl > " + log4 + " 2>&1";
  const auto start = std::chrono::steady_clock::now();
  EXPECT_NE(std::system(cmd4.c_str()), 0);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30));
  std::ifstream in4(log4);
  const std::string out4((std::istreambuf_iterator<char>(in4)), std::istreambuf_iterator<char>());
  EXPECT_NE(out4.find("cannot open --metrics /nonexistent/dir/m.jsonl"), std::string::npos) << out4;
}

// The trainer runs OpenBLAS's fastest kernel set for this CPU even where OpenBLAS, loading,
// fell back to generic ones (it restarts itself with OPENBLAS_CORETYPE), and keeps a set the
// user names. The banner says which set runs.
std::string BlasCoreOfTrainer(const std::string& env, const std::string& tag) {
  const std::string log = TempPath(tag + ".log");
  const std::string cmd = "env " + env + " " + std::string(GPT_TRAIN_PATH) + " --text " + WriteCorpus() +
                          " --n-layer 1 --n-head 2 --n-embd 16 --seq 8 --steps 1 --sample-tokens 0 --device cpu > " +
                          log + " 2>&1";
  EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
  std::ifstream in(log);
  const std::string out((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const size_t at = out.find("OpenBLAS ");
  if (at == std::string::npos) {
    ADD_FAILURE() << "no OpenBLAS core in the banner:\n" << out;
    return "";
  }
  const size_t begin = at + 9;
  return out.substr(begin, out.find_first_of("),", begin) - begin);
}

TEST(GptTrainTest, RunsTheFastestBlasKernelsForThisCpu) {
  if (!BlasChoosesCoreAtLoad()) GTEST_SKIP() << "OpenBLAS built for one core: nothing to choose";
  const std::string core = BlasCoreOfTrainer("-u OPENBLAS_CORETYPE", "blas_auto");
  EXPECT_EQ(FasterBlasCoreType(core, HostVectorIsa()), "") << "trainer ran OpenBLAS's " << core << " kernels";
  EXPECT_EQ(BlasCoreOfTrainer("OPENBLAS_CORETYPE=Prescott", "blas_user"), "Prescott");
}

// Two processes on a host with one GPU fail at once on every rank with a message that says
// so: ours where nothing hands each process its own GPU, NCCL's where CUDA_VISIBLE_DEVICES says
// it does but both masks name the same GPU. Never a hang.
TEST(GptTrainTest, TwoProcessesOnOneGpuFailClearly) {
  if (CudaDeviceCount() != 1) GTEST_SKIP() << "needs exactly 1 CUDA device, " << CudaDeviceCount() << " visible";
  for (const std::string env : {"env -u CUDA_VISIBLE_DEVICES", "env CUDA_VISIBLE_DEVICES=0"}) {
    const std::string log = TempPath("one_gpu_two_procs.log");
    const std::string cmd = "DTENSOR_TIMEOUT_S=60 " + env + " " + std::string(DTRUN_PATH) + " --nproc-per-node 2 " +
                            std::string(GPT_TRAIN_PATH) + " --text " + WriteCorpus() +
                            " --n-layer 1 --n-head 2 --n-embd 16 --seq 8 --steps 1 --device cuda > " + log + " 2>&1";
    const auto start = std::chrono::steady_clock::now();
    EXPECT_NE(std::system(cmd.c_str()), 0) << cmd;
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(45)) << env;
    std::ifstream in(log);
    const std::string out((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const bool ours = out.find("2 processes on this host but 1 CUDA device(s) visible") != std::string::npos;
    const bool nccls = out.find("Duplicate GPU") != std::string::npos;
    EXPECT_TRUE(env.find("-u") != std::string::npos ? ours : nccls) << env << ":\n" << out;
  }
}

// One rank on cuda:0 trains to the CPU's losses (float32 on both; GPU reductions run in
// another order).
TEST(GptTrainTest, OneGpuMatchesCpu) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device visible";
  const std::vector<double> cpu = RunLosses("", "--batch 4 --ranks 1 --device cpu", "c1");
  const std::vector<double> gpu = RunLosses("", "--batch 4 --ranks 1 --device cuda", "g1");
  ASSERT_EQ(gpu.size(), cpu.size());
  for (size_t i = 0; i < cpu.size(); ++i) EXPECT_NEAR(gpu[i], cpu[i], 1e-4 * std::abs(cpu[i])) << "step " << i;
}

}  // namespace
}  // namespace dtensor
