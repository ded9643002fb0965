// Fuzz target: the llm.c checkpoint reader (examples/gpt/llmc.h) on arbitrary file contents.
// A file that reads has exactly LlmcParamShapes(config) as its parameters, float32, and its
// size is the header plus every parameter (so a reader that believed a header's sizes without
// checking them against the file would be caught here or by the sanitizers).
#include <cstdint>
#include <string>

#include "examples/gpt/llmc.h"
#include "tests/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace dtensor;
  const std::string path = fuzz::WriteTempFile("model.bin", data, size);
  absl::StatusOr<gpt::LlmcCheckpoint> ckpt = gpt::ReadLlmcCheckpoint(path);
  if (!ckpt.ok()) {
    FUZZ_CHECK(fuzz::IsCleanError(ckpt.status()));
    return 0;
  }
  const std::vector<std::pair<std::string, Shape>> want = gpt::LlmcParamShapes(ckpt->config);
  FUZZ_CHECK(want.size() == ckpt->params.size());
  uint64_t elements = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    FUZZ_CHECK(ckpt->params[i].first == want[i].first);
    FUZZ_CHECK(ckpt->params[i].second.shape() == IntSpan(want[i].second));
    FUZZ_CHECK(ckpt->params[i].second.dtype() == DType::kFloat32);
    elements += static_cast<uint64_t>(ckpt->params[i].second.numel());
  }
  const uint64_t element_bytes = ckpt->config.version == gpt::kLlmcVersionFp32 ? 4 : 2;
  FUZZ_CHECK(256 * 4 + elements * element_bytes <= size);
  return 0;
}
