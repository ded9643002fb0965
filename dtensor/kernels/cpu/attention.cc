// Causal scaled-dot-product attention, forward and backward (CPU).
//
// Legend: q, k, v, out, dout, dq, dk, dv [B, H, T, D] row views (stride 1 along D, any strides
// elsewhere: heads split out of a fused qkv projection, or an output laid out as [B, T, H, D],
// are read and written where they lie); lse float32 [B, H, T] contiguous.
// Each (batch, head) is an independent [T, D] problem, computed in float32 with OpenBLAS sgemm
// over blocks of kQueryBlock query rows (sgemm takes a head's row stride as its leading
// dimension, so a float32 head is used in place; bfloat16 and float16 heads are converted
// through per-thread scratch); a block of rows [r0, r1) only needs keys [0, r1), so
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

// Where the heads of a [B, H, T, D] row view lie: head bh = b * H + h starts at b * sb + h * sh,
// its rows `ld` apart (stride 1 along D).
struct Heads {
  int64_t h, sb, sh, ld;
  Heads(const Tensor& x, int64_t d)
      // One row: its stride addresses nothing, and sgemm wants ld >= D.
      : h(x.size(1)), sb(x.stride(0)), sh(x.stride(1)), ld(x.size(2) == 1 ? d : x.stride(2)) {}
  int64_t Offset(int64_t bh) const { return bh / h * sb + bh % h * sh; }
};

// A head as float32 rows: `p` with rows `ld` apart.
struct RowsF32 {
  float* p;
  int64_t ld;
};

// Head bh of `base` as float32: in place for float, else converted into scratch (rows d apart).
template <typename T>
RowsF32 LoadHead(const T* base, const Heads& hs, int64_t bh, int64_t t, int64_t d, std::vector<float>& scratch) {
  const T* src = base + hs.Offset(bh);
  if constexpr (std::is_same_v<T, float>) {
    return {const_cast<float*>(src), hs.ld};
  } else {
    scratch.resize(static_cast<size_t>(t * d));
    for (int64_t i = 0; i < t; ++i) LoadRow(src + i * hs.ld, scratch.data() + i * d, d);
    return {scratch.data(), d};
  }
}
// Where to compute head bh of `base`: in place for float, else scratch (then StoreHead).
template <typename T>
RowsF32 OutHead(T* base, const Heads& hs, int64_t bh, int64_t t, int64_t d, std::vector<float>& scratch) {
  if constexpr (std::is_same_v<T, float>) {
    return {base + hs.Offset(bh), hs.ld};
  } else {
    scratch.resize(static_cast<size_t>(t * d));
    return {scratch.data(), d};
  }
}
template <typename T>
void StoreHead(const RowsF32& src, T* base, const Heads& hs, int64_t bh, int64_t t, int64_t d) {
  if constexpr (!std::is_same_v<T, float>) {
    T* dst = base + hs.Offset(bh);
    for (int64_t i = 0; i < t; ++i) StoreRow(src.p + i * src.ld, dst + i * hs.ld, d);
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

// One head: o = softmax(scale * q k^T, causal) v, lse per row. q, k, v, o [T, D] rows.
void HeadForward(RowsF32 q, RowsF32 k, RowsF32 v, int64_t t, int64_t d, float scale, RowsF32 o, float* lse,
                 Scratch& sc) {
  sc.s.resize(static_cast<size_t>(std::min(t, kQueryBlock) * t));
  for (int64_t r0 = 0; r0 < t; r0 += kQueryBlock) {
    const int64_t r1 = std::min(t, r0 + kQueryBlock);
    const int64_t m = r1 - r0;  // rows in this block; keys [0, r1)
    float* s = sc.s.data();     // [m, r1]
    Sgemm(false, true, m, r1, d, scale, q.p + r0 * q.ld, q.ld, k.p, k.ld, 0.0f, s, r1);
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
    Sgemm(false, false, m, d, r1, 1.0f, s, r1, v.p, v.ld, 0.0f, o.p + r0 * o.ld, o.ld);
  }
}

// One head's gradients. dq, dk, dv [T, D] rows are overwritten.
void HeadBackward(RowsF32 dout, RowsF32 q, RowsF32 k, RowsF32 v, RowsF32 o, const float* lse, int64_t t, int64_t d,
                  float scale, RowsF32 dq, RowsF32 dk, RowsF32 dv, Scratch& sc) {
  const size_t block = static_cast<size_t>(std::min(t, kQueryBlock) * t);
  sc.s.resize(block);
  sc.ds.resize(block);
  sc.rowdot.resize(static_cast<size_t>(t));
  // rowdot[i] = dout[i] . o[i] = sum_j P[i, j] dP[i, j].
  for (int64_t i = 0; i < t; ++i) {
    const float* dr = dout.p + i * dout.ld;
    const float* orow = o.p + i * o.ld;
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t x = 0; x < d; ++x) acc += dr[x] * orow[x];
    sc.rowdot[i] = acc;
  }
  for (int64_t r0 = 0; r0 < t; r0 += kQueryBlock) {
    const int64_t r1 = std::min(t, r0 + kQueryBlock);
    const int64_t m = r1 - r0;
    float* p = sc.s.data();    // [m, r1]
    float* ds = sc.ds.data();  // [m, r1]
    Sgemm(false, true, m, r1, d, scale, q.p + r0 * q.ld, q.ld, k.p, k.ld, 0.0f, p, r1);
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
    for (int64_t i = r0 == 0 ? r1 : r0; i < r1; ++i) {
      std::fill_n(dv.p + i * dv.ld, d, 0.0f);
      std::fill_n(dk.p + i * dk.ld, d, 0.0f);
    }
    // dv[0:r1] += P^T dout[r0:r1]
    Sgemm(true, false, r1, d, m, 1.0f, p, r1, dout.p + r0 * dout.ld, dout.ld, beta, dv.p, dv.ld);
    // dP = dout[r0:r1] v[0:r1]^T, then dS = P * (dP - rowdot).
    Sgemm(false, true, m, r1, d, 1.0f, dout.p + r0 * dout.ld, dout.ld, v.p, v.ld, 0.0f, ds, r1);
    for (int64_t i = 0; i < m; ++i) {
      const float rd = sc.rowdot[r0 + i];
      float* dsr = ds + i * r1;
      const float* pr = p + i * r1;
#pragma omp simd
      for (int64_t j = 0; j < r1; ++j) dsr[j] = pr[j] * (dsr[j] - rd);
    }
    // dq[r0:r1] = scale dS k[0:r1];  dk[0:r1] (+)= scale dS^T q[r0:r1].
    Sgemm(false, false, m, d, r1, scale, ds, r1, k.p, k.ld, 0.0f, dq.p + r0 * dq.ld, dq.ld);
    Sgemm(true, false, r1, d, m, scale, ds, r1, q.p + r0 * q.ld, q.ld, beta, dk.p, dk.ld);
  }
}

}  // namespace

absl::Status CpuBackend::CausalAttention(const Tensor& q, const Tensor& k, const Tensor& v, float scale,
                                         const Tensor& out, const Tensor& lse) {
  if (q.numel() == 0) return absl::OkStatus();
  const int64_t t = q.size(2), d = q.size(3);
  const int64_t bh_count = q.size(0) * q.size(1);
  const Heads qh(q, d), kh(k, d), vh(v, d), oh(out, d);
  return DispatchFloat("CausalAttention", q.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* qp = q.data<T>();
    const T* kp = k.data<T>();
    const T* vp = v.data<T>();
    T* op = out.data<T>();
    float* lp = lse.data<float>();  // [B*H, T]
    ForEachHead(bh_count, t, d, [&](int64_t bh, Scratch& sc) {
      const RowsF32 of = OutHead(op, oh, bh, t, d, sc.o);
      HeadForward(LoadHead(qp, qh, bh, t, d, sc.q), LoadHead(kp, kh, bh, t, d, sc.k), LoadHead(vp, vh, bh, t, d, sc.v),
                  t, d, scale, of, lp + bh * t, sc);
      StoreHead(of, op, oh, bh, t, d);
    });
    return absl::OkStatus();
  });
}

absl::Status CpuBackend::CausalAttentionBackward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                                                 const Tensor& out, const Tensor& lse, float scale, const Tensor& dq,
                                                 const Tensor& dk, const Tensor& dv) {
  if (q.numel() == 0) return absl::OkStatus();
  const int64_t t = q.size(2), d = q.size(3);
  const int64_t bh_count = q.size(0) * q.size(1);
  const Heads doh(dout, d), qh(q, d), kh(k, d), vh(v, d), oh(out, d), dqh(dq, d), dkh(dk, d), dvh(dv, d);
  return DispatchFloat("CausalAttentionBackward", q.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* dop = dout.data<T>();
    const T* qp = q.data<T>();
    const T* kp = k.data<T>();
    const T* vp = v.data<T>();
    const T* op = out.data<T>();
    const float* lp = lse.data<float>();  // [B*H, T]
    T* dqp = dq.data<T>();
    T* dkp = dk.data<T>();
    T* dvp = dv.data<T>();
    ForEachHead(bh_count, t, d, [&](int64_t bh, Scratch& sc) {
      const RowsF32 dqf = OutHead(dqp, dqh, bh, t, d, sc.dq);
      const RowsF32 dkf = OutHead(dkp, dkh, bh, t, d, sc.dk);
      const RowsF32 dvf = OutHead(dvp, dvh, bh, t, d, sc.dv);
      HeadBackward(LoadHead(dop, doh, bh, t, d, sc.dout), LoadHead(qp, qh, bh, t, d, sc.q),
                   LoadHead(kp, kh, bh, t, d, sc.k), LoadHead(vp, vh, bh, t, d, sc.v), LoadHead(op, oh, bh, t, d, sc.o),
                   lp + bh * t, t, d, scale, dqf, dkf, dvf, sc);
      StoreHead(dqf, dqp, dqh, bh, t, d);
      StoreHead(dkf, dkp, dkh, bh, t, d);
      StoreHead(dvf, dvp, dvh, bh, t, d);
    });
    return absl::OkStatus();
  });
}

}  // namespace dtensor::internal
