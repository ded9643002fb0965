// gpt::Sampler against naive references: the distribution it draws from (greedy, temperature,
// top-k, top-p) equals a straightforward softmax / sort / cut written here; its draws land
// only on kept tokens, with frequencies near the probabilities; a seed reproduces the same
// tokens (and another seed does not); top-k = 1 is greedy; bad options and logits are
// InvalidArgument naming them.
#include "examples/gpt/sampler.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <numeric>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/testing/test_util.h"

namespace dtensor {
namespace {

using testing::Unwrap;

// A row of V logits in [-4, 4) from `seed` (testing::Random's generator, not the sampler's).
std::vector<float> Row(int64_t v, uint64_t seed) {
  const std::vector<double> d = testing::Values(testing::Random({v}, DType::kFloat32, seed, -4.0, 4.0));
  return std::vector<float>(d.begin(), d.end());
}

// The naive reference: softmax(logits / T) in double over all tokens; keep the k largest
// and every one equal to the k-th (nanoGPT's `logits < v[-1]` cut; in order, ties by the lower
// index), then the most likely ones in order until their share of the kept mass
// reaches p; renormalise.
std::vector<double> Reference(const std::vector<float>& logits, double temperature, int64_t k, double p) {
  const size_t v = logits.size();
  std::vector<double> out(v, 0.0);
  std::vector<size_t> idx(v);
  std::iota(idx.begin(), idx.end(), size_t{0});
  std::stable_sort(idx.begin(), idx.end(), [&](size_t a, size_t b) { return logits[a] > logits[b]; });
  if (temperature == 0) {
    out[idx[0]] = 1;
    return out;
  }
  size_t keep_k = k > 0 ? std::min(v, static_cast<size_t>(k)) : v;
  while (keep_k < v && logits[idx[keep_k]] == logits[idx[keep_k - 1]]) ++keep_k;
  double m = -1e300;
  for (float x : logits) m = std::max(m, static_cast<double>(x));
  std::vector<double> e(v);
  for (size_t i = 0; i < v; ++i) e[i] = std::exp((logits[i] - m) / temperature);
  double kept_mass = 0;
  for (size_t r = 0; r < keep_k; ++r) kept_mass += e[idx[r]];
  double cum = 0;
  size_t n = 0;
  for (; n < keep_k; ++n) {
    if (n > 0 && cum / kept_mass >= p) break;
    cum += e[idx[n]];
  }
  for (size_t r = 0; r < n; ++r) out[idx[r]] = e[idx[r]] / cum;
  return out;
}

TEST(SamplerTest, DistributionMatchesNaiveReference) {
  for (uint64_t seed = 1; seed <= 20; ++seed) {
    const std::vector<float> logits = Row(50, seed);
    for (double t : {0.0, 0.5, 1.0, 1.7}) {
      for (int64_t k : {0, 1, 5, 50, 80}) {
        for (double p : {1.0, 0.9, 0.5, 0.05}) {
          gpt::Sampler s = Unwrap(gpt::Sampler::Create({.temperature = t, .top_k = k, .top_p = p, .seed = seed}));
          const std::vector<double> got = Unwrap(s.Probabilities(logits));
          const std::vector<double> want = Reference(logits, t, k, p);
          testing::ExpectNear(got, want, {1e-12, 1e-15}, absl::StrCat("seed ", seed, " T ", t, " k ", k, " p ", p));
        }
      }
    }
  }
}

TEST(SamplerTest, TopPDrawsStayInTheNucleusWithTheRightFrequencies) {
  const std::vector<float> logits = Row(40, 77);
  for (double p : {0.3, 0.75, 0.95}) {
    const std::vector<double> want = Reference(logits, 1.0, 0, p);
    const int64_t nucleus = std::count_if(want.begin(), want.end(), [](double x) { return x > 0; });
    ASSERT_LT(nucleus, 40) << "p " << p << " must exclude some tokens for this check";
    gpt::Sampler s = Unwrap(gpt::Sampler::Create({.top_p = p, .seed = 5}));
    constexpr int kDraws = 20000;
    std::vector<double> freq(logits.size(), 0.0);
    for (int i = 0; i < kDraws; ++i) {
      const int64_t tok = Unwrap(s.Next(logits));
      ASSERT_GT(want[static_cast<size_t>(tok)], 0) << "token " << tok << " is outside the top-p " << p << " nucleus";
      freq[static_cast<size_t>(tok)] += 1.0 / kDraws;
    }
    // Binomial standard deviation <= sqrt(0.25 / 20000) = 0.0035: 0.02 is over 5 sigma.
    testing::ExpectNear(freq, want, {0.0, 0.02}, absl::StrCat("frequencies at top_p ", p));
  }
}

TEST(SamplerTest, SeedsReproduceAndDiffer) {
  auto run = [](uint64_t seed) {
    gpt::Sampler s = Unwrap(gpt::Sampler::Create({.temperature = 0.9, .top_k = 20, .top_p = 0.95, .seed = seed}));
    std::vector<int64_t> toks;
    for (uint64_t i = 0; i < 200; ++i) toks.push_back(Unwrap(s.Next(Row(64, 1000 + i % 7))));
    EXPECT_EQ(s.draws(), 200);
    return toks;
  };
  const std::vector<int64_t> a = run(7), b = run(7), c = run(8);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  // Not degenerate: the draws spread over many tokens.
  std::vector<int64_t> distinct = a;
  std::sort(distinct.begin(), distinct.end());
  EXPECT_GT(std::unique(distinct.begin(), distinct.end()) - distinct.begin(), 10);
}

TEST(SamplerTest, TopKOneAndTemperatureZeroAreGreedy) {
  gpt::Sampler k1 = Unwrap(gpt::Sampler::Create({.temperature = 1.3, .top_k = 1, .seed = 3}));
  gpt::Sampler t0 = Unwrap(gpt::Sampler::Create({.temperature = 0, .seed = 4}));
  for (uint64_t seed = 0; seed < 100; ++seed) {
    const std::vector<float> logits = Row(97, seed);
    const int64_t argmax = std::max_element(logits.begin(), logits.end()) - logits.begin();
    EXPECT_EQ(Unwrap(k1.Next(logits)), argmax);
    EXPECT_EQ(Unwrap(t0.Next(logits)), argmax);
  }
  // Ties: greedy takes the lower index; top_k = 1 keeps both (the cut is at the k-th value).
  EXPECT_EQ(Unwrap(t0.Next(std::vector<float>{1, 3, 3, 2})), 1);
  testing::ExpectNear(Unwrap(k1.Probabilities(std::vector<float>{1, 3, 3, 2})), {0, 0.5, 0.5, 0}, {0, 1e-15},
                      "top_k 1 with a tie at the top");
}

// bfloat16 logits (a GPU model's) tie often: top-k keeps every token equal to the k-th, as
// Hugging Face and nanoGPT do, whatever the k and the order of the row.
TEST(SamplerTest, TopKKeepsEveryTokenTiedWithTheKth) {
  for (uint64_t seed = 1; seed <= 10; ++seed) {
    std::vector<float> logits = Row(300, seed);
    for (float& x : logits) x = std::round(x * 4) / 4;  // 33 values: many ties
    for (int64_t k : {1, 2, 7, 40, 299}) {
      gpt::Sampler s = Unwrap(gpt::Sampler::Create({.temperature = 0.7, .top_k = k, .top_p = 0.8, .seed = seed}));
      const std::vector<double> got = Unwrap(s.Probabilities(logits));
      testing::ExpectNear(got, Reference(logits, 0.7, k, 0.8), {1e-12, 1e-15}, absl::StrCat("seed ", seed, " k ", k));
      gpt::Sampler no_p = Unwrap(gpt::Sampler::Create({.top_k = k, .seed = seed}));
      const std::vector<double> all = Unwrap(no_p.Probabilities(logits));
      std::vector<float> sorted = logits;
      std::sort(sorted.begin(), sorted.end(), std::greater<float>());
      const float kth = sorted[static_cast<size_t>(k - 1)];
      for (size_t i = 0; i < logits.size(); ++i) {
        EXPECT_EQ(all[i] > 0, logits[i] >= kth)
            << "seed " << seed << " k " << k << " token " << i << " logit " << logits[i] << " k-th " << kth;
      }
    }
  }
}

TEST(SamplerTest, TensorRowsOfAnyFloatDtype) {
  const std::vector<float> logits = Row(33, 9);
  const Tensor bf = Unwrap(Cast(Unwrap(Tensor::FromVector<float>(logits, {33})), DType::kBFloat16));
  const std::vector<double> rounded = testing::Values(bf);
  gpt::Sampler a = Unwrap(gpt::Sampler::Create({.top_k = 8, .seed = 2}));
  gpt::Sampler b = Unwrap(gpt::Sampler::Create({.top_k = 8, .seed = 2}));
  for (int i = 0; i < 50; ++i) {
    EXPECT_EQ(Unwrap(a.Next(bf)), Unwrap(b.Next(std::vector<float>(rounded.begin(), rounded.end()))));
  }
  EXPECT_EQ(a.Next(Unwrap(Tensor::FromVector<float>(logits, {3, 11}))).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(SamplerTest, BadOptionsAndLogitsAreErrorsNamingThem) {
  struct Bad {
    gpt::SamplerOptions o;
    const char* name;
  };
  const double nan = std::numeric_limits<double>::quiet_NaN();
  for (const Bad& b : std::vector<Bad>{{{.temperature = -0.5}, "temperature"},
                                       {{.temperature = nan}, "temperature"},
                                       {{.top_k = -1}, "top_k"},
                                       {{.top_p = 0}, "top_p"},
                                       {{.top_p = -0.1}, "top_p"},
                                       {{.top_p = 1.5}, "top_p"},
                                       {{.top_p = nan}, "top_p"}}) {
    absl::StatusOr<gpt::Sampler> s = gpt::Sampler::Create(b.o);
    ASSERT_FALSE(s.ok()) << b.name;
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(s.status().message().find(b.name), std::string::npos) << s.status();
  }
  EXPECT_TRUE(gpt::Sampler::Create({.temperature = 0, .top_k = 0, .top_p = 1}).ok());
  gpt::Sampler s = Unwrap(gpt::Sampler::Create({}));
  EXPECT_EQ(s.Next(std::vector<float>{}).status().code(), absl::StatusCode::kInvalidArgument);
  absl::StatusOr<int64_t> n = s.Next(std::vector<float>{0, std::numeric_limits<float>::quiet_NaN()});
  EXPECT_EQ(n.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(n.status().message().find("logit 1"), std::string::npos) << n.status();
  const float ninf = -std::numeric_limits<float>::infinity();
  EXPECT_EQ(s.Next(std::vector<float>{ninf, ninf}).status().code(), absl::StatusCode::kInvalidArgument);
  // -inf logits are never drawn.
  for (int i = 0; i < 100; ++i) EXPECT_EQ(Unwrap(s.Next(std::vector<float>{ninf, 0.5f, ninf})), 1);
}

}  // namespace
}  // namespace dtensor
