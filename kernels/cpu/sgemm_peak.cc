// The MFU peak of MODEL_SPEC.md: the measured oneDNN sgemm rate (and, for mixed precision,
// the bf16/f16 GEMM rate), used by the benchmarks and the training example so that MFU is
// relative to what this machine actually sustains.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <vector>

#include "fsdp/kernels_cpu.h"
#include "kernels/cpu/gemm.h"

namespace fsdp::kernels::cpu {

double measure_sgemm_gflops(int64_t n, int threads, int repeats) {
  return measure_gemm_gflops(n, threads, repeats, DType::kF32);
}

double measure_gemm_gflops(int64_t n, int threads, int repeats, DType dtype) {
  if (n <= 0 || !lowp_gemm_choice(dtype).native_available) return 0.0;
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
  // The operands in `dtype` (rounded once, outside the timing), as the Linear layers hold them.
  std::vector<uint16_t> a16(dtype == DType::kF32 ? 0 : elems), b16(a16.size());
  if (dtype == DType::kBF16) {
    cast_f32_to_bf16(a16.data(), a.data(), n * n);
    cast_f32_to_bf16(b16.data(), b.data(), n * n);
  } else if (dtype == DType::kF16) {
    cast_f32_to_f16(a16.data(), a.data(), n * n);
    cast_f32_to_f16(b16.data(), b.data(), n * n);
  }
  const bool f32 = dtype == DType::kF32;
  const internal::Operand pa{f32 ? static_cast<const void*>(a.data()) : a16.data(), n, false,
                             dtype};
  const internal::Operand pb{f32 ? static_cast<const void*>(b.data()) : b16.data(), n, false,
                             dtype};
  const auto gemm = [&] { internal::Gemm(c.data(), n, pa, pb, nullptr, n, n, n, false); };
  gemm();  // warm-up: plan creation, page faults

  std::vector<double> gflops;
  const double flops = 2.0 * static_cast<double>(n) * static_cast<double>(n) *
                       static_cast<double>(n);
  for (int r = 0; r < repeats; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    gemm();
    const std::chrono::duration<double> dt = std::chrono::steady_clock::now() - t0;
    gflops.push_back(flops / dt.count() * 1e-9);
  }
  omp_set_num_threads(saved_threads);
  std::sort(gflops.begin(), gflops.end());
  return gflops[gflops.size() / 2];
}

}  // namespace fsdp::kernels::cpu
