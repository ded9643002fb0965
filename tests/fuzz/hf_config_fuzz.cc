// Fuzz target: Hugging Face GPT-2 config.json text (examples/gpt/hf_gpt2.h,
// GptConfigFromHfJson). A parse returns a config or InvalidArgument; a config's JSON form
// (HfJsonFromGptConfig) parses back to the same config.
#include <cstdint>
#include <string>

#include "examples/gpt/hf_gpt2.h"
#include "tests/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace dtensor;
  const std::string text(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<nn::GPTConfig> c = gpt::GptConfigFromHfJson(text, "fuzz/config.json");
  if (!c.ok()) {
    FUZZ_CHECK(c.status().code() == absl::StatusCode::kInvalidArgument);
    return 0;
  }
  FUZZ_CHECK(c->vocab_size > 0 && c->block_size > 0 && c->n_layer > 0 && c->n_head > 0 && c->n_embd > 0);
  FUZZ_CHECK(c->n_embd % c->n_head == 0);
  absl::StatusOr<nn::GPTConfig> again = gpt::GptConfigFromHfJson(gpt::HfJsonFromGptConfig(*c), "printed");
  FUZZ_CHECK(again.ok());
  FUZZ_CHECK(again->vocab_size == c->vocab_size && again->block_size == c->block_size && again->n_layer == c->n_layer &&
             again->n_head == c->n_head && again->n_embd == c->n_embd);
  return 0;
}
