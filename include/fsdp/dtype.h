// Element types of libfsdp buffers and exact scalar conversions. Floating point: f32, bf16,
// f16 (the data the runtime computes and communicates) and f64 (scalars: sums of squares).
// Integers: i32 (token ids), i64 and u8 (control data and raw bytes).
// bf16 and f16 are stored as raw uint16_t bits; conversions round to nearest even and keep
// NaN/Inf, as hardware converters (vcvtneps2bf16, vcvtps2ph, vcvtph2ps) do: a NaN keeps its
// sign and top payload bits and becomes quiet. Unlike vcvtneps2bf16, f32 subnormals are
// rounded, not flushed to zero (as PyTorch's c10::BFloat16 does).
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

namespace fsdp {

enum class DType : uint8_t { kF32 = 0, kBF16 = 1, kF16 = 2, kF64 = 3, kI32 = 4, kI64 = 5, kU8 = 6 };

constexpr size_t DTypeSize(DType t) {
  switch (t) {
    case DType::kF32: return 4;
    case DType::kBF16: return 2;
    case DType::kF16: return 2;
    case DType::kF64: return 8;
    case DType::kI32: return 4;
    case DType::kI64: return 8;
    case DType::kU8: return 1;
  }
  return 0;
}
constexpr std::string_view DTypeName(DType t) {
  switch (t) {
    case DType::kF32: return "f32";
    case DType::kBF16: return "bf16";
    case DType::kF16: return "f16";
    case DType::kF64: return "f64";
    case DType::kI32: return "i32";
    case DType::kI64: return "i64";
    case DType::kU8: return "u8";
  }
  return "?";
}
// DTypeName's inverse, case-insensitive ("f32", "BF16", "i64" ...); nullopt for any other
// text. Programs that take only the float types check IsFloat16Or32 on the result.
constexpr std::optional<DType> ParseDType(std::string_view name) {
  for (DType t : {DType::kF32, DType::kBF16, DType::kF16, DType::kF64, DType::kI32, DType::kI64,
                  DType::kU8}) {
    const std::string_view n = DTypeName(t);
    if (n.size() != name.size()) continue;
    bool same = true;
    for (size_t i = 0; i < n.size() && same; ++i) {
      const char c = name[i] >= 'A' && name[i] <= 'Z' ? static_cast<char>(name[i] - 'A' + 'a')
                                                       : name[i];
      same = c == n[i];
    }
    if (same) return t;
  }
  return std::nullopt;
}
// The types the data plane reduces and the runtime gathers: f32, bf16, f16.
constexpr bool IsFloat16Or32(DType t) {
  return t == DType::kF32 || t == DType::kBF16 || t == DType::kF16;
}

inline uint16_t FloatToBf16(float f) {
  uint32_t u = std::bit_cast<uint32_t>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return static_cast<uint16_t>(u >> 16);
}

inline float Bf16ToFloat(uint16_t h) { return std::bit_cast<float>(static_cast<uint32_t>(h) << 16); }

inline uint16_t FloatToF16(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t absu = u & 0x7fffffffu;
  if (absu >= 0x7f800000u) {  // Inf, or NaN made quiet with its top payload bits (as F16C)
    return static_cast<uint16_t>(
        sign | 0x7c00u | (absu > 0x7f800000u ? 0x200u | ((absu >> 13) & 0x3ffu) : 0u));
  }
  if (absu >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to >= 65520: Inf
  if (absu < 0x38800000u) {  // result is subnormal or zero: value * 2^24 rounded to an integer
    const float a = std::bit_cast<float>(absu);
    // Adding 0.5f aligns the mantissa so the FPU performs round-to-nearest-even for us.
    const float r = a + 0.5f;
    return static_cast<uint16_t>(sign | (std::bit_cast<uint32_t>(r) - 0x3f000000u));
  }
  uint32_t mant_odd = (absu >> 13) & 1u;
  uint32_t v = absu + 0xc8000fffu + mant_odd;  // re-bias exponent (-112 << 23) and round
  return static_cast<uint16_t>(sign | (v >> 13));
}

inline float F16ToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0) {
    // subnormal or zero: mant * 2^-24
    const float v = static_cast<float>(mant) * 5.9604644775390625e-8f;
    return std::bit_cast<float>(sign | std::bit_cast<uint32_t>(v));
  }
  if (exp == 31) {  // Inf, or NaN made quiet (as F16C vcvtph2ps)
    return std::bit_cast<float>(sign | 0x7f800000u | (mant != 0 ? 0x400000u : 0u) | (mant << 13));
  }
  return std::bit_cast<float>(sign | ((exp + 112u) << 23) | (mant << 13));
}

}  // namespace fsdp
