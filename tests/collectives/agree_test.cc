// AgreeOnStatus and AllGatherText on thread ranks: every rank goes on only when all did; a
// failed rank keeps its own error, the others get the first failed rank's code and message
// with every failed rank named; texts of any length (0, not a multiple of 4, NUL bytes) come
// back exactly, in rank order.
#include "dtensor/collectives/agree.h"

#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "dtensor/collectives/threads/threads_communicator.h"
#include "gtest/gtest.h"
#include "tests/testing/test_util.h"

namespace dtensor {
namespace {

using testing::Unwrap;

// Runs fn(rank, comm) on `n` thread ranks and returns each rank's result.
template <typename Fn>
auto OnRanks(int n, Fn fn) {
  auto comms = Unwrap(MakeThreadGroup(n, absl::Seconds(20)));
  std::vector<decltype(fn(0, *comms[0]))> out(static_cast<size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] { out[static_cast<size_t>(r)] = fn(r, *comms[static_cast<size_t>(r)]); });
  }
  for (auto& t : threads) t.join();
  return out;
}

TEST(AgreeTest, EveryRankOkIsOk) {
  for (int n : {1, 3}) {
    auto out = OnRanks(n, [](int, Communicator& c) { return AgreeOnStatus(c, absl::OkStatus(), "opening"); });
    for (const absl::Status& s : out) EXPECT_TRUE(s.ok()) << s;
  }
}

TEST(AgreeTest, FailedRanksKeepTheirErrorsAndTheOthersNameThem) {
  auto mine = [](int r) -> absl::Status {
    if (r == 1) return absl::NotFoundError("[Open] no file /x/1.bin");
    if (r == 3) return absl::PermissionDeniedError("[Open] /x/3.bin: permission denied");
    return absl::OkStatus();
  };
  auto out = OnRanks(4, [&](int r, Communicator& c) { return AgreeOnStatus(c, mine(r), "opening the shards"); });
  EXPECT_EQ(out[1], mine(1));
  EXPECT_EQ(out[3], mine(3));
  for (int r : {0, 2}) {
    const absl::Status& s = out[static_cast<size_t>(r)];
    EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
    EXPECT_EQ(s.message(), "opening the shards failed on rank(s) 1, 3; rank 1: [Open] no file /x/1.bin") << s;
  }
  // One rank alone: its own status, whatever it is.
  auto one = OnRanks(1, [&](int, Communicator& c) { return AgreeOnStatus(c, mine(1), "opening"); });
  EXPECT_EQ(one[0], mine(1));
}

// A rank that failed and aborted its communicator (as a rank does that cannot take part)
// keeps its own error; the others get the abort.
TEST(AgreeTest, AFailedRankWhoseCommunicatorIsGoneKeepsItsError) {
  const absl::Status failure = absl::NotFoundError("[Open] no file /x/1.bin");
  auto out = OnRanks(2, [&](int r, Communicator& c) {
    if (r == 1) c.Abort(failure);
    return AgreeOnStatus(c, r == 1 ? failure : absl::OkStatus(), "opening the shards");
  });
  EXPECT_TRUE(absl::IsAborted(out[0])) << out[0];
  EXPECT_NE(out[0].message().find("no file /x/1.bin"), std::string::npos) << out[0];
  EXPECT_EQ(out[1].code(), absl::StatusCode::kNotFound) << out[1];
  EXPECT_TRUE(absl::StartsWith(out[1].message(), failure.message())) << out[1];
}

TEST(AgreeTest, TextsOfAnyLengthComeBackInRankOrder) {
  auto text = [](int r) {
    if (r == 0) return std::string();
    std::string s = absl::StrCat("rank ", r, ":");
    s.append(static_cast<size_t>(r * 37 % 11), 'x');
    s.push_back('\0');
    s += "after a NUL";
    return s;
  };
  auto out = OnRanks(5, [&](int r, Communicator& c) { return AllGatherText(c, text(r)); });
  for (int r = 0; r < 5; ++r) {
    const absl::StatusOr<std::vector<std::string>>& got = out[static_cast<size_t>(r)];
    ASSERT_TRUE(got.ok()) << got.status();
    ASSERT_EQ(got->size(), 5u);
    for (int q = 0; q < 5; ++q) EXPECT_EQ((*got)[static_cast<size_t>(q)], text(q)) << "rank " << r << " of " << q;
  }
}

}  // namespace
}  // namespace dtensor
