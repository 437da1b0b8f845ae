// The sharding runtime's pure parts on their own (src/fsdp): the flat layout of a unit, the
// dynamic loss scaler and the strategies' meshes. (The unit schedule: schedule_test.cc; the
// deferred frees: pending_frees_test.cc.)
#include <numeric>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "src/fsdp/flat_layout.h"
#include "src/fsdp/loss_scaler.h"
#include "src/fsdp/strategy.h"

namespace fsdp::internal {
namespace {

using ::testing::HasSubstr;

FlatTensor T(const char* name, std::vector<int64_t> shape, bool grad = true) {
  FlatTensor t;
  t.name = name;
  t.shape = shape;
  t.numel = std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<>());
  t.requires_grad = grad;
  t.weight_decay = shape.size() >= 2;
  return t;
}

// A [3, 5] weight, a [5] bias and a frozen [2] tensor: 22 elements, padded to 24 on 4 ranks
// (6 per shard). Shard 0: w[0,6); shard 1: w[6,12); shard 2: w[12,15) b[0,3); shard 3:
// b[3,5) f[0,2) and 2 elements of padding.
TEST(FlatLayoutTest, OffsetsPaddingAndPieces) {
  const FlatLayout l = FlatLayout::Build({T("w", {3, 5}), T("b", {5}), T("f", {2}, false)}, 4);
  EXPECT_EQ(l.numel, 22);
  EXPECT_EQ(l.padded_numel, 24);
  EXPECT_EQ(l.shard_numel, 6);
  EXPECT_EQ(l.tensors[0].offset, 0);
  EXPECT_EQ(l.tensors[1].offset, 15);
  EXPECT_EQ(l.tensors[2].offset, 20);
  auto pieces = [&](int r) {
    std::vector<std::string> out;
    for (const ShardPiece& p : l.Pieces(r)) {
      out.push_back(l.tensors[p.tensor].name + "[" + std::to_string(p.tensor_begin) + "," +
                    std::to_string(p.tensor_end) + ")@" + std::to_string(p.shard_offset));
    }
    return out;
  };
  EXPECT_THAT(pieces(0), ::testing::ElementsAre("w[0,6)@0"));
  EXPECT_THAT(pieces(1), ::testing::ElementsAre("w[6,12)@0"));
  EXPECT_THAT(pieces(2), ::testing::ElementsAre("w[12,15)@0", "b[0,3)@3"));
  EXPECT_THAT(pieces(3), ::testing::ElementsAre("b[3,5)@0", "f[0,2)@2"));
  // The optimizer's ranges leave the frozen tensor and the padding out; weight decay on the
  // matrix only.
  const std::vector<DecayRange> r3 = l.ShardDecayRanges(3);
  ASSERT_EQ(r3.size(), 1u);
  EXPECT_EQ(r3[0].begin, 0);
  EXPECT_EQ(r3[0].end, 2);
  EXPECT_FALSE(r3[0].weight_decay);
  const std::vector<DecayRange> r0 = l.ShardDecayRanges(0);
  ASSERT_EQ(r0.size(), 1u);
  EXPECT_TRUE(r0[0].weight_decay);
}

// A shard group larger than the unit: most shards hold only padding.
TEST(FlatLayoutTest, MoreRanksThanElements) {
  const FlatLayout l = FlatLayout::Build({T("x", {3})}, 8);
  EXPECT_EQ(l.shard_numel, 1);
  EXPECT_EQ(l.padded_numel, 8);
  for (int r = 0; r < 8; ++r) EXPECT_EQ(l.Pieces(r).size(), r < 3 ? 1u : 0u) << r;
}

// The fingerprint tells apart names, shapes and flags, and only them.
TEST(FlatLayoutTest, FingerprintSeesNamesShapesAndFlags) {
  const uint64_t base = FlatLayout::Build({T("w", {3, 5})}, 2).Fingerprint();
  EXPECT_EQ(base, FlatLayout::Build({T("w", {3, 5})}, 2).Fingerprint());
  EXPECT_NE(base, FlatLayout::Build({T("v", {3, 5})}, 2).Fingerprint());
  EXPECT_NE(base, FlatLayout::Build({T("w", {5, 3})}, 2).Fingerprint());
  EXPECT_NE(base, FlatLayout::Build({T("w", {3, 5}, false)}, 2).Fingerprint());
}

MixedPrecision Scaling(float initial, int interval) {
  MixedPrecision mp;
  mp.dynamic_loss_scale = true;
  mp.initial_loss_scale = initial;
  mp.growth_factor = 2;
  mp.backoff_factor = 0.5f;
  mp.growth_interval = interval;
  return mp;
}

// Backs off on every skipped step, grows after growth_interval good steps in a row, and
// counts skips (also without scaling, where the scale stays 1).
TEST(LossScalerTest, BacksOffGrowsAndCounts) {
  LossScaler s;
  s.Init(Scaling(1024, 3));
  EXPECT_EQ(s.scale(), 1024);
  s.OnSkipped();
  EXPECT_EQ(s.scale(), 512);
  s.OnGoodStep();
  s.OnGoodStep();
  EXPECT_EQ(s.scale(), 512);
  s.OnSkipped();  // the run of good steps starts again
  s.OnGoodStep();
  s.OnGoodStep();
  EXPECT_EQ(s.scale(), 256);
  s.OnGoodStep();
  EXPECT_EQ(s.scale(), 512);
  EXPECT_EQ(s.good_steps(), 0);
  EXPECT_EQ(s.skipped_steps(), 2);
  s.Restore(8, 1, 7);
  EXPECT_EQ(s.scale(), 8);
  EXPECT_EQ(s.good_steps(), 1);
  EXPECT_EQ(s.skipped_steps(), 7);
  LossScaler off;
  off.Init(MixedPrecision{});
  off.OnSkipped();
  off.OnGoodStep();
  EXPECT_EQ(off.scale(), 1);
  EXPECT_EQ(off.skipped_steps(), 1);
}

TEST(StrategyMeshTest, EveryStrategysMesh) {
  auto mesh = [](ShardingStrategy s, int hybrid, int world) {
    ShardingOptions o;
    o.strategy = s;
    o.hybrid_shard_size = hybrid;
    return StrategyMesh(o, world);
  };
  auto is = [](const absl::StatusOr<MeshShape>& m, int r, int s) {
    return m.ok() && m->replicate == r && m->shard == s;
  };
  EXPECT_TRUE(is(mesh(ShardingStrategy::kFullShard, 0, 8), 1, 8));
  EXPECT_TRUE(is(mesh(ShardingStrategy::kShardGradOp, 0, 8), 1, 8));
  EXPECT_TRUE(is(mesh(ShardingStrategy::kNoShard, 0, 8), 8, 1));
  EXPECT_TRUE(is(mesh(ShardingStrategy::kHybridShard, 2, 8), 4, 2));
  EXPECT_TRUE(is(mesh(ShardingStrategy::kHybridShardGradOp, 4, 8), 2, 4));
  EXPECT_TRUE(is(mesh(ShardingStrategy::kHybridShard, 8, 8), 1, 8));
  const absl::StatusOr<MeshShape> bad = mesh(ShardingStrategy::kHybridShard, 3, 8);
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("divide the world size (8)"));
}

}  // namespace
}  // namespace fsdp::internal
