// A representative slice of the redistribution suite as processes on the ucx backend: runs
// tests/core/dtensor_ucx_child.cc under dtrun on 2 and 4 ranks (each rank checks its own
// results against the global tensor and the plan's predicted collectives). Where a GPU is
// visible, the same on the nccl backend (ranks sharing cuda:0 where GPUs are fewer).
#include <cstdio>
#include <string>

#include "absl/strings/str_cat.h"
#include "dtensor/tensor/device.h"
#include "gtest/gtest.h"

#if defined(DTENSOR_UCX_CHILD_PATH) && defined(DTRUN_PATH)

namespace {

struct ChildRun {
  int code = -1;
  std::string output;  // stdout and stderr
};

// dtrun with `ranks` processes, killed by coreutils' timeout after 240 s.
ChildRun RunChild(int ranks, const std::string& env, const std::string& args = "") {
  const std::string cmd = absl::StrCat(env, " timeout -s KILL 240 ", DTRUN_PATH, " --nproc-per-node ", ranks, " ",
                                       DTENSOR_UCX_CHILD_PATH, " ", args, " 2>&1");
  ChildRun run;
  FILE* pipe = popen(cmd.c_str(), "r");
  if (pipe == nullptr) return run;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), pipe)) > 0) run.output.append(buf, n);
  const int status = pclose(pipe);
  run.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return run;
}

// Every rank of the run printed its summary line (naming `backend`) and no failure.
void ExpectEveryRankPassed(const ChildRun& run, int ranks, const std::string& backend) {
  EXPECT_EQ(run.code, 0) << run.output;
  for (int r = 0; r < ranks; ++r) {
    EXPECT_NE(run.output.find(absl::StrCat("[rank ", r, "] ")), std::string::npos) << run.output;
  }
  EXPECT_NE(run.output.find(" cases on " + backend), std::string::npos) << run.output;
  EXPECT_EQ(run.output.find("FAIL:"), std::string::npos) << run.output;
}

std::string RanksName(const testing::TestParamInfo<int>& info) { return absl::StrCat("P", info.param); }

class DTensorUcxTest : public testing::TestWithParam<int> {};

TEST_P(DTensorUcxTest, RedistributionsMatchTheGlobalTensorAndThePlan) {
  ExpectEveryRankPassed(RunChild(GetParam(), ""), GetParam(), "ucx");
}

INSTANTIATE_TEST_SUITE_P(Ranks, DTensorUcxTest, testing::Values(2, 4), RanksName);

class DTensorNcclProcessesTest : public testing::TestWithParam<int> {};

TEST_P(DTensorNcclProcessesTest, RedistributionsMatchTheGlobalTensorAndThePlan) {
  if (dtensor::CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device visible: the nccl backend needs a GPU";
  ExpectEveryRankPassed(RunChild(GetParam(), "", "--backend nccl"), GetParam(), "nccl");
}

INSTANTIATE_TEST_SUITE_P(Ranks, DTensorNcclProcessesTest, testing::Values(2, 4), RanksName);

}  // namespace

#endif
