// CPU compute kernels with explicit forward and backward (llm.c style): plain functions on raw
// row-major f32 pointers and sizes. They are the reference implementation that every other
// backend is tested against, op by op.
//
// Conventions:
// - Every *_backward ACCUMULATES (+=) into its gradient outputs; callers zero them first.
//   Any gradient output may be nullptr, and is then not computed (frozen weight, no input grad).
// - Kernels parallelise with OpenMP over the calling thread's OpenMP thread count, so a rank
//   thread that called omp_set_num_threads(k) (see CpuBackend) uses k threads and no more.
// - Shapes: B batch, T sequence, C channels, NH heads, V vocabulary, M/K/N matmul sizes.
#pragma once

#include <cstdint>

#include "fsdp/dtype.h"
#include "fsdp/optim_scalars.h"
#include "fsdp/wire_format.h"

namespace fsdp::kernels::cpu {

// ---- Linear layer (oneDNN) -----------------------------------------------------------------
// out[M,N] = inp[M,K] . weight[N,K]^T + bias[N]   (bias may be nullptr)
void matmul_forward(float* out, const float* inp, const float* weight, const float* bias,
                    int64_t M, int64_t K, int64_t N);
// dinp[M,K] += dout[M,N] . weight[N,K];  dweight[N,K] += dout^T . inp;  dbias[N] += sum_m dout
void matmul_backward(float* dinp, float* dweight, float* dbias, const float* dout,
                     const float* inp, const float* weight, int64_t M, int64_t K, int64_t N);
// Low-precision Linear (mixed precision compute): `weight` and `bias` hold elements of `dtype`
// (bf16 or f16 as raw 16-bit values; kF32 simply calls the f32 kernels), activations and
// gradients stay f32. The f32 operands (inp, dout) are rounded to `dtype` in thread-local
// scratch, multiplied with f32 accumulation (oneDNN bf16/f16 matmul), and the result is f32;
// the bias is read as f32 and dbias is the f32 column sum of the unrounded dout. Where oneDNN
// has no such matmul on this CPU (or FSDP_FORCE_LOWP_FALLBACK=1 is set) the same rounded
// operands are upcast and run through the f32 GEMM: the same result to f32 rounding, slower.
// Semantics otherwise as matmul_forward / matmul_backward (forward overwrites, backward +=).
// inp is f32 (rounded here), or with inp_dtype == dtype a kept copy already in that dtype, read
// as is: the same result, without a pass that widens and rounds it again. So is backward's.
void matmul_forward_lowp(float* out, const void* inp, const void* weight, const void* bias,
                         int64_t M, int64_t K, int64_t N, DType dtype,
                         DType inp_dtype = DType::kF32);
void matmul_backward_lowp(float* dinp, float* dweight, float* dbias, const float* dout,
                          const void* inp, const void* weight, int64_t M, int64_t K, int64_t N,
                          DType dtype, DType inp_dtype = DType::kF32);
// The kernel the low-precision Linear layers of `dtype` run on this CPU. A product of two bf16
// (f16) values is exact in f32, so the same rounded operands can be multiplied either by
// oneDNN's native 16-bit matmul or, widened, by the f32 GEMM (the same products, summed in
// another order): on a CPU whose 16-bit matmul is slower than its f32 one (AVX512-BF16 without
// AMX) the widened one is faster. FSDP_LOWP_GEMM in the environment (read each call) picks:
// `native`, `widened`, or `auto` (unset): once per process and dtype, the first call times
// both on a kLowpGemmProbeSize^3 Linear forward (best of 3 after a warm-up, rounding and
// widening included) and takes the widened one only when its rate times the margin still
// beats the native one (11% faster), so that ranks on one kind of machine agree (the rates
// differ by 1.6x or more where it matters).
// Without a native matmul (oneDNN has none for the type on this CPU) it is always widened.
struct LowpGemmChoice {
  DType dtype = DType::kBF16;
  bool native_available = false;  // oneDNN has a native matmul of this type here
  bool native = false;            // the choice
  double native_gflops = 0, widened_gflops = 0;  // measured (auto only)
  const char* reason = "";
};
inline constexpr int64_t kLowpGemmProbeSize = 1024;
inline constexpr double kLowpGemmWidenedMargin = 0.9;
LowpGemmChoice lowp_gemm_choice(DType dtype);
// Whether the low-precision matmuls of `dtype` run natively in oneDNN (true for kF32): the
// choice above, unless FSDP_FORCE_LOWP_FALLBACK=1 (read each call) forces the widened one.
bool matmul_lowp_native(DType dtype);
// Plain GEMM used by benchmarks and the MFU peak: c[M,N] = a[M,K] . b[K,N] (row-major, f32).
void sgemm(float* c, const float* a, const float* b, int64_t M, int64_t K, int64_t N);

// ---- LayerNorm over the last dimension (biased variance) -----------------------------------
// mean[N], rstd[N] are saved for backward.
void layernorm_forward(float* out, float* mean, float* rstd, const float* inp,
                       const float* weight, const float* bias, int64_t N, int64_t C,
                       float eps = 1e-5f);
void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout,
                        const float* inp, const float* weight, const float* mean,
                        const float* rstd, int64_t N, int64_t C);

// ---- tanh GELU: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) ----------------------------
void gelu_forward(float* out, const float* inp, int64_t n);
void gelu_backward(float* dinp, const float* inp, const float* dout, int64_t n);
// The same with inp kept in bf16 / f16 (`dtype`), widened as it is read.
void gelu_backward_lowp(float* dinp, const uint16_t* inp, const float* dout, int64_t n,
                        DType dtype);
// gelu_forward's values rounded to bf16 / f16 (`dtype`, round to nearest even) as they are
// written: bitwise gelu_forward then the cast, without the f32 tensor between them.
void gelu_forward_lowp(uint16_t* out, const float* inp, int64_t n, DType dtype);

// ---- Causal multi-head self-attention ------------------------------------------------------
// qkv[B,T,3C]: q, k, v are columns [0,C), [C,2C), [2C,3C); head h uses [hD,(h+1)D), D = C/NH.
// out[B,T,C] = concat_h softmax(q k^T / sqrt(D) + causal mask) v.
// lse[B,NH,T] receives the log-sum-exp of each row of the scaled causal scores,
// log(sum_{s<=t} exp(q_t . k_s / sqrt(D))): with out, what backward needs besides qkv. No
// T x T matrix is kept: backward recomputes the probabilities block by block from qkv and lse
// (FlashAttention-2's backward), with dot[t] = dout[t] . out[t] for the softmax's backward.
void attention_forward(float* out, float* lse, const float* qkv, int64_t B, int64_t T,
                       int64_t C, int64_t NH);
void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* out,
                        const float* lse, int64_t B, int64_t T, int64_t C, int64_t NH);

// ---- Grouped-query causal attention (Llama) ------------------------------------------------
// qkv[B,T,(NH+2*NKV)*D]: query head h is columns [h*D, (h+1)*D); key head g is columns
// [(NH+g)*D, ...) and value head g [(NH+NKV+g)*D, ...). Query head h uses kv head
// h / (NH / NKV) (NH divisible by NKV). out[B,T,NH*D]; lse[B,NH,T] as attention_forward.
// With NKV == NH and D = C / NH this is exactly attention_forward / attention_backward.
void gqa_attention_forward(float* out, float* lse, const float* qkv, int64_t B, int64_t T,
                           int64_t NH, int64_t NKV, int64_t D);
void gqa_attention_backward(float* dqkv, const float* dout, const float* qkv, const float* out,
                            const float* lse, int64_t B, int64_t T, int64_t NH, int64_t NKV,
                            int64_t D);
// As gqa_attention_backward, with qkv and out each f32 or a kept bf16 / f16 copy (raw 16-bit
// values, qkv_dtype / out_dtype): the rows a task reads are widened into per-thread scratch
// (T x D floats for k, v and each query head of a kv group), so the result is the f32 kernel's
// on the widened values, with no widened copy of the whole tensor. (The GPT's attention is
// NKV = NH, D = C / NH.)
void gqa_attention_backward_kept(float* dqkv, const float* dout, const void* qkv,
                                 DType qkv_dtype, const void* out, DType out_dtype,
                                 const float* lse, int64_t B, int64_t T, int64_t NH, int64_t NKV,
                                 int64_t D);

// ---- RMSNorm over the last dimension (Llama) -----------------------------------------------
// out = inp / sqrt(mean(inp^2) + eps) * weight, the mean over C in f32; rstd[N] is saved for
// backward.
void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight, int64_t N,
                     int64_t C, float eps = 1e-5f);
void rmsnorm_backward(float* dinp, float* dweight, const float* dout, const float* inp,
                      const float* weight, const float* rstd, int64_t N, int64_t C);

// ---- Rotary position embeddings, Hugging Face layout (MODEL_SPEC.md, Llama) ---------------
// IN PLACE on x[B,T,W]: the first NH heads of D columns of every row (row (b, t) is position
// t) become x*cos + rotate_half(x)*sin, with inv_freq[j] = theta^(-2j/D). Columns from NH*D
// to W are left alone (in a Llama qkv, NH = query heads + kv heads rotates q and k, not v).
// Backward is the transposed rotation, also in place on the gradient: dx = R^T dx (it does
// not accumulate; the rotation is linear and needs no saved input).
void rope_forward(float* x, int64_t B, int64_t T, int64_t W, int64_t NH, int64_t D,
                  float theta);
void rope_backward(float* dx, int64_t B, int64_t T, int64_t W, int64_t NH, int64_t D,
                   float theta);

// ---- SwiGLU (Llama MLP): gu[N,2F] = [gate | up], out[N,F] = silu(gate) * up ----------------
void swiglu_forward(float* out, const float* gu, int64_t N, int64_t F);
// swiglu_forward's values rounded to bf16 / f16 (`dtype`) as they are written: bitwise
// swiglu_forward then the cast.
void swiglu_forward_lowp(uint16_t* out, const float* gu, int64_t N, int64_t F, DType dtype);
// dgu[N,2F] += d out / d gu
void swiglu_backward(float* dgu, const float* dout, const float* gu, int64_t N, int64_t F);
// As swiglu_backward, with gu a kept bf16 / f16 copy (raw 16-bit values), widened a row block
// at a time on the stack: the f32 kernel's result on the widened values.
void swiglu_backward_lowp(float* dgu, const float* dout, const uint16_t* gu, int64_t N, int64_t F,
                          DType dtype);

// ---- Softmax cross-entropy over V classes --------------------------------------------------
// probs[N,V] = softmax(logits); losses[N] = -log probs[n, targets[n]].
// A target < 0 is ignored: its loss is 0 and it gets no gradient.
void softmax_crossentropy_forward(float* losses, float* probs, const float* logits,
                                  const int32_t* targets, int64_t N, int64_t V);
// dlogits[n,:] += dloss * (probs[n,:] - onehot(targets[n]))  (dloss: d mean-loss / d loss[n])
void softmax_crossentropy_backward(float* dlogits, const float* probs, const int32_t* targets,
                                   float dloss, int64_t N, int64_t V);

// ---- Embedding lookup ----------------------------------------------------------------------
// out[n,:] = table[idx[n],:]
void embedding_forward(float* out, const int32_t* idx, const float* table, int64_t N, int64_t C);
// dtable[idx[n],:] += dout[n,:]   (scatter-add; repeated indices accumulate)
void embedding_backward(float* dtable, const float* dout, const int32_t* idx, int64_t N,
                        int64_t C);

// ---- Residual add --------------------------------------------------------------------------
// out = a + b (out may alias a or b)
void residual_forward(float* out, const float* a, const float* b, int64_t n);
// da += dout; db += dout
void residual_backward(float* da, float* db, const float* dout, int64_t n);

// ---- Casts (round to nearest even, NaN/Inf kept) -------------------------------------------
void cast_f32_to_bf16(uint16_t* out, const float* in, int64_t n);
void cast_bf16_to_f32(float* out, const uint16_t* in, int64_t n);
void cast_f32_to_f16(uint16_t* out, const float* in, int64_t n);
void cast_f16_to_f32(float* out, const uint16_t* in, int64_t n);
// out = in rounded to bf16 (f16) and widened back to f32, in one pass: bitwise
// cast_bf16_to_f32(cast_f32_to_bf16(in)) (the same for f16). out may be in.
void round_f32_through_bf16(float* out, const float* in, int64_t n);
void round_f32_through_f16(float* out, const float* in, int64_t n);
// low = x rounded to bf16, and x = low widened back to f32, in one pass: bitwise
// cast_f32_to_bf16(low, x) then cast_bf16_to_f32(x, low).
void round_f32_keeping_bf16(uint16_t* low, float* x, int64_t n);

// ---- Block quantization (fsdp/wire_format.h) ----------------------------------------------
// codes[n] and scales[QuantizedLayout{n, block}.blocks()] of in[n] in `format` (int8 or fp8).
void quantize_blocks(uint8_t* codes, float* scales, const float* in, int64_t n, int64_t block,
                     WireFormat format);
// out[n] (f32, bf16 or f16 by out_dtype, rounded to nearest even) = codes decoded times their
// block's scale.
void dequantize_blocks(void* out, DType out_dtype, const uint8_t* codes, const float* scales,
                       int64_t n, int64_t block, WireFormat format);
// One fp8 e4m3 (E4M3FN) code of x, rounded to nearest even, saturating at +-448 (NaN for NaN),
// and its value.
uint8_t float_to_e4m3(float x);
float e4m3_to_float(uint8_t code);

// ---- Optimizer element-wise updates (MODEL_SPEC.md; PyTorch semantics) ---------------------
// AdamW, step >= 1:  p -= lr*wd*p; m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
//                    p -= lr * (m / (1 - b1^step)) / (sqrt(v / (1 - b2^step)) + eps)
// with the step's scalars from AdamWStepScalars (fsdp/optim_scalars.h).
void adamw_update(float* param, const float* grad, float* m, float* v, int64_t n,
                  const AdamWScalars& k);
// SGD with momentum (torch.optim.SGD): g' = g + wd*p; buf = g' on the first step, else
// buf = momentum*buf + (1-dampening)*g'; d = nesterov ? g' + momentum*buf : buf; p -= lr*d.
// momentum_buf may be nullptr when momentum == 0.
void sgd_update(float* param, const float* grad, float* momentum_buf, int64_t n, float lr,
                float momentum, float dampening, float weight_decay, bool nesterov,
                bool first_step);

// ---- Reductions used by clipping and loss scaling ------------------------------------------
double sum_squares(const float* x, int64_t n);       // sum x^2, accumulated in double
void scale_inplace(float* x, float s, int64_t n);    // x *= s
bool all_finite(const float* x, int64_t n);          // no NaN / Inf in x

// ---- MFU peak (MODEL_SPEC.md) --------------------------------------------------------------
// Times sgemm(n, n, n) `repeats` times on `threads` OpenMP threads (<= 0: the calling thread's
// current count) after one warm-up call, and returns the median GFLOP/s (2 n^3 per call).
// The calling thread's OpenMP thread count is restored afterwards.
double measure_sgemm_gflops(int64_t n, int threads, int repeats);
// The same for a GEMM with both operands in `dtype` (f32, bf16 or f16) and f32 accumulation
// and output: the peak of the mixed-precision Linear layers. 0 when oneDNN has no native
// matmul of that type on this CPU.
double measure_gemm_gflops(int64_t n, int threads, int repeats, DType dtype);

}  // namespace fsdp::kernels::cpu
