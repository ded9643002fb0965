// Internal helpers shared by the op families in autograd/ops/ (not installed).
#ifndef DTENSOR_AUTOGRAD_OPS_OP_UTIL_H_
#define DTENSOR_AUTOGRAD_OPS_OP_UTIL_H_

#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "dtensor/autograd/dispatch.h"
#include "dtensor/autograd/variable.h"
#include "dtensor/ops/ops.h"
#include "dtensor/tensor/status.h"

namespace dtensor::op_util {

inline absl::StatusOr<std::vector<Tensor>> One(absl::StatusOr<Tensor> t) {
  if (!t.ok()) return t.status();
  return std::vector<Tensor>{*std::move(t)};
}

inline absl::StatusOr<Value> First(absl::StatusOr<std::vector<Value>> r) {
  if (!r.ok()) return r.status();
  return std::move((*r)[0]);
}

inline absl::StatusOr<std::vector<TensorMeta>> SameAs(const TensorMeta& m) { return std::vector<TensorMeta>{m}; }

inline absl::Status Invalid(const char* op, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat("[", op, "] ", what));
}

inline Shape ToShape(IntSpan s) { return Shape(s.begin(), s.end()); }
inline std::vector<int64_t> ToVec(IntSpan s) { return std::vector<int64_t>(s.begin(), s.end()); }

// The local shape of output `i` of a dispatched call (its own shape for plain tensors).
inline Shape LocalOutShape(const LocalCall& c, int i, IntSpan plain_shape) {
  if (c.mesh == nullptr) return ToShape(plain_shape);
  return LocalBoxOf(c.output_meta[static_cast<size_t>(i)].shape, c.mesh->shape(),
                    c.output_layouts[static_cast<size_t>(i)], c.mesh->coordinate())
      .shape;
}

// The mesh dims on which input `i` is sharded on tensor dim `d` (empty without a mesh).
inline std::vector<int> ShardingMeshDims(const LocalCall& c, int i, int64_t d) {
  std::vector<int> dims;
  if (c.mesh == nullptr) return dims;
  const Layout& l = c.input_layouts[static_cast<size_t>(i)];
  for (int m = 0; m < l.ndim(); ++m) {
    if (l[m].is_shard() && l[m].shard_dim() == d) dims.push_back(m);
  }
  return dims;
}

// `s`, a check of input `i`'s values (ids, targets) that failed on this rank: where that input
// is sharded (ranks hold different values, so some may pass and go on into a collective) the
// ranks fail together (Communicator::Abort: the others return Aborted naming this rank at
// once, not DeadlineExceeded after the timeout). Where every rank holds the same values they
// all fail alike, and the mesh stays usable.
inline absl::Status FailTogetherIfSharded(const LocalCall& c, int i, absl::Status s) {
  if (s.ok() || c.mesh == nullptr || c.mesh->world().size() <= 1) return s;
  const Layout& l = c.input_layouts[static_cast<size_t>(i)];
  for (int m = 0; m < l.ndim(); ++m) {
    if (l[m].is_shard() && c.mesh->size(m) > 1) {
      c.mesh->world().Abort(s);
      break;
    }
  }
  return s;
}
template <typename T>
absl::StatusOr<T> FailTogetherIfSharded(const LocalCall& c, int i, absl::StatusOr<T> r) {
  if (!r.ok()) return FailTogetherIfSharded(c, i, r.status());
  return r;
}

// An OpDef's local function `F` whose errors fail the ranks together where input `kInput`
// (whose values it checks) is sharded (above).
template <absl::StatusOr<std::vector<Tensor>> (*F)(const LocalCall&), int kInput>
absl::StatusOr<std::vector<Tensor>> TogetherIfSharded(const LocalCall& c) {
  return FailTogetherIfSharded(c, kInput, F(c));
}

// A single-output Variable op: records `backward` (one grad in, one per input out).
inline Variable Result1(const char* name, absl::Span<const Variable> inputs, Value out,
                        std::function<absl::StatusOr<std::vector<Value>>(const Value& g)> backward) {
  std::vector<Value> outs;
  outs.push_back(std::move(out));
  return Record(
      name, inputs, std::move(outs),
      [bw = std::move(backward)](std::vector<Value>& g) -> absl::StatusOr<std::vector<Value>> { return bw(g[0]); })[0];
}

}  // namespace dtensor::op_util

#endif  // DTENSOR_AUTOGRAD_OPS_OP_UTIL_H_
