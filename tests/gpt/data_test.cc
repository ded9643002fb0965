#include "examples/gpt/data.h"

#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

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

// An llm.c token file written by hand: 256 int32 header words, then uint16 tokens.
std::string LlmcTokenBytes(int32_t magic, int32_t version, int32_t count, const std::vector<uint16_t>& tokens) {
  std::vector<int32_t> header(256, 0);
  header[0] = magic;
  header[1] = version;
  header[2] = count;
  std::string bytes(reinterpret_cast<const char*>(header.data()), 1024);
  bytes.append(reinterpret_cast<const char*>(tokens.data()), tokens.size() * 2);
  return bytes;
}

TEST(TextTokensTest, OneTokenPerByte) {
  testing::ScopedTempDir dir("gpt_data");
  WriteBytes(dir.Path("t.txt"), std::string("Hi\xff\n\0z", 6));
  auto tokens = LoadTextTokens(dir.Path("t.txt"));
  ASSERT_TRUE(tokens.ok()) << tokens.status();
  EXPECT_EQ(*tokens, (std::vector<uint16_t>{72, 105, 255, 10, 0, 122}));
}

TEST(TextTokensTest, MissingAndEmptyFiles) {
  testing::ScopedTempDir dir("gpt_data");
  auto missing = LoadTextTokens(dir.Path("nope.txt"));
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("nope.txt"), std::string::npos) << missing.status();
  WriteBytes(dir.Path("empty.txt"), "");
  auto empty = LoadTextTokens(dir.Path("empty.txt"));
  EXPECT_EQ(empty.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(empty.status().message().find("empty"), std::string::npos) << empty.status();
}

TEST(LlmcTokensTest, ReadsValidFile) {
  testing::ScopedTempDir dir("gpt_data");
  const std::vector<uint16_t> tokens = {50256, 0, 1, 65535, 464, 3290};
  WriteBytes(dir.Path("ok.bin"), LlmcTokenBytes(20240520, 1, 6, tokens));
  auto read = LoadLlmcTokens(dir.Path("ok.bin"));
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, tokens);
}

TEST(LlmcTokensTest, WriteMatchesHandWrittenBytes) {
  testing::ScopedTempDir dir("gpt_data");
  const std::vector<uint16_t> tokens = {7, 8, 9, 40000};
  ASSERT_TRUE(WriteLlmcTokens(dir.Path("w.bin"), tokens).ok());
  EXPECT_EQ(ReadBytes(dir.Path("w.bin")), LlmcTokenBytes(20240520, 1, 4, tokens));
  // No temporary files left behind.
  int files = 0;
  for (const auto& e : fs::directory_iterator(dir.path())) files += e.is_regular_file() ? 1 : 0;
  EXPECT_EQ(files, 1);
}

void ExpectError(const std::string& path, absl::StatusCode code, const std::vector<std::string>& needles) {
  auto r = LoadLlmcTokens(path);
  ASSERT_FALSE(r.ok()) << path;
  EXPECT_EQ(r.status().code(), code) << r.status();
  for (const std::string& n : needles) {
    EXPECT_NE(r.status().message().find(n), std::string::npos) << "'" << n << "' not in: " << r.status();
  }
}

TEST(LlmcTokensTest, Errors) {
  testing::ScopedTempDir dir("gpt_data");
  const std::vector<uint16_t> tokens = {1, 2, 3, 4, 5};
  ExpectError(dir.Path("missing.bin"), absl::StatusCode::kNotFound, {"missing.bin"});

  WriteBytes(dir.Path("magic.bin"), LlmcTokenBytes(12345, 1, 5, tokens));
  ExpectError(dir.Path("magic.bin"), absl::StatusCode::kInvalidArgument, {"magic.bin", "12345", "20240520"});

  WriteBytes(dir.Path("version.bin"), LlmcTokenBytes(20240520, 7, 5, tokens));
  ExpectError(dir.Path("version.bin"), absl::StatusCode::kInvalidArgument, {"version.bin", "version 7"});

  std::string truncated = LlmcTokenBytes(20240520, 1, 5, tokens);
  truncated.pop_back();
  WriteBytes(dir.Path("truncated.bin"), truncated);
  ExpectError(dir.Path("truncated.bin"), absl::StatusCode::kInvalidArgument, {"truncated.bin", "5 tokens", "1033"});

  WriteBytes(dir.Path("count.bin"), LlmcTokenBytes(20240520, 1, 9, tokens));
  ExpectError(dir.Path("count.bin"), absl::StatusCode::kInvalidArgument, {"count.bin", "9 tokens", "1042", "1034"});

  WriteBytes(dir.Path("zero.bin"), LlmcTokenBytes(20240520, 1, 0, {}));
  ExpectError(dir.Path("zero.bin"), absl::StatusCode::kInvalidArgument, {"zero.bin", "0 tokens"});

  WriteBytes(dir.Path("short.bin"), std::string(100, '\0'));
  ExpectError(dir.Path("short.bin"), absl::StatusCode::kInvalidArgument, {"short.bin", "100 bytes"});
}

TEST(ValidateTokensTest, NamesTheFirstTokenOutsideTheVocab) {
  const std::vector<uint16_t> tokens = {1, 255, 256, 300};
  EXPECT_TRUE(ValidateTokens(tokens, 1000, "x").ok());
  absl::Status s = ValidateTokens(tokens, 256, "data.bin");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("token 256 at position 2"), std::string::npos) << s;
  EXPECT_NE(s.message().find("data.bin"), std::string::npos) << s;
}

// Checks the loader against a naive recomputation of llm.c's sequential loader: batch k of an
// epoch starts at token k*B*T, and there are floor((N-1)/(B*T)) batches per epoch.
void CheckLoaderSequence(int64_t n, int64_t B, int64_t T, int steps) {
  SCOPED_TRACE(::testing::Message() << "N=" << n << " B=" << B << " T=" << T);
  std::mt19937 rng(static_cast<uint32_t>(n * 131 + B * 7 + T));
  std::vector<uint16_t> tokens(static_cast<size_t>(n));
  for (auto& t : tokens) t = static_cast<uint16_t>(rng() % 65536);
  auto loader = TokenLoader::Create(tokens, B, T);
  ASSERT_TRUE(loader.ok()) << loader.status();
  const int64_t per_epoch = (n - 1) / (B * T);
  EXPECT_EQ(loader->batches_per_epoch(), per_epoch);
  for (int step = 0; step < steps; ++step) {
    const int64_t start = (step % per_epoch) * B * T;
    ASSERT_EQ(loader->position(), start) << "step " << step;
    Batch batch = loader->Next();
    ASSERT_EQ(batch.inputs.size(), static_cast<size_t>(B * T));
    ASSERT_EQ(batch.targets.size(), static_cast<size_t>(B * T));
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t t = 0; t < T; ++t) {
        const size_t i = static_cast<size_t>(b * T + t);
        ASSERT_EQ(batch.inputs[i], tokens[static_cast<size_t>(start + b * T + t)]) << "step " << step;
        ASSERT_EQ(batch.targets[i], tokens[static_cast<size_t>(start + b * T + t + 1)]) << "step " << step;
      }
    }
  }
}

TEST(TokenLoaderTest, SequentialWithWrapAround) {
  CheckLoaderSequence(50, 2, 4, 20);  // 6 batches per epoch, 1 token left over
  CheckLoaderSequence(49, 2, 4, 20);  // exactly 6 batches: the last reads the final token
  CheckLoaderSequence(48, 2, 4, 20);  // 5 batches: the 6th would need token 48
  CheckLoaderSequence(9, 1, 8, 5);    // a single batch per epoch
  CheckLoaderSequence(1000, 3, 7, 100);
}

TEST(TokenLoaderTest, ResetAndErrors) {
  std::vector<uint16_t> tokens(30);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<uint16_t>(i);
  auto loader = TokenLoader::Create(tokens, 2, 3);
  ASSERT_TRUE(loader.ok());
  loader->Next();
  loader->Next();
  EXPECT_EQ(loader->position(), 12);
  loader->Reset();
  EXPECT_EQ(loader->position(), 0);
  EXPECT_EQ(loader->Next().inputs[0], 0);
  // A position too close to the end for one batch (a checkpoint saved with a smaller batch)
  // starts the next epoch instead of reading past the tokens: 28 + 6 + 1 > 30.
  ASSERT_TRUE(loader->set_position(28).ok());
  const Batch wrapped = loader->Next();
  EXPECT_EQ(wrapped.inputs[0], 0);
  EXPECT_EQ(wrapped.targets[5], 6);
  EXPECT_EQ(loader->position(), 6);
  ASSERT_TRUE(loader->set_position(23).ok());  // 23 + 6 + 1 = 30 tokens: fits exactly
  EXPECT_EQ(loader->Next().targets[5], 29);

  auto too_few = TokenLoader::Create(std::vector<uint16_t>(12), 3, 4);
  EXPECT_EQ(too_few.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(too_few.status().message().find("13"), std::string::npos) << too_few.status();
  EXPECT_TRUE(TokenLoader::Create(std::vector<uint16_t>(13), 3, 4).ok());
  EXPECT_FALSE(TokenLoader::Create(std::vector<uint16_t>(13), 0, 4).ok());
  EXPECT_FALSE(TokenLoader::Create(std::vector<uint16_t>(13), 3, -1).ok());
  // B*T that would overflow is refused, not wrapped into a small positive count.
  auto huge = TokenLoader::Create(std::vector<uint16_t>(10), 3'000'000'000, 4'000'000'000);
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kInvalidArgument) << huge.status();
  auto wraps = TokenLoader::Create(std::vector<uint16_t>(10), int64_t{1} << 32, int64_t{1} << 32);
  EXPECT_EQ(wraps.status().code(), absl::StatusCode::kInvalidArgument) << wraps.status();
}

TEST(FortunesCorpusTest, BuildsFromFakeFortuneFiles) {
  testing::ScopedTempDir dir("gpt_data");
  const std::string src = dir.Path("fortunes");
  fs::create_directories(src + "/off");
  WriteBytes(src + "/zoo", "Zebra.\n%\n\n  Indented\nline.\n\n%\n%\nLast one.\n");
  WriteBytes(src + "/apple", "An apple a day.\n%\nTwo\n%\n");
  WriteBytes(src + "/apple.dat", std::string("\0\0\0\2binary index", 16));
  fs::create_symlink("apple", src + "/apple.u8");
  fs::create_symlink("zoo", src + "/link");
  WriteBytes(src + "/off/rude", "Offensive.\n%\n");
  WriteBytes(src + "/.hidden", "Hidden.\n");
  WriteBytes(src + "/binary", std::string("Bin\0ary\n", 8));
  const std::string second = dir.Path("more");
  fs::create_directories(second);
  WriteBytes(second + "/aaa", "From the second dir.\n");

  const std::string out = dir.Path("corpus.txt");
  auto r = PrepareFortunesCorpus(out, {src, dir.Path("does-not-exist"), second});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(*r, out);
  EXPECT_EQ(ReadBytes(out),
            "An apple a day.\n"
            "\n"
            "Two\n"
            "\n"
            "Zebra.\n"
            "\n"
            "  Indented\nline.\n"
            "\n"
            "Last one.\n"
            "\n"
            "From the second dir.\n");
}

TEST(FortunesCorpusTest, NoFortuneFilesIsNotFound) {
  testing::ScopedTempDir dir("gpt_data");
  fs::create_directories(dir.Path("empty"));
  WriteBytes(dir.Path("empty/x.dat"), "index");
  auto r = PrepareFortunesCorpus(dir.Path("out.txt"), {dir.Path("empty"), dir.Path("missing")});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(r.status().message().find("missing"), std::string::npos) << r.status();
  EXPECT_FALSE(fs::exists(dir.Path("out.txt")));
}

TEST(FortunesCorpusTest, DebianFortunesPackage) {
  const std::string system_dir = "/usr/share/games/fortunes";
  if (!fs::exists(system_dir + "/fortunes")) GTEST_SKIP() << "Debian's fortunes package is not installed";
  testing::ScopedTempDir dir("gpt_data");
  auto r = PrepareFortunesCorpus(dir.Path("corpus.txt"));
  ASSERT_TRUE(r.ok()) << r.status();
  const std::string text = ReadBytes(*r);
  EXPECT_GT(text.size(), 1'000'000u);
  EXPECT_EQ(text.find('\0'), std::string::npos);
  EXPECT_EQ(text.find("\n%\n"), std::string::npos);
  EXPECT_NE(text.find("Debian"), std::string::npos);
  auto tokens = LoadTextTokens(*r);
  ASSERT_TRUE(tokens.ok());
  EXPECT_TRUE(ValidateTokens(*tokens, 256, *r).ok());
}

}  // namespace
}  // namespace dtensor::gpt
