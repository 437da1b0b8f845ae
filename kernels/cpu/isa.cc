// Which variant of the element-wise loops this CPU runs (kernels/cpu/isa.h).
#include "kernels/cpu/isa.h"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace fsdp::kernels::cpu::internal {
namespace {

Isa Detect() {
#if FSDP_HAVE_AVX512_VARIANT
  const char* env = std::getenv("FSDP_CPU_ISA");
  if (env != nullptr && std::strcmp(env, "baseline") == 0) return Isa::kBaseline;
  if (env != nullptr && *env != '\0' && std::strcmp(env, "auto") != 0) {
    std::fprintf(stderr,
                 "libfsdp: FSDP_CPU_ISA=%s is ignored: use 'baseline' (the x86-64-v3 loops) or "
                 "'auto' (the CPU's best, the default)\n",
                 env);
  }
  __builtin_cpu_init();
  // Every feature the AVX-512 variant is compiled for (FSDP_AVX512_TARGET).
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512cd") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512vl")) {
    return Isa::kAvx512;
  }
#endif
  return Isa::kBaseline;
}

std::atomic<bool> force_baseline{false};

}  // namespace

Isa ElementwiseIsa() {
  static const Isa detected = Detect();
  return force_baseline.load(std::memory_order_relaxed) ? Isa::kBaseline : detected;
}

void ForceBaselineIsa(bool force) { force_baseline.store(force); }

}  // namespace fsdp::kernels::cpu::internal
