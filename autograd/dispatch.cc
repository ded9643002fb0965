#include "dtensor/autograd/dispatch.h"

#include <limits>
#include <memory>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "dtensor/tensor/status.h"

namespace dtensor {
namespace {

// The cache key: op, input shapes / dtypes / layouts, static args, mesh shape. Lookups hash
// the call's Values directly (KeyView, heterogeneous lookup); the Key is built only on a miss.
struct Key {
  const OpDef* op;
  absl::InlinedVector<Shape, 4> shapes;
  absl::InlinedVector<DType, 4> dtypes;
  absl::InlinedVector<Layout, 4> layouts;
  absl::InlinedVector<bool, 4> plain;  // a plain Tensor (read as Replicate)
  OpArgs args;
  Shape mesh_shape;
  size_t hash;
};

struct KeyView {
  const OpDef* op;
  absl::Span<const Value> inputs;
  const OpArgs* args;
  IntSpan mesh_shape;
  size_t hash;
};

inline size_t Mix(size_t h, size_t v) { return (h ^ v) * 0x9E3779B97F4A7C15ull + (h >> 29); }

size_t HashCall(const OpDef* op, absl::Span<const Value> inputs, const OpArgs& args, IntSpan mesh_shape) {
  size_t h = Mix(0, reinterpret_cast<uintptr_t>(op));
  for (const Value& v : inputs) {
    for (int64_t d : v.shape()) h = Mix(h, static_cast<size_t>(d));
    h = Mix(h, 0xD1 + static_cast<size_t>(v.dtype()) + (static_cast<size_t>(v.dim()) << 8));
    h = Mix(h, v.is_dtensor() ? absl::Hash<Layout>()(v.dtensor().layout()) : 0x5EED);
  }
  h = Mix(h, absl::Hash<OpArgs>()(args));
  for (int64_t d : mesh_shape) h = Mix(h, static_cast<size_t>(d));
  return h;
}

struct KeyHash {
  using is_transparent = void;
  size_t operator()(const Key& k) const { return k.hash; }
  size_t operator()(const KeyView& k) const { return k.hash; }
};

bool LayoutMatches(const Layout& l, bool plain, const Value& v) {
  if (plain != !v.is_dtensor()) return false;
  return plain || l == v.dtensor().layout();
}

struct KeyEq {
  using is_transparent = void;
  bool operator()(const Key& a, const Key& b) const {
    return a.op == b.op && a.shapes == b.shapes && a.dtypes == b.dtypes && a.layouts == b.layouts &&
           a.plain == b.plain && a.args == b.args && a.mesh_shape == b.mesh_shape;
  }
  bool operator()(const Key& a, const KeyView& b) const {
    if (a.op != b.op || a.shapes.size() != b.inputs.size() || !(a.args == *b.args) ||
        IntSpan(a.mesh_shape) != b.mesh_shape) {
      return false;
    }
    for (size_t i = 0; i < b.inputs.size(); ++i) {
      const Value& v = b.inputs[i];
      if (IntSpan(a.shapes[i]) != v.shape() || a.dtypes[i] != v.dtype() ||
          !LayoutMatches(a.layouts[i], a.plain[i], v)) {
        return false;
      }
    }
    return true;
  }
  bool operator()(const KeyView& b, const Key& a) const { return (*this)(a, b); }
};

struct Choice {
  std::vector<Layout> inputs;
  std::vector<Layout> outputs;
  std::vector<TensorMeta> in_meta;
  std::vector<TensorMeta> out_meta;
  double cost = 0;
  bool verified = false;  // output local shapes checked once
};

struct OpsState {
  // At kMaxChoices entries the cache starts over (shapes that keep changing would grow it
  // without end); a dispatch in progress holds its choice.
  static constexpr size_t kMaxChoices = 4096;
  absl::flat_hash_map<Key, std::shared_ptr<Choice>, KeyHash, KeyEq> cache;
  DispatchStats stats;
};

OpsState& OpsStateOf(const DeviceMesh& mesh) {
  std::shared_ptr<void>& slot = mesh.root().ops_state;
  if (slot == nullptr) slot = std::make_shared<OpsState>();
  return *static_cast<OpsState*>(slot.get());
}

absl::Status Invalid(const OpDef& op, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat("[", op.name, "] ", what));
}

// The mesh of the first DTensor input (nullptr when none); all DTensors must share it.
absl::StatusOr<const DeviceMesh*> CommonMesh(const OpDef& op, absl::Span<const Value> inputs) {
  const DeviceMesh* mesh = nullptr;
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!inputs[i].defined()) return Invalid(op, absl::StrCat("input ", i, " is undefined"));
    if (!inputs[i].is_dtensor()) continue;
    const DeviceMesh& m = inputs[i].dtensor().mesh();
    if (mesh == nullptr) {
      mesh = &m;
    } else if (!mesh->SameAs(m)) {
      return Invalid(op, absl::StrCat("inputs on different meshes: ", mesh->ToString(), " and ", m.ToString()));
    }
  }
  return mesh;
}

Layout CurrentLayout(const Value& v, int mesh_ndim) {
  if (v.is_dtensor()) return v.dtensor().layout();
  return Layout(absl::InlinedVector<Placement, 4>(static_cast<size_t>(mesh_ndim), Replicate()));
}

// Every combination of one DimStrategy per mesh dim, in preference order (mesh dim 0 varies
// slowest), as normalised layouts; combinations with mixed Partial ops are dropped.
absl::StatusOr<std::vector<OpStrategy>> Enumerate(const OpDef& op, absl::Span<const TensorMeta> in, const OpArgs& args,
                                                  IntSpan mesh_shape, size_t num_outputs) {
  std::vector<DimStrategy> dims;
  op.rule(in, args, mesh_shape, &dims);
  DimStrategy all_r;
  all_r.inputs.assign(in.size(), Replicate());
  all_r.outputs.assign(num_outputs, Replicate());
  dims.push_back(all_r);
  for (const DimStrategy& d : dims) {
    if (d.inputs.size() != in.size() || d.outputs.size() != num_outputs) {
      return absl::InternalError(absl::StrCat("[", op.name, "] sharding rule gives ", d.inputs.size(), " inputs and ",
                                              d.outputs.size(), " outputs, expected ", in.size(), " and ",
                                              num_outputs));
    }
  }
  const int k = static_cast<int>(mesh_shape.size());
  std::vector<OpStrategy> out;
  std::vector<size_t> pick(static_cast<size_t>(k), 0);
  while (true) {
    OpStrategy s;
    bool ok = true;
    auto build = [&](size_t n, bool is_input, std::vector<Layout>* layouts, absl::Span<const TensorMeta> metas) {
      for (size_t t = 0; t < n && ok; ++t) {
        absl::InlinedVector<Placement, 4> ps;
        for (int m = 0; m < k; ++m) {
          const DimStrategy& d = dims[pick[static_cast<size_t>(m)]];
          ps.push_back(is_input ? d.inputs[t] : d.outputs[t]);
        }
        const int64_t ndim = metas.empty() ? 0 : static_cast<int64_t>(metas[t].shape.size());
        auto l = NormalizeLayout(op.name, Layout(ps), metas.empty() ? 8 : ndim, k);
        if (!l.ok()) {
          ok = false;
        } else {
          layouts->push_back(*std::move(l));
        }
      }
    };
    build(in.size(), true, &s.inputs, in);
    build(num_outputs, false, &s.outputs, {});
    for (int m = 0; m < k && ok; ++m) {  // strategies limited to some mesh dims
      ok = m >= 64 || ((dims[pick[static_cast<size_t>(m)]].mesh_dims >> m) & 1) != 0;
    }
    for (size_t j = 0; j < dims.size() && ok; ++j) {  // sizes that must divide by the shard count
      if (dims[j].divisible.empty()) continue;
      int64_t shards = 1;
      for (int m = 0; m < k; ++m) shards *= pick[static_cast<size_t>(m)] == j ? mesh_shape[static_cast<size_t>(m)] : 1;
      for (int64_t size : dims[j].divisible) ok = ok && size % shards == 0;
    }
    if (ok) out.push_back(std::move(s));
    int m = k - 1;
    while (m >= 0 && ++pick[static_cast<size_t>(m)] == dims.size()) pick[static_cast<size_t>(m--)] = 0;
    if (m < 0) break;
  }
  return out;
}

absl::StatusOr<std::shared_ptr<Choice>> Choose(const OpDef& op, absl::Span<const Value> inputs, const OpArgs& args,
                                               const DeviceMesh& mesh) {
  OpsState& state = OpsStateOf(mesh);
  const KeyView view{&op, inputs, &args, mesh.shape(), HashCall(&op, inputs, args, mesh.shape())};
  auto it = state.cache.find(view);
  if (it != state.cache.end()) {
    ++state.stats.hits;
    return it->second;
  }
  ++state.stats.misses;
  Key key{&op, {}, {}, {}, {}, args, Shape(mesh.shape().begin(), mesh.shape().end()), view.hash};
  for (const Value& v : inputs) {
    key.shapes.emplace_back(v.shape().begin(), v.shape().end());
    key.dtypes.push_back(v.dtype());
    key.layouts.push_back(CurrentLayout(v, mesh.ndim()));
    key.plain.push_back(!v.is_dtensor());
  }
  auto choice = std::make_shared<Choice>();
  for (size_t i = 0; i < inputs.size(); ++i) choice->in_meta.push_back({key.shapes[i], key.dtypes[i]});
  DT_ASSIGN_OR_RETURN(choice->out_meta, op.meta(choice->in_meta, args));
  DT_ASSIGN_OR_RETURN(std::vector<OpStrategy> all,
                      Enumerate(op, choice->in_meta, args, mesh.shape(), choice->out_meta.size()));
  // The cheapest strategy: fewest bytes moved, then fewest inputs redistributed at all (so
  // Replicate inputs stay Replicate rather than being sliced to a free Shard), then the rule's
  // order. Output layouts must fit the output shapes (a rule may not know them).
  double best = std::numeric_limits<double>::infinity();
  int best_moves = std::numeric_limits<int>::max();
  const OpStrategy* pick = nullptr;
  RedistributePlanner& planner = PlannerOf(mesh);
  for (const OpStrategy& s : all) {
    bool ok = true;
    for (size_t o = 0; o < s.outputs.size() && ok; ++o) {
      ok = NormalizeLayout(op.name, s.outputs[o], static_cast<int64_t>(choice->out_meta[o].shape.size()), mesh.ndim())
               .ok();
    }
    double cost = 0;
    int moves = 0;
    for (size_t i = 0; i < inputs.size() && ok; ++i) {
      if (key.layouts[i] == s.inputs[i]) continue;
      ++moves;
      auto plan = planner.Plan(key.shapes[i], mesh.shape(), key.layouts[i], s.inputs[i],
                               static_cast<int64_t>(ElementSize(key.dtypes[i])));
      if (!plan.ok()) {
        ok = false;
      } else {
        cost += (*plan)->cost;
      }
    }
    if (ok && (cost < best || (cost == best && moves < best_moves))) {
      best = cost;
      best_moves = moves;
      pick = &s;
    }
  }
  if (pick == nullptr) {
    std::vector<std::string> ls;
    for (const Layout& l : key.layouts) ls.push_back(l.ToString());
    return Invalid(op, absl::StrCat("no sharding strategy for input layouts ", absl::StrJoin(ls, ", ")));
  }
  choice->inputs = pick->inputs;
  choice->outputs = pick->outputs;
  choice->cost = best;
  if (state.cache.size() >= OpsState::kMaxChoices) state.cache.clear();
  state.cache.emplace(std::move(key), choice);
  return choice;
}

absl::StatusOr<std::vector<Value>> RunChoice(const OpDef& op, Choice& c, absl::Span<const Value> inputs,
                                             const OpArgs& args, const DeviceMesh& mesh) {
  absl::InlinedVector<Tensor, 5> locals;
  locals.reserve(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    const Value& v = inputs[i];
    if (v.is_dtensor()) {
      if (v.dtensor().layout() == c.inputs[i]) {
        locals.push_back(v.local());
      } else {
        DT_ASSIGN_OR_RETURN(DTensor r, v.dtensor().Redistribute(c.inputs[i]));
        locals.push_back(r.ToLocal());
      }
    } else if (c.inputs[i].is_replicated()) {
      locals.push_back(v.local());
    } else {
      // A plain tensor is Replicate: take this rank's piece of it (no communication).
      DT_ASSIGN_OR_RETURN(DTensor d, DTensor::Distribute(v.local(), mesh, c.inputs[i], {.src_rank = std::nullopt}));
      locals.push_back(d.ToLocal());
    }
  }
  uint64_t plain = 0;
  for (size_t i = 0; i < inputs.size() && i < 64; ++i) {
    if (!inputs[i].is_dtensor()) plain |= uint64_t{1} << i;
  }
  LocalCall call{locals, args, c.in_meta, c.out_meta, &mesh, c.inputs, c.outputs, plain};
  DT_ASSIGN_OR_RETURN(std::vector<Tensor> outs, op.local(call));
  if (outs.size() != c.outputs.size()) {
    return absl::InternalError(
        absl::StrCat("[", op.name, "] local function returned ", outs.size(), " outputs, expected ", c.outputs.size()));
  }
  std::vector<Value> result;
  result.reserve(outs.size());
  for (size_t o = 0; o < outs.size(); ++o) {
    if (!c.verified) {
      DT_ASSIGN_OR_RETURN(DTensor d,
                          DTensor::FromLocal(outs[o], mesh, c.outputs[o], {.global_shape = c.out_meta[o].shape}));
      result.emplace_back(std::move(d));
    } else {
      result.emplace_back(DTensor::WrapTrusted(std::move(outs[o]), mesh, c.outputs[o], c.out_meta[o].shape));
    }
  }
  c.verified = true;
  return result;
}

}  // namespace

Shape LocalCall::InputOffset(int i) const {
  const TensorMeta& m = input_meta[static_cast<size_t>(i)];
  if (mesh == nullptr) return Shape(m.shape.size(), 0);
  return LocalBoxOf(m.shape, mesh->shape(), input_layouts[static_cast<size_t>(i)], mesh->coordinate()).offset;
}

Shape LocalCall::OutputOffset(int i) const {
  const TensorMeta& m = output_meta[static_cast<size_t>(i)];
  if (mesh == nullptr) return Shape(m.shape.size(), 0);
  return LocalBoxOf(m.shape, mesh->shape(), output_layouts[static_cast<size_t>(i)], mesh->coordinate()).offset;
}

namespace {

thread_local internal::DispatchObserver* t_observer = nullptr;

absl::StatusOr<std::vector<Value>> DispatchUnobserved(const OpDef& op, absl::Span<const Value> inputs,
                                                      const OpArgs& args) {
  DT_ASSIGN_OR_RETURN(const DeviceMesh* mesh, CommonMesh(op, inputs));
  if (mesh == nullptr) {
    absl::InlinedVector<Tensor, 5> locals;
    absl::InlinedVector<TensorMeta, 5> metas;
    for (const Value& v : inputs) {
      locals.push_back(v.local());
      metas.push_back({Shape(v.shape().begin(), v.shape().end()), v.dtype()});
    }
    LocalCall call{locals, args, metas, {}, nullptr, {}, {}};
    DT_ASSIGN_OR_RETURN(std::vector<Tensor> outs, op.local(call));
    return std::vector<Value>(outs.begin(), outs.end());
  }
  DT_ASSIGN_OR_RETURN(const std::shared_ptr<Choice> c, Choose(op, inputs, args, *mesh));
  return RunChoice(op, *c, inputs, args, *mesh);
}

}  // namespace

internal::DispatchObserver* internal::SetDispatchObserver(DispatchObserver* observer) {
  DispatchObserver* prev = t_observer;
  t_observer = observer;
  return prev;
}

absl::StatusOr<std::vector<Value>> internal::RunObserved(const OpDef& op, absl::Span<const Value> inputs,
                                                         const OpArgs& args,
                                                         absl::FunctionRef<absl::StatusOr<std::vector<Value>>()> run) {
  if (t_observer == nullptr) return run();
  internal::DispatchObserver* observer = t_observer;
  DT_ASSIGN_OR_RETURN(std::optional<std::vector<Value>> replaced, observer->Replace(op, inputs, args));
  if (replaced.has_value()) return *std::move(replaced);
  DT_ASSIGN_OR_RETURN(std::vector<Value> out, run());
  observer->Ran(op, inputs, args, out);
  return out;
}

absl::StatusOr<std::vector<Value>> Dispatch(const OpDef& op, absl::Span<const Value> inputs, const OpArgs& args) {
  if (t_observer == nullptr) return DispatchUnobserved(op, inputs, args);
  return internal::RunObserved(op, inputs, args, [&] { return DispatchUnobserved(op, inputs, args); });
}

absl::StatusOr<std::string> ExplainStrategy(const OpDef& op, absl::Span<const Value> inputs, const OpArgs& args) {
  DT_ASSIGN_OR_RETURN(const DeviceMesh* mesh, CommonMesh(op, inputs));
  if (mesh == nullptr) return std::string(op.name) + ": local";
  DT_ASSIGN_OR_RETURN(const std::shared_ptr<Choice> c, Choose(op, inputs, args, *mesh));
  std::vector<std::string> in, out;
  for (const Layout& l : c->inputs) in.push_back(l.ToString());
  for (const Layout& l : c->outputs) out.push_back(l.ToString());
  return absl::StrCat(op.name, ": ", absl::StrJoin(in, ", "), " -> ", absl::StrJoin(out, ", "), " (cost ", c->cost,
                      ")");
}

absl::StatusOr<std::vector<OpStrategy>> EnumerateStrategies(const OpDef& op, absl::Span<const TensorMeta> in,
                                                            const OpArgs& args, IntSpan mesh_shape) {
  DT_ASSIGN_OR_RETURN(std::vector<TensorMeta> out_meta, op.meta(in, args));
  DT_ASSIGN_OR_RETURN(std::vector<OpStrategy> all, Enumerate(op, in, args, mesh_shape, out_meta.size()));
  std::vector<OpStrategy> valid;
  for (OpStrategy& s : all) {
    bool ok = true;
    for (size_t o = 0; o < s.outputs.size() && ok; ++o) {
      ok = NormalizeLayout(op.name, s.outputs[o], static_cast<int64_t>(out_meta[o].shape.size()),
                           static_cast<int>(mesh_shape.size()))
               .ok();
    }
    if (ok) valid.push_back(std::move(s));
  }
  return valid;
}

absl::StatusOr<std::vector<Value>> DispatchWith(const OpDef& op, const OpStrategy& strategy,
                                                absl::Span<const Value> inputs, const OpArgs& args) {
  DT_ASSIGN_OR_RETURN(const DeviceMesh* mesh, CommonMesh(op, inputs));
  if (mesh == nullptr) return Invalid(op, "DispatchWith needs DTensor inputs");
  Choice c;
  for (const Value& v : inputs) c.in_meta.push_back({Shape(v.shape().begin(), v.shape().end()), v.dtype()});
  DT_ASSIGN_OR_RETURN(c.out_meta, op.meta(c.in_meta, args));
  c.inputs = strategy.inputs;
  c.outputs = strategy.outputs;
  return RunChoice(op, c, inputs, args, *mesh);
}

DispatchStats DispatchStatsOf(const DeviceMesh& mesh) {
  const OpsState& state = OpsStateOf(mesh);
  DispatchStats s = state.stats;
  s.cached = static_cast<int64_t>(state.cache.size());
  return s;
}

}  // namespace dtensor
