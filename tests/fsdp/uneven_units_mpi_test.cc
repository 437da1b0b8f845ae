// Uneven and degenerate units with one rank per process, under `mpirun -np 2` and `-np 3`
// (ctest registers both): a few representative cases of uneven_units_test (the awkward MLPs
// and the degenerate units against one rank on the concatenated batch, a checkpoint saved and
// loaded into another strategy, the export) and impossible configurations failing at once.
// Each process computes the reference itself. The world these tests use has a 20 s deadline,
// so a hang is a failure.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <chrono>
#include <filesystem>
#include <map>
#include <memory>

#include "fsdp/mpi_world.h"
#include "src/checkpoint/rank_sync.h"
#include "tests/fsdp/uneven_model.h"
#include "tests/mpi_test_main.h"

namespace fsdp::testing::uneven {
namespace {

std::unique_ptr<Communicator> g_world;  // a world of its own, with a short deadline
std::string g_dir;                      // shared by all ranks, made by rank 0

Communicator& World() { return *g_world; }

// The reference of a model (MakeReference), computed once per process.
const Reference& ReferenceOf(const Model& m) {
  static std::map<std::string, Reference> cache;
  auto it = cache.find(m.name);
  if (it == cache.end()) it = cache.emplace(m.name, MakeReference(m)).first;
  return it->second;
}

void ExpectParityOnWorld(const Model& m, ShardingStrategy strategy, int hybrid_shard = 0) {
  const Reference& ref = ReferenceOf(m);
  ASSERT_GT(ref.result.clipped_steps, 0) << m.name;
  ASSERT_LT(ref.result.clipped_steps, ref.spec.steps) << m.name;
  absl::StatusOr<Result> got =
      TrainSharded(World(), m, ref.spec, Options(strategy, hybrid_shard, ref.spec));
  ASSERT_TRUE(got.ok()) << got.status();
  const std::string where = "rank " + std::to_string(World().rank());
  ExpectParity(*got, ref.result, where);
  ExpectReportIsBackend(got->memory, got->backend_memory, where);
}

TEST(UnevenMpiTest, Mlp16x15x8FullShard) {
  ExpectParityOnWorld(Mlp(16, 15, 8), ShardingStrategy::kFullShard);
}
TEST(UnevenMpiTest, Mlp16x17x8ShardGradOp) {
  ExpectParityOnWorld(Mlp(16, 17, 8), ShardingStrategy::kShardGradOp);
}
TEST(UnevenMpiTest, DegenerateUnitsFullShard) {
  ExpectParityOnWorld(Degenerate(7, 15, 3), ShardingStrategy::kFullShard);
}
TEST(UnevenMpiTest, DegenerateUnitsNoShard) {
  ExpectParityOnWorld(Degenerate(7, 15, 3), ShardingStrategy::kNoShard);
}
TEST(UnevenMpiTest, Mlp7x15x3HybridOneRankPerShardGroup) {
  // The only mesh besides 1 x N that 2 and 3 processes allow.
  ExpectParityOnWorld(Mlp(7, 15, 3), ShardingStrategy::kHybridShard, 1);
}

// Saved with FULL_SHARD, loaded into SHARD_GRAD_OP and trained on, exported: the steps together
// are the reference's, and the export holds the parameters.
TEST(UnevenMpiTest, DegenerateUnitsCheckpointIntoAnotherStrategyAndExport) {
  const Model m = Degenerate(7, 15, 3);
  const Reference& ref = ReferenceOf(m);
  const Spec& spec = ref.spec;
  const std::string ckpt = g_dir + "/ckpt", exported = g_dir + "/model.safetensors";
  Result chained;
  LoadedCheckpoint loaded;
  absl::Status s = RunLeg(World(), m, spec, {World().size(), ShardingStrategy::kFullShard, 0, 4},
                          0, "", ckpt, "", chained, nullptr);
  ASSERT_TRUE(s.ok()) << s;
  s = RunLeg(World(), m, spec, {World().size(), ShardingStrategy::kShardGradOp, 0, 2}, 4, ckpt, "",
             exported, chained, &loaded);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(loaded.step, 4);
  ExpectParity(chained, ref.result, "rank " + std::to_string(World().rank()));
  if (World().rank() == 0) ExpectExportHolds(exported, m, chained.params, ref.result.params);
}

template <typename F>
std::pair<absl::Status, double> Timed(F f) {
  const auto t0 = std::chrono::steady_clock::now();
  absl::Status s = f();
  return {s, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count()};
}

// One rank given a HYBRID shard size that does not divide the world: every rank gets its error
// at once (the world stays usable: nothing was aborted).
TEST(UnevenMpiTest, HybridShardSizeThatDoesNotDivideTheWorldOnOneRank) {
  auto [s, seconds] = Timed([] {
    auto backend = *CpuBackend::Create({.num_threads = 1});
    ShardingOptions o;
    o.strategy = ShardingStrategy::kHybridShard;
    o.hybrid_shard_size = World().rank() == 1 ? World().size() + 1 : 1;
    return ShardingRuntime::Create(backend.get(), World(), o).status();
  });
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("rank 1: HYBRID_SHARD: hybrid_shard_size (" +
                             std::to_string(World().size() + 1) + ") must be >= 1 and divide"),
            std::string::npos)
      << s;
  EXPECT_LT(seconds, 5.0);
}

TEST(UnevenMpiTest, RankRegisteringAnotherShapeOfADegenerateUnit) {
  auto [s, seconds] = Timed([] {
    Model m = Degenerate(7, 15, 3);
    if (World().rank() == 1) m.stages[3].params[1].shape = {3};
    auto backend = *CpuBackend::Create({.num_threads = 1});
    return BuildRuntime(backend.get(), World(), m, {}).status();
  });
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("differs between rank 0 and rank 1"), std::string::npos) << s;
  EXPECT_LT(seconds, 5.0);
}

}  // namespace
}  // namespace fsdp::testing::uneven

int main(int argc, char** argv) {
  using fsdp::testing::uneven::g_dir;
  using fsdp::testing::uneven::g_world;
  return fsdp::testing::MpiTestMain(
      argc, argv, "uneven_units_mpi_test",
      [](fsdp::Communicator& world) -> absl::Status {
        fsdp::CommOptions o;
        o.timeout = absl::Seconds(20);
        FSDP_ASSIGN_OR_RETURN(g_world, fsdp::CreateMpiWorld(o));
        std::string dir;
        if (world.rank() == 0) {
          char tmpl[] = "/tmp/fsdp_uneven_mpi_XXXXXX";
          if (mkdtemp(tmpl) != nullptr) dir = tmpl;
        }
        FSDP_ASSIGN_OR_RETURN(g_dir, fsdp::checkpoint::BroadcastString(world, dir, 0, 4096));
        if (g_dir.empty()) return absl::InternalError("no shared temporary directory");
        return absl::OkStatus();
      },
      [](fsdp::Communicator& world) {
        world.Barrier().IgnoreError();
        if (world.rank() == 0) std::filesystem::remove_all(g_dir);
        g_world.reset();
      });
}
