// LayerNorm over the last dimension (biased variance), forward and backward. Rows are
// independent and split across OpenMP threads; the parameter gradients are column sums.
#include <cmath>

#include "fsdp/kernels_cpu.h"
#include "kernels/cpu/column_sum.h"

namespace fsdp::kernels::cpu {

void layernorm_forward(float* out, float* mean, float* rstd, const float* inp,
                       const float* weight, const float* bias, int64_t N, int64_t C,
                       float eps) {
#pragma omp parallel for schedule(static) if (N * C > 16384)
  for (int64_t n = 0; n < N; ++n) {
    const float* x = inp + n * C;
    float* y = out + n * C;
    // Two passes (mean, then squared deviations) rather than E[x^2]-E[x]^2, which cancels
    // catastrophically when |mean| >> std. Both work on x - x[0]: when the row sits far from
    // 0 these are small and exact, and the deviations x - mean = (x - x[0]) - dm keep all
    // their digits, which x - (rounded mean) would not.
    const float shift = x[0];
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t c = 0; c < C; ++c) sum += x[c] - shift;
    const float dm = sum / static_cast<float>(C);  // mean - shift
    float sq = 0.0f;
#pragma omp simd reduction(+ : sq)
    for (int64_t c = 0; c < C; ++c) sq += ((x[c] - shift) - dm) * ((x[c] - shift) - dm);
    const float s = 1.0f / std::sqrt(sq / static_cast<float>(C) + eps);
#pragma omp simd
    for (int64_t c = 0; c < C; ++c) y[c] = ((x[c] - shift) - dm) * s * weight[c] + bias[c];
    const float m = shift + dm;
    mean[n] = m;
    rstd[n] = s;
  }
}

void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout,
                        const float* inp, const float* weight, const float* mean,
                        const float* rstd, int64_t N, int64_t C) {
  if (dinp != nullptr) {
#pragma omp parallel for schedule(static) if (N * C > 16384)
    for (int64_t n = 0; n < N; ++n) {
      const float* x = inp + n * C;
      const float* dy = dout + n * C;
      float* dx = dinp + n * C;
      const float m = mean[n];
      const float s = rstd[n];
      // dx = s * (g - mean(g) - xhat * mean(g * xhat)), with g = dy * weight
      float g_sum = 0.0f, gx_sum = 0.0f;
#pragma omp simd reduction(+ : g_sum, gx_sum)
      for (int64_t c = 0; c < C; ++c) {
        const float g = dy[c] * weight[c];
        g_sum += g;
        gx_sum += g * (x[c] - m) * s;
      }
      const float g_mean = g_sum / static_cast<float>(C);
      const float gx_mean = gx_sum / static_cast<float>(C);
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) {
        const float xhat = (x[c] - m) * s;
        dx[c] += s * (dy[c] * weight[c] - g_mean - xhat * gx_mean);
      }
    }
  }
  if (dweight != nullptr) {
    internal::AccumulateColumnSums(dweight, N, C, [=](int64_t r, int64_t c) {
      return dout[r * C + c] * (inp[r * C + c] - mean[r]) * rstd[r];
    });
  }
  if (dbias != nullptr) {
    internal::AccumulateColumnSums(dbias, N, C,
                                   [=](int64_t r, int64_t c) { return dout[r * C + c]; });
  }
}

}  // namespace fsdp::kernels::cpu
