// The parity tests of the sharding runtime with one rank per process, under
// `mpirun -np 2` and `-np 3` (ctest registers both). Each process computes the single-rank
// reference itself and compares its own results with it.
#include <gtest/gtest.h>

#include "fsdp/mpi_world.h"
#include "tests/fsdp/parity_util.h"

namespace fsdp::testing {
namespace {

Communicator* g_world = nullptr;

void ExpectParity(ShardingOptions sharding, int micro_batches) {
  TrainSpec spec;
  spec.steps = 10;
  spec.micro_batches = micro_batches;
  auto ref = TrainReference(spec, g_world->size(), 1);
  ASSERT_TRUE(ref.ok()) << ref.status();
  auto got = TrainSharded(*g_world, spec, sharding, 1);
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_EQ(got->losses.size(), ref->losses.size());
  for (size_t i = 0; i < ref->losses.size(); ++i) {
    EXPECT_NEAR(got->losses[i], ref->losses[i], 1e-5 * ref->losses[i]) << "step " << i;
  }
  for (size_t u = 0; u < ref->params.size(); ++u) {
    EXPECT_LT(NormRelDiff(got->params[u], ref->params[u]), 1e-5) << "unit " << u;
  }
}

TEST(ShardingMpiTest, FullShard) { ExpectParity({ShardingStrategy::kFullShard}, 1); }
TEST(ShardingMpiTest, ShardGradOp) { ExpectParity({ShardingStrategy::kShardGradOp}, 1); }
TEST(ShardingMpiTest, NoShard) { ExpectParity({ShardingStrategy::kNoShard}, 1); }
TEST(ShardingMpiTest, FullShardWithAccumulation) {
  ExpectParity({ShardingStrategy::kFullShard}, 4);
}
TEST(ShardingMpiTest, HybridShardOneRankPerShardGroup) {
  ShardingOptions o{ShardingStrategy::kHybridShard};
  o.hybrid_shard_size = 1;  // the only mesh besides 1 x N that 2 and 3 processes allow
  ExpectParity(o, 1);
}

}  // namespace
}  // namespace fsdp::testing

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  auto world = fsdp::CreateMpiWorld();
  if (!world.ok()) {
    std::fprintf(stderr, "sharding_mpi_test: %s\n", world.status().ToString().c_str());
    return 1;
  }
  fsdp::testing::g_world = world->get();
  const int rc = RUN_ALL_TESTS();
  world->reset();
  fsdp::ShutdownMpi();
  return rc;
}
