// Placement: how a DTensor is laid out along one mesh dim — Shard(dim), Replicate() or
// Partial(op). Placements are values: compare, hash and print them.
//
//   std::vector<Placement> ps = {Shard(0), Replicate()};     // 2-d mesh: rows over mesh dim 0
//   ps[0].is_shard();          // true
//   ps[0].shard_dim();         // 0
//   PlacementsString(ps);      // "S(0)R"
//   Placement p = Partial(PartialOp::kAvg);                   // prints "P(avg)"
//
// Shard(d): the tensor dim d is split over the mesh dim as torch.chunk splits it (see
// layout.h); d may be negative (counted from the end, normalised against the tensor's ndim
// by NormalizeLayout). Replicate(): every rank of the mesh dim holds the same values.
// Partial(op): every rank holds a partial value; the tensor is the reduction (op) of them.
#ifndef DTENSOR_PLACEMENTS_PLACEMENT_H_
#define DTENSOR_PLACEMENTS_PLACEMENT_H_

#include <cstdint>
#include <string>
#include <utility>
#include <variant>

#include "absl/types/span.h"

namespace dtensor {

// Reduction that turns Partial values into the tensor. kAvg: the mean over the mesh dim.
enum class PartialOp : uint8_t { kSum, kAvg, kMax, kMin };

// "sum", "avg", "max", "min".
const char* PartialOpName(PartialOp op);

struct Shard {
  explicit Shard(int64_t d) : dim(d) {}
  int64_t dim;
  friend bool operator==(const Shard& a, const Shard& b) { return a.dim == b.dim; }
};

struct Replicate {
  friend bool operator==(const Replicate&, const Replicate&) { return true; }
};

struct Partial {
  Partial() = default;
  explicit Partial(PartialOp o) : op(o) {}
  PartialOp op = PartialOp::kSum;
  friend bool operator==(const Partial& a, const Partial& b) { return a.op == b.op; }
};

class Placement {
 public:
  Placement() : v_(Replicate{}) {}
  Placement(Shard s) : v_(s) {}      // NOLINT: implicit, so {Shard(0), Replicate()} reads well
  Placement(Replicate r) : v_(r) {}  // NOLINT
  Placement(Partial p) : v_(p) {}    // NOLINT

  bool is_shard() const { return std::holds_alternative<Shard>(v_); }
  bool is_replicate() const { return std::holds_alternative<Replicate>(v_); }
  bool is_partial() const { return std::holds_alternative<Partial>(v_); }
  // Precondition: is_shard().
  int64_t shard_dim() const { return std::get<Shard>(v_).dim; }
  // Precondition: is_partial().
  PartialOp partial_op() const { return std::get<Partial>(v_).op; }

  // "S(0)", "R", "P(sum)".
  std::string ToString() const;

  friend bool operator==(const Placement& a, const Placement& b) { return a.v_ == b.v_; }
  friend bool operator!=(const Placement& a, const Placement& b) { return !(a == b); }
  template <typename H>
  friend H AbslHashValue(H h, const Placement& p) {
    const int kind = static_cast<int>(p.v_.index());
    const int64_t arg = p.is_shard() ? p.shard_dim() : p.is_partial() ? static_cast<int64_t>(p.partial_op()) : 0;
    return H::combine(std::move(h), kind, arg);
  }

 private:
  std::variant<Shard, Replicate, Partial> v_;
};

// Concatenated short forms: "S(0)R", "P(sum)S(1)".
std::string PlacementsString(absl::Span<const Placement> placements);

}  // namespace dtensor

#endif  // DTENSOR_PLACEMENTS_PLACEMENT_H_
