#include "dtensor/autograd/checkpoint.h"

#include <memory>
#include <optional>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "dtensor/autograd/dispatch.h"
#include "dtensor/tensor/status.h"

namespace dtensor {
namespace {

// Installs a dispatch observer (or none) for a scope.
class ObserverScope {
 public:
  explicit ObserverScope(internal::DispatchObserver* o) : prev_(internal::SetDispatchObserver(o)) {}
  ~ObserverScope() { internal::SetDispatchObserver(prev_); }
  ObserverScope(const ObserverScope&) = delete;
  ObserverScope& operator=(const ObserverScope&) = delete;

 private:
  internal::DispatchObserver* prev_;
};

std::string ShapesString(absl::Span<const Shape> shapes) {
  return absl::StrJoin(shapes, ", ", [](std::string* out, const Shape& s) { out->append(ShapeString(s)); });
}

// The outputs of the save_ops ops of one forward, in the order they ran; handed back in that
// order while the forward is recomputed.
class SavedOps : public internal::DispatchObserver {
 public:
  explicit SavedOps(const std::vector<std::string>& names) : names_(names.begin(), names.end()) {}

  void StartRecording() {
    recording_ = true;
    entries_.clear();
  }
  void StartReplay() {
    recording_ = false;
    next_ = 0;
  }
  // After a replay: every kept output must have been asked for again.
  absl::Status FinishReplay() const {
    if (next_ == entries_.size()) return absl::OkStatus();
    return absl::FailedPreconditionError(absl::StrCat("[Checkpoint] the recomputation ran ", next_, " of the ",
                                                      entries_.size(), " saved ops (next: ", entries_[next_].op->name,
                                                      "): the function is not deterministic"));
  }

  absl::StatusOr<std::optional<std::vector<Value>>> Replace(const OpDef& op, absl::Span<const Value> inputs,
                                                            const OpArgs&) override {
    if (recording_ || !names_.contains(op.name)) return std::optional<std::vector<Value>>();
    std::vector<Shape> shapes = ShapesOf(inputs);
    if (next_ >= entries_.size() || entries_[next_].op != &op || entries_[next_].input_shapes != shapes) {
      const std::string was = next_ < entries_.size() ? absl::StrCat(entries_[next_].op->name, " on ",
                                                                     ShapesString(entries_[next_].input_shapes))
                                                      : "no more saved ops";
      return absl::FailedPreconditionError(absl::StrCat("[Checkpoint] the recomputation ran ", op.name, " on ",
                                                        ShapesString(shapes), " where the forward ran ", was,
                                                        ": the function is not deterministic"));
    }
    const Entry& e = entries_[next_++];
    if (op.ac_rebuild != nullptr) {  // only one output was kept: the others come from it
      DT_ASSIGN_OR_RETURN(std::vector<Value> outputs, op.ac_rebuild(e.outputs[0], *e.args));
      return std::optional<std::vector<Value>>(std::move(outputs));
    }
    return std::optional<std::vector<Value>>(e.outputs);
  }

  void Ran(const OpDef& op, absl::Span<const Value> inputs, const OpArgs& args,
           const std::vector<Value>& outputs) override {
    if (!recording_ || !names_.contains(op.name)) return;
    if (op.ac_rebuild != nullptr && op.ac_kept_output >= 0 && static_cast<size_t>(op.ac_kept_output) < outputs.size()) {
      entries_.push_back({&op,
                          ShapesOf(inputs),
                          {outputs[static_cast<size_t>(op.ac_kept_output)]},
                          std::make_shared<const OpArgs>(args)});
      return;
    }
    entries_.push_back({&op, ShapesOf(inputs), outputs, nullptr});
  }

 private:
  struct Entry {
    const OpDef* op;
    std::vector<Shape> input_shapes;
    std::vector<Value> outputs;  // all of them, or the kept one (OpDef::ac_rebuild)
    // For ac_rebuild (behind a pointer: g++ 12 reports a false "maybe uninitialized" when an
    // absl::InlinedVector is moved inside this struct).
    std::shared_ptr<const OpArgs> args;
  };
  static std::vector<Shape> ShapesOf(absl::Span<const Value> inputs) {
    std::vector<Shape> out;
    for (const Value& v : inputs) out.emplace_back(v.shape().begin(), v.shape().end());
    return out;
  }
  absl::flat_hash_set<std::string> names_;
  bool recording_ = true;
  std::vector<Entry> entries_;
  size_t next_ = 0;
};

struct OutputMeta {
  Shape shape;
  DType dtype = DType::kFloat32;
};

// What the Checkpoint node keeps between forward and backward.
struct Saved {
  CheckpointFn fn;
  std::vector<Value> inputs;
  std::vector<bool> needs_grad;  // per input
  std::vector<OutputMeta> outputs;
  std::function<std::function<void()>()> capture_state;
  std::function<void()> forward_state;  // puts the state back as the forward began
  std::shared_ptr<SavedOps> saved_ops;  // null: recompute everything
};

// Runs `fn` again on the saved inputs with grad recording and backpropagates `grads` (one per
// output) through the new graph; returns the inputs' gradients.
absl::StatusOr<std::vector<Value>> Recompute(const Saved& s, std::vector<Value>& grads) {
  // Each input enters the recomputation as the output of a node of its own that only keeps
  // the gradient reaching it (the sum over the paths inside fn).
  auto input_grads = std::make_shared<std::vector<Value>>(s.inputs.size());
  std::vector<Variable> inputs;
  inputs.reserve(s.inputs.size());
  for (size_t i = 0; i < s.inputs.size(); ++i) {
    if (!s.needs_grad[i]) {
      inputs.push_back(Variable::Leaf(s.inputs[i], false));
      continue;
    }
    auto sink = std::make_shared<FunctionNode>(
        "CheckpointInput", 1, [input_grads, i](std::vector<Value>& g) -> absl::StatusOr<std::vector<Value>> {
          (*input_grads)[i] = std::move(g[0]);
          return std::vector<Value>{};
        });
    inputs.push_back(Variable::FromNode(s.inputs[i], std::move(sink), 0));
  }

  absl::StatusOr<std::vector<Variable>> outputs;
  {
    // The state as the forward found it, for the recomputation only.
    std::function<void()> back_to_now = s.capture_state ? s.capture_state() : nullptr;
    if (s.forward_state) s.forward_state();
    EnableGradGuard grad_on;
    if (s.saved_ops) s.saved_ops->StartReplay();
    {
      ObserverScope observe(s.saved_ops.get());
      outputs = s.fn(inputs);
    }
    if (back_to_now) back_to_now();
  }
  DT_RETURN_IF_ERROR(outputs.status());
  if (s.saved_ops) DT_RETURN_IF_ERROR(s.saved_ops->FinishReplay());
  if (outputs->size() != s.outputs.size()) {
    return absl::FailedPreconditionError(absl::StrCat("[Checkpoint] the recomputation returned ", outputs->size(),
                                                      " outputs, the forward ", s.outputs.size()));
  }
  std::vector<Variable> roots;
  std::vector<Value> root_grads;
  for (size_t i = 0; i < outputs->size(); ++i) {
    const Variable& v = (*outputs)[i];
    const OutputMeta& m = s.outputs[i];
    if (!v.defined() || v.value().shape() != IntSpan(m.shape) || v.value().dtype() != m.dtype) {
      return absl::FailedPreconditionError(absl::StrCat(
          "[Checkpoint] recomputed output ", i, " is ", v.defined() ? DTypeName(v.value().dtype()) : "undefined", " ",
          v.defined() ? ShapeString(v.value().shape()) : "", " but the forward's was ", DTypeName(m.dtype), " ",
          ShapeString(m.shape), ": the function is not deterministic"));
    }
    if (!grads[i].defined() || !v.requires_grad()) continue;
    roots.push_back(v);
    root_grads.push_back(std::move(grads[i]));
  }
  if (!roots.empty()) {
    ObserverScope none(nullptr);  // the inner pass's ops run as usual
    DT_RETURN_IF_ERROR(Backward(roots, root_grads));
  }
  return std::move(*input_grads);
}

}  // namespace

absl::StatusOr<std::vector<Variable>> ActivationCheckpoint(const CheckpointFn& fn, absl::Span<const Variable> inputs,
                                                           const CheckpointOptions& options) {
  if (!GradEnabled()) return fn(inputs);
  auto saved = std::make_shared<Saved>();
  saved->fn = fn;
  saved->capture_state = options.capture_state;
  if (options.capture_state) saved->forward_state = options.capture_state();
  if (!options.save_ops.empty()) saved->saved_ops = std::make_shared<SavedOps>(options.save_ops);
  absl::StatusOr<std::vector<Variable>> plain;
  {
    NoGradGuard no_grad;
    if (saved->saved_ops) saved->saved_ops->StartRecording();
    ObserverScope observe(saved->saved_ops.get());  // also hides an enclosing checkpoint's
    plain = fn(inputs);
  }
  DT_RETURN_IF_ERROR(plain.status());
  for (size_t i = 0; i < plain->size(); ++i) {
    const Variable& v = (*plain)[i];
    if (!v.defined()) return absl::InvalidArgumentError(absl::StrCat("[Checkpoint] output ", i, " is undefined"));
    saved->outputs.push_back({Shape(v.value().shape().begin(), v.value().shape().end()), v.value().dtype()});
  }
  for (const Variable& v : inputs) {
    saved->inputs.push_back(v.value());
    saved->needs_grad.push_back(v.requires_grad());
  }
  auto node = std::make_shared<FunctionNode>(
      "Checkpoint", static_cast<int>(plain->size()),
      [saved](std::vector<Value>& grads) -> absl::StatusOr<std::vector<Value>> { return Recompute(*saved, grads); });
  node->next_edges().reserve(inputs.size());
  for (const Variable& v : inputs) node->next_edges().push_back(Node::EdgeOf(v));
  std::vector<Variable> out;
  out.reserve(plain->size());
  for (size_t i = 0; i < plain->size(); ++i) {
    out.push_back(Variable::FromNode((*plain)[i].value(), node, static_cast<int>(i)));
  }
  return out;
}

absl::StatusOr<Variable> ActivationCheckpoint(const std::function<absl::StatusOr<Variable>(const Variable&)>& fn,
                                              const Variable& input, const CheckpointOptions& options) {
  CheckpointFn many = [fn](absl::Span<const Variable> in) -> absl::StatusOr<std::vector<Variable>> {
    DT_ASSIGN_OR_RETURN(Variable y, fn(in[0]));
    return std::vector<Variable>{std::move(y)};
  };
  DT_ASSIGN_OR_RETURN(std::vector<Variable> out, ActivationCheckpoint(many, absl::MakeConstSpan(&input, 1), options));
  return std::move(out[0]);
}

}  // namespace dtensor
