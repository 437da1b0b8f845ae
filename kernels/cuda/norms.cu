// LayerNorm and RMSNorm over the last dimension, forward and backward, with the semantics and
// formulas of kernels/cpu/layernorm.cc and kernels/cpu/rmsnorm.cc. The forward pass and the
// input gradient run one block per row (rows grid-strided over the blocks), with f32 block
// reductions. The weight and bias gradients are column sums, in a second kernel: a block owns
// 32 columns, its 32 x 32 threads each sum every 32nd row of one column, and the 32 partial
// sums of a column are added in a fixed order into the gradient (+=): no atomics, and the
// result does not change from run to run.
#include <cstdint>

#include "kernels/cuda/kernels.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/reduce_utils.cuh"

namespace fsdp::kernels::cuda {
namespace {

using reduce_utils::BlockSum;
using reduce_utils::Blocks;
using reduce_utils::kMaxBlocksX;
using reduce_utils::RowThreads;

constexpr int64_t kRowThreads = 256;  // most threads of a one-block-per-row kernel
constexpr int kColTile = 32;          // columns per block of the column-sum kernels
constexpr int kRowLanes = 32;         // threads per column there (row stride)

// ---- LayerNorm -----------------------------------------------------------------------------

// As the CPU: two passes on x - x[0] (the shifted mean dm, then the squared deviations),
// biased variance, rstd = 1 / sqrt(var + eps), mean = x[0] + dm.
__global__ void LayerNormForwardKernel(float* out, float* mean, float* rstd, const float* inp,
                                       const float* weight, const float* bias, int64_t N,
                                       int64_t C, float eps) {
  for (int64_t row = blockIdx.x; row < N; row += gridDim.x) {
    const float* x = inp + row * C;
    float* y = out + row * C;
    const float shift = x[0];
    float sum = 0.0f;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) sum += x[c] - shift;
    sum = BlockSum(sum);
    const float dm = sum / static_cast<float>(C);  // mean - shift
    float sq = 0.0f;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
      const float d = (x[c] - shift) - dm;
      sq += d * d;
    }
    sq = BlockSum(sq);
    const float s = 1.0f / sqrtf(sq / static_cast<float>(C) + eps);
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
      y[c] = ((x[c] - shift) - dm) * s * weight[c] + bias[c];
    }
    if (threadIdx.x == 0) {
      mean[row] = shift + dm;
      rstd[row] = s;
    }
  }
}

// dx += s * (g - mean(g) - xhat * mean(g * xhat)), g = dy * weight, xhat = (x - mean) * s.
__global__ void LayerNormBackwardInputKernel(float* dinp, const float* dout, const float* inp,
                                             const float* weight, const float* mean,
                                             const float* rstd, int64_t N, int64_t C) {
  for (int64_t row = blockIdx.x; row < N; row += gridDim.x) {
    const float* x = inp + row * C;
    const float* dy = dout + row * C;
    float* dx = dinp + row * C;
    const float m = mean[row];
    const float s = rstd[row];
    float g_sum = 0.0f, gx_sum = 0.0f;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
      const float g = dy[c] * weight[c];
      g_sum += g;
      gx_sum += g * (x[c] - m) * s;
    }
    g_sum = BlockSum(g_sum);
    gx_sum = BlockSum(gx_sum);
    const float g_mean = g_sum / static_cast<float>(C);
    const float gx_mean = gx_sum / static_cast<float>(C);
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
      const float xhat = (x[c] - m) * s;
      dx[c] += s * (dy[c] * weight[c] - g_mean - xhat * gx_mean);
    }
  }
}

// dweight[c] += sum_r dout[r,c] * (inp[r,c] - mean[r]) * rstd[r]; dbias[c] += sum_r dout[r,c].
// Either output may be nullptr (not computed). Block (kColTile, kRowLanes).
__global__ void __launch_bounds__(kColTile* kRowLanes)
    LayerNormBackwardParamKernel(float* dweight, float* dbias, const float* dout,
                                 const float* inp, const float* mean, const float* rstd,
                                 int64_t N, int64_t C) {
  __shared__ float part_w[kRowLanes][kColTile + 1];
  __shared__ float part_b[kRowLanes][kColTile + 1];
  const int tx = static_cast<int>(threadIdx.x), ty = static_cast<int>(threadIdx.y);
  for (int64_t c0 = static_cast<int64_t>(blockIdx.x) * kColTile; c0 < C;
       c0 += static_cast<int64_t>(gridDim.x) * kColTile) {
    const int64_t c = c0 + tx;
    float acc_w = 0.0f, acc_b = 0.0f;
    if (c < C) {
      for (int64_t r = ty; r < N; r += kRowLanes) {
        const int64_t i = r * C + c;
        const float dy = dout[i];
        if (dweight != nullptr) acc_w += dy * (inp[i] - mean[r]) * rstd[r];
        acc_b += dy;
      }
    }
    part_w[ty][tx] = acc_w;
    part_b[ty][tx] = acc_b;
    __syncthreads();
    if (ty == 0 && c < C) {
      float total_w = part_w[0][tx], total_b = part_b[0][tx];
      for (int k = 1; k < kRowLanes; ++k) {
        total_w += part_w[k][tx];
        total_b += part_b[k][tx];
      }
      if (dweight != nullptr) dweight[c] += total_w;
      if (dbias != nullptr) dbias[c] += total_b;
    }
    __syncthreads();  // the partials are read before the next tile overwrites them
  }
}

// ---- RMSNorm -------------------------------------------------------------------------------

// rstd = 1 / sqrt(sum(x^2) / C + eps) in f32; y = (x * rstd) * weight.
__global__ void RmsNormForwardKernel(float* out, float* rstd, const float* inp,
                                     const float* weight, int64_t N, int64_t C, float eps) {
  for (int64_t row = blockIdx.x; row < N; row += gridDim.x) {
    const float* x = inp + row * C;
    float* y = out + row * C;
    float sq = 0.0f;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) sq += x[c] * x[c];
    sq = BlockSum(sq);
    const float s = 1.0f / sqrtf(sq / static_cast<float>(C) + eps);
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) y[c] = (x[c] * s) * weight[c];
    if (threadIdx.x == 0) rstd[row] = s;
  }
}

// dx += s * (g - xhat * mean(g * xhat)), g = dy * weight, xhat = x * s.
__global__ void RmsNormBackwardInputKernel(float* dinp, const float* dout, const float* inp,
                                           const float* weight, const float* rstd, int64_t N,
                                           int64_t C) {
  for (int64_t row = blockIdx.x; row < N; row += gridDim.x) {
    const float* x = inp + row * C;
    const float* dy = dout + row * C;
    float* dx = dinp + row * C;
    const float s = rstd[row];
    float gx_sum = 0.0f;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
      gx_sum += dy[c] * weight[c] * (x[c] * s);
    }
    gx_sum = BlockSum(gx_sum);
    const float gx_mean = gx_sum / static_cast<float>(C);
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
      dx[c] += s * (dy[c] * weight[c] - (x[c] * s) * gx_mean);
    }
  }
}

// dweight[c] += sum_r dout[r,c] * (inp[r,c] * rstd[r]). Block (kColTile, kRowLanes).
__global__ void __launch_bounds__(kColTile* kRowLanes)
    RmsNormBackwardWeightKernel(float* dweight, const float* dout, const float* inp,
                                const float* rstd, int64_t N, int64_t C) {
  __shared__ float part[kRowLanes][kColTile + 1];
  const int tx = static_cast<int>(threadIdx.x), ty = static_cast<int>(threadIdx.y);
  for (int64_t c0 = static_cast<int64_t>(blockIdx.x) * kColTile; c0 < C;
       c0 += static_cast<int64_t>(gridDim.x) * kColTile) {
    const int64_t c = c0 + tx;
    float acc = 0.0f;
    if (c < C) {
      for (int64_t r = ty; r < N; r += kRowLanes) {
        const int64_t i = r * C + c;
        acc += dout[i] * (inp[i] * rstd[r]);
      }
    }
    part[ty][tx] = acc;
    __syncthreads();
    if (ty == 0 && c < C) {
      float total = part[0][tx];
      for (int k = 1; k < kRowLanes; ++k) total += part[k][tx];
      dweight[c] += total;
    }
    __syncthreads();
  }
}

unsigned int RowBlocks(int64_t N) { return Blocks(N, 1, kMaxBlocksX); }
unsigned int ColumnBlocks(int64_t C) { return Blocks(C, kColTile, kMaxBlocksX); }

}  // namespace

// N == 0 or C == 0: nothing to normalise, nothing is launched (the CPU kernel would read x[0]
// of an empty row).
void layernorm_forward(cudaStream_t s, float* out, float* mean, float* rstd, const float* inp,
                       const float* weight, const float* bias, int64_t N, int64_t C, float eps) {
  if (N <= 0 || C <= 0) return;
  FSDP_LAUNCH(LayerNormForwardKernel, RowBlocks(N), RowThreads(C, kRowThreads), 0, s)
  (out, mean, rstd, inp, weight, bias, N, C, eps);
}

void layernorm_backward(cudaStream_t s, float* dinp, float* dweight, float* dbias,
                        const float* dout, const float* inp, const float* weight,
                        const float* mean, const float* rstd, int64_t N, int64_t C) {
  if (N <= 0 || C <= 0) return;
  if (dinp != nullptr) {
    FSDP_LAUNCH(LayerNormBackwardInputKernel, RowBlocks(N), RowThreads(C, kRowThreads), 0, s)
    (dinp, dout, inp, weight, mean, rstd, N, C);
  }
  if (dweight != nullptr || dbias != nullptr) {
    FSDP_LAUNCH(LayerNormBackwardParamKernel, ColumnBlocks(C), dim3(kColTile, kRowLanes), 0, s)
    (dweight, dbias, dout, inp, mean, rstd, N, C);
  }
}

void rmsnorm_forward(cudaStream_t s, float* out, float* rstd, const float* inp,
                     const float* weight, int64_t N, int64_t C, float eps) {
  if (N <= 0 || C <= 0) return;
  FSDP_LAUNCH(RmsNormForwardKernel, RowBlocks(N), RowThreads(C, kRowThreads), 0, s)
  (out, rstd, inp, weight, N, C, eps);
}

void rmsnorm_backward(cudaStream_t s, float* dinp, float* dweight, const float* dout,
                      const float* inp, const float* weight, const float* rstd, int64_t N,
                      int64_t C) {
  if (N <= 0 || C <= 0) return;
  if (dinp != nullptr) {
    FSDP_LAUNCH(RmsNormBackwardInputKernel, RowBlocks(N), RowThreads(C, kRowThreads), 0, s)
    (dinp, dout, inp, weight, rstd, N, C);
  }
  if (dweight != nullptr) {
    FSDP_LAUNCH(RmsNormBackwardWeightKernel, ColumnBlocks(C), dim3(kColTile, kRowLanes), 0, s)
    (dweight, dout, inp, rstd, N, C);
  }
}

}  // namespace fsdp::kernels::cuda
