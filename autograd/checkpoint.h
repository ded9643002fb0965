// Activation checkpointing (torch.utils.checkpoint): run a function of Variables without
// keeping what its backward would need, and run it again in backward. Semantics are those of
// use_reentrant=False where they show here (parameters get gradients when no input needs
// one; state is replayed; recomputed metadata is checked; no-grad mode just runs `fn`); the
// mechanism is an inner backward pass over the recomputed graph (as use_reentrant=True), so
// torch's early stop of the recomputation and nested autograd.grad are not offered.
//
//   auto block = [&](const Variable& x) -> absl::StatusOr<Variable> { ... };  // uses parameters
//   DT_ASSIGN_OR_RETURN(Variable y, ActivationCheckpoint(block, x));
//   ...
//   DT_RETURN_IF_ERROR(Backward(loss));   // reaching y: block runs again with grad recording and
//                                         // the gradient of y flows through the new graph into
//                                         // x and into the parameters block used
//
// Forward: `fn` runs with grad mode off, so it records nothing and its intermediate values are
// freed as it goes; one node ("Checkpoint") holds only the inputs and becomes the producer of
// the outputs. Backward (when the gradient of the outputs arrives): `fn` runs again on the
// saved inputs with grad mode on, and an inner backward pass from its new outputs carries the
// incoming gradients into the inputs (returned to the outer pass, which sends them on) and
// into the leaves `fn` reached itself (parameters: their .grad accumulates and their
// post-accumulate hooks run, as without checkpointing). The recomputed graph is freed after.
//
// Contract, as PyTorch's:
//   - `fn` must compute the same values when run again. State it consumes that is not an input
//     (nn::Dropout's call counter, which picks its mask) is saved at the forward and put back
//     for the recomputation by CheckpointOptions::capture_state (preserve_rng_state), then
//     returned to what it was before the recomputation.
//   - Pass Variables with history as inputs: one that `fn` captures instead is reached by the
//     inner pass through its own graph (its gradient does arrive), but that pass releases the
//     captured graph's saved values, so an outer use of the same graph later fails ("ran a
//     second time after its saved values were released") after part of its gradient landed.
//   - A checkpoint inside a selective one (save_ops) fails at the recomputation: the inner one
//     hides the ops it runs from the outer's record.
//   - Outputs must keep their shapes and dtypes on recomputation (FailedPrecondition naming
//     the output otherwise, as torch's "Recomputed values ... have different metadata").
//   - With grad mode off, `fn` simply runs (nothing to recompute later). With it on, the
//     outputs require grad (even when nothing in `fn` does: the inner pass then finds no
//     gradient to send).
//   - `fn` is kept (by copy) until the node runs without retain_graph: what it refers to must
//     live until the backward pass. With retain_graph, each backward recomputes again.
//
// Selective checkpointing (torch's create_selective_checkpoint_contexts, CheckpointPolicy
// MUST_SAVE): CheckpointOptions::save_ops names dispatcher ops (OpDef::name, dispatch.h, e.g.
// "linear", "linear_bias", "linear_bias_gelu", "matmul", "causal_attention") whose outputs the
// forward keeps (of an op with OpDef::ac_rebuild, one output that rebuilds the others); the
// recomputation receives those outputs again instead of running the ops (matched in order:
// op name and input shapes must agree, or FailedPrecondition), and recomputes only the rest
// (layer norms, GELU, adds, reshapes: the cheap ops).
#ifndef DTENSOR_AUTOGRAD_CHECKPOINT_H_
#define DTENSOR_AUTOGRAD_CHECKPOINT_H_

#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "dtensor/autograd/variable.h"

namespace dtensor {

struct CheckpointOptions {
  // Called when the forward starts; returns a function that puts the state back as it was at
  // that call. Null: no state.
  std::function<std::function<void()>()> capture_state = nullptr;
  // Dispatcher ops whose outputs the forward keeps for the recomputation (selective
  // checkpointing). Empty: everything is recomputed.
  std::vector<std::string> save_ops = {};
};

using CheckpointFn = std::function<absl::StatusOr<std::vector<Variable>>(absl::Span<const Variable> inputs)>;

// Runs `fn` on `inputs` as described above. InvalidArgument when `fn` returns an undefined
// output; `fn`'s own errors are returned as they are (in backward: they stop the pass).
absl::StatusOr<std::vector<Variable>> ActivationCheckpoint(const CheckpointFn& fn, absl::Span<const Variable> inputs,
                                                           const CheckpointOptions& options = {});
// One input, one output.
absl::StatusOr<Variable> ActivationCheckpoint(const std::function<absl::StatusOr<Variable>(const Variable&)>& fn,
                                              const Variable& input, const CheckpointOptions& options = {});

}  // namespace dtensor

#endif  // DTENSOR_AUTOGRAD_CHECKPOINT_H_
