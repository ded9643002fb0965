// CPU batched matrix multiply on OpenBLAS sgemm.
//
// float32 operands whose strides BLAS can describe (row-major, or a transposed view, with a
// leading dimension of at least the row length) go to cblas_sgemm as they are; anything else
// (bfloat16/float16, or float32 with e.g. a stride-0 row dim) is first converted/packed into a
// float32 scratch in the operand's own orientation, and bf16/f16 results are rounded back once.
// Large matrices loop over the batch and let OpenBLAS use the OpenMP pool; small ones split the
// batch across threads instead (OpenBLAS runs single-threaded inside a parallel region).
#include <cblas.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <vector>

#include "dtensor/kernels/cpu/cpu_backend.h"
#include "dtensor/kernels/cpu/cpu_internal.h"
#include "dtensor/tensor/status.h"

namespace dtensor::internal {
namespace {

// Below this many multiply-adds per matrix, batches are split across threads.
constexpr int64_t kSmallGemm = int64_t{1} << 21;  // 128^3

// How a [rows, cols] operand with strides (sr, sc) looks to BLAS (row-major convention).
struct BlasLayout {
  bool ok = false;     // BLAS can read it in place
  bool trans = false;  // stored as [cols, rows] (element (i, j) at j * ld + i)
  int64_t ld = 1;
};

BlasLayout Describe(int64_t rows, int64_t cols, int64_t sr, int64_t sc) {
  const int64_t min_row = std::max<int64_t>(cols, 1), min_col = std::max<int64_t>(rows, 1);
  if ((sc == 1 || cols == 1) && (rows == 1 || sr >= min_row)) return {true, false, rows == 1 ? min_row : sr};
  if ((sr == 1 || rows == 1) && (cols == 1 || sc >= min_col)) return {true, true, cols == 1 ? min_col : sc};
  return {};
}

// Copies a [rows, cols] operand into contiguous float `dst` in orientation `trans` (row-major
// [rows, cols] when false, [cols, rows] when true), so that reads follow the source's layout.
template <typename T>
void Pack(const T* src, int64_t rows, int64_t cols, int64_t sr, int64_t sc, bool trans, float* dst) {
  const int64_t outer = trans ? cols : rows, inner = trans ? rows : cols;
  const int64_t so = trans ? sc : sr, si = trans ? sr : sc;
  ParallelFor(outer, std::max<int64_t>(1, kParallelGrain / std::max<int64_t>(inner, 1)), [&](int64_t b, int64_t e) {
    for (int64_t o = b; o < e; ++o) {
      const T* s = src + o * so;
      float* d = dst + o * inner;
      if (si == 1) {
        for (int64_t i = 0; i < inner; ++i) d[i] = ToFloat(s[i]);
      } else {
        for (int64_t i = 0; i < inner; ++i) d[i] = ToFloat(s[i * si]);
      }
    }
  });
}

struct Dims {
  int64_t batch, m, n, k;
};

template <typename T>
void GemmTyped(const Tensor& a, const Tensor& b, const Tensor& c, const Dims& d, float alpha, float beta) {
  constexpr bool kF32 = std::is_same_v<T, float>;
  const T* pa = static_cast<const T*>(a.raw_data());
  const T* pb = static_cast<const T*>(b.raw_data());
  T* pc = static_cast<T*>(c.raw_data());
  const int64_t sa0 = a.stride(0), sa1 = a.stride(1), sa2 = a.stride(2);
  const int64_t sb0 = b.stride(0), sb1 = b.stride(1), sb2 = b.stride(2);
  const BlasLayout la = Describe(d.m, d.k, sa1, sa2);
  const BlasLayout lb = Describe(d.k, d.n, sb1, sb2);
  const bool direct_a = kF32 && la.ok, direct_b = kF32 && lb.ok;
  // Packed operands keep a describable orientation (transposed when the source is).
  const bool trans_a = la.ok ? la.trans : false, trans_b = lb.ok ? lb.trans : false;
  const int64_t lda = direct_a ? la.ld : (trans_a ? d.m : d.k);
  const int64_t ldb = direct_b ? lb.ld : (trans_b ? d.k : d.n);
  const int64_t mn = d.m * d.n;

  const double mnk = static_cast<double>(d.m) * static_cast<double>(d.n) * static_cast<double>(d.k);
  const bool batch_parallel = d.batch > 1 && mnk <= static_cast<double>(kSmallGemm);
  // OpenBLAS clears C for beta = 0 in a pass of its own (sgemm_beta) that runs well below
  // memset's speed: zeroing C here and accumulating (beta = 1) gives the same values (its kernel
  // adds the product to the cleared C either way) in less time. On this 2-core EPYC, dW's
  // shapes (A^T B, K = 256, C cold as a fresh gradient is; ms per call, 3 runs' best):
  // [3072, 768] 9.3 -> 7.5, [2304, 768] 8.2 -> 5.5, [768, 3072] 8.0 -> 7.3. Where the batch is
  // split over threads the matrices are small and OpenBLAS's pass stays (it runs in cache).
  const bool clear_c = kF32 && beta == 0.0f && !batch_parallel;
  const int64_t grain = batch_parallel ? std::max<int64_t>(1, static_cast<int64_t>(65536.0 / std::max(1.0, mnk)))
                                       : d.batch + 1;  // serial loop; OpenBLAS threads each call
  ParallelFor(d.batch, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch_a(direct_a ? 0 : static_cast<size_t>(d.m * d.k));
    std::vector<float> scratch_b(direct_b ? 0 : static_cast<size_t>(d.k * d.n));
    std::vector<float> scratch_c(kF32 ? 0 : static_cast<size_t>(mn));
    const T* packed_a_src = nullptr;  // skip re-packing a broadcast (batch stride 0) operand
    const T* packed_b_src = nullptr;
    for (int64_t i = begin; i < end; ++i) {
      const T* ai = pa + i * sa0;
      const T* bi = pb + i * sb0;
      T* ci = pc + i * mn;
      const float* fa;
      const float* fb;
      float* fc;
      if constexpr (kF32) {
        fc = ci;
      } else {
        fc = scratch_c.data();
        if (beta != 0.0f) Pack(ci, d.m, d.n, d.n, 1, false, fc);
      }
      if (direct_a) {
        fa = reinterpret_cast<const float*>(ai);
      } else {
        if (ai != packed_a_src) Pack(ai, d.m, d.k, sa1, sa2, trans_a, scratch_a.data());
        packed_a_src = ai;
        fa = scratch_a.data();
      }
      if (direct_b) {
        fb = reinterpret_cast<const float*>(bi);
      } else {
        if (bi != packed_b_src) Pack(bi, d.k, d.n, sb1, sb2, trans_b, scratch_b.data());
        packed_b_src = bi;
        fb = scratch_b.data();
      }
      if (clear_c) {
        ParallelFor(mn, kParallelGrain * 8,
                    [&](int64_t b, int64_t e) { std::memset(fc + b, 0, static_cast<size_t>(e - b) * sizeof(float)); });
      }
      cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans,
                  static_cast<blasint>(d.m), static_cast<blasint>(d.n), static_cast<blasint>(d.k), alpha, fa,
                  static_cast<blasint>(lda), fb, static_cast<blasint>(ldb), clear_c ? 1.0f : beta, fc,
                  static_cast<blasint>(std::max<int64_t>(d.n, 1)));
      if constexpr (!kF32) StoreRow(fc, ci, mn);
    }
  });
}

// c = beta * c (K == 0: the product is empty). beta == 0 writes zeros, NaN or not.
template <typename T>
void ScaleC(T* c, int64_t n, float beta) {
  ParallelFor(n, kParallelGrain, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) c[i] = beta == 0.0f ? FromFloat<T>(0.0f) : FromFloat<T>(beta * ToFloat(c[i]));
  });
}

}  // namespace

absl::Status CpuBackend::Gemm(const Tensor& a, const Tensor& b, const Tensor& c, float alpha, float beta) {
  if (a.dim() != 3 || b.dim() != 3 || c.dim() != 3) {
    return InvalidArg("Gemm", "expects 3-d a, b, c; got ", ShapeString(a.shape()), ", ", ShapeString(b.shape()), ", ",
                      ShapeString(c.shape()));
  }
  const Dims d{c.size(0), c.size(1), c.size(2), a.size(2)};
  if (a.size(0) != d.batch || b.size(0) != d.batch || a.size(1) != d.m || b.size(1) != d.k || b.size(2) != d.n) {
    return InvalidArg("Gemm", "shapes do not match: a ", ShapeString(a.shape()), ", b ", ShapeString(b.shape()), ", c ",
                      ShapeString(c.shape()));
  }
  if (a.dtype() != c.dtype() || b.dtype() != c.dtype()) {
    return InvalidArg("Gemm", "dtypes differ: a ", DTypeName(a.dtype()), ", b ", DTypeName(b.dtype()), ", c ",
                      DTypeName(c.dtype()));
  }
  if (c.numel() == 0) return absl::OkStatus();
  // BLAS takes 32-bit sizes; leading dims are at most a stride or a size.
  const int64_t limits[] = {d.m, d.n, d.k, a.stride(1), a.stride(2), b.stride(1), b.stride(2)};
  for (int64_t v : limits) {
    if (v > INT_MAX) {
      return InvalidArg("Gemm", "a size or stride (", v, ") exceeds OpenBLAS's 32-bit limit: a ",
                        ShapeString(a.shape()), ", b ", ShapeString(b.shape()));
    }
  }
  return DispatchFloat("Gemm", c.dtype(), [&](auto tag) {
    using T = decltype(tag);
    if (d.k == 0) {
      ScaleC(static_cast<T*>(c.raw_data()), c.numel(), beta);
    } else {
      GemmTyped<T>(a, b, c, d, alpha, beta);
    }
    return absl::OkStatus();
  });
}

}  // namespace dtensor::internal
