// Activation checkpointing for a GPT, TorchTitan's options (activation_checkpoint.mode and
// selective_ac_option): the chosen transformer blocks run their forward without keeping
// activations and run it again in backward (autograd/checkpoint.h), trading compute for
// memory.
//
//   DT_ASSIGN_OR_RETURN(nn::AcOptions ac, nn::ParseAcMode("selective:2"));   // from --ac
//   DT_RETURN_IF_ERROR(nn::ApplyActivationCheckpointing(model, ac));
//   ... FullyShard / ParallelizeModule (before or after: either order works) ...
//   DT_ASSIGN_OR_RETURN(auto out, model.Forward(x, y));   // checkpointed blocks keep their input only
//   DT_RETURN_IF_ERROR(Backward(out.loss));              // ... and recompute the rest here
//
// Modes:
//   none            nothing changes.
//   full            every block is recomputed: per block only its input is kept.
//   selective:N     every Nth block (blocks i with (i + 1) % N == 0, TorchTitan's ac_freq;
//                   "selective" is selective:2): the others keep all their activations.
//   selective:op    every block, keeping the outputs of the matmuls (Linear with its fused
//                   bias / bias + GELU, the fused MLP's output and pre-activation, Matmul and
//                   the attention kernel) and of the redistributions of the layers' hooks
//                   (AcOptions::save_ops), and recomputing only the cheap ops between them
//                   (layer norms, adds, reshapes, dropout).
// Losses and gradients are those of the model without checkpointing, bit for bit on the CPU
// (recomputation is deterministic; each block's dropout masks are drawn again from the same
// call counts).
//
// How it composes. The checkpoint wraps the block's computation between its module hooks
// (Module::SetForwardWrapper), as PyTorch's checkpoint_wrapper sits inside fully_shard:
//   - FSDP (fully_shard.h): the pre-forward all_gather and the post-forward reshard run once
//     around the block's first forward (which keeps no views of the gathered parameters, so
//     resharding frees them); the pre-backward all_gather, which runs before the
//     recomputation, provides them again, the recomputation's gradients land in the unsharded
//     .grad and are reduce-scattered once at the block's post-backward. The collectives are
//     exactly those of the run without checkpointing. A group inside a checkpointed block
//     (fully_shard on its attn or mlp) is gathered once more, for the recomputation, as in
//     FSDP2; the recomputation prefetches no group.
//   - Tensor parallelism (parallelize.h): the hooks of the modules inside a block (input and
//     output layouts) run again in the recomputation. In full and selective:N mode their
//     collectives run again with them (one forward's worth of all_gathers and reduce_scatters,
//     or all_reduces, per block); selective:op keeps the outputs of those redistributions, so
//     its collectives are exactly those of the run without checkpointing (TorchTitan's op
//     policy keeps the reduce_scatters' outputs and gathers again; this keeps both, the
//     gathered [B, T, C] inputs of the column-parallel matmuls among them).
//   - Gradient accumulation: each micro-batch's backward recomputes its own forward.
// Calling it twice on a model, or on one whose blocks another transform wraps, is
// FailedPrecondition.
#ifndef DTENSOR_NN_PARALLEL_ACTIVATION_CHECKPOINT_H_
#define DTENSOR_NN_PARALLEL_ACTIVATION_CHECKPOINT_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "dtensor/nn/gpt.h"

namespace dtensor::nn {

struct AcOptions {
  enum class Mode { kNone, kFull, kSelectiveLayer, kSelectiveOp };
  Mode mode = Mode::kNone;
  // kSelectiveLayer: checkpoint blocks i with (i + 1) % every == 0.
  int64_t every = 2;
  // kSelectiveOp: the dispatcher ops (OpDef names) whose outputs are kept.
  std::vector<std::string> save_ops = {"linear", "linear_bias",      "linear_bias_gelu", "mlp_gelu",
                                       "matmul", "causal_attention", "redistribute"};

  // "none", "full", "selective:N", "selective:op" (what ParseAcMode reads back).
  std::string ToString() const;
  friend bool operator==(const AcOptions& a, const AcOptions& b) {
    return a.mode == b.mode && a.every == b.every && a.save_ops == b.save_ops;
  }
};

// "none", "full", "selective" (= "selective:2"), "selective:N" (N >= 1) or "selective:op".
// InvalidArgument naming the text otherwise.
absl::StatusOr<AcOptions> ParseAcMode(std::string_view text);

// The blocks `options` checkpoints in a model of `n_layer` blocks, in order.
std::vector<int64_t> CheckpointedBlocks(int64_t n_layer, const AcOptions& options);

// Applies `options` to `model`'s blocks (see above). InvalidArgument for every < 1 or an empty
// save_ops in selective:op; FailedPrecondition when any block is wrapped already (whichever
// blocks this mode picks).
absl::Status ApplyActivationCheckpointing(GPT& model, const AcOptions& options);

}  // namespace dtensor::nn

#endif  // DTENSOR_NN_PARALLEL_ACTIVATION_CHECKPOINT_H_
