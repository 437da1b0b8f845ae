// Reductions for gradient clipping and loss scaling: squared norm, scaling, finiteness.
#include <bit>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "fsdp/kernels_cpu.h"

namespace fsdp::kernels::cpu {
namespace {

// Fixed-size blocks summed in a fixed order: the norm is the same for any thread count, so
// runs on different numbers of cores clip identically.
constexpr int64_t kBlock = 8192;

}  // namespace

double sum_squares(const float* x, int64_t n) {
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  std::vector<double> partial(static_cast<size_t>(blocks));
#pragma omp parallel for schedule(static) if (blocks > 4)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t end = b * kBlock + kBlock < n ? b * kBlock + kBlock : n;
    double acc = 0.0;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = b * kBlock; i < end; ++i) acc += static_cast<double>(x[i]) * x[i];
    partial[static_cast<size_t>(b)] = acc;
  }
  double total = 0.0;
  for (double p : partial) total += p;
  return total;
}

void scale_inplace(float* x, float s, int64_t n) {
#pragma omp parallel for simd schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) x[i] *= s;
}

bool all_finite(const float* x, int64_t n) {
  int bad = 0;
#pragma omp parallel for simd schedule(static) reduction(| : bad) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) {
    // Exponent all ones = Inf or NaN; integer test vectorises and ignores FP modes.
    bad |= (std::bit_cast<uint32_t>(x[i]) & 0x7f800000u) == 0x7f800000u;
  }
  return bad == 0;
}

}  // namespace fsdp::kernels::cpu
