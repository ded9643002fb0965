// Which GPU a process takes under a launcher (torchrun's convention, plus one GPU
// handed to each process through CUDA_VISIBLE_DEVICES).
#include "dtensor/collectives/nccl/local_gpu.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace dtensor {
namespace {

using ::testing::HasSubstr;

TEST(LocalGpuTest, OneGpuPerProcessByLocalRank) {
  EXPECT_EQ(*LocalGpu(0, 2, 2, false), 0);
  EXPECT_EQ(*LocalGpu(1, 2, 2, false), 1);
  EXPECT_EQ(*LocalGpu(3, 4, 8, false), 3);  // more GPUs than processes: the first ones
  EXPECT_EQ(*LocalGpu(0, 1, 8, false), 0);
}

TEST(LocalGpuTest, ProcessesHandedOneGpuEachTakeIt) {
  EXPECT_EQ(*LocalGpu(0, 4, 1, true), 0);  // CUDA_VISIBLE_DEVICES set: one GPU each
  EXPECT_EQ(*LocalGpu(3, 4, 1, true), 0);
  EXPECT_EQ(*LocalGpu(1, 2, 2, true), 1);
  // Unset: the host has one GPU, which the processes would share.
  const auto shared = LocalGpu(1, 2, 1, false);
  EXPECT_EQ(shared.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(shared.status().message(), HasSubstr("2 processes on this host but 1 CUDA device(s) visible"));
}

TEST(LocalGpuTest, TooFewGpusToShareOutOrBadRanksFail) {
  const auto few = LocalGpu(2, 4, 2, false);
  EXPECT_EQ(few.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(few.status().message(), HasSubstr("4 processes on this host but 2 CUDA device(s) visible"));
  EXPECT_EQ(LocalGpu(0, 2, 0, false).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(LocalGpu(2, 2, 2, false).status().message(), HasSubstr("local rank 2 is not in a host of 2"));
  EXPECT_EQ(LocalGpu(-1, 2, 2, false).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace dtensor
