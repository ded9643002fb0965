#include "dtensor/core/plan.h"

#include <algorithm>
#include <optional>
#include <queue>
#include <tuple>

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

// The layout with every size-1 mesh dim Replicate: such dims never change data.
Layout Canonical(const Layout& l, IntSpan mesh_shape) {
  Layout out = l;
  for (int m = 0; m < l.ndim(); ++m) {
    if (mesh_shape[static_cast<size_t>(m)] == 1 && !l[m].is_replicate()) out = out.WithPlacement(m, Replicate());
  }
  return out;
}

// What the packed state below can hold.
constexpr int kPlanMaxMeshDims = 8;
constexpr int kPlanMaxTensorDims = 8;

// A normalised layout packed into 64 bits for the search, so that moving, comparing and
// hashing layouts costs a few instructions: byte m is mesh dim m, its placement in the low 4
// bits (0 R, 1 + d S(d), 9 + op P(op)) and, for a shard, its nest level among the sharders
// of its tensor dim in the high 4 (0 outermost, dense as in Layout). Equal layouts pack equal.
struct Packed {
  static constexpr int kReplicate = 0;
  static constexpr int kShard0 = 1;
  static constexpr int kPartial0 = kShard0 + kPlanMaxTensorDims;
  uint64_t bits = 0;

  int code(int m) const { return static_cast<int>((bits >> (8 * m)) & 0xF); }
  int level(int m) const { return static_cast<int>((bits >> (8 * m + 4)) & 0xF); }
  bool is_shard(int m) const { return code(m) >= kShard0 && code(m) < kPartial0; }
  bool is_partial(int m) const { return code(m) >= kPartial0; }
  int shard_dim(int m) const { return code(m) - kShard0; }
  void Set(int m, int code, int level) {
    const int shift = 8 * m;
    bits = (bits & ~(uint64_t{0xFF} << shift)) | (static_cast<uint64_t>(code | (level << 4)) << shift);
  }
  friend bool operator==(Packed a, Packed b) { return a.bits == b.bits; }
};

Packed Pack(const Layout& l) {
  Packed p;
  for (int m = 0; m < l.ndim(); ++m) {
    const Placement& pl = l[m];
    if (pl.is_shard()) {
      p.Set(m, Packed::kShard0 + static_cast<int>(pl.shard_dim()), l.nest_level(m));
    } else if (pl.is_partial()) {
      p.Set(m, Packed::kPartial0 + static_cast<int>(pl.partial_op()), 0);
    }
  }
  return p;
}

Layout Unpack(Packed p, int mesh_ndim, int tensor_ndim) {
  Placements ps;
  for (int m = 0; m < mesh_ndim; ++m) {
    if (p.is_shard(m)) {
      ps.push_back(Shard(p.shard_dim(m)));
    } else if (p.is_partial(m)) {
      ps.push_back(Partial(static_cast<PartialOp>(p.code(m) - Packed::kPartial0)));
    } else {
      ps.push_back(Replicate());
    }
  }
  Layout out(ps);
  for (int d = 0; d < tensor_ndim; ++d) {
    Dims dims;
    for (int m = 0; m < mesh_ndim; ++m) {
      if (p.is_shard(m) && p.shard_dim(m) == d) dims.push_back(m);
    }
    if (dims.size() < 2) continue;
    std::sort(dims.begin(), dims.end(), [&](int a, int b) { return p.level(a) < p.level(b); });
    // Cannot fail: dims are exactly the sharders of d.
    if (absl::StatusOr<Layout> ordered = out.WithShardOrder(d, dims); ordered.ok()) out = *std::move(ordered);
  }
  return out;
}

// The sharders of every tensor dim of a packed layout, outermost first.
struct Nest {
  int dims[kPlanMaxTensorDims][kPlanMaxMeshDims];
  int count[kPlanMaxTensorDims];
};

struct Planner {
  IntSpan global_shape;
  IntSpan mesh_shape;
  int64_t element_size;
  Packed target;
  int md;             // mesh dims
  int nd;             // tensor dims
  int64_t mesh_size;  // M of Scaled
  // Which shards a Replicate or Partial mesh dim may become (by chunk, reduce_scatter or
  // all_to_all). kNarrow: where the target shards it, only that shard. kWide: any shard
  // (replicas that each take a piece reduce or move less), which finds cheaper plans but
  // weighs many more moves. kWideReductions: chunks and reduce_scatters to any shard,
  // all_to_alls narrow — most of kWide's gains at a fraction of its moves.
  enum class Breadth { kNarrow, kWideReductions, kWide };
  Breadth breadth = Breadth::kNarrow;

  // extent[d][mask]: the size along tensor dim d of the box at coordinate 0 when the mesh
  // dims in `mask` shard it: ceil(n / k) for the product k of their sizes, in any nest order
  // (nested ceil-divisions compose). Filled by Init.
  std::vector<int64_t> extent;

  void Init() {
    const size_t masks = size_t{1} << md;
    extent.assign(static_cast<size_t>(nd) * masks, 0);
    for (int d = 0; d < nd; ++d) {
      for (size_t mask = 0; mask < masks; ++mask) {
        int64_t k = 1;
        for (int m = 0; m < md; ++m) {
          if (mask & (size_t{1} << m)) k *= mesh_shape[static_cast<size_t>(m)];
        }
        extent[static_cast<size_t>(d) * masks + mask] = (global_shape[static_cast<size_t>(d)] + k - 1) / k;
      }
    }
  }

  // Bytes of the box at coordinate 0 when mask[d] are the mesh dims sharding tensor dim d.
  int64_t BoxBytes(const uint32_t* mask) const {
    int64_t bytes = element_size;
    for (int d = 0; d < nd; ++d) bytes *= extent[(static_cast<size_t>(d) << md) + mask[d]];
    return bytes;
  }
  int64_t BoxBytes(Packed l) const {
    uint32_t mask[kPlanMaxTensorDims] = {};
    for (int m = 0; m < md; ++m) {
      if (l.is_shard(m)) mask[l.shard_dim(m)] |= 1u << m;
    }
    return BoxBytes(mask);
  }

  // (s-1)/s for the group of mesh dims in `mask`, times M (exact: s divides M).
  Scaled Share(uint32_t mask) const {
    int64_t s = 1;
    for (int m = 0; m < md; ++m) {
      if (mask & (1u << m)) s *= mesh_shape[static_cast<size_t>(m)];
    }
    return static_cast<Scaled>(s - 1) * (mesh_size / s);
  }

  Nest NestOf(Packed l) const {
    Nest n;
    std::fill(n.count, n.count + nd, 0);
    for (int m = 0; m < md; ++m) {
      if (l.is_shard(m)) {
        n.dims[l.shard_dim(m)][l.level(m)] = m;
        ++n.count[l.shard_dim(m)];
      }
    }
    return n;
  }

  // l with mesh dim m (Replicate in l) made the innermost sharder of tensor dim d.
  Packed Append(Packed l, int m, int d) const {
    int level = 0;
    for (int o = 0; o < md; ++o) level += l.is_shard(o) && l.shard_dim(o) == d ? 1 : 0;
    l.Set(m, Packed::kShard0 + d, level);
    return l;
  }

  // Calls fn(layout, box bytes) for every distinct way of making the mesh dims
  // `members[0, n)` (Replicate in `base`) shards, each of some tensor dim, appended innermost
  // in every order among those that shard the same dim, until fn returns false (then returns
  // false). Unless `any_shard`, a member the target shards only becomes that shard. (The
  // search weighs millions of these: levels and box bytes come from `base` once, and the box
  // once per assignment, which every order of it shares.)
  template <typename Fn>
  bool ForEachShardAssignment(const int* members, int n, Packed base, bool any_shard, Fn&& fn) const {
    if (nd == 0) return true;  // a 0-d tensor has nothing to shard
    int base_count[kPlanMaxTensorDims] = {};
    uint32_t base_mask[kPlanMaxTensorDims] = {};
    for (int m = 0; m < md; ++m) {
      if (base.is_shard(m)) {
        ++base_count[base.shard_dim(m)];
        base_mask[base.shard_dim(m)] |= 1u << m;
      }
    }
    int lo[kPlanMaxMeshDims], hi[kPlanMaxMeshDims], to[kPlanMaxMeshDims];
    for (int i = 0; i < n; ++i) {
      const int m = members[i];
      if (!any_shard && target.is_shard(m)) {
        lo[i] = target.shard_dim(m);
        hi[i] = lo[i] + 1;
      } else {
        lo[i] = 0;
        hi[i] = nd;
      }
      to[i] = lo[i];
    }
    while (true) {
      // The members per tensor dim, ascending; then every order of each dim's list.
      int lists[kPlanMaxTensorDims][kPlanMaxMeshDims];
      int count[kPlanMaxTensorDims];
      uint32_t mask[kPlanMaxTensorDims];
      std::fill(count, count + nd, 0);
      std::copy(base_mask, base_mask + nd, mask);
      for (int i = 0; i < n; ++i) {
        lists[to[i]][count[to[i]]++] = members[i];
        mask[to[i]] |= 1u << members[i];
      }
      const int64_t x_bytes = BoxBytes(mask);
      while (true) {
        Packed x = base;
        for (int d = 0; d < nd; ++d) {
          for (int j = 0; j < count[d]; ++j) x.Set(lists[d][j], Packed::kShard0 + d, base_count[d] + j);
        }
        if (!fn(x, x_bytes)) return false;
        int d = 0;
        while (d < nd && !std::next_permutation(lists[d], lists[d] + count[d])) ++d;
        if (d == nd) break;
      }
      int i = 0;
      while (i < n && ++to[i] == hi[i]) {
        to[i] = lo[i];
        ++i;
      }
      if (i == n) return true;
    }
  }

  // Calls fn(kind, group mask, after, cost, BoxBytes(after)) for every legal one-step move out
  // of `l` (whose size-1 mesh dims are Replicate), until fn returns false.
  template <typename Fn>
  void ForEachMove(Packed l, Fn&& fn) const {
    const int64_t bytes = BoxBytes(l);
    // Shard -> Replicate (all_gather) and Shard -> Shard (all_to_all): for every tensor dim,
    // its innermost k_d sharders (any k_d, not all 0) form the group G of one collective over
    // the union of those mesh dims — the members' pieces tile the gathered box, whichever
    // dims they split. all_gather makes G Replicate; all_to_all re-shards that box over G in
    // any other arrangement (each member of G a shard of some tensor dim, innermost, in any
    // order), e.g. S(0)S(1) -> S(1)S(0), or S(0)S(0) -> the other shard order, in one step.
    const Nest nest = NestOf(l);
    int k[kPlanMaxTensorDims] = {};
    while (true) {
      int d = 0;
      while (d < nd && ++k[d] > nest.count[d]) k[d++] = 0;
      if (d == nd) break;
      uint32_t mask = 0;
      Packed gathered = l;
      for (int e = 0; e < nd; ++e) {
        for (int i = nest.count[e] - k[e]; i < nest.count[e]; ++i) {
          mask |= 1u << nest.dims[e][i];
          gathered.Set(nest.dims[e][i], Packed::kReplicate, 0);
        }
      }
      int members[kPlanMaxMeshDims];
      int n = 0;
      for (int m = 0; m < md; ++m) {
        if (mask & (1u << m)) members[n++] = m;
      }
      const Scaled share = Share(mask);
      const int64_t gathered_bytes = BoxBytes(gathered);
      if (!fn(StepKind::kAllGather, mask, gathered, share * gathered_bytes, gathered_bytes)) return;
      const bool more =
          ForEachShardAssignment(members, n, gathered, breadth == Breadth::kWide, [&](Packed x, int64_t x_bytes) {
            return x == l || fn(StepKind::kAllToAll, mask, x, share * std::max(bytes, x_bytes), x_bytes);
          });
      if (!more) return;
    }
    // Partial -> Replicate (all_reduce) and Partial -> Shard (reduce_scatter) over any
    // non-empty set of the Partial dims (one collective on their group); reduce_scatter makes
    // every member of the group a shard of some tensor dim (several dims at once, in any
    // nesting order): the members' pieces tile the reduced box.
    int partial[kPlanMaxMeshDims];
    int np = 0;
    int partial_code = -1;
    for (int m = 0; m < md; ++m) {
      if (l.is_partial(m)) {
        partial[np++] = m;
        partial_code = l.code(m);
      }
    }
    for (uint32_t sub = 1; sub < (1u << np); ++sub) {
      uint32_t mask = 0;
      int members[kPlanMaxMeshDims];
      int n = 0;
      Packed reduced = l;
      for (int i = 0; i < np; ++i) {
        if (sub & (1u << i)) {
          mask |= 1u << partial[i];
          members[n++] = partial[i];
          reduced.Set(partial[i], Packed::kReplicate, 0);
        }
      }
      const Scaled share = Share(mask);
      if (!fn(StepKind::kAllReduce, mask, reduced, 2 * share * bytes, bytes)) return;
      const bool more = ForEachShardAssignment(
          members, n, reduced, breadth != Breadth::kNarrow,
          [&](Packed x, int64_t x_bytes) { return fn(StepKind::kReduceScatter, mask, x, share * bytes, x_bytes); });
      if (!more) return;
    }
    // Replicate -> Shard (local chunk) and Replicate -> Partial (local), towards the target.
    for (int m = 0; m < md; ++m) {
      if (l.code(m) != Packed::kReplicate || mesh_shape[static_cast<size_t>(m)] == 1) continue;
      // Towards the target's shard, or (wide search) any shard: replicas that each take a
      // piece can reduce or re-shard less data (P R -> R R on 4x2 moves fewer bytes as chunk,
      // reduce_scatter, all_gather than as one all_reduce), also where the target is Partial:
      // the piece is gathered back, then made Partial locally (P R -> R P on 4x2 likewise).
      const bool narrow = breadth == Breadth::kNarrow;
      if (narrow && target.is_shard(m)) {
        const Packed x = Append(l, m, target.shard_dim(m));
        if (!fn(StepKind::kChunk, 1u << m, x, 0, BoxBytes(x))) return;
      } else if (!narrow) {
        for (int d = 0; d < nd; ++d) {
          const Packed x = Append(l, m, d);
          if (!fn(StepKind::kChunk, 1u << m, x, 0, BoxBytes(x))) return;
        }
      }
      if (target.is_partial(m) && (partial_code < 0 || partial_code == target.code(m))) {
        Packed x = l;
        x.Set(m, target.code(m), 0);
        if (!fn(StepKind::kToPartial, 1u << m, x, 0, bytes)) return;
      }
    }
  }
};

// Moves each search may weigh (about 0.05-0.09 us a move): past that, the best plan found so
// far stands. (The narrow search weighs far fewer moves per layout.) At 50000,
// the wide searches missed the cheapest plan in 23 of 27136 pairs on 2x2x2x2 with a [5, 6, 7]
// tensor (up to 10% costlier; plan_test's PlanOptimalityTest has ten); at 500000 none, and on
// 5-d meshes over a quarter of sampled plans got cheaper, for about twice the time.
constexpr size_t kNarrowSearchMoves = 250000;
constexpr size_t kWideSearchMoves = 500000;

struct PackedStep {
  StepKind kind;
  uint32_t mask;
  Packed before;
  Packed after;
  Scaled cost;
};

struct Found {
  std::vector<PackedStep> steps;
  Cost cost;
};

// A* over layouts from start to goal with p's moves, pruned by the best plan found so far.
// h = growth of the box at coordinate 0 still needed to reach the target's, in bytes (only
// gathers and all_to_alls grow a box, and they cost at least the growth they bring: (s-1)/s x
// out >= out - in, because in >= out/s), plus the least a reduction still needed costs (see
// below): a lower bound of what is left. Only plans cheaper than `bound` are
// looked for; after `budget` moves weighed, the best one found by then is returned (nullopt
// when there is none).
std::optional<Found> Search(const Planner& p, Packed start, Packed goal, std::optional<Cost> bound, size_t budget) {
  const int64_t goal_bytes = p.BoxBytes(goal);
  Scaled total_bytes = p.element_size;
  for (int64_t n : p.global_shape) total_bytes *= n;
  // Per mesh dim m of size s: (s-1) x total and (s-1)/s x total, scaled (see h).
  Scaled reduce_at[kPlanMaxMeshDims] = {}, reshard_at[kPlanMaxMeshDims] = {};
  for (int m = 0; m < p.md; ++m) {
    const Scaled s = p.mesh_shape[static_cast<size_t>(m)];
    reduce_at[m] = (s - 1) * total_bytes;
    reshard_at[m] = (s - 1) * total_bytes / s;
  }
  auto h = [&](Packed l, int64_t l_bytes) {
    Scaled growth = static_cast<Scaled>(std::max<int64_t>(0, goal_bytes - l_bytes)) * p.mesh_size;
    // A Partial dim the goal does not keep must be reduced, on a box of at least total / K
    // bytes (K: the product of the other mesh dims, which can shard it at most), sending
    // (s-1)/s of it, times M = s K: (s-1) x total, scaled. Reductions grow no box, so this
    // adds to the growth.
    // Likewise a shard the goal does not have in that place (another dim, another nest level,
    // or none) must go through an all_gather or all_to_all of a group holding it, of a box of
    // at least total / M bytes: (s-1)/s of it, scaled, at least. It may be the gather that
    // brings the growth: the larger of the two counts.
    Scaled reduce = 0, reshard = 0;
    for (int m = 0; m < p.md; ++m) {
      if (l.is_partial(m) && l.code(m) != goal.code(m)) reduce = std::max(reduce, reduce_at[m]);
      if (l.is_shard(m) && (l.code(m) != goal.code(m) || l.level(m) != goal.level(m))) {
        reshard = std::max(reshard, reshard_at[m]);
      }
    }
    return std::max(growth, reshard) + reduce;
  };
  struct Node {
    Packed layout;
    Cost g;
    Scaled h = 0;
    int parent = -1;
    StepKind kind = StepKind::kRelabel;  // the move from the parent
    uint32_t mask = 0;
    Scaled cost = 0;
  };
  std::vector<Node> nodes;
  absl::flat_hash_map<uint64_t, int> index;
  using Entry = std::pair<Cost, int>;  // (g + h, node); ties go to the earlier node
  auto cmp = [](const Entry& a, const Entry& b) {
    if (b.first < a.first) return true;
    if (a.first < b.first) return false;
    return a.second > b.second;
  };
  auto f = [](const Cost& g, Scaled h_bytes) { return Cost{g.bytes + h_bytes, g.collectives, g.steps}; };
  // Plans must cost less than `limit`: the bound, then the cost of the best plan found (as
  // soon as a move reaches the goal), so every path that cannot beat it is dropped at once.
  std::optional<Cost> limit = bound;
  auto worth = [&](const Cost& priority) { return !limit || priority < *limit; };
  std::priority_queue<Entry, std::vector<Entry>, decltype(cmp)> queue(cmp);
  nodes.push_back(Node{start, Cost{}, h(start, p.BoxBytes(start))});
  index[start.bits] = 0;
  queue.push({f(Cost{}, nodes[0].h), 0});
  bool over_budget = false;
  while (!queue.empty() && !over_budget) {
    const Cost priority = queue.top().first;
    const int id = queue.top().second;
    queue.pop();
    if (!worth(priority)) break;  // every plan left costs at least the best one (or the bound)
    const Node& node = nodes[static_cast<size_t>(id)];
    if (f(node.g, node.h) < priority) continue;  // stale: the node was reached more cheaply since
    if (node.layout == goal) break;              // start == goal
    const Packed here = node.layout;
    const Cost g = node.g;
    p.ForEachMove(here, [&](StepKind kind, uint32_t mask, Packed after, Scaled cost, int64_t after_bytes) {
      if (budget-- == 0) {
        over_budget = true;
        return false;
      }
      const bool collective = kind <= StepKind::kAllToAll;
      const Cost next = g + Cost{cost, collective ? 1 : 0, 1};
      const Scaled hn = h(after, after_bytes);
      const Cost priority_next = f(next, hn);
      if (!worth(priority_next)) return true;
      auto [it, added] = index.try_emplace(after.bits, static_cast<int>(nodes.size()));
      if (added) {
        nodes.push_back(Node{after, next, hn, id, kind, mask, cost});
      } else {
        Node& n = nodes[static_cast<size_t>(it->second)];
        if (!(next < n.g)) return true;
        // Also re-opens an expanded node: h need not be consistent.
        n.g = next;
        n.parent = id;
        n.kind = kind;
        n.mask = mask;
        n.cost = cost;
      }
      if (after == goal) {
        limit = next;  // h(goal) = 0: a plan of cost `next`, the best so far; nothing to expand
      } else {
        queue.push({priority_next, it->second});
      }
      return true;
    });
  }
  // The best plan found: optimal when the queue ran out of nodes that could beat it, the best
  // within the budget otherwise.
  auto reached = index.find(goal.bits);
  if (reached == index.end()) return std::nullopt;
  const int found = reached->second;
  if (bound && !(nodes[static_cast<size_t>(found)].g < *bound)) return std::nullopt;
  Found out;
  out.cost = nodes[static_cast<size_t>(found)].g;
  for (int id = found; nodes[static_cast<size_t>(id)].parent >= 0; id = nodes[static_cast<size_t>(id)].parent) {
    const Node& n = nodes[static_cast<size_t>(id)];
    out.steps.push_back({n.kind, n.mask, nodes[static_cast<size_t>(n.parent)].layout, n.layout, n.cost});
  }
  std::reverse(out.steps.begin(), out.steps.end());
  return out;
}

// A plan that always exists, found without search: all_reduce every Partial dim (on the
// smaller box), all_gather every shard (one collective: each tensor dim's sharders are all
// its innermost ones), then chunk into the target's shards (outermost first, so the nest
// order comes out right) and make its Partial dims locally. The searches start from its cost.
Found Fallback(const Planner& p, Packed start) {
  Found out;
  Packed l = start;
  auto add = [&](StepKind kind, uint32_t mask, Packed after, Scaled cost) {
    out.steps.push_back({kind, mask, l, after, cost});
    out.cost = out.cost + Cost{cost, kind <= StepKind::kAllToAll ? 1 : 0, 1};
    l = after;
  };
  uint32_t partial = 0, shards = 0;
  Packed reduced = l;
  for (int m = 0; m < p.md; ++m) {
    if (l.is_partial(m)) {
      partial |= 1u << m;
      reduced.Set(m, Packed::kReplicate, 0);
    }
  }
  if (partial != 0) add(StepKind::kAllReduce, partial, reduced, 2 * p.Share(partial) * p.BoxBytes(l));
  Packed gathered = l;
  for (int m = 0; m < p.md; ++m) {
    if (l.is_shard(m)) {
      shards |= 1u << m;
      gathered.Set(m, Packed::kReplicate, 0);
    }
  }
  if (shards != 0) add(StepKind::kAllGather, shards, gathered, p.Share(shards) * p.BoxBytes(gathered));
  const Nest nest = p.NestOf(p.target);
  for (int d = 0; d < p.nd; ++d) {
    for (int i = 0; i < nest.count[d]; ++i) {
      add(StepKind::kChunk, 1u << nest.dims[d][i], p.Append(l, nest.dims[d][i], d), 0);
    }
  }
  for (int m = 0; m < p.md; ++m) {
    if (p.target.is_partial(m)) {
      Packed x = l;
      x.Set(m, p.target.code(m), 0);
      add(StepKind::kToPartial, 1u << m, x, 0);
    }
  }
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
  for (int64_t n : mesh_shape) {
    if (n < 1) return InvalidArg(op, "mesh shape ", ShapeString(mesh_shape), ": every mesh dim needs a rank");
  }
  for (int64_t n : global_shape) {
    if (n < 0) return InvalidArg(op, "negative size in global shape ", ShapeString(global_shape));
  }
  if (element_size < 1) return InvalidArg(op, "element size ", element_size, ": an element has at least one byte");
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
    if (md > kPlanMaxMeshDims || nd > kPlanMaxTensorDims) {
      return InvalidArg(op, plan.src.ToString(), " -> ", plan.dst.ToString(), " for a ", nd, "-d tensor on a ", md,
                        "-d mesh: data moves are planned for up to ", kPlanMaxTensorDims, " tensor dims and ",
                        kPlanMaxMeshDims, " mesh dims");
    }
    int64_t mesh_size = 1;
    for (int64_t m : mesh_shape) mesh_size *= m;
    Planner p{global_shape,
              mesh_shape,
              element_size,
              Pack(goal),
              md,
              static_cast<int>(nd),
              mesh_size,
              Planner::Breadth::kNarrow,
              {}};
    p.Init();
    // From the fallback plan, each search looks for a cheaper one: narrow (the target's shards
    // only; it may also match the fallback's cost, and wins that tie), then wide reductions,
    // then wide, each within its budget of moves.
    Found best = Fallback(p, Pack(start));
    for (Planner::Breadth breadth :
         {Planner::Breadth::kNarrow, Planner::Breadth::kWideReductions, Planner::Breadth::kWide}) {
      p.breadth = breadth;
      Cost bound = best.cost;
      if (breadth == Planner::Breadth::kNarrow) ++bound.steps;  // an equal plan too
      const size_t budget = breadth == Planner::Breadth::kNarrow ? kNarrowSearchMoves : kWideSearchMoves;
      if (std::optional<Found> found = Search(p, Pack(start), p.target, bound, budget)) best = *std::move(found);
    }
    for (const PackedStep& s : best.steps) {
      Dims dims;
      for (int m = 0; m < md; ++m) {
        if (s.mask & (1u << m)) dims.push_back(m);
      }
      plan.steps.push_back({s.kind, std::move(dims), Unpack(s.before, md, static_cast<int>(nd)),
                            Unpack(s.after, md, static_cast<int>(nd)),
                            static_cast<double>(s.cost) / static_cast<double>(mesh_size)});
    }
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
  DT_ASSIGN_OR_RETURN(const std::shared_ptr<const RedistributePlan>* plan,
                      PlanRef(global_shape, mesh_shape, src, dst, element_size));
  return *plan;
}

absl::StatusOr<const std::shared_ptr<const RedistributePlan>*> RedistributePlanner::PlanRef(
    IntSpan global_shape, IntSpan mesh_shape, const Layout& src, const Layout& dst, int64_t element_size) {
  const KeyRef ref{global_shape, mesh_shape, src, dst, element_size};
  if (last_ != cache_.end() && KeyEq::Same(Ref(last_->first), ref)) {  // the same as last time
    ++hits_;
    return &last_->second;
  }
  auto it = cache_.find(ref);
  if (it != cache_.end()) {
    ++hits_;
    last_ = it;
    return &it->second;
  }
  ++misses_;
  DT_ASSIGN_OR_RETURN(RedistributePlan plan, PlanRedistribute(global_shape, mesh_shape, src, dst, element_size));
  auto shared = std::make_shared<const RedistributePlan>(std::move(plan));
  if (cache_.size() >= kMaxPlans) cache_.clear();  // holders keep their plans
  last_ = cache_
              .emplace(Key{Shape(global_shape.begin(), global_shape.end()), Shape(mesh_shape.begin(), mesh_shape.end()),
                           src, dst, element_size},
                       std::move(shared))
              .first;
  return &last_->second;
}

}  // namespace dtensor
