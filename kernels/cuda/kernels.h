// CUDA kernels of the op table (fsdp/ops.h), one launcher per CPU reference kernel
// (fsdp/kernels_cpu.h) with the same semantics, sizes and conventions:
// - every pointer is device memory; every launcher only enqueues work on `stream` and returns
//   at once (no synchronisation, no allocation); launch errors are read by the caller with
//   cudaGetLastError();
// - *_backward ACCUMULATE (+=) into their gradient outputs, and a nullptr gradient output is
//   not computed;
// - bf16 / f16 values are raw 16-bit patterns (uint16_t), converted with round to nearest even;
// - reductions accumulate in f32 unless said otherwise (sum of squares in f64), so results
//   match the CPU kernels to f32 rounding, not bitwise.
// The matmuls run through cuBLASLt (backends/cuda/gemm.h); bias_broadcast fills their
// output with the bias first.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "fsdp/optim_scalars.h"

namespace fsdp::kernels::cuda {

// ---- LayerNorm / RMSNorm over the last dimension -------------------------------------------
void layernorm_forward(cudaStream_t s, float* out, float* mean, float* rstd, const float* inp,
                       const float* weight, const float* bias, int64_t N, int64_t C, float eps);
void layernorm_backward(cudaStream_t s, float* dinp, float* dweight, float* dbias,
                        const float* dout, const float* inp, const float* weight,
                        const float* mean, const float* rstd, int64_t N, int64_t C);
void rmsnorm_forward(cudaStream_t s, float* out, float* rstd, const float* inp,
                     const float* weight, int64_t N, int64_t C, float eps);
void rmsnorm_backward(cudaStream_t s, float* dinp, float* dweight, const float* dout,
                      const float* inp, const float* weight, const float* rstd, int64_t N,
                      int64_t C);

// ---- element-wise activations ---------------------------------------------------------------
void gelu_forward(cudaStream_t s, float* out, const float* inp, int64_t n);
void gelu_backward(cudaStream_t s, float* dinp, const float* inp, const float* dout, int64_t n);
void swiglu_forward(cudaStream_t s, float* out, const float* gu, int64_t N, int64_t F);
void swiglu_backward(cudaStream_t s, float* dgu, const float* dout, const float* gu, int64_t N,
                     int64_t F);
// In place on x[B,T,W] (the first NH heads of D columns of each row), as rope_forward /
// rope_backward of the CPU kernels (inv_freq[j] = theta^(-2j/D), angles computed as there).
void rope_forward(cudaStream_t s, float* x, int64_t B, int64_t T, int64_t W, int64_t NH,
                  int64_t D, float theta);
void rope_backward(cudaStream_t s, float* dx, int64_t B, int64_t T, int64_t W, int64_t NH,
                   int64_t D, float theta);

// ---- causal attention: qkv[B,T,(NH+2*NKV)*D], out[B,T,NH*D], lse[B,NH,T] (the log-sum-exp
// of each row of the scaled causal scores; no T x T matrix is kept: backward recomputes the
// probabilities from qkv and lse, with out for the softmax's backward); query head h uses kv
// head h / (NH / NKV). Multi-head attention is NKV == NH. Head sizes up to D = 256; a shape the
// kernels do not take (D > 256, NH not a multiple of NKV) launches nothing and leaves
// cudaErrorInvalidConfiguration for the caller's cudaGetLastError(). ---------------------------
void attention_forward(cudaStream_t s, float* out, float* lse, const float* qkv, int64_t B,
                       int64_t T, int64_t NH, int64_t NKV, int64_t D);
// `workspace`: B*NH*T floats of device scratch the caller owns (the row sums
// dot[t] = dout[t] . out[t]); its contents on entry do not matter.
void attention_backward(cudaStream_t s, float* dqkv, const float* dout, const float* qkv,
                        const float* out, const float* lse, int64_t B, int64_t T, int64_t NH,
                        int64_t NKV, int64_t D, float* workspace);
// Bytes of `workspace` attention_backward needs.
inline int64_t attention_backward_workspace_bytes(int64_t B, int64_t T, int64_t NH) {
  return B * NH * T * static_cast<int64_t>(sizeof(float));
}

// ---- softmax cross-entropy (targets < 0 ignored), embedding ---------------------------------
void softmax_crossentropy_forward(cudaStream_t s, float* losses, float* probs,
                                  const float* logits, const int32_t* targets, int64_t N,
                                  int64_t V);
void softmax_crossentropy_backward(cudaStream_t s, float* dlogits, const float* probs,
                                   const int32_t* targets, float dloss, int64_t N, int64_t V);
void embedding_forward(cudaStream_t s, float* out, const int32_t* idx, const float* table,
                       int64_t N, int64_t C);
// dtable[idx[n],:] += dout[n,:], repeated indices in position order (no atomics: the CPU's
// result bit for bit, the same on every run).
void embedding_backward(cudaStream_t s, float* dtable, const float* dout, const int32_t* idx,
                        int64_t N, int64_t C);

// ---- element-wise arithmetic and casts ------------------------------------------------------
void add(cudaStream_t s, float* out, const float* a, const float* b, int64_t n);  // may alias
void add_backward(cudaStream_t s, float* da, float* db, const float* dout, int64_t n);
// dst[i] += src[i] (f32)
void accumulate(cudaStream_t s, float* dst, const float* src, int64_t n);
void cast_f32_to_bf16(cudaStream_t s, uint16_t* out, const float* in, int64_t n);
void cast_bf16_to_f32(cudaStream_t s, float* out, const uint16_t* in, int64_t n);
void cast_f32_to_f16(cudaStream_t s, uint16_t* out, const float* in, int64_t n);
void cast_f16_to_f32(cudaStream_t s, float* out, const uint16_t* in, int64_t n);
void scale(cudaStream_t s, float* x, float factor, int64_t n);
// x *= factor[0] (a device f32 scalar; nothing is written when it is 1)
void scale_by(cudaStream_t s, float* x, const float* factor, int64_t n);
// out = ins[0] op ins[1] op ... (in order, f32 arithmetic, rounded once to the dtype);
// dtype: 0 f32, 1 bf16, 2 f16 (elements are float or uint16_t); op: 0 sum, 1 avg (sum / n_in),
// 2 max. out may be one of the inputs. `ins` is a HOST array of n_in device pointers
// (n_in <= 16); the launcher passes them by value.
void reduce(cudaStream_t s, void* out, const void* const* ins, int n_in, int64_t n, int dtype,
            int op);
// dbias[N] += sum over the M rows of dout[M,N]
void bias_backward(cudaStream_t s, float* dbias, const float* dout, int64_t M, int64_t N);

// out[m,n] = bias[n] for every row m < M; bias in f32 (dtype 0), bf16 (1) or f16 (2)
// (kernels/cuda/matmul_support.cu).
void bias_broadcast(cudaStream_t s, float* out, const void* bias, int dtype, int64_t M,
                    int64_t N);

// ---- optimizers (PyTorch semantics, as the CPU kernels) -------------------------------------
void adamw_update(cudaStream_t s, float* param, const float* grad, float* m, float* v, int64_t n,
                  const AdamWScalars& k);
void sgd_update(cudaStream_t s, float* param, const float* grad, float* momentum_buf, int64_t n,
                float lr, float momentum, float dampening, float weight_decay, bool nesterov,
                bool first_step);

// ---- block quantization for the wire (fsdp/wire_format.h): kernels/cpu/quantize.cc bit for bit
// format: 1 int8, 2 fp8 e4m3 (WireFormat's values). codes[n], scales[ceil(n / block)].
void quantize_blocks(cudaStream_t s, uint8_t* codes, float* scales, const float* in, int64_t n,
                     int64_t block, int format);
// out[n] in out_dtype (0 f32, 1 bf16, 2 f16) = each code's value times its block's scale.
void dequantize_blocks(cudaStream_t s, void* out, int out_dtype, const uint8_t* codes,
                       const float* scales, int64_t n, int64_t block, int format);

// ---- reductions into device scalars ---------------------------------------------------------
// out[0] (f64) += sum of x^2, accumulated in double: each block's sum into `partials` (at
// least kSumSquaresPartials doubles of scratch), then one block adds them in a fixed order, so
// the result depends only on n and x (no atomics).
inline constexpr int64_t kSumSquaresPartials = 1024;
void sum_squares(cudaStream_t s, double* out, const float* x, int64_t n, double* partials);
// out[0] = float(in[0]); out[1] = float(in[0] - double(out[0])).
void split_f64(cudaStream_t s, float* out, const double* in);
// total_sq[0] = the sum over r < n, in rank order in double, of partials[r] when `wide`
// (f64 partials), else of double(p[2r]) + p[2r+1] (f32 pairs from split_f64);
// factor[0] = float(double(ClipCoefficient(sqrt(total_sq) / k, max_norm)) / k), with the
// ClipCoefficient of fsdp/optim_scalars.h (backends/host/host_ops.h is the CPU op).
void global_norm_clip(cudaStream_t s, double* total_sq, float* factor, const void* partials,
                      bool wide, int64_t n, double k, float max_norm);
// out[0] = float(sum of x in double / n)
void mean(cudaStream_t s, float* out, const float* x, int64_t n);

}  // namespace fsdp::kernels::cuda
