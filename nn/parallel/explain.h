// ExplainGptStep: what one training step of a parallelized GPT will cost this rank, computed
// from the layouts before anything runs (gpt_train --explain): each parameter's placements and
// local shape; the collectives of the forward, the backward and the update (kind, calls,
// bytes, and why); and the bytes of parameters, gradients, optimizer state and the peak of
// parameters FSDP holds gathered at once.
//
//   DT_RETURN_IF_ERROR(ParallelizeModule(*model, mesh, plan, "tp"));   // as the step will run
//   ... FullyShard(*model->block(i), mesh, o) ..., FullyShard(*model, mesh, o);
//   DT_ASSIGN_OR_RETURN(StepExplanation e, ExplainGptStep(*model, mesh, {.batch = 8, .seq = 64, .plan = plan}));
//   std::printf("%s", e.ToString().c_str());
//
// How each part is derived (and what a test checks against a real step's CommCounter, the
// parameters' and optimizer's bytes and FSDP's buffer tracker):
//   parameters   the placements each parameter has now; local shapes by LocalBoxOf.
//   activations  the residual stream [B, T, C] is Shard(0) over the data-parallel dims and, on
//                tp, what the plan's styles make it, walked through GPT's modules in forward
//                order: a rowwise output P -> its output layout, an input a style or
//                PrepareModuleInput wants another way, colwise outputs sharded on the last
//                dim. Each change is planned by PlanRedistribute and counted by PredictComm
//                (so the planner's choices are the ones shown). Backward is the transpose
//                (PyTorch's rule): a colwise input's gradient is P and goes back to the
//                input's layout before a style changed it (sequence parallel: a
//                reduce_scatter); without sequence parallel nothing did, and it stays P
//                through the norms' backwards and the residual's adds; a rowwise output's
//                gradient goes back to Replicate (P -> R: an all_reduce, Megatron's one per
//                sublayer, where a colwise consumer above made it P).
//   loss         vocab-sharded logits: three all_reduces of float32 [rows] (max, sum of
//                exponentials, target logit) over tp; the count of targets over the
//                data-parallel dims.
//   gradients    P over the data-parallel dims (the batch is sharded there); on tp, a
//                parameter's shard; P for the norms and wpe, whose gradients come from the
//                residual stream's, which colwise consumers make P or sharded on tp; else
//                Replicate (the rowwise biases).
//                FSDP: per group one all_gather per forward, one per backward when it
//                reshards after forward (not the root), one reduce_scatter (HSDP: then one
//                all_reduce) per synchronised backward, and an all_reduce over tp for each
//                P-on-tp gradient; DDP / TP alone: ReduceGradients' buckets, replayed.
//   recompute    a block that activation checkpointing recomputes (options.ac, any mode:
//                selective:op keeps the matmuls' outputs, not the hooks' redistributions)
//                issues its forward's tp collectives again in backward; FSDP's are the same.
//   update       ClipGradNorm's one all_reduce per group of sharding dims, and the loss
//                read-out (P over the data-parallel dims -> Replicate).
//   memory       parameters and gradients: the local shards; AdamW: two float32 moments per
//                element; peak gathered: the groups FSDP holds at once (the root all step,
//                groups that keep their parameters after forward, plus the largest one that
//                does not, at its forward or backward).
// Modules it knows: GPT's (nn/gpt.h) with ColwiseParallel on c_attn, c_fc and lm_head,
// RowwiseParallel on wte and the c_projs, SequenceParallel on the norms and
// PrepareModuleInput on attn and mlp (the GPT plans, gpt_plan.h, and their plan files); a
// plan that places other styles there (ColwiseParallel on c_attn must be fused=3, elsewhere
// unfused) is Unimplemented, naming the module and the style, and so are one that gives a
// module two different styles, one whose raw placements ("params") put a parameter other
// than Replicate on tp (naming the rule), and one that splits some of wte, lm_head and the
// blocks' attn and mlp but not all (naming one of each).
#ifndef DTENSOR_NN_PARALLEL_EXPLAIN_H_
#define DTENSOR_NN_PARALLEL_EXPLAIN_H_

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "dtensor/core/comm_counter.h"
#include "dtensor/mesh/device_mesh.h"
#include "dtensor/nn/gpt.h"
#include "dtensor/nn/parallel/activation_checkpoint.h"
#include "dtensor/nn/parallel/parallelize.h"
#include "nlohmann/json.hpp"

namespace dtensor::nn {

enum class StepPhase : uint8_t { kForward, kBackward, kUpdate };
const char* StepPhaseName(StepPhase phase);  // "forward", "backward", "update"

struct ExplainOptions {
  int64_t batch = 0;  // rows of one micro-batch, global (the trainer's --batch / --grad-accum)
  int64_t seq = 0;    // T
  int64_t grad_accum = 1;
  bool grad_sync_every = true;  // FSDP reduces every micro-batch (false: the last one only)
  ParallelizePlan plan = {};    // the tensor-parallel plan the model was parallelized with
  std::string tp_dim = "tp";
  AcOptions ac = {};  // the activation checkpointing applied (its blocks' tp collectives run twice)
};

struct ParamExplanation {
  std::string name = "";
  Shape shape = {};         // global
  std::string layout = "";  // "dp_shard=S(0) tp=S(0)", with the shard order when not the default
  Shape local_shape = {};   // this rank's
  DType dtype = DType::kFloat32;
};

struct CommExplanation {
  StepPhase phase = StepPhase::kForward;
  CommKind kind = CommKind::kAllReduce;
  int64_t calls = 0;
  int64_t bytes = 0;      // all calls together (CommCounter's convention)
  std::string what = "";  // "transformer.h.*.attn input S(0)S(1) -> S(0)R"
};

struct StepExplanation {
  std::string mesh;  // "DeviceMesh(dp_shard=2, tp=2)", or "" on one rank without a mesh
  std::vector<ParamExplanation> params;
  std::vector<CommExplanation> comm;  // by phase, then in the order they run
  int64_t param_bytes = 0, grad_bytes = 0, optim_bytes = 0, peak_unsharded_bytes = 0;

  // Calls and bytes per kind, per phase (forward, backward, update).
  std::array<CommCounter, 3> Totals() const;
  std::string ToString() const;
  nlohmann::json ToJson() const;
};

// This rank's step. `model` is parallelized as the step will run it (ParallelizeModule with
// options.plan, then FullyShard, or DistributeModule for DDP, or nothing on one rank); `mesh`
// its mesh (undefined on one rank without one).
absl::StatusOr<StepExplanation> ExplainGptStep(GPT& model, const DeviceMesh& mesh, const ExplainOptions& options);

// {"forward": {"all_gather": {"calls": 2, "bytes": 4096}, ...}, "backward": ..., "update": ...}:
// the kinds with calls only (what StepExplanation::ToJson and the trainer's metrics hold).
nlohmann::json CommToJson(const std::array<CommCounter, 3>& phases);

}  // namespace dtensor::nn

#endif  // DTENSOR_NN_PARALLEL_EXPLAIN_H_
