// Parity of every strategy with a single rank training on the concatenated batches: 20 AdamW
// steps on nano with clipping, ranks as threads.
#include <gtest/gtest.h>

#include <map>
#include <mutex>

#include "fsdp/local_world.h"
#include "tests/fsdp/parity_util.h"

namespace fsdp::testing {
namespace {

// Losses: relative to each loss. Parameters: ||got - ref|| / ||ref|| per unit (elementwise,
// Adam turns rounding-level differences of near-zero gradients into larger relative ones).
constexpr double kTol = 1e-5;

struct Case {
  ShardingStrategy strategy;
  int world;
  int hybrid_shard = 0;
  int micro_batches = 1;
};

std::string CaseName(const ::testing::TestParamInfo<Case>& info) {
  std::string s(StrategyName(info.param.strategy));
  s += "_N" + std::to_string(info.param.world);
  if (info.param.hybrid_shard) s += "_S" + std::to_string(info.param.hybrid_shard);
  if (info.param.micro_batches > 1) s += "_accum" + std::to_string(info.param.micro_batches);
  return s;
}

// The reference of a (world, micro_batches) pair, computed once.
const TrainResult& Reference(const TrainSpec& spec, int world) {
  static std::mutex mu;
  static std::map<std::pair<int, int>, TrainResult> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto key = std::make_pair(world, spec.micro_batches);
  auto it = cache.find(key);
  if (it == cache.end()) {
    auto r = TrainReference(spec, world, 2);
    EXPECT_TRUE(r.ok()) << r.status();
    it = cache.emplace(key, r.ok() ? *std::move(r) : TrainResult{}).first;
  }
  return it->second;
}

class ParityTest : public ::testing::TestWithParam<Case> {};

TEST_P(ParityTest, LossesAndParamsMatchSingleRankOnConcatenatedBatch) {
  const Case c = GetParam();
  TrainSpec spec;
  spec.micro_batches = c.micro_batches;
  const TrainResult& ref = Reference(spec, c.world);
  ASSERT_EQ(ref.losses.size(), static_cast<size_t>(spec.steps));
  ASSERT_GT(ref.clipped_steps, 0) << "max_grad_norm too large: clipping never ran";

  ShardingOptions sharding;
  sharding.strategy = c.strategy;
  sharding.hybrid_shard_size = c.hybrid_shard;
  std::vector<TrainResult> results(c.world);
  const int threads = std::max(1, 2 / c.world);
  absl::Status s = LocalWorld::Run(c.world, CommOptions{}, [&](Communicator& comm) {
    FSDP_ASSIGN_OR_RETURN(results[comm.rank()], TrainSharded(comm, spec, sharding, threads));
    return absl::OkStatus();
  });
  ASSERT_TRUE(s.ok()) << s;
  for (int r = 0; r < c.world; ++r) {
    const TrainResult& got = results[r];
    ASSERT_EQ(got.losses.size(), ref.losses.size());
    EXPECT_EQ(got.clipped_steps, ref.clipped_steps) << "rank " << r;
    for (size_t i = 0; i < ref.losses.size(); ++i) {
      EXPECT_NEAR(got.losses[i], ref.losses[i], kTol * ref.losses[i]) << "rank " << r
                                                                      << " step " << i;
    }
    ASSERT_EQ(got.params.size(), ref.params.size());
    for (size_t u = 0; u < ref.params.size(); ++u) {
      EXPECT_LT(NormRelDiff(got.params[u], ref.params[u]), kTol) << "rank " << r << " unit " << u;
    }
  }
  // The loss fell: the parity is over real training, not a constant.
  EXPECT_LT(ref.losses.back(), ref.losses.front() - 0.5);
}

INSTANTIATE_TEST_SUITE_P(
    Strategies, ParityTest,
    ::testing::Values(
        Case{ShardingStrategy::kFullShard, 1}, Case{ShardingStrategy::kFullShard, 2},
        Case{ShardingStrategy::kFullShard, 3}, Case{ShardingStrategy::kFullShard, 4},
        Case{ShardingStrategy::kShardGradOp, 1}, Case{ShardingStrategy::kShardGradOp, 2},
        Case{ShardingStrategy::kShardGradOp, 3}, Case{ShardingStrategy::kShardGradOp, 4},
        Case{ShardingStrategy::kNoShard, 1}, Case{ShardingStrategy::kNoShard, 2},
        Case{ShardingStrategy::kNoShard, 3}, Case{ShardingStrategy::kNoShard, 4},
        Case{ShardingStrategy::kHybridShard, 4, 2},
        Case{ShardingStrategy::kHybridShardGradOp, 4, 2},
        Case{ShardingStrategy::kHybridShard, 2, 1},
        Case{ShardingStrategy::kFullShard, 1, 0, 4}, Case{ShardingStrategy::kFullShard, 2, 0, 4},
        Case{ShardingStrategy::kFullShard, 3, 0, 4}, Case{ShardingStrategy::kShardGradOp, 2, 0, 4},
        Case{ShardingStrategy::kNoShard, 2, 0, 4}, Case{ShardingStrategy::kHybridShard, 4, 2, 4}),
    CaseName);

}  // namespace
}  // namespace fsdp::testing
