// Cast kernels: exhaustive over every bf16 and f16 bit pattern, rounding boundaries, and
// random / strided f32 patterns, all bit-identical to the scalar converters of dtype.h.
#include <bit>
#include <cmath>
#include <limits>

#include "fsdp/dtype.h"
#include "fsdp/kernels_cpu.h"
#include "tests/kernels/reference.h"

namespace fsdp::kernels::cpu {
namespace {

using Bits16 = std::vector<uint16_t>;

Bits16 AllPatterns() {
  Bits16 all(65536);
  for (uint32_t i = 0; i < 65536; ++i) all[i] = static_cast<uint16_t>(i);
  return all;
}

uint32_t Bits(float f) { return std::bit_cast<uint32_t>(f); }

bool IsBf16NaN(uint16_t h) { return (h & 0x7f80) == 0x7f80 && (h & 0x7f) != 0; }
bool IsF16NaN(uint16_t h) { return (h & 0x7c00) == 0x7c00 && (h & 0x3ff) != 0; }

TEST(CastBf16, ExhaustiveRoundTrip) {
  const Bits16 all = AllPatterns();
  std::vector<float> f(all.size());
  cast_bf16_to_f32(f.data(), all.data(), static_cast<int64_t>(all.size()));
  Bits16 back(all.size());
  cast_f32_to_bf16(back.data(), f.data(), static_cast<int64_t>(f.size()));
  for (uint32_t i = 0; i < 65536; ++i) {
    const uint16_t h = all[i];
    ASSERT_EQ(Bits(f[i]), Bits(Bf16ToFloat(h))) << std::hex << h;
    ASSERT_EQ(back[i], FloatToBf16(f[i])) << std::hex << h;
    if (IsBf16NaN(h)) {
      ASSERT_TRUE(std::isnan(f[i])) << std::hex << h;
      ASSERT_EQ(back[i], h | 0x40) << std::hex << h;  // same NaN, made quiet
    } else {
      ASSERT_EQ(back[i], h) << std::hex << h;
    }
  }
}

TEST(CastF16, ExhaustiveRoundTrip) {
  const Bits16 all = AllPatterns();
  std::vector<float> f(all.size());
  cast_f16_to_f32(f.data(), all.data(), static_cast<int64_t>(all.size()));
  Bits16 back(all.size());
  cast_f32_to_f16(back.data(), f.data(), static_cast<int64_t>(f.size()));
  for (uint32_t i = 0; i < 65536; ++i) {
    const uint16_t h = all[i];
    ASSERT_EQ(Bits(f[i]), Bits(F16ToFloat(h))) << std::hex << h;
    ASSERT_EQ(back[i], FloatToF16(f[i])) << std::hex << h;
    if (IsF16NaN(h)) {
      ASSERT_TRUE(std::isnan(f[i])) << std::hex << h;
      ASSERT_EQ(back[i], h | 0x200) << std::hex << h;
    } else {
      ASSERT_EQ(back[i], h) << std::hex << h;
      // Values are exact: f16 -> f32 loses nothing.
      if (h != 0x7c00 && h != 0xfc00) {
        const int e = (h >> 10) & 0x1f, m = h & 0x3ff;
        const double mag = e == 0 ? std::ldexp(m, -24) : std::ldexp(1024 + m, e - 25);
        ASSERT_EQ(f[i], (h & 0x8000) ? -mag : mag) << std::hex << h;
      }
    }
  }
}

// Runs both kernels on `in` and compares with the scalar converters bit for bit. Offsets
// 0..8 move the values across the vector body and the scalar tail.
void ExpectMatchesScalar(const std::vector<float>& in) {
  for (size_t offset = 0; offset < 9 && offset < in.size(); ++offset) {
    const int64_t n = static_cast<int64_t>(in.size() - offset);
    Bits16 bf(n), hf(n);
    cast_f32_to_bf16(bf.data(), in.data() + offset, n);
    cast_f32_to_f16(hf.data(), in.data() + offset, n);
    std::vector<float> bf_round(n), hf_round(n);  // rounded and widened in one pass
    round_f32_through_bf16(bf_round.data(), in.data() + offset, n);
    round_f32_through_f16(hf_round.data(), in.data() + offset, n);
    // Rounded in place, keeping the bf16 copy, in one pass.
    std::vector<float> bf_kept_x(in.begin() + static_cast<int64_t>(offset), in.end());
    Bits16 bf_kept(n);
    round_f32_keeping_bf16(bf_kept.data(), bf_kept_x.data(), n);
    for (int64_t i = 0; i < n; ++i) {
      const float x = in[offset + i];
      ASSERT_EQ(bf_kept[i], FloatToBf16(x)) << std::hex << Bits(x);
      ASSERT_EQ(Bits(bf_kept_x[i]), Bits(Bf16ToFloat(FloatToBf16(x)))) << std::hex << Bits(x);
      ASSERT_EQ(bf[i], FloatToBf16(x)) << std::hex << Bits(x);
      ASSERT_EQ(hf[i], FloatToF16(x)) << std::hex << Bits(x);
      ASSERT_EQ(Bits(bf_round[i]), Bits(Bf16ToFloat(FloatToBf16(x)))) << std::hex << Bits(x);
      ASSERT_EQ(Bits(hf_round[i]), Bits(F16ToFloat(FloatToF16(x)))) << std::hex << Bits(x);
    }
  }
}

TEST(Casts, RoundingBoundaries) {
  std::vector<float> v;
  const auto from = [](uint32_t u) { return std::bit_cast<float>(u); };
  for (uint32_t base : {0x3f800000u, 0x3f810000u, 0x40490000u, 0x00010000u, 0x7f7f0000u}) {
    // bf16 ties (low half = 0x8000) and their neighbours, both signs.
    for (uint32_t low : {0x7fffu, 0x8000u, 0x8001u, 0x0000u, 0xffffu}) {
      v.push_back(from(base | low));
      v.push_back(from((base | low) | 0x80000000u));
    }
  }
  // f16 ties at 1.0, the subnormal range and the overflow edge.
  for (float x : {1.0f + std::ldexp(1.0f, -11), 1.0f + 3 * std::ldexp(1.0f, -11),
                  std::ldexp(1.0f, -24), std::ldexp(1.0f, -25), 3 * std::ldexp(1.0f, -25),
                  std::ldexp(1.0f, -26), 1023.5f * std::ldexp(1.0f, -24), 65504.0f,
                  65519.0f, 65519.99f, 65520.0f, 65536.0f, 1e30f, 6.1035156e-05f}) {
    v.push_back(x);
    v.push_back(-x);
    v.push_back(std::nextafter(x, 0.0f));
    v.push_back(std::nextafter(x, INFINITY));
  }
  for (uint32_t special : {0x0u, 0x80000000u, 0x1u, 0x807fffffu, 0x7f800000u, 0xff800000u,
                           0x7fc00000u, 0x7f800001u, 0xffbfffffu, 0x7fffffffu}) {
    v.push_back(from(special));
  }
  ExpectMatchesScalar(v);

  // Spot checks of the expected values themselves.
  Bits16 out(4);
  const float f16_edge[4] = {65519.0f, 65520.0f, std::ldexp(1.0f, -24), -65520.0f};
  cast_f32_to_f16(out.data(), f16_edge, 4);
  EXPECT_EQ(out, (Bits16{0x7bff, 0x7c00, 0x0001, 0xfc00}));
  const float bf_ties[2] = {from(0x3f808000u), from(0x3f818000u)};
  cast_f32_to_bf16(out.data(), bf_ties, 2);
  EXPECT_EQ(out[0], 0x3f80);
  EXPECT_EQ(out[1], 0x3f82);
}

TEST(Casts, RandomAndStridedPatterns) {
  std::mt19937 rng(2024);
  std::vector<float> v;
  // Random bit patterns (all exponents, NaNs included) ...
  for (int i = 0; i < 200000; ++i) v.push_back(std::bit_cast<float>(static_cast<uint32_t>(rng())));
  // ... random values in the f16 range ...
  std::uniform_real_distribution<float> dist(-70000.0f, 70000.0f);
  for (int i = 0; i < 100000; ++i) v.push_back(dist(rng));
  // ... and a sweep over the whole f32 space with a stride coprime to 2^32.
  for (uint64_t u = 0; u < (1ull << 32); u += 4099) {  // ~1M values
    v.push_back(std::bit_cast<float>(static_cast<uint32_t>(u)));
  }
  ExpectMatchesScalar(v);
}

TEST(Casts, LargeParallelRun) {
  // Above the parallel threshold, with a tail that is not a multiple of the vector width.
  const int64_t n = (1 << 18) + 5;
  std::mt19937 rng(1);
  std::vector<float> in(n);
  for (float& x : in) x = std::bit_cast<float>(static_cast<uint32_t>(rng()));
  Bits16 bf(n), hf(n);
  cast_f32_to_bf16(bf.data(), in.data(), n);
  cast_f32_to_f16(hf.data(), in.data(), n);
  std::vector<float> bf_back(n), hf_back(n);
  cast_bf16_to_f32(bf_back.data(), bf.data(), n);
  cast_f16_to_f32(hf_back.data(), hf.data(), n);
  // In place: out may be in.
  std::vector<float> bf_round = in, hf_round = in, bf_kept_x = in;
  round_f32_through_bf16(bf_round.data(), bf_round.data(), n);
  round_f32_through_f16(hf_round.data(), hf_round.data(), n);
  Bits16 bf_kept(n);
  round_f32_keeping_bf16(bf_kept.data(), bf_kept_x.data(), n);
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_EQ(bf_kept[i], bf[i]) << i;
    ASSERT_EQ(Bits(bf_kept_x[i]), Bits(bf_back[i])) << i;
    ASSERT_EQ(bf[i], FloatToBf16(in[i])) << i;
    ASSERT_EQ(hf[i], FloatToF16(in[i])) << i;
    ASSERT_EQ(Bits(bf_back[i]), Bits(Bf16ToFloat(bf[i]))) << i;
    ASSERT_EQ(Bits(hf_back[i]), Bits(F16ToFloat(hf[i]))) << i;
    ASSERT_EQ(Bits(bf_round[i]), Bits(bf_back[i])) << i;
    ASSERT_EQ(Bits(hf_round[i]), Bits(hf_back[i])) << i;
  }
}

}  // namespace
}  // namespace fsdp::kernels::cpu
