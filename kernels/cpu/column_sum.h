// Private helper for the bias-style gradients (matmul dbias, layernorm dweight/dbias):
// dst[c] += sum_r value(r, c). Threads own disjoint column blocks and walk the rows in order,
// so the result does not depend on the thread count and rows stream through the cache once
// per block rather than once per column.
#pragma once

#include <algorithm>
#include <cstdint>

namespace fsdp::kernels::cpu::internal {

template <typename ValueFn>
void AccumulateColumnSums(float* dst, int64_t rows, int64_t cols, ValueFn value) {
  constexpr int64_t kBlock = 64;
  const int64_t blocks = (cols + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static) if (rows * cols > 32768)
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t c0 = blk * kBlock;
    const int64_t width = std::min(kBlock, cols - c0);
    float acc[kBlock] = {};
    for (int64_t r = 0; r < rows; ++r) {
#pragma omp simd
      for (int64_t j = 0; j < width; ++j) acc[j] += value(r, c0 + j);
    }
    for (int64_t j = 0; j < width; ++j) dst[c0 + j] += acc[j];
  }
}

}  // namespace fsdp::kernels::cpu::internal
