#include "dtensor/nn/parallel/parallelize.h"

#include <fnmatch.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "dtensor/autograd/ops.h"
#include "dtensor/nn/layers.h"
#include "dtensor/ops/ops.h"
#include "dtensor/tensor/status.h"

namespace dtensor::nn {
namespace {

constexpr const char* kOp = "ParallelizeModule";

// What a rule asks of one parameter: its placement on the tp dim, and (fused > 1) the stacked
// view [fused, rows / fused, ...] it is placed in.
struct ParamPlan {
  Placement placement;
  int64_t fused = 1;
  std::string rule;  // for messages
};

// `p` with a negative shard dim counted from the end of an `ndim`-d tensor; InvalidArgument
// for a dim the tensor does not have.
absl::StatusOr<Placement> ForTensor(const Placement& p, int64_t ndim, const std::string& what) {
  if (!p.is_shard()) return p;
  const int64_t d = p.shard_dim() < 0 ? p.shard_dim() + ndim : p.shard_dim();
  if (d < 0 || d >= ndim) {
    return InvalidArg(kOp, what, ": ", p.ToString(), " of a ", ndim, "-d tensor");
  }
  return Placement(Shard(d));
}

// "S(1)", or for a parameter of `shape` placed fused (k > 1): "S(1) of its stacked [3, 32, 32]
// view", the view [k, rows / k, ...] a fused placement shards.
std::string PlacementText(const Placement& p, int64_t fused, IntSpan shape) {
  if (fused <= 1 || shape.empty()) return p.ToString();
  Shape stacked = {fused, shape[0] / fused};
  for (size_t d = 1; d < shape.size(); ++d) stacked.push_back(shape[d]);
  return absl::StrCat(p.ToString(), " of its stacked ", ShapeString(stacked), " view (fused=", fused, ")");
}

// Lays `x` out with `desired` on mesh dim `tp` (its other placements kept); a plain Tensor is
// first this rank's piece laid out as `plain` on tp and Replicate elsewhere. Differentiable.
absl::Status Prepare(Variable& x, const DeviceMesh& mesh, int tp, const Placement& plain, const Placement& desired,
                     const std::string& what) {
  if (!x.defined()) return absl::OkStatus();
  const int64_t nd = x.value().dim();
  if (!x.value().is_dtensor()) {
    DT_ASSIGN_OR_RETURN(Placement p, ForTensor(plain, nd, what));
    Layout l(Placements(static_cast<size_t>(mesh.ndim()), Replicate()));
    DT_ASSIGN_OR_RETURN(x, FromLocal(x, mesh, l.WithPlacement(tp, p)));
  }
  DT_ASSIGN_OR_RETURN(Placement want, ForTensor(desired, nd, what));
  if (!x.value().dtensor().mesh().SameAs(mesh)) {  // e.g. a batch on the data-parallel sub-mesh only
    return InvalidArg(kOp, what, " is a DTensor on mesh ", x.value().dtensor().mesh().ToString(),
                      ", not on the module's mesh ", mesh.ToString(),
                      " (lay it out on that mesh, e.g. Replicate on its tensor-parallel dim)");
  }
  const Layout& have = x.value().dtensor().layout();
  if (have[tp] == want) return absl::OkStatus();
  DT_ASSIGN_OR_RETURN(x, Redistribute(x, have.WithPlacement(tp, want)));
  return absl::OkStatus();
}

absl::Status ToLocalIf(bool local, Variable& x) {
  if (local && x.defined() && x.value().is_dtensor()) {
    DT_ASSIGN_OR_RETURN(x, ToLocal(x));
  }
  return absl::OkStatus();
}

// Records what `style` asks of `m` (whose parent is `parent`, null for the root) into `plans`
// and its hooks into `hooks` (or `late_hooks`, installed after all of `hooks`), installed once
// the whole plan has passed its checks. The hooks share `mesh_ptr` (a copy of the caller's
// mesh, alive as long as they are).
absl::Status Apply(const std::string& name, Module& m, Module* parent, const ParallelStyle& style,
                   const std::string& rule, const std::shared_ptr<const DeviceMesh>& mesh_ptr, int tp,
                   absl::flat_hash_map<const VariableImpl*, ParamPlan>* plans,
                   std::vector<std::function<void()>>* hooks, std::vector<std::function<void()>>* late_hooks) {
  auto place = [&](Variable* v, Placement p, int64_t fused = 1) -> absl::Status {
    if (v == nullptr) return absl::OkStatus();
    ParamPlan want{p, fused, rule};
    auto [it, fresh] = plans->emplace(v->id(), want);
    if (!fresh && (it->second.placement != p || it->second.fused != fused)) {
      return InvalidArg(kOp, "parameter ", v->name(), " of ", name, ": rule '", rule, "' places it ",
                        PlacementText(p, fused, v->value().shape()), " but rule '", it->second.rule, "' placed it ",
                        PlacementText(it->second.placement, it->second.fused, v->value().shape()));
    }
    return absl::OkStatus();
  };
  auto* linear = dynamic_cast<Linear*>(&m);
  auto* embedding = dynamic_cast<Embedding*>(&m);
  const std::string where = absl::StrCat("rule '", rule, "' on ", name.empty() ? "the root module" : name);
  if (const auto* c = std::get_if<ColwiseParallel>(&style)) {
    if (linear == nullptr && embedding == nullptr) {
      return InvalidArg(kOp, where, ": ColwiseParallel applies to a Linear or an Embedding");
    }
    if (c->fused > 1) {
      const int64_t out = linear != nullptr ? linear->weight()->value().shape()[0] : 0;
      if (linear == nullptr || out % c->fused != 0) {
        return InvalidArg(kOp, where, ": fused=", c->fused, " needs a Linear whose ", out,
                          " outputs divide into that many blocks");
      }
      // The stacked view is read by the attention's projection of q, k and v, which runs the
      // three blocks itself (not through the Linear's Forward, so no hooks of its own).
      const auto* attn = dynamic_cast<const CausalSelfAttention*>(parent);
      if (attn == nullptr || !absl::EndsWith(name, "c_attn") || c->fused != 3) {
        return InvalidArg(kOp, where, ": fused=", c->fused,
                          " applies to the q, k, v projection (c_attn) of a CausalSelfAttention, as fused=3");
      }
      // Each rank computes whole heads: the heads must divide over the tp ranks.
      const int64_t ranks = mesh_ptr->size(tp);
      if (attn->heads() % ranks != 0) {
        return InvalidArg(kOp, where, ": the attention's ", attn->heads(), " heads do not divide over the ", ranks,
                          " ranks of mesh dim '", mesh_ptr->names()[static_cast<size_t>(tp)], "'");
      }
      if (c->output_layout != Placement(Shard(-1)) || c->use_local_output) {
        return InvalidArg(kOp, where, ": fused=3 keeps the default output (S(-1)) and use_local_output (false): ",
                          "the attention consumes q, k and v itself");
      }
    }
    if (linear != nullptr) {
      const Placement p = c->fused > 1 ? Placement(Shard(1)) : Placement(Shard(0));
      DT_RETURN_IF_ERROR(place(linear->weight(), p, c->fused));
      DT_RETURN_IF_ERROR(place(linear->bias(), p, c->fused));
    } else {
      DT_RETURN_IF_ERROR(place(embedding->weight(), Shard(1)));
    }
    const ColwiseParallel s = *c;
    if (c->fused > 1) {
      // The attention projects q, k and v from the stacked weight itself (c_attn's Forward does
      // not run), so c_attn's input, the attention's input, is brought to Replicate by a hook on
      // the attention, after that module's own input hooks (e.g. a PrepareModuleInput there).
      late_hooks->push_back([=] {
        parent->RegisterForwardInputHook([=](Module&, Variable& x) {
          return Prepare(x, *mesh_ptr, tp, s.input_layout, Replicate(), where + " input");
        });
      });
      return absl::OkStatus();
    }
    hooks->push_back([=, &m] {
      m.RegisterForwardInputHook([=](Module&, Variable& x) {
        return Prepare(x, *mesh_ptr, tp, s.input_layout, Replicate(), where + " input");
      });
      m.RegisterForwardOutputHook([=](Module&, Variable& y) -> absl::Status {
        DT_RETURN_IF_ERROR(Prepare(y, *mesh_ptr, tp, s.output_layout, s.output_layout, where + " output"));
        return ToLocalIf(s.use_local_output, y);
      });
    });
    return absl::OkStatus();
  }
  if (const auto* r = std::get_if<RowwiseParallel>(&style)) {
    if (linear == nullptr && embedding == nullptr) {
      return InvalidArg(kOp, where, ": RowwiseParallel applies to a Linear or an Embedding");
    }
    if (linear != nullptr) {
      DT_RETURN_IF_ERROR(place(linear->weight(), Shard(1)));
      DT_RETURN_IF_ERROR(place(linear->bias(), Replicate()));
    } else {
      DT_RETURN_IF_ERROR(place(embedding->weight(), Shard(0)));
    }
    const RowwiseParallel s = *r;
    // Plain inputs are taken as laid out as input_layout, ids too (PyTorch's from_local with
    // input_layouts), then brought to what the op needs.
    const Placement desired_in = embedding != nullptr ? Placement(Replicate()) : Placement(Shard(-1));
    hooks->push_back([=, &m] {
      m.RegisterForwardInputHook([=](Module&, Variable& x) {
        return Prepare(x, *mesh_ptr, tp, s.input_layout, desired_in, where + " input");
      });
      m.RegisterForwardOutputHook([=](Module&, Variable& y) -> absl::Status {
        DT_RETURN_IF_ERROR(Prepare(y, *mesh_ptr, tp, Partial(), s.output_layout, where + " output"));
        return ToLocalIf(s.use_local_output, y);
      });
    });
    return absl::OkStatus();
  }
  if (const auto* q = std::get_if<SequenceParallel>(&style)) {
    if (dynamic_cast<LayerNorm*>(&m) == nullptr && dynamic_cast<RMSNorm*>(&m) == nullptr &&
        dynamic_cast<Dropout*>(&m) == nullptr) {
      return InvalidArg(kOp, where, ": SequenceParallel applies to a LayerNorm, an RMSNorm or a Dropout");
    }
    for (auto& [pname, v] : m.NamedParameters()) DT_RETURN_IF_ERROR(place(v, Replicate()));
    const SequenceParallel s = *q;
    hooks->push_back([=, &m] {
      m.RegisterForwardInputHook([=](Module&, Variable& x) {
        return Prepare(x, *mesh_ptr, tp, Shard(s.sequence_dim), Shard(s.sequence_dim), where + " input");
      });
      m.RegisterForwardOutputHook([=](Module&, Variable& y) { return ToLocalIf(s.use_local_output, y); });
    });
    return absl::OkStatus();
  }
  if (const auto* i = std::get_if<PrepareModuleInput>(&style)) {
    const PrepareModuleInput s = *i;
    hooks->push_back([=, &m] {
      m.RegisterForwardInputHook([=](Module&, Variable& x) {
        return Prepare(x, *mesh_ptr, tp, s.input_layout, s.desired_input_layout, where + " input");
      });
    });
    return absl::OkStatus();
  }
  const PrepareModuleOutput s = std::get<PrepareModuleOutput>(style);
  hooks->push_back([=, &m] {
    m.RegisterForwardOutputHook([=](Module&, Variable& y) {
      return Prepare(y, *mesh_ptr, tp, s.output_layout, s.desired_output_layout, where + " output");
    });
  });
  return absl::OkStatus();
}

}  // namespace

std::string ParallelizePlan::ToString() const {
  std::vector<std::string> lines;
  for (const auto& [pattern, style] : rules) lines.push_back(absl::StrCat(pattern, ": ", StyleToString(style)));
  for (const ParamPlacements& p : params) {
    std::vector<std::string> dims;
    for (const auto& [dim, placement] : p.placements) dims.push_back(absl::StrCat(dim, "=", placement.ToString()));
    lines.push_back(absl::StrCat(p.pattern, ": ", absl::StrJoin(dims, ", ")));
  }
  return absl::StrJoin(lines, "\n");
}

bool MatchesModulePattern(const std::string& pattern, const std::string& name) {
  // The root's name is empty: only the empty pattern names it ("*" matches children only, as
  // in PyTorch).
  if (name.empty() || pattern.empty()) return name.empty() && pattern.empty();
  const std::vector<std::string> p = absl::StrSplit(pattern, '.');
  const std::vector<std::string> n = absl::StrSplit(name, '.');
  if (p.size() != n.size()) return false;
  for (size_t i = 0; i < p.size(); ++i) {
    if (fnmatch(p[i].c_str(), n[i].c_str(), 0) != 0) return false;
  }
  return true;
}

absl::Status ParallelizeModule(Module& module, const DeviceMesh& mesh, const ParallelizePlan& plan,
                               const std::string& tp_dim) {
  int tp = 0;
  if (!tp_dim.empty()) {
    DT_ASSIGN_OR_RETURN(tp, mesh.DimIndex(tp_dim));
  } else if (mesh.ndim() != 1) {
    return InvalidArg(kOp, "mesh ", mesh.ToString(), " has ", mesh.ndim(), " dims: name its tensor-parallel dim");
  }
  // The hooks hold the mesh (a copy shared by them): it outlives the caller's.
  auto kept = std::make_shared<const DeviceMesh>(mesh);
  absl::flat_hash_map<const VariableImpl*, ParamPlan> plans;
  // Installed once every check has passed; `late` after `hooks` (a fused c_attn's input hook on
  // its attention runs after the attention's own).
  std::vector<std::function<void()>> hooks, late;
  std::vector<std::pair<std::string, Module*>> modules = module.NamedModules();
  absl::flat_hash_map<std::string, Module*> by_name(modules.begin(), modules.end());
  // The rules applied to each module so far (text, style): two that both lay out its input, or
  // both its output, would stack their hooks; the same style twice is applied once.
  absl::flat_hash_map<std::string, std::vector<std::pair<std::string, const ParallelStyle*>>> applied;
  auto hooks_input = [](const ParallelStyle& s) { return !std::holds_alternative<PrepareModuleOutput>(s); };
  auto hooks_output = [](const ParallelStyle& s) { return !std::holds_alternative<PrepareModuleInput>(s); };
  for (const auto& [pattern, style] : plan.rules) {
    const std::string rule = absl::StrCat(pattern, ": ", StyleToString(style));
    int matched = 0;
    for (auto& [name, m] : modules) {
      if (!MatchesModulePattern(pattern, name)) continue;
      ++matched;
      bool same = false;
      for (const auto& [other, other_style] : applied[name]) {
        if (*other_style == style) {
          same = true;
        } else if ((hooks_input(style) && hooks_input(*other_style)) ||
                   (hooks_output(style) && hooks_output(*other_style))) {
          return InvalidArg(kOp, "rules '", other, "' and '", rule, "' both match module ",
                            name.empty() ? "(the root)" : name, " and both lay out its ",
                            hooks_input(style) && hooks_input(*other_style) ? "input" : "output",
                            ": give each module one style (narrow a pattern)");
        }
      }
      if (same) continue;
      applied[name].emplace_back(rule, &style);
      const size_t dot = name.rfind('.');
      Module* parent = name.empty() ? nullptr : by_name[dot == std::string::npos ? "" : name.substr(0, dot)];
      DT_RETURN_IF_ERROR(Apply(name, *m, parent, style, rule, kept, tp, &plans, &hooks, &late));
    }
    if (matched == 0) return InvalidArg(kOp, "rule '", rule, "' matches no module");
  }
  std::vector<std::pair<std::string, Variable*>> named = module.NamedParameters();
  for (const ParamPlacements& pr : plan.params) {
    const std::string rule = pr.text.empty() ? pr.pattern : pr.text;
    std::optional<Placement> on_tp;
    for (const auto& [dim, placement] : pr.placements) {
      absl::StatusOr<int> d = mesh.DimIndex(dim);
      if (!d.ok()) return InvalidArg(kOp, "rule '", rule, "': ", d.status().message());
      if (*d != tp) {
        return InvalidArg(kOp, "rule '", rule, "': ", dim,
                          " is a data-parallel dim, laid out by FSDP / DDP from its degree, not by a plan");
      }
      on_tp = placement;
    }
    int matched = 0;
    for (auto& [name, v] : named) {
      if (!MatchesModulePattern(pr.pattern, name)) continue;
      ++matched;
      const Placement p = on_tp.value_or(Replicate());
      if (p.is_partial()) return InvalidArg(kOp, "rule '", rule, "': a parameter cannot be ", p.ToString());
      DT_RETURN_IF_ERROR(
          ForTensor(p, v->value().dim(), absl::StrCat("rule '", rule, "' on parameter ", name)).status());
      ParamPlan want{p, 1, rule};
      auto [it, fresh] = plans.emplace(v->id(), want);
      if (!fresh && (it->second.placement != p || it->second.fused != 1)) {
        return InvalidArg(kOp, "parameter ", name, ": rule '", rule, "' places it ", p.ToString(), " but rule '",
                          it->second.rule, "' placed it ",
                          PlacementText(it->second.placement, it->second.fused, v->value().shape()));
      }
    }
    if (matched == 0) return InvalidArg(kOp, "rule '", rule, "' matches no parameter");
  }
  if (plan.every_parameter) {
    for (auto& [name, v] : named) {
      if (!plans.contains(v->id())) {
        return InvalidArg(kOp, "parameter ", name, " (", ShapeString(v->value().shape()),
                          ") is covered by no rule of the plan");
      }
    }
  }
  for (auto& [name, v] : named) {
    const Value& val = v->value();
    if (val.is_dtensor()) {
      return InvalidArg(kOp, "parameter ", name, " is a DTensor already (", val.dtensor().ToString(),
                        "): apply tensor parallelism first, and once");
    }
  }
  // Checked: nothing was changed before this point, so a plan refused leaves the module as it
  // was (and may be fixed and applied again).
  for (const std::function<void()>& install : hooks) install();
  for (const std::function<void()>& install : late) install();
  // Every parameter onto the mesh: its placement on tp, Replicate elsewhere.
  for (auto& [name, v] : named) {
    const Value& val = v->value();
    ParamPlan pp{Replicate(), 1, ""};
    if (auto it = plans.find(v->id()); it != plans.end()) pp = it->second;
    Tensor full = val.local();
    if (pp.fused > 1) {  // [k * n, ...] viewed as [k, n, ...]
      Shape stacked = {pp.fused, full.size(0) / pp.fused};
      for (int64_t d = 1; d < full.dim(); ++d) stacked.push_back(full.size(d));
      DT_ASSIGN_OR_RETURN(full, Reshape(full, stacked));
    }
    DT_ASSIGN_OR_RETURN(Placement p, ForTensor(pp.placement, full.dim(), absl::StrCat("parameter ", name)));
    Layout layout = Layout(Placements(static_cast<size_t>(mesh.ndim()), Replicate())).WithPlacement(tp, p);
    DT_ASSIGN_OR_RETURN(Tensor on_device, To(full, mesh.device()));
    DT_ASSIGN_OR_RETURN(DTensor d, DTensor::Distribute(on_device, mesh, layout, {.src_rank = std::nullopt}));
    DT_ASSIGN_OR_RETURN(Tensor own, Clone(d.ToLocal()));  // its own memory, not a view of the full value
    v->set_value(Value(DTensor::WrapTrusted(own, *kept, d.layout(), Shape(d.shape().begin(), d.shape().end()))));
  }
  return absl::OkStatus();
}

}  // namespace dtensor::nn
