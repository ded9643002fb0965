// Shape ops: reshape, transpose/permute, narrow and split (and their backwards), contiguous.
//
// Sharding rule: a sharded dim moves with its data — permute moves the shard, narrow keeps
// shards on other dims, reshape keeps a shard on the first dim of a group of merged/split
// dims when the sizes divide evenly over the shards (else the dim is gathered first);
// size-1 dims do not count (a squeeze or unsqueeze keeps any shard).
// Values are unchanged, so every Partial passes through. For DTensors the result may be a
// view of the input's local piece.
#include <algorithm>
#include <optional>

#include "dtensor/autograd/functional.h"
#include "dtensor/autograd/ops.h"
#include "dtensor/autograd/ops/op_util.h"

namespace dtensor {
namespace {

void PartialsPass(size_t n, std::vector<DimStrategy>* s) {
  for (PartialOp op : {PartialOp::kSum, PartialOp::kAvg, PartialOp::kMax, PartialOp::kMin}) {
    DimStrategy st;
    st.inputs.assign(n, Partial(op));
    st.outputs.assign(1, Partial(op));
    s->push_back(st);
  }
}

// ---- reshape: args.ints = the new shape (resolved) ----
absl::StatusOr<std::vector<TensorMeta>> ReshapeMeta(absl::Span<const TensorMeta> in, const OpArgs& args) {
  Shape out(args.ints.begin(), args.ints.end());
  if (NumElements(out) != NumElements(in[0].shape)) {
    return op_util::Invalid("Reshape",
                            absl::StrCat("cannot reshape ", ShapeString(in[0].shape), " to ", ShapeString(out)));
  }
  return std::vector<TensorMeta>{{out, in[0].dtype}};
}
void ReshapeRule(absl::Span<const TensorMeta> in, const OpArgs& args, IntSpan, std::vector<DimStrategy>* s) {
  PartialsPass(1, s);
  const Shape& a = in[0].shape;
  const Shape b(args.ints.begin(), args.ints.end());
  if (NumElements(a) == 0) return;
  size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    const size_t i0 = i, j0 = j;
    int64_t pa = a[i++], pb = b[j++];
    while (pa != pb) {
      if (pa < pb && i < a.size()) {
        pa *= a[i++];
      } else if (j < b.size()) {
        pb *= b[j++];
      } else {
        break;
      }
    }
    // Size-1 dims of a group hold nothing to shard: the shard goes from the group's first
    // dim of size > 1 to the other's ([1, C, C] -> [C, C] keeps a shard of the C dims).
    size_t fa = i0, fb = j0;
    while (fa + 1 < i && a[fa] == 1) ++fa;
    while (fb + 1 < j && b[fb] == 1) ++fb;
    size_t big_a = 0, big_b = 0;
    for (size_t k = i0; k < i; ++k) big_a += a[k] > 1 ? 1 : 0;
    for (size_t k = j0; k < j; ++k) big_b += b[k] > 1 ? 1 : 0;
    const bool one_to_one = big_a <= 1 && big_b <= 1;
    DimStrategy st{{Shard(static_cast<int64_t>(fa))}, {Shard(static_cast<int64_t>(fb))}};
    // Merged or split dims: each piece must be whole rows of the others, so both first dims
    // divide by the shards (the mesh dims that take this strategy, not the whole mesh: a
    // [B, T, C] -> [B, T, H, D] with C over tp and B over two data-parallel dims keeps C's shard
    // when H divides by tp).
    if (!one_to_one) st.divisible = {a[fa], b[fb]};
    s->push_back(std::move(st));
  }
}
absl::StatusOr<std::vector<Tensor>> ReshapeLocal(const LocalCall& c) {
  const Shape out = op_util::LocalOutShape(c, 0, Shape(c.args.ints.begin(), c.args.ints.end()));
  return op_util::One(dtensor::Reshape(c.inputs[0], out));
}
const OpDef kReshape = {"reshape", ReshapeRule, ReshapeMeta, ReshapeLocal};

// ---- permute: args.ints = perm ----
absl::StatusOr<std::vector<TensorMeta>> PermuteMeta(absl::Span<const TensorMeta> in, const OpArgs& args) {
  Shape out;
  for (int64_t p : args.ints) out.push_back(in[0].shape[static_cast<size_t>(p)]);
  return std::vector<TensorMeta>{{out, in[0].dtype}};
}
void PermuteRule(absl::Span<const TensorMeta>, const OpArgs& args, IntSpan, std::vector<DimStrategy>* s) {
  for (size_t j = 0; j < args.ints.size(); ++j) s->push_back({{Shard(args.ints[j])}, {Shard(static_cast<int64_t>(j))}});
  PartialsPass(1, s);
}
absl::StatusOr<std::vector<Tensor>> PermuteLocal(const LocalCall& c) {
  return op_util::One(c.inputs[0].Permute(c.args.ints));
}
const OpDef kPermute = {"permute", PermuteRule, PermuteMeta, PermuteLocal};

// ---- narrow: args.ints = {dim, start, length} ----
absl::StatusOr<std::vector<TensorMeta>> NarrowMeta(absl::Span<const TensorMeta> in, const OpArgs& args) {
  Shape out = in[0].shape;
  const int64_t dim = args.ints[0], start = args.ints[1], len = args.ints[2];
  if (dim < 0 || dim >= static_cast<int64_t>(out.size())) {  // a 0-d input: as torch.narrow
    return op_util::Invalid(
        "Narrow", absl::StrCat("cannot narrow dim ", dim, " of the ", out.size(), "-d tensor ", ShapeString(out)));
  }
  if (start < 0 || len < 0 || start + len > out[static_cast<size_t>(dim)]) {
    return op_util::Invalid("Narrow", absl::StrCat("[", start, ", ", start + len, ") is out of range for dim ", dim,
                                                   " of ", ShapeString(out)));
  }
  out[static_cast<size_t>(dim)] = len;
  return std::vector<TensorMeta>{{out, in[0].dtype}};
}
void KeepOtherDims(absl::Span<const TensorMeta> in, const OpArgs& args, IntSpan, std::vector<DimStrategy>* s) {
  for (int64_t d = 0; d < static_cast<int64_t>(in[0].shape.size()); ++d) {
    if (d != args.ints[0]) s->push_back({{Shard(d)}, {Shard(d)}});
  }
}
void NarrowRule(absl::Span<const TensorMeta> in, const OpArgs& args, IntSpan m, std::vector<DimStrategy>* s) {
  KeepOtherDims(in, args, m, s);
  PartialsPass(1, s);
}
absl::StatusOr<std::vector<Tensor>> NarrowLocal(const LocalCall& c) {
  return op_util::One(c.inputs[0].Narrow(c.args.ints[0], c.args.ints[1], c.args.ints[2]));
}
const OpDef kNarrow = {"narrow", NarrowRule, NarrowMeta, NarrowLocal};

// ---- narrow_backward: args.ints = {dim, start, ndim, shape...} ----
absl::StatusOr<std::vector<TensorMeta>> NarrowBwdMeta(absl::Span<const TensorMeta> in, const OpArgs& args) {
  return std::vector<TensorMeta>{{Shape(args.ints.begin() + 3, args.ints.end()), in[0].dtype}};
}
void NarrowBwdRule(absl::Span<const TensorMeta> in, const OpArgs& args, IntSpan m, std::vector<DimStrategy>* s) {
  KeepOtherDims(in, args, m, s);
  s->push_back({{Partial(PartialOp::kSum)}, {Partial(PartialOp::kSum)}});
}
absl::StatusOr<std::vector<Tensor>> NarrowBwdLocal(const LocalCall& c) {
  const Tensor& g = c.inputs[0];
  const Shape out = op_util::LocalOutShape(c, 0, Shape(c.args.ints.begin() + 3, c.args.ints.end()));
  DT_ASSIGN_OR_RETURN(Tensor z, Zeros(out, g.dtype(), g.device()));
  DT_ASSIGN_OR_RETURN(Tensor dst, z.Narrow(c.args.ints[0], c.args.ints[1], g.size(c.args.ints[0])));
  DT_RETURN_IF_ERROR(Copy_(dst, g));
  return std::vector<Tensor>{z};
}
const OpDef kNarrowBackward = {"narrow_backward", NarrowBwdRule, NarrowBwdMeta, NarrowBwdLocal};

// ---- split_backward: the pieces' gradients concatenated; args.ints = {dim} ----
absl::StatusOr<std::vector<TensorMeta>> SplitBwdMeta(absl::Span<const TensorMeta> in, const OpArgs& args) {
  const int64_t dim = args.ints[0];
  Shape out = in[0].shape;
  out[static_cast<size_t>(dim)] = 0;
  for (const TensorMeta& m : in) {
    bool fits = m.dtype == in[0].dtype && m.shape.size() == out.size();
    for (size_t j = 0; fits && j < out.size(); ++j) fits = static_cast<int64_t>(j) == dim || m.shape[j] == out[j];
    if (!fits) {
      return op_util::Invalid("SplitBackward",
                              absl::StrCat("gradient ", ShapeString(m.shape), " ", DTypeName(m.dtype), " does not fit ",
                                           ShapeString(in[0].shape), " ", DTypeName(in[0].dtype), " along dim ", dim));
    }
    out[static_cast<size_t>(dim)] += m.shape[static_cast<size_t>(dim)];
  }
  return std::vector<TensorMeta>{{out, in[0].dtype}};
}
void SplitBwdRule(absl::Span<const TensorMeta> in, const OpArgs& args, IntSpan, std::vector<DimStrategy>* s) {
  for (int64_t d = 0; d < static_cast<int64_t>(in[0].shape.size()); ++d) {
    if (d == args.ints[0]) continue;
    DimStrategy st;
    st.inputs.assign(in.size(), Shard(d));
    st.outputs.assign(1, Shard(d));
    s->push_back(st);
  }
  PartialsPass(in.size(), s);  // no padding: every reduction passes
}
// The pieces as one tensor without a copy where they already are one: views of one storage at
// the offsets and strides of the contiguous concatenation (the gradients of q, k and v that
// CausalAttentionBackward writes into one [B, T, 3, H, D] buffer, seen as [B, T, C] each).
std::optional<Tensor> AdjacentPieces(absl::Span<const Tensor> xs, int64_t dim, IntSpan out_shape) {
  const Tensor& first = xs[0];
  Shape strides(out_shape.size());
  int64_t step = 1;
  for (size_t j = out_shape.size(); j-- > 0;) {
    strides[j] = step;
    step *= out_shape[j];
  }
  int64_t at = first.storage_offset();
  for (const Tensor& x : xs) {
    if (x.storage() != first.storage() || x.storage_offset() != at) return std::nullopt;
    for (size_t j = 0; j < out_shape.size(); ++j) {
      if (x.size(static_cast<int64_t>(j)) > 1 && x.stride(static_cast<int64_t>(j)) != strides[j]) return std::nullopt;
    }
    at += x.size(dim) * strides[static_cast<size_t>(dim)];
  }
  auto whole = first.AsStrided(out_shape, strides, first.storage_offset());
  if (!whole.ok()) return std::nullopt;
  return *std::move(whole);
}
absl::StatusOr<std::vector<Tensor>> SplitBwdLocal(const LocalCall& c) {
  const int64_t dim = c.args.ints[0];
  Shape out(c.inputs[0].shape().begin(), c.inputs[0].shape().end());
  out[static_cast<size_t>(dim)] = 0;
  for (const Tensor& x : c.inputs) out[static_cast<size_t>(dim)] += x.size(dim);
  if (std::optional<Tensor> whole = AdjacentPieces(c.inputs, dim, out)) return std::vector<Tensor>{*std::move(whole)};
  return op_util::One(dtensor::Cat(c.inputs, dim));
}
const OpDef kSplitBackward = {"split_backward", SplitBwdRule, SplitBwdMeta, SplitBwdLocal};

// ---- contiguous ----
absl::StatusOr<std::vector<TensorMeta>> SameMeta(absl::Span<const TensorMeta> in, const OpArgs&) {
  return std::vector<TensorMeta>{in[0]};
}
void AllDimsRule(absl::Span<const TensorMeta> in, const OpArgs&, IntSpan, std::vector<DimStrategy>* s) {
  for (int64_t d = 0; d < static_cast<int64_t>(in[0].shape.size()); ++d) s->push_back({{Shard(d)}, {Shard(d)}});
  PartialsPass(1, s);
}
absl::StatusOr<std::vector<Tensor>> ContiguousLocal(const LocalCall& c) {
  return op_util::One(dtensor::Contiguous(c.inputs[0]));
}
const OpDef kContiguous = {"contiguous", AllDimsRule, SameMeta, ContiguousLocal};

}  // namespace

namespace fn {

absl::StatusOr<Value> Reshape(const Value& x, std::vector<int64_t> shape) {
  DT_ASSIGN_OR_RETURN(Shape s, InferViewShape("Reshape", shape, x.numel()));
  if (IntSpan(s) == x.shape()) return x;
  OpArgs args;
  args.ints.assign(s.begin(), s.end());
  return op_util::First(Dispatch(kReshape, {x}, args));
}

absl::StatusOr<Value> Permute(const Value& x, std::vector<int64_t> dims) {
  if (static_cast<int64_t>(dims.size()) != x.dim()) {
    return op_util::Invalid("Permute", absl::StrCat(dims.size(), " dims for a ", x.dim(), "-d tensor"));
  }
  std::vector<bool> seen(dims.size(), false);
  for (int64_t& d : dims) {
    DT_ASSIGN_OR_RETURN(d, NormalizeDim("Permute", d, x.dim()));
    if (seen[static_cast<size_t>(d)]) return op_util::Invalid("Permute", "repeated dim");
    seen[static_cast<size_t>(d)] = true;
  }
  OpArgs args;
  args.ints.assign(dims.begin(), dims.end());
  return op_util::First(Dispatch(kPermute, {x}, args));
}

absl::StatusOr<Value> Transpose(const Value& x, int64_t dim0, int64_t dim1) {
  DT_ASSIGN_OR_RETURN(int64_t a, NormalizeDim("Transpose", dim0, x.dim()));
  DT_ASSIGN_OR_RETURN(int64_t b, NormalizeDim("Transpose", dim1, x.dim()));
  if (x.dim() == 0) return x;  // as torch: transpose(0, 0) / (-1, -1) of a 0-d tensor is itself
  std::vector<int64_t> perm;
  for (int64_t d = 0; d < x.dim(); ++d) perm.push_back(d);
  std::swap(perm[static_cast<size_t>(a)], perm[static_cast<size_t>(b)]);
  return Permute(x, perm);
}

absl::StatusOr<Value> Narrow(const Value& x, int64_t dim, int64_t start, int64_t length) {
  DT_ASSIGN_OR_RETURN(int64_t d, NormalizeDim("Narrow", dim, x.dim()));
  if (x.dim() == 0) return op_util::Invalid("Narrow", "cannot narrow a 0-d tensor");  // as torch.narrow
  OpArgs args;
  args.ints = {d, start, length};
  return op_util::First(Dispatch(kNarrow, {x}, args));
}

absl::StatusOr<Value> NarrowBackward(const Value& g, std::vector<int64_t> shape, int64_t dim, int64_t start) {
  DT_ASSIGN_OR_RETURN(int64_t d, NormalizeDim("NarrowBackward", dim, static_cast<int64_t>(shape.size())));
  if (shape.empty()) return op_util::Invalid("NarrowBackward", "cannot narrow a 0-d tensor");
  OpArgs args;
  args.ints = {d, start, static_cast<int64_t>(shape.size())};
  args.ints.insert(args.ints.end(), shape.begin(), shape.end());
  return op_util::First(Dispatch(kNarrowBackward, {g}, args));
}

absl::StatusOr<Value> SplitBackward(const std::vector<Value>& grads, int64_t dim) {
  if (grads.empty()) return op_util::Invalid("SplitBackward", "no gradients");
  DT_ASSIGN_OR_RETURN(int64_t d, NormalizeDim("SplitBackward", dim, grads[0].dim()));
  if (grads[0].dim() == 0) return op_util::Invalid("SplitBackward", "cannot concatenate 0-d gradients");
  OpArgs args;
  args.ints = {d};
  return op_util::First(Dispatch(kSplitBackward, grads, args));
}

absl::StatusOr<Value> Contiguous(const Value& x) { return op_util::First(Dispatch(kContiguous, {x})); }

}  // namespace fn

absl::StatusOr<Variable> Reshape(const Variable& x, std::vector<int64_t> shape) {
  DT_ASSIGN_OR_RETURN(Value y, fn::Reshape(x.value(), std::move(shape)));
  if (!AnyRequiresGrad({x})) return Variable::Leaf(std::move(y));  // no tape: skip the captures
  return op_util::Result1(
      "Reshape", {x}, std::move(y),
      [s = op_util::ToVec(x.value().shape())](const Value& g) -> absl::StatusOr<std::vector<Value>> {
        DT_ASSIGN_OR_RETURN(Value r, fn::Reshape(g, s));
        return std::vector<Value>{r};
      });
}

absl::StatusOr<Variable> Transpose(const Variable& x, int64_t dim0, int64_t dim1) {
  DT_ASSIGN_OR_RETURN(Value y, fn::Transpose(x.value(), dim0, dim1));
  if (!AnyRequiresGrad({x})) return Variable::Leaf(std::move(y));  // no tape: skip the captures
  return op_util::Result1("Transpose", {x}, std::move(y),
                          [dim0, dim1](const Value& g) -> absl::StatusOr<std::vector<Value>> {
                            DT_ASSIGN_OR_RETURN(Value r, fn::Transpose(g, dim0, dim1));
                            return std::vector<Value>{r};
                          });
}

absl::StatusOr<Variable> Narrow(const Variable& x, int64_t dim, int64_t start, int64_t length) {
  DT_ASSIGN_OR_RETURN(Value y, fn::Narrow(x.value(), dim, start, length));
  if (!AnyRequiresGrad({x})) return Variable::Leaf(std::move(y));  // no tape: skip the captures
  return op_util::Result1(
      "Narrow", {x}, std::move(y),
      [s = op_util::ToVec(x.value().shape()), dim, start](const Value& g) -> absl::StatusOr<std::vector<Value>> {
        DT_ASSIGN_OR_RETURN(Value r, fn::NarrowBackward(g, s, dim, start));
        return std::vector<Value>{r};
      });
}

absl::StatusOr<std::vector<Variable>> Split(const Variable& x, int64_t split_size, int64_t dim) {
  DT_ASSIGN_OR_RETURN(int64_t d, NormalizeDim("Split", dim, x.value().dim()));
  if (x.value().dim() == 0) return op_util::Invalid("Split", "cannot split a 0-d tensor");  // as torch.split
  if (split_size <= 0) return op_util::Invalid("Split", absl::StrCat("split_size must be > 0, got ", split_size));
  std::vector<Value> pieces;
  std::vector<int64_t> starts;
  const int64_t n = x.value().shape()[static_cast<size_t>(d)];
  for (int64_t start = 0; start < n; start += split_size) {
    DT_ASSIGN_OR_RETURN(Value p, fn::Narrow(x.value(), d, start, std::min(split_size, n - start)));
    pieces.push_back(std::move(p));
    starts.push_back(start);
  }
  if (!AnyRequiresGrad({x})) {
    std::vector<Variable> out;
    for (Value& p : pieces) out.push_back(Variable::Leaf(std::move(p)));
    return out;
  }
  // One node for all pieces: their gradients are concatenated in one pass (a view where they
  // already lie side by side), as torch.split's backward does; a piece without a gradient
  // (unused) leaves its place zero.
  return Record("Split", {x}, std::move(pieces),
                [shape = op_util::ToVec(x.value().shape()), d,
                 starts](std::vector<Value>& g) -> absl::StatusOr<std::vector<Value>> {
                  if (g.size() == 1) return std::vector<Value>{g[0]};
                  if (std::all_of(g.begin(), g.end(), [](const Value& v) { return v.defined(); })) {
                    DT_ASSIGN_OR_RETURN(Value r, fn::SplitBackward(g, d));
                    return std::vector<Value>{r};
                  }
                  Value sum;
                  for (size_t i = 0; i < g.size(); ++i) {
                    if (!g[i].defined()) continue;
                    DT_ASSIGN_OR_RETURN(Value r, fn::NarrowBackward(g[i], shape, d, starts[i]));
                    if (sum.defined()) {
                      DT_ASSIGN_OR_RETURN(sum, fn::Add(sum, r));
                    } else {
                      sum = std::move(r);
                    }
                  }
                  return std::vector<Value>{sum};
                });
}

namespace op_defs {
const OpDef& Reshape() { return kReshape; }
const OpDef& Permute() { return kPermute; }
const OpDef& Narrow() { return kNarrow; }
const OpDef& NarrowBackward() { return kNarrowBackward; }
const OpDef& SplitBackward() { return kSplitBackward; }
const OpDef& Contiguous() { return kContiguous; }
}  // namespace op_defs

}  // namespace dtensor
