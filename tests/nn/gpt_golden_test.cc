// The GPT of nn/gpt.h against golden tensors from PyTorch (tests/golden/make_gpt_golden.py):
// logits, loss, every parameter's gradient and the parameters after one AdamW step, on one
// rank (plain tensors) and data-parallel over 2 and 3 thread ranks (batch Shard(0), uneven for
// 2 ranks: rows 2 + 1; parameters Replicate; gradients reduced by ReduceGradients). Where a
// GPU is visible, also on cuda:0: plain tensors, and DTensors on a one-rank NCCL mesh.
#include <cmath>
#include <string>
#include <thread>

#include "dtensor/autograd/ops.h"
#include "dtensor/collectives/nccl/nccl_communicator.h"
#include "dtensor/collectives/store/tcp_store.h"
#include "dtensor/collectives/threads/threads_communicator.h"
#include "dtensor/nn/gpt.h"
#include "dtensor/nn/optim.h"
#include "dtensor/nn/safetensors.h"
#include "gtest/gtest.h"
#include "tests/testing/test_util.h"

namespace dtensor {
namespace {

using testing::Unwrap;

struct Golden {
  NamedTensors file;
  nn::GPTConfig config;
  const Tensor& Get(const std::string& name) const {
    const Tensor* t = file.Find(name);
    EXPECT_NE(t, nullptr) << name;
    return *t;
  }
};

const Golden& LoadGolden() {
  static const Golden* g = [] {
    auto* gg = new Golden;
    gg->file = Unwrap(ReadSafetensors(std::string(DTENSOR_GOLDEN_DIR) + "/gpt2_tiny.safetensors"));
    auto num = [&](const char* k) { return std::stoll(gg->file.metadata.at(k)); };
    gg->config.vocab_size = num("vocab_size");
    gg->config.block_size = num("block_size");
    gg->config.n_layer = num("n_layer");
    gg->config.n_head = num("n_head");
    gg->config.n_embd = num("n_embd");
    return gg;
  }();
  return *g;
}

// Max |a - b| relative to max |b| (gradients of LayerNorm weights are ~1e-4 in size).
double RelErr(const Tensor& a, const Tensor& b) {
  const std::vector<double> x = Unwrap(ToDoubleVector(a)), y = Unwrap(ToDoubleVector(b));
  EXPECT_EQ(x.size(), y.size());
  double diff = 0, scale = 1e-30;
  for (size_t i = 0; i < x.size() && i < y.size(); ++i) {
    diff = std::max(diff, std::abs(x[i] - y[i]));
    scale = std::max(scale, std::abs(y[i]));
  }
  return diff / scale;
}

Tensor Full(const Value& v) { return v.is_dtensor() ? Unwrap(v.dtensor().FullTensor()) : v.local(); }

// One rank's run: returns nothing, checks with EXPECT (rank 0 reports).
void RunGolden(const DeviceMesh* mesh, Device device = Device::Cpu()) {
  const Golden& g = LoadGolden();
  auto model = Unwrap(nn::GPT::Create(g.config));
  std::vector<std::pair<std::string, Tensor>> params;
  for (auto& [name, p] : model->NamedParameters()) params.emplace_back(name, g.Get(name));
  ASSERT_TRUE(model->LoadStateDict(params).ok());
  const Tensor& tokens = g.Get("tokens");  // int64 [B, T+1]
  const int64_t t = tokens.size(1) - 1;
  Tensor inputs = Unwrap(To(Unwrap(Contiguous(Unwrap(tokens.Narrow(1, 0, t)))), device));
  Tensor targets = Unwrap(To(Unwrap(Contiguous(Unwrap(tokens.Narrow(1, 1, t)))), device));
  Variable ids, tg;
  if (mesh != nullptr) {
    ASSERT_TRUE(nn::DistributeModule(*model, *mesh).ok());  // to the mesh's device
    ids = Variable::Constant(Unwrap(DTensor::Distribute(inputs, *mesh, {Shard(0)}, {.src_rank = std::nullopt})));
    tg = Variable::Constant(Unwrap(DTensor::Distribute(targets, *mesh, {Shard(0)}, {.src_rank = std::nullopt})));
  } else {
    ASSERT_TRUE(model->To(device).ok());
    ids = Variable::Constant(inputs);
    tg = Variable::Constant(targets);
  }
  for (auto& [name, p] : model->NamedParameters()) ASSERT_EQ(p->value().local().device(), device) << name;
  nn::GPT::Output out = Unwrap(model->Forward(ids, tg));
  const bool report = mesh == nullptr || mesh->coordinate()[0] == 0;
  const double logits_err = RelErr(Full(out.logits.value()), g.Get("logits"));
  Value loss = out.loss.value();
  if (loss.is_dtensor()) loss = Unwrap(loss.dtensor().Redistribute({Replicate()}));
  const double loss_err = RelErr(loss.local(), g.Get("loss"));
  ASSERT_TRUE(Backward(out.loss).ok());
  auto ps = model->Parameters();
  ASSERT_TRUE(nn::ReduceGradients(ps).ok());
  double worst_grad = 0;
  std::string worst_name;
  for (auto& [name, p] : model->NamedParameters()) {
    ASSERT_TRUE(p->grad().defined()) << name;
    const double e = RelErr(Full(p->grad()), g.Get("grad." + name));
    if (e > worst_grad) {
      worst_grad = e;
      worst_name = name;
    }
  }
  nn::AdamW opt(ps, {.lr = std::stod(g.file.metadata.at("adamw_lr")),
                     .beta1 = std::stod(g.file.metadata.at("adamw_beta1")),
                     .beta2 = std::stod(g.file.metadata.at("adamw_beta2")),
                     .eps = std::stod(g.file.metadata.at("adamw_eps")),
                     .weight_decay = std::stod(g.file.metadata.at("adamw_weight_decay"))});
  ASSERT_TRUE(opt.Step().ok());
  double worst_step = 0;
  for (auto& [name, p] : model->NamedParameters()) {
    worst_step = std::max(worst_step, RelErr(Full(p->value()), g.Get("step1." + name)));
  }
  for (auto& [name, p] : model->NamedParameters()) EXPECT_EQ(p->value().local().device(), device) << name;
  if (report) {
    std::printf("%s: logits %.3g loss %.3g grad %.3g (%s) step %.3g\n", device.ToString().c_str(), logits_err, loss_err,
                worst_grad, worst_name.c_str(), worst_step);
    EXPECT_LT(logits_err, 1e-5);
    EXPECT_LT(loss_err, 1e-5);
    EXPECT_LT(worst_grad, 1e-5) << "worst gradient: " << worst_name;
    EXPECT_LT(worst_step, 1e-5);
  }
}

TEST(GptGoldenTest, OneRankMatchesPyTorch) { RunGolden(nullptr); }

class GptGoldenDpTest : public ::testing::TestWithParam<int> {};

TEST_P(GptGoldenDpTest, DataParallelMatchesPyTorch) {
  const int world = GetParam();
  auto comms = Unwrap(MakeThreadGroup(world, absl::Seconds(30)));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      DeviceMesh mesh = Unwrap(DeviceMesh::Create(*comms[static_cast<size_t>(r)], {world}, {"dp"}));
      RunGolden(&mesh);
    });
  }
  for (auto& th : threads) th.join();
}

INSTANTIATE_TEST_SUITE_P(Ranks, GptGoldenDpTest, ::testing::Values(2, 3));

TEST(GptGoldenTest, OneGpuMatchesPyTorch) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device visible";
  RunGolden(nullptr, Device::Cuda(0));
}

// DTensors on cuda:0 over a one-rank NCCL communicator: the DTensor dispatch, the optimizer
// and ReduceGradients on device memory with the nccl backend underneath.
TEST(GptGoldenTest, OneGpuNcclMeshMatchesPyTorch) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device visible: the nccl backend needs a GPU";
  auto server = Unwrap(StoreServer::Start("127.0.0.1", 0));
  auto client = Unwrap(StoreClient::Connect("127.0.0.1", server->port(), absl::Seconds(60)));
  LaunchInfo info;
  info.rank = 0;
  info.world_size = 1;
  info.local_rank = 0;
  info.local_world_size = 1;
  auto comm = Unwrap(MakeNcclCommunicator(info, *client, 0, absl::Seconds(60)));
  DeviceMesh mesh = Unwrap(DeviceMesh::Create(*comm, {1}, {"dp"}));
  RunGolden(&mesh, Device::Cuda(0));
}

}  // namespace
}  // namespace dtensor
