// Copies, casts and fills on the CPU backend: every dtype pair, IEEE rounding of bf16/f16
// checked against independent float64 math, strided/broadcast sources and destinations.
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "dtensor/kernels/cpu/cpu_kernels.h"
#include "dtensor/ops/ops.h"
#include "gtest/gtest.h"
#include "tests/testing/test_util.h"

namespace dtensor {
namespace {

using testing::Unwrap;

constexpr DType kAllDTypes[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16,    DType::kInt32,
                                DType::kInt64,   DType::kBool,     DType::kFloat8E4M3, DType::kFloat8E5M2};

// ---- Independent references (float64 math, never the kernels' bit tricks) ----

// A binary float format: `mant` stored mantissa bits, `min_exp` exponent of the smallest
// normal, largest finite value, and whether overflow gives inf (else NaN, as e4m3fn).
struct Fmt {
  int mant;
  int min_exp;
  double max;
  bool has_inf;
};

Fmt FmtOf(DType t) {
  switch (t) {
    case DType::kFloat32:
      return {23, -126, std::ldexp(2.0 - std::ldexp(1.0, -23), 127), true};
    case DType::kBFloat16:
      return {7, -126, std::ldexp(2.0 - std::ldexp(1.0, -7), 127), true};
    case DType::kFloat16:
      return {10, -14, 65504.0, true};
    case DType::kFloat8E4M3:
      return {3, -6, 448.0, false};
    case DType::kFloat8E5M2:
      return {2, -14, 57344.0, true};
    default:
      return {52, -1022, std::numeric_limits<double>::max(), true};
  }
}

// x rounded to nearest even in format f (x / 2^k is exact in double, nearbyint rounds to even).
double RoundTo(double x, const Fmt& f) {
  if (std::isnan(x)) return x;
  if (std::isinf(x)) return f.has_inf ? x : std::nan("");
  if (x == 0.0) return x;
  const int e = std::max(std::ilogb(x), f.min_exp);
  const double quantum = std::ldexp(1.0, e - f.mant);
  const double r = std::nearbyint(x / quantum) * quantum;
  if (std::fabs(r) > f.max) return f.has_inf ? std::copysign(INFINITY, x) : std::nan("");
  return r;
}

// The value a `dst` element gets from a source value `s` (already exactly what src holds),
// following the backend's documented conventions (cpu_internal.h): float -> int truncates
// with saturation and NaN -> 0; anything -> bool is != 0.
double ExpectedCast(double s, DType dst) {
  switch (dst) {
    case DType::kBool:
      return s != 0.0 ? 1.0 : 0.0;  // NaN != 0
    case DType::kInt32:
    case DType::kInt64: {
      if (std::isnan(s)) return 0.0;
      const double lim = dst == DType::kInt32 ? 2147483648.0 : 9223372036854775808.0;
      if (s >= lim) return lim - 1;  // saturates (as a double: close enough for our values)
      if (s < -lim) return -lim;
      return std::trunc(s);
    }
    default:
      return RoundTo(s, FmtOf(dst));
  }
}

// Host tensors written and read through dtype.h's host types only.
Tensor MakeHost(const std::vector<double>& v, IntSpan shape, DType dtype) {
  Tensor t = Unwrap(Tensor::Empty(shape, dtype));
  VisitDType(dtype, [&](auto tag) {
    using T = decltype(tag);
    T* p = t.data<T>();
    for (size_t i = 0; i < v.size(); ++i) {
      if constexpr (std::is_same_v<T, bool>) {
        p[i] = v[i] != 0.0;
      } else if constexpr (std::is_integral_v<T>) {
        p[i] = static_cast<T>(v[i]);
      } else if constexpr (std::is_same_v<T, float>) {
        p[i] = static_cast<float>(v[i]);
      } else {
        p[i] = T(static_cast<float>(v[i]));
      }
    }
  });
  return t;
}

double HostValue(const void* p, DType dtype) {
  return VisitDType(dtype, [&](auto tag) -> double {
    using T = decltype(tag);
    T v;
    std::memcpy(&v, p, sizeof(T));
    if constexpr (std::is_same_v<T, bool>) {
      return v ? 1.0 : 0.0;
    } else if constexpr (std::is_integral_v<T>) {
      return static_cast<double>(v);
    } else {
      return static_cast<double>(static_cast<float>(v));
    }
  });
}

// Row-major values of any strided CPU tensor, read straight from memory.
std::vector<double> ReadStrided(const Tensor& t) {
  std::vector<double> out;
  const int64_t n = t.numel(), nd = t.dim();
  std::vector<int64_t> idx(static_cast<size_t>(nd), 0);
  const auto* base = static_cast<const char*>(t.raw_data());
  const auto es = static_cast<int64_t>(ElementSize(t.dtype()));
  for (int64_t i = 0; i < n; ++i) {
    int64_t off = 0;
    for (int64_t d = 0; d < nd; ++d) off += idx[d] * t.stride(d);
    out.push_back(HostValue(base + off * es, t.dtype()));
    for (int64_t d = nd - 1; d >= 0; --d) {
      if (++idx[d] < t.size(d)) break;
      idx[d] = 0;
    }
  }
  return out;
}

void ExpectSame(const std::vector<double>& a, const std::vector<double>& e, const std::string& what) {
  ASSERT_EQ(a.size(), e.size()) << what;
  int bad = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const bool ok = (std::isnan(a[i]) && std::isnan(e[i])) || a[i] == e[i];
    if (!ok && bad++ < 5) ADD_FAILURE() << what << ": element " << i << " is " << a[i] << ", expected " << e[i];
  }
}

std::vector<double> SourceValues(DType t) {
  if (t == DType::kBool) return {0, 1, 1, 0, 1};
  if (IsInteger(t)) return {0, 1, -1, 7, -100, 300, 65537};
  return {0, 1, -1, 2.5, -3.75, 7, 100.5, -0.1, 0.3333333, 300, -1e-3};
}

// ---- Tests ----

TEST(CpuCopyTest, EveryDTypePair) {
  for (DType s : kAllDTypes) {
    const std::vector<double> v = SourceValues(s);
    const Tensor src = MakeHost(v, {static_cast<int64_t>(v.size())}, s);
    const std::vector<double> held = ReadStrided(src);
    for (DType d : kAllDTypes) {
      Tensor dst = Unwrap(Tensor::Empty(src.shape(), d));
      ASSERT_TRUE(CpuKernels()->Copy(src, dst).ok());
      std::vector<double> expected;
      for (double x : held) expected.push_back(ExpectedCast(x, d));
      ExpectSame(ReadStrided(dst), expected, std::string(DTypeName(s)) + " -> " + std::string(DTypeName(d)));
    }
  }
}

TEST(CpuCopyTest, CastThroughOpsMatches) {
  const Tensor src = MakeHost({1.5, -2.25, 1e-3, 70000}, {2, 2}, DType::kFloat32);
  for (DType d : {DType::kBFloat16, DType::kFloat16, DType::kInt32}) {
    const Tensor c = Unwrap(Cast(src, d));
    EXPECT_EQ(c.dtype(), d);
    std::vector<double> expected;
    for (double x : ReadStrided(src)) expected.push_back(ExpectedCast(x, d));
    ExpectSame(ReadStrided(c), expected, std::string("Cast to ") + std::string(DTypeName(d)));
  }
}

TEST(CpuCopyTest, Float16AndBFloat16RoundingEdgeCases) {
  const std::vector<double> v = {1.0 + std::ldexp(1.0, -11),      // f16 tie -> even (1)
                                 1.0 + 3 * std::ldexp(1.0, -11),  // f16 tie -> even (1 + 2^-9)
                                 1.0 + std::ldexp(1.0, -8),       // bf16 tie -> 1
                                 1.0 + 3 * std::ldexp(1.0, -8),   // bf16 tie -> 1 + 2^-6
                                 65504.0,
                                 65519.0,
                                 65520.0,  // f16 max, below and at the overflow threshold
                                 std::ldexp(1.0, -24),
                                 std::ldexp(1.5, -24),
                                 std::ldexp(1.0, -25),
                                 std::ldexp(1.0001, -25),  // f16 subnormals
                                 std::ldexp(1.0, -14),
                                 std::ldexp(1023.0, -24),  // smallest normal, largest subnormal
                                 -0.0,
                                 3.0e38,
                                 -3.4e38,
                                 1e-40,
                                 INFINITY,
                                 -INFINITY,
                                 std::nan(""),
                                 0.1,
                                 -0.7,
                                 1.0 / 3.0,
                                 12345.678,
                                 2.0e-5};
  const Tensor src = MakeHost(v, {static_cast<int64_t>(v.size())}, DType::kFloat32);
  for (DType d : {DType::kFloat16, DType::kBFloat16, DType::kFloat8E4M3, DType::kFloat8E5M2}) {
    Tensor dst = Unwrap(Tensor::Empty(src.shape(), d));
    ASSERT_TRUE(CpuKernels()->Copy(src, dst).ok());
    std::vector<double> expected;
    for (double x : ReadStrided(src)) expected.push_back(RoundTo(x, FmtOf(d)));
    ExpectSame(ReadStrided(dst), expected, std::string("f32 -> ") + std::string(DTypeName(d)));
  }
  // The sign of zero survives.
  Tensor h = Unwrap(Tensor::Empty({1}, DType::kFloat16));
  const Tensor nz = MakeHost({-0.0}, {1}, DType::kFloat32);
  ASSERT_TRUE(CpuKernels()->Copy(nz, h).ok());
  EXPECT_EQ(h.data<Float16>()[0].bits, 0x8000);
}

TEST(CpuCopyTest, RandomFloatBitsToHalfAndBFloat16) {
  std::mt19937 rng(7);
  const int n = 200000;
  std::vector<float> f(n);
  for (int i = 0; i < n; ++i) {
    uint32_t u = rng();
    if (i % 2 == 0) u = (u & 0x80ffffffu) | ((100u + (u >> 24) % 56u) << 23);  // dense near f16 range
    std::memcpy(&f[i], &u, 4);
  }
  const Tensor src = Unwrap(Tensor::FromVector<float>(f, {n}));
  Tensor h = Unwrap(Tensor::Empty({n}, DType::kFloat16));
  Tensor b = Unwrap(Tensor::Empty({n}, DType::kBFloat16));
  ASSERT_TRUE(CpuKernels()->Copy(src, h).ok());
  ASSERT_TRUE(CpuKernels()->Copy(src, b).ok());
  int bad_h = 0, bad_b = 0;
  for (int i = 0; i < n; ++i) {
    const double x = f[i];
    const double eh = RoundTo(x, FmtOf(DType::kFloat16)), eb = RoundTo(x, FmtOf(DType::kBFloat16));
    const double gh = Float16::ToFloat(h.data<Float16>()[i].bits);
    const double gb = static_cast<float>(b.data<BFloat16>()[i]);
    if (!((std::isnan(eh) && std::isnan(gh)) || (eh == gh && std::signbit(eh) == std::signbit(gh))) && bad_h++ < 5) {
      ADD_FAILURE() << "f16 of " << x << " is " << gh << ", expected " << eh;
    }
    if (!((std::isnan(eb) && std::isnan(gb)) || eb == gb) && bad_b++ < 5) {
      ADD_FAILURE() << "bf16 of " << x << " is " << gb << ", expected " << eb;
    }
    // Bit-identical to the host types of dtype.h (NaN payloads included).
    if (h.data<Float16>()[i].bits != Float16::FromFloat(f[i]) && bad_h++ < 5) ADD_FAILURE() << "f16 bits of " << x;
    if (b.data<BFloat16>()[i].bits != BFloat16::FromFloat(f[i]) && bad_b++ < 5) ADD_FAILURE() << "bf16 bits of " << x;
  }
}

TEST(CpuCopyTest, EveryHalfAndBFloat16BitPatternToFloat) {
  const int n = 65536;
  Tensor h = Unwrap(Tensor::Empty({n}, DType::kFloat16));
  Tensor b = Unwrap(Tensor::Empty({n}, DType::kBFloat16));
  for (int i = 0; i < n; ++i) {
    h.data<Float16>()[i].bits = static_cast<uint16_t>(i);
    b.data<BFloat16>()[i].bits = static_cast<uint16_t>(i);
  }
  Tensor fh = Unwrap(Tensor::Empty({n}, DType::kFloat32));
  Tensor fb = Unwrap(Tensor::Empty({n}, DType::kFloat32));
  ASSERT_TRUE(CpuKernels()->Copy(h, fh).ok());
  ASSERT_TRUE(CpuKernels()->Copy(b, fb).ok());
  int bad = 0;
  for (int i = 0; i < n; ++i) {
    // Independent decode of the half: sign, 5-bit exponent, 10-bit mantissa.
    const int sign = i >> 15, e = (i >> 10) & 31, m = i & 1023;
    double v = e == 0 ? std::ldexp(m, -24) : e == 31 ? (m ? std::nan("") : INFINITY) : std::ldexp(1024 + m, e - 25);
    if (sign) v = -v;
    const double got = fh.data<float>()[i];
    if (!((std::isnan(v) && std::isnan(got)) || (v == got && std::signbit(v) == std::signbit(got))) && bad++ < 5) {
      ADD_FAILURE() << "half 0x" << std::hex << i << " -> " << got << ", expected " << v;
    }
    const uint32_t u = static_cast<uint32_t>(i) << 16;  // bf16 is the top half of a float
    uint32_t got_bits;
    std::memcpy(&got_bits, &fb.data<float>()[i], 4);
    if (got_bits != u && bad++ < 5) ADD_FAILURE() << "bf16 0x" << std::hex << i << " -> " << fb.data<float>()[i];
  }
}

TEST(CpuCopyTest, SameDTypeCopiesBitsIncludingNaNPayloads) {
  const uint32_t payload = 0x7fc12345u;
  float nanv;
  std::memcpy(&nanv, &payload, 4);
  const Tensor src = Unwrap(Tensor::FromVector<float>(std::vector<float>{1.0f, nanv, -0.0f}, {3}));
  Tensor dst = Unwrap(Tensor::Empty({3}, DType::kFloat32));
  ASSERT_TRUE(CpuKernels()->Copy(src, dst).ok());
  EXPECT_EQ(std::memcmp(src.raw_data(), dst.raw_data(), 12), 0);
}

TEST(CpuCopyTest, FloatToIntConventions) {
  const Tensor src =
      MakeHost({-2.7, 2.7, 3e9, -3e9, 1e19, -1e19, std::nan(""), INFINITY, -INFINITY}, {9}, DType::kFloat32);
  Tensor i32 = Unwrap(Cast(src, DType::kInt32));
  Tensor i64 = Unwrap(Cast(src, DType::kInt64));
  const int32_t e32[] = {-2, 2, INT32_MAX, INT32_MIN, INT32_MAX, INT32_MIN, 0, INT32_MAX, INT32_MIN};
  const int64_t e64[] = {-2, 2, 3000000000LL, -3000000000LL, INT64_MAX, INT64_MIN, 0, INT64_MAX, INT64_MIN};
  for (int i = 0; i < 9; ++i) {
    EXPECT_EQ(i32.data<int32_t>()[i], e32[i]) << i;
    EXPECT_EQ(i64.data<int64_t>()[i], e64[i]) << i;
  }
  // int64 -> int32 wraps (two's complement), as PyTorch.
  const Tensor big =
      Unwrap(Tensor::FromVector<int64_t>(std::vector<int64_t>{(int64_t{1} << 32) + 5, -(int64_t{1} << 31) - 1}, {2}));
  const Tensor narrow = Unwrap(Cast(big, DType::kInt32));
  EXPECT_EQ(narrow.data<int32_t>()[0], 5);
  EXPECT_EQ(narrow.data<int32_t>()[1], INT32_MAX);
}

// Shapes with odd sizes, permuted/sliced sources and destinations, broadcast sources.
TEST(CpuCopyTest, StridedAndBroadcastLayouts) {
  for (DType d : {DType::kFloat32, DType::kBFloat16, DType::kInt64}) {
    for (const Shape& shape : {Shape{127}, Shape{3, 17, 5}, Shape{2, 1, 3, 1, 2, 3, 1, 2}, Shape{1}, Shape{}}) {
      const Tensor x = testing::Random(shape, DType::kFloat32, 3, -50, 50);
      const Tensor xd = Unwrap(Cast(x, d));
      const std::vector<double> ref = ReadStrided(xd);
      // Non-contiguous destination (gaps in the last memory dim, dims reversed).
      const Tensor nc = testing::NonContiguous(xd);
      ExpectSame(ReadStrided(nc), ref, "into NonContiguous");
      // Non-contiguous source into a contiguous destination of another dtype.
      Tensor back = Unwrap(Tensor::Empty(shape, DType::kFloat32));
      ASSERT_TRUE(Copy_(back, nc).ok());
      std::vector<double> ref32;
      for (double v : ref) ref32.push_back(ExpectedCast(v, DType::kFloat32));
      ExpectSame(ReadStrided(back), ref32, "from NonContiguous");
    }
  }
  // Transposed source, larger than the parallel threshold.
  const Tensor big = testing::Random({301, 257}, DType::kFloat32, 5);
  const Tensor t = Unwrap(big.Transpose(0, 1));
  const Tensor tc = Unwrap(Contiguous(t));
  EXPECT_TRUE(tc.is_contiguous());
  ExpectSame(ReadStrided(tc), ReadStrided(t), "transpose copy");
  const Tensor tb = Unwrap(Cast(t, DType::kBFloat16));
  std::vector<double> eb;
  for (double v : ReadStrided(t)) eb.push_back(RoundTo(v, FmtOf(DType::kBFloat16)));
  ExpectSame(ReadStrided(tb), eb, "transpose cast bf16");
  // Batched transposes (the last two dims swapped), converting and not.
  const Tensor p3 = testing::Random({5, 67, 45}, DType::kBFloat16, 6);
  const Tensor perm = Unwrap(p3.Permute({0, 2, 1}));  // [5, 45, 67]
  for (DType d : {DType::kBFloat16, DType::kFloat32, DType::kFloat16}) {
    Tensor out = Unwrap(Tensor::Empty(perm.shape(), d));
    ASSERT_TRUE(Copy_(out, perm).ok());
    std::vector<double> expected;
    for (double v : ReadStrided(perm)) expected.push_back(RoundTo(v, FmtOf(d)));
    ExpectSame(ReadStrided(out), expected, "batched transpose to " + std::string(DTypeName(d)));
  }
  // Broadcast source (stride 0) into a sliced destination; the gaps stay untouched.
  const Tensor row = MakeHost({1, 2, 3, 4, 5}, {1, 5}, DType::kFloat32);
  Tensor buf = Unwrap(Full({7, 10}, -9.0, DType::kFloat16));
  const Tensor dst = Unwrap(buf.Slice(1, 0, 10, 2));  // [7, 5], stride 2
  ASSERT_TRUE(Copy_(dst, row).ok());
  const std::vector<double> all = ReadStrided(buf);
  for (int64_t i = 0; i < 7; ++i) {
    for (int64_t j = 0; j < 10; ++j) {
      EXPECT_EQ(all[i * 10 + j], j % 2 == 0 ? static_cast<double>(j / 2 + 1) : -9.0) << i << "," << j;
    }
  }
  // A 0-d source broadcast to a large destination.
  const Tensor scalar = MakeHost({2.5}, {}, DType::kFloat32);
  Tensor many = Unwrap(Tensor::Empty({40000}, DType::kBFloat16));
  ASSERT_TRUE(Copy_(many, scalar).ok());
  for (double v : ReadStrided(many)) ASSERT_EQ(v, 2.5);
}

TEST(CpuCopyTest, FillEveryDTypeAndStridedDestination) {
  for (DType d : kAllDTypes) {
    Tensor t = Unwrap(Tensor::Empty({3, 7}, d));
    ASSERT_TRUE(CpuKernels()->Fill(t, 1.0 / 3.0).ok());
    const double expected = ExpectedCast(RoundTo(1.0 / 3.0, FmtOf(DType::kFloat32)), d);
    for (double v : ReadStrided(t)) ASSERT_EQ(v, expected) << DTypeName(d);
  }
  // Fill a transposed column slice only.
  Tensor buf = Unwrap(Zeros({5, 9}, DType::kFloat32));
  const Tensor col = Unwrap(Unwrap(buf.Slice(1, 1, 9, 3)).Transpose(0, 1));  // [3, 5], columns 1, 4, 7
  ASSERT_TRUE(Fill_(col, -4.5).ok());
  const std::vector<double> all = ReadStrided(buf);
  for (int64_t i = 0; i < 5; ++i) {
    for (int64_t j = 0; j < 9; ++j) EXPECT_EQ(all[i * 9 + j], j % 3 == 1 ? -4.5 : 0.0);
  }
  // Large fill (parallel path).
  Tensor big = Unwrap(Tensor::Empty({100003}, DType::kInt32));
  ASSERT_TRUE(CpuKernels()->Fill(big, -7.9).ok());
  for (double v : ReadStrided(big)) ASSERT_EQ(v, -7.0);
}

TEST(CpuCopyTest, HostDeviceCopiesAreUnimplementedOnCpu) {
  char a[4] = {}, b[4] = {};
  EXPECT_EQ(CpuKernels()->MemcpyToDevice(a, b, 4, /*wait=*/true).code(), absl::StatusCode::kUnimplemented);
  EXPECT_EQ(CpuKernels()->MemcpyToHost(a, b, 4).code(), absl::StatusCode::kUnimplemented);
  EXPECT_TRUE(CpuKernels()->Synchronize().ok());
  EXPECT_EQ(CpuKernels()->device(), Device::Cpu());
}

TEST(CpuCopyTest, EmptyTensorsAreNoOps) {
  Tensor e = Unwrap(Tensor::Empty({0, 5}, DType::kFloat32));
  Tensor f = Unwrap(Tensor::Empty({0, 5}, DType::kBFloat16));
  EXPECT_TRUE(CpuKernels()->Copy(e, f).ok());
  EXPECT_TRUE(CpuKernels()->Fill(e, 1.0).ok());
}

}  // namespace
}  // namespace dtensor
