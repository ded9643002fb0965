#include "dtensor/core/plan.h"

#include <algorithm>
#include <optional>
#include <queue>
#include <tuple>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "dtensor/tensor/status.h"

namespace dtensor {
namespace {

using Dims = absl::InlinedVector<int, 4>;

// Bytes scaled by the mesh size M, exact: a group of s ranks (s divides M) sends
// bytes x (s-1)/s, i.e. bytes x (s-1) x (M/s) / M. Doubles would round (s-1)/s for s = 3, 6,
// ... and break ties between equal plans (one merged collective vs several) by an ulp.
using Scaled = __int128;

// The search's cost: bytes first, then fewer collectives, then fewer steps.
struct Cost {
  Scaled bytes = 0;
  int collectives = 0;
  int steps = 0;
  friend bool operator<(const Cost& a, const Cost& b) {
    return std::tie(a.bytes, a.collectives, a.steps) < std::tie(b.bytes, b.collectives, b.steps);
  }
  Cost operator+(const Cost& o) const { return {bytes + o.bytes, collectives + o.collectives, steps + o.steps}; }
};

int64_t GroupSize(IntSpan mesh_shape, const Dims& dims) {
  int64_t s = 1;
  for (int m : dims) s *= mesh_shape[static_cast<size_t>(m)];
  return s;
}

// The layout with every size-1 mesh dim Replicate: such dims never change data.
Layout Canonical(const Layout& l, IntSpan mesh_shape) {
  Layout out = l;
  for (int m = 0; m < l.ndim(); ++m) {
    if (mesh_shape[static_cast<size_t>(m)] == 1 && !l[m].is_replicate()) out = out.WithPlacement(m, Replicate());
  }
  return out;
}

struct Planner {
  IntSpan global_shape;
  IntSpan mesh_shape;
  int64_t element_size;
  Layout target;
  Shape zero;         // coordinate 0
  int64_t mesh_size;  // M of Scaled
  // Narrow search: a mesh dim only ever becomes the target's shard of it (by chunk,
  // reduce_scatter or all_to_all). Wide: chunks and reduce_scatters to any shard (replicas
  // that each take a piece reduce less), which finds cheaper plans but explores many more
  // layouts; all_to_all stays narrow (its assignments are most of the moves).
  bool narrow = false;

  // Memoised: the searches weigh many moves into the same layouts.
  mutable absl::flat_hash_map<Layout, int64_t> box_bytes;
  int64_t BoxBytes(const Layout& l) const {
    auto [it, added] = box_bytes.try_emplace(l, 0);
    if (added) it->second = LocalBoxOf(global_shape, mesh_shape, l, zero).numel() * element_size;
    return it->second;
  }

  // A step and its exact cost (Scaled).
  struct Move {
    RedistributeStep step;
    Scaled cost = 0;
  };

  Move Make(StepKind kind, Dims dims, const Layout& before, const Layout& after) const {
    Move move{RedistributeStep{kind, std::move(dims), before, after, 0}, 0};
    const int64_t s = GroupSize(mesh_shape, move.step.mesh_dims);
    const Scaled share = static_cast<Scaled>(s - 1) * (mesh_size / s);  // (s-1)/s, times M
    int64_t bytes = 0;
    switch (kind) {
      case StepKind::kAllGather:
        bytes = BoxBytes(after);
        break;
      case StepKind::kAllReduce:
        bytes = 2 * BoxBytes(before);
        break;
      case StepKind::kReduceScatter:
        bytes = BoxBytes(before);
        break;
      case StepKind::kAllToAll:
        // The larger of the two boxes: with uneven pieces rank 0's may grow.
        bytes = std::max(BoxBytes(before), BoxBytes(after));
        break;
      default:
        return move;
    }
    move.cost = share * bytes;
    move.step.cost = static_cast<double>(move.cost) / static_cast<double>(mesh_size);
    return move;
  }

  // Calls fn(layout) for every way of making each mesh dim of `group` (Replicate in `base`),
  // until fn returns false,
  // a shard of some tensor dim, appended innermost in every order (duplicates included).
  // Unless `any_shard`, a mesh dim that the target shards only becomes that shard (sharding
  // it along another dim would have to be undone later, and the search space stays small).
  template <typename Fn>
  void ForEachShardAssignment(const Dims& group, const Layout& base, bool any_shard, Fn fn) const {
    const int64_t nd = static_cast<int64_t>(global_shape.size());
    if (nd == 0) return;
    Dims order = group;
    std::sort(order.begin(), order.end());
    do {
      // choices[i]: the tensor dims mesh dim order[i] may shard; to[i] indexes them.
      std::vector<absl::InlinedVector<int64_t, 4>> choices(order.size());
      for (size_t i = 0; i < order.size(); ++i) {
        if (!any_shard && target[order[i]].is_shard()) {
          choices[i].push_back(target[order[i]].shard_dim());
        } else {
          for (int64_t e = 0; e < nd; ++e) choices[i].push_back(e);
        }
      }
      std::vector<size_t> to(order.size(), 0);
      while (true) {
        Layout l = base;
        for (size_t i = 0; i < order.size(); ++i) l = l.WithPlacement(order[i], Shard(choices[i][to[i]]));
        if (!fn(l)) return;
        size_t i = 0;
        while (i < to.size() && ++to[i] == choices[i].size()) to[i++] = 0;
        if (i == to.size()) break;
      }
    } while (std::next_permutation(order.begin(), order.end()));
  }

  // Every legal one-step move out of `l` (whose size-1 dims are Replicate); past `limit`
  // moves it stops (then out.size() > limit), so a budget bounds the work, not just the result.
  std::vector<Move> Moves(const Layout& l, size_t limit) const {
    std::vector<Move> out;
    auto room = [&] { return out.size() <= limit; };
    const int64_t nd = static_cast<int64_t>(global_shape.size());
    const int md = l.ndim();
    // Shard -> Replicate (all_gather) and Shard -> Shard (all_to_all): for every tensor dim,
    // its innermost k_d sharders (any k_d, not all 0) form the group G of one collective over
    // the union of those mesh dims — the members' pieces tile the gathered box, whichever
    // dims they split. all_gather makes G Replicate; all_to_all re-shards that box over G in
    // any other arrangement (each member of G a shard of some tensor dim, innermost, in any
    // order), e.g. S(0)S(1) -> S(1)S(0), or S(0)S(0) -> the other shard order, in one step.
    std::vector<Dims> sharders(static_cast<size_t>(nd));
    for (int64_t d = 0; d < nd; ++d) sharders[static_cast<size_t>(d)] = l.ShardMeshDims(d);
    absl::flat_hash_set<Layout> seen;
    std::vector<size_t> k(static_cast<size_t>(nd), 0);
    while (true) {
      size_t d = 0;
      while (d < k.size() && ++k[d] > sharders[d].size()) k[d++] = 0;
      if (d == k.size()) break;
      Dims group;
      Layout gathered = l;
      for (size_t e = 0; e < k.size(); ++e) {
        for (size_t i = sharders[e].size() - k[e]; i < sharders[e].size(); ++i) {
          group.push_back(sharders[e][i]);
          gathered = gathered.WithPlacement(sharders[e][i], Replicate());
        }
      }
      std::sort(group.begin(), group.end());
      out.push_back(Make(StepKind::kAllGather, group, l, gathered));
      ForEachShardAssignment(group, gathered, /*any_shard=*/false, [&](const Layout& moved) {
        if (moved != l && seen.insert(moved).second) out.push_back(Make(StepKind::kAllToAll, group, l, moved));
        return room();
      });
      if (!room()) return out;
    }
    // Partial -> Replicate (all_reduce) and Partial -> Shard (reduce_scatter) over any
    // non-empty set of the Partial dims (one collective on their group).
    Dims partial;
    for (int m = 0; m < md; ++m) {
      if (l[m].is_partial()) partial.push_back(m);
    }
    const uint32_t nsub = 1u << partial.size();
    for (uint32_t sub = 1; sub < nsub; ++sub) {
      Dims group;
      for (size_t i = 0; i < partial.size(); ++i) {
        if (sub & (1u << i)) group.push_back(partial[i]);
      }
      Layout reduced = l;
      for (int m : group) reduced = reduced.WithPlacement(m, Replicate());
      out.push_back(Make(StepKind::kAllReduce, group, l, reduced));
      // reduce_scatter: every member of the group becomes a shard of some tensor dim (several
      // dims at once, in any nesting order); the members' pieces tile the reduced box.
      absl::flat_hash_set<Layout> scattered;
      ForEachShardAssignment(group, reduced, /*any_shard=*/!narrow, [&](const Layout& to) {
        if (scattered.insert(to).second) out.push_back(Make(StepKind::kReduceScatter, group, l, to));
        return room();
      });
      if (!room()) return out;
    }
    // Replicate -> Shard (local chunk) and Replicate -> Partial (local), towards the target.
    const std::optional<PartialOp> current = l.partial_op();
    for (int m = 0; m < md; ++m) {
      if (!l[m].is_replicate() || mesh_shape[static_cast<size_t>(m)] == 1) continue;
      // Towards the target's shard, or (wide search) any shard: replicas that each take a
      // piece can reduce or re-shard less data (P R -> R R on 4x2 moves fewer bytes as chunk,
      // reduce_scatter, all_gather than as one all_reduce), also where the target is Partial:
      // the piece is gathered back, then made Partial locally (P R -> R P on 4x2 likewise).
      if (narrow && target[m].is_shard()) {
        out.push_back(Make(StepKind::kChunk, {m}, l, l.WithPlacement(m, target[m])));
      } else if (!narrow) {
        for (int64_t e = 0; e < nd; ++e) out.push_back(Make(StepKind::kChunk, {m}, l, l.WithPlacement(m, Shard(e))));
      }
      if (target[m].is_partial() && (!current || *current == target[m].partial_op())) {
        out.push_back(Make(StepKind::kToPartial, {m}, l, l.WithPlacement(m, target[m])));
      }
    }
    return out;
  }
};

constexpr size_t kNoBudget = ~size_t{0};
constexpr size_t kWideSearchMoves = 5000;  // a few ms of planning at most

struct Found {
  std::vector<RedistributeStep> steps;
  Cost cost;
};

// A* over layouts from start to goal with p's moves. h = growth of the box at coordinate 0
// still needed to reach the target's, in bytes: a lower bound, since only gathers grow a box
// and a gather costs at least the growth it brings ((s-1)/s x out >= out - in, because
// in >= out/s). With `bound`, only plans cheaper than it are looked for; nullopt when there
// is none, or when more than `budget` moves had to be weighed first.
std::optional<Found> Search(const Planner& p, const Layout& start, const Layout& goal, std::optional<Cost> bound,
                            size_t budget) {
  const int64_t goal_bytes = p.BoxBytes(goal);
  auto h = [&](const Layout& l) {
    return static_cast<Scaled>(std::max<int64_t>(0, goal_bytes - p.BoxBytes(l))) * p.mesh_size;
  };
  struct Node {
    Layout layout;
    Cost g;
    Scaled h = 0;
    int parent = -1;
    int via = -1;  // index into `edges`
  };
  std::vector<Node> nodes;
  std::vector<RedistributeStep> edges;  // every step that improved a node, as found
  absl::flat_hash_map<Layout, int> index;
  using Entry = std::tuple<Cost, Cost, int>;  // (g + h, g, node); ties go to the earlier node
  auto cmp = [](const Entry& a, const Entry& b) {
    if (std::get<0>(b) < std::get<0>(a)) return true;
    if (std::get<0>(a) < std::get<0>(b)) return false;
    return std::get<2>(a) > std::get<2>(b);
  };
  auto f = [](const Cost& g, Scaled h_bytes) { return Cost{g.bytes + h_bytes, g.collectives, g.steps}; };
  auto worth = [&](const Cost& priority) { return !bound || priority < *bound; };
  std::priority_queue<Entry, std::vector<Entry>, decltype(cmp)> queue(cmp);
  nodes.push_back(Node{start, Cost{}, h(start), -1, -1});
  index[start] = 0;
  queue.push({f(Cost{}, nodes[0].h), Cost{}, 0});
  int found = -1;
  while (!queue.empty()) {
    auto [priority, g, id] = queue.top();
    queue.pop();
    if (!worth(priority)) break;  // every plan left costs at least the bound
    Node& node = nodes[static_cast<size_t>(id)];
    if (node.g < g) continue;  // a stale entry: the node was reached more cheaply since
    if (node.layout == goal) {
      found = id;
      break;
    }
    const Layout here = node.layout;
    std::vector<Planner::Move> moves = p.Moves(here, budget);
    if (moves.size() > budget) return std::nullopt;
    budget -= moves.size();
    for (Planner::Move& move : moves) {
      RedistributeStep& step = move.step;
      const Cost next = g + Cost{move.cost, step.is_collective() ? 1 : 0, 1};
      auto it = index.find(step.after);
      if (it == index.end()) {
        const Scaled hn = h(step.after);
        if (!worth(f(next, hn))) continue;
        index.emplace(step.after, static_cast<int>(nodes.size()));
        edges.push_back(std::move(step));
        nodes.push_back(Node{edges.back().after, next, hn, id, static_cast<int>(edges.size()) - 1});
        queue.push({f(next, hn), next, static_cast<int>(nodes.size()) - 1});
      } else {
        Node& n = nodes[static_cast<size_t>(it->second)];
        if (next < n.g && worth(f(next, n.h))) {  // also re-opens an expanded node: h need not be consistent
          edges.push_back(std::move(step));
          n.g = next;
          n.parent = id;
          n.via = static_cast<int>(edges.size()) - 1;
          queue.push({f(next, n.h), next, it->second});
        }
      }
    }
  }
  if (found < 0) return std::nullopt;
  Found out;
  out.cost = nodes[static_cast<size_t>(found)].g;
  for (int id = found; nodes[static_cast<size_t>(id)].parent >= 0; id = nodes[static_cast<size_t>(id)].parent) {
    out.steps.push_back(edges[static_cast<size_t>(nodes[static_cast<size_t>(id)].via)]);
  }
  std::reverse(out.steps.begin(), out.steps.end());
  return out;
}

}  // namespace

const char* StepKindName(StepKind kind) {
  switch (kind) {
    case StepKind::kAllGather:
      return "all_gather";
    case StepKind::kAllReduce:
      return "all_reduce";
    case StepKind::kReduceScatter:
      return "reduce_scatter";
    case StepKind::kAllToAll:
      return "all_to_all";
    case StepKind::kChunk:
      return "chunk";
    case StepKind::kToPartial:
      return "to_partial";
    case StepKind::kRelabel:
      return "relabel";
  }
  return "?";
}

CommKind RedistributeStep::comm_kind() const {
  switch (kind) {
    case StepKind::kAllGather:
      return CommKind::kAllGather;
    case StepKind::kAllReduce:
      return CommKind::kAllReduce;
    case StepKind::kReduceScatter:
      return CommKind::kReduceScatter;
    default:
      return CommKind::kAllToAll;
  }
}

std::vector<Shape> GroupCoords(IntSpan mesh_shape, IntSpan coord, absl::Span<const int> dims) {
  Dims sorted(dims.begin(), dims.end());
  std::sort(sorted.begin(), sorted.end());
  int64_t n = 1;
  for (int m : sorted) n *= mesh_shape[static_cast<size_t>(m)];
  std::vector<Shape> out;
  out.reserve(static_cast<size_t>(n));
  for (int64_t j = 0; j < n; ++j) {
    Shape c(coord.begin(), coord.end());
    int64_t rest = j;
    for (size_t i = sorted.size(); i-- > 0;) {
      const size_t m = static_cast<size_t>(sorted[i]);
      c[m] = rest % mesh_shape[m];
      rest /= mesh_shape[m];
    }
    out.push_back(std::move(c));
  }
  return out;
}

LocalBox Intersect(const LocalBox& a, const LocalBox& b) {
  LocalBox out;
  for (size_t d = 0; d < a.offset.size(); ++d) {
    const int64_t lo = std::max(a.offset[d], b.offset[d]);
    const int64_t hi = std::min(a.offset[d] + a.shape[d], b.offset[d] + b.shape[d]);
    out.offset.push_back(lo);
    out.shape.push_back(std::max<int64_t>(0, hi - lo));
  }
  return out;
}

int RedistributePlan::num_collectives() const {
  int n = 0;
  for (const RedistributeStep& s : steps) n += s.is_collective() ? 1 : 0;
  return n;
}

std::string RedistributePlan::ToString() const {
  std::string s = src.ToString();
  for (const RedistributeStep& step : steps) absl::StrAppend(&s, " -> ", step.after.ToString());
  return s;
}

std::string RedistributePlan::DebugString() const {
  std::string s;
  for (const RedistributeStep& step : steps) {
    absl::StrAppend(&s, s.empty() ? "" : "\n", StepKindName(step.kind), " on mesh dims {",
                    absl::StrJoin(step.mesh_dims, ","), "}: ", step.before.ToString(), " -> ", step.after.ToString(),
                    absl::StrFormat(" (~%.0f bytes)", step.cost));
  }
  return s.empty() ? absl::StrCat(src.ToString(), ": nothing to do") : s;
}

std::vector<CommRecord> RedistributePlan::PredictComm(IntSpan coord) const {
  std::vector<CommRecord> out;
  for (const RedistributeStep& step : steps) {
    if (!step.is_collective()) continue;
    const Layout& box_layout = step.kind == StepKind::kAllGather ? step.after : step.before;
    const int64_t numel = LocalBoxOf(global_shape, mesh_shape, box_layout, coord).numel();
    out.push_back({step.comm_kind(), numel * element_size});
  }
  return out;
}

absl::StatusOr<RedistributePlan> PlanRedistribute(IntSpan global_shape, IntSpan mesh_shape, const Layout& src,
                                                  const Layout& dst, int64_t element_size) {
  const char* op = "Redistribute";
  const int64_t nd = static_cast<int64_t>(global_shape.size());
  const int md = static_cast<int>(mesh_shape.size());
  RedistributePlan plan;
  DT_ASSIGN_OR_RETURN(plan.src, NormalizeLayout(op, src, nd, md));
  DT_ASSIGN_OR_RETURN(plan.dst, NormalizeLayout(op, dst, nd, md));
  plan.global_shape.assign(global_shape.begin(), global_shape.end());
  plan.mesh_shape.assign(mesh_shape.begin(), mesh_shape.end());
  plan.element_size = element_size;
  for (int m = 0; m < md; ++m) {
    if (mesh_shape[static_cast<size_t>(m)] > 1 && plan.src[m].is_shard() && plan.dst[m].is_partial()) {
      return InvalidArg(op, plan.src.ToString(), " -> ", plan.dst.ToString(), ": mesh dim ", m, " goes from ",
                        plan.src[m].ToString(), " to ", plan.dst[m].ToString(),
                        "; Shard -> Partial is not a legal move");
    }
  }
  const Layout start = Canonical(plan.src, mesh_shape);
  const Layout goal = Canonical(plan.dst, mesh_shape);
  if (start != plan.src) {
    plan.steps.push_back({StepKind::kRelabel, {}, plan.src, start, 0});
  }
  if (start != goal) {
    int64_t mesh_size = 1;
    for (int64_t m : mesh_shape) mesh_size *= m;
    Planner p{global_shape, mesh_shape, element_size, goal, Shape(mesh_shape.size(), 0), mesh_size, false, {}};
    // The narrow search first (small: a mesh dim only becomes the target's shard of it), then
    // the wide one (any shard) for a strictly cheaper plan, bounded by the narrow plan's cost
    // and by kWideSearchMoves moves weighed: past that, the narrow plan stands (4-d meshes).
    p.narrow = true;
    std::optional<Found> narrow = Search(p, start, goal, std::nullopt, kNoBudget);
    if (!narrow) {
      return absl::UnimplementedError(
          absl::StrCat("[Redistribute] no plan from ", plan.src.ToString(), " to ", plan.dst.ToString()));
    }
    // Only a reduction gains from the detour (replicas each reducing a piece: the examples
    // in plan_test); the wide search would multiply planning time for every other pair.
    std::optional<Found> wide;
    if (start.has_partial()) {
      p.narrow = false;
      wide = Search(p, start, goal, narrow->cost, kWideSearchMoves);
    }
    const Found& best = wide && wide->cost < narrow->cost ? *wide : *narrow;
    plan.steps.insert(plan.steps.end(), best.steps.begin(), best.steps.end());
  }
  if (goal != plan.dst) {
    plan.steps.push_back({StepKind::kRelabel, {}, goal, plan.dst, 0});
  }
  for (const RedistributeStep& s : plan.steps) plan.cost += s.cost;
  return plan;
}

absl::StatusOr<std::shared_ptr<const RedistributePlan>> RedistributePlanner::Plan(IntSpan global_shape,
                                                                                  IntSpan mesh_shape, const Layout& src,
                                                                                  const Layout& dst,
                                                                                  int64_t element_size) {
  Key key{Shape(global_shape.begin(), global_shape.end()), Shape(mesh_shape.begin(), mesh_shape.end()), src, dst,
          element_size};
  auto it = cache_.find(key);
  if (it != cache_.end()) {
    ++hits_;
    return it->second;
  }
  ++misses_;
  DT_ASSIGN_OR_RETURN(RedistributePlan plan, PlanRedistribute(global_shape, mesh_shape, src, dst, element_size));
  auto shared = std::make_shared<const RedistributePlan>(std::move(plan));
  if (cache_.size() >= kMaxPlans) cache_.clear();  // holders keep their plans
  cache_.emplace(std::move(key), shared);
  return shared;
}

}  // namespace dtensor
