// Fuzz target: the llm.c token-file reader and the text reader (examples/gpt/data.h) on
// arbitrary file contents. A token file that reads holds (size - header) / 2 tokens and writes
// back to the same bytes; the text reader returns one token per byte.
#include <cstdint>
#include <fstream>
#include <iterator>
#include <string>

#include "examples/gpt/data.h"
#include "tests/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace dtensor;
  const std::string path = fuzz::WriteTempFile("tokens.bin", data, size);
  absl::StatusOr<std::vector<uint16_t>> tokens = gpt::LoadLlmcTokens(path);
  if (!tokens.ok()) {
    FUZZ_CHECK(fuzz::IsCleanError(tokens.status()));
  } else {
    const size_t header = static_cast<size_t>(gpt::kLlmcHeaderInts) * 4;
    FUZZ_CHECK(!tokens->empty() && header + 2 * tokens->size() == size);
    const std::string copy = fuzz::TempDir() + "/tokens-copy.bin";
    FUZZ_CHECK(gpt::WriteLlmcTokens(copy, *tokens).ok());
    std::ifstream in(copy, std::ios::binary);
    const std::string back((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    // The header's first three words (magic, version, count) and the tokens come back; the
    // writer zeroes the unused words.
    const std::string in_bytes(reinterpret_cast<const char*>(data), size);
    FUZZ_CHECK(back.size() == size);
    FUZZ_CHECK(back.compare(0, 12, in_bytes, 0, 12) == 0);
    FUZZ_CHECK(back.compare(header, std::string::npos, in_bytes, header, std::string::npos) == 0);
  }
  absl::StatusOr<std::vector<uint16_t>> text = gpt::LoadTextTokens(path);
  FUZZ_CHECK(text.ok() == (size > 0));
  if (text.ok()) {
    FUZZ_CHECK(text->size() == size);
    for (size_t i = 0; i < size; ++i) FUZZ_CHECK((*text)[i] == data[i]);
  } else {
    FUZZ_CHECK(fuzz::IsCleanError(text.status()));
  }
  return 0;
}
