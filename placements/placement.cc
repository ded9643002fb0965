#include "dtensor/placements/placement.h"

#include "absl/strings/str_cat.h"

namespace dtensor {

const char* PartialOpName(PartialOp op) {
  switch (op) {
    case PartialOp::kSum:
      return "sum";
    case PartialOp::kAvg:
      return "avg";
    case PartialOp::kMax:
      return "max";
    case PartialOp::kMin:
      return "min";
  }
  return "?";
}

std::string Placement::ToString() const {
  if (is_shard()) return absl::StrCat("S(", shard_dim(), ")");
  if (is_partial()) return absl::StrCat("P(", PartialOpName(partial_op()), ")");
  return "R";
}

std::string PlacementsString(absl::Span<const Placement> placements) {
  std::string s;
  for (const Placement& p : placements) absl::StrAppend(&s, p.ToString());
  return s;
}

}  // namespace dtensor
