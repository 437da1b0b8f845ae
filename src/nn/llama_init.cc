// Deterministic Llama initialisation (MODEL_SPEC.md): the same counter-based generator as the
// GPT's, so element j of a tensor depends on (seed, tensor name, j) only.
#include "fsdp/nn/llama.h"
#include "src/nn/counter_rng.h"

namespace fsdp::nn {

void InitParamSlice(const LlamaConfig& /*config*/, const ParamSpec& spec, uint64_t seed,
                    int64_t begin, int64_t end, float* out) {
  if (spec.shape.size() < 2) {  // RMSNorm weights
    for (int64_t j = begin; j < end; ++j) out[j - begin] = 1.0f;
    return;
  }
  const uint64_t key =
      internal::SplitMix64(internal::SplitMix64(seed) ^ internal::Fnv1a(spec.name));
  for (int64_t j = begin; j < end; ++j) {
    out[j - begin] = static_cast<float>(0.02 * internal::NormalAt(key, j));
  }
}

void InitUnit(const LlamaConfig& config, int unit, uint64_t seed, float* flat) {
  for (const ParamSpec& spec : LlamaParamSpecs(config)) {
    if (spec.unit == unit) InitParamSlice(config, spec, seed, 0, spec.numel, flat + spec.offset);
  }
}

}  // namespace fsdp::nn
