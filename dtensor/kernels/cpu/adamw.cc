// Fused AdamW step (CPU), PyTorch semantics:
//   p -= lr * wd * p                       (decoupled weight decay, applied first)
//   m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
//   p -= lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)
// One pass over param, grad, m, v (memory bound), split over OpenMP threads.
#include <bit>
#include <cmath>
#include <cstdint>

#include "dtensor/kernels/cpu/cpu_backend.h"
#include "dtensor/kernels/cpu/cpu_internal.h"
#include "dtensor/tensor/status.h"

namespace dtensor::internal {
namespace {

// sqrt(x) for x >= 0 within 1 ulp, branch-free so that the step loop vectorises (std::sqrt
// does not: it may set errno, and the build does not pass -fno-math-errno): an estimate of
// 1/sqrt(x) from the exponent bits, three Newton steps, then sqrt(x) = x * (1/sqrt(x)) with one
// correction step.
// sqrt(0) = 0; subnormal x give a tiny finite value (eps dominates it).
inline float SqrtF(float x) {
  float r = std::bit_cast<float>(0x5f375a86 - (std::bit_cast<int32_t>(x) >> 1));
  r = r * (1.5f - 0.5f * x * r * r);
  r = r * (1.5f - 0.5f * x * r * r);
  r = r * (1.5f - 0.5f * x * r * r);
  const float y = x * r;
  return y + 0.5f * r * (x - y * y);
}

template <typename P, typename G>
void Step(P* param, const G* grad, float* m, float* v, int64_t n, const AdamWParams& hp) {
  const float b1 = hp.beta1, b2 = hp.beta2, lr = hp.lr, eps = hp.eps;
  const float decay = 1.0f - hp.lr * hp.weight_decay;
  const double t = static_cast<double>(hp.step);
  const float inv_bc1 = static_cast<float>(1.0 / (1.0 - std::pow(static_cast<double>(b1), t)));
  const float inv_bc2 = static_cast<float>(1.0 / (1.0 - std::pow(static_cast<double>(b2), t)));
#pragma omp parallel for schedule(static) if (n >= 2 * kParallelGrain)
  for (int64_t i = 0; i < n; ++i) {
    const float g = ToFloat(grad[i]);
    const float mi = b1 * m[i] + (1.0f - b1) * g;
    const float vi = b2 * v[i] + (1.0f - b2) * g * g;
    m[i] = mi;
    v[i] = vi;
    const float p = ToFloat(param[i]) * decay;
    param[i] = FromFloat<P>(p - lr * (mi * inv_bc1) / (SqrtF(vi * inv_bc2) + eps));
  }
}

}  // namespace

absl::Status CpuBackend::AdamW(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v,
                               const AdamWParams& p) {
  if (p.step < 1) return InvalidArg("AdamW", "step must be >= 1 (1-based), got ", p.step);
  if (m.dtype() != DType::kFloat32 || v.dtype() != DType::kFloat32) {
    return InvalidArg("AdamW", "m and v must be float32, got ", DTypeName(m.dtype()), " and ", DTypeName(v.dtype()));
  }
  const int64_t n = param.numel();
  if (n == 0) return absl::OkStatus();
  return DispatchFloat("AdamW", param.dtype(), [&](auto ptag) {
    using P = decltype(ptag);
    return DispatchFloat("AdamW", grad.dtype(), [&](auto gtag) {
      using G = decltype(gtag);
      Step(param.data<P>(), grad.data<G>(), m.data<float>(), v.data<float>(), n, p);
      return absl::OkStatus();
    });
  });
}

}  // namespace dtensor::internal
