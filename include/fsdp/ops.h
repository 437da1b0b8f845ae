// The op tables of a backend: the compute the runtime (RuntimeOps, which every backend has) and
// the bundled models (Ops, optional: Backend::model_ops) issue, on device memory, in stream
// order. Every op takes the stream it runs on and Views; semantics are those
// of the CPU reference kernels (fsdp/kernels_cpu.h), which every backend is tested against op
// by op (tests/backends/op_conformance_test.cc). Coarse on purpose (whole layers), so that a
// backend running compiled programs can implement an op as one program.
//
// Conventions: sizes come from the arguments (B, T, C, M, K, N ...), a View holds at least
// that many elements; *Backward ops ACCUMULATE (+=) into their gradient outputs, and an empty
// View as a gradient output means "not computed". Reductions (sums of squares, the mean loss,
// the global norm) write to device memory: reading them on the host is the caller's choice
// (a CopyToHost, which synchronises). A call whose views do not fit the op (a dtype it does not
// take, fewer elements than its sizes need) runs nothing and fails the backend, naming the op
// and the view: the next copy, event or wait returns that error (backends/common/checked_ops.h).

#pragma once

#include <cstdint>
#include <span>
#include <string_view>

#include "fsdp/backend.h"
#include "fsdp/collective_types.h"
#include "fsdp/optim_scalars.h"
#include "fsdp/wire_format.h"

namespace fsdp {

// The runtime's ops: all the sharding runtime issues (casts for mixed precision, gradient
// accumulation, the global norm and clipping, the optimizer update). Every backend implements
// them; a runtime-only backend implements only these and trains a framework's own model
// through the hooks.
class RuntimeOps {
 public:
  virtual ~RuntimeOps() = default;

  // out = in converted between f32 and bf16 / f16 (round to nearest even), by the views' dtypes.
  virtual void Cast(Stream s, View out, View in) = 0;
  virtual void Add(Stream s, View out, View a, View b) = 0;  // out = a + b (may alias)
  // x *= factor[0] (a f32 scalar on the device).
  virtual void ScaleBy(Stream s, View x, View factor) = 0;
  virtual void Scale(Stream s, View x, float factor) = 0;  // x *= factor

  // ---- optimizers over a flat shard (MODEL_SPEC.md; PyTorch semantics) ----------------------
  // One AdamW step with the step's scalars (AdamWStepScalars, fsdp/optim_scalars.h).
  virtual void AdamW(Stream s, View param, View grad, View m, View v, const AdamWScalars& k) = 0;
  // momentum_buf may be empty when momentum == 0.
  virtual void Sgd(Stream s, View param, View grad, View momentum_buf, float lr, float momentum,
                   float dampening, float weight_decay, bool nesterov, bool first_step) = 0;

  // ---- reductions into device scalars -------------------------------------------------------
  // out[0] (f64) += sum of x^2 over f32 x, accumulated in double.
  virtual void SumSquares(Stream s, View out, View x) = 0;
  // out (f32 pair) = the f64 in[0] as hi + lo: hi = float(in), lo = float(in - hi).
  virtual void SplitF64(Stream s, View out, View in) = 0;
  // The global gradient norm and the clip factor from the shard group's partial sums of
  // squares (partials: n f32 pairs from SplitF64, one per rank, gathered in rank order):
  // total_sq[0] (f64) = the sum over ranks, added in rank order in double;
  // factor[0] (f32) = ClipCoefficient(sqrt(total_sq) / k, max_norm) / k (1/k without
  // clipping, max_norm <= 0), where k undoes the accumulation and loss scaling.
  virtual void GlobalNormClip(Stream s, View total_sq, View factor, View partials, double k,
                              float max_norm) = 0;

  // ---- block quantization for the wire (fsdp/wire_format.h) ---------------------------------
  // Whether this backend has QuantizeBlocks / DequantizeBlocks for `format` (kDType needs
  // neither). The runtime refuses a format its backend lacks when it is created, so a backend
  // without them never has them called (they abort with a message: a program error).
  virtual bool supports_wire_format(WireFormat format) const {
    return format == WireFormat::kDType;
  }
  // codes (u8, at least x.count) and scales (f32, one per block) of x (f32) in blocks of
  // `block` elements.
  virtual void QuantizeBlocks(Stream s, View codes, View scales, View x, int64_t block,
                              WireFormat format);
  // out (f32, bf16 or f16; out.count elements) = the codes decoded times their block's scale.
  virtual void DequantizeBlocks(Stream s, View out, View codes, View scales, int64_t block,
                                WireFormat format);
};

// The layers of the bundled models (MODEL_SPEC.md) and the other ops they use, grouped as a
// backend says which it supports (Ops::supports_op), as ggml's supports_op does.
enum class ModelOp : uint8_t {
  kMatmul,               // MatmulForward / MatmulBackward
  kLayernorm,            // LayernormForward / Backward
  kGelu,                 // GeluForward / Backward
  kAttention,            // AttentionForward / Backward
  kGqaAttention,         // GqaAttentionForward / Backward
  kRmsnorm,              // RmsnormForward / Backward
  kRope,                 // RopeForward / Backward
  kSwiglu,               // SwigluForward / Backward
  kSoftmaxCrossEntropy,  // SoftmaxCrossEntropyForward / Backward
  kEmbedding,            // EmbeddingForward / Backward
  kElementwise,          // AddBackward, Scale, Reduce, Mean
};
inline constexpr int kNumModelOps = 11;
std::string_view ModelOpName(ModelOp op);  // "matmul", "layernorm", ...

// The op table of a backend that runs the bundled models: the runtime's ops and the layers.
class Ops : public RuntimeOps {
 public:
  // Whether this backend implements `op` (a backend may leave out, say, the Llama layers). The
  // bundled models check the ops they use when they are created.
  virtual bool supports_op(ModelOp op) const {
    (void)op;
    return true;
  }

  // ---- a kept copy in the compute dtype ------------------------------------------------------
  // low = x rounded to low's dtype (bf16 / f16), and x = low widened back, so that x holds the
  // values low keeps: Cast(low, x) then Cast(x, low), which a backend may fuse into one pass.
  virtual void CastKeepingRounded(Stream s, View low, View x) {
    Cast(s, low, x);
    Cast(s, x, low);
  }

  // ---- Linear: out[M,N] = inp[M,K] . weight[N,K]^T + bias[N] --------------------------------
  // weight and bias are f32, or bf16 / f16 (mixed-precision compute: inp and dout are rounded
  // to that dtype, products accumulate in f32); inp, out and every gradient are f32. bias may
  // be empty. Backward: dinp += dout . weight, dweight += dout^T . inp, dbias += sum dout.
  // inp (forward's and backward's) may also be in the weight's dtype (a kept copy, already
  // rounded), read as is.
  virtual void MatmulForward(Stream s, View out, View inp, View weight, View bias, int64_t M,
                             int64_t K, int64_t N) = 0;
  virtual void MatmulBackward(Stream s, View dinp, View dweight, View dbias, View dout,
                              View inp, View weight, int64_t M, int64_t K, int64_t N) = 0;

  // ---- LayerNorm over the last dimension (biased variance); mean[N], rstd[N] saved --------
  virtual void LayernormForward(Stream s, View out, View mean, View rstd, View inp, View weight,
                                View bias, int64_t N, int64_t C, float eps) = 0;
  virtual void LayernormBackward(Stream s, View dinp, View dweight, View dbias, View dout,
                                 View inp, View weight, View mean, View rstd, int64_t N,
                                 int64_t C) = 0;

  // ---- tanh GELU (n = inp.count) ------------------------------------------------------------
  // Forward's out may be bf16 / f16: the f32 values rounded as they are written (a kept copy
  // made without the f32 tensor).
  virtual void GeluForward(Stream s, View out, View inp) = 0;
  // Backward's inp may also be a kept bf16 / f16 copy, widened as it is read.
  virtual void GeluBackward(Stream s, View dinp, View inp, View dout) = 0;

  // ---- causal multi-head attention (qkv[B,T,3C], out[B,T,C], lse[B,NH,T] f32) --------------
  // Forward keeps no T x T matrix: lse is the log-sum-exp of each row of the scaled causal
  // scores, and backward recomputes the probabilities from qkv and lse, with out (forward's
  // output) for the softmax's backward (FlashAttention-2's contract).
  virtual void AttentionForward(Stream s, View out, View lse, View qkv, int64_t B, int64_t T,
                                int64_t C, int64_t NH) = 0;
  // Backward's qkv and out may each also be a kept bf16 / f16 copy (the forward's rounded
  // values), widened as they are read; dout, lse and dqkv are f32.
  virtual void AttentionBackward(Stream s, View dqkv, View dout, View qkv, View out, View lse,
                                 int64_t B, int64_t T, int64_t C, int64_t NH) = 0;

  // ---- Llama layers (fsdp/kernels_cpu.h: gqa_attention_*, rmsnorm_*, rope_*, swiglu_*) ------
  // Grouped-query causal attention: qkv[B,T,(NH+2*NKV)*D], out[B,T,NH*D], lse[B,NH,T];
  // backward's qkv and out as AttentionBackward's.
  virtual void GqaAttentionForward(Stream s, View out, View lse, View qkv, int64_t B,
                                   int64_t T, int64_t NH, int64_t NKV, int64_t D) = 0;
  virtual void GqaAttentionBackward(Stream s, View dqkv, View dout, View qkv, View out,
                                    View lse, int64_t B, int64_t T, int64_t NH, int64_t NKV,
                                    int64_t D) = 0;
  // RMSNorm over the last dimension; rstd[N] saved.
  virtual void RmsnormForward(Stream s, View out, View rstd, View inp, View weight, int64_t N,
                              int64_t C, float eps) = 0;
  virtual void RmsnormBackward(Stream s, View dinp, View dweight, View dout, View inp,
                               View weight, View rstd, int64_t N, int64_t C) = 0;
  // Rotary embeddings IN PLACE on the first NH heads of D columns of each row of x[B,T,W];
  // backward rotates the gradient back in place (no accumulation).
  virtual void RopeForward(Stream s, View x, int64_t B, int64_t T, int64_t W, int64_t NH,
                           int64_t D, float theta) = 0;
  virtual void RopeBackward(Stream s, View dx, int64_t B, int64_t T, int64_t W, int64_t NH,
                            int64_t D, float theta) = 0;
  // out[N,F] = silu(gu[:, :F]) * gu[:, F:] (out f32, or bf16 / f16 rounded as written, as
  // GeluForward's); backward dgu[N,2F] +=, its gu f32 or a kept bf16 / f16 copy.
  virtual void SwigluForward(Stream s, View out, View gu, int64_t N, int64_t F) = 0;
  virtual void SwigluBackward(Stream s, View dgu, View dout, View gu, int64_t N,
                              int64_t F) = 0;

  // ---- softmax cross-entropy (targets i32; < 0 ignored) ------------------------------------
  virtual void SoftmaxCrossEntropyForward(Stream s, View losses, View probs, View logits,
                                          View targets, int64_t N, int64_t V) = 0;
  virtual void SoftmaxCrossEntropyBackward(Stream s, View dlogits, View probs, View targets,
                                           float dloss, int64_t N, int64_t V) = 0;

  // ---- embedding (idx i32): out[n,:] = table[idx[n],:]; backward scatter-adds -------------
  virtual void EmbeddingForward(Stream s, View out, View idx, View table, int64_t N,
                                int64_t C) = 0;
  virtual void EmbeddingBackward(Stream s, View dtable, View dout, View idx, int64_t N,
                                 int64_t C) = 0;

  // ---- element-wise (n = out.count) ---------------------------------------------------------
  virtual void AddBackward(Stream s, View da, View db, View dout) = 0;  // da += dout; db += dout
  // out = ins[0] op ins[1] op ... in order, in f32, rounded once to out's dtype; kAvg divides
  // the sum by ins.size(). out may be one of the inputs. f32, bf16, f16. (The device data plane
  // of a backend can reduce its peers' buffers with it.)
  virtual void Reduce(Stream s, View out, std::span<const View> ins, ReduceOp op) = 0;
  // out[0] (f32) = mean of x (f32), summed in double (a device scalar).
  virtual void Mean(Stream s, View out, View x) = 0;
};

}  // namespace fsdp
