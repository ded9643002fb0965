// Fuzz target: the safetensors reader (nn/safetensors.h) on arbitrary file contents, and, when a
// file reads, the Hugging Face GPT-2 reader (examples/gpt/hf_gpt2.h) on it with a tiny
// config.json beside it. Both must return a value or a clean error, never crash; a file that
// reads holds tensors whose bytes add up to at most the file's size.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "dtensor/nn/safetensors.h"
#include "examples/gpt/hf_gpt2.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

// GPT-2 with 1 layer, 1 head, 4 dims, 4 positions and a vocabulary of 8: the shapes the seeds use.
constexpr char kConfig[] =
    R"({"model_type": "gpt2", "vocab_size": 8, "n_positions": 4, "n_embd": 4, "n_layer": 1, "n_head": 1})";

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace dtensor;
  const std::string path = fuzz::WriteTempFile("model.safetensors", data, size);
  absl::StatusOr<NamedTensors> file = ReadSafetensors(path);
  if (std::getenv("FUZZ_VERBOSE") != nullptr)
    std::fprintf(stderr, "ReadSafetensors: %s\n", file.status().ToString().c_str());
  if (!file.ok()) {
    FUZZ_CHECK(fuzz::IsCleanError(file.status()));
    return 0;
  }
  uint64_t bytes = 0;
  for (const auto& [name, t] : file->tensors) {
    FUZZ_CHECK(t.defined() && t.is_contiguous());
    bytes += t.nbytes();
  }
  FUZZ_CHECK(bytes <= size);
  static const std::string config =
      fuzz::WriteTempFile("config.json", reinterpret_cast<const uint8_t*>(kConfig), sizeof(kConfig) - 1);
  absl::StatusOr<gpt::HfGpt2> hf = gpt::ReadHfGpt2(path);
  if (std::getenv("FUZZ_VERBOSE") != nullptr) std::fprintf(stderr, "ReadHfGpt2: %s\n", hf.status().ToString().c_str());
  if (!hf.ok()) {
    FUZZ_CHECK(fuzz::IsCleanError(hf.status()));
  } else {
    FUZZ_CHECK(hf->config.n_layer == 1 && hf->config.n_embd == 4);
    for (const auto& [name, t] : hf->params) FUZZ_CHECK(t.dtype() == DType::kFloat32);
  }
  return 0;
}
