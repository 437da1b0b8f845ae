// Block quantization for the wire (fsdp/wire_format.h): int8 and fp8 e4m3 codes with one f32
// scale per block. Each block is independent, so blocks are spread over OpenMP threads.
// Scalar code: these run once per unit and step on a shard (int8: one division, one rounding
// per element), well below the optimizer update of the same shard.
#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdint>

#include "fsdp/dtype.h"
#include "fsdp/kernels_cpu.h"

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

float BlockMaxAbs(const float* in, int64_t lo, int64_t hi) {
  float m = 0.0f;
  for (int64_t i = lo; i < hi; ++i) {
    const float a = std::fabs(in[i]);
    if (std::isnan(a)) return a;  // poisons the scale (a later larger value must not hide it)
    m = std::max(m, a);
  }
  return m;
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
      for (int64_t i = lo; i < hi; ++i) {
        const float q = std::clamp(std::nearbyint(in[i] / scale), -kInt8Max, kInt8Max);
        codes[i] = static_cast<uint8_t>(static_cast<int8_t>(q));
      }
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
    auto value = [&](int64_t i) {
      const float c = format == WireFormat::kInt8
                          ? static_cast<float>(static_cast<int8_t>(codes[i]))
                          : e4m3[codes[i]];
      return c * s;
    };
    switch (out_dtype) {
      case DType::kF32: {
        float* o = static_cast<float*>(out);
        for (int64_t i = lo; i < hi; ++i) o[i] = value(i);
        break;
      }
      case DType::kBF16: {
        uint16_t* o = static_cast<uint16_t*>(out);
        for (int64_t i = lo; i < hi; ++i) o[i] = FloatToBf16(value(i));
        break;
      }
      case DType::kF16: {
        uint16_t* o = static_cast<uint16_t*>(out);
        for (int64_t i = lo; i < hi; ++i) o[i] = FloatToF16(value(i));
        break;
      }
      default:
        break;  // the runtime gathers parameters in f32, bf16 or f16 only
    }
  });
}

}  // namespace fsdp::kernels::cpu
