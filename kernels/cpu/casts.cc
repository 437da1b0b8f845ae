// Casts between f32 and the 16-bit types, bit-identical to the scalar converters of
// include/fsdp/dtype.h (round to nearest even; NaN stays NaN, made quiet; Inf kept).
// bf16 is integer arithmetic that GCC vectorises; f16 uses the F16C instructions, whose
// rounding and NaN handling the scalar converters reproduce exactly.
#include <bit>
#include <cstdint>

#if defined(__F16C__)
#include <immintrin.h>
#endif

#include "fsdp/dtype.h"
#include "fsdp/kernels_cpu.h"

namespace fsdp::kernels::cpu {
namespace {

constexpr int64_t kParallelMin = 1 << 16;  // below this, waking threads costs more than it saves

}  // namespace

void cast_f32_to_bf16(uint16_t* out, const float* in, int64_t n) {
#pragma omp parallel for simd schedule(static) if (n > kParallelMin)
  for (int64_t i = 0; i < n; ++i) {
    // FloatToBf16 written without branches so it vectorises.
    const uint32_t u = std::bit_cast<uint32_t>(in[i]);
    const bool nan = static_cast<int32_t>(u & 0x7fffffffu) > 0x7f800000;
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    out[i] = static_cast<uint16_t>(nan ? ((u >> 16) | 0x40u) : rounded);
  }
}

void cast_bf16_to_f32(float* out, const uint16_t* in, int64_t n) {
#pragma omp parallel for simd schedule(static) if (n > kParallelMin)
  for (int64_t i = 0; i < n; ++i) out[i] = std::bit_cast<float>(static_cast<uint32_t>(in[i]) << 16);
}

void cast_f32_to_f16(uint16_t* out, const float* in, int64_t n) {
#if defined(__F16C__)
  const int64_t vec = n / 8;
#pragma omp parallel for schedule(static) if (n > kParallelMin)
  for (int64_t j = 0; j < vec; ++j) {
    const __m256 x = _mm256_loadu_ps(in + 8 * j);
    const __m128i h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 8 * j), h);
  }
  for (int64_t i = vec * 8; i < n; ++i) out[i] = FloatToF16(in[i]);
#else
#pragma omp parallel for schedule(static) if (n > kParallelMin)
  for (int64_t i = 0; i < n; ++i) out[i] = FloatToF16(in[i]);
#endif
}

void cast_f16_to_f32(float* out, const uint16_t* in, int64_t n) {
#if defined(__F16C__)
  const int64_t vec = n / 8;
#pragma omp parallel for schedule(static) if (n > kParallelMin)
  for (int64_t j = 0; j < vec; ++j) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + 8 * j));
    _mm256_storeu_ps(out + 8 * j, _mm256_cvtph_ps(h));
  }
  for (int64_t i = vec * 8; i < n; ++i) out[i] = F16ToFloat(in[i]);
#else
#pragma omp parallel for schedule(static) if (n > kParallelMin)
  for (int64_t i = 0; i < n; ++i) out[i] = F16ToFloat(in[i]);
#endif
}

}  // namespace fsdp::kernels::cpu
