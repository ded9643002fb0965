#include "dtensor/placements/layout.h"

#include <algorithm>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "dtensor/tensor/status.h"

namespace dtensor {
namespace {

// Dense nest levels for the sharders of each tensor dim, ordered by (current level, mesh dim).
absl::InlinedVector<int, 4> Renest(const Placements& ps, const absl::InlinedVector<int, 4>& levels) {
  absl::InlinedVector<int, 4> nest(ps.size(), 0);
  for (size_t m = 0; m < ps.size(); ++m) {
    if (!ps[m].is_shard()) continue;
    int level = 0;
    for (size_t o = 0; o < ps.size(); ++o) {
      if (o == m || !ps[o].is_shard() || ps[o].shard_dim() != ps[m].shard_dim()) continue;
      if (std::tie(levels[o], o) < std::tie(levels[m], m)) ++level;
    }
    nest[m] = level;
  }
  return nest;
}

}  // namespace

Layout::Layout(absl::Span<const Placement> placements)
    : placements_(placements.begin(), placements.end()),
      nest_(Renest(placements_, absl::InlinedVector<int, 4>(placements.size(), 0))) {}

absl::StatusOr<Layout> Layout::WithShardOrder(int64_t tensor_dim, absl::Span<const int> mesh_dims) const {
  absl::InlinedVector<int, 4> sharders = ShardMeshDims(tensor_dim);
  absl::InlinedVector<int, 4> given(mesh_dims.begin(), mesh_dims.end());
  std::sort(sharders.begin(), sharders.end());
  std::sort(given.begin(), given.end());
  if (sharders != given) {
    return InvalidArg("Layout", "shard order {", absl::StrJoin(mesh_dims, ","), "} for tensor dim ", tensor_dim,
                      " must list exactly the mesh dims that shard it {", absl::StrJoin(sharders, ","), "} in ",
                      PlacementsString(placements_));
  }
  Layout out = *this;
  for (size_t i = 0; i < mesh_dims.size(); ++i) out.nest_[static_cast<size_t>(mesh_dims[i])] = static_cast<int>(i);
  return out;
}

absl::InlinedVector<int, 4> Layout::ShardMeshDims(int64_t tensor_dim) const {
  absl::InlinedVector<int, 4> dims;
  for (int m = 0; m < ndim(); ++m) {
    if (placements_[static_cast<size_t>(m)].is_shard() &&
        placements_[static_cast<size_t>(m)].shard_dim() == tensor_dim) {
      dims.push_back(m);
    }
  }
  std::sort(dims.begin(), dims.end(),
            [&](int a, int b) { return nest_[static_cast<size_t>(a)] < nest_[static_cast<size_t>(b)]; });
  return dims;
}

bool Layout::is_default_order() const {
  return nest_ == Renest(placements_, absl::InlinedVector<int, 4>(nest_.size(), 0));
}

bool Layout::is_replicated() const {
  return std::all_of(placements_.begin(), placements_.end(), [](const Placement& p) { return p.is_replicate(); });
}

bool Layout::has_partial() const {
  return std::any_of(placements_.begin(), placements_.end(), [](const Placement& p) { return p.is_partial(); });
}

std::optional<PartialOp> Layout::partial_op() const {
  for (const Placement& p : placements_) {
    if (p.is_partial()) return p.partial_op();
  }
  return std::nullopt;
}

std::string Layout::ToString() const {
  std::string s = PlacementsString(placements_);
  if (is_default_order()) return s;
  // Every tensor dim whose order is not ascending, once, in the order of first appearance.
  absl::InlinedVector<int64_t, 4> done;
  for (const Placement& p : placements_) {
    if (!p.is_shard() || std::find(done.begin(), done.end(), p.shard_dim()) != done.end()) continue;
    done.push_back(p.shard_dim());
    absl::InlinedVector<int, 4> dims = ShardMeshDims(p.shard_dim());
    if (!std::is_sorted(dims.begin(), dims.end())) {
      absl::StrAppend(&s, "{", p.shard_dim(), ":", absl::StrJoin(dims, ","), "}");
    }
  }
  return s;
}

Layout Layout::WithPlacement(int mesh_dim, const Placement& p) const {
  Layout out = *this;
  const size_t m = static_cast<size_t>(mesh_dim);
  out.placements_[m] = p;
  absl::InlinedVector<int, 4> levels = nest_;
  levels[m] = 1 << 20;  // innermost of its (new) group
  out.nest_ = Renest(out.placements_, levels);
  return out;
}

absl::StatusOr<Layout> NormalizeLayout(const char* op, const Layout& layout, int64_t tensor_ndim, int mesh_ndim) {
  if (layout.ndim() != mesh_ndim) {
    return InvalidArg(op, layout.ndim(), " placements (", layout.ToString(), ") for a ", mesh_ndim,
                      "-d mesh: need one placement per mesh dim");
  }
  Placements ps(layout.placements().begin(), layout.placements().end());
  absl::InlinedVector<int, 4> levels(ps.size());
  std::optional<PartialOp> partial;
  for (size_t m = 0; m < ps.size(); ++m) {
    levels[m] = layout.nest_level(static_cast<int>(m));
    if (ps[m].is_shard()) {
      const int64_t d = ps[m].shard_dim();
      if (d < -tensor_ndim || d >= tensor_ndim) {
        return InvalidArg(op, "placement ", ps[m].ToString(), " on mesh dim ", m, " of ", layout.ToString(),
                          ": shard dim out of range for a ", tensor_ndim, "-d tensor");
      }
      ps[m] = Shard(d < 0 ? d + tensor_ndim : d);
    } else if (ps[m].is_partial()) {
      if (partial && *partial != ps[m].partial_op()) {
        return InvalidArg(op, "mixed Partial ops in ", layout.ToString(), ": P(", PartialOpName(*partial), ") and P(",
                          PartialOpName(ps[m].partial_op()), ") cannot be reduced together");
      }
      partial = ps[m].partial_op();
    }
  }
  Layout out(ps);
  // Left to right stays left to right, even when one dim is spelled both ways (S(0), S(-1)).
  if (layout.is_default_order()) return out;
  // Carry the order over: per tensor dim, sort the sharders by their old level.
  for (int64_t d = 0; d < tensor_ndim; ++d) {
    absl::InlinedVector<int, 4> dims = out.ShardMeshDims(d);
    if (dims.size() < 2) continue;
    std::stable_sort(dims.begin(), dims.end(),
                     [&](int a, int b) { return levels[static_cast<size_t>(a)] < levels[static_cast<size_t>(b)]; });
    DT_ASSIGN_OR_RETURN(out, out.WithShardOrder(d, dims));
  }
  return out;
}

ChunkRange ChunkOf(int64_t n, int64_t chunks, int64_t index) {
  const int64_t chunk = ChunkSizeOf(n, chunks);
  const int64_t begin = std::min(n, index * chunk);
  const int64_t end = std::min(n, begin + chunk);
  return {begin, end - begin};
}

int64_t ChunkSizeOf(int64_t n, int64_t chunks) { return chunks <= 0 ? 0 : (n + chunks - 1) / chunks; }

ChunkRange ParentRangeOf(IntSpan global_shape, IntSpan mesh_shape, const Layout& layout, IntSpan coord, int mesh_dim) {
  const int64_t d = layout[mesh_dim].shard_dim();
  ChunkRange range{0, global_shape[static_cast<size_t>(d)]};
  for (int m : layout.ShardMeshDims(d)) {
    if (m == mesh_dim) break;
    const ChunkRange r = ChunkOf(range.size, mesh_shape[static_cast<size_t>(m)], coord[static_cast<size_t>(m)]);
    range = {range.offset + r.offset, r.size};
  }
  return range;
}

LocalBox LocalBoxOf(IntSpan global_shape, IntSpan mesh_shape, const Layout& layout, IntSpan coord) {
  LocalBox box;
  box.offset.assign(global_shape.size(), 0);
  box.shape.assign(global_shape.begin(), global_shape.end());
  for (size_t d = 0; d < global_shape.size(); ++d) {
    for (int m : layout.ShardMeshDims(static_cast<int64_t>(d))) {
      const ChunkRange r = ChunkOf(box.shape[d], mesh_shape[static_cast<size_t>(m)], coord[static_cast<size_t>(m)]);
      box.offset[d] += r.offset;
      box.shape[d] = r.size;
    }
  }
  return box;
}

absl::StatusOr<LocalBox> CheckedLocalBoxOf(IntSpan global_shape, IntSpan mesh_shape, const Layout& layout,
                                           IntSpan coord) {
  DT_ASSIGN_OR_RETURN(Layout l, NormalizeLayout("LocalBox", layout, static_cast<int64_t>(global_shape.size()),
                                                static_cast<int>(mesh_shape.size())));
  if (coord.size() != mesh_shape.size()) {
    return InvalidArg("LocalBox", "coordinate ", ShapeString(coord), " for mesh ", ShapeString(mesh_shape));
  }
  for (size_t m = 0; m < coord.size(); ++m) {
    if (coord[m] < 0 || coord[m] >= mesh_shape[m]) {
      return InvalidArg("LocalBox", "coordinate ", ShapeString(coord), " outside mesh ", ShapeString(mesh_shape));
    }
  }
  for (int64_t n : global_shape) {
    if (n < 0) return InvalidArg("LocalBox", "negative size in global shape ", ShapeString(global_shape));
  }
  return LocalBoxOf(global_shape, mesh_shape, l, coord);
}

}  // namespace dtensor
