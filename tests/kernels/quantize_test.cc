// Block quantization for the wire (fsdp/wire_format.h): fp8 e4m3 encoding against a brute-force
// nearest-value search over the format's own definition, the error bounds of int8 and fp8
// blocks, zeros, non-finite values, decoding into bf16 / f16, and the threaded path.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "fsdp/dtype.h"
#include "fsdp/kernels_cpu.h"
#include "fsdp/wire_format.h"

namespace fsdp::kernels::cpu {
namespace {

// The value of an E4M3FN code from the format's definition (OCP 8-bit floating point, E4M3):
// sign, 4 exponent bits with bias 7, 3 mantissa bits, subnormals at exponent 0, NaN at
// S.1111.111 and no infinity.
double E4m3Value(int code) {
  const int sign = code >> 7, e = (code >> 3) & 15, m = code & 7;
  if (e == 15 && m == 7) return std::numeric_limits<double>::quiet_NaN();
  const double mag = e == 0 ? m / 8.0 * std::pow(2.0, -6) : (1 + m / 8.0) * std::pow(2.0, e - 7);
  return sign ? -mag : mag;
}

// The code nearest to x, ties to the even mantissa, saturating at +-448, by trying every
// finite code.
int NearestE4m3(float x) {
  if (std::fabs(x) >= 448.0f) return std::signbit(x) ? 0xfe : 0x7e;
  int best = -1;
  double best_err = 0;
  for (int c = 0; c < 256; ++c) {
    const double v = E4m3Value(c);
    if (std::isnan(v) || std::signbit(v) != std::signbit(x)) continue;
    const double err = std::fabs(v - static_cast<double>(x));
    if (best < 0 || err < best_err || (err == best_err && (c & 1) == 0 && (best & 1) == 1)) {
      best = c;
      best_err = err;
    }
  }
  return best;
}

TEST(E4m3, DecodesEveryCodeAsTheFormatDefinesIt) {
  for (int c = 0; c < 256; ++c) {
    const double want = E4m3Value(c);
    const float got = e4m3_to_float(static_cast<uint8_t>(c));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << c;
    } else {
      EXPECT_EQ(static_cast<double>(got), want) << c;
      EXPECT_EQ(std::signbit(got), c >= 128) << c;
    }
  }
  EXPECT_EQ(e4m3_to_float(0x7e), 448.0f);
  EXPECT_EQ(e4m3_to_float(0x38), 1.0f);
  EXPECT_EQ(e4m3_to_float(0x01), std::ldexp(1.0f, -9));
}

// Every code's value, the midpoints between neighbours (the ties), the floats just either side
// of each midpoint, and random values over the whole range and beyond it.
TEST(E4m3, EncodesToTheNearestCodeTiesToEven) {
  std::vector<float> xs;
  std::vector<float> values;
  for (int c = 0; c < 0x7f; ++c) values.push_back(static_cast<float>(E4m3Value(c)));
  for (size_t i = 0; i < values.size(); ++i) {
    xs.push_back(values[i]);
    if (i + 1 < values.size()) {
      const float mid = (values[i] + values[i + 1]) / 2;  // exact in f32
      xs.push_back(mid);
      xs.push_back(std::nextafter(mid, 0.0f));
      xs.push_back(std::nextafter(mid, 1000.0f));
    }
  }
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> exponent(-14.0f, 10.0f);
  for (int i = 0; i < 20000; ++i) xs.push_back(std::exp2(exponent(rng)));
  xs.push_back(464.0f);
  xs.push_back(1e30f);
  xs.push_back(std::ldexp(1.0f, -11));  // rounds to zero
  const size_t positive = xs.size();
  for (size_t i = 0; i < positive; ++i) xs.push_back(-xs[i]);
  for (float x : xs) {
    ASSERT_EQ(static_cast<int>(float_to_e4m3(x)), NearestE4m3(x)) << x;
  }
  EXPECT_EQ(float_to_e4m3(std::numeric_limits<float>::quiet_NaN()) & 0x7f, 0x7f);
  EXPECT_EQ(float_to_e4m3(std::numeric_limits<float>::infinity()), 0x7e);  // saturates
}

// n not a multiple of the block (the last block is short), blocks of very different magnitude.
std::vector<float> Blocks(int64_t n, int64_t block, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> exponent(-20.0f, 20.0f);
  std::vector<float> x(n);
  for (int64_t lo = 0; lo < n; lo += block) {
    const float magnitude = std::exp2(exponent(rng));
    for (int64_t i = lo; i < std::min(n, lo + block); ++i) x[i] = magnitude * normal(rng);
  }
  return x;
}

struct Coded {
  std::vector<uint8_t> codes;
  std::vector<float> scales, decoded;
};

Coded RoundTrip(const std::vector<float>& x, int64_t block, WireFormat format) {
  const int64_t n = static_cast<int64_t>(x.size());
  const QuantizedLayout layout{n, block};
  Coded c{std::vector<uint8_t>(n), std::vector<float>(layout.blocks()), std::vector<float>(n)};
  quantize_blocks(c.codes.data(), c.scales.data(), x.data(), n, block, format);
  dequantize_blocks(c.decoded.data(), DType::kF32, c.codes.data(), c.scales.data(), n, block,
                    format);
  return c;
}

float BlockMax(const std::vector<float>& x, int64_t lo, int64_t hi) {
  float m = 0;
  for (int64_t i = lo; i < hi; ++i) m = std::max(m, std::fabs(x[i]));
  return m;
}

TEST(QuantizeBlocks, Int8ErrorIsAtMostHalfAScaleStep) {
  for (int64_t block : {16, 256}) {
    const std::vector<float> x = Blocks(1000, block, 1);
    const Coded c = RoundTrip(x, block, WireFormat::kInt8);
    for (int64_t b = 0; b * block < 1000; ++b) {
      const int64_t lo = b * block, hi = std::min<int64_t>(1000, lo + block);
      const float scale = BlockMax(x, lo, hi) / 127.0f;
      ASSERT_EQ(c.scales[b], scale) << "block " << b;
      bool saw_max = false;
      for (int64_t i = lo; i < hi; ++i) {
        const int code = static_cast<int8_t>(c.codes[i]);
        ASSERT_LE(std::abs(code), 127);
        saw_max |= std::abs(code) == 127;
        // Half a step, and the f32 rounding of the division and the product.
        ASSERT_LE(std::fabs(x[i] - c.decoded[i]), scale * (0.5f + 1e-5f))
            << "block " << block << " element " << i;
      }
      EXPECT_TRUE(saw_max) << "the largest element of a block takes the largest code";
    }
  }
}

// The int8 codes are clamp(nearbyint(x / scale), -127, 127) element by element, in the
// vector lanes and in a block's tail alike: ties go to the even integer (a block whose scale is
// 1 exactly holds every k + 1/2), negative values that round to zero give code 0, and a block
// that holds NaNs takes the first NaN's magnitude (its payload) for its scale.
TEST(QuantizeBlocks, Int8CodesAreTheScalarDefinitionTiesToEven) {
  constexpr int64_t kBlock = 256, kN = 300;  // a full block and a short one of 44 (5 x 8 + 4)
  std::vector<float> x(kN);
  for (int64_t i = 0; i < kN; ++i) {
    x[i] = static_cast<float>((i * 37) % 254 - 127) + 0.5f;  // -126.5 .. 126.5: ties
  }
  x[0] = 127.0f;  // the first block's scale: exactly 1
  x[256] = -127.0f;
  x[257] = -0.3f;
  x[258] = -0.5f;
  std::vector<uint8_t> codes(kN);
  std::vector<float> scales(2);
  quantize_blocks(codes.data(), scales.data(), x.data(), kN, kBlock, WireFormat::kInt8);
  for (int64_t i = 0; i < kN; ++i) {
    const float scale = scales[i / kBlock];
    ASSERT_EQ(scale, 1.0f);
    const float want = std::clamp(std::nearbyint(x[i] / scale), -127.0f, 127.0f);
    ASSERT_EQ(static_cast<int8_t>(codes[i]), static_cast<int>(want)) << "element " << i;
    const float t = x[i] - std::floor(x[i]);
    if (t == 0.5f) {
      ASSERT_EQ(static_cast<int8_t>(codes[i]) % 2, 0) << "a tie, element " << i;
    }
  }
  // NaNs: the first one's magnitude (a payload) poisons the scale, wherever the lanes see it.
  const float first = std::bit_cast<float>(0xffc12345u), later = std::bit_cast<float>(0x7fc00001u);
  for (int64_t at : {3, 17, 250}) {
    std::vector<float> y(kN, 1.0f);
    y[at] = first;
    y[at + 2] = later;
    y[at + 1] = 1e30f;
    quantize_blocks(codes.data(), scales.data(), y.data(), kN, kBlock, WireFormat::kInt8);
    EXPECT_EQ(std::bit_cast<uint32_t>(scales[0]),
              std::bit_cast<uint32_t>(std::fabs(first) / 127.0f))
        << "NaN at " << at;
    EXPECT_EQ(scales[1], 1.0f / 127.0f);
  }
}

TEST(QuantizeBlocks, Fp8ErrorIsRelative) {
  const int64_t block = 64;
  const std::vector<float> x = Blocks(999, block, 2);
  const Coded c = RoundTrip(x, block, WireFormat::kFp8E4M3);
  for (int64_t i = 0; i < 999; ++i) {
    const float scale = c.scales[i / block];
    const int64_t lo = i / block * block;
    ASSERT_EQ(scale, BlockMax(x, lo, std::min<int64_t>(999, lo + block)) / 448.0f);
    // 3 mantissa bits: half an ulp is 2^-4 of the value; below 2^-6 (scaled) the subnormals'
    // fixed step of 2^-9 gives an absolute bound instead.
    const float bound = std::max(std::fabs(x[i]) * 0.0625f, scale * std::ldexp(1.0f, -10));
    ASSERT_LE(std::fabs(x[i] - c.decoded[i]), bound * (1 + 1e-5f)) << i;
  }
}

TEST(QuantizeBlocks, ZeroBlocksDecodeToZerosAndNonFiniteBlocksToNaN) {
  for (WireFormat format : {WireFormat::kInt8, WireFormat::kFp8E4M3}) {
    std::vector<float> x(64, 0.0f);  // 4 blocks of 16: zeros, inf, NaN, ordinary
    x[20] = std::numeric_limits<float>::infinity();
    x[40] = std::numeric_limits<float>::quiet_NaN();
    for (int i = 48; i < 64; ++i) x[i] = 0.5f * (i - 55);
    const Coded c = RoundTrip(x, 16, format);
    EXPECT_EQ(c.scales[0], 0.0f);
    for (int i = 0; i < 16; ++i) EXPECT_EQ(std::bit_cast<uint32_t>(c.decoded[i]), 0u) << i;
    for (int i = 16; i < 48; ++i) EXPECT_TRUE(std::isnan(c.decoded[i])) << i;
    for (int i = 48; i < 64; ++i) {
      EXPECT_TRUE(std::isfinite(c.decoded[i]));
      const float bound =
          format == WireFormat::kInt8 ? 0.5f * 4.0f / 127.0f : std::fabs(x[i]) / 16.0f;
      EXPECT_NEAR(c.decoded[i], x[i], bound + 1e-6f) << i;
    }
  }
}

// bf16 and f16 outputs are the f32 decoding rounded once.
TEST(QuantizeBlocks, DecodesIntoBf16AndF16AsTheF32ValueRounded) {
  const int64_t n = 300, block = 32;
  const std::vector<float> x = Blocks(n, block, 3);
  for (WireFormat format : {WireFormat::kInt8, WireFormat::kFp8E4M3}) {
    const Coded c = RoundTrip(x, block, format);
    std::vector<uint16_t> bf(n), h(n);
    dequantize_blocks(bf.data(), DType::kBF16, c.codes.data(), c.scales.data(), n, block, format);
    dequantize_blocks(h.data(), DType::kF16, c.codes.data(), c.scales.data(), n, block, format);
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_EQ(bf[i], FloatToBf16(c.decoded[i])) << i;
      ASSERT_EQ(h[i], FloatToF16(c.decoded[i])) << i;
    }
  }
}

// Above the threshold where blocks spread over threads, the result is each block's on its own.
TEST(QuantizeBlocks, ThreadedPathMatchesBlockByBlock) {
  const int64_t n = (1 << 17) + 77, block = 256;
  const std::vector<float> x = Blocks(n, block, 4);
  for (WireFormat format : {WireFormat::kInt8, WireFormat::kFp8E4M3}) {
    const Coded all = RoundTrip(x, block, format);
    for (int64_t lo = 0; lo < n; lo += block) {
      const int64_t len = std::min(block, n - lo);
      const std::vector<float> one(x.begin() + lo, x.begin() + lo + len);
      const Coded c = RoundTrip(one, block, format);
      ASSERT_EQ(c.scales[0], all.scales[lo / block]) << lo;
      for (int64_t i = 0; i < len; ++i) {
        ASSERT_EQ(c.codes[i], all.codes[lo + i]) << lo + i;
        ASSERT_EQ(std::bit_cast<uint32_t>(c.decoded[i]),
                  std::bit_cast<uint32_t>(all.decoded[lo + i]));
      }
    }
  }
}

TEST(WireFormat, NamesParseBackAndBadNamesSayWhatIsAllowed) {
  for (WireFormat f : {WireFormat::kDType, WireFormat::kInt8, WireFormat::kFp8E4M3}) {
    auto parsed = ParseWireFormat(WireFormatName(f));
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    EXPECT_EQ(*parsed, f);
  }
  EXPECT_EQ(*ParseWireFormat("FP8_E4M3"), WireFormat::kFp8E4M3);
  const absl::Status bad = ParseWireFormat("int4").status();
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.message().find("int8"), std::string_view::npos) << bad;
  EXPECT_EQ((QuantizedLayout{10, 4}.bytes()), 12 + 3 * 4);
  EXPECT_EQ((QuantizedLayout{16, 16}.bytes()), 16 + 4);
}

}  // namespace
}  // namespace fsdp::kernels::cpu
