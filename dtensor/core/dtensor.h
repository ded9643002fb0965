// DTensor: a global tensor laid out over a DeviceMesh — this rank's local piece, the mesh,
// one placement per mesh dim (Layout, with the shard order), and the global shape and dtype.
//
//   DT_ASSIGN_OR_RETURN(DeviceMesh mesh, DeviceMesh::Create(world, {2, 2}, {"dp", "tp"}));
//   // every rank passes a [7, 5] tensor; rank 0's values are scattered (the default src):
//   DT_ASSIGN_OR_RETURN(DTensor x, DTensor::Distribute(full, mesh, {Shard(0), Shard(1)}));
//   x.ToLocal();                                                  // e.g. [4, 3] on rank 0
//   DT_ASSIGN_OR_RETURN(DTensor y, x.Redistribute({Replicate(), Shard(0)}));
//   DT_ASSIGN_OR_RETURN(Tensor all, y.FullTensor());              // [7, 5] on every rank
//   std::cout << y.ToString() << "\n" << VisualizeSharding(y);
//
// A DTensor is a value: copying it copies the view of the local tensor (shared storage).
// Operations never modify their input; results may share storage with it when no data
// changes (e.g. R -> P(avg)). Every collective runs on the mesh's communicators, so every
// rank of the mesh must make the same calls in the same order (as with any collective).
// Integer P(avg): each reducing collective divides (truncating, as NCCL's integer avg does),
// so a plan that reduces the avg dims in two collectives (when that is cheaper than one over
// their merged group) can differ by truncation from one that reduces them at once: int
// P(avg)P(avg) -> RR on a 2x3 mesh is trunc(sum/6) when planned as one all_reduce, which
// equal-cost plans are (ties go to fewer collectives). Float avg differs only by rounding.
//
// Redistribution follows the plan of plan.h (cached in the mesh, see RedistributePlanner)
// and executes it step by step; uneven torch.chunk shards move exactly their elements.
// A DTensor can also move to another mesh over the same ranks (4 -> 2x2, say): the
// pieces go straight from their old owner to their new one in one all_to_all. The meshes
// must hold the same ranks of one communicator (the whole world, or e.g. the same 4 ranks of
// 8 as sub-meshes of two meshes). Any source layout may become any target layout there,
// Partial targets included: they are made locally from the moved values (as R -> P is), and
// no mesh dim of the source corresponds to a target's Partial dim, so the single-mesh rule
// "Shard -> Partial is not a legal move" has nothing to apply to.
//
// Errors: InvalidArgument naming the values for placements that do not fit the mesh or the
// tensor, mixed Partial ops, Shard -> Partial, local shapes that disagree with the global
// shape, a tensor on the wrong device, meshes over different communicators; transport errors
// (DeadlineExceeded, Unavailable) come back unchanged from the communicator.
// Ranks fail together: when a check of this rank's own data fails (FromLocal's local piece
// of the wrong shape or device, without run_check; Distribute's tensor on the wrong device),
// the call aborts the mesh's communicators (Communicator::Abort) before returning its
// InvalidArgument, so peers that already wait in the next collective (a Redistribute, say)
// return Aborted naming this rank and its error within milliseconds instead of the timeout;
// the mesh is unusable afterwards. Checks of arguments every rank passes alike (layouts,
// placements, target meshes) fail alike everywhere and abort nothing.
#ifndef DTENSOR_CORE_DTENSOR_H_
#define DTENSOR_CORE_DTENSOR_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "dtensor/core/comm_counter.h"
#include "dtensor/core/plan.h"
#include "dtensor/mesh/device_mesh.h"
#include "dtensor/placements/layout.h"
#include "dtensor/tensor/tensor.h"

namespace dtensor {

class PendingDTensor;

class DTensor {
 public:
  DTensor() = default;

  struct FromLocalOptions {
    // The global shape. Without it, it is inferred as PyTorch does: each sharded dim's local
    // size times its mesh dims' sizes (right for even shards only; uneven ones need it, or
    // run_check).
    std::optional<Shape> global_shape;
    // Check across the mesh (collective: two small all-gathers on the mesh's device) that the
    // local shapes and dtypes fit together — and, without global_shape, compute the global
    // shape from them (uneven shards then work too). Every rank gets the same verdict, also
    // when some rank's own arguments are wrong (it still takes part in the exchange).
    bool run_check = false;
  };
  // Wraps this rank's piece. The local tensor's shape must be this rank's box of the global
  // shape (InvalidArgument naming both otherwise).
  static absl::StatusOr<DTensor> FromLocal(Tensor local, const DeviceMesh& mesh, const Layout& layout,
                                           const FromLocalOptions& options);
  static absl::StatusOr<DTensor> FromLocal(Tensor local, const DeviceMesh& mesh, const Layout& layout) {
    return FromLocal(std::move(local), mesh, layout, FromLocalOptions{});
  }

  struct DistributeOptions {
    // The mesh rank (index in mesh.ranks(); 0 is the rank at coordinate 0, PyTorch's default
    // src_data_rank) whose values are used: it scatters the pieces (all_to_all, each rank
    // receiving only its own piece) or broadcasts a replicated tensor. nullopt: every rank
    // already holds the same full tensor and keeps its piece (no communication).
    std::optional<int> src_rank = 0;
  };
  // Every rank passes a tensor of the global shape (only the source's values are read); with
  // a source, the ranks first agree on its shape and dtype (one all-gather of 10 integers per
  // rank; a rank that differs is InvalidArgument on every rank, naming it and both shapes).
  // Partial placements start from the full value (R -> P(sum) divides floating point values by
  // the mesh dim size, as PyTorch does; integers stay whole at coordinate 0 of that dim and are
  // zero elsewhere, so the sum is exact).
  static absl::StatusOr<DTensor> Distribute(const Tensor& global, const DeviceMesh& mesh, const Layout& layout,
                                            const DistributeOptions& options);
  static absl::StatusOr<DTensor> Distribute(const Tensor& global, const DeviceMesh& mesh, const Layout& layout) {
    return Distribute(global, mesh, layout, DistributeOptions{});
  }

  // Wraps without any check: for op implementations (autograd/dispatch.cc) whose local
  // shapes are right by construction and that checked them once. `layout` must be normalised.
  static DTensor WrapTrusted(Tensor local, DeviceMesh mesh, Layout layout, Shape global_shape) {
    return DTensor(std::move(local), std::move(mesh), std::move(layout), std::move(global_shape));
  }

  bool defined() const { return local_.defined(); }
  const Tensor& ToLocal() const { return local_; }
  const DeviceMesh& mesh() const { return mesh_; }
  const Layout& layout() const { return layout_; }
  absl::Span<const Placement> placements() const { return layout_.placements(); }
  IntSpan shape() const { return global_shape_; }  // global
  int64_t dim() const { return static_cast<int64_t>(global_shape_.size()); }
  int64_t numel() const { return NumElements(global_shape_); }
  DType dtype() const { return local_.dtype(); }
  // Global (row-major) strides of the logical tensor.
  Shape stride() const { return ContiguousStrides(global_shape_); }
  // This rank's box of the global tensor (offset and shape of its piece); empty when undefined.
  LocalBox local_box() const;

  // A DTensor with the same values laid out as `layout` (collective over the mesh).
  absl::StatusOr<DTensor> Redistribute(const Layout& layout) const;
  // Starts the redistribution: the first collective of the plan runs asynchronously (on
  // transports that overlap); the rest runs in Wait(). Keep this DTensor alive until then.
  absl::StatusOr<PendingDTensor> RedistributeAsync(const Layout& layout) const;
  // Onto another mesh over the same ranks (collective over them). A mesh
  // with the same ranks and shape (another object, other names) redistributes on `mesh`: the
  // result carries `mesh`, and its counter sees the collectives.
  absl::StatusOr<DTensor> Redistribute(const DeviceMesh& mesh, const Layout& layout) const;
  // The whole tensor on every rank (Replicate on every mesh dim, then the local tensor).
  absl::StatusOr<Tensor> FullTensor() const;

  // "DTensor(shape=[7, 5], dtype=float32, mesh=DeviceMesh(dp=2, tp=2), placements=S(0)R,
  //  local=[4, 5])"
  std::string ToString() const;

 private:
  friend class PendingDTensor;
  DTensor(Tensor local, DeviceMesh mesh, Layout layout, Shape global_shape)
      : local_(std::move(local)),
        mesh_(std::move(mesh)),
        layout_(std::move(layout)),
        global_shape_(std::move(global_shape)) {}

  Tensor local_;
  DeviceMesh mesh_;
  Layout layout_;
  Shape global_shape_;
};

// A redistribution in flight (DTensor::RedistributeAsync).
class PendingDTensor {
 public:
  // Movable (defined where State is complete, so that code outside the library can move one).
  PendingDTensor(PendingDTensor&&) noexcept;
  PendingDTensor& operator=(PendingDTensor&&) noexcept;
  ~PendingDTensor();
  // Waits for the collective and runs the rest of the plan. Call once.
  absl::StatusOr<DTensor> Wait();
  bool IsCompleted();

 private:
  friend class DTensor;
  PendingDTensor() = default;
  struct State;
  std::unique_ptr<State> state_;
};

// Records every collective that DTensor operations on `mesh` (and its views) issue on this
// rank into `counter` (nullptr: stop). The counter must outlive the attachment.
void SetCommCounter(const DeviceMesh& mesh, CommCounter* counter);
// The counter attached to `mesh` (nullptr when none): ops that call the mesh's communicators
// directly record their collectives there too.
CommCounter* CommCounterOf(const DeviceMesh& mesh);
// The plan cache of `mesh` (shared by its views): hits, misses, clearing.
RedistributePlanner& PlannerOf(const DeviceMesh& mesh);

// Which rank holds which block: one line per distinct block with the ranks holding it, e.g.
//   DTensor [7, 5] float32 on DeviceMesh(dp=2, tp=2) as S(0)R
//     [0:4, 0:5]  ranks 0, 1
//     [4:7, 0:5]  ranks 2, 3
// with "(partial sum)" appended for Partial layouts (the layout-only overload cannot name
// the dtype). Pure: no communication.
std::string VisualizeSharding(IntSpan global_shape, const DeviceMesh& mesh, const Layout& layout);
std::string VisualizeSharding(const DTensor& x);

}  // namespace dtensor

#endif  // DTENSOR_CORE_DTENSOR_H_
