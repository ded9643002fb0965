// Layout: where every element of a global tensor lives on a device mesh — one Placement per
// mesh dim, plus the order in which mesh dims that shard the same tensor dim split it. And the
// one pure function that gives any rank's local shape and global offset (LocalBoxOf).
//
//   Layout l({Shard(0), Shard(0)});              // 2x2 mesh: mesh dim 0 splits rows first
//   LocalBox b = LocalBoxOf({5, 3}, {2, 2}, l, {1, 0});   // rank at mesh coordinate (1, 0)
//   // b.offset = {3, 0}, b.shape = {1, 3}: rows 0-2 go to mesh row 0, rows 3-4 to row 1,
//   // then each row's piece is chunked again over mesh dim 1: rows [0,2),[2,3),[3,4),[4,5)
//   // for coordinates (0,0), (0,1), (1,0), (1,1).
//   DT_ASSIGN_OR_RETURN(Layout tp_first, l.WithShardOrder(0, {1, 0}));  // mesh dim 1 first
//
// Uneven sharding is exactly torch.chunk (ChunkOf): n elements over k ranks give chunks of
// ceil(n/k); rank i holds [i*chunk, min(n, (i+1)*chunk)), possibly empty (5 over 4 -> 2,2,1,0).
// Several mesh dims sharding one tensor dim nest: the outermost chunks the dim, the next
// chunks that piece with the piece's own (logical) size, and so on. The default order is
// left to right (ascending mesh dim), as in PyTorch; any other order (PyTorch's
// _StridedShard / shard_order, which FSDP over TP needs) is set with WithShardOrder. Every
// rank's piece is one box (a contiguous range per tensor dim) of the global tensor.
//
// Layout values are not tied to a tensor: negative shard dims are kept until NormalizeLayout
// checks the layout against a tensor rank and a mesh.
#ifndef DTENSOR_PLACEMENTS_LAYOUT_H_
#define DTENSOR_PLACEMENTS_LAYOUT_H_

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/inlined_vector.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "dtensor/placements/placement.h"
#include "dtensor/tensor/tensor.h"

namespace dtensor {

using Placements = absl::InlinedVector<Placement, 4>;

class Layout {
 public:
  Layout() = default;
  // Default (left-to-right) shard order.
  Layout(absl::Span<const Placement> placements);  // NOLINT: implicit, Layout({Shard(0), Replicate()})
  Layout(std::initializer_list<Placement> placements)
      : Layout(absl::MakeConstSpan(placements.begin(), placements.size())) {}
  Layout(const std::vector<Placement>& placements) : Layout(absl::MakeConstSpan(placements)) {}  // NOLINT: implicit

  // The same placements with `tensor_dim` split by `mesh_dims` in that order (outermost
  // first). mesh_dims must be exactly the mesh dims whose placement is Shard(tensor_dim)
  // (InvalidArgument otherwise, naming both lists).
  absl::StatusOr<Layout> WithShardOrder(int64_t tensor_dim, absl::Span<const int> mesh_dims) const;

  int ndim() const { return static_cast<int>(placements_.size()); }  // mesh dims
  absl::Span<const Placement> placements() const { return placements_; }
  const Placement& operator[](int mesh_dim) const { return placements_[static_cast<size_t>(mesh_dim)]; }
  // Mesh dims that shard `tensor_dim`, outermost first.
  absl::InlinedVector<int, 4> ShardMeshDims(int64_t tensor_dim) const;
  // Position of mesh dim m among the sharders of its tensor dim (0 = outermost); 0 when m
  // does not shard.
  int nest_level(int mesh_dim) const { return nest_[static_cast<size_t>(mesh_dim)]; }
  bool is_default_order() const;
  bool is_replicated() const;  // every placement is Replicate
  bool has_partial() const;
  // The op of the first Partial placement, if any.
  std::optional<PartialOp> partial_op() const;

  // Placements ("S(0)R"), followed by the orders that are not left to right as
  // "{tensor_dim:outer,...,inner}" — e.g. "S(0)S(0){0:1,0}".
  std::string ToString() const;

  // The same layout with placement `mesh_dim` replaced; the new shard (if any) becomes the
  // innermost sharder of its tensor dim.
  Layout WithPlacement(int mesh_dim, const Placement& p) const;

  friend bool operator==(const Layout& a, const Layout& b) {
    return a.placements_ == b.placements_ && a.nest_ == b.nest_;
  }
  friend bool operator!=(const Layout& a, const Layout& b) { return !(a == b); }
  template <typename H>
  friend H AbslHashValue(H h, const Layout& l) {
    return H::combine(std::move(h), l.placements_, l.nest_);
  }

 private:
  Placements placements_;
  absl::InlinedVector<int, 4> nest_;
};

// The layout with negative shard dims mapped into [0, tensor_ndim), checked against a tensor
// of tensor_ndim dims on a mesh of mesh_ndim dims: placement count != mesh_ndim, a shard dim
// out of range, or Partial placements with different ops -> InvalidArgument naming the
// values, with `op` in brackets.
absl::StatusOr<Layout> NormalizeLayout(const char* op, const Layout& layout, int64_t tensor_ndim, int mesh_ndim);

// Piece `index` of n elements split torch.chunk-style over `chunks` ranks.
struct ChunkRange {
  int64_t offset = 0;
  int64_t size = 0;
};
ChunkRange ChunkOf(int64_t n, int64_t chunks, int64_t index);
// ceil(n / chunks): the size every piece is padded to by padded collectives.
int64_t ChunkSizeOf(int64_t n, int64_t chunks);

// A rank's piece of the global tensor: a box [offset, offset + shape) per tensor dim.
struct LocalBox {
  Shape offset;
  Shape shape;
  int64_t numel() const { return NumElements(shape); }
  friend bool operator==(const LocalBox& a, const LocalBox& b) { return a.offset == b.offset && a.shape == b.shape; }
};

// The box the rank at `coord` holds. Preconditions: `layout` normalised for
// global_shape.size() dims and mesh_shape.size() mesh dims, coord inside mesh_shape.
// (CheckedLocalBoxOf validates instead.)
LocalBox LocalBoxOf(IntSpan global_shape, IntSpan mesh_shape, const Layout& layout, IntSpan coord);
absl::StatusOr<LocalBox> CheckedLocalBoxOf(IntSpan global_shape, IntSpan mesh_shape, const Layout& layout,
                                           IntSpan coord);

// The range along `tensor_dim` covered by the sharders of that dim nested outside mesh dim
// `mesh_dim` (the "parent" piece that mesh_dim chunks). Same preconditions.
ChunkRange ParentRangeOf(IntSpan global_shape, IntSpan mesh_shape, const Layout& layout, IntSpan coord, int mesh_dim);

}  // namespace dtensor

#endif  // DTENSOR_PLACEMENTS_LAYOUT_H_
