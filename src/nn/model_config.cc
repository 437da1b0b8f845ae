// ModelConfig: a GPT or Llama configuration behind one interface.
#include "fsdp/nn/model_config.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace fsdp::nn {

namespace {
const char* const kGptNames[] = {"nano", "mini", "gpt2", "gpt2-medium", "gpt2-xl"};
const char* const kLlamaNames[] = {"llama-nano", "llama-mini", "llama2-7b", "llama2-13b",
                                   "llama2-70b"};
}  // namespace

std::vector<std::string> ModelConfig::Names() {
  std::vector<std::string> names(std::begin(kGptNames), std::end(kGptNames));
  names.insert(names.end(), std::begin(kLlamaNames), std::end(kLlamaNames));
  return names;
}

absl::StatusOr<ModelConfig> ModelConfig::FromName(std::string_view name) {
  if (auto g = GptConfig::FromName(name); g.ok()) return ModelConfig(*std::move(g));
  if (auto l = LlamaConfig::FromName(name); l.ok()) return ModelConfig(*std::move(l));
  return absl::NotFoundError(absl::StrCat("unknown model '", std::string(name),
                                          "'; known: ", absl::StrJoin(Names(), ", ")));
}

const std::string& ModelConfig::name() const { return is_gpt() ? gpt().name : llama().name; }
int ModelConfig::vocab_size() const {
  return is_gpt() ? gpt().vocab_size : llama().vocab_size;
}
int ModelConfig::block_size() const {
  return is_gpt() ? gpt().block_size : llama().block_size;
}
int ModelConfig::num_layers() const {
  return is_gpt() ? gpt().num_layers : llama().num_layers;
}
int ModelConfig::channels() const { return is_gpt() ? gpt().channels : llama().channels; }

absl::Status ModelConfig::Validate() const {
  return is_gpt() ? gpt().Validate() : llama().Validate();
}

std::vector<std::pair<std::string, std::string>> ModelConfig::Describe() const {
  std::vector<std::pair<std::string, std::string>> d = {{"family", family()}, {"name", name()}};
  auto add = [&](const char* key, auto value) { d.emplace_back(key, absl::StrCat(value)); };
  if (is_gpt()) {
    const GptConfig& c = gpt();
    add("vocab_size", c.vocab_size);
    add("block_size", c.block_size);
    add("num_layers", c.num_layers);
    add("num_heads", c.num_heads);
    add("channels", c.channels);
  } else {
    const LlamaConfig& c = llama();
    add("vocab_size", c.vocab_size);
    add("block_size", c.block_size);
    add("num_layers", c.num_layers);
    add("num_heads", c.num_heads);
    add("num_kv_heads", c.num_kv_heads);
    add("channels", c.channels);
    add("mlp_hidden", c.mlp_hidden);
    d.emplace_back("rope_theta", absl::StrFormat("%.9g", c.rope_theta));
    d.emplace_back("norm_eps", absl::StrFormat("%.9g", c.norm_eps));
  }
  return d;
}

int64_t ModelConfig::num_parameters() const {
  return is_gpt() ? gpt().num_parameters() : llama().num_parameters();
}

double ModelConfig::flops_per_step(int64_t tokens, int64_t T) const {
  return is_gpt() ? gpt().flops_per_step(tokens, T) : llama().flops_per_step(tokens, T);
}

std::vector<ParamSpec> ModelConfig::ParamSpecs() const {
  return is_gpt() ? GptParamSpecs(gpt()) : LlamaParamSpecs(llama());
}

int64_t ModelConfig::UnitNumel(int unit) const {
  return is_gpt() ? GptUnitNumel(gpt(), unit) : LlamaUnitNumel(llama(), unit);
}

std::string ModelConfig::BlockName(int i) const {
  return absl::StrCat(BlockPrefix(), i);
}

void ModelConfig::InitParamSlice(const ParamSpec& spec, uint64_t seed, int64_t begin,
                                 int64_t end, float* out) const {
  if (is_gpt()) {
    nn::InitParamSlice(gpt(), spec, seed, begin, end, out);
  } else {
    nn::InitParamSlice(llama(), spec, seed, begin, end, out);
  }
}

absl::StatusOr<int64_t> ModelConfig::ActivationBytes(int B, int T, const ModelOptions& options) const {
  return is_gpt() ? GptActivationBytes(gpt(), B, T, options)
                  : LlamaActivationBytes(llama(), B, T, options);
}

absl::StatusOr<std::unique_ptr<StagedModel>> ModelConfig::CreateModel(
    Backend* backend, int B, int T, ModelOptions options) const {
  if (is_gpt()) {
    FSDP_ASSIGN_OR_RETURN(std::unique_ptr<Gpt> m,
                          Gpt::Create(gpt(), backend, B, T, std::move(options)));
    return std::unique_ptr<StagedModel>(std::move(m));
  }
  FSDP_ASSIGN_OR_RETURN(std::unique_ptr<Llama> m,
                        Llama::Create(llama(), backend, B, T, std::move(options)));
  return std::unique_ptr<StagedModel>(std::move(m));
}

}  // namespace fsdp::nn
