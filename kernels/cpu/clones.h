// FSDP_CPU_CLONES: the hot element-wise kernels are compiled twice in the portable x86-64
// build, for the x86-64-v3 baseline (AVX2) and for x86-64-v4 (AVX-512), and the dynamic loader
// picks one for the CPU it runs on (GCC's target_clones, an ifunc). The GEMMs need none of
// this: oneDNN picks its kernels per CPU at run time.
//
// Off (plain functions) in -DFSDP_NATIVE=ON builds, which already target the build machine,
// under the sanitizers (TSan crashes in an ifunc resolver run before it is initialised),
// with compilers other than GCC, and off x86-64 (FsdpCompileOptions.cmake decides).
#pragma once

#if defined(FSDP_CPU_CLONES_X86) && defined(__GNUC__) && !defined(__clang__)
#define FSDP_CPU_CLONES __attribute__((target_clones("default", "arch=x86-64-v4")))
#else
#define FSDP_CPU_CLONES
#endif
