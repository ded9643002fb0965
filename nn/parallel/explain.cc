#include "dtensor/nn/parallel/explain.h"

#include <algorithm>
#include <map>
#include <set>
#include <utility>
#include <variant>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "dtensor/core/plan.h"
#include "dtensor/nn/parallel/fully_shard.h"
#include "dtensor/tensor/status.h"

namespace dtensor::nn {
namespace {

constexpr const char* kOp = "ExplainGptStep";
constexpr int64_t kReduceBucketBytes = 25 << 20;  // ReduceGradients' default (optim.h)
const Placement kR = Replicate();
const Placement kP = Partial(PartialOp::kSum);
const Placement kSeq = Shard(1);

bool HasShard(const Layout& l) {
  for (int m = 0; m < l.ndim(); ++m) {
    if (l[m].is_shard()) return true;
  }
  return false;
}

// The walk's state: the mesh, where tp is, and what has been counted.
struct Walk {
  const DeviceMesh* mesh = nullptr;
  int tp = -1;  // the tp mesh dim, or -1
  Shape mesh_shape;
  Shape coord;
  int64_t times = 1;  // micro-batches
  StepExplanation* out = nullptr;
  // Set while walking a block that activation checkpointing recomputes: its forward's
  // collectives run again in backward (its modules' hooks run in the recomputation).
  bool recomputed = false;

  // An activation's layout: Shard(0) over every data-parallel dim, `on_tp` on tp.
  Layout Act(const Placement& on_tp) const {
    Placements p;
    for (int m = 0; m < mesh->ndim(); ++m) p.push_back(m == tp ? on_tp : Placement(Shard(0)));
    return Layout(p);
  }

  void Add(StepPhase phase, CommKind kind, int64_t calls, int64_t bytes, const std::string& what) {
    if (calls == 0) return;
    for (CommExplanation& c : out->comm) {
      if (c.phase == phase && c.kind == kind && c.what == what) {
        c.calls += calls;
        c.bytes += bytes;
        return;
      }
    }
    out->comm.push_back({.phase = phase, .kind = kind, .calls = calls, .bytes = bytes, .what = what});
  }

  // Counts the collectives of src -> dst (planned as DTensor plans it), `n` times.
  absl::Status Move(StepPhase phase, const std::string& what, IntSpan shape, const Layout& src, const Layout& dst,
                    DType dtype, int64_t n) {
    if (src == dst || n == 0) return absl::OkStatus();
    DT_ASSIGN_OR_RETURN(RedistributePlan plan,
                        PlanRedistribute(shape, mesh_shape, src, dst, static_cast<int64_t>(ElementSize(dtype))));
    const std::string label = absl::StrCat(what, " ", src.ToString(), " -> ", dst.ToString());
    for (const CommRecord& r : plan.PredictComm(coord)) {
      Add(phase, r.kind, n, n * r.bytes, label);
      if (recomputed && phase == StepPhase::kForward) {
        Add(StepPhase::kBackward, r.kind, n, n * r.bytes, label + " (recomputed)");
      }
    }
    return absl::OkStatus();
  }
};

// The styles the plan's rules give module `name`, in rule order.
std::vector<const ParallelStyle*> StylesOf(const ParallelizePlan& plan, const std::string& name) {
  std::vector<const ParallelStyle*> s;
  for (const auto& [pattern, style] : plan.rules) {
    if (MatchesModulePattern(pattern, name)) s.push_back(&style);
  }
  return s;
}

// What the walk knows: each module's role in GPT and the styles it models there.
enum class Role { kOther, kWte, kNorm, kPrepare, kColwise, kRowwise, kHead };

Role RoleOf(const std::string& name) {
  if (name == "transformer.wte") return Role::kWte;
  if (name == "lm_head") return Role::kHead;
  if (name == "transformer.ln_f" || absl::EndsWith(name, ".ln_1") || absl::EndsWith(name, ".ln_2")) {
    return Role::kNorm;
  }
  if (absl::EndsWith(name, ".attn") || absl::EndsWith(name, ".mlp")) return Role::kPrepare;
  if (absl::EndsWith(name, ".c_attn") || absl::EndsWith(name, ".c_fc")) return Role::kColwise;
  if (absl::EndsWith(name, ".c_proj")) return Role::kRowwise;
  return Role::kOther;
}

bool IsRS(const Placement& p) { return p == kR || p == kSeq; }

absl::Status Refuse(const std::string& name, const ParallelStyle& style, const std::string& why) {
  return absl::UnimplementedError(absl::StrCat("[", kOp, "] ", StyleToString(style), " on ", name,
                                               ": --explain models the GPT plans' styles only (", why, ")"));
}

// Checks that every style the plan places is one the walk models where it is, one style a
// module, and that the plan's raw placements keep every parameter Replicate on tp.
absl::Status CheckStyles(GPT& model, const ParallelizePlan& plan, const std::string& tp_dim) {
  for (const ParamPlacements& pr : plan.params) {
    for (const auto& [dim, placement] : pr.placements) {
      if (dim == tp_dim && placement != kR) {
        return absl::UnimplementedError(absl::StrCat(
            "[", kOp, "] rule '", pr.text.empty() ? pr.pattern : pr.text, "' places parameters ", placement.ToString(),
            " on ", dim, ": --explain models the GPT plans' styles, with parameters that no style places Replicate"));
      }
    }
  }
  for (auto& [name, m] : model.NamedModules()) {
    const std::vector<const ParallelStyle*> styles = StylesOf(plan, name);
    for (const ParallelStyle* s : styles) {
      if (*s != *styles[0]) {
        return absl::UnimplementedError(absl::StrCat("[", kOp, "] ", name, " is matched by rules with styles ",
                                                     StyleToString(*styles[0]), " and ", StyleToString(*s),
                                                     ": --explain models one style a module"));
      }
    }
    for (const ParallelStyle* s : styles) {
      const Role role = RoleOf(name);
      bool ok = false;
      std::string why;
      if (const auto* r = std::get_if<RowwiseParallel>(s)) {
        ok = (role == Role::kWte || role == Role::kRowwise) && IsRS(r->output_layout) && !r->use_local_output;
        why = "RowwiseParallel on wte and the c_projs, output R or S(1)";
      } else if (const auto* c = std::get_if<ColwiseParallel>(s)) {
        // c_attn fused=3 (its stacked q, k, v); unfused, its [B, T, 3C] output sharded on the
        // last dim splits into q, k and v with collectives the walk does not count.
        const int64_t fused = absl::EndsWith(name, ".c_attn") ? 3 : 1;
        ok = (role == Role::kColwise || role == Role::kHead) && c->output_layout == Placement(Shard(-1)) &&
             !c->use_local_output && c->fused == fused;
        why = "ColwiseParallel on c_attn with fused=3, on c_fc and lm_head unfused, output S(-1)";
      } else if (const auto* q = std::get_if<SequenceParallel>(s)) {
        ok = role == Role::kNorm && q->sequence_dim == 1 && !q->use_local_output;
        why = "SequenceParallel on the norms, dim 1";
      } else if (const auto* p = std::get_if<PrepareModuleInput>(s)) {
        ok = role == Role::kPrepare && IsRS(p->desired_input_layout);
        why = "PrepareModuleInput on attn and mlp, desired R or S(1)";
      } else {
        why = "PrepareModuleOutput is not among them";
      }
      if (!ok) return Refuse(name, *s, why);
    }
  }
  return absl::OkStatus();
}

template <class S>
const S* Find(const ParallelizePlan& plan, const std::string& name) {
  const S* found = nullptr;
  for (const ParallelStyle* s : StylesOf(plan, name)) {
    if (const auto* x = std::get_if<S>(s)) found = x;
  }
  return found;
}

// The walk models plans that split every block's attn and mlp, wte and lm_head alike (or none
// of them): a replicated sublayer or an embedding split without its tied head keeps the
// gradient Partial through modules whose weight gradients then need reductions it does not
// count.
absl::Status CheckSplitAlike(const GPTConfig& cfg, const ParallelizePlan& plan) {
  std::vector<std::pair<std::string, bool>> parts = {
      {"transformer.wte", Find<RowwiseParallel>(plan, "transformer.wte") != nullptr},
      {"lm_head", Find<ColwiseParallel>(plan, "lm_head") != nullptr}};
  for (int64_t i = 0; i < cfg.n_layer; ++i) {
    const std::string h = absl::StrCat("transformer.h.", i);
    parts.emplace_back(h + ".attn.c_attn", Find<ColwiseParallel>(plan, h + ".attn.c_attn") != nullptr);
    parts.emplace_back(h + ".mlp.c_fc", Find<ColwiseParallel>(plan, h + ".mlp.c_fc") != nullptr);
  }
  for (const auto& [name, split] : parts) {
    if (split == parts[0].second) continue;
    const std::string& yes = split ? name : parts[0].first;
    const std::string& no = split ? parts[0].first : name;
    return absl::UnimplementedError(
        absl::StrCat("[", kOp, "] the plan splits ", yes, " but not ", no,
                     ": --explain models plans that split wte, lm_head and every block's attn and mlp alike"));
  }
  return absl::OkStatus();
}

// "transformer.h.3.ln_1.weight" -> "transformer.h.*.ln_1.weight": one line for every block.
std::string AnyBlock(const std::string& name) {
  const std::string h = "transformer.h.";
  if (!absl::StartsWith(name, h)) return name;
  const size_t dot = name.find('.', h.size());
  return dot == std::string::npos ? name : h + "*" + name.substr(dot);
}

std::string LayoutText(const DeviceMesh& mesh, const Layout& l) {
  std::vector<std::string> parts;
  for (int m = 0; m < l.ndim(); ++m)
    parts.push_back(absl::StrCat(mesh.names()[static_cast<size_t>(m)], "=", l[m].ToString()));
  std::string s = absl::StrJoin(parts, " ");
  if (!l.is_default_order()) absl::StrAppend(&s, " (order ", l.ToString(), ")");
  return s;
}

}  // namespace

const char* StepPhaseName(StepPhase phase) {
  switch (phase) {
    case StepPhase::kForward:
      return "forward";
    case StepPhase::kBackward:
      return "backward";
    case StepPhase::kUpdate:
      return "update";
  }
  return "?";
}

absl::StatusOr<StepExplanation> ExplainGptStep(GPT& model, const DeviceMesh& mesh, const ExplainOptions& o) {
  if (o.batch < 1 || o.seq < 1 || o.grad_accum < 1) {
    return absl::InvalidArgumentError(absl::StrCat("[", kOp, "] batch ", o.batch, ", seq ", o.seq, ", grad_accum ",
                                                   o.grad_accum, ": each must be >= 1"));
  }
  StepExplanation e;
  const GPTConfig& cfg = model.config();
  std::vector<std::pair<std::string, Variable*>> named = model.NamedParameters();

  // ---- Parameters and their bytes ----
  for (auto& [name, v] : named) {
    const Value& val = v->value();
    ParamExplanation p{.name = name, .shape = Shape(val.shape().begin(), val.shape().end()), .dtype = val.dtype()};
    if (val.is_dtensor()) {
      const Layout& l = val.dtensor().layout();
      p.layout = LayoutText(mesh, l);
      p.local_shape = LocalBoxOf(val.shape(), mesh.shape(), l, mesh.coordinate()).shape;
    } else {
      p.local_shape = p.shape;
    }
    const int64_t n = NumElements(p.local_shape);
    e.param_bytes += n * static_cast<int64_t>(ElementSize(p.dtype));
    e.grad_bytes += n * static_cast<int64_t>(ElementSize(p.dtype));
    e.optim_bytes += 2 * n * static_cast<int64_t>(sizeof(float));  // AdamW: m and v, float32
    e.params.push_back(std::move(p));
  }
  if (!mesh.defined()) return e;  // one rank: no collectives
  e.mesh = mesh.ToString();

  Walk w{.mesh = &mesh,
         .mesh_shape = Shape(mesh.shape().begin(), mesh.shape().end()),
         .coord = Shape(mesh.coordinate().begin(), mesh.coordinate().end()),
         .times = o.grad_accum,
         .out = &e};
  for (int m = 0; m < mesh.ndim(); ++m) {
    if (mesh.names()[static_cast<size_t>(m)] == o.tp_dim) w.tp = m;
  }
  std::vector<int> dp_dims;  // data-parallel dims of size > 1
  for (int m = 0; m < mesh.ndim(); ++m) {
    if (m != w.tp && mesh.size(m) > 1) dp_dims.push_back(m);
  }

  // FSDP's groups: each block's, then the root's (as the trainer shards them).
  std::vector<FsdpGroup*> blocks;
  for (int64_t i = 0; i < cfg.n_layer; ++i) blocks.push_back(FsdpGroupOf(*model.block(i)));
  FsdpGroup* root = FsdpGroupOf(model);
  const bool fsdp = root != nullptr;
  // Activations: in the dtype FSDP gathers parameters in, else the parameters'.
  DType act = named.empty() ? DType::kFloat32 : named[0].second->value().dtype();
  if (fsdp && root->options().mp_policy.param_dtype.has_value()) act = *root->options().mp_policy.param_dtype;

  // ---- Activations on tp, walked through GPT's modules ----
  const Shape btc = {o.batch, o.seq, cfg.n_embd};
  const int64_t k = o.grad_accum;
  const StepPhase F = StepPhase::kForward, B = StepPhase::kBackward, U = StepPhase::kUpdate;
  std::set<std::string> seq_params;  // Replicate on tp, gradients P on tp (they meet S(1))
  bool loss_parallel = false;
  if (w.tp >= 0) {
    DT_RETURN_IF_ERROR(CheckStyles(model, o.plan, o.tp_dim));
    DT_RETURN_IF_ERROR(CheckSplitAlike(cfg, o.plan));
    Placement a = kR;  // the residual stream on tp
    if (const auto* r = Find<RowwiseParallel>(o.plan, "transformer.wte")) {
      const Placement out = r->output_layout;
      DT_RETURN_IF_ERROR(w.Move(F, "transformer.wte output", btc, w.Act(kP), w.Act(out), act, k));
      // (A colwise consumer sits above every rowwise output, CheckSplitAlike: the gradient that
      // comes back is P where the output is R, see colwise_gradient.)
      DT_RETURN_IF_ERROR(
          w.Move(B, "transformer.wte output gradient", btc, w.Act(out == kR ? kP : out), w.Act(kR), act, k));
      a = out;
    }
    if (a.is_shard()) seq_params.insert("transformer.wpe.weight");
    // A colwise input's gradient is P on tp. It goes back to `a` where a style changed the
    // layout (sequence parallel: reduce_scatter). Where nothing did (a = R) it stays P: the
    // norms' backwards are linear in it, the residual's gradients add as P, and it is
    // all-reduced where a rowwise output's P -> R goes back (Megatron's one all_reduce per
    // sublayer). Either way the gradient of the residual stream, and so of the norms and wpe
    // below it, is partial or sharded on tp: their weights' gradients are P there.
    auto colwise_gradient = [&](const std::string& label) -> absl::Status {
      if (a != kR) return w.Move(B, label + " input gradient", btc, w.Act(kP), w.Act(a), act, k);
      return absl::OkStatus();
    };
    bool partial_below = false;  // a colwise consumer has made the residual's gradient P / S
    // A colwise module's input: `a` -> R (through PrepareModuleInput and the style's own
    // input), its gradient P -> a. A rowwise output: P -> out, its gradient out -> R.
    auto colwise_input = [&](const std::string& prep, const std::string& col,
                             const std::string& label) -> absl::Status {
      Placement x = a;
      if (const auto* p = Find<PrepareModuleInput>(o.plan, prep)) {
        DT_RETURN_IF_ERROR(w.Move(F, label + " input", btc, w.Act(x), w.Act(p->desired_input_layout), act, k));
        x = p->desired_input_layout;
      }
      if (Find<ColwiseParallel>(o.plan, col) == nullptr) {
        return x == a ? absl::OkStatus()
                      : absl::UnimplementedError(absl::StrCat("[", kOp, "] ", prep,
                                                              "'s input changes layout without a "
                                                              "ColwiseParallel ",
                                                              col, ": not modelled"));
      }
      partial_below = true;
      DT_RETURN_IF_ERROR(w.Move(F, col + " input", btc, w.Act(x), w.Act(kR), act, k));
      return colwise_gradient(label);
    };
    auto rowwise_output = [&](const std::string& col, const std::string& row,
                              const std::string& label) -> absl::Status {
      const auto* r = Find<RowwiseParallel>(o.plan, row);
      if ((r == nullptr) != (Find<ColwiseParallel>(o.plan, col) == nullptr)) {
        return absl::UnimplementedError(absl::StrCat("[", kOp, "] ", col, " and ", row,
                                                     ": --explain models ColwiseParallel and RowwiseParallel "
                                                     "as a pair"));
      }
      if (r == nullptr) return absl::OkStatus();
      if (r->output_layout != a) {
        return absl::UnimplementedError(absl::StrCat("[", kOp, "] ", row, "'s output ", r->output_layout.ToString(),
                                                     " differs from the residual stream's ", a.ToString()));
      }
      DT_RETURN_IF_ERROR(w.Move(F, label + " output", btc, w.Act(kP), w.Act(a), act, k));
      return w.Move(B, label + " output gradient", btc, w.Act(a == kR ? kP : a), w.Act(kR), act, k);
    };
    auto norm = [&](const std::string& name) -> absl::Status {
      if (Find<SequenceParallel>(o.plan, name) != nullptr && a != kSeq) {
        return absl::UnimplementedError(
            absl::StrCat("[", kOp, "] SequenceParallel on ", name, " whose input is ", a.ToString(), ", not S(1)"));
      }
      if (a.is_shard()) {
        seq_params.insert(name + ".weight");
        seq_params.insert(name + ".bias");
      }
      return absl::OkStatus();
    };
    const std::vector<int64_t> checkpointed = CheckpointedBlocks(cfg.n_layer, o.ac);
    // selective:op keeping the redistributions' outputs recomputes none of the hooks' collectives.
    const bool keeps_redistributions =
        o.ac.mode == AcOptions::Mode::kSelectiveOp &&
        std::find(o.ac.save_ops.begin(), o.ac.save_ops.end(), "redistribute") != o.ac.save_ops.end();
    for (int64_t i = 0; i < cfg.n_layer; ++i) {
      const std::string h = absl::StrCat("transformer.h.", i);
      w.recomputed =
          !keeps_redistributions && std::find(checkpointed.begin(), checkpointed.end(), i) != checkpointed.end();
      DT_RETURN_IF_ERROR(norm(h + ".ln_1"));
      DT_RETURN_IF_ERROR(colwise_input(h + ".attn", h + ".attn.c_attn", "transformer.h.*.attn"));
      DT_RETURN_IF_ERROR(rowwise_output(h + ".attn.c_attn", h + ".attn.c_proj", "transformer.h.*.attn.c_proj"));
      DT_RETURN_IF_ERROR(norm(h + ".ln_2"));
      DT_RETURN_IF_ERROR(colwise_input(h + ".mlp", h + ".mlp.c_fc", "transformer.h.*.mlp"));
      DT_RETURN_IF_ERROR(rowwise_output(h + ".mlp.c_fc", h + ".mlp.c_proj", "transformer.h.*.mlp.c_proj"));
    }
    w.recomputed = false;
    DT_RETURN_IF_ERROR(norm("transformer.ln_f"));
    if (Find<ColwiseParallel>(o.plan, "lm_head") != nullptr) {
      DT_RETURN_IF_ERROR(w.Move(F, "lm_head input", btc, w.Act(a), w.Act(kR), act, k));
      DT_RETURN_IF_ERROR(colwise_gradient("lm_head"));
      loss_parallel = true;
    }
    if (partial_below) {  // every norm sits below a colwise consumer's gradient, and wpe too
      for (auto& [name, v] : named) {
        if (name == "transformer.wpe.weight" || absl::StrContains(name, ".ln_")) seq_params.insert(name);
      }
    }
  }
  // ---- The loss ----
  if (loss_parallel) {  // max, sum of exponentials, target logit: [rows] each, over tp, in float32
    const Shape bt = {o.batch, o.seq};
    const int64_t rows = LocalBoxOf(bt, w.mesh_shape, w.Act(kR), w.coord).numel();
    w.Add(F, CommKind::kAllReduce, 3 * k, 3 * k * rows * static_cast<int64_t>(sizeof(float)),
          "cross-entropy over vocab shards (loss parallel): max, sum of exponentials, target logit");
  }
  if (!dp_dims.empty()) {
    w.Add(F, CommKind::kAllReduce, k, k * static_cast<int64_t>(sizeof(float)),
          "cross-entropy: the count of targets over the data-parallel dims");
  }

  // ---- Gradients: their layouts before any reduction ----
  auto grad_layout = [&](const std::string& name, const Layout& param) {
    Placements p;
    for (int m = 0; m < mesh.ndim(); ++m) {
      if (m != w.tp) {
        p.push_back(kP);
      } else {
        p.push_back(param[m].is_shard() ? param[m] : (seq_params.contains(name) ? kP : kR));
      }
    }
    return Layout(p);
  };
  if (fsdp) {
    std::vector<FsdpGroup*> groups = blocks;
    groups.push_back(root);
    const int64_t syncs = o.grad_sync_every ? k : 1;
    for (FsdpGroup* g : groups) {
      if (g == nullptr) continue;
      const bool is_root = g == root;
      const std::string label = is_root ? "FSDP root group (wte, wpe, ln_f)" : "FSDP group transformer.h.*";
      const int64_t n = g->num_flat_buffers();
      const int64_t shards = g->shard_size();
      if (shards > 1) {
        w.Add(F, CommKind::kAllGather, n * k, k * g->all_gather_bytes(), label + ": gather parameters");
        if (g->options().reshard_after_forward && !is_root) {
          w.Add(B, CommKind::kAllGather, n * k, k * g->all_gather_bytes(), label + ": gather again for backward");
        }
        w.Add(B, CommKind::kReduceScatter, n * syncs, syncs * g->reduce_scatter_bytes(),
              label + ": reduce-scatter gradients");
      }
      const std::optional<std::string>& rep = g->options().replicate_dim;
      if (rep.has_value()) {
        DT_ASSIGN_OR_RETURN(int r, mesh.DimIndex(*rep));
        if (mesh.size(r) > 1) {
          w.Add(B, CommKind::kAllReduce, n * syncs, syncs * g->reduced_shard_bytes(),
                label + ": all-reduce the gradient shards over " + *rep + " (HSDP)");
        }
      }
    }
    // P-on-tp gradients: all-reduced over tp by each group's post-backward, every pass.
    if (w.tp >= 0) {
      for (auto& [name, v] : named) {
        if (!seq_params.contains(name)) continue;
        Placements src, dst;
        for (int m = 0; m < mesh.ndim(); ++m) {
          src.push_back(kP);
          dst.push_back(m == w.tp ? kR : kP);
        }
        DT_RETURN_IF_ERROR(w.Move(B, "FSDP post-backward: " + AnyBlock(name) + " gradient over tp", v->value().shape(),
                                  Layout(src), Layout(dst), act, k));
      }
    }
  } else {
    // ReduceGradients (optim.h), replayed: Partial-only gradients in buckets, others one by one.
    std::vector<std::pair<std::string, Variable*>> bucket;
    Layout bucket_grad, bucket_param;
    int64_t bucket_numel = 0;
    auto flush = [&]() -> absl::Status {
      if (bucket.empty()) return absl::OkStatus();
      const DType dt = bucket[0].second->value().dtype();
      DT_RETURN_IF_ERROR(w.Move(U, "ReduceGradients bucket", Shape{bucket_numel}, bucket_grad, bucket_param, dt, 1));
      bucket.clear();
      bucket_numel = 0;
      return absl::OkStatus();
    };
    for (auto& [name, v] : named) {
      const Value& val = v->value();
      if (!val.is_dtensor()) continue;
      const Layout& vl = val.dtensor().layout();
      const Layout gl = grad_layout(name, vl);
      if (gl == vl) continue;
      bool size_one_only = true;
      for (int m = 0; m < mesh.ndim(); ++m) {
        if (mesh.size(m) > 1 && gl[m] != vl[m]) size_one_only = false;
      }
      if (size_one_only) continue;
      if (HasShard(gl) || HasShard(vl) || !gl.is_default_order()) {
        DT_RETURN_IF_ERROR(w.Move(U, "ReduceGradients: " + AnyBlock(name), val.shape(), gl, vl, val.dtype(), 1));
        continue;
      }
      if (!bucket.empty() &&
          (bucket_grad != gl || bucket_param != vl || bucket[0].second->value().dtype() != val.dtype())) {
        DT_RETURN_IF_ERROR(flush());
      }
      if (bucket.empty()) {
        bucket_grad = gl;
        bucket_param = vl;
      }
      bucket.emplace_back(name, v);
      bucket_numel += val.numel();
      if (bucket_numel * static_cast<int64_t>(ElementSize(val.dtype())) >= kReduceBucketBytes) {
        DT_RETURN_IF_ERROR(flush());
      }
    }
    DT_RETURN_IF_ERROR(flush());
  }

  // ---- Update: ClipGradNorm's sums of squares, one all_reduce per group of sharding dims ----
  std::map<std::vector<int>, int64_t> clip_groups;
  for (auto& [name, v] : named) {
    const Value& val = v->value();
    if (!val.is_dtensor()) continue;
    std::vector<int> dims;
    for (int m = 0; m < mesh.ndim(); ++m) {
      if (val.dtensor().layout()[m].is_shard() && mesh.size(m) > 1) dims.push_back(m);
    }
    if (!dims.empty()) ++clip_groups[dims];
  }
  for (const auto& [dims, n] : clip_groups) {
    std::vector<std::string> names;
    for (int m : dims) names.push_back(mesh.names()[static_cast<size_t>(m)]);
    w.Add(U, CommKind::kAllReduce, 1, n * static_cast<int64_t>(sizeof(float)),
          absl::StrCat("gradient norm: sums of squares of ", n, " parameters over ", absl::StrJoin(names, ", ")));
  }
  // The loss read-out: P over the data-parallel dims -> Replicate, per micro-batch.
  {
    Placements src, dst;
    for (int m = 0; m < mesh.ndim(); ++m) {
      src.push_back(m == w.tp ? kR : kP);
      dst.push_back(kR);
    }
    DT_RETURN_IF_ERROR(w.Move(U, "the loss read-out", Shape{}, Layout(src), Layout(dst), DType::kFloat32, k));
  }

  // ---- Peak of gathered parameters (FSDP): the root all step, groups kept after forward, and
  // the largest resharded one at its turn (forward order: the blocks in order) ----
  if (fsdp) {
    int64_t held = root->unsharded_buffer_bytes(), peak = held;
    for (FsdpGroup* g : blocks) {
      if (g == nullptr) continue;
      if (g->options().reshard_after_forward) {
        peak = std::max(peak, held + g->unsharded_buffer_bytes());
      } else {
        held += g->unsharded_buffer_bytes();
        peak = std::max(peak, held);
      }
    }
    e.peak_unsharded_bytes = peak;
  }
  std::stable_sort(e.comm.begin(), e.comm.end(),
                   [](const CommExplanation& x, const CommExplanation& y) { return x.phase < y.phase; });
  return e;
}

std::array<CommCounter, 3> StepExplanation::Totals() const {
  std::array<CommCounter, 3> t;
  for (const CommExplanation& c : comm) {
    CommCounter& p = t[static_cast<size_t>(c.phase)];
    for (int64_t i = 0; i < c.calls; ++i) p.Record(c.kind, i == 0 ? c.bytes : 0);
  }
  return t;
}

std::string StepExplanation::ToString() const {
  std::string s = absl::StrCat("explain: ", mesh.empty() ? "one rank, no mesh" : mesh, "; this rank's view\n");
  size_t w = 4;
  for (const ParamExplanation& p : params) w = std::max(w, p.name.size());
  absl::StrAppend(&s, "parameters (", params.size(), "):\n");
  for (const ParamExplanation& p : params) {
    absl::StrAppend(&s,
                    absl::StrFormat("  %-*s %-14s %-40s local %s\n", static_cast<int>(w), p.name, ShapeString(p.shape),
                                    p.layout.empty() ? "(plain)" : p.layout, ShapeString(p.local_shape)));
  }
  absl::StrAppend(&s, "collectives per step:\n");
  if (comm.empty()) absl::StrAppend(&s, "  none\n");
  for (const CommExplanation& c : comm) {
    absl::StrAppend(&s, absl::StrFormat("  %-8s %-14s %5d calls %12d bytes  %s\n", StepPhaseName(c.phase),
                                        CommKindName(c.kind), c.calls, c.bytes, c.what));
  }
  const std::array<CommCounter, 3> t = Totals();
  for (size_t i = 0; i < t.size(); ++i) {
    absl::StrAppend(&s, "  total ", StepPhaseName(static_cast<StepPhase>(i)), ": ", t[i].total_calls(), " calls, ",
                    t[i].total_bytes(), " bytes\n");
  }
  absl::StrAppend(&s, "bytes per rank: parameters ", param_bytes, ", gradients ", grad_bytes, ", optimizer state ",
                  optim_bytes, ", peak gathered parameters (FSDP) ", peak_unsharded_bytes, "\n");
  return s;
}

nlohmann::json StepExplanation::ToJson() const {
  nlohmann::json ps = nlohmann::json::array();
  for (const ParamExplanation& p : params) {
    ps.push_back({{"name", p.name},
                  {"shape", p.shape},
                  {"layout", p.layout},
                  {"local_shape", p.local_shape},
                  {"dtype", DTypeName(p.dtype)}});
  }
  nlohmann::json cs = nlohmann::json::array();
  for (const CommExplanation& c : comm) {
    cs.push_back({{"phase", StepPhaseName(c.phase)},
                  {"kind", CommKindName(c.kind)},
                  {"calls", c.calls},
                  {"bytes", c.bytes},
                  {"what", c.what}});
  }
  return {{"mesh", mesh},
          {"params", ps},
          {"collectives", cs},
          {"comm", CommToJson(Totals())},
          {"param_bytes", param_bytes},
          {"grad_bytes", grad_bytes},
          {"optim_bytes", optim_bytes},
          {"peak_unsharded_bytes", peak_unsharded_bytes}};
}

nlohmann::json CommToJson(const std::array<CommCounter, 3>& phases) {
  nlohmann::json j = nlohmann::json::object();
  for (size_t i = 0; i < phases.size(); ++i) {
    nlohmann::json kinds = nlohmann::json::object();
    for (int k = 0; k < kNumCommKinds; ++k) {
      const CommKind kind = static_cast<CommKind>(k);
      if (phases[i].calls(kind) == 0) continue;
      kinds[CommKindName(kind)] = {{"calls", phases[i].calls(kind)}, {"bytes", phases[i].bytes(kind)}};
    }
    j[StepPhaseName(static_cast<StepPhase>(i))] = kinds;
  }
  return j;
}

}  // namespace dtensor::nn
