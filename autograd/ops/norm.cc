// LayerNorm (also fused with the residual add before it), RmsNorm and softmax over one dim:
// forward, backward and sharding rules.
//
// Sharding rule: rows are independent, so any dim but the normalised one may be sharded
// (the statistics mean/rstd [x.shape[:-1]] are sharded alike); the weight and bias are
// replicated and their gradients come out Partial(sum) over the row shards. The backwards are
// linear in dy (x, the weight and the statistics fixed), so a Partial(sum) dy gives Partial
// dx, dw and db with everything else Replicate: tensor parallelism without sequence
// parallelism keeps the residual stream's gradient partial through the norms, and it is
// all-reduced once where a row-parallel output's P -> R goes back (Megatron's one all_reduce
// per sublayer), not reduce-scattered here and all-gathered again.
#include "dtensor/autograd/functional.h"
#include "dtensor/autograd/ops.h"
#include "dtensor/autograd/ops/op_util.h"

namespace dtensor {
namespace {

const Placement kP = Partial(PartialOp::kSum);

Shape Rows(const Shape& s) { return Shape(s.begin(), s.end() - 1); }

absl::Status CheckNorm(const char* op, absl::Span<const TensorMeta> in) {
  const Shape& x = in[0].shape;
  for (size_t i = 1; i < in.size(); ++i) {
    if (x.empty() || in[i].shape != Shape{x.back()}) {
      return op_util::Invalid(op, absl::StrCat("x ", ShapeString(x), " and parameter ", ShapeString(in[i].shape),
                                               " do not fit (parameters must be [C], C = x's last dim)"));
    }
  }
  return absl::OkStatus();
}

// ---- layer_norm (x, w, b) -> (y, mean, rstd); args.floats = {eps} ----
absl::StatusOr<std::vector<TensorMeta>> LnMeta(absl::Span<const TensorMeta> in, const OpArgs&) {
  DT_RETURN_IF_ERROR(CheckNorm("LayerNorm", in));
  return std::vector<TensorMeta>{in[0], {Rows(in[0].shape), DType::kFloat32}, {Rows(in[0].shape), DType::kFloat32}};
}
void LnRule(absl::Span<const TensorMeta> in, const OpArgs&, IntSpan, std::vector<DimStrategy>* s) {
  for (int64_t d = 0; d + 1 < static_cast<int64_t>(in[0].shape.size()); ++d) {
    s->push_back({{Shard(d), Replicate(), Replicate()}, {Shard(d), Shard(d), Shard(d)}});
  }
}
absl::StatusOr<std::vector<Tensor>> LnLocal(const LocalCall& c) {
  const Tensor& x = c.inputs[0];
  DT_ASSIGN_OR_RETURN(NormOutput o,
                      dtensor::LayerNorm(x, c.inputs[1], c.inputs[2], static_cast<float>(c.args.floats[0])));
  Shape rows(x.shape().begin(), x.shape().end() - 1);
  DT_ASSIGN_OR_RETURN(Tensor mean, o.mean.View(rows));
  DT_ASSIGN_OR_RETURN(Tensor rstd, o.rstd.View(rows));
  return std::vector<Tensor>{o.y, mean, rstd};
}
const OpDef kLayerNorm = {"layer_norm", LnRule, LnMeta, LnLocal};

// ---- layer_norm_backward (dy, x, w, mean, rstd) -> (dx, dw, db) ----
absl::StatusOr<std::vector<TensorMeta>> LnBwdMeta(absl::Span<const TensorMeta> in, const OpArgs&) {
  DT_RETURN_IF_ERROR(CheckNorm("LayerNormBackward", in.subspan(1, 2)));
  return std::vector<TensorMeta>{in[1], in[2], in[2]};
}
void LnBwdRule(absl::Span<const TensorMeta> in, const OpArgs&, IntSpan, std::vector<DimStrategy>* s) {
  for (int64_t d = 0; d + 1 < static_cast<int64_t>(in[0].shape.size()); ++d) {
    s->push_back({{Shard(d), Shard(d), Replicate(), Shard(d), Shard(d)}, {Shard(d), kP, kP}});
  }
  s->push_back({{kP, Replicate(), Replicate(), Replicate(), Replicate()}, {kP, kP, kP}});
}
absl::StatusOr<std::vector<Tensor>> LnBwdLocal(const LocalCall& c) {
  NormOutput saved;
  DT_ASSIGN_OR_RETURN(saved.mean, dtensor::Contiguous(c.inputs[3]));
  DT_ASSIGN_OR_RETURN(saved.rstd, dtensor::Contiguous(c.inputs[4]));
  DT_ASSIGN_OR_RETURN(NormGrads g, dtensor::LayerNormBackward(c.inputs[0], c.inputs[1], c.inputs[2], saved, true));
  return std::vector<Tensor>{g.dx, g.dweight, g.dbias};
}
const OpDef kLayerNormBackward = {"layer_norm_backward", LnBwdRule, LnBwdMeta, LnBwdLocal};

// ---- add_layer_norm (x, h, w, b) -> (x + h, y, mean, rstd); args.floats = {eps} ----
// Rows stay independent: x and h sharded alike on any dim but the last (as LayerNorm). No
// Partial strategy: P + P is P, but LayerNorm of a Partial sum is not the sum of LayerNorms.
// The backward is add_layer_norm_backward: layer_norm_backward's with the gradient of x + h added
// to its dx in the same pass.
absl::StatusOr<std::vector<TensorMeta>> AddLnMeta(absl::Span<const TensorMeta> in, const OpArgs&) {
  if (in[1].shape != in[0].shape || in[1].dtype != in[0].dtype) {
    return op_util::Invalid(
        "AddLayerNorm", absl::StrCat("x ", ShapeString(in[0].shape), " ", DTypeName(in[0].dtype), " and h ",
                                     ShapeString(in[1].shape), " ", DTypeName(in[1].dtype), " differ (no broadcast)"));
  }
  const TensorMeta xwb[3] = {in[0], in[2], in[3]};
  DT_RETURN_IF_ERROR(CheckNorm("AddLayerNorm", xwb));
  const TensorMeta stats = {Rows(in[0].shape), DType::kFloat32};
  return std::vector<TensorMeta>{in[0], in[0], stats, stats};
}
void AddLnRule(absl::Span<const TensorMeta> in, const OpArgs&, IntSpan, std::vector<DimStrategy>* s) {
  for (int64_t d = 0; d + 1 < static_cast<int64_t>(in[0].shape.size()); ++d) {
    s->push_back({{Shard(d), Shard(d), Replicate(), Replicate()}, {Shard(d), Shard(d), Shard(d), Shard(d)}});
  }
}
absl::StatusOr<std::vector<Tensor>> AddLnLocal(const LocalCall& c) {
  const Tensor& x = c.inputs[0];
  DT_ASSIGN_OR_RETURN(AddNormOutput o, dtensor::AddLayerNorm(x, c.inputs[1], c.inputs[2], c.inputs[3],
                                                             static_cast<float>(c.args.floats[0])));
  Shape rows(x.shape().begin(), x.shape().end() - 1);
  DT_ASSIGN_OR_RETURN(Tensor mean, o.norm.mean.View(rows));
  DT_ASSIGN_OR_RETURN(Tensor rstd, o.norm.rstd.View(rows));
  return std::vector<Tensor>{o.residual, o.norm.y, mean, rstd};
}
const OpDef kAddLayerNorm = {"add_layer_norm", AddLnRule, AddLnMeta, AddLnLocal};

// ---- add_layer_norm_backward (dy, x1, w, mean, rstd, dx1) -> (dx1 + dLN, dw, db) ----
// layer_norm_backward with the residual's own gradient dx1 added to dx in the same pass (the
// gradient of x and of h alike).
absl::StatusOr<std::vector<TensorMeta>> AddLnBwdMeta(absl::Span<const TensorMeta> in, const OpArgs& args) {
  if (in[5].shape != in[1].shape || in[5].dtype != in[1].dtype) {
    return op_util::Invalid("AddLayerNormBackward",
                            absl::StrCat("dresidual ", ShapeString(in[5].shape), " ", DTypeName(in[5].dtype),
                                         " does not match x ", ShapeString(in[1].shape), " ", DTypeName(in[1].dtype)));
  }
  return LnBwdMeta(in.subspan(0, 5), args);
}
void AddLnBwdRule(absl::Span<const TensorMeta> in, const OpArgs&, IntSpan, std::vector<DimStrategy>* s) {
  for (int64_t d = 0; d + 1 < static_cast<int64_t>(in[0].shape.size()); ++d) {
    s->push_back({{Shard(d), Shard(d), Replicate(), Shard(d), Shard(d), Shard(d)}, {Shard(d), kP, kP}});
  }
  s->push_back({{kP, Replicate(), Replicate(), Replicate(), Replicate(), kP}, {kP, kP, kP}});
}
absl::StatusOr<std::vector<Tensor>> AddLnBwdLocal(const LocalCall& c) {
  NormOutput saved;
  DT_ASSIGN_OR_RETURN(saved.mean, dtensor::Contiguous(c.inputs[3]));
  DT_ASSIGN_OR_RETURN(saved.rstd, dtensor::Contiguous(c.inputs[4]));
  DT_ASSIGN_OR_RETURN(NormGrads g,
                      dtensor::LayerNormBackwardAdd(c.inputs[0], c.inputs[1], c.inputs[2], saved, c.inputs[5], true));
  return std::vector<Tensor>{g.dx, g.dweight, g.dbias};
}
const OpDef kAddLayerNormBackward = {"add_layer_norm_backward", AddLnBwdRule, AddLnBwdMeta, AddLnBwdLocal};

// ---- rms_norm (x, w) -> (y, rstd) ----
absl::StatusOr<std::vector<TensorMeta>> RmsMeta(absl::Span<const TensorMeta> in, const OpArgs&) {
  DT_RETURN_IF_ERROR(CheckNorm("RmsNorm", in));
  return std::vector<TensorMeta>{in[0], {Rows(in[0].shape), DType::kFloat32}};
}
void RmsRule(absl::Span<const TensorMeta> in, const OpArgs&, IntSpan, std::vector<DimStrategy>* s) {
  for (int64_t d = 0; d + 1 < static_cast<int64_t>(in[0].shape.size()); ++d) {
    s->push_back({{Shard(d), Replicate()}, {Shard(d), Shard(d)}});
  }
}
absl::StatusOr<std::vector<Tensor>> RmsLocal(const LocalCall& c) {
  const Tensor& x = c.inputs[0];
  DT_ASSIGN_OR_RETURN(NormOutput o, dtensor::RmsNorm(x, c.inputs[1], static_cast<float>(c.args.floats[0])));
  Shape rows(x.shape().begin(), x.shape().end() - 1);
  DT_ASSIGN_OR_RETURN(Tensor rstd, o.rstd.View(rows));
  return std::vector<Tensor>{o.y, rstd};
}
const OpDef kRmsNorm = {"rms_norm", RmsRule, RmsMeta, RmsLocal};

// ---- rms_norm_backward (dy, x, w, rstd) -> (dx, dw) ----
absl::StatusOr<std::vector<TensorMeta>> RmsBwdMeta(absl::Span<const TensorMeta> in, const OpArgs&) {
  DT_RETURN_IF_ERROR(CheckNorm("RmsNormBackward", in.subspan(1, 2)));
  return std::vector<TensorMeta>{in[1], in[2]};
}
void RmsBwdRule(absl::Span<const TensorMeta> in, const OpArgs&, IntSpan, std::vector<DimStrategy>* s) {
  for (int64_t d = 0; d + 1 < static_cast<int64_t>(in[0].shape.size()); ++d) {
    s->push_back({{Shard(d), Shard(d), Replicate(), Shard(d)}, {Shard(d), kP}});
  }
  s->push_back({{kP, Replicate(), Replicate(), Replicate()}, {kP, kP}});
}
absl::StatusOr<std::vector<Tensor>> RmsBwdLocal(const LocalCall& c) {
  NormOutput saved;
  DT_ASSIGN_OR_RETURN(saved.rstd, dtensor::Contiguous(c.inputs[3]));
  DT_ASSIGN_OR_RETURN(NormGrads g, dtensor::RmsNormBackward(c.inputs[0], c.inputs[1], c.inputs[2], saved));
  return std::vector<Tensor>{g.dx, g.dweight};
}
const OpDef kRmsNormBackward = {"rms_norm_backward", RmsBwdRule, RmsBwdMeta, RmsBwdLocal};

// ---- softmax / log_softmax (x) over args.ints[0] (normalised); args.ints[1] = log ----
absl::StatusOr<std::vector<TensorMeta>> SmMeta(absl::Span<const TensorMeta> in, const OpArgs&) {
  return std::vector<TensorMeta>{in[0]};
}
void SmRule(absl::Span<const TensorMeta> in, const OpArgs& args, IntSpan, std::vector<DimStrategy>* s) {
  for (int64_t d = 0; d < static_cast<int64_t>(in[0].shape.size()); ++d) {
    if (d == args.ints[0]) continue;
    absl::InlinedVector<Placement, 5> ins(in.size(), Shard(d));
    s->push_back({ins, {Shard(d)}});
  }
}
absl::StatusOr<std::vector<Tensor>> SmLocal(const LocalCall& c) {
  const int64_t dim = c.args.ints[0];
  if (c.args.ints[1] != 0) return op_util::One(dtensor::LogSoftmax(c.inputs[0], dim));
  return op_util::One(dtensor::Softmax(c.inputs[0], dim));
}
const OpDef kSoftmax = {"softmax", SmRule, SmMeta, SmLocal};
// (dy, y) -> dx
absl::StatusOr<std::vector<Tensor>> SmBwdLocal(const LocalCall& c) {
  const int64_t dim = c.args.ints[0];
  if (c.args.ints[1] != 0) return op_util::One(dtensor::LogSoftmaxBackward(c.inputs[0], c.inputs[1], dim));
  return op_util::One(dtensor::SoftmaxBackward(c.inputs[0], c.inputs[1], dim));
}
const OpDef kSoftmaxBackward = {"softmax_backward", SmRule, SmMeta, SmBwdLocal};

}  // namespace

namespace fn {

absl::StatusOr<NormResult> LayerNorm(const Value& x, const Value& w, const Value& b, double eps) {
  OpArgs args;
  args.floats.push_back(eps);
  DT_ASSIGN_OR_RETURN(std::vector<Value> r, Dispatch(kLayerNorm, {x, w, b}, args));
  return NormResult{r[0], r[1], r[2]};
}

absl::StatusOr<std::vector<Value>> LayerNormBackward(const Value& dy, const Value& x, const Value& w,
                                                     const NormResult& saved) {
  return Dispatch(kLayerNormBackward, {dy, x, w, saved.mean, saved.rstd});
}

absl::StatusOr<AddNormResult> AddLayerNorm(const Value& x, const Value& h, const Value& w, const Value& b, double eps) {
  OpArgs args;
  args.floats.push_back(eps);
  DT_ASSIGN_OR_RETURN(std::vector<Value> r, Dispatch(kAddLayerNorm, {x, h, w, b}, args));
  return AddNormResult{r[0], NormResult{r[1], r[2], r[3]}};
}

absl::StatusOr<std::vector<Value>> AddLayerNormBackward(const Value& dy, const Value& dresidual, const Value& w,
                                                        const AddNormResult& saved) {
  return Dispatch(kAddLayerNormBackward, {dy, saved.residual, w, saved.norm.mean, saved.norm.rstd, dresidual});
}

absl::StatusOr<NormResult> RmsNorm(const Value& x, const Value& w, double eps) {
  OpArgs args;
  args.floats.push_back(eps);
  DT_ASSIGN_OR_RETURN(std::vector<Value> r, Dispatch(kRmsNorm, {x, w}, args));
  return NormResult{r[0], Value(), r[1]};
}

absl::StatusOr<std::vector<Value>> RmsNormBackward(const Value& dy, const Value& x, const Value& w,
                                                   const NormResult& saved) {
  return Dispatch(kRmsNormBackward, {dy, x, w, saved.rstd});
}

absl::StatusOr<Value> Softmax(const Value& x, int64_t dim) {
  DT_ASSIGN_OR_RETURN(int64_t d, NormalizeDim("Softmax", dim, x.dim()));
  OpArgs args;
  args.ints = {d, 0};
  return op_util::First(Dispatch(kSoftmax, {x}, args));
}

absl::StatusOr<Value> LogSoftmax(const Value& x, int64_t dim) {
  DT_ASSIGN_OR_RETURN(int64_t d, NormalizeDim("LogSoftmax", dim, x.dim()));
  OpArgs args;
  args.ints = {d, 1};
  return op_util::First(Dispatch(kSoftmax, {x}, args));
}

absl::StatusOr<Value> SoftmaxBackward(const Value& dy, const Value& y, int64_t dim, bool log) {
  DT_ASSIGN_OR_RETURN(int64_t d, NormalizeDim("SoftmaxBackward", dim, y.dim()));
  OpArgs args;
  args.ints = {d, log ? 1 : 0};
  return op_util::First(Dispatch(kSoftmaxBackward, {dy, y}, args));
}

}  // namespace fn

absl::StatusOr<Variable> LayerNorm(const Variable& x, const Variable& w, const Variable& b, double eps) {
  DT_ASSIGN_OR_RETURN(fn::NormResult r, fn::LayerNorm(x.value(), w.value(), b.value(), eps));
  if (!AnyRequiresGrad({x, w, b})) return Variable::Leaf(r.y);  // no tape: skip the captures
  return op_util::Result1("LayerNorm", {x, w, b}, r.y,
                          [xv = x.value(), wv = w.value(), r](const Value& g) -> absl::StatusOr<std::vector<Value>> {
                            return fn::LayerNormBackward(g, xv, wv, r);
                          });
}

absl::StatusOr<ResidualNorm> AddLayerNorm(const Variable& x, const Variable& h, const Variable& w, const Variable& b,
                                          double eps) {
  DT_ASSIGN_OR_RETURN(fn::AddNormResult r, fn::AddLayerNorm(x.value(), h.value(), w.value(), b.value(), eps));
  if (!AnyRequiresGrad({x, h, w, b})) return ResidualNorm{Variable::Leaf(r.residual), Variable::Leaf(r.norm.y)};
  std::vector<Value> outs = {r.residual, r.norm.y};
  // g[0] reaches residual directly (the residual stream), g[1] reaches y: the gradient of
  // residual is their sum (one pass when both arrived), and Add's backward hands it to x and h
  // alike. The saved values: residual, mean, rstd (not y).
  fn::AddNormResult saved{r.residual, fn::NormResult{Value(), r.norm.mean, r.norm.rstd}};
  std::vector<Variable> v =
      Record("AddLayerNorm", {x, h, w, b}, std::move(outs),
             [wv = w.value(), saved](std::vector<Value>& g) -> absl::StatusOr<std::vector<Value>> {
               std::vector<Value> grads(4);
               Value dres = g[0];
               if (g[1].defined()) {
                 std::vector<Value> ln;
                 if (dres.defined()) {
                   DT_ASSIGN_OR_RETURN(ln, fn::AddLayerNormBackward(g[1], dres, wv, saved));
                 } else {
                   DT_ASSIGN_OR_RETURN(ln, fn::LayerNormBackward(g[1], saved.residual, wv, saved.norm));
                 }
                 dres = std::move(ln[0]);
                 grads[2] = std::move(ln[1]);
                 grads[3] = std::move(ln[2]);
               }
               grads[0] = dres;
               grads[1] = std::move(dres);
               return grads;
             });
  return ResidualNorm{std::move(v[0]), std::move(v[1])};
}

absl::StatusOr<Variable> RmsNorm(const Variable& x, const Variable& w, double eps) {
  DT_ASSIGN_OR_RETURN(fn::NormResult r, fn::RmsNorm(x.value(), w.value(), eps));
  if (!AnyRequiresGrad({x, w})) return Variable::Leaf(r.y);  // no tape: skip the captures
  return op_util::Result1("RmsNorm", {x, w}, r.y,
                          [xv = x.value(), wv = w.value(), r](const Value& g) -> absl::StatusOr<std::vector<Value>> {
                            return fn::RmsNormBackward(g, xv, wv, r);
                          });
}

absl::StatusOr<Variable> Softmax(const Variable& x, int64_t dim) {
  DT_ASSIGN_OR_RETURN(Value y, fn::Softmax(x.value(), dim));
  if (!AnyRequiresGrad({x})) return Variable::Leaf(y);  // no tape: skip the captures
  return op_util::Result1("Softmax", {x}, y, [y, dim](const Value& g) -> absl::StatusOr<std::vector<Value>> {
    DT_ASSIGN_OR_RETURN(Value r, fn::SoftmaxBackward(g, y, dim, false));
    return std::vector<Value>{r};
  });
}

absl::StatusOr<Variable> LogSoftmax(const Variable& x, int64_t dim) {
  DT_ASSIGN_OR_RETURN(Value y, fn::LogSoftmax(x.value(), dim));
  if (!AnyRequiresGrad({x})) return Variable::Leaf(y);  // no tape: skip the captures
  return op_util::Result1("LogSoftmax", {x}, y, [y, dim](const Value& g) -> absl::StatusOr<std::vector<Value>> {
    DT_ASSIGN_OR_RETURN(Value r, fn::SoftmaxBackward(g, y, dim, true));
    return std::vector<Value>{r};
  });
}

namespace op_defs {
const OpDef& LayerNorm() { return kLayerNorm; }
const OpDef& LayerNormBackward() { return kLayerNormBackward; }
const OpDef& AddLayerNorm() { return kAddLayerNorm; }
const OpDef& AddLayerNormBackward() { return kAddLayerNormBackward; }
const OpDef& RmsNorm() { return kRmsNorm; }
const OpDef& RmsNormBackward() { return kRmsNormBackward; }
const OpDef& Softmax() { return kSoftmax; }
const OpDef& SoftmaxBackward() { return kSoftmaxBackward; }
}  // namespace op_defs

}  // namespace dtensor
