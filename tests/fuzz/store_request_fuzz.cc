// Fuzz target: the rendezvous store server's request parser (collectives/store/tcp_store.h,
// ParseStoreRequest) on an arbitrary byte stream, as a connection would deliver it: requests
// are consumed one after the other until the parser wants more bytes or refuses. Each step
// consumes at least one request header and never more than what is there; every prefix of a
// whole request asks for more bytes, and a refusal is a clean error.
#include <cstdint>
#include <string_view>

#include "dtensor/collectives/store/tcp_store.h"
#include "tests/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view in(reinterpret_cast<const char*>(data), size);
  while (!in.empty()) {
    absl::StatusOr<size_t> n = dtensor::ParseStoreRequest(in);
    if (!n.ok()) {
      FUZZ_CHECK(n.status().code() == absl::StatusCode::kInvalidArgument && !n.status().message().empty());
      break;
    }
    if (*n == 0) break;
    FUZZ_CHECK(*n >= 9 && *n <= in.size());
    // A request cut short anywhere is incomplete, not wrong (checked at a few cuts).
    for (size_t cut : {*n - 1, *n / 2, size_t{5}}) {
      if (cut >= *n) continue;
      absl::StatusOr<size_t> part = dtensor::ParseStoreRequest(in.substr(0, cut));
      FUZZ_CHECK(part.ok() && *part == 0);
    }
    in.remove_prefix(*n);
  }
  return 0;
}
