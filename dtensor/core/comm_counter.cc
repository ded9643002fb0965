#include "dtensor/core/comm_counter.h"

#include "absl/strings/str_cat.h"

namespace dtensor {

const char* CommKindName(CommKind kind) {
  switch (kind) {
    case CommKind::kAllGather:
      return "all_gather";
    case CommKind::kAllReduce:
      return "all_reduce";
    case CommKind::kReduceScatter:
      return "reduce_scatter";
    case CommKind::kAllToAll:
      return "all_to_all";
    case CommKind::kBroadcast:
      return "broadcast";
  }
  return "?";
}

int64_t CommCounter::total_calls() const {
  int64_t n = 0;
  for (int64_t c : calls_) n += c;
  return n;
}

int64_t CommCounter::total_bytes() const {
  int64_t n = 0;
  for (int64_t b : bytes_) n += b;
  return n;
}

std::string CommCounter::ToString() const {
  std::string s;
  for (int k = 0; k < kNumCommKinds; ++k) {
    if (calls_[static_cast<size_t>(k)] == 0) continue;
    absl::StrAppend(&s, s.empty() ? "" : "\n", CommKindName(static_cast<CommKind>(k)), ": ",
                    calls_[static_cast<size_t>(k)], calls_[static_cast<size_t>(k)] == 1 ? " call, " : " calls, ",
                    bytes_[static_cast<size_t>(k)], " bytes");
  }
  return s.empty() ? "no collectives" : s;
}

}  // namespace dtensor
