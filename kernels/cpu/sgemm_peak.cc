// The MFU peak of MODEL_SPEC.md: the measured oneDNN sgemm rate, used by the benchmarks and
// the training example so that MFU is relative to what this machine actually sustains.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <vector>

#include "fsdp/kernels_cpu.h"

namespace fsdp::kernels::cpu {

double measure_sgemm_gflops(int64_t n, int threads, int repeats) {
  if (n <= 0) return 0.0;
  repeats = std::max(repeats, 1);
  const int saved_threads = omp_get_max_threads();
  if (threads > 0) omp_set_num_threads(threads);

  const size_t elems = static_cast<size_t>(n) * static_cast<size_t>(n);
  // Non-trivial values: all-zero inputs could let the hardware take shortcuts.
  std::vector<float> a(elems), b(elems), c(elems);
  for (size_t i = 0; i < elems; ++i) {
    a[i] = static_cast<float>(i % 7) * 0.25f - 0.75f;
    b[i] = static_cast<float>(i % 5) * 0.5f - 1.0f;
  }
  sgemm(c.data(), a.data(), b.data(), n, n, n);  // warm-up: plan creation, page faults

  std::vector<double> gflops;
  const double flops = 2.0 * static_cast<double>(n) * static_cast<double>(n) *
                       static_cast<double>(n);
  for (int r = 0; r < repeats; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    sgemm(c.data(), a.data(), b.data(), n, n, n);
    const std::chrono::duration<double> dt = std::chrono::steady_clock::now() - t0;
    gflops.push_back(flops / dt.count() * 1e-9);
  }
  omp_set_num_threads(saved_threads);
  std::sort(gflops.begin(), gflops.end());
  return gflops[gflops.size() / 2];
}

}  // namespace fsdp::kernels::cpu
