// CUDA causal scaled-dot-product attention, forward and backward.
//
// Legend: q, k, v, out, dout, dq, dk, dv [BH, T, D] contiguous (BH = batch * heads); lse,
// delta float32 [BH, T]. D <= kMaxAttentionHeadDim (128). Everything accumulates in float32.
//
// Where flash_attention.cu's tensor-core kernels take the problem (bfloat16 / float16 heads of
// D = 64, or 128 forward; FlashAttentionSupported) the launchers below hand it to them; the rest
// (float32, other head dims) runs here.
//
// A straightforward tiled design (correctness first, not FlashAttention speed): a block is
// 4 warps; each warp owns 4 rows and each lane owns the head dims lane, lane + 32, ... of
// their accumulators. Tiles of 32 rows of the other operand sit in shared memory as float32,
// transposed with a padded pitch of 33 so that "lane j reads row j" and "lane c reads dim c"
// are both free of bank conflicts.
//   Forward: block = (bh, 16 query rows); loops over key tiles up to the diagonal with an
//            online softmax (running max m and sum l); lse = m + log(l).
//   Backward (no atomics, deterministic):
//            delta[t] = dout[t] . out[t]                              (one warp per row)
//            dq: block = (bh, 16 query rows), loop over key tiles:
//                P = exp(scale q.k - lse), dS = P (dout.v - delta), dq += scale dS k
//            dk, dv: block = (bh, 16 key rows), loop over query tiles from the diagonal:
//                dv += P dout, dk += scale dS q
#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "dtensor/kernels/cuda/device_common.cuh"

namespace dtensor::internal::gpu {
namespace {

constexpr int kWarps = 4;
constexpr int kRowsPerWarp = 4;
constexpr int kBlockRows = kWarps * kRowsPerWarp;                        // rows a block owns
constexpr int kTile = 32;                                                // rows of the other operand per tile
constexpr int kPitch = kTile + 1;                                        // padded pitch of transposed tiles
constexpr int kMaxChunks = static_cast<int>(kMaxAttentionHeadDim / 32);  // head dims per lane
constexpr unsigned kFull = 0xffffffffu;

// Copies rows [row0, row0 + rows) of a [t_len, d] head into dst [rows, d] (row-major) as float;
// rows past t_len are zero.
template <typename T>
__device__ void LoadRows(const T* src, int64_t row0, int rows, int64_t t_len, int d, float* dst) {
  for (int i = threadIdx.x; i < rows * d; i += blockDim.x) {
    const int r = i / d;
    const int64_t t = row0 + r;
    dst[i] = t < t_len ? ToFloat(src[t * d + (i - r * d)]) : 0.0f;
  }
}
// Same, stored transposed: dst[c * kPitch + r].
template <typename T>
__device__ void LoadRowsTransposed(const T* src, int64_t row0, int rows, int64_t t_len, int d, float* dst) {
  for (int i = threadIdx.x; i < rows * d; i += blockDim.x) {
    const int r = i / d, c = i - r * d;
    const int64_t t = row0 + r;
    dst[c * kPitch + r] = t < t_len ? ToFloat(src[t * d + c]) : 0.0f;
  }
}

template <typename T>
__global__ void __launch_bounds__(kWarps * 32)
    AttentionKernel(const T* q, const T* k, const T* v, float scale, T* out, float* lse, int64_t t_len, int d) {
  extern __shared__ float smem[];
  float* qs = smem;                 // [kBlockRows, d]
  float* kt = qs + kBlockRows * d;  // [d, kPitch]: key tile, transposed
  float* vs = kt + d * kPitch;      // [kTile, d]
  const int64_t head = static_cast<int64_t>(blockIdx.x) * t_len * d;
  const int64_t t0 = static_cast<int64_t>(blockIdx.y) * kBlockRows;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  LoadRows(q + head, t0, kBlockRows, t_len, d, qs);

  float o[kRowsPerWarp][kMaxChunks] = {};
  float m[kRowsPerWarp], l[kRowsPerWarp];
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    m[i] = -INFINITY;
    l[i] = 0.0f;
  }
  const int64_t last = std::min<int64_t>(t0 + kBlockRows, t_len) - 1;  // keys [0, last] are needed
  for (int64_t s0 = 0; s0 <= last; s0 += kTile) {
    __syncthreads();  // the previous tile is consumed (and qs is loaded)
    LoadRowsTransposed(k + head, s0, kTile, t_len, d, kt);
    LoadRows(v + head, s0, kTile, t_len, d, vs);
    __syncthreads();
    // Scores of the warp's rows against key s0 + lane.
    float sc[kRowsPerWarp] = {};
    for (int c = 0; c < d; ++c) {
      const float kc = kt[c * kPitch + lane];
#pragma unroll
      for (int i = 0; i < kRowsPerWarp; ++i) sc[i] += qs[(warp * kRowsPerWarp + i) * d + c] * kc;
    }
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) {
      const int64_t t = t0 + warp * kRowsPerWarp + i;
      if (t >= t_len || s0 > t) continue;  // warp-uniform
      const bool ok = s0 + lane <= t;
      const float x = ok ? sc[i] * scale : -INFINITY;
      const float m_new = fmaxf(m[i], WarpMax(x));
      const float p = ok ? expf(x - m_new) : 0.0f;
      const float corr = expf(m[i] - m_new);  // 0 on the first tile (m = -inf)
      l[i] = l[i] * corr + WarpSum(p);
      m[i] = m_new;
      const int keys = static_cast<int>(std::min<int64_t>(kTile, t - s0 + 1));
#pragma unroll
      for (int ch = 0; ch < kMaxChunks; ++ch) o[i][ch] *= corr;
      for (int j = 0; j < keys; ++j) {
        const float pj = __shfl_sync(kFull, p, j);
#pragma unroll
        for (int ch = 0; ch < kMaxChunks; ++ch) {
          const int c = lane + 32 * ch;
          if (c < d) o[i][ch] += pj * vs[j * d + c];
        }
      }
    }
  }
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int64_t t = t0 + warp * kRowsPerWarp + i;
    if (t >= t_len) continue;
    const float inv = 1.0f / l[i];
#pragma unroll
    for (int ch = 0; ch < kMaxChunks; ++ch) {
      const int c = lane + 32 * ch;
      if (c < d) out[head + t * d + c] = FromFloat<T>(o[i][ch] * inv);
    }
    if (lane == 0) lse[static_cast<int64_t>(blockIdx.x) * t_len + t] = m[i] + logf(l[i]);
  }
}

// delta[r] = dout[r] . out[r], one warp per row of [rows, d].
template <typename T>
__global__ void AttentionDeltaKernel(const T* dout, const T* out, float* delta, int64_t rows, int d) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = blockDim.x >> 5;
  for (int64_t r = blockIdx.x * warps + (threadIdx.x >> 5); r < rows; r += gridDim.x * warps) {
    float s = 0.0f;
    for (int c = lane; c < d; c += 32) s += ToFloat(dout[r * d + c]) * ToFloat(out[r * d + c]);
    s = WarpSum(s);
    if (lane == 0) delta[r] = s;
  }
}

template <typename T>
__global__ void __launch_bounds__(kWarps * 32)
    AttentionDqKernel(const T* dout, const T* q, const T* k, const T* v, const float* lse, const float* delta,
                      float scale, T* dq, int64_t t_len, int d) {
  extern __shared__ float smem[];
  float* qs = smem;                  // [kBlockRows, d]
  float* dos = qs + kBlockRows * d;  // [kBlockRows, d]
  float* kt = dos + kBlockRows * d;  // [d, kPitch]
  float* vt = kt + d * kPitch;       // [d, kPitch]
  const int64_t bh = blockIdx.x;
  const int64_t head = bh * t_len * d;
  const int64_t t0 = static_cast<int64_t>(blockIdx.y) * kBlockRows;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  LoadRows(q + head, t0, kBlockRows, t_len, d, qs);
  LoadRows(dout + head, t0, kBlockRows, t_len, d, dos);
  float row_lse[kRowsPerWarp], row_delta[kRowsPerWarp];
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int64_t t = t0 + warp * kRowsPerWarp + i;
    row_lse[i] = t < t_len ? lse[bh * t_len + t] : 0.0f;
    row_delta[i] = t < t_len ? delta[bh * t_len + t] : 0.0f;
  }
  float acc[kRowsPerWarp][kMaxChunks] = {};
  const int64_t last = std::min<int64_t>(t0 + kBlockRows, t_len) - 1;
  for (int64_t s0 = 0; s0 <= last; s0 += kTile) {
    __syncthreads();
    LoadRowsTransposed(k + head, s0, kTile, t_len, d, kt);
    LoadRowsTransposed(v + head, s0, kTile, t_len, d, vt);
    __syncthreads();
    float sc[kRowsPerWarp] = {}, dp[kRowsPerWarp] = {};
    for (int c = 0; c < d; ++c) {
      const float kc = kt[c * kPitch + lane], vc = vt[c * kPitch + lane];
#pragma unroll
      for (int i = 0; i < kRowsPerWarp; ++i) {
        const int r = (warp * kRowsPerWarp + i) * d + c;
        sc[i] += qs[r] * kc;
        dp[i] += dos[r] * vc;
      }
    }
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) {
      const int64_t t = t0 + warp * kRowsPerWarp + i;
      if (t >= t_len || s0 > t) continue;  // warp-uniform
      const bool ok = s0 + lane <= t;
      const float p = ok ? expf(sc[i] * scale - row_lse[i]) : 0.0f;
      const float ds = p * (dp[i] - row_delta[i]);
      const int keys = static_cast<int>(std::min<int64_t>(kTile, t - s0 + 1));
      for (int j = 0; j < keys; ++j) {
        const float dsj = __shfl_sync(kFull, ds, j);
#pragma unroll
        for (int ch = 0; ch < kMaxChunks; ++ch) {
          const int c = lane + 32 * ch;
          if (c < d) acc[i][ch] += dsj * kt[c * kPitch + j];
        }
      }
    }
  }
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int64_t t = t0 + warp * kRowsPerWarp + i;
    if (t >= t_len) continue;
#pragma unroll
    for (int ch = 0; ch < kMaxChunks; ++ch) {
      const int c = lane + 32 * ch;
      if (c < d) dq[head + t * d + c] = FromFloat<T>(acc[i][ch] * scale);
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kWarps * 32)
    AttentionDkvKernel(const T* dout, const T* q, const T* k, const T* v, const float* lse, const float* delta,
                       float scale, T* dk, T* dv, int64_t t_len, int d) {
  extern __shared__ float smem[];
  float* ks = smem;                 // [kBlockRows, d]: this block's keys
  float* vs = ks + kBlockRows * d;  // [kBlockRows, d]
  float* qt = vs + kBlockRows * d;  // [d, kPitch]: query tile, transposed
  float* dot = qt + d * kPitch;     // [d, kPitch]: dout tile, transposed
  float* tl = dot + d * kPitch;     // [kTile]: lse of the query tile
  float* td = tl + kTile;           // [kTile]: delta of the query tile
  const int64_t bh = blockIdx.x;
  const int64_t head = bh * t_len * d;
  const int64_t s0 = static_cast<int64_t>(blockIdx.y) * kBlockRows;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  LoadRows(k + head, s0, kBlockRows, t_len, d, ks);
  LoadRows(v + head, s0, kBlockRows, t_len, d, vs);
  float gk[kRowsPerWarp][kMaxChunks] = {}, gv[kRowsPerWarp][kMaxChunks] = {};
  for (int64_t q0 = s0 / kTile * kTile; q0 < t_len; q0 += kTile) {
    __syncthreads();
    LoadRowsTransposed(q + head, q0, kTile, t_len, d, qt);
    LoadRowsTransposed(dout + head, q0, kTile, t_len, d, dot);
    if (threadIdx.x < kTile) {
      const int64_t t = q0 + threadIdx.x;
      tl[threadIdx.x] = t < t_len ? lse[bh * t_len + t] : 0.0f;
      td[threadIdx.x] = t < t_len ? delta[bh * t_len + t] : 0.0f;
    }
    __syncthreads();
    // Lane = query q0 + lane against the warp's keys.
    float sc[kRowsPerWarp] = {}, dp[kRowsPerWarp] = {};
    for (int c = 0; c < d; ++c) {
      const float qc = qt[c * kPitch + lane], oc = dot[c * kPitch + lane];
#pragma unroll
      for (int i = 0; i < kRowsPerWarp; ++i) {
        const int r = (warp * kRowsPerWarp + i) * d + c;
        sc[i] += ks[r] * qc;
        dp[i] += vs[r] * oc;
      }
    }
    const int64_t tq = q0 + lane;
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) {
      const int64_t s = s0 + warp * kRowsPerWarp + i;
      if (s >= t_len || q0 + kTile <= s) continue;  // warp-uniform: no query of this tile sees key s
      const bool ok = tq >= s && tq < t_len;
      const float p = ok ? expf(sc[i] * scale - tl[lane]) : 0.0f;
      const float ds = p * (dp[i] - td[lane]);
      const int j0 = static_cast<int>(std::max<int64_t>(0, s - q0));
      const int j1 = static_cast<int>(std::min<int64_t>(kTile, t_len - q0));
      for (int j = j0; j < j1; ++j) {
        const float pj = __shfl_sync(kFull, p, j), dsj = __shfl_sync(kFull, ds, j);
#pragma unroll
        for (int ch = 0; ch < kMaxChunks; ++ch) {
          const int c = lane + 32 * ch;
          if (c < d) {
            gv[i][ch] += pj * dot[c * kPitch + j];
            gk[i][ch] += dsj * qt[c * kPitch + j];
          }
        }
      }
    }
  }
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int64_t s = s0 + warp * kRowsPerWarp + i;
    if (s >= t_len) continue;
#pragma unroll
    for (int ch = 0; ch < kMaxChunks; ++ch) {
      const int c = lane + 32 * ch;
      if (c < d) {
        dk[head + s * d + c] = FromFloat<T>(gk[i][ch] * scale);
        dv[head + s * d + c] = FromFloat<T>(gv[i][ch]);
      }
    }
  }
}

// Dynamic shared memory above the default 48 KiB needs an opt-in per kernel (sm_80: up to
// 163 KiB, sm_90: 227 KiB).
template <typename Kernel>
cudaError_t AllowSmem(Kernel kernel, size_t bytes) {
  if (bytes <= 48 * 1024) return cudaSuccess;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
}

// DTENSOR_CUDA_ATTENTION=simple: these kernels even where the tensor-core ones would run.
bool ForceSimple() {
  const char* e = std::getenv("DTENSOR_CUDA_ATTENTION");
  return e != nullptr && std::strcmp(e, "simple") == 0;
}

bool Supported(int64_t bh, int64_t t, int64_t d) {
  return d >= 1 && d <= kMaxAttentionHeadDim && bh <= 0x7fffffff && (t + kBlockRows - 1) / kBlockRows <= 65535;
}

}  // namespace

cudaError_t LaunchAttention(DType dtype, const void* q, const void* k, const void* v, float scale, void* out,
                            float* lse, int64_t bh, int64_t t, int64_t d) {
  if (bh <= 0 || t <= 0) return cudaSuccess;
  if (!ForceSimple() && FlashAttentionSupported(dtype, bh, t, d, /*backward=*/false, {q, k, v, out})) {
    return LaunchFlashAttention(dtype, q, k, v, scale, out, lse, bh, t, d);
  }
  if (!Supported(bh, t, d)) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(bh), static_cast<unsigned>((t + kBlockRows - 1) / kBlockRows));
  const size_t smem = sizeof(float) * static_cast<size_t>(kBlockRows * d + d * kPitch + kTile * d);
  const int di = static_cast<int>(d);
  return DispatchFloat(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const cudaError_t err = AllowSmem(AttentionKernel<T>, smem);
    if (err != cudaSuccess) return err;
    AttentionKernel<T><<<grid, kWarps * 32, smem, cudaStreamPerThread>>>(
        static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v), scale, static_cast<T*>(out), lse,
        t, di);
    return cudaGetLastError();
  });
}

cudaError_t LaunchAttentionBackward(DType dtype, const void* dout, const void* q, const void* k, const void* v,
                                    const void* out, const float* lse, float scale, void* dq, void* dk, void* dv,
                                    float* delta, int64_t bh, int64_t t, int64_t d) {
  if (bh <= 0 || t <= 0) return cudaSuccess;
  if (!Supported(bh, t, d)) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(bh), static_cast<unsigned>((t + kBlockRows - 1) / kBlockRows));
  const size_t smem_dq = sizeof(float) * static_cast<size_t>(2 * kBlockRows * d + 2 * d * kPitch);
  const size_t smem_dkv = smem_dq + sizeof(float) * 2 * kTile;
  const int di = static_cast<int>(d);
  return DispatchFloat(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* pdo = static_cast<const T*>(dout);
    const T* pq = static_cast<const T*>(q);
    const T* pk = static_cast<const T*>(k);
    const T* pv = static_cast<const T*>(v);
    const int64_t rows = bh * t;
    AttentionDeltaKernel<T>
        <<<GridFor(rows * 32), kThreads, 0, cudaStreamPerThread>>>(pdo, static_cast<const T*>(out), delta, rows, di);
    if (!ForceSimple() && FlashAttentionSupported(dtype, bh, t, d, /*backward=*/true, {dout, q, k, v, dq, dk, dv})) {
      return LaunchFlashAttentionBackward(dtype, dout, q, k, v, lse, delta, scale, dq, dk, dv, bh, t, d);
    }
    cudaError_t err = AllowSmem(AttentionDqKernel<T>, smem_dq);
    if (err == cudaSuccess) err = AllowSmem(AttentionDkvKernel<T>, smem_dkv);
    if (err != cudaSuccess) return err;
    AttentionDqKernel<T><<<grid, kWarps * 32, smem_dq, cudaStreamPerThread>>>(pdo, pq, pk, pv, lse, delta, scale,
                                                                              static_cast<T*>(dq), t, di);
    AttentionDkvKernel<T><<<grid, kWarps * 32, smem_dkv, cudaStreamPerThread>>>(
        pdo, pq, pk, pv, lse, delta, scale, static_cast<T*>(dk), static_cast<T*>(dv), t, di);
    return cudaGetLastError();
  });
}

}  // namespace dtensor::internal::gpu
