// Block quantization for the wire (fsdp/wire_format.h): int8 and fp8 e4m3 codes with one f32
// scale per block. Each block is independent, so blocks are spread over OpenMP threads. The
// block's max and the int8 codes run eight lanes at a time (GCC vectors, kernels/cpu/vec_math.h),
// bit for bit the scalar definitions; fp8's encoding is scalar.
#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdint>

#include "fsdp/dtype.h"
#include "fsdp/kernels_cpu.h"
#include "kernels/cpu/vec_math.h"

namespace fsdp::kernels::cpu {
namespace {

constexpr int64_t kParallelMin = 1 << 16;  // elements; below this one thread is faster
constexpr float kInt8Max = 127.0f;
constexpr float kE4m3Max = 448.0f;

// The 256 values of the E4M3FN codes: bias 7, 3 mantissa bits, subnormals, no infinity, NaN at
// S.1111.111.
const std::array<float, 256>& E4m3Table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int c = 0; c < 256; ++c) {
      const int e = (c >> 3) & 0xf, m = c & 7;
      float v = e == 0 ? std::ldexp(static_cast<float>(m), -9)
                       : std::ldexp(1.0f + static_cast<float>(m) / 8.0f, e - 7);
      if ((c & 0x7f) == 0x7f) v = std::nanf("");
      t[c] = (c & 0x80) ? -v : v;
    }
    return t;
  }();
  return table;
}

template <class Body>
void ForEachBlock(int64_t n, int64_t block, Body body) {
  const int64_t blocks = (n + block - 1) / block;
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t lo = b * block, hi = std::min(n, lo + block);
    body(b, lo, hi);
  }
}

using I8 = int32_t __attribute__((vector_size(32)));  // the lanes of internal::F8 as integers
using C8 = int8_t __attribute__((vector_size(8)));

// The largest |x| of a block; for a block that holds a NaN, the first NaN's magnitude, which
// poisons the scale (a later larger value must not hide it). Eight lanes at a time (a max is
// exact in any order) with a NaN flag and no early exit; a block with a NaN is scanned again.
float BlockMaxAbs(const float* in, int64_t lo, int64_t hi) {
  float m = 0.0f;
  int nan = 0;
  int64_t i = lo;
  if (hi - lo >= 8) {
    const I8 abs_bits = {0x7fffffff, 0x7fffffff, 0x7fffffff, 0x7fffffff,
                         0x7fffffff, 0x7fffffff, 0x7fffffff, 0x7fffffff};
    internal::F8 mx = {};
    I8 bad = {};
    for (; i + 8 <= hi; i += 8) {
      const internal::F8 a =
          reinterpret_cast<internal::F8>(reinterpret_cast<I8>(internal::LoadF8(in + i)) & abs_bits);
      bad |= a != a;
      mx = mx < a ? a : mx;
    }
    for (int j = 0; j < 8; ++j) {
      m = m < mx[j] ? mx[j] : m;
      nan |= bad[j];
    }
  }
  for (; i < hi; ++i) {
    const float a = std::fabs(in[i]);
    nan |= a != a;
    m = m < a ? a : m;
  }
  if (nan != 0) {
    for (i = lo; i < hi; ++i) {
      if (std::isnan(in[i])) return std::fabs(in[i]);
    }
  }
  return m;
}

// codes[lo, hi) = clamp(nearbyint(in / scale), -127, 127) as int8 (scale finite and > 0, so
// every quotient is finite): eight lanes at a time, the same divisions and roundings as the
// scalar tail. Adding and taking away 1.5 * 2^23 rounds to the nearest integer, ties to even,
// exactly, for |q| <= 2^22 (the quotients are at most 127 and a rounding above it).
void QuantizeInt8(uint8_t* codes, const float* in, int64_t lo, int64_t hi, float scale) {
  constexpr float kRound = 12582912.0f;
  int64_t i = lo;
  const internal::F8 s = {scale, scale, scale, scale, scale, scale, scale, scale};
  const internal::F8 top = {kInt8Max, kInt8Max, kInt8Max, kInt8Max,
                            kInt8Max, kInt8Max, kInt8Max, kInt8Max};
  for (; i + 8 <= hi; i += 8) {
    internal::F8 q = internal::LoadF8(in + i) / s;
    q = (q + kRound) - kRound;
    q = q < -top ? -top : q;
    q = q > top ? top : q;
    const C8 c = __builtin_convertvector(__builtin_convertvector(q, I8), C8);
    __builtin_memcpy(codes + i, &c, sizeof(c));
  }
  for (; i < hi; ++i) {
    const float q = std::clamp(std::nearbyint(in[i] / scale), -kInt8Max, kInt8Max);
    codes[i] = static_cast<uint8_t>(static_cast<int8_t>(q));
  }
}

}  // namespace

uint8_t float_to_e4m3(float x) {
  const uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  float a = std::fabs(x);
  if (std::isnan(a)) return 0x7f | sign;
  if (a >= kE4m3Max) return 0x7e | sign;  // saturate (E4M3FN has no infinity)
  if (a < 0.015625f) {                    // below the smallest normal, 2^-6: steps of 2^-9
    // Code m (0..8) is m * 2^-9; 8 is the smallest normal's code, so the carry is free.
    return static_cast<uint8_t>(std::nearbyint(a * 512.0f)) | sign;
  }
  int e = 0;
  const float frac = std::frexp(a, &e);  // a = frac * 2^e, frac in [0.5, 1)
  // a = (1 + q / 8) * 2^(e - 1): q rounded to nearest even; q == 8 carries into the exponent.
  const int q = static_cast<int>(std::nearbyint((frac * 2.0f - 1.0f) * 8.0f));
  const int code = ((e - 1 + 7) << 3) + q;
  return static_cast<uint8_t>(std::min(code, 0x7e)) | sign;
}

float e4m3_to_float(uint8_t code) { return E4m3Table()[code]; }

void quantize_blocks(uint8_t* codes, float* scales, const float* in, int64_t n, int64_t block,
                     WireFormat format) {
  const float max_code = format == WireFormat::kInt8 ? kInt8Max : kE4m3Max;
  ForEachBlock(n, block, [&](int64_t b, int64_t lo, int64_t hi) {
    const float amax = BlockMaxAbs(in, lo, hi);
    const float scale = amax / max_code;
    scales[b] = scale;
    if (!(scale > 0.0f) || !std::isfinite(scale)) {  // zeros, or a block the scale poisons
      std::fill(codes + lo, codes + hi, uint8_t{0});
      return;
    }
    if (format == WireFormat::kInt8) {
      QuantizeInt8(codes, in, lo, hi, scale);
    } else {
      for (int64_t i = lo; i < hi; ++i) codes[i] = float_to_e4m3(in[i] / scale);
    }
  });
}

void dequantize_blocks(void* out, DType out_dtype, const uint8_t* codes, const float* scales,
                       int64_t n, int64_t block, WireFormat format) {
  const std::array<float, 256>& e4m3 = E4m3Table();
  ForEachBlock(n, block, [&](int64_t b, int64_t lo, int64_t hi) {
    const float scale = scales[b];
    // A non-finite scale (an inf or NaN in the block) decodes to NaN: never a finite value.
    const float s = std::isfinite(scale) ? scale : std::nanf("");
    // One loop per format and dtype, without a branch inside, so that int8's vectorize.
    auto decode = [&](auto code) {
      switch (out_dtype) {
        case DType::kF32: {
          float* o = static_cast<float*>(out);
          for (int64_t i = lo; i < hi; ++i) o[i] = code(i) * s;
          break;
        }
        case DType::kBF16: {
          uint16_t* o = static_cast<uint16_t*>(out);
          for (int64_t i = lo; i < hi; ++i) o[i] = internal::Bf16Bits(code(i) * s);  // FloatToBf16
          break;
        }
        case DType::kF16: {
          uint16_t* o = static_cast<uint16_t*>(out);
          for (int64_t i = lo; i < hi; ++i) o[i] = FloatToF16(code(i) * s);
          break;
        }
        default:
          break;  // the runtime gathers parameters in f32, bf16 or f16 only
      }
    };
    if (format == WireFormat::kInt8) {
      decode([&](int64_t i) { return static_cast<float>(static_cast<int8_t>(codes[i])); });
    } else {
      decode([&](int64_t i) { return e4m3[codes[i]]; });
    }
  });
}

}  // namespace fsdp::kernels::cpu
