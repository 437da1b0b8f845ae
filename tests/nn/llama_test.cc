// The Llama family: configs and parameter specs against MODEL_SPEC.md, the model against the
// double-precision reference of reference_llama.h (loss, logits, every gradient by finite
// differences), activation checkpointing, mixed precision and the activation-bytes formula.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <random>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/checkpoint/safetensors_ref_reader.h"
#include "tests/nn/reference_llama.h"
#include "tests/nn/test_util.h"

namespace fsdp::nn {
namespace {

using ::testing::HasSubstr;
using testing::RandomTokens;
using testing::ReferenceLlama;
using testing::UnitBuffers;

// ---- configs and specs ---------------------------------------------------------------------

TEST(LlamaSpecTest, NamedConfigsHaveTheSpecsParameterCounts) {
  struct Row {
    const char* name;
    int64_t params;  // exact count from the shapes of MODEL_SPEC.md
    double approx;   // the table's rounded figure
    double half_ulp;  // half a unit of its last digit
  };
  for (const Row& r : {Row{"llama-nano", 125248, 0.13e6, 0.005e6},
                       Row{"llama-mini", 9638784, 9.6e6, 0.05e6},
                       Row{"llama2-7b", 6738415616, 6.74e9, 0.005e9},
                       Row{"llama2-13b", 13015864320, 13.0e9, 0.05e9},
                       Row{"llama2-70b", 68976648192, 69.0e9, 0.05e9}}) {
    auto c = LlamaConfig::FromName(r.name);
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_TRUE(c->Validate().ok()) << c->Validate();
    EXPECT_EQ(c->num_parameters(), r.params) << r.name;
    EXPECT_NEAR(static_cast<double>(c->num_parameters()), r.approx, r.half_ulp) << r.name;
  }
  auto unknown = LlamaConfig::FromName("llama3");
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(unknown.status().message(), HasSubstr("llama2-70b"));
}

TEST(LlamaSpecTest, HuggingFaceNamesShapesAndOrder) {
  const LlamaConfig c = *LlamaConfig::FromName("llama2-70b");  // GQA: Hkv = 8 of H = 64
  const std::vector<ParamSpec> specs = LlamaParamSpecs(c);      // never allocates the model
  ASSERT_EQ(specs.size(), 3u + 9u * 80u);
  const std::vector<std::pair<std::string, std::vector<int64_t>>> want = {
      {"model.embed_tokens.weight", {32000, 8192}},
      {"model.norm.weight", {8192}},
      {"lm_head.weight", {32000, 8192}},
      {"model.layers.0.input_layernorm.weight", {8192}},
      {"model.layers.0.self_attn.q_proj.weight", {8192, 8192}},
      {"model.layers.0.self_attn.k_proj.weight", {1024, 8192}},
      {"model.layers.0.self_attn.v_proj.weight", {1024, 8192}},
      {"model.layers.0.self_attn.o_proj.weight", {8192, 8192}},
      {"model.layers.0.post_attention_layernorm.weight", {8192}},
      {"model.layers.0.mlp.gate_proj.weight", {28672, 8192}},
      {"model.layers.0.mlp.up_proj.weight", {28672, 8192}},
      {"model.layers.0.mlp.down_proj.weight", {8192, 28672}},
  };
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(specs[i].name, want[i].first);
    EXPECT_EQ(specs[i].shape, want[i].second) << want[i].first;
    EXPECT_EQ(specs[i].weight_decay, want[i].second.size() == 2) << want[i].first;
  }
  EXPECT_EQ(specs.back().name, "model.layers.79.mlp.down_proj.weight");
  EXPECT_EQ(specs.back().unit, 80);
  // Flat offsets are contiguous inside each unit.
  int64_t expect = 0;
  int unit = 0;
  for (const ParamSpec& s : specs) {
    if (s.unit != unit) expect = 0, unit = s.unit;
    EXPECT_EQ(s.offset, expect) << s.name;
    expect += s.numel;
  }
  // FLOP parameters exclude the embedding lookup.
  EXPECT_EQ(c.num_flop_parameters(), c.num_parameters() - int64_t{32000} * 8192);
}

TEST(LlamaSpecTest, InvalidConfigsSayWhatIsWrong) {
  LlamaConfig c = *LlamaConfig::FromName("llama-nano");
  c.num_kv_heads = 3;
  EXPECT_THAT(c.Validate().message(), HasSubstr("divisible by num_kv_heads"));
  c = *LlamaConfig::FromName("llama-nano");
  c.channels = 60;  // D = 15: RoPE needs an even head size
  EXPECT_THAT(c.Validate().message(), HasSubstr("even"));
  c = *LlamaConfig::FromName("llama-nano");
  c.mlp_hidden = 0;
  EXPECT_THAT(c.Validate().message(), HasSubstr("positive"));
  c = *LlamaConfig::FromName("llama-nano");
  c.num_layers = 2147483647;
  EXPECT_THAT(c.Validate().message(), HasSubstr("num_layers must be <= 10000"));
  c = *LlamaConfig::FromName("llama-nano");
  c.mlp_hidden = 2147483647;
  EXPECT_THAT(c.Validate().message(), HasSubstr("mlp_hidden must be <= 16777216"));
  auto backend = testing::MakeCpuBackend();
  EXPECT_THAT(Llama::Create(*LlamaConfig::FromName("llama-nano"), backend.get(), 1, 65)
                  .status()
                  .message(),
              HasSubstr("block_size"));
  ModelOptions bad;
  bad.checkpoint_layers = {true};
  EXPECT_THAT(Llama::Create(*LlamaConfig::FromName("llama-nano"), backend.get(), 1, 8, bad)
                  .status()
                  .message(),
              HasSubstr("one per layer"));
}

TEST(LlamaSpecTest, ModelConfigResolvesEveryNameOfBothFamilies) {
  for (const std::string& name : ModelConfig::Names()) {
    auto c = ModelConfig::FromName(name);
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_EQ(c->name(), name);
    EXPECT_EQ(c->is_llama(), name.starts_with("llama"));
    int64_t total = 0;
    for (int u = 0; u < c->num_units(); ++u) total += c->UnitNumel(u);
    EXPECT_EQ(total, c->num_parameters()) << name;
  }
  EXPECT_THAT(ModelConfig::FromName("gpt3").status().message(), HasSubstr("llama-mini"));
  EXPECT_EQ(ModelConfig(*LlamaConfig::FromName("llama-mini")).BlockName(5), "model.layers.5");
  EXPECT_EQ(ModelConfig(*GptConfig::FromName("mini")).BlockName(5), "transformer.h.5");
}

// The planner's figure is the model's own allocation, for both families and every option.
TEST(LlamaSpecTest, ActivationBytesFormulaEqualsWhatCreateAllocates) {
  auto backend = testing::MakeCpuBackend();
  for (const char* name : {"nano", "mini", "llama-nano", "llama-mini"}) {
    const ModelConfig c = *ModelConfig::FromName(name);
    for (DType d : {DType::kF32, DType::kBF16}) {
      for (int every : {0, 1, 2}) {
        ModelOptions o;
        o.compute_dtype = d;
        if (every > 0) {
          for (int i = 0; i < c.num_layers(); ++i) o.checkpoint_layers.push_back(i % every == 0);
        }
        auto m = c.CreateModel(backend.get(), 2, 32, o);
        ASSERT_TRUE(m.ok()) << m.status();
        absl::StatusOr<int64_t> counted = c.ActivationBytes(2, 32, o);
        ASSERT_TRUE(counted.ok()) << counted.status();
        EXPECT_EQ((*m)->activation_bytes(), *counted)
            << name << " " << DTypeName(d) << " every " << every;
      }
    }
  }
  // The 70B shape: counted without allocating (about 1.2 TB for B=8 at T=4096).
  const ModelConfig big = *ModelConfig::FromName("llama2-70b");
  EXPECT_GT(*big.ActivationBytes(8, 4096, {}), int64_t{1} << 40);
  // Sizes whose bytes do not fit in int64 are an error, not a wrapped count: at B = 2^31 - 1
  // one block's attention alone is 2^31 x 64 heads x 4096^2 floats.
  absl::StatusOr<int64_t> huge = big.ActivationBytes(2147483647, 4096, {});
  ASSERT_FALSE(huge.ok());
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(huge.status().message().find("more than 2^63 - 1 bytes (8 EiB)"), std::string::npos)
      << huge.status();
}

// ---- the model against the double reference -----------------------------------------------

// V=17 T=8 L=2 H=4 Hkv=2 C=16 F=24: small enough to check every parameter's gradient, with
// grouped-query attention (two query heads per kv head).
LlamaConfig Tiny() {
  LlamaConfig c;
  c.name = "tiny";
  c.vocab_size = 17;
  c.block_size = 8;
  c.num_layers = 2;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.channels = 16;
  c.mlp_hidden = 24;
  return c;
}

// Random parameters well away from the init (norm weights 1), so every term matters.
void RandomParams(const LlamaConfig& config, UnitBuffers& u, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> n(0.0f, 1.0f);
  for (const ParamSpec& s : LlamaParamSpecs(config)) {
    float* p = u.params[s.unit].as<float>() + s.offset;
    for (int64_t j = 0; j < s.numel; ++j) {
      p[j] = s.shape.size() == 1 ? 1.0f + 0.2f * n(rng) : 0.3f * n(rng);
    }
  }
}

ReferenceLlama::Units ToDouble(const LlamaConfig& config, const UnitBuffers& u) {
  ReferenceLlama::Units out;
  for (int i = 0; i <= config.num_layers; ++i) {
    const float* p = u.params[i].as<float>();
    out.emplace_back(p, p + LlamaUnitNumel(config, i));
  }
  return out;
}

struct Case {
  LlamaConfig config;
  int B, T;
  std::vector<int32_t> idx, tgt;
};

Case MakeCase(LlamaConfig config, int B, int T, uint64_t seed) {
  const int V = config.vocab_size;
  return {std::move(config), B, T, RandomTokens(B * T, V, seed), RandomTokens(B * T, V, seed + 1)};
}

TEST(LlamaReferenceTest, LossAndLogitsMatchDoubleReference) {
  auto backend = testing::MakeCpuBackend();
  Case c = MakeCase(Tiny(), 2, 7, 7);
  UnitBuffers u = UnitBuffers::Create(backend.get(), c.config);
  RandomParams(c.config, u, 1);
  auto m = Llama::Create(c.config, backend.get(), c.B, c.T);
  ASSERT_TRUE(m.ok()) << m.status();
  auto loss = (*m)->Forward(u.param_views(), testing::I32(backend, c.idx),
                            testing::I32(backend, c.tgt));
  ASSERT_TRUE(loss.ok()) << loss.status();
  std::vector<double> ref_logits;
  const double ref = ReferenceLlama(c.config).Loss(ToDouble(c.config, u), c.idx, c.tgt, c.B,
                                                   c.T, &ref_logits);
  EXPECT_NEAR(*loss, ref, 1e-5 * std::abs(ref));
  EXPECT_GT(ref, 1.0);  // far from a trivial model
  const float* logits = (*m)->logits().host_as<float>();
  for (size_t i = 0; i < ref_logits.size(); ++i) {
    ASSERT_NEAR(logits[i], ref_logits[i], 1e-4 * (1 + std::abs(ref_logits[i]))) << "logit " << i;
  }
}

void ModelGradients(Backend* backend, const Case& c, UnitBuffers& u) {
  auto m = Llama::Create(c.config, backend, c.B, c.T);
  ASSERT_TRUE(m.ok()) << m.status();
  u.ZeroGrads();
  ASSERT_TRUE((*m)->Forward(u.param_views(), testing::I32(backend, c.idx),
                            testing::I32(backend, c.tgt))
                  .ok());
  ASSERT_TRUE((*m)->Backward(u.param_views(), u.grad_views()).ok());
}

double FiniteDifference(const ReferenceLlama& ref, ReferenceLlama::Units& p, const Case& c,
                        int unit, int64_t j, double h) {
  const double saved = p[unit][j];
  p[unit][j] = saved + h;
  const double up = ref.Loss(p, c.idx, c.tgt, c.B, c.T);
  p[unit][j] = saved - h;
  const double down = ref.Loss(p, c.idx, c.tgt, c.B, c.T);
  p[unit][j] = saved;
  return (up - down) / (2 * h);
}

TEST(LlamaReferenceTest, EveryGradientMatchesFiniteDifferencesOnTinyModel) {
  auto backend = testing::MakeCpuBackend();
  Case c = MakeCase(Tiny(), 2, 7, 11);
  UnitBuffers u = UnitBuffers::Create(backend.get(), c.config);
  RandomParams(c.config, u, 2);
  ModelGradients(backend.get(), c, u);
  ReferenceLlama ref(c.config);
  ReferenceLlama::Units p = ToDouble(c.config, u);
  int checked = 0;
  double worst = 0;
  for (const ParamSpec& s : LlamaParamSpecs(c.config)) {
    for (int64_t j = 0; j < s.numel; ++j) {
      const double fd = FiniteDifference(ref, p, c, s.unit, s.offset + j, 1e-5);
      const double g = u.grads[s.unit].as<float>()[s.offset + j];
      const double err = std::abs(g - fd) / (std::abs(fd) + 1e-4);
      worst = std::max(worst, err);
      ASSERT_LT(err, 2e-3) << s.name << "[" << j << "]: model " << g << ", finite difference "
                           << fd;
      ++checked;
    }
  }
  EXPECT_EQ(checked, c.config.num_parameters());
  std::printf("tiny llama: %d gradients checked, worst relative error %.2e\n", checked, worst);
}

// The whole-model gradient check on llama-nano: two elements of every tensor (one in a row
// the batch touches, for the embedding and lm_head), at the spec's initialisation.
TEST(LlamaReferenceTest, SampledGradientsMatchFiniteDifferencesOnNano) {
  auto backend = testing::MakeCpuBackend();
  Case c = MakeCase(*LlamaConfig::FromName("llama-nano"), 2, 16, 21);
  UnitBuffers u = UnitBuffers::Create(backend.get(), c.config);
  u.Init(c.config, 3);
  ModelGradients(backend.get(), c, u);
  ReferenceLlama ref(c.config);
  ReferenceLlama::Units p = ToDouble(c.config, u);
  std::mt19937 rng(5);
  int checked = 0;
  double worst = 0;
  for (const ParamSpec& s : LlamaParamSpecs(c.config)) {
    const float* g = u.grads[s.unit].as<float>() + s.offset;
    double scale = 0;  // RMS of the tensor's gradient: the size of an error that matters
    for (int64_t j = 0; j < s.numel; ++j) scale += static_cast<double>(g[j]) * g[j];
    scale = std::sqrt(scale / s.numel);
    ASSERT_GT(scale, 0) << s.name << " has no gradient at all";
    int64_t touched = static_cast<int64_t>(rng() % s.numel);
    if (s.name == "model.embed_tokens.weight" || s.name == "lm_head.weight") {
      const int64_t row = s.name == "lm_head.weight" ? c.tgt[rng() % c.tgt.size()]
                                                     : c.idx[rng() % c.idx.size()];
      touched = row * s.shape[1] + rng() % s.shape[1];
    }
    for (int64_t j : {touched, static_cast<int64_t>(rng() % s.numel)}) {
      const double fd = FiniteDifference(ref, p, c, s.unit, s.offset + j, 1e-4);
      const double err = std::abs(g[j] - fd) / (std::abs(fd) + 1e-2 * scale + 1e-9);
      worst = std::max(worst, err);
      EXPECT_LT(err, 2e-3) << s.name << "[" << j << "]: model " << g[j]
                           << ", finite difference " << fd << ", tensor rms " << scale;
      ++checked;
    }
  }
  EXPECT_EQ(checked, 2 * static_cast<int>(LlamaParamSpecs(c.config).size()));
  std::printf("llama-nano: %d gradients checked, worst relative error %.2e\n", checked, worst);
}

// Checkpointed layers recompute bitwise the same activations: loss and gradients are equal
// to the bit with and without checkpointing.
TEST(LlamaReferenceTest, CheckpointingIsBitwiseIdentical) {
  auto backend = testing::MakeCpuBackend();
  Case c = MakeCase(Tiny(), 2, 8, 41);
  UnitBuffers u = UnitBuffers::Create(backend.get(), c.config);
  RandomParams(c.config, u, 6);
  auto run = [&](ModelOptions o) {
    auto m = *Llama::Create(c.config, backend.get(), c.B, c.T, o);
    u.ZeroGrads();
    auto loss = m->Forward(u.param_views(), testing::I32(backend, c.idx),
                           testing::I32(backend, c.tgt));
    EXPECT_TRUE(loss.ok()) << loss.status();
    EXPECT_TRUE(m->Backward(u.param_views(), u.grad_views()).ok());
    return std::make_pair(*loss, u.grad_values());
  };
  const auto plain = run({});
  ModelOptions ckpt;
  ckpt.checkpoint_layers = {true, true};
  const auto recomputed = run(ckpt);
  EXPECT_EQ(plain.first, recomputed.first);
  EXPECT_EQ(plain.second, recomputed.second);
}

// bf16 compute: the Linear layers in bf16 with f32 accumulation; the loss and gradients stay
// close to f32 (bf16 keeps 8 bits of mantissa).
TEST(LlamaReferenceTest, Bf16ComputeStaysCloseToF32) {
  auto backend = testing::MakeCpuBackend();
  Case c = MakeCase(*LlamaConfig::FromName("llama-nano"), 2, 16, 51);
  UnitBuffers u = UnitBuffers::Create(backend.get(), c.config);
  u.Init(c.config, 9);
  ModelGradients(backend.get(), c, u);
  const auto g32 = u.grad_values();
  auto m32 = *Llama::Create(c.config, backend.get(), c.B, c.T);
  const float loss32 = *m32->Forward(u.param_views(), testing::I32(backend, c.idx),
                                     testing::I32(backend, c.tgt));
  ModelOptions o;
  o.compute_dtype = DType::kBF16;
  auto m16 = *Llama::Create(c.config, backend.get(), c.B, c.T, o);
  testing::LowpUnits low = testing::LowpUnits::Create(backend.get(), c.config, DType::kBF16);
  low.CastFrom(*backend, u);
  u.ZeroGrads();
  auto loss16 = m16->Forward(low.views(), testing::I32(backend, c.idx),
                             testing::I32(backend, c.tgt));
  ASSERT_TRUE(loss16.ok()) << loss16.status();
  ASSERT_TRUE(m16->Backward(low.views(), u.grad_views()).ok());
  EXPECT_NEAR(*loss16, loss32, 1e-2 * loss32);
  EXPECT_NE(*loss16, loss32);  // it did compute in bf16
  // Against the double reference on the same bf16 parameters, once rounding what the model
  // keeps in bf16 (autocast-style: the Linear layers' inputs, q, k after RoPE, v, gate and
  // up) and once not: the model sits on the first (measured on AMD EPYC: 5.4e-8 from the
  // emulation, 2.1e-5 from the unrounded run).
  ReferenceLlama::Units rounded = ToDouble(c.config, u);
  for (auto& unit : rounded) unit = testing::RoundedTo(DType::kBF16, std::move(unit));
  const double emulated =
      ReferenceLlama(c.config, DType::kBF16).Loss(rounded, c.idx, c.tgt, c.B, c.T);
  const double unrounded = ReferenceLlama(c.config).Loss(rounded, c.idx, c.tgt, c.B, c.T);
  std::printf("llama-nano bf16: loss %.7f, autocast emulation %.7f (diff %.2e), rounded "
              "parameters only %.7f (diff %.2e)\n",
              *loss16, emulated, std::abs(*loss16 - emulated), unrounded,
              std::abs(*loss16 - unrounded));
  EXPECT_NEAR(*loss16, emulated, 1e-5);
  EXPECT_LT(std::abs(*loss16 - emulated), 0.2 * std::abs(*loss16 - unrounded));
  const auto g16 = u.grad_values();
  for (size_t unit = 0; unit < g32.size(); ++unit) {
    double diff = 0, norm = 0;
    for (size_t j = 0; j < g32[unit].size(); ++j) {
      diff += std::pow(g16[unit][j] - g32[unit][j], 2);
      norm += std::pow(g32[unit][j], 2);
    }
    EXPECT_LT(std::sqrt(diff / norm), 0.05) << "unit " << unit;
  }
}

// ---- against Hugging Face transformers -------------------------------------------------------

// golden/tiny_llama_hf.safetensors (make_llama_golden.py): LlamaForCausalLM in f32 with
// grouped-query attention, its parameters, tokens, logits, loss and every gradient. Loading
// the parameters by their Hugging Face names and matching all of it checks the names, the
// layouts, RoPE's rotate_half convention and the kv-head mapping against the real thing.
TEST(LlamaHuggingFaceTest, LogitsLossAndGradientsMatchTransformers) {
  const std::string path =
      std::string(FSDP_SOURCE_DIR) + "/tests/nn/golden/tiny_llama_hf.safetensors";
  std::ifstream in(path, std::ios::binary);
  ASSERT_TRUE(in) << "cannot open " << path;
  std::stringstream raw;
  raw << in.rdbuf();
  auto file = fsdp::testing::ref_st::Parse(raw.str());
  ASSERT_TRUE(file.ok()) << file.status();
  auto values = [&](const std::string& name) {
    auto it = file->tensors.find(name);
    EXPECT_NE(it, file->tensors.end()) << name << " is not in the golden file";
    return it == file->tensors.end() ? std::vector<float>{}
                                     : fsdp::testing::ref_st::F32Values(it->second);
  };
  auto tokens = [&](const std::string& name) {
    const auto& t = file->tensors.at(name);
    EXPECT_EQ(t.dtype, "I32");
    std::vector<int32_t> v(t.bytes.size() / 4);
    std::memcpy(v.data(), t.bytes.data(), t.bytes.size());
    return v;
  };
  LlamaConfig config = Tiny();
  config.vocab_size = 32;
  const int B = 2, T = 8;
  auto backend = testing::MakeCpuBackend();
  UnitBuffers u = UnitBuffers::Create(backend.get(), config);
  int loaded = 0;
  for (const ParamSpec& s : LlamaParamSpecs(config)) {
    const std::vector<float> v = values(s.name);
    ASSERT_EQ(static_cast<int64_t>(v.size()), s.numel) << s.name;
    EXPECT_EQ(file->tensors.at(s.name).shape, s.shape) << s.name;
    std::copy(v.begin(), v.end(), u.params[s.unit].as<float>() + s.offset);
    ++loaded;
  }
  // Every parameter of the Hugging Face model is one of ours: 2 per tensor (value, grad)
  // plus tokens.idx, tokens.tgt, out.logits and out.loss.
  EXPECT_EQ(file->tensors.size(), 2u * loaded + 4u);
  const std::vector<int32_t> idx = tokens("tokens.idx"), tgt = tokens("tokens.tgt");
  ASSERT_EQ(idx.size(), static_cast<size_t>(B * T));

  auto m = Llama::Create(config, backend.get(), B, T);
  ASSERT_TRUE(m.ok()) << m.status();
  auto loss = (*m)->Forward(u.param_views(), testing::I32(backend, idx),
                            testing::I32(backend, tgt));
  ASSERT_TRUE(loss.ok()) << loss.status();
  const float want_loss = values("out.loss").at(0);
  EXPECT_NEAR(*loss, want_loss, 2e-6 * want_loss);
  const std::vector<float> want_logits = values("out.logits");
  const float* logits = (*m)->logits().host_as<float>();
  double worst_logit = 0;
  for (size_t i = 0; i < want_logits.size(); ++i) {
    worst_logit = std::max(worst_logit, static_cast<double>(std::abs(logits[i] - want_logits[i])));
  }
  EXPECT_LT(worst_logit, 2e-5);
  ASSERT_TRUE((*m)->Backward(u.param_views(), u.grad_views()).ok());
  double worst_grad = 0;
  for (const ParamSpec& s : LlamaParamSpecs(config)) {
    const std::vector<float> want = values("grad." + s.name);
    ASSERT_EQ(static_cast<int64_t>(want.size()), s.numel) << s.name;
    const float* got = u.grads[s.unit].as<float>() + s.offset;
    double rms = 0;
    for (float w : want) rms += static_cast<double>(w) * w;
    rms = std::sqrt(rms / s.numel);
    ASSERT_GT(rms, 0) << s.name;
    for (int64_t j = 0; j < s.numel; ++j) {
      const double err = std::abs(got[j] - want[j]) / rms;
      worst_grad = std::max(worst_grad, err);
      ASSERT_LT(err, 1e-4) << "grad of " << s.name << "[" << j << "]: " << got[j]
                           << ", transformers " << want[j];
    }
  }
  std::printf("vs transformers %s: loss %.7f / %.7f, worst logit error %.2e, worst gradient "
              "error %.2e of the tensor's rms\n",
              file->metadata.count("transformers") ? file->metadata.at("transformers").c_str()
                                                   : "?",
              *loss, want_loss, worst_logit, worst_grad);
}

}  // namespace
}  // namespace fsdp::nn
