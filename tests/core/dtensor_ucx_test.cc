// A representative slice of the redistribution suite as processes on the ucx backend: runs
// tests/core/dtensor_ucx_child.cc under dtrun on 2 and 4 ranks (each rank checks its own
// results against the global tensor and the plan's predicted collectives). Where a GPU is
// visible, the same on the nccl backend (ranks sharing cuda:0 where GPUs are fewer).
#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "dtensor/tensor/device.h"
#include "gtest/gtest.h"
#include "tests/testing/run_process.h"

#if defined(DTENSOR_UCX_CHILD_PATH) && defined(DTRUN_PATH)

namespace {

using dtensor::testing::ProcessRun;

// dtrun with `ranks` processes and `args` for each, killed after 240 s.
ProcessRun RunChild(int ranks, const std::vector<std::string>& args = {}) {
  std::vector<std::string> argv = {DTRUN_PATH, "--nproc-per-node", std::to_string(ranks), DTENSOR_UCX_CHILD_PATH};
  argv.insert(argv.end(), args.begin(), args.end());
  return dtensor::testing::RunProcess(argv, {.timeout = absl::Seconds(240), .merge_output = true});
}

// Every rank of the run printed its summary line (naming `backend`) and no failure.
void ExpectEveryRankPassed(const ProcessRun& run, int ranks, const std::string& backend) {
  EXPECT_EQ(run.code, 0) << run.out;
  for (int r = 0; r < ranks; ++r) {
    EXPECT_NE(run.out.find(absl::StrCat("[rank ", r, "] ")), std::string::npos) << run.out;
  }
  EXPECT_NE(run.out.find(" cases on " + backend), std::string::npos) << run.out;
  EXPECT_EQ(run.out.find("FAIL:"), std::string::npos) << run.out;
}

std::string RanksName(const testing::TestParamInfo<int>& info) { return absl::StrCat("P", info.param); }

class DTensorUcxTest : public testing::TestWithParam<int> {};

TEST_P(DTensorUcxTest, RedistributionsMatchTheGlobalTensorAndThePlan) {
  ExpectEveryRankPassed(RunChild(GetParam()), GetParam(), "ucx");
}

INSTANTIATE_TEST_SUITE_P(Ranks, DTensorUcxTest, testing::Values(2, 4), RanksName);

// Ranks fail together on processes: rank k's FromLocal fails while the other three wait in
// Redistribute; they return Aborted naming rank k within 1 s (each rank checks its own time),
// and an abort on a 2x2 split reaches ranks waiting on row and column communicators.
class DTensorUcxAbortTest : public testing::TestWithParam<int> {};

TEST_P(DTensorUcxAbortTest, PeersReturnAbortedNamingTheFailingRankWithinOneSecond) {
  const int k = GetParam();
  const ProcessRun run = RunChild(4, {"--abort", std::to_string(k)});
  EXPECT_EQ(run.code, 0) << run.out;
  EXPECT_EQ(run.out.find("FAIL:"), std::string::npos) << run.out;
  for (int r = 0; r < 4; ++r) {
    EXPECT_NE(run.out.find(absl::StrCat("[rank ", r, "] abort: 0 failures")), std::string::npos) << run.out;
    if (r == k) continue;
    EXPECT_NE(run.out.find(absl::StrCat("[rank ", r, "] Redistribute: Aborted after")), std::string::npos) << run.out;
  }
  std::printf("%s\n", run.out.c_str());
}

INSTANTIATE_TEST_SUITE_P(FailingRank, DTensorUcxAbortTest, testing::Values(0, 2),
                         [](const testing::TestParamInfo<int>& info) { return absl::StrCat("K", info.param); });

class DTensorNcclProcessesTest : public testing::TestWithParam<int> {};

TEST_P(DTensorNcclProcessesTest, RedistributionsMatchTheGlobalTensorAndThePlan) {
  if (dtensor::CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device visible: the nccl backend needs a GPU";
  ExpectEveryRankPassed(RunChild(GetParam(), {"--backend", "nccl"}), GetParam(), "nccl");
}

INSTANTIATE_TEST_SUITE_P(Ranks, DTensorNcclProcessesTest, testing::Values(2, 4), RanksName);

}  // namespace

#endif
