// Helpers shared by the CPU kernels of this folder (internal; not installed).
//
//   // Parallel loop over [0, n): serial below `grain` items, else one chunk per OpenMP thread.
//   ParallelFor(n, kParallelGrain, [&](int64_t begin, int64_t end) { ... });
//
//   // Element <-> float conversions, inlined so that loops over bf16/f16 vectorize.
//   float f = ToFloat(x[i]);            // any host element type of dtype.h
//   y[i] = FromFloat<BFloat16>(f);      // round to nearest even, as dtype.h's host types
//
//   // dtype -> C++ type with an error for dtypes the kernel does not support.
//   return DispatchFloat("Softmax", x.dtype(), [&](auto tag) {
//     using T = decltype(tag);
//     ...
//     return absl::OkStatus();
//   });
//
//   // N same-shaped strided operands (operand 0 is the output) walked row by row.
//   StridedLoop<2> loop(out.shape(), {out.strides(), a.strides()});
//   loop.Run(kParallelGrain, [&](const int64_t* off, const int64_t* inner_stride, int64_t n) {
//     // n elements: operand k starts at element off[k] of its data and steps inner_stride[k].
//   });
//
//   // Branch-free float math that vectorizes (libm calls and float `?:` do not, see SelectF).
//   y[i] = FastExp(x[i]);                       // also FastTanh, FastSigmoid: a few ulp
//   y[i] = ExpInRange(v);                       // e^v for v in [-87, 88] only: cheaper
//   m = MaxPropagateNaN(a, b);                  // torch.maximum semantics
//   float row_max = ExtremeOf<true>(row, n);    // NaN-propagating max of a contiguous run
//
// Loops that should vectorize: keep the body free of calls into libm and of float `?:`
// (use SelectF), and reduce through several independent accumulators (see SumOf-style loops in
// softmax.cc / reduce.cc) since the compiler may not reassociate one float chain.
//
// Conventions: float32/bfloat16/float16 compute in float; integer arithmetic wraps (two's
// complement); float -> integer conversion truncates toward zero, saturates at the type's
// range and maps NaN to 0; anything -> bool is `!= 0` (NaN -> true); bool -> anything is 0/1.
#ifndef DTENSOR_KERNELS_CPU_CPU_INTERNAL_H_
#define DTENSOR_KERNELS_CPU_CPU_INTERNAL_H_

#include <omp.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "dtensor/tensor/dtype.h"
#include "dtensor/tensor/tensor.h"

namespace dtensor::internal {

// ---------------------------------------------------------------------------------------
// Parallelism
// ---------------------------------------------------------------------------------------

// Below this many elements an elementwise loop stays on the calling thread: waking the
// OpenMP pool costs a few microseconds, more than ~32K simple element updates.
inline constexpr int64_t kParallelGrain = 32768;
// Grain for loops whose elements cost a transcendental call (exp, tanh, ...) or more.
inline constexpr int64_t kParallelGrainExpensive = 4096;

// Calls f(begin, end) on disjoint chunks covering [0, n). Runs f(0, n) on the calling thread
// when n < 2 * grain, OpenMP has one thread, or we are already inside a parallel region;
// otherwise uses min(threads, n / grain) threads with one contiguous chunk each (static, so
// which thread handles which index is deterministic for a given thread count). f must not
// throw.
template <typename F>
void ParallelFor(int64_t n, int64_t grain, F&& f) {
  if (n <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  const int64_t max_threads = omp_get_max_threads();
  const int64_t threads = std::min(max_threads, n / grain);
  if (threads <= 1 || omp_in_parallel()) {
    f(int64_t{0}, n);
    return;
  }
#pragma omp parallel num_threads(static_cast <int>(threads))
  {
    const int64_t nt = omp_get_num_threads();
    const int64_t t = omp_get_thread_num();
    const int64_t chunk = (n + nt - 1) / nt;
    const int64_t begin = std::min(n, t * chunk);
    const int64_t end = std::min(n, begin + chunk);
    if (begin < end) f(begin, end);
  }
}

// ---------------------------------------------------------------------------------------
// Element conversions
// ---------------------------------------------------------------------------------------

inline float BitsToFloat(uint32_t u) { return std::bit_cast<float>(u); }
inline uint32_t FloatToBits(float f) { return std::bit_cast<uint32_t>(f); }

// bfloat16 bits -> float (exact).
inline float Bf16BitsToFloat(uint16_t b) { return BitsToFloat(static_cast<uint32_t>(b) << 16); }
// float -> bfloat16 bits, round to nearest even; NaN stays a quiet NaN (as BFloat16::FromFloat).
inline uint16_t FloatToBf16Bits(float f) {
  const uint32_t u = FloatToBits(f);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const uint32_t nan = (u >> 16) | 0x40u;
  return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

// IEEE half bits -> float (exact), branch-free so that loops vectorize. Normal halves are
// rebased by shifting exponent and mantissa into float position and scaling by 2^-112;
// subnormal halves (m * 2^-24) come out of a magic-number subtraction.
inline float HalfBitsToFloat(uint16_t h) {
  const uint32_t w = static_cast<uint32_t>(h) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;  // exponent and mantissa, sign shifted out
  // Normal (and inf/NaN): exponent field moved to float position, bias fixed by 2^-112 scale;
  // adding 0xE0 << 23 pushes half inf/NaN exponents (31) to float's 255 after scaling.
  const float normal = BitsToFloat((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  // Subnormal: 0.5 + m * 2^-24 - 0.5 exactly, with m the 10-bit mantissa.
  const float subnormal = BitsToFloat((two_w >> 17) | (126u << 23)) - 0.5f;
  const uint32_t sub_mask = 0u - static_cast<uint32_t>(two_w < (1u << 27));  // all ones if subnormal
  return BitsToFloat(sign | (FloatToBits(subnormal) & sub_mask) | (FloatToBits(normal) & ~sub_mask));
}

// float -> IEEE half bits, round to nearest even (overflow -> inf, NaN -> 0x7e00 | sign), as
// Float16::FromFloat, branch-free (selects written as masks so that GCC vectorizes the loop).
// Scaling |f| by 2^112 then 2^-110 lets the FPU do the rounding at the half's precision
// (subnormals included) and saturate to inf.
inline uint16_t FloatToHalfBits(float f) {
  const uint32_t w = FloatToBits(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  float base = (std::fabs(f) * 0x1.0p+112f) * 0x1.0p-110f;
  const uint32_t bias = std::max(shl1_w & 0xFF000000u, 0x71000000u);
  base = BitsToFloat((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = FloatToBits(base);
  const uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
  const uint32_t mantissa_bits = bits & 0x00000FFFu;
  const uint32_t nonsign = exp_bits + mantissa_bits;
  const uint32_t nan_mask = 0u - static_cast<uint32_t>(shl1_w > 0xFF000000u);  // all ones if NaN
  return static_cast<uint16_t>((sign >> 16) | (0x7E00u & nan_mask) | (nonsign & ~nan_mask));
}

template <typename T>
inline constexpr bool kIsFloatLike =
    std::is_same_v<T, float> || std::is_same_v<T, BFloat16> || std::is_same_v<T, Float16> ||
    std::is_same_v<T, Float8E4M3> || std::is_same_v<T, Float8E5M2>;
template <typename T>
inline constexpr bool kIsComputeFloat =
    std::is_same_v<T, float> || std::is_same_v<T, BFloat16> || std::is_same_v<T, Float16>;
template <typename T>
inline constexpr bool kIsInt = std::is_same_v<T, int32_t> || std::is_same_v<T, int64_t>;

// Any element -> float.
template <typename T>
inline float ToFloat(T v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else if constexpr (std::is_same_v<T, BFloat16>) {
    return Bf16BitsToFloat(v.bits);
  } else if constexpr (std::is_same_v<T, Float16>) {
    return HalfBitsToFloat(v.bits);
  } else if constexpr (std::is_same_v<T, bool>) {
    return v ? 1.0f : 0.0f;
  } else {
    return static_cast<float>(v);  // ints (rounded to nearest), float8 (exact)
  }
}

// float -> integer: truncates toward zero, saturates, NaN -> 0.
template <typename I>
inline I FloatToInt(float f) {
  constexpr float kHi = -static_cast<float>(std::numeric_limits<I>::min());  // 2^31 or 2^63
  if (!(f == f)) return 0;
  if (f >= kHi) return std::numeric_limits<I>::max();
  if (f < -kHi) return std::numeric_limits<I>::min();
  return static_cast<I>(f);
}
template <typename I>
inline I DoubleToInt(double d) {
  constexpr double kHi = -static_cast<double>(std::numeric_limits<I>::min());
  if (!(d == d)) return 0;
  if (d >= kHi) return std::numeric_limits<I>::max();
  if (d < -kHi) return std::numeric_limits<I>::min();
  return static_cast<I>(d);
}

// float -> any element (one rounding for float types).
template <typename T>
inline T FromFloat(float f) {
  if constexpr (std::is_same_v<T, float>) {
    return f;
  } else if constexpr (std::is_same_v<T, BFloat16>) {
    BFloat16 r;
    r.bits = FloatToBf16Bits(f);
    return r;
  } else if constexpr (std::is_same_v<T, Float16>) {
    Float16 r;
    r.bits = FloatToHalfBits(f);
    return r;
  } else if constexpr (std::is_same_v<T, bool>) {
    return f != 0.0f;
  } else if constexpr (kIsInt<T>) {
    return FloatToInt<T>(f);
  } else {
    return T(f);  // float8
  }
}

// double -> any element (Fill, FillRandom, scalars): float types go through float (so
// bfloat16/float16 round twice, double -> float -> 16 bits); integers truncate with
// saturation (NaN -> 0); bool is `!= 0`.
template <typename T>
inline T FromDouble(double d) {
  if constexpr (std::is_same_v<T, bool>) {
    return d != 0.0;
  } else if constexpr (kIsInt<T>) {
    return DoubleToInt<T>(d);
  } else {
    return FromFloat<T>(static_cast<float>(d));
  }
}

// S -> D for Copy. Same type: bit copy. Integer -> integer: wraps (two's complement).
// Integer -> float: rounded to float (then to D). Float -> integer: FloatToInt.
template <typename D, typename S>
inline D CastElement(S v) {
  if constexpr (std::is_same_v<D, S>) {
    return v;
  } else if constexpr (std::is_same_v<S, bool>) {
    if constexpr (kIsInt<D>) {
      return static_cast<D>(v ? 1 : 0);
    } else {
      return FromFloat<D>(v ? 1.0f : 0.0f);
    }
  } else if constexpr (std::is_same_v<D, bool>) {
    if constexpr (kIsInt<S>) {
      return v != 0;
    } else {
      return ToFloat(v) != 0.0f;
    }
  } else if constexpr (kIsInt<S> && kIsInt<D>) {
    return static_cast<D>(v);
  } else {
    return FromFloat<D>(ToFloat(v));
  }
}

// ---------------------------------------------------------------------------------------
// Vectorizable float math (no calls, no branches: loops using these vectorize, libm's don't)
// ---------------------------------------------------------------------------------------

// c ? a : b on floats, written with integer masks. GCC does not if-convert a float `?:` under
// its default -ftrapping-math, which leaves such loops scalar; this form vectorizes.
inline float SelectF(bool c, float a, float b) {
  const uint32_t m = 0u - static_cast<uint32_t>(c);
  return BitsToFloat((FloatToBits(a) & m) | (FloatToBits(b) & ~m));
}

// max / min that propagate NaN from either operand (torch.maximum / torch.minimum).
inline float MaxPropagateNaN(float a, float b) { return SelectF((a != a) | (a > b), a, b); }
inline float MinPropagateNaN(float a, float b) { return SelectF((a != a) | (a < b), a, b); }

// e^x within 1 ulp (Cody-Waite reduction x = n ln2 + r, |r| <= ln2 / 2, Cephes' degree-6
// polynomial for e^r, 2^n assembled in the exponent bits). x > 88.72 gives +inf, NaN gives
// NaN; x < -87.34 gives 0 (results that would be subnormal are flushed to zero).
inline float FastExp(float x) {
  constexpr float kHi = 88.72283935546875f;   // largest x with finite e^x
  constexpr float kLo = -87.33654022216797f;  // ln(FLT_MIN)
  float xc = SelectF(x > kLo, x, kLo);        // also maps NaN to kLo: the int conversion stays defined
  xc = SelectF(xc < kHi, xc, kHi);
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer (ties to even)
  const float n = (xc * 1.44269504088896341f + kRound) - kRound;
  float r = xc - n * 0.693359375f;  // ln2 = 0.693359375 - 2.12194440e-4, the first part exact in n * c
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  float y = p * (r * r) + r + 1.0f;
  // 2^n for n in [-126, 128]: n = 128 is applied as 2 * 2^127.
  int32_t ni = static_cast<int32_t>(n);
  const bool over = ni > 127;
  ni -= over ? 1 : 0;
  y *= SelectF(over, 2.0f, 1.0f);
  y *= BitsToFloat(static_cast<uint32_t>(ni + 127) << 23);
  y = SelectF(x > kHi, std::numeric_limits<float>::infinity(), y);
  y = SelectF(x < kLo, 0.0f, y);
  return SelectF(x != x, x, y);
}

// e^v for v in [-87, 88] only (callers clamp): the reduction and polynomial of FastExp without
// its range checks, with n taken from the rounding constant's bits (no float -> int conversion,
// so any argument is defined behaviour; NaN gives NaN, other out-of-range v give garbage).
// Relative error about 1 ulp; e^r = 1 + r + r^2 P(r) with P a degree-4 minimax fit on
// |r| <= ln2 / 2 (relative error 4e-9).
inline float ExpInRange(float v) {
  constexpr float kRound = 12582912.0f + 127.0f;  // 1.5 * 2^23 + bias: z's low mantissa bits hold n + 127
  const float z = v * 1.44269504088896341f + kRound;
  const float n = z - kRound;
  float r = v - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.3893402858663369e-3f;
  p = p * r + 8.370262673410076e-3f;
  p = p * r + 4.166709015836673e-2f;
  p = p * r + 1.6666506067331835e-1f;
  p = p * r + 0.499999981311868f;
  const float e = p * (r * r) + r + 1.0f;
  return e * BitsToFloat(FloatToBits(z) << 23);  // 2^n: n + 127 shifted into the exponent field
}

// tanh(x) within 2 ulp: an odd polynomial for |x| < 0.625 (Cephes), else
// sign(x) * (1 - 2 / (e^{2|x|} + 1)). NaN gives NaN.
inline float FastTanh(float x) {
  const float ax = std::fabs(x);
  const float s = x * x;
  float p = -5.70498872745e-3f;
  p = p * s + 2.06390887954e-2f;
  p = p * s - 5.37397155531e-2f;
  p = p * s + 1.33314422036e-1f;
  p = p * s - 3.33332819422e-1f;
  const float small = p * s * x + x;
  const float big = std::copysign(1.0f - 2.0f / (FastExp(2.0f * ax) + 1.0f), x);
  return SelectF(ax < 0.625f, small, big);
}

// 1 / (1 + e^-x).
inline float FastSigmoid(float x) { return 1.0f / (1.0f + FastExp(-x)); }

// Largest (kMax) or smallest element of a contiguous run, as float; NaN if any element is NaN
// (as torch.max); -inf / +inf when n == 0. Written with GCC/Clang vector extensions: neither
// compiler vectorizes a NaN-propagating max reduction written as a plain loop.
template <bool kMax, typename T>
float ExtremeOf(const T* p, int64_t n) {
  using V4F = float __attribute__((vector_size(16)));
  using V4I = int32_t __attribute__((vector_size(16)));
  const float init = kMax ? -std::numeric_limits<float>::infinity() : std::numeric_limits<float>::infinity();
  auto load4 = [](const T* q) {
    V4F v;
    if constexpr (std::is_same_v<T, float>) {
      std::memcpy(&v, q, sizeof(v));
    } else {
      v = V4F{ToFloat(q[0]), ToFloat(q[1]), ToFloat(q[2]), ToFloat(q[3])};
    }
    return v;
  };
  auto merge = [](V4F acc, V4F v) {
    const V4I take = (kMax ? (v > acc) : (v < acc)) | (v != v);  // all-ones lanes take v
    return reinterpret_cast<V4F>((reinterpret_cast<V4I>(v) & take) | (reinterpret_cast<V4I>(acc) & ~take));
  };
  V4F a0 = {init, init, init, init}, a1 = a0;
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    a0 = merge(a0, load4(p + i));
    a1 = merge(a1, load4(p + i + 4));
  }
  a0 = merge(a0, a1);
  float m = init;
  auto merge1 = [](float acc, float v) { return (v != v || (kMax ? v > acc : v < acc)) ? v : acc; };
  for (int j = 0; j < 4; ++j) m = merge1(m, a0[j]);
  for (; i < n; ++i) m = merge1(m, ToFloat(p[i]));
  return m;
}

// Converts n elements of a contiguous row to float / back (scratch rows for bf16/f16 kernels).
template <typename T>
inline void LoadRow(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = ToFloat(src[i]);
}
template <typename T>
inline void StoreRow(const float* src, T* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = FromFloat<T>(src[i]);
}

// SumOfSquares in fixed chunks: each chunk's sum (float64, eight independent chains, so the
// loop vectorizes without reassociating one) is one task, and the chunks' sums are added in
// order, so the result does not depend on the thread count. Shared by SumOfSquares and the
// AdamW step that reads the gradient norm in its own pass (the same bits).
inline constexpr int64_t kSquareChunk = int64_t{1} << 16;
template <typename T>
double SquareSumChunk(const T* p, int64_t len) {
  double acc[8] = {};
  int64_t i = 0;
  for (; i + 8 <= len; i += 8) {
    for (int j = 0; j < 8; ++j) {
      const double v = ToFloat(p[i + j]);
      acc[j] += v * v;
    }
  }
  for (; i < len; ++i) {
    const double v = ToFloat(p[i]);
    acc[0] += v * v;
  }
  double r = acc[0];
  for (int j = 1; j < 8; ++j) r += acc[j];
  return r;
}
inline float AddSquareSumChunks(const std::vector<double>& partial) {
  double total = 0;
  for (double v : partial) total += v;
  return static_cast<float>(total);
}

// ---------------------------------------------------------------------------------------
// dtype dispatch
// ---------------------------------------------------------------------------------------

inline absl::Status UnsupportedDType(const char* op, DType t) {
  return absl::UnimplementedError(absl::StrCat("[", op, "] dtype ", DTypeName(t), " is not supported on cpu"));
}

// f(T{}) for T in {float, BFloat16, Float16}; Unimplemented for other dtypes. f returns Status.
template <typename F>
absl::Status DispatchFloat(const char* op, DType t, F&& f) {
  switch (t) {
    case DType::kFloat32:
      return f(float{});
    case DType::kBFloat16:
      return f(BFloat16{});
    case DType::kFloat16:
      return f(Float16{});
    default:
      return UnsupportedDType(op, t);
  }
}

// As DispatchFloat, plus int32 and int64.
template <typename F>
absl::Status DispatchNumeric(const char* op, DType t, F&& f) {
  switch (t) {
    case DType::kInt32:
      return f(int32_t{});
    case DType::kInt64:
      return f(int64_t{});
    default:
      return DispatchFloat(op, t, std::forward<F>(f));
  }
}

// ---------------------------------------------------------------------------------------
// Strided iteration
// ---------------------------------------------------------------------------------------

// Walks N operands of one shape with their own strides (in elements), row by row. Operand 0
// is the output: dims are reordered so that its strides decrease (its innermost stride is
// the smallest; ties and stride-0 dims defer to the next operand), size-1 dims are dropped
// and neighbouring dims merged wherever every operand's strides allow. A contiguous tensor
// thus becomes one row. Element order does not matter to the callers (elementwise ops).
template <int N>
class StridedLoop {
 public:
  StridedLoop(IntSpan shape, const std::array<IntSpan, N>& strides) {
    numel_ = NumElements(shape);
    // Dims (in the original order) that matter: size != 1.
    int order[kMaxDims];
    int nd = 0;
    for (int d = 0; d < static_cast<int>(shape.size()); ++d) {
      if (shape[d] != 1) order[nd++] = d;
    }
    // Insertion sort: move dim b before dim a when b should be the outer one.
    auto outer_first = [&](int a, int b) {  // true when dim b must be outer to dim a
      for (int k = 0; k < N; ++k) {
        const int64_t sa = strides[k][a], sb = strides[k][b];
        if (sa == 0 || sb == 0 || sa == sb) continue;
        return sb > sa;
      }
      return false;
    };
    for (int i = 1; i < nd; ++i) {
      for (int j = i; j > 0 && outer_first(order[j - 1], order[j]); --j) std::swap(order[j - 1], order[j]);
    }
    // Walk dims outer to inner, merging each into the previous one when every operand allows;
    // shape_/strides_ keep the result innermost-last.
    ndim_ = 0;
    for (int i = 0; i < nd; ++i) {
      const int d = order[i];
      if (ndim_ > 0) {
        bool merge = true;
        for (int k = 0; k < N; ++k) {
          // Dim d follows the current innermost dim `ndim_-1`: they merge when the previous
          // (outer) dim's stride equals d's stride times d's size.
          if (strides_[k][ndim_ - 1] != strides[k][d] * shape[d]) merge = false;
        }
        if (merge) {
          shape_[ndim_ - 1] *= shape[d];
          for (int k = 0; k < N; ++k) strides_[k][ndim_ - 1] = strides[k][d];
          continue;
        }
      }
      shape_[ndim_] = shape[d];
      for (int k = 0; k < N; ++k) strides_[k][ndim_] = strides[k][d];
      ++ndim_;
    }
    if (ndim_ == 0) {  // a single element
      shape_[0] = 1;
      for (int k = 0; k < N; ++k) strides_[k][0] = 1;
      ndim_ = 1;
    }
  }

  int64_t numel() const { return numel_; }
  int ndim() const { return ndim_; }
  // Size of the innermost (row) dim.
  int64_t row_size() const { return shape_[ndim_ - 1]; }
  // The collapsed dims (innermost last) and operand k's strides over them.
  int64_t size(int d) const { return shape_[d]; }
  int64_t stride(int k, int d) const { return strides_[k][d]; }

  // Calls f(off, inner_stride, n) for consecutive runs covering elements [begin, end) in loop
  // order, one call per (part of a) row; off[k] is the element offset of the run's first
  // element in operand k, inner_stride[k] the step between its elements.
  template <typename F>
  void ForRange(int64_t begin, int64_t end, F&& f) const {
    if (begin >= end) return;
    const int inner = ndim_ - 1;
    int64_t coord[kMaxDims];
    int64_t rem = begin;
    for (int d = ndim_; d-- > 0;) {
      coord[d] = rem % shape_[d];
      rem /= shape_[d];
    }
    int64_t inner_stride[N];
    for (int k = 0; k < N; ++k) inner_stride[k] = strides_[k][inner];
    int64_t pos = begin;
    while (pos < end) {
      int64_t off[N];
      for (int k = 0; k < N; ++k) {
        int64_t o = 0;
        for (int d = 0; d < ndim_; ++d) o += coord[d] * strides_[k][d];
        off[k] = o;
      }
      const int64_t n = std::min(shape_[inner] - coord[inner], end - pos);
      f(static_cast<const int64_t*>(off), static_cast<const int64_t*>(inner_stride), n);
      pos += n;
      coord[inner] += n;
      for (int d = inner; d > 0 && coord[d] == shape_[d]; --d) {
        coord[d] = 0;
        ++coord[d - 1];
      }
    }
  }

  // ForRange over all elements, split across threads (see ParallelFor).
  template <typename F>
  void Run(int64_t grain, F&& f) const {
    ParallelFor(numel_, grain, [&](int64_t b, int64_t e) { ForRange(b, e, f); });
  }

 private:
  int64_t numel_ = 0;
  int ndim_ = 0;
  int64_t shape_[kMaxDims] = {};
  int64_t strides_[N][kMaxDims] = {};
};

// ---------------------------------------------------------------------------------------
// Row helpers of the cross-entropy and attention kernels
// ---------------------------------------------------------------------------------------

// Order-preserving map between float bits and int32 (its own inverse): comparing keys as
// integers compares the floats, so a clamp needs no float compare.
constexpr int32_t FloatKey(int32_t bits) { return bits ^ ((bits >> 31) & 0x7fffffff); }

// exp(x) for float, written so that GCC and clang vectorise the loops calling it: no libm call
// (expf is not vectorised without -ffast-math) and no float compare (under the default
// -ftrapping-math GCC will not if-convert one). x is clamped to [-88, 88.3] on integer keys;
// x = n ln2 + r with |r| <= ln2/2; exp(r) by Cephes' degree-6 polynomial; 2^n is built in the
// exponent bits, and n = -127 gives 0, so x below about -87.7 (-inf included) flushes to 0.
// Within 1.5 ulp of exp on [-87.3, 88]; NaN gives NaN. Callers pass x <= ~0.
inline float ExpKeyClamped(float x) {
  constexpr int32_t kLo = FloatKey(std::bit_cast<int32_t>(-88.0f));
  constexpr int32_t kHi = FloatKey(std::bit_cast<int32_t>(88.3f));
  const int32_t xi = std::bit_cast<int32_t>(x);
  int32_t k = FloatKey(xi);
  k = k < kLo ? kLo : k;
  k = k > kHi ? kHi : k;
  const float xc = std::bit_cast<float>(FloatKey(k));
  const float shift = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const float t = xc * 1.44269504088896341f + shift;
  const float n = t - shift;
  const float r = (xc - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  // t's low mantissa bits hold n: read it as an integer without a float->int conversion.
  const int32_t ni = std::bit_cast<int32_t>(t) - std::bit_cast<int32_t>(shift);
  const int32_t yi = std::bit_cast<int32_t>(p * std::bit_cast<float>((ni + 127) << 23));
  const int32_t nan_mask = (0x7f800000 - (xi & 0x7fffffff)) >> 31;  // all ones iff x is NaN
  return std::bit_cast<float>(yi | (nan_mask & 0x7fc00000));
}

// max(row[0..n)) for n >= 1, as an integer max over FloatKey (so both compilers vectorise it
// without fast-math). A NaN wins where its sign bit is clear and is passed over where it is set;
// callers' sums of exp then turn NaN anyway, where the max is finite.
inline float RowMaxKeyed(const float* row, int64_t n) {
  constexpr int32_t kMinusInf = FloatKey(std::bit_cast<int32_t>(-std::numeric_limits<float>::infinity()));
  int32_t k = kMinusInf;
#pragma omp simd reduction(max : k)
  for (int64_t i = 0; i < n; ++i) k = std::max(k, FloatKey(std::bit_cast<int32_t>(row[i])));
  return std::bit_cast<float>(FloatKey(k));
}

}  // namespace dtensor::internal

#endif  // DTENSOR_KERNELS_CPU_CPU_INTERNAL_H_
