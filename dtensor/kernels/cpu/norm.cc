// LayerNorm (also after a residual add, AddLayerNorm) and RmsNorm over the last dim, forward and
// backward (CPU).
//
// Legend: x, h, x1, y, dy, dx are [rows, C] contiguous; weight, bias, dweight, dbias are [C];
// mean, rstd are float32 [rows]. Rows are split over OpenMP threads; everything is computed in
// float32 from rows converted once (bf16/f16). The weight/bias gradients are summed per fixed
// block of rows and then over blocks in order, so they do not depend on the thread count.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "dtensor/kernels/cpu/cpu_backend.h"
#include "dtensor/kernels/cpu/cpu_internal.h"

namespace dtensor::internal {
namespace {

// Rows per partial sum of dweight/dbias in the backward passes.
constexpr int64_t kRowBlock = 16;

// The n values at src as float32: src itself for float, else converted into scratch.
template <typename T>
const float* RowF32(const T* src, int64_t n, float* scratch) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else {
    LoadRow(src, scratch, n);
    return scratch;
  }
}

// Where to compute an output row in float32: dst itself for float, else scratch (then Store).
template <typename T>
float* OutF32(T* dst, float* scratch) {
  if constexpr (std::is_same_v<T, float>) {
    return dst;
  } else {
    return scratch;
  }
}
template <typename T>
void Store(const float* src, int64_t n, T* dst) {
  if constexpr (!std::is_same_v<T, float>) {
    StoreRow(src, dst, n);
  }
}

// A [C] parameter as float32 (an undefined tensor gives `fill`).
template <typename T>
std::vector<float> ParamF32(const Tensor& t, int64_t c, float fill) {
  std::vector<float> out(static_cast<size_t>(c), fill);
  if (t.defined()) {
    const T* p = t.data<T>();
    for (int64_t i = 0; i < c; ++i) out[i] = ToFloat(p[i]);
  }
  return out;
}

// Sums the per-block partials [nblocks, C] over blocks, in block order, into dst [C].
template <typename T>
void SumBlocks(const std::vector<float>& partial, int64_t nblocks, int64_t c, T* dst) {
#pragma omp parallel for schedule(static) if (nblocks * c >= kParallelGrain)
  for (int64_t j = 0; j < c; ++j) {
    double s = 0.0;
    for (int64_t b = 0; b < nblocks; ++b) s += partial[b * c + j];
    dst[j] = FromFloat<T>(static_cast<float>(s));
  }
}

// One row of LayerNorm in float32: yr[i] = (xr[i] - mean) * rstd * w[i] + b[i]; writes mean
// and rstd to *mu, *rs. LayerNormForward uses it with and without the residual, so that the fused
// op's statistics and outputs equal LayerNorm's bit for bit.
inline void LayerNormRow(const float* xr, const float* w, const float* b, int64_t c, float eps, float* yr, float* mu,
                         float* rs) {
  const float inv_c = 1.0f / static_cast<float>(c);
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < c; ++i) sum += xr[i];
  const float m = sum * inv_c;
  float sq = 0.0f;
#pragma omp simd reduction(+ : sq)
  for (int64_t i = 0; i < c; ++i) sq += (xr[i] - m) * (xr[i] - m);
  const float r = 1.0f / std::sqrt(sq * inv_c + eps);
#pragma omp simd
  for (int64_t i = 0; i < c; ++i) yr[i] = (xr[i] - m) * r * w[i] + b[i];
  *mu = m;
  *rs = r;
}

// LayerNorm of x row by row; with h defined, of x1 = x + h (rounded to T, as Binary's kAdd,
// and written to x1): each row of x and h is read once and x1's row is normalised while it is
// still in cache.
template <typename T>
void LayerNormForward(const Tensor& x, const Tensor& h, const Tensor& weight, const Tensor& bias, float eps,
                      const Tensor& x1, const Tensor& y, const Tensor& mean, const Tensor& rstd) {
  const int64_t c = x.size(-1);
  const int64_t rows = x.numel() / c;
  const std::vector<float> w = ParamF32<T>(weight, c, 1.0f);
  const std::vector<float> b = ParamF32<T>(bias, c, 0.0f);
  const T* xp = x.data<T>();                          // [rows, C]
  const T* hp = h.defined() ? h.data<T>() : nullptr;  // [rows, C] or none
  T* x1p = h.defined() ? x1.data<T>() : nullptr;      // [rows, C] or none
  T* yp = y.data<T>();                                // [rows, C]
  float* mp = mean.data<float>();
  float* rp = rstd.data<float>();
#pragma omp parallel if (rows * c >= kParallelGrain)
  {
    std::vector<float> sx, sy;
    if constexpr (!std::is_same_v<T, float>) {
      sx.resize(c);
      sy.resize(c);
    }
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const float* xr;
      if (hp == nullptr) {
        xr = RowF32(xp + r * c, c, sx.data());
      } else {
        const T* xs = xp + r * c;
        const T* hr = hp + r * c;
        T* x1r = x1p + r * c;
        float* sum = OutF32(x1r, sx.data());  // x + h in float32 (x1's row itself for float)
        for (int64_t i = 0; i < c; ++i) sum[i] = ToFloat(xs[i]) + ToFloat(hr[i]);
        if constexpr (!std::is_same_v<T, float>) {
          // Normalise the rounded sum, as LayerNorm of the stored x1 would.
          for (int64_t i = 0; i < c; ++i) {
            x1r[i] = FromFloat<T>(sum[i]);
            sum[i] = ToFloat(x1r[i]);
          }
        }
        xr = sum;
      }
      float* yr = OutF32(yp + r * c, sy.data());
      LayerNormRow(xr, w.data(), b.data(), c, eps, yr, mp + r, rp + r);
      Store(yr, c, yp + r * c);
    }
  }
}

// dres (undefined: none) is added to dx after dx's rounding to T, as a separate Binary add would.
template <typename T>
void LayerNormBackwardImpl(const Tensor& dy, const Tensor& x, const Tensor& weight, const Tensor& mean,
                           const Tensor& rstd, const Tensor& dres, const Tensor& dx, const Tensor& dweight,
                           const Tensor& dbias) {
  const int64_t c = x.size(-1);
  const int64_t rows = x.numel() / c;
  const int64_t nblocks = (rows + kRowBlock - 1) / kRowBlock;
  const std::vector<float> w = ParamF32<T>(weight, c, 1.0f);
  const T* dyp = dy.data<T>();                               // [rows, C]
  const T* xp = x.data<T>();                                 // [rows, C]
  T* dxp = dx.data<T>();                                     // [rows, C]
  const T* drp = dres.defined() ? dres.data<T>() : nullptr;  // [rows, C] or none
  const float* mp = mean.data<float>();
  const float* rp = rstd.data<float>();
  std::vector<float> dw_part(static_cast<size_t>(nblocks * c));  // [nblocks, C]
  std::vector<float> db_part(static_cast<size_t>(nblocks * c));
  const float inv_c = 1.0f / static_cast<float>(c);
#pragma omp parallel if (rows * c >= kParallelGrain)
  {
    std::vector<float> sx, sdy, sdx;
    if constexpr (!std::is_same_v<T, float>) {
      sx.resize(c);
      sdy.resize(c);
      sdx.resize(c);
    }
#pragma omp for schedule(static)
    for (int64_t blk = 0; blk < nblocks; ++blk) {
      float* dwb = dw_part.data() + blk * c;
      float* dbb = db_part.data() + blk * c;
      for (int64_t i = 0; i < c; ++i) dwb[i] = dbb[i] = 0.0f;
      const int64_t r_end = std::min(rows, (blk + 1) * kRowBlock);
      for (int64_t r = blk * kRowBlock; r < r_end; ++r) {
        const float* xr = RowF32(xp + r * c, c, sx.data());
        const float* dyr = RowF32(dyp + r * c, c, sdy.data());
        float* dxr = OutF32(dxp + r * c, sdx.data());
        const float mu = mp[r], rs = rp[r];
        // dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) with g = dy * w.
        float sg = 0.0f, sgx = 0.0f;
#pragma omp simd reduction(+ : sg, sgx)
        for (int64_t i = 0; i < c; ++i) {
          const float xhat = (xr[i] - mu) * rs;
          const float g = dyr[i] * w[i];
          sg += g;
          sgx += g * xhat;
          dwb[i] += dyr[i] * xhat;
          dbb[i] += dyr[i];
        }
        const float mg = sg * inv_c, mgx = sgx * inv_c;
#pragma omp simd
        for (int64_t i = 0; i < c; ++i) {
          const float xhat = (xr[i] - mu) * rs;
          dxr[i] = rs * (dyr[i] * w[i] - mg - xhat * mgx);
        }
        if (drp != nullptr) {
          // A loop of its own, so that the add is not contracted into the multiply above.
          const T* drr = drp + r * c;
          for (int64_t i = 0; i < c; ++i) dxr[i] = ToFloat(FromFloat<T>(dxr[i])) + ToFloat(drr[i]);
        }
        Store(dxr, c, dxp + r * c);
      }
    }
  }
  SumBlocks(dw_part, nblocks, c, dweight.data<T>());
  if (dbias.defined()) SumBlocks(db_part, nblocks, c, dbias.data<T>());
}

template <typename T>
void RmsNormForward(const Tensor& x, const Tensor& weight, float eps, const Tensor& y, const Tensor& rstd) {
  const int64_t c = x.size(-1);
  const int64_t rows = x.numel() / c;
  const std::vector<float> w = ParamF32<T>(weight, c, 1.0f);
  const T* xp = x.data<T>();  // [rows, C]
  T* yp = y.data<T>();        // [rows, C]
  float* rp = rstd.data<float>();
  const float inv_c = 1.0f / static_cast<float>(c);
#pragma omp parallel if (rows * c >= kParallelGrain)
  {
    std::vector<float> sx, sy;
    if constexpr (!std::is_same_v<T, float>) {
      sx.resize(c);
      sy.resize(c);
    }
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const float* xr = RowF32(xp + r * c, c, sx.data());
      float* yr = OutF32(yp + r * c, sy.data());
      float sq = 0.0f;
#pragma omp simd reduction(+ : sq)
      for (int64_t i = 0; i < c; ++i) sq += xr[i] * xr[i];
      const float rs = 1.0f / std::sqrt(sq * inv_c + eps);
#pragma omp simd
      for (int64_t i = 0; i < c; ++i) yr[i] = xr[i] * rs * w[i];
      Store(yr, c, yp + r * c);
      rp[r] = rs;
    }
  }
}

template <typename T>
void RmsNormBackwardImpl(const Tensor& dy, const Tensor& x, const Tensor& weight, const Tensor& rstd, const Tensor& dx,
                         const Tensor& dweight) {
  const int64_t c = x.size(-1);
  const int64_t rows = x.numel() / c;
  const int64_t nblocks = (rows + kRowBlock - 1) / kRowBlock;
  const std::vector<float> w = ParamF32<T>(weight, c, 1.0f);
  const T* dyp = dy.data<T>();  // [rows, C]
  const T* xp = x.data<T>();    // [rows, C]
  T* dxp = dx.data<T>();        // [rows, C]
  const float* rp = rstd.data<float>();
  std::vector<float> dw_part(static_cast<size_t>(nblocks * c));  // [nblocks, C]
  const float inv_c = 1.0f / static_cast<float>(c);
#pragma omp parallel if (rows * c >= kParallelGrain)
  {
    std::vector<float> sx, sdy, sdx;
    if constexpr (!std::is_same_v<T, float>) {
      sx.resize(c);
      sdy.resize(c);
      sdx.resize(c);
    }
#pragma omp for schedule(static)
    for (int64_t blk = 0; blk < nblocks; ++blk) {
      float* dwb = dw_part.data() + blk * c;
      for (int64_t i = 0; i < c; ++i) dwb[i] = 0.0f;
      const int64_t r_end = std::min(rows, (blk + 1) * kRowBlock);
      for (int64_t r = blk * kRowBlock; r < r_end; ++r) {
        const float* xr = RowF32(xp + r * c, c, sx.data());
        const float* dyr = RowF32(dyp + r * c, c, sdy.data());
        float* dxr = OutF32(dxp + r * c, sdx.data());
        const float rs = rp[r];
        // dx = rstd * g - x * rstd^3 * mean(g * x) with g = dy * w.
        float sgx = 0.0f;
#pragma omp simd reduction(+ : sgx)
        for (int64_t i = 0; i < c; ++i) {
          sgx += dyr[i] * w[i] * xr[i];
          dwb[i] += dyr[i] * xr[i] * rs;
        }
        const float k = rs * rs * rs * sgx * inv_c;
#pragma omp simd
        for (int64_t i = 0; i < c; ++i) dxr[i] = rs * dyr[i] * w[i] - xr[i] * k;
        Store(dxr, c, dxp + r * c);
      }
    }
  }
  SumBlocks(dw_part, nblocks, c, dweight.data<T>());
}

}  // namespace

absl::Status CpuBackend::LayerNorm(const Tensor& x, const Tensor& weight, const Tensor& bias, float eps,
                                   const Tensor& y, const Tensor& mean, const Tensor& rstd) {
  if (x.numel() == 0) return absl::OkStatus();
  return DispatchFloat("LayerNorm", x.dtype(), [&](auto tag) {
    LayerNormForward<decltype(tag)>(x, Tensor(), weight, bias, eps, Tensor(), y, mean, rstd);
    return absl::OkStatus();
  });
}

absl::Status CpuBackend::AddLayerNorm(const Tensor& x, const Tensor& h, const Tensor& weight, const Tensor& bias,
                                      float eps, const Tensor& x1, const Tensor& y, const Tensor& mean,
                                      const Tensor& rstd) {
  if (x.numel() == 0) return absl::OkStatus();
  return DispatchFloat("AddLayerNorm", x.dtype(), [&](auto tag) {
    LayerNormForward<decltype(tag)>(x, h, weight, bias, eps, x1, y, mean, rstd);
    return absl::OkStatus();
  });
}

absl::Status CpuBackend::LayerNormBackward(const Tensor& dy, const Tensor& x, const Tensor& weight, const Tensor& mean,
                                           const Tensor& rstd, const Tensor& dx, const Tensor& dweight,
                                           const Tensor& dbias) {
  if (x.numel() == 0) {
    // No rows: the parameter gradients are sums over nothing.
    return DispatchFloat("LayerNormBackward", x.dtype(), [&](auto tag) {
      using T = decltype(tag);
      for (const Tensor* t : {&dweight, &dbias}) {
        if (!t->defined()) continue;
        for (int64_t i = 0; i < t->numel(); ++i) t->data<T>()[i] = FromFloat<T>(0.0f);
      }
      return absl::OkStatus();
    });
  }
  return DispatchFloat("LayerNormBackward", x.dtype(), [&](auto tag) {
    LayerNormBackwardImpl<decltype(tag)>(dy, x, weight, mean, rstd, Tensor(), dx, dweight, dbias);
    return absl::OkStatus();
  });
}

absl::Status CpuBackend::LayerNormBackwardAdd(const Tensor& dy, const Tensor& x, const Tensor& weight,
                                              const Tensor& mean, const Tensor& rstd, const Tensor& dresidual,
                                              const Tensor& dx, const Tensor& dweight, const Tensor& dbias) {
  if (x.numel() == 0) return LayerNormBackward(dy, x, weight, mean, rstd, dx, dweight, dbias);
  return DispatchFloat("LayerNormBackwardAdd", x.dtype(), [&](auto tag) {
    LayerNormBackwardImpl<decltype(tag)>(dy, x, weight, mean, rstd, dresidual, dx, dweight, dbias);
    return absl::OkStatus();
  });
}

absl::Status CpuBackend::RmsNorm(const Tensor& x, const Tensor& weight, float eps, const Tensor& y,
                                 const Tensor& rstd) {
  if (x.numel() == 0) return absl::OkStatus();
  return DispatchFloat("RmsNorm", x.dtype(), [&](auto tag) {
    RmsNormForward<decltype(tag)>(x, weight, eps, y, rstd);
    return absl::OkStatus();
  });
}

absl::Status CpuBackend::RmsNormBackward(const Tensor& dy, const Tensor& x, const Tensor& weight, const Tensor& rstd,
                                         const Tensor& dx, const Tensor& dweight) {
  return DispatchFloat("RmsNormBackward", x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    if (x.numel() == 0) {
      for (int64_t i = 0; i < dweight.numel(); ++i) dweight.data<T>()[i] = FromFloat<T>(0.0f);
      return absl::OkStatus();
    }
    RmsNormBackwardImpl<T>(dy, x, weight, rstd, dx, dweight);
    return absl::OkStatus();
  });
}

}  // namespace dtensor::internal
