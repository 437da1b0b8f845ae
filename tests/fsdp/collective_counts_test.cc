// The collectives each forward, backward and Step() issues, per group, for every strategy,
// prefetch depth (off, 1, 2), accumulation mode (1 micro-batch; 4 with no_sync until the last;
// 4 reduce-scattered each, all-reduced across replicas in the last) and activation
// checkpointing setting (off, every block), counted by the communicators themselves
// (tests/fsdp/collective_counts.h has the formulas). Ranks as threads on the CPU backend, whose
// data plane is the groups' own communicators.
#include <gtest/gtest.h>

#include <vector>

#include "fsdp/local_world.h"
#include "tests/fsdp/collective_counts.h"

namespace fsdp::testing {
namespace {

class CollectiveCountsTest : public ::testing::TestWithParam<CountCase> {};

TEST_P(CollectiveCountsTest, PerForwardBackwardAndStep) {
  const CountCase c = GetParam();
  CommOptions o;
  o.timeout = absl::Seconds(20);
  const absl::Status s = LocalWorld::Run(c.world, o, [&](Communicator& comm) {
    return CheckCollectiveCounts(comm, c);
  });
  ASSERT_TRUE(s.ok()) << s;
}

std::vector<CountCase> AllCases() {
  struct Mesh {
    ShardingStrategy strategy;
    int world, hybrid_shard;
  };
  // HYBRID on 2 x 2, so that both groups have two ranks; the others on 2 ranks.
  const Mesh meshes[] = {{ShardingStrategy::kFullShard, 2, 0},
                         {ShardingStrategy::kShardGradOp, 2, 0},
                         {ShardingStrategy::kNoShard, 2, 0},
                         {ShardingStrategy::kHybridShard, 4, 2},
                         {ShardingStrategy::kHybridShardGradOp, 4, 2}};
  std::vector<CountCase> out;
  for (const Mesh& m : meshes) {
    for (int prefetch : {0, 1, 2}) {
      for (int micro_batches : {1, 4}) {
        for (bool checkpoint : {false, true}) {
          CountCase c;
          c.strategy = m.strategy;
          c.world = m.world;
          c.hybrid_shard = m.hybrid_shard;
          c.prefetch = prefetch;
          c.micro_batches = micro_batches;
          c.checkpoint = checkpoint;
          out.push_back(c);
        }
      }
    }
  }
  // Gradients reduce-scattered every micro-batch: HYBRID all-reduces across replicas only in
  // the last one; without replicas each micro-batch reduces as with one.
  for (const Mesh& m : meshes) {
    CountCase c;
    c.strategy = m.strategy;
    c.world = m.world;
    c.hybrid_shard = m.hybrid_shard;
    c.micro_batches = 4;
    c.accumulation = Accumulation::kSharded;
    out.push_back(c);
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(EveryStrategy, CollectiveCountsTest, ::testing::ValuesIn(AllCases()),
                         [](const ::testing::TestParamInfo<CountCase>& info) {
                           return CountCaseName(info.param);
                         });

}  // namespace
}  // namespace fsdp::testing
