// dtype.h: sizes, names and the scalar f32 <-> bf16 / f16 converters on known values.
// (The vector cast kernels are checked against these converters in tests/kernels/.)
#include "fsdp/dtype.h"

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>

#include "gtest/gtest.h"

namespace fsdp {
namespace {

uint32_t Bits(float f) { return std::bit_cast<uint32_t>(f); }
float FromBits(uint32_t u) { return std::bit_cast<float>(u); }

TEST(DType, SizesAndNames) {
  EXPECT_EQ(DTypeSize(DType::kF32), 4u);
  EXPECT_EQ(DTypeSize(DType::kBF16), 2u);
  EXPECT_EQ(DTypeSize(DType::kF16), 2u);
  EXPECT_EQ(DTypeName(DType::kF32), "f32");
  EXPECT_EQ(DTypeName(DType::kBF16), "bf16");
  EXPECT_EQ(DTypeName(DType::kF16), "f16");
  static_assert(DTypeSize(DType::kBF16) == 2);  // usable in constant expressions
}

TEST(Bf16, KnownValues) {
  EXPECT_EQ(FloatToBf16(1.0f), 0x3f80);
  EXPECT_EQ(FloatToBf16(-2.5f), 0xc020);
  EXPECT_EQ(FloatToBf16(0.0f), 0x0000);
  EXPECT_EQ(FloatToBf16(-0.0f), 0x8000);
  EXPECT_EQ(Bf16ToFloat(0x3f80), 1.0f);
  EXPECT_EQ(Bf16ToFloat(0xc020), -2.5f);
  // Largest finite bf16: (2 - 2^-7) * 2^127.
  EXPECT_EQ(Bf16ToFloat(0x7f7f), std::ldexp(2.0f - std::ldexp(1.0f, -7), 127));
  EXPECT_EQ(FloatToBf16(Bf16ToFloat(0x7f7f)), 0x7f7f);
  // FLT_MAX lies above the last bf16 + half an ulp: overflows to Inf.
  EXPECT_EQ(FloatToBf16(std::numeric_limits<float>::max()), 0x7f80);
  EXPECT_EQ(FloatToBf16(std::numeric_limits<float>::infinity()), 0x7f80);
  EXPECT_EQ(FloatToBf16(-std::numeric_limits<float>::infinity()), 0xff80);
}

TEST(Bf16, RoundsToNearestEven) {
  // 1 + 2^-8 is halfway between 1 (even mantissa) and 1 + 2^-7: goes to 1.
  EXPECT_EQ(FloatToBf16(FromBits(0x3f808000)), 0x3f80);
  // 1 + 3*2^-8 is halfway between 1 + 2^-7 (odd) and 1 + 2^-6 (even): goes up.
  EXPECT_EQ(FloatToBf16(FromBits(0x3f818000)), 0x3f82);
  // Just above / below the tie.
  EXPECT_EQ(FloatToBf16(FromBits(0x3f808001)), 0x3f81);
  EXPECT_EQ(FloatToBf16(FromBits(0x3f807fff)), 0x3f80);
  // Subnormals are rounded, not flushed.
  EXPECT_EQ(FloatToBf16(FromBits(0x007fffff)), 0x0080);
  EXPECT_EQ(FloatToBf16(FromBits(0x00010000)), 0x0001);
}

TEST(Bf16, NaNStaysQuietNaN) {
  const float qnan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(qnan))));
  // A signalling NaN whose payload sits in the low bits must not round into Inf.
  EXPECT_EQ(FloatToBf16(FromBits(0x7f800001)), 0x7fc0);
  EXPECT_EQ(FloatToBf16(FromBits(0xff800001)), 0xffc0);
  EXPECT_EQ(FloatToBf16(FromBits(0x7fffffff)), 0x7fff);
}

TEST(F16, KnownValues) {
  EXPECT_EQ(FloatToF16(1.0f), 0x3c00);
  EXPECT_EQ(FloatToF16(-2.5f), 0xc100);
  EXPECT_EQ(FloatToF16(65504.0f), 0x7bff);
  EXPECT_EQ(FloatToF16(-0.0f), 0x8000);
  EXPECT_EQ(F16ToFloat(0x3c00), 1.0f);
  EXPECT_EQ(F16ToFloat(0xc100), -2.5f);
  EXPECT_EQ(F16ToFloat(0x7bff), 65504.0f);
  EXPECT_EQ(F16ToFloat(0x0400), std::ldexp(1.0f, -14));  // smallest normal
}

TEST(F16, Subnormals) {
  const float tiny = std::ldexp(1.0f, -24);  // smallest f16 subnormal
  EXPECT_EQ(FloatToF16(tiny), 0x0001);
  EXPECT_EQ(F16ToFloat(0x0001), tiny);
  EXPECT_EQ(F16ToFloat(0x03ff), 1023.0f * tiny);  // largest subnormal
  EXPECT_EQ(FloatToF16(1023.0f * tiny), 0x03ff);
  EXPECT_EQ(FloatToF16(-tiny), 0x8001);
  // Ties at the bottom of the range: 0.5 * 2^-24 -> 0 (even), 1.5 * 2^-24 -> 2 * 2^-24.
  EXPECT_EQ(FloatToF16(0.5f * tiny), 0x0000);
  EXPECT_EQ(FloatToF16(1.5f * tiny), 0x0002);
  EXPECT_EQ(FloatToF16(2.5f * tiny), 0x0002);
  EXPECT_EQ(FloatToF16(std::nextafter(0.5f * tiny, 1.0f)), 0x0001);
  // Rounding up out of the subnormal range gives the smallest normal.
  EXPECT_EQ(FloatToF16(1023.5f * tiny), 0x0400);
}

TEST(F16, RoundingAndOverflow) {
  // 1 + 2^-11 is halfway between 1 and 1 + 2^-10: to even (1).
  EXPECT_EQ(FloatToF16(1.0f + std::ldexp(1.0f, -11)), 0x3c00);
  EXPECT_EQ(FloatToF16(1.0f + 3.0f * std::ldexp(1.0f, -11)), 0x3c02);
  EXPECT_EQ(FloatToF16(65519.0f), 0x7bff);
  EXPECT_EQ(FloatToF16(65520.0f), 0x7c00);  // tie with an odd mantissa: up, to Inf
  EXPECT_EQ(FloatToF16(-65520.0f), 0xfc00);
  EXPECT_EQ(FloatToF16(1e10f), 0x7c00);
  EXPECT_EQ(FloatToF16(std::numeric_limits<float>::infinity()), 0x7c00);
  EXPECT_EQ(F16ToFloat(0x7c00), std::numeric_limits<float>::infinity());
  EXPECT_EQ(F16ToFloat(0xfc00), -std::numeric_limits<float>::infinity());
}

TEST(F16, NaNBehavesAsF16C) {
  // vcvtps2ph: quiet bit set, top 10 payload bits kept; vcvtph2ps: quiet bit set.
  EXPECT_EQ(FloatToF16(FromBits(0x7f800001)), 0x7e00);
  EXPECT_EQ(FloatToF16(FromBits(0x7f802000)), 0x7e01);
  EXPECT_EQ(FloatToF16(FromBits(0xffffffff)), 0xffff);
  EXPECT_EQ(Bits(F16ToFloat(0x7c01)), 0x7fc02000u);
  EXPECT_EQ(Bits(F16ToFloat(0xfe00)), 0xffc00000u);
  EXPECT_TRUE(std::isnan(F16ToFloat(FloatToF16(std::numeric_limits<float>::quiet_NaN()))));
}

}  // namespace
}  // namespace fsdp
