// The Llama 2 family of MODEL_SPEC.md (Hugging Face LlamaForCausalLM layout): RMSNorm, rotary
// embeddings, grouped-query attention, SwiGLU MLP, no biases, untied lm_head. Written as the
// GPT is (gpt.h): each layer a forward/backward pair of ops, driven through the staged API of
// model.h.
//
// Units: unit 0 is the root (model.embed_tokens.weight, model.norm.weight, lm_head.weight),
// unit 1 + i is model.layers.{i}. Inside a layer the flat order is input_layernorm, q_proj,
// k_proj, v_proj, o_proj, post_attention_layernorm, gate_proj, up_proj, down_proj, so q, k and
// v are one [(H + 2 Hkv) D, C] matrix and gate and up one [2F, C] matrix: each pair of
// projections runs as one GEMM.
//
// Mixed precision (compute_dtype bf16 or f16): the Linear layers multiply in that dtype with
// f32 accumulation; the embedding, RMSNorm, RoPE, attention, SwiGLU and softmax run in f32, on
// upcast copies of the parameters they read.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "fsdp/nn/model.h"

namespace fsdp::nn {

struct LlamaConfig {
  std::string name;
  int vocab_size = 256;   // V
  int block_size = 64;    // T, the longest sequence
  int num_layers = 2;     // L
  int num_heads = 4;      // H, query heads
  int num_kv_heads = 2;   // Hkv, key/value heads (H divisible by Hkv)
  int channels = 64;      // C (head size D = C / H)
  int mlp_hidden = 176;   // F
  float rope_theta = 10000.0f;
  float norm_eps = 1e-5f;

  // "llama-nano", "llama-mini", "llama2-7b", "llama2-13b", "llama2-70b".
  static absl::StatusOr<LlamaConfig> FromName(std::string_view name);
  // Positive sizes, C divisible by H, H divisible by Hkv, even head size, V <= 65536 for
  // models that are allocated (the published shapes' V = 32000 is fine), L <= kMaxLayers,
  // C <= kMaxChannels, F <= kMaxMlpHidden (model.h).
  absl::Status Validate() const;
  // The config.json of transformers' LlamaForCausalLM for this model (model_type "llama",
  // the sizes, rms_norm_eps, rope_theta, untied lm_head, no biases; torch_dtype from `dtype`:
  // "float32", "bfloat16" or "float16"), so that from_pretrained loads a directory exported by
  // ExportSafetensorsDirectory (SafetensorsExportOptions::extra_files).
  std::string HuggingFaceConfigJson(DType dtype) const;
  int head_size() const { return channels / num_heads; }
  int64_t qkv_width() const {  // (H + 2 Hkv) D: columns of the fused q/k/v projection
    return static_cast<int64_t>(num_heads + 2 * num_kv_heads) * head_size();
  }
  int64_t num_parameters() const;
  // P of MODEL_SPEC.md's FLOP formula (all parameters except model.embed_tokens).
  int64_t num_flop_parameters() const;
  double flops_per_step(int64_t tokens, int64_t T) const;
};

std::vector<ParamSpec> LlamaParamSpecs(const LlamaConfig& config);
int64_t LlamaUnitNumel(const LlamaConfig& config, int unit);
// Deterministic initialisation (MODEL_SPEC.md): every Linear weight and the embedding
// ~ N(0, 0.02), RMSNorm weights 1. Element j is a pure function of (seed, name, j).
void InitParamSlice(const LlamaConfig& config, const ParamSpec& spec, uint64_t seed,
                    int64_t begin, int64_t end, float* out);
void InitUnit(const LlamaConfig& config, int unit, uint64_t seed, float* flat);
// Bytes of the buffers Llama::Create allocates for B x T with `options` (what
// activation_bytes() reports), computed without allocating: for the memory planner.
// InvalidArgument when they come to more than int64 bytes (8 EiB).
absl::StatusOr<int64_t> LlamaActivationBytes(const LlamaConfig& config, int B, int T,
                                             const ModelOptions& options);

class Llama final : public StagedModel {
 public:
  static absl::StatusOr<std::unique_ptr<Llama>> Create(const LlamaConfig& config,
                                                       Backend* backend, int B, int T,
                                                       ModelOptions options = {});
  ~Llama() override;

  const LlamaConfig& config() const { return config_; }
  int64_t activation_bytes() const override;
  View logits() const override;

 private:
  struct Activations;
  struct BlockActs;
  Llama(LlamaConfig config, Backend* backend, int B, int T, ModelOptions options);
  void RunForwardEmbed(View root, View idx) override;
  void RunForwardBlock(int layer, View block) override;
  void RunForwardHead(View root, View targets) override;
  absl::Status RunBackwardHead(View root, View droot, View targets, float loss_scale) override;
  absl::Status RunBackwardBlock(int layer, View block, View dblock) override;
  void RunBackwardEmbed(View droot, View idx) override;
  View loss_view() const override;
  friend absl::StatusOr<int64_t> LlamaActivationBytes(const LlamaConfig&, int, int,
                                                      const ModelOptions&);
  BlockActs& Acts(int layer) const;

  LlamaConfig config_;
  std::unique_ptr<Activations> acts_;
};

}  // namespace fsdp::nn
