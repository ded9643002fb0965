// The executor: runs the steps of a RedistributePlan with the mesh's communicators. Every
// step is box arithmetic — which rank holds which box before and after — and one collective
// whose blocks are those boxes: the V collectives move exactly the elements of uneven shards.
#include <algorithm>
#include <cstring>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "dtensor/core/executor.h"
#include "dtensor/ops/ops.h"
#include "dtensor/tensor/status.h"

namespace dtensor::internal {
namespace {

using Dims = absl::InlinedVector<int, 4>;

Dims Sorted(absl::Span<const int> dims) {
  Dims out(dims.begin(), dims.end());
  std::sort(out.begin(), out.end());
  return out;
}

// True when `parts` (in order, each inside `whole`) are consecutive row-major blocks of a
// contiguous tensor holding `whole`: part j starts at element sum(numel(parts[<j])). Then a
// collective can read or write the whole tensor directly, without packing.
bool ConsecutiveBlocks(const LocalBox& whole, absl::Span<const LocalBox> parts) {
  const size_t nd = whole.shape.size();
  size_t split = nd;
  for (const LocalBox& p : parts) {
    if (p.numel() == 0) continue;
    for (size_t d = 0; d < nd; ++d) {
      if (p.offset[d] != whole.offset[d] || p.shape[d] != whole.shape[d]) {
        if (split != nd && split != d) return false;
        split = d;
      }
    }
  }
  if (split == nd) {  // every non-empty part is the whole box: fine if there is at most one
    return std::count_if(parts.begin(), parts.end(), [](const LocalBox& p) { return p.numel() != 0; }) <= 1;
  }
  for (size_t d = 0; d < split; ++d) {
    if (whole.shape[d] != 1) return false;
  }
  int64_t next = whole.offset[split];
  for (const LocalBox& p : parts) {
    if (p.numel() == 0) continue;
    if (p.offset[split] != next) return false;
    next += p.shape[split];
  }
  return true;
}

using Counts = absl::InlinedVector<int64_t, 8>;
using Boxes = absl::InlinedVector<LocalBox, 8>;

Counts CountsOf(absl::Span<const LocalBox> boxes) {
  Counts counts;
  for (const LocalBox& b : boxes) counts.push_back(b.numel());
  return counts;
}

bool AllEqual(absl::Span<const int64_t> counts) {
  return std::all_of(counts.begin(), counts.end(), [&](int64_t c) { return c == counts[0]; });
}

// The boxes that the members of the group over `group` (ascending dims) containing `coord`
// hold in `layout`, in the group communicator's rank order (as GroupCoords, without the
// vector of coordinates).
Boxes MemberBoxes(IntSpan global_shape, IntSpan mesh_shape, const Layout& layout, IntSpan coord,
                  absl::Span<const int> group) {
  int64_t n = 1;
  for (int m : group) n *= mesh_shape[static_cast<size_t>(m)];
  Boxes out;
  Shape c(coord.begin(), coord.end());
  for (int64_t j = 0; j < n; ++j) {
    int64_t rest = j;
    for (size_t i = group.size(); i-- > 0;) {
      const size_t m = static_cast<size_t>(group[i]);
      c[m] = rest % mesh_shape[m];
      rest /= mesh_shape[m];
    }
    out.push_back(LocalBoxOf(global_shape, mesh_shape, layout, c));
  }
  return out;
}

// Block j of a flat staging tensor, viewed with `shape`.
absl::StatusOr<Tensor> Block(const Tensor& flat, int64_t start, IntSpan shape) {
  DT_ASSIGN_OR_RETURN(Tensor piece, flat.Narrow(0, start, NumElements(shape)));
  return piece.View(shape);
}

void Record(CommKind kind, int64_t bytes, const DeviceMesh& mesh) {
  if (CommCounter* c = CoreStateOf(mesh).counter) c->Record(kind, bytes);
}

StartedStep Done(Tensor t) { return StartedStep{nullptr, nullptr, std::move(t), {}}; }

}  // namespace

CoreState& CoreStateOf(const DeviceMesh& mesh) {
  std::shared_ptr<void>& slot = mesh.root().core_state;
  if (slot == nullptr) slot = std::make_shared<CoreState>();
  return *static_cast<CoreState*>(slot.get());
}

CommReduceOp ToCommReduceOp(PartialOp op) {
  switch (op) {
    case PartialOp::kSum:
      return CommReduceOp::kSum;
    case PartialOp::kAvg:
      return CommReduceOp::kAvg;
    case PartialOp::kMax:
      return CommReduceOp::kMax;
    case PartialOp::kMin:
      return CommReduceOp::kMin;
  }
  return CommReduceOp::kSum;
}

absl::StatusOr<Tensor> RegionOf(const Tensor& t, const LocalBox& t_box, const LocalBox& region) {
  // One view (a Narrow per dim would build a tensor per dim).
  const bool dims_agree = static_cast<int64_t>(region.shape.size()) == t.dim() &&
                          region.offset.size() == region.shape.size() && t_box.shape.size() == region.shape.size() &&
                          t_box.offset.size() == region.shape.size();
  // An empty region is empty wherever it starts (torch.chunk's trailing empty pieces start at
  // the end of the dim, which may lie outside the box).
  if (dims_agree && region.numel() == 0) return t.AsStrided(region.shape, t.strides(), t.storage_offset());
  int64_t offset = t.storage_offset();
  for (size_t d = 0; d < region.shape.size(); ++d) {
    const int64_t start = dims_agree ? region.offset[d] - t_box.offset[d] : -1;
    if (start < 0 || start + region.shape[d] > t_box.shape[d] || t_box.shape[d] != t.size(static_cast<int64_t>(d))) {
      return absl::InternalError(absl::StrCat("[Redistribute] region at ", ShapeString(region.offset), " of shape ",
                                              ShapeString(region.shape), " is outside the box at ",
                                              ShapeString(t_box.offset), " of shape ", ShapeString(t_box.shape),
                                              " (tensor ", ShapeString(t.shape()), ")"));
    }
    offset += start * t.stride(static_cast<int64_t>(d));
  }
  return t.AsStrided(region.shape, t.strides(), offset);
}

std::optional<Slab> SlabOf(const LocalBox& box, const LocalBox& region) {
  const size_t n = box.shape.size();
  if (n == 0 || box.offset.size() != n || region.shape.size() != n || region.offset.size() != n) return std::nullopt;
  if (region.numel() == 0) return Slab{0, 0, 0};
  Slab slab;
  for (size_t d = 0; d < n; ++d) {
    const int64_t start = region.offset[d] - box.offset[d];
    if (start < 0 || start + region.shape[d] > box.shape[d]) return std::nullopt;
    if (region.shape[d] == box.shape[d]) continue;
    if (slab.dim >= 0) return std::nullopt;  // a second narrowed dim
    slab = Slab{static_cast<int64_t>(d), start, region.shape[d]};
  }
  return slab;
}

absl::StatusOr<Tensor> DivideForPartial(const Tensor& x, int64_t divisor, bool first) {
  if (divisor == 1) return Clone(x);
  if (IsComputeFloat(x.dtype())) return BinaryScalar(BinaryOp::kDiv, x, static_cast<double>(divisor));
  if (first) return Clone(x);
  return Zeros(x.shape(), x.dtype(), x.device());
}

namespace {

// Copies region j of `t` (whose box is t_box) into block j of the flat tensor `flat`; the
// blocks follow each other in order, empty regions take no room.
absl::Status Pack(const Tensor& t, const LocalBox& t_box, absl::Span<const LocalBox> regions, const Tensor& flat) {
  int64_t at = 0;
  for (const LocalBox& r : regions) {
    if (r.numel() == 0) continue;
    DT_ASSIGN_OR_RETURN(Tensor src, RegionOf(t, t_box, r));
    DT_ASSIGN_OR_RETURN(Tensor dst, Block(flat, at, r.shape));
    DT_RETURN_IF_ERROR(CopyBlock(dst, src));
    at += r.numel();
  }
  return absl::OkStatus();
}

// The reverse of Pack: block j of `flat` into region j of `t`.
absl::Status Unpack(const Tensor& flat, absl::Span<const LocalBox> regions, const Tensor& t, const LocalBox& t_box) {
  int64_t at = 0;
  for (const LocalBox& r : regions) {
    if (r.numel() == 0) continue;
    DT_ASSIGN_OR_RETURN(Tensor dst, RegionOf(t, t_box, r));
    DT_ASSIGN_OR_RETURN(Tensor src, Block(flat, at, r.shape));
    DT_RETURN_IF_ERROR(CopyBlock(dst, src));
    at += r.numel();
  }
  return absl::OkStatus();
}

// The view of `t` (whose box is t_box) for each region; empty regions give empty tensors.
using Views = absl::InlinedVector<Tensor, 4>;

// Built in place: a view is moved once, into `views` (this runs on every S -> S redistribution).
// `slabs`, when not empty, are the regions as slabs: one Narrow each, the box checked once.
absl::Status RegionViews(const Tensor& t, const LocalBox& t_box, absl::Span<const LocalBox> regions,
                         absl::Span<const Slab> slabs, Views& views) {
  views.reserve(regions.size());
  if (!slabs.empty()) {
    if (slabs.size() != regions.size() || IntSpan(t.shape()) != IntSpan(t_box.shape)) {
      return absl::InternalError(absl::StrCat("[Redistribute] a tensor of shape ", ShapeString(t.shape()),
                                              " for a box of shape ", ShapeString(t_box.shape), " with ", slabs.size(),
                                              " slabs for ", regions.size(), " regions"));
    }
    for (const Slab& s : slabs) {
      if (s.dim < 0) {
        views.push_back(t);
        continue;
      }
      absl::StatusOr<Tensor> v = t.Narrow(s.dim, s.start, s.length);
      if (!v.ok()) return v.status();
      views.push_back(*std::move(v));
    }
    return absl::OkStatus();
  }
  for (const LocalBox& r : regions) {
    absl::StatusOr<Tensor> v = r.numel() == 0 ? t.AsStrided({0}, {1}, t.storage_offset()) : RegionOf(t, t_box, r);
    if (!v.ok()) return v.status();
    views.push_back(*std::move(v));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<Tensor> TransferBoxes(Communicator& comm, const Tensor& local, const LocalBox& local_box,
                                     absl::Span<const LocalBox> send_regions, const LocalBox& out_box,
                                     absl::Span<const LocalBox> recv_regions, TransferKind kind, CommCounter* counter,
                                     absl::Span<const Slab> send_slabs, absl::Span<const Slab> recv_slabs) {
  DT_ASSIGN_OR_RETURN(Tensor out, Tensor::Empty(out_box.shape, local.dtype(), local.device()));
  if (counter != nullptr) {
    int64_t send_total = 0;
    for (const LocalBox& r : send_regions) send_total += r.numel();
    counter->Record(CommKind::kAllToAll, send_total * static_cast<int64_t>(ElementSize(local.dtype())));
  }
  if (kind == TransferKind::kBlocks || kind == TransferKind::kEvenBlocks) {
    // Regions that are not back to back (the column blocks of S(0) -> S(1)): the transport
    // moves them view to view (threads) or packs them around its all_to_all_v.
    Views sends, recvs;
    DT_RETURN_IF_ERROR(RegionViews(local, local_box, send_regions, send_slabs, sends));
    DT_RETURN_IF_ERROR(RegionViews(out, out_box, recv_regions, recv_slabs, recvs));
    DT_RETURN_IF_ERROR(comm.AllToAllBlocks(sends, recvs, kind == TransferKind::kEvenBlocks));
    return out;
  }
  const Counts send_counts = CountsOf(send_regions);
  const Counts recv_counts = CountsOf(recv_regions);
  const int64_t send_total = std::accumulate(send_counts.begin(), send_counts.end(), int64_t{0});
  const int64_t recv_total = std::accumulate(recv_counts.begin(), recv_counts.end(), int64_t{0});
  DT_ASSIGN_OR_RETURN(Tensor send, Contiguous(local));
  if (send.numel() != send_total) {
    DT_ASSIGN_OR_RETURN(send, send.View({send.numel()}));
    DT_ASSIGN_OR_RETURN(send, send.Narrow(0, 0, send_total));
  }
  Tensor recv = out;
  if (out.numel() != recv_total) {
    DT_ASSIGN_OR_RETURN(recv, out.View({out.numel()}));
    DT_ASSIGN_OR_RETURN(recv, recv.Narrow(0, 0, recv_total));
  }
  if (kind == TransferKind::kAllToAll) {
    DT_RETURN_IF_ERROR(comm.AllToAll(send, recv));
  } else {
    DT_RETURN_IF_ERROR(comm.AllToAllV(send, recv, send_counts, recv_counts));
  }
  return out;
}

namespace {

StepGeometry ComputeGeometry(const RedistributeStep& step, IntSpan global_shape, IntSpan mshape, IntSpan coord) {
  StepGeometry g;
  g.before = LocalBoxOf(global_shape, mshape, step.before, coord);
  g.after = LocalBoxOf(global_shape, mshape, step.after, coord);
  g.group = Sorted(step.mesh_dims);
  switch (step.kind) {
    case StepKind::kAllGather: {
      Boxes parts = MemberBoxes(global_shape, mshape, step.before, coord, g.group);
      g.parts.assign(parts.begin(), parts.end());
      g.consecutive = ConsecutiveBlocks(g.after, parts);
      break;
    }
    case StepKind::kReduceScatter: {
      Boxes parts = MemberBoxes(global_shape, mshape, step.after, coord, g.group);
      g.parts.assign(parts.begin(), parts.end());
      g.consecutive = ConsecutiveBlocks(g.before, parts);
      break;
    }
    case StepKind::kAllToAll: {
      const Boxes befores = MemberBoxes(global_shape, mshape, step.before, coord, g.group);
      const Boxes afters = MemberBoxes(global_shape, mshape, step.after, coord, g.group);
      for (size_t j = 0; j < befores.size(); ++j) {
        g.send_regions.push_back(Intersect(g.before, afters[j]));
        g.recv_regions.push_back(Intersect(befores[j], g.after));
      }
      // Every member moves the same count to every member (the same on every rank: each
      // knows all members' boxes) -> the even all_to_all.
      // AllToAllBlocks unless every member's regions are back to back in its boxes.
      for (size_t i = 0; i < befores.size() && !g.blocks; ++i) {
        Boxes sends, recvs;
        for (size_t j = 0; j < afters.size(); ++j) {
          sends.push_back(Intersect(befores[i], afters[j]));
          recvs.push_back(Intersect(befores[j], afters[i]));
        }
        g.blocks = !ConsecutiveBlocks(befores[i], sends) || !ConsecutiveBlocks(afters[i], recvs);
      }
      for (size_t j = 0; j < befores.size(); ++j) {
        const std::optional<Slab> send = SlabOf(g.before, g.send_regions[j]);
        const std::optional<Slab> recv = SlabOf(g.after, g.recv_regions[j]);
        if (!send || !recv) {
          g.send_slabs.clear();
          g.recv_slabs.clear();
          break;
        }
        g.send_slabs.push_back(*send);
        g.recv_slabs.push_back(*recv);
      }
      g.uniform = true;
      const int64_t n = Intersect(befores[0], afters[0]).numel();
      for (size_t i = 0; i < befores.size() && g.uniform; ++i) {
        for (size_t j = 0; j < afters.size() && g.uniform; ++j) {
          g.uniform = Intersect(befores[i], afters[j]).numel() == n;
        }
      }
      break;
    }
    default:
      break;
  }
  for (const LocalBox& b : g.parts) g.counts.push_back(b.numel());
  g.even = AllEqual(g.counts);
  return g;
}

}  // namespace

const PlanGeometry& GeometryRef(const std::shared_ptr<const RedistributePlan>& plan, const DeviceMesh& mesh) {
  CoreState& state = CoreStateOf(mesh);
  // The last entry again (a loop redistributing one way): no hashing, no key to build.
  if (state.last_geometry != nullptr && state.last_geometry->plan == plan &&
      IntSpan(state.last_coordinate) == mesh.coordinate()) {
    return *state.last_geometry;
  }
  std::pair<const RedistributePlan*, Shape> key(plan.get(), Shape(mesh.coordinate().begin(), mesh.coordinate().end()));
  state.last_coordinate = key.second;
  auto it = state.geometry.find(key);
  if (it != state.geometry.end()) {
    state.last_geometry = it->second;
    return *state.last_geometry;
  }
  auto g = std::make_shared<PlanGeometry>();
  g->plan = plan;
  for (const RedistributeStep& step : plan->steps) {
    g->steps.push_back(ComputeGeometry(step, plan->global_shape, mesh.shape(), mesh.coordinate()));
  }
  if (state.geometry.size() >= CoreState::kMaxGeometries) state.geometry.clear();
  state.last_geometry = g;
  state.geometry.emplace(std::move(key), std::move(g));
  return *state.last_geometry;
}

std::shared_ptr<const PlanGeometry> GeometryOf(const std::shared_ptr<const RedistributePlan>& plan,
                                               const DeviceMesh& mesh) {
  GeometryRef(plan, mesh);
  return CoreStateOf(mesh).last_geometry;
}

namespace {

// The all_to_all step, synchronous (TransferBoxes takes any strides: no Contiguous copy).
absl::StatusOr<Tensor> RunAllToAll(const StepGeometry& g, const Tensor& local, const DeviceMesh& mesh) {
  DT_ASSIGN_OR_RETURN(Communicator * comm, mesh.comm(g.group));
  const TransferKind kind = g.blocks ? (g.uniform ? TransferKind::kEvenBlocks : TransferKind::kBlocks)
                                     : (g.uniform ? TransferKind::kAllToAll : TransferKind::kAllToAllV);
  return TransferBoxes(*comm, local, g.before, g.send_regions, g.after, g.recv_regions, kind, CoreStateOf(mesh).counter,
                       g.send_slabs, g.recv_slabs);
}

}  // namespace

absl::StatusOr<StartedStep> StartStep(const RedistributeStep& step, const StepGeometry& g, const Tensor& local,
                                      const DeviceMesh& mesh) {
  const IntSpan mshape = mesh.shape();
  const LocalBox& before = g.before;
  const LocalBox& after = g.after;
  const int64_t esize = static_cast<int64_t>(ElementSize(local.dtype()));
  switch (step.kind) {
    case StepKind::kRelabel:
      return Done(local);
    case StepKind::kChunk: {
      DT_ASSIGN_OR_RETURN(Tensor piece, RegionOf(local, before, after));
      DT_ASSIGN_OR_RETURN(Tensor copy, Tensor::Empty(after.shape, local.dtype(), local.device()));
      DT_RETURN_IF_ERROR(CopyBlock(copy, piece));
      return Done(std::move(copy));
    }
    case StepKind::kToPartial: {
      const PartialOp op = step.after[step.mesh_dims[0]].partial_op();
      if (op != PartialOp::kSum) return Done(local);
      const int m = step.mesh_dims[0];
      DT_ASSIGN_OR_RETURN(Tensor part, DivideForPartial(local, mshape[static_cast<size_t>(m)],
                                                        mesh.coordinate()[static_cast<size_t>(m)] == 0));
      return Done(std::move(part));
    }
    case StepKind::kAllToAll: {
      DT_ASSIGN_OR_RETURN(Tensor out, RunAllToAll(g, local, mesh));
      return Done(std::move(out));
    }
    default:
      break;
  }
  DT_ASSIGN_OR_RETURN(Communicator * comm, mesh.comm(g.group));
  DT_ASSIGN_OR_RETURN(Tensor input, Contiguous(local));
  switch (step.kind) {
    case StepKind::kAllReduce: {
      DT_ASSIGN_OR_RETURN(Tensor out, Tensor::Empty(before.shape, local.dtype(), local.device()));
      Record(CommKind::kAllReduce, before.numel() * esize, mesh);
      DT_ASSIGN_OR_RETURN(auto work, comm->AllReduceAsync(input, out, ToCommReduceOp(*step.before.partial_op())));
      return StartedStep{std::move(work), nullptr, std::move(out), {input, Tensor()}};
    }
    case StepKind::kAllGather: {
      DT_ASSIGN_OR_RETURN(Tensor out, Tensor::Empty(after.shape, local.dtype(), local.device()));
      Record(CommKind::kAllGather, after.numel() * esize, mesh);
      const Counts counts(g.counts.begin(), g.counts.end());
      if (g.consecutive) {
        DT_ASSIGN_OR_RETURN(auto work,
                            g.even ? comm->AllGatherAsync(input, out) : comm->AllGatherVAsync(input, out, counts));
        return StartedStep{std::move(work), nullptr, std::move(out), {input, Tensor()}};
      }
      DT_ASSIGN_OR_RETURN(Tensor staging, Tensor::Empty({after.numel()}, local.dtype(), local.device()));
      DT_ASSIGN_OR_RETURN(
          auto work, g.even ? comm->AllGatherAsync(input, staging) : comm->AllGatherVAsync(input, staging, counts));
      auto finish = [out, input, staging, &g]() -> absl::StatusOr<Tensor> {
        (void)input;
        DT_RETURN_IF_ERROR(Unpack(staging, g.parts, out, g.after));
        return out;
      };
      return StartedStep{std::move(work), std::move(finish), Tensor(), {}};
    }
    case StepKind::kReduceScatter: {
      DT_ASSIGN_OR_RETURN(Tensor out, Tensor::Empty(after.shape, local.dtype(), local.device()));
      Tensor send = input;
      if (!g.consecutive) {
        DT_ASSIGN_OR_RETURN(send, Tensor::Empty({before.numel()}, local.dtype(), local.device()));
        DT_RETURN_IF_ERROR(Pack(input, before, g.parts, send));
      }
      Record(CommKind::kReduceScatter, before.numel() * esize, mesh);
      const CommReduceOp op = ToCommReduceOp(*step.before.partial_op());
      const Counts counts(g.counts.begin(), g.counts.end());
      DT_ASSIGN_OR_RETURN(auto work, g.even ? comm->ReduceScatterAsync(send, out, op)
                                            : comm->ReduceScatterVAsync(send, out, counts, op));
      return StartedStep{std::move(work), nullptr, std::move(out), {input, send}};
    }
    default:
      return absl::InternalError(absl::StrCat("[Redistribute] unknown step ", StepKindName(step.kind)));
  }
}

namespace {

// One step, synchronously. The collectives that write straight into their output (every
// P->R, and S->R / P->S whose pieces are consecutive) make the blocking call here: no
// StartedStep, closure or extra Tensor copies. At 1 MiB the data evicts what Redistribute
// touches from the caches, so every line touched is a miss: a P->R of 1 MiB on 2 thread ranks
// added about 2.5 us to the raw all_reduce through StartStep, 0.7 us this way. The other
// steps go through StartStep and wait.
absl::StatusOr<Tensor> RunStep(const RedistributeStep& step, const StepGeometry& g, const Tensor& local,
                               const DeviceMesh& mesh) {
  if (step.kind == StepKind::kAllToAll) return RunAllToAll(g, local, mesh);
  const bool direct = step.kind == StepKind::kAllReduce ||
                      ((step.kind == StepKind::kAllGather || step.kind == StepKind::kReduceScatter) && g.consecutive);
  if (!direct) {
    DT_ASSIGN_OR_RETURN(StartedStep started, StartStep(step, g, local, mesh));
    if (started.work != nullptr) DT_RETURN_IF_ERROR(started.work->Wait());
    return started.Finish();
  }
  DT_ASSIGN_OR_RETURN(Communicator * comm, mesh.comm(g.group));
  Tensor copy;  // only where `local` is not contiguous
  if (!local.is_contiguous()) {
    DT_ASSIGN_OR_RETURN(copy, Contiguous(local));
  }
  const Tensor& input = copy.defined() ? copy : local;
  const int64_t esize = static_cast<int64_t>(ElementSize(local.dtype()));
  const LocalBox& box = step.kind == StepKind::kAllReduce ? g.before : g.after;
  DT_ASSIGN_OR_RETURN(Tensor out, Tensor::Empty(box.shape, local.dtype(), local.device()));
  const absl::Span<const int64_t> counts = g.counts;
  switch (step.kind) {
    case StepKind::kAllReduce:
      Record(CommKind::kAllReduce, g.before.numel() * esize, mesh);
      DT_RETURN_IF_ERROR(comm->AllReduce(input, out, ToCommReduceOp(*step.before.partial_op())));
      break;
    case StepKind::kAllGather:
      Record(CommKind::kAllGather, g.after.numel() * esize, mesh);
      DT_RETURN_IF_ERROR(g.even ? comm->AllGather(input, out) : comm->AllGatherV(input, out, counts));
      break;
    default: {  // kReduceScatter
      Record(CommKind::kReduceScatter, g.before.numel() * esize, mesh);
      const CommReduceOp op = ToCommReduceOp(*step.before.partial_op());
      DT_RETURN_IF_ERROR(g.even ? comm->ReduceScatter(input, out, op) : comm->ReduceScatterV(input, out, counts, op));
      break;
    }
  }
  return out;
}

}  // namespace

absl::StatusOr<Tensor> ExecuteSteps(const std::shared_ptr<const RedistributePlan>& plan, size_t first,
                                    const Tensor& local, const DeviceMesh& mesh) {
  if (first >= plan->steps.size()) return local;
  const PlanGeometry& geometry = GeometryRef(plan, mesh);  // nothing below looks up another
  if (first + 1 == plan->steps.size()) return RunStep(plan->steps[first], geometry.steps[first], local, mesh);
  Tensor out;  // the last step's output
  for (size_t i = first; i < plan->steps.size(); ++i) {
    DT_ASSIGN_OR_RETURN(out, RunStep(plan->steps[i], geometry.steps[i], i == first ? local : out, mesh));
  }
  return out;
}

}  // namespace dtensor::internal
