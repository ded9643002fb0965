// Linear layers and matmul: forward, both backward products and their sharding rules.
//
//   linear       x [..., in] · w [out, in]^T -> [..., out]
//     S(d)·R -> S(d) (batch/data parallel)   R·S(0) -> S(-1) (colwise)
//     S(-1)·S(1) -> P(sum) (rowwise)         P·R, R·P -> P
//   linear_bias  x · w^T + b (b [out]) in one kernel (Kernels::GemmBias); linear_bias_gelu the
//                same through GELU (outputs y and the pre-GELU values, saved for the backward):
//     linear's strategies with b R, S(0) where the output is S(-1), and P where the output is
//     P (b made Partial locally, no communication); with GELU only those without P (GELU is
//     not linear)
//   linear_dx    dy [..., out] · w [out, in] -> [..., in]
//     S(d)·R -> S(d)   S(-1)·S(0) -> P   R·S(1) -> S(-1)   P·R, R·P -> P
//   linear_dw    sum over leading dims of dy^T x -> [out, in]
//     S(d)·S(d) -> P (the data-parallel weight gradient)   S(-1)·R -> S(0)   R·S(-1) -> S(1)
//   linear_dw_bias  linear_dw and the bias gradient (dy summed over leading dims) from one
//                kernel (Kernels::GemmBiasGrad): linear_dw's strategies, db P / S(0) / R / P
//   linear_dx_gelu  (dy · w) * gelu'(pre) and its sum over leading dims: the gradient of the
//                pre-activation of an MLP's first Linear and of its bias, from one kernel
//                (Kernels::GemmDgelu); linear_dx's strategies (it is linear in dy and w), with pre
//                laid out as the result: S(d)·R·S(d) -> S(d), P   R·S(1)·S(-1) -> S(-1), S(0)
//                S(-1)·S(0)·R -> P, P   P·R·R, R·P·R -> P, P
//   mlp_gelu     the GPT MLP gelu(x w_fc^T + b_fc) w_proj^T + b_proj as one op (outputs y and the
//                pre-activation): S(d) x with replicated weights -> S(d), S(d) (data parallel);
//                Megatron's R x, w_fc S(0), b_fc S(0), w_proj S(1), b_proj P -> P, S(-1). Its
//                backward runs linear_dw_bias, linear_dx_gelu (the GELU backward in the second
//                Linear's input-gradient matrix multiply), linear_dw and linear_dx.
//   matmul       a [..., M, K] · b [K, N] or [..., K, N]: batch, M, N shards; K·K -> P
#include "dtensor/autograd/functional.h"
#include "dtensor/autograd/ops.h"
#include "dtensor/autograd/ops/op_util.h"

namespace dtensor {
namespace {

using op_util::One;
const Placement kP = Partial(PartialOp::kSum);

// [..., n] -> [rows, n] (a view when possible).
// (The row count is explicit: -1 cannot be inferred when this rank's piece of the last dim is
// empty, e.g. 6 features over 4 ranks.)
absl::StatusOr<Tensor> As2d(const Tensor& t) {
  return dtensor::Reshape(t, {NumElements(t.shape().subspan(0, static_cast<size_t>(t.dim() - 1))), t.size(-1)});
}

absl::StatusOr<Tensor> Unflatten(const Tensor& t2, IntSpan lead, int64_t last) {
  Shape s(lead.begin(), lead.end());
  s.push_back(last);
  return t2.View(s);
}

void LinearLikeRule(int64_t nd, std::vector<DimStrategy>* s, bool dx) {
  for (int64_t d = 0; d + 1 < nd; ++d) s->push_back({{Shard(d), Replicate()}, {Shard(d)}});
  if (dx) {
    s->push_back({{Shard(nd - 1), Shard(0)}, {kP}});
    s->push_back({{Replicate(), Shard(1)}, {Shard(nd - 1)}});
  } else {
    s->push_back({{Replicate(), Shard(0)}, {Shard(nd - 1)}});
    s->push_back({{Shard(nd - 1), Shard(1)}, {kP}});
  }
  s->push_back({{kP, Replicate()}, {kP}});
  s->push_back({{Replicate(), kP}, {kP}});
}

// ---- linear ----
absl::StatusOr<std::vector<TensorMeta>> LinearMeta(absl::Span<const TensorMeta> in, const OpArgs&) {
  const Shape& x = in[0].shape;
  const Shape& w = in[1].shape;
  if (x.empty() || w.size() != 2 || x.back() != w[1] || in[0].dtype != in[1].dtype) {
    return op_util::Invalid(
        "Linear", absl::StrCat("x ", ShapeString(x), " ", DTypeName(in[0].dtype), " and w ", ShapeString(w), " ",
                               DTypeName(in[1].dtype), " do not fit (",
                               in[0].dtype != in[1].dtype ? "the dtypes differ: cast x to w's"
                                                          : "w must be [out, in], in = x's last dim",
                               ")"));
  }
  Shape out = x;
  out.back() = w[0];
  return std::vector<TensorMeta>{{out, in[0].dtype}};
}
void LinearRule(absl::Span<const TensorMeta> in, const OpArgs&, IntSpan, std::vector<DimStrategy>* s) {
  LinearLikeRule(static_cast<int64_t>(in[0].shape.size()), s, false);
}
absl::StatusOr<std::vector<Tensor>> LinearLocal(const LocalCall& c) {
  const Tensor& x = c.inputs[0];
  DT_ASSIGN_OR_RETURN(Tensor x2, As2d(x));
  DT_ASSIGN_OR_RETURN(Tensor y2, dtensor::Matmul(x2, c.inputs[1], false, true));
  return One(Unflatten(y2, x.shape().subspan(0, static_cast<size_t>(x.dim() - 1)), y2.size(1)));
}
const OpDef kLinear = {"linear", LinearRule, LinearMeta, LinearLocal};

// ---- linear_bias: (x, w, b); args.ints = {gelu} -> y, and with gelu also pre ----
absl::StatusOr<std::vector<TensorMeta>> LinearBiasMeta(absl::Span<const TensorMeta> in, const OpArgs& args) {
  DT_ASSIGN_OR_RETURN(std::vector<TensorMeta> out, LinearMeta(in.subspan(0, 2), args));
  const Shape& b = in[2].shape;
  if (b.size() != 1 || b[0] != in[1].shape[0] || in[2].dtype != in[0].dtype) {
    return op_util::Invalid(
        "Linear", absl::StrCat("bias ", ShapeString(b), " ", DTypeName(in[2].dtype), " does not fit w ",
                               ShapeString(in[1].shape), " ", DTypeName(in[1].dtype), " (bias must be [out])"));
  }
  if (args.ints[0] != 0) out.push_back(out[0]);
  return out;
}
void LinearBiasRule(absl::Span<const TensorMeta> in, const OpArgs& args, IntSpan, std::vector<DimStrategy>* s) {
  const int64_t nd = static_cast<int64_t>(in[0].shape.size());
  const bool gelu = args.ints[0] != 0;
  auto add = [&](Placement x, Placement w, Placement b, Placement y) {
    DimStrategy d{{x, w, b}, {y}};
    if (gelu) d.outputs.push_back(y);
    s->push_back(std::move(d));
  };
  for (int64_t d = 0; d + 1 < nd; ++d) add(Shard(d), Replicate(), Replicate(), Shard(d));
  add(Replicate(), Shard(0), Shard(0), Shard(nd - 1));
  if (!gelu) {
    add(Shard(nd - 1), Shard(1), kP, kP);
    add(kP, Replicate(), kP, kP);
    add(Replicate(), kP, kP, kP);
  }
}
absl::StatusOr<std::vector<Tensor>> LinearBiasLocal(const LocalCall& c) {
  const Tensor& x = c.inputs[0];
  const bool gelu = c.args.ints[0] != 0;
  DT_ASSIGN_OR_RETURN(Tensor x2, As2d(x));
  Tensor pre2;
  DT_ASSIGN_OR_RETURN(Tensor y2, dtensor::LinearBias(x2, c.inputs[1], c.inputs[2], gelu, &pre2));
  const IntSpan lead = x.shape().subspan(0, static_cast<size_t>(x.dim() - 1));
  std::vector<Tensor> out;
  DT_ASSIGN_OR_RETURN(Tensor y, Unflatten(y2, lead, y2.size(1)));
  out.push_back(std::move(y));
  if (gelu) {
    DT_ASSIGN_OR_RETURN(Tensor pre, Unflatten(pre2, lead, pre2.size(1)));
    out.push_back(std::move(pre));
  }
  return out;
}
const OpDef kLinearBias = {"linear_bias", LinearBiasRule, LinearBiasMeta, LinearBiasLocal};
// The GELU form under its own name (args.ints = {1}), so that activation checkpointing policies
// can name it; selective checkpointing keeps its pre-activation only and rebuilds the
// activation from it (one GELU pass, no matrix multiply).
absl::StatusOr<std::vector<Value>> RebuildGelu(const Value& pre, const OpArgs&) {
  DT_ASSIGN_OR_RETURN(Value y, fn::Unary(UnaryOp::kGelu, pre));
  return std::vector<Value>{std::move(y), pre};
}
const OpDef kLinearBiasGelu = {"linear_bias_gelu", LinearBiasRule, LinearBiasMeta, LinearBiasLocal, RebuildGelu, 1};

// ---- linear_dx ----
absl::StatusOr<std::vector<TensorMeta>> LinearDxMeta(absl::Span<const TensorMeta> in, const OpArgs&) {
  const Shape& dy = in[0].shape;
  const Shape& w = in[1].shape;
  if (dy.empty() || w.size() != 2 || dy.back() != w[0]) {
    return op_util::Invalid("LinearInputGrad",
                            absl::StrCat("dy ", ShapeString(dy), " and w ", ShapeString(w), " do not fit"));
  }
  Shape out = dy;
  out.back() = w[1];
  return std::vector<TensorMeta>{{out, in[0].dtype}};
}
void LinearDxRule(absl::Span<const TensorMeta> in, const OpArgs&, IntSpan, std::vector<DimStrategy>* s) {
  LinearLikeRule(static_cast<int64_t>(in[0].shape.size()), s, true);
}
absl::StatusOr<std::vector<Tensor>> LinearDxLocal(const LocalCall& c) {
  const Tensor& dy = c.inputs[0];
  DT_ASSIGN_OR_RETURN(Tensor dy2, As2d(dy));
  DT_ASSIGN_OR_RETURN(Tensor dx2, dtensor::Matmul(dy2, c.inputs[1]));
  return One(Unflatten(dx2, dy.shape().subspan(0, static_cast<size_t>(dy.dim() - 1)), dx2.size(1)));
}
const OpDef kLinearDx = {"linear_dx", LinearDxRule, LinearDxMeta, LinearDxLocal};

// ---- linear_dw ----
absl::StatusOr<std::vector<TensorMeta>> LinearDwMeta(absl::Span<const TensorMeta> in, const OpArgs&) {
  const Shape& dy = in[0].shape;
  const Shape& x = in[1].shape;
  if (dy.empty() || dy.size() != x.size() || !std::equal(dy.begin(), dy.end() - 1, x.begin())) {
    return op_util::Invalid("LinearWeightGrad", absl::StrCat("dy ", ShapeString(dy), " and x ", ShapeString(x),
                                                             " must share their leading dims"));
  }
  return std::vector<TensorMeta>{{Shape{dy.back(), x.back()}, in[0].dtype}};
}
void LinearDwRule(absl::Span<const TensorMeta> in, const OpArgs&, IntSpan, std::vector<DimStrategy>* s) {
  const int64_t nd = static_cast<int64_t>(in[0].shape.size());
  for (int64_t d = 0; d + 1 < nd; ++d) s->push_back({{Shard(d), Shard(d)}, {kP}});
  s->push_back({{Shard(nd - 1), Replicate()}, {Shard(0)}});
  s->push_back({{Replicate(), Shard(nd - 1)}, {Shard(1)}});
  s->push_back({{kP, Replicate()}, {kP}});
  s->push_back({{Replicate(), kP}, {kP}});
}
absl::StatusOr<std::vector<Tensor>> LinearDwLocal(const LocalCall& c) {
  DT_ASSIGN_OR_RETURN(Tensor dy2, As2d(c.inputs[0]));
  DT_ASSIGN_OR_RETURN(Tensor x2, As2d(c.inputs[1]));
  return One(dtensor::Matmul(dy2, x2, /*trans_a=*/true, false));
}
const OpDef kLinearDw = {"linear_dw", LinearDwRule, LinearDwMeta, LinearDwLocal};

// ---- linear_dw_bias: (dy, x) -> (dw, db) ----
absl::StatusOr<std::vector<TensorMeta>> LinearDwBiasMeta(absl::Span<const TensorMeta> in, const OpArgs& args) {
  DT_ASSIGN_OR_RETURN(std::vector<TensorMeta> out, LinearDwMeta(in, args));
  out.push_back({Shape{in[0].shape.back()}, in[0].dtype});
  return out;
}
void LinearDwBiasRule(absl::Span<const TensorMeta> in, const OpArgs&, IntSpan, std::vector<DimStrategy>* s) {
  const int64_t nd = static_cast<int64_t>(in[0].shape.size());
  for (int64_t d = 0; d + 1 < nd; ++d) s->push_back({{Shard(d), Shard(d)}, {kP, kP}});
  s->push_back({{Shard(nd - 1), Replicate()}, {Shard(0), Shard(0)}});
  s->push_back({{Replicate(), Shard(nd - 1)}, {Shard(1), Replicate()}});
  s->push_back({{kP, Replicate()}, {kP, kP}});
  s->push_back({{Replicate(), kP}, {kP, Replicate()}});
}
absl::StatusOr<std::vector<Tensor>> LinearDwBiasLocal(const LocalCall& c) {
  DT_ASSIGN_OR_RETURN(Tensor dy2, As2d(c.inputs[0]));
  DT_ASSIGN_OR_RETURN(Tensor x2, As2d(c.inputs[1]));
  std::vector<Tensor> out(2);
  DT_ASSIGN_OR_RETURN(out[0], dtensor::LinearWeightBiasGrad(dy2, x2, &out[1]));
  return out;
}
const OpDef kLinearDwBias = {"linear_dw_bias", LinearDwBiasRule, LinearDwBiasMeta, LinearDwBiasLocal};

// ---- linear_dx_gelu: (dy, w, pre) -> (dpre, db) ----
absl::StatusOr<std::vector<TensorMeta>> LinearDxGeluMeta(absl::Span<const TensorMeta> in, const OpArgs& args) {
  DT_ASSIGN_OR_RETURN(std::vector<TensorMeta> out, LinearDxMeta(in.subspan(0, 2), args));
  if (in[2].shape != out[0].shape || in[2].dtype != in[0].dtype) {
    return op_util::Invalid(
        "LinearInputGradGelu",
        absl::StrCat("pre ", ShapeString(in[2].shape), " ", DTypeName(in[2].dtype), " does not fit the input gradient ",
                     ShapeString(out[0].shape), " ", DTypeName(in[0].dtype)));
  }
  out.push_back({Shape{out[0].shape.back()}, in[0].dtype});
  return out;
}
void LinearDxGeluRule(absl::Span<const TensorMeta> in, const OpArgs&, IntSpan, std::vector<DimStrategy>* s) {
  const int64_t nd = static_cast<int64_t>(in[0].shape.size());
  for (int64_t d = 0; d + 1 < nd; ++d) s->push_back({{Shard(d), Replicate(), Shard(d)}, {Shard(d), kP}});
  s->push_back({{Replicate(), Shard(1), Shard(nd - 1)}, {Shard(nd - 1), Shard(0)}});
  s->push_back({{Shard(nd - 1), Shard(0), Replicate()}, {kP, kP}});
  s->push_back({{kP, Replicate(), Replicate()}, {kP, kP}});
  s->push_back({{Replicate(), kP, Replicate()}, {kP, kP}});
}
absl::StatusOr<std::vector<Tensor>> LinearDxGeluLocal(const LocalCall& c) {
  const Tensor& dy = c.inputs[0];
  DT_ASSIGN_OR_RETURN(Tensor dy2, As2d(dy));
  DT_ASSIGN_OR_RETURN(Tensor pre2, As2d(c.inputs[2]));
  Tensor db;
  DT_ASSIGN_OR_RETURN(Tensor dpre2, dtensor::LinearInputGradGelu(dy2, c.inputs[1], pre2, &db));
  std::vector<Tensor> out;
  DT_ASSIGN_OR_RETURN(Tensor dpre,
                      Unflatten(dpre2, dy.shape().subspan(0, static_cast<size_t>(dy.dim() - 1)), dpre2.size(1)));
  out.push_back(std::move(dpre));
  out.push_back(std::move(db));
  return out;
}
const OpDef kLinearDxGelu = {"linear_dx_gelu", LinearDxGeluRule, LinearDxGeluMeta, LinearDxGeluLocal};

// ---- mlp_gelu: (x, w_fc, b_fc, w_proj, b_proj) -> (y, pre) ----
absl::StatusOr<std::vector<TensorMeta>> MlpGeluMeta(absl::Span<const TensorMeta> in, const OpArgs&) {
  OpArgs gelu;
  gelu.ints = {1};
  DT_ASSIGN_OR_RETURN(std::vector<TensorMeta> fc, LinearBiasMeta(in.subspan(0, 3), gelu));  // {h, pre}
  const TensorMeta proj_in[3] = {fc[0], in[3], in[4]};
  OpArgs plain;
  plain.ints = {0};
  DT_ASSIGN_OR_RETURN(std::vector<TensorMeta> out, LinearBiasMeta(proj_in, plain));  // {y}
  out.push_back(fc[1]);
  return out;
}
void MlpGeluRule(absl::Span<const TensorMeta> in, const OpArgs&, IntSpan, std::vector<DimStrategy>* s) {
  const int64_t nd = static_cast<int64_t>(in[0].shape.size());
  const Placement r = Replicate();
  for (int64_t d = 0; d + 1 < nd; ++d) s->push_back({{Shard(d), r, r, r, r}, {Shard(d), Shard(d)}});
  // Megatron: c_fc colwise, c_proj rowwise; the output a partial sum (b_proj made Partial
  // locally, no communication).
  s->push_back({{r, Shard(0), Shard(0), Shard(1), kP}, {kP, Shard(nd - 1)}});
}
absl::StatusOr<std::vector<Tensor>> MlpGeluLocal(const LocalCall& c) {
  const Tensor& x = c.inputs[0];
  DT_ASSIGN_OR_RETURN(Tensor x2, As2d(x));
  Tensor pre2;
  DT_ASSIGN_OR_RETURN(Tensor h2, dtensor::LinearBias(x2, c.inputs[1], c.inputs[2], /*gelu=*/true, &pre2));
  DT_ASSIGN_OR_RETURN(Tensor y2, dtensor::LinearBias(h2, c.inputs[3], c.inputs[4]));
  const IntSpan lead = x.shape().subspan(0, static_cast<size_t>(x.dim() - 1));
  std::vector<Tensor> out;
  DT_ASSIGN_OR_RETURN(Tensor y, Unflatten(y2, lead, y2.size(1)));
  out.push_back(std::move(y));
  DT_ASSIGN_OR_RETURN(Tensor pre, Unflatten(pre2, lead, pre2.size(1)));
  out.push_back(std::move(pre));
  return out;
}
// Selective activation checkpointing keeps both outputs (y and the pre-activation; the backward
// rebuilds gelu(pre) itself), so no ac_rebuild.
const OpDef kMlpGelu = {"mlp_gelu", MlpGeluRule, MlpGeluMeta, MlpGeluLocal};

// ---- matmul: args.ints = {trans_a, trans_b} ----
struct MatDims {
  int64_t na, nb, am, ak, bk, bn;
  MatDims(const Shape& a, const Shape& b, const OpArgs& args) {
    na = static_cast<int64_t>(a.size());
    nb = static_cast<int64_t>(b.size());
    const bool ta = args.ints[0] != 0, tb = args.ints[1] != 0;
    am = ta ? na - 1 : na - 2;
    ak = ta ? na - 2 : na - 1;
    bk = tb ? nb - 1 : nb - 2;
    bn = tb ? nb - 2 : nb - 1;
  }
};
absl::StatusOr<std::vector<TensorMeta>> MatmulMeta(absl::Span<const TensorMeta> in, const OpArgs& args) {
  const Shape& a = in[0].shape;
  const Shape& b = in[1].shape;
  auto bad = [&] {
    return op_util::Invalid("Matmul", absl::StrCat("a ", ShapeString(a), " and b ", ShapeString(b), " (trans ",
                                                   args.ints[0], ", ", args.ints[1], ") do not fit"));
  };
  if (a.size() < 2 || b.size() < 2 || (b.size() != 2 && b.size() != a.size())) return bad();
  MatDims m(a, b, args);
  if (a[static_cast<size_t>(m.ak)] != b[static_cast<size_t>(m.bk)]) return bad();
  if (b.size() == a.size() && !std::equal(a.begin(), a.end() - 2, b.begin())) return bad();
  Shape out(a.begin(), a.end() - 2);
  out.push_back(a[static_cast<size_t>(m.am)]);
  out.push_back(b[static_cast<size_t>(m.bn)]);
  return std::vector<TensorMeta>{{out, in[0].dtype}};
}
void MatmulRule(absl::Span<const TensorMeta> in, const OpArgs& args, IntSpan, std::vector<DimStrategy>* s) {
  MatDims m(in[0].shape, in[1].shape, args);
  for (int64_t d = 0; d + 2 < m.na; ++d) {
    s->push_back({{Shard(d), m.nb == m.na ? Placement(Shard(d)) : Placement(Replicate())}, {Shard(d)}});
  }
  s->push_back({{Shard(m.am), Replicate()}, {Shard(m.na - 2)}});
  s->push_back({{Replicate(), Shard(m.bn)}, {Shard(m.na - 1)}});
  s->push_back({{Shard(m.ak), Shard(m.bk)}, {kP}});
  s->push_back({{kP, Replicate()}, {kP}});
  s->push_back({{Replicate(), kP}, {kP}});
}
absl::StatusOr<std::vector<Tensor>> MatmulLocal(const LocalCall& c) {
  return One(dtensor::Matmul(c.inputs[0], c.inputs[1], c.args.ints[0] != 0, c.args.ints[1] != 0));
}
const OpDef kMatmul = {"matmul", MatmulRule, MatmulMeta, MatmulLocal};

}  // namespace

namespace fn {
absl::StatusOr<Value> Linear(const Value& x, const Value& w) { return op_util::First(Dispatch(kLinear, {x, w})); }
absl::StatusOr<Value> LinearInputGrad(const Value& dy, const Value& w) {
  return op_util::First(Dispatch(kLinearDx, {dy, w}));
}
absl::StatusOr<Value> LinearWeightGrad(const Value& dy, const Value& x) {
  return op_util::First(Dispatch(kLinearDw, {dy, x}));
}
absl::StatusOr<std::vector<Value>> LinearWeightBiasGrad(const Value& dy, const Value& x) {
  return Dispatch(kLinearDwBias, {dy, x});
}
absl::StatusOr<std::vector<Value>> LinearInputGradGelu(const Value& dy, const Value& w, const Value& pre) {
  return Dispatch(kLinearDxGelu, {dy, w, pre});
}
absl::StatusOr<Value> Matmul(const Value& a, const Value& b, bool trans_a, bool trans_b) {
  OpArgs args;
  args.ints = {trans_a ? 1 : 0, trans_b ? 1 : 0};
  return op_util::First(Dispatch(kMatmul, {a, b}, args));
}
}  // namespace fn

namespace {
// The weight and bias gradients of a Linear whose output gradient is g and input x, as `nw` and
// `nb` ask: both from one kernel (linear_dw_bias) when both are needed.
absl::Status WeightBiasGrads(const Value& g, const Value& x, bool nw, bool nb, const std::vector<int64_t>& bshape,
                             Value* dw, Value* db) {
  if (nw && nb) {
    DT_ASSIGN_OR_RETURN(std::vector<Value> both, fn::LinearWeightBiasGrad(g, x));
    *dw = std::move(both[0]);
    *db = std::move(both[1]);
    return absl::OkStatus();
  }
  if (nw) {
    DT_ASSIGN_OR_RETURN(*dw, fn::LinearWeightGrad(g, x));
  }
  if (nb) {
    DT_ASSIGN_OR_RETURN(*db, fn::SumTo(g, bshape));
  }
  return absl::OkStatus();
}
}  // namespace

absl::StatusOr<Variable> Linear(const Variable& x, const Variable& w, const Variable& b) {
  const bool has_bias = b.defined();
  Value y;
  if (has_bias) {  // the bias added by the matrix multiply's epilogue
    OpArgs args;
    args.ints = {0};
    DT_ASSIGN_OR_RETURN(y, op_util::First(Dispatch(kLinearBias, {x.value(), w.value(), b.value()}, args)));
  } else {
    DT_ASSIGN_OR_RETURN(y, fn::Linear(x.value(), w.value()));
  }
  Variable none;
  if (!AnyRequiresGrad({x, w, has_bias ? b : none})) return Variable::Leaf(std::move(y));  // no tape: skip the captures
  return op_util::Result1("Linear", {x, w, has_bias ? b : none}, std::move(y),
                          [xv = x.value(), wv = w.value(), nx = x.requires_grad(), nw = w.requires_grad(),
                           nb = has_bias && b.requires_grad(),
                           bshape = has_bias ? op_util::ToVec(b.value().shape()) : std::vector<int64_t>{}](
                              const Value& g) -> absl::StatusOr<std::vector<Value>> {
                            std::vector<Value> r(3);
                            if (nx) {
                              DT_ASSIGN_OR_RETURN(r[0], fn::LinearInputGrad(g, wv));
                            }
                            DT_RETURN_IF_ERROR(WeightBiasGrads(g, xv, nw, nb, bshape, &r[1], &r[2]));
                            return r;
                          });
}

absl::StatusOr<Variable> LinearGelu(const Variable& x, const Variable& w, const Variable& b) {
  if (!b.defined()) return absl::InvalidArgumentError("[LinearGelu] needs a bias (use Gelu(Linear(x, w)) without)");
  OpArgs args;
  args.ints = {1};
  DT_ASSIGN_OR_RETURN(std::vector<Value> yp, Dispatch(kLinearBiasGelu, {x.value(), w.value(), b.value()}, args));
  if (!AnyRequiresGrad({x, w, b})) return Variable::Leaf(std::move(yp[0]));  // no tape: skip the captures
  return op_util::Result1("LinearGelu", {x, w, b}, std::move(yp[0]),
                          [xv = x.value(), wv = w.value(), pre = yp[1], nx = x.requires_grad(), nw = w.requires_grad(),
                           nb = b.requires_grad(), bshape = op_util::ToVec(b.value().shape())](
                              const Value& g) -> absl::StatusOr<std::vector<Value>> {
                            DT_ASSIGN_OR_RETURN(Value dpre, fn::UnaryBackward(UnaryOp::kGelu, g, pre));
                            std::vector<Value> r(3);
                            if (nx) {
                              DT_ASSIGN_OR_RETURN(r[0], fn::LinearInputGrad(dpre, wv));
                            }
                            DT_RETURN_IF_ERROR(WeightBiasGrads(dpre, xv, nw, nb, bshape, &r[1], &r[2]));
                            return r;
                          });
}

absl::StatusOr<Variable> MlpGelu(const Variable& x, const Variable& w_fc, const Variable& b_fc, const Variable& w_proj,
                                 const Variable& b_proj) {
  if (!b_fc.defined() || !b_proj.defined()) {
    return absl::InvalidArgumentError("[MlpGelu] needs both biases (use Linear and Gelu without)");
  }
  DT_ASSIGN_OR_RETURN(std::vector<Value> yp,
                      Dispatch(kMlpGelu, {x.value(), w_fc.value(), b_fc.value(), w_proj.value(), b_proj.value()}));
  if (!AnyRequiresGrad({x, w_fc, b_fc, w_proj, b_proj})) return Variable::Leaf(std::move(yp[0]));
  // Kept for the backward: x, the weights and the pre-activation (not gelu(pre): rebuilt there
  // with one GELU pass, which saves [..., 4C] per MLP, as llm.c's GELU recompute).
  return op_util::Result1(
      "MlpGelu", {x, w_fc, b_fc, w_proj, b_proj}, std::move(yp[0]),
      [xv = x.value(), wfc = w_fc.value(), wproj = w_proj.value(), pre = yp[1], nx = x.requires_grad(),
       nwfc = w_fc.requires_grad(), nbfc = b_fc.requires_grad(), nwproj = w_proj.requires_grad(),
       nbproj = b_proj.requires_grad(),
       bshape = op_util::ToVec(b_proj.value().shape())](const Value& g) -> absl::StatusOr<std::vector<Value>> {
        std::vector<Value> r(5);
        if (nwproj) {
          DT_ASSIGN_OR_RETURN(Value h, fn::Unary(UnaryOp::kGelu, pre));
          DT_RETURN_IF_ERROR(WeightBiasGrads(g, h, nwproj, nbproj, bshape, &r[3], &r[4]));
        } else if (nbproj) {
          DT_ASSIGN_OR_RETURN(r[4], fn::SumTo(g, bshape));
        }
        if (!nx && !nwfc && !nbfc) return r;
        // The gradient of the pre-activation and of b_fc, from c_proj's input-gradient product.
        DT_ASSIGN_OR_RETURN(std::vector<Value> dpre, fn::LinearInputGradGelu(g, wproj, pre));
        if (nx) {
          DT_ASSIGN_OR_RETURN(r[0], fn::LinearInputGrad(dpre[0], wfc));
        }
        if (nwfc) {
          DT_ASSIGN_OR_RETURN(r[1], fn::LinearWeightGrad(dpre[0], xv));
        }
        if (nbfc) r[2] = std::move(dpre[1]);
        return r;
      });
}

absl::StatusOr<Variable> Matmul(const Variable& a, const Variable& b, bool ta, bool tb) {
  DT_ASSIGN_OR_RETURN(Value y, fn::Matmul(a.value(), b.value(), ta, tb));
  if (!AnyRequiresGrad({a, b})) return Variable::Leaf(std::move(y));  // no tape: skip the captures
  return op_util::Result1("Matmul", {a, b}, std::move(y),
                          [av = a.value(), bv = b.value(), ta, tb, na = a.requires_grad(),
                           nb = b.requires_grad()](const Value& g) -> absl::StatusOr<std::vector<Value>> {
                            std::vector<Value> r(2);
                            if (na) {  // d op(a) = g op(b)^T
                              if (!ta) {
                                DT_ASSIGN_OR_RETURN(r[0], fn::Matmul(g, bv, false, !tb));
                              } else if (bv.dim() == 2 && g.dim() > 2) {
                                DT_ASSIGN_OR_RETURN(Value t, fn::Matmul(g, bv, false, !tb));
                                DT_ASSIGN_OR_RETURN(r[0], fn::Transpose(t, -1, -2));
                              } else {
                                DT_ASSIGN_OR_RETURN(r[0], fn::Matmul(bv, g, tb, true));
                              }
                            }
                            if (nb) {  // d op(b) = op(a)^T g, summed over batch dims when b is 2-d
                              Value t;
                              if (!tb) {
                                DT_ASSIGN_OR_RETURN(t, fn::Matmul(av, g, !ta, false));
                              } else {
                                DT_ASSIGN_OR_RETURN(t, fn::Matmul(g, av, true, ta));
                              }
                              DT_ASSIGN_OR_RETURN(r[1], fn::SumTo(t, op_util::ToVec(bv.shape())));
                            }
                            return r;
                          });
}

namespace op_defs {
const OpDef& Linear() { return kLinear; }
const OpDef& LinearBias() { return kLinearBias; }
const OpDef& LinearBiasGelu() { return kLinearBiasGelu; }
const OpDef& LinearDx() { return kLinearDx; }
const OpDef& LinearDw() { return kLinearDw; }
const OpDef& LinearDwBias() { return kLinearDwBias; }
const OpDef& LinearDxGelu() { return kLinearDxGelu; }
const OpDef& MlpGelu() { return kMlpGelu; }
const OpDef& Matmul() { return kMatmul; }
}  // namespace op_defs

}  // namespace dtensor
