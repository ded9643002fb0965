// Hugging Face GPT-2 weights (examples/gpt/hf_gpt2.h) against an independent PyTorch
// implementation of GPT2LMHeadModel: tests/golden/hf_gpt2_tiny/ (made by
// tests/golden/make_hf_gpt2_golden.py) holds random weights in the hub's layout and the
// reference's logits, per-layer outputs and a greedy continuation, computed in float64.
// Tolerance: max |ours - reference| / max |reference| <= 1e-5 for every compared tensor.
#include "examples/gpt/hf_gpt2.h"

#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "dtensor/nn/safetensors.h"
#include "dtensor/ops/ops.h"
#include "examples/gpt/llmc.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/testing/test_util.h"

#ifndef DTENSOR_GOLDEN_DIR
#error "DTENSOR_GOLDEN_DIR must name tests/golden (set in tests/CMakeLists.txt)"
#endif

namespace dtensor::gpt {
namespace {

using testing::Unwrap;
using Named = std::vector<std::pair<std::string, Tensor>>;

const std::string kModelDir = std::string(DTENSOR_GOLDEN_DIR) + "/hf_gpt2_tiny";

NamedTensors Golden() { return Unwrap(ReadSafetensors(kModelDir + "/golden.safetensors")); }

const Tensor& Get(const NamedTensors& f, const std::string& name) {
  const Tensor* t = f.Find(name);
  if (t == nullptr) {
    ADD_FAILURE() << "golden tensor " << name << " missing";
    static const Tensor* empty = new Tensor();
    return *empty;
  }
  return *t;
}

std::vector<float> Floats(const Tensor& t) { return Unwrap(Unwrap(Contiguous(t)).ToVector<float>()); }

// max |a - b| / max |b|; a and b must have the same shape.
double RelMaxErr(const Tensor& a, const Tensor& b) {
  EXPECT_EQ(ShapeString(a.shape()), ShapeString(b.shape()));
  const std::vector<float> x = Floats(a), y = Floats(b);
  if (x.size() != y.size() || y.empty()) return 1e30;
  double diff = 0, scale = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    diff = std::max(diff, std::abs(static_cast<double>(x[i]) - y[i]));
    scale = std::max(scale, std::abs(static_cast<double>(y[i])));
  }
  return diff / scale;
}

std::unique_ptr<nn::GPT> LoadModel(const HfGpt2& hf) {
  std::unique_ptr<nn::GPT> model = Unwrap(nn::GPT::Create(hf.config));
  absl::Status s = model->LoadStateDict(hf.params);
  EXPECT_TRUE(s.ok()) << s;
  model->Eval();
  return model;
}

Tensor Logits(nn::GPT& model, const Tensor& ids) {
  nn::GPT::Output out = Unwrap(model.Forward(Variable::Constant(ids)));
  return out.logits.value().local();
}

template <typename M>
M* FindModule(nn::Module& model, const std::string& name) {
  for (auto& [n, m] : model.NamedModules()) {
    if (n == name) return dynamic_cast<M*>(m);
  }
  return nullptr;
}

TEST(HfGpt2Test, ReadsHubLayoutIntoOurNamesAndTransposesConv1D) {
  HfGpt2 hf = Unwrap(ReadHfGpt2(kModelDir));
  EXPECT_EQ(hf.config.vocab_size, 97);
  EXPECT_EQ(hf.config.block_size, 48);
  EXPECT_EQ(hf.config.n_layer, 3);
  EXPECT_EQ(hf.config.n_head, 4);
  EXPECT_EQ(hf.config.n_embd, 32);
  EXPECT_FALSE(hf.widened);
  LlmcConfig lc;
  lc.max_seq_len = 48;
  lc.vocab_size = lc.padded_vocab_size = 97;
  lc.num_layers = 3;
  lc.num_heads = 4;
  lc.channels = 32;
  const auto shapes = LlmcParamShapes(lc);
  ASSERT_EQ(hf.params.size(), shapes.size());
  for (size_t i = 0; i < shapes.size(); ++i) {
    EXPECT_EQ(hf.params[i].first, shapes[i].first);
    EXPECT_EQ(ShapeString(hf.params[i].second.shape()), ShapeString(shapes[i].second)) << shapes[i].first;
    EXPECT_EQ(hf.params[i].second.dtype(), DType::kFloat32);
  }
  // Element by element against the raw file: Conv1D weights transposed, the rest as stored.
  NamedTensors file = Unwrap(ReadSafetensors(kModelDir + "/model.safetensors"));
  for (const std::string name : {"h.1.attn.c_attn.weight", "h.2.mlp.c_proj.weight", "h.0.ln_2.bias", "wpe.weight"}) {
    const Tensor& raw = Get(file, name);
    const Tensor* ours = hf.Find("transformer." + name);
    ASSERT_NE(ours, nullptr) << name;
    const std::vector<float> r = Floats(raw), o = Floats(*ours);
    ASSERT_EQ(r.size(), o.size());
    if (raw.dim() == 2 && name.find(".c_") != std::string::npos) {
      const int64_t in = raw.size(0), out = raw.size(1);
      EXPECT_EQ(ours->size(0), out);
      for (int64_t i = 0; i < in; ++i) {
        for (int64_t j = 0; j < out; ++j) {
          ASSERT_EQ(o[static_cast<size_t>(j * in + i)], r[static_cast<size_t>(i * out + j)]) << name;
        }
      }
    } else {
      EXPECT_EQ(o, r) << name;
    }
  }
  // A path to the .safetensors file itself (config.json beside it) reads the same.
  HfGpt2 by_file = Unwrap(ReadHfGpt2(kModelDir + "/model.safetensors"));
  ASSERT_EQ(by_file.params.size(), hf.params.size());
  for (size_t i = 0; i < hf.params.size(); ++i) {
    EXPECT_EQ(Floats(by_file.params[i].second), Floats(hf.params[i].second)) << hf.params[i].first;
  }
}

TEST(HfGpt2Test, LogitsMatchIndependentPyTorchWithin1e5Relative) {
  std::unique_ptr<nn::GPT> model = LoadModel(Unwrap(ReadHfGpt2(kModelDir)));
  NamedTensors golden = Golden();
  const Tensor logits = Logits(*model, Get(golden, "input_ids"));
  const double err = RelMaxErr(logits, Get(golden, "logits"));
  EXPECT_LE(err, 1e-5);
  std::printf("logits: max |ours - pytorch| / max |pytorch| = %.3e\n", err);
}

TEST(HfGpt2Test, LayerByLayerOutputsMatch) {
  std::unique_ptr<nn::GPT> model = LoadModel(Unwrap(ReadHfGpt2(kModelDir)));
  NamedTensors golden = Golden();
  const Tensor& ids = Get(golden, "input_ids");
  auto* wte = FindModule<nn::Embedding>(*model, "transformer.wte");
  auto* wpe = FindModule<nn::Embedding>(*model, "transformer.wpe");
  auto* ln_f = FindModule<nn::LayerNorm>(*model, "transformer.ln_f");
  ASSERT_NE(wte, nullptr);
  ASSERT_NE(wpe, nullptr);
  ASSERT_NE(ln_f, nullptr);
  ASSERT_EQ(wte->weight(), model->FindParameter("transformer.wte.weight"));
  const Tensor pos = Unwrap(Arange(ids.size(1), DType::kInt64));
  Variable tok = Unwrap(wte->Forward(Variable::Constant(ids)));
  Variable x = Unwrap(dtensor::Add(tok, Unwrap(wpe->Forward(Variable::Constant(pos)))));
  double worst = RelMaxErr(x.value().local(), Get(golden, "hidden.embed"));
  EXPECT_LE(worst, 1e-5) << "embeddings";
  for (int64_t i = 0; i < model->config().n_layer; ++i) {
    x = Unwrap(model->block(i)->Forward(x));
    const double err = RelMaxErr(x.value().local(), Get(golden, absl::StrCat("hidden.block.", i)));
    EXPECT_LE(err, 1e-5) << "block " << i;
    worst = std::max(worst, err);
  }
  x = Unwrap(ln_f->Forward(x));
  const double err = RelMaxErr(x.value().local(), Get(golden, "hidden.ln_f"));
  EXPECT_LE(err, 1e-5) << "ln_f";
  worst = std::max(worst, err);
  // The LM head on our ln_f output gives the full forward's logits.
  Variable logits = Unwrap(model->lm_head()->Forward(x));
  EXPECT_LE(RelMaxErr(logits.value().local(), Get(golden, "logits")), 1e-5);
  std::printf("layer outputs: worst max |ours - pytorch| / max |pytorch| = %.3e\n", worst);
}

TEST(HfGpt2Test, GreedyContinuationIsTokenIdentical) {
  std::unique_ptr<nn::GPT> model = LoadModel(Unwrap(ReadHfGpt2(kModelDir)));
  NamedTensors golden = Golden();
  std::vector<int64_t> seq = Unwrap(Get(golden, "prompt").ToVector<int64_t>());
  const std::vector<int64_t> expected = Unwrap(Get(golden, "greedy").ToVector<int64_t>());
  ASSERT_EQ(expected.size(), 32u);
  const size_t prompt = seq.size();
  const int64_t vocab = model->config().vocab_size;
  for (size_t step = 0; step < expected.size(); ++step) {
    const int64_t t = static_cast<int64_t>(seq.size());
    const Tensor ids = Unwrap(Tensor::FromVector<int64_t>(seq, {1, t}));
    const std::vector<float> logits = Floats(Logits(*model, ids));  // the whole sequence again
    const float* last = logits.data() + (t - 1) * vocab;
    int64_t best = 0;
    for (int64_t v = 1; v < vocab; ++v) {
      if (last[v] > last[best]) best = v;
    }
    seq.push_back(best);
  }
  EXPECT_EQ(std::vector<int64_t>(seq.begin() + static_cast<std::ptrdiff_t>(prompt), seq.end()), expected);
}

// ---- Errors: a copy of the golden model with one thing changed. ----

class HfGpt2ErrorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    file_ = Unwrap(ReadSafetensors(kModelDir + "/model.safetensors"));
    config_ = testing::ReadBytes(kModelDir + "/config.json");
    ASSERT_FALSE(config_.empty());
  }
  // Writes `tensors` and `config` into the temp dir and reads it back.
  absl::StatusOr<HfGpt2> Read(const Named& tensors, const std::string& config) {
    EXPECT_TRUE(WriteSafetensors(dir_.Path("model.safetensors"), tensors, {{"format", "pt"}}).ok());
    testing::WriteBytes(dir_.Path("config.json"), config);
    return ReadHfGpt2(dir_.path());
  }
  Named Replaced(const std::string& name, const Tensor& t) const {
    Named out = file_.tensors;
    for (auto& [n, v] : out) {
      if (n == name) v = t;
    }
    return out;
  }
  // Expects InvalidArgument whose message holds every one of `parts`.
  static void ExpectInvalid(const absl::StatusOr<HfGpt2>& r, const std::vector<std::string>& parts) {
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
    for (const std::string& p : parts) EXPECT_NE(r.status().message().find(p), std::string::npos) << r.status();
  }

  testing::ScopedTempDir dir_{"hf_gpt2"};
  NamedTensors file_;
  std::string config_;
};

TEST_F(HfGpt2ErrorTest, TheUnchangedCopyReads) { EXPECT_TRUE(Read(file_.tensors, config_).ok()); }

TEST_F(HfGpt2ErrorTest, WrongName) {
  Named t = file_.tensors;
  for (auto& [n, v] : t) {
    if (n == "h.1.mlp.c_fc.bias") n = "h.1.mlp.fc.bias";
  }
  ExpectInvalid(Read(t, config_), {"unknown tensor 'h.1.mlp.fc.bias'", dir_.Path("model.safetensors")});
  Named extra = file_.tensors;
  extra.emplace_back("h.3.ln_1.weight", Get(file_, "h.0.ln_1.weight"));  // only 3 layers
  ExpectInvalid(Read(extra, config_), {"unknown tensor 'h.3.ln_1.weight'"});
  Named mixed = file_.tensors;
  for (auto& [n, v] : mixed) {
    if (n == "wpe.weight") n = "transformer.wpe.weight";
  }
  ExpectInvalid(Read(mixed, config_), {"mixes", "transformer.wpe.weight"});
}

TEST_F(HfGpt2ErrorTest, WrongShape) {
  // nn.Linear's [out, in] where Conv1D's [in, out] belongs: the classic mistake.
  const Tensor w = Unwrap(Contiguous(Unwrap(Get(file_, "h.0.attn.c_attn.weight").Transpose(0, 1))));
  ExpectInvalid(Read(Replaced("h.0.attn.c_attn.weight", w), config_),
                {"'h.0.attn.c_attn.weight' has shape [96, 32], expected [32, 96]", "Conv1D"});
  const Tensor short_bias = Unwrap(Zeros({31}, DType::kFloat32));
  ExpectInvalid(Read(Replaced("ln_f.bias", short_bias), config_), {"'ln_f.bias' has shape [31]"});
}

TEST_F(HfGpt2ErrorTest, WrongDtype) {
  const Tensor i64 = Unwrap(Zeros({32}, DType::kInt64));
  ExpectInvalid(Read(Replaced("h.2.ln_2.bias", i64), config_), {"'h.2.ln_2.bias' has dtype I64"});
}

TEST_F(HfGpt2ErrorTest, MissingTensor) {
  Named t;
  for (const auto& [n, v] : file_.tensors) {
    if (n != "h.1.attn.c_proj.bias") t.emplace_back(n, v);
  }
  ExpectInvalid(Read(t, config_), {"missing tensor 'h.1.attn.c_proj.bias'"});
}

TEST_F(HfGpt2ErrorTest, BadMaskBufferAndUntiedHead) {
  std::vector<float> mask = Floats(Get(file_, "h.2.attn.bias"));
  mask[5] = 1.f;  // row 0, column 5: above the diagonal
  ExpectInvalid(Read(Replaced("h.2.attn.bias", Unwrap(Tensor::FromVector<float>(mask, {1, 1, 48, 48}))), config_),
                {"'h.2.attn.bias'", "row 0, column 5"});
  Named untied = file_.tensors;
  untied.emplace_back("lm_head.weight", Unwrap(Scale(Get(file_, "wte.weight"), 2.0)));
  ExpectInvalid(Read(untied, config_), {"'lm_head.weight' differs from 'wte.weight'"});
}

TEST_F(HfGpt2ErrorTest, BadConfigJson) {
  auto with = [&](const std::string& from, const std::string& to) {
    const std::string c = absl::StrReplaceAll(config_, {{from, to}});
    EXPECT_NE(c, config_) << from;
    return Read(file_.tensors, c);
  };
  ExpectInvalid(with("\"layer_norm_epsilon\": 1e-05", "\"layer_norm_epsilon\": 1e-06"),
                {"layer_norm_epsilon", "1e-06", "config.json"});
  ExpectInvalid(with("\"gelu_new\"", "\"relu\""), {"activation_function", "relu"});
  ExpectInvalid(with("\"n_head\": 4", "\"n_head\": 5"), {"n_embd 32 is not a multiple of n_head 5"});
  ExpectInvalid(with("\"n_head\": 4", "\"n_heads\": 4"), {"missing \"n_head\""});
  ExpectInvalid(with("\"n_inner\": null", "\"n_inner\": 100"), {"n_inner", "100"});
  ExpectInvalid(with("\"vocab_size\": 97", "\"vocab_size\": -97"), {"vocab_size", "-97"});
  // 2^32 + 32 would pass as 32 once cut to int (the weights are 32 wide).
  ExpectInvalid(with("\"n_embd\": 32", "\"n_embd\": 4294967328"), {"n_embd", "4294967328", "2^31 - 1"});
  ExpectInvalid(with("\"tie_word_embeddings\": true", "\"tie_word_embeddings\": false"), {"tie_word_embeddings"});
  ExpectInvalid(with("{", "["), {"config.json"});
  // A config that disagrees with the weights: the weights are refused, naming the tensor.
  ExpectInvalid(with("\"n_positions\": 48", "\"n_positions\": 64"), {"'wpe.weight' has shape [48, 32]"});
  std::filesystem::remove(dir_.Path("config.json"));
  absl::StatusOr<HfGpt2> r = ReadHfGpt2(dir_.Path("model.safetensors"));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound) << r.status();
}

TEST_F(HfGpt2ErrorTest, AcceptsPrefixedNamesTiedHeadNoMasksAndWidensBf16) {
  Named t;
  for (const auto& [n, v] : file_.tensors) {
    if (n.size() > 10 && n.compare(n.size() - 10, 10, ".attn.bias") == 0) {  // h.<i>.attn.bias
      t.emplace_back("transformer." + n.substr(0, n.size() - 4) + "masked_bias", Unwrap(Full({}, -1e4, v.dtype())));
      continue;
    }
    t.emplace_back("transformer." + n, Unwrap(Cast(v, DType::kBFloat16)));
  }
  t.emplace_back("lm_head.weight", Unwrap(Cast(Get(file_, "wte.weight"), DType::kBFloat16)));
  HfGpt2 got = Unwrap(Read(t, config_));
  EXPECT_TRUE(got.widened);
  HfGpt2 ref = Unwrap(ReadHfGpt2(kModelDir));
  ASSERT_EQ(got.params.size(), ref.params.size());
  for (size_t i = 0; i < ref.params.size(); ++i) {
    const Tensor rounded = Unwrap(Cast(Unwrap(Cast(ref.params[i].second, DType::kBFloat16)), DType::kFloat32));
    EXPECT_EQ(Floats(got.params[i].second), Floats(rounded)) << ref.params[i].first;
  }
}

// ---- Export ----

TEST(HfGpt2WriteTest, RoundTripAndGpt2LMHeadModelLayout) {
  testing::ScopedTempDir dir("hf_gpt2_write");
  HfGpt2 hf = Unwrap(ReadHfGpt2(kModelDir));
  const std::string out = dir.Path("export");
  ASSERT_TRUE(WriteHfGpt2(out, hf.config, hf.params).ok());
  HfGpt2 back = Unwrap(ReadHfGpt2(out));
  EXPECT_EQ(HfJsonFromGptConfig(back.config), HfJsonFromGptConfig(hf.config));
  ASSERT_EQ(back.params.size(), hf.params.size());
  for (size_t i = 0; i < hf.params.size(); ++i) {
    EXPECT_EQ(back.params[i].first, hf.params[i].first);
    EXPECT_EQ(Floats(back.params[i].second), Floats(hf.params[i].second)) << hf.params[i].first;
  }
  NamedTensors raw = Unwrap(ReadSafetensors(out + "/model.safetensors"));
  EXPECT_EQ(raw.metadata["format"], "pt");
  EXPECT_EQ(raw.tensors.size(), hf.params.size());  // no lm_head.weight, no mask buffers
  for (const auto& [n, t] : raw.tensors) {
    EXPECT_EQ(n.rfind("transformer.", 0), 0u) << n;
    EXPECT_EQ(t.dtype(), DType::kFloat32) << n;
  }
  ASSERT_NE(raw.Find("transformer.h.0.mlp.c_fc.weight"), nullptr);
  EXPECT_EQ(ShapeString(raw.Find("transformer.h.0.mlp.c_fc.weight")->shape()), "[32, 128]");  // [in, out]
  EXPECT_EQ(Floats(*raw.Find("transformer.h.0.mlp.c_fc.weight")),
            Floats(Get(Unwrap(ReadSafetensors(kModelDir + "/model.safetensors")), "h.0.mlp.c_fc.weight")));
}

TEST(HfGpt2WriteTest, ExportReadByTheIndependentPyTorchForward) {
  if (std::system("/usr/bin/python3 -c 'import torch' >/dev/null 2>&1") != 0) {
    GTEST_SKIP() << "/usr/bin/python3 with torch (Debian's python3-torch) is not installed";
  }
  testing::ScopedTempDir dir("hf_gpt2_py");
  HfGpt2 hf = Unwrap(ReadHfGpt2(kModelDir));
  // Export what the model holds (its state_dict), not the tensors read.
  std::unique_ptr<nn::GPT> model = LoadModel(hf);
  ASSERT_TRUE(WriteHfGpt2(dir.path(), model->config(), Unwrap(model->StateDict())).ok());
  const std::string cmd = absl::StrCat("/usr/bin/python3 ", DTENSOR_SOURCE_DIR,
                                       "/tests/golden/make_hf_gpt2_golden.py --check-export ", dir.path());
  EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
}

TEST(HfGpt2WriteTest, Errors) {
  testing::ScopedTempDir dir("hf_gpt2_write");
  HfGpt2 hf = Unwrap(ReadHfGpt2(kModelDir));
  Named extra = hf.params;
  extra.emplace_back("lm_head.weight", hf.params[0].second);
  absl::Status s = WriteHfGpt2(dir.path(), hf.config, extra);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("'lm_head.weight'"), std::string::npos) << s;
  Named missing(hf.params.begin() + 1, hf.params.end());
  s = WriteHfGpt2(dir.path(), hf.config, missing);
  EXPECT_NE(s.message().find("'transformer.wte.weight' missing"), std::string::npos) << s;
  Named wrong = hf.params;
  wrong[4].second = Unwrap(Zeros({5}, DType::kFloat32));
  s = WriteHfGpt2(dir.path(), hf.config, wrong);
  EXPECT_NE(s.message().find(wrong[4].first), std::string::npos) << s;
  EXPECT_FALSE(std::filesystem::exists(dir.Path("model.safetensors")));
}

TEST(GptPresetTest, KnownAndUnknownNames) {
  const nn::GPTConfig small = Unwrap(GptPreset("gpt2"));
  EXPECT_EQ(small.n_layer, 12);
  EXPECT_EQ(small.n_embd, 768);
  EXPECT_EQ(small.vocab_size, 50257);
  EXPECT_EQ(small.block_size, 1024);
  const nn::GPTConfig xl = Unwrap(GptPreset("gpt2-xl"));
  EXPECT_EQ(xl.n_layer, 48);
  EXPECT_EQ(xl.n_head, 25);
  EXPECT_EQ(xl.n_embd, 1600);
  // Parameter counts against the published sizes (124M, 355M, 774M, 1558M).
  const std::pair<const char*, double> sizes[] = {
      {"gpt2", 124.44e6}, {"gpt2-medium", 354.82e6}, {"gpt2-large", 774.03e6}, {"gpt2-xl", 1557.61e6}};
  for (const auto& [name, count] : sizes) {
    const nn::GPTConfig c = Unwrap(GptPreset(name));
    const int64_t C = c.n_embd;
    const double n =
        static_cast<double>(c.vocab_size * C + c.block_size * C + c.n_layer * (12 * C * C + 13 * C) + 2 * C);
    EXPECT_NEAR(n, count, 0.01e6) << name;
    // The preset's config.json reads back to the preset.
    const nn::GPTConfig again = Unwrap(GptConfigFromHfJson(HfJsonFromGptConfig(c), name));
    EXPECT_EQ(again.n_layer, c.n_layer);
    EXPECT_EQ(again.n_head, c.n_head);
    EXPECT_EQ(again.n_embd, c.n_embd);
  }
  // <|endoftext|> (50256) is bos and eos for GPT-2's vocabulary, also padded as gpt_train pads
  // it (50304; the last row, 50303, is padding); a smaller vocabulary's last id otherwise.
  for (const auto& [vocab, eos] :
       std::vector<std::pair<int64_t, int64_t>>{{50257, 50256}, {50304, 50256}, {256, 255}}) {
    nn::GPTConfig c = Unwrap(GptPreset("tiny"));
    c.vocab_size = vocab;
    const nlohmann::json j = nlohmann::json::parse(HfJsonFromGptConfig(c));
    EXPECT_EQ(j.at("eos_token_id").get<int64_t>(), eos) << vocab;
    EXPECT_EQ(j.at("bos_token_id").get<int64_t>(), eos) << vocab;
    EXPECT_EQ(j.at("vocab_size").get<int64_t>(), vocab);
  }
  EXPECT_TRUE(GptPreset("tiny").ok());
  absl::StatusOr<nn::GPTConfig> bad = GptPreset("gpt3");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  for (const std::string part : {"'gpt3'", "gpt2-medium", "gpt2-large", "tiny"}) {
    EXPECT_NE(bad.status().message().find(part), std::string::npos) << bad.status();
  }
}

}  // namespace
}  // namespace dtensor::gpt
