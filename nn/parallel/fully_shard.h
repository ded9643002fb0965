// FullyShard: FSDP2's fully_shard as a placement transform. Each parameter of a module group
// becomes a DTensor sharded on dim 0 over the data-parallel mesh dim (Shard(0); HSDP:
// (Replicate(), Shard(0)) over a (replicate, shard) mesh), so parameters, gradients and
// optimizer state cost 1/N per rank; hooks gather the group's parameters for its forward and
// backward and reduce-scatter its gradients.
//
//   for (int i = 0; i < model.config().n_layer; ++i) {                  // bottom-up, as TorchTitan
//     DT_RETURN_IF_ERROR(nn::FullyShard(*model.block(i), mesh, {.reshard_after_forward = i + 1 < n}).status());
//   }
//   DT_RETURN_IF_ERROR(nn::FullyShard(model, mesh).status());          // the root: wte, wpe, ln_f
//   nn::AdamW opt(model.Parameters(), {...});                            // state for the shards only
//   DT_ASSIGN_OR_RETURN(auto out, model.Forward(x, y));                  // x, y: DTensors S(0) over mesh
//   DT_RETURN_IF_ERROR(Backward(out.loss));                              // grads: Shard(0), reduced
//   DT_RETURN_IF_ERROR(opt.Step());
//
// Groups. FullyShard(m) takes m's parameters that no already-sharded descendant owns (tied
// parameters: under their first name). Applied to a module above groups, it becomes their
// root: the root's forward begins each step (it records the order in which the groups run
// forward on the first step and prefetches by it afterwards) and its backward ends it.
//
// Per group and step (each exactly one collective per dtype of the group's parameters, through
// one flat buffer on the mesh's communicators, recorded in the mesh's CommCounter):
//   pre-forward    all_gather of every rank's shards; the parameters become DTensors
//                  Replicate on the FSDP dims (their local tensors views of one unsharded
//                  buffer) in param_dtype; with prefetch, the next group's all_gather starts
//                  before this one's is awaited (at most one group ahead).
//   post-forward   reshard_after_forward: the unsharded buffer's memory is released (the
//                  autograd graph keeps views of it; Storage::Release), the parameters are
//                  their shards again. Not the root's (its backward comes at once), and every
//                  group's when grad mode is off (no backward will follow).
//   pre-backward   (the gradient of the group's output arrives) all_gather again into the same
//                  buffer when resharded; with prefetch, the group before it in forward order
//                  starts its all_gather too. (A second backward through the same graph,
//                  retain_graph, gathers and reduces again: its gradients add up.)
//   post-backward  (the pass has run every node of the group's forward) the unsharded
//                  gradients are cast to reduce_dtype and reduce-scattered into the sharded
//                  gradients (asynchronously; awaited at the next group's post-backward or at
//                  the end of the pass); HSDP then all-reduces them over the replicate dim.
//                  Every parameter of the group that requires grad takes part, as zeros on a
//                  rank whose forward did not use it, so every rank runs the same collectives
//                  and each shard gets the peers' gradients too (a rank-dependent branch inside
//                  a group; a group whose forward or backward runs on some ranks only is not
//                  supported, as in FSDP2: its all_gathers would not match).
//                  Gradients accumulate into the sharded .grad across backward passes.
// The reduction per FSDP mesh dim: sum where the unsharded gradient is Partial(sum) there (a
// batch sharded over that dim, the DTensor way: the loss is already the global mean), average
// otherwise (Replicate or plain gradients: each rank's loss over its own data, PyTorch's
// FSDP way) — either way the gradient of the global mean loss.
//
// Mixed precision: parameters are gathered and computed in param_dtype (e.g. bfloat16);
// gradients are reduced in reduce_dtype (default: the parameter's own dtype, float32); the
// sharded master parameters, gradients and optimizer state keep the parameter's dtype;
// cast_forward_inputs (default on) casts the module's floating input to param_dtype, and
// output_dtype its floating output. (PyTorch reduces in param_dtype when reduce_dtype is unset;
// here reductions stay in float32 unless asked.) A module may run more than once in one
// forward: its gradients are reduced once, after the backward of every use. Two forwards
// before their backward (two losses) work too: each graph gathers what it uses again and
// reduces after its own nodes (as FSDP2).
//
// A backward pass that fails (an error from a node, a hook or a peer) drops the step: the
// reductions it started are waited for and dropped, and so are the unsharded gradients it made
// and the sums kept from earlier micro-batches (without gradient sync or all_reduce); the
// groups of every tree it reached are sharded again (others at the next forward). The sharded
// .grad keeps what earlier synchronised passes reduced: zero it, as after any failed step,
// and run the step's micro-batches again.
//
// Between a group's forward and its backward (the root's always; others' with
// reshard_after_forward false), and after a forward whose backward never runs (a logged loss,
// a forward that failed), the parameters hold the gathered values and their sharded
// gradients are kept aside: .grad() read directly shows none. Optimizer steps, ClipGradNorm,
// AdamW::InitState, StateDict and LoadStateDict first shard such groups again (Variable::Settle;
// a pending backward then gathers them again), so they update, save and load the float32
// shards, not the gathered param_dtype copies; reset_grad (zero_grad) also drops the
// gradient kept aside and the group's sums kept without gradient sync or all_reduce, so a
// failed step is retried from zero.
//
// Errors (InvalidArgument naming the values): a module already sharded; a parameter on
// another device than the mesh's; a 0-d parameter; a DTensor parameter whose mesh does not
// contain the FSDP dims or that is not Replicate on them; a mesh of more than 2 dims without
// dim names, or a dim name the mesh lacks.
#ifndef DTENSOR_NN_PARALLEL_FULLY_SHARD_H_
#define DTENSOR_NN_PARALLEL_FULLY_SHARD_H_

#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "dtensor/mesh/device_mesh.h"
#include "dtensor/nn/module.h"
#include "dtensor/nn/parallel/fsdp_group.h"

namespace dtensor::nn {

// Shards `module`'s parameters over `mesh` (see above) and installs the hooks. The returned
// group belongs to the module (it lives as long as the module).
absl::StatusOr<FsdpGroup*> FullyShard(Module& module, const DeviceMesh& mesh, const FsdpOptions& options = {});

// The group FullyShard made of `module`; null when it made none.
FsdpGroup* FsdpGroupOf(const Module& module);

// PyTorch's set_requires_gradient_sync for `module`'s group and every group below it: with
// false, backward keeps accumulating unsharded gradients (in reduce_dtype) and reduces
// nothing, until a backward with true reduces the sum (gradient accumulation with one
// reduce-scatter per group on the last micro-batch, at the memory of unsharded gradients).
void SetRequiresGradientSync(Module& module, bool sync);
// Likewise for FsdpGroup::set_requires_all_reduce (HSDP: all-reduce over the replicas only on
// the backward with true) and set_reshard_after_forward. (PyTorch's set_reshard_after_backward
// is not offered: a Variable holds one value, so an optimizer step while the parameters were
// kept gathered would see the gathered views without gradients and change nothing.)
void SetRequiresAllReduce(Module& module, bool all_reduce);
void SetReshardAfterForward(Module& module, bool reshard);

}  // namespace dtensor::nn

#endif  // DTENSOR_NN_PARALLEL_FULLY_SHARD_H_
