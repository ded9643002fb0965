// generate_bench: the cost of one new token with the KV cache (GPT::ForwardCached of one
// position after the context is cached) and without it (GPT::Forward over the whole context,
// as generation without a cache does), at several context lengths, on a GPT-2 124M-shaped
// model with random weights, one rank, CPU.
//
//   generate_bench                              # contexts 16, 128, 512
//   generate_bench --contexts 16,64 --steps 3 --model tiny
//
// Per context: prefill the cache with `ctx` tokens, then time `steps` single-token forwards
// (positions ctx, ctx + 1, ...) and report their median; time `reps` full forwards of ctx + 1
// tokens and report the median. Each includes bringing the last position's logits to the host.
// The check column is the largest |difference| between the cached and the recomputed logits
// of position ctx (they must agree: float32 rounding only).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "dtensor/kernels/cpu/blas_core.h"
#include "dtensor/nn/gpt.h"
#include "dtensor/ops/ops.h"
#include "dtensor/tensor/status.h"

ABSL_FLAG(std::string, contexts, "16,128,512", "context lengths (tokens already seen)");
ABSL_FLAG(int, steps, 5, "single-token forwards timed per context with the cache");
ABSL_FLAG(int, reps, 2, "full-context forwards timed per context without it");
ABSL_FLAG(std::string, model, "gpt2", "gpt2 (124M: 12 layers, 12 heads, C 768, V 50257) or tiny");

namespace dtensor {
namespace {

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

absl::StatusOr<std::vector<float>> LastRow(const Variable& logits) {
  const Tensor& t = logits.value().local();
  DT_ASSIGN_OR_RETURN(Tensor row, t.Select(1, t.size(1) - 1));
  DT_ASSIGN_OR_RETURN(row, Contiguous(row));
  return std::vector<float>(row.data<float>(), row.data<float>() + row.numel());
}

absl::Status Run() {
  std::vector<int64_t> contexts;
  for (absl::string_view s : absl::StrSplit(absl::GetFlag(FLAGS_contexts), ',', absl::SkipEmpty())) {
    int64_t c = 0;
    if (!absl::SimpleAtoi(s, &c) || c < 1) return absl::InvalidArgumentError("bad --contexts entry " + std::string(s));
    contexts.push_back(c);
  }
  const int steps = std::max(1, absl::GetFlag(FLAGS_steps)), reps = std::max(1, absl::GetFlag(FLAGS_reps));
  nn::GPTConfig cfg;  // GPT-2 124M
  if (absl::GetFlag(FLAGS_model) == "tiny")
    cfg = {.vocab_size = 256, .block_size = 1024, .n_layer = 2, .n_head = 4, .n_embd = 64};
  const int64_t max_ctx = *std::max_element(contexts.begin(), contexts.end());
  if (max_ctx + steps > cfg.block_size) return absl::InvalidArgumentError("contexts + steps exceed the block size");
  DT_ASSIGN_OR_RETURN(std::unique_ptr<nn::GPT> model, nn::GPT::Create(cfg));
  DT_RETURN_IF_ERROR(model->InitWeights(1));
  model->Eval();
  NoGradGuard no_grad;
  std::printf("generate_bench: %lld parameters (%lld layers, %lld heads, C %lld, V %lld), 1 rank, CPU, OpenBLAS %s\n",
              static_cast<long long>(model->NumParameters()), static_cast<long long>(cfg.n_layer),
              static_cast<long long>(cfg.n_head), static_cast<long long>(cfg.n_embd),
              static_cast<long long>(cfg.vocab_size), BlasCoreName().c_str());
  std::vector<int64_t> ids;  // a fixed pseudo-random token stream
  for (int64_t i = 0; i < max_ctx + steps; ++i) ids.push_back((i * 7919 + 13) % cfg.vocab_size);
  auto input = [&](int64_t start, int64_t len) -> absl::StatusOr<Variable> {
    DT_ASSIGN_OR_RETURN(Tensor t, Tensor::FromVector<int64_t>(
                                      std::vector<int64_t>(ids.begin() + start, ids.begin() + start + len), {1, len}));
    return Variable::Constant(t);
  };
  using Clock = std::chrono::steady_clock;
  auto ms = [](Clock::time_point a, Clock::time_point b) {
    return std::chrono::duration<double, std::milli>(b - a).count();
  };

  std::printf("%8s | %14s | %16s | %8s | %12s | %10s\n", "context", "cached ms/tok", "recompute ms/tok", "speedup",
              "prefill ms", "max |diff|");
  for (int64_t ctx : contexts) {
    nn::KvCache cache(cfg, ctx + steps);
    DT_ASSIGN_OR_RETURN(Variable prompt, input(0, ctx));
    const auto p0 = Clock::now();
    DT_ASSIGN_OR_RETURN(Variable pl, model->ForwardCached(prompt, cache));
    DT_RETURN_IF_ERROR(LastRow(pl).status());
    const double prefill = ms(p0, Clock::now());
    std::vector<double> cached;
    std::vector<float> cached_row;  // position ctx
    for (int s = 0; s < steps; ++s) {
      DT_ASSIGN_OR_RETURN(Variable one, input(ctx + s, 1));
      const auto t0 = Clock::now();
      DT_ASSIGN_OR_RETURN(Variable logits, model->ForwardCached(one, cache));
      DT_ASSIGN_OR_RETURN(std::vector<float> row, LastRow(logits));
      cached.push_back(ms(t0, Clock::now()));
      if (s == 0) cached_row = std::move(row);
    }
    std::vector<double> full;
    std::vector<float> full_row;
    for (int r = 0; r < reps; ++r) {
      DT_ASSIGN_OR_RETURN(Variable all, input(0, ctx + 1));
      const auto t0 = Clock::now();
      DT_ASSIGN_OR_RETURN(nn::GPT::Output o, model->Forward(all));
      DT_ASSIGN_OR_RETURN(full_row, LastRow(o.logits));
      full.push_back(ms(t0, Clock::now()));
    }
    double diff = 0;
    for (size_t i = 0; i < full_row.size(); ++i) diff = std::max(diff, std::fabs(double(full_row[i]) - cached_row[i]));
    const double c = Median(cached), f = Median(full);
    std::printf("%8lld | %14.2f | %16.2f | %7.1fx | %12.1f | %10.2e\n", static_cast<long long>(ctx), c, f, f / c,
                prefill, diff);
    std::fflush(stdout);
    if (!(diff <= 1e-3)) return absl::InternalError("cached and recomputed logits differ");
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace dtensor

int main(int argc, char** argv) {
  if (absl::Status blas = dtensor::ReexecWithFasterBlasCore(argv); !blas.ok()) {
    std::fprintf(stderr, "generate_bench: %s\n", blas.ToString().c_str());
  }
  absl::ParseCommandLine(argc, argv);
  absl::Status s = dtensor::Run();
  if (!s.ok()) {
    std::fprintf(stderr, "generate_bench: %s\n", s.ToString().c_str());
    return 1;
  }
  return 0;
}
