// The kernel profiler's table (benchmarks/gpu/kernel_table.h): sums, the warm-up subtraction,
// the TSV form and the printed table, on made-up activity (no GPU needed).
#include "benchmarks/gpu/kernel_table.h"

#include <gtest/gtest.h>

#include <sstream>
#include <string>
#include <vector>

namespace dtensor::bench {
namespace {

std::vector<std::string> Lines(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

TEST(KernelTable, SumsPerNameAndSubtractsAWarmUp) {
  KernelTable run;
  run.Add("gemm", 1, 3000);
  run.Add("gemm", 2, 5000);
  run.Add("layernorm\twith\ttabs", 1, 100);
  run.Add("init_only", 1, 700);
  EXPECT_EQ(run.stats().at("gemm").calls, 3);
  EXPECT_EQ(run.stats().at("gemm").ns, 8000);
  EXPECT_EQ(run.stats().count("layernorm with tabs"), 1u);
  EXPECT_EQ(run.total_ns(), 8800);
  EXPECT_EQ(run.total_calls(), 5);

  KernelTable warm;
  warm.Add("gemm", 1, 3500);
  warm.Add("init_only", 1, 700);           // only in the warm-up: gone
  warm.Add("layernorm with tabs", 2, 50);  // more calls than the run: clamped at 0
  warm.Add("not_in_run", 4, 4);
  run.Subtract(warm);
  EXPECT_EQ(run.stats().at("gemm").calls, 2);
  EXPECT_EQ(run.stats().at("gemm").ns, 4500);
  EXPECT_EQ(run.stats().count("init_only"), 0u);
  EXPECT_EQ(run.stats().at("layernorm with tabs").calls, 0);
  EXPECT_EQ(run.stats().at("layernorm with tabs").ns, 50);
  EXPECT_EQ(run.stats().count("not_in_run"), 0u);
}

TEST(KernelTable, TsvRoundTripsAndNamesTheBadLine) {
  KernelTable t;
  t.Add("dtensor::Softmax<float>", 12, 123456789012);
  t.Add("[memcpy HtoD]", 2, 900);
  std::string error;
  std::optional<KernelTable> back = KernelTable::FromTsv(t.ToTsv(), &error);
  ASSERT_TRUE(back.has_value()) << error;
  EXPECT_EQ(back->ToTsv(), t.ToTsv());
  EXPECT_EQ(back->stats().at("dtensor::Softmax<float>").ns, 123456789012);

  EXPECT_FALSE(KernelTable::FromTsv("a\t1\t2\nb\t1\n", &error).has_value());
  EXPECT_EQ(error, "line 2 is not 'name<TAB>calls<TAB>ns': 'b\t1'");
  EXPECT_FALSE(KernelTable::FromTsv("a\t-1\t2\n", &error).has_value());
  EXPECT_FALSE(KernelTable::FromTsv("a\t1\t2x\n", &error).has_value());
  EXPECT_TRUE(KernelTable::FromTsv("", &error).has_value());
}

TEST(KernelTable, FormatsSortedRowsPerStepAndTheRest) {
  KernelTable t;
  t.Add("small", 4, 1'000'000);                // 1 ms
  t.Add("big", 8, 6'000'000);                  // 6 ms
  t.Add("medium", 4, 2'000'000);               // 2 ms
  t.Add(std::string(100, 'x'), 4, 1'000'000);  // 1 ms, a long name
  const std::string text = t.Format({.steps = 4, .top = 2, .name_width = 20, .title = "test"});
  const std::vector<std::string> lines = Lines(text);
  ASSERT_EQ(lines.size(), 7u) << text;
  EXPECT_EQ(lines[0], "GPU time by kernel, test: 20 activities, 10.000 ms in all, 2.500 ms per step (4)");
  EXPECT_NE(lines[1].find("kernel"), std::string::npos);
  EXPECT_EQ(lines[3], "    1 | big                  |         8 |      6.000 |     1.500 |  60.0%");
  EXPECT_EQ(lines[4], "    2 | medium               |         4 |      2.000 |     0.500 |  20.0%");
  EXPECT_EQ(lines[5], "      | (2 more)             |         8 |      2.000 |     0.500 |  20.0%");
  EXPECT_EQ(lines[6], "      | total                |        20 |     10.000 |     2.500 | 100.0%");
  // All rows: the long name is cut to the width.
  const std::string all = t.Format({.steps = 1, .top = 0, .name_width = 20, .title = ""});
  EXPECT_NE(all.find("| xxxxxxxxxxxxxxxxx... |"), std::string::npos) << all;
  EXPECT_EQ(all.find("more)"), std::string::npos) << all;
  // An empty table prints its heading and a zero total.
  EXPECT_NE(KernelTable().Format(KernelTable::FormatOptions()).find("0 activities, 0.000 ms in all"),
            std::string::npos);
}

TEST(KernelTable, ShortKernelNames) {
  EXPECT_EQ(ShortKernelName("_ZN7dtensor7kernels12_GLOBAL__N_116LayerNormForwardIfLi256EEEvPKT_PS3_i"),
            "dtensor::kernels::LayerNormForward<float, 256>");
  EXPECT_EQ(ShortKernelName("_Z12plain_kernelPf"), "plain_kernel");
  EXPECT_EQ(ShortKernelName("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64"),
            "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64");
  EXPECT_EQ(ShortKernelName(nullptr), "(unnamed)");
}

}  // namespace
}  // namespace dtensor::bench
