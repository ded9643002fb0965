// Causal scaled-dot-product attention, forward and backward (CPU).
//
// Legend: q, k, v, out, dout, dq, dk, dv [B, H, T, D] contiguous; lse float32 [B, H, T].
// Each (batch, head) is an independent [T, D] problem, computed in float32 with OpenBLAS sgemm
// over blocks of kQueryBlock query rows; a block of rows [r0, r1) only needs keys [0, r1), so
// the masked upper triangle beyond the diagonal block is never computed. When there are at least
// as many heads as threads the heads are split over OpenMP threads (sgemm then runs on one
// thread: OpenBLAS does not nest inside a parallel region); otherwise heads run in turn and
// sgemm threads itself.
#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "dtensor/kernels/cpu/cpu_backend.h"
#include "dtensor/kernels/cpu/cpu_internal.h"
#include "dtensor/tensor/status.h"

namespace dtensor::internal {
namespace {

// Query rows per score block: bounds scratch to kQueryBlock * T floats per thread.
constexpr int64_t kQueryBlock = 128;

// n values as float32: src itself for float, else converted into scratch.
template <typename T>
const float* AsF32(const T* src, int64_t n, std::vector<float>& scratch) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else {
    scratch.resize(static_cast<size_t>(n));
    LoadRow(src, scratch.data(), n);
    return scratch.data();
  }
}
// Where to compute n output values: dst itself for float, else scratch (then StoreF32).
template <typename T>
float* OutF32(T* dst, int64_t n, std::vector<float>& scratch) {
  if constexpr (std::is_same_v<T, float>) {
    return dst;
  } else {
    scratch.resize(static_cast<size_t>(n));
    return scratch.data();
  }
}
template <typename T>
void StoreF32(const float* src, int64_t n, T* dst) {
  if constexpr (!std::is_same_v<T, float>) {
    StoreRow(src, dst, n);
  }
}

// Row-major sgemm: c[m, n] = alpha * op(a) @ op(b) + beta * c.
void Sgemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
           const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans,
              static_cast<blasint>(m), static_cast<blasint>(n), static_cast<blasint>(k), alpha, a,
              static_cast<blasint>(lda), b, static_cast<blasint>(ldb), beta, c, static_cast<blasint>(ldc));
}

// Per-thread float32 buffers, grown on demand.
struct Scratch {
  std::vector<float> q, k, v, o, dout, dq, dk, dv;
  std::vector<float> s;   // [kQueryBlock, T] scores, then probabilities
  std::vector<float> ds;  // [kQueryBlock, T] dP, then dS
  std::vector<float> rowdot;
};

// Runs body(bh, scratch) for bh in [0, bh_count): across threads when there are enough heads
// (and work), else in turn so that sgemm can use the threads.
template <typename Body>
void ForEachHead(int64_t bh_count, int64_t t, int64_t d, Body&& body) {
  const bool across = bh_count >= omp_get_max_threads() && bh_count * t * t * d >= (int64_t{1} << 16);
  if (across) {
#pragma omp parallel
    {
      Scratch scratch;
#pragma omp for schedule(dynamic, 1)
      for (int64_t bh = 0; bh < bh_count; ++bh) body(bh, scratch);
    }
  } else {
    Scratch scratch;
    for (int64_t bh = 0; bh < bh_count; ++bh) body(bh, scratch);
  }
}

// One head: o = softmax(scale * q k^T, causal) v, lse per row. q, k, v, o [T, D].
void HeadForward(const float* q, const float* k, const float* v, int64_t t, int64_t d, float scale, float* o,
                 float* lse, Scratch& sc) {
  sc.s.resize(static_cast<size_t>(std::min(t, kQueryBlock) * t));
  for (int64_t r0 = 0; r0 < t; r0 += kQueryBlock) {
    const int64_t r1 = std::min(t, r0 + kQueryBlock);
    const int64_t m = r1 - r0;  // rows in this block; keys [0, r1)
    float* s = sc.s.data();     // [m, r1]
    Sgemm(false, true, m, r1, d, scale, q + r0 * d, d, k, d, 0.0f, s, r1);
    for (int64_t i = 0; i < m; ++i) {
      float* row = s + i * r1;
      const int64_t n = r0 + i + 1;  // keys 0..r0+i are visible
      const float mx = RowMaxKeyed(row, n);
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t j = 0; j < n; ++j) {
        row[j] = ExpKeyClamped(row[j] - mx);
        sum += row[j];
      }
      const float inv = 1.0f / sum;
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) row[j] *= inv;
      for (int64_t j = n; j < r1; ++j) row[j] = 0.0f;
      lse[r0 + i] = mx + std::log(sum);
    }
    Sgemm(false, false, m, d, r1, 1.0f, s, r1, v, d, 0.0f, o + r0 * d, d);
  }
}

// One head's gradients. dq, dk, dv [T, D] are overwritten.
void HeadBackward(const float* dout, const float* q, const float* k, const float* v, const float* o, const float* lse,
                  int64_t t, int64_t d, float scale, float* dq, float* dk, float* dv, Scratch& sc) {
  const size_t block = static_cast<size_t>(std::min(t, kQueryBlock) * t);
  sc.s.resize(block);
  sc.ds.resize(block);
  sc.rowdot.resize(static_cast<size_t>(t));
  // rowdot[i] = dout[i] . o[i] = sum_j P[i, j] dP[i, j].
  for (int64_t i = 0; i < t; ++i) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t x = 0; x < d; ++x) acc += dout[i * d + x] * o[i * d + x];
    sc.rowdot[i] = acc;
  }
  for (int64_t r0 = 0; r0 < t; r0 += kQueryBlock) {
    const int64_t r1 = std::min(t, r0 + kQueryBlock);
    const int64_t m = r1 - r0;
    float* p = sc.s.data();    // [m, r1]
    float* ds = sc.ds.data();  // [m, r1]
    Sgemm(false, true, m, r1, d, scale, q + r0 * d, d, k, d, 0.0f, p, r1);
    for (int64_t i = 0; i < m; ++i) {
      float* row = p + i * r1;
      const int64_t n = r0 + i + 1;
      const float l = lse[r0 + i];
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) row[j] = ExpKeyClamped(row[j] - l);
      for (int64_t j = n; j < r1; ++j) row[j] = 0.0f;
    }
    // dk and dv rows [0, r1) accumulate over blocks: the first block overwrites (beta 0); a
    // later block first zeroes its new key rows [r0, r1), then adds.
    const float beta = r0 == 0 ? 0.0f : 1.0f;
    if (r0 > 0) {
      std::fill(dv + r0 * d, dv + r1 * d, 0.0f);
      std::fill(dk + r0 * d, dk + r1 * d, 0.0f);
    }
    // dv[0:r1] += P^T dout[r0:r1]
    Sgemm(true, false, r1, d, m, 1.0f, p, r1, dout + r0 * d, d, beta, dv, d);
    // dP = dout[r0:r1] v[0:r1]^T, then dS = P * (dP - rowdot).
    Sgemm(false, true, m, r1, d, 1.0f, dout + r0 * d, d, v, d, 0.0f, ds, r1);
    for (int64_t i = 0; i < m; ++i) {
      const float rd = sc.rowdot[r0 + i];
      float* dsr = ds + i * r1;
      const float* pr = p + i * r1;
#pragma omp simd
      for (int64_t j = 0; j < r1; ++j) dsr[j] = pr[j] * (dsr[j] - rd);
    }
    // dq[r0:r1] = scale dS k[0:r1];  dk[0:r1] (+)= scale dS^T q[r0:r1].
    Sgemm(false, false, m, d, r1, scale, ds, r1, k, d, 0.0f, dq + r0 * d, d);
    Sgemm(true, false, r1, d, m, scale, ds, r1, q + r0 * d, d, beta, dk, d);
  }
}

}  // namespace

absl::Status CpuBackend::CausalAttention(const Tensor& q, const Tensor& k, const Tensor& v, float scale,
                                         const Tensor& out, const Tensor& lse) {
  if (q.numel() == 0) return absl::OkStatus();
  const int64_t t = q.size(-2), d = q.size(-1);
  const int64_t bh_count = q.numel() / (t * d);
  const int64_t head = t * d;
  return DispatchFloat("CausalAttention", q.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* qp = q.data<T>();  // [B*H, T, D]
    const T* kp = k.data<T>();
    const T* vp = v.data<T>();
    T* op = out.data<T>();
    float* lp = lse.data<float>();  // [B*H, T]
    ForEachHead(bh_count, t, d, [&](int64_t bh, Scratch& sc) {
      const int64_t off = bh * head;
      const float* qf = AsF32(qp + off, head, sc.q);
      const float* kf = AsF32(kp + off, head, sc.k);
      const float* vf = AsF32(vp + off, head, sc.v);
      float* of = OutF32(op + off, head, sc.o);
      HeadForward(qf, kf, vf, t, d, scale, of, lp + bh * t, sc);
      StoreF32(of, head, op + off);
    });
    return absl::OkStatus();
  });
}

absl::Status CpuBackend::CausalAttentionBackward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                                                 const Tensor& out, const Tensor& lse, float scale, const Tensor& dq,
                                                 const Tensor& dk, const Tensor& dv) {
  if (q.numel() == 0) return absl::OkStatus();
  const int64_t t = q.size(-2), d = q.size(-1);
  const int64_t bh_count = q.numel() / (t * d);
  const int64_t head = t * d;
  return DispatchFloat("CausalAttentionBackward", q.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* dop = dout.data<T>();  // [B*H, T, D]
    const T* qp = q.data<T>();
    const T* kp = k.data<T>();
    const T* vp = v.data<T>();
    const T* op = out.data<T>();
    const float* lp = lse.data<float>();  // [B*H, T]
    T* dqp = dq.data<T>();
    T* dkp = dk.data<T>();
    T* dvp = dv.data<T>();
    ForEachHead(bh_count, t, d, [&](int64_t bh, Scratch& sc) {
      const int64_t off = bh * head;
      const float* dof = AsF32(dop + off, head, sc.dout);
      const float* qf = AsF32(qp + off, head, sc.q);
      const float* kf = AsF32(kp + off, head, sc.k);
      const float* vf = AsF32(vp + off, head, sc.v);
      const float* of = AsF32(op + off, head, sc.o);
      float* dqf = OutF32(dqp + off, head, sc.dq);
      float* dkf = OutF32(dkp + off, head, sc.dk);
      float* dvf = OutF32(dvp + off, head, sc.dv);
      HeadBackward(dof, qf, kf, vf, of, lp + bh * t, t, d, scale, dqf, dkf, dvf, sc);
      StoreF32(dqf, head, dqp + off);
      StoreF32(dkf, head, dkp + off);
      StoreF32(dvf, head, dvp + off);
    });
    return absl::OkStatus();
  });
}

}  // namespace dtensor::internal
