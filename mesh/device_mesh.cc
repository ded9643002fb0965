#include "dtensor/mesh/device_mesh.h"

#include <algorithm>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "dtensor/collectives/agree.h"
#include "dtensor/tensor/status.h"

namespace dtensor {
namespace {

// Linear (row-major) index of `coord` restricted to the root dims in `mask`.
int64_t LinearIndex(IntSpan shape, IntSpan coord, uint32_t mask) {
  int64_t index = 0;
  for (size_t d = 0; d < shape.size(); ++d) {
    if (mask & (1u << d)) index = index * shape[d] + coord[d];
  }
  return index;
}

// The ranks must ask for one mesh: ranks that split by different shapes or names would get
// groups that do not match their meshes (a rank of a [2, 3] mesh in a group of 3 for its
// first dim) and fail, or compute wrongly, later. One all_gather of a fixed record per rank
// (ndim, the sizes, a hash of the names); only when they differ, a second one of each rank's
// mesh in words for the message. Every rank gets the same InvalidArgument.
absl::Status AgreeOnMesh(Communicator& world, IntSpan shape, const std::vector<std::string>& names) {
  if (world.size() == 1) return absl::OkStatus();
  constexpr int kRecord = 2 + kMaxMeshDims;
  std::vector<int64_t> record(kRecord, 0);
  record[0] = static_cast<int64_t>(shape.size());
  for (size_t d = 0; d < shape.size(); ++d) record[1 + d] = shape[d];
  uint64_t hash = 14695981039346656037ull;  // FNV-1a over the names, each ended by a 0 byte
  for (const std::string& n : names) {
    for (const char c : n + '\0') hash = (hash ^ static_cast<unsigned char>(c)) * 1099511628211ull;
  }
  record[kRecord - 1] = static_cast<int64_t>(hash);
  absl::StatusOr<std::vector<int64_t>> all = AllGatherInts(world, record);
  if (!all.ok()) {
    return absl::Status(all.status().code(), absl::StrCat("[DeviceMesh] agreeing on the mesh ", ShapeString(shape),
                                                          " with the other ranks: ", all.status().message()));
  }
  const int64_t* rec = all->data();
  std::vector<int> differ;
  for (int r = 1; r < world.size(); ++r) {
    if (!std::equal(rec, rec + kRecord, rec + static_cast<ptrdiff_t>(r) * kRecord)) differ.push_back(r);
  }
  if (differ.empty()) return absl::OkStatus();
  DT_ASSIGN_OR_RETURN(std::vector<std::string> meshes,
                      AllGatherText(world, absl::StrCat(ShapeString(shape), " (", absl::StrJoin(names, ", "), ")")));
  return InvalidArg("DeviceMesh", "the ranks ask for different meshes: rank 0 for ", meshes[0], ", rank ", differ[0],
                    " for ", meshes[static_cast<size_t>(differ[0])], " (rank(s) ", absl::StrJoin(differ, ", "),
                    " differ from rank 0)");
}

}  // namespace

Shape UnravelIndex(IntSpan shape, int64_t linear) {
  Shape coord(shape.size());
  for (size_t d = shape.size(); d-- > 0;) {
    coord[d] = linear % shape[d];
    linear /= shape[d];
  }
  return coord;
}

absl::StatusOr<DeviceMesh> DeviceMesh::Create(Communicator& world, IntSpan shape) {
  std::vector<std::string> names;
  for (size_t d = 0; d < shape.size(); ++d) names.push_back(absl::StrCat("d", d));
  return Create(world, shape, std::move(names));
}

absl::StatusOr<DeviceMesh> DeviceMesh::Create(Communicator& world, IntSpan shape, std::vector<std::string> names) {
  const char* op = "DeviceMesh";
  if (shape.empty() || shape.size() > static_cast<size_t>(kMaxMeshDims)) {
    return InvalidArg(op, "mesh shape ", ShapeString(shape), " has ", shape.size(), " dims; 1 to ", kMaxMeshDims,
                      " are supported");
  }
  for (int64_t s : shape) {
    if (s <= 0) return InvalidArg(op, "mesh shape ", ShapeString(shape), " has a non-positive size");
    // (Also keeps the product below from overflowing: at most 4 dims of at most 2^31.)
    if (s > world.size()) {
      return InvalidArg(op, "mesh shape ", ShapeString(shape), " has a dim of ", s,
                        " ranks, more than the communicator's ", world.size());
    }
  }
  if (NumElements(shape) != world.size()) {
    return InvalidArg(op, "mesh shape ", ShapeString(shape), " holds ", NumElements(shape),
                      " ranks but the communicator has ", world.size());
  }
  if (names.size() != shape.size()) {
    return InvalidArg(op, names.size(), " dim names [", absl::StrJoin(names, ", "), "] for mesh shape ",
                      ShapeString(shape));
  }
  absl::flat_hash_set<std::string> seen;
  for (const std::string& n : names) {
    if (n.empty()) return InvalidArg(op, "empty dim name in [", absl::StrJoin(names, ", "), "]");
    if (!seen.insert(n).second) {
      return InvalidArg(op, "duplicate dim name \"", n, "\" in [", absl::StrJoin(names, ", "), "]");
    }
  }
  DT_RETURN_IF_ERROR(AgreeOnMesh(world, shape, names));
  auto root = std::make_shared<internal::MeshRoot>();
  root->world = &world;
  root->shape.assign(shape.begin(), shape.end());
  root->coord = UnravelIndex(shape, world.rank());
  const uint32_t full = (1u << shape.size()) - 1;
  root->groups.resize(full + 1);
  // One group per proper non-empty set of dims: ranks that agree on the other dims.
  for (uint32_t mask = 1; mask < full; ++mask) {
    const int color = static_cast<int>(LinearIndex(root->shape, root->coord, full & ~mask));
    const int key = static_cast<int>(LinearIndex(root->shape, root->coord, mask));
    DT_ASSIGN_OR_RETURN(root->groups[mask], world.Split(color, key));
  }
  View v;
  for (size_t d = 0; d < shape.size(); ++d) v.dims.push_back({static_cast<int>(d)});
  v.names = std::move(names);
  v.shape = root->shape;
  v.coord = root->coord;
  v.root = std::move(root);
  return DeviceMesh(std::move(v));
}

absl::StatusOr<int> DeviceMesh::DimIndex(const std::string& name) const {
  for (size_t d = 0; d < v_->names.size(); ++d) {
    if (v_->names[d] == name) return static_cast<int>(d);
  }
  return InvalidArg("DeviceMesh", "no dim named \"", name, "\" in ", ToString());
}

int DeviceMesh::world_rank() const { return v_->root->world->rank(); }

Communicator& DeviceMesh::world() const { return *v_->root->world; }

std::vector<int> DeviceMesh::ranks() const {
  uint32_t mask = 0;
  for (const auto& rd : v_->dims) {
    for (int d : rd) mask |= 1u << d;
  }
  std::vector<int> out;
  const IntSpan rshape = v_->root->shape;
  Shape c(v_->root->coord.begin(), v_->root->coord.end());
  const int64_t n = size();
  for (int64_t i = 0; i < n; ++i) {
    // Row-major over the covered root dims (ascending), the others fixed at this rank's.
    int64_t rest = i;
    for (size_t d = rshape.size(); d-- > 0;) {
      if (!(mask & (1u << d))) continue;
      c[d] = rest % rshape[d];
      rest /= rshape[d];
    }
    out.push_back(static_cast<int>(LinearIndex(rshape, c, (1u << rshape.size()) - 1)));
  }
  return out;
}

Communicator& DeviceMesh::comm(int dim) const {
  uint32_t mask = 0;
  for (int d : v_->dims[static_cast<size_t>(dim)]) mask |= 1u << d;
  const uint32_t full = (1u << v_->root->shape.size()) - 1;
  return mask == full ? *v_->root->world : *v_->root->groups[mask];
}

absl::StatusOr<Communicator*> DeviceMesh::comm(absl::Span<const int> dims) const {
  uint32_t mask = 0;
  uint32_t seen = 0;
  for (int dim : dims) {
    if (dim < 0 || dim >= ndim() || (seen & (1u << dim))) {
      return InvalidArg("DeviceMesh", "bad dim list {", absl::StrJoin(dims, ","), "} for ", ToString());
    }
    seen |= 1u << dim;
    for (int d : v_->dims[static_cast<size_t>(dim)]) mask |= 1u << d;
  }
  if (mask == 0) return InvalidArg("DeviceMesh", "empty dim list for ", ToString());
  const uint32_t full = (1u << v_->root->shape.size()) - 1;
  return mask == full ? v_->root->world : v_->root->groups[mask].get();
}

absl::StatusOr<DeviceMesh> DeviceMesh::Sub(const std::string& name) const {
  return Sub(absl::Span<const std::string>(&name, 1));
}

absl::StatusOr<DeviceMesh> DeviceMesh::Sub(absl::Span<const std::string> names) const {
  if (names.empty()) return InvalidArg("DeviceMesh", "Sub needs at least one dim name, for ", ToString());
  View out;
  out.root = v_->root;
  int last = -1;
  for (const std::string& n : names) {
    DT_ASSIGN_OR_RETURN(int d, DimIndex(n));
    if (d <= last) {
      return InvalidArg("DeviceMesh", "sub-mesh dims [", absl::StrJoin(names, ", "),
                        "] must be distinct and in mesh order, for ", ToString());
    }
    last = d;
    out.dims.push_back(v_->dims[static_cast<size_t>(d)]);
    out.names.push_back(n);
    out.shape.push_back(v_->shape[static_cast<size_t>(d)]);
    out.coord.push_back(v_->coord[static_cast<size_t>(d)]);
  }
  return DeviceMesh(std::move(out));
}

absl::StatusOr<DeviceMesh> DeviceMesh::Flatten(const std::string& first, const std::string& last,
                                               std::string new_name) const {
  DT_ASSIGN_OR_RETURN(int a, DimIndex(first));
  DT_ASSIGN_OR_RETURN(int b, DimIndex(last));
  if (b < a) {
    return InvalidArg("DeviceMesh", "cannot flatten \"", first, "\"..\"", last, "\": \"", last, "\" comes before \"",
                      first, "\" in ", ToString());
  }
  if (new_name.empty()) return InvalidArg("DeviceMesh", "empty name for the flattened dim of ", ToString());
  for (int d = 0; d < ndim(); ++d) {
    if ((d < a || d > b) && v_->names[static_cast<size_t>(d)] == new_name) {
      return InvalidArg("DeviceMesh", "flattened dim name \"", new_name, "\" is already a dim of ", ToString());
    }
  }
  // Adjacent in this mesh is not enough: the root dims must be contiguous too (a view that
  // skipped a dim in between cannot merge across the gap).
  for (int d = a; d < b; ++d) {
    if (v_->dims[static_cast<size_t>(d)].back() + 1 != v_->dims[static_cast<size_t>(d) + 1].front()) {
      return InvalidArg("DeviceMesh", "dims \"", v_->names[static_cast<size_t>(d)], "\" and \"",
                        v_->names[static_cast<size_t>(d) + 1], "\" of ", ToString(),
                        " are not adjacent in the mesh they were taken from");
    }
  }
  View out;
  out.root = v_->root;
  for (int d = 0; d < ndim(); ++d) {
    const size_t i = static_cast<size_t>(d);
    if (d > a && d <= b) {
      out.dims.back().insert(out.dims.back().end(), v_->dims[i].begin(), v_->dims[i].end());
      out.coord.back() = out.coord.back() * v_->shape[i] + v_->coord[i];
      out.shape.back() *= v_->shape[i];
      continue;
    }
    out.dims.push_back(v_->dims[i]);
    out.names.push_back(d == a ? new_name : v_->names[i]);
    out.shape.push_back(v_->shape[i]);
    out.coord.push_back(v_->coord[i]);
  }
  return DeviceMesh(std::move(out));
}

bool DeviceMesh::SameAs(const DeviceMesh& other) const {
  if (v_ == nullptr || other.v_ == nullptr) return false;
  if (v_ == other.v_) return true;
  return v_->root->world == other.v_->root->world && v_->shape == other.v_->shape && ranks() == other.ranks();
}

absl::StatusOr<std::vector<int>> DeviceMesh::DimsOf(const DeviceMesh& part) const {
  if (v_ == nullptr || part.v_ == nullptr || v_->root != part.v_->root) {
    return InvalidArg("DeviceMesh", part.ToString(), " is not a view of the same mesh as ", ToString());
  }
  std::vector<int> out;
  for (size_t i = 0; i < part.v_->dims.size(); ++i) {
    int found = -1;
    for (size_t j = 0; j < v_->dims.size(); ++j) {
      if (v_->dims[j] == part.v_->dims[i]) found = static_cast<int>(j);
    }
    if (found < 0) {
      return InvalidArg("DeviceMesh", "dim ", part.v_->names[i], " of ", part.ToString(), " is no dim of ", ToString());
    }
    out.push_back(found);
  }
  return out;
}

std::string DeviceMesh::ToString() const {
  if (v_ == nullptr) return "DeviceMesh()";
  std::vector<std::string> parts;
  for (size_t d = 0; d < v_->names.size(); ++d) parts.push_back(absl::StrCat(v_->names[d], "=", v_->shape[d]));
  return absl::StrCat("DeviceMesh(", absl::StrJoin(parts, ", "), ")");
}

}  // namespace dtensor
