// ParallelizeModule: tensor parallelism as a placement transform (PyTorch's
// parallelize_module). A plan maps module-name patterns to styles (parallel_style.h); each
// matched module's parameters get the style's placement on the tensor-parallel mesh dim and
// its inputs and outputs are redistributed by hooks, so the ops in between run sharded and
// every byte moves through DTensor redistribution (the mesh's CommCounter sees it).
//
//   ParallelizePlan plan = {{"transformer.h.*.mlp.c_fc", ColwiseParallel{}},
//                           {"transformer.h.*.mlp.c_proj", RowwiseParallel{}}};
//   DT_ASSIGN_OR_RETURN(DeviceMesh mesh, DeviceMesh::Create(world, {2, 2}, {"dp_shard", "tp"}));
//   DT_RETURN_IF_ERROR(ParallelizeModule(model, mesh, plan, "tp"));   // TP first ...
//   for (...) DT_RETURN_IF_ERROR(FullyShard(*model.block(i), mesh, {.shard_dim = "dp_shard"}).status());
//   DT_RETURN_IF_ERROR(FullyShard(model, mesh, {.shard_dim = "dp_shard"}).status());  // ... then FSDP
//
// `mesh` is the mesh parameters and activations live on, `tp_dim` its tensor-parallel dim
// (empty: the only dim of a 1-d mesh); its other dims (data parallel) are left to FSDP / DDP.
// Every parameter of the module becomes a DTensor on `mesh`: its style's placement on tp and
// Replicate elsewhere; parameters no style places are Replicate everywhere. Each rank keeps
// its piece of the value it holds (every rank must hold the same values, as after seeded
// initialisation). Patterns are matched against the dotted names of NamedModules() segment
// by segment with shell globs ('*' matches within one segment: "transformer.h.*.attn"); the
// root module's name is empty and only the empty pattern matches it ("*" matches its children,
// as in PyTorch). The rules apply in order. A module may be matched by several rules only if
// they are the same style (applied once) or a PrepareModuleInput and a PrepareModuleOutput:
// two styles that both lay out its input (or both its output) would stack their hooks.
//
// Errors (InvalidArgument naming the rule): a pattern that matches no module (or, for
// placements, no parameter); a placement on a mesh dim the mesh lacks or a data-parallel
// dim; a parameter no rule covers (with every_parameter, naming it); a style on a
// module it does not apply to (Colwise / Rowwise: Linear or Embedding; fused: a Linear whose
// outputs divide by it, the c_attn of an attention whose heads divide over the tp ranks;
// SequenceParallel: LayerNorm, RMSNorm or Dropout); two rules that both lay out one module's
// input or output (naming both and the module); a parameter two
// rules place differently (a tied weight); a parameter that is a DTensor already; a shard of
// a dim the tensor does not have; an unknown tp dim.
#ifndef DTENSOR_NN_PARALLEL_PARALLELIZE_H_
#define DTENSOR_NN_PARALLEL_PARALLELIZE_H_

#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "dtensor/mesh/device_mesh.h"
#include "dtensor/nn/module.h"
#include "dtensor/nn/parallel/parallel_style.h"

namespace dtensor::nn {

// Raw placements for the parameters whose dotted names match `pattern`: by mesh dim name, the
// model-parallel dims only (the data-parallel ones, dp_replicate and dp_shard, are FSDP's and
// DDP's); `text` is the rule as written, for messages.
struct ParamPlacements {
  std::string pattern;
  std::vector<std::pair<std::string, Placement>> placements;
  std::string text;
  friend bool operator==(const ParamPlacements& a, const ParamPlacements& b) {
    return a.pattern == b.pattern && a.placements == b.placements;
  }
};

struct ParallelizePlan {
  std::vector<std::pair<std::string, ParallelStyle>> rules;  // (module-name pattern, style), in order
  std::vector<ParamPlacements> params;                       // applied after the styles, in order
  // Refuse a parameter that no style and no placement rule covers (plan files: every
  // parameter is described); otherwise such parameters are Replicate.
  bool every_parameter = false;

  ParallelizePlan() = default;
  ParallelizePlan(std::initializer_list<std::pair<std::string, ParallelStyle>> r) : rules(r) {}  // NOLINT
  // One rule a line: "transformer.h.*.mlp.c_fc: ColwiseParallel",
  // "transformer.wpe.weight: tp=R".
  std::string ToString() const;
  friend bool operator==(const ParallelizePlan& a, const ParallelizePlan& b) {
    return a.rules == b.rules && a.params == b.params && a.every_parameter == b.every_parameter;
  }
};

// Whether `name` (dotted) matches `pattern` (dotted, shell globs per segment).
bool MatchesModulePattern(const std::string& pattern, const std::string& name);

absl::Status ParallelizeModule(Module& module, const DeviceMesh& mesh, const ParallelizePlan& plan,
                               const std::string& tp_dim = "");

}  // namespace dtensor::nn

#endif  // DTENSOR_NN_PARALLEL_PARALLELIZE_H_
