// Module: named parameters, buffers and children, as torch.nn.Module.
//
//   class Mlp : public Module {
//    public:
//     Mlp(int64_t c) : fc_(RegisterModule("c_fc", std::make_unique<Linear>(c, 4 * c))) {}
//     absl::StatusOr<Variable> Forward(const Variable& x) { ... }
//    private:
//     Linear* fc_;
//   };
//   for (auto& [name, p] : model.NamedParameters()) ...   // "c_fc.weight", "c_fc.bias"
//   DT_RETURN_IF_ERROR(model.LoadStateDict(tensors));      // dotted names as in PyTorch
//
// Parameters are Variables (requires_grad) whose value is a Tensor or a DTensor; placement
// transforms (DistributeModule here, FullyShard in nn/parallel/) replace the values in place, so
// a module and its optimizer keep pointing at the same Variables. Hooks: forward pre/post hooks
// run around Forward (modules run their body through WithHooks), and backward pre-hooks run
// when the gradient of the module's output arrives.
#ifndef DTENSOR_NN_MODULE_H_
#define DTENSOR_NN_MODULE_H_

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "dtensor/autograd/variable.h"
#include "dtensor/mesh/device_mesh.h"
#include "dtensor/placements/layout.h"

namespace dtensor::nn {

class Module {
 public:
  Module() = default;
  virtual ~Module();
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;

  // Every parameter of this module and its children, depth first in registration order, with
  // dotted names; a Variable shared by two modules (tied weights) is listed once, under its
  // first name.
  std::vector<std::pair<std::string, Variable*>> NamedParameters();
  std::vector<Variable*> Parameters();
  std::vector<std::pair<std::string, Value*>> NamedBuffers();
  std::vector<std::pair<std::string, Module*>> NamedModules();  // "" is this module
  Variable* FindParameter(const std::string& dotted_name);

  // Moves every parameter, its gradient and every buffer to `device` (torch's module.to(device));
  // values already there are kept as they are. Plain tensors only: a DTensor parameter lives on
  // its mesh's device (InvalidArgument naming it).
  absl::Status To(Device device);

  void Train(bool on = true);
  void Eval() { Train(false); }
  bool training() const { return training_; }

  // Full values of every parameter (collective for DTensors: gathers each to every rank), in
  // the shape it was registered with (a transform that views a parameter in another shape of
  // the same row-major values, as tensor parallelism's stacked q/k/v, leaves the state as it
  // was). Each parameter is settled first (Variable::Settle: an FSDP group left gathered is
  // sharded again), so the state is the parameters' own, not a gathered param_dtype copy.
  absl::StatusOr<std::vector<std::pair<std::string, Tensor>>> StateDict();
  // Copies full tensors into the parameters (each rank keeps its piece: no communication);
  // a tensor in the registered shape fills a parameter viewed in another.
  // strict: every parameter must be given and no unknown name may appear.
  absl::Status LoadStateDict(const std::vector<std::pair<std::string, Tensor>>& tensors, bool strict = true);
  // The shape `param` (a parameter of this module or of a child) was registered with, which a
  // transform may view in another (tensor parallelism's stacked q/k/v); its current shape when
  // it is not one of them.
  Shape RegisteredShapeOf(const Variable& param) const;

  using Hook = std::function<absl::Status(Module&)>;
  void RegisterForwardPreHook(Hook h) { pre_hooks_.push_back(std::move(h)); }
  void RegisterForwardHook(Hook h) { post_hooks_.push_back(std::move(h)); }
  void RegisterBackwardPreHook(Hook h) { backward_pre_hooks_.push_back(std::move(h)); }
  // A forward hook that sees the module's output and may replace it (PyTorch's forward hook
  // returning a value; FSDP's output_dtype cast, TP's output layouts). Runs after the plain
  // forward hooks.
  using OutputHook = std::function<absl::Status(Module&, Variable& output)>;
  void RegisterForwardOutputHook(OutputHook h) { output_hooks_.push_back(std::move(h)); }
  // A forward pre-hook that sees the module's input and may replace it (PyTorch's forward
  // pre-hook returning new args; TP's input layouts). Runs after the plain pre-hooks.
  using InputHook = std::function<absl::Status(Module&, Variable& input)>;
  void RegisterForwardInputHook(InputHook h) { input_hooks_.push_back(std::move(h)); }

  // Wraps the computation WithHooks runs between the hooks: `wrapper(input, body)` must return
  // body's output for that input (activation checkpointing, nn/parallel/activation_checkpoint.h,
  // runs body without keeping its activations and again in backward, so a module's body may
  // run after its Forward returned: bodies refer only to the module and their argument).
  // Null: body runs directly.
  using Body = std::function<absl::StatusOr<Variable>(const Variable&)>;
  using ForwardWrapper = std::function<absl::StatusOr<Variable>(const Variable& input, const Body& body)>;
  void SetForwardWrapper(ForwardWrapper w) { wrapper_ = std::move(w); }
  bool has_forward_wrapper() const { return wrapper_ != nullptr; }
  // Whether anything was registered to run around or inside this module's Forward: a forward
  // pre-, input, output or plain hook, a backward pre-hook or a forward wrapper. A parent that
  // computes a child's work itself (MLP's fused Linears, Block's fused residual add and ln_2)
  // does so only when this is false.
  bool has_hooks() const {
    return !pre_hooks_.empty() || !post_hooks_.empty() || !backward_pre_hooks_.empty() || !output_hooks_.empty() ||
           !input_hooks_.empty() || wrapper_ != nullptr;
  }

  // State that a transform attaches to this module (FSDP's group), kept as long as the module;
  // one per key. Null when none.
  void SetAttachment(const std::string& key, std::shared_ptr<void> value);
  std::shared_ptr<void> GetAttachment(const std::string& key) const;

 protected:
  Variable* RegisterParameter(const std::string& name, Value value);
  // A parameter that is another module's Variable (tied weights).
  Variable* RegisterSharedParameter(const std::string& name, Variable* shared);
  Value* RegisterBuffer(const std::string& name, Value value);
  template <typename M>
  M* RegisterModule(const std::string& name, std::unique_ptr<M> m) {
    M* raw = m.get();
    children_.emplace_back(name, std::move(m));
    return raw;
  }
  // Runs `body` (the module's computation on its input, as the input hooks left it) between
  // the forward pre- and post-hooks, and routes its output through the backward pre-hooks.
  absl::StatusOr<Variable> WithHooks(const Variable& input,
                                     const std::function<absl::StatusOr<Variable>(const Variable&)>& body);
  // The same in parts, for modules whose output is not one Variable (GPT): the pre-hooks and
  // input hooks on `input`; the forward and output hooks on `output`; the backward pre-hooks
  // on `output`'s gradient.
  absl::Status RunForwardPreHooks(Variable& input);
  absl::Status RunForwardHooks(Variable& output);
  void AttachBackwardPreHooks(Variable& output);

 private:
  void Collect(const std::string& prefix, std::vector<std::pair<std::string, Variable*>>* out,
               std::vector<const VariableImpl*>* seen);
  // The shape a parameter was registered with, searched in this module and its children.
  const Shape* RegisteredShape(const VariableImpl* v) const;
  std::vector<std::pair<std::string, std::unique_ptr<Variable>>> params_;
  std::vector<Shape> param_shapes_;  // registered shape of params_[i]
  std::vector<std::pair<std::string, Variable*>> shared_params_;
  std::vector<std::pair<std::string, std::unique_ptr<Value>>> buffers_;
  std::vector<std::pair<std::string, std::unique_ptr<Module>>> children_;
  std::vector<Hook> pre_hooks_, post_hooks_, backward_pre_hooks_;
  std::vector<OutputHook> output_hooks_;
  std::vector<InputHook> input_hooks_;
  ForwardWrapper wrapper_;
  std::vector<std::pair<std::string, std::shared_ptr<void>>> attachments_;
  bool training_ = true;
  // False once the module is destroyed: a backward pass that outlives it skips to an error
  // instead of running its backward pre-hooks on freed memory.
  std::shared_ptr<bool> alive_ = std::make_shared<bool>(true);
};

// Makes every parameter a DTensor on `mesh`, laid out as `layout_for(name, param)` returns
// (Replicate everywhere when layout_for is null). Each rank keeps its piece of the value it
// holds (all ranks must hold the same values, as after seeded initialisation): no
// communication. Pieces are moved to the mesh's device (cuda:r on an NCCL mesh), as
// PyTorch's distribute_module / distribute_tensor do.
absl::Status DistributeModule(Module& module, const DeviceMesh& mesh,
                              const std::function<Layout(const std::string&, const Variable&)>& layout_for = nullptr);

}  // namespace dtensor::nn

#endif  // DTENSOR_NN_MODULE_H_
