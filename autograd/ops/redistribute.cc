// The DTensor boundaries as differentiable ops: Redistribute, FromLocal, ToLocal.
//
// Backward of a redistribution is the transposed redistribution: the gradient goes back to the
// input's layout with Partial read as Replicate (all_gather <-> reduce_scatter, P -> R's
// all_reduce <-> nothing), as PyTorch defines it.
#include "absl/strings/str_cat.h"
#include "dtensor/autograd/dispatch.h"
#include "dtensor/autograd/functional.h"
#include "dtensor/autograd/ops.h"
#include "dtensor/autograd/ops/op_util.h"

namespace dtensor {
namespace {

Layout PartialAsReplicate(Layout l) {
  for (int m = 0; m < l.ndim(); ++m) {
    if (l[m].is_partial()) l = l.WithPlacement(m, Replicate());
  }
  return l;
}

absl::StatusOr<Value> GradTo(const Value& g, const DeviceMesh& mesh, const Layout& layout, IntSpan shape) {
  if (!g.is_dtensor()) {  // a plain gradient of a DTensor value: it holds the full (replicated) value
    DT_ASSIGN_OR_RETURN(DTensor d, DTensor::Distribute(g.local(), mesh, layout, {.src_rank = std::nullopt}));
    return Value(d);
  }
  if (g.shape() != shape) {
    return absl::InternalError(absl::StrCat("[Redistribute backward] gradient shape ", ShapeString(g.shape()),
                                            " differs from ", ShapeString(shape)));
  }
  DT_ASSIGN_OR_RETURN(DTensor r, g.dtensor().Redistribute(layout));
  return Value(r);
}

// Names redistributions to a dispatch observer: selective activation checkpointing
// (checkpoint.h) keeps their outputs where "redistribute" is among its save_ops, so a
// recomputation runs no collective of the layers' hooks (tensor parallelism's) again.
const OpDef kRedistributeOp = {"redistribute", nullptr, nullptr, nullptr};

}  // namespace

absl::StatusOr<Variable> Redistribute(const Variable& x, const Layout& layout) {
  const Value& v = x.value();
  if (!v.is_dtensor()) return op_util::Invalid("Redistribute", "the input is not a DTensor: " + v.ToString());
  DT_ASSIGN_OR_RETURN(std::vector<Value> out,
                      internal::RunObserved(kRedistributeOp, {v}, {}, [&]() -> absl::StatusOr<std::vector<Value>> {
                        DT_ASSIGN_OR_RETURN(DTensor r, v.dtensor().Redistribute(layout));
                        return std::vector<Value>{Value(r)};
                      }));
  if (out.size() != 1 || !out[0].is_dtensor() || !(out[0].dtensor().layout() == layout)) {
    return absl::InternalError(absl::StrCat("[Redistribute] a kept output is not of layout ", layout.ToString(),
                                            " (the recomputation asked for another redistribution)"));
  }
  const DTensor& y = out[0].dtensor();
  if (!AnyRequiresGrad({x})) return Variable::Leaf(Value(y));  // no tape: skip the captures
  return op_util::Result1("Redistribute", {x}, Value(y),
                          [mesh = v.dtensor().mesh(), back = PartialAsReplicate(v.dtensor().layout()),
                           shape = op_util::ToShape(v.shape())](const Value& g) -> absl::StatusOr<std::vector<Value>> {
                            DT_ASSIGN_OR_RETURN(Value r, GradTo(g, mesh, back, shape));
                            return std::vector<Value>{r};
                          });
}

absl::StatusOr<Variable> FromLocal(const Variable& local, const DeviceMesh& mesh, const Layout& layout,
                                   const DTensor::FromLocalOptions& options) {
  if (local.value().is_dtensor()) {
    return op_util::Invalid("FromLocal", "the input is already a DTensor: " + local.value().ToString());
  }
  DT_ASSIGN_OR_RETURN(DTensor y, DTensor::FromLocal(local.value().local(), mesh, layout, options));
  if (!AnyRequiresGrad({local})) return Variable::Leaf(Value(y));  // no tape: skip the captures
  return op_util::Result1("FromLocal", {local}, Value(y),
                          [mesh, back = PartialAsReplicate(y.layout()),
                           shape = op_util::ToShape(y.shape())](const Value& g) -> absl::StatusOr<std::vector<Value>> {
                            DT_ASSIGN_OR_RETURN(Value r, GradTo(g, mesh, back, shape));
                            return std::vector<Value>{Value(r.local())};
                          });
}

absl::StatusOr<Variable> ToLocal(const Variable& x) {
  const Value& v = x.value();
  if (!v.is_dtensor()) return op_util::Invalid("ToLocal", "the input is not a DTensor: " + v.ToString());
  if (!AnyRequiresGrad({x})) return Variable::Leaf(Value(v.local()));  // no tape: skip the captures
  return op_util::Result1(
      "ToLocal", {x}, Value(v.local()), [d = v.dtensor()](const Value& g) -> absl::StatusOr<std::vector<Value>> {
        Tensor local = g.local();
        if (g.is_dtensor()) {
          // The local tensor took part beside DTensors as Replicate (their mesh: maybe another
          // one): its gradient is the whole one, reduced from their pieces (as a plain leaf's).
          const DTensor& gd = g.dtensor();
          DT_ASSIGN_OR_RETURN(DTensor r,
                              gd.Redistribute(Layout(Placements(static_cast<size_t>(gd.mesh().ndim()), Replicate()))));
          local = r.ToLocal();
        }
        return std::vector<Value>{
            Value(DTensor::WrapTrusted(local, d.mesh(), d.layout(), op_util::ToShape(d.shape())))};
      });
}

}  // namespace dtensor
