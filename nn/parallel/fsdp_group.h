// FsdpGroup: the parameters of one module under FSDP (made by FullyShard, fully_shard.h) and
// the collectives that move them: one all_gather of all the group's shards per dtype into one
// flat buffer, one reduce_scatter of all its gradients per dtype.
//
//   FsdpGroup* g = FsdpGroupOf(block);
//   DT_RETURN_IF_ERROR(g->Unshard());   // parameters: Replicate on the FSDP dims (gathered)
//   ...                                 // forward and backward on the full parameters
//   DT_RETURN_IF_ERROR(g->Reshard());   // parameters: their shards again
//
// Flat buffers (per dtype of the group): a rank's block holds, parameter after parameter, its
// torch.chunk piece of dim 0 (or FsdpOptions::shard_dim_fn's dim) of each parameter's local
// tensor, padded to ceil(rows / N) rows;
// the all_gather output is N such blocks, copied out into one unsharded buffer (the
// parameters' local tensors are views of it), and a gradient goes into the reduce_scatter
// input the same way. Parameters sharded by tensor parallelism already (DTensors on a mesh
// that holds the FSDP dims) are handled alike: FSDP chunks their local pieces, as the
// innermost sharder of dim 0 (PyTorch's _StridedShard order, so full_tensor() is right).
#ifndef DTENSOR_NN_PARALLEL_FSDP_GROUP_H_
#define DTENSOR_NN_PARALLEL_FSDP_GROUP_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "dtensor/autograd/variable.h"
#include "dtensor/collectives/communicator.h"
#include "dtensor/mesh/device_mesh.h"
#include "dtensor/placements/layout.h"

namespace dtensor::nn {

struct MixedPrecisionPolicy {
  std::optional<DType> param_dtype = std::nullopt;   // gather and compute in it (default: the parameter's dtype)
  std::optional<DType> reduce_dtype = std::nullopt;  // reduce gradients in it (default: the parameter's dtype)
  std::optional<DType> output_dtype = std::nullopt;  // cast the module's floating output to it
  // Cast the module's floating input to param_dtype before its forward (PyTorch's default), so
  // a float32 input meets bfloat16 parameters as their dtype.
  bool cast_forward_inputs = true;
};

struct FsdpOptions {
  // Free the gathered parameters after forward and gather again for backward (false: keep
  // them until the end of backward, one all_gather less per step at the memory of the group).
  bool reshard_after_forward = true;
  // Start the next group's all_gather (forward: the next in forward order; backward: the one
  // before) before waiting for this one's, so that it overlaps this group's compute.
  bool prefetch = true;
  MixedPrecisionPolicy mp_policy = {};
  // Which mesh dims shard and replicate. Unset: a 1-d mesh shards over its dim; a 2-d mesh is
  // (replicate, shard), HSDP. Set for larger meshes (FSDP x TP): e.g. {"dp_shard"} and
  // optionally {"dp_replicate"}.
  std::optional<std::string> shard_dim = std::nullopt;
  std::optional<std::string> replicate_dim = std::nullopt;
  // Which dim of a parameter's local tensor to shard (PyTorch's shard_placement_fn); unset:
  // dim 0. For a parameter whose dim 0 is short (tensor parallelism's stacked q, k, v:
  // [3, C / tp, C]), another dim keeps the shards even.
  std::function<int64_t(const std::string& name, const Value& param)> shard_dim_fn = nullptr;
};

class FsdpTree;

class FsdpGroup {
 public:
  // Made by FullyShard. `params`: the group's parameters by name.
  static absl::StatusOr<std::shared_ptr<FsdpGroup>> Create(std::vector<std::pair<std::string, Variable*>> params,
                                                           const DeviceMesh& mesh, const FsdpOptions& options);
  ~FsdpGroup();
  FsdpGroup(const FsdpGroup&) = delete;
  FsdpGroup& operator=(const FsdpGroup&) = delete;

  // Gathers the parameters (a no-op when they are gathered); StartUnshard only starts the
  // all_gather, Unshard also waits for it and makes the parameters unsharded.
  absl::Status StartUnshard();
  absl::Status Unshard();
  // Back to the shards; the unsharded buffer's memory is released.
  absl::Status Reshard();
  bool unsharded() const { return state_ == State::kUnsharded; }

  // Post-backward: takes the parameters' unsharded gradients and starts their reduce_scatter
  // (or, without gradient sync, adds them to the unsynced sums). FinishReduce waits for it and
  // adds the results to the sharded gradients: on the host, or (host_wait false) by ordering
  // the device's later work after it (NCCL: no host sync; CPU transports wait either way).
  absl::Status StartReduce() { return StartReduce(/*kept_only=*/false); }
  absl::Status FinishReduce(bool host_wait = true);
  // HSDP after backward passes without all_reduce: starts the all_reduce of the sums they kept
  // where this pass's StartReduce did not (the group took no part in it); FinishReduce adds
  // them to the sharded gradients. A no-op without such sums, gradient sync or all_reduce.
  absl::Status StartKeptAllReduce();
  // After backward passes without gradient sync: starts the reduce_scatter of the sums they
  // kept where this synchronised pass's StartReduce did not (the group took no part in it);
  // FinishReduce adds the results to the sharded gradients. A no-op without such sums or sync.
  absl::Status StartKeptReduce();
  // Waits for the collectives StartReduce started and drops their results (a failed backward
  // pass: its gradients are not to be added).
  void DiscardReduce();
  // Drops the sums kept without gradient sync and HSDP's kept for a later all_reduce (a failed
  // backward pass: the step is dropped, its earlier micro-batches included).
  void DiscardKept();
  bool reduce_pending() const { return !pending_reduce_.empty(); }

  void set_requires_gradient_sync(bool sync) { sync_ = sync; }
  // HSDP (PyTorch's set_requires_all_reduce): false keeps each backward's reduce-scattered
  // gradients in a sum on this group instead of all-reducing them over the replicate dim; the
  // next synchronised backward with true adds that sum and all-reduces once (gradient
  // accumulation: a reduce_scatter per micro-batch, one all_reduce per step). No effect
  // without a replicate dim of size > 1.
  void set_requires_all_reduce(bool all_reduce) { all_reduce_ = all_reduce; }
  void set_reshard_after_forward(bool reshard) { options_.reshard_after_forward = reshard; }
  void set_prefetch(bool prefetch) { options_.prefetch = prefetch; }

  // Time this rank spent waiting for the group's collectives (the communication that compute
  // did not hide), and their counts, since the last ResetStats().
  struct Stats {
    double gather_wait_s = 0;
    double reduce_wait_s = 0;
    int64_t gathers = 0;
    int64_t reduces = 0;
  };
  const Stats& stats() const { return stats_; }
  void ResetStats() { stats_ = Stats(); }
  const FsdpOptions& options() const { return options_; }
  const DeviceMesh& mesh() const { return mesh_; }
  int64_t shard_size() const { return shard_size_; }
  std::vector<std::string> param_names() const;
  // Elements per rank in the flat all_gather / reduce_scatter buffers, summed over dtypes
  // (each parameter's dim-0 chunk padded to ceil(rows / N) rows).
  int64_t padded_shard_numel() const;
  // Bytes one all_gather / reduce_scatter of this group records in the CommCounter (nccl-tests
  // convention: the gathered output; the scattered input), summed over dtypes.
  int64_t all_gather_bytes() const;
  int64_t reduce_scatter_bytes() const;
  // One flat buffer per dtype of the group's parameters: the collectives per gather or reduce.
  int64_t num_flat_buffers() const;
  // Bytes of this rank's reduced gradient shards (what HSDP all-reduces over the replicas).
  int64_t reduced_shard_bytes() const;
  // Bytes of this group's unsharded buffers (the gathered parameters layers compute with), and
  // of those of every group of its tree held at once now and at most since the last
  // ResetPeakUnshardedBytes() (the all_gather's transient output is not counted).
  int64_t unsharded_buffer_bytes() const;
  int64_t tree_unsharded_bytes() const { return held_->now; }
  int64_t tree_peak_unsharded_bytes() const { return held_->peak; }
  void ResetPeakUnshardedBytes() { held_->peak = held_->now; }

 private:
  friend class FsdpTree;
  friend struct FsdpHooks;
  enum class State { kSharded, kGathering, kUnsharded };
  struct Param;
  struct Bucket;
  struct Pending;
  FsdpGroup();
  absl::Status StashGrads();
  absl::Status RestoreGrads();
  // The parameters' hooks (Variable::SetParamHooks, installed by FullyShard). Settle: a group
  // left gathered (by a forward whose backward has not run: the root, reshard_after_forward
  // false, a forward that failed) is sharded again, its sharded gradients back in .grad
  // (FailedPrecondition inside a backward pass); a pending backward gathers it again.
  // DropKeptGradient: reset_grad of parameter `param` while gathered drops its sharded gradient
  // kept aside, and the group's sums kept from passes without gradient sync or all_reduce.
  absl::Status Settle();
  void DropKeptGradient(size_t param);
  void InstallParamHooks(const std::weak_ptr<FsdpGroup>& self);
  // kept_only: reduces the sums kept without gradient sync alone (the group is sharded).
  absl::Status StartReduce(bool kept_only);

  DeviceMesh mesh_;
  FsdpOptions options_;
  int shard_dim_ = 0;       // in mesh_
  int replicate_dim_ = -1;  // in mesh_, or -1
  int64_t shard_size_ = 1;  // N
  int64_t shard_rank_ = 0;
  Device device_;
  std::vector<Param> params_;
  std::vector<Bucket> buckets_;
  State state_ = State::kSharded;
  bool sync_ = true;
  // A post-backward without gradient sync kept sums that no synchronised one reduced yet (on
  // every rank alike, even where this rank's forward used none of the group's parameters).
  bool kept_ = false;
  bool all_reduce_ = true;
  std::vector<Pending> pending_reduce_;
  Stats stats_;
  struct Held {
    int64_t now = 0, peak = 0;
  };
  std::shared_ptr<Held> held_ = std::make_shared<Held>();  // shared by the groups of a tree

  // Hook state (fully_shard.cc).
  std::shared_ptr<FsdpTree> tree_;
  bool is_root_ = true;
  // NextSequenceNr() when this step's forward of the group began (a second use in the same
  // forward keeps the first's); each use's output carries it to its pre-backward.
  uint64_t forward_seq_ = 0;
  bool forwarded_ = false;  // ran forward in this step, post-backward not yet
  // The forward starts whose post-backward is queued in this backward pass: one per forward
  // whose output's gradient arrived (two forwards before their backward give two).
  std::vector<uint64_t> queued_starts_;
  int order_index_ = -1;  // in the tree's forward order
  std::string label_;     // for messages: the first parameter's name
};

}  // namespace dtensor::nn

#endif  // DTENSOR_NN_PARALLEL_FSDP_GROUP_H_
