// RMSNorm over the last dimension (Llama), forward and backward: out = inp * rstd * weight with
// rstd = 1 / sqrt(mean(inp^2) + eps), the mean in f32. Rows are independent and split across
// OpenMP threads; the weight gradient is a column sum (column_sum.h), so it is race-free and
// does not depend on the thread count.
#include <cmath>

#include "fsdp/kernels_cpu.h"
#include "kernels/cpu/column_sum.h"

namespace fsdp::kernels::cpu {

void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight, int64_t N,
                     int64_t C, float eps) {
#pragma omp parallel for schedule(static) if (N * C > 16384)
  for (int64_t n = 0; n < N; ++n) {
    const float* x = inp + n * C;
    float* y = out + n * C;
    float sq = 0.0f;
#pragma omp simd reduction(+ : sq)
    for (int64_t c = 0; c < C; ++c) sq += x[c] * x[c];
    const float s = 1.0f / std::sqrt(sq / static_cast<float>(C) + eps);
    // (x * rstd) * weight, in the order of Hugging Face's LlamaRMSNorm.
#pragma omp simd
    for (int64_t c = 0; c < C; ++c) y[c] = (x[c] * s) * weight[c];
    rstd[n] = s;
  }
}

void rmsnorm_backward(float* dinp, float* dweight, const float* dout, const float* inp,
                      const float* weight, const float* rstd, int64_t N, int64_t C) {
  if (dinp != nullptr) {
#pragma omp parallel for schedule(static) if (N * C > 16384)
    for (int64_t n = 0; n < N; ++n) {
      const float* x = inp + n * C;
      const float* dy = dout + n * C;
      float* dx = dinp + n * C;
      const float s = rstd[n];
      // dx = s * (g - xhat * mean(g * xhat)), with g = dy * weight and xhat = x * s
      float gx_sum = 0.0f;
#pragma omp simd reduction(+ : gx_sum)
      for (int64_t c = 0; c < C; ++c) gx_sum += dy[c] * weight[c] * (x[c] * s);
      const float gx_mean = gx_sum / static_cast<float>(C);
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) {
        dx[c] += s * (dy[c] * weight[c] - (x[c] * s) * gx_mean);
      }
    }
  }
  if (dweight != nullptr) {
    internal::AccumulateColumnSums(dweight, N, C, [=](int64_t r, int64_t c) {
      return dout[r * C + c] * (inp[r * C + c] * rstd[r]);
    });
  }
}

}  // namespace fsdp::kernels::cpu
