// Initialisation: any slice equals the same part of the whole tensor; the statistics of
// MODEL_SPEC.md; determinism in the seed.
#include <cmath>
#include <vector>

#include "gtest/gtest.h"
#include "fsdp/nn/gpt.h"

namespace fsdp::nn {
namespace {

const ParamSpec& Find(const std::vector<ParamSpec>& specs, const std::string& name) {
  for (const ParamSpec& s : specs) {
    if (s.name == name) return s;
  }
  ADD_FAILURE() << "no parameter " << name;
  return specs.front();
}

std::vector<float> Whole(const GptConfig& c, const ParamSpec& s, uint64_t seed) {
  std::vector<float> v(s.numel);
  InitParamSlice(c, s, seed, 0, s.numel, v.data());
  return v;
}

TEST(GptInitTest, AnySliceEqualsThePartOfTheWholeTensor) {
  const GptConfig c = *GptConfig::FromName("nano");
  for (const ParamSpec& s : GptParamSpecs(c)) {
    const std::vector<float> whole = Whole(c, s, 42);
    // Cuts that do not align with rows, plus empty and one-element slices.
    for (auto [b, e] : std::vector<std::pair<int64_t, int64_t>>{
             {0, 1}, {3, 3}, {7, s.numel / 3 + 1}, {s.numel / 3 + 1, s.numel}, {s.numel - 1, s.numel}}) {
      std::vector<float> part(e - b);
      InitParamSlice(c, s, 42, b, e, part.data());
      for (int64_t j = b; j < e; ++j) ASSERT_EQ(part[j - b], whole[j]) << s.name << "[" << j << "]";
    }
  }
  // InitUnit is the concatenation of its tensors.
  std::vector<float> unit(GptUnitNumel(c, 1));
  InitUnit(c, 1, 42, unit.data());
  const auto specs = GptParamSpecs(c);
  const ParamSpec& fc = Find(specs, "transformer.h.0.mlp.c_fc.weight");
  EXPECT_EQ(std::vector<float>(unit.begin() + fc.offset, unit.begin() + fc.offset + fc.numel),
            Whole(c, fc, 42));
}

struct Stats {
  double mean = 0, std = 0;
};
Stats Moments(const std::vector<float>& v) {
  Stats s;
  for (float x : v) s.mean += x;
  s.mean /= v.size();
  for (float x : v) s.std += (x - s.mean) * (x - s.mean);
  s.std = std::sqrt(s.std / v.size());
  return s;
}

TEST(GptInitTest, StatisticsFollowTheSpec) {
  const GptConfig c = *GptConfig::FromName("mini");
  const auto specs = GptParamSpecs(c);
  const double proj_std = 0.02 / std::sqrt(2.0 * c.num_layers);
  struct Want {
    const char* name;
    double std;
  };
  for (Want w : {Want{"transformer.wte.weight", 0.02}, Want{"transformer.wpe.weight", 0.02},
                 Want{"transformer.h.0.attn.c_attn.weight", 0.02},
                 Want{"transformer.h.3.mlp.c_fc.weight", 0.02},
                 Want{"transformer.h.0.attn.c_proj.weight", proj_std},
                 Want{"transformer.h.5.mlp.c_proj.weight", proj_std}}) {
    const Stats s = Moments(Whole(c, Find(specs, w.name), 1));
    // >= 98k samples: the sample std is within 1% of the true one with overwhelming odds.
    EXPECT_NEAR(s.std, w.std, 0.01 * w.std) << w.name;
    EXPECT_NEAR(s.mean, 0.0, 0.02 * w.std) << w.name;
  }
  for (const ParamSpec& s : specs) {
    if (s.shape.size() != 1) continue;
    const float want = s.name.ends_with(".weight") ? 1.0f : 0.0f;  // LN weights 1, biases 0
    for (float x : Whole(c, s, 1)) ASSERT_EQ(x, want) << s.name;
  }
}

TEST(GptInitTest, SameSeedSameModelOtherSeedOtherModel) {
  const GptConfig c = *GptConfig::FromName("nano");
  const auto specs = GptParamSpecs(c);
  const ParamSpec& wte = Find(specs, "transformer.wte.weight");
  EXPECT_EQ(Whole(c, wte, 7), Whole(c, wte, 7));
  const auto a = Whole(c, wte, 7), b = Whole(c, wte, 8);
  int equal = 0;
  for (size_t i = 0; i < a.size(); ++i) equal += a[i] == b[i];
  EXPECT_LT(equal, 10);
  // Tensors of the same shape draw different numbers (the name is part of the key).
  const auto fc0 = Whole(c, Find(specs, "transformer.h.0.mlp.c_fc.weight"), 7);
  const auto fc1 = Whole(c, Find(specs, "transformer.h.1.mlp.c_fc.weight"), 7);
  EXPECT_NE(fc0, fc1);
}

}  // namespace
}  // namespace fsdp::nn
