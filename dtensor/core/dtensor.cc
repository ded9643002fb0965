#include "dtensor/core/dtensor.h"

#include <algorithm>
#include <map>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "dtensor/collectives/agree.h"
#include "dtensor/core/executor.h"
#include "dtensor/ops/ops.h"
#include "dtensor/tensor/status.h"

namespace dtensor {
namespace {

using internal::CoreStateOf;

std::vector<int> AllDims(const DeviceMesh& mesh) {
  std::vector<int> dims(static_cast<size_t>(mesh.ndim()));
  for (int d = 0; d < mesh.ndim(); ++d) dims[static_cast<size_t>(d)] = d;
  return dims;
}

Layout AllReplicate(int ndim) { return Layout(Placements(static_cast<size_t>(ndim), Replicate())); }

// The layout with every Partial placement replaced by Replicate.
Layout WithoutPartial(const Layout& l) {
  Layout out = l;
  for (int m = 0; m < l.ndim(); ++m) {
    if (l[m].is_partial()) out = out.WithPlacement(m, Replicate());
  }
  return out;
}

// Whether this rank is at coordinate 0 of every mesh dim that is P(sum) in `l` (where R -> P
// keeps a value it does not divide).
bool FirstOnSumPartialDims(const Layout& l, const DeviceMesh& mesh) {
  for (int m = 0; m < l.ndim(); ++m) {
    if (l[m].is_partial() && l[m].partial_op() == PartialOp::kSum && mesh.coordinate()[static_cast<size_t>(m)] != 0) {
      return false;
    }
  }
  return true;
}

// Product of the sizes of the mesh dims that are P(sum) in `l` (what R -> P divides by).
int64_t SumPartialDivisor(const Layout& l, const DeviceMesh& mesh) {
  int64_t divisor = 1;
  for (int m = 0; m < l.ndim(); ++m) {
    if (l[m].is_partial() && l[m].partial_op() == PartialOp::kSum) divisor *= mesh.size(m);
  }
  return divisor;
}

// `s` failed this rank's checks of its own data (its piece's device or shape: what differs by
// rank) in a call whose collectives its peers, whose checks passed, are about to enter or
// already wait in: ranks fail together (Communicator::Abort), so the peers return an error
// naming this rank at once instead of waiting for the timeout. (Checks of layouts and shapes
// that every rank passes alike fail alike on every rank: nobody waits, nothing is aborted.)
// A rank alone has nobody to tell.
absl::Status FailTogether(const DeviceMesh& mesh, absl::Status s) {
  if (!s.ok() && mesh.defined() && mesh.world().size() > 1) mesh.world().Abort(s);
  return s;
}

absl::Status CheckDevice(const char* op, const Tensor& t, const DeviceMesh& mesh) {
  if (!mesh.defined()) return InvalidArg(op, "undefined (default-constructed) mesh");
  if (!t.defined()) return InvalidArg(op, "undefined tensor");
  if (t.device() != mesh.device()) {
    return InvalidArg(op, "tensor on ", t.device().ToString(), " but ", mesh.ToString(), " moves tensors on ",
                      mesh.device().ToString());
  }
  return absl::OkStatus();
}

}  // namespace

// ---- Construction ----

namespace {

// FromLocal's checks of this rank's own arguments; `global` gets the global shape (from the
// options, else from the local shape as if the shards were even). *own_data: whether the
// failure lies in this rank's piece (its device, its number of dims), which its peers may not
// share, rather than in arguments every rank passes alike (the layout against the mesh and
// the given global shape).
absl::Status CheckLocal(const char* op, const Tensor& local, const DeviceMesh& mesh, const Layout& layout,
                        const DTensor::FromLocalOptions& options, Layout* l, Shape* global, bool* own_data) {
  *own_data = true;
  DT_RETURN_IF_ERROR(CheckDevice(op, local, mesh));
  if (options.global_shape) {
    *global = *options.global_shape;
    *own_data = false;
    DT_ASSIGN_OR_RETURN(*l, NormalizeLayout(op, layout, static_cast<int64_t>(global->size()), mesh.ndim()));
    for (int64_t n : *global) {
      if (n < 0) return InvalidArg(op, "negative size in global shape ", ShapeString(*global));
    }
    *own_data = true;
    if (static_cast<int64_t>(global->size()) != local.dim()) {
      return InvalidArg(op, "global shape ", ShapeString(*global), " and local shape ", ShapeString(local.shape()),
                        " have different ranks");
    }
  } else {
    // What fails for any number of dims (the placement count, mixed Partial ops) fails alike:
    // checked first against a tensor with every shard dim in range.
    int64_t any_dims = 1;
    for (const Placement& p : layout.placements()) {
      if (p.is_shard()) any_dims = std::max(any_dims, p.shard_dim() < 0 ? -p.shard_dim() : p.shard_dim() + 1);
    }
    *own_data = false;
    DT_RETURN_IF_ERROR(NormalizeLayout(op, layout, any_dims, mesh.ndim()).status());
    *own_data = true;
    DT_ASSIGN_OR_RETURN(*l, NormalizeLayout(op, layout, local.dim(), mesh.ndim()));
    global->assign(local.shape().begin(), local.shape().end());
    for (int m = 0; m < mesh.ndim(); ++m) {
      if ((*l)[m].is_shard()) (*global)[static_cast<size_t>((*l)[m].shard_dim())] *= mesh.size(m);
    }
  }
  return absl::OkStatus();
}

// All-gathers `mine` (the same count on every rank) over the whole mesh, on the mesh's device
// (NCCL moves device tensors only); the result on the host.
absl::StatusOr<std::vector<int64_t>> GatherInts(const DeviceMesh& mesh, const std::vector<int64_t>& mine) {
  DT_ASSIGN_OR_RETURN(Communicator * comm, mesh.comm(AllDims(mesh)));
  if (CommCounter* c = CoreStateOf(mesh).counter) {
    c->Record(CommKind::kAllGather, mesh.size() * static_cast<int64_t>(mine.size() * sizeof(int64_t)));
  }
  return AllGatherInts(*comm, mine);
}

// Distribute from a source: every rank's tensor must have the source's shape and dtype, or
// the ranks would size the broadcast or scatter differently (the source returning OK, the
// others failing or waiting). One small all-gather of a fixed header (dims, dtype, sizes padded
// to kMaxDims); every rank reaches the same verdict from the same gathered values.
absl::Status AgreeWithSource(const char* op, const Tensor& global, const DeviceMesh& mesh, int src) {
  constexpr int64_t kHead = 2 + kMaxDims;
  std::vector<int64_t> mine(kHead, -1);
  mine[0] = global.dim();
  mine[1] = static_cast<int64_t>(global.dtype());
  std::copy(global.shape().begin(), global.shape().end(), mine.begin() + 2);
  DT_ASSIGN_OR_RETURN(const std::vector<int64_t> all, GatherInts(mesh, mine));
  const auto shape_of = [&](int64_t r) {
    const int64_t* h = all.data() + kHead * r;
    return Shape(h + 2, h + 2 + std::clamp<int64_t>(h[0], 0, kMaxDims));
  };
  const int64_t* s = all.data() + kHead * src;
  for (int64_t r = 0; r < mesh.size(); ++r) {
    const int64_t* h = all.data() + kHead * r;
    if (h[0] != s[0] || h[1] != s[1]) {
      return InvalidArg(op, "mesh rank ", r, " passes a ", h[0], "-d ", DTypeName(static_cast<DType>(h[1])),
                        " tensor but the source, mesh rank ", src, ", a ", s[0], "-d ",
                        DTypeName(static_cast<DType>(s[1])), " one");
    }
    if (shape_of(r) != shape_of(src)) {
      return InvalidArg(op, "mesh rank ", r, " passes a tensor of shape ", ShapeString(shape_of(r)),
                        " but the source, mesh rank ", src, ", one of shape ", ShapeString(shape_of(src)),
                        " (every rank passes the global shape)");
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<DTensor> DTensor::FromLocal(Tensor local, const DeviceMesh& mesh, const Layout& layout,
                                           const FromLocalOptions& options) {
  const char* op = "FromLocal";
  Layout l;
  Shape global;
  bool own_data = false;
  const absl::Status checked = CheckLocal(op, local, mesh, layout, options, &l, &global, &own_data);
  if (!checked.ok() && (!options.run_check || !mesh.defined())) {
    // Without run_check this rank's error reaches the peers only through an abort. (Without a
    // global shape the layout is checked against the piece's dims: a rank whose piece has a
    // dim fewer fails alone, so that too is this rank's own.)
    return own_data ? FailTogether(mesh, checked) : checked;
  }
  if (options.run_check) {
    // First a fixed-size header from every rank (its own checks passed, dims, dtype), so that
    // a rank whose arguments are wrong still takes part and every rank gets the same verdict.
    DT_ASSIGN_OR_RETURN(const std::vector<int64_t> head,
                        GatherInts(mesh, {checked.ok() ? 1 : 0, local.defined() ? local.dim() : -1,
                                          local.defined() ? static_cast<int64_t>(local.dtype()) : -1}));
    DT_RETURN_IF_ERROR(checked);
    for (int64_t r = 0; r < mesh.size(); ++r) {
      const int64_t* h = head.data() + 3 * r;
      if (h[0] == 0) return InvalidArg(op, "mesh rank ", r, " passed arguments it rejected (see its error)");
      if (h[1] != local.dim() || h[2] != static_cast<int64_t>(local.dtype())) {
        return InvalidArg(op, "mesh rank ", r, " holds a ", h[1], "-d ", DTypeName(static_cast<DType>(h[2])),
                          " tensor but this rank a ", local.dim(), "-d ", DTypeName(local.dtype()), " one");
      }
    }
  }
  if (options.run_check) {
    // Every rank's shape and dtype, and the global shape it was given (if any), then the same
    // verdict on every rank. Row r: its local shape (nd), its dtype, whether it was given a
    // global shape, that shape (nd).
    const int64_t nd = local.dim();
    const int64_t row = 2 * nd + 2;
    std::vector<int64_t> mine(local.shape().begin(), local.shape().end());
    mine.push_back(static_cast<int64_t>(local.dtype()));
    mine.push_back(options.global_shape ? 1 : 0);
    for (int64_t d = 0; d < nd; ++d) mine.push_back(options.global_shape ? global[static_cast<size_t>(d)] : 0);
    DT_ASSIGN_OR_RETURN(const std::vector<int64_t> all, GatherInts(mesh, mine));
    const int64_t* v = all.data();
    // The ranks must give one global shape, or none (checked against rank 0's, so that every
    // rank finds the same rank first).
    for (int64_t r = 1; r < mesh.size(); ++r) {
      const int64_t* a = v + nd + 1;
      const int64_t* b = v + r * row + nd + 1;
      if (!std::equal(a, a + nd + 1, b)) {
        auto given = [&](const int64_t* g) {
          return g[0] == 0 ? std::string("none") : ShapeString(Shape(g + 1, g + 1 + nd));
        };
        return InvalidArg(op, "mesh rank ", r, " gives global shape ", given(b), " but mesh rank 0 ", given(a),
                          " (every rank passes the same global_shape, or none)");
      }
    }
    if (!options.global_shape) {
      // Along each sharded dim, the pieces of the ranks whose other coordinates are 0 tile it.
      for (int64_t d = 0; d < nd; ++d) {
        const auto sharders = l.ShardMeshDims(d);
        if (sharders.empty()) {
          global[static_cast<size_t>(d)] = v[d];
          continue;
        }
        int64_t total = 0;
        for (int64_t r = 0; r < mesh.size(); ++r) {
          const Shape c = UnravelIndex(mesh.shape(), r);
          bool line = true;
          for (int m = 0; m < mesh.ndim(); ++m) {
            if (std::find(sharders.begin(), sharders.end(), m) == sharders.end() && c[static_cast<size_t>(m)] != 0) {
              line = false;
            }
          }
          if (line) total += v[r * row + d];
        }
        global[static_cast<size_t>(d)] = total;
      }
    }
    for (int64_t r = 0; r < mesh.size(); ++r) {
      const Shape c = UnravelIndex(mesh.shape(), r);
      const LocalBox box = LocalBoxOf(global, mesh.shape(), l, c);
      const Shape got(v + r * row, v + r * row + nd);
      if (got != box.shape || v[r * row + nd] != static_cast<int64_t>(local.dtype())) {
        return InvalidArg(op, "mesh rank ", r, " holds a ", DTypeName(static_cast<DType>(v[r * row + nd])),
                          " tensor of shape ", ShapeString(got), " but ", l.ToString(), " of global shape ",
                          ShapeString(global), " gives it ", ShapeString(box.shape), " (", DTypeName(local.dtype()),
                          " here)");
      }
    }
  }
  const LocalBox box = LocalBoxOf(global, mesh.shape(), l, mesh.coordinate());
  if (box.shape != Shape(local.shape().begin(), local.shape().end())) {
    return FailTogether(
        mesh,
        InvalidArg(op, "local shape ", ShapeString(local.shape()), " is not this rank's piece ", ShapeString(box.shape),
                   " of global shape ", ShapeString(global), " laid out as ", l.ToString(), " on ", mesh.ToString(),
                   options.global_shape ? "" : " (uneven shards: pass global_shape or set run_check)"));
  }
  return DTensor(std::move(local), mesh, std::move(l), std::move(global));
}

absl::StatusOr<DTensor> DTensor::Distribute(const Tensor& global, const DeviceMesh& mesh, const Layout& layout,
                                            const DistributeOptions& options) {
  const char* op = "Distribute";
  DT_RETURN_IF_ERROR(FailTogether(mesh, CheckDevice(op, global, mesh)));
  if (options.src_rank) {
    // First the ranks agree on the tensor's shape: the layout is checked against its dims, so
    // a rank whose tensor has other dims would fail alone (its peers waiting in the agreement).
    const int src = *options.src_rank;
    if (src < 0 || src >= mesh.size()) {
      return InvalidArg(op, "source rank ", src, " is not a rank of ", mesh.ToString(), " (0 to ", mesh.size() - 1,
                        ")");
    }
    DT_RETURN_IF_ERROR(AgreeWithSource(op, global, mesh, src));
  }
  DT_ASSIGN_OR_RETURN(Layout l, NormalizeLayout(op, layout, global.dim(), mesh.ndim()));
  const Layout base = WithoutPartial(l);
  const Shape shape(global.shape().begin(), global.shape().end());
  const LocalBox whole{Shape(shape.size(), 0), shape};
  const LocalBox mine = LocalBoxOf(shape, mesh.shape(), base, mesh.coordinate());
  Tensor local;
  if (!options.src_rank) {
    DT_ASSIGN_OR_RETURN(Tensor piece, internal::RegionOf(global, whole, mine));
    DT_ASSIGN_OR_RETURN(local, Clone(piece));
  } else {
    const int src = *options.src_rank;  // agreed above
    DT_ASSIGN_OR_RETURN(Communicator * comm, mesh.comm(AllDims(mesh)));
    CommCounter* counter = CoreStateOf(mesh).counter;
    if (base.is_replicated()) {
      if (comm->rank() == src) {
        DT_ASSIGN_OR_RETURN(local, Clone(global));
      } else {
        DT_ASSIGN_OR_RETURN(local, Tensor::Empty(shape, global.dtype(), global.device()));
      }
      if (counter != nullptr) counter->Record(CommKind::kBroadcast, static_cast<int64_t>(local.nbytes()));
      DT_RETURN_IF_ERROR(comm->Broadcast(local, src));
    } else {
      // A scatter: only the source sends, each rank receives its own piece.
      std::vector<LocalBox> send(static_cast<size_t>(comm->size()), LocalBox{mine.offset, Shape(shape.size(), 0)});
      std::vector<LocalBox> recv = send;
      if (comm->rank() == src) {
        for (int j = 0; j < comm->size(); ++j) {
          send[static_cast<size_t>(j)] = LocalBoxOf(shape, mesh.shape(), base, UnravelIndex(mesh.shape(), j));
        }
      }
      recv[static_cast<size_t>(src)] = mine;
      DT_ASSIGN_OR_RETURN(local, internal::TransferBoxes(*comm, global, whole, send, mine, recv,
                                                         internal::TransferKind::kBlocks, counter));
    }
  }
  const int64_t divisor = SumPartialDivisor(l, mesh);
  if (divisor > 1) {
    DT_ASSIGN_OR_RETURN(local, internal::DivideForPartial(local, divisor, FirstOnSumPartialDims(l, mesh)));
  }
  return DTensor(std::move(local), mesh, std::move(l), shape);
}

LocalBox DTensor::local_box() const {
  if (!defined() || !mesh_.defined()) return LocalBox{};  // an undefined DTensor holds no box
  return LocalBoxOf(global_shape_, mesh_.shape(), layout_, mesh_.coordinate());
}

// ---- Redistribution ----

absl::StatusOr<DTensor> DTensor::Redistribute(const Layout& layout) const {
  if (!defined()) return InvalidArg("Redistribute", "undefined DTensor");
  // The cache's own pointer: nothing below plans on this mesh.
  DT_ASSIGN_OR_RETURN(const std::shared_ptr<const RedistributePlan>* plan,
                      PlannerOf(mesh_).PlanRef(global_shape_, mesh_.shape(), layout_, layout,
                                               static_cast<int64_t>(ElementSize(dtype()))));
  DT_ASSIGN_OR_RETURN(Tensor local, internal::ExecuteSteps(*plan, 0, local_, mesh_));
  return DTensor(std::move(local), mesh_, (*plan)->dst, global_shape_);
}

struct PendingDTensor::State {
  std::shared_ptr<const RedistributePlan> plan;
  std::shared_ptr<const internal::PlanGeometry> geometry;  // the started step's finisher refers to it
  DeviceMesh mesh;
  size_t next = 0;  // first step not started
  internal::StartedStep started;
  Tensor local;  // the input of the started step (kept alive), or the result so far
  bool waited = false;
};

PendingDTensor::PendingDTensor(PendingDTensor&&) noexcept = default;

PendingDTensor& PendingDTensor::operator=(PendingDTensor&& other) noexcept {
  if (this != &other) {
    PendingDTensor dropped(std::move(*this));  // its destructor finishes a collective in flight
    state_ = std::move(other.state_);
  }
  return *this;
}

PendingDTensor::~PendingDTensor() {
  // A collective in flight reads and writes buffers this state owns: finish it first.
  if (state_ != nullptr && state_->started.work != nullptr && !state_->waited) (void)state_->started.work->Wait();
}

absl::StatusOr<PendingDTensor> DTensor::RedistributeAsync(const Layout& layout) const {
  if (!defined()) return InvalidArg("Redistribute", "undefined DTensor");
  auto state = std::make_unique<PendingDTensor::State>();
  DT_ASSIGN_OR_RETURN(state->plan, PlannerOf(mesh_).Plan(global_shape_, mesh_.shape(), layout_, layout,
                                                         static_cast<int64_t>(ElementSize(dtype()))));
  state->mesh = mesh_;
  state->local = local_;
  // Local steps up to the first collective run now; the collective is started.
  const RedistributePlan& plan = *state->plan;
  state->geometry = internal::GeometryOf(state->plan, mesh_);
  while (state->next < plan.steps.size()) {
    DT_ASSIGN_OR_RETURN(
        internal::StartedStep s,
        internal::StartStep(plan.steps[state->next], state->geometry->steps[state->next], state->local, mesh_));
    ++state->next;
    if (s.work != nullptr) {
      state->started = std::move(s);
      break;
    }
    DT_ASSIGN_OR_RETURN(state->local, s.Finish());
  }
  PendingDTensor pending;
  pending.state_ = std::move(state);
  return pending;
}

bool PendingDTensor::IsCompleted() {
  return state_ == nullptr || state_->started.work == nullptr || state_->started.work->IsCompleted();
}

absl::StatusOr<DTensor> PendingDTensor::Wait() {
  if (state_ == nullptr || state_->waited) return absl::FailedPreconditionError("[Redistribute] Wait called twice");
  State& s = *state_;
  s.waited = true;
  if (s.started.work != nullptr) {
    DT_RETURN_IF_ERROR(s.started.work->Wait());
    DT_ASSIGN_OR_RETURN(s.local, s.started.Finish());
  }
  DT_ASSIGN_OR_RETURN(Tensor local, internal::ExecuteSteps(s.plan, s.next, s.local, s.mesh));
  return DTensor(std::move(local), s.mesh, s.plan->dst, s.plan->global_shape);
}

absl::StatusOr<DTensor> DTensor::Redistribute(const DeviceMesh& mesh, const Layout& layout) const {
  const char* op = "Redistribute";
  if (!defined()) return InvalidArg(op, "undefined DTensor");
  if (!mesh.defined()) return InvalidArg(op, "undefined (default-constructed) target mesh");
  // The same ranks in the same shape (another mesh object, perhaps other dim names): the
  // coordinates and so the local boxes agree; the plan runs on the target mesh (its names, its
  // plan cache and its comm counter).
  if (mesh.SameAs(mesh_)) return DTensor(local_, mesh, layout_, global_shape_).Redistribute(layout);
  // The two meshes must hold the same ranks (of one world): the exchange runs on the source
  // mesh's group over all its dims, whose rank i is mesh_.ranks()[i] (the world itself when
  // the mesh spans it). ranks() of every mesh view is ascending, so meshes over the same ranks
  // list them alike, and position i is the same rank in both.
  const std::vector<int> src_ranks = mesh_.ranks();
  const std::vector<int> dst_ranks = mesh.ranks();
  if (&mesh.world() != &mesh_.world() || src_ranks != dst_ranks) {
    return InvalidArg(op, "from ", mesh_.ToString(), " to ", mesh.ToString(),
                      ": cross-mesh redistribution needs two meshes over the same ranks of one communicator (ranks {",
                      absl::StrJoin(src_ranks, ","), "} and {", absl::StrJoin(dst_ranks, ","), "}",
                      &mesh.world() != &mesh_.world() ? ", different communicators" : "", ")");
  }
  std::vector<int> all_dims(static_cast<size_t>(mesh_.ndim()));
  std::iota(all_dims.begin(), all_dims.end(), 0);
  DT_ASSIGN_OR_RETURN(Communicator * group, mesh_.comm(all_dims));
  DT_ASSIGN_OR_RETURN(Layout target, NormalizeLayout(op, layout, dim(), mesh.ndim()));
  // 1. Reduce Partial values on the source mesh.
  DTensor x = *this;
  if (layout_.has_partial()) {
    DT_ASSIGN_OR_RETURN(x, Redistribute(WithoutPartial(layout_)));
  }
  // 2. One all_to_all over the group: rank v receives its new box from itself if it already
  // holds it, else from the ranks of one replica of the source (each element once).
  const Layout target_base = WithoutPartial(target);
  const int n = group->size();
  std::vector<LocalBox> before(static_cast<size_t>(n)), after(static_cast<size_t>(n));
  std::vector<bool> tiling(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) {
    const Shape c = UnravelIndex(mesh_.shape(), i);
    const size_t w = static_cast<size_t>(i);
    before[w] = LocalBoxOf(global_shape_, mesh_.shape(), x.layout_, c);
    bool first_replica = true;
    for (int m = 0; m < mesh_.ndim(); ++m) first_replica &= x.layout_[m].is_shard() || c[static_cast<size_t>(m)] == 0;
    tiling[w] = first_replica;
    after[w] = LocalBoxOf(global_shape_, mesh.shape(), target_base, UnravelIndex(mesh.shape(), i));
  }
  auto contains = [](const LocalBox& outer, const LocalBox& inner) { return Intersect(outer, inner) == inner; };
  auto sends = [&](int w, int v) {  // what group rank w sends to group rank v
    const size_t sw = static_cast<size_t>(w), sv = static_cast<size_t>(v);
    const bool from_self = contains(before[sv], after[sv]);
    if (from_self ? w != v : !tiling[sw]) return LocalBox{after[sv].offset, Shape(after[sv].shape.size(), 0)};
    return Intersect(before[sw], after[sv]);
  };
  bool all_local = true;
  for (int v = 0; v < n; ++v) all_local &= contains(before[static_cast<size_t>(v)], after[static_cast<size_t>(v)]);
  const int me = group->rank();
  Tensor local;
  if (all_local) {
    DT_ASSIGN_OR_RETURN(Tensor piece,
                        internal::RegionOf(x.local_, before[static_cast<size_t>(me)], after[static_cast<size_t>(me)]));
    DT_ASSIGN_OR_RETURN(local, Clone(piece));
  } else {
    std::vector<LocalBox> send(static_cast<size_t>(n)), recv(static_cast<size_t>(n));
    for (int j = 0; j < n; ++j) {
      send[static_cast<size_t>(j)] = sends(me, j);
      recv[static_cast<size_t>(j)] = sends(j, me);
    }
    DT_ASSIGN_OR_RETURN(Tensor input, Contiguous(x.local_));
    DT_ASSIGN_OR_RETURN(local, internal::TransferBoxes(*group, input, before[static_cast<size_t>(me)], send,
                                                       after[static_cast<size_t>(me)], recv,
                                                       internal::TransferKind::kBlocks, CoreStateOf(mesh_).counter));
  }
  // 3. Partial placements of the target, locally.
  const int64_t divisor = SumPartialDivisor(target, mesh);
  if (divisor > 1) {
    DT_ASSIGN_OR_RETURN(local, internal::DivideForPartial(local, divisor, FirstOnSumPartialDims(target, mesh)));
  }
  return DTensor(std::move(local), mesh, std::move(target), global_shape_);
}

absl::StatusOr<Tensor> DTensor::FullTensor() const {
  if (!defined()) return InvalidArg("FullTensor", "undefined DTensor");
  DT_ASSIGN_OR_RETURN(DTensor full, Redistribute(AllReplicate(mesh_.ndim())));
  return full.local_;
}

std::string DTensor::ToString() const {
  if (!defined()) return "DTensor(undefined)";
  return absl::StrCat("DTensor(shape=", ShapeString(global_shape_), ", dtype=", DTypeName(dtype()),
                      ", mesh=", mesh_.ToString(), ", placements=", layout_.ToString(),
                      ", local=", ShapeString(local_.shape()), ")");
}

// ---- Mesh-attached state and debugging ----

void SetCommCounter(const DeviceMesh& mesh, CommCounter* counter) { CoreStateOf(mesh).counter = counter; }
CommCounter* CommCounterOf(const DeviceMesh& mesh) { return CoreStateOf(mesh).counter; }

RedistributePlanner& PlannerOf(const DeviceMesh& mesh) { return CoreStateOf(mesh).planner; }

namespace {

std::string Visualize(IntSpan global_shape, const char* dtype, const DeviceMesh& mesh, const Layout& layout) {
  if (!mesh.defined()) return std::string(InvalidArg("VisualizeSharding", "undefined DeviceMesh").message());
  auto normalized =
      NormalizeLayout("VisualizeSharding", layout, static_cast<int64_t>(global_shape.size()), mesh.ndim());
  if (!normalized.ok()) return std::string(normalized.status().message());
  const Layout& l = *normalized;
  std::string out = absl::StrCat("DTensor ", ShapeString(global_shape), dtype == nullptr ? "" : " ",
                                 dtype == nullptr ? "" : dtype, " on ", mesh.ToString(), " as ", l.ToString());
  // Distinct boxes in order of their offsets, each with the world ranks holding it.
  std::map<std::pair<Shape, Shape>, std::vector<int>> blocks;
  const std::vector<int> ranks = mesh.ranks();
  for (int64_t i = 0; i < mesh.size(); ++i) {
    const LocalBox b = LocalBoxOf(global_shape, mesh.shape(), l, UnravelIndex(mesh.shape(), i));
    blocks[{b.offset, b.shape}].push_back(ranks[static_cast<size_t>(i)]);
  }
  for (const auto& [box, holders] : blocks) {
    std::vector<std::string> ranges;
    for (size_t d = 0; d < box.first.size(); ++d) {
      ranges.push_back(absl::StrCat(box.first[d], ":", box.first[d] + box.second[d]));
    }
    absl::StrAppend(&out, "\n  [", absl::StrJoin(ranges, ", "), "]  rank", holders.size() == 1 ? " " : "s ",
                    absl::StrJoin(holders, ", "));
  }
  if (const auto op = l.partial_op()) absl::StrAppend(&out, "\n  (partial ", PartialOpName(*op), ")");
  return out;
}

}  // namespace

std::string VisualizeSharding(IntSpan global_shape, const DeviceMesh& mesh, const Layout& layout) {
  return Visualize(global_shape, nullptr, mesh, layout);
}

std::string VisualizeSharding(const DTensor& x) {
  if (!x.defined()) return "DTensor(undefined)";
  return Visualize(x.shape(), DTypeName(x.dtype()), x.mesh(), x.layout());
}

}  // namespace dtensor
