// The op dispatcher: runs one op on Values, choosing a sharding strategy for DTensors.
//
// An op is an OpDef: its sharding rule (the single-mesh-dim strategies, as PyTorch's
// `register_op_strategy`), its meta function (global output shapes) and its local function
// (the computation on this rank's pieces). Dispatch:
//   - plain Tensors only: calls the local function directly (no mesh, no strategy);
//   - any DTensor: every strategy is the product of one DimStrategy per mesh dim (plus
//     Replicate everywhere); the one whose input redistributions move the fewest bytes
//     (RedistributePlan::cost; ties to the one redistributing fewer inputs, so Replicate stays
//     Replicate, then to the earlier strategy) is chosen, inputs are
//     redistributed, the local function runs and the outputs are wrapped as DTensors.
//     The choice is cached per (op, input shapes, dtypes, layouts, static args, mesh shape)
//     in the mesh (no global cache).
//
//   const OpDef kGelu = {"gelu", PointwiseRule, SameShapeMeta, GeluLocal};
//   DT_ASSIGN_OR_RETURN(std::vector<Value> out, Dispatch(kGelu, {x}, {}));
//
// A plain Tensor among DTensors is treated as Replicate on their mesh. DTensors on different
// meshes -> InvalidArgument.
#ifndef DTENSOR_AUTOGRAD_DISPATCH_H_
#define DTENSOR_AUTOGRAD_DISPATCH_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/inlined_vector.h"
#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "dtensor/autograd/value.h"
#include "dtensor/core/dtensor.h"
#include "dtensor/placements/layout.h"

namespace dtensor {

// Static (non-tensor) arguments of a call: part of the strategy cache key.
struct OpArgs {
  absl::InlinedVector<int64_t, 6> ints;
  absl::InlinedVector<double, 2> floats;
  friend bool operator==(const OpArgs& a, const OpArgs& b) { return a.ints == b.ints && a.floats == b.floats; }
  template <typename H>
  friend H AbslHashValue(H h, const OpArgs& a) {
    return H::combine(std::move(h), a.ints, a.floats);
  }
};

// Global shape and dtype of an op's input or output.
struct TensorMeta {
  Shape shape;
  DType dtype = DType::kFloat32;
};

// One mesh dim's strategy: the placement each input must have and each output gets.
struct DimStrategy {
  absl::InlinedVector<Placement, 5> inputs = {};
  absl::InlinedVector<Placement, 3> outputs = {};
  // Sizes that must divide evenly by the number of shards this strategy makes: the product
  // of the sizes of the mesh dims that take it (reshape's merged or split dims, whose pieces
  // must stay whole rows). Combinations where one does not are dropped.
  std::vector<int64_t> divisible = {};
  // The mesh dims this strategy may take, as a bit mask (bit m: mesh dim m); a rule sets it
  // from its args where a strategy is only right on some dims (embedding_backward splits the
  // table's gradient by rows from replicated inputs only where the table is Shard(0): on a dim
  // where it is Replicate, plain per-rank data is "Replicate" too and must not be split).
  uint64_t mesh_dims = ~uint64_t{0};
};

// What an op's local function receives.
struct LocalCall {
  absl::Span<const Tensor> inputs;  // this rank's pieces, laid out as the chosen strategy asks
  const OpArgs& args;
  absl::Span<const TensorMeta> input_meta;   // global
  absl::Span<const TensorMeta> output_meta;  // global (empty for plain tensors)
  // Distributed context; mesh == nullptr for plain tensors (one rank holding everything).
  const DeviceMesh* mesh = nullptr;
  absl::Span<const Layout> input_layouts;
  absl::Span<const Layout> output_layouts;
  // Bit i: input i came as a plain Tensor (taken as Replicate, though its values may be this
  // rank's own: each rank's batch).
  uint64_t plain_inputs = 0;

  // The global offset of this rank's piece of input `i` / output `i` (zeros without a mesh).
  Shape InputOffset(int i) const;
  Shape OutputOffset(int i) const;
};

struct OpDef {
  const char* name;
  // Appends the single-mesh-dim strategies for inputs of these global shapes (Replicate
  // everywhere is always added after them). Each must hold on every dim of a mesh of
  // `mesh_shape`, or say with DimStrategy::divisible what it needs of the shard count.
  void (*rule)(absl::Span<const TensorMeta> in, const OpArgs& args, IntSpan mesh_shape, std::vector<DimStrategy>* out);
  // The global output shapes and dtypes; InvalidArgument for inputs the op refuses.
  absl::StatusOr<std::vector<TensorMeta>> (*meta)(absl::Span<const TensorMeta> in, const OpArgs& args);
  // The computation on local pieces: one tensor per output, of the output layout's local shape.
  absl::StatusOr<std::vector<Tensor>> (*local)(const LocalCall& call);
  // Optional, for selective activation checkpointing (checkpoint.h): when set, a forward that
  // keeps this op's outputs keeps only output `ac_kept_output`, and the recomputation gets all
  // outputs back from ac_rebuild(kept, args), which must be cheap (linear_bias_gelu keeps the
  // pre-activation and rebuilds the activation with one GELU pass, as llm.c's recompute does).
  absl::StatusOr<std::vector<Value>> (*ac_rebuild)(const Value& kept, const OpArgs& args) = nullptr;
  int ac_kept_output = 0;
};

// Runs `op` on `inputs`. Collective over the mesh when any input is a DTensor.
absl::StatusOr<std::vector<Value>> Dispatch(const OpDef& op, absl::Span<const Value> inputs, const OpArgs& args = {});

// The strategy the dispatcher would choose (for tests and debugging), e.g.
// "linear: S(0)R, RR -> S(0)R (cost 0)". Pure: no communication.
absl::StatusOr<std::string> ExplainStrategy(const OpDef& op, absl::Span<const Value> inputs, const OpArgs& args = {});

// Every candidate strategy (as layouts) for inputs on `mesh_shape`, in preference order; for
// tests that run an op under each of them.
struct OpStrategy {
  std::vector<Layout> inputs;
  std::vector<Layout> outputs;
};
absl::StatusOr<std::vector<OpStrategy>> EnumerateStrategies(const OpDef& op, absl::Span<const TensorMeta> in,
                                                            const OpArgs& args, IntSpan mesh_shape);

// Runs `op` with inputs already laid out as `strategy` asks (tests: each strategy's result).
absl::StatusOr<std::vector<Value>> DispatchWith(const OpDef& op, const OpStrategy& strategy,
                                                absl::Span<const Value> inputs, const OpArgs& args = {});

// Cache statistics of the dispatcher on `mesh` (shared by its views).
struct DispatchStats {
  int64_t hits = 0;
  int64_t misses = 0;
  int64_t cached = 0;  // strategies held (at most 4096: then the cache starts over)
};
DispatchStats DispatchStatsOf(const DeviceMesh& mesh);

namespace internal {

// Sees every Dispatch on this thread while installed (TorchDispatchMode's role, for selective
// activation checkpointing, checkpoint.h: a forward keeps some ops' outputs, its
// recomputation gets them back instead of running those ops again).
class DispatchObserver {
 public:
  virtual ~DispatchObserver() = default;
  // Before `op` runs: the outputs to return instead of running it, or nullopt to run it.
  virtual absl::StatusOr<std::optional<std::vector<Value>>> Replace(const OpDef& op, absl::Span<const Value> inputs,
                                                                    const OpArgs& args) = 0;
  // After `op` ran (not when Replace gave its outputs).
  virtual void Ran(const OpDef& op, absl::Span<const Value> inputs, const OpArgs& args,
                   const std::vector<Value>& outputs) = 0;
};

// Installs `observer` on this thread (null: none) and returns the one it replaces.
DispatchObserver* SetDispatchObserver(DispatchObserver* observer);

// Runs `run`, an operation that is not dispatched (a Variable's Redistribute), as Dispatch runs
// `op`: the installed observer may hand back its outputs instead, or sees them. `op` names it
// (its functions are not called).
absl::StatusOr<std::vector<Value>> RunObserved(const OpDef& op, absl::Span<const Value> inputs, const OpArgs& args,
                                               absl::FunctionRef<absl::StatusOr<std::vector<Value>>()> run);

}  // namespace internal

}  // namespace dtensor

#endif  // DTENSOR_AUTOGRAD_DISPATCH_H_
