// Helpers shared by the element-wise, optimizer and reduction kernels (elementwise.cu,
// optim.cu): the launch shape of grid-stride loops, the bf16 / f16 conversions of
// include/fsdp/dtype.h written for the device with the same integer operations (bit-identical,
// NaN and Inf kept), and a fixed-order block sum in double.
//
// Arithmetic that must round operation by operation goes through the __f*_rn intrinsics: nvcc
// contracts a * b + c into one FMA by default, and the intrinsics are never contracted. Note
// that the CPU build does contract: GCC's default for C++ is -ffp-contract=fast, even with
// -std=c++20, and -march=x86-64-v3 has FMA (cpu::adamw_update compiles to vfmadd / vfmsub),
// so a kernel with a product and a sum per element matches the CPU to an ulp or so, and
// bitwise only a CPU build with -ffp-contract=off; one operation per element (add, scale,
// casts, reduce) is bitwise either way. No FTZ or fast-math flag may be used for these files:
// the CPU keeps subnormals.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>

namespace fsdp::kernels::cuda::ew {

// Threads per block of the grid-stride loops, and the most blocks launched: beyond that each
// thread takes several elements.
inline constexpr int kThreads = 256;
inline constexpr int64_t kMaxBlocks = 65536;

// Blocks for n > 0 elements, one per kThreads elements up to kMaxBlocks.
inline unsigned int GridFor(int64_t n) {
  return static_cast<unsigned int>(std::min<int64_t>((n + kThreads - 1) / kThreads, kMaxBlocks));
}

// The first element of this thread and the stride of a grid-stride loop, in int64_t.
__device__ __forceinline__ int64_t FirstIndex() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ int64_t GridStride() {
  return static_cast<int64_t>(gridDim.x) * blockDim.x;
}

// ---- bf16 / f16 <-> f32, bit for bit as FloatToBf16, Bf16ToFloat, FloatToF16, F16ToFloat of
// include/fsdp/dtype.h ----------------------------------------------------------------------

__device__ __forceinline__ uint16_t FloatToBf16(float f) {
  const uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // quiet NaN
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);  // round to nearest even
}

__device__ __forceinline__ float Bf16ToFloat(uint16_t h) {
  return __uint_as_float(static_cast<uint32_t>(h) << 16);
}

__device__ __forceinline__ uint16_t FloatToF16(float f) {
  const uint32_t u = __float_as_uint(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t absu = u & 0x7fffffffu;
  if (absu >= 0x7f800000u) {  // Inf, or NaN made quiet with its top payload bits
    return static_cast<uint16_t>(
        sign | 0x7c00u | (absu > 0x7f800000u ? 0x200u | ((absu >> 13) & 0x3ffu) : 0u));
  }
  if (absu >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to >= 65520: Inf
  if (absu < 0x38800000u) {  // subnormal or zero: value * 2^24 rounded to an integer
    // 0.5 + a rounds a to a multiple of 2^-24 (the ulp of [0.5, 1)), to nearest even.
    const float r = __fadd_rn(__uint_as_float(absu), 0.5f);
    return static_cast<uint16_t>(sign | (__float_as_uint(r) - 0x3f000000u));
  }
  const uint32_t mant_odd = (absu >> 13) & 1u;
  const uint32_t v = absu + 0xc8000fffu + mant_odd;  // re-bias the exponent (-112 << 23), round
  return static_cast<uint16_t>(sign | (v >> 13));
}

__device__ __forceinline__ float F16ToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0) {  // subnormal or zero: mant * 2^-24 (exact)
    const float v = __fmul_rn(static_cast<float>(mant), 5.9604644775390625e-8f);
    return __uint_as_float(sign | __float_as_uint(v));
  }
  if (exp == 31) {  // Inf, or NaN made quiet
    return __uint_as_float(sign | 0x7f800000u | (mant != 0 ? 0x400000u : 0u) | (mant << 13));
  }
  return __uint_as_float(sign | ((exp + 112u) << 23) | (mant << 13));
}

// ---- block reduction -----------------------------------------------------------------------

// The sum of v over the block, valid in thread 0 (other threads get partial sums). blockDim.x
// must be a multiple of 32 and at most 1024, every thread of the block must call it, and a
// kernel calls it once (its shared array is not guarded for reuse). The order of the additions
// depends only on blockDim.x, so the result is reproducible.
__device__ __forceinline__ double BlockSum(double v) {
  __shared__ double warp_sums[32];
  const unsigned lane = threadIdx.x % 32u, warp = threadIdx.x / 32u;
  for (int off = 16; off > 0; off /= 2) v += __shfl_down_sync(0xffffffffu, v, off);
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < blockDim.x / 32u ? warp_sums[lane] : 0.0;
    for (int off = 16; off > 0; off /= 2) v += __shfl_down_sync(0xffffffffu, v, off);
  }
  return v;
}

}  // namespace fsdp::kernels::cuda::ew
