// Llama 2 configurations of MODEL_SPEC.md, parameter specs (Hugging Face names, units, flat
// offsets), parameter and FLOP counts.
#include <array>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "fsdp/nn/llama.h"
#include "src/nn/llama_layout.h"

namespace fsdp::nn {
namespace {

using internal::LlamaBlockDefs;
using internal::LlamaRootDefs;
using internal::TensorDef;

const std::array<LlamaConfig, 5>& NamedConfigs() {
  // name, V, T, L, H, Hkv, C, F
  static const std::array<LlamaConfig, 5> configs = {{
      {"llama-nano", 256, 64, 2, 4, 2, 64, 176},
      {"llama-mini", 256, 256, 6, 6, 2, 384, 1024},
      {"llama2-7b", 32000, 4096, 32, 32, 32, 4096, 11008},
      {"llama2-13b", 32000, 4096, 40, 40, 40, 5120, 13824},
      {"llama2-70b", 32000, 4096, 80, 64, 8, 8192, 28672},
  }};
  return configs;
}

}  // namespace

absl::StatusOr<LlamaConfig> LlamaConfig::FromName(std::string_view name) {
  std::vector<std::string> names;
  for (const LlamaConfig& c : NamedConfigs()) {
    if (c.name == name) return c;
    names.push_back(c.name);
  }
  return absl::NotFoundError(absl::StrCat("unknown Llama config '", std::string(name),
                                          "'; known: ", absl::StrJoin(names, ", ")));
}

absl::Status LlamaConfig::Validate() const {
  auto bad = [&](absl::string_view what) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Llama config '", name, "' (V=", vocab_size, " T=", block_size, " L=", num_layers,
        " H=", num_heads, " Hkv=", num_kv_heads, " C=", channels, " F=", mlp_hidden, "): ",
        what));
  };
  if (vocab_size <= 0 || block_size <= 0 || num_layers <= 0 || num_heads <= 0 ||
      num_kv_heads <= 0 || channels <= 0 || mlp_hidden <= 0) {
    return bad("all sizes must be positive");
  }
  if (vocab_size > 65536) return bad("vocab_size must be <= 65536");  // uint16 token files
  if (num_layers > kMaxLayers) return bad(absl::StrCat("num_layers must be <= ", kMaxLayers));
  if (channels > kMaxChannels) return bad(absl::StrCat("channels must be <= ", kMaxChannels));
  if (mlp_hidden > kMaxMlpHidden) return bad(absl::StrCat("mlp_hidden must be <= ", kMaxMlpHidden));
  if (channels % num_heads != 0) return bad("channels must be divisible by num_heads");
  if (num_heads % num_kv_heads != 0) return bad("num_heads must be divisible by num_kv_heads");
  if (head_size() % 2 != 0) return bad("the head size channels / num_heads must be even (RoPE)");
  if (!(rope_theta > 0.0f) || !(norm_eps > 0.0f)) return bad("rope_theta and norm_eps must be > 0");
  return absl::OkStatus();
}

int64_t LlamaConfig::num_parameters() const {
  int64_t n = LlamaUnitNumel(*this, 0);
  for (int i = 0; i < num_layers; ++i) n += LlamaUnitNumel(*this, 1 + i);
  return n;
}

int64_t LlamaConfig::num_flop_parameters() const {
  return num_parameters() - static_cast<int64_t>(vocab_size) * channels;
}

double LlamaConfig::flops_per_step(int64_t tokens, int64_t T) const {
  return 6.0 * static_cast<double>(num_flop_parameters()) * static_cast<double>(tokens) +
         12.0 * num_layers * channels * static_cast<double>(T) * static_cast<double>(tokens);
}

int64_t LlamaUnitNumel(const LlamaConfig& config, int unit) {
  return unit == 0 ? internal::TotalNumel(LlamaRootDefs(config))
                   : internal::TotalNumel(LlamaBlockDefs(config));
}

std::vector<ParamSpec> LlamaParamSpecs(const LlamaConfig& config) {
  return internal::ModelSpecs("", LlamaRootDefs(config), "model.layers.", LlamaBlockDefs(config),
                              config.num_layers);
}

std::string LlamaConfig::HuggingFaceConfigJson(DType dtype) const {
  const char* torch_dtype = dtype == DType::kBF16  ? "bfloat16"
                            : dtype == DType::kF16 ? "float16"
                                                   : "float32";
  return absl::StrFormat(
      "{\n"
      "  \"architectures\": [\"LlamaForCausalLM\"],\n"
      "  \"model_type\": \"llama\",\n"
      "  \"vocab_size\": %d,\n"
      "  \"hidden_size\": %d,\n"
      "  \"intermediate_size\": %d,\n"
      "  \"num_hidden_layers\": %d,\n"
      "  \"num_attention_heads\": %d,\n"
      "  \"num_key_value_heads\": %d,\n"
      "  \"max_position_embeddings\": %d,\n"
      "  \"rms_norm_eps\": %.9g,\n"
      "  \"rope_theta\": %.9g,\n"
      "  \"hidden_act\": \"silu\",\n"
      "  \"attention_bias\": false,\n"
      "  \"mlp_bias\": false,\n"
      "  \"tie_word_embeddings\": false,\n"
      "  \"initializer_range\": 0.02,\n"
      "  \"torch_dtype\": \"%s\"\n"
      "}\n",
      vocab_size, channels, mlp_hidden, num_layers, num_heads, num_kv_heads, block_size,
      static_cast<double>(norm_eps), static_cast<double>(rope_theta), torch_dtype);
}

}  // namespace fsdp::nn
