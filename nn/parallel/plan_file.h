// Sharding plans as data (AXLearn's descriptive style beside TorchTitan's imperative one, with
// one meaning: a plan file loads into the same ParallelizePlan the code builds).
//
//   {
//     "mesh": {"dp_replicate": 1, "dp_shard": -1, "tp": 2},
//     "rules": [
//       {"module": "transformer.wte", "style": "RowwiseParallel(input=R, output=S(1))"},
//       {"module": "transformer.h.*.attn.c_attn", "style": "ColwiseParallel(fused=3)"},
//       {"param": "transformer.wpe.weight", "placements": {"tp": "R"}}
//     ]
//   }
//
//   DT_ASSIGN_OR_RETURN(PlanFile f, ReadPlanFile("examples/gpt/plans/gpt_tp.json"));
//   DT_ASSIGN_OR_RETURN(ParallelDims dims, f.dims.Resolve(world.size()));
//   DT_RETURN_IF_ERROR(ParallelizeModule(model, mesh, f.plan, "tp"));
//
// "mesh": degrees by dim name, TorchTitan's (dp_replicate, dp_shard, tp; -1: the ranks left
// over, at most one), each optional (default 1, dp_shard -1); the mesh is built in that order.
// "rules": in order; a rule is {"module": pattern, "style": text} (parallel_style.h's text
// form, applied as ParallelizeModule applies a style) or {"param": pattern, "placements":
// {dim: placement}} (raw placements of parameters on the model-parallel dims: "S(0)", "R").
// Patterns are dotted names with shell globs per segment. A file describes every parameter:
// one that no rule covers is refused ("every_parameter", default true; false: such parameters
// are Replicate, as in a code plan that says so).
//
// Errors (InvalidArgument quoting the file and the rule): malformed JSON, unknown keys, a key
// twice in one object, an unknown mesh dim, a bad style or placement text; then, when applied: degrees that do not
// multiply to the world size, a shard of a dim a parameter lacks, a parameter no rule covers.
#ifndef DTENSOR_NN_PARALLEL_PLAN_FILE_H_
#define DTENSOR_NN_PARALLEL_PLAN_FILE_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "dtensor/nn/parallel/parallelize.h"

namespace dtensor::nn {

// TorchTitan's parallel degrees: dp_replicate x dp_shard x tp = world size.
struct ParallelDims {
  int64_t dp_replicate = 1;
  int64_t dp_shard = -1;  // -1: the ranks left over
  int64_t tp = 1;
  // The degrees with -1 resolved for `world` ranks; InvalidArgument naming all of them when
  // they are not positive or do not multiply to `world`.
  absl::StatusOr<ParallelDims> Resolve(int64_t world) const;
  friend bool operator==(const ParallelDims&, const ParallelDims&) = default;
};

struct PlanFile {
  ParallelDims dims;
  ParallelizePlan plan;  // every_parameter as the file says (default true)
};

absl::StatusOr<PlanFile> ParsePlanFile(const std::string& json, const std::string& source = "plan");
absl::StatusOr<PlanFile> ReadPlanFile(const std::string& path);
// The file form of a plan (two-space indented JSON, rules in order); ParsePlanFile reads it back.
std::string PlanFileToJson(const PlanFile& file);

}  // namespace dtensor::nn

#endif  // DTENSOR_NN_PARALLEL_PLAN_FILE_H_
