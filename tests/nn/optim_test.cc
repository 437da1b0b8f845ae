// Optimizers on a flat buffer with mixed decay ranges against per-element double references
// of PyTorch's AdamW and SGD; schedules; the clip coefficient.
#include <cmath>
#include <random>
#include <vector>

#include "fsdp/optim.h"
#include "gtest/gtest.h"
#include "tests/nn/test_util.h"

namespace fsdp {
namespace {

constexpr int64_t kN = 40;
// Unsorted on purpose, with a gap [25, 30) that no range covers (shard padding).
const std::vector<DecayRange> kRanges = {
    {15, 25, true}, {0, 10, true}, {10, 15, false}, {30, 40, false}};

bool Decays(int64_t i) { return i < 10 || (i >= 15 && i < 25); }
bool Covered(int64_t i) { return i < 25 || i >= 30; }

std::vector<float> RandomVector(std::mt19937& rng, float scale) {
  std::normal_distribution<float> n(0.0f, scale);
  std::vector<float> v(kN);
  for (float& x : v) x = n(rng);
  return v;
}

TEST(OptimTest, AdamWMatchesPyTorchSemanticsPerElement) {
  auto backend = nn::testing::MakeCpuBackend(1);
  AdamWOptions o{.lr = 1e-2f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.1f};
  auto opt = AdamW::Create(backend.get(), kN, kRanges, o);
  ASSERT_TRUE(opt.ok()) << opt.status();
  std::mt19937 rng(1);
  std::vector<float> p = RandomVector(rng, 1.0f);
  std::vector<double> rp(p.begin(), p.end()), rm(kN, 0.0), rv(kN, 0.0);
  for (int t = 1; t <= 6; ++t) {
    const std::vector<float> g = RandomVector(rng, 0.5f);
    const float lr = 1e-2f / t;  // as a schedule would change it
    (*opt)->set_lr(lr);
    ASSERT_TRUE((*opt)->Step(nn::testing::F32(backend, p), nn::testing::F32(backend, g)).ok());
    for (int64_t i = 0; i < kN; ++i) {
      if (!Covered(i)) continue;
      if (Decays(i)) rp[i] -= static_cast<double>(lr) * o.weight_decay * rp[i];
      rm[i] = o.beta1 * rm[i] + (1 - static_cast<double>(o.beta1)) * g[i];
      rv[i] = o.beta2 * rv[i] + (1 - static_cast<double>(o.beta2)) * g[i] * g[i];
      const double mhat = rm[i] / (1 - std::pow(static_cast<double>(o.beta1), t));
      const double vhat = rv[i] / (1 - std::pow(static_cast<double>(o.beta2), t));
      rp[i] -= lr * mhat / (std::sqrt(vhat) + o.eps);
    }
  }
  EXPECT_EQ((*opt)->step(), 6);
  const auto state = (*opt)->state();
  ASSERT_EQ(state.size(), 2u);
  EXPECT_EQ(state[0].name, "exp_avg");
  for (int64_t i = 0; i < kN; ++i) {
    EXPECT_NEAR(p[i], rp[i], 2e-6 * (1 + std::abs(rp[i]))) << "param " << i;
    EXPECT_NEAR(state[0].data.host_as<float>()[i], rm[i], 1e-6) << "m " << i;
    EXPECT_NEAR(state[1].data.host_as<float>()[i], rv[i], 1e-6) << "v " << i;
  }
}

TEST(OptimTest, SgdMatchesPyTorchSemanticsPerElement) {
  for (SgdOptions o : {SgdOptions{.lr = 0.1f},
                       SgdOptions{.lr = 0.1f, .momentum = 0.9f, .dampening = 0.1f,
                                  .weight_decay = 0.01f},
                       SgdOptions{.lr = 0.05f, .momentum = 0.8f, .weight_decay = 0.02f,
                                  .nesterov = true}}) {
    auto backend = nn::testing::MakeCpuBackend(1);
    auto opt = Sgd::Create(backend.get(), kN, kRanges, o);
    ASSERT_TRUE(opt.ok()) << opt.status();
    EXPECT_EQ((*opt)->state().size(), o.momentum != 0 ? 1u : 0u);
    std::mt19937 rng(2);
    std::vector<float> p = RandomVector(rng, 1.0f);
    std::vector<double> rp(p.begin(), p.end()), buf(kN, 0.0);
    for (int t = 1; t <= 4; ++t) {
      const std::vector<float> g = RandomVector(rng, 0.5f);
      ASSERT_TRUE((*opt)->Step(nn::testing::F32(backend, p), nn::testing::F32(backend, g)).ok());
      for (int64_t i = 0; i < kN; ++i) {
        if (!Covered(i)) continue;
        double d = g[i] + (Decays(i) ? o.weight_decay * rp[i] : 0.0);
        if (o.momentum != 0) {
          buf[i] = t == 1 ? d : o.momentum * buf[i] + (1 - static_cast<double>(o.dampening)) * d;
          d = o.nesterov ? d + o.momentum * buf[i] : buf[i];
        }
        rp[i] -= o.lr * d;
      }
    }
    for (int64_t i = 0; i < kN; ++i) {
      EXPECT_NEAR(p[i], rp[i], 2e-6 * (1 + std::abs(rp[i]))) << "param " << i;
    }
  }
}

TEST(OptimTest, RejectsBadRangesAndOptions) {
  auto backend = nn::testing::MakeCpuBackend(1);
  EXPECT_FALSE(AdamW::Create(backend.get(), 10, {{0, 6, true}, {5, 10, false}}).ok());
  EXPECT_FALSE(AdamW::Create(backend.get(), 10, {{0, 11, true}}).ok());
  EXPECT_FALSE(AdamW::Create(backend.get(), 10, {{-1, 3, true}}).ok());
  EXPECT_FALSE(AdamW::Create(backend.get(), 10, {}, {.beta1 = 1.0f}).ok());
  EXPECT_FALSE(AdamW::Create(nullptr, 10, {}).ok());
  EXPECT_FALSE(Sgd::Create(backend.get(), 10, {}, {.momentum = 0.9f, .dampening = 0.5f,
                                                   .nesterov = true}).ok());
  auto ok = AdamW::Create(backend.get(), 10, {{0, 10, true}});
  ASSERT_TRUE(ok.ok());
  EXPECT_FALSE((*ok)->Step(View{}, View{}).ok());
  EXPECT_EQ((*ok)->options().lr, 3e-4f);  // MODEL_SPEC.md defaults
  EXPECT_EQ((*ok)->options().beta2, 0.95f);
  EXPECT_EQ((*ok)->options().weight_decay, 0.1f);
}

TEST(OptimTest, SliceDecayRangesClipsAndRebases) {
  const std::vector<DecayRange> unit = {{0, 10, false}, {10, 50, true}, {50, 60, false}};
  const auto s = SliceDecayRanges(unit, 5, 55);
  ASSERT_EQ(s.size(), 3u);
  EXPECT_EQ(s[0].begin, 0);
  EXPECT_EQ(s[0].end, 5);
  EXPECT_EQ(s[1].begin, 5);
  EXPECT_EQ(s[1].end, 45);
  EXPECT_TRUE(s[1].weight_decay);
  EXPECT_EQ(s[2].end, 50);
  EXPECT_TRUE(SliceDecayRanges(unit, 60, 70).empty());  // all padding
}

TEST(OptimTest, WarmupCosineSchedule) {
  const WarmupCosine s(10, 110, 1e-3f, 1e-4f);
  EXPECT_FLOAT_EQ(s.At(0), 1e-4f);
  EXPECT_FLOAT_EQ(s.At(4), 5e-4f);
  EXPECT_FLOAT_EQ(s.At(9), 1e-3f);
  EXPECT_FLOAT_EQ(s.At(10), 1e-3f);
  EXPECT_FLOAT_EQ(s.At(60), 5.5e-4f);  // half way down the cosine
  EXPECT_FLOAT_EQ(s.At(110), 1e-4f);
  EXPECT_FLOAT_EQ(s.At(1000), 1e-4f);
  for (int64_t t = 10; t < 110; ++t) EXPECT_GE(s.At(t), s.At(t + 1));
  EXPECT_EQ(ConstantLr(0.5f).At(123), 0.5f);
}

TEST(OptimTest, ClipCoefficient) {
  EXPECT_FLOAT_EQ(ClipCoefficient(2.0, 1.0f), 1.0f / (2.0f + 1e-6f));
  EXPECT_EQ(ClipCoefficient(0.5, 1.0f), 1.0f);
  EXPECT_EQ(ClipCoefficient(1.0, 1.0f), 1.0f);  // only strictly above the limit
  EXPECT_EQ(ClipCoefficient(100.0, 0.0f), 1.0f);  // disabled
}

}  // namespace
}  // namespace fsdp
