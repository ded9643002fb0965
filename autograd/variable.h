// Variable and the reverse-mode engine: a tape of nodes over Values (Tensors or DTensors).
//
//   Variable w = Variable::Leaf(weight, /*requires_grad=*/true, "w");
//   DT_ASSIGN_OR_RETURN(Variable y, Linear(x, w));        // records a node (autograd/ops.h)
//   DT_ASSIGN_OR_RETURN(Variable loss, Sum(y));
//   DT_RETURN_IF_ERROR(Backward(loss));                   // w.grad() now holds d loss / d w
//   { NoGradGuard no_grad; ... }                          // nothing recorded inside
//
// The engine is generic: a Node is a backward function from the gradients of its outputs to
// the gradients of its inputs; it knows no op. Gradients of one Variable reached along several
// paths are summed (dispatched Add, so DTensor gradients with different layouts combine).
// Nodes run in reverse creation order as soon as all their gradients are in, and release
// what they saved after running (unless retain_graph).
//
// Hooks: a gradient hook on a Variable sees (and may replace) the gradient flowing into it;
// a post-accumulate hook on a leaf runs after its .grad was updated (FSDP's reduce-scatter
// and DDP's bucketing hang there). Module hooks are in nn/module.h.
//
// Grad mode is per thread (a thread is a rank in the threads backend), as in PyTorch.
#ifndef DTENSOR_AUTOGRAD_VARIABLE_H_
#define DTENSOR_AUTOGRAD_VARIABLE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "dtensor/autograd/value.h"

namespace dtensor {

class Node;
struct VariableImpl;

// Replaces the gradient `g` in place or leaves it; an error stops the backward pass.
using GradHook = std::function<absl::Status(Value& g)>;

class Variable {
 public:
  Variable() = default;
  // A leaf: no history; gradients accumulate into grad() when requires_grad.
  static Variable Leaf(Value value, bool requires_grad = false, std::string name = "");
  // A leaf sharing nothing with the graph: the value, requires_grad false.
  static Variable Constant(Value value) { return Leaf(std::move(value), false); }

  bool defined() const { return impl_ != nullptr; }
  const Value& value() const;
  // Replaces the value (optimizers, FSDP's resharding). Shape must not change for graphs in use.
  void set_value(Value v);
  // The accumulated gradient (undefined until a backward pass reaches this leaf).
  const Value& grad() const;
  void set_grad(Value g);
  // Drops the gradient (PyTorch's zero_grad(set_to_none=True)), and what a transform keeps
  // aside of it (see SetParamHooks).
  void reset_grad();
  bool requires_grad() const;
  void set_requires_grad(bool r);  // leaves only
  bool is_leaf() const;
  const std::string& name() const;
  const std::shared_ptr<Node>& grad_fn() const;
  int output_nr() const;

  void RegisterHook(GradHook hook);
  // Leaves only: runs after each accumulation into grad().
  void RegisterPostAccumulateGradHook(std::function<absl::Status(Variable&)> hook);

  // A transform that holds a parameter in another form for a while gives its readers a way
  // back (FSDP keeps a group's gathered value from its forward to its backward, the sharded
  // gradient aside): `settle` makes value() and grad() the parameter's own again, `reset` drops
  // what the transform keeps aside of the gradient. Settle() runs the first (OK without one):
  // optimizer steps, gradient clipping and state dicts call it before they read parameters;
  // reset_grad() runs the second.
  void SetParamHooks(std::function<absl::Status()> settle, std::function<void()> reset);
  absl::Status Settle() const;

  // Identity of the underlying variable (parameters are compared by it).
  const VariableImpl* id() const { return impl_.get(); }

  // Internal: a result of `node`'s forward.
  static Variable FromNode(Value value, std::shared_ptr<Node> node, int output_nr);

 private:
  friend class Node;
  friend struct AccumulateGradNode;
  explicit Variable(std::shared_ptr<VariableImpl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<VariableImpl> impl_;
};

// One edge of the graph: gradient slot `input_nr` of `node` (a null node: no gradient needed).
struct Edge {
  std::shared_ptr<Node> node;
  int input_nr = 0;
};

class Node {
 public:
  // `name` must outlive the node (a string literal).
  explicit Node(const char* name, int num_outputs);
  virtual ~Node() = default;
  // Gradients of the inputs (one per next edge; undefined Values where none) from those of
  // the outputs (one per output; undefined where no gradient arrived).
  virtual absl::StatusOr<std::vector<Value>> Apply(std::vector<Value> grad_outputs) = 0;
  // Apply, where the pass offers, per input, the gradient already waiting for it (`pending[i]`:
  // the sum of what other nodes delivered for the same input, a plain Tensor of our allocator
  // that nothing but the pass holds; null where there is none or it is shared). A node may add
  // its gradient of input i into *pending[i]'s data in place (the handle is const, the data is
  // the node's to write) and then must return an undefined Value for i; or leave it and return
  // the gradient as Apply does. The pointers are valid during the call only; two inputs fed by
  // one Variable get the same tensor. A tied embedding adds its few rows into the head's [V, C]
  // gradient rather than returning a [V, C] of zeros to be added. Only nodes that say so
  // (AddsIntoPending) are offered.
  virtual bool AddsIntoPending() const { return false; }
  virtual absl::StatusOr<std::vector<Value>> ApplyInto(std::vector<Value> grad_outputs,
                                                       absl::Span<const Tensor* const> pending) {
    (void)pending;
    return Apply(std::move(grad_outputs));
  }
  // Frees saved tensors after the node ran.
  virtual void ReleaseSaved() {}

  const char* name() const { return name_; }
  int num_outputs() const { return num_outputs_; }
  uint64_t sequence_nr() const { return sequence_nr_; }
  std::vector<Edge>& next_edges() { return next_; }
  // Hooks on the gradient of output `output_nr` before Apply.
  void AddPreHook(int output_nr, GradHook hook) { pre_hooks_.push_back({output_nr, std::move(hook)}); }

  // The edge a forward input contributes: its grad_fn, or its leaf accumulator.
  static Edge EdgeOf(const Variable& v);

 private:
  friend absl::Status RunBackward(absl::Span<const Variable>, absl::Span<const Value>, bool);
  const char* name_;
  int num_outputs_;
  uint64_t sequence_nr_;
  std::vector<Edge> next_;
  std::vector<std::pair<int, GradHook>> pre_hooks_;
};

// A node whose backward is a function (saved values live in its captures and are released
// with it).
class FunctionNode : public Node {
 public:
  using Fn = std::function<absl::StatusOr<std::vector<Value>>(std::vector<Value>& grad_outputs)>;
  // The backward as Node::ApplyInto (pending: one entry per input, null where none is offered).
  using IntoFn = std::function<absl::StatusOr<std::vector<Value>>(std::vector<Value>& grad_outputs,
                                                                  absl::Span<const Tensor* const> pending)>;
  FunctionNode(const char* name, int num_outputs, Fn fn) : Node(name, num_outputs), fn_(std::move(fn)) {}
  absl::StatusOr<std::vector<Value>> Apply(std::vector<Value> grad_outputs) override;
  // Gives the node a backward that may add into pending gradients (Node::ApplyInto); Apply
  // still runs `fn` where the pass offers none.
  void set_into(IntoFn into) { into_ = std::move(into); }
  bool AddsIntoPending() const override { return into_ != nullptr; }
  absl::StatusOr<std::vector<Value>> ApplyInto(std::vector<Value> grad_outputs,
                                               absl::Span<const Tensor* const> pending) override;
  void ReleaseSaved() override {
    fn_ = nullptr;
    into_ = nullptr;
  }

 private:
  Fn fn_;
  IntoFn into_;
};

// Whether ops record nodes on this thread.
bool GradEnabled();
class NoGradGuard {
 public:
  NoGradGuard();
  ~NoGradGuard();
  NoGradGuard(const NoGradGuard&) = delete;
  NoGradGuard& operator=(const NoGradGuard&) = delete;

 private:
  bool prev_;
};
// The opposite (torch.enable_grad): ops record inside even where the caller turned grad mode
// off (activation checkpointing's recomputation, checkpoint.h).
class EnableGradGuard {
 public:
  EnableGradGuard();
  ~EnableGradGuard();
  EnableGradGuard(const EnableGradGuard&) = delete;
  EnableGradGuard& operator=(const EnableGradGuard&) = delete;

 private:
  bool prev_;
};

// Whether an op with these inputs records a node (grad mode on and some input requires grad).
bool AnyRequiresGrad(absl::Span<const Variable> inputs);

// Records `node` (whose backward is `backward`) as the producer of `outputs` from `inputs`
// when AnyRequiresGrad(inputs), and returns the output Variables (plain Variables otherwise).
// `backward` receives one gradient per output (undefined where none arrived; it may return
// undefined Values for inputs that need none) and returns one per input.
std::vector<Variable> Record(const char* name, absl::Span<const Variable> inputs, std::vector<Value> outputs,
                             FunctionNode::Fn backward);

// Reverse pass from `roots`; grad_roots are their gradients (empty: ones for each root,
// which must then have one element). With retain_graph the nodes keep their saved values.
absl::Status Backward(const Variable& root, bool retain_graph = false);
absl::Status Backward(absl::Span<const Variable> roots, absl::Span<const Value> grad_roots, bool retain_graph = false);

// A fresh mark in node order: every node recorded from now on has a greater sequence number,
// every earlier one a smaller (FSDP notes where a module's forward starts).
uint64_t NextSequenceNr();

// Only within a backward pass, from one of its hooks or nodes (on the pass's thread): runs
// `fn` once the pass has run every node it will run that was recorded at or after
// `sequence_nr` — just before the first older node, or when the pass ends (sequence_nr 0:
// when the pass ends, as PyTorch's queue_callback). Nodes run from the newest, so those are
// exactly the nodes of a forward that began at `sequence_nr` (FSDP's post-backward of a
// module). Due callbacks run newest point first, then in the order queued; a callback may
// queue more; an error stops the pass. FailedPrecondition outside a backward pass.
absl::Status QueueBackwardCallback(uint64_t sequence_nr, std::function<absl::Status()> fn);
// Only within a backward pass: runs `fn` if this pass ends with an error (a node, hook or
// callback failed), after it stopped and before Backward returns; such callbacks run newest
// first. For state that the pass's queued callbacks would have settled (FSDP's gathered
// parameters and reductions in flight). FailedPrecondition outside a backward pass.
absl::Status QueueBackwardFailureCallback(std::function<void()> fn);
// Whether this thread is inside a backward pass.
bool InBackward();

// Sum of two gradients (undefined + g = g). DTensor gradients with different layouts are
// combined by the dispatcher's Add.
absl::StatusOr<Value> AddGrads(const Value& a, const Value& b);

}  // namespace dtensor

#endif  // DTENSOR_AUTOGRAD_VARIABLE_H_
