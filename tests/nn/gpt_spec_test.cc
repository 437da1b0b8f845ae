// Parameter names, shapes, units, flat offsets and counts of the GPT configs (MODEL_SPEC.md).
#include <map>
#include <string>

#include "gtest/gtest.h"
#include "fsdp/nn/gpt.h"

namespace fsdp::nn {
namespace {

using Shape = std::vector<int64_t>;

// P = V C + T C + 2 C + L (12 C^2 + 13 C), counted by hand from the spec's tensor list.
int64_t FormulaCount(int64_t V, int64_t T, int64_t L, int64_t C) {
  return V * C + T * C + 2 * C + L * (12 * C * C + 13 * C);
}

TEST(GptSpecTest, ParameterCountsMatchTheSpecTable) {
  const std::map<std::string, int64_t> expected = {
      {"nano", 120576},           // ~0.12 M
      {"mini", 10844160},         // ~10.8 M
      {"gpt2", 124475904},        // ~124 M with V = 50304
      {"gpt2-medium", 354871296}, // ~350 M
      {"gpt2-xl", 1557686400},    // ~1.56 B
  };
  for (const auto& [name, count] : expected) {
    auto c = GptConfig::FromName(name);
    ASSERT_TRUE(c.ok()) << c.status();
    ASSERT_TRUE(c->Validate().ok()) << name;
    EXPECT_EQ(c->name, name);
    EXPECT_EQ(c->num_parameters(), count) << name;
    EXPECT_EQ(count, FormulaCount(c->vocab_size, c->block_size, c->num_layers, c->channels));
    EXPECT_EQ(c->num_flop_parameters(), count - int64_t{c->block_size} * c->channels);
  }
  const GptConfig xl = *GptConfig::FromName("gpt2-xl");
  EXPECT_EQ(xl.num_heads, 25);
  EXPECT_EQ(xl.channels / xl.num_heads, 64);
  const GptConfig mini = *GptConfig::FromName("mini");
  EXPECT_EQ(mini.vocab_size, 256);
  EXPECT_EQ(mini.block_size, 256);
  EXPECT_EQ(mini.num_layers, 6);
  EXPECT_EQ(mini.num_heads, 6);
}

TEST(GptSpecTest, FlopsPerStepFollowThePalmConvention) {
  const GptConfig nano = *GptConfig::FromName("nano");
  const int64_t tokens = 8 * 64;
  const double expected = 6.0 * (120576 - 64 * 64) * tokens + 12.0 * 2 * 64 * 64 * tokens;
  EXPECT_DOUBLE_EQ(nano.flops_per_step(tokens, 64), expected);
}

TEST(GptSpecTest, NanoNamesShapesUnitsAndOffsets) {
  const GptConfig c = *GptConfig::FromName("nano");
  const auto specs = GptParamSpecs(c);
  ASSERT_EQ(specs.size(), 4u + 12u * 2);
  ASSERT_EQ(GptNumUnits(c), 3);
  struct Expect {
    std::string name;
    Shape shape;
    int unit;
  };
  std::vector<Expect> want = {
      {"transformer.wte.weight", {256, 64}, 0},
      {"transformer.wpe.weight", {64, 64}, 0},
      {"transformer.ln_f.weight", {64}, 0},
      {"transformer.ln_f.bias", {64}, 0},
  };
  for (int i = 0; i < 2; ++i) {
    const std::string p = "transformer.h." + std::to_string(i) + ".";
    const int u = 1 + i;
    for (Expect e : std::vector<Expect>{
             {p + "ln_1.weight", {64}, u}, {p + "ln_1.bias", {64}, u},
             {p + "attn.c_attn.weight", {192, 64}, u}, {p + "attn.c_attn.bias", {192}, u},
             {p + "attn.c_proj.weight", {64, 64}, u}, {p + "attn.c_proj.bias", {64}, u},
             {p + "ln_2.weight", {64}, u}, {p + "ln_2.bias", {64}, u},
             {p + "mlp.c_fc.weight", {256, 64}, u}, {p + "mlp.c_fc.bias", {256}, u},
             {p + "mlp.c_proj.weight", {64, 256}, u}, {p + "mlp.c_proj.bias", {64}, u}}) {
      want.push_back(e);
    }
  }
  std::map<int, int64_t> next_offset;
  int64_t total = 0;
  for (size_t i = 0; i < specs.size(); ++i) {
    const ParamSpec& s = specs[i];
    EXPECT_EQ(s.name, want[i].name);
    EXPECT_EQ(s.shape, want[i].shape) << s.name;
    EXPECT_EQ(s.unit, want[i].unit) << s.name;
    int64_t numel = 1;
    for (int64_t d : s.shape) numel *= d;
    EXPECT_EQ(s.numel, numel) << s.name;
    EXPECT_EQ(s.offset, next_offset[s.unit]) << s.name << ": tensors of a unit are contiguous";
    EXPECT_EQ(s.weight_decay, s.shape.size() >= 2) << s.name;
    next_offset[s.unit] += s.numel;
    total += s.numel;
  }
  for (int u = 0; u < 3; ++u) EXPECT_EQ(GptUnitNumel(c, u), next_offset[u]) << "unit " << u;
  EXPECT_EQ(total, c.num_parameters());
}

TEST(GptSpecTest, MiniAndGpt2UnitsAddUp) {
  for (const char* name : {"mini", "gpt2"}) {
    const GptConfig c = *GptConfig::FromName(name);
    const auto specs = GptParamSpecs(c);
    EXPECT_EQ(specs.size(), 4u + 12u * c.num_layers);
    int64_t sum = 0;
    for (int u = 0; u < GptNumUnits(c); ++u) sum += GptUnitNumel(c, u);
    EXPECT_EQ(sum, c.num_parameters()) << name;
    const int64_t C = c.channels;
    EXPECT_EQ(GptUnitNumel(c, 0), int64_t{c.vocab_size} * C + int64_t{c.block_size} * C + 2 * C);
    EXPECT_EQ(GptUnitNumel(c, 1), 12 * C * C + 13 * C);
    EXPECT_EQ(specs.back().name, "transformer.h." + std::to_string(c.num_layers - 1) +
                                     ".mlp.c_proj.bias");
  }
}

TEST(GptSpecTest, UnitDecayRangesCoverTheUnitAndSliceIntoShards) {
  const GptConfig c = *GptConfig::FromName("nano");
  const auto specs = GptParamSpecs(c);
  const auto ranges = UnitDecayRanges(specs, 1);
  ASSERT_EQ(ranges.size(), 12u);
  EXPECT_EQ(ranges.front().begin, 0);
  EXPECT_EQ(ranges.back().end, GptUnitNumel(c, 1));
  EXPECT_FALSE(ranges[0].weight_decay);  // ln_1.weight
  EXPECT_TRUE(ranges[2].weight_decay);   // attn.c_attn.weight
  // A shard that starts inside ln_1.bias and ends inside c_attn.weight.
  const auto shard = SliceDecayRanges(ranges, 100, 300);
  ASSERT_EQ(shard.size(), 2u);
  EXPECT_EQ(shard[0].begin, 0);
  EXPECT_EQ(shard[0].end, 28);  // rest of ln_1.bias [64, 128)
  EXPECT_FALSE(shard[0].weight_decay);
  EXPECT_EQ(shard[1].begin, 28);
  EXPECT_EQ(shard[1].end, 200);
  EXPECT_TRUE(shard[1].weight_decay);
}

}  // namespace
}  // namespace fsdp::nn
