// Generate: a GPT continues a prompt token by token, each token picked by a Sampler from the
// last position's logits; with a KV cache (GPT::ForwardCached: the prompt in one forward, then
// one position per token) or by recomputing the whole context every step (GPT::Forward, the
// reference the cache is checked against).
//
//   DT_ASSIGN_OR_RETURN(gpt::Sampler sampler, gpt::Sampler::Create({.temperature = 0}));  // greedy
//   DT_ASSIGN_OR_RETURN(gpt::GenerateResult out,
//                       gpt::Generate(model, prompt_ids, sampler, {.max_new_tokens = 64}));
//   // out.tokens: the 64 new ids; out.decode_s / 63: seconds per token after the first
//
// Collective under tensor parallelism: every rank of the model's mesh calls it with the same
// prompt and a Sampler of the same seed; the logits are gathered whole on every rank
// (FullTensor), so every rank picks the same tokens and returns the same result. The model
// runs in eval mode (no dropout) and records no autograd graph; its training mode is restored
// afterwards. No sliding window: prompt length + max_new_tokens - 1 (the positions fed) must
// fit the block size (OutOfRange otherwise, before any forward).
#ifndef DTENSOR_EXAMPLES_GPT_GENERATE_H_
#define DTENSOR_EXAMPLES_GPT_GENERATE_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "dtensor/nn/gpt.h"
#include "examples/gpt/sampler.h"

namespace dtensor::gpt {

struct GenerateOptions {
  int64_t max_new_tokens = 32;    // >= 0
  bool use_cache = true;          // false: recompute the whole context for every token
  int64_t stop_token = -1;        // stop once this token is picked (kept in the result); -1: never;
                                  // else an id that can be picked (below vocab_limit), or InvalidArgument
  Device device = Device::Cpu();  // where the ids go (the model's device)
  // > 0: only ids below it are picked (GPT-2's 50257 tokens in a vocabulary padded to 50304:
  // the padding rows are never sampled); 0: every id.
  int64_t vocab_limit = 0;
};

struct GenerateResult {
  std::vector<int64_t> tokens;  // the new tokens, without the prompt
  double prefill_s = 0;         // the prompt's forward and the first token's pick
  double decode_s = 0;          // every later token
};

absl::StatusOr<GenerateResult> Generate(nn::GPT& model, absl::Span<const int64_t> prompt, Sampler& sampler,
                                        const GenerateOptions& options = {});

// The logits of the last position of `logits` [1, T, V] (a Tensor or a DTensor of any
// layout: gathered, a collective) as float32 on the host.
absl::StatusOr<std::vector<float>> LastLogits(const Value& logits);

}  // namespace dtensor::gpt

#endif  // DTENSOR_EXAMPLES_GPT_GENERATE_H_
