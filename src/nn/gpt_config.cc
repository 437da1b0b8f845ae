// GPT configurations of MODEL_SPEC.md, parameter specs (names, shapes, units, flat offsets),
// parameter and FLOP counts.
#include <array>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "fsdp/nn/gpt.h"
#include "src/nn/gpt_layout.h"

namespace fsdp::nn {
namespace {

using internal::BlockDefs;
using internal::RootDefs;
using internal::TensorDef;

const std::array<GptConfig, 5>& NamedConfigs() {
  static const std::array<GptConfig, 5> configs = {{
      {"nano", 256, 64, 2, 2, 64},
      {"mini", 256, 256, 6, 6, 384},
      {"gpt2", 50304, 1024, 12, 12, 768},
      {"gpt2-medium", 50304, 1024, 24, 16, 1024},
      {"gpt2-xl", 50304, 1024, 48, 25, 1600},
  }};
  return configs;
}

}  // namespace

absl::StatusOr<GptConfig> GptConfig::FromName(std::string_view name) {
  std::vector<std::string> names;
  for (const GptConfig& c : NamedConfigs()) {
    if (c.name == name) return c;
    names.push_back(c.name);
  }
  return absl::NotFoundError(absl::StrCat("unknown GPT config '", std::string(name), "'; known: ",
                                          absl::StrJoin(names, ", ")));
}

absl::Status GptConfig::Validate() const {
  auto bad = [&](absl::string_view what) {
    return absl::InvalidArgumentError(absl::StrCat(
        "GPT config '", name, "' (V=", vocab_size, " T=", block_size, " L=", num_layers,
        " H=", num_heads, " C=", channels, "): ", what));
  };
  if (vocab_size <= 0 || block_size <= 0 || num_layers <= 0 || num_heads <= 0 || channels <= 0) {
    return bad("all sizes must be positive");
  }
  // Token files hold uint16 ids.
  if (vocab_size > 65536) return bad("vocab_size must be <= 65536");
  if (num_layers > kMaxLayers) return bad(absl::StrCat("num_layers must be <= ", kMaxLayers));
  if (channels > kMaxChannels) return bad(absl::StrCat("channels must be <= ", kMaxChannels));
  if (channels % num_heads != 0) return bad("channels must be divisible by num_heads");
  return absl::OkStatus();
}

int64_t GptConfig::num_parameters() const {
  int64_t n = 0;
  for (int u = 0; u < GptNumUnits(*this); ++u) n += GptUnitNumel(*this, u);
  return n;
}

int64_t GptConfig::num_flop_parameters() const {
  return num_parameters() - static_cast<int64_t>(block_size) * channels;
}

double GptConfig::flops_per_step(int64_t tokens, int64_t T) const {
  return 6.0 * static_cast<double>(num_flop_parameters()) * static_cast<double>(tokens) +
         12.0 * num_layers * channels * static_cast<double>(T) * static_cast<double>(tokens);
}

int GptNumUnits(const GptConfig& config) { return config.num_layers + 1; }

int64_t GptUnitNumel(const GptConfig& config, int unit) {
  if (unit == 0) {
    return internal::TotalNumel(RootDefs(config.vocab_size, config.block_size, config.channels));
  }
  return internal::TotalNumel(BlockDefs(config.channels));
}

std::vector<ParamSpec> GptParamSpecs(const GptConfig& config) {
  return internal::ModelSpecs("transformer.",
                              RootDefs(config.vocab_size, config.block_size, config.channels),
                              "transformer.h.", BlockDefs(config.channels), config.num_layers);
}

}  // namespace fsdp::nn
