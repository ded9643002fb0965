#include "dtensor/autograd/variable.h"

#include <algorithm>
#include <atomic>
#include <queue>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "dtensor/autograd/functional.h"
#include "dtensor/ops/ops.h"
#include "dtensor/tensor/status.h"

namespace dtensor {

struct VariableImpl {
  Value value;
  Value grad;
  bool grad_owned = false;  // grad's memory is ours to accumulate into in place
  bool requires_grad = false;
  std::shared_ptr<Node> grad_fn;
  int output_nr = 0;
  std::string name;
  std::vector<GradHook> hooks;  // leaves (non-leaf hooks live on grad_fn)
  std::vector<std::function<absl::Status(Variable&)>> post_hooks;
  std::weak_ptr<Node> accumulator;
  std::function<absl::Status()> settle;  // SetParamHooks
  std::function<void()> reset;
};

namespace {

std::atomic<uint64_t> g_next_sequence_nr{1};  // orders nodes; not state anyone configures
thread_local bool t_grad_enabled = true;

// Callbacks queued during the backward pass running on this thread (QueueBackwardCallback).
struct PassCallbacks {
  struct Entry {
    uint64_t sequence_nr;
    uint64_t order;
    std::function<absl::Status()> fn;
  };
  std::vector<Entry> pending;
  uint64_t queued = 0;
  std::vector<std::function<void()>> on_failure;  // QueueBackwardFailureCallback

  // Runs (and removes) the due callbacks — those whose point is newer than `node_nr` (the
  // node about to run), or all at the end of the pass — newest point first, then in queued
  // order. Callbacks queued meanwhile run too when due.
  absl::Status RunDue(uint64_t node_nr, bool at_end) {
    while (true) {
      size_t best = pending.size();
      for (size_t i = 0; i < pending.size(); ++i) {
        const Entry& e = pending[i];
        if (!at_end && e.sequence_nr <= node_nr) continue;
        if (best == pending.size() || e.sequence_nr > pending[best].sequence_nr ||
            (e.sequence_nr == pending[best].sequence_nr && e.order < pending[best].order)) {
          best = i;
        }
      }
      if (best == pending.size()) return absl::OkStatus();
      std::function<absl::Status()> fn = std::move(pending[best].fn);
      pending.erase(pending.begin() + static_cast<std::ptrdiff_t>(best));
      DT_RETURN_IF_ERROR(fn());
    }
  }
};
thread_local PassCallbacks* t_pass = nullptr;

const Value& EmptyValue() {
  static const Value* empty = new Value();
  return *empty;
}

const std::string& EmptyString() {
  static const std::string* empty = new std::string();
  return *empty;
}

}  // namespace

// ---- Variable ----

Variable Variable::Leaf(Value value, bool requires_grad, std::string name) {
  auto impl = std::make_shared<VariableImpl>();
  impl->value = std::move(value);
  impl->requires_grad = requires_grad;
  impl->name = std::move(name);
  return Variable(std::move(impl));
}

Variable Variable::FromNode(Value value, std::shared_ptr<Node> node, int output_nr) {
  auto impl = std::make_shared<VariableImpl>();
  impl->value = std::move(value);
  impl->requires_grad = true;
  impl->grad_fn = std::move(node);
  impl->output_nr = output_nr;
  return Variable(std::move(impl));
}

const Value& Variable::value() const { return impl_ ? impl_->value : EmptyValue(); }
void Variable::set_value(Value v) { impl_->value = std::move(v); }
const Value& Variable::grad() const { return impl_ ? impl_->grad : EmptyValue(); }
void Variable::set_grad(Value g) {
  impl_->grad = std::move(g);
  impl_->grad_owned = impl_->grad.defined();
}
void Variable::reset_grad() {
  set_grad(Value());
  if (impl_->reset) impl_->reset();
}
void Variable::SetParamHooks(std::function<absl::Status()> settle, std::function<void()> reset) {
  impl_->settle = std::move(settle);
  impl_->reset = std::move(reset);
}
absl::Status Variable::Settle() const { return impl_ != nullptr && impl_->settle ? impl_->settle() : absl::OkStatus(); }
bool Variable::requires_grad() const { return impl_ && impl_->requires_grad; }
void Variable::set_requires_grad(bool r) { impl_->requires_grad = r; }
bool Variable::is_leaf() const { return impl_ && impl_->grad_fn == nullptr; }
const std::string& Variable::name() const { return impl_ ? impl_->name : EmptyString(); }
const std::shared_ptr<Node>& Variable::grad_fn() const {
  static const std::shared_ptr<Node>* none = new std::shared_ptr<Node>();
  return impl_ ? impl_->grad_fn : *none;
}
int Variable::output_nr() const { return impl_ ? impl_->output_nr : 0; }

void Variable::RegisterHook(GradHook hook) {
  if (impl_->grad_fn) {
    impl_->grad_fn->AddPreHook(impl_->output_nr, std::move(hook));
  } else {
    impl_->hooks.push_back(std::move(hook));
  }
}

void Variable::RegisterPostAccumulateGradHook(std::function<absl::Status(Variable&)> hook) {
  impl_->post_hooks.push_back(std::move(hook));
}

// ---- Nodes ----

Node::Node(const char* name, int num_outputs)
    : name_(name), num_outputs_(num_outputs), sequence_nr_(g_next_sequence_nr.fetch_add(1)) {}

absl::StatusOr<std::vector<Value>> FunctionNode::Apply(std::vector<Value> grad_outputs) {
  if (!fn_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "[Backward] ", name(), " ran a second time after its saved values were released; pass retain_graph=true"));
  }
  return fn_(grad_outputs);
}

absl::StatusOr<std::vector<Value>> FunctionNode::ApplyInto(std::vector<Value> grad_outputs,
                                                           absl::Span<const Tensor* const> pending) {
  if (!into_) return Apply(std::move(grad_outputs));
  return into_(grad_outputs, pending);
}

namespace {

// Whether `d` is sharded on a mesh dim (of more than one rank) where `target` is Partial: no
// redistribution goes there (Shard -> Partial), so such gradients are added by the
// dispatcher's Add, which picks a layout both reach.
bool ShardMeetsPartial(const DTensor& d, const Layout& target) {
  const Layout& have = d.layout();
  for (int m = 0; m < d.mesh().ndim(); ++m) {
    if (d.mesh().size(m) > 1 && have[m].is_shard() && target[m].is_partial()) return true;
  }
  return false;
}

}  // namespace

// Accumulates into a leaf's grad. It runs as soon as every gradient for its leaf has arrived
// (it outranks every other node, as PyTorch's AccumulateGrad does): a node kept from an
// earlier graph (a previous step's loss still held) or made at a module's first use in a
// forward that used it twice is older than the module's later forward, yet its leaf's
// gradient must be in place before that forward's post-backward callbacks (FSDP's reduce)
// run.
struct AccumulateGradNode : public Node {
  explicit AccumulateGradNode(std::weak_ptr<VariableImpl> v) : Node("AccumulateGrad", 1), var(std::move(v)) {}
  absl::StatusOr<std::vector<Value>> Apply(std::vector<Value> grads) override {
    std::shared_ptr<VariableImpl> impl = var.lock();
    if (impl == nullptr || !grads[0].defined()) return std::vector<Value>{};
    Value g = std::move(grads[0]);
    if (g.is_dtensor() && impl->value.defined() && !impl->value.is_dtensor()) {
      // A plain leaf used beside DTensors took part as Replicate (as under PyTorch's implicit
      // replication): its gradient is the whole one, reduced from the Partial / Shard pieces.
      const DTensor& d = g.dtensor();
      DT_ASSIGN_OR_RETURN(DTensor r,
                          d.Redistribute(Layout(Placements(static_cast<size_t>(d.mesh().ndim()), Replicate()))));
      g = Value(r.ToLocal());
    }
    for (GradHook& h : impl->hooks) DT_RETURN_IF_ERROR(h(g));
    if (!impl->grad.defined()) {
      // A leaf's grad never shares memory with another tensor (as in PyTorch): a gradient
      // passed through unchanged (Add's, to both inputs) is copied, so that in-place updates
      // of one grad (clipping, accumulation) do not reach another.
      const auto& storage = g.local().storage();
      if (storage == nullptr || storage.use_count() != 1) {
        DT_ASSIGN_OR_RETURN(Tensor copy, Clone(g.local()));
        if (g.is_dtensor()) {
          const DTensor& d = g.dtensor();
          DTensor::FromLocalOptions o;
          o.global_shape = Shape(d.shape().begin(), d.shape().end());
          DT_ASSIGN_OR_RETURN(DTensor dc, DTensor::FromLocal(std::move(copy), d.mesh(), d.layout(), o));
          g = Value(std::move(dc));
        } else {
          g = Value(std::move(copy));
        }
      }
      impl->grad_owned = true;
      impl->grad = std::move(g);
    } else if (impl->grad_owned && impl->grad.is_dtensor() == g.is_dtensor() &&
               (!g.is_dtensor() || impl->grad.dtensor().layout() == g.dtensor().layout())) {
      DT_RETURN_IF_ERROR(Add_(impl->grad.local(), g.local()));
    } else if (impl->grad_owned && g.is_dtensor() && impl->grad.is_dtensor() &&
               !ShardMeetsPartial(g.dtensor(), impl->grad.dtensor().layout())) {
      DT_ASSIGN_OR_RETURN(DTensor r, g.dtensor().Redistribute(impl->grad.dtensor().layout()));
      DT_RETURN_IF_ERROR(Add_(impl->grad.local(), r.ToLocal()));
    } else {
      DT_ASSIGN_OR_RETURN(impl->grad, AddGrads(impl->grad, g));
      impl->grad_owned = true;
    }
    Variable v(impl);
    for (auto& h : impl->post_hooks) DT_RETURN_IF_ERROR(h(v));
    return std::vector<Value>{};
  }
  std::weak_ptr<VariableImpl> var;
};

Edge Node::EdgeOf(const Variable& v) {
  if (!v.requires_grad()) return Edge{};
  if (v.impl_->grad_fn) return Edge{v.impl_->grad_fn, v.impl_->output_nr};
  std::shared_ptr<Node> acc = v.impl_->accumulator.lock();
  if (acc == nullptr) {
    acc = std::make_shared<AccumulateGradNode>(v.impl_);
    v.impl_->accumulator = acc;
  }
  return Edge{acc, 0};
}

// ---- Grad mode ----

bool GradEnabled() { return t_grad_enabled; }
NoGradGuard::NoGradGuard() : prev_(t_grad_enabled) { t_grad_enabled = false; }
NoGradGuard::~NoGradGuard() { t_grad_enabled = prev_; }
EnableGradGuard::EnableGradGuard() : prev_(t_grad_enabled) { t_grad_enabled = true; }
EnableGradGuard::~EnableGradGuard() { t_grad_enabled = prev_; }

bool AnyRequiresGrad(absl::Span<const Variable> inputs) {
  if (!t_grad_enabled) return false;
  for (const Variable& v : inputs) {
    if (v.requires_grad()) return true;
  }
  return false;
}

std::vector<Variable> Record(const char* name, absl::Span<const Variable> inputs, std::vector<Value> outputs,
                             FunctionNode::Fn backward) {
  std::vector<Variable> result;
  result.reserve(outputs.size());
  if (!AnyRequiresGrad(inputs)) {
    for (Value& v : outputs) result.push_back(Variable::Leaf(std::move(v)));
    return result;
  }
  auto node = std::make_shared<FunctionNode>(name, static_cast<int>(outputs.size()), std::move(backward));
  node->next_edges().reserve(inputs.size());
  for (const Variable& v : inputs) node->next_edges().push_back(Node::EdgeOf(v));
  for (size_t i = 0; i < outputs.size(); ++i) {
    result.push_back(Variable::FromNode(std::move(outputs[i]), node, static_cast<int>(i)));
  }
  return result;
}

// A number of its own (no node takes it): two marks with no node recorded between them still
// differ, on every thread alike, whatever other threads record (the counter is shared).
uint64_t NextSequenceNr() { return g_next_sequence_nr.fetch_add(1); }

absl::Status QueueBackwardCallback(uint64_t sequence_nr, std::function<absl::Status()> fn) {
  if (t_pass == nullptr) {
    return absl::FailedPreconditionError("[QueueBackwardCallback] called outside a backward pass");
  }
  t_pass->pending.push_back({sequence_nr, t_pass->queued++, std::move(fn)});
  return absl::OkStatus();
}

absl::Status QueueBackwardFailureCallback(std::function<void()> fn) {
  if (t_pass == nullptr) {
    return absl::FailedPreconditionError("[QueueBackwardFailureCallback] called outside a backward pass");
  }
  t_pass->on_failure.push_back(std::move(fn));
  return absl::OkStatus();
}

bool InBackward() { return t_pass != nullptr; }

absl::StatusOr<Value> AddGrads(const Value& a, const Value& b) {
  if (!a.defined()) return b;
  if (!b.defined()) return a;
  return fn::Add(a, b);
}

// ---- The backward pass ----

absl::Status RunBackward(absl::Span<const Variable> roots, absl::Span<const Value> grad_roots, bool retain_graph) {
  // A root gradient must look like its root (PyTorch: "Mismatch in shape"); none at all, or
  // one per root.
  if (!grad_roots.empty() && grad_roots.size() != roots.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("[Backward] ", grad_roots.size(), " root gradients for ", roots.size(), " roots"));
  }
  for (size_t i = 0; i < grad_roots.size(); ++i) {
    const Value& g = grad_roots[i];
    const Value& v = roots[i].value();
    if (!g.defined()) continue;
    if (g.shape() != v.shape() || g.dtype() != v.dtype()) {
      return absl::InvalidArgumentError(
          absl::StrCat("[Backward] the gradient of root ", i, " is ", DTypeName(g.dtype()), " ", ShapeString(g.shape()),
                       " but the root is ", DTypeName(v.dtype()), " ", ShapeString(v.shape())));
    }
  }
  // Callbacks queued by this pass's hooks (QueueBackwardCallback); a nested pass has its own.
  PassCallbacks pass;
  struct Install {
    PassCallbacks* prev;
    explicit Install(PassCallbacks* p) : prev(t_pass) { t_pass = p; }
    ~Install() { t_pass = prev; }
  } install(&pass);
  // On any error return: the failure callbacks, newest first (t_pass is still this pass).
  struct OnFailure {
    PassCallbacks& pass;
    bool ok = false;
    ~OnFailure() {
      if (ok) return;
      for (auto it = pass.on_failure.rbegin(); it != pass.on_failure.rend(); ++it) (*it)();
    }
  } on_failure{pass};
  // Dependencies: how many edges lead into each reachable node.
  absl::flat_hash_map<Node*, int> deps;
  std::vector<Node*> stack;
  std::vector<Edge> root_edges;
  for (const Variable& r : roots) {
    Edge e = Node::EdgeOf(r);
    if (e.node == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("[Backward] root ", r.name().empty() ? "variable" : r.name(), " does not require grad"));
    }
    root_edges.push_back(e);
    if (deps.emplace(e.node.get(), 0).second) stack.push_back(e.node.get());
  }
  while (!stack.empty()) {
    Node* n = stack.back();
    stack.pop_back();
    for (const Edge& e : n->next_edges()) {
      if (e.node == nullptr) continue;
      auto [it, fresh] = deps.emplace(e.node.get(), 0);
      ++it->second;
      if (fresh) stack.push_back(e.node.get());
    }
  }
  // Gradient buffers per node, filled as producers run.
  absl::flat_hash_map<Node*, std::vector<Value>> buffers;
  auto deliver = [&](const Edge& e, Value g) -> absl::Status {
    std::vector<Value>& buf = buffers[e.node.get()];
    if (buf.empty()) buf.resize(static_cast<size_t>(e.node->num_outputs()));
    Value& slot = buf[static_cast<size_t>(e.input_nr)];
    DT_ASSIGN_OR_RETURN(slot, AddGrads(slot, g));
    return absl::OkStatus();
  };
  for (size_t i = 0; i < roots.size(); ++i) {
    Value g;
    if (i < grad_roots.size() && grad_roots[i].defined()) {
      g = grad_roots[i];
    } else {
      if (roots[i].value().numel() != 1) {
        return absl::InvalidArgumentError(absl::StrCat("[Backward] a root without a gradient must have one element; ",
                                                       roots[i].value().ToString(), " has ", roots[i].value().numel()));
      }
      DT_ASSIGN_OR_RETURN(g, fn::OnesLike(roots[i].value()));
    }
    DT_RETURN_IF_ERROR(deliver(root_edges[i], std::move(g)));
  }
  // Newest first; accumulators first of all (AccumulateGradNode).
  auto priority = [](Node* n) {
    return dynamic_cast<const AccumulateGradNode*>(n) != nullptr ? ~uint64_t{0} : n->sequence_nr();
  };
  auto later_first = [&priority](Node* a, Node* b) { return priority(a) < priority(b); };
  std::priority_queue<Node*, std::vector<Node*>, decltype(later_first)> ready(later_first);
  for (const Edge& e : root_edges) {
    if (deps[e.node.get()] == 0) {
      deps[e.node.get()] = -1;  // queued
      ready.push(e.node.get());
    }
  }
  while (!ready.empty()) {
    Node* n = ready.top();
    ready.pop();
    if (!pass.pending.empty()) DT_RETURN_IF_ERROR(pass.RunDue(priority(n), /*at_end=*/false));
    // (The roots hold the graph, so every node stays alive during the pass.)
    std::vector<Value> in_grads;
    auto buf = buffers.find(n);
    if (buf != buffers.end()) {  // else no gradient reached it: skip it, but release what it feeds
      std::vector<Value> grads = std::move(buf->second);
      buffers.erase(buf);
      grads.resize(static_cast<size_t>(n->num_outputs()));
      for (auto& [nr, hook] : n->pre_hooks_) {
        Value& g = grads[static_cast<size_t>(nr)];
        if (g.defined()) DT_RETURN_IF_ERROR(hook(g));
      }
      // Offer the gradients already waiting for this node's inputs to a node that can add into
      // them (Node::ApplyInto): plain Tensors that only this pass holds.
      std::vector<const Tensor*> pending;
      if (n->AddsIntoPending()) {
        pending.assign(n->next_edges().size(), nullptr);
        for (size_t i = 0; i < pending.size(); ++i) {
          const Edge& e = n->next_edges()[i];
          if (e.node == nullptr) continue;
          auto it = buffers.find(e.node.get());
          if (it == buffers.end() || static_cast<size_t>(e.input_nr) >= it->second.size()) continue;
          const Value& slot = it->second[static_cast<size_t>(e.input_nr)];
          if (!slot.defined() || slot.is_dtensor()) continue;
          // Held by nothing else (every alias holds the storage), and memory of our allocator,
          // not a caller's buffer wrapped by FromBlob.
          const auto& storage = slot.local().storage();
          if (storage != nullptr && storage.use_count() == 1 && storage->allocator() != nullptr &&
              !storage->released()) {
            pending[i] = &slot.local();
          }
        }
      }
      if (std::any_of(pending.begin(), pending.end(), [](const Tensor* t) { return t != nullptr; })) {
        DT_ASSIGN_OR_RETURN(in_grads, n->ApplyInto(std::move(grads), pending));
      } else {
        DT_ASSIGN_OR_RETURN(in_grads, n->Apply(std::move(grads)));
      }
      if (!retain_graph) n->ReleaseSaved();
    }
    std::vector<Edge>& next = n->next_edges();
    if (!in_grads.empty() && in_grads.size() != next.size()) {
      return absl::InternalError(absl::StrCat("[Backward] ", n->name(), " returned ", in_grads.size(),
                                              " gradients for ", next.size(), " inputs"));
    }
    for (size_t i = 0; i < next.size(); ++i) {
      const Edge& e = next[i];
      if (e.node == nullptr) continue;
      if (i < in_grads.size() && in_grads[i].defined()) DT_RETURN_IF_ERROR(deliver(e, std::move(in_grads[i])));
      int& d = deps[e.node.get()];
      if (--d == 0) {
        d = -1;
        ready.push(e.node.get());
      }
    }
  }
  DT_RETURN_IF_ERROR(pass.RunDue(0, /*at_end=*/true));
  on_failure.ok = true;
  return absl::OkStatus();
}

absl::Status Backward(const Variable& root, bool retain_graph) {
  return RunBackward(absl::MakeConstSpan(&root, 1), {}, retain_graph);
}

absl::Status Backward(absl::Span<const Variable> roots, absl::Span<const Value> grad_roots, bool retain_graph) {
  return RunBackward(roots, grad_roots, retain_graph);
}

}  // namespace dtensor
