// The parity tests of the sharding runtime with one rank per process, under
// `mpirun -np 2` and `-np 3` (ctest registers both). Each process computes the single-rank
// reference itself and compares its own results with it.
#include <gtest/gtest.h>

#include "fsdp/cpu_backend.h"
#include "fsdp/mpi_world.h"
#include "tests/fsdp/collective_counts.h"
#include "tests/fsdp/parity_util.h"
#include "tests/mpi_test_main.h"

namespace fsdp::testing {
namespace {

Communicator* g_world = nullptr;

ShardingOptions With(ShardingStrategy strategy, int hybrid_shard = 0) {
  ShardingOptions o;
  o.strategy = strategy;
  o.hybrid_shard_size = hybrid_shard;
  return o;
}

// Parity with the single-rank reference for each way of clipping (tests/fsdp/parity_util.h).
void ExpectParity(ShardingOptions sharding, int micro_batches,
                  const std::string& model = "nano") {
  TrainSpec spec;
  spec.config = model;
  spec.steps = 10;
  spec.micro_batches = micro_batches;
  ExpectParityOnWorld(*g_world, sharding, spec, {Clip::kOff, Clip::kSome, Clip::kAlways});
}

TEST(ShardingMpiTest, FullShard) { ExpectParity(With(ShardingStrategy::kFullShard), 1); }
TEST(ShardingMpiTest, ShardGradOp) { ExpectParity(With(ShardingStrategy::kShardGradOp), 1); }
TEST(ShardingMpiTest, NoShard) { ExpectParity(With(ShardingStrategy::kNoShard), 1); }
TEST(ShardingMpiTest, FullShardWithAccumulation) {
  ExpectParity(With(ShardingStrategy::kFullShard), 4);
}
TEST(ShardingMpiTest, HybridShardOneRankPerShardGroup) {
  // The only mesh besides 1 x N that 2 and 3 processes allow.
  ExpectParity(With(ShardingStrategy::kHybridShard, 1), 1);
}

TEST(ShardingMpiTest, LlamaFullShard) {
  ExpectParity(With(ShardingStrategy::kFullShard), 1, "llama-nano");
}
TEST(ShardingMpiTest, LlamaShardGradOpWithAccumulation) {
  ExpectParity(With(ShardingStrategy::kShardGradOp), 2, "llama-nano");
}

TEST(ShardingMpiTest, FullShardHoldsOneNthOfThePersistentBytes) {
  TrainSpec spec;
  spec.steps = 1;
  auto got = TrainSharded(*g_world, spec, With(ShardingStrategy::kFullShard), 1);
  ASSERT_TRUE(got.ok()) << got.status();
  auto config = nn::GptConfig::FromName("nano");
  const int n = g_world->size();
  const double single = 4.0 * 4 * config->num_parameters();
  const double padding = 4.0 * 4 * (config->num_layers + 1) * n;
  EXPECT_GE(got->memory.persistent_bytes(), single / n);
  EXPECT_LE(got->memory.persistent_bytes(), single / n * 1.01 + padding);
  ExpectReportIsBackend(got->memory, got->backend_memory, "FULL_SHARD under mpirun");
}

// The collectives of each forward, backward and Step(), counted by the mpi communicators
// themselves (tests/fsdp/collective_counts.h has the formulas; collective_counts_test runs
// every combination with ranks as threads). HYBRID_SHARD with a shard group of one rank is
// the hybrid mesh that 2 and 3 processes allow besides 1 x N.
TEST(ShardingMpiTest, CollectiveCountsPerPhase) {
  CountCase full{.strategy = ShardingStrategy::kFullShard, .prefetch = 1, .micro_batches = 4,
                 .checkpoint = true};
  CountCase grad_op{.strategy = ShardingStrategy::kShardGradOp, .prefetch = 2};
  CountCase no_shard{.strategy = ShardingStrategy::kNoShard, .micro_batches = 4};
  CountCase hybrid{.strategy = ShardingStrategy::kHybridShard, .hybrid_shard = 1,
                   .micro_batches = 4};
  for (CountCase c : {full, grad_op, no_shard, hybrid}) {
    c.world = g_world->size();
    const absl::Status s = CheckCollectiveCounts(*g_world, c);
    ASSERT_TRUE(s.ok()) << CountCaseName(c) << ": " << s;
  }
}

// Runs last: it leaves the runtime it made failed (the world stays usable).
TEST(ShardingMpiTest, RanksRegisteringDifferentShapesFailEverywhere) {
  auto backend = *CpuBackend::Create({.num_threads = 1});
  auto rt = ShardingRuntime::Create(backend.get(), *g_world, {});
  ASSERT_TRUE(rt.ok()) << rt.status();
  const int64_t cols = g_world->rank() == 1 ? 5 : 4;
  ASSERT_TRUE((*rt)->RegisterUnit("a", {{"w", {3, cols}}}).ok());
  absl::Status s = (*rt)->Finalize(nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("differs between rank 0 and rank 1"), std::string::npos) << s;
}

}  // namespace
}  // namespace fsdp::testing

int main(int argc, char** argv) {
  return fsdp::testing::MpiTestMain(argc, argv, "sharding_mpi_test",
                                    [](fsdp::Communicator& world) {
                                      fsdp::testing::g_world = &world;
                                      return absl::OkStatus();
                                    });
}
