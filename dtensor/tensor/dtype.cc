#include "dtensor/tensor/dtype.h"

#include <cmath>
#include <limits>

namespace dtensor {

const char* DTypeName(DType t) {
  switch (t) {
    case DType::kFloat32:
      return "float32";
    case DType::kBFloat16:
      return "bfloat16";
    case DType::kFloat16:
      return "float16";
    case DType::kInt32:
      return "int32";
    case DType::kInt64:
      return "int64";
    case DType::kBool:
      return "bool";
    case DType::kFloat8E4M3:
      return "float8_e4m3";
    case DType::kFloat8E5M2:
      return "float8_e5m2";
  }
  return "unknown";
}

std::ostream& operator<<(std::ostream& os, DType t) { return os << DTypeName(t); }

uint16_t Float16::FromFloat(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t abs = x & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);   // NaN
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to inf
  if (abs < 0x38800000u) {  // below 2^-14: subnormal or zero; a * 2^24 is exact in float
    float a;
    std::memcpy(&a, &abs, 4);
    const auto m = static_cast<uint32_t>(std::nearbyint(a * 16777216.0f));
    return static_cast<uint16_t>(sign | m);
  }
  const uint32_t e = (abs >> 23) - 127 + 15;
  const uint32_t mant = abs & 0x7fffffu;
  uint32_t h = (e << 10) | (mant >> 13);
  const uint32_t rem = mant & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // may carry into the exponent
  return static_cast<uint16_t>(sign | h);
}

float Float16::ToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0) {
    const float v = static_cast<float>(mant) * (1.0f / 16777216.0f);
    return sign ? -v : v;
  }
  uint32_t u;
  if (exp == 31) {
    u = sign | 0x7f800000u | (mant << 13);
  } else {
    u = sign | ((exp - 15 + 127) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

namespace {

// A small float format with `ebits` exponent and `mbits` mantissa bits.
struct MiniFloat {
  int ebits;
  int mbits;
  int bias;
  float max_finite;
  bool has_inf;  // e5m2: yes; e4m3fn: no (overflow and NaN share code 0x7f)
};
constexpr MiniFloat kE4M3{4, 3, 7, 448.0f, false};
constexpr MiniFloat kE5M2{5, 2, 15, 57344.0f, true};

uint8_t Encode(float f, const MiniFloat& fmt) {
  const uint8_t sign = std::signbit(f) ? 0x80 : 0;
  const uint8_t nan_code = 0x7f;  // e4m3fn NaN; for e5m2 0x7f is also a NaN
  const uint8_t inf_code = static_cast<uint8_t>(((1 << fmt.ebits) - 1) << fmt.mbits);
  if (std::isnan(f)) return sign | nan_code;
  float a = std::fabs(f);
  if (a == 0.0f) return sign;
  const int min_exp = 1 - fmt.bias;  // exponent of the smallest normal
  int e;
  std::frexp(a, &e);
  e -= 1;  // a = m * 2^e with m in [1, 2)
  if (e < min_exp) e = min_exp;
  const float quantum = std::ldexp(1.0f, e - fmt.mbits);
  const float q = std::nearbyint(a / quantum) * quantum;
  if (q > fmt.max_finite || std::isinf(a)) {
    return sign | (fmt.has_inf ? inf_code : nan_code);
  }
  if (q == 0.0f) return sign;
  int qe;
  std::frexp(q, &qe);
  qe -= 1;
  if (qe < min_exp) {  // subnormal
    const auto mant = static_cast<uint32_t>(q / std::ldexp(1.0f, min_exp - fmt.mbits));
    return sign | static_cast<uint8_t>(mant);
  }
  const auto exp_field = static_cast<uint32_t>(qe + fmt.bias);
  const auto mant = static_cast<uint32_t>((q / std::ldexp(1.0f, qe) - 1.0f) * static_cast<float>(1 << fmt.mbits));
  return sign | static_cast<uint8_t>((exp_field << fmt.mbits) | mant);
}

float Decode(uint8_t b, const MiniFloat& fmt) {
  const bool neg = b & 0x80;
  const int exp_field = (b >> fmt.mbits) & ((1 << fmt.ebits) - 1);
  const int mant = b & ((1 << fmt.mbits) - 1);
  const int max_exp_field = (1 << fmt.ebits) - 1;
  float v;
  if (fmt.has_inf && exp_field == max_exp_field) {
    v = mant == 0 ? std::numeric_limits<float>::infinity() : std::numeric_limits<float>::quiet_NaN();
  } else if (!fmt.has_inf && exp_field == max_exp_field && mant == (1 << fmt.mbits) - 1) {
    v = std::numeric_limits<float>::quiet_NaN();
  } else if (exp_field == 0) {
    v = std::ldexp(static_cast<float>(mant), 1 - fmt.bias - fmt.mbits);
  } else {
    v = std::ldexp(1.0f + static_cast<float>(mant) / static_cast<float>(1 << fmt.mbits), exp_field - fmt.bias);
  }
  return neg ? -v : v;
}

}  // namespace

uint8_t Float8E4M3::FromFloat(float f) { return Encode(f, kE4M3); }
float Float8E4M3::ToFloat(uint8_t b) { return Decode(b, kE4M3); }
uint8_t Float8E5M2::FromFloat(float f) { return Encode(f, kE5M2); }
float Float8E5M2::ToFloat(uint8_t b) { return Decode(b, kE5M2); }

}  // namespace dtensor
