// CUDA LayerNorm (also after a residual add) and RmsNorm over the last dim, forward and backward.
//
// Legend: x, h, x1, y, dy, dx [rows, C] contiguous; weight, bias, dweight, dbias [C]; mean, rstd
// float32 [rows]. Everything computes in float32, with the CPU backend's formulas:
//   LayerNorm: mean = sum(x) / C, var = sum((x - mean)^2) / C (biased), rstd = 1/sqrt(var + eps)
//   RmsNorm:   rstd = 1/sqrt(sum(x^2) / C + eps)
// Forward and dx: one block per row. dweight/dbias: deterministic column sums without
// atomics: block (column tile, row split) writes a partial sum per split, then one thread per
// column adds the splits in order and rounds once to weight's dtype.
#include "dtensor/kernels/cuda/device_common.cuh"

namespace dtensor::internal::gpu {
namespace {

// Rows per split of the column sums (at most kMaxSplits splits).
constexpr int64_t kRowsPerSplit = 64;
constexpr int64_t kMaxSplits = 128;

int64_t Splits(int64_t rows) {
  int64_t s = (rows + kRowsPerSplit - 1) / kRowsPerSplit;
  if (s > kMaxSplits) s = kMaxSplits;
  return s < 1 ? 1 : s;
}

template <typename T>
__device__ __forceinline__ float ParamAt(const T* p, int64_t i, float fallback) {
  return p == nullptr ? fallback : ToFloat(p[i]);
}

template <typename T>
__global__ void NormKernel(bool rms, const T* x, const T* weight, const T* bias, float eps, T* y, float* mean,
                           float* rstd, int64_t rows, int64_t c) {
  __shared__ float smem[32];
  const float inv_c = 1.0f / static_cast<float>(c);
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * c;
    T* yr = y + r * c;
    float mu = 0.0f;
    if (!rms) {
      float s = 0.0f;
      for (int64_t j = threadIdx.x; j < c; j += blockDim.x) s += ToFloat(xr[j]);
      mu = BlockSum(s, smem) * inv_c;
    }
    float sq = 0.0f;
    for (int64_t j = threadIdx.x; j < c; j += blockDim.x) {
      const float d = ToFloat(xr[j]) - mu;
      sq += d * d;
    }
    const float rs = 1.0f / sqrtf(BlockSum(sq, smem) * inv_c + eps);
    for (int64_t j = threadIdx.x; j < c; j += blockDim.x) {
      const float v = (ToFloat(xr[j]) - mu) * rs * ParamAt(weight, j, 1.0f);
      yr[j] = FromFloat<T>(rms ? v : v + ParamAt(bias, j, 0.0f));
    }
    if (threadIdx.x == 0) {
      if (!rms) mean[r] = mu;
      rstd[r] = rs;
    }
  }
}

// The residual add and LayerNorm (llm.c's fused_residual_forward), one block per row:
// x1 = x + h rounded to T, written once; then NormKernel's statistics and output of that rounded
// x1. Each thread reads back only the elements of x1 it wrote itself (the same j stride), so
// no barrier is needed between the add and the sums, and those reads hit the cache: x and h
// are read from memory once, x1 and y written once.
template <typename T>
__global__ void AddNormKernel(const T* x, const T* h, const T* weight, const T* bias, float eps, T* x1, T* y,
                              float* mean, float* rstd, int64_t rows, int64_t c) {
  __shared__ float smem[32];
  const float inv_c = 1.0f / static_cast<float>(c);
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * c;
    const T* hr = h + r * c;
    T* x1r = x1 + r * c;
    T* yr = y + r * c;
    float s = 0.0f;
    for (int64_t j = threadIdx.x; j < c; j += blockDim.x) {
      const T v = FromFloat<T>(ToFloat(xr[j]) + ToFloat(hr[j]));
      x1r[j] = v;
      s += ToFloat(v);
    }
    const float mu = BlockSum(s, smem) * inv_c;
    float sq = 0.0f;
    for (int64_t j = threadIdx.x; j < c; j += blockDim.x) {
      const float d = ToFloat(x1r[j]) - mu;
      sq += d * d;
    }
    const float rs = 1.0f / sqrtf(BlockSum(sq, smem) * inv_c + eps);
    for (int64_t j = threadIdx.x; j < c; j += blockDim.x) {
      const float v = (ToFloat(x1r[j]) - mu) * rs * ParamAt(weight, j, 1.0f);
      yr[j] = FromFloat<T>(v + ParamAt(bias, j, 0.0f));
    }
    if (threadIdx.x == 0) {
      mean[r] = mu;
      rstd[r] = rs;
    }
  }
}

// dx, with g = dy * w:
//   LayerNorm: dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), xhat = (x - mean) * rstd
//   RmsNorm:   dx = rstd * g - x * rstd^3 * mean(g * x)
// LayerNorm with dres (AddLayerNorm's backward; null: none): dx rounded to T, plus dres.
template <typename T>
__global__ void NormBackwardKernel(bool rms, const T* dy, const T* x, const T* weight, const float* mean,
                                   const float* rstd, const T* dres, T* dx, int64_t rows, int64_t c) {
  __shared__ float smem[32];
  const float inv_c = 1.0f / static_cast<float>(c);
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* dyr = dy + r * c;
    const T* xr = x + r * c;
    T* dxr = dx + r * c;
    const float rs = rstd[r];
    const float mu = rms ? 0.0f : mean[r];
    float sg = 0.0f, sgx = 0.0f;
    for (int64_t j = threadIdx.x; j < c; j += blockDim.x) {
      const float g = ToFloat(dyr[j]) * ParamAt(weight, j, 1.0f);
      const float xv = ToFloat(xr[j]);
      sg += g;
      sgx += g * (rms ? xv : (xv - mu) * rs);
    }
    sgx = BlockSum(sgx, smem);
    if (rms) {
      const float k = rs * rs * rs * sgx * inv_c;
      for (int64_t j = threadIdx.x; j < c; j += blockDim.x) {
        dxr[j] = FromFloat<T>(rs * ToFloat(dyr[j]) * ParamAt(weight, j, 1.0f) - ToFloat(xr[j]) * k);
      }
    } else {
      const float mg = BlockSum(sg, smem) * inv_c, mgx = sgx * inv_c;
      for (int64_t j = threadIdx.x; j < c; j += blockDim.x) {
        const float xhat = (ToFloat(xr[j]) - mu) * rs;
        const T v = FromFloat<T>(rs * (ToFloat(dyr[j]) * ParamAt(weight, j, 1.0f) - mg - xhat * mgx));
        dxr[j] = dres == nullptr ? v : FromFloat<T>(ToFloat(v) + ToFloat(dres[r * c + j]));
      }
    }
  }
}

// Block (32, 8) at (column tile, split): partial_w[split, col] = sum over the split's rows of
// dy * xhat (LayerNorm) or dy * x * rstd (RmsNorm); partial_b[split, col] = sum of dy.
template <typename T>
__global__ void NormParamPartialKernel(bool rms, const T* dy, const T* x, const float* mean, const float* rstd,
                                       float* partial_w, float* partial_b, int64_t rows, int64_t c,
                                       int64_t rows_per_split) {
  __shared__ float sw[8][33];
  __shared__ float sb[8][33];
  const int64_t col = static_cast<int64_t>(blockIdx.x) * 32 + threadIdx.x;
  const int64_t split = blockIdx.y;
  const int64_t r0 = split * rows_per_split;
  const int64_t r1 = r0 + rows_per_split < rows ? r0 + rows_per_split : rows;
  float aw = 0.0f, ab = 0.0f;
  if (col < c) {
    for (int64_t r = r0 + threadIdx.y; r < r1; r += 8) {
      const float g = ToFloat(dy[r * c + col]);
      const float xv = ToFloat(x[r * c + col]);
      aw += g * (rms ? xv * rstd[r] : (xv - mean[r]) * rstd[r]);
      ab += g;
    }
  }
  sw[threadIdx.y][threadIdx.x] = aw;
  sb[threadIdx.y][threadIdx.x] = ab;
  __syncthreads();
  if (threadIdx.y == 0 && col < c) {
    for (int k = 1; k < 8; ++k) {
      aw += sw[k][threadIdx.x];
      ab += sb[k][threadIdx.x];
    }
    partial_w[split * c + col] = aw;
    partial_b[split * c + col] = ab;
  }
}

// dweight[col] = sum over splits (in order) of partial_w; likewise dbias. Null outputs skipped.
template <typename T>
__global__ void NormParamFinishKernel(const float* partial_w, const float* partial_b, T* dweight, T* dbias,
                                      int64_t splits, int64_t c) {
  for (int64_t col = GlobalThread(); col < c; col += GridThreads()) {
    float w = 0.0f, b = 0.0f;
    for (int64_t s = 0; s < splits; ++s) {
      w += partial_w[s * c + col];
      b += partial_b[s * c + col];
    }
    if (dweight != nullptr) dweight[col] = FromFloat<T>(w);
    if (dbias != nullptr) dbias[col] = FromFloat<T>(b);
  }
}

}  // namespace

cudaError_t LaunchNorm(bool rms, DType dtype, const void* x, const void* weight, const void* bias, float eps, void* y,
                       float* mean, float* rstd, int64_t rows, int64_t c) {
  if (rows <= 0 || c <= 0) return cudaSuccess;
  return DispatchFloat(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    NormKernel<T><<<GridForRows(rows), RowThreads(c), 0, cudaStreamPerThread>>>(
        rms, static_cast<const T*>(x), static_cast<const T*>(weight), static_cast<const T*>(bias), eps,
        static_cast<T*>(y), mean, rstd, rows, c);
    return cudaGetLastError();
  });
}

cudaError_t LaunchAddNorm(DType dtype, const void* x, const void* h, const void* weight, const void* bias, float eps,
                          void* x1, void* y, float* mean, float* rstd, int64_t rows, int64_t c) {
  if (rows <= 0 || c <= 0) return cudaSuccess;
  return DispatchFloat(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    AddNormKernel<T><<<GridForRows(rows), RowThreads(c), 0, cudaStreamPerThread>>>(
        static_cast<const T*>(x), static_cast<const T*>(h), static_cast<const T*>(weight), static_cast<const T*>(bias),
        eps, static_cast<T*>(x1), static_cast<T*>(y), mean, rstd, rows, c);
    return cudaGetLastError();
  });
}

int64_t NormPartialFloats(int64_t rows, int64_t c) { return 2 * Splits(rows) * (c < 1 ? 1 : c); }

cudaError_t LaunchNormBackward(bool rms, DType dtype, const void* dy, const void* x, const void* weight,
                               const float* mean, const float* rstd, const void* dresidual, void* dx, void* dweight,
                               void* dbias, float* partial, int64_t rows, int64_t c) {
  if (c <= 0) return cudaSuccess;
  return DispatchFloat(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* pdy = static_cast<const T*>(dy);
    const T* px = static_cast<const T*>(x);
    if (rows > 0) {
      NormBackwardKernel<T><<<GridForRows(rows), RowThreads(c), 0, cudaStreamPerThread>>>(
          rms, pdy, px, static_cast<const T*>(weight), mean, rstd, static_cast<const T*>(dresidual),
          static_cast<T*>(dx), rows, c);
    }
    if (dweight != nullptr || dbias != nullptr) {
      if (partial == nullptr) return cudaErrorInvalidValue;
      const int64_t splits = Splits(rows);
      const int64_t rows_per_split = (rows + splits - 1) / splits;
      float* pw = partial;
      float* pb = partial + splits * c;
      const dim3 grid(static_cast<unsigned>((c + 31) / 32), static_cast<unsigned>(splits));
      NormParamPartialKernel<T>
          <<<grid, dim3(32, 8), 0, cudaStreamPerThread>>>(rms, pdy, px, mean, rstd, pw, pb, rows, c, rows_per_split);
      NormParamFinishKernel<T><<<GridFor(c), kThreads, 0, cudaStreamPerThread>>>(pw, pb, static_cast<T*>(dweight),
                                                                                 static_cast<T*>(dbias), splits, c);
    }
    return cudaGetLastError();
  });
}

}  // namespace dtensor::internal::gpu
