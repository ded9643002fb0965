#include "examples/gpt/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "dtensor/ops/ops.h"
#include "dtensor/tensor/status.h"

namespace dtensor::gpt {

absl::StatusOr<Sampler> Sampler::Create(const SamplerOptions& o) {
  // (%.17g: 1.0000001 is not shown as 1.)
  if (!(o.temperature >= 0) || !std::isfinite(o.temperature)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("[Sampler] temperature must be finite and >= 0, got %.17g", o.temperature));
  }
  if (o.top_k < 0) return absl::InvalidArgumentError(absl::StrCat("[Sampler] top_k must be >= 0, got ", o.top_k));
  if (!(o.top_p > 0 && o.top_p <= 1)) {
    return absl::InvalidArgumentError(absl::StrFormat("[Sampler] top_p must be in (0, 1], got %.17g", o.top_p));
  }
  return Sampler(o);
}

double Sampler::Uniform(uint64_t i) const {
  // SplitMix64 (Steele, Lea and Flood) of the seed's (i + 1)-th step.
  uint64_t z = options_.seed + (i + 1) * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return static_cast<double>(z >> 11) * 0x1.0p-53;
}

absl::StatusOr<std::vector<double>> Sampler::Probabilities(absl::Span<const float> logits) const {
  const size_t v = logits.size();
  if (v == 0) return absl::InvalidArgumentError("[Sampler] empty logits");
  for (size_t i = 0; i < v; ++i) {
    if (std::isnan(logits[i]) || logits[i] == std::numeric_limits<float>::infinity()) {
      return absl::InvalidArgumentError(absl::StrCat("[Sampler] logit ", i, " is ", logits[i]));
    }
  }
  std::vector<double> p(v, 0.0);
  // Greedy: the first of the largest logits.
  const size_t best = static_cast<size_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
  if (logits[best] == -std::numeric_limits<float>::infinity()) {
    return absl::InvalidArgumentError("[Sampler] every logit is -inf");
  }
  if (options_.temperature == 0) {
    p[best] = 1.0;
    return p;
  }
  // Candidates in descending logit order (ties: lower index first); all of them without
  // filtering.
  const bool top_k = options_.top_k > 0 && static_cast<size_t>(options_.top_k) < v;
  const bool filter = top_k || options_.top_p < 1;
  std::vector<size_t> order(v);
  std::iota(order.begin(), order.end(), size_t{0});
  size_t kept = v;
  if (filter) {
    auto before = [&](size_t a, size_t b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); };
    if (top_k) {
      kept = static_cast<size_t>(options_.top_k);
      const auto kth = order.begin() + static_cast<std::ptrdiff_t>(kept);
      std::partial_sort(order.begin(), kth, order.end(), before);
      // Every token tied with the k-th largest logit stays too (Hugging Face's and nanoGPT's
      // `logits < topk(logits, k)[-1]` cut), after those above it, by index.
      const float cut = logits[order[kept - 1]];
      const auto ties = std::partition(kth, order.end(), [&](size_t i) { return logits[i] == cut; });
      std::sort(kth, ties);
      kept += static_cast<size_t>(ties - kth);
    } else {
      std::sort(order.begin(), order.end(), before);
    }
  }
  const double t = options_.temperature, top = static_cast<double>(logits[best]);
  double total = 0;
  for (size_t r = 0; r < kept; ++r) {
    const size_t i = order[r];
    p[i] = std::exp((static_cast<double>(logits[i]) - top) / t);
    total += p[i];
  }
  if (options_.top_p < 1) {  // the smallest prefix holding top_p of the mass
    double cum = 0;
    size_t r = 0;
    while (r < kept) {
      cum += p[order[r++]];
      if (cum >= options_.top_p * total) break;
    }
    for (size_t q = r; q < kept; ++q) p[order[q]] = 0;
    kept = r;
    total = cum;
  }
  for (size_t r = 0; r < kept; ++r) p[order[r]] /= total;
  return p;
}

absl::StatusOr<int64_t> Sampler::Next(absl::Span<const float> logits) {
  DT_ASSIGN_OR_RETURN(std::vector<double> p, Probabilities(logits));
  const double u = Uniform(static_cast<uint64_t>(draws_++));
  // The token whose cumulative interval holds u; rounding may leave the last sum under 1, so
  // the last token with any mass is the fallback.
  double cum = 0;
  int64_t last = -1;
  for (size_t i = 0; i < p.size(); ++i) {
    if (p[i] == 0) continue;
    cum += p[i];
    last = static_cast<int64_t>(i);
    if (u < cum) return last;
  }
  return last;
}

absl::StatusOr<int64_t> Sampler::Next(const Tensor& logits) {
  if (logits.dim() != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("[Sampler] logits must be one row [V], got ", ShapeString(logits.shape())));
  }
  DT_ASSIGN_OR_RETURN(Tensor host, To(logits, Device::Cpu()));
  DT_ASSIGN_OR_RETURN(host, Cast(host, DType::kFloat32));
  DT_ASSIGN_OR_RETURN(host, Contiguous(host));
  return Next(absl::MakeConstSpan(host.data<float>(), static_cast<size_t>(host.numel())));
}

}  // namespace dtensor::gpt
