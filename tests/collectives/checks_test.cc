// The collectives' shared message helpers.
#include "dtensor/collectives/checks.h"

#include "gtest/gtest.h"

namespace dtensor::internal {
namespace {

TEST(RanksPhraseTest, NamesOneTwoOrSeveralRanks) {
  EXPECT_EQ(RanksPhrase({}), "no rank");
  EXPECT_EQ(RanksPhrase({3}), "rank 3");
  EXPECT_EQ(RanksPhrase({1, 3}), "ranks 1 and 3");
  EXPECT_EQ(RanksPhrase({1, 3, 5}), "ranks 1, 3 and 5");
}

}  // namespace
}  // namespace dtensor::internal
