// Private: the blocked causal attention behind attention_forward / attention_backward and
// their grouped-query forms, with the block size as a parameter so that tests can run many
// blocks (and partial ones) on shapes small enough for finite differences.
#pragma once

#include <cstdint>

#include "fsdp/dtype.h"

namespace fsdp::kernels::cpu::internal {

// Query rows per block of the public kernels. Smaller blocks skip more of the masked half
// (nb(nb+1)/2 of nb^2 blocks are computed, nb = T / block) and keep less scratch (block x T
// floats a thread in forward, 2 block x T + (NH / NKV) x T in backward) but make more,
// smaller GEMM calls; 64 is the fastest measured at T = 256..2048 with D = 64 (128 is no faster
// at T = 1024-2048).
constexpr int64_t kAttentionBlock = 64;

// NH query heads and NKV key/value heads of D columns, rows of qkv (NH + 2 NKV) D wide, as
// gqa_attention_forward / gqa_attention_backward (fsdp/kernels_cpu.h). The GPT's attention is
// NKV = NH, D = C / NH.
void AttentionForward(float* out, float* lse, const float* qkv, int64_t B, int64_t T,
                      int64_t NH, int64_t NKV, int64_t D, int64_t block);
// qkv and out each f32 or a kept bf16 / f16 copy (gqa_attention_backward_kept).
void AttentionBackward(float* dqkv, const float* dout, const void* qkv, DType qkv_dtype,
                       const void* out, DType out_dtype, const float* lse, int64_t B, int64_t T,
                       int64_t NH, int64_t NKV, int64_t D, int64_t block);

}  // namespace fsdp::kernels::cpu::internal
