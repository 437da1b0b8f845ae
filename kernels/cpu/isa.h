// Private: element-wise loops compiled twice on x86-64, for the build's baseline (x86-64-v3,
// AVX2) and for AVX-512 (the x86-64-v4 extensions, 16 floats a vector), with the variant chosen
// at run time from the CPU. The default build targets x86-64-v3 so that one binary runs on any
// recent x86 server. GELU's loops are compute-bound (an exp and a division an element) and run
// twice as fast in the AVX-512 variant; the bf16 casts about twice as fast while their arrays
// stay in the caches. Loops bound by memory bandwidth gain nothing and are not dispatched: an
// AVX-512 AdamW over a 10.8 M-element shard ran at 0.85x the speed of the baseline one.
//
// Only element-wise loops are dispatched: element i of the output depends on element i of the
// inputs alone, through the same operations in the same order in both variants (GCC forms the
// same FMAs; division and square root are correctly rounded), so both give bitwise the same
// results. Loops that reduce (sums, maxima) are not dispatched: a wider vector would add in a
// different order. tests/kernels/isa_test.cc compares the two variants bit for bit.
//
// A kernel writes its loop once, as an always-inline function of a range [lo, hi), and
// instantiates it with FSDP_ISA_VARIANTS; RunRanges splits [0, n) over the OpenMP threads, and
// FSDP_ISA_CALL calls the variant of this CPU.
#pragma once

#include <omp.h>

#include <cstdint>

namespace fsdp::kernels::cpu::internal {

enum class Isa { kBaseline, kAvx512 };

// The variant the element-wise kernels run: kAvx512 where the CPU has AVX-512 F, BW, CD, DQ, VL
// (and the build is for x86-64 without AVX-512 already), else kBaseline. FSDP_CPU_ISA=baseline
// in the environment, read once, keeps the baseline; `auto` or unset picks from the CPU; any
// other value is reported on stderr and ignored.
Isa ElementwiseIsa();

// Tests: run the baseline variant from now on (true), or the CPU's again (false).
void ForceBaselineIsa(bool force);

#if (defined(__x86_64__) || defined(_M_X64)) && !defined(__AVX512F__)
#define FSDP_HAVE_AVX512_VARIANT 1
// ISA flags rather than arch=x86-64-v4: GCC inlines the always-inline bodies (compiled for the
// build's -march) only into functions of the same arch. Both compilers are told to use the full
// 512-bit vectors, each in its own words.
#if defined(__clang__)
#define FSDP_AVX512_TARGET \
  __attribute__((target("avx512f,avx512bw,avx512cd,avx512dq,avx512vl"), min_vector_width(512)))
#else
#define FSDP_AVX512_TARGET \
  __attribute__((target("avx512f,avx512bw,avx512cd,avx512dq,avx512vl,prefer-vector-width=512")))
#endif
#else
#define FSDP_HAVE_AVX512_VARIANT 0
#endif

// Defines NAME##Baseline and, on x86-64, NAME##Avx512, both running BODY ARGS with BODY an
// always-inline function: FSDP_ISA_VARIANTS(GeluForwardRange, GeluForwardBody,
// (float* out, const float* inp, int64_t lo, int64_t hi), (out, inp, lo, hi)).
#define FSDP_ISA_BASELINE_(NAME, BODY, PARAMS, ARGS) \
  [[gnu::noinline]] inline void NAME##Baseline PARAMS { BODY ARGS; }
#if FSDP_HAVE_AVX512_VARIANT
#define FSDP_ISA_VARIANTS(NAME, BODY, PARAMS, ARGS) \
  FSDP_ISA_BASELINE_(NAME, BODY, PARAMS, ARGS)      \
  [[gnu::noinline]] FSDP_AVX512_TARGET inline void NAME##Avx512 PARAMS { BODY ARGS; }
#define FSDP_ISA_CALL(NAME, ARGS)                       \
  (::fsdp::kernels::cpu::internal::ElementwiseIsa() ==  \
           ::fsdp::kernels::cpu::internal::Isa::kAvx512 \
       ? NAME##Avx512 ARGS                              \
       : NAME##Baseline ARGS)
#else
#define FSDP_ISA_VARIANTS(NAME, BODY, PARAMS, ARGS) FSDP_ISA_BASELINE_(NAME, BODY, PARAMS, ARGS)
#define FSDP_ISA_CALL(NAME, ARGS) NAME##Baseline ARGS
#endif

// Runs f(lo, hi) over [0, n) in one contiguous range per OpenMP thread (each range starts on a
// multiple of 16 elements), or on the calling thread alone when n <= parallel_min.
template <typename F>
void RunRanges(int64_t n, int64_t parallel_min, F f) {
  if (n <= 0) return;
#pragma omp parallel if (n > parallel_min)
  {
    const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t per = ((n + nt - 1) / nt + 15) / 16 * 16;
    const int64_t lo = t * per, hi = lo + per < n ? lo + per : n;
    if (lo < hi) f(lo, hi);
  }
}

}  // namespace fsdp::kernels::cpu::internal
