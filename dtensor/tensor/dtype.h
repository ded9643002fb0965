// DType: the element types a Tensor can hold, and host-side 16-bit float types.
//
//   DType t = DType::kBFloat16;
//   size_t bytes = ElementSize(t);           // 2
//   const char* n = DTypeName(t);            // "bfloat16"
//   BFloat16 h = BFloat16(1.5f);  float f = static_cast<float>(h);
//
// float32, bfloat16 and float16 are compute types (bf16/f16 kernels accumulate in fp32);
// int32, int64 and bool are index/mask types; float8 e4m3/e5m2 are storage-only for now
// (copies and casts work, arithmetic returns Unimplemented).
#ifndef DTENSOR_TENSOR_DTYPE_H_
#define DTENSOR_TENSOR_DTYPE_H_

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <ostream>
#include <string_view>

namespace dtensor {

enum class DType : uint8_t {
  kFloat32,
  kBFloat16,
  kFloat16,
  kInt32,
  kInt64,
  kBool,
  kFloat8E4M3,
  kFloat8E5M2,
};

// Bytes per element.
constexpr size_t ElementSize(DType t) {
  switch (t) {
    case DType::kFloat32:
    case DType::kInt32:
      return 4;
    case DType::kBFloat16:
    case DType::kFloat16:
      return 2;
    case DType::kInt64:
      return 8;
    case DType::kBool:
    case DType::kFloat8E4M3:
    case DType::kFloat8E5M2:
      return 1;
  }
  return 0;
}

// "float32", "bfloat16", "float16", "int32", "int64", "bool", "float8_e4m3", "float8_e5m2".
const char* DTypeName(DType t);
std::ostream& operator<<(std::ostream& os, DType t);

// Floating point types that kernels compute on (float8 excluded: storage only).
constexpr bool IsComputeFloat(DType t) { return t == DType::kFloat32 || t == DType::kBFloat16 || t == DType::kFloat16; }
constexpr bool IsInteger(DType t) { return t == DType::kInt32 || t == DType::kInt64; }
constexpr bool IsFloat8(DType t) { return t == DType::kFloat8E4M3 || t == DType::kFloat8E5M2; }

// bfloat16 on the host: the top 16 bits of a float32, rounded to nearest even.
struct BFloat16 {
  uint16_t bits = 0;
  BFloat16() = default;
  explicit BFloat16(float f) : bits(FromFloat(f)) {}
  explicit operator float() const {
    uint32_t u = static_cast<uint32_t>(bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  static uint16_t FromFloat(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<uint16_t>(u >> 16);
  }
};

// IEEE half precision on the host, round to nearest even.
struct Float16 {
  uint16_t bits = 0;
  Float16() = default;
  explicit Float16(float f) : bits(FromFloat(f)) {}
  explicit operator float() const { return ToFloat(bits); }
  static uint16_t FromFloat(float f);
  static float ToFloat(uint16_t h);
};

// float8 storage types (OCP FP8): e4m3fn (no infinities, max 448) and e5m2.
struct Float8E4M3 {
  uint8_t bits = 0;
  Float8E4M3() = default;
  explicit Float8E4M3(float f) : bits(FromFloat(f)) {}
  explicit operator float() const { return ToFloat(bits); }
  static uint8_t FromFloat(float f);
  static float ToFloat(uint8_t b);
};
struct Float8E5M2 {
  uint8_t bits = 0;
  Float8E5M2() = default;
  explicit Float8E5M2(float f) : bits(FromFloat(f)) {}
  explicit operator float() const { return ToFloat(bits); }
  static uint8_t FromFloat(float f);
  static float ToFloat(uint8_t b);
};

// C++ type -> DType.
template <typename T>
struct DTypeOf;
template <>
struct DTypeOf<float> {
  static constexpr DType value = DType::kFloat32;
};
template <>
struct DTypeOf<BFloat16> {
  static constexpr DType value = DType::kBFloat16;
};
template <>
struct DTypeOf<Float16> {
  static constexpr DType value = DType::kFloat16;
};
template <>
struct DTypeOf<int32_t> {
  static constexpr DType value = DType::kInt32;
};
template <>
struct DTypeOf<int64_t> {
  static constexpr DType value = DType::kInt64;
};
template <>
struct DTypeOf<bool> {
  static constexpr DType value = DType::kBool;
};
template <>
struct DTypeOf<Float8E4M3> {
  static constexpr DType value = DType::kFloat8E4M3;
};
template <>
struct DTypeOf<Float8E5M2> {
  static constexpr DType value = DType::kFloat8E5M2;
};

// Calls f(T{}) with T the C++ type of `t` (host types above). Used by CPU kernels and tests.
template <typename F>
decltype(auto) VisitDType(DType t, F&& f) {
  switch (t) {
    case DType::kFloat32:
      return f(float{});
    case DType::kBFloat16:
      return f(BFloat16{});
    case DType::kFloat16:
      return f(Float16{});
    case DType::kInt32:
      return f(int32_t{});
    case DType::kInt64:
      return f(int64_t{});
    case DType::kBool:
      return f(bool{});
    case DType::kFloat8E4M3:
      return f(Float8E4M3{});
    case DType::kFloat8E5M2:
      return f(Float8E5M2{});
  }
  return f(float{});
}

// Value conversions through float/int64 for any host element type.
template <typename T>
inline float ToF32(T v) {
  return static_cast<float>(v);
}
template <typename T>
inline T FromF32(float f) {
  if constexpr (std::is_same_v<T, bool>) {
    return f != 0.0f;
  } else {
    return static_cast<T>(f);
  }
}

}  // namespace dtensor

#endif  // DTENSOR_TENSOR_DTYPE_H_
