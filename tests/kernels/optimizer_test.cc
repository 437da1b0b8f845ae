// AdamW and SGD updates over several steps against double references of the formulas in
// MODEL_SPEC.md / torch.optim.
#include <cmath>

#include "fsdp/kernels_cpu.h"
#include "tests/kernels/reference.h"

namespace fsdp::kernels::cpu {
namespace {

using namespace fsdp::kernels::cpu::testing;

struct AdamWConfig {
  float lr, beta1, beta2, eps, wd;
};

class AdamWTest : public ::testing::TestWithParam<AdamWConfig> {};

TEST_P(AdamWTest, MatchesDoubleReferenceOverSteps) {
  const AdamWConfig cfg = GetParam();
  const int64_t n = 1003;  // odd: exercises the vector tail
  std::mt19937 rng(17);
  Vec p = Random(n, rng), m(n, 0.0f), v(n, 0.0f);
  DVec rp = ToDouble(p), rm(n, 0.0), rv(n, 0.0);
  for (int64_t step = 1; step <= 6; ++step) {
    Vec g = Random(n, rng, -0.5f, 0.5f);
    if (step == 3) g.assign(n, 0.0f);  // a zero gradient still decays and moves by momentum
    adamw_update(p.data(), g.data(), m.data(), v.data(), n,
                 AdamWStepScalars(cfg.lr, cfg.beta1, cfg.beta2, cfg.eps, cfg.wd, step));
    const double b1 = cfg.beta1, b2 = cfg.beta2;
    for (int64_t i = 0; i < n; ++i) {
      rp[i] -= double{cfg.lr} * cfg.wd * rp[i];
      rm[i] = b1 * rm[i] + (1 - b1) * g[i];
      rv[i] = b2 * rv[i] + (1 - b2) * double{g[i]} * g[i];
      const double mhat = rm[i] / (1 - std::pow(b1, step));
      const double vhat = rv[i] / (1 - std::pow(b2, step));
      rp[i] -= cfg.lr * mhat / (std::sqrt(vhat) + cfg.eps);
    }
    const std::string at = absl::StrCat(" at step ", step);
    ExpectClose(m, rm, 1e-7, 1e-5, absl::StrCat("m", at));
    ExpectClose(v, rv, 1e-9, 1e-5, absl::StrCat("v", at));
    // The update is ~lr per step; its relative error is what f32 allows.
    ExpectClose(p, rp, 2e-6 + 1e-4 * cfg.lr, 1e-6, absl::StrCat("param", at));
  }
}

INSTANTIATE_TEST_SUITE_P(Configs, AdamWTest,
                         ::testing::Values(AdamWConfig{3e-4f, 0.9f, 0.95f, 1e-8f, 0.1f},
                                           AdamWConfig{1e-2f, 0.9f, 0.999f, 1e-8f, 0.0f},
                                           AdamWConfig{1e-3f, 0.8f, 0.9f, 1e-3f, 0.5f}));

TEST(AdamW, StepOneIsSignTimesLr) {
  // With bias correction, the first step is lr * g / (|g| + eps) = ~lr * sign(g).
  const float g[3] = {0.3f, -2.0f, 1e-3f};
  float p[3] = {1.0f, 1.0f, 1.0f}, m[3] = {}, v[3] = {};
  adamw_update(p, g, m, v, 3, AdamWStepScalars(0.01f, 0.9f, 0.95f, 1e-8f, 0.0f, 1));
  EXPECT_NEAR(p[0], 0.99f, 1e-6);
  EXPECT_NEAR(p[1], 1.01f, 1e-6);
  EXPECT_NEAR(p[2], 0.99f, 1e-5);
}

struct SgdConfig {
  float lr, momentum, dampening, wd;
  bool nesterov;
};

class SgdTest : public ::testing::TestWithParam<SgdConfig> {};

TEST_P(SgdTest, MatchesDoubleReferenceOverSteps) {
  const SgdConfig cfg = GetParam();
  const int64_t n = 517;
  std::mt19937 rng(23);
  Vec p = Random(n, rng), buf(n, 0.0f);
  DVec rp = ToDouble(p), rbuf(n, 0.0);
  for (int step = 0; step < 5; ++step) {
    const Vec g = Random(n, rng);
    sgd_update(p.data(), g.data(), cfg.momentum != 0.0f ? buf.data() : nullptr, n, cfg.lr,
               cfg.momentum, cfg.dampening, cfg.wd, cfg.nesterov, step == 0);
    for (int64_t i = 0; i < n; ++i) {
      const double gp = g[i] + double{cfg.wd} * rp[i];
      double d = gp;
      if (cfg.momentum != 0.0f) {
        rbuf[i] = step == 0 ? gp : cfg.momentum * rbuf[i] + (1.0 - cfg.dampening) * gp;
        d = cfg.nesterov ? gp + cfg.momentum * rbuf[i] : rbuf[i];
      }
      rp[i] -= cfg.lr * d;
    }
    const std::string at = absl::StrCat(" at step ", step);
    ExpectClose(p, rp, 1e-6, 1e-5, absl::StrCat("param", at));
    if (cfg.momentum != 0.0f) ExpectClose(buf, rbuf, 1e-6, 1e-5, absl::StrCat("buf", at));
  }
}

INSTANTIATE_TEST_SUITE_P(Configs, SgdTest,
                         ::testing::Values(SgdConfig{0.1f, 0.0f, 0.0f, 0.0f, false},
                                           SgdConfig{0.1f, 0.0f, 0.0f, 0.01f, false},
                                           SgdConfig{0.05f, 0.9f, 0.0f, 0.0f, false},
                                           SgdConfig{0.05f, 0.9f, 0.1f, 0.001f, false},
                                           SgdConfig{0.05f, 0.9f, 0.0f, 0.01f, true},
                                           SgdConfig{0.02f, 0.5f, 0.5f, 0.0f, true}));

TEST(Sgd, LargeParallelRunMatchesSmallRuns) {
  // Above the parallel threshold the result equals element-wise updates done in pieces.
  const int64_t n = 100003;
  std::mt19937 rng(29);
  const Vec p0 = Random(n, rng), g = Random(n, rng), b0 = Random(n, rng);
  Vec p = p0, b = b0, q = p0, c = b0;
  sgd_update(p.data(), g.data(), b.data(), n, 0.1f, 0.9f, 0.1f, 0.01f, true, false);
  for (int64_t i = 0; i < n; i += 1000) {
    const int64_t len = std::min<int64_t>(1000, n - i);
    sgd_update(q.data() + i, g.data() + i, c.data() + i, len, 0.1f, 0.9f, 0.1f, 0.01f, true,
               false);
  }
  EXPECT_EQ(p, q);
  EXPECT_EQ(b, c);
}

}  // namespace
}  // namespace fsdp::kernels::cpu
