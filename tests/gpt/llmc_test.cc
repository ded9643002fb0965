#include "examples/gpt/llmc.h"

#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "dtensor/ops/ops.h"
#include "gtest/gtest.h"
#include "tests/testing/test_util.h"

namespace dtensor::gpt {
namespace {

namespace fs = std::filesystem;
using testing::WriteBytes;

std::string ReadBytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

LlmcConfig TinyConfig() {
  LlmcConfig c;
  c.max_seq_len = 8;
  c.vocab_size = 10;
  c.padded_vocab_size = 16;
  c.num_layers = 2;
  c.num_heads = 2;
  c.channels = 4;
  return c;
}

// A checkpoint file written by hand, straight from llm.c's train_gpt2.py write_tensors(): the
// tensors of every layer for one kind, kind after kind. Values are small multiples of 1/64
// (exact in bf16) that differ from tensor to tensor. `expected` gets each named tensor's values
// (wte without its padding rows).
struct HandFile {
  std::string bytes;
  std::map<std::string, std::vector<float>> expected;
};

HandFile MakeHandFile(const LlmcConfig& c, int32_t version, float pad_value) {
  const int64_t C = c.channels, L = c.num_layers;
  HandFile f;
  std::vector<int32_t> header(256, 0);
  header[0] = 20240326;
  header[1] = version;
  header[2] = c.max_seq_len;
  header[3] = c.vocab_size;
  header[4] = c.num_layers;
  header[5] = c.num_heads;
  header[6] = c.channels;
  header[7] = c.padded_vocab_size;
  f.bytes.assign(reinterpret_cast<const char*>(header.data()), 1024);
  int64_t g = 0;  // global element counter
  auto put = [&](float v) {
    if (version == 5) {
      uint32_t u;
      std::memcpy(&u, &v, 4);
      const uint16_t h = static_cast<uint16_t>(u >> 16);  // exact: the values have <= 8 significant bits
      f.bytes.append(reinterpret_cast<const char*>(&h), 2);
    } else {
      f.bytes.append(reinterpret_cast<const char*>(&v), 4);
    }
  };
  auto tensor = [&](const std::string& name, int64_t numel) {
    std::vector<float>& vals = f.expected[name];
    for (int64_t i = 0; i < numel; ++i, ++g) {
      const float v = static_cast<float>(g % 251 - 125) / 64.0f;
      vals.push_back(v);
      put(v);
    }
  };
  tensor("transformer.wte.weight", static_cast<int64_t>(c.vocab_size) * C);
  for (int64_t i = 0; i < (c.padded_vocab_size - c.vocab_size) * C; ++i) put(pad_value);
  tensor("transformer.wpe.weight", static_cast<int64_t>(c.max_seq_len) * C);
  const std::vector<std::pair<std::string, int64_t>> kinds = {{"ln_1.weight", C},
                                                              {"ln_1.bias", C},
                                                              {"attn.c_attn.weight", 3 * C * C},
                                                              {"attn.c_attn.bias", 3 * C},
                                                              {"attn.c_proj.weight", C * C},
                                                              {"attn.c_proj.bias", C},
                                                              {"ln_2.weight", C},
                                                              {"ln_2.bias", C},
                                                              {"mlp.c_fc.weight", 4 * C * C},
                                                              {"mlp.c_fc.bias", 4 * C},
                                                              {"mlp.c_proj.weight", 4 * C * C},
                                                              {"mlp.c_proj.bias", C}};
  for (const auto& [kind, numel] : kinds) {
    for (int64_t l = 0; l < L; ++l) tensor("transformer.h." + std::to_string(l) + "." + kind, numel);
  }
  tensor("transformer.ln_f.weight", C);
  tensor("transformer.ln_f.bias", C);
  return f;
}

void ExpectMatchesHandFile(const LlmcCheckpoint& ckpt, const HandFile& f, const LlmcConfig& c) {
  const int64_t C = c.channels;
  ASSERT_EQ(ckpt.params.size(), f.expected.size());
  ASSERT_EQ(ckpt.params.size(), static_cast<size_t>(2 + 12 * c.num_layers + 2));
  // nanoGPT's named_parameters order.
  EXPECT_EQ(ckpt.params[0].first, "transformer.wte.weight");
  EXPECT_EQ(ckpt.params[1].first, "transformer.wpe.weight");
  EXPECT_EQ(ckpt.params[2].first, "transformer.h.0.ln_1.weight");
  EXPECT_EQ(ckpt.params[4].first, "transformer.h.0.attn.c_attn.weight");
  EXPECT_EQ(ckpt.params[14].first, "transformer.h.1.ln_1.weight");
  EXPECT_EQ(ckpt.params.back().first, "transformer.ln_f.bias");
  const std::map<std::string, Shape> shapes = {{"transformer.wte.weight", {c.vocab_size, C}},
                                               {"transformer.wpe.weight", {c.max_seq_len, C}},
                                               {"transformer.h.1.attn.c_attn.weight", {3 * C, C}},
                                               {"transformer.h.1.attn.c_attn.bias", {3 * C}},
                                               {"transformer.h.0.attn.c_proj.weight", {C, C}},
                                               {"transformer.h.0.mlp.c_fc.weight", {4 * C, C}},
                                               {"transformer.h.0.mlp.c_fc.bias", {4 * C}},
                                               {"transformer.h.1.mlp.c_proj.weight", {C, 4 * C}},
                                               {"transformer.h.1.ln_2.bias", {C}},
                                               {"transformer.ln_f.weight", {C}}};
  for (const auto& [name, shape] : shapes) {
    const Tensor* t = ckpt.Find(name);
    ASSERT_NE(t, nullptr) << name;
    EXPECT_EQ(Shape(t->shape().begin(), t->shape().end()), shape) << name;
  }
  for (const auto& [name, t] : ckpt.params) {
    auto it = f.expected.find(name);
    ASSERT_NE(it, f.expected.end()) << name;
    EXPECT_EQ(t.dtype(), DType::kFloat32);
    const std::vector<double> got = testing::Values(t);
    ASSERT_EQ(got.size(), it->second.size()) << name;
    for (size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], it->second[i]) << name << "[" << i << "]";
  }
}

TEST(LlmcCheckpointTest, ReadsHandWrittenFp32AndWritesIdenticalBytes) {
  testing::ScopedTempDir dir("gpt_llmc");
  const LlmcConfig c = TinyConfig();
  const HandFile f = MakeHandFile(c, 3, 0.0f);
  WriteBytes(dir.Path("v3.bin"), f.bytes);
  auto ckpt = ReadLlmcCheckpoint(dir.Path("v3.bin"));
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_EQ(ckpt->config.version, 3);
  EXPECT_EQ(ckpt->config.max_seq_len, 8);
  EXPECT_EQ(ckpt->config.vocab_size, 10);
  EXPECT_EQ(ckpt->config.padded_vocab_size, 16);
  EXPECT_EQ(ckpt->config.num_layers, 2);
  EXPECT_EQ(ckpt->config.num_heads, 2);
  EXPECT_EQ(ckpt->config.channels, 4);
  ExpectMatchesHandFile(*ckpt, f, c);

  // Writing back gives the same bytes (wte padded with zero rows, as the hand file was).
  ASSERT_TRUE(WriteLlmcCheckpoint(dir.Path("out.bin"), ckpt->config, ckpt->params).ok());
  EXPECT_EQ(ReadBytes(dir.Path("out.bin")), f.bytes);
}

TEST(LlmcCheckpointTest, WriteReadRoundTripOfArbitraryTensors) {
  testing::ScopedTempDir dir("gpt_llmc");
  LlmcConfig c = TinyConfig();
  c.padded_vocab_size = 0;  // -> rounded up to 128, as llm.c pads
  std::vector<std::pair<std::string, Tensor>> params;
  uint64_t seed = 1;
  for (const auto& [name, shape] : LlmcParamShapes(c)) {
    // Mix dtypes and layouts: the writer converts to contiguous float32.
    Tensor t = testing::Random(shape, seed % 3 == 0 ? DType::kBFloat16 : DType::kFloat32, seed);
    if (shape.size() == 2 && seed % 2 == 0) t = testing::NonContiguous(t);
    params.emplace_back(name, t);
    ++seed;
  }
  // Reversed order on input: the writer places tensors by name.
  std::vector<std::pair<std::string, Tensor>> reversed(params.rbegin(), params.rend());
  ASSERT_TRUE(WriteLlmcCheckpoint(dir.Path("rt.bin"), c, reversed).ok());
  const int64_t C = 4, L = 2;
  EXPECT_EQ(static_cast<int64_t>(fs::file_size(dir.Path("rt.bin"))),
            1024 + 4 * (128 * C + 8 * C + L * (12 * C * C + 13 * C) + 2 * C));
  auto ckpt = ReadLlmcCheckpoint(dir.Path("rt.bin"));
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_EQ(ckpt->config.padded_vocab_size, 128);
  EXPECT_EQ(ckpt->config.vocab_size, 10);
  ASSERT_EQ(ckpt->params.size(), params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_EQ(ckpt->params[i].first, params[i].first);
    EXPECT_EQ(testing::Values(ckpt->params[i].second), testing::Values(params[i].second)) << params[i].first;
  }
  // The padding rows are zeros, right after the 10 rows of wte.
  const std::string bytes = ReadBytes(dir.Path("rt.bin"));
  for (int64_t i = 10 * C; i < 128 * C; ++i) {
    float v;
    std::memcpy(&v, bytes.data() + 1024 + 4 * i, 4);
    ASSERT_EQ(v, 0.0f) << i;
  }
}

TEST(LlmcCheckpointTest, ReadsBf16Version5) {
  testing::ScopedTempDir dir("gpt_llmc");
  const LlmcConfig c = TinyConfig();
  const HandFile f = MakeHandFile(c, 5, /*pad_value=*/3.0f);  // padding rows are dropped, whatever they hold
  EXPECT_EQ(f.bytes.size(), 1024u + 2u * (16 * 4 + 8 * 4 + 2 * (12 * 16 + 13 * 4) + 2 * 4));
  WriteBytes(dir.Path("v5.bin"), f.bytes);
  auto ckpt = ReadLlmcCheckpoint(dir.Path("v5.bin"));
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_EQ(ckpt->config.version, 5);
  ExpectMatchesHandFile(*ckpt, f, c);
  // Re-exported as float32 version 3: the same values as the fp32 hand file.
  ASSERT_TRUE(WriteLlmcCheckpoint(dir.Path("v3.bin"), ckpt->config, ckpt->params).ok());
  EXPECT_EQ(ReadBytes(dir.Path("v3.bin")), MakeHandFile(c, 3, 0.0f).bytes);
}

void ExpectReadError(const std::string& path, absl::StatusCode code, const std::vector<std::string>& needles) {
  auto r = ReadLlmcCheckpoint(path);
  ASSERT_FALSE(r.ok()) << path;
  EXPECT_EQ(r.status().code(), code) << r.status();
  for (const std::string& n : needles) {
    EXPECT_NE(r.status().message().find(n), std::string::npos) << "'" << n << "' not in: " << r.status();
  }
}

std::string WithHeaderWord(std::string bytes, int index, int32_t value) {
  std::memcpy(bytes.data() + 4 * index, &value, 4);
  return bytes;
}

TEST(LlmcCheckpointTest, ReadErrors) {
  testing::ScopedTempDir dir("gpt_llmc");
  const LlmcConfig c = TinyConfig();
  const std::string good = MakeHandFile(c, 3, 0.0f).bytes;
  ExpectReadError(dir.Path("missing.bin"), absl::StatusCode::kNotFound, {"missing.bin"});

  WriteBytes(dir.Path("magic.bin"), WithHeaderWord(good, 0, 20240520));
  ExpectReadError(dir.Path("magic.bin"), absl::StatusCode::kInvalidArgument, {"magic.bin", "20240520", "token file"});

  for (int32_t version : {1, 2, 4, 6}) {
    WriteBytes(dir.Path("version.bin"), WithHeaderWord(good, 1, version));
    ExpectReadError(dir.Path("version.bin"), absl::StatusCode::kUnimplemented,
                    {"version.bin", "version " + std::to_string(version)});
  }

  WriteBytes(dir.Path("truncated.bin"), good.substr(0, good.size() - 4));
  ExpectReadError(dir.Path("truncated.bin"), absl::StatusCode::kInvalidArgument,
                  {"truncated.bin", std::to_string(good.size() - 4), std::to_string(good.size()), "truncated"});

  WriteBytes(dir.Path("trailing.bin"), good + "xx");
  ExpectReadError(dir.Path("trailing.bin"), absl::StatusCode::kInvalidArgument, {"trailing.bin", "trailing"});

  // A bf16 header on an fp32-sized file.
  WriteBytes(dir.Path("v5size.bin"), WithHeaderWord(good, 1, 5));
  ExpectReadError(dir.Path("v5size.bin"), absl::StatusCode::kInvalidArgument, {"v5size.bin", "version 5"});

  WriteBytes(dir.Path("short.bin"), good.substr(0, 100));
  ExpectReadError(dir.Path("short.bin"), absl::StatusCode::kInvalidArgument, {"short.bin", "100 bytes"});

  WriteBytes(dir.Path("padded.bin"), WithHeaderWord(good, 7, 9));
  ExpectReadError(dir.Path("padded.bin"), absl::StatusCode::kInvalidArgument, {"padded_vocab_size 9", "vocab_size 10"});

  WriteBytes(dir.Path("heads.bin"), WithHeaderWord(good, 5, 3));
  ExpectReadError(dir.Path("heads.bin"), absl::StatusCode::kInvalidArgument, {"channels 4", "num_heads 3"});

  WriteBytes(dir.Path("negative.bin"), WithHeaderWord(good, 4, -2));
  ExpectReadError(dir.Path("negative.bin"), absl::StatusCode::kInvalidArgument, {"num_layers=-2"});

  // Huge header values must not overflow into a plausible size or allocate.
  WriteBytes(dir.Path("huge.bin"), WithHeaderWord(WithHeaderWord(good, 6, 2'000'000'000), 4, 2'000'000'000));
  ExpectReadError(dir.Path("huge.bin"), absl::StatusCode::kInvalidArgument, {"huge.bin", "impossible"});
}

TEST(LlmcCheckpointTest, WriteErrors) {
  testing::ScopedTempDir dir("gpt_llmc");
  const LlmcConfig c = TinyConfig();
  std::vector<std::pair<std::string, Tensor>> params;
  for (const auto& [name, shape] : LlmcParamShapes(c))
    params.emplace_back(name, testing::Random(shape, DType::kFloat32, 3));

  auto missing = params;
  missing.erase(missing.begin() + 5);
  absl::Status s = WriteLlmcCheckpoint(dir.Path("a.bin"), c, missing);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find(params[5].first), std::string::npos) << s;

  auto wrong_shape = params;
  wrong_shape[4].second = testing::Random({4, 12}, DType::kFloat32, 1);
  s = WriteLlmcCheckpoint(dir.Path("a.bin"), c, wrong_shape);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("[4, 12]"), std::string::npos) << s;

  auto extra = params;
  extra.emplace_back("lm_head.weight", params[0].second);
  s = WriteLlmcCheckpoint(dir.Path("a.bin"), c, extra);
  EXPECT_NE(s.message().find("lm_head.weight"), std::string::npos) << s;

  auto twice = params;
  twice.push_back(params[3]);
  EXPECT_FALSE(WriteLlmcCheckpoint(dir.Path("a.bin"), c, twice).ok());

  LlmcConfig bad = c;
  bad.padded_vocab_size = 5;
  EXPECT_FALSE(WriteLlmcCheckpoint(dir.Path("a.bin"), bad, params).ok());
  EXPECT_FALSE(fs::exists(dir.Path("a.bin")));

  // wte already padded to [Vp, C] is written as given.
  auto padded = params;
  padded[0].second = testing::Random({16, 4}, DType::kFloat32, 9);
  ASSERT_TRUE(WriteLlmcCheckpoint(dir.Path("p.bin"), c, padded).ok());
  auto back = ReadLlmcCheckpoint(dir.Path("p.bin"));
  ASSERT_TRUE(back.ok()) << back.status();
  const std::vector<double> full = testing::Values(padded[0].second);
  EXPECT_EQ(testing::Values(back->params[0].second), std::vector<double>(full.begin(), full.begin() + 40));
}

}  // namespace
}  // namespace dtensor::gpt
