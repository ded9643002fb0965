// The trainer's report: FLOPs per token (ANCHORS.md's formula), GPU peaks by name, the CPU's
// measured peak, MFU and the progress bar.
#include "examples/gpt/report.h"

#include <string>

#include "gtest/gtest.h"
#include "tests/testing/test_util.h"

namespace dtensor::gpt {
namespace {

TEST(ReportTest, FlopsPerTokenOfGpt2Small) {
  // GPT-2 124M: 124,439,808 parameters (V = 50257, wte tied), of which 1024 x 768 are wpe.
  const nn::GPTConfig cfg{.vocab_size = 50257, .block_size = 1024, .n_layer = 12, .n_head = 12, .n_embd = 768};
  const double by_hand = 6.0 * (124439808.0 - 1024.0 * 768.0) + 12.0 * 12 * 768 * 1024;
  EXPECT_DOUBLE_EQ(FlopsPerToken(cfg, 124439808, 1024), by_hand);
  EXPECT_NEAR(FlopsPerToken(cfg, 124439808, 1024) / 1e9, 0.86, 0.01);  // ANCHORS.md: about 0.86 GFLOP
  // The attention term grows with the context actually used.
  EXPECT_DOUBLE_EQ(FlopsPerToken(cfg, 124439808, 1024) - FlopsPerToken(cfg, 124439808, 512), 12.0 * 12 * 768 * 512);
}

TEST(ReportTest, GpuPeaksByName) {
  EXPECT_EQ(GpuPeakFlops("NVIDIA H100 80GB HBM3", true), 989e12);
  EXPECT_EQ(GpuPeakFlops("NVIDIA H100 80GB HBM3", false), 67e12);
  EXPECT_EQ(GpuPeakFlops("NVIDIA H100 PCIe", true), 756e12);
  EXPECT_EQ(GpuPeakFlops("NVIDIA H200", true), 989e12);
  EXPECT_EQ(GpuPeakFlops("NVIDIA A100-SXM4-80GB", false), 19.5e12);
  EXPECT_EQ(GpuPeakFlops("Some Future GPU", true), 0);
}

TEST(ReportTest, MeasuredCpuPeakIsPlausible) {
  const double peak = testing::Unwrap(PeakFlops(Device::Cpu(), false, 1));
  // One core of anything this runs on: between 0.1 and 1000 GFLOP/s.
  EXPECT_GT(peak, 1e8);
  EXPECT_LT(peak, 1e12);
  EXPECT_DOUBLE_EQ(Mfu(1e9, 10, 2e10), 0.5);
  EXPECT_EQ(Mfu(1e9, 10, 0), 0);  // unknown peak
}

TEST(ReportTest, ProgressBarAndDurations) {
  EXPECT_EQ(FormatDuration(0), "0:00");
  EXPECT_EQ(FormatDuration(62.4), "1:02");
  EXPECT_EQ(FormatDuration(3723), "1:02:03");
  EXPECT_EQ(ProgressBar(25, 100, 10, 20), "[#####---------------]  25/100  0:10 elapsed  0:30 left");
  EXPECT_EQ(ProgressBar(0, 4, 0, 4), "[----] 0/4  0:00 elapsed  ? left");
  EXPECT_EQ(ProgressBar(4, 4, 8, 4), "[####] 4/4  0:08 elapsed  0:00 left");
}

TEST(ReportTest, DeviceMemory) {
  EXPECT_GT(DeviceMemoryBytes(Device::Cpu()), int64_t{1} << 28);  // the host has at least 256 MiB
}

}  // namespace
}  // namespace dtensor::gpt
