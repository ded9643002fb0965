// Internal to dtensor/core: the executor of redistribution plans and the per-mesh state of
// this layer. Not installed.
#ifndef DTENSOR_CORE_EXECUTOR_H_
#define DTENSOR_CORE_EXECUTOR_H_

#include <array>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/inlined_vector.h"
#include "absl/status/statusor.h"
#include "dtensor/collectives/communicator.h"
#include "dtensor/core/comm_counter.h"
#include "dtensor/core/plan.h"
#include "dtensor/mesh/device_mesh.h"

namespace dtensor::internal {

// A region of a box that narrows the box in at most one dim: elements [start, start + length)
// of `dim` (relative to the box), or the whole box (dim -1). Its view is one Tensor::Narrow,
// cheaper than RegionOf, which checks the region against the box in every dim. The regions of
// an S(i) -> S(j) step are slabs; an empty region is the slab of length 0 at the start of dim 0.
struct Slab {
  int64_t dim = -1;
  int64_t start = 0;
  int64_t length = 0;
};
// The slab of `region` (inside `box`), or nullopt when it narrows several dims or does not
// lie inside the box.
std::optional<Slab> SlabOf(const LocalBox& box, const LocalBox& region);

// The box arithmetic of one plan step for one mesh coordinate: what StartStep needs besides
// the tensors. Pure; computed once per (plan, coordinate) and cached (PlanGeometry).
struct StepGeometry {
  LocalBox before, after;                  // this rank's boxes
  absl::InlinedVector<int, 4> group;       // the step's mesh dims, ascending
  absl::InlinedVector<LocalBox, 4> parts;  // all_gather: members' before boxes; reduce_scatter: after
  absl::InlinedVector<int64_t, 4> counts;  // numel of parts
  bool even = false;                       // all counts equal
  bool consecutive = false;                // parts are consecutive blocks of after (gather) / before (scatter)
  absl::InlinedVector<LocalBox, 4> send_regions, recv_regions;  // all_to_all
  bool uniform = false;                                         // all_to_all: every pair moves the same count
  bool blocks = false;  // all_to_all: some member's regions are not back to back (AllToAllBlocks)
  // all_to_all: the regions as slabs of before / after, when every one of them is a slab (else
  // empty).
  absl::InlinedVector<Slab, 4> send_slabs, recv_slabs;
};
struct PlanGeometry {
  std::shared_ptr<const RedistributePlan> plan;  // kept alive: the cache is keyed by its address
  std::vector<StepGeometry> steps;
};

// Kept in MeshRoot::core_state: shared by a mesh and its views, one per rank.
struct CoreState {
  RedistributePlanner planner;
  CommCounter* counter = nullptr;
  // Step geometry per (plan, mesh coordinate): a redistribution that hits the plan cache does
  // no box arithmetic. Views of one mesh with the same shape and coordinate share entries
  // (the geometry depends on nothing else). An entry keeps its plan alive, so a key's address
  // is not reused while the entry lives; at kMaxGeometries entries the cache starts over
  // (users hold their entry: an async redistribution keeps its own).
  static constexpr size_t kMaxGeometries = 4096;
  absl::flat_hash_map<std::pair<const RedistributePlan*, Shape>, std::shared_ptr<const PlanGeometry>> geometry;
  // The entry found last and its coordinate, tried first.
  std::shared_ptr<const PlanGeometry> last_geometry;
  Shape last_coordinate;
};
CoreState& CoreStateOf(const DeviceMesh& mesh);

CommReduceOp ToCommReduceOp(PartialOp op);

// A view of `t` (whose box is `t_box`) restricted to `region` (inside t_box).
absl::StatusOr<Tensor> RegionOf(const Tensor& t, const LocalBox& t_box, const LocalBox& region);

// A collective step in flight: wait for `work`, then Finish() gives the step's output:
// `finish`'s result, or `done` (moved out) where there is nothing to finish (a step done at once,
// or a collective straight into its output, needs no closure: no allocation on the path of every
// redistribution). `keep` holds the buffers the collective reads until it is done.
struct StartedStep {
  std::unique_ptr<Work> work;
  std::function<absl::StatusOr<Tensor>()> finish;
  Tensor done;
  std::array<Tensor, 2> keep;
  absl::StatusOr<Tensor> Finish() { return finish ? finish() : std::move(done); }
};

// The cached geometry of every step of `plan` at this rank's coordinate of `mesh`.
std::shared_ptr<const PlanGeometry> GeometryOf(const std::shared_ptr<const RedistributePlan>& plan,
                                               const DeviceMesh& mesh);
// The same by reference, valid until the next GeometryOf or GeometryRef on a view of `mesh`.
const PlanGeometry& GeometryRef(const std::shared_ptr<const RedistributePlan>& plan, const DeviceMesh& mesh);

// Starts step `step` (with its geometry `g`) of a plan on `mesh`, with this rank's input
// `local` (its box in step.before). Local steps complete at once (work is null).
absl::StatusOr<StartedStep> StartStep(const RedistributeStep& step, const StepGeometry& g, const Tensor& local,
                                      const DeviceMesh& mesh);
// Runs steps [first, end) of `plan` on `local`, synchronously.
absl::StatusOr<Tensor> ExecuteSteps(const std::shared_ptr<const RedistributePlan>& plan, size_t first,
                                    const Tensor& local, const DeviceMesh& mesh);

// Which all_to_all moves the boxes; the caller picks it alike on every rank (the transports
// check that all ranks make the same call).
enum class TransferKind {
  kAllToAll,    // every rank's regions are back to back and every pair moves the same count
  kAllToAllV,   // every rank's regions are back to back
  kBlocks,      // any regions: Communicator::AllToAllBlocks, view to view
  kEvenBlocks,  // any regions, every pair moves the same count: AllToAllBlocks(uniform)
};

// Moves boxes between the ranks of `comm` in one all_to_all: send_regions[j] (a region of
// `local`, whose box is local_box) goes to rank j, recv_regions[j] (a region of the output,
// whose box is out_box) comes from rank j. Empty regions send nothing. Records one
// all_to_all into `counter` (if any) with the bytes this rank sends. send_slabs and
// recv_slabs, when not empty, are the same regions as slabs (StepGeometry's): the block kinds
// then build each view with one Narrow.
absl::StatusOr<Tensor> TransferBoxes(Communicator& comm, const Tensor& local, const LocalBox& local_box,
                                     absl::Span<const LocalBox> send_regions, const LocalBox& out_box,
                                     absl::Span<const LocalBox> recv_regions, TransferKind kind, CommCounter* counter,
                                     absl::Span<const Slab> send_slabs = {}, absl::Span<const Slab> recv_slabs = {});

// R -> P(sum) over mesh dims of `divisor` ranks in all, as a copy: floating point values are
// divided by it (as PyTorch does); other dtypes (integers, bool, float8) stay on the rank at
// coordinate 0 of those dims (`first`) and are zero elsewhere, so that the sum is exact.
absl::StatusOr<Tensor> DivideForPartial(const Tensor& x, int64_t divisor, bool first);

}  // namespace dtensor::internal

#endif  // DTENSOR_CORE_EXECUTOR_H_
