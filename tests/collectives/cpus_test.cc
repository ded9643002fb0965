#include "dtensor/collectives/store/cpus.h"

#include <sched.h>

#include <algorithm>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"

namespace dtensor {
namespace {

using Shares = std::vector<std::vector<int>>;

TEST(CpusTest, AllowedCpusIsThisThreadsAffinity) {
  const std::vector<int> cpus = AllowedCpus();
  ASSERT_FALSE(cpus.empty());
  EXPECT_TRUE(std::is_sorted(cpus.begin(), cpus.end()));
  cpu_set_t set;
  CPU_ZERO(&set);
  ASSERT_EQ(sched_getaffinity(0, sizeof(set), &set), 0);
  EXPECT_EQ(static_cast<int>(cpus.size()), CPU_COUNT(&set));
  for (int c : cpus) EXPECT_TRUE(CPU_ISSET(c, &set)) << c;
}

// The CPUs in a sysfs list such as "0-3,8", or nothing if the file cannot be read.
std::set<int> ReadCpuList(const std::string& path) {
  std::ifstream in(path);
  std::string text;
  std::set<int> out;
  if (!(in >> text)) return out;
  for (absl::string_view part : absl::StrSplit(text, ',')) {
    const std::vector<std::string> ends = absl::StrSplit(part, '-');
    int lo = 0, hi = 0;
    if (!absl::SimpleAtoi(ends[0], &lo)) continue;
    hi = lo;
    if (ends.size() == 2 && !absl::SimpleAtoi(ends[1], &hi)) continue;
    for (int c = lo; c <= hi; ++c) out.insert(c);
  }
  return out;
}

TEST(CpusTest, CoreKeysMatchTheKernelsThreadSiblings) {
  const std::vector<int> cpus = AllowedCpus();
  const std::vector<int64_t> keys = CoreKeys(cpus);
  ASSERT_EQ(keys.size(), cpus.size());
  for (size_t a = 0; a < cpus.size(); ++a) {
    const std::set<int> siblings =
        ReadCpuList(absl::StrCat("/sys/devices/system/cpu/cpu", cpus[a], "/topology/thread_siblings_list"));
    if (siblings.empty()) GTEST_SKIP() << "no sysfs topology for cpu " << cpus[a];
    for (size_t b = 0; b < cpus.size(); ++b) {
      EXPECT_EQ(keys[a] == keys[b], siblings.count(cpus[b]) == 1) << "cpus " << cpus[a] << " and " << cpus[b];
    }
  }
}

TEST(CpusTest, SplitGivesWholeCoresInOrder) {
  // 4 cores with 2 hyperthreads each, numbered as Linux often does: CPU c and c + 4 share core c.
  const std::vector<int> cpus = {0, 1, 2, 3, 4, 5, 6, 7};
  const std::vector<int64_t> keys = {0, 1, 2, 3, 0, 1, 2, 3};
  EXPECT_EQ(SplitCpus(cpus, keys, 2), (Shares{{0, 4, 1, 5}, {2, 6, 3, 7}}));
  EXPECT_EQ(SplitCpus(cpus, keys, 4), (Shares{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));
  EXPECT_EQ(SplitCpus(cpus, keys, 1), (Shares{{0, 4, 1, 5, 2, 6, 3, 7}}));
  // 3 ranks over 4 cores: floor(i*C/n) boundaries 0, 1, 2, 4.
  EXPECT_EQ(SplitCpus(cpus, keys, 3), (Shares{{0, 4}, {1, 5}, {2, 6, 3, 7}}));
  // More ranks than cores, not than CPUs: single CPUs.
  EXPECT_EQ(SplitCpus(cpus, keys, 8), (Shares{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}}));
  EXPECT_EQ(SplitCpus(cpus, keys, 5), (Shares{{0}, {1, 2}, {3}, {4, 5}, {6, 7}}));  // 8i/5: 0 1 3 4 6 8
}

TEST(CpusTest, SplitOfAnAffinitySubsetAndUnsortedInput) {
  // A cgroup/taskset gave CPUs 9, 3, 5 (unsorted; unknown topology: each CPU its own core).
  EXPECT_EQ(SplitCpus({9, 3, 5}, {9, 3, 5}, 2), (Shares{{3}, {5, 9}}));
  EXPECT_EQ(SplitCpus({9, 3, 5}, {9, 3, 5}, 3), (Shares{{3}, {5}, {9}}));
}

TEST(CpusTest, SplitKeepsPackagesTogether) {
  // Two packages whose CPUs alternate (0, 2 on package 0; 1, 3 on package 1).
  const int64_t p1 = int64_t{1} << 32;
  EXPECT_EQ(SplitCpus({0, 1, 2, 3}, {0, p1 | 1, 2, p1 | 3}, 2), (Shares{{0, 2}, {1, 3}}));
}

TEST(CpusTest, ParseCpuListIsFormatsInverse) {
  EXPECT_EQ(ParseCpuList("0-3,8,10-11"), (std::vector<int>{0, 1, 2, 3, 8, 10, 11}));
  EXPECT_EQ(ParseCpuList("5"), (std::vector<int>{5}));
  EXPECT_EQ(ParseCpuList(""), (std::vector<int>{}));
  EXPECT_EQ(ParseCpuList("3,1-2,2"), (std::vector<int>{1, 2, 3}));
  EXPECT_TRUE(ParseCpuList("x").empty());
  EXPECT_TRUE(ParseCpuList("3-1").empty());
  EXPECT_TRUE(ParseCpuList("-1").empty());
  for (const std::vector<int>& cpus : {std::vector<int>{0}, std::vector<int>{0, 1, 2, 7, 9, 10}}) {
    EXPECT_EQ(ParseCpuList(FormatCpuList(cpus)), cpus);
  }
}

TEST(CpusTest, SplitRefusesTooFewCpusAndBadInput) {
  EXPECT_TRUE(SplitCpus({0, 1}, {0, 1}, 3).empty());        // 3 ranks on 2 CPUs share anyway
  EXPECT_TRUE(SplitCpus({0, 0, 1}, {0, 0, 1}, 3).empty());  // a listed-twice CPU is one CPU
  EXPECT_TRUE(SplitCpus({0, 1}, {0}, 2).empty());           // keys do not match
  EXPECT_TRUE(SplitCpus({0, 1}, {0, 1}, 0).empty());
  EXPECT_TRUE(SplitCpus({}, {}, 1).empty());
}

TEST(CpusTest, StackGivesConsecutiveRanksOneCpu) {
  EXPECT_EQ(StackCpus({0, 1}, {0, 1}, 4), (Shares{{0}, {0}, {1}, {1}}));
  EXPECT_EQ(StackCpus({0, 1}, {0, 1}, 3), (Shares{{0}, {0}, {1}}));  // floor(2i/3): 0 0 1
  EXPECT_EQ(StackCpus({5}, {5}, 3), (Shares{{5}, {5}, {5}}));
  // Hyperthreads (CPU c and c + 2 share core c): one CPU each in SplitCpus order, then stacked.
  EXPECT_EQ(StackCpus({0, 1, 2, 3}, {0, 1, 0, 1}, 8), (Shares{{0}, {0}, {1}, {1}, {2}, {2}, {3}, {3}}));
  EXPECT_EQ(StackCpus({9, 3, 3}, {9, 3, 3}, 3), (Shares{{3}, {3}, {9}}));  // a CPU listed twice is one
  // As many CPUs as ranks (SplitCpus' case) or bad input: none.
  EXPECT_TRUE(StackCpus({0, 1}, {0, 1}, 2).empty());
  EXPECT_TRUE(StackCpus({0, 1}, {0}, 3).empty());
  EXPECT_TRUE(StackCpus({}, {}, 2).empty());
  EXPECT_TRUE(StackCpus({0}, {0}, 0).empty());
}

TEST(CpusTest, SplitSharesAreDisjointAndCoverEverything) {
  // Random-ish topologies: every CPU in exactly one share, none empty, siblings together.
  for (int ncpu = 1; ncpu <= 24; ++ncpu) {
    for (int threads = 1; threads <= 3; ++threads) {
      std::vector<int> cpus;
      std::vector<int64_t> keys;
      for (int c = 0; c < ncpu; ++c) {
        cpus.push_back(c);
        keys.push_back(c % ((ncpu + threads - 1) / threads));
      }
      for (int ranks = 1; ranks <= ncpu; ++ranks) {
        const Shares s = SplitCpus(cpus, keys, ranks);
        ASSERT_EQ(static_cast<int>(s.size()), ranks) << ncpu << " " << threads;
        std::multiset<int> seen;
        for (const auto& share : s) {
          EXPECT_FALSE(share.empty());
          seen.insert(share.begin(), share.end());
        }
        EXPECT_EQ(seen, std::multiset<int>(cpus.begin(), cpus.end()));
        const int cores = (ncpu + threads - 1) / threads;
        if (ranks <= cores) {  // whole cores: a key never spans two shares
          for (size_t a = 0; a < s.size(); ++a) {
            for (size_t b = a + 1; b < s.size(); ++b) {
              for (int x : s[a]) {
                for (int y : s[b]) EXPECT_NE(keys[x], keys[y]) << ncpu << " " << threads << " " << ranks;
              }
            }
          }
        }
      }
    }
  }
}

TEST(CpusTest, RanksHaveOwnCpusIsAMatching) {
  EXPECT_TRUE(RanksHaveOwnCpus({}));
  EXPECT_TRUE(RanksHaveOwnCpus({{0}, {1}}));        // bound to a core each (dtrun)
  EXPECT_TRUE(RanksHaveOwnCpus({{0, 1}, {0, 1}}));  // unbound, two CPUs
  EXPECT_TRUE(RanksHaveOwnCpus({{0}, {0, 1}}));     // the second one moves to CPU 1
  EXPECT_TRUE(RanksHaveOwnCpus({{0, 1}, {0}}));     // needs an augmenting path
  EXPECT_TRUE(RanksHaveOwnCpus({{0, 1}, {1, 2}, {0}}));
  EXPECT_FALSE(RanksHaveOwnCpus({{0}, {0}}));                // both bound to one CPU
  EXPECT_FALSE(RanksHaveOwnCpus({{0, 1}, {0, 1}, {0, 1}}));  // 3 ranks, 2 CPUs
  EXPECT_FALSE(RanksHaveOwnCpus({{0}, {0}, {1, 2}}));        // enough CPUs overall, but 0 and 1 share
  EXPECT_FALSE(RanksHaveOwnCpus({{0, 1}, {}}));              // unknown affinity counts as shared
}

TEST(CpusTest, FormatCpuList) {
  EXPECT_EQ(FormatCpuList({}), "none");
  EXPECT_EQ(FormatCpuList({3}), "3");
  EXPECT_EQ(FormatCpuList({0, 1}), "0-1");
  EXPECT_EQ(FormatCpuList({0, 1, 2, 3, 8, 10, 11}), "0-3,8,10-11");
  EXPECT_EQ(FormatCpuList({1, 3, 5}), "1,3,5");
}

}  // namespace
}  // namespace dtensor
