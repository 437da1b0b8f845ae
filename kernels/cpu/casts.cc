// Casts between f32 and the 16-bit types, bit-identical to the scalar converters of
// include/fsdp/dtype.h (round to nearest even; NaN stays NaN, made quiet; Inf kept).
// bf16 is integer arithmetic that GCC vectorises (with an AVX-512 variant, kernels/cpu/isa.h);
// f16 uses the F16C instructions, whose rounding and NaN handling the scalar converters
// reproduce exactly.
#include <bit>
#include <cstdint>

#if defined(__F16C__)
#include <immintrin.h>
#endif

#include "fsdp/dtype.h"
#include "fsdp/kernels_cpu.h"
#include "kernels/cpu/isa.h"
#include "kernels/cpu/vec_math.h"

namespace fsdp::kernels::cpu {
namespace {

constexpr int64_t kParallelMin = 1 << 16;  // below this, waking threads costs more than it saves

[[gnu::always_inline]] inline void F32ToBf16Body(uint16_t* out, const float* in, int64_t lo,
                                                 int64_t hi) {
#pragma omp simd
  for (int64_t i = lo; i < hi; ++i) out[i] = internal::Bf16Bits(in[i]);
}

[[gnu::always_inline]] inline void Bf16ToF32Body(float* out, const uint16_t* in, int64_t lo,
                                                 int64_t hi) {
#pragma omp simd
  for (int64_t i = lo; i < hi; ++i) {
    out[i] = std::bit_cast<float>(static_cast<uint32_t>(in[i]) << 16);
  }
}

[[gnu::always_inline]] inline void RoundThroughBf16Body(float* out, const float* in, int64_t lo,
                                                        int64_t hi) {
#pragma omp simd
  for (int64_t i = lo; i < hi; ++i) {
    out[i] = std::bit_cast<float>(static_cast<uint32_t>(internal::Bf16Bits(in[i])) << 16);
  }
}

[[gnu::always_inline]] inline void RoundKeepingBf16Body(uint16_t* low, float* x, int64_t lo,
                                                        int64_t hi) {
#pragma omp simd
  for (int64_t i = lo; i < hi; ++i) {
    const uint16_t b = internal::Bf16Bits(x[i]);
    low[i] = b;
    x[i] = std::bit_cast<float>(static_cast<uint32_t>(b) << 16);
  }
}

FSDP_ISA_VARIANTS(RoundKeepingBf16Range, RoundKeepingBf16Body,
                  (uint16_t* low, float* x, int64_t lo, int64_t hi), (low, x, lo, hi))
FSDP_ISA_VARIANTS(RoundThroughBf16Range, RoundThroughBf16Body,
                  (float* out, const float* in, int64_t lo, int64_t hi), (out, in, lo, hi))
FSDP_ISA_VARIANTS(F32ToBf16Range, F32ToBf16Body,
                  (uint16_t* out, const float* in, int64_t lo, int64_t hi), (out, in, lo, hi))
FSDP_ISA_VARIANTS(Bf16ToF32Range, Bf16ToF32Body,
                  (float* out, const uint16_t* in, int64_t lo, int64_t hi), (out, in, lo, hi))

}  // namespace

void cast_f32_to_bf16(uint16_t* out, const float* in, int64_t n) {
  internal::RunRanges(n, kParallelMin, [=](int64_t lo, int64_t hi) {
    FSDP_ISA_CALL(F32ToBf16Range, (out, in, lo, hi));
  });
}

void cast_bf16_to_f32(float* out, const uint16_t* in, int64_t n) {
  internal::RunRanges(n, kParallelMin, [=](int64_t lo, int64_t hi) {
    FSDP_ISA_CALL(Bf16ToF32Range, (out, in, lo, hi));
  });
}

void round_f32_through_bf16(float* out, const float* in, int64_t n) {
  internal::RunRanges(n, kParallelMin, [=](int64_t lo, int64_t hi) {
    FSDP_ISA_CALL(RoundThroughBf16Range, (out, in, lo, hi));
  });
}

void round_f32_keeping_bf16(uint16_t* low, float* x, int64_t n) {
  internal::RunRanges(n, kParallelMin, [=](int64_t lo, int64_t hi) {
    FSDP_ISA_CALL(RoundKeepingBf16Range, (low, x, lo, hi));
  });
}

void round_f32_through_f16(float* out, const float* in, int64_t n) {
#if defined(__F16C__)
  const int64_t vec = n / 8;
#pragma omp parallel for schedule(static) if (n > kParallelMin)
  for (int64_t j = 0; j < vec; ++j) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(in + 8 * j),
                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm256_storeu_ps(out + 8 * j, _mm256_cvtph_ps(h));
  }
  for (int64_t i = vec * 8; i < n; ++i) out[i] = F16ToFloat(FloatToF16(in[i]));
#else
#pragma omp parallel for schedule(static) if (n > kParallelMin)
  for (int64_t i = 0; i < n; ++i) out[i] = F16ToFloat(FloatToF16(in[i]));
#endif
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
