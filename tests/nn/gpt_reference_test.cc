// The model against the double-precision reference of reference_gpt.h: loss and logits, and
// every gradient against central finite differences of the reference.
#include <algorithm>
#include <cmath>
#include <random>

#include "gtest/gtest.h"
#include "tests/nn/reference_gpt.h"
#include "tests/nn/test_util.h"

namespace fsdp::nn {
namespace {

using testing::ReferenceGpt;
using testing::UnitBuffers;

// V=17 T=8 L=2 H=2 C=8: small enough to check every parameter's gradient.
GptConfig Tiny() { return {"tiny", 17, 8, 2, 2, 8}; }

// Random parameters well away from the init's symmetric point (biases 0, LN weights 1), so
// every term of the gradient matters.
void RandomParams(const GptConfig& config, UnitBuffers& u, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> n(0.0f, 1.0f);
  for (const ParamSpec& s : GptParamSpecs(config)) {
    float* p = u.params[s.unit].as<float>() + s.offset;
    const bool ln_weight = s.shape.size() == 1 && s.name.ends_with(".weight");
    for (int64_t j = 0; j < s.numel; ++j) {
      p[j] = ln_weight ? 1.0f + 0.2f * n(rng) : (s.shape.size() == 1 ? 0.1f : 0.3f) * n(rng);
    }
  }
}

ReferenceGpt::Units ToDouble(const GptConfig& config, const UnitBuffers& u) {
  ReferenceGpt::Units out;
  for (int i = 0; i < GptNumUnits(config); ++i) {
    const float* p = u.params[i].as<float>();
    out.emplace_back(p, p + GptUnitNumel(config, i));
  }
  return out;
}

using testing::RandomTokens;

struct Case {
  GptConfig config;
  int B, T;
  std::vector<int32_t> idx, tgt;
};

Case MakeCase(GptConfig config, int B, int T, uint64_t seed) {
  const int V = config.vocab_size;
  return {std::move(config), B, T, RandomTokens(B * T, V, seed), RandomTokens(B * T, V, seed + 1)};
}

TEST(GptReferenceTest, LossAndLogitsMatchDoubleReference) {
  auto backend = testing::MakeCpuBackend();
  Case c = MakeCase(Tiny(), 2, 5, 7);
  UnitBuffers u = UnitBuffers::Create(backend.get(), c.config);
  RandomParams(c.config, u, 1);
  auto gpt = Gpt::Create(c.config, backend.get(), c.B, c.T);
  ASSERT_TRUE(gpt.ok()) << gpt.status();
  auto loss = (*gpt)->Forward(u.param_views(), testing::I32(backend, c.idx), testing::I32(backend, c.tgt));
  ASSERT_TRUE(loss.ok()) << loss.status();

  std::vector<double> ref_logits;
  const double ref = ReferenceGpt(c.config).Loss(ToDouble(c.config, u), c.idx, c.tgt, c.B, c.T,
                                                 &ref_logits);
  EXPECT_NEAR(*loss, ref, 1e-5 * std::abs(ref));
  EXPECT_GT(ref, 1.0);  // far from a trivial model
  const float* logits = (*gpt)->logits().host_as<float>();
  for (size_t i = 0; i < ref_logits.size(); ++i) {
    ASSERT_NEAR(logits[i], ref_logits[i], 1e-5 * (1 + std::abs(ref_logits[i]))) << "logit " << i;
  }
}

// Model gradient of `c` at the parameters of `u` (written into u.grads).
void ModelGradients(Backend* backend, const Case& c, UnitBuffers& u) {
  auto gpt = Gpt::Create(c.config, backend, c.B, c.T);
  ASSERT_TRUE(gpt.ok()) << gpt.status();
  u.ZeroGrads();
  ASSERT_TRUE((*gpt)->Forward(u.param_views(), testing::I32(backend, c.idx), testing::I32(backend, c.tgt)).ok());
  ASSERT_TRUE((*gpt)->Backward(u.param_views(), u.grad_views()).ok());
}

// Central difference of the reference loss in parameter (unit, j).
double FiniteDifference(const ReferenceGpt& ref, ReferenceGpt::Units& p, const Case& c, int unit,
                        int64_t j, double h) {
  const double saved = p[unit][j];
  p[unit][j] = saved + h;
  const double up = ref.Loss(p, c.idx, c.tgt, c.B, c.T);
  p[unit][j] = saved - h;
  const double down = ref.Loss(p, c.idx, c.tgt, c.B, c.T);
  p[unit][j] = saved;
  return (up - down) / (2 * h);
}

TEST(GptReferenceTest, EveryGradientMatchesFiniteDifferencesOnTinyModel) {
  auto backend = testing::MakeCpuBackend();
  Case c = MakeCase(Tiny(), 2, 5, 11);
  UnitBuffers u = UnitBuffers::Create(backend.get(), c.config);
  RandomParams(c.config, u, 2);
  ModelGradients(backend.get(), c, u);
  ReferenceGpt ref(c.config);
  ReferenceGpt::Units p = ToDouble(c.config, u);
  int checked = 0;
  double worst = 0;
  for (const ParamSpec& s : GptParamSpecs(c.config)) {
    for (int64_t j = 0; j < s.numel; ++j) {
      const double fd = FiniteDifference(ref, p, c, s.unit, s.offset + j, 1e-5);
      const double g = u.grads[s.unit].as<float>()[s.offset + j];
      const double err = std::abs(g - fd) / (std::abs(fd) + 1e-4);
      worst = std::max(worst, err);
      ASSERT_LT(err, 1e-3) << s.name << "[" << j << "]: model " << g << ", finite difference "
                           << fd;
      ++checked;
    }
  }
  EXPECT_EQ(checked, c.config.num_parameters());
  std::printf("tiny: %d gradients checked, worst relative error %.2e\n", checked, worst);
}

TEST(GptReferenceTest, SampledGradientsMatchFiniteDifferencesOnNano) {
  auto backend = testing::MakeCpuBackend();
  Case c = MakeCase(*GptConfig::FromName("nano"), 2, 16, 21);
  UnitBuffers u = UnitBuffers::Create(backend.get(), c.config);
  u.Init(c.config, 3);
  ModelGradients(backend.get(), c, u);
  ReferenceGpt ref(c.config);
  ReferenceGpt::Units p = ToDouble(c.config, u);
  std::mt19937 rng(5);
  int checked = 0;
  double worst = 0;
  // Two elements of every tensor (56 in all); for wte/wpe only rows the batch touches have a
  // non-zero gradient, so pick one of those and one anywhere.
  for (const ParamSpec& s : GptParamSpecs(c.config)) {
    const float* g = u.grads[s.unit].as<float>() + s.offset;
    double scale = 0;  // RMS of the tensor's gradient: the size of an error that matters
    for (int64_t j = 0; j < s.numel; ++j) scale += static_cast<double>(g[j]) * g[j];
    scale = std::sqrt(scale / s.numel);
    int64_t touched = static_cast<int64_t>(rng() % s.numel);
    if (s.shape.size() == 2 && s.shape[0] >= c.config.vocab_size / 4) {
      const int64_t row = s.name.find("wte") != std::string::npos ? c.idx[rng() % c.idx.size()]
                                                                 : rng() % c.T;
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
  EXPECT_EQ(checked, 2 * static_cast<int>(GptParamSpecs(c.config).size()));
  std::printf("nano: %d gradients checked, worst relative error %.2e\n", checked, worst);
}

TEST(GptReferenceTest, BackwardAccumulatesSkipsNullAndAllowsRecompute) {
  auto backend = testing::MakeCpuBackend();
  Case c = MakeCase(Tiny(), 2, 5, 31);
  UnitBuffers u = UnitBuffers::Create(backend.get(), c.config);
  RandomParams(c.config, u, 4);
  auto gpt = *Gpt::Create(c.config, backend.get(), c.B, c.T);
  auto params = u.param_views();
  auto snapshot = [&] {
    std::vector<std::vector<float>> g;
    for (int i = 0; i < gpt->num_units(); ++i) {
      const float* p = u.grads[i].as<float>();
      g.emplace_back(p, p + gpt->unit_numel(i));
    }
    return g;
  };
  ASSERT_TRUE(gpt->Forward(params, testing::I32(backend, c.idx), testing::I32(backend, c.tgt)).ok());
  ASSERT_TRUE(gpt->Backward(params, u.grad_views()).ok());
  const auto once = snapshot();

  // A second step without zeroing adds the same gradient again.
  ASSERT_TRUE(gpt->Forward(params, testing::I32(backend, c.idx), testing::I32(backend, c.tgt)).ok());
  ASSERT_TRUE(gpt->Backward(params, u.grad_views()).ok());
  const auto twice = snapshot();
  for (size_t i = 0; i < once.size(); ++i) {
    for (size_t j = 0; j < once[i].size(); ++j) {
      ASSERT_NEAR(twice[i][j], 2 * once[i][j], 1e-6 + 1e-6 * std::abs(once[i][j]));
    }
  }

  // Staged, recomputing block 1 and then block 0 just before their backward (activation
  // checkpointing), with block 0's gradient skipped: the other gradients are unchanged.
  u.ZeroGrads();
  auto grads = u.grad_views();
  ASSERT_TRUE(gpt->Forward(params, testing::I32(backend, c.idx), testing::I32(backend, c.tgt)).ok());
  ASSERT_TRUE(gpt->BackwardHead(params[0], grads[0]).ok());
  ASSERT_TRUE(gpt->ForwardBlock(1, params[2]).ok());
  ASSERT_TRUE(gpt->BackwardBlock(1, params[2], grads[2]).ok());
  ASSERT_TRUE(gpt->ForwardBlock(0, params[1]).ok());
  ASSERT_TRUE(gpt->BackwardBlock(0, params[1], View{}).ok());
  ASSERT_TRUE(gpt->BackwardEmbed(grads[0]).ok());
  const auto staged = snapshot();
  for (int i : {0, 2}) EXPECT_EQ(staged[i], once[i]) << "unit " << i;
  EXPECT_TRUE(std::all_of(staged[1].begin(), staged[1].end(), [](float x) { return x == 0; }));
}

}  // namespace
}  // namespace fsdp::nn
