// The GPT of MODEL_SPEC.md, written llm.c style: each layer a forward/backward pair of
// kernels, called through a Backend's op table, behind the staged API of model.h (units,
// stage order, activation checkpointing are described there).
//
// Units: unit 0 is the root (transformer.wte.weight, transformer.wpe.weight,
// transformer.ln_f.weight, transformer.ln_f.bias) and unit 1 + i is transformer block i.
//
// Mixed precision (compute_dtype bf16 or f16): every Linear (c_attn, c_proj, c_fc, the mlp's
// c_proj and the tied lm_head) multiplies in that dtype with f32 accumulation
// (Ops::Matmul* with bf16/f16 weights); everything else (embeddings, LayerNorm, attention,
// GELU, softmax) runs in f32 on f32 activations, on upcast copies of the parameters it reads.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "fsdp/backend.h"
#include "fsdp/dtype.h"
#include "fsdp/optim.h"
#include "fsdp/nn/model.h"
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
  // Positive sizes, C divisible by H, V <= 65536, L <= kMaxLayers, C <= kMaxChannels.
  absl::Status Validate() const;
  int64_t num_parameters() const;  // all parameters (wte counted once; lm_head is tied)
  // P of MODEL_SPEC.md's FLOP formula (all parameters except wpe).
  int64_t num_flop_parameters() const;
  // Model FLOPs of one step over `tokens` tokens of sequence length T (PaLM convention).
  double flops_per_step(int64_t tokens, int64_t T) const;
};

// All parameters, unit by unit (root first), in flat-buffer order inside each unit.
std::vector<ParamSpec> GptParamSpecs(const GptConfig& config);
int GptNumUnits(const GptConfig& config);  // L + 1
int64_t GptUnitNumel(const GptConfig& config, int unit);

// Deterministic initialisation (MODEL_SPEC.md). Element j of a tensor is a pure function of
// (seed, tensor name, j), so any slice [begin, end) of any tensor can be initialised alone
// and every world size and strategy sees the same model. `out` is host memory.
void InitParamSlice(const GptConfig& config, const ParamSpec& spec, uint64_t seed,
                    int64_t begin, int64_t end, float* out);
// Initialises a whole unit's flat buffer in host memory (GptUnitNumel floats).
void InitUnit(const GptConfig& config, int unit, uint64_t seed, float* flat);

using GptOptions = ModelOptions;

// Bytes of the buffers Gpt::Create allocates for B x T with `options` (what
// activation_bytes() reports), computed without allocating: for the memory planner.
// InvalidArgument when they come to more than int64 bytes (8 EiB).
absl::StatusOr<int64_t> GptActivationBytes(const GptConfig& config, int B, int T,
                                           const ModelOptions& options);

class Gpt final : public StagedModel {
 public:
  // Activations are allocated on `backend` for batches of B sequences of length T
  // (1 <= T <= block_size); every call runs on exactly that shape.
  static absl::StatusOr<std::unique_ptr<Gpt>> Create(const GptConfig& config, Backend* backend,
                                                     int B, int T, GptOptions options = {});
  ~Gpt() override;

  const GptConfig& config() const { return config_; }
  int64_t activation_bytes() const override;
  View logits() const override;

 private:
  struct Activations;
  struct BlockActs;
  Gpt(GptConfig config, Backend* backend, int B, int T, GptOptions options);
  void RunForwardEmbed(View root, View idx) override;
  void RunForwardBlock(int layer, View block) override;
  void RunForwardHead(View root, View targets) override;
  absl::Status RunBackwardHead(View root, View droot, View targets, float loss_scale) override;
  absl::Status RunBackwardBlock(int layer, View block, View dblock) override;
  void RunBackwardEmbed(View droot, View idx) override;
  View loss_view() const override;
  friend absl::StatusOr<int64_t> GptActivationBytes(const GptConfig&, int, int,
                                                    const ModelOptions&);
  BlockActs& Acts(int layer) const;  // the block's own activations, or the shared set
  GptConfig config_;
  std::unique_ptr<Activations> acts_;
};

}  // namespace fsdp::nn
