// Deterministic GPT initialisation (MODEL_SPEC.md) from a counter-based generator: element j
// of a tensor is a function of (seed, tensor name, j) only, so a rank can initialise just its
// shard and every world size sees the same model.
#include <cmath>
#include <string_view>

#include "fsdp/nn/gpt.h"
#include "src/nn/counter_rng.h"

namespace fsdp::nn {
namespace {

using internal::Fnv1a;
using internal::NormalAt;
using internal::SplitMix64;

bool EndsWith(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

}  // namespace

void InitParamSlice(const GptConfig& config, const ParamSpec& spec, uint64_t seed,
                    int64_t begin, int64_t end, float* out) {
  if (spec.shape.size() < 2) {
    // LayerNorm weights are 1; biases (LayerNorm and Linear) are 0.
    const float value = EndsWith(spec.name, ".weight") ? 1.0f : 0.0f;
    for (int64_t j = begin; j < end; ++j) out[j - begin] = value;
    return;
  }
  // The residual projections are scaled down so the residual stream's variance does not grow
  // with depth (GPT-2).
  const double std_dev = EndsWith(spec.name, "c_proj.weight")
                             ? 0.02 / std::sqrt(2.0 * config.num_layers)
                             : 0.02;
  const uint64_t key = SplitMix64(SplitMix64(seed) ^ Fnv1a(spec.name));
  for (int64_t j = begin; j < end; ++j) {
    out[j - begin] = static_cast<float>(std_dev * NormalAt(key, j));
  }
}

void InitUnit(const GptConfig& config, int unit, uint64_t seed, float* flat) {
  for (const ParamSpec& spec : GptParamSpecs(config)) {
    if (spec.unit == unit) InitParamSlice(config, spec, seed, 0, spec.numel, flat + spec.offset);
  }
}

}  // namespace fsdp::nn
