// kernels_bench's baseline: causal grouped-query attention that keeps the T x T probabilities
// (att[B,NH,T,T]) for backward, as the CPU kernels did before FlashAttention-2's contract
// (bench/attention_full_square.cc). qkv, out and dqkv as gqa_attention_forward /
// gqa_attention_backward (fsdp/kernels_cpu.h); `block` query rows per GEMM block.
#pragma once

#include <cstdint>

namespace fsdp::bench {

void FullSquareAttentionForward(float* out, float* att, const float* qkv, int64_t B, int64_t T,
                                int64_t NH, int64_t NKV, int64_t D, int64_t block);
void FullSquareAttentionBackward(float* dqkv, const float* dout, const float* qkv,
                                 const float* att, int64_t B, int64_t T, int64_t NH, int64_t NKV,
                                 int64_t D, int64_t block);

}  // namespace fsdp::bench
