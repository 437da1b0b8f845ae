// SwiGLU, the gated activation of the Llama MLP, forward and backward: gu[N,2F] holds the gate
// and up projections side by side, out = silu(gate) * up with silu(g) = g * sigmoid(g).
#include <algorithm>
#include <bit>
#include <cstdint>

#include "fsdp/kernels_cpu.h"
#include "kernels/cpu/vec_math.h"

namespace fsdp::kernels::cpu {
namespace {

constexpr int64_t kParallelMin = 1 << 14;

// exp(-g), the sigmoid's denominator less one, with -g clamped to 87 so that it stays finite
// and the sigmoid a normal float. For g < -87, where silu(g) ~ g e^g is below 1e-35,
// g / (1 + e) is then a number rather than -Inf / Inf, and e * sigmoid ~1 rather than Inf * 0.
inline float ExpNeg(float g) { return internal::ExpF(std::min(-g, 87.0f)); }

// y[0:len] = silu(gate[0:len]) * up[0:len].
[[gnu::always_inline]] inline void SwigluForwardSpan(float* y, const float* gate, const float* up,
                                                     int64_t len) {
#pragma omp simd
  for (int64_t f = 0; f < len; ++f) {
    const float g = gate[f];
    y[f] = g / (1.0f + ExpNeg(g)) * up[f];
  }
}

// dgate[0:len] and dup[0:len] += the gradient of silu(gate) * up for dy[0:len].
[[gnu::always_inline]] inline void SwigluBackwardSpan(float* dgate, float* dup, const float* dy,
                                                      const float* gate, const float* up,
                                                      int64_t len) {
#pragma omp simd
  for (int64_t f = 0; f < len; ++f) {
    const float g = gate[f];
    const float e = ExpNeg(g);
    const float sig = 1.0f / (1.0f + e);  // 1 - sig = e * sig
    // d silu / dg = sig + g sig (1 - sig)
    dgate[f] += dy[f] * up[f] * (sig * (1.0f + g * (e * sig)));
    dup[f] += dy[f] * (g / (1.0f + e));  // silu(g) exactly as forward computes it
  }
}

}  // namespace

void swiglu_forward(float* out, const float* gu, int64_t N, int64_t F) {
#pragma omp parallel for schedule(static) if (N * F > kParallelMin)
  for (int64_t n = 0; n < N; ++n) {
    SwigluForwardSpan(out + n * F, gu + n * 2 * F, gu + n * 2 * F + F, F);
  }
}

void swiglu_forward_lowp(uint16_t* out, const float* gu, int64_t N, int64_t F, DType dtype) {
#pragma omp parallel for schedule(static) if (N * F > kParallelMin)
  for (int64_t n = 0; n < N; ++n) {
    // The row kBlock columns at a time on the stack, then rounded into out.
    constexpr int64_t kBlock = 512;
    alignas(64) float y[kBlock];
    const float* gate = gu + n * 2 * F;
    const float* up = gate + F;
    for (int64_t f0 = 0; f0 < F; f0 += kBlock) {
      const int64_t len = std::min(kBlock, F - f0);
      SwigluForwardSpan(y, gate + f0, up + f0, len);
      uint16_t* o = out + n * F + f0;
      if (dtype == DType::kBF16) {
#pragma omp simd
        for (int64_t j = 0; j < len; ++j) o[j] = internal::Bf16Bits(y[j]);
      } else {
        cast_f32_to_f16(o, y, len);  // serial at this length
      }
    }
  }
}

void swiglu_backward(float* dgu, const float* dout, const float* gu, int64_t N, int64_t F) {
#pragma omp parallel for schedule(static) if (N * F > kParallelMin)
  for (int64_t n = 0; n < N; ++n) {
    float* dgate = dgu + n * 2 * F;
    SwigluBackwardSpan(dgate, dgate + F, dout + n * F, gu + n * 2 * F, gu + n * 2 * F + F, F);
  }
}

void swiglu_backward_lowp(float* dgu, const float* dout, const uint16_t* gu, int64_t N, int64_t F,
                          DType dtype) {
#pragma omp parallel for schedule(static) if (N * F > kParallelMin)
  for (int64_t n = 0; n < N; ++n) {
    // The row's gate and up, kBlock columns at a time, widened on the stack (in L1); then the
    // f32 kernel's arithmetic on them: bitwise swiglu_backward on the widened gu.
    constexpr int64_t kBlock = 512;
    alignas(64) float gate[kBlock], up[kBlock];
    const uint16_t* row = gu + n * 2 * F;
    float* dgate = dgu + n * 2 * F;
    for (int64_t f0 = 0; f0 < F; f0 += kBlock) {
      const int64_t len = std::min(kBlock, F - f0);
      if (dtype == DType::kBF16) {
#pragma omp simd
        for (int64_t j = 0; j < len; ++j) {
          gate[j] = std::bit_cast<float>(static_cast<uint32_t>(row[f0 + j]) << 16);
          up[j] = std::bit_cast<float>(static_cast<uint32_t>(row[F + f0 + j]) << 16);
        }
      } else {
        cast_f16_to_f32(gate, row + f0, len);  // serial at this length
        cast_f16_to_f32(up, row + F + f0, len);
      }
      SwigluBackwardSpan(dgate + f0, dgate + F + f0, dout + n * F + f0, gate, up, len);
    }
  }
}

}  // namespace fsdp::kernels::cpu
