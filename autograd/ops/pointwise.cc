// Pointwise ops: binary (broadcasting), with a scalar, unary, their backward, dropout.
//
// Sharding rule: every output dim may be sharded when each input either has that dim at full
// size (sharded alike) or broadcasts it (replicated). Linear ops pass Partial through:
// P + P -> P for add/sub, P * R -> P for mul (and P / R for div), -P, s * P.
#include <cmath>

#include "dtensor/autograd/functional.h"
#include "dtensor/autograd/ops.h"
#include "dtensor/autograd/ops/op_util.h"

namespace dtensor {
namespace {

using op_util::One;

const Placement kPSum = Partial(PartialOp::kSum);

// Shard strategies of pointwise ops whose inputs broadcast to `out`.
void BroadcastShards(absl::Span<const TensorMeta> in, IntSpan out, size_t num_outputs, std::vector<DimStrategy>* s) {
  const int64_t nd = static_cast<int64_t>(out.size());
  for (int64_t d = 0; d < nd; ++d) {
    DimStrategy st;
    bool any = false;
    for (const TensorMeta& m : in) {
      const int64_t di = d - (nd - static_cast<int64_t>(m.shape.size()));
      if (di >= 0 && m.shape[static_cast<size_t>(di)] == out[static_cast<size_t>(d)]) {
        st.inputs.push_back(Shard(di));
        any = true;
      } else {
        st.inputs.push_back(Replicate());
      }
    }
    if (!any) continue;
    st.outputs.assign(num_outputs, Shard(d));
    s->push_back(st);
  }
}

// ---- Binary ----
absl::StatusOr<std::vector<TensorMeta>> BinaryMeta(absl::Span<const TensorMeta> in, const OpArgs&) {
  DT_ASSIGN_OR_RETURN(Shape out, BroadcastShapes("Binary", in[0].shape, in[1].shape));
  if (in[0].dtype != in[1].dtype) {
    return op_util::Invalid("Binary",
                            absl::StrCat("dtypes differ: ", DTypeName(in[0].dtype), " and ", DTypeName(in[1].dtype)));
  }
  return std::vector<TensorMeta>{{out, in[0].dtype}};
}
void BinaryRule(absl::Span<const TensorMeta> in, const OpArgs& args, IntSpan, std::vector<DimStrategy>* s) {
  auto out = BroadcastShapes("Binary", in[0].shape, in[1].shape);
  if (!out.ok()) return;
  BroadcastShards(in, *out, 1, s);
  const auto op = static_cast<BinaryOp>(args.ints[0]);
  if (op == BinaryOp::kAdd || op == BinaryOp::kSub) {
    s->push_back({{kPSum, kPSum}, {kPSum}});
    // (Integers: the average truncates, so the parts' averages do not add up: two P(avg)
    // of parts (1, 0) are 0 each, but the parts' sums (2, 0) average to 1.)
    if (IsComputeFloat(in[0].dtype)) {
      const Placement avg = Partial(PartialOp::kAvg);
      s->push_back({{avg, avg}, {avg}});
    }
  } else if (op == BinaryOp::kMul) {
    s->push_back({{kPSum, Replicate()}, {kPSum}});
    s->push_back({{Replicate(), kPSum}, {kPSum}});
  } else if (op == BinaryOp::kDiv && IsComputeFloat(in[0].dtype)) {
    // (Integers: each part's quotient would be truncated apart, and their sum is not the
    // sum's quotient.)
    s->push_back({{kPSum, Replicate()}, {kPSum}});
  }
}
absl::StatusOr<std::vector<Tensor>> BinaryLocal(const LocalCall& c) {
  return One(dtensor::Binary(static_cast<BinaryOp>(c.args.ints[0]), c.inputs[0], c.inputs[1]));
}
const OpDef kBinary = {"binary", BinaryRule, BinaryMeta, BinaryLocal};

// ---- Binary with a scalar ----
absl::StatusOr<std::vector<TensorMeta>> SameMeta(absl::Span<const TensorMeta> in, const OpArgs&) {
  return std::vector<TensorMeta>{in[0]};
}
void ScalarRule(absl::Span<const TensorMeta> in, const OpArgs& args, IntSpan, std::vector<DimStrategy>* s) {
  BroadcastShards(in.subspan(0, 1), in[0].shape, 1, s);
  const auto op = static_cast<BinaryOp>(args.ints[0]);
  const bool scalar_first = args.ints[1] != 0;
  // Linear in the partial values, so each part can be scaled apart: for integers only a
  // multiply by a whole number (each part's product by 2.5, or quotient by 4, is truncated
  // apart: 3 * 2.5 + 9 * 2.5 -> 7 + 22, not 30).
  // (Partial(avg) of integers: the average itself truncates, (1 + 2) / 2 * 2 = 2 but
  // (2 + 4) / 2 = 3, so it keeps Partial for floats only.)
  const double k = args.floats[0];
  const bool is_float = IsComputeFloat(in[0].dtype);
  const bool exact = is_float || (op == BinaryOp::kMul && std::floor(k) == k);
  if (exact && (op == BinaryOp::kMul || (op == BinaryOp::kDiv && !scalar_first))) {
    s->push_back({{kPSum}, {kPSum}});
    if (is_float) s->push_back({{Partial(PartialOp::kAvg)}, {Partial(PartialOp::kAvg)}});
  }
}
absl::StatusOr<std::vector<Tensor>> ScalarLocal(const LocalCall& c) {
  return One(
      dtensor::BinaryScalar(static_cast<BinaryOp>(c.args.ints[0]), c.inputs[0], c.args.floats[0], c.args.ints[1] != 0));
}
const OpDef kScalar = {"binary_scalar", ScalarRule, SameMeta, ScalarLocal};

// ---- Unary ----
void UnaryRule(absl::Span<const TensorMeta> in, const OpArgs& args, IntSpan, std::vector<DimStrategy>* s) {
  BroadcastShards(in.subspan(0, 1), in[0].shape, 1, s);
  if (static_cast<UnaryOp>(args.ints[0]) == UnaryOp::kNeg) {
    s->push_back({{kPSum}, {kPSum}});
    s->push_back({{Partial(PartialOp::kAvg)}, {Partial(PartialOp::kAvg)}});
  }
}
absl::StatusOr<std::vector<Tensor>> UnaryLocal(const LocalCall& c) {
  return One(dtensor::Unary(static_cast<UnaryOp>(c.args.ints[0]), c.inputs[0]));
}
const OpDef kUnary = {"unary", UnaryRule, SameMeta, UnaryLocal};

// ---- dy * f'(x) ----
absl::StatusOr<std::vector<TensorMeta>> UnaryBackwardMeta(absl::Span<const TensorMeta> in, const OpArgs&) {
  if (in[0].shape != in[1].shape) {
    return op_util::Invalid(
        "UnaryBackward", absl::StrCat("dy ", ShapeString(in[0].shape), " and x ", ShapeString(in[1].shape), " differ"));
  }
  return std::vector<TensorMeta>{in[0]};
}
void UnaryBackwardRule(absl::Span<const TensorMeta> in, const OpArgs&, IntSpan, std::vector<DimStrategy>* s) {
  BroadcastShards(in, in[0].shape, 1, s);
  s->push_back({{kPSum, Replicate()}, {kPSum}});  // linear in dy
}
absl::StatusOr<std::vector<Tensor>> UnaryBackwardLocal(const LocalCall& c) {
  return One(dtensor::UnaryBackward(static_cast<UnaryOp>(c.args.ints[0]), c.inputs[0], c.inputs[1]));
}
const OpDef kUnaryBackward = {"unary_backward", UnaryBackwardRule, UnaryBackwardMeta, UnaryBackwardLocal};

// ---- Dropout: y = x * mask, mask = (u >= p) / (1 - p), u uniform from (seed, global index) ----
absl::StatusOr<std::vector<TensorMeta>> DropoutMeta(absl::Span<const TensorMeta> in, const OpArgs&) {
  return std::vector<TensorMeta>{in[0], in[0]};
}
void DropoutRule(absl::Span<const TensorMeta> in, const OpArgs&, IntSpan, std::vector<DimStrategy>* s) {
  BroadcastShards(in, in[0].shape, 2, s);
}
absl::StatusOr<std::vector<Tensor>> DropoutLocal(const LocalCall& c) {
  const Tensor& x = c.inputs[0];
  const double p = c.args.floats[0];
  DT_ASSIGN_OR_RETURN(Tensor u, Tensor::Empty(x.shape(), DType::kFloat32, x.device()));
  RandomSpec spec;
  spec.kind = RandomSpec::Kind::kUniform;
  spec.seed = static_cast<uint64_t>(c.args.ints[0]);
  DT_RETURN_IF_ERROR(FillRandom_(u, spec, c.input_meta[0].shape, c.InputOffset(0)));
  // mask = (u >= p) / (1 - p) = (max(u - p, 0) > 0) ...: computed as step(u - p) / (1 - p).
  DT_ASSIGN_OR_RETURN(Tensor shifted, dtensor::AddScalar(u, -p));
  DT_ASSIGN_OR_RETURN(Tensor pos, dtensor::Relu(shifted));
  // step(z) for z in [0, 1): z / z where z > 0 else 0 — use ceil-free form: min(z * huge, 1).
  DT_ASSIGN_OR_RETURN(Tensor big, dtensor::Scale(pos, 1e30));
  DT_ASSIGN_OR_RETURN(Tensor step, dtensor::BinaryScalar(BinaryOp::kMin, big, 1.0));
  DT_ASSIGN_OR_RETURN(Tensor mask32, dtensor::Scale(step, 1.0 / (1.0 - p)));
  DT_ASSIGN_OR_RETURN(Tensor mask, Cast(mask32, x.dtype()));
  DT_ASSIGN_OR_RETURN(Tensor y, dtensor::Mul(x, mask));
  return std::vector<Tensor>{y, mask};
}
const OpDef kDropout = {"dropout", DropoutRule, DropoutMeta, DropoutLocal};

bool NeedsGrad(const Variable& v) { return v.requires_grad(); }

}  // namespace

namespace fn {

absl::StatusOr<Value> Binary(BinaryOp op, const Value& a, const Value& b) {
  OpArgs args;
  args.ints.push_back(static_cast<int64_t>(op));
  return op_util::First(Dispatch(kBinary, {a, b}, args));
}

namespace {
// Whether casting each part of a Partial(op) value from `from` to `to` and then reducing gives
// the cast of the reduced value (up to the rounding of each part, which PyTorch's per-piece
// cast also has). max / min: a cast monotone over all values (not to bool: bool(-1) > bool(0);
// not a narrowing integer cast, which wraps: int64 2^31 -> int32 -2^31 < 7; not float to
// integer, out of range; not to e4m3, whose overflow is NaN): widening integer to integer,
// integer to float, float to float (rounding keeps the order; overflow goes to inf). sum: to a
// float, or between integers (wrapping arithmetic commutes with narrowing). avg: between
// floats only (an integer average truncates; a float to integer cast truncates each part).
bool CastKeepsPartial(PartialOp op, DType from, DType to) {
  const auto is_float = [](DType t) { return IsComputeFloat(t) || IsFloat8(t); };
  const auto is_int = [](DType t) { return t == DType::kInt32 || t == DType::kInt64; };
  if (from == DType::kBool || to == DType::kBool) return false;
  switch (op) {
    case PartialOp::kMax:
    case PartialOp::kMin:
      if (to == DType::kFloat8E4M3) return false;  // overflow -> NaN (no inf in e4m3fn)
      if (is_int(to)) return is_int(from) && ElementSize(to) >= ElementSize(from);
      return is_float(to) && (is_int(from) || is_float(from));
    case PartialOp::kSum:
      return is_float(to) || (is_int(from) && is_int(to));
    case PartialOp::kAvg:
      return is_float(from) && is_float(to);
  }
  return false;
}
}  // namespace

absl::StatusOr<Value> Cast(const Value& x, DType dtype) {
  if (x.dtype() == dtype) return x;
  if (!x.is_dtensor()) {
    DT_ASSIGN_OR_RETURN(Tensor local, dtensor::Cast(x.local(), dtype));
    return Value(std::move(local));
  }
  DTensor d = x.dtensor();
  // A Partial the cast does not commute with is reduced first (float32 P(sum) parts 0.5 and
  // 0.75 cast to int64 would give 0 + 0 for the 1.25 whose cast is 1).
  Layout reduced = d.layout();
  for (int m = 0; m < reduced.ndim(); ++m) {
    if (reduced[m].is_partial() && !CastKeepsPartial(reduced[m].partial_op(), x.dtype(), dtype)) {
      reduced = reduced.WithPlacement(m, Replicate());
    }
  }
  if (reduced != d.layout()) {
    DT_ASSIGN_OR_RETURN(d, d.Redistribute(reduced));
  }
  DT_ASSIGN_OR_RETURN(Tensor local, dtensor::Cast(d.ToLocal(), dtype));
  return Value(DTensor::WrapTrusted(std::move(local), d.mesh(), d.layout(), Shape(d.shape().begin(), d.shape().end())));
}

absl::StatusOr<Value> BinaryScalar(BinaryOp op, const Value& a, double s, bool scalar_first) {
  OpArgs args;
  args.ints = {static_cast<int64_t>(op), scalar_first ? 1 : 0};
  args.floats.push_back(s);
  return op_util::First(Dispatch(kScalar, {a}, args));
}

absl::StatusOr<Value> Unary(UnaryOp op, const Value& x) {
  OpArgs args;
  args.ints.push_back(static_cast<int64_t>(op));
  return op_util::First(Dispatch(kUnary, {x}, args));
}

absl::StatusOr<Value> UnaryBackward(UnaryOp op, const Value& dy, const Value& x) {
  OpArgs args;
  args.ints.push_back(static_cast<int64_t>(op));
  return op_util::First(Dispatch(kUnaryBackward, {dy, x}, args));
}

namespace {
absl::StatusOr<Value> FilledLike(const Value& x, double v) {
  DT_ASSIGN_OR_RETURN(Tensor t, Full(x.local().shape(), v, x.dtype(), x.device()));
  if (!x.is_dtensor()) return Value(t);
  Layout l = x.dtensor().layout();
  for (int m = 0; m < l.ndim(); ++m) {
    if (l[m].is_partial()) l = l.WithPlacement(m, Replicate());
  }
  return Value(DTensor::WrapTrusted(t, x.dtensor().mesh(), l, op_util::ToShape(x.shape())));
}
}  // namespace

absl::StatusOr<Value> OnesLike(const Value& x) { return FilledLike(x, 1.0); }
absl::StatusOr<Value> ZerosLike(const Value& x) { return FilledLike(x, 0.0); }

absl::StatusOr<Value> Dropout(const Value& x, double p, uint64_t seed) {
  if (p < 0 || p >= 1) return op_util::Invalid("Dropout", absl::StrCat("p must be in [0, 1), got ", p));
  if (p == 0) return x;
  OpArgs args;
  args.ints.push_back(static_cast<int64_t>(seed));
  args.floats.push_back(p);
  return op_util::First(Dispatch(kDropout, {x}, args));
}

}  // namespace fn

// ---- Differentiable versions ----

absl::StatusOr<Variable> Add(const Variable& a, const Variable& b) {
  DT_ASSIGN_OR_RETURN(Value y, fn::Add(a.value(), b.value()));
  if (!AnyRequiresGrad({a, b})) return Variable::Leaf(std::move(y));  // no tape: skip the captures
  return op_util::Result1("Add", {a, b}, std::move(y),
                          [sa = op_util::ToVec(a.value().shape()), sb = op_util::ToVec(b.value().shape()),
                           na = NeedsGrad(a), nb = NeedsGrad(b)](const Value& g) -> absl::StatusOr<std::vector<Value>> {
                            std::vector<Value> r(2);
                            if (na) {
                              DT_ASSIGN_OR_RETURN(r[0], fn::SumTo(g, sa));
                            }
                            if (nb) {
                              DT_ASSIGN_OR_RETURN(r[1], fn::SumTo(g, sb));
                            }
                            return r;
                          });
}

absl::StatusOr<Variable> Sub(const Variable& a, const Variable& b) {
  DT_ASSIGN_OR_RETURN(Value y, fn::Sub(a.value(), b.value()));
  if (!AnyRequiresGrad({a, b})) return Variable::Leaf(std::move(y));  // no tape: skip the captures
  return op_util::Result1("Sub", {a, b}, std::move(y),
                          [sa = op_util::ToVec(a.value().shape()), sb = op_util::ToVec(b.value().shape()),
                           na = NeedsGrad(a), nb = NeedsGrad(b)](const Value& g) -> absl::StatusOr<std::vector<Value>> {
                            std::vector<Value> r(2);
                            if (na) {
                              DT_ASSIGN_OR_RETURN(r[0], fn::SumTo(g, sa));
                            }
                            if (nb) {
                              DT_ASSIGN_OR_RETURN(Value n, fn::Unary(UnaryOp::kNeg, g));
                              DT_ASSIGN_OR_RETURN(r[1], fn::SumTo(n, sb));
                            }
                            return r;
                          });
}

absl::StatusOr<Variable> Mul(const Variable& a, const Variable& b) {
  DT_ASSIGN_OR_RETURN(Value y, fn::Mul(a.value(), b.value()));
  if (!AnyRequiresGrad({a, b})) return Variable::Leaf(std::move(y));  // no tape: skip the captures
  return op_util::Result1("Mul", {a, b}, std::move(y),
                          [av = a.value(), bv = b.value(), na = NeedsGrad(a),
                           nb = NeedsGrad(b)](const Value& g) -> absl::StatusOr<std::vector<Value>> {
                            std::vector<Value> r(2);
                            if (na) {
                              DT_ASSIGN_OR_RETURN(Value t, fn::Mul(g, bv));
                              DT_ASSIGN_OR_RETURN(r[0], fn::SumTo(t, op_util::ToVec(av.shape())));
                            }
                            if (nb) {
                              DT_ASSIGN_OR_RETURN(Value t, fn::Mul(g, av));
                              DT_ASSIGN_OR_RETURN(r[1], fn::SumTo(t, op_util::ToVec(bv.shape())));
                            }
                            return r;
                          });
}

absl::StatusOr<Variable> Div(const Variable& a, const Variable& b) {
  DT_ASSIGN_OR_RETURN(Value y, fn::Div(a.value(), b.value()));
  if (!AnyRequiresGrad({a, b})) return Variable::Leaf(y);  // no tape: skip the captures
  return op_util::Result1("Div", {a, b}, y,
                          [y, sa = op_util::ToVec(a.value().shape()), bv = b.value(), na = NeedsGrad(a),
                           nb = NeedsGrad(b)](const Value& g) -> absl::StatusOr<std::vector<Value>> {
                            std::vector<Value> r(2);
                            DT_ASSIGN_OR_RETURN(Value gb, fn::Div(g, bv));  // g / b
                            if (na) {
                              DT_ASSIGN_OR_RETURN(r[0], fn::SumTo(gb, sa));
                            }
                            if (nb) {  // -g a / b^2 = -(g / b) * y
                              DT_ASSIGN_OR_RETURN(Value t, fn::Mul(gb, y));
                              DT_ASSIGN_OR_RETURN(Value n, fn::Unary(UnaryOp::kNeg, t));
                              DT_ASSIGN_OR_RETURN(r[1], fn::SumTo(n, op_util::ToVec(bv.shape())));
                            }
                            return r;
                          });
}

absl::StatusOr<Variable> Scale(const Variable& a, double s) {
  DT_ASSIGN_OR_RETURN(Value y, fn::Scale(a.value(), s));
  if (!AnyRequiresGrad({a})) return Variable::Leaf(std::move(y));  // no tape: skip the captures
  return op_util::Result1("Scale", {a}, std::move(y), [s](const Value& g) -> absl::StatusOr<std::vector<Value>> {
    DT_ASSIGN_OR_RETURN(Value r, fn::Scale(g, s));
    return std::vector<Value>{r};
  });
}

absl::StatusOr<Variable> Cast(const Variable& x, DType dtype) {
  if (x.value().dtype() == dtype) return x;
  DT_ASSIGN_OR_RETURN(Value y, fn::Cast(x.value(), dtype));
  if (!AnyRequiresGrad({x})) return Variable::Leaf(std::move(y));  // no tape: skip the captures
  return op_util::Result1("Cast", {x}, std::move(y),
                          [from = x.value().dtype()](const Value& g) -> absl::StatusOr<std::vector<Value>> {
                            DT_ASSIGN_OR_RETURN(Value r, fn::Cast(g, from));
                            return std::vector<Value>{r};
                          });
}

absl::StatusOr<Variable> AddScalar(const Variable& a, double s) {
  DT_ASSIGN_OR_RETURN(Value y, fn::AddScalar(a.value(), s));
  if (!AnyRequiresGrad({a})) return Variable::Leaf(std::move(y));  // no tape: skip the captures
  return op_util::Result1("AddScalar", {a}, std::move(y),
                          [](const Value& g) -> absl::StatusOr<std::vector<Value>> { return std::vector<Value>{g}; });
}

absl::StatusOr<Variable> Unary(UnaryOp op, const Variable& x) {
  DT_ASSIGN_OR_RETURN(Value y, fn::Unary(op, x.value()));
  if (op == UnaryOp::kNeg) {
    if (!AnyRequiresGrad({x})) return Variable::Leaf(std::move(y));  // no tape: skip the captures
    return op_util::Result1("Neg", {x}, std::move(y), [](const Value& g) -> absl::StatusOr<std::vector<Value>> {
      DT_ASSIGN_OR_RETURN(Value r, fn::Unary(UnaryOp::kNeg, g));
      return std::vector<Value>{r};
    });
  }
  if (op != UnaryOp::kGelu && op != UnaryOp::kRelu && op != UnaryOp::kTanh && op != UnaryOp::kExp &&
      op != UnaryOp::kLog && op != UnaryOp::kSqrt) {
    if (AnyRequiresGrad({x})) {
      return absl::UnimplementedError(
          absl::StrCat("[Unary] no gradient for unary op ", static_cast<int>(op), "; use it under NoGradGuard"));
    }
    return Variable::Leaf(std::move(y));
  }
  if (!AnyRequiresGrad({x})) return Variable::Leaf(std::move(y));  // no tape: skip the captures
  return op_util::Result1("Unary", {x}, std::move(y),
                          [op, xv = x.value()](const Value& g) -> absl::StatusOr<std::vector<Value>> {
                            DT_ASSIGN_OR_RETURN(Value r, fn::UnaryBackward(op, g, xv));
                            return std::vector<Value>{r};
                          });
}

absl::StatusOr<Variable> Dropout(const Variable& x, double p, uint64_t seed, bool training) {
  if (!training || p == 0) return x;
  if (p < 0 || p >= 1) return op_util::Invalid("Dropout", absl::StrCat("p must be in [0, 1), got ", p));
  OpArgs args;
  args.ints.push_back(static_cast<int64_t>(seed));
  args.floats.push_back(p);
  DT_ASSIGN_OR_RETURN(std::vector<Value> ym, Dispatch(kDropout, {x.value()}, args));
  if (!AnyRequiresGrad({x})) return Variable::Leaf(ym[0]);  // no tape: skip the captures
  return op_util::Result1("Dropout", {x}, ym[0], [mask = ym[1]](const Value& g) -> absl::StatusOr<std::vector<Value>> {
    DT_ASSIGN_OR_RETURN(Value r, fn::Mul(g, mask));
    return std::vector<Value>{r};
  });
}

namespace op_defs {
const OpDef& Binary() { return kBinary; }
const OpDef& Scalar() { return kScalar; }
const OpDef& Unary() { return kUnary; }
const OpDef& UnaryBackward() { return kUnaryBackward; }
const OpDef& Dropout() { return kDropout; }
}  // namespace op_defs

}  // namespace dtensor
