// Checks that tests/golden/gpt2_tiny.safetensors (made by tests/golden/make_gpt_golden.py with
// PyTorch) loads with ReadSafetensors and is self-consistent: names and shapes per its config,
// loss = mean cross entropy of its logits, and step1 = one AdamW step from the params and grads.
#include <cmath>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "dtensor/nn/safetensors.h"
#include "gtest/gtest.h"
#include "tests/testing/test_util.h"

#ifndef DTENSOR_GOLDEN_DIR
#error "DTENSOR_GOLDEN_DIR must name tests/golden (set in tests/CMakeLists.txt)"
#endif

namespace dtensor {
namespace {

using testing::Unwrap;

constexpr int64_t kV = 61, kMaxT = 12, kLayers = 2, kHeads = 2, kC = 16, kB = 3, kT = 10;

// nanoGPT state_dict order and shapes (lm_head.weight is tied to wte and not stored).
std::vector<std::pair<std::string, Shape>> ExpectedParams() {
  std::vector<std::pair<std::string, Shape>> p = {{"transformer.wte.weight", {kV, kC}},
                                                  {"transformer.wpe.weight", {kMaxT, kC}}};
  for (int64_t i = 0; i < kLayers; ++i) {
    const std::string h = "transformer.h." + std::to_string(i) + ".";
    p.push_back({h + "ln_1.weight", {kC}});
    p.push_back({h + "ln_1.bias", {kC}});
    p.push_back({h + "attn.c_attn.weight", {3 * kC, kC}});
    p.push_back({h + "attn.c_attn.bias", {3 * kC}});
    p.push_back({h + "attn.c_proj.weight", {kC, kC}});
    p.push_back({h + "attn.c_proj.bias", {kC}});
    p.push_back({h + "ln_2.weight", {kC}});
    p.push_back({h + "ln_2.bias", {kC}});
    p.push_back({h + "mlp.c_fc.weight", {4 * kC, kC}});
    p.push_back({h + "mlp.c_fc.bias", {4 * kC}});
    p.push_back({h + "mlp.c_proj.weight", {kC, 4 * kC}});
    p.push_back({h + "mlp.c_proj.bias", {kC}});
  }
  p.push_back({"transformer.ln_f.weight", {kC}});
  p.push_back({"transformer.ln_f.bias", {kC}});
  return p;
}

class GoldenFileTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto r = ReadSafetensors(std::string(DTENSOR_GOLDEN_DIR) + "/gpt2_tiny.safetensors");
    ASSERT_TRUE(r.ok()) << r.status();
    file_ = new NamedTensors(*std::move(r));
  }
  static void TearDownTestSuite() {
    delete file_;
    file_ = nullptr;
  }
  // The tensor `name`, checked for dtype and shape; an undefined Tensor (and a failure) otherwise.
  static Tensor Get(const std::string& name, DType dtype, const Shape& shape) {
    if (file_ == nullptr) return Tensor();
    const Tensor* t = file_->Find(name);
    if (t == nullptr) {
      ADD_FAILURE() << "missing tensor " << name;
      return Tensor();
    }
    EXPECT_EQ(t->dtype(), dtype) << name;
    EXPECT_EQ(Shape(t->shape().begin(), t->shape().end()), shape) << name;
    return *t;
  }
  static NamedTensors* file_;
};
NamedTensors* GoldenFileTest::file_ = nullptr;

TEST_F(GoldenFileTest, NamesShapesAndMetadataFollowTheConfig) {
  ASSERT_NE(file_, nullptr);
  const auto params = ExpectedParams();
  // Exactly: params, tokens, logits, loss, grad.*, step1.* (no lm_head.weight).
  std::vector<std::string> expected_names;
  for (const auto& [n, s] : params) expected_names.push_back(n);
  expected_names.insert(expected_names.end(), {"tokens", "logits", "loss"});
  for (const auto& [n, s] : params) expected_names.push_back("grad." + n);
  for (const auto& [n, s] : params) expected_names.push_back("step1." + n);
  std::vector<std::string> names;
  for (const auto& [n, t] : file_->tensors) names.push_back(n);
  EXPECT_EQ(names, expected_names);
  for (const auto& [n, s] : params) {
    Get(n, DType::kFloat32, s);
    Get("grad." + n, DType::kFloat32, s);
    Get("step1." + n, DType::kFloat32, s);
  }
  Tensor tokens = Get("tokens", DType::kInt64, {kB, kT + 1});
  for (int64_t tok : Unwrap(ToInt64Vector(tokens))) {
    EXPECT_GE(tok, 0);
    EXPECT_LT(tok, kV);
  }
  Get("logits", DType::kFloat32, {kB, kT, kV});
  Get("loss", DType::kFloat32, {});

  const auto& m = file_->metadata;
  auto meta = [&](const std::string& k) { return m.count(k) ? m.at(k) : std::string("<missing>"); };
  EXPECT_EQ(meta("vocab_size"), std::to_string(kV));
  EXPECT_EQ(meta("block_size"), std::to_string(kMaxT));
  EXPECT_EQ(meta("n_layer"), std::to_string(kLayers));
  EXPECT_EQ(meta("n_head"), std::to_string(kHeads));
  EXPECT_EQ(meta("n_embd"), std::to_string(kC));
  EXPECT_EQ(meta("batch_size"), std::to_string(kB));
  EXPECT_EQ(meta("seq_len"), std::to_string(kT));
  EXPECT_EQ(std::stod(meta("adamw_lr")), 1e-3);
  EXPECT_EQ(std::stod(meta("adamw_beta1")), 0.9);
  EXPECT_EQ(std::stod(meta("adamw_beta2")), 0.95);
  EXPECT_EQ(std::stod(meta("adamw_eps")), 1e-8);
  EXPECT_EQ(std::stod(meta("adamw_weight_decay")), 0.1);
}

TEST_F(GoldenFileTest, LossIsMeanCrossEntropyOfLogits) {
  ASSERT_NE(file_, nullptr);
  std::vector<int64_t> tokens = Unwrap(ToInt64Vector(Get("tokens", DType::kInt64, {kB, kT + 1})));
  std::vector<double> logits = testing::Values(Get("logits", DType::kFloat32, {kB, kT, kV}));
  std::vector<double> loss = testing::Values(Get("loss", DType::kFloat32, {}));
  ASSERT_EQ(tokens.size(), static_cast<size_t>(kB * (kT + 1)));
  ASSERT_EQ(logits.size(), static_cast<size_t>(kB * kT * kV));
  ASSERT_EQ(loss.size(), 1u);
  double total = 0;
  for (int64_t b = 0; b < kB; ++b) {
    for (int64_t t = 0; t < kT; ++t) {
      const double* row = &logits[static_cast<size_t>((b * kT + t) * kV)];
      const int64_t target = tokens[static_cast<size_t>(b * (kT + 1) + t + 1)];  // targets = tokens[:, 1:]
      double mx = row[0];
      for (int64_t v = 1; v < kV; ++v) mx = std::max(mx, row[v]);
      double sum = 0;
      for (int64_t v = 0; v < kV; ++v) sum += std::exp(row[v] - mx);
      total += std::log(sum) + mx - row[target];
    }
  }
  const double ce = total / static_cast<double>(kB * kT);
  EXPECT_NEAR(loss[0], ce, 1e-6);
  EXPECT_GT(ce, 3.0);  // ~log(61) = 4.11 for an untrained model
  EXPECT_LT(ce, 5.0);
}

TEST_F(GoldenFileTest, Step1IsOneAdamWStepFromParamsAndGrads) {
  ASSERT_NE(file_, nullptr);
  const double lr = 1e-3, wd = 0.1, eps = 1e-8;
  for (const auto& [name, shape] : ExpectedParams()) {
    SCOPED_TRACE(name);
    std::vector<double> p = testing::Values(Get(name, DType::kFloat32, shape));
    std::vector<double> g = testing::Values(Get("grad." + name, DType::kFloat32, shape));
    std::vector<double> p1 = testing::Values(Get("step1." + name, DType::kFloat32, shape));
    ASSERT_EQ(p.size(), g.size());
    ASSERT_EQ(p.size(), p1.size());
    // Bias correction makes the first Adam step lr * g / (|g| + eps); decoupled decay p *= 1 - lr*wd.
    std::vector<double> expected(p.size());
    int64_t unchanged = 0, nonzero_grads = 0;
    for (size_t i = 0; i < p.size(); ++i) {
      expected[i] = p[i] * (1 - lr * wd) - lr * g[i] / (std::abs(g[i]) + eps);
      if (p1[i] == p[i]) ++unchanged;
      if (g[i] != 0) ++nonzero_grads;
    }
    EXPECT_EQ(unchanged, 0);
    EXPECT_GT(nonzero_grads, 0);
    testing::ExpectNear(p1, expected, {1e-6, 2e-8}, name);
  }
}

TEST_F(GoldenFileTest, InitNoiseAndUnusedPositionsAreAsDocumented) {
  ASSERT_NE(file_, nullptr);
  // Biases got noise (not zero) and LayerNorm weights are 1 + noise (not exactly 1).
  for (const auto& [name, shape] : ExpectedParams()) {
    const bool bias = name.size() > 5 && name.compare(name.size() - 5, 5, ".bias") == 0;
    const bool ln_weight = name.find("ln_") != std::string::npos && !bias;
    if (!bias && !ln_weight) continue;
    std::vector<double> v = testing::Values(Get(name, DType::kFloat32, shape));
    int64_t plain = 0;
    for (double x : v) plain += (x == (bias ? 0.0 : 1.0));
    EXPECT_EQ(plain, 0) << name;
  }
  // T < block_size: wpe rows T..maxT-1 are unused (zero gradient), rows < T are used.
  std::vector<double> g = testing::Values(Get("grad.transformer.wpe.weight", DType::kFloat32, {kMaxT, kC}));
  for (int64_t r = 0; r < kMaxT; ++r) {
    double norm = 0;
    for (int64_t c = 0; c < kC; ++c) norm += std::abs(g[static_cast<size_t>(r * kC + c)]);
    if (r < kT) {
      EXPECT_GT(norm, 0) << "row " << r;
    } else {
      EXPECT_EQ(norm, 0) << "row " << r;
    }
  }
}

}  // namespace
}  // namespace dtensor
