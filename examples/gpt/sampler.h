// Sampler: picks the next token from a row of logits: greedy, or a seeded draw with
// temperature, top-k and top-p (nucleus) filtering, as Hugging Face's generate() applies them
// (temperature, then top-k, then top-p).
//
//   DT_ASSIGN_OR_RETURN(gpt::Sampler sampler,
//                       gpt::Sampler::Create({.temperature = 0.8, .top_k = 40, .top_p = 0.95, .seed = 7}));
//   DT_ASSIGN_OR_RETURN(int64_t next, sampler.Next(logits_row));   // logits_row: [V]
//
// Deterministic: the draws come from a counter-based generator (SplitMix64 of the seed and the
// draw's index) turned into doubles by hand, not from <random>'s distributions (which differ
// between standard libraries), and the filtering sorts with a total order (logit, then index).
// So the same seed and the same logits give the same tokens on every rank, every run and every
// platform: under tensor parallelism every rank samples the full (gathered) logits with its
// own Sampler of the same seed and all pick the same token, with no broadcast.
//
// The distribution of one step (Probabilities):
//   temperature == 0: greedy, all mass on the largest logit (the lowest index among equals);
//     top_k and top_p are then irrelevant.
//   otherwise p = softmax(logits / temperature) over the tokens kept by
//     top_k > 0: the k largest logits and every one equal to the k-th (Hugging Face's and
//       nanoGPT's cut at the k-th value: with bfloat16 logits ties are common);
//     top_p < 1: then the smallest prefix of those, in descending probability, whose
//       probability sums to at least top_p (always at least one token: the most likely;
//       among equal logits the lower index comes first);
//   renormalised over the kept tokens (computed in double).
#ifndef DTENSOR_EXAMPLES_GPT_SAMPLER_H_
#define DTENSOR_EXAMPLES_GPT_SAMPLER_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "dtensor/tensor/tensor.h"

namespace dtensor::gpt {

struct SamplerOptions {
  double temperature = 1.0;  // >= 0; 0 is greedy
  int64_t top_k = 0;         // >= 0; 0 keeps every token
  double top_p = 1.0;        // in (0, 1]; 1 keeps every token
  uint64_t seed = 0;
};

class Sampler {
 public:
  Sampler() = default;  // SamplerOptions' defaults: temperature 1, no filtering, seed 0
  // InvalidArgument naming the value: temperature < 0 (or not finite), top_k < 0, top_p
  // outside (0, 1].
  static absl::StatusOr<Sampler> Create(const SamplerOptions& options);

  // The next token for `logits` [V] (V > 0); advances the generator by one draw (greedy too,
  // so switching modes mid-stream keeps later draws aligned). InvalidArgument for an empty
  // row or a NaN logit.
  absl::StatusOr<int64_t> Next(absl::Span<const float> logits);
  // The same for a 1-d tensor of any float dtype on any device (copied to the host).
  absl::StatusOr<int64_t> Next(const Tensor& logits);

  // The distribution Next draws from for `logits`: one probability per token, zeros outside
  // the kept set, summing to 1. Does not advance the generator.
  absl::StatusOr<std::vector<double>> Probabilities(absl::Span<const float> logits) const;

  const SamplerOptions& options() const { return options_; }
  int64_t draws() const { return draws_; }  // how many tokens were picked so far

 private:
  explicit Sampler(const SamplerOptions& o) : options_(o) {}
  // A uniform double in [0, 1) for draw number `i` (53 random bits).
  double Uniform(uint64_t i) const;
  SamplerOptions options_;
  int64_t draws_ = 0;
};

}  // namespace dtensor::gpt

#endif  // DTENSOR_EXAMPLES_GPT_SAMPLER_H_
