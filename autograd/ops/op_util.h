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

// `s`, an error of an op's local function on this rank (a check of input `i`'s values: ids,
// targets; or any other failure here) where input `i` may differ by rank: sharded on a mesh
// dim of size > 1, or a plain tensor (taken as Replicate, but maybe each rank's own batch). The
// others may have passed and gone on into a collective, so the ranks fail together
// (Communicator::Abort of the mesh's world family: threads and ucx peers return Aborted naming
// this rank at once; NCCL tells no peer, nccl_communicator.h, so they wait for their timeout).
// Where the input is a replicated DTensor every rank holds the same values and fails alike:
// nothing is aborted and the mesh stays usable.
inline absl::Status FailTogetherIfPerRank(const LocalCall& c, int i, absl::Status s) {
  if (s.ok() || c.mesh == nullptr || c.mesh->world().size() <= 1) return s;
  bool differs = i < 64 && ((c.plain_inputs >> i) & 1) != 0;
  const Layout& l = c.input_layouts[static_cast<size_t>(i)];
  for (int m = 0; m < l.ndim() && !differs; ++m) differs = l[m].is_shard() && c.mesh->size(m) > 1;
  if (differs) c.mesh->world().Abort(s);
  return s;
}
template <typename T>
absl::StatusOr<T> FailTogetherIfPerRank(const LocalCall& c, int i, absl::StatusOr<T> r) {
  if (!r.ok()) return FailTogetherIfPerRank(c, i, r.status());
  return r;
}

// An OpDef's local function `F` whose errors fail the ranks together where input `kInput`
// (whose values it checks) is sharded (above).
template <absl::StatusOr<std::vector<Tensor>> (*F)(const LocalCall&), int kInput>
absl::StatusOr<std::vector<Tensor>> TogetherIfPerRank(const LocalCall& c) {
  return FailTogetherIfPerRank(c, kInput, F(c));
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
