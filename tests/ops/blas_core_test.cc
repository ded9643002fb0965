// Which OpenBLAS kernel set is faster for a CPU: the rule ReexecWithFasterBlasCore applies.
// (That the trainer really restarts onto it is checked end to end in tests/gpt.)
#include "dtensor/kernels/cpu/blas_core.h"

#include "gtest/gtest.h"

namespace dtensor {
namespace {

constexpr CpuVectorIsa kSse{false, false};
constexpr CpuVectorIsa kAvx2{true, false};
constexpr CpuVectorIsa kAvx512{true, true};

TEST(BlasCoreTest, GenericFallbacksGetTheWidestSetTheCpuRuns) {
  EXPECT_EQ(FasterBlasCoreType("Prescott", kAvx512), "SkylakeX");
  EXPECT_EQ(FasterBlasCoreType("PRESCOTT", kAvx512), "SkylakeX");  // non-DYNAMIC_ARCH spelling
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

TEST(BlasCoreTest, NamesTheLoadedCore) { EXPECT_FALSE(BlasCoreName().empty()); }

}  // namespace
}  // namespace dtensor
