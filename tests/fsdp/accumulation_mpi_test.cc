// HYBRID_SHARD's sharded accumulation with one rank per process, under `mpirun -np 4` (a 2 x 2
// mesh: two shard groups, two replicas): every micro-batch reduce-scatters inside its shard
// group, and only the last one all-reduces the accumulated shards across the replicas
// (ShardingRuntime::set_requires_all_reduce). The collectives are counted by the mpi
// communicators; the training matches the single-rank reference on the concatenated batch.
// collective_counts_test and sharding_parity_test run the same with ranks as threads.
#include <gtest/gtest.h>

#include <bit>
#include <cstdint>
#include <vector>

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

// The quantized all-gather and gradient reduction across processes (all_to_all in the shard
// group, the replicas' codes all-gathered; shared memory inside the host, Open MPI between
// groups): the replicas end every step with bitwise-equal parameters, and the losses stay
// within 2% of the same training without quantization.
TEST(AccumulationMpiTest, HybridQuantizedReductionKeepsReplicasEqual) {
  ASSERT_EQ(g_world->size(), 4) << "run under mpirun -np 4";
  TrainSpec spec;
  spec.steps = 6;
  spec.micro_batches = 2;
  spec.accumulation = Accumulation::kSharded;
  spec.lr = 3e-3f;
  ShardingOptions sharding;
  sharding.strategy = ShardingStrategy::kHybridShard;
  sharding.hybrid_shard_size = 2;
  absl::StatusOr<TrainResult> plain = TrainSharded(*g_world, spec, sharding, 1);
  ASSERT_TRUE(plain.ok()) << plain.status();
  sharding.communication.all_gather = WireFormat::kInt8;
  sharding.communication.reduction = WireFormat::kInt8;
  sharding.communication.block_size = 64;
  absl::StatusOr<TrainResult> q = TrainSharded(*g_world, spec, sharding, 1);
  ASSERT_TRUE(q.ok()) << q.status();
  ASSERT_EQ(q->losses.size(), plain->losses.size());
  for (size_t i = 0; i < q->losses.size(); ++i) {
    EXPECT_NEAR(q->losses[i], plain->losses[i], 0.02 * plain->losses[i]) << "step " << i;
  }
  EXPECT_NE(q->losses, plain->losses) << "the quantized run computed the unquantized values";
  // Every rank's parameters after the last step, as a hash, compared across the processes.
  uint64_t h = 1469598103934665603ULL;
  for (const std::vector<float>& unit : q->params) {
    for (float x : unit) h = (h ^ std::bit_cast<uint32_t>(x)) * 1099511628211ULL;
  }
  std::vector<int64_t> all(g_world->size());
  const int64_t mine = static_cast<int64_t>(h);
  ASSERT_TRUE(g_world->AllGather(&mine, all.data(), 1, DType::kI64).ok());
  for (int r = 1; r < g_world->size(); ++r) {
    EXPECT_EQ(all[r], all[0]) << "rank " << r << "'s parameters differ from rank 0's";
  }
}

// The secondary shard inside the host (hpZ) across processes: FULL_SHARD over the 4 processes
// with backward's gathers over pairs of them (their own Open MPI communicator, shared memory
// inside the host) trains bitwise as without it, and the shard group no longer carries
// backward's regathers. HYBRID_SHARD 2 x 2 cannot take one (2 <= N < 2): every process is
// refused, naming the option.
TEST(AccumulationMpiTest, SecondaryShardTrainsBitwiseAcrossProcesses) {
  ASSERT_EQ(g_world->size(), 4) << "run under mpirun -np 4";
  TrainSpec spec;
  spec.steps = 4;
  spec.micro_batches = 2;
  spec.accumulation = Accumulation::kSharded;
  ShardingOptions sharding;
  sharding.mixed_precision.param_dtype = DType::kBF16;
  absl::StatusOr<TrainResult> plain = TrainSharded(*g_world, spec, sharding, 1);
  ASSERT_TRUE(plain.ok()) << plain.status();
  sharding.secondary_shard_size = 2;
  absl::StatusOr<TrainResult> hpz = TrainSharded(*g_world, spec, sharding, 1);
  ASSERT_TRUE(hpz.ok()) << hpz.status();
  EXPECT_EQ(hpz->losses, plain->losses);
  EXPECT_EQ(hpz->grad_norms, plain->grad_norms);
  ASSERT_EQ(hpz->params.size(), plain->params.size());
  for (size_t u = 0; u < hpz->params.size(); ++u) {
    ASSERT_EQ(hpz->params[u].size(), plain->params[u].size());
    for (size_t i = 0; i < hpz->params[u].size(); ++i) {
      ASSERT_EQ(std::bit_cast<uint32_t>(hpz->params[u][i]),
                std::bit_cast<uint32_t>(plain->params[u][i]))
          << "unit " << u << " element " << i;
    }
  }
  const int64_t passes = int64_t{spec.steps} * spec.micro_batches;
  EXPECT_EQ(plain->shard_all_gathers - hpz->shard_all_gathers,
            (hpz->num_units - 1) + int64_t{hpz->num_units - 2} * (passes - 1));
  EXPECT_GT(hpz->memory.secondary_param_peak_bytes, 0);
  sharding.strategy = ShardingStrategy::kHybridShard;
  sharding.hybrid_shard_size = 2;
  absl::StatusOr<TrainResult> bad = TrainSharded(*g_world, spec, sharding, 1);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument) << bad.status();
  EXPECT_NE(bad.status().message().find("secondary_shard_size is 2 with HYBRID_SHARD"),
            absl::string_view::npos)
      << bad.status();
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
