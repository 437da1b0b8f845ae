// Element-wise kernels: tanh GELU and the residual add, forward and backward.
#include <algorithm>
#include <bit>
#include <cstdint>

#include "fsdp/kernels_cpu.h"
#include "kernels/cpu/isa.h"
#include "kernels/cpu/vec_math.h"

namespace fsdp::kernels::cpu {
namespace {

constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kGeluCubic = 0.044715f;
constexpr int64_t kParallelMin = 1 << 14;

// 0.5 (1 + tanh(u)) = 1 / (1 + exp(-2u)). The sigmoid form has no cancellation where
// tanh(u) ~ -1, so GELU keeps its relative accuracy far into the negative tail. The clamp
// keeps exp finite, so e * s below never becomes Inf * 0.
[[gnu::always_inline]] inline float GeluExp(float x) {
  const float u = kSqrt2OverPi * (x + kGeluCubic * x * x * x);
  return internal::ExpF(std::min(-2.0f * u, 80.0f));
}

[[gnu::always_inline]] inline void GeluForwardBody(float* out, const float* inp, int64_t lo,
                                                   int64_t hi) {
#pragma omp simd
  for (int64_t i = lo; i < hi; ++i) {
    const float x = inp[i];
    out[i] = x / (1.0f + GeluExp(x));
  }
}

[[gnu::always_inline]] inline void GeluBackwardBody(float* dinp, const float* inp,
                                                    const float* dout, int64_t lo, int64_t hi) {
#pragma omp simd
  for (int64_t i = lo; i < hi; ++i) {
    const float x = inp[i];
    const float e = GeluExp(x);
    const float s = 1.0f / (1.0f + e);  // 0.5 (1 + tanh u); 1 - s = e s
    const float du = kSqrt2OverPi * (1.0f + 3.0f * kGeluCubic * x * x);
    // d/dx [x s(u)] = s + x * 2 s (1 - s) * du/dx
    dinp[i] += dout[i] * (s + 2.0f * x * s * (e * s) * du);
  }
}

// GeluForwardBody's values rounded to bf16 as they are stored.
[[gnu::always_inline]] inline void GeluForwardBf16Body(uint16_t* out, const float* inp,
                                                       int64_t lo, int64_t hi) {
#pragma omp simd
  for (int64_t i = lo; i < hi; ++i) {
    const float x = inp[i];
    out[i] = internal::Bf16Bits(x / (1.0f + GeluExp(x)));
  }
}

FSDP_ISA_VARIANTS(GeluForwardBf16Range, GeluForwardBf16Body,
                  (uint16_t* out, const float* inp, int64_t lo, int64_t hi), (out, inp, lo, hi))
FSDP_ISA_VARIANTS(GeluForwardRange, GeluForwardBody,
                  (float* out, const float* inp, int64_t lo, int64_t hi), (out, inp, lo, hi))
FSDP_ISA_VARIANTS(GeluBackwardRange, GeluBackwardBody,
                  (float* dinp, const float* inp, const float* dout, int64_t lo, int64_t hi),
                  (dinp, inp, dout, lo, hi))

}  // namespace

void gelu_forward(float* out, const float* inp, int64_t n) {
  internal::RunRanges(n, kParallelMin, [=](int64_t lo, int64_t hi) {
    FSDP_ISA_CALL(GeluForwardRange, (out, inp, lo, hi));
  });
}

void gelu_backward(float* dinp, const float* inp, const float* dout, int64_t n) {
  internal::RunRanges(n, kParallelMin, [=](int64_t lo, int64_t hi) {
    FSDP_ISA_CALL(GeluBackwardRange, (dinp, inp, dout, lo, hi));
  });
}

void gelu_forward_lowp(uint16_t* out, const float* inp, int64_t n, DType dtype) {
  if (dtype == DType::kBF16) {  // rounded in the loop that computes it
    internal::RunRanges(n, kParallelMin, [=](int64_t lo, int64_t hi) {
      FSDP_ISA_CALL(GeluForwardBf16Range, (out, inp, lo, hi));
    });
    return;
  }
  internal::RunRanges(n, kParallelMin, [=](int64_t lo, int64_t hi) {
    // f16: a block computed on the stack (in L1), then rounded into out by F16C.
    constexpr int64_t kBlock = 1024;
    alignas(64) float y[kBlock];
    for (int64_t b0 = lo; b0 < hi; b0 += kBlock) {
      const int64_t len = std::min(kBlock, hi - b0);
      FSDP_ISA_CALL(GeluForwardRange, (y, inp + b0, 0, len));
      cast_f32_to_f16(out + b0, y, len);  // serial at a block's length
    }
  });
}

void gelu_backward_lowp(float* dinp, const uint16_t* inp, const float* dout, int64_t n,
                        DType dtype) {
  internal::RunRanges(n, kParallelMin, [=](int64_t lo, int64_t hi) {
    // A block widened on the stack (in L1), then the f32 kernel on it: bitwise the f32
    // kernel's result on the widened input.
    constexpr int64_t kBlock = 1024;
    alignas(64) float x[kBlock];
    for (int64_t b0 = lo; b0 < hi; b0 += kBlock) {
      const int64_t len = std::min(kBlock, hi - b0);
      if (dtype == DType::kBF16) {
#pragma omp simd
        for (int64_t j = 0; j < len; ++j) {
          x[j] = std::bit_cast<float>(static_cast<uint32_t>(inp[b0 + j]) << 16);
        }
      } else {
        cast_f16_to_f32(x, inp + b0, len);  // serial at this length
      }
      FSDP_ISA_CALL(GeluBackwardRange, (dinp + b0, x, dout + b0, 0, len));
    }
  });
}

void residual_forward(float* out, const float* a, const float* b, int64_t n) {
#pragma omp parallel for simd schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
}

void residual_backward(float* da, float* db, const float* dout, int64_t n) {
  if (da != nullptr) {
#pragma omp parallel for simd schedule(static) if (n > 65536)
    for (int64_t i = 0; i < n; ++i) da[i] += dout[i];
  }
  if (db != nullptr) {
#pragma omp parallel for simd schedule(static) if (n > 65536)
    for (int64_t i = 0; i < n; ++i) db[i] += dout[i];
  }
}

}  // namespace fsdp::kernels::cpu
