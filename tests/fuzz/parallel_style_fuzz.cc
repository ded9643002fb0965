// Fuzz target: the text forms of placements, parallel styles and activation-checkpoint modes
// (nn/parallel/parallel_style.h, activation_checkpoint.h) on arbitrary text. Each parse returns
// a value or InvalidArgument; a value prints back to text that parses to the same value.
#include <cstdint>
#include <string>

#include "dtensor/nn/parallel/activation_checkpoint.h"
#include "dtensor/nn/parallel/parallel_style.h"
#include "tests/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace dtensor;
  const std::string text(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<Placement> p = nn::ParsePlacement(text);
  if (p.ok()) {
    absl::StatusOr<Placement> again = nn::ParsePlacement(p->ToString());
    FUZZ_CHECK(again.ok() && *again == *p);
  } else {
    FUZZ_CHECK(p.status().code() == absl::StatusCode::kInvalidArgument);
  }
  absl::StatusOr<nn::ParallelStyle> s = nn::ParseStyle(text);
  if (s.ok()) {
    absl::StatusOr<nn::ParallelStyle> again = nn::ParseStyle(nn::StyleToString(*s));
    FUZZ_CHECK(again.ok() && *again == *s);
  } else {
    FUZZ_CHECK(s.status().code() == absl::StatusCode::kInvalidArgument);
  }
  absl::StatusOr<nn::AcOptions> ac = nn::ParseAcMode(text);
  if (ac.ok()) {
    absl::StatusOr<nn::AcOptions> again = nn::ParseAcMode(ac->ToString());
    FUZZ_CHECK(again.ok() && *again == *ac);
  } else {
    FUZZ_CHECK(ac.status().code() == absl::StatusCode::kInvalidArgument);
  }
  return 0;
}
