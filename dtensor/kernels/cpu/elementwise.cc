// CPU elementwise kernels: Binary, BinaryScalar, Unary, UnaryBackward.
//
// Float dtypes compute in float (bf16/f16 converted in registers); int32/int64 compute in
// their own type with wrapping arithmetic (kDiv truncates, x / 0 = 0). Each row runs one of a
// few loops specialised on its strides (contiguous, broadcast scalar, strided) so that the
// common contiguous case is a plain loop the compiler vectorizes.
#include <array>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "dtensor/kernels/cpu/cpu_backend.h"
#include "dtensor/kernels/cpu/cpu_internal.h"
#include "dtensor/tensor/status.h"

namespace dtensor::internal {
namespace {

// Compute type: float for the float dtypes, the type itself for integers.
template <typename T>
using Compute = std::conditional_t<kIsComputeFloat<T>, float, T>;

template <typename T>
inline Compute<T> Load(T v) {
  if constexpr (kIsComputeFloat<T>) {
    return ToFloat(v);
  } else {
    return v;
  }
}
template <typename T>
inline T Store(Compute<T> v) {
  if constexpr (kIsComputeFloat<T>) {
    return FromFloat<T>(v);
  } else {
    return v;
  }
}

// Wrapping integer arithmetic (signed overflow is undefined in C++; unsigned wraps).
template <typename I>
inline I WrapAdd(I a, I b) {
  using U = std::make_unsigned_t<I>;
  return static_cast<I>(static_cast<U>(a) + static_cast<U>(b));
}
template <typename I>
inline I WrapSub(I a, I b) {
  using U = std::make_unsigned_t<I>;
  return static_cast<I>(static_cast<U>(a) - static_cast<U>(b));
}
template <typename I>
inline I WrapMul(I a, I b) {
  using U = std::make_unsigned_t<I>;
  return static_cast<I>(static_cast<U>(a) * static_cast<U>(b));
}

// ---- Binary functors: C is float or an integer type ----
struct AddFn {
  template <typename C>
  C operator()(C a, C b) const {
    if constexpr (std::is_integral_v<C>) {
      return WrapAdd(a, b);
    } else {
      return a + b;
    }
  }
};
struct SubFn {
  template <typename C>
  C operator()(C a, C b) const {
    if constexpr (std::is_integral_v<C>) {
      return WrapSub(a, b);
    } else {
      return a - b;
    }
  }
};
struct MulFn {
  template <typename C>
  C operator()(C a, C b) const {
    if constexpr (std::is_integral_v<C>) {
      return WrapMul(a, b);
    } else {
      return a * b;
    }
  }
};
struct DivFn {
  template <typename C>
  C operator()(C a, C b) const {
    if constexpr (std::is_integral_v<C>) {
      if (b == 0) return 0;
      if (b == -1) return WrapSub(C{0}, a);  // min / -1 overflows
      return a / b;
    } else {
      return a / b;
    }
  }
};
// torch.maximum / torch.minimum: NaN in either operand gives NaN.
struct MaxFn {
  template <typename C>
  C operator()(C a, C b) const {
    if constexpr (std::is_integral_v<C>) {
      return a > b ? a : b;
    } else if constexpr (std::is_same_v<C, float>) {
      return MaxPropagateNaN(a, b);
    } else {
      return (a != a || a > b) ? a : b;
    }
  }
};
struct MinFn {
  template <typename C>
  C operator()(C a, C b) const {
    if constexpr (std::is_integral_v<C>) {
      return a < b ? a : b;
    } else if constexpr (std::is_same_v<C, float>) {
      return MinPropagateNaN(a, b);
    } else {
      return (a != a || a < b) ? a : b;
    }
  }
};

// Calls f(functor) for `op`.
template <typename F>
decltype(auto) WithBinaryFn(BinaryOp op, F&& f) {
  switch (op) {
    case BinaryOp::kAdd:
      return f(AddFn{});
    case BinaryOp::kSub:
      return f(SubFn{});
    case BinaryOp::kMul:
      return f(MulFn{});
    case BinaryOp::kDiv:
      return f(DivFn{});
    case BinaryOp::kMax:
      return f(MaxFn{});
    case BinaryOp::kMin:
      return f(MinFn{});
  }
  return f(AddFn{});
}

// o[i*so] = op(a[i*sa], b[i*sb]) for i < n, with fast paths for the common stride patterns.
template <typename T, typename Op>
void BinaryRow(const T* a, int64_t sa, const T* b, int64_t sb, T* o, int64_t so, int64_t n, Op op) {
  if (so == 1) {
    if (sa == 1 && sb == 1) {
      for (int64_t i = 0; i < n; ++i) o[i] = Store<T>(op(Load(a[i]), Load(b[i])));
      return;
    }
    if (sa == 1 && sb == 0) {
      const Compute<T> bv = Load(b[0]);
      for (int64_t i = 0; i < n; ++i) o[i] = Store<T>(op(Load(a[i]), bv));
      return;
    }
    if (sa == 0 && sb == 1) {
      const Compute<T> av = Load(a[0]);
      for (int64_t i = 0; i < n; ++i) o[i] = Store<T>(op(av, Load(b[i])));
      return;
    }
  }
  for (int64_t i = 0; i < n; ++i) o[i * so] = Store<T>(op(Load(a[i * sa]), Load(b[i * sb])));
}

template <typename T, typename Op>
void BinaryTyped(const Tensor& a, const Tensor& b, const Tensor& out, Op op) {
  const StridedLoop<3> loop(out.shape(), {out.strides(), a.strides(), b.strides()});
  const T* pa = static_cast<const T*>(a.raw_data());
  const T* pb = static_cast<const T*>(b.raw_data());
  T* po = static_cast<T*>(out.raw_data());
  loop.Run(kParallelGrain, [&](const int64_t* off, const int64_t* st, int64_t n) {
    BinaryRow<T>(pa + off[1], st[1], pb + off[2], st[2], po + off[0], st[0], n, op);
  });
}

// out = op(a, s) (or op(s, a)) with the scalar already in compute type C and the result
// converted by `store` (a lambda C -> T).
template <typename T, typename C, typename Op, typename StoreFn>
void ScalarTyped(const Tensor& a, C s, bool scalar_first, const Tensor& out, Op op, StoreFn store) {
  const StridedLoop<2> loop(out.shape(), {out.strides(), a.strides()});
  const T* pa = static_cast<const T*>(a.raw_data());
  T* po = static_cast<T*>(out.raw_data());
  auto load = [](T v) -> C {
    if constexpr (kIsComputeFloat<T>) {
      return ToFloat(v);
    } else {
      return static_cast<C>(v);
    }
  };
  loop.Run(kParallelGrain, [&](const int64_t* off, const int64_t* st, int64_t n) {
    const T* x = pa + off[1];
    T* o = po + off[0];
    const int64_t sx = st[1], so = st[0];
    if (so == 1 && sx == 1) {
      if (scalar_first) {
        for (int64_t i = 0; i < n; ++i) o[i] = store(op(s, load(x[i])));
      } else {
        for (int64_t i = 0; i < n; ++i) o[i] = store(op(load(x[i]), s));
      }
    } else if (scalar_first) {
      for (int64_t i = 0; i < n; ++i) o[i * so] = store(op(s, load(x[i * sx])));
    } else {
      for (int64_t i = 0; i < n; ++i) o[i * so] = store(op(load(x[i * sx]), s));
    }
  });
}

// ---- Unary functors (float) ----
// GELU, tanh approximation: 0.5 x (1 + tanh(u)) with u = k (x + c x^3), evaluated as
// x * sigmoid(2u) = x / (1 + e^{-2u}) (the same function; one exp, accurate in both tails).
// The exponent argument is clamped to ExpInRange's domain instead of handling inf / NaN /
// overflow inside the exp: for x > ~10 the clamped e^{-2u} (1.6e-38) leaves x / (1 + e) = x
// (inf included), and for x < -10 gelu(x) (< 1e-36) is returned as -0 (-inf included). NaN
// propagates through x. The clamps are SelectF masks: GCC turns std::min/max here into branches
// on constant-folded exps (two divisions per element).
constexpr float kGeluK = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluC = 0.044715f;
constexpr float kGeluCut = 10.0f;  // |x| beyond which gelu(x) is x (or -0) in float

inline float GeluF(float x) {
  const float x2 = x * x;
  float t = x * (x2 * (-2.0f * kGeluK * kGeluC) + (-2.0f * kGeluK));  // -2u
  t = SelectF(t > -87.0f, t, -87.0f);                                 // NaN -> -87; y is still NaN
  t = SelectF(t < 88.0f, t, 88.0f);
  const float y = x / (1.0f + ExpInRange(t));
  return SelectF(x < -kGeluCut, -0.0f, y);
}
// d/dx = s + 2 x s (1 - s) k (1 + 3 c x^2) with s = sigmoid(2u) and 1 - s = e s (e = e^{-2u}),
// which avoids the cancellation in 1 - s. x is clamped to [-10, 10] (NaN kept): beyond 10 the
// derivative is 1 in float, below -10 it is below 1e-35 and returned as 0.
inline float GeluGradF(float x) {
  float xc = SelectF(x < -kGeluCut, -kGeluCut, x);
  xc = SelectF(xc > kGeluCut, kGeluCut, xc);
  const float x2 = xc * xc;
  const float e = ExpInRange(xc * (x2 * (-2.0f * kGeluK * kGeluC) + (-2.0f * kGeluK)));  // |arg| <= 87.4
  const float s = 1.0f / (1.0f + e);
  const float g = s * (1.0f + xc * (e * s) * (x2 * (6.0f * kGeluK * kGeluC) + 2.0f * kGeluK));
  return SelectF(x < -kGeluCut, 0.0f, g);
}

// Smallest 16-bit unary op that goes through a lookup table: building one costs 65536 fn calls.
constexpr int64_t kTableMinElements = 65536;

template <typename F>
decltype(auto) WithUnaryFloatFn(UnaryOp op, F&& f) {
  switch (op) {
    case UnaryOp::kNeg:
      return f([](float x) { return -x; }, false);
    case UnaryOp::kExp:
      return f([](float x) { return FastExp(x); }, true);
    case UnaryOp::kLog:
      return f([](float x) { return std::log(x); }, true);
    case UnaryOp::kSqrt:
      return f([](float x) { return std::sqrt(x); }, false);
    case UnaryOp::kRsqrt:
      return f([](float x) { return 1.0f / std::sqrt(x); }, false);
    case UnaryOp::kRelu:
      return f([](float x) { return SelectF(x < 0.0f, 0.0f, x); }, false);  // NaN stays NaN
    case UnaryOp::kGelu:
      return f([](float x) { return GeluF(x); }, true);
    case UnaryOp::kTanh:
      return f([](float x) { return FastTanh(x); }, true);
    case UnaryOp::kAbs:
      return f([](float x) { return std::fabs(x); }, false);
    case UnaryOp::kSquare:
      return f([](float x) { return x * x; }, false);
  }
  return f([](float x) { return x; }, false);
}

// The 65536 results of fn on a 16-bit float type T, indexed by the input's bits: exactly what
// the computed loop gives (same fn, same rounding). Built on first use, once per (T, fn) type
// (function-local static: thread-safe).
template <typename T, typename Fn>
const std::array<uint16_t, 65536>& Table16(Fn fn) {
  static const std::array<uint16_t, 65536> table = [&] {
    std::array<uint16_t, 65536> t;
    for (uint32_t b = 0; b < 65536; ++b) {
      T v;
      v.bits = static_cast<uint16_t>(b);
      t[b] = FromFloat<T>(fn(ToFloat(v))).bits;
    }
    return t;
  }();
  return table;
}

// o[i] = fn(a[i]) with `a` of any strides. For bfloat16 / float16 and an expensive fn, a
// lookup table replaces the math (a 128 KiB table stays in L2; four loads per element beat
// ~20 vector ops plus two conversions).
template <typename T, typename Fn>
void UnaryTyped(const Tensor& a, const Tensor& out, Fn fn, bool expensive) {
  const StridedLoop<2> loop(out.shape(), {out.strides(), a.strides()});
  const T* pa = static_cast<const T*>(a.raw_data());
  T* po = static_cast<T*>(out.raw_data());
  if constexpr (sizeof(T) == 2 && kIsComputeFloat<T>) {
    if (expensive && loop.numel() >= kTableMinElements) {
      const uint16_t* table = Table16<T>(fn).data();
      loop.Run(kParallelGrain, [&](const int64_t* off, const int64_t* st, int64_t n) {
        const T* x = pa + off[1];
        T* o = po + off[0];
        const int64_t sx = st[1], so = st[0];
        if (so == 1 && sx == 1) {
          for (int64_t i = 0; i < n; ++i) o[i].bits = table[x[i].bits];
        } else {
          for (int64_t i = 0; i < n; ++i) o[i * so].bits = table[x[i * sx].bits];
        }
      });
      return;
    }
  }
  loop.Run(expensive ? kParallelGrainExpensive : kParallelGrain, [&](const int64_t* off, const int64_t* st, int64_t n) {
    const T* x = pa + off[1];
    T* o = po + off[0];
    const int64_t sx = st[1], so = st[0];
    if (so == 1 && sx == 1) {
      for (int64_t i = 0; i < n; ++i) o[i] = Store<T>(fn(Load(x[i])));
    } else {
      for (int64_t i = 0; i < n; ++i) o[i * so] = Store<T>(fn(Load(x[i * sx])));
    }
  });
}

// dx = dy * f'(x), all contiguous.
template <typename T, typename Grad>
void UnaryBackwardTyped(const Tensor& dy, const Tensor& x, const Tensor& dx, Grad grad, bool expensive) {
  const T* pdy = static_cast<const T*>(dy.raw_data());
  const T* px = static_cast<const T*>(x.raw_data());
  T* pdx = static_cast<T*>(dx.raw_data());
  ParallelFor(dx.numel(), expensive ? kParallelGrainExpensive : kParallelGrain, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) pdx[i] = FromFloat<T>(grad(ToFloat(pdy[i]), ToFloat(px[i])));
  });
}

}  // namespace

absl::Status CpuBackend::Binary(BinaryOp op, const Tensor& a, const Tensor& b, const Tensor& out) {
  if (out.numel() == 0) return absl::OkStatus();
  if (a.dtype() != out.dtype() || b.dtype() != out.dtype()) {
    return InvalidArg("Binary", "dtypes differ: a ", DTypeName(a.dtype()), ", b ", DTypeName(b.dtype()), ", out ",
                      DTypeName(out.dtype()));
  }
  return DispatchNumeric("Binary", out.dtype(), [&](auto tag) {
    using T = decltype(tag);
    WithBinaryFn(op, [&](auto fn) { BinaryTyped<T>(a, b, out, fn); });
    return absl::OkStatus();
  });
}

absl::Status CpuBackend::BinaryScalar(BinaryOp op, const Tensor& a, double scalar, bool scalar_first,
                                      const Tensor& out) {
  if (out.numel() == 0) return absl::OkStatus();
  return DispatchNumeric("BinaryScalar", out.dtype(), [&](auto tag) {
    using T = decltype(tag);
    WithBinaryFn(op, [&](auto fn) {
      if constexpr (kIsComputeFloat<T>) {
        ScalarTyped<T>(a, static_cast<float>(scalar), scalar_first, out, fn, [](float v) { return FromFloat<T>(v); });
      } else if (std::trunc(scalar) == scalar && std::fabs(scalar) < 9.2233720368547758e18) {
        // Integral scalar: exact wrapping integer arithmetic in int64, narrowed (wrapping).
        ScalarTyped<T>(a, static_cast<int64_t>(scalar), scalar_first, out, fn,
                       [](int64_t v) { return static_cast<T>(v); });
      } else {
        // Fractional (or huge / NaN) scalar: computed in double, truncated with saturation.
        ScalarTyped<T>(a, scalar, scalar_first, out, fn, [](double v) { return DoubleToInt<T>(v); });
      }
    });
    return absl::OkStatus();
  });
}

absl::Status CpuBackend::Unary(UnaryOp op, const Tensor& a, const Tensor& out) {
  if (out.numel() == 0) return absl::OkStatus();
  return DispatchNumeric("Unary", out.dtype(), [&](auto tag) -> absl::Status {
    using T = decltype(tag);
    if constexpr (kIsComputeFloat<T>) {
      WithUnaryFloatFn(op, [&](auto fn, bool expensive) { UnaryTyped<T>(a, out, fn, expensive); });
    } else {
      switch (op) {
        case UnaryOp::kNeg:
          UnaryTyped<T>(
              a, out, [](T x) { return WrapSub(T{0}, x); }, false);
          break;
        case UnaryOp::kAbs:
          UnaryTyped<T>(
              a, out, [](T x) { return x < 0 ? WrapSub(T{0}, x) : x; }, false);
          break;
        case UnaryOp::kSquare:
          UnaryTyped<T>(
              a, out, [](T x) { return WrapMul(x, x); }, false);
          break;
        case UnaryOp::kRelu:
          UnaryTyped<T>(
              a, out, [](T x) { return x < 0 ? T{0} : x; }, false);
          break;
        default:
          return absl::UnimplementedError(absl::StrCat("[Unary] op ", static_cast<int>(op),
                                                       " is not defined for integer dtype ", DTypeName(out.dtype())));
      }
    }
    return absl::OkStatus();
  });
}

absl::Status CpuBackend::UnaryBackward(UnaryOp op, const Tensor& dy, const Tensor& x, const Tensor& dx) {
  if (dx.numel() == 0) return absl::OkStatus();
  return DispatchFloat("UnaryBackward", dx.dtype(), [&](auto tag) -> absl::Status {
    using T = decltype(tag);
    switch (op) {
      case UnaryOp::kGelu:
        UnaryBackwardTyped<T>(
            dy, x, dx, [](float g, float v) { return g * GeluGradF(v); }, true);
        break;
      case UnaryOp::kRelu:
        UnaryBackwardTyped<T>(
            dy, x, dx, [](float g, float v) { return SelectF(v > 0.0f, g, 0.0f); }, false);
        break;
      case UnaryOp::kTanh:
        UnaryBackwardTyped<T>(
            dy, x, dx,
            [](float g, float v) {
              const float t = FastTanh(v);
              return g * (1.0f - t * t);
            },
            true);
        break;
      case UnaryOp::kExp:
        UnaryBackwardTyped<T>(
            dy, x, dx, [](float g, float v) { return g * FastExp(v); }, true);
        break;
      case UnaryOp::kLog:
        UnaryBackwardTyped<T>(
            dy, x, dx, [](float g, float v) { return g / v; }, false);
        break;
      case UnaryOp::kSqrt:
        UnaryBackwardTyped<T>(
            dy, x, dx, [](float g, float v) { return g * 0.5f / std::sqrt(v); }, false);
        break;
      case UnaryOp::kRsqrt:
        UnaryBackwardTyped<T>(
            dy, x, dx, [](float g, float v) { return g * -0.5f / (v * std::sqrt(v)); }, false);
        break;
      case UnaryOp::kNeg:
        UnaryBackwardTyped<T>(
            dy, x, dx, [](float g, float) { return -g; }, false);
        break;
      case UnaryOp::kAbs:
        UnaryBackwardTyped<T>(
            dy, x, dx, [](float g, float v) { return SelectF(v > 0.0f, g, SelectF(v < 0.0f, -g, 0.0f)); }, false);
        break;
      case UnaryOp::kSquare:
        UnaryBackwardTyped<T>(
            dy, x, dx, [](float g, float v) { return 2.0f * v * g; }, false);
        break;
    }
    return absl::OkStatus();
  });
}

}  // namespace dtensor::internal
