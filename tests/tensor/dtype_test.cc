// 16-bit and 8-bit float conversions against values computed independently with double math.
#include "dtensor/tensor/dtype.h"

#include <cmath>
#include <limits>

#include "gtest/gtest.h"

namespace dtensor {
namespace {

// Round-to-nearest-even of x to a float format with `mbits` mantissa bits and minimum normal
// exponent `emin` (subnormals below), done in double: an independent reference.
double RoundToFormat(double x, int mbits, int emin) {
  if (x == 0 || std::isnan(x) || std::isinf(x)) return x;
  int e;
  std::frexp(std::fabs(x), &e);
  e -= 1;
  if (e < emin) e = emin;
  const double q = std::ldexp(1.0, e - mbits);
  return std::nearbyint(x / q) * q;
}

TEST(DTypeTest, SizesAndNames) {
  EXPECT_EQ(ElementSize(DType::kBFloat16), 2u);
  EXPECT_EQ(ElementSize(DType::kInt64), 8u);
  EXPECT_EQ(ElementSize(DType::kFloat8E4M3), 1u);
  EXPECT_STREQ(DTypeName(DType::kFloat16), "float16");
}

TEST(DTypeTest, BFloat16RoundsToNearestEven) {
  for (double x : {1.0, -2.5, 3.14159265, 1e-3, 65504.0, 1.00390625, 1.01171875, 1e30, -7e-39}) {
    const float f = static_cast<float>(x);
    const double want = RoundToFormat(f, 7, -126);
    EXPECT_EQ(static_cast<float>(BFloat16(f)), static_cast<float>(want)) << x;
  }
  EXPECT_TRUE(std::isnan(static_cast<float>(BFloat16(std::nanf("")))));
  EXPECT_TRUE(std::isinf(static_cast<float>(BFloat16(std::numeric_limits<float>::infinity()))));
}

TEST(DTypeTest, Float16RoundsToNearestEvenWithSubnormals) {
  for (double x : {1.0, -2.5, 3.14159265, 1e-3, 65504.0, 1.00048828125, 6e-8, 3e-5, -1e-6, 0.1, 1000.3}) {
    const float f = static_cast<float>(x);
    const double want = RoundToFormat(f, 10, -14);
    EXPECT_EQ(static_cast<float>(Float16(f)), static_cast<float>(want)) << x;
  }
  EXPECT_TRUE(std::isinf(static_cast<float>(Float16(65520.0f))));  // rounds up past 65504
  EXPECT_EQ(static_cast<float>(Float16(65519.0f)), 65504.0f);
  // Every half bit pattern survives a round trip through float.
  for (uint32_t h = 0; h < 0x10000; ++h) {
    Float16 v;
    v.bits = static_cast<uint16_t>(h);
    const float f = static_cast<float>(v);
    if (std::isnan(f)) continue;
    EXPECT_EQ(Float16(f).bits, v.bits) << h;
  }
}

TEST(DTypeTest, Float8RoundTripsAndSaturation) {
  for (uint32_t b = 0; b < 256; ++b) {
    Float8E4M3 e4;
    e4.bits = static_cast<uint8_t>(b);
    const float f4 = static_cast<float>(e4);
    if (!std::isnan(f4)) {
      EXPECT_EQ(Float8E4M3(f4).bits, e4.bits) << b;
    }
    Float8E5M2 e5;
    e5.bits = static_cast<uint8_t>(b);
    const float f5 = static_cast<float>(e5);
    if (!std::isnan(f5)) {
      EXPECT_EQ(Float8E5M2(f5).bits, e5.bits) << b;
    }
  }
  EXPECT_EQ(static_cast<float>(Float8E4M3(448.0f)), 448.0f);
  EXPECT_EQ(static_cast<float>(Float8E4M3(0.3f)), static_cast<float>(RoundToFormat(0.3, 3, -6)));
  EXPECT_TRUE(std::isnan(static_cast<float>(Float8E4M3(1000.0f))));  // e4m3fn has no inf
  EXPECT_TRUE(std::isinf(static_cast<float>(Float8E5M2(1e6f))));
  EXPECT_EQ(static_cast<float>(Float8E5M2(0.3f)), static_cast<float>(RoundToFormat(0.3, 2, -14)));
}

}  // namespace
}  // namespace dtensor
