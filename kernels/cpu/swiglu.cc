// SwiGLU, the gated activation of the Llama MLP, forward and backward: gu[N,2F] holds the gate
// and up projections side by side, out = silu(gate) * up with silu(g) = g * sigmoid(g).
#include <algorithm>
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

}  // namespace

void swiglu_forward(float* out, const float* gu, int64_t N, int64_t F) {
#pragma omp parallel for schedule(static) if (N * F > kParallelMin)
  for (int64_t n = 0; n < N; ++n) {
    const float* gate = gu + n * 2 * F;
    const float* up = gate + F;
    float* y = out + n * F;
#pragma omp simd
    for (int64_t f = 0; f < F; ++f) {
      const float g = gate[f];
      y[f] = g / (1.0f + ExpNeg(g)) * up[f];
    }
  }
}

void swiglu_backward(float* dgu, const float* dout, const float* gu, int64_t N, int64_t F) {
#pragma omp parallel for schedule(static) if (N * F > kParallelMin)
  for (int64_t n = 0; n < N; ++n) {
    const float* gate = gu + n * 2 * F;
    const float* up = gate + F;
    const float* dy = dout + n * F;
    float* dgate = dgu + n * 2 * F;
    float* dup = dgate + F;
#pragma omp simd
    for (int64_t f = 0; f < F; ++f) {
      const float g = gate[f];
      const float e = ExpNeg(g);
      const float sig = 1.0f / (1.0f + e);  // 1 - sig = e * sig
      // d silu / dg = sig + g sig (1 - sig)
      dgate[f] += dy[f] * up[f] * (sig * (1.0f + g * (e * sig)));
      dup[f] += dy[f] * (g / (1.0f + e));  // silu(g) exactly as forward computes it
    }
  }
}

}  // namespace fsdp::kernels::cpu
