#include "examples/gpt/generate.h"

#include <algorithm>
#include <chrono>

#include "absl/strings/str_cat.h"
#include "dtensor/autograd/functional.h"
#include "dtensor/ops/ops.h"
#include "dtensor/tensor/status.h"

namespace dtensor::gpt {

absl::StatusOr<std::vector<float>> LastLogits(const Value& logits) {
  if (logits.dim() != 3 || logits.shape()[0] != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("[Generate] logits must be [1, T, V], got ", ShapeString(logits.shape())));
  }
  Tensor full = logits.local();
  if (logits.is_dtensor()) {  // the last position first (its sharding rule), then gathered: [1, 1, V]
    DT_ASSIGN_OR_RETURN(Value last, fn::Narrow(logits, 1, logits.shape()[1] - 1, 1));
    DT_ASSIGN_OR_RETURN(full, last.dtensor().FullTensor());
  }
  DT_ASSIGN_OR_RETURN(Tensor row, full.Select(1, full.size(1) - 1));  // [1, V]
  DT_ASSIGN_OR_RETURN(row, To(row, Device::Cpu()));
  DT_ASSIGN_OR_RETURN(row, Cast(row, DType::kFloat32));
  DT_ASSIGN_OR_RETURN(row, Contiguous(row));
  return std::vector<float>(row.data<float>(), row.data<float>() + row.numel());
}

absl::StatusOr<GenerateResult> Generate(nn::GPT& model, absl::Span<const int64_t> prompt, Sampler& sampler,
                                        const GenerateOptions& options) {
  const int64_t n = static_cast<int64_t>(prompt.size()), block = model.config().block_size;
  if (n == 0) return absl::InvalidArgumentError("[Generate] the prompt is empty");
  if (options.max_new_tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("[Generate] max_new_tokens must be >= 0, got ", options.max_new_tokens));
  }
  // (Compared without adding to max_new_tokens, which may be near INT64_MAX.)
  if (n > block || std::max<int64_t>(options.max_new_tokens, 1) > block - n + 1) {
    return absl::OutOfRangeError(absl::StrCat(
        "[Generate] a prompt of ", n, " tokens and ", options.max_new_tokens, " new tokens need more than the ", block,
        " positions of block_size (at most ", std::max<int64_t>(block - n + 1, 0), " new tokens fit)"));
  }
  if (options.vocab_limit < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("[Generate] vocab_limit must be >= 0 (0: every id), got ", options.vocab_limit));
  }
  // A stop token the sampler can never pick would silently never stop.
  const int64_t pickable =
      options.vocab_limit > 0 ? std::min(options.vocab_limit, model.config().vocab_size) : model.config().vocab_size;
  if (options.stop_token != -1 && (options.stop_token < 0 || options.stop_token >= pickable)) {
    return absl::InvalidArgumentError(absl::StrCat("[Generate] stop_token ", options.stop_token,
                                                   " is not an id the model can pick (0..", pickable - 1,
                                                   "; -1: never stop early)"));
  }
  GenerateResult out;
  if (options.max_new_tokens == 0) return out;
  NoGradGuard no_grad;
  const bool was_training = model.training();
  model.Eval();
  struct Restore {
    nn::GPT& m;
    bool on;
    ~Restore() { m.Train(on); }
  } restore{model, was_training};

  std::vector<int64_t> context(prompt.begin(), prompt.end());
  nn::KvCache cache(model.config(), options.use_cache ? n + options.max_new_tokens - 1 : 1);
  auto ids = [&](absl::Span<const int64_t> t) -> absl::StatusOr<Variable> {
    DT_ASSIGN_OR_RETURN(Tensor x, Tensor::FromVector<int64_t>(t, {1, static_cast<int64_t>(t.size())}));
    DT_ASSIGN_OR_RETURN(x, To(x, options.device));
    return Variable::Constant(x);
  };
  auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < options.max_new_tokens; ++i) {
    Variable logits;
    if (options.use_cache) {
      // The prompt at once, then the token picked last.
      const absl::Span<const int64_t> fresh =
          i == 0 ? absl::MakeConstSpan(context) : absl::MakeConstSpan(&context.back(), 1);
      DT_ASSIGN_OR_RETURN(Variable x, ids(fresh));
      DT_ASSIGN_OR_RETURN(logits, model.ForwardCached(x, cache));
    } else {
      DT_ASSIGN_OR_RETURN(Variable x, ids(context));
      DT_ASSIGN_OR_RETURN(nn::GPT::Output o, model.Forward(x));
      logits = o.logits;
    }
    DT_ASSIGN_OR_RETURN(std::vector<float> row, LastLogits(logits.value()));
    if (options.vocab_limit > 0 && static_cast<int64_t>(row.size()) > options.vocab_limit) {
      row.resize(static_cast<size_t>(options.vocab_limit));
    }
    DT_ASSIGN_OR_RETURN(int64_t next, sampler.Next(row));
    out.tokens.push_back(next);
    context.push_back(next);
    if (i == 0) {
      const auto t1 = std::chrono::steady_clock::now();
      out.prefill_s = std::chrono::duration<double>(t1 - t0).count();
      t0 = t1;
    }
    if (next == options.stop_token) break;
  }
  out.decode_s =
      out.tokens.size() > 1 ? std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() : 0.0;
  return out;
}

}  // namespace dtensor::gpt
