// HYBRID_SHARD's sharded accumulation with one rank per process, under `mpirun -np 4` (a 2 x 2
// mesh: two shard groups, two replicas): every micro-batch reduce-scatters inside its shard
// group, and only the last one all-reduces the accumulated shards across the replicas
// (ShardingRuntime::set_requires_all_reduce). The collectives are counted by the mpi
// communicators; the training matches the single-rank reference on the concatenated batch.
// collective_counts_test and sharding_parity_test run the same with ranks as threads.
#include <gtest/gtest.h>

#include "tests/fsdp/collective_counts.h"
#include "tests/fsdp/parity_util.h"
#include "tests/mpi_test_main.h"

namespace fsdp::testing {
namespace {

Communicator* g_world = nullptr;

TEST(AccumulationMpiTest, HybridAllReducesAcrossReplicasOncePerStep) {
  ASSERT_EQ(g_world->size(), 4) << "run under mpirun -np 4";
  CountCase c{.strategy = ShardingStrategy::kHybridShard, .world = 4, .hybrid_shard = 2,
              .micro_batches = 4, .accumulation = Accumulation::kSharded};
  const absl::Status s = CheckCollectiveCounts(*g_world, c);
  ASSERT_TRUE(s.ok()) << CountCaseName(c) << ": " << s;
}

TEST(AccumulationMpiTest, HybridShardedAccumulationMatchesTheReference) {
  ShardingOptions sharding;
  sharding.strategy = ShardingStrategy::kHybridShard;
  sharding.hybrid_shard_size = 2;
  TrainSpec spec;
  spec.steps = 6;
  spec.micro_batches = 3;
  spec.accumulation = Accumulation::kSharded;
  ExpectParityOnWorld(*g_world, sharding, spec, {Clip::kSome});
}

}  // namespace
}  // namespace fsdp::testing

int main(int argc, char** argv) {
  return fsdp::testing::MpiTestMain(argc, argv, "accumulation_mpi_test",
                                    [](fsdp::Communicator& world) {
                                      fsdp::testing::g_world = &world;
                                      return absl::OkStatus();
                                    });
}
