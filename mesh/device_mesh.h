// DeviceMesh: the ranks of a communicator arranged as an n-d array (1 to 4 dims) with named
// dims, and one sub-communicator per dim (and per group of dims), created once.
//
//   // every rank (thread or process) of an 8-rank communicator `world`:
//   DT_ASSIGN_OR_RETURN(DeviceMesh mesh, DeviceMesh::Create(world, {2, 2, 2}, {"dp", "cp", "tp"}));
//   mesh.coordinate();                                   // e.g. {1, 0, 1} for rank 5
//   DT_ASSIGN_OR_RETURN(DeviceMesh tp, mesh.Sub("tp"));  // 1-d mesh of this rank's tp group
//   DT_ASSIGN_OR_RETURN(DeviceMesh dp_cp, mesh.Flatten("dp", "cp", "dp_cp"));  // 4 x 2
//   Communicator& tp_comm = mesh.comm(2);                // ranks that differ only in "tp"
//
// Rank r of the communicator sits at the row-major coordinate of r. Create is collective
// over `world`: it splits it once for every non-empty set of mesh dims (2^ndim - 1 groups, at
// most 15), so that any later step over any dims, or over several dims at once (a flattened
// group), needs no new communicator. Sub-meshes and flattened meshes share those groups and
// the mesh's caches (plans, comm counter): they are views of the mesh they came from. The
// world communicator must outlive the mesh and every view; a mesh belongs to one rank.
//
// Errors (InvalidArgument naming the values): a shape whose product differs from the
// communicator size, 0 or more than 4 dims, non-positive sizes or sizes above the
// communicator's, names that are missing, duplicated or unknown, flattening dims that are not
// adjacent. Those are found by each rank alone, before any collective. Then the ranks agree
// (one small all_gather): ranks asking for different shapes or names all get InvalidArgument
// naming two of the meshes asked for.
#ifndef DTENSOR_MESH_DEVICE_MESH_H_
#define DTENSOR_MESH_DEVICE_MESH_H_

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/inlined_vector.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "dtensor/collectives/communicator.h"
#include "dtensor/tensor/tensor.h"

namespace dtensor {

namespace internal {
// What a mesh and all its views share: the world communicator, one communicator per set of
// root dims (index = bit mask of root dims; the full mask is the world itself), and a slot
// for the state of the layer above (dtensor/core keeps its plan cache and comm counter
// there; opaque here so that mesh/ does not depend on that layer).
struct MeshRoot {
  Communicator* world = nullptr;
  Shape shape;                                        // of the Created mesh
  Shape coord;                                        // this rank's coordinate in it
  std::vector<std::unique_ptr<Communicator>> groups;  // [mask]; [0] and [full] are null
  std::shared_ptr<void> core_state;
  std::shared_ptr<void> ops_state;  // the same for the op dispatcher (autograd/): its strategy cache
};
}  // namespace internal

inline constexpr int kMaxMeshDims = 4;

// The row-major coordinate of the `linear`-th rank of a mesh of `shape` (rank r of the
// communicator a mesh is created over sits at UnravelIndex(shape, r)).
Shape UnravelIndex(IntSpan shape, int64_t linear);

class DeviceMesh {
 public:
  // Collective over `world`. names: one per dim, distinct and non-empty.
  static absl::StatusOr<DeviceMesh> Create(Communicator& world, IntSpan shape, std::vector<std::string> names);
  // Names "d0", "d1", ...
  static absl::StatusOr<DeviceMesh> Create(Communicator& world, IntSpan shape);
  // An empty mesh, for default-constructed holders (only assignment and defined() work on
  // it); use Create.
  DeviceMesh() = default;
  bool defined() const { return v_ != nullptr; }

  int ndim() const { return static_cast<int>(v_->dims.size()); }
  IntSpan shape() const { return v_->shape; }
  int64_t size(int dim) const { return v_->shape[static_cast<size_t>(dim)]; }
  int64_t size() const { return NumElements(v_->shape); }  // number of ranks in this mesh
  const std::vector<std::string>& names() const { return v_->names; }
  // Index of the dim called `name`; InvalidArgument listing the names if there is none.
  absl::StatusOr<int> DimIndex(const std::string& name) const;

  // This rank's coordinate in the mesh, and its rank in the world communicator.
  IntSpan coordinate() const { return v_->coord; }
  int64_t coordinate(int dim) const { return v_->coord[static_cast<size_t>(dim)]; }
  int world_rank() const;
  // World ranks of the mesh, row-major (rank at coordinate c is ranks()[linear index of c]).
  std::vector<int> ranks() const;
  // The world communicator this mesh was built over (all its ranks, not only this mesh's).
  Communicator& world() const;
  Device device() const { return world().device(); }

  // The ranks that differ from this one only in mesh dim `dim`, ordered by that coordinate.
  // Precondition: 0 <= dim < ndim().
  Communicator& comm(int dim) const;
  // The ranks that differ only in `dims` (distinct, any order), ordered row-major over those
  // dims in ascending dim order. InvalidArgument for a bad dim list.
  absl::StatusOr<Communicator*> comm(absl::Span<const int> dims) const;

  // The sub-mesh of the named dims (in mesh order) that contains this rank.
  absl::StatusOr<DeviceMesh> Sub(absl::Span<const std::string> names) const;
  absl::StatusOr<DeviceMesh> Sub(const std::string& name) const;
  // PyTorch's spelling: mesh["tp"], mesh[{"dp", "tp"}].
  absl::StatusOr<DeviceMesh> operator[](const std::string& name) const { return Sub(name); }
  absl::StatusOr<DeviceMesh> operator[](std::initializer_list<std::string> names) const {
    return Sub(absl::MakeConstSpan(names.begin(), names.size()));
  }
  // The mesh with the adjacent dims first..last (by name, inclusive) merged into one dim
  // called `new_name` (TorchTitan's dp_shard_cp); the other dims are kept.
  absl::StatusOr<DeviceMesh> Flatten(const std::string& first, const std::string& last, std::string new_name) const;

  // Same ranks in the same arrangement over the same groups (names are not compared).
  bool SameAs(const DeviceMesh& other) const;
  // The dims of this mesh that `part`'s dims are, in `part`'s order: `part` must be a view of
  // the same created mesh holding this rank, each of its dims exactly one dim of this mesh
  // (mesh["dp"] of a [dp, tp] mesh gives {0}; the mesh itself gives {0, ..., ndim-1}).
  // InvalidArgument naming both meshes otherwise.
  absl::StatusOr<std::vector<int>> DimsOf(const DeviceMesh& part) const;
  // "DeviceMesh(dp=2, tp=2)"
  std::string ToString() const;

  // For the layers above (dtensor/core): the state shared with every view of this mesh.
  internal::MeshRoot& root() const { return *v_->root; }

 private:
  // Immutable and shared, so that copying a mesh (every DTensor holds one) is cheap.
  struct View {
    // Root dims (of the mesh that was Created) each of this mesh's dims covers, ascending.
    std::vector<absl::InlinedVector<int, 4>> dims;
    std::vector<std::string> names;
    Shape shape;
    Shape coord;
    std::shared_ptr<internal::MeshRoot> root;
  };
  explicit DeviceMesh(View v) : v_(std::make_shared<const View>(std::move(v))) {}
  std::shared_ptr<const View> v_;
};

}  // namespace dtensor

#endif  // DTENSOR_MESH_DEVICE_MESH_H_
