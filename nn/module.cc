#include "dtensor/nn/module.h"

#include <algorithm>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "dtensor/ops/ops.h"
#include "dtensor/tensor/status.h"

namespace dtensor::nn {

void Module::Collect(const std::string& prefix, std::vector<std::pair<std::string, Variable*>>* out,
                     std::vector<const VariableImpl*>* seen) {
  auto add = [&](const std::string& name, Variable* v) {
    if (std::find(seen->begin(), seen->end(), v->id()) != seen->end()) return;
    seen->push_back(v->id());
    out->emplace_back(prefix + name, v);
  };
  for (auto& [name, v] : params_) add(name, v.get());
  for (auto& [name, v] : shared_params_) add(name, v);
  for (auto& [name, m] : children_) m->Collect(prefix + name + ".", out, seen);
}

std::vector<std::pair<std::string, Variable*>> Module::NamedParameters() {
  std::vector<std::pair<std::string, Variable*>> out;
  std::vector<const VariableImpl*> seen;
  Collect("", &out, &seen);
  return out;
}

std::vector<Variable*> Module::Parameters() {
  std::vector<Variable*> out;
  for (auto& [name, v] : NamedParameters()) out.push_back(v);
  return out;
}

std::vector<std::pair<std::string, Value*>> Module::NamedBuffers() {
  std::vector<std::pair<std::string, Value*>> out;
  for (auto& [name, m] : NamedModules()) {
    for (auto& [b, v] : m->buffers_) out.emplace_back(name.empty() ? b : name + "." + b, v.get());
  }
  return out;
}

std::vector<std::pair<std::string, Module*>> Module::NamedModules() {
  std::vector<std::pair<std::string, Module*>> out = {{"", this}};
  for (auto& [name, m] : children_) {
    for (auto& [sub, mm] : m->NamedModules()) out.emplace_back(sub.empty() ? name : name + "." + sub, mm);
  }
  return out;
}

Variable* Module::FindParameter(const std::string& dotted_name) {
  for (auto& [name, v] : NamedParameters()) {
    if (name == dotted_name) return v;
  }
  return nullptr;
}

void Module::Train(bool on) {
  for (auto& [name, m] : NamedModules()) m->training_ = on;
}

Shape Module::RegisteredShapeOf(const Variable& param) const {
  if (const Shape* s = RegisteredShape(param.id())) return *s;
  return Shape(param.value().shape().begin(), param.value().shape().end());
}

const Shape* Module::RegisteredShape(const VariableImpl* v) const {
  for (size_t i = 0; i < params_.size(); ++i) {
    if (params_[i].second->id() == v) return &param_shapes_[i];
  }
  for (const auto& [name, m] : children_) {
    if (const Shape* s = m->RegisteredShape(v)) return s;
  }
  return nullptr;
}

absl::StatusOr<std::vector<std::pair<std::string, Tensor>>> Module::StateDict() {
  std::vector<std::pair<std::string, Tensor>> out;
  for (auto& [name, v] : NamedParameters()) {
    DT_RETURN_IF_ERROR(v->Settle());  // the parameter itself, not a gathered (param_dtype) copy
    const Value& val = v->value();
    Tensor full = val.local();
    if (val.is_dtensor()) {
      DT_ASSIGN_OR_RETURN(full, val.dtensor().FullTensor());
    }
    const Shape* shape = RegisteredShape(v->id());
    if (shape != nullptr && full.shape() != IntSpan(*shape) && NumElements(*shape) == full.numel()) {
      DT_ASSIGN_OR_RETURN(full, Reshape(full, *shape));
    }
    out.emplace_back(name, full);
  }
  return out;
}

absl::Status Module::LoadStateDict(const std::vector<std::pair<std::string, Tensor>>& tensors, bool strict) {
  absl::flat_hash_map<std::string, const Tensor*> given;
  for (const auto& [name, t] : tensors) given[name] = &t;
  size_t used = 0;
  for (auto& [name, v] : NamedParameters()) {
    DT_RETURN_IF_ERROR(v->Settle());  // load into the parameter itself, not a gathered copy
    auto it = given.find(name);
    if (it == given.end()) {
      if (strict) return absl::InvalidArgumentError(absl::StrCat("[LoadStateDict] missing parameter ", name));
      continue;
    }
    ++used;
    Tensor src = *it->second;
    const Value& val = v->value();
    const Shape* registered = RegisteredShape(v->id());
    if (src.shape() != val.shape() && registered != nullptr && src.shape() == IntSpan(*registered) &&
        src.numel() == val.numel()) {
      DT_ASSIGN_OR_RETURN(src, Reshape(src, val.shape()));  // a parameter viewed in another shape
    }
    if (src.shape() != val.shape()) {
      return absl::InvalidArgumentError(absl::StrCat("[LoadStateDict] ", name, ": shape ", ShapeString(src.shape()),
                                                     " does not match the parameter's ", ShapeString(val.shape())));
    }
    if (val.is_dtensor()) {
      const DTensor& d = val.dtensor();
      DT_ASSIGN_OR_RETURN(DTensor piece, DTensor::Distribute(src, d.mesh(), d.layout(), {.src_rank = std::nullopt}));
      DT_RETURN_IF_ERROR(Copy_(d.ToLocal(), piece.ToLocal()));
    } else {
      DT_RETURN_IF_ERROR(Copy_(val.local(), src));
    }
  }
  if (strict && used != tensors.size()) {
    for (const auto& [name, t] : tensors) {
      if (FindParameter(name) == nullptr) {
        return absl::InvalidArgumentError(absl::StrCat("[LoadStateDict] unknown parameter ", name));
      }
    }
  }
  return absl::OkStatus();
}

Variable* Module::RegisterParameter(const std::string& name, Value value) {
  param_shapes_.emplace_back(value.shape().begin(), value.shape().end());
  params_.emplace_back(name, std::make_unique<Variable>(Variable::Leaf(std::move(value), true, name)));
  return params_.back().second.get();
}

Variable* Module::RegisterSharedParameter(const std::string& name, Variable* shared) {
  shared_params_.emplace_back(name, shared);
  return shared;
}

Value* Module::RegisterBuffer(const std::string& name, Value value) {
  buffers_.emplace_back(name, std::make_unique<Value>(std::move(value)));
  return buffers_.back().second.get();
}

Module::~Module() { *alive_ = false; }

absl::Status Module::RunForwardPreHooks(Variable& input) {
  for (Hook& h : pre_hooks_) DT_RETURN_IF_ERROR(h(*this));
  for (InputHook& h : input_hooks_) DT_RETURN_IF_ERROR(h(*this, input));
  return absl::OkStatus();
}

absl::Status Module::RunForwardHooks(Variable& output) {
  for (Hook& h : post_hooks_) DT_RETURN_IF_ERROR(h(*this));
  for (OutputHook& h : output_hooks_) DT_RETURN_IF_ERROR(h(*this, output));
  return absl::OkStatus();
}

void Module::AttachBackwardPreHooks(Variable& out) {
  if (backward_pre_hooks_.empty() || !out.requires_grad()) return;
  out.RegisterHook([this, alive = alive_](Value&) -> absl::Status {
    if (!*alive) {
      return absl::FailedPreconditionError(
          "[Module] backward reached a module's backward pre-hooks after the module was destroyed");
    }
    for (Hook& h : backward_pre_hooks_) DT_RETURN_IF_ERROR(h(*this));
    return absl::OkStatus();
  });
}

absl::StatusOr<Variable> Module::WithHooks(const Variable& input,
                                           const std::function<absl::StatusOr<Variable>(const Variable&)>& body) {
  Variable x = input;
  DT_RETURN_IF_ERROR(RunForwardPreHooks(x));
  DT_ASSIGN_OR_RETURN(Variable out, wrapper_ ? wrapper_(x, body) : body(x));
  DT_RETURN_IF_ERROR(RunForwardHooks(out));
  AttachBackwardPreHooks(out);
  return out;
}

void Module::SetAttachment(const std::string& key, std::shared_ptr<void> value) {
  for (auto& [k, v] : attachments_) {
    if (k == key) {
      v = std::move(value);
      return;
    }
  }
  attachments_.emplace_back(key, std::move(value));
}

std::shared_ptr<void> Module::GetAttachment(const std::string& key) const {
  for (const auto& [k, v] : attachments_) {
    if (k == key) return v;
  }
  return nullptr;
}

absl::Status Module::To(Device device) {
  for (auto& [name, v] : NamedParameters()) {
    if (v->value().is_dtensor()) {
      return absl::InvalidArgumentError(absl::StrCat("[Module::To] parameter ", name, " is a DTensor (on ",
                                                     v->value().dtensor().mesh().ToString(),
                                                     "); it lives on its mesh's device"));
    }
    DT_ASSIGN_OR_RETURN(Tensor moved, dtensor::To(v->value().local(), device));
    Value grad = v->grad();
    v->set_value(Value(std::move(moved)));
    if (grad.defined() && !grad.is_dtensor()) {
      DT_ASSIGN_OR_RETURN(Tensor g, dtensor::To(grad.local(), device));
      v->set_grad(Value(std::move(g)));
    }
  }
  for (auto& [name, b] : NamedBuffers()) {
    if (!b->defined()) continue;
    if (b->is_dtensor()) {
      return absl::InvalidArgumentError(absl::StrCat("[Module::To] buffer ", name, " is a DTensor"));
    }
    DT_ASSIGN_OR_RETURN(Tensor moved, dtensor::To(b->local(), device));
    *b = Value(std::move(moved));
  }
  return absl::OkStatus();
}

absl::Status DistributeModule(Module& module, const DeviceMesh& mesh,
                              const std::function<Layout(const std::string&, const Variable&)>& layout_for) {
  for (auto& [name, v] : module.NamedParameters()) {
    const Value& val = v->value();
    if (val.is_dtensor()) {
      return absl::InvalidArgumentError(absl::StrCat("[DistributeModule] ", name, " is already a DTensor"));
    }
    Layout layout = layout_for
                        ? layout_for(name, *v)
                        : Layout(absl::InlinedVector<Placement, 4>(static_cast<size_t>(mesh.ndim()), Replicate()));
    DT_ASSIGN_OR_RETURN(Tensor on_device, To(val.local(), mesh.device()));
    DT_ASSIGN_OR_RETURN(DTensor d, DTensor::Distribute(on_device, mesh, layout, {.src_rank = std::nullopt}));
    // Own the piece (Distribute may return a view of the full tensor).
    DT_ASSIGN_OR_RETURN(Tensor own, Clone(d.ToLocal()));
    DT_ASSIGN_OR_RETURN(DTensor dd, DTensor::FromLocal(own, mesh, d.layout(),
                                                       {.global_shape = Shape(d.shape().begin(), d.shape().end())}));
    v->set_value(Value(dd));
  }
  return absl::OkStatus();
}

}  // namespace dtensor::nn
