// Element-wise activations and rotary position embeddings, forward and backward, with the
// semantics and formulas of kernels/cpu/elementwise.cc (tanh GELU in its sigmoid form),
// kernels/cpu/swiglu.cc and kernels/cpu/rope.cc.
// - GELU: a one-dimensional grid-stride loop over the n elements.
// - SwiGLU: a two-dimensional grid, x over the F columns and y over the N rows, both
//   grid-strided (no per-element index division).
// - RoPE: one thread per (row, pair j) that computes the angle of position t and pair j once and
//   rotates that pair in each of the NH heads of the row; x over the D/2 pairs, y over the B*T
//   rows. The angle follows rope.cc in f32: inv_freq[j] = 1 / theta^(2j / D), angle =
//   float(t) * inv_freq[j]. theta^(2j/D), cos and sin are evaluated in double and rounded to
//   f32, so they are correctly rounded but for rare double-rounding cases. The host's glibc
//   powf, cosf and sinf are accurate to < 1 ulp, so inv_freq and the angles normally come out
//   bit-identical to the CPU's, and cos / sin within 1 ulp of its values; the device's own
//   powf, cosf and sinf (2-4 ulp) would move a large angle, float(t) * inv_freq, by several
//   f32 ulps.
#include <cstdint>

#include "kernels/cuda/kernels.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/reduce_utils.cuh"

namespace fsdp::kernels::cuda {
namespace {

using reduce_utils::Blocks;
using reduce_utils::kMaxBlocksX;
using reduce_utils::kMaxBlocksY;
using reduce_utils::MinAsStd;

constexpr int kThreads = 256;

// ---- GELU ----------------------------------------------------------------------------------

constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kGeluCubic = 0.044715f;

// exp(-2u), u = sqrt(2/pi) (x + 0.044715 x^3), with -2u clamped to 80 (std::min semantics):
// 0.5 (1 + tanh(u)) = 1 / (1 + exp(-2u)).
__device__ __forceinline__ float GeluExp(float x) {
  const float u = kSqrt2OverPi * (x + kGeluCubic * x * x * x);
  return expf(MinAsStd(-2.0f * u, 80.0f));
}

__global__ void GeluForwardKernel(float* out, const float* inp, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    const float x = inp[i];
    out[i] = x / (1.0f + GeluExp(x));
  }
}

__global__ void GeluBackwardKernel(float* dinp, const float* inp, const float* dout, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    const float x = inp[i];
    const float e = GeluExp(x);
    const float s = 1.0f / (1.0f + e);  // 0.5 (1 + tanh u); 1 - s = e s
    const float du = kSqrt2OverPi * (1.0f + 3.0f * kGeluCubic * x * x);
    dinp[i] += dout[i] * (s + 2.0f * x * s * (e * s) * du);
  }
}

// ---- SwiGLU --------------------------------------------------------------------------------

// exp(-g) with -g clamped to 87 (std::min semantics), as swiglu.cc.
__device__ __forceinline__ float ExpNeg(float g) { return expf(MinAsStd(-g, 87.0f)); }

__global__ void SwigluForwardKernel(float* out, const float* gu, int64_t N, int64_t F) {
  const int64_t col_stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t n = blockIdx.y; n < N; n += gridDim.y) {
    const float* gate = gu + n * 2 * F;
    const float* up = gate + F;
    float* y = out + n * F;
    for (int64_t f = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; f < F;
         f += col_stride) {
      const float g = gate[f];
      y[f] = g / (1.0f + ExpNeg(g)) * up[f];
    }
  }
}

__global__ void SwigluBackwardKernel(float* dgu, const float* dout, const float* gu, int64_t N,
                                     int64_t F) {
  const int64_t col_stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t n = blockIdx.y; n < N; n += gridDim.y) {
    const float* gate = gu + n * 2 * F;
    const float* up = gate + F;
    const float* dy = dout + n * F;
    float* dgate = dgu + n * 2 * F;
    float* dup = dgate + F;
    for (int64_t f = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; f < F;
         f += col_stride) {
      const float g = gate[f];
      const float e = ExpNeg(g);
      const float sig = 1.0f / (1.0f + e);  // 1 - sig = e * sig
      dgate[f] += dy[f] * up[f] * (sig * (1.0f + g * (e * sig)));
      dup[f] += dy[f] * (g / (1.0f + e));  // silu(g) exactly as forward computes it
    }
  }
}

// ---- RoPE ----------------------------------------------------------------------------------

// Rotates pair j of the first NH heads of every row of x[B*T, W] by +angle (sign = 1) or
// -angle (sign = -1, the transpose); row r is position r % T.
__global__ void RopeKernel(float* x, int64_t rows, int64_t T, int64_t W, int64_t NH,
                           int64_t D, float theta, float sign) {
  const int64_t half = D / 2;
  const int64_t j_stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t row = blockIdx.y; row < rows; row += gridDim.y) {
    const int64_t t = row % T;
    float* x_row = x + row * W;
    for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < half;
         j += j_stride) {
      // As rope.cc: exponent and 1 / theta^exponent in f32, angle = float(t) * inv_freq.
      const float exponent = static_cast<float>(2 * j) / static_cast<float>(D);
      const float inv_freq =
          1.0f / static_cast<float>(pow(static_cast<double>(theta), static_cast<double>(exponent)));
      const float angle = static_cast<float>(t) * inv_freq;
      double sin_d, cos_d;
      sincos(static_cast<double>(angle), &sin_d, &cos_d);
      const float c = static_cast<float>(cos_d);
      const float sn = sign * static_cast<float>(sin_d);
      for (int64_t h = 0; h < NH; ++h) {
        float* lo = x_row + h * D;
        float* hi = lo + half;
        const float a = lo[j], b = hi[j];
        lo[j] = a * c - b * sn;
        hi[j] = b * c + a * sn;
      }
    }
  }
}

void Rope(cudaStream_t s, float* x, int64_t B, int64_t T, int64_t W, int64_t NH, int64_t D,
          float theta, float sign) {
  const int64_t rows = B * T, half = D / 2;
  if (rows <= 0 || NH <= 0 || half <= 0) return;
  const dim3 grid(Blocks(half, kThreads, kMaxBlocksX), Blocks(rows, 1, kMaxBlocksY));
  FSDP_LAUNCH(RopeKernel, grid, kThreads, 0, s)(x, rows, T, W, NH, D, theta, sign);
}

}  // namespace

void gelu_forward(cudaStream_t s, float* out, const float* inp, int64_t n) {
  if (n <= 0) return;
  FSDP_LAUNCH(GeluForwardKernel, Blocks(n, kThreads, kMaxBlocksX), kThreads, 0, s)(out, inp, n);
}

void gelu_backward(cudaStream_t s, float* dinp, const float* inp, const float* dout, int64_t n) {
  if (n <= 0 || dinp == nullptr) return;
  FSDP_LAUNCH(GeluBackwardKernel, Blocks(n, kThreads, kMaxBlocksX), kThreads, 0, s)
  (dinp, inp, dout, n);
}

void swiglu_forward(cudaStream_t s, float* out, const float* gu, int64_t N, int64_t F) {
  if (N <= 0 || F <= 0) return;
  const dim3 grid(Blocks(F, kThreads, kMaxBlocksX), Blocks(N, 1, kMaxBlocksY));
  FSDP_LAUNCH(SwigluForwardKernel, grid, kThreads, 0, s)(out, gu, N, F);
}

void swiglu_backward(cudaStream_t s, float* dgu, const float* dout, const float* gu, int64_t N,
                     int64_t F) {
  if (N <= 0 || F <= 0 || dgu == nullptr) return;
  const dim3 grid(Blocks(F, kThreads, kMaxBlocksX), Blocks(N, 1, kMaxBlocksY));
  FSDP_LAUNCH(SwigluBackwardKernel, grid, kThreads, 0, s)(dgu, dout, gu, N, F);
}

void rope_forward(cudaStream_t s, float* x, int64_t B, int64_t T, int64_t W, int64_t NH,
                  int64_t D, float theta) {
  Rope(s, x, B, T, W, NH, D, theta, 1.0f);
}

void rope_backward(cudaStream_t s, float* dx, int64_t B, int64_t T, int64_t W, int64_t NH,
                   int64_t D, float theta) {
  Rope(s, dx, B, T, W, NH, D, theta, -1.0f);
}

}  // namespace fsdp::kernels::cuda
