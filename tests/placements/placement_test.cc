// Tests of Placement: equality, hashing (absl::Hash, flat_hash_set) and printing, and of
// Layout's value semantics (equality and hashing with shard orders).
#include "dtensor/placements/placement.h"

#include <string>
#include <tuple>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/hash/hash.h"
#include "absl/hash/hash_testing.h"
#include "dtensor/placements/layout.h"
#include "gtest/gtest.h"

namespace dtensor {
namespace {

// One of every kind of placement, all different.
std::vector<Placement> DistinctPlacements() {
  return {Shard(-2),
          Shard(-1),
          Shard(0),
          Shard(1),
          Shard(2),
          Replicate(),
          Partial(PartialOp::kSum),
          Partial(PartialOp::kAvg),
          Partial(PartialOp::kMax),
          Partial(PartialOp::kMin)};
}

TEST(PlacementTest, KindsAndAccessors) {
  const Placement s = Shard(3);
  EXPECT_TRUE(s.is_shard());
  EXPECT_FALSE(s.is_replicate());
  EXPECT_FALSE(s.is_partial());
  EXPECT_EQ(s.shard_dim(), 3);

  const Placement r = Replicate();
  EXPECT_TRUE(r.is_replicate());
  EXPECT_FALSE(r.is_shard());
  EXPECT_FALSE(r.is_partial());

  const Placement p = Partial(PartialOp::kMax);
  EXPECT_TRUE(p.is_partial());
  EXPECT_FALSE(p.is_shard());
  EXPECT_FALSE(p.is_replicate());
  EXPECT_EQ(p.partial_op(), PartialOp::kMax);

  // Defaults: Placement() is Replicate, Partial() is a sum.
  EXPECT_TRUE(Placement().is_replicate());
  EXPECT_EQ(Placement(Partial()).partial_op(), PartialOp::kSum);
  EXPECT_EQ(Placement(), Placement(Replicate()));
  EXPECT_EQ(Placement(Partial()), Placement(Partial(PartialOp::kSum)));
}

TEST(PlacementTest, EqualityIsByKindAndArgument) {
  const std::vector<Placement> all = DistinctPlacements();
  for (size_t i = 0; i < all.size(); ++i) {
    for (size_t j = 0; j < all.size(); ++j) {
      EXPECT_EQ(all[i] == all[j], i == j) << all[i].ToString() << " vs " << all[j].ToString();
      EXPECT_EQ(all[i] != all[j], i != j) << all[i].ToString() << " vs " << all[j].ToString();
    }
  }
  // Copies compare equal.
  EXPECT_EQ(Placement(Shard(2)), Placement(Shard(2)));
  EXPECT_EQ(Placement(Partial(PartialOp::kMin)), Placement(Partial(PartialOp::kMin)));
  // Shard(0) and Partial(kSum) both carry a 0 argument but differ in kind.
  EXPECT_NE(Placement(Shard(0)), Placement(Partial(PartialOp::kSum)));
  EXPECT_NE(Placement(Shard(0)), Placement(Replicate()));
}

TEST(PlacementTest, AbslHashIsConsistentWithEquality) {
  EXPECT_TRUE(absl::VerifyTypeImplementsAbslHashCorrectly(DistinctPlacements()));
  // Equal values hash equal, whichever way they were built.
  EXPECT_EQ(absl::Hash<Placement>()(Shard(1)), absl::Hash<Placement>()(Placement(Shard(1))));
  EXPECT_EQ(absl::Hash<Placement>()(Placement()), absl::Hash<Placement>()(Replicate()));
}

TEST(PlacementTest, FlatHashSet) {
  absl::flat_hash_set<Placement> set;
  for (const Placement& p : DistinctPlacements()) EXPECT_TRUE(set.insert(p).second) << p.ToString();
  EXPECT_EQ(set.size(), DistinctPlacements().size());
  // Re-inserting equal values adds nothing.
  for (const Placement& p : DistinctPlacements()) EXPECT_FALSE(set.insert(p).second) << p.ToString();
  EXPECT_FALSE(set.insert(Placement()).second);
  EXPECT_FALSE(set.insert(Partial()).second);
  EXPECT_EQ(set.size(), DistinctPlacements().size());
  EXPECT_TRUE(set.contains(Shard(-1)));
  EXPECT_FALSE(set.contains(Shard(7)));
}

TEST(PlacementTest, ToString) {
  EXPECT_EQ(Placement(Shard(0)).ToString(), "S(0)");
  EXPECT_EQ(Placement(Shard(12)).ToString(), "S(12)");
  EXPECT_EQ(Placement(Shard(-1)).ToString(), "S(-1)");
  EXPECT_EQ(Placement(Replicate()).ToString(), "R");
  EXPECT_EQ(Placement(Partial(PartialOp::kSum)).ToString(), "P(sum)");
  EXPECT_EQ(Placement(Partial(PartialOp::kAvg)).ToString(), "P(avg)");
  EXPECT_EQ(Placement(Partial(PartialOp::kMax)).ToString(), "P(max)");
  EXPECT_EQ(Placement(Partial(PartialOp::kMin)).ToString(), "P(min)");
  EXPECT_STREQ(PartialOpName(PartialOp::kSum), "sum");
  EXPECT_STREQ(PartialOpName(PartialOp::kAvg), "avg");
  EXPECT_STREQ(PartialOpName(PartialOp::kMax), "max");
  EXPECT_STREQ(PartialOpName(PartialOp::kMin), "min");
}

TEST(PlacementTest, PlacementsString) {
  EXPECT_EQ(PlacementsString({}), "");
  const std::vector<Placement> a = {Shard(0), Replicate()};
  EXPECT_EQ(PlacementsString(a), "S(0)R");
  const std::vector<Placement> b = {Partial(PartialOp::kSum), Shard(1)};
  EXPECT_EQ(PlacementsString(b), "P(sum)S(1)");
  const std::vector<Placement> c = {Replicate(), Partial(PartialOp::kAvg), Shard(-2), Partial(PartialOp::kMin)};
  EXPECT_EQ(PlacementsString(c), "RP(avg)S(-2)P(min)");
}

// ---- Layout as a value ----

TEST(LayoutValueTest, EqualityIncludesShardOrder) {
  const Layout a({Shard(0), Shard(0)});
  const Layout b({Shard(0), Shard(0)});
  EXPECT_EQ(a, b);
  absl::StatusOr<Layout> reversed = a.WithShardOrder(0, {1, 0});
  ASSERT_TRUE(reversed.ok()) << reversed.status();
  EXPECT_NE(a, *reversed);
  // Setting the default order explicitly gives the default layout back.
  absl::StatusOr<Layout> same = a.WithShardOrder(0, {0, 1});
  ASSERT_TRUE(same.ok()) << same.status();
  EXPECT_EQ(a, *same);
  EXPECT_NE(Layout({Shard(0), Replicate()}), Layout({Replicate(), Shard(0)}));
  EXPECT_NE(Layout({Shard(0)}), Layout({Shard(0), Replicate()}));
}

TEST(LayoutValueTest, HashAndFlatHashSet) {
  const Layout ss({Shard(0), Shard(0)});
  const Layout ss_rev = *ss.WithShardOrder(0, {1, 0});
  const std::vector<Layout> distinct = {ss,
                                        ss_rev,
                                        Layout({Shard(0), Replicate()}),
                                        Layout({Replicate(), Shard(0)}),
                                        Layout({Partial(), Partial()}),
                                        Layout({Partial(PartialOp::kMax), Partial(PartialOp::kMax)}),
                                        Layout({Replicate()}),
                                        Layout({Replicate(), Replicate()})};
  EXPECT_TRUE(absl::VerifyTypeImplementsAbslHashCorrectly(distinct));
  absl::flat_hash_set<Layout> set(distinct.begin(), distinct.end());
  EXPECT_EQ(set.size(), distinct.size());
  EXPECT_FALSE(set.insert(Layout({Shard(0), Shard(0)})).second);
  EXPECT_FALSE(set.insert(*Layout({Shard(0), Shard(0)}).WithShardOrder(0, {1, 0})).second);
}

}  // namespace
}  // namespace dtensor
