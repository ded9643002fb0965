#include "dtensor/nn/parallel/fsdp_group.h"

#include <algorithm>
#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"
#include "dtensor/core/dtensor.h"
#include "dtensor/ops/ops.h"
#include "dtensor/tensor/status.h"

namespace dtensor::nn {

// One parameter of the group. Its local (unsharded) tensor is viewed as [pre, rows, rest]
// around the sharded dim `dim` (pre = 1 for dim 0); "rows" are that dim's entries.
struct FsdpGroup::Param {
  std::string name;
  Variable* var = nullptr;
  DeviceMesh mesh;     // the parameter's mesh: the FSDP mesh, or a larger one (TP)
  int shard_mdim = 0;  // the FSDP dims in `mesh`
  int rep_mdim = -1;
  Layout unsharded_layout;  // Replicate on the FSDP dims
  Layout sharded_layout;    // Shard(0) on the shard dim, innermost
  Shape global_shape;
  Shape local_shape;  // of the unsharded local tensor
  Shape shard_shape;  // of this rank's shard
  int64_t dim = 0, pre = 1, rows = 0, rest = 1, chunk_rows = 0;
  ChunkRange mine;
  DType dtype = DType::kFloat32;  // the parameter's own (master) dtype
  int bucket = 0;
  int64_t offset = 0;            // elements into a rank's block of the bucket
  int64_t unsharded_offset = 0;  // elements into the bucket's unsharded buffer
  DTensor sharded;               // the value at rest
  Value unsharded;               // the value while gathered: a view of the bucket's buffer
  Value stashed_grad;            // the sharded gradient, while unsharded
  Tensor unsynced;               // unsharded gradients kept without gradient sync (reduce dtype)
};

// The parameters of one (compute dtype, reduce dtype) pair: one collective each way.
struct FsdpGroup::Bucket {
  DType compute = DType::kFloat32;
  DType reduce = DType::kFloat32;
  std::vector<int> params;
  int64_t block = 0;            // elements per rank
  int64_t unsharded_numel = 0;  // elements of the unsharded buffer
  Tensor unsharded;             // released while sharded
  Tensor gather_in, gather_out;
  std::unique_ptr<Work> gather_work;
  // HSDP without all_reduce (set_requires_all_reduce(false)): the reduce-scattered sums of the
  // backward passes since the last all_reduce, and the parameters reduced in them.
  Tensor partial_reduce;
  std::vector<int> partial_params;
};

// A reduce-scatter in flight.
struct FsdpGroup::Pending {
  int bucket = 0;
  Tensor input, output;
  std::vector<std::unique_ptr<Work>> works;
  std::vector<int> params;  // those reduced in it: requiring grad, or with a gradient
  bool partial = false;     // reduce-scattered only: kept in the bucket's partial_reduce
};

namespace {

// Appends the indices of `from` that `to` lacks (a bucket's few parameters).
void AddMissing(std::vector<int>& to, const std::vector<int>& from) {
  for (int i : from) {
    if (std::find(to.begin(), to.end(), i) == to.end()) to.push_back(i);
  }
}

// The views of one parameter inside a [N, block] flat buffer: its rows [0, q * chunk) as
// [q, chunk * rest] (ranks 0..q-1 hold full chunks), the remainder rows of rank q as
// [r * rest], and the padding after them.
struct Parts {
  Tensor full, remainder;
  std::vector<Tensor> padding;
};

absl::StatusOr<Parts> PartsOf(const Tensor& flat2d, int64_t offset, int64_t rows, int64_t chunk, int64_t rest) {
  Parts out;
  const int64_t n = flat2d.size(0);
  const int64_t width = chunk * rest;
  if (rows == 0 || width == 0) return out;
  const int64_t q = rows / chunk, r = rows - q * chunk;
  DT_ASSIGN_OR_RETURN(Tensor cols, flat2d.Narrow(1, offset, width));
  if (q > 0) {
    DT_ASSIGN_OR_RETURN(out.full, cols.Narrow(0, 0, q));
  }
  if (q < n) {
    DT_ASSIGN_OR_RETURN(Tensor row, cols.Select(0, q));
    if (r > 0) {
      DT_ASSIGN_OR_RETURN(out.remainder, row.Narrow(0, 0, r * rest));
    }
    DT_ASSIGN_OR_RETURN(Tensor pad, row.Narrow(0, r * rest, (chunk - r) * rest));
    out.padding.push_back(pad);
    if (q + 1 < n) {
      DT_ASSIGN_OR_RETURN(Tensor more, cols.Narrow(0, q + 1, n - q - 1));
      out.padding.push_back(more);
    }
  }
  return out;
}

// The flat (row-major) pieces of a contiguous tensor of `rows` x `rest` matching PartsOf.
absl::StatusOr<std::pair<Tensor, Tensor>> FlatPieces(const Tensor& flat, int64_t rows, int64_t chunk, int64_t rest) {
  const int64_t q = rows / chunk, r = rows - q * chunk;
  std::pair<Tensor, Tensor> out;
  if (q > 0) {
    DT_ASSIGN_OR_RETURN(Tensor a, flat.Narrow(0, 0, q * chunk * rest));
    DT_ASSIGN_OR_RETURN(out.first, a.View({q, chunk * rest}));
  }
  if (r > 0) {
    DT_ASSIGN_OR_RETURN(out.second, flat.Narrow(0, q * chunk * rest, r * rest));
  }
  return out;
}

// The [pre, chunk, rest] block a parameter has in rank r's row of a [N, block] buffer.
absl::StatusOr<Tensor> BlockOf(const Tensor& flat2d, int64_t r, int64_t offset, int64_t pre, int64_t chunk,
                               int64_t rest) {
  DT_ASSIGN_OR_RETURN(Tensor row, flat2d.Select(0, r));
  DT_ASSIGN_OR_RETURN(Tensor region, row.Narrow(0, offset, pre * chunk * rest));
  return region.View({pre, chunk, rest});
}

void Record(const DeviceMesh& mesh, CommKind kind, const Tensor& t) {
  if (CommCounter* c = CommCounterOf(mesh)) c->Record(kind, static_cast<int64_t>(t.nbytes()));
}

}  // namespace

FsdpGroup::FsdpGroup() = default;
FsdpGroup::~FsdpGroup() = default;

absl::StatusOr<std::shared_ptr<FsdpGroup>> FsdpGroup::Create(std::vector<std::pair<std::string, Variable*>> params,
                                                             const DeviceMesh& mesh, const FsdpOptions& options) {
  constexpr const char* kOp = "FullyShard";
  std::shared_ptr<FsdpGroup> g(new FsdpGroup());
  g->mesh_ = mesh;
  g->options_ = options;
  g->device_ = mesh.device();
  if (options.shard_dim.has_value()) {
    DT_ASSIGN_OR_RETURN(g->shard_dim_, mesh.DimIndex(*options.shard_dim));
    if (options.replicate_dim.has_value()) {
      DT_ASSIGN_OR_RETURN(g->replicate_dim_, mesh.DimIndex(*options.replicate_dim));
    }
  } else if (options.replicate_dim.has_value()) {
    return InvalidArg(kOp, "replicate_dim ", *options.replicate_dim, " given without shard_dim");
  } else if (mesh.ndim() == 1) {
    g->shard_dim_ = 0;
  } else if (mesh.ndim() == 2) {
    g->replicate_dim_ = 0;  // HSDP: (replicate, shard)
    g->shard_dim_ = 1;
  } else {
    return InvalidArg(kOp, "mesh ", mesh.ToString(), " has ", mesh.ndim(),
                      " dims: name the FSDP dims (FsdpOptions::shard_dim, replicate_dim)");
  }
  if (g->replicate_dim_ == g->shard_dim_) {
    return InvalidArg(kOp, "shard and replicate dims are both ", mesh.names()[static_cast<size_t>(g->shard_dim_)]);
  }
  g->shard_size_ = mesh.size(g->shard_dim_);
  g->shard_rank_ = mesh.coordinate(g->shard_dim_);
  std::vector<std::string> fsdp_names = {mesh.names()[static_cast<size_t>(g->shard_dim_)]};
  if (g->replicate_dim_ >= 0)
    fsdp_names.insert(fsdp_names.begin(), mesh.names()[static_cast<size_t>(g->replicate_dim_)]);
  DT_ASSIGN_OR_RETURN(DeviceMesh fsdp_mesh, mesh.Sub(fsdp_names));
  if (!params.empty()) g->label_ = params[0].first;

  for (auto& [name, var] : params) {
    const Value& v = var->value();
    Param p;
    p.name = name;
    p.var = var;
    if (!v.defined()) return InvalidArg(kOp, "parameter ", name, " is undefined");
    if (v.dim() == 0) return InvalidArg(kOp, "parameter ", name, " is 0-d: FSDP shards dim 0");
    if (v.device() != g->device_) {
      return InvalidArg(kOp, "parameter ", name, " is on ", v.device().ToString(), " but the mesh ", mesh.ToString(),
                        " is on ", g->device_.ToString());
    }
    Tensor local;
    if (!v.is_dtensor()) {
      p.mesh = mesh;
      p.shard_mdim = g->shard_dim_;
      p.rep_mdim = g->replicate_dim_;
      p.unsharded_layout = Layout(Placements(static_cast<size_t>(mesh.ndim()), Replicate()));
      local = v.local();
    } else {
      const DTensor& d = v.dtensor();
      p.mesh = d.mesh();
      auto dims = d.mesh().DimsOf(fsdp_mesh);
      if (!dims.ok()) {
        return InvalidArg(kOp, "parameter ", name, " lives on ", d.mesh().ToString(),
                          ", which does not hold the FSDP dims ", fsdp_mesh.ToString(), ": ", dims.status().message());
      }
      p.shard_mdim = dims->back();
      p.rep_mdim = dims->size() == 2 ? (*dims)[0] : -1;
      if (d.layout().has_partial()) return InvalidArg(kOp, "parameter ", name, " is Partial: ", d.ToString());
      for (int m : *dims) {
        if (!d.layout()[m].is_replicate()) {
          return InvalidArg(kOp, "parameter ", name, " is ", d.layout().ToString(), ", not Replicate on the FSDP dim ",
                            d.mesh().names()[static_cast<size_t>(m)]);
        }
      }
      p.unsharded_layout = d.layout();
      local = d.ToLocal();
    }
    p.global_shape = Shape(v.shape().begin(), v.shape().end());
    p.local_shape = Shape(local.shape().begin(), local.shape().end());
    p.dtype = v.dtype();
    if (options.shard_dim_fn) {
      p.dim = options.shard_dim_fn(name, v);
      if (p.dim < 0 || p.dim >= v.dim()) {
        return InvalidArg(kOp, "shard_dim_fn chose dim ", p.dim, " of parameter ", name, " ", ShapeString(v.shape()));
      }
    }
    const size_t k = static_cast<size_t>(p.dim);
    p.pre = NumElements(IntSpan(p.local_shape).subspan(0, k));
    p.rows = p.local_shape[k];
    p.rest = NumElements(IntSpan(p.local_shape).subspan(k + 1));
    p.chunk_rows = ChunkSizeOf(p.rows, g->shard_size_);
    p.mine = ChunkOf(p.rows, g->shard_size_, g->shard_rank_);
    p.shard_shape = p.local_shape;
    p.shard_shape[k] = p.mine.size;
    p.sharded_layout = p.unsharded_layout.WithPlacement(p.shard_mdim, Shard(p.dim));
    const LocalBox box = LocalBoxOf(p.global_shape, p.mesh.shape(), p.sharded_layout, p.mesh.coordinate());
    if (box.shape != p.shard_shape) {
      return absl::InternalError(absl::StrCat("[FullyShard] ", name, ": shard ", ShapeString(p.shard_shape),
                                              " is not the layout's box ", ShapeString(box.shape)));
    }
    DT_ASSIGN_OR_RETURN(Tensor shard, Tensor::Empty(p.shard_shape, p.dtype, g->device_));
    DT_ASSIGN_OR_RETURN(Tensor mine, local.Narrow(p.dim, p.mine.offset, p.mine.size));
    DT_RETURN_IF_ERROR(Copy_(shard, mine));
    p.sharded = DTensor::WrapTrusted(shard, p.mesh, p.sharded_layout, p.global_shape);

    const DType compute = options.mp_policy.param_dtype.value_or(p.dtype);
    const DType reduce = options.mp_policy.reduce_dtype.value_or(p.dtype);
    size_t b = 0;
    while (b < g->buckets_.size() && (g->buckets_[b].compute != compute || g->buckets_[b].reduce != reduce)) ++b;
    if (b == g->buckets_.size()) {
      g->buckets_.emplace_back();
      g->buckets_[b].compute = compute;
      g->buckets_[b].reduce = reduce;
    }
    Bucket& bucket = g->buckets_[b];
    p.bucket = static_cast<int>(b);
    p.offset = bucket.block;
    p.unsharded_offset = bucket.unsharded_numel;
    bucket.block += p.pre * p.chunk_rows * p.rest;
    bucket.unsharded_numel += p.pre * p.rows * p.rest;
    bucket.params.push_back(static_cast<int>(g->params_.size()));
    g->params_.push_back(std::move(p));
  }
  for (Param& p : g->params_) p.var->set_value(Value(p.sharded));
  return g;
}

std::vector<std::string> FsdpGroup::param_names() const {
  std::vector<std::string> out;
  for (const Param& p : params_) out.push_back(p.name);
  return out;
}

int64_t FsdpGroup::padded_shard_numel() const {
  int64_t n = 0;
  for (const Bucket& b : buckets_) n += b.block;
  return n;
}

int64_t FsdpGroup::all_gather_bytes() const {
  int64_t n = 0;
  for (const Bucket& b : buckets_) n += shard_size_ * b.block * static_cast<int64_t>(ElementSize(b.compute));
  return shard_size_ > 1 ? n : 0;
}

int64_t FsdpGroup::reduce_scatter_bytes() const {
  int64_t n = 0;
  for (const Bucket& b : buckets_) n += shard_size_ * b.block * static_cast<int64_t>(ElementSize(b.reduce));
  return shard_size_ > 1 ? n : 0;
}

int64_t FsdpGroup::num_flat_buffers() const { return static_cast<int64_t>(buckets_.size()); }

int64_t FsdpGroup::reduced_shard_bytes() const {
  int64_t n = 0;
  for (const Bucket& b : buckets_) n += b.block * static_cast<int64_t>(ElementSize(b.reduce));
  return n;
}

int64_t FsdpGroup::unsharded_buffer_bytes() const {
  int64_t n = 0;
  for (const Bucket& b : buckets_) n += b.unsharded_numel * static_cast<int64_t>(ElementSize(b.compute));
  return n;
}

absl::Status FsdpGroup::StartUnshard() {
  if (state_ != State::kSharded) return absl::OkStatus();
  Communicator& comm = mesh_.comm(shard_dim_);
  for (Bucket& b : buckets_) {
    DT_ASSIGN_OR_RETURN(b.gather_in, Tensor::Empty({b.block}, b.compute, device_));
    for (int i : b.params) {
      Param& p = params_[static_cast<size_t>(i)];
      // The optimizer or a state-dict load may have replaced the value: keep what is there.
      const Value& v = p.var->value();
      if (!v.is_dtensor() || v.dtensor().layout() != p.sharded_layout || v.local().shape() != IntSpan(p.shard_shape)) {
        return absl::FailedPreconditionError(absl::StrCat("[FullyShard] parameter ", p.name, " is ", v.ToString(),
                                                          ", not its shard ", p.sharded_layout.ToString()));
      }
      p.sharded = v.dtensor();
      if (p.pre * p.chunk_rows * p.rest == 0) continue;
      DT_ASSIGN_OR_RETURN(Tensor in1, b.gather_in.View({1, b.block}));
      DT_ASSIGN_OR_RETURN(Tensor block, BlockOf(in1, 0, p.offset, p.pre, p.chunk_rows, p.rest));
      if (p.mine.size > 0) {
        DT_ASSIGN_OR_RETURN(Tensor dst, block.Narrow(1, 0, p.mine.size));
        DT_ASSIGN_OR_RETURN(Tensor src, p.sharded.ToLocal().View({p.pre, p.mine.size, p.rest}));
        DT_RETURN_IF_ERROR(Copy_(dst, src));
      }
      if (p.chunk_rows > p.mine.size) {
        DT_ASSIGN_OR_RETURN(Tensor pad, block.Narrow(1, p.mine.size, p.chunk_rows - p.mine.size));
        DT_RETURN_IF_ERROR(Fill_(pad, 0.0));
      }
    }
    if (shard_size_ == 1) {
      b.gather_out = b.gather_in;
      continue;
    }
    DT_ASSIGN_OR_RETURN(b.gather_out, Tensor::Empty({shard_size_ * b.block}, b.compute, device_));
    DT_ASSIGN_OR_RETURN(b.gather_work, comm.AllGatherAsync(b.gather_in, b.gather_out));
    Record(mesh_, CommKind::kAllGather, b.gather_out);
    ++stats_.gathers;
  }
  state_ = State::kGathering;
  return absl::OkStatus();
}

absl::Status FsdpGroup::Unshard() {
  DT_RETURN_IF_ERROR(StartUnshard());
  if (state_ == State::kUnsharded) return absl::OkStatus();
  for (Bucket& b : buckets_) {
    if (b.gather_work != nullptr) {
      const auto t0 = std::chrono::steady_clock::now();
      absl::Status s = b.gather_work->WaitStream();
      stats_.gather_wait_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      b.gather_work.reset();
      DT_RETURN_IF_ERROR(s);
    }
    if (!b.unsharded.defined()) {
      DT_ASSIGN_OR_RETURN(b.unsharded, Tensor::Empty({b.unsharded_numel}, b.compute, device_));
    } else {
      DT_RETURN_IF_ERROR(b.unsharded.storage()->Reallocate());
    }
    held_->now += static_cast<int64_t>(b.unsharded.nbytes());
    held_->peak = std::max(held_->peak, held_->now);
    DT_ASSIGN_OR_RETURN(Tensor out2, b.gather_out.View({shard_size_, b.block}));
    for (int i : b.params) {
      Param& p = params_[static_cast<size_t>(i)];
      DT_ASSIGN_OR_RETURN(Tensor flat, b.unsharded.Narrow(0, p.unsharded_offset, p.pre * p.rows * p.rest));
      if (p.pre == 1) {  // dim 0: two copies (the full chunks at once, then the remainder)
        DT_ASSIGN_OR_RETURN(Parts parts, PartsOf(out2, p.offset, p.rows, p.chunk_rows, p.rest));
        DT_ASSIGN_OR_RETURN(auto pieces, FlatPieces(flat, p.rows, p.chunk_rows, p.rest));
        if (parts.full.defined()) DT_RETURN_IF_ERROR(CopyBlock(pieces.first, parts.full));
        if (parts.remainder.defined()) DT_RETURN_IF_ERROR(CopyBlock(pieces.second, parts.remainder));
      } else if (p.rows * p.rest > 0) {  // another dim: one strided copy per rank
        DT_ASSIGN_OR_RETURN(Tensor whole, flat.View({p.pre, p.rows, p.rest}));
        for (int64_t r = 0; r < shard_size_; ++r) {
          const ChunkRange c = ChunkOf(p.rows, shard_size_, r);
          if (c.size == 0) continue;
          DT_ASSIGN_OR_RETURN(Tensor block, BlockOf(out2, r, p.offset, p.pre, p.chunk_rows, p.rest));
          DT_ASSIGN_OR_RETURN(Tensor src, block.Narrow(1, 0, c.size));
          DT_ASSIGN_OR_RETURN(Tensor dst, whole.Narrow(1, c.offset, c.size));
          DT_RETURN_IF_ERROR(CopyBlock(dst, src));
        }
      }
      if (!p.unsharded.defined()) {
        DT_ASSIGN_OR_RETURN(Tensor view, flat.View(p.local_shape));
        p.unsharded = Value(DTensor::WrapTrusted(view, p.mesh, p.unsharded_layout, p.global_shape));
      }
    }
    b.gather_in = Tensor();
    b.gather_out = Tensor();
  }
  for (Param& p : params_) p.var->set_value(p.unsharded);
  DT_RETURN_IF_ERROR(StashGrads());
  state_ = State::kUnsharded;
  return absl::OkStatus();
}

absl::Status FsdpGroup::Reshard() {
  if (state_ == State::kSharded) return absl::OkStatus();
  if (state_ == State::kGathering) {  // prefetched, never used
    absl::Status s;
    for (Bucket& b : buckets_) {
      if (b.gather_work != nullptr) s.Update(b.gather_work->Wait());
      b.gather_work.reset();
      b.gather_in = Tensor();
      b.gather_out = Tensor();
    }
    state_ = State::kSharded;
    return s;
  }
  for (Param& p : params_) p.var->set_value(Value(p.sharded));
  DT_RETURN_IF_ERROR(RestoreGrads());
  for (Bucket& b : buckets_) {
    if (b.unsharded.defined()) {
      DT_RETURN_IF_ERROR(b.unsharded.storage()->Release());
      held_->now -= static_cast<int64_t>(b.unsharded.nbytes());
    }
  }
  state_ = State::kSharded;
  return absl::OkStatus();
}

absl::Status FsdpGroup::StashGrads() {
  for (Param& p : params_) {
    p.stashed_grad = p.var->grad();
    p.var->set_grad(Value());  // (not reset_grad: that would drop the stash just made)
  }
  return absl::OkStatus();
}

absl::Status FsdpGroup::Settle() {
  if (state_ == State::kSharded) return absl::OkStatus();
  if (InBackward()) {
    return absl::FailedPreconditionError(absl::StrCat("[FullyShard] the parameters of the group of ", label_,
                                                      " were read for an update during a backward pass"));
  }
  return Reshard();
}

void FsdpGroup::InstallParamHooks(const std::weak_ptr<FsdpGroup>& self) {
  for (size_t i = 0; i < params_.size(); ++i) {
    params_[i].var->SetParamHooks(
        [self] {
          const std::shared_ptr<FsdpGroup> g = self.lock();
          return g == nullptr ? absl::OkStatus() : g->Settle();
        },
        [self, i] {
          if (const std::shared_ptr<FsdpGroup> g = self.lock()) g->DropKeptGradient(i);
        });
  }
}

void FsdpGroup::DropKeptGradient(size_t param) {
  if (param < params_.size()) params_[param].stashed_grad = Value(Tensor());
  DiscardKept();
}

absl::Status FsdpGroup::RestoreGrads() {
  for (Param& p : params_) {
    p.var->set_grad(p.stashed_grad);
    p.stashed_grad = Value(Tensor());  // (not Value(): GCC 12 warns of its unused DTensor half)
  }
  return absl::OkStatus();
}

absl::Status FsdpGroup::StartKeptReduce() {
  if (!sync_ || !kept_) return absl::OkStatus();
  return StartReduce(/*kept_only=*/true);
}

void FsdpGroup::DiscardReduce() {
  for (Pending& pending : pending_reduce_) {
    for (auto& w : pending.works) w->Wait().IgnoreError();  // the pass failed already
  }
  pending_reduce_.clear();
}

void FsdpGroup::DiscardKept() {
  const Tensor none;  // (assigned, not a temporary per element: GCC 12 warns of those here)
  for (Param& p : params_) p.unsynced = none;
  kept_ = false;
  for (Bucket& b : buckets_) {
    b.partial_reduce = none;
    b.partial_params.clear();
  }
}

absl::Status FsdpGroup::StartReduce(bool kept_only) {
  if (!kept_only && state_ != State::kUnsharded) {
    return absl::FailedPreconditionError(
        absl::StrCat("[FullyShard] group of ", label_, ": gradients reduced while its parameters are not gathered"));
  }
  // Whether sums are kept depends on the passes the group's post-backward ran in, alike on
  // every rank, not on which of its parameters this rank's forward used.
  kept_ = !sync_;
  for (size_t bi = 0; bi < buckets_.size(); ++bi) {
    Bucket& b = buckets_[bi];
    // Each gradient as this rank's part of a sum over the FSDP dims: Partial(sum) as it is,
    // anything else (Replicate, Partial(avg), plain) scaled by 1 / the dim's size.
    std::vector<Tensor> locals(b.params.size());
    for (size_t k = 0; k < b.params.size(); ++k) {
      Param& p = params_[static_cast<size_t>(b.params[k])];
      Value g;  // kept_only: the parameters are their shards, and so is .grad
      if (!kept_only) {
        g = p.var->grad();
        p.var->set_grad(Value());
      }
      Tensor local;
      if (g.defined()) {
        double scale = 1.0;
        if (g.is_dtensor()) {
          DTensor d = g.dtensor();
          if (!d.mesh().SameAs(p.mesh)) {
            return InvalidArg("FullyShard", "gradient of ", p.name, " lives on ", d.mesh().ToString(),
                              ", the parameter on ", p.mesh.ToString());
          }
          Layout target = p.unsharded_layout;
          for (int m : {p.rep_mdim, p.shard_mdim}) {
            if (m < 0) continue;
            const Placement& pl = d.layout()[m];
            const bool keep =
                pl.is_partial() && (pl.partial_op() == PartialOp::kSum || pl.partial_op() == PartialOp::kAvg);
            if (pl.is_partial() && !keep) {
              return absl::UnimplementedError(absl::StrCat("[FullyShard] gradient of ", p.name, " is ",
                                                           d.layout().ToString(), ": only sum and avg reduce"));
            }
            target = target.WithPlacement(m, keep ? pl : Placement(Replicate()));
            if (!(keep && pl.partial_op() == PartialOp::kSum)) scale /= static_cast<double>(p.mesh.size(m));
          }
          if (d.layout() != target) {
            DT_ASSIGN_OR_RETURN(d, d.Redistribute(target));
          }
          local = d.ToLocal();
        } else {
          local = g.local();
          scale /= static_cast<double>(shard_size_ * (replicate_dim_ >= 0 ? mesh_.size(replicate_dim_) : 1));
        }
        if (local.shape() != IntSpan(p.local_shape)) {
          return InvalidArg("FullyShard", "gradient of ", p.name, " has local shape ", ShapeString(local.shape()),
                            ", the parameter ", ShapeString(p.local_shape));
        }
        DT_ASSIGN_OR_RETURN(local, Cast(local, b.reduce));
        if (scale != 1.0) {
          DT_ASSIGN_OR_RETURN(local, Scale(local, scale));
        }
      }
      if (p.unsynced.defined()) {  // sums kept from backward passes without gradient sync
        if (local.defined()) {
          DT_ASSIGN_OR_RETURN(local, Add(local, p.unsynced));
        } else {
          local = p.unsynced;
        }
        if (sync_) p.unsynced = Tensor();
      }
      if (!sync_ && local.defined()) {
        if (local.storage() == nullptr || local.storage().use_count() > 1 || !local.is_contiguous()) {
          DT_ASSIGN_OR_RETURN(local, Clone(local));
        }
        p.unsynced = local;
        continue;
      }
      if (local.defined()) {
        DT_ASSIGN_OR_RETURN(locals[k], Contiguous(local));
      }
    }
    if (!sync_) continue;
    const bool hsdp = replicate_dim_ >= 0 && mesh_.size(replicate_dim_) > 1;
    // Earlier passes' reduce-scattered sums, all-reduced now (with this pass's, zeros if none).
    const bool flush = hsdp && all_reduce_ && b.partial_reduce.defined();
    // Every rank runs the group's post-backward, so each runs the same collectives whatever
    // parameters its own forward used: every parameter that requires grad is reduced (zeros
    // where this rank has no gradient of it; a peer may have one) and gets its reduced shard.
    // Only a bucket of frozen parameters without gradients is skipped, alike on every rank.
    std::vector<bool> reduced(b.params.size());
    bool any = false;
    for (size_t k = 0; k < b.params.size(); ++k) {
      reduced[k] = locals[k].defined() || params_[static_cast<size_t>(b.params[k])].var->requires_grad();
      any = any || reduced[k];
    }
    if (!any && !flush) continue;
    Pending pending;
    pending.bucket = static_cast<int>(bi);
    DT_ASSIGN_OR_RETURN(pending.input, Tensor::Empty({shard_size_ * b.block}, b.reduce, device_));
    DT_ASSIGN_OR_RETURN(Tensor in2, pending.input.View({shard_size_, b.block}));
    for (size_t k = 0; k < b.params.size(); ++k) {
      const Param& p = params_[static_cast<size_t>(b.params[k])];
      if (p.pre > 1) {  // another dim than 0: rank by rank
        if (p.rows * p.rest == 0) continue;
        if (reduced[k]) pending.params.push_back(b.params[k]);
        Tensor whole;
        if (locals[k].defined()) {
          DT_ASSIGN_OR_RETURN(whole, locals[k].View({p.pre, p.rows, p.rest}));
        }
        for (int64_t r = 0; r < shard_size_; ++r) {
          const ChunkRange c = ChunkOf(p.rows, shard_size_, r);
          DT_ASSIGN_OR_RETURN(Tensor block, BlockOf(in2, r, p.offset, p.pre, p.chunk_rows, p.rest));
          if (!whole.defined()) {
            DT_RETURN_IF_ERROR(Fill_(block, 0.0));
            continue;
          }
          if (c.size > 0) {
            DT_ASSIGN_OR_RETURN(Tensor dst, block.Narrow(1, 0, c.size));
            DT_ASSIGN_OR_RETURN(Tensor src, whole.Narrow(1, c.offset, c.size));
            DT_RETURN_IF_ERROR(CopyBlock(dst, src));
          }
          if (p.chunk_rows > c.size) {
            DT_ASSIGN_OR_RETURN(Tensor pad, block.Narrow(1, c.size, p.chunk_rows - c.size));
            DT_RETURN_IF_ERROR(Fill_(pad, 0.0));
          }
        }
        continue;
      }
      DT_ASSIGN_OR_RETURN(Parts parts, PartsOf(in2, p.offset, p.rows, p.chunk_rows, p.rest));
      for (const Tensor& pad : parts.padding) DT_RETURN_IF_ERROR(Fill_(pad, 0.0));
      if (reduced[k]) pending.params.push_back(b.params[k]);
      if (!locals[k].defined()) {
        if (parts.full.defined()) DT_RETURN_IF_ERROR(Fill_(parts.full, 0.0));
        if (parts.remainder.defined()) DT_RETURN_IF_ERROR(Fill_(parts.remainder, 0.0));
        continue;
      }
      DT_ASSIGN_OR_RETURN(Tensor flat, locals[k].View({p.rows * p.rest}));
      DT_ASSIGN_OR_RETURN(auto pieces, FlatPieces(flat, p.rows, p.chunk_rows, p.rest));
      if (parts.full.defined()) DT_RETURN_IF_ERROR(CopyBlock(parts.full, pieces.first));
      if (parts.remainder.defined()) DT_RETURN_IF_ERROR(CopyBlock(parts.remainder, pieces.second));
    }
    if (shard_size_ == 1) {
      pending.output = pending.input;
    } else {
      DT_ASSIGN_OR_RETURN(pending.output, Tensor::Empty({b.block}, b.reduce, device_));
      DT_ASSIGN_OR_RETURN(auto rs,
                          mesh_.comm(shard_dim_).ReduceScatterAsync(pending.input, pending.output, CommReduceOp::kSum));
      Record(mesh_, CommKind::kReduceScatter, pending.input);
      pending.works.push_back(std::move(rs));
    }
    if (hsdp && !all_reduce_) {
      pending.partial = true;  // FinishReduce adds it to the bucket's partial_reduce
    } else if (hsdp) {         // then over the replicas
      if (!pending.works.empty()) DT_RETURN_IF_ERROR(pending.works.back()->WaitStream());
      if (flush) {
        DT_RETURN_IF_ERROR(Add_(pending.output, b.partial_reduce));
        AddMissing(pending.params, b.partial_params);
        b.partial_reduce = Tensor();
        b.partial_params.clear();
      }
      DT_ASSIGN_OR_RETURN(
          auto ar, mesh_.comm(replicate_dim_).AllReduceAsync(pending.output, pending.output, CommReduceOp::kSum));
      Record(mesh_, CommKind::kAllReduce, pending.output);
      pending.works.push_back(std::move(ar));
    }
    pending_reduce_.push_back(std::move(pending));
  }
  return absl::OkStatus();
}

absl::Status FsdpGroup::StartKeptAllReduce() {
  if (!sync_ || !all_reduce_ || replicate_dim_ < 0 || mesh_.size(replicate_dim_) <= 1) return absl::OkStatus();
  for (size_t bi = 0; bi < buckets_.size(); ++bi) {
    Bucket& b = buckets_[bi];
    if (!b.partial_reduce.defined()) continue;
    Pending pending;
    pending.bucket = static_cast<int>(bi);
    pending.output = b.partial_reduce;
    pending.params = b.partial_params;
    b.partial_reduce = Tensor();
    b.partial_params.clear();
    DT_ASSIGN_OR_RETURN(auto ar,
                        mesh_.comm(replicate_dim_).AllReduceAsync(pending.output, pending.output, CommReduceOp::kSum));
    Record(mesh_, CommKind::kAllReduce, pending.output);
    pending.works.push_back(std::move(ar));
    pending_reduce_.push_back(std::move(pending));
  }
  return absl::OkStatus();
}

absl::Status FsdpGroup::FinishReduce(bool host_wait) {
  std::vector<Pending> all = std::move(pending_reduce_);
  pending_reduce_.clear();
  absl::Status status;
  const auto t0 = std::chrono::steady_clock::now();
  for (Pending& pending : all) {
    for (auto& w : pending.works) status.Update(host_wait ? w->Wait() : w->WaitStream());
    ++stats_.reduces;
  }
  stats_.reduce_wait_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  DT_RETURN_IF_ERROR(status);
  for (Pending& pending : all) {
    if (pending.partial) {  // kept for the all_reduce of a later pass
      Bucket& b = buckets_[static_cast<size_t>(pending.bucket)];
      if (b.partial_reduce.defined()) {
        DT_RETURN_IF_ERROR(Add_(b.partial_reduce, pending.output));
      } else {
        b.partial_reduce = pending.output;
      }
      AddMissing(b.partial_params, pending.params);
      continue;
    }
    for (int i : pending.params) {
      Param& p = params_[static_cast<size_t>(i)];
      DT_ASSIGN_OR_RETURN(Tensor out1, pending.output.View({1, pending.output.numel()}));
      DT_ASSIGN_OR_RETURN(Tensor block, BlockOf(out1, 0, p.offset, p.pre, p.chunk_rows, p.rest));
      DT_ASSIGN_OR_RETURN(Tensor piece, block.Narrow(1, 0, p.mine.size));
      DT_ASSIGN_OR_RETURN(piece, Contiguous(piece));  // a view when pre == 1 or the chunk is full
      DT_ASSIGN_OR_RETURN(piece, piece.View(p.shard_shape));
      DT_ASSIGN_OR_RETURN(piece, Cast(piece, p.dtype));
      // The sharded gradient is in .grad while the parameters are their shards (sharded, or
      // prefetched and not yet gathered: a group this pass did not use), else stashed.
      Value& stash = p.stashed_grad;
      const bool in_var = state_ != State::kUnsharded;
      const Value cur = in_var ? p.var->grad() : stash;
      Value next;
      if (cur.defined()) {
        DT_RETURN_IF_ERROR(Add_(cur.local(), piece));
        next = cur;
      } else {
        next = Value(DTensor::WrapTrusted(piece, p.mesh, p.sharded_layout, p.global_shape));
      }
      if (in_var) {
        p.var->set_grad(next);
      } else {
        stash = next;
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace dtensor::nn
