// One name for any bundled model's configuration: a GptConfig or a LlamaConfig, with what the
// trainer, the sharded model and the memory planner need from either without knowing which.
// Converts implicitly from both, so code written for the GPT keeps working.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "fsdp/nn/gpt.h"
#include "fsdp/nn/llama.h"

namespace fsdp::nn {

class ModelConfig {
 public:
  ModelConfig() = default;  // the default GptConfig
  ModelConfig(GptConfig c) : v_(std::move(c)) {}    // NOLINT: implicit on purpose
  ModelConfig(LlamaConfig c) : v_(std::move(c)) {}  // NOLINT: implicit on purpose
  // Any named config of either family (GPT names first); an unknown name lists all of them.
  static absl::StatusOr<ModelConfig> FromName(std::string_view name);
  static std::vector<std::string> Names();

  bool is_gpt() const { return std::holds_alternative<GptConfig>(v_); }
  bool is_llama() const { return std::holds_alternative<LlamaConfig>(v_); }
  const GptConfig& gpt() const { return std::get<GptConfig>(v_); }
  const LlamaConfig& llama() const { return std::get<LlamaConfig>(v_); }
  const char* family() const { return is_gpt() ? "gpt" : "llama"; }

  const std::string& name() const;
  int vocab_size() const;
  int block_size() const;
  int num_layers() const;
  int channels() const;
  absl::Status Validate() const;
  // Every field of the configuration as (key, value) pairs, "family" and "name" first:
  // what checkpoints and exports record (ShardingRuntime::set_model_description).
  std::vector<std::pair<std::string, std::string>> Describe() const;
  int64_t num_parameters() const;
  double flops_per_step(int64_t tokens, int64_t T) const;
  std::vector<ParamSpec> ParamSpecs() const;
  int num_units() const { return num_layers() + 1; }
  int64_t UnitNumel(int unit) const;
  // The module name of block i: "transformer.h.{i}" (GPT) or "model.layers.{i}" (Llama);
  // BlockPrefix() is the part before the number.
  std::string BlockName(int i) const;
  const char* BlockPrefix() const { return is_gpt() ? "transformer.h." : "model.layers."; }
  void InitParamSlice(const ParamSpec& spec, uint64_t seed, int64_t begin, int64_t end,
                      float* out) const;
  // What Create allocates for B x T (the model's activation_bytes()), without allocating;
  // InvalidArgument when that comes to more than int64 bytes (8 EiB).
  absl::StatusOr<int64_t> ActivationBytes(int B, int T, const ModelOptions& options) const;
  absl::StatusOr<std::unique_ptr<StagedModel>> CreateModel(Backend* backend, int B, int T,
                                                           ModelOptions options = {}) const;

 private:
  std::variant<GptConfig, LlamaConfig> v_;
};

}  // namespace fsdp::nn
