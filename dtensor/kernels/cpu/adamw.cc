// Fused AdamW step (CPU), PyTorch semantics:
//   p -= lr * wd * p                       (decoupled weight decay, applied first)
//   m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
//   p -= lr * (m / (1 - b1^t)) / (sqrt(v) / sqrt(1 - b2^t) + eps)
// (the square root before the bias correction, as torch: v / (1 - b2^t) would overflow to inf,
// and the step to 0, once |g| > ~1.8e19).
// One pass over param, grad, m, v (memory bound), split over OpenMP threads; AdamWMulti also
// sums the squares of the gradients it reads where asked (the gradient norm, in the same pass),
// and multiplies each gradient by its grad_scale as it reads it (clipping, without a pass).
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "dtensor/kernels/cpu/cpu_backend.h"
#include "dtensor/kernels/cpu/cpu_internal.h"
#include "dtensor/tensor/status.h"

namespace dtensor::internal {
namespace {

// sqrt(x) for x >= 0 within 1 ulp, branch-free so that the step loop vectorises whatever the
// math flags (std::sqrt may set errno where -fno-math-errno is not passed): an estimate of
// 1/sqrt(x) from the exponent bits, three Newton steps, then sqrt(x) = x * (1/sqrt(x)) with one
// correction step. sqrt(0) = 0 and sqrt(inf) = inf (the steps would make inf - inf = NaN: a
// gradient of 1e21 overflows v); a subnormal x is scaled by 2^24 first
// (the estimate is far off there, and eps = 0 is allowed).
inline float SqrtF(float x) {
  const float tiny = x < std::numeric_limits<float>::min() ? 16777216.0f : 1.0f;
  const float xs = x * tiny;
  float r = std::bit_cast<float>(0x5f375a86 - (std::bit_cast<int32_t>(xs) >> 1));
  r = r * (1.5f - 0.5f * xs * r * r);
  r = r * (1.5f - 0.5f * xs * r * r);
  r = r * (1.5f - 0.5f * xs * r * r);
  const float y = xs * r;
  const float s = (y + 0.5f * r * (xs - y * y)) * (tiny == 1.0f ? 1.0f : 1.0f / 4096.0f);
  return x > std::numeric_limits<float>::max() ? x : s;  // inf where x is (a select: std::fmax is a libm call)
}

// The step's constants.
struct StepConsts {
  float b1, b2, lr, eps, decay, inv_bc1, inv_sqrt_bc2;
  float gscale;  // the gradient's factor (1: none; x * 1.0f is x exactly)
  StepConsts(const AdamWParams& hp, float grad_scale)
      : b1(hp.beta1),
        b2(hp.beta2),
        lr(hp.lr),
        eps(hp.eps),
        decay(1.0f - hp.lr * hp.weight_decay),
        inv_bc1(
            static_cast<float>(1.0 / (1.0 - std::pow(static_cast<double>(hp.beta1), static_cast<double>(hp.step))))),
        // pow rather than 1 / sqrt: pow is the one libm call the step may make (adamw_calls_no_libm).
        inv_sqrt_bc2(static_cast<float>(
            std::pow(1.0 - std::pow(static_cast<double>(hp.beta2), static_cast<double>(hp.step)), -0.5))),
        gscale(grad_scale) {}
};

template <typename P, typename G>
inline void StepRange(P* param, const G* grad, float* m, float* v, int64_t begin, int64_t end, const StepConsts& k) {
  for (int64_t i = begin; i < end; ++i) {
    const float g = ToFloat(grad[i]) * k.gscale;
    const float mi = k.b1 * m[i] + (1.0f - k.b1) * g;
    const float vi = k.b2 * v[i] + (1.0f - k.b2) * g * g;
    m[i] = mi;
    v[i] = vi;
    const float p = ToFloat(param[i]) * k.decay;
    param[i] = FromFloat<P>(p - k.lr * (mi * k.inv_bc1) / (SqrtF(vi) * k.inv_sqrt_bc2 + k.eps));
  }
}

template <typename P, typename G>
void Step(P* param, const G* grad, float* m, float* v, int64_t n, const AdamWParams& hp, float grad_scale) {
  const StepConsts k(hp, grad_scale);
  ParallelFor(n, kParallelGrain, [&](int64_t begin, int64_t end) { StepRange(param, grad, m, v, begin, end, k); });
}

// Step, and SumOfSquares(grad) into *square_sum: per chunk of kSquareChunk elements, its sum of
// squares (SquareSumChunk: the same bits as SumOfSquares) then its update, while the chunk's
// gradient is still in cache, so the gradient is read from memory once.
template <typename P, typename G>
void StepWithSquareSum(P* param, const G* grad, float* m, float* v, int64_t n, const AdamWParams& hp, float grad_scale,
                       float* square_sum) {
  const StepConsts k(hp, grad_scale);
  const int64_t chunks = (n + kSquareChunk - 1) / kSquareChunk;
  std::vector<double> partial(static_cast<size_t>(chunks));
  ParallelFor(chunks, 1, [&](int64_t b, int64_t e) {
    for (int64_t c = b; c < e; ++c) {
      const int64_t begin = c * kSquareChunk, end = std::min(n, begin + kSquareChunk);
      partial[static_cast<size_t>(c)] = SquareSumChunk(grad + begin, end - begin);
      StepRange(param, grad, m, v, begin, end, k);
    }
  });
  *square_sum = AddSquareSumChunks(partial);
}

}  // namespace

namespace {

// The backend's own checks of one entry (the ops layer checks the rest first).
absl::Status CheckOne(const Tensor& m, const Tensor& v, const AdamWParams& p, const Tensor& square_sum,
                      const Tensor& grad_scale) {
  if (p.step < 1) return InvalidArg("AdamW", "step must be >= 1 (1-based), got ", p.step);
  if (m.dtype() != DType::kFloat32 || v.dtype() != DType::kFloat32) {
    return InvalidArg("AdamW", "m and v must be float32, got ", DTypeName(m.dtype()), " and ", DTypeName(v.dtype()));
  }
  if (square_sum.defined() &&
      (square_sum.dtype() != DType::kFloat32 || square_sum.numel() != 1 || !square_sum.device().is_cpu())) {
    return InvalidArg("AdamW", "grad_square_sum must be a float32 of one element on the cpu, got ",
                      DTypeName(square_sum.dtype()), " ", ShapeString(square_sum.shape()), " on ",
                      square_sum.device().ToString());
  }
  if (grad_scale.defined() &&
      (grad_scale.dtype() != DType::kFloat32 || grad_scale.numel() != 1 || !grad_scale.device().is_cpu())) {
    return InvalidArg("AdamW", "grad_scale must be a float32 of one element on the cpu, got ",
                      DTypeName(grad_scale.dtype()), " ", ShapeString(grad_scale.shape()), " on ",
                      grad_scale.device().ToString());
  }
  return absl::OkStatus();
}

// AdamW on grad * grad_scale (where defined), and the sum of squares of grad into square_sum
// when it is defined (both checked by CheckOne).
absl::Status AdamWOne(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v, const AdamWParams& p,
                      const Tensor& square_sum, const Tensor& grad_scale) {
  const int64_t n = param.numel();
  const float gscale = grad_scale.defined() ? grad_scale.data<float>()[0] : 1.0f;
  if (n == 0) {
    if (square_sum.defined()) square_sum.data<float>()[0] = 0.0f;
    return absl::OkStatus();
  }
  return DispatchFloat("AdamW", param.dtype(), [&](auto ptag) {
    using P = decltype(ptag);
    return DispatchFloat("AdamW", grad.dtype(), [&](auto gtag) {
      using G = decltype(gtag);
      if (square_sum.defined()) {
        StepWithSquareSum(param.data<P>(), grad.data<G>(), m.data<float>(), v.data<float>(), n, p, gscale,
                          square_sum.data<float>());
      } else {
        Step(param.data<P>(), grad.data<G>(), m.data<float>(), v.data<float>(), n, p, gscale);
      }
      return absl::OkStatus();
    });
  });
}

}  // namespace

absl::Status CpuBackend::AdamW(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v,
                               const AdamWParams& p) {
  DT_RETURN_IF_ERROR(CheckOne(m, v, p, Tensor(), Tensor()));
  return AdamWOne(param, grad, m, v, p, Tensor(), Tensor());
}

absl::Status CpuBackend::AdamWMulti(absl::Span<const AdamWTensors> list, const AdamWParams& p) {
  // Every entry checked before any moves.
  for (const AdamWTensors& t : list) {
    AdamWParams one = p;
    one.step = t.step;
    DT_RETURN_IF_ERROR(CheckOne(t.m, t.v, one, t.grad_square_sum, t.grad_scale));
  }
  for (const AdamWTensors& t : list) {
    AdamWParams one = p;
    one.step = t.step;
    DT_RETURN_IF_ERROR(AdamWOne(t.param, t.grad, t.m, t.v, one, t.grad_square_sum, t.grad_scale));
  }
  return absl::OkStatus();
}

}  // namespace dtensor::internal
