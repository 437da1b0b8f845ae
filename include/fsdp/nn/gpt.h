// The GPT of MODEL_SPEC.md, written llm.c style: each layer a forward/backward pair of
// kernels, called through a Backend's op table.
//
// Parameters are grouped into units, the sharding units of the runtime: unit 0 is the root
// (transformer.wte.weight, transformer.wpe.weight, transformer.ln_f.weight,
// transformer.ln_f.bias) and unit 1 + i is transformer block i. A unit's parameters are stored
// as one flat buffer, the concatenation of its tensors in the order of unit_params(u), in the
// model's compute dtype (GptOptions; f32 by default). Gradients are always f32, in the same
// layout. The model never owns parameters: every stage takes views of the flat buffers it
// needs, so a sharding runtime can point them into gathered buffers (and gradients into its
// own). Every op is issued on the backend's compute stream.
//
// Mixed precision (compute_dtype bf16 or f16): every Linear (c_attn, c_proj, c_fc, the mlp's
// c_proj and the tied lm_head) multiplies in that dtype with f32 accumulation
// (Ops::Matmul* with bf16/f16 weights); everything else (embeddings, LayerNorm, attention,
// GELU, softmax) runs in f32 on f32 activations, on upcast copies of the parameters it reads.
//
// Activation checkpointing (GptOptions::checkpoint_layers): a checkpointed block keeps only its
// input after ForwardBlock; its other activations live in one scratch set shared by all
// checkpointed blocks, so the caller recomputes them with ForwardBlock(i) right before
// BackwardBlock(i). Recomputation runs the same kernels in the same order: results are
// bitwise identical to a model without checkpointing.
//
// One training step with all units resident (what Gpt::Forward/Backward do):
//   ForwardEmbed(root) ; ForwardBlock(i, block_i) for i = 0..L-1 ; loss = ForwardHead(root)
//   BackwardHead(root, droot) ; [ForwardBlock(i) if checkpointed ;] BackwardBlock(i, ...)
//   for i = L-1..0 ; BackwardEmbed(droot)
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "fsdp/backend.h"
#include "fsdp/dtype.h"
#include "fsdp/optim.h"
#include "fsdp/status.h"

namespace fsdp::nn {

struct GptConfig {
  std::string name;
  int vocab_size = 256;  // V
  int block_size = 64;   // T, the longest sequence
  int num_layers = 2;    // L
  int num_heads = 2;     // H
  int channels = 64;     // C

  // "nano", "mini", "gpt2", "gpt2-medium", "gpt2-xl".
  static absl::StatusOr<GptConfig> FromName(std::string_view name);
  absl::Status Validate() const;  // positive sizes, C divisible by H, V <= 65536
  int64_t num_parameters() const;  // all parameters (wte counted once; lm_head is tied)
  // P of MODEL_SPEC.md's FLOP formula (all parameters except wpe).
  int64_t num_flop_parameters() const;
  // Model FLOPs of one step over `tokens` tokens of sequence length T (PaLM convention).
  double flops_per_step(int64_t tokens, int64_t T) const;
};

struct ParamSpec {
  std::string name;            // e.g. "transformer.h.3.attn.c_attn.weight"
  std::vector<int64_t> shape;  // row-major; Linear weights are [out, in]
  int64_t numel = 0;
  int64_t offset = 0;  // element offset inside its unit's flat buffer
  int unit = 0;        // 0 = root, 1 + i = block i
  bool weight_decay = false;  // true for tensors of two or more dimensions
};

// All parameters, unit by unit (root first), in flat-buffer order inside each unit.
std::vector<ParamSpec> GptParamSpecs(const GptConfig& config);
int GptNumUnits(const GptConfig& config);  // L + 1
int64_t GptUnitNumel(const GptConfig& config, int unit);
// The weight-decay ranges of a whole unit's flat buffer, one per tensor (use
// SliceDecayRanges of optim.h for a shard of it).
std::vector<DecayRange> UnitDecayRanges(const std::vector<ParamSpec>& specs, int unit);

// Deterministic initialisation (MODEL_SPEC.md). Element j of a tensor is a pure function of
// (seed, tensor name, j), so any slice [begin, end) of any tensor can be initialised alone
// and every world size and strategy sees the same model. `out` is host memory.
void InitParamSlice(const GptConfig& config, const ParamSpec& spec, uint64_t seed,
                    int64_t begin, int64_t end, float* out);
// Initialises a whole unit's flat buffer in host memory (GptUnitNumel floats).
void InitUnit(const GptConfig& config, int unit, uint64_t seed, float* flat);

// OK when the n host token ids are in [0, vocab_size); else InvalidArgument naming the first
// bad one as what[row, column] (T columns per row).
absl::Status CheckTokenIds(const int32_t* ids, int64_t n, int vocab_size, int T,
                           const char* what);

struct GptOptions {
  // The dtype of the parameter buffers handed to the stages, and of the Linear layers'
  // multiplications: kF32, kBF16 or kF16 (2-byte elements at the same element offsets).
  DType compute_dtype = DType::kF32;
  // Activation checkpointing: empty (none), or one flag per layer (true: checkpointed).
  std::vector<bool> checkpoint_layers = {};
};

// Stage order is checked: a backward stage before its forward, or blocks out of order, is a
// FailedPrecondition error. The whole-model Forward checks token ids against [0, V) (a copy to
// the host); the staged API does not (the caller checks them where they are host data, as
// ShardedGpt does with CheckTokenIds).
// ForwardBlock(i) may run again between BackwardHead and BackwardBlock(i) (recomputation for
// activation checkpointing): each block's input is kept. BackwardBlock(i) of a checkpointed
// block is a FailedPrecondition error unless the shared scratch holds block i's activations,
// i.e. unless ForwardBlock(i) was the last checkpointed ForwardBlock to run.
class Gpt {
 public:
  // Activations are allocated on `backend` for batches of B sequences of length T
  // (1 <= T <= block_size); every call runs on exactly that shape.
  static absl::StatusOr<std::unique_ptr<Gpt>> Create(const GptConfig& config, Backend* backend,
                                                     int B, int T, GptOptions options = {});
  ~Gpt();

  const GptConfig& config() const { return config_; }
  int batch_size() const { return B_; }
  int seq_len() const { return T_; }
  int num_units() const { return config_.num_layers + 1; }
  const std::vector<ParamSpec>& params() const { return specs_; }
  std::vector<const ParamSpec*> unit_params(int unit) const;
  int64_t unit_numel(int unit) const;
  // Bytes of the buffers the model holds for B x T: activations, gradient scratch and (bf16,
  // f16) the f32 upcasts of the parameters the f32 kernels read.
  int64_t activation_bytes() const;
  const GptOptions& options() const { return options_; }
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
  View logits() const;

 private:
  struct Activations;
  struct BlockActs;
  Gpt(GptConfig config, Backend* backend, int B, int T, GptOptions options);
  absl::Status CheckTokens(View tokens, const char* what) const;
  absl::Status Zero(View v) const;
  BlockActs& Acts(int layer) const;  // the block's own activations, or the shared set
  // f32 values of parameters: `p` itself in f32, else upcast into the scratch at `slot`.
  View ParamF32(View p, int64_t slot) const;
  GptConfig config_;
  GptOptions options_;
  Backend* backend_;
  int B_, T_;
  std::vector<ParamSpec> specs_;
  std::unique_ptr<Activations> acts_;
  View idx_;      // inputs of the last ForwardEmbed
  View targets_;  // targets of the last ForwardHead
  // Progress of the current step, for the stage-order checks.
  int forward_blocks_done_ = -1;  // -1: no ForwardEmbed yet; i: blocks 0..i-1 done
  bool head_done_ = false;        // a ForwardHead with targets awaits its BackwardHead
  int backward_next_ = -2;  // -2: no BackwardHead yet; i >= 0: BackwardBlock(i); -1: embed
};

}  // namespace fsdp::nn
