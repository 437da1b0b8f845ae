// CUDA block quantization for the wire (kernels.h; fsdp/wire_format.h), bit for bit the CPU
// kernels of kernels/cpu/quantize.cc.
// - quantize_blocks: one thread block per quantization block (blocks grid-strided). The block's
//   max |x| is reduced with NaN kept (a NaN anywhere makes the scale NaN, an inf makes it inf),
//   scale = max / 127 (int8) or / 448 (fp8), one IEEE division per element and rint (nearest
//   even), as the CPU's std::nearbyint in its default rounding mode. A zero or non-finite scale
//   gives zero codes.
// - dequantize_blocks: one thread per element (grid-stride): the code's value (int8, or e4m3
//   from its bits) times its block's scale (NaN for a non-finite scale), rounded to the output
//   dtype as dtype.h does.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kernels/cuda/elementwise_utils.cuh"
#include "kernels/cuda/kernels.h"
#include "kernels/cuda/launch.cuh"

namespace fsdp::kernels::cuda {
namespace {

using ew::FirstIndex;
using ew::GridFor;
using ew::GridStride;
using ew::kThreads;

constexpr int kQuantThreads = 256;
constexpr int64_t kMaxQuantBlocks = 65535;
constexpr int kInt8 = 1;  // WireFormat::kInt8; 2 is kFp8E4M3

__device__ __forceinline__ float QuietNaN() { return __int_as_float(0x7fc00000); }
__device__ __forceinline__ bool Finite(float x) {
  return (__float_as_uint(x) & 0x7f800000u) != 0x7f800000u;
}

// max(a, b) for |x| values, NaN if either is.
__device__ __forceinline__ float MaxKeepNaN(float a, float b) {
  if (a != a || b != b) return QuietNaN();
  return a > b ? a : b;
}

// The fp8 e4m3 (E4M3FN) code of x, nearest even, saturating at 448: float_to_e4m3 of the CPU.
__device__ __forceinline__ uint8_t E4m3Code(float x) {
  const uint8_t sign = static_cast<uint8_t>((__float_as_uint(x) >> 24) & 0x80u);
  const float a = fabsf(x);
  if (a != a) return static_cast<uint8_t>(0x7f | sign);
  if (a >= 448.0f) return static_cast<uint8_t>(0x7e | sign);
  if (a < 0.015625f) {  // subnormal codes, steps of 2^-9 (code 8 is the smallest normal)
    return static_cast<uint8_t>(static_cast<int>(rintf(__fmul_rn(a, 512.0f))) | sign);
  }
  const unsigned int u = __float_as_uint(a);
  const int e = static_cast<int>(u >> 23) - 127;                    // a >= 2^-6: normal
  const float m = __uint_as_float((u & 0x7fffffu) | 0x3f800000u);  // [1, 2), exact
  const int q = static_cast<int>(rintf(__fmul_rn(__fsub_rn(m, 1.0f), 8.0f)));
  const int code = ((e + 7) << 3) + q;  // q == 8 carries into the exponent
  return static_cast<uint8_t>((code < 0x7e ? code : 0x7e) | sign);
}

// The value of an e4m3 code: e4m3_to_float of the CPU.
__device__ __forceinline__ float E4m3Value(uint8_t c) {
  const int e = (c >> 3) & 15, m = c & 7;
  float v;
  if (e == 15 && m == 7) {
    v = QuietNaN();
  } else if (e == 0) {
    v = __fmul_rn(static_cast<float>(m), __int_as_float((127 - 9) << 23));
  } else {
    v = __fmul_rn(static_cast<float>(8 + m), __int_as_float((127 + e - 10) << 23));
  }
  return (c & 0x80) ? -v : v;
}

// Block size kQuantThreads.
__global__ void QuantizeBlocksKernel(uint8_t* codes, float* scales, const float* in, int64_t n,
                                     int64_t block, int format) {
  __shared__ float warp_max[kQuantThreads / 32];
  __shared__ float block_scale;
  const int64_t blocks = (n + block - 1) / block;
  const float max_code = format == kInt8 ? 127.0f : 448.0f;
  for (int64_t b = blockIdx.x; b < blocks; b += gridDim.x) {
    const int64_t lo = b * block, hi = lo + block < n ? lo + block : n;
    float m = 0.0f;
    for (int64_t i = lo + threadIdx.x; i < hi; i += blockDim.x) m = MaxKeepNaN(m, fabsf(in[i]));
    for (int off = 16; off > 0; off /= 2) m = MaxKeepNaN(m, __shfl_down_sync(0xffffffffu, m, off));
    __syncthreads();  // the previous block's readers of warp_max and block_scale are done
    if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = m;
    __syncthreads();
    if (threadIdx.x == 0) {
      float all = 0.0f;
      for (unsigned w = 0; w < blockDim.x / 32; ++w) all = MaxKeepNaN(all, warp_max[w]);
      const float scale = __fdiv_rn(all, max_code);
      scales[b] = scale;
      block_scale = scale;
    }
    __syncthreads();
    const float scale = block_scale;
    const bool usable = scale > 0.0f && Finite(scale);
    for (int64_t i = lo + threadIdx.x; i < hi; i += blockDim.x) {
      uint8_t c = 0;
      if (usable) {
        const float x = __fdiv_rn(in[i], scale);
        if (format == kInt8) {
          const float q = fminf(fmaxf(rintf(x), -127.0f), 127.0f);
          c = static_cast<uint8_t>(static_cast<int8_t>(q));
        } else {
          c = E4m3Code(x);
        }
      }
      codes[i] = c;
    }
  }
}

__global__ void DequantizeBlocksKernel(void* out, int out_dtype, const uint8_t* codes,
                                       const float* scales, int64_t n, int64_t block,
                                       int format) {
  for (int64_t i = FirstIndex(); i < n; i += GridStride()) {
    const float scale = scales[i / block];
    const float s = Finite(scale) ? scale : QuietNaN();
    const float c = format == kInt8 ? static_cast<float>(static_cast<int8_t>(codes[i]))
                                    : E4m3Value(codes[i]);
    const float v = __fmul_rn(c, s);
    if (out_dtype == 1) {
      static_cast<uint16_t*>(out)[i] = ew::FloatToBf16(v);
    } else if (out_dtype == 2) {
      static_cast<uint16_t*>(out)[i] = ew::FloatToF16(v);
    } else {
      static_cast<float*>(out)[i] = v;
    }
  }
}

}  // namespace

void quantize_blocks(cudaStream_t s, uint8_t* codes, float* scales, const float* in, int64_t n,
                     int64_t block, int format) {
  if (n <= 0 || block <= 0) return;
  const int64_t blocks = (n + block - 1) / block;
  const unsigned int grid = static_cast<unsigned int>(std::min(blocks, kMaxQuantBlocks));
  FSDP_LAUNCH(QuantizeBlocksKernel, grid, kQuantThreads, 0, s)
  (codes, scales, in, n, block, format);
}

void dequantize_blocks(cudaStream_t s, void* out, int out_dtype, const uint8_t* codes,
                       const float* scales, int64_t n, int64_t block, int format) {
  if (n <= 0 || block <= 0) return;
  FSDP_LAUNCH(DequantizeBlocksKernel, GridFor(n), kThreads, 0, s)
  (out, out_dtype, codes, scales, n, block, format);
}

}  // namespace fsdp::kernels::cuda
