// Which OpenBLAS kernel set is faster for a CPU: the rule ReexecWithFasterBlasCore applies.
// (That the trainer really restarts onto it is checked end to end in tests/gpt.)
#include "dtensor/kernels/cpu/blas_core.h"

#include <cstdlib>
#include <string>

#include "gtest/gtest.h"

namespace dtensor {
namespace {

constexpr CpuVectorIsa kSse{false, false};
constexpr CpuVectorIsa kAvx2{true, false};
constexpr CpuVectorIsa kAvx512{true, true};

TEST(BlasCoreTest, GenericFallbacksGetTheWidestSetTheCpuRuns) {
  EXPECT_EQ(FasterBlasCoreType("Prescott", kAvx512), "SkylakeX");
  EXPECT_EQ(FasterBlasCoreType("PRESCOTT", kAvx512), "SkylakeX");  // any case
  EXPECT_EQ(FasterBlasCoreType("Nehalem", kAvx512), "SkylakeX");
  EXPECT_EQ(FasterBlasCoreType("Sandybridge", kAvx2), "Haswell");
  EXPECT_EQ(FasterBlasCoreType("Core2", kAvx2), "Haswell");
}

TEST(BlasCoreTest, RightOrDeliberateChoicesStay) {
  EXPECT_EQ(FasterBlasCoreType("Prescott", kSse), "");  // an old CPU: Prescott is right
  EXPECT_EQ(FasterBlasCoreType("Sandybridge", kSse), "");
  EXPECT_EQ(FasterBlasCoreType("SkylakeX", kAvx512), "");
  EXPECT_EQ(FasterBlasCoreType("Haswell", kAvx2), "");
  EXPECT_EQ(FasterBlasCoreType("Haswell", kAvx512), "");  // OpenBLAS's own choice (e.g. no OS AVX-512 state)
  EXPECT_EQ(FasterBlasCoreType("Zen", kAvx512), "");
  EXPECT_EQ(FasterBlasCoreType("Cooperlake", kAvx512), "");
  EXPECT_EQ(FasterBlasCoreType("", kAvx512), "");
}

// This binary's main (tests/testing/main.cc) restarted it onto the faster set where OpenBLAS
// can switch: fails on OpenBLAS 0.3.21 on a CPU model it does not know, without the restart.
TEST(BlasCoreTest, ThisTestBinaryRunsTheFasterKernels) {
  const std::string core = BlasCoreName();
  EXPECT_FALSE(core.empty());
  if (!BlasChoosesCoreAtLoad()) GTEST_SKIP() << "OpenBLAS built for one core (" << core << "): nothing to choose";
  if (std::getenv("OPENBLAS_CORETYPE") != nullptr && FasterBlasCoreType(core, HostVectorIsa()) != "") {
    GTEST_SKIP() << "OPENBLAS_CORETYPE=" << std::getenv("OPENBLAS_CORETYPE") << " set by the user";
  }
  EXPECT_EQ(FasterBlasCoreType(core, HostVectorIsa()), "") << "running OpenBLAS's " << core << " kernels";
}

}  // namespace
}  // namespace dtensor
