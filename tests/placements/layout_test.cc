// Tests of the layout math: torch.chunk pieces (ChunkOf / ChunkSizeOf) against a naive
// list-splitting torch.chunk, every rank's box (LocalBoxOf, ParentRangeOf) for nested shards
// in every order against naive nested chunking of index lists (and the tiling of the tensor
// by the boxes of all ranks), shard orders, WithPlacement, ToString, NormalizeLayout and
// CheckedLocalBoxOf errors.
#include "dtensor/placements/layout.h"

#include <algorithm>
#include <cstdint>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "dtensor/placements/placement.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace dtensor {
namespace {

using ::testing::HasSubstr;
using Index = std::vector<int64_t>;

// ---- Naive references ----

// torch.chunk of a list into k pieces, the way torch does it: pieces of ceil(len / k) taken
// from the front until the list runs out; the remaining pieces (DTensor pads to k) are empty.
std::vector<Index> NaiveChunk(const Index& items, int64_t k) {
  int64_t piece = 0;
  while (piece * k < static_cast<int64_t>(items.size())) ++piece;  // ceil(len / k)
  std::vector<Index> pieces(static_cast<size_t>(k));
  size_t next = 0;
  for (int64_t p = 0; p < k; ++p) {
    for (int64_t j = 0; j < piece && next < items.size(); ++j) pieces[static_cast<size_t>(p)].push_back(items[next++]);
  }
  return pieces;
}

Index Iota(int64_t n) {
  Index v;
  for (int64_t i = 0; i < n; ++i) v.push_back(i);
  return v;
}

// A layout described independently of Layout: placement per mesh dim (shard dims already
// non-negative) and, per tensor dim, the mesh dims that shard it, outermost first.
struct RefLayout {
  std::vector<Placement> placements;
  std::map<int64_t, std::vector<int>> order;
};

// The global indices along each tensor dim that the rank at `coord` holds, by chunking index
// lists level by level. `stop_at`: stop before applying this mesh dim (for parent ranges).
std::vector<Index> NaiveIndices(const Index& global, const Index& mesh, const RefLayout& ref, const Index& coord,
                                int stop_at = -1) {
  std::vector<Index> out;
  for (size_t d = 0; d < global.size(); ++d) {
    Index items = Iota(global[d]);
    auto it = ref.order.find(static_cast<int64_t>(d));
    if (it != ref.order.end()) {
      for (int m : it->second) {
        if (m == stop_at) break;
        items = NaiveChunk(items, mesh[static_cast<size_t>(m)])[static_cast<size_t>(coord[static_cast<size_t>(m)])];
      }
    }
    out.push_back(items);
  }
  return out;
}

// True if `items` is a contiguous ascending run.
bool Contiguous(const Index& items) {
  for (size_t i = 1; i < items.size(); ++i) {
    if (items[i] != items[i - 1] + 1) return false;
  }
  return true;
}

std::vector<Index> AllCoords(const Index& mesh) {
  std::vector<Index> out;
  int64_t n = 1;
  for (int64_t s : mesh) n *= s;
  for (int64_t i = 0; i < n; ++i) {
    Index c(mesh.size());
    int64_t rest = i;
    for (size_t m = mesh.size(); m-- > 0;) {
      c[m] = rest % mesh[m];
      rest /= mesh[m];
    }
    out.push_back(c);
  }
  return out;
}

std::string Str(const Index& v) { return absl::StrCat("[", absl::StrJoin(v, ","), "]"); }

Layout MustOrder(Layout l, int64_t tensor_dim, std::vector<int> dims) {
  absl::StatusOr<Layout> out = l.WithShardOrder(tensor_dim, dims);
  EXPECT_TRUE(out.ok()) << out.status();
  return out.ok() ? *out : l;
}

// ---- ChunkOf / ChunkSizeOf ----

TEST(LayoutTest, FromAVectorOfPlacementsAsFromAList) {
  const std::vector<Placement> ps = {Shard(1), Replicate(), Partial()};
  const Layout a = ps;
  const Layout b({Shard(1), Replicate(), Partial()});
  EXPECT_EQ(a, b);
  EXPECT_EQ(a.ToString(), "S(1)RP(sum)");
}

TEST(ChunkTest, HandComputedTorchChunkExamples) {
  auto sizes = [](int64_t n, int64_t k) {
    Index s;
    for (int64_t i = 0; i < k; ++i) s.push_back(ChunkOf(n, k, i).size);
    return s;
  };
  EXPECT_EQ(sizes(5, 4), (Index{2, 2, 1, 0}));
  EXPECT_EQ(sizes(10, 4), (Index{3, 3, 3, 1}));
  EXPECT_EQ(sizes(6, 4), (Index{2, 2, 2, 0}));
  EXPECT_EQ(sizes(7, 3), (Index{3, 3, 1}));
  EXPECT_EQ(sizes(1, 4), (Index{1, 0, 0, 0}));
  EXPECT_EQ(sizes(0, 3), (Index{0, 0, 0}));
  EXPECT_EQ(sizes(8, 4), (Index{2, 2, 2, 2}));
  EXPECT_EQ(sizes(9, 1), (Index{9}));
  EXPECT_EQ(ChunkOf(10, 4, 3).offset, 9);
  EXPECT_EQ(ChunkOf(10, 4, 2).offset, 6);
  EXPECT_EQ(ChunkSizeOf(5, 4), 2);
  EXPECT_EQ(ChunkSizeOf(10, 4), 3);
  EXPECT_EQ(ChunkSizeOf(0, 4), 0);
  EXPECT_EQ(ChunkSizeOf(8, 4), 2);
}

TEST(ChunkTest, MatchesNaiveTorchChunkForAllSmallSizes) {
  for (int64_t n = 0; n <= 40; ++n) {
    for (int64_t k = 1; k <= 9; ++k) {
      int64_t ceil = 0;
      while (ceil * k < n) ++ceil;
      EXPECT_EQ(ChunkSizeOf(n, k), ceil) << "n=" << n << " k=" << k;
      const std::vector<Index> pieces = NaiveChunk(Iota(n), k);
      int64_t total = 0;
      for (int64_t i = 0; i < k; ++i) {
        const Index& piece = pieces[static_cast<size_t>(i)];
        const ChunkRange r = ChunkOf(n, k, i);
        EXPECT_EQ(r.size, static_cast<int64_t>(piece.size())) << "n=" << n << " k=" << k << " i=" << i;
        EXPECT_LE(r.size, ChunkSizeOf(n, k));
        if (!piece.empty()) {
          EXPECT_EQ(r.offset, piece.front()) << "n=" << n << " k=" << k << " i=" << i;
        } else {
          // An empty piece sits inside [0, n] (no garbage offsets).
          EXPECT_GE(r.offset, 0) << "n=" << n << " k=" << k << " i=" << i;
          EXPECT_LE(r.offset, n) << "n=" << n << " k=" << k << " i=" << i;
        }
        total += r.size;
      }
      EXPECT_EQ(total, n) << "n=" << n << " k=" << k;
    }
  }
}

// ---- LocalBoxOf against nested naive chunking, every layout and every order ----

// Every permutation of `v`.
std::vector<std::vector<int>> Permutations(std::vector<int> v) {
  std::sort(v.begin(), v.end());
  std::vector<std::vector<int>> out;
  do {
    out.push_back(v);
  } while (std::next_permutation(v.begin(), v.end()));
  return out;
}

// Calls fn(layout, ref) for every assignment of {R, S(0), ..., S(nd-1)} to the mesh dims and
// every shard order of every tensor dim.
template <typename Fn>
void ForEachLayout(int mesh_ndim, int64_t tensor_ndim, const Fn& fn) {
  const int64_t options = tensor_ndim + 1;
  int64_t total = 1;
  for (int m = 0; m < mesh_ndim; ++m) total *= options;
  for (int64_t code = 0; code < total; ++code) {
    std::vector<Placement> ps;
    int64_t rest = code;
    for (int m = 0; m < mesh_ndim; ++m) {
      const int64_t o = rest % options;
      rest /= options;
      ps.push_back(o == 0 ? Placement(Replicate()) : Placement(Shard(o - 1)));
    }
    // Orders: the cartesian product of the permutations of each tensor dim's sharders.
    std::vector<std::vector<std::vector<int>>> perms;  // [tensor dim][choice]
    for (int64_t d = 0; d < tensor_ndim; ++d) {
      std::vector<int> sharders;
      for (int m = 0; m < mesh_ndim; ++m) {
        if (ps[static_cast<size_t>(m)].is_shard() && ps[static_cast<size_t>(m)].shard_dim() == d) sharders.push_back(m);
      }
      perms.push_back(Permutations(sharders));
    }
    std::vector<size_t> pick(static_cast<size_t>(tensor_ndim), 0);
    while (true) {
      RefLayout ref{ps, {}};
      Layout layout(ps);
      for (int64_t d = 0; d < tensor_ndim; ++d) {
        const std::vector<int>& order = perms[static_cast<size_t>(d)][pick[static_cast<size_t>(d)]];
        if (order.empty()) continue;
        ref.order[d] = order;
        layout = MustOrder(layout, d, order);
      }
      fn(layout, ref);
      size_t i = 0;
      for (; i < pick.size(); ++i) {
        if (++pick[i] < perms[i].size()) break;
        pick[i] = 0;
      }
      if (i == pick.size()) break;
    }
  }
}

using BoxParam = std::tuple<Index /*mesh*/, Index /*global*/>;

class LocalBoxSweepTest : public ::testing::TestWithParam<BoxParam> {};

TEST_P(LocalBoxSweepTest, MatchesNaiveNestedChunkingAndTilesTheTensor) {
  const auto& mesh = std::get<0>(GetParam());
  const auto& global = std::get<1>(GetParam());
  const int64_t nd = static_cast<int64_t>(global.size());
  const std::vector<Index> coords = AllCoords(mesh);
  int64_t numel = 1;
  for (int64_t s : global) numel *= s;
  int layouts = 0;
  ForEachLayout(static_cast<int>(mesh.size()), nd, [&](const Layout& layout, const RefLayout& ref) {
    ++layouts;
    // Each element must be held by exactly (product of the Replicate mesh dims) ranks.
    int64_t replication = 1;
    for (size_t m = 0; m < mesh.size(); ++m) {
      if (ref.placements[m].is_replicate()) replication *= mesh[m];
    }
    std::vector<int64_t> count(static_cast<size_t>(numel), 0);
    for (const Index& coord : coords) {
      const std::string where =
          absl::StrCat(layout.ToString(), " mesh ", Str(mesh), " global ", Str(global), " coord ", Str(coord));
      const LocalBox box = LocalBoxOf(global, mesh, layout, coord);
      ASSERT_EQ(box.offset.size(), global.size()) << where;
      ASSERT_EQ(box.shape.size(), global.size()) << where;
      const std::vector<Index> idx = NaiveIndices(global, mesh, ref, coord);
      for (int64_t d = 0; d < nd; ++d) {
        const Index& items = idx[static_cast<size_t>(d)];
        ASSERT_TRUE(Contiguous(items)) << where;
        EXPECT_EQ(box.shape[static_cast<size_t>(d)], static_cast<int64_t>(items.size())) << where << " dim " << d;
        if (!items.empty()) {
          EXPECT_EQ(box.offset[static_cast<size_t>(d)], items.front()) << where << " dim " << d;
        } else {
          EXPECT_GE(box.offset[static_cast<size_t>(d)], 0) << where << " dim " << d;
          EXPECT_LE(box.offset[static_cast<size_t>(d)], global[static_cast<size_t>(d)]) << where << " dim " << d;
        }
        // Parent range of each sharder: the indices before that level's chunking.
        auto it = ref.order.find(d);
        if (it == ref.order.end()) continue;
        for (int m : it->second) {
          const Index parent = NaiveIndices(global, mesh, ref, coord, m)[static_cast<size_t>(d)];
          const ChunkRange pr = ParentRangeOf(global, mesh, layout, coord, m);
          EXPECT_EQ(pr.size, static_cast<int64_t>(parent.size())) << where << " parent of mesh dim " << m;
          if (!parent.empty()) {
            EXPECT_EQ(pr.offset, parent.front()) << where << " parent of mesh dim " << m;
          }
        }
      }
      EXPECT_EQ(box.numel(), NumElements(box.shape));
      // Count the box's elements.
      if (box.numel() == 0) continue;
      Index e(global.size(), 0);
      while (true) {
        int64_t linear = 0;
        for (size_t d = 0; d < global.size(); ++d) linear = linear * global[d] + box.offset[d] + e[d];
        ++count[static_cast<size_t>(linear)];
        size_t d = global.size();
        while (d-- > 0) {
          if (++e[d] < box.shape[d]) break;
          e[d] = 0;
        }
        if (d == static_cast<size_t>(-1)) break;
      }
    }
    for (int64_t i = 0; i < numel; ++i) {
      ASSERT_EQ(count[static_cast<size_t>(i)], replication)
          << layout.ToString() << " mesh " << Str(mesh) << " global " << Str(global) << " element " << i;
    }
  });
  EXPECT_GT(layouts, 0);
}

INSTANTIATE_TEST_SUITE_P(
    Meshes, LocalBoxSweepTest,
    ::testing::Combine(::testing::Values(Index{4}, Index{3}, Index{2, 2}, Index{2, 3}, Index{3, 2}, Index{4, 2},
                                         Index{2, 2, 2}, Index{3, 1, 2}, Index{2, 1, 2, 2}),
                       ::testing::Values(Index{5, 3}, Index{7}, Index{10}, Index{0, 3}, Index{1, 1}, Index{9, 5, 2},
                                         Index{13, 4}, Index{2, 6, 11})),
    [](const ::testing::TestParamInfo<BoxParam>& info) {
      return absl::StrCat("mesh", absl::StrJoin(std::get<0>(info.param), "x"), "_shape",
                          absl::StrJoin(std::get<1>(info.param), "x"));
    });

TEST(LocalBoxTest, AnchorsExampleDefaultOrder) {
  // (5, 3) with [S(0), S(0)] on 2x2: mesh dim 0 splits 5 rows 3/2, mesh dim 1 splits each
  // piece with its own size: 3 -> 2/1, 2 -> 1/1. Rows 2/1/1/1 (not 2/2/1/0 as a flat split).
  const Layout l({Shard(0), Shard(0)});
  const Index global = {5, 3}, mesh = {2, 2};
  const std::vector<std::pair<Index, Index>> expect = {// coord -> {row offset, rows}
                                                       {{0, 0}, {0, 2}},
                                                       {{0, 1}, {2, 1}},
                                                       {{1, 0}, {3, 1}},
                                                       {{1, 1}, {4, 1}}};
  for (const auto& [coord, rows] : expect) {
    const LocalBox b = LocalBoxOf(global, mesh, l, coord);
    EXPECT_EQ(b.offset, (Shape{rows[0], 0})) << Str(coord);
    EXPECT_EQ(b.shape, (Shape{rows[1], 3})) << Str(coord);
  }
}

TEST(LocalBoxTest, AnchorsExampleReversedOrder) {
  // Mesh dim 1 first: coord[1] picks 3/2 rows, then coord[0] splits that piece.
  const Layout l = MustOrder(Layout({Shard(0), Shard(0)}), 0, {1, 0});
  const Index global = {5, 3}, mesh = {2, 2};
  const std::vector<std::pair<Index, Index>> expect = {
      {{0, 0}, {0, 2}}, {{1, 0}, {2, 1}}, {{0, 1}, {3, 1}}, {{1, 1}, {4, 1}}};
  for (const auto& [coord, rows] : expect) {
    const LocalBox b = LocalBoxOf(global, mesh, l, coord);
    EXPECT_EQ(b.offset, (Shape{rows[0], 0})) << Str(coord);
    EXPECT_EQ(b.shape, (Shape{rows[1], 3})) << Str(coord);
  }
}

TEST(LocalBoxTest, NestedDiffersFromFlatForUnevenSizes) {
  // 10 rows on 2x2 nested: 5/5 then 3/2 and 3/2 -> rows 3,2,3,2; a flat split over 4 would be 3,3,3,1.
  const Layout l({Shard(0), Shard(0)});
  Index rows;
  for (const Index& c : AllCoords({2, 2})) rows.push_back(LocalBoxOf({10}, {2, 2}, l, c).shape[0]);
  EXPECT_EQ(rows, (Index{3, 2, 3, 2}));
}

TEST(LocalBoxTest, PartialAndReplicateDimsDoNotSplit) {
  const Index global = {6, 4};
  for (const Index& c : AllCoords({2, 3})) {
    const LocalBox a = LocalBoxOf(global, {2, 3}, Layout({Partial(), Shard(1)}), c);
    const LocalBox b = LocalBoxOf(global, {2, 3}, Layout({Replicate(), Shard(1)}), c);
    EXPECT_EQ(a, b) << Str(c);
    EXPECT_EQ(a.shape[0], 6);
  }
  const LocalBox full = LocalBoxOf(global, {2, 3}, Layout({Partial(PartialOp::kMax), Replicate()}), {1, 2});
  EXPECT_EQ(full.offset, (Shape{0, 0}));
  EXPECT_EQ(full.shape, (Shape{6, 4}));
  // A 0-d tensor: an empty box of one element everywhere.
  const LocalBox scalar = LocalBoxOf({}, {2}, Layout({Replicate()}), {1});
  EXPECT_TRUE(scalar.shape.empty());
  EXPECT_EQ(scalar.numel(), 1);
}

// ---- Shard orders ----

TEST(LayoutTest, ShardMeshDimsAndNestLevels) {
  const Layout l({Shard(0), Replicate(), Shard(0), Shard(1)});
  EXPECT_EQ(l.ndim(), 4);
  EXPECT_THAT(l.ShardMeshDims(0), ::testing::ElementsAre(0, 2));
  EXPECT_THAT(l.ShardMeshDims(1), ::testing::ElementsAre(3));
  EXPECT_TRUE(l.ShardMeshDims(2).empty());
  EXPECT_EQ(l.nest_level(0), 0);
  EXPECT_EQ(l.nest_level(2), 1);
  EXPECT_EQ(l.nest_level(3), 0);
  EXPECT_EQ(l.nest_level(1), 0);
  EXPECT_TRUE(l.is_default_order());

  const Layout r = MustOrder(l, 0, {2, 0});
  EXPECT_THAT(r.ShardMeshDims(0), ::testing::ElementsAre(2, 0));
  EXPECT_THAT(r.ShardMeshDims(1), ::testing::ElementsAre(3));
  EXPECT_EQ(r.nest_level(2), 0);
  EXPECT_EQ(r.nest_level(0), 1);
  EXPECT_FALSE(r.is_default_order());
  EXPECT_EQ(r[0], Placement(Shard(0)));
  EXPECT_EQ(r[1], Placement(Replicate()));

  // Three sharders of one dim, in an arbitrary order.
  const Layout three = MustOrder(Layout({Shard(1), Shard(1), Shard(1)}), 1, {2, 0, 1});
  EXPECT_THAT(three.ShardMeshDims(1), ::testing::ElementsAre(2, 0, 1));
  EXPECT_EQ(three.nest_level(2), 0);
  EXPECT_EQ(three.nest_level(0), 1);
  EXPECT_EQ(three.nest_level(1), 2);
}

TEST(LayoutTest, WithShardOrderErrorsNameBothLists) {
  const Layout l({Shard(0), Replicate(), Shard(0)});
  struct Case {
    int64_t tensor_dim;
    std::vector<int> dims;
    std::string given;
  };
  const std::vector<Case> cases = {
      {0, {0}, "{0}"},            // missing a sharder
      {0, {2, 0, 1}, "{2,0,1}"},  // a mesh dim that does not shard dim 0
      {0, {2, 2}, "{2,2}"},       // duplicate
      {0, {}, "{}"},              // empty
      {1, {0}, "{0}"},            // tensor dim 1 has no sharders
      {0, {0, 3}, "{0,3}"},       // out-of-range mesh dim
  };
  for (const Case& c : cases) {
    absl::StatusOr<Layout> out = l.WithShardOrder(c.tensor_dim, c.dims);
    ASSERT_FALSE(out.ok()) << "dim " << c.tensor_dim << " order " << c.given;
    EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(out.status().message(), HasSubstr(c.given));
    EXPECT_THAT(out.status().message(), HasSubstr(c.tensor_dim == 0 ? "{0,2}" : "{}")) << out.status();
  }
  // The trivial orders are fine.
  EXPECT_TRUE(l.WithShardOrder(1, {}).ok());
  EXPECT_TRUE(Layout({Shard(1), Replicate()}).WithShardOrder(1, {0}).ok());
}

TEST(LayoutTest, ToStringShowsNonDefaultOrders) {
  const Layout ss({Shard(0), Shard(0)});
  EXPECT_EQ(ss.ToString(), "S(0)S(0)");
  EXPECT_EQ(MustOrder(ss, 0, {1, 0}).ToString(), "S(0)S(0){0:1,0}");
  EXPECT_EQ(MustOrder(ss, 0, {0, 1}).ToString(), "S(0)S(0)");

  const Layout mixed({Shard(0), Shard(1), Shard(0), Shard(1)});
  EXPECT_EQ(mixed.ToString(), "S(0)S(1)S(0)S(1)");
  const Layout one = MustOrder(mixed, 0, {2, 0});
  EXPECT_EQ(one.ToString(), "S(0)S(1)S(0)S(1){0:2,0}");
  const Layout only_second = MustOrder(mixed, 1, {3, 1});
  EXPECT_EQ(only_second.ToString(), "S(0)S(1)S(0)S(1){1:3,1}");
  const Layout both = MustOrder(one, 1, {3, 1});
  EXPECT_EQ(both.ToString(), "S(0)S(1)S(0)S(1){0:2,0}{1:3,1}");
  EXPECT_EQ(MustOrder(Layout({Shard(2), Shard(2), Shard(2)}), 2, {0, 2, 1}).ToString(), "S(2)S(2)S(2){2:0,2,1}");
  EXPECT_EQ(Layout({Replicate(), Partial(PartialOp::kAvg)}).ToString(), "RP(avg)");
  EXPECT_EQ(Layout().ToString(), "");
}

TEST(LayoutTest, Predicates) {
  EXPECT_TRUE(Layout({Replicate(), Replicate()}).is_replicated());
  EXPECT_FALSE(Layout({Replicate(), Shard(0)}).is_replicated());
  EXPECT_FALSE(Layout({Partial(), Replicate()}).is_replicated());
  EXPECT_TRUE(Layout({Shard(0), Partial(PartialOp::kMin)}).has_partial());
  EXPECT_FALSE(Layout({Shard(0), Replicate()}).has_partial());
  EXPECT_EQ(Layout({Shard(0), Partial(PartialOp::kMin)}).partial_op(), PartialOp::kMin);
  EXPECT_EQ(Layout({Shard(0), Replicate()}).partial_op(), std::nullopt);
  // The first Partial's op (mixed ops are only rejected by NormalizeLayout).
  EXPECT_EQ(Layout({Replicate(), Partial(PartialOp::kMax), Partial(PartialOp::kSum)}).partial_op(), PartialOp::kMax);
}

TEST(LayoutTest, WithPlacementMakesTheNewShardInnermost) {
  // Reversed S(0)S(0) plus a new S(0) on mesh dim 2: the new one is innermost.
  const Layout rev = MustOrder(Layout({Shard(0), Shard(0), Replicate()}), 0, {1, 0});
  const Layout added = rev.WithPlacement(2, Shard(0));
  EXPECT_EQ(PlacementsString(added.placements()), "S(0)S(0)S(0)");
  EXPECT_THAT(added.ShardMeshDims(0), ::testing::ElementsAre(1, 0, 2));
  EXPECT_EQ(added.ToString(), "S(0)S(0)S(0){0:1,0,2}");

  // Replacing an outer sharder by a shard of the same dim moves it to the inside.
  const Layout moved = Layout({Shard(1), Shard(0), Shard(0)}).WithPlacement(0, Shard(0));
  EXPECT_THAT(moved.ShardMeshDims(0), ::testing::ElementsAre(1, 2, 0));
  EXPECT_EQ(moved.ToString(), "S(0)S(0)S(0){0:1,2,0}");

  // Removing a sharder keeps the order of the others.
  const Layout three = MustOrder(Layout({Shard(0), Shard(0), Shard(0)}), 0, {2, 0, 1});
  const Layout removed = three.WithPlacement(0, Replicate());
  EXPECT_THAT(removed.ShardMeshDims(0), ::testing::ElementsAre(2, 1));
  EXPECT_EQ(removed.ToString(), "RS(0)S(0){0:2,1}");
  // Removing the only out-of-order one gives a default layout equal to a fresh one.
  const Layout back = rev.WithPlacement(1, Replicate());
  EXPECT_EQ(back, Layout({Shard(0), Replicate(), Replicate()}));
  EXPECT_TRUE(back.is_default_order());

  // A shard of another dim leaves the old dim's order alone and starts its own.
  const Layout other = rev.WithPlacement(2, Shard(1));
  EXPECT_THAT(other.ShardMeshDims(0), ::testing::ElementsAre(1, 0));
  EXPECT_THAT(other.ShardMeshDims(1), ::testing::ElementsAre(2));
  // Partial in.
  const Layout p = Layout({Shard(0), Shard(0)}).WithPlacement(0, Partial(PartialOp::kAvg));
  EXPECT_EQ(p.ToString(), "P(avg)S(0)");
  EXPECT_EQ(p, Layout({Partial(PartialOp::kAvg), Shard(0)}));
  // The original is unchanged (value semantics).
  EXPECT_EQ(rev.ToString(), "S(0)S(0)R{0:1,0}");
}

// ---- NormalizeLayout ----

TEST(NormalizeLayoutTest, NegativeDimsAreMapped) {
  absl::StatusOr<Layout> n = NormalizeLayout("Op", Layout({Shard(-1), Shard(-3), Replicate()}), 3, 3);
  ASSERT_TRUE(n.ok()) << n.status();
  EXPECT_EQ(*n, Layout({Shard(2), Shard(0), Replicate()}));
  EXPECT_EQ(n->ToString(), "S(2)S(0)R");

  // Negative and positive spellings of one dim become sharders of the same dim, default order.
  absl::StatusOr<Layout> same = NormalizeLayout("Op", Layout({Shard(0), Shard(-2)}), 2, 2);
  ASSERT_TRUE(same.ok()) << same.status();
  EXPECT_EQ(*same, Layout({Shard(0), Shard(0)}));

  // A non-default order survives normalisation.
  const Layout rev = MustOrder(Layout({Shard(-2), Shard(-2)}), -2, {1, 0});
  absl::StatusOr<Layout> nrev = NormalizeLayout("Op", rev, 2, 2);
  ASSERT_TRUE(nrev.ok()) << nrev.status();
  EXPECT_EQ(nrev->ToString(), "S(0)S(0){0:1,0}");
  EXPECT_EQ(*nrev, MustOrder(Layout({Shard(0), Shard(0)}), 0, {1, 0}));

  // Already normal layouts are unchanged; Partial with one op is fine.
  const Layout ok({Partial(PartialOp::kMax), Shard(1), Partial(PartialOp::kMax)});
  absl::StatusOr<Layout> nok = NormalizeLayout("Op", ok, 2, 3);
  ASSERT_TRUE(nok.ok()) << nok.status();
  EXPECT_EQ(*nok, ok);
}

TEST(NormalizeLayoutTest, WrongPlacementCount) {
  absl::StatusOr<Layout> n = NormalizeLayout("MyOp", Layout({Shard(0), Replicate()}), 2, 3);
  ASSERT_FALSE(n.ok());
  EXPECT_EQ(n.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(n.status().message(), HasSubstr("[MyOp]"));
  EXPECT_THAT(n.status().message(), HasSubstr("S(0)R"));
  EXPECT_THAT(n.status().message(), HasSubstr("2 placements"));
  EXPECT_THAT(n.status().message(), HasSubstr("3-d mesh"));
  EXPECT_FALSE(NormalizeLayout("MyOp", Layout({Replicate(), Replicate()}), 2, 1).ok());
  EXPECT_FALSE(NormalizeLayout("MyOp", Layout(), 2, 1).ok());
}

TEST(NormalizeLayoutTest, ShardDimOutOfRange) {
  for (int64_t d : {3, 4, -4, -10}) {
    absl::StatusOr<Layout> n = NormalizeLayout("MyOp", Layout({Replicate(), Shard(d)}), 3, 2);
    ASSERT_FALSE(n.ok()) << d;
    EXPECT_EQ(n.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(n.status().message(), HasSubstr("[MyOp]"));
    EXPECT_THAT(n.status().message(), HasSubstr(absl::StrCat("S(", d, ")")));
    EXPECT_THAT(n.status().message(), HasSubstr("3-d tensor"));
  }
  // A 0-d tensor cannot be sharded at all.
  EXPECT_FALSE(NormalizeLayout("MyOp", Layout({Shard(0)}), 0, 1).ok());
  EXPECT_FALSE(NormalizeLayout("MyOp", Layout({Shard(-1)}), 0, 1).ok());
  EXPECT_TRUE(NormalizeLayout("MyOp", Layout({Replicate()}), 0, 1).ok());
}

TEST(NormalizeLayoutTest, MixedPartialOps) {
  absl::StatusOr<Layout> n =
      NormalizeLayout("MyOp", Layout({Partial(PartialOp::kSum), Shard(0), Partial(PartialOp::kMax)}), 2, 3);
  ASSERT_FALSE(n.ok());
  EXPECT_EQ(n.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(n.status().message(), HasSubstr("[MyOp]"));
  EXPECT_THAT(n.status().message(), HasSubstr("P(sum)"));
  EXPECT_THAT(n.status().message(), HasSubstr("P(max)"));
  absl::StatusOr<Layout> m =
      NormalizeLayout("MyOp", Layout({Partial(PartialOp::kAvg), Partial(PartialOp::kMin)}), 1, 2);
  ASSERT_FALSE(m.ok());
  EXPECT_THAT(m.status().message(), HasSubstr("P(avg)"));
  EXPECT_THAT(m.status().message(), HasSubstr("P(min)"));
}

// ---- CheckedLocalBoxOf ----

TEST(CheckedLocalBoxTest, NormalisesAndMatchesLocalBoxOf) {
  const Index global = {5, 3}, mesh = {2, 2};
  for (const Index& c : AllCoords(mesh)) {
    absl::StatusOr<LocalBox> b = CheckedLocalBoxOf(global, mesh, Layout({Shard(-2), Shard(-2)}), c);
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_EQ(*b, LocalBoxOf(global, mesh, Layout({Shard(0), Shard(0)}), c)) << Str(c);
  }
}

TEST(CheckedLocalBoxTest, Errors) {
  const Index global = {5, 3}, mesh = {2, 2};
  const Layout ok({Shard(0), Replicate()});
  struct Case {
    Index global, mesh;
    Layout layout;
    Index coord;
    std::string needle;
  };
  const std::vector<Case> cases = {
      {global, mesh, ok, {0}, "[0]"},                              // coordinate of the wrong rank
      {global, mesh, ok, {0, 0, 0}, "[0, 0, 0]"},                  // coordinate of the wrong rank
      {global, mesh, ok, {2, 0}, "[2, 0]"},                        // outside the mesh
      {global, mesh, ok, {0, -1}, "[0, -1]"},                      // outside the mesh
      {{5, -3}, mesh, ok, {0, 0}, "[5, -3]"},                      // negative size
      {global, mesh, Layout({Shard(0)}), {0, 0}, "1 placements"},  // placement count
      {global, mesh, Layout({Shard(2), Replicate()}), {0, 0}, "S(2)"},
      {global, mesh, Layout({Partial(PartialOp::kSum), Partial(PartialOp::kMin)}), {0, 0}, "P(min)"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<LocalBox> b = CheckedLocalBoxOf(c.global, c.mesh, c.layout, c.coord);
    ASSERT_FALSE(b.ok()) << c.needle;
    EXPECT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument) << c.needle;
    EXPECT_THAT(b.status().message(), HasSubstr(c.needle)) << b.status();
  }
}

}  // namespace
}  // namespace dtensor
