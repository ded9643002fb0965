#include "dtensor/nn/parallel/fully_shard.h"

#include <algorithm>
#include <memory>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "dtensor/autograd/ops.h"
#include "dtensor/tensor/status.h"

namespace dtensor::nn {
namespace {
constexpr const char* kAttachment = "fsdp";
}  // namespace

// The groups under one root: the forward order recorded on the first step (prefetching
// follows it), the reduce-scatter in flight, and whether this backward pass has queued its
// end.
class FsdpTree {
 public:
  std::vector<FsdpGroup*> groups;  // every group of the tree, the root last
  std::vector<FsdpGroup*> order;   // forward order
  bool recorded = false;
  bool recording = false;
  bool end_queued = false;
  FsdpGroup* reducing = nullptr;  // whose reduce-scatter is in flight

  FsdpGroup* Next(const FsdpGroup& g, int delta) const {
    const int i = g.order_index_ + delta;
    if (!recorded || g.order_index_ < 0 || i < 0 || i >= static_cast<int>(order.size())) return nullptr;
    return order[static_cast<size_t>(i)];
  }
};

// The hooks FullyShard installs; each runs on the rank's own thread.
struct FsdpHooks {
  static absl::Status PreForward(FsdpGroup& g) {
    FsdpTree& t = *g.tree_;
    if (g.is_root_) {
      // A step begins: settle what a previous forward left (a pass that failed, or a forward
      // without backward).
      for (FsdpGroup* x : t.groups) {
        if (x->reduce_pending()) DT_RETURN_IF_ERROR(x->FinishReduce());
        if (x != &g) DT_RETURN_IF_ERROR(x->Reshard());
        x->forwarded_ = false;
        x->queued_starts_.clear();
      }
      t.reducing = nullptr;
      t.end_queued = false;
      t.recording = !t.recorded;
      if (t.recording) t.order.clear();
    }
    if (t.recording) {
      g.order_index_ = static_cast<int>(t.order.size());
      t.order.push_back(&g);
    }
    DT_RETURN_IF_ERROR(g.StartUnshard());
    // Not in a recomputation (a group inside a checkpointed body runs its forward again in
    // backward): the next group in forward order has finished its backward by then.
    if (g.options_.prefetch && !InBackward()) {
      if (FsdpGroup* next = t.Next(g, +1)) DT_RETURN_IF_ERROR(next->StartUnshard());
    }
    DT_RETURN_IF_ERROR(g.Unshard());
    // A module used twice in one forward keeps its first recorded use's start: its
    // post-backward then waits for the backward of every use (and of what ran between them).
    // A later use without grad records nothing and moves nothing.
    if (!g.forwarded_) g.forward_seq_ = NextSequenceNr();
    g.forwarded_ = g.forwarded_ || GradEnabled();
    return absl::OkStatus();
  }

  static absl::Status PostForward(FsdpGroup& g) {
    FsdpTree& t = *g.tree_;
    if (!GradEnabled()) {
      DT_RETURN_IF_ERROR(g.Reshard());  // no backward will follow
    } else if (g.options_.reshard_after_forward && !g.is_root_) {
      DT_RETURN_IF_ERROR(g.Reshard());
    }
    if (g.is_root_ && t.recording) {
      t.recording = false;
      t.recorded = true;
    }
    return absl::OkStatus();
  }

  static absl::Status CastInput(FsdpGroup& g, Variable& in) {
    const MixedPrecisionPolicy& mp = g.options_.mp_policy;
    if (!mp.cast_forward_inputs || !mp.param_dtype.has_value() || !in.defined() ||
        !IsComputeFloat(in.value().dtype()) || in.value().dtype() == *mp.param_dtype) {
      return absl::OkStatus();
    }
    DT_ASSIGN_OR_RETURN(in, Cast(in, *mp.param_dtype));
    return absl::OkStatus();
  }

  static absl::Status CastOutput(FsdpGroup& g, Variable& out) {
    const auto& dtype = g.options_.mp_policy.output_dtype;
    if (!dtype.has_value() || !out.defined() || !IsComputeFloat(out.value().dtype())) return absl::OkStatus();
    DT_ASSIGN_OR_RETURN(out, Cast(out, *dtype));
    return absl::OkStatus();
  }

  // The output's gradient runs PreBackward with the start of the forward that made it.
  static void AttachPreBackward(const std::weak_ptr<FsdpGroup>& weak, Variable& out) {
    if (!out.defined() || !out.requires_grad()) return;
    const uint64_t start = weak.lock()->forward_seq_;
    out.RegisterHook([weak, start](Value&) -> absl::Status {
      const std::shared_ptr<FsdpGroup> g = weak.lock();
      if (g == nullptr) {
        return absl::FailedPreconditionError(
            "[FullyShard] backward reached a sharded module's output after the module was destroyed");
      }
      return PreBackward(*g, start);
    });
  }

  // `start`: the forward_seq_ of the forward whose output's gradient arrived. Its post-backward
  // runs once the pass is past that forward's nodes; a group that two graphs use (two forwards
  // before their backward) is gathered and reduced for each.
  static absl::Status PreBackward(FsdpGroup& g, uint64_t start) {
    FsdpTree& t = *g.tree_;
    // A backward through a graph whose post-backward already ran (retain_graph, a second
    // pass) gathers the parameters again and reduces again: the graph keeps views of them.
    g.forwarded_ = true;
    if (!t.end_queued) {
      t.end_queued = true;
      DT_RETURN_IF_ERROR(QueueBackwardCallback(0, [&t] { return EndBackward(t); }));
      DT_RETURN_IF_ERROR(QueueBackwardFailureCallback([&t] { AbortBackward(t); }));
    }
    DT_RETURN_IF_ERROR(g.StartUnshard());
    if (g.options_.prefetch) {
      FsdpGroup* prev = t.Next(g, -1);
      if (prev != nullptr && prev->forwarded_ && !prev->is_root_) DT_RETURN_IF_ERROR(prev->StartUnshard());
    }
    DT_RETURN_IF_ERROR(g.Unshard());
    if (std::find(g.queued_starts_.begin(), g.queued_starts_.end(), start) == g.queued_starts_.end()) {
      g.queued_starts_.push_back(start);
      DT_RETURN_IF_ERROR(QueueBackwardCallback(start, [&g, start] { return PostBackward(g, start); }));
    }
    return absl::OkStatus();
  }

  // The post-backward queued for `start`; the group reduces and reshards when no other is
  // queued (another graph's backward of it has begun and still reads the gathered parameters).
  static absl::Status PostBackward(FsdpGroup& g, uint64_t start) {
    auto& q = g.queued_starts_;
    q.erase(std::remove(q.begin(), q.end(), start), q.end());
    return q.empty() ? PostBackward(g) : absl::OkStatus();
  }

  static absl::Status PostBackward(FsdpGroup& g) {
    if (!g.forwarded_) return absl::OkStatus();
    g.forwarded_ = false;
    g.queued_starts_.clear();
    FsdpTree& t = *g.tree_;
    if (g.unsharded()) DT_RETURN_IF_ERROR(g.StartReduce());
    DT_RETURN_IF_ERROR(g.Reshard());
    // At most one reduce-scatter in flight: the one before this group's is awaited now (on a
    // GPU by the compute stream; the end of the pass waits on the host, so a failed peer is
    // an error within the timeout).
    FsdpGroup* prev = t.reducing;
    t.reducing = g.reduce_pending() ? &g : nullptr;
    if (prev != nullptr && prev != &g) DT_RETURN_IF_ERROR(prev->FinishReduce(/*host_wait=*/false));
    return absl::OkStatus();
  }

  // The end of the backward pass: groups whose post-backward did not run (their output had
  // no gradient), kept HSDP sums still to all-reduce, then the last reduce-scatter.
  static absl::Status EndBackward(FsdpTree& t) {
    t.end_queued = false;
    for (auto it = t.groups.rbegin(); it != t.groups.rend(); ++it) DT_RETURN_IF_ERROR(PostBackward(**it));
    // Sums that earlier passes kept without gradient sync (reduce_scatter), or HSDP's kept for
    // this all_reduce, of groups this pass did not use.
    for (FsdpGroup* g : t.groups) DT_RETURN_IF_ERROR(g->StartKeptReduce());
    for (FsdpGroup* g : t.groups) DT_RETURN_IF_ERROR(g->StartKeptAllReduce());
    for (FsdpGroup* g : t.groups) {
      if (g->reduce_pending()) DT_RETURN_IF_ERROR(g->FinishReduce());
    }
    t.reducing = nullptr;
    return absl::OkStatus();
  }

  // A backward pass that failed: its queued post-backwards and end will not run. Back to the
  // state between steps: nothing in flight (a reduction started is waited for and dropped, not
  // added after the user's zero_grad), no sums kept from earlier micro-batches (some groups
  // would have moved theirs into the dropped reductions already), every group sharded (the
  // partial unsharded gradients dropped), so that the next forward, or a backward of another
  // graph, starts clean.
  static void AbortBackward(FsdpTree& t) {
    t.end_queued = false;
    t.reducing = nullptr;
    for (FsdpGroup* g : t.groups) {
      g->DiscardReduce();
      g->DiscardKept();
      g->queued_starts_.clear();
      g->forwarded_ = false;
      g->Reshard().IgnoreError();  // the pass failed already; a later gather reports a dead peer
    }
  }

  // Optimizers and state dicts read the sharded parameters whatever the group's state;
  // zero_grad reaches the gradient kept aside while gathered (fsdp_group.h).
  static void InstallParamHooks(const std::weak_ptr<FsdpGroup>& weak, FsdpGroup& g) { g.InstallParamHooks(weak); }

  static void Adopt(FsdpGroup& root, std::vector<FsdpGroup*> below) {
    auto tree = std::make_shared<FsdpTree>();
    auto held = std::make_shared<FsdpGroup::Held>();
    root.held_ = held;
    for (FsdpGroup* g : below) {
      g->held_ = held;
      g->tree_ = tree;
      g->is_root_ = false;
      tree->groups.push_back(g);
    }
    root.tree_ = tree;
    root.is_root_ = true;
    tree->groups.push_back(&root);
  }
};

FsdpGroup* FsdpGroupOf(const Module& module) {
  return static_cast<FsdpGroup*>(module.GetAttachment(kAttachment).get());
}

absl::StatusOr<FsdpGroup*> FullyShard(Module& module, const DeviceMesh& mesh, const FsdpOptions& options) {
  std::vector<std::pair<std::string, Variable*>> named = module.NamedParameters();
  if (FsdpGroupOf(module) != nullptr) {
    std::vector<std::string> names;
    for (size_t i = 0; i < named.size() && i < 4; ++i) names.push_back(named[i].first);
    return InvalidArg("FullyShard", "the module holding [", absl::StrJoin(names, ", "), named.size() > 4 ? ", ..." : "",
                      "] is sharded already");
  }
  // Parameters that groups below already own stay theirs.
  absl::flat_hash_set<const VariableImpl*> owned;
  std::vector<FsdpGroup*> below;
  for (auto& [name, m] : module.NamedModules()) {
    if (m == &module) continue;
    if (FsdpGroup* g = FsdpGroupOf(*m)) {
      below.push_back(g);
      for (const std::string& p : g->param_names()) {
        // Names in g are relative to m; find the Variable through m.
        if (Variable* v = m->FindParameter(p)) owned.insert(v->id());
      }
    }
  }
  std::vector<std::pair<std::string, Variable*>> mine;
  for (auto& [name, v] : named) {
    if (!owned.contains(v->id())) mine.emplace_back(name, v);
  }
  DT_ASSIGN_OR_RETURN(std::shared_ptr<FsdpGroup> group, FsdpGroup::Create(std::move(mine), mesh, options));
  FsdpGroup* g = group.get();
  FsdpHooks::Adopt(*g, below);
  const std::weak_ptr<FsdpGroup> weak = group;
  FsdpHooks::InstallParamHooks(weak, *g);
  module.SetAttachment(kAttachment, std::move(group));
  module.RegisterForwardPreHook([g](Module&) { return FsdpHooks::PreForward(*g); });
  module.RegisterForwardHook([g](Module&) { return FsdpHooks::PostForward(*g); });
  module.RegisterForwardInputHook([g](Module&, Variable& in) { return FsdpHooks::CastInput(*g, in); });
  module.RegisterForwardOutputHook([g, weak](Module&, Variable& out) {
    DT_RETURN_IF_ERROR(FsdpHooks::CastOutput(*g, out));
    FsdpHooks::AttachPreBackward(weak, out);
    return absl::OkStatus();
  });
  return g;
}

namespace {
template <typename Fn>
void ForEachGroup(Module& module, Fn fn) {
  for (auto& [name, m] : module.NamedModules()) {
    if (FsdpGroup* g = FsdpGroupOf(*m)) fn(*g);
  }
}
}  // namespace

void SetRequiresGradientSync(Module& module, bool sync) {
  ForEachGroup(module, [sync](FsdpGroup& g) { g.set_requires_gradient_sync(sync); });
}
void SetRequiresAllReduce(Module& module, bool all_reduce) {
  ForEachGroup(module, [all_reduce](FsdpGroup& g) { g.set_requires_all_reduce(all_reduce); });
}
void SetReshardAfterForward(Module& module, bool reshard) {
  ForEachGroup(module, [reshard](FsdpGroup& g) { g.set_reshard_after_forward(reshard); });
}

}  // namespace dtensor::nn
