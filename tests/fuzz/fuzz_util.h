// Helpers shared by the libFuzzer targets in tests/fuzz/ (one target per .cc, each defining
// LLVMFuzzerTestOneInput). A target checks its invariants with FUZZ_CHECK, which prints the
// condition and aborts, so libFuzzer (or the replay driver, replay_main.cc) reports the input.
//
//   extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
//     const std::string path = fuzz::WriteTempFile("model.safetensors", data, size);
//     absl::StatusOr<NamedTensors> r = ReadSafetensors(path);
//     FUZZ_CHECK(r.ok() || r.status().code() == absl::StatusCode::kInvalidArgument);
//     return 0;
//   }
#ifndef DTENSOR_TESTS_FUZZ_FUZZ_UTIL_H_
#define DTENSOR_TESTS_FUZZ_FUZZ_UTIL_H_

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/status/status.h"

#define FUZZ_CHECK(cond)                                                                 \
  do {                                                                                   \
    if (!(cond)) {                                                                       \
      std::fprintf(stderr, "%s:%d: FUZZ_CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      std::abort();                                                                      \
    }                                                                                    \
  } while (0)

namespace dtensor::fuzz {

// A directory of this process's own (created once, removed at exit).
const std::string& TempDir();

// Writes `size` bytes to TempDir()/`name` (replacing it) and returns its path.
std::string WriteTempFile(const std::string& name, const uint8_t* data, size_t size);

// True when `s` is an error with a message and a code other than OK, Unknown and Internal: a
// deliberate refusal rather than something leaking from a lower layer.
bool IsCleanError(const absl::Status& s);

}  // namespace dtensor::fuzz

#endif  // DTENSOR_TESTS_FUZZ_FUZZ_UTIL_H_
