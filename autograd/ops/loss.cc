// Cross-entropy over the last dim: forward, backward and sharding rule.
//
//   cross_entropy (logits [..., V] S(-1), targets R) -> (loss R, lse R, count R): loss parallel,
//     the vocab-sharded logits stay sharded; each rank reduces its piece and three [rows]
//     vectors (max, sum of exponentials, target logit) are all-reduced.
//
//   cross_entropy (logits [..., V], targets [...]) -> (loss 0-d, lse [...], count 0-d)
//     S(d), S(d) -> P(sum), S(d), R   for batch dims d: each rank sums its rows' losses and
//                                     divides by the global count of targets != ignore_index
//                                     (one small all_reduce of the counts), so the Partial
//                                     sum is the global mean, for uneven shards too.
//   cross_entropy_backward (dloss, logits, targets, lse, count) -> dlogits, sharded as logits.
//
//   cross_entropy_fused (logits [..., V], targets [...]) -> (loss, dlogits, count, dloss_seen)
//     S(d), S(d) -> P(sum), S(d), R, R   for batch dims d (no loss parallel: callers keep the
//                                        unfused op for vocab-sharded logits)
//     The training form (llm.c's fused classifier): one pass over the logits gives the loss
//     and the gradient for an upstream gradient args.floats[0] (1: the loss backpropagated as
//     is). The backward node keeps that gradient instead of the logits and rescales it in
//     place by dloss / dloss_seen on the device, which skips the pass when they are equal.
#include <algorithm>
#include <cmath>
#include <limits>

#include "dtensor/autograd/functional.h"
#include "dtensor/autograd/ops.h"
#include "dtensor/autograd/ops/op_util.h"

namespace dtensor {
namespace {

const Placement kP = Partial(PartialOp::kSum);

absl::StatusOr<std::vector<TensorMeta>> CeMeta(absl::Span<const TensorMeta> in, const OpArgs&) {
  const Shape& l = in[0].shape;
  const Shape& t = in[1].shape;
  if (l.empty() || t.size() + 1 != l.size() || !std::equal(t.begin(), t.end(), l.begin()) ||
      (in[1].dtype != DType::kInt32 && in[1].dtype != DType::kInt64)) {
    return op_util::Invalid(
        "CrossEntropy",
        absl::StrCat("logits ", ShapeString(l), " and targets ", ShapeString(t), " ", DTypeName(in[1].dtype),
                     " do not fit (targets: int, logits' shape without the last dim)"));
  }
  return std::vector<TensorMeta>{{Shape{}, DType::kFloat32}, {t, DType::kFloat32}, {Shape{}, DType::kFloat32}};
}
void CeRule(absl::Span<const TensorMeta> in, const OpArgs&, IntSpan, std::vector<DimStrategy>* s) {
  for (int64_t d = 0; d < static_cast<int64_t>(in[1].shape.size()); ++d) {
    s->push_back({{Shard(d), Shard(d)}, {kP, Shard(d), Replicate()}});
  }
  // Loss parallel: vocab-sharded logits, replicated targets; the logits are never gathered.
  const int64_t v = static_cast<int64_t>(in[0].shape.size()) - 1;
  s->push_back({{Shard(v), Replicate()}, {Replicate(), Replicate(), Replicate()}});
}
// Mesh dims (of size > 1) on which input `i` is sharded along tensor dim `d`.
std::vector<int> ShardDims(const LocalCall& c, int i, int64_t d) {
  std::vector<int> dims;
  for (int m : op_util::ShardingMeshDims(c, i, d)) {
    if (c.mesh->size(m) > 1) dims.push_back(m);
  }
  return dims;
}

absl::Status AllReduce(const LocalCall& c, const std::vector<int>& dims, const Tensor& t, CommReduceOp op) {
  if (dims.empty()) return absl::OkStatus();
  DT_ASSIGN_OR_RETURN(Communicator * comm, c.mesh->comm(dims));
  if (CommCounter* counter = CommCounterOf(*c.mesh))
    counter->Record(CommKind::kAllReduce, static_cast<int64_t>(t.nbytes()));
  return comm->AllReduce(t, t, op);
}

// Per local row of the vocab-sharded logits [N, Vl]: the index of the target's logit in the
// flattened [N * Vl] piece (0 when the target is on another rank), whether it is here, and
// whether the row counts (target != ignore_index).
struct TargetIndex {
  Tensor flat_ids;  // int64 [N]
  Tensor here;      // [N, 1] logits' dtype, 1 or 0
  Tensor valid;     // [N, 1] logits' dtype, 1 or 0
  double count = 0;
};
// `vocab`: the whole vocabulary (targets outside [0, vocab) are InvalidArgument, as on one
// rank; every rank of the vocab group holds the same targets, so all of them refuse).
absl::StatusOr<TargetIndex> IndexTargets(const Tensor& targets, int64_t vocab_begin, int64_t vl, int64_t vocab,
                                         int64_t ignore, DType dtype, Device device) {
  DT_ASSIGN_OR_RETURN(std::vector<int64_t> t, ToInt64Vector(targets));
  const int64_t n = static_cast<int64_t>(t.size());
  std::vector<int64_t> ids(t.size(), 0);
  std::vector<float> here(t.size(), 0.0f), valid(t.size(), 0.0f);
  TargetIndex r;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t x = t[static_cast<size_t>(i)];
    if (x == ignore) continue;
    if (x < 0 || x >= vocab) {
      return InvalidArg("CrossEntropy", "target ", x, " at row ", i, " is outside [0, ", vocab,
                        ") and is not ignore_index ", ignore);
    }
    valid[static_cast<size_t>(i)] = 1.0f;
    r.count += 1;
    if (x >= vocab_begin && x < vocab_begin + vl) {
      here[static_cast<size_t>(i)] = 1.0f;
      ids[static_cast<size_t>(i)] = i * vl + (x - vocab_begin);
    }
  }
  DT_ASSIGN_OR_RETURN(r.flat_ids, Tensor::FromVector<int64_t>(ids, {n}));
  DT_ASSIGN_OR_RETURN(r.here, Tensor::FromVector<float>(here, {n, 1}));
  DT_ASSIGN_OR_RETURN(r.valid, Tensor::FromVector<float>(valid, {n, 1}));
  DT_ASSIGN_OR_RETURN(r.flat_ids, To(r.flat_ids, device));
  DT_ASSIGN_OR_RETURN(r.here, Cast(r.here, dtype));
  DT_ASSIGN_OR_RETURN(r.here, To(r.here, device));
  DT_ASSIGN_OR_RETURN(r.valid, Cast(r.valid, dtype));
  DT_ASSIGN_OR_RETURN(r.valid, To(r.valid, device));
  return r;
}

// Cross-entropy of vocab-sharded logits: max, sum of exponentials and the target logit are
// all-reduced over the vocab mesh dims ([N] floats each), never the logits.
absl::StatusOr<std::vector<Tensor>> CeVocabParallel(const LocalCall& c, const std::vector<int>& vocab_dims,
                                                    const std::vector<int>& batch_dims) {
  const Tensor& logits = c.inputs[0];
  const int64_t vl = logits.size(-1);
  const int64_t vocab_begin = c.InputOffset(0).back();
  DT_ASSIGN_OR_RETURN(
      Tensor x, dtensor::Reshape(logits, {NumElements(logits.shape().subspan(0, static_cast<size_t>(logits.dim() - 1))),
                                          vl}));  // [N, Vl]
  DT_ASSIGN_OR_RETURN(x, dtensor::Contiguous(x));
  // In float32, as the unsharded kernel computes (bfloat16 logits: the row max, the sums of
  // exponentials and the loss would otherwise be rounded to bfloat16, ~1e-2 off).
  if (x.dtype() != DType::kFloat32) {
    DT_ASSIGN_OR_RETURN(x, Cast(x, DType::kFloat32));
  }
  const int64_t rows = x.size(0);
  // An empty vocab piece (e.g. 6 over 4 ranks) still joins every all_reduce, with identities.
  Tensor m;
  if (vl > 0) {
    DT_ASSIGN_OR_RETURN(m, dtensor::Max(x, {-1}, true));  // [N, 1]
  } else {
    DT_ASSIGN_OR_RETURN(m, Full({rows, 1}, -std::numeric_limits<double>::infinity(), x.dtype(), x.device()));
  }
  DT_RETURN_IF_ERROR(AllReduce(c, vocab_dims, m, CommReduceOp::kMax));
  DT_ASSIGN_OR_RETURN(Tensor e, dtensor::Sub(x, m));
  DT_ASSIGN_OR_RETURN(e, dtensor::Exp(e));
  Tensor s;
  if (vl > 0) {
    DT_ASSIGN_OR_RETURN(s, dtensor::Sum(e, {-1}, true));
  } else {
    DT_ASSIGN_OR_RETURN(s, Zeros({rows, 1}, x.dtype(), x.device()));
  }
  DT_RETURN_IF_ERROR(AllReduce(c, vocab_dims, s, CommReduceOp::kSum));
  DT_ASSIGN_OR_RETURN(Tensor log_s, dtensor::Log(s));
  DT_ASSIGN_OR_RETURN(Tensor lse, dtensor::Add(log_s, m));  // [N, 1]
  DT_ASSIGN_OR_RETURN(TargetIndex ti, IndexTargets(c.inputs[1], vocab_begin, vl, c.input_meta[0].shape.back(),
                                                   c.args.ints[0], x.dtype(), x.device()));
  Tensor tl;
  if (vl > 0) {
    DT_ASSIGN_OR_RETURN(Tensor flat, x.View({x.numel(), 1}));
    DT_ASSIGN_OR_RETURN(tl, dtensor::Embedding(flat, ti.flat_ids));  // [N, 1]
    DT_ASSIGN_OR_RETURN(tl, dtensor::Mul(tl, ti.here));
  } else {
    DT_ASSIGN_OR_RETURN(tl, Zeros({rows, 1}, x.dtype(), x.device()));
  }
  DT_RETURN_IF_ERROR(AllReduce(c, vocab_dims, tl, CommReduceOp::kSum));
  // log s - (x_t - m), not lse - x_t: lse = m + log s is rounded at the magnitude of the row
  // max (1e-4 off at logits of 2e4), the difference x_t - m is exact (as the unsharded kernel).
  DT_ASSIGN_OR_RETURN(Tensor shifted, dtensor::Sub(tl, m));
  DT_ASSIGN_OR_RETURN(Tensor losses, dtensor::Sub(log_s, shifted));
  DT_ASSIGN_OR_RETURN(losses, dtensor::Mul(losses, ti.valid));
  DT_ASSIGN_OR_RETURN(Tensor total, dtensor::Sum(losses));
  DT_ASSIGN_OR_RETURN(Tensor count, Full({}, ti.count, DType::kFloat32, x.device()));
  DT_RETURN_IF_ERROR(AllReduce(c, batch_dims, count, CommReduceOp::kSum));
  DT_ASSIGN_OR_RETURN(std::vector<double> cv, ToDoubleVector(count));
  DT_ASSIGN_OR_RETURN(Tensor loss, dtensor::Scale(total, cv[0] == 0 ? std::nan("") : 1.0 / cv[0]));
  DT_ASSIGN_OR_RETURN(loss, Cast(loss, DType::kFloat32));
  DT_ASSIGN_OR_RETURN(lse, Cast(lse, DType::kFloat32));
  DT_ASSIGN_OR_RETURN(lse, lse.View(c.inputs[1].shape()));
  return std::vector<Tensor>{loss, lse, count};
}

absl::StatusOr<std::vector<Tensor>> CeLocal(const LocalCall& c) {
  if (c.mesh != nullptr) {
    std::vector<int> vocab_dims = ShardDims(c, 0, c.inputs[0].dim() - 1);
    if (!vocab_dims.empty()) {
      std::vector<int> batch_dims;
      for (int64_t d = 0; d < c.inputs[1].dim(); ++d) {
        for (int m : ShardDims(c, 1, d)) batch_dims.push_back(m);
      }
      std::sort(batch_dims.begin(), batch_dims.end());
      return CeVocabParallel(c, vocab_dims, batch_dims);
    }
  }
  DT_ASSIGN_OR_RETURN(CrossEntropyOutput o, dtensor::CrossEntropy(c.inputs[0], c.inputs[1], c.args.ints[0]));
  Tensor count = o.count;
  Tensor loss = o.loss;
  std::vector<int> dims;
  if (c.mesh != nullptr) {
    const Layout& l = c.input_layouts[1];
    for (int m = 0; m < l.ndim(); ++m) {
      if (l[m].is_shard() && c.mesh->size(m) > 1) dims.push_back(m);
    }
  }
  if (!dims.empty()) {
    // loss_local = mean_local * count_local / count_global (0 for a piece with no targets;
    // NaN on every rank when no rank has one, the mean of nothing, as on one rank).
    DT_ASSIGN_OR_RETURN(Tensor total, Clone(count));
    DT_RETURN_IF_ERROR(AllReduce(c, dims, total, CommReduceOp::kSum));
    DT_ASSIGN_OR_RETURN(std::vector<double> lv, ToDoubleVector(o.loss));
    DT_ASSIGN_OR_RETURN(std::vector<double> cv, ToDoubleVector(count));
    DT_ASSIGN_OR_RETURN(std::vector<double> tv, ToDoubleVector(total));
    const double local = tv[0] == 0   ? std::numeric_limits<double>::quiet_NaN()
                         : cv[0] == 0 ? 0.0
                                      : lv[0] * cv[0] / tv[0];
    DT_ASSIGN_OR_RETURN(loss, Full({}, local, DType::kFloat32, count.device()));
    count = total;
  }
  DT_ASSIGN_OR_RETURN(Tensor lse, o.lse.View(c.inputs[1].shape()));
  return std::vector<Tensor>{loss, lse, count};
}
const OpDef kCrossEntropy = {"cross_entropy", CeRule, CeMeta, op_util::TogetherIfPerRank<CeLocal, 1>};

// (dloss, logits, targets, lse, count) -> dlogits; args.ints = {ignore_index}
absl::StatusOr<std::vector<TensorMeta>> CeBwdMeta(absl::Span<const TensorMeta> in, const OpArgs&) {
  return std::vector<TensorMeta>{in[1]};
}
void CeBwdRule(absl::Span<const TensorMeta> in, const OpArgs&, IntSpan, std::vector<DimStrategy>* s) {
  for (int64_t d = 0; d < static_cast<int64_t>(in[2].shape.size()); ++d) {
    s->push_back({{Replicate(), Shard(d), Shard(d), Shard(d), Replicate()}, {Shard(d)}});
  }
  const int64_t v = static_cast<int64_t>(in[1].shape.size()) - 1;
  s->push_back({{Replicate(), Shard(v), Replicate(), Replicate(), Replicate()}, {Shard(v)}});
}
// dlogits = dloss / count * (softmax(logits) - onehot(target)) on this rank's vocab piece.
absl::StatusOr<std::vector<Tensor>> CeBwdVocabParallel(const LocalCall& c) {
  const Tensor& logits = c.inputs[1];
  const int64_t vl = logits.size(-1);
  const int64_t vocab_begin = c.InputOffset(1).back();
  DT_ASSIGN_OR_RETURN(std::vector<double> dl, ToDoubleVector(c.inputs[0]));
  DT_ASSIGN_OR_RETURN(std::vector<double> cnt, ToDoubleVector(c.inputs[4]));
  const double scale = cnt[0] == 0 ? 0.0 : dl[0] / cnt[0];
  DT_ASSIGN_OR_RETURN(
      Tensor x,
      dtensor::Reshape(logits, {NumElements(logits.shape().subspan(0, static_cast<size_t>(logits.dim() - 1))), vl}));
  if (x.dtype() != DType::kFloat32) {  // in float32, as the forward (x - lse in bfloat16 is ~3% off)
    DT_ASSIGN_OR_RETURN(x, Cast(x, DType::kFloat32));
  }
  DT_ASSIGN_OR_RETURN(Tensor lse, dtensor::Reshape(c.inputs[3], {-1, 1}));
  DT_ASSIGN_OR_RETURN(lse, Cast(lse, x.dtype()));
  DT_ASSIGN_OR_RETURN(TargetIndex ti, IndexTargets(c.inputs[2], vocab_begin, vl, c.input_meta[1].shape.back(),
                                                   c.args.ints[0], x.dtype(), x.device()));
  DT_ASSIGN_OR_RETURN(Tensor p, dtensor::Sub(x, lse));
  DT_ASSIGN_OR_RETURN(p, dtensor::Exp(p));
  DT_ASSIGN_OR_RETURN(Tensor w, dtensor::Scale(ti.valid, scale));
  DT_ASSIGN_OR_RETURN(p, dtensor::Mul(p, w));  // new contiguous [N, Vl]
  DT_ASSIGN_OR_RETURN(Tensor onehot, dtensor::Mul(w, ti.here));
  DT_ASSIGN_OR_RETURN(onehot, dtensor::Scale(onehot, -1.0));
  if (vl > 0) {
    DT_ASSIGN_OR_RETURN(Tensor flat, p.View({p.numel(), 1}));
    DT_RETURN_IF_ERROR(EmbeddingBackward_(flat, onehot, ti.flat_ids));  // subtract at the targets
  }
  DT_ASSIGN_OR_RETURN(p, p.View(logits.shape()));
  return op_util::One(Cast(p, logits.dtype()));
}

absl::StatusOr<std::vector<Tensor>> CeBwdLocal(const LocalCall& c) {
  if (c.mesh != nullptr && !ShardDims(c, 1, c.inputs[1].dim() - 1).empty()) return CeBwdVocabParallel(c);
  CrossEntropyOutput saved;
  DT_ASSIGN_OR_RETURN(saved.lse, dtensor::Contiguous(c.inputs[3]));
  DT_ASSIGN_OR_RETURN(saved.lse, saved.lse.View({-1}));
  saved.count = c.inputs[4];
  DT_ASSIGN_OR_RETURN(Tensor dloss, Cast(c.inputs[0], DType::kFloat32));
  return op_util::One(dtensor::CrossEntropyBackward(dloss, c.inputs[1], c.inputs[2], saved, c.args.ints[0]));
}
const OpDef kCrossEntropyBackward = {"cross_entropy_backward", CeBwdRule, CeBwdMeta,
                                     op_util::TogetherIfPerRank<CeBwdLocal, 2>};

// (logits, targets) -> (loss, dlogits, count, dloss_seen); args.ints = {ignore_index},
// args.floats = {the upstream gradient the dlogits are for}.
absl::StatusOr<std::vector<TensorMeta>> CeFusedMeta(absl::Span<const TensorMeta> in, const OpArgs& args) {
  DT_ASSIGN_OR_RETURN(std::vector<TensorMeta> m, CeMeta(in, args));
  return std::vector<TensorMeta>{m[0], in[0], m[2], m[2]};
}
void CeFusedRule(absl::Span<const TensorMeta> in, const OpArgs&, IntSpan, std::vector<DimStrategy>* s) {
  for (int64_t d = 0; d < static_cast<int64_t>(in[1].shape.size()); ++d) {
    s->push_back({{Shard(d), Shard(d)}, {kP, Shard(d), Replicate(), Replicate()}});
  }
}
absl::StatusOr<std::vector<Tensor>> CeFusedLocal(const LocalCall& c) {
  const Tensor& logits = c.inputs[0];
  const int64_t ignore = c.args.ints[0];
  // The count over every batch shard, summed on the device (no host read).
  DT_ASSIGN_OR_RETURN(Tensor count, CountTargets(c.inputs[1], c.input_meta[0].shape.back(), ignore));
  if (c.mesh != nullptr) {
    std::vector<int> dims;
    const Layout& l = c.input_layouts[1];
    for (int m = 0; m < l.ndim(); ++m) {
      if (l[m].is_shard() && c.mesh->size(m) > 1) dims.push_back(m);
    }
    DT_RETURN_IF_ERROR(AllReduce(c, dims, count, CommReduceOp::kSum));
  }
  DT_ASSIGN_OR_RETURN(Tensor seen, Full({}, c.args.floats[0], DType::kFloat32, logits.device()));
  DT_ASSIGN_OR_RETURN(CrossEntropyWithGradOutput o,
                      dtensor::CrossEntropyWithGrad(logits, c.inputs[1], seen, ignore, count));
  return std::vector<Tensor>{o.loss, o.dlogits, o.count, seen};
}
const OpDef kCrossEntropyFused = {"cross_entropy_fused", CeFusedRule, CeFusedMeta,
                                  op_util::TogetherIfPerRank<CeFusedLocal, 1>};

// This rank's piece of a scalar gradient as the whole value (a Partial one is reduced first).
absl::StatusOr<Tensor> WholeScalar(const Value& g) {
  if (!g.is_dtensor()) return g.local();
  const DTensor& d = g.dtensor();
  if (d.layout().is_replicated()) return d.ToLocal();
  DT_ASSIGN_OR_RETURN(DTensor r, d.Redistribute(Layout(Placements(d.layout().placements().size(), Replicate()))));
  return r.ToLocal();
}

}  // namespace

namespace fn {
absl::StatusOr<CrossEntropyResult> CrossEntropy(const Value& logits, const Value& targets, int64_t ignore_index) {
  OpArgs args;
  args.ints.push_back(ignore_index);
  DT_ASSIGN_OR_RETURN(std::vector<Value> r, Dispatch(kCrossEntropy, {logits, targets}, args));
  CrossEntropyResult out;
  out.loss = r[0];
  out.lse = r[1];
  out.count = r[2];
  return out;
}
absl::StatusOr<Value> CrossEntropyBackward(const Value& dloss, const Value& logits, const Value& targets,
                                           const CrossEntropyResult& saved, int64_t ignore_index) {
  OpArgs args;
  args.ints.push_back(ignore_index);
  return op_util::First(Dispatch(kCrossEntropyBackward, {dloss, logits, targets, saved.lse, saved.count}, args));
}
absl::StatusOr<CrossEntropyFusedResult> CrossEntropyFused(const Value& logits, const Value& targets,
                                                          int64_t ignore_index, double expected_dloss) {
  // The backward rescales the stored gradient by dloss / expected_dloss: a zero (or subnormal,
  // where float32 keeps too few bits) expected_dloss would make that ratio inf and the gradient
  // NaN, an infinite or NaN one a NaN gradient.
  if (!std::isnormal(static_cast<float>(expected_dloss))) {
    return InvalidArg("CrossEntropyFused", "expected_dloss must be a finite, nonzero (normal) float32, got ",
                      expected_dloss);
  }
  OpArgs args;
  args.ints.push_back(ignore_index);
  args.floats.push_back(expected_dloss);
  DT_ASSIGN_OR_RETURN(std::vector<Value> r, Dispatch(kCrossEntropyFused, {logits, targets}, args));
  CrossEntropyFusedResult out;
  out.loss = r[0];
  out.dlogits = r[1];
  out.count = r[2];
  out.dloss_seen = r[3];
  return out;
}
}  // namespace fn

absl::StatusOr<Variable> CrossEntropy(const Variable& logits, const Variable& targets, int64_t ignore_index) {
  DT_ASSIGN_OR_RETURN(fn::CrossEntropyResult r, fn::CrossEntropy(logits.value(), targets.value(), ignore_index));
  if (!AnyRequiresGrad({logits, targets})) return Variable::Leaf(r.loss);  // no tape: skip the captures
  return op_util::Result1("CrossEntropy", {logits, targets}, r.loss,
                          [lv = logits.value(), tv = targets.value(), r,
                           ignore_index](const Value& g) -> absl::StatusOr<std::vector<Value>> {
                            DT_ASSIGN_OR_RETURN(Value d, fn::CrossEntropyBackward(g, lv, tv, r, ignore_index));
                            return std::vector<Value>{d, Value()};
                          });
}

absl::StatusOr<Variable> CrossEntropyFused(const Variable& logits, const Variable& targets, int64_t ignore_index,
                                           double expected_dloss) {
  if (!AnyRequiresGrad({logits, targets})) return CrossEntropy(logits, targets, ignore_index);
  DT_ASSIGN_OR_RETURN(fn::CrossEntropyFusedResult r,
                      fn::CrossEntropyFused(logits.value(), targets.value(), ignore_index, expected_dloss));
  // The first backward rescales the kept gradient in place and hands it on; a later one
  // (retain_graph) leaves it as the first handed it on and returns a rescaled copy.
  return op_util::Result1("CrossEntropyFused", {logits, targets}, r.loss,
                          [r, first = true](const Value& g) mutable -> absl::StatusOr<std::vector<Value>> {
                            DT_ASSIGN_OR_RETURN(Tensor dloss, WholeScalar(g));
                            DT_ASSIGN_OR_RETURN(dloss, Cast(dloss, DType::kFloat32));
                            DT_ASSIGN_OR_RETURN(dloss, dloss.View(IntSpan()));
                            const Tensor& seen = r.dloss_seen.local();
                            if (first) {
                              first = false;
                              DT_RETURN_IF_ERROR(ScaleByRatio_(r.dlogits.local(), dloss, seen));
                              DT_RETURN_IF_ERROR(Copy_(seen, dloss));
                              return std::vector<Value>{r.dlogits, Value()};
                            }
                            DT_ASSIGN_OR_RETURN(Tensor ratio, Div(dloss, seen));
                            DT_ASSIGN_OR_RETURN(Value d, fn::Mul(r.dlogits, Value(ratio)));
                            return std::vector<Value>{d, Value()};
                          });
}

namespace op_defs {
const OpDef& CrossEntropy() { return kCrossEntropy; }
const OpDef& CrossEntropyBackward() { return kCrossEntropyBackward; }
const OpDef& CrossEntropyFused() { return kCrossEntropyFused; }
}  // namespace op_defs

}  // namespace dtensor
