// Tensor-parallel styles: how one module is split over the tensor-parallel mesh dim, as values
// that print, compare and load from text (PyTorch's ParallelStyle classes). Placements here
// are those on the tp dim; a module's parameters are Replicate on every other mesh dim, and
// its activations keep their placements there (e.g. the batch's Shard(0) over dp).
//
//   ParallelStyle c = ColwiseParallel{};                               // Linear: weight S(0)
//   ParallelStyle r = RowwiseParallel{.output_layout = Shard(1)};      // output P -> S(1)
//   StyleToString(r);                                                  // "RowwiseParallel(output=S(1))"
//   DT_ASSIGN_OR_RETURN(ParallelStyle s, ParseStyle("SequenceParallel"));
//
// What each does (PyTorch's semantics; inputs that are plain Tensors are first taken as
// DTensors laid out as the style's input layout):
//   ColwiseParallel     Linear: weight Shard(0), bias Shard(0); input -> Replicate; output
//                       Shard(-1) (then output_layout). Embedding: weight Shard(1) (the
//                       embedding dim); ids -> Replicate. fused = k: the Linear's outputs are k
//                       equal blocks (GPT-2's q, k, v in c_attn): the weight [k*n, in] is
//                       viewed as [k, n, in] (bias [k, n]) and dim 1 is sharded, so every rank
//                       holds its part of each block (its heads of q, k and v; the heads must
//                       divide over the tp ranks); the state dict keeps the fused shape. The
//                       attention projects q, k and v itself, so the input -> Replicate hook is
//                       on the attention (after its own PrepareModuleInput, if any).
//   RowwiseParallel     Linear: weight Shard(1), bias Replicate; input -> Shard(-1); output
//                       Partial(sum) -> output_layout (Replicate: all_reduce; Shard(1):
//                       reduce_scatter, sequence parallel). Embedding: weight Shard(0) (the
//                       vocabulary; uneven works); ids -> Replicate; output Partial -> as above.
//   SequenceParallel    LayerNorm, RMSNorm, Dropout: parameters Replicate; input ->
//                       Shard(sequence_dim); the output stays sharded on it.
//   PrepareModuleInput  any module: input -> desired_input_layout.
//   PrepareModuleOutput any module: output -> desired_output_layout.
// use_local_output hands the output on as this rank's local tensor (PyTorch's default for
// Colwise/Rowwise; here false by default, since every op runs on DTensors).
//
// Text form (ParseStyle, plan files): the name, optionally followed by arguments in
// parentheses, e.g. "ColwiseParallel", "ColwiseParallel(fused=3)",
// "RowwiseParallel(output=S(1))", "SequenceParallel(dim=1)",
// "PrepareModuleInput(input=S(1), desired=R)", "PrepareModuleOutput(output=P(sum), desired=R)".
#ifndef DTENSOR_NN_PARALLEL_PARALLEL_STYLE_H_
#define DTENSOR_NN_PARALLEL_PARALLEL_STYLE_H_

#include <cstdint>
#include <string>
#include <variant>

#include "absl/status/statusor.h"
#include "dtensor/placements/placement.h"

namespace dtensor::nn {

struct ColwiseParallel {
  Placement input_layout = Replicate();
  Placement output_layout = Shard(-1);
  bool use_local_output = false;
  int64_t fused = 1;
  friend bool operator==(const ColwiseParallel&, const ColwiseParallel&) = default;
};

struct RowwiseParallel {
  Placement input_layout = Shard(-1);
  Placement output_layout = Replicate();
  bool use_local_output = false;
  friend bool operator==(const RowwiseParallel&, const RowwiseParallel&) = default;
};

struct SequenceParallel {
  int64_t sequence_dim = 1;
  bool use_local_output = false;
  friend bool operator==(const SequenceParallel&, const SequenceParallel&) = default;
};

struct PrepareModuleInput {
  Placement input_layout = Replicate();
  Placement desired_input_layout = Replicate();
  friend bool operator==(const PrepareModuleInput&, const PrepareModuleInput&) = default;
};

struct PrepareModuleOutput {
  Placement output_layout = Replicate();
  Placement desired_output_layout = Replicate();
  friend bool operator==(const PrepareModuleOutput&, const PrepareModuleOutput&) = default;
};

using ParallelStyle =
    std::variant<ColwiseParallel, RowwiseParallel, SequenceParallel, PrepareModuleInput, PrepareModuleOutput>;

// "ColwiseParallel", "RowwiseParallel(output=S(1))": the name and the fields that differ from
// the defaults, in the text form above (ParseStyle(StyleToString(s)) == s).
std::string StyleToString(const ParallelStyle& style);
// The text form above; InvalidArgument quoting the text for an unknown name or argument.
absl::StatusOr<ParallelStyle> ParseStyle(const std::string& text);
// "S(0)", "S(-1)", "R", "P(sum)" (also "P(avg)", "P(max)", "P(min)"); InvalidArgument otherwise.
absl::StatusOr<Placement> ParsePlacement(const std::string& text);

}  // namespace dtensor::nn

#endif  // DTENSOR_NN_PARALLEL_PARALLEL_STYLE_H_
