// Embedding lookup and its scatter-add backward.
#include <algorithm>

#include "fsdp/kernels_cpu.h"

namespace fsdp::kernels::cpu {

void embedding_forward(float* out, const int32_t* idx, const float* table, int64_t N,
                       int64_t C) {
#pragma omp parallel for schedule(static) if (N * C > 32768)
  for (int64_t n = 0; n < N; ++n) {
    const float* src = table + static_cast<int64_t>(idx[n]) * C;
    float* dst = out + n * C;
#pragma omp simd
    for (int64_t c = 0; c < C; ++c) dst[c] = src[c];
  }
}

void embedding_backward(float* dtable, const float* dout, const int32_t* idx, int64_t N,
                        int64_t C) {
  // Repeated indices make a row-parallel scatter race. Threads own column slices instead and
  // walk all positions in order: no atomics, and the sum order is the same for any thread count.
  constexpr int64_t kSlice = 64;
  const int64_t slices = (C + kSlice - 1) / kSlice;
#pragma omp parallel for schedule(static) if (N * C > 32768)
  for (int64_t s = 0; s < slices; ++s) {
    const int64_t c0 = s * kSlice;
    const int64_t width = std::min(kSlice, C - c0);
    for (int64_t n = 0; n < N; ++n) {
      float* dst = dtable + static_cast<int64_t>(idx[n]) * C + c0;
      const float* src = dout + n * C + c0;
#pragma omp simd
      for (int64_t c = 0; c < width; ++c) dst[c] += src[c];
    }
  }
}

}  // namespace fsdp::kernels::cpu
