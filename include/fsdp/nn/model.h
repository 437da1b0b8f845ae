// What every bundled model (the GPT of gpt.h, the Llama of llama.h) shares: parameter specs,
// options, and the staged forward/backward API that the sharding runtime's hooks drive.
//
// Parameters are grouped into units, the sharding units of the runtime: unit 0 is the root
// (embeddings, final norm, head) and unit 1 + i is block (decoder layer) i. A unit's parameters
// are stored as one flat buffer, the concatenation of its tensors in the order of
// unit_params(u), in the model's compute dtype (ModelOptions; f32 by default). Gradients are
// always f32, in the same layout. A model never owns parameters: every stage takes views of
// the flat buffers it needs, so a sharding runtime can point them into gathered buffers (and
// gradients into its own). Every op is issued on the backend's compute stream.
//
// Activation checkpointing (ModelOptions::checkpoint_layers): a checkpointed block keeps only
// its input after ForwardBlock; its other activations live in one scratch set shared by all
// checkpointed blocks, so the caller recomputes them with ForwardBlock(i) right before
// BackwardBlock(i). Recomputation runs the same kernels in the same order: results are
// bitwise identical to a model without checkpointing.
//
// One training step with all units resident (what Forward/Backward do):
//   ForwardEmbed(root) ; ForwardBlock(i, block_i) for i = 0..L-1 ; loss = ForwardHead(root)
//   BackwardHead(root, droot) ; [ForwardBlock(i) if checkpointed ;] BackwardBlock(i, ...)
//   for i = L-1..0 ; BackwardEmbed(droot)
//
// Stage order is checked: a backward stage before its forward, or blocks out of order, is a
// FailedPrecondition error. The whole-model Forward checks token ids against [0, V) (a copy to
// the host); the staged API checks them only where they are host memory (the caller checks
// device tokens where they are host data, as ShardedModel does with CheckTokenIds).
// ForwardBlock(i) may run again between BackwardHead and BackwardBlock(i) (recomputation for
// activation checkpointing): each block's input is kept. BackwardBlock(i) of a checkpointed
// block is a FailedPrecondition error unless the shared scratch holds block i's activations,
// i.e. unless ForwardBlock(i) was the last checkpointed ForwardBlock to run.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "fsdp/backend.h"
#include "fsdp/dtype.h"
#include "fsdp/optim.h"
#include "fsdp/status.h"

namespace fsdp::nn {

struct ParamSpec {
  std::string name;            // e.g. "transformer.h.3.attn.c_attn.weight"
  std::vector<int64_t> shape;  // row-major; Linear weights are [out, in]
  int64_t numel = 0;
  int64_t offset = 0;  // element offset inside its unit's flat buffer
  int unit = 0;        // 0 = root, 1 + i = block i
  bool weight_decay = false;  // true for tensors of two or more dimensions
};

// The weight-decay ranges of a whole unit's flat buffer, one per tensor (use
// SliceDecayRanges of optim.h for a shard of it).
std::vector<DecayRange> UnitDecayRanges(const std::vector<ParamSpec>& specs, int unit);

// OK when the n host token ids are in [0, vocab_size); else InvalidArgument naming the first
// bad one as what[row, column] (T columns per row).
absl::Status CheckTokenIds(const int32_t* ids, int64_t n, int vocab_size, int T,
                           const char* what);

// Upper bounds on a configuration's sizes (GptConfig / LlamaConfig::Validate). They sit far
// above any model trained (the deepest transformers have about 100 layers and DeepNet 1000;
// the widest C = 18432 and F = 73728) and low enough that every unit's and the whole model's
// parameter count fits in int64 (L x the largest block stays below 2^60 elements), and that
// what is done per block (the memory planner's and the projection's replays, the parameter
// specs) takes well under a second at the bound.
inline constexpr int kMaxLayers = 10000;
inline constexpr int kMaxChannels = 1 << 20;   // C, and so the heads (H divides C)
inline constexpr int kMaxMlpHidden = 1 << 24;  // F (Llama)

struct ModelOptions {
  // The dtype of the parameter buffers handed to the stages, and of the Linear layers'
  // multiplications: kF32, kBF16 or kF16 (2-byte elements at the same element offsets).
  DType compute_dtype = DType::kF32;
  // Activation checkpointing: empty (none), or one flag per layer (true: checkpointed).
  std::vector<bool> checkpoint_layers = {};
};

class StagedModel {
 public:
  virtual ~StagedModel();

  const char* family() const { return family_; }  // "Gpt" or "Llama"
  int batch_size() const { return B_; }
  int seq_len() const { return T_; }
  int num_layers() const { return L_; }
  int vocab_size() const { return V_; }
  int num_units() const { return L_ + 1; }
  const std::vector<ParamSpec>& params() const { return specs_; }
  std::vector<const ParamSpec*> unit_params(int unit) const;
  int64_t unit_numel(int unit) const;
  // Bytes of the buffers the model holds for B x T: activations, gradient scratch and (bf16,
  // f16) the f32 upcasts of the parameters the f32 kernels read.
  virtual int64_t activation_bytes() const = 0;
  const ModelOptions& options() const { return options_; }
  DType compute_dtype() const { return options_.compute_dtype; }
  bool layer_checkpointed(int i) const;

  // ---- staged API (views of this backend's memory) ------------------------------------------
  // Parameter views (root, block) cover a unit's flat buffer in the compute dtype; gradient
  // views f32 buffers of the same layout. idx and targets are [B, T] i32 token ids in [0, V);
  // the model keeps the views (not a copy) until the matching backward stage.
  absl::Status ForwardEmbed(View root, View idx);
  absl::Status ForwardBlock(int layer, View block);
  // Returns the mean cross-entropy over the B*T positions (read back to the host: a host
  // synchronisation); with empty targets (logits only, as in sampling) returns 0 and reads
  // nothing.
  absl::StatusOr<float> ForwardHead(View root, View targets);
  // Backward accumulates (+=) into the gradient buffers (same flat layout as the parameters);
  // an empty gradient view skips that unit's parameter gradients. Every gradient is of
  // loss_scale * loss (d loss / d loss[n] = loss_scale / (B*T)): loss scaling for f16, whose
  // small gradients would otherwise underflow; the caller unscales. loss_scale must be > 0.
  absl::Status BackwardHead(View root, View droot, float loss_scale = 1.0f);
  absl::Status BackwardBlock(int layer, View block, View dblock);
  absl::Status BackwardEmbed(View droot);

  // ---- whole-model convenience over resident units (units[u] = unit u's flat buffer) --------
  // Backward recomputes each checkpointed block (ForwardBlock) right before its backward.
  absl::StatusOr<float> Forward(const std::vector<View>& units, View idx, View targets);
  absl::Status Backward(const std::vector<View>& units, const std::vector<View>& grads,
                        float loss_scale = 1.0f);

  // Logits of the last ForwardHead, [B, T, V] f32 on the backend. BackwardHead reuses this
  // buffer for the logits' gradient, so they are valid until then.
  virtual View logits() const = 0;

 protected:
  StagedModel(const char* family, Backend* backend, int B, int T, int L, int V,
              std::vector<ParamSpec> specs, ModelOptions options);
  // The checks every family's Create makes: backend, 1 <= T <= block_size, B >= 1, the
  // compute dtype and the checkpoint flags.
  static absl::Status CheckCreate(const char* family, Backend* backend, int B, int T,
                                  int block_size, int L, const ModelOptions& options);

  // The families' stages, called after the order and argument checks. RunForwardHead leaves
  // the mean loss in loss_view() when targets are given.
  virtual void RunForwardEmbed(View root, View idx) = 0;
  virtual void RunForwardBlock(int layer, View block) = 0;
  virtual void RunForwardHead(View root, View targets) = 0;
  virtual absl::Status RunBackwardHead(View root, View droot, View targets,
                                       float loss_scale) = 0;
  virtual absl::Status RunBackwardBlock(int layer, View block, View dblock) = 0;
  virtual void RunBackwardEmbed(View droot, View idx) = 0;
  virtual View loss_view() const = 0;

  absl::Status Zero(View v) const { return backend_->Memset(v, 0); }
  // f32 values of parameters for the kernels that read f32: `p` itself in f32, else its
  // upcast into params32_ (the family's scratch, set at Create for bf16/f16) at `slot`.
  View ParamF32(View p, int64_t slot) const;
  // Activations kept in the compute dtype (bf16 / f16; nothing to do in f32, where v32 is the
  // kept buffer itself): `kept` takes v32 rounded; with `reread`, v32 then holds the rounded
  // values too, so that the forward reads what the backward will.
  void KeepRounded(const Buffer& kept, View v32, bool reread) const;
  // The first n elements of a kept tensor as kept (f32, or the compute dtype), for the ops
  // that read either (fsdp/ops.h: the backward of a Linear, GELU, SwiGLU and attention).
  View Kept(const Buffer& kept, int64_t n) const;

  Backend* backend_;
  const int B_, T_;
  View params32_;

 private:
  absl::Status CheckTokens(View tokens, const char* what) const;
  absl::Status CheckHostTokens(View tokens, const char* stage, const char* what) const;
  absl::Status NullArgument(const char* stage, const char* what) const;

  const char* family_;
  const int L_, V_;
  std::vector<ParamSpec> specs_;
  ModelOptions options_;
  View idx_;      // inputs of the last ForwardEmbed
  View targets_;  // targets of the last ForwardHead
  // Progress of the current step, for the stage-order checks.
  int forward_blocks_done_ = -1;  // -1: no ForwardEmbed yet; i: blocks 0..i-1 done
  bool head_done_ = false;        // a ForwardHead with targets awaits its BackwardHead
  int backward_next_ = -2;  // -2: no BackwardHead yet; i >= 0: BackwardBlock(i); -1: embed
  int shared_holds_ = -1;   // the checkpointed block whose activations the scratch holds
};

}  // namespace fsdp::nn
