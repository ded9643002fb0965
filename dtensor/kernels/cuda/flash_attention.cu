// Causal attention on tensor cores (FlashAttention-2's scheme) for bfloat16 / float16 heads of
// D = 64 (forward and backward) or D = 128 (forward): the T x T score matrix is never stored.
//
// Legend: q, k, v, out, dout, dq, dk, dv [BH, T, D] contiguous; lse, delta float32 [BH, T].
// Scores, softmax and every accumulator are float32; the matrix products take bf16/fp16
// operands (P and dS are rounded to the input dtype before their products, as in
// FlashAttention), through mma.sync.m16n8k16 with float32 accumulation (sm_80 and later).
//
// A block is 4 warps over a tile of 64 rows; each warp owns 16 of them, and keeps its operand
// fragments and accumulators in registers in the layouts PTX documents for m16n8k16 (lane =
// 4 * g + t: g = lane / 4 picks rows g and g + 8, t = lane % 4 picks columns 2t, 2t + 1 of
// each 8-column piece). A 16 x 8 float32 result piece in registers is, after rounding, half of
// the 16 x 16 A operand of the next product (S -> P -> P @ V), so probabilities never go
// through shared memory. Tiles of the other operand (64 rows) sit in shared memory, row-major
// with a pitch of D + 8 elements, or transposed [D, 64 + 8] where the product needs pairs of
// adjacent rows; the pads put the 8 rows a warp reads at once in distinct banks.
//   Forward: block = (bh, 64 queries); key tiles up to the diagonal; online softmax in the
//            log2 domain (exp2f) with the running max and sum per row; lse = ln(l) + m ln 2.
//   dK, dV:  block = (bh, 64 keys); query tiles from the diagonal on: S^T = K Q^T,
//            P^T = exp(S^T - lse), dP^T = V dO^T, dS^T = P^T (dP^T - delta),
//            dV += P^T dO, dK += scale dS^T Q.
//   dQ:      block = (bh, 64 queries); key tiles up to the diagonal: dQ += scale dS K.
// No atomics: the results are deterministic. delta (dout . out per row) comes from
// attention.cu, which also decides when these kernels run (FlashAttentionSupported).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "dtensor/kernels/cuda/device_common.cuh"

namespace dtensor::internal::gpu {
namespace {

constexpr int kRows = 64;        // rows of a block's own tile (4 warps x 16)
constexpr int kCols = 64;        // rows of the other operand's tiles
constexpr int kThreadsFa = 128;  // 4 warps
constexpr int kTPitch = kCols + 8;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr unsigned kFullMask = 0xffffffffu;

template <int D>
constexpr int kPitch = D + 8;

// ---- Fragments ----

// Two floats as the pair of 16-bit elements one 32-bit register of an mma operand holds (the
// first in the low half).
template <typename T>
__device__ __forceinline__ uint32_t Pack(float lo, float hi) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&h);
  } else {
    const __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&h);
  }
}

// Two adjacent 16-bit elements (p must be 4-byte aligned).
template <typename T>
__device__ __forceinline__ uint32_t Pair(const T* p) {
  return *reinterpret_cast<const uint32_t*>(p);
}

// c[16 x 8] += a[16 x 16] @ b[16 x 8], float32 accumulation.
template <typename T>
__device__ __forceinline__ void Mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// The A operand (16 x 16, row-major) at columns [16 kk, 16 kk + 16) of the 16 rows starting at
// `rows` of a row-major shared tile of pitch `pitch`.
template <typename T>
__device__ __forceinline__ void LoadA(const T* rows, int pitch, int kk, int g, int t, uint32_t (&a)[4]) {
  const T* r0 = rows + g * pitch + 16 * kk + 2 * t;
  const T* r1 = r0 + 8 * pitch;
  a[0] = Pair(r0);
  a[1] = Pair(r1);
  a[2] = Pair(r0 + 8);
  a[3] = Pair(r1 + 8);
}

// The B operand (16 x 8, k x n) whose column n is row `n0 + n` of a shared tile `src` and whose
// k runs along that row from `k0`: b[k][n] = src[(n0 + n) * pitch + k0 + k].
template <typename T>
__device__ __forceinline__ void LoadB(const T* src, int pitch, int n0, int k0, int g, int t, uint32_t& b0,
                                      uint32_t& b1) {
  const T* p = src + (n0 + g) * pitch + k0 + 2 * t;
  b0 = Pair(p);
  b1 = Pair(p + 8);
}

// The A operand of a product over 16 columns [16 kk, 16 kk + 16) of a 16 x 64 float result held
// as 8 pieces of 16 x 8 (c[n] = columns [8n, 8n + 8)), rounded to T.
template <typename T>
__device__ __forceinline__ void AFromC(const float (&c)[kCols / 8][4], int kk, uint32_t (&a)[4]) {
  a[0] = Pack<T>(c[2 * kk][0], c[2 * kk][1]);
  a[1] = Pack<T>(c[2 * kk][2], c[2 * kk][3]);
  a[2] = Pack<T>(c[2 * kk + 1][0], c[2 * kk + 1][1]);
  a[3] = Pack<T>(c[2 * kk + 1][2], c[2 * kk + 1][3]);
}

// c1 += a1 @ tile1^T and c2 += a2 @ tile2^T, a1 and a2 the warp's 16 x D A operands (D / 16
// k-steps), tile1 and tile2 64-row shared tiles (row-major, pitch D + 8): c[n] is the 16 x 8
// piece against tile rows [8n, 8n + 8).
template <typename T, int D>
__device__ __forceinline__ void TileProducts(const uint32_t (&a1)[D / 16][4], const T* tile1, float (&c1)[kCols / 8][4],
                                             const uint32_t (&a2)[D / 16][4], const T* tile2, float (&c2)[kCols / 8][4],
                                             int g, int t) {
#pragma unroll
  for (int n = 0; n < kCols / 8; ++n) {
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t b0, b1;
      LoadB(tile1, kPitch<D>, 8 * n, 16 * kk, g, t, b0, b1);
      Mma<T>(c1[n], a1[kk], b0, b1);
      LoadB(tile2, kPitch<D>, 8 * n, 16 * kk, g, t, b0, b1);
      Mma<T>(c2[n], a2[kk], b0, b1);
    }
  }
}

// ---- Tiles ----

// Rows [row0, row0 + 64) of a [t_len, D] head into shared memory, zeros past t_len: row-major
// (pitch D + 8) into `rm` and/or transposed ([D, 64 + 8]) into `tr` (either may be null).
template <typename T, int D>
__device__ __forceinline__ void LoadTile(const T* head, int64_t row0, int64_t t_len, T* rm, T* tr) {
  constexpr int kChunks = D / 8;  // 16-byte chunks per row
  for (int i = threadIdx.x; i < kCols * kChunks; i += kThreadsFa) {
    const int r = i / kChunks, c = (i - r * kChunks) * 8;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (row0 + r < t_len) v = *reinterpret_cast<const uint4*>(head + (row0 + r) * D + c);
    if (rm != nullptr) *reinterpret_cast<uint4*>(rm + r * kPitch<D> + c) = v;
    if (tr != nullptr) {
      const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
      for (int j = 0; j < 8; ++j) tr[(c + j) * kTPitch + r] = e[j];
    }
  }
}

// ---- Forward ----

template <typename T, int D>
__global__ void __launch_bounds__(kThreadsFa)
    FlashForwardKernel(const T* q, const T* k, const T* v, float scale_log2, T* out, float* lse, int64_t t_len) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* qs = reinterpret_cast<T*>(smem_raw);  // [64, D + 8]
  T* ks = qs + kRows * kPitch<D>;          // [64, D + 8]
  T* vt = ks + kCols * kPitch<D>;          // [D, 64 + 8]: values, transposed
  const int64_t bh = blockIdx.x;
  const int64_t head = bh * t_len * D;
  // The longest rows (last tiles) first: they have the most key tiles.
  const int64_t q0 = static_cast<int64_t>(gridDim.y - 1 - blockIdx.y) * kRows;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  LoadTile<T, D>(q + head, q0, t_len, qs, nullptr);
  __syncthreads();
  uint32_t qa[D / 16][4];
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) LoadA(qs + warp * 16 * kPitch<D>, kPitch<D>, kk, g, t, qa[kk]);

  float o[D / 8][4] = {};
  float m_lo = -INFINITY, m_hi = -INFINITY, l_lo = 0.0f, l_hi = 0.0f;
  const int64_t r_lo = q0 + warp * 16 + g, r_hi = r_lo + 8;
  const int64_t end = std::min<int64_t>(q0 + kRows, t_len);  // keys [0, end) are needed
  for (int64_t j0 = 0; j0 < end; j0 += kCols) {
    __syncthreads();  // the previous tile is consumed
    LoadTile<T, D>(k + head, j0, t_len, ks, nullptr);
    LoadTile<T, D>(v + head, j0, t_len, nullptr, vt);
    __syncthreads();
    float s[kCols / 8][4] = {};
#pragma unroll
    for (int n = 0; n < kCols / 8; ++n) {
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        uint32_t b0, b1;
        LoadB(ks, kPitch<D>, 8 * n, 16 * kk, g, t, b0, b1);
        Mma<T>(s[n], qa[kk], b0, b1);
      }
    }
    // Scale into the log2 domain, mask (key > query or past the end), row max.
    float mx_lo = -INFINITY, mx_hi = -INFINITY;
#pragma unroll
    for (int n = 0; n < kCols / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int64_t col = j0 + 8 * n + 2 * t + (e & 1);
        const int64_t row = e < 2 ? r_lo : r_hi;
        const bool ok = col <= row && col < t_len;
        s[n][e] = ok ? s[n][e] * scale_log2 : -INFINITY;
      }
      mx_lo = fmaxf(mx_lo, fmaxf(s[n][0], s[n][1]));
      mx_hi = fmaxf(mx_hi, fmaxf(s[n][2], s[n][3]));
    }
#pragma unroll
    for (int off = 1; off <= 2; off <<= 1) {  // over the 4 lanes of a row
      mx_lo = fmaxf(mx_lo, __shfl_xor_sync(kFullMask, mx_lo, off));
      mx_hi = fmaxf(mx_hi, __shfl_xor_sync(kFullMask, mx_hi, off));
    }
    const float new_lo = fmaxf(m_lo, mx_lo), new_hi = fmaxf(m_hi, mx_hi);
    // A row with no key yet (only past t_len: rows beyond the end) keeps 0 as its base.
    const float base_lo = new_lo == -INFINITY ? 0.0f : new_lo, base_hi = new_hi == -INFINITY ? 0.0f : new_hi;
    const float corr_lo = exp2f(m_lo - base_lo), corr_hi = exp2f(m_hi - base_hi);
    m_lo = new_lo;
    m_hi = new_hi;
    float sum_lo = 0.0f, sum_hi = 0.0f;
#pragma unroll
    for (int n = 0; n < kCols / 8; ++n) {
      s[n][0] = exp2f(s[n][0] - base_lo);
      s[n][1] = exp2f(s[n][1] - base_lo);
      s[n][2] = exp2f(s[n][2] - base_hi);
      s[n][3] = exp2f(s[n][3] - base_hi);
      sum_lo += s[n][0] + s[n][1];
      sum_hi += s[n][2] + s[n][3];
    }
    l_lo = l_lo * corr_lo + sum_lo;  // this lane's share of the row sum (same corr on all 4)
    l_hi = l_hi * corr_hi + sum_hi;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      o[n][0] *= corr_lo;
      o[n][1] *= corr_lo;
      o[n][2] *= corr_hi;
      o[n][3] *= corr_hi;
    }
#pragma unroll
    for (int kk = 0; kk < kCols / 16; ++kk) {
      uint32_t pa[4];
      AFromC<T>(s, kk, pa);
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        uint32_t b0, b1;
        LoadB(vt, kTPitch, 8 * n, 16 * kk, g, t, b0, b1);
        Mma<T>(o[n], pa, b0, b1);
      }
    }
  }
#pragma unroll
  for (int off = 1; off <= 2; off <<= 1) {
    l_lo += __shfl_xor_sync(kFullMask, l_lo, off);
    l_hi += __shfl_xor_sync(kFullMask, l_hi, off);
  }
  const float inv_lo = 1.0f / l_lo, inv_hi = 1.0f / l_hi;
#pragma unroll
  for (int n = 0; n < D / 8; ++n) {
    const int c = 8 * n + 2 * t;
    if (r_lo < t_len)
      *reinterpret_cast<uint32_t*>(out + head + r_lo * D + c) = Pack<T>(o[n][0] * inv_lo, o[n][1] * inv_lo);
    if (r_hi < t_len)
      *reinterpret_cast<uint32_t*>(out + head + r_hi * D + c) = Pack<T>(o[n][2] * inv_hi, o[n][3] * inv_hi);
  }
  if (t == 0) {
    if (r_lo < t_len) lse[bh * t_len + r_lo] = m_lo * kLn2 + logf(l_lo);
    if (r_hi < t_len) lse[bh * t_len + r_hi] = m_hi * kLn2 + logf(l_hi);
  }
}

// ---- Backward: dK, dV ----

template <typename T, int D>
__global__ void __launch_bounds__(kThreadsFa)
    FlashDkvKernel(const T* dout, const T* q, const T* k, const T* v, const float* lse, const float* delta, float scale,
                   float scale_log2, T* dk, T* dv, int64_t t_len) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* qs = reinterpret_cast<T*>(smem_raw);                   // [64, D + 8]: queries
  T* dos = qs + kCols * kPitch<D>;                          // [64, D + 8]: dout
  T* qt = dos + kCols * kPitch<D>;                          // [D, 64 + 8]: queries, transposed
  T* dot = qt + D * kTPitch;                                // [D, 64 + 8]: dout, transposed
  float* tl = reinterpret_cast<float*>(dot + D * kTPitch);  // [64]: lse (log2 domain) of the query tile
  float* td = tl + kCols;                                   // [64]: delta of the query tile
  const int64_t bh = blockIdx.x;
  const int64_t head = bh * t_len * D;
  const int64_t s0 = static_cast<int64_t>(gridDim.y - 1 - blockIdx.y) * kRows;  // this block's keys
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  // This warp's keys and values as A operands (staged through the query tiles' space).
  LoadTile<T, D>(k + head, s0, t_len, qs, nullptr);
  LoadTile<T, D>(v + head, s0, t_len, dos, nullptr);
  __syncthreads();
  uint32_t ka[D / 16][4], va[D / 16][4];
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    LoadA(qs + warp * 16 * kPitch<D>, kPitch<D>, kk, g, t, ka[kk]);
    LoadA(dos + warp * 16 * kPitch<D>, kPitch<D>, kk, g, t, va[kk]);
  }
  float gk[D / 8][4] = {}, gv[D / 8][4] = {};
  const int64_t k_lo = s0 + warp * 16 + g, k_hi = k_lo + 8;
  for (int64_t q0 = s0; q0 < t_len; q0 += kCols) {
    __syncthreads();
    LoadTile<T, D>(q + head, q0, t_len, qs, qt);
    LoadTile<T, D>(dout + head, q0, t_len, dos, dot);
    for (int i = threadIdx.x; i < kCols; i += kThreadsFa) {
      const int64_t row = q0 + i;
      tl[i] = row < t_len ? lse[bh * t_len + row] * kLog2e : 0.0f;
      td[i] = row < t_len ? delta[bh * t_len + row] : 0.0f;
    }
    __syncthreads();
    float p[kCols / 8][4] = {}, dp[kCols / 8][4] = {};  // rows: this warp's keys; columns: queries
    TileProducts<T, D>(ka, qs, p, va, dos, dp, g, t);   // S^T = K Q^T, dP^T = V dO^T
#pragma unroll
    for (int n = 0; n < kCols / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int qi = 8 * n + 2 * t + (e & 1);
        const int64_t row_q = q0 + qi, key = e < 2 ? k_lo : k_hi;
        const bool ok = row_q >= key && row_q < t_len;
        const float pe = ok ? exp2f(p[n][e] * scale_log2 - tl[qi]) : 0.0f;
        p[n][e] = pe;
        dp[n][e] = pe * (dp[n][e] - td[qi]);  // dS^T
      }
    }
#pragma unroll
    for (int kk = 0; kk < kCols / 16; ++kk) {
      uint32_t pa[4], dsa[4];
      AFromC<T>(p, kk, pa);
      AFromC<T>(dp, kk, dsa);
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        uint32_t b0, b1;
        LoadB(dot, kTPitch, 8 * n, 16 * kk, g, t, b0, b1);
        Mma<T>(gv[n], pa, b0, b1);
        LoadB(qt, kTPitch, 8 * n, 16 * kk, g, t, b0, b1);
        Mma<T>(gk[n], dsa, b0, b1);
      }
    }
  }
#pragma unroll
  for (int n = 0; n < D / 8; ++n) {
    const int c = 8 * n + 2 * t;
    if (k_lo < t_len) {
      *reinterpret_cast<uint32_t*>(dk + head + k_lo * D + c) = Pack<T>(gk[n][0] * scale, gk[n][1] * scale);
      *reinterpret_cast<uint32_t*>(dv + head + k_lo * D + c) = Pack<T>(gv[n][0], gv[n][1]);
    }
    if (k_hi < t_len) {
      *reinterpret_cast<uint32_t*>(dk + head + k_hi * D + c) = Pack<T>(gk[n][2] * scale, gk[n][3] * scale);
      *reinterpret_cast<uint32_t*>(dv + head + k_hi * D + c) = Pack<T>(gv[n][2], gv[n][3]);
    }
  }
}

// ---- Backward: dQ ----

template <typename T, int D>
__global__ void __launch_bounds__(kThreadsFa)
    FlashDqKernel(const T* dout, const T* q, const T* k, const T* v, const float* lse, const float* delta, float scale,
                  float scale_log2, T* dq, int64_t t_len) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* ks = reinterpret_cast<T*>(smem_raw);  // [64, D + 8]: keys
  T* vs = ks + kCols * kPitch<D>;          // [64, D + 8]: values
  T* kt = vs + kCols * kPitch<D>;          // [D, 64 + 8]: keys, transposed
  const int64_t bh = blockIdx.x;
  const int64_t head = bh * t_len * D;
  const int64_t q0 = static_cast<int64_t>(gridDim.y - 1 - blockIdx.y) * kRows;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  LoadTile<T, D>(q + head, q0, t_len, ks, nullptr);
  LoadTile<T, D>(dout + head, q0, t_len, vs, nullptr);
  __syncthreads();
  uint32_t qa[D / 16][4], da[D / 16][4];
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    LoadA(ks + warp * 16 * kPitch<D>, kPitch<D>, kk, g, t, qa[kk]);
    LoadA(vs + warp * 16 * kPitch<D>, kPitch<D>, kk, g, t, da[kk]);
  }
  const int64_t r_lo = q0 + warp * 16 + g, r_hi = r_lo + 8;
  const float lse_lo = r_lo < t_len ? lse[bh * t_len + r_lo] * kLog2e : 0.0f;
  const float lse_hi = r_hi < t_len ? lse[bh * t_len + r_hi] * kLog2e : 0.0f;
  const float dl_lo = r_lo < t_len ? delta[bh * t_len + r_lo] : 0.0f;
  const float dl_hi = r_hi < t_len ? delta[bh * t_len + r_hi] : 0.0f;
  float acc[D / 8][4] = {};
  const int64_t end = std::min<int64_t>(q0 + kRows, t_len);
  for (int64_t j0 = 0; j0 < end; j0 += kCols) {
    __syncthreads();
    LoadTile<T, D>(k + head, j0, t_len, ks, kt);
    LoadTile<T, D>(v + head, j0, t_len, vs, nullptr);
    __syncthreads();
    float p[kCols / 8][4] = {}, ds[kCols / 8][4] = {};
    TileProducts<T, D>(qa, ks, p, da, vs, ds, g, t);  // S = Q K^T, dP = dO V^T
#pragma unroll
    for (int n = 0; n < kCols / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int64_t col = j0 + 8 * n + 2 * t + (e & 1);
        const bool lo = e < 2;
        const int64_t row = lo ? r_lo : r_hi;
        const bool ok = col <= row && col < t_len && row < t_len;
        const float pe = ok ? exp2f(p[n][e] * scale_log2 - (lo ? lse_lo : lse_hi)) : 0.0f;
        ds[n][e] = pe * (ds[n][e] - (lo ? dl_lo : dl_hi));
      }
    }
#pragma unroll
    for (int kk = 0; kk < kCols / 16; ++kk) {
      uint32_t dsa[4];
      AFromC<T>(ds, kk, dsa);
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        uint32_t b0, b1;
        LoadB(kt, kTPitch, 8 * n, 16 * kk, g, t, b0, b1);
        Mma<T>(acc[n], dsa, b0, b1);
      }
    }
  }
#pragma unroll
  for (int n = 0; n < D / 8; ++n) {
    const int c = 8 * n + 2 * t;
    if (r_lo < t_len)
      *reinterpret_cast<uint32_t*>(dq + head + r_lo * D + c) = Pack<T>(acc[n][0] * scale, acc[n][1] * scale);
    if (r_hi < t_len)
      *reinterpret_cast<uint32_t*>(dq + head + r_hi * D + c) = Pack<T>(acc[n][2] * scale, acc[n][3] * scale);
  }
}

template <typename Kernel>
cudaError_t OptInSmem(Kernel kernel, size_t bytes) {
  if (bytes <= 48 * 1024) return cudaSuccess;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
}

template <int D>
constexpr size_t kForwardSmem = sizeof(uint16_t) * (2 * kCols * kPitch<D> + D * kTPitch);
template <int D>
constexpr size_t kDkvSmem = sizeof(uint16_t) * (2 * kCols * kPitch<D> + 2 * D * kTPitch) + sizeof(float) * 2 * kCols;
template <int D>
constexpr size_t kDqSmem = kForwardSmem<D>;

dim3 Grid(int64_t bh, int64_t t) {
  return dim3(static_cast<unsigned>(bh), static_cast<unsigned>((t + kRows - 1) / kRows));
}

template <typename F>
cudaError_t DispatchHalf(DType dtype, F&& f) {
  if (dtype == DType::kBFloat16) return f(Tag<__nv_bfloat16>{});
  if (dtype == DType::kFloat16) return f(Tag<__half>{});
  return cudaErrorInvalidValue;
}

template <int D>
cudaError_t Forward(DType dtype, const void* q, const void* k, const void* v, float scale, void* out, float* lse,
                    int64_t bh, int64_t t) {
  return DispatchHalf(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const cudaError_t err = OptInSmem(FlashForwardKernel<T, D>, kForwardSmem<D>);
    if (err != cudaSuccess) return err;
    FlashForwardKernel<T, D><<<Grid(bh, t), kThreadsFa, kForwardSmem<D>, cudaStreamPerThread>>>(
        static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v), scale * kLog2e,
        static_cast<T*>(out), lse, t);
    return cudaGetLastError();
  });
}

template <int D>
cudaError_t Backward(DType dtype, const void* dout, const void* q, const void* k, const void* v, const float* lse,
                     const float* delta, float scale, void* dq, void* dk, void* dv, int64_t bh, int64_t t) {
  return DispatchHalf(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    cudaError_t err = OptInSmem(FlashDkvKernel<T, D>, kDkvSmem<D>);
    if (err == cudaSuccess) err = OptInSmem(FlashDqKernel<T, D>, kDqSmem<D>);
    if (err != cudaSuccess) return err;
    const T* pdo = static_cast<const T*>(dout);
    const T* pq = static_cast<const T*>(q);
    const T* pk = static_cast<const T*>(k);
    const T* pv = static_cast<const T*>(v);
    FlashDkvKernel<T, D><<<Grid(bh, t), kThreadsFa, kDkvSmem<D>, cudaStreamPerThread>>>(
        pdo, pq, pk, pv, lse, delta, scale, scale * kLog2e, static_cast<T*>(dk), static_cast<T*>(dv), t);
    FlashDqKernel<T, D><<<Grid(bh, t), kThreadsFa, kDqSmem<D>, cudaStreamPerThread>>>(
        pdo, pq, pk, pv, lse, delta, scale, scale * kLog2e, static_cast<T*>(dq), t);
    return cudaGetLastError();
  });
}

bool Aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

}  // namespace

bool FlashAttentionSupported(DType dtype, int64_t bh, int64_t t, int64_t d, bool backward,
                             std::initializer_list<const void*> pointers) {
  if (dtype != DType::kBFloat16 && dtype != DType::kFloat16) return false;
  if (!(d == 64 || (d == 128 && !backward))) return false;
  if (bh <= 0 || bh > 0x7fffffff || t <= 0 || (t + kRows - 1) / kRows > 65535) return false;
  for (const void* p : pointers) {
    if (!Aligned16(p)) return false;
  }
  // mma.sync on bf16 / fp16 with these shapes needs sm_80 or later.
  int device = 0, major = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) {
    return false;
  }
  return major >= 8;
}

cudaError_t LaunchFlashAttention(DType dtype, const void* q, const void* k, const void* v, float scale, void* out,
                                 float* lse, int64_t bh, int64_t t, int64_t d) {
  if (d == 64) return Forward<64>(dtype, q, k, v, scale, out, lse, bh, t);
  if (d == 128) return Forward<128>(dtype, q, k, v, scale, out, lse, bh, t);
  return cudaErrorInvalidValue;
}

cudaError_t LaunchFlashAttentionBackward(DType dtype, const void* dout, const void* q, const void* k, const void* v,
                                         const float* lse, const float* delta, float scale, void* dq, void* dk,
                                         void* dv, int64_t bh, int64_t t, int64_t d) {
  if (d == 64) return Backward<64>(dtype, dout, q, k, v, lse, delta, scale, dq, dk, dv, bh, t);
  return cudaErrorInvalidValue;
}

}  // namespace dtensor::internal::gpu
