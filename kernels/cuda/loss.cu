// Softmax cross-entropy and the embedding lookup, forward and backward, with the semantics of
// kernels/cpu/crossentropy.cc (and the row softmax of kernels/cpu/vec_math.h) and
// kernels/cpu/embedding.cc.
// - Cross-entropy forward: one block per row (rows grid-strided over the blocks). Three passes
//   over the logits: the max (block max), the sum of exp(x - max) (per-thread f32 partial sums
//   added in double across the block, as the CPU adds f32 block sums in double), then
//   probs = exp(x - max) * float(1 / sum). The loss is computed from the logits,
//   (max + log(sum)) - x[target], so that it stays finite where probs[target] underflows.
//   A target < 0 gives loss 0.
// - Cross-entropy backward: one block per row; a row whose target is < 0 is skipped (no
//   gradient), the others get dlogits += dloss * probs, then dlogits[target] -= dloss.
// - Embedding forward: a two-dimensional grid, x over the C columns and y over the N rows, both
//   grid-strided.
// - Embedding backward: no atomics, so the result is the CPU's bit for bit and the same on
//   every run. A thread owns one column of the rows whose index is y modulo the grid's height
//   (kEmbeddingPartitions), and walks every position in order, adding the positions whose index
//   is one of its rows: each element of the table adds its positions in position order, as the
//   CPU does. The indices are staged through shared memory in chunks.
#include <cstdint>

#include "kernels/cuda/kernels.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/reduce_utils.cuh"

namespace fsdp::kernels::cuda {
namespace {

using reduce_utils::BlockMax;
using reduce_utils::BlockSum;
using reduce_utils::Blocks;
using reduce_utils::kMaxBlocksX;
using reduce_utils::kMaxBlocksY;
using reduce_utils::RowThreads;

constexpr int64_t kSoftmaxThreads = 512;  // most threads per row of the cross-entropy kernels
constexpr int kThreads = 256;             // threads per block of the embedding kernels
constexpr int kEmbeddingPartitions = 64;  // the backward's grid height: rows by index modulo it
constexpr int kIndexChunk = 1024;         // indices staged in shared memory at a time

// ---- softmax cross-entropy -----------------------------------------------------------------

__global__ void CrossEntropyForwardKernel(float* losses, float* probs, const float* logits,
                                          const int32_t* targets, int64_t N, int64_t V) {
  for (int64_t row = blockIdx.x; row < N; row += gridDim.x) {
    const float* x = logits + row * V;
    float* p = probs + row * V;
    // The target and its logit are read before the barriers of the reductions, so that the
    // loss is right even when probs is logits (the last pass overwrites the row).
    int32_t t = -1;
    float x_t = 0.0f;
    if (threadIdx.x == 0) {
      t = targets[row];
      if (t >= 0 && t < V) x_t = x[t];
    }
    // fmaxf passes over NaN entries, as the CPU's RowMax does; exp then turns them into NaN.
    float mx = -INFINITY;
    for (int64_t v = threadIdx.x; v < V; v += blockDim.x) mx = fmaxf(mx, x[v]);
    mx = BlockMax(mx);
    float part = 0.0f;
    for (int64_t v = threadIdx.x; v < V; v += blockDim.x) part += expf(x[v] - mx);
    const double sum = BlockSum(static_cast<double>(part));
    const float inv = static_cast<float>(1.0 / sum);
    for (int64_t v = threadIdx.x; v < V; v += blockDim.x) p[v] = expf(x[v] - mx) * inv;
    if (threadIdx.x == 0) {
      float loss = 0.0f;
      if (t >= V) {
        loss = __int_as_float(0x7fc00000);  // invalid target (the CPU asserts): NaN
      } else if (t >= 0) {
        loss = (mx + logf(static_cast<float>(sum))) - x_t;
      }
      losses[row] = loss;
    }
  }
}

__global__ void CrossEntropyBackwardKernel(float* dlogits, const float* probs,
                                           const int32_t* targets, float dloss, int64_t N,
                                           int64_t V) {
  for (int64_t row = blockIdx.x; row < N; row += gridDim.x) {
    const int32_t t = targets[row];
    if (t < 0) continue;  // ignored position: no gradient (uniform across the block)
    float* d = dlogits + row * V;
    const float* p = probs + row * V;
    for (int64_t v = threadIdx.x; v < V; v += blockDim.x) {
      // As the CPU: d[v] += dloss * p[v] for every v, then d[t] -= dloss.
      float dv = d[v] + dloss * p[v];
      if (v == t) dv -= dloss;
      d[v] = dv;
    }
  }
}

// ---- embedding -----------------------------------------------------------------------------

__global__ void EmbeddingForwardKernel(float* out, const int32_t* idx, const float* table,
                                       int64_t N, int64_t C) {
  const int64_t col_stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t n = blockIdx.y; n < N; n += gridDim.y) {
    const float* src = table + static_cast<int64_t>(idx[n]) * C;
    float* dst = out + n * C;
    for (int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; c < C;
         c += col_stride) {
      dst[c] = src[c];
    }
  }
}

__global__ void EmbeddingBackwardKernel(float* dtable, const float* dout, const int32_t* idx,
                                        int64_t N, int64_t C) {
  __shared__ int32_t ids[kIndexChunk];
  const int32_t part = static_cast<int32_t>(blockIdx.y);
  const int32_t parts = static_cast<int32_t>(gridDim.y);
  const int64_t col_stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t c0 = static_cast<int64_t>(blockIdx.x) * blockDim.x; c0 < C; c0 += col_stride) {
    const int64_t c = c0 + threadIdx.x;
    for (int64_t n0 = 0; n0 < N; n0 += kIndexChunk) {
      const int64_t len = N - n0 < kIndexChunk ? N - n0 : kIndexChunk;
      __syncthreads();  // the previous chunk is read by every thread
      for (int64_t i = threadIdx.x; i < len; i += blockDim.x) ids[i] = idx[n0 + i];
      __syncthreads();
      if (c >= C) continue;
      for (int64_t i = 0; i < len; ++i) {
        const int32_t row = ids[i];
        if (row % parts != part) continue;
        dtable[static_cast<int64_t>(row) * C + c] += dout[(n0 + i) * C + c];
      }
    }
  }
}

}  // namespace

// V == 0: no classes, nothing is launched (the CPU kernel would read logits[0] of an empty row).
void softmax_crossentropy_forward(cudaStream_t s, float* losses, float* probs,
                                  const float* logits, const int32_t* targets, int64_t N,
                                  int64_t V) {
  if (N <= 0 || V <= 0) return;
  FSDP_LAUNCH(CrossEntropyForwardKernel, Blocks(N, 1, kMaxBlocksX), RowThreads(V, kSoftmaxThreads),
              0, s)
  (losses, probs, logits, targets, N, V);
}

void softmax_crossentropy_backward(cudaStream_t s, float* dlogits, const float* probs,
                                   const int32_t* targets, float dloss, int64_t N, int64_t V) {
  if (N <= 0 || V <= 0 || dlogits == nullptr) return;
  FSDP_LAUNCH(CrossEntropyBackwardKernel, Blocks(N, 1, kMaxBlocksX), RowThreads(V, kSoftmaxThreads),
              0, s)
  (dlogits, probs, targets, dloss, N, V);
}

void embedding_forward(cudaStream_t s, float* out, const int32_t* idx, const float* table,
                       int64_t N, int64_t C) {
  if (N <= 0 || C <= 0) return;
  const dim3 grid(Blocks(C, kThreads, kMaxBlocksX), Blocks(N, 1, kMaxBlocksY));
  FSDP_LAUNCH(EmbeddingForwardKernel, grid, kThreads, 0, s)(out, idx, table, N, C);
}

void embedding_backward(cudaStream_t s, float* dtable, const float* dout, const int32_t* idx,
                        int64_t N, int64_t C) {
  if (N <= 0 || C <= 0 || dtable == nullptr) return;
  const dim3 grid(Blocks(C, kThreads, kMaxBlocksX), kEmbeddingPartitions);
  FSDP_LAUNCH(EmbeddingBackwardKernel, grid, kThreads, 0, s)(dtable, dout, idx, N, C);
}

}  // namespace fsdp::kernels::cuda
