// Helpers shared by the row-wise and element-wise kernels of norms.cu, activations.cu and
// loss.cu: warp and block reductions whose order of operations depends only on the block size
// (so results are reproducible run to run), std::min's NaN behaviour on the device, and the
// launch shapes of the grid-stride loops.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>

namespace fsdp::kernels::cuda::reduce_utils {

// ---- launch shapes -------------------------------------------------------------------------

// The most blocks along x, and along y (the hardware limit), of a grid-stride launch; beyond
// that each block or thread takes several items.
inline constexpr int64_t kMaxBlocksX = 1 << 20;
inline constexpr int64_t kMaxBlocksY = 65535;

// Blocks for `items` > 0 items at `per_block` items per block, at most `cap`.
inline unsigned int Blocks(int64_t items, int64_t per_block, int64_t cap) {
  return static_cast<unsigned int>(std::min((items + per_block - 1) / per_block, cap));
}

// Threads for one block per row of `cols` > 0 columns: a multiple of 32, at least 32, at most
// `max_threads` (itself a multiple of 32, at most 1024).
inline unsigned int RowThreads(int64_t cols, int64_t max_threads) {
  return static_cast<unsigned int>(std::min((cols + 31) / 32 * 32, max_threads));
}

// ---- device helpers ------------------------------------------------------------------------

// std::min(a, b) as the CPU kernels call it: (b < a) ? b : a, so a NaN `a` is returned as is
// (fminf would return b).
__device__ __forceinline__ float MinAsStd(float a, float b) { return (b < a) ? b : a; }

// Sum / max over the 32 lanes of a warp (all lanes active), by an xor butterfly: every lane
// ends with the same value, bit for bit (each step adds the same two operands in every lane).
template <typename T>
__device__ __forceinline__ T WarpSum(T v) {
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

__device__ __forceinline__ float WarpMax(float v) {
  for (int offset = 16; offset > 0; offset /= 2) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  }
  return v;
}

// Sum / max of v over a one-dimensional block, returned to every thread. blockDim.x must be a
// multiple of 32 and at most 1024, and every thread of the block must call it (it contains
// __syncthreads). The leading barrier makes back-to-back calls safe: no thread overwrites the
// shared partials before all threads have read the previous call's. The warp partials are
// added in warp order by every thread, so all threads get the same value.
template <typename T>
__device__ __forceinline__ T BlockSum(T v) {
  __shared__ T partial[32];
  v = WarpSum(v);
  const unsigned int lane = threadIdx.x % 32u, warp = threadIdx.x / 32u;
  __syncthreads();
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  T total = partial[0];
  for (unsigned int w = 1; w < blockDim.x / 32u; ++w) total += partial[w];
  return total;
}

__device__ __forceinline__ float BlockMax(float v) {
  __shared__ float partial[32];
  v = WarpMax(v);
  const unsigned int lane = threadIdx.x % 32u, warp = threadIdx.x / 32u;
  __syncthreads();
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  float mx = partial[0];
  for (unsigned int w = 1; w < blockDim.x / 32u; ++w) mx = fmaxf(mx, partial[w]);
  return mx;
}

}  // namespace fsdp::kernels::cuda::reduce_utils
