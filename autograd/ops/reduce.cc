// Reductions (sum, mean, max, min), their backward (broadcast back, ties split evenly for
// max/min), and SumTo (the gradient of broadcasting).
//
// Sharding rule: a kept dim stays sharded; reducing a sharded dim gives Partial — P(sum) for
// sum and mean (mean divides by the global count, so uneven shards are exact), P(max)/P(min)
// for max/min. Sum and mean of a P(sum) input stay P(sum).
#include <algorithm>

#include "dtensor/autograd/functional.h"
#include "dtensor/autograd/ops.h"
#include "dtensor/autograd/ops/op_util.h"

namespace dtensor {
namespace {

using op_util::One;
using op_util::ToShape;
using op_util::ToVec;

// args.ints = {op, keepdim, dims... (normalised, sorted)}
struct ReduceArgs {
  ReduceOp op;
  bool keepdim;
  std::vector<int64_t> dims;
  explicit ReduceArgs(const OpArgs& a)
      : op(static_cast<ReduceOp>(a.ints[0])), keepdim(a.ints[1] != 0), dims(a.ints.begin() + 2, a.ints.end()) {}
  bool reduced(int64_t d) const { return std::find(dims.begin(), dims.end(), d) != dims.end(); }
  // Output dim of kept input dim d.
  int64_t out_dim(int64_t d) const {
    if (keepdim) return d;
    int64_t before = 0;
    for (int64_t r : dims) before += r < d ? 1 : 0;
    return d - before;
  }
};

Shape ReducedShape(IntSpan shape, const ReduceArgs& r) {
  Shape out;
  for (int64_t d = 0; d < static_cast<int64_t>(shape.size()); ++d) {
    if (!r.reduced(d)) {
      out.push_back(shape[static_cast<size_t>(d)]);
    } else if (r.keepdim) {
      out.push_back(1);
    }
  }
  return out;
}

absl::StatusOr<std::vector<TensorMeta>> ReduceMeta(absl::Span<const TensorMeta> in, const OpArgs& args) {
  ReduceArgs r(args);
  if ((r.op == ReduceOp::kMax || r.op == ReduceOp::kMin)) {
    for (int64_t d : r.dims) {
      if (in[0].shape[static_cast<size_t>(d)] == 0) {
        return op_util::Invalid("Reduce",
                                absl::StrCat("max/min over the empty dim ", d, " of ", ShapeString(in[0].shape)));
      }
    }
  }
  return std::vector<TensorMeta>{{ReducedShape(in[0].shape, r), in[0].dtype}};
}

void ReduceRule(absl::Span<const TensorMeta> in, const OpArgs& args, IntSpan, std::vector<DimStrategy>* s) {
  ReduceArgs r(args);
  const PartialOp pop = r.op == ReduceOp::kMax   ? PartialOp::kMax
                        : r.op == ReduceOp::kMin ? PartialOp::kMin
                                                 : PartialOp::kSum;
  for (int64_t d = 0; d < static_cast<int64_t>(in[0].shape.size()); ++d) {
    if (r.reduced(d)) {
      s->push_back({{Shard(d)}, {Partial(pop)}});
    } else {
      s->push_back({{Shard(d)}, {Shard(r.out_dim(d))}});
    }
  }
  if (r.op == ReduceOp::kSum || r.op == ReduceOp::kMean) {
    s->push_back({{Partial(PartialOp::kSum)}, {Partial(PartialOp::kSum)}});
  }
}

absl::StatusOr<std::vector<Tensor>> ReduceLocal(const LocalCall& c) {
  ReduceArgs r(c.args);
  const Tensor& x = c.inputs[0];
  bool empty = false;
  for (int64_t d : r.dims) empty |= x.size(d) == 0;
  if (r.op == ReduceOp::kMax || r.op == ReduceOp::kMin) {
    if (empty) {  // an empty piece of a sharded dim: the identity of max / min
      const double inf = std::numeric_limits<double>::infinity();
      return One(Full(ReducedShape(x.shape(), r), r.op == ReduceOp::kMax ? -inf : inf, x.dtype(), x.device()));
    }
    return One(dtensor::Reduce(r.op, x, r.dims, r.keepdim));
  }
  if (r.op == ReduceOp::kMean && !IsComputeFloat(x.dtype())) {  // as dtensor::Mean
    return op_util::Invalid(
        "Reduce", absl::StrCat("mean of a ", DTypeName(x.dtype()), " tensor (a float type's only: cast it first)"));
  }
  DT_ASSIGN_OR_RETURN(Tensor sum, dtensor::Sum(x, r.dims, r.keepdim));
  if (r.op == ReduceOp::kSum) return std::vector<Tensor>{sum};
  int64_t count = 1;  // the global count, so that uneven shards are exact
  for (int64_t d : r.dims) count *= c.input_meta[0].shape[static_cast<size_t>(d)];
  return One(dtensor::Scale(sum, count == 0 ? std::numeric_limits<double>::quiet_NaN() : 1.0 / count));
}
const OpDef kReduce = {"reduce", ReduceRule, ReduceMeta, ReduceLocal};

// ---- ExpandReduced: args.ints = {keepdim, ndim, shape..., dims...} ----
struct ExpandArgs {
  bool keepdim;
  Shape shape;
  std::vector<int64_t> dims;
  explicit ExpandArgs(const OpArgs& a) : keepdim(a.ints[0] != 0) {
    const int64_t nd = a.ints[1];
    shape.assign(a.ints.begin() + 2, a.ints.begin() + 2 + nd);
    dims.assign(a.ints.begin() + 2 + nd, a.ints.end());
  }
  bool reduced(int64_t d) const { return std::find(dims.begin(), dims.end(), d) != dims.end(); }
};

absl::StatusOr<std::vector<TensorMeta>> ExpandMeta(absl::Span<const TensorMeta> in, const OpArgs& args) {
  ExpandArgs e(args);
  return std::vector<TensorMeta>{{e.shape, in[0].dtype}};
}
void ExpandRule(absl::Span<const TensorMeta>, const OpArgs& args, IntSpan, std::vector<DimStrategy>* s) {
  ExpandArgs e(args);
  int64_t gd = 0;
  for (int64_t d = 0; d < static_cast<int64_t>(e.shape.size()); ++d) {
    if (!e.reduced(d)) s->push_back({{Shard(e.keepdim ? d : gd)}, {Shard(d)}});
    if (!e.reduced(d) || e.keepdim) ++gd;
  }
  s->push_back({{Partial(PartialOp::kSum)}, {Partial(PartialOp::kSum)}});
}
absl::StatusOr<std::vector<Tensor>> ExpandLocal(const LocalCall& c) {
  ExpandArgs e(c.args);
  Tensor g = c.inputs[0];
  if (!e.keepdim) {
    for (int64_t d : e.dims) {
      DT_ASSIGN_OR_RETURN(g, g.Unsqueeze(d));  // dims sorted ascending
    }
  }
  Shape out = op_util::LocalOutShape(c, 0, e.shape);
  DT_ASSIGN_OR_RETURN(Tensor x, g.Expand(out));
  return One(dtensor::Contiguous(x));
}
const OpDef kExpand = {"expand_reduced", ExpandRule, ExpandMeta, ExpandLocal};

// ---- x == y (1 or 0), for the max/min backward ----
absl::StatusOr<std::vector<TensorMeta>> EqualMeta(absl::Span<const TensorMeta> in, const OpArgs&) {
  return std::vector<TensorMeta>{in[0]};
}
void EqualRule(absl::Span<const TensorMeta> in, const OpArgs&, IntSpan, std::vector<DimStrategy>* s) {
  for (int64_t d = 0; d < static_cast<int64_t>(in[0].shape.size()); ++d)
    s->push_back({{Shard(d), Shard(d)}, {Shard(d)}});
}
absl::StatusOr<std::vector<Tensor>> EqualLocal(const LocalCall& c) {
  DT_ASSIGN_OR_RETURN(std::vector<double> a, ToDoubleVector(c.inputs[0]));
  DT_ASSIGN_OR_RETURN(std::vector<double> b, ToDoubleVector(c.inputs[1]));
  std::vector<float> eq(a.size());
  for (size_t i = 0; i < a.size(); ++i) eq[i] = a[i] == b[i] ? 1.0f : 0.0f;
  DT_ASSIGN_OR_RETURN(Tensor t, Tensor::FromVector<float>(eq, c.inputs[0].shape()));
  DT_ASSIGN_OR_RETURN(t, Cast(t, c.inputs[0].dtype()));
  return One(To(t, c.inputs[0].device()));
}
const OpDef kEqual = {"equal", EqualRule, EqualMeta, EqualLocal};

absl::StatusOr<std::vector<int64_t>> NormalizeDims(const char* op, std::vector<int64_t> dims, int64_t ndim) {
  if (dims.empty()) {
    for (int64_t d = 0; d < ndim; ++d) dims.push_back(d);
    return dims;
  }
  for (int64_t& d : dims) {
    DT_ASSIGN_OR_RETURN(d, NormalizeDim(op, d, ndim));
  }
  std::sort(dims.begin(), dims.end());
  if (std::adjacent_find(dims.begin(), dims.end()) != dims.end()) {
    return op_util::Invalid(op, "repeated dim in the reduction dims");
  }
  // A 0-d tensor accepts dim 0 / -1 (as PyTorch) but has no dim to index: reducing over it
  // reduces over nothing, which the empty list (all of its zero dims) says.
  if (ndim == 0) dims.clear();
  return dims;
}

}  // namespace

namespace fn {

absl::StatusOr<Value> Reduce(ReduceOp op, const Value& x, std::vector<int64_t> dims, bool keepdim) {
  DT_ASSIGN_OR_RETURN(dims, NormalizeDims("Reduce", std::move(dims), x.dim()));
  OpArgs args;
  args.ints = {static_cast<int64_t>(op), keepdim ? 1 : 0};
  args.ints.insert(args.ints.end(), dims.begin(), dims.end());
  return op_util::First(Dispatch(kReduce, {x}, args));
}

absl::StatusOr<Value> ExpandReduced(const Value& g, std::vector<int64_t> shape, std::vector<int64_t> dims,
                                    bool keepdim) {
  DT_ASSIGN_OR_RETURN(dims, NormalizeDims("ExpandReduced", std::move(dims), static_cast<int64_t>(shape.size())));
  OpArgs args;
  args.ints = {keepdim ? 1 : 0, static_cast<int64_t>(shape.size())};
  args.ints.insert(args.ints.end(), shape.begin(), shape.end());
  args.ints.insert(args.ints.end(), dims.begin(), dims.end());
  return op_util::First(Dispatch(kExpand, {g}, args));
}

absl::StatusOr<Value> SumTo(const Value& g, std::vector<int64_t> shape) {
  IntSpan gs = g.shape();
  if (gs == IntSpan(shape)) return g;
  const int64_t lead = g.dim() - static_cast<int64_t>(shape.size());
  if (lead < 0) {
    return op_util::Invalid("SumTo", absl::StrCat("cannot sum ", ShapeString(gs), " to ", ShapeString(shape)));
  }
  std::vector<int64_t> lead_dims, ones;
  for (int64_t d = 0; d < lead; ++d) lead_dims.push_back(d);
  for (size_t i = 0; i < shape.size(); ++i) {
    const int64_t gsz = gs[static_cast<size_t>(lead) + i];
    if (shape[i] == 1 && gsz != 1) {
      ones.push_back(static_cast<int64_t>(i));
    } else if (shape[i] != gsz) {
      return op_util::Invalid("SumTo", absl::StrCat("cannot sum ", ShapeString(gs), " to ", ShapeString(shape)));
    }
  }
  Value r = g;
  if (!lead_dims.empty()) {
    DT_ASSIGN_OR_RETURN(r, Sum(r, lead_dims, false));
  }
  if (!ones.empty()) {
    DT_ASSIGN_OR_RETURN(r, Sum(r, ones, true));
  }
  return r;
}

absl::StatusOr<Value> ReduceMaxBackward(const Value& dy, const Value& x, const Value& y, std::vector<int64_t> dims,
                                        bool keepdim) {
  std::vector<int64_t> shape = ToVec(x.shape());
  DT_ASSIGN_OR_RETURN(Value ye, ExpandReduced(y, shape, dims, keepdim));
  DT_ASSIGN_OR_RETURN(Value ge, ExpandReduced(dy, shape, dims, keepdim));
  DT_ASSIGN_OR_RETURN(Value eq, op_util::First(Dispatch(kEqual, {x, ye})));
  DT_ASSIGN_OR_RETURN(Value count, Sum(eq, dims, /*keepdim=*/true));
  DT_ASSIGN_OR_RETURN(Value ce, ExpandReduced(count, shape, dims, /*keepdim=*/true));
  DT_ASSIGN_OR_RETURN(Value share, Div(eq, ce));
  return Mul(ge, share);
}

}  // namespace fn

absl::StatusOr<Variable> Sum(const Variable& x, std::vector<int64_t> dims, bool keepdim) {
  DT_ASSIGN_OR_RETURN(Value y, fn::Sum(x.value(), dims, keepdim));
  if (!AnyRequiresGrad({x})) return Variable::Leaf(std::move(y));  // no tape: skip the captures
  return op_util::Result1(
      "Sum", {x}, std::move(y),
      [shape = ToVec(x.value().shape()), dims, keepdim](const Value& g) -> absl::StatusOr<std::vector<Value>> {
        DT_ASSIGN_OR_RETURN(Value r, fn::ExpandReduced(g, shape, dims, keepdim));
        return std::vector<Value>{r};
      });
}

absl::StatusOr<Variable> Mean(const Variable& x, std::vector<int64_t> dims, bool keepdim) {
  DT_ASSIGN_OR_RETURN(Value y, fn::Mean(x.value(), dims, keepdim));
  int64_t count = 1;
  if (dims.empty()) {
    count = x.value().numel();
  } else {
    for (int64_t d : dims) {
      DT_ASSIGN_OR_RETURN(int64_t nd, NormalizeDim("Mean", d, x.value().dim()));
      if (x.value().dim() > 0) count *= x.value().shape()[static_cast<size_t>(nd)];  // 0-d: one element
    }
  }
  if (!AnyRequiresGrad({x})) return Variable::Leaf(std::move(y));  // no tape: skip the captures
  return op_util::Result1(
      "Mean", {x}, std::move(y),
      [shape = ToVec(x.value().shape()), dims, keepdim, count](const Value& g) -> absl::StatusOr<std::vector<Value>> {
        DT_ASSIGN_OR_RETURN(Value r, fn::ExpandReduced(g, shape, dims, keepdim));
        DT_ASSIGN_OR_RETURN(r, fn::Scale(r, 1.0 / static_cast<double>(count)));
        return std::vector<Value>{r};
      });
}

absl::StatusOr<Variable> Max(const Variable& x, std::vector<int64_t> dims, bool keepdim) {
  DT_ASSIGN_OR_RETURN(Value y, fn::Max(x.value(), dims, keepdim));
  if (!AnyRequiresGrad({x})) return Variable::Leaf(y);  // no tape: skip the captures
  return op_util::Result1("Max", {x}, y,
                          [xv = x.value(), y, dims, keepdim](const Value& g) -> absl::StatusOr<std::vector<Value>> {
                            // y may be Partial(max) on a DTensor: compare against its reduced value.
                            Value yr = y;
                            if (y.is_dtensor() && y.dtensor().layout().has_partial()) {
                              Layout l = y.dtensor().layout();
                              for (int m = 0; m < l.ndim(); ++m) {
                                if (l[m].is_partial()) l = l.WithPlacement(m, Replicate());
                              }
                              DT_ASSIGN_OR_RETURN(DTensor r, y.dtensor().Redistribute(l));
                              yr = r;
                            }
                            DT_ASSIGN_OR_RETURN(Value r, fn::ReduceMaxBackward(g, xv, yr, dims, keepdim));
                            return std::vector<Value>{r};
                          });
}

namespace op_defs {
const OpDef& Reduce() { return kReduce; }
const OpDef& Expand() { return kExpand; }
const OpDef& Equal() { return kEqual; }
}  // namespace op_defs

}  // namespace dtensor
