// Fuzz target: GPT-2's BPE tokenizer (examples/gpt/tokenizer.h). Encoding takes any bytes and
// Decode(Encode(x)) == x; decoding the input read as int32 ids succeeds exactly when every id is
// in [0, vocab_size()), and then equals the ids' bytes decoded one by one.
// The vocabulary is GPT-2's (Gpt2Tokenizer::DefaultDir(), installed by scripts/setup.sh) when
// it is there, else a small one written here: the 256 byte tokens, a few merges, <|endoftext|>.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "examples/gpt/tokenizer.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

using dtensor::gpt::Gpt2Tokenizer;

// GPT-2's byte-to-unicode map: byte b -> the UTF-8 of its code point in encoder.json.
std::string ByteSymbol(int b) {
  const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
  int cp = b;
  if (!printable) {
    int n = 0;
    for (int x = 0; x < b; ++x) {
      if (!((x >= '!' && x <= '~') || (x >= 0xA1 && x <= 0xAC) || (x >= 0xAE && x <= 0xFF))) ++n;
    }
    cp = 256 + n;
  }
  std::string s;
  if (cp < 0x80) {
    s.push_back(static_cast<char>(cp));
  } else {
    s.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    s.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
  return s;
}

std::string SmallVocabDir() {
  const std::string dir = dtensor::fuzz::TempDir() + "/bpe";
  std::filesystem::create_directories(dir);
  std::vector<std::string> tokens;
  for (int b = 0; b < 256; ++b) tokens.push_back(ByteSymbol(b));
  const std::string space = ByteSymbol(' ');
  const std::vector<std::pair<std::string, std::string>> merges = {
      {"t", "h"}, {"th", "e"}, {space, "t"}, {space + "t", "he"}, {"i", "n"}, {space, "a"}, {"e", "r"}, {"o", "n"}};
  for (const auto& [l, r] : merges) tokens.push_back(l + r);
  tokens.push_back("he");
  std::string json = "{";
  for (size_t i = 0; i < tokens.size(); ++i) {
    std::string escaped;
    for (char ch : tokens[i]) {
      if (ch == '"' || ch == '\\') escaped.push_back('\\');
      escaped.push_back(ch);
    }
    json += "\"" + escaped + "\": " + std::to_string(i) + ", ";
  }
  json += "\"<|endoftext|>\": " + std::to_string(tokens.size()) + "}";
  std::string bpe = "#version: 0.2\n";
  for (const auto& [l, r] : merges) bpe += l + " " + r + "\n";
  bpe += "h e\n";
  dtensor::fuzz::WriteTempFile("bpe/encoder.json", reinterpret_cast<const uint8_t*>(json.data()), json.size());
  dtensor::fuzz::WriteTempFile("bpe/vocab.bpe", reinterpret_cast<const uint8_t*>(bpe.data()), bpe.size());
  return dir;
}

Gpt2Tokenizer& Tokenizer() {
  static Gpt2Tokenizer* tok = [] {
    absl::StatusOr<Gpt2Tokenizer> t = Gpt2Tokenizer::Load(Gpt2Tokenizer::DefaultDir());
    if (!t.ok()) {
      std::fprintf(stderr, "tokenizer_fuzz: %s; using a small vocabulary\n", t.status().ToString().c_str());
      t = Gpt2Tokenizer::Load(SmallVocabDir());
    }
    FUZZ_CHECK(t.ok());
    return new Gpt2Tokenizer(*std::move(t));
  }();
  return *tok;
}

}  // namespace

// Loads the vocabulary before the first input (GPT-2's takes seconds under the sanitizers, which
// would count against libFuzzer's per-input -timeout).
extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  Tokenizer();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Gpt2Tokenizer& tok = Tokenizer();
  const std::string text(reinterpret_cast<const char*>(data), size);
  const std::vector<int32_t> ids = tok.Encode(text);
  for (int32_t id : ids) FUZZ_CHECK(id >= 0 && id < tok.vocab_size());
  FUZZ_CHECK(ids.size() <= size);
  absl::StatusOr<std::string> back = tok.Decode(ids);
  FUZZ_CHECK(back.ok() && *back == text);

  std::vector<int32_t> raw(size / 4);
  if (!raw.empty()) std::memcpy(raw.data(), data, raw.size() * 4);
  bool in_range = true;
  std::string expect;
  for (int32_t id : raw) {
    if (id < 0 || id >= tok.vocab_size()) {
      in_range = false;
      break;
    }
    absl::StatusOr<std::string> one = tok.Decode({id});
    FUZZ_CHECK(one.ok() && !one->empty());
    expect += *one;
  }
  absl::StatusOr<std::string> decoded = tok.Decode(raw);
  FUZZ_CHECK(decoded.ok() == in_range);
  if (decoded.ok()) {
    FUZZ_CHECK(*decoded == expect);
  } else {
    FUZZ_CHECK(decoded.status().code() == absl::StatusCode::kInvalidArgument);
  }
  return 0;
}
