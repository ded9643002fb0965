// Cross-entropy over the last dim: forward, backward and sharding rule.
//
//   cross_entropy (logits [..., V], targets [...]) -> (loss 0-d, lse [...], count 0-d)
//     S(d), S(d) -> P(sum), S(d), R   for batch dims d: each rank sums its rows' losses and
//                                     divides by the global count of targets != ignore_index
//                                     (one small all_reduce of the counts), so the Partial
//                                     sum is the global mean, for uneven shards too.
//   cross_entropy_backward (dloss, logits, targets, lse, count) -> dlogits, sharded as logits.
#include "autograd/functional.h"
#include "autograd/ops.h"
#include "autograd/ops/op_util.h"

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
}
absl::StatusOr<std::vector<Tensor>> CeLocal(const LocalCall& c) {
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
    // loss_local = mean_local * count_local / count_global (0 for a piece with no targets).
    DT_ASSIGN_OR_RETURN(Communicator * comm, c.mesh->comm(dims));
    DT_ASSIGN_OR_RETURN(Tensor total, Tensor::Empty({}, DType::kFloat32, count.device()));
    DT_RETURN_IF_ERROR(comm->AllReduce(count, total, CommReduceOp::kSum));
    DT_ASSIGN_OR_RETURN(std::vector<double> lv, ToDoubleVector(o.loss));
    DT_ASSIGN_OR_RETURN(std::vector<double> cv, ToDoubleVector(count));
    DT_ASSIGN_OR_RETURN(std::vector<double> tv, ToDoubleVector(total));
    const double local = cv[0] == 0 ? 0.0 : lv[0] * cv[0] / tv[0];
    DT_ASSIGN_OR_RETURN(loss, Full({}, local, DType::kFloat32, count.device()));
    count = total;
  }
  DT_ASSIGN_OR_RETURN(Tensor lse, o.lse.View(c.inputs[1].shape()));
  return std::vector<Tensor>{loss, lse, count};
}
const OpDef kCrossEntropy = {"cross_entropy", CeRule, CeMeta, CeLocal};

// (dloss, logits, targets, lse, count) -> dlogits; args.ints = {ignore_index}
absl::StatusOr<std::vector<TensorMeta>> CeBwdMeta(absl::Span<const TensorMeta> in, const OpArgs&) {
  return std::vector<TensorMeta>{in[1]};
}
void CeBwdRule(absl::Span<const TensorMeta> in, const OpArgs&, IntSpan, std::vector<DimStrategy>* s) {
  for (int64_t d = 0; d < static_cast<int64_t>(in[2].shape.size()); ++d) {
    s->push_back({{Replicate(), Shard(d), Shard(d), Shard(d), Replicate()}, {Shard(d)}});
  }
}
absl::StatusOr<std::vector<Tensor>> CeBwdLocal(const LocalCall& c) {
  CrossEntropyOutput saved;
  DT_ASSIGN_OR_RETURN(saved.lse, dtensor::Contiguous(c.inputs[3]));
  DT_ASSIGN_OR_RETURN(saved.lse, saved.lse.View({-1}));
  saved.count = c.inputs[4];
  DT_ASSIGN_OR_RETURN(Tensor dloss, Cast(c.inputs[0], DType::kFloat32));
  return op_util::One(dtensor::CrossEntropyBackward(dloss, c.inputs[1], c.inputs[2], saved, c.args.ints[0]));
}
const OpDef kCrossEntropyBackward = {"cross_entropy_backward", CeBwdRule, CeBwdMeta, CeBwdLocal};

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
}  // namespace fn

absl::StatusOr<Variable> CrossEntropy(const Variable& logits, const Variable& targets, int64_t ignore_index) {
  DT_ASSIGN_OR_RETURN(fn::CrossEntropyResult r, fn::CrossEntropy(logits.value(), targets.value(), ignore_index));
  return op_util::Result1("CrossEntropy", {logits, targets}, r.loss,
                          [lv = logits.value(), tv = targets.value(), r,
                           ignore_index](const Value& g) -> absl::StatusOr<std::vector<Value>> {
                            DT_ASSIGN_OR_RETURN(Value d, fn::CrossEntropyBackward(g, lv, tv, r, ignore_index));
                            return std::vector<Value>{d, Value()};
                          });
}

}  // namespace dtensor
