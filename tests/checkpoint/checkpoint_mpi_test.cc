// Sharded checkpoints with one rank per process, under `mpirun -np 2` and `-np 3` (ctest
// registers both): save and load on the same world size with exact resume for every strategy
// (HYBRID with one rank per shard group, the only mesh that 2 and 3 processes allow), a
// corrupted shard as an error on every rank, a save in the background while training goes on,
// and safetensors export/import. Rank 0 makes a
// temporary directory and broadcasts its path. Loading on other world sizes is in the thread
// tests.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include "fsdp/mpi_world.h"
#include "src/checkpoint/rank_sync.h"
#include "src/checkpoint/shard_file.h"
#include "tests/checkpoint/ckpt_util.h"
#include "tests/mpi_test_main.h"

namespace fsdp::testing {
namespace {

Communicator* g_world = nullptr;
std::string g_dir;  // shared by all ranks, made by rank 0


void ExpectExactResume(const CkptRun& run, const std::string& name) {
  const std::string dir = g_dir + "/" + name;
  auto full = RunRank(*g_world, run, 12, "", "");
  ASSERT_TRUE(full.ok()) << full.status();
  auto first = RunRank(*g_world, run, 6, "", dir);
  ASSERT_TRUE(first.ok()) << first.status();
  CkptRun resumed = run;
  resumed.init_seed = 777;
  auto second = RunRank(*g_world, resumed, 6, dir, "");
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_TRUE(second->loaded.rank_state_restored);
  for (int i = 0; i < 6; ++i) EXPECT_EQ(second->losses[i], full->losses[6 + i]) << "step " << i;
  EXPECT_TRUE(BitEqual(second->params, full->params));
}

TEST(CheckpointMpiTest, FullShardExactResume) { ExpectExactResume(CkptRun{}, "full_shard"); }

TEST(CheckpointMpiTest, ShardGradOpExactResume) {
  CkptRun run;
  run.strategy = ShardingStrategy::kShardGradOp;
  ExpectExactResume(run, "shard_grad_op");
}

TEST(CheckpointMpiTest, HybridShardGradOpOneRankPerShardGroupExactResume) {
  CkptRun run;
  run.strategy = ShardingStrategy::kHybridShardGradOp;
  run.hybrid_shard = 1;
  ExpectExactResume(run, "hybrid_grad_op");
}

TEST(CheckpointMpiTest, NoShardExactResume) {
  CkptRun run;
  run.strategy = ShardingStrategy::kNoShard;
  ExpectExactResume(run, "no_shard");
}

TEST(CheckpointMpiTest, HybridOneRankPerShardGroupExactResume) {
  CkptRun run;
  run.strategy = ShardingStrategy::kHybridShard;
  run.hybrid_shard = 1;
  ExpectExactResume(run, "hybrid");
}

// A background save (AsyncCheckpointer) at step 6 while training goes on to step 12: the run's
// losses are the uninterrupted run's, and a resume from that checkpoint continues exactly.
TEST(CheckpointMpiTest, AsyncSaveWhileTrainingExactResume) {
  const std::string dir = g_dir + "/async";
  auto full = RunRank(*g_world, CkptRun{}, 12, "", "");
  ASSERT_TRUE(full.ok()) << full.status();
  CkptRun async;
  async.async_save = true;
  async.steps_after_save = 6;
  auto first = RunRank(*g_world, async, 6, "", dir);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->losses, full->losses) << "the background save disturbed training";
  CkptRun resumed;
  resumed.init_seed = 777;
  auto second = RunRank(*g_world, resumed, 6, dir, "");
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_TRUE(second->loaded.rank_state_restored);
  for (int i = 0; i < 6; ++i) EXPECT_EQ(second->losses[i], full->losses[6 + i]) << "step " << i;
  EXPECT_TRUE(BitEqual(second->params, full->params));
}

TEST(CheckpointMpiTest, CorruptedShardFailsOnEveryRankAndLoadsNothing) {
  const std::string dir = g_dir + "/corrupt";
  ASSERT_TRUE(RunRank(*g_world, CkptRun{}, 2, "", dir).ok());
  const int last = g_world->size() - 1;
  const std::string victim =
      absl::StrCat(dir, "/", checkpoint::ShardFileName(last, g_world->size()));
  if (g_world->rank() == 0) {
    std::fstream f(victim, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(100);
    const char c = static_cast<char>(f.get() ^ 0x10);
    f.seekp(100);
    f.put(c);
  }
  ASSERT_TRUE(g_world->Barrier().ok());
  auto backend = *CpuBackend::Create({.num_threads = 1});
  auto model = MakeModel(*g_world, backend.get(), CkptRun{});
  ASSERT_TRUE(model.ok()) << model.status();
  auto before = (*model)->GatherModelUnits();
  absl::Status s = LoadCheckpoint((*model)->runtime(), dir).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_NE(s.message().find(absl::StrCat("rank ", last, ": ")), absl::string_view::npos) << s;
  EXPECT_NE(s.message().find("checksum mismatch"), absl::string_view::npos) << s;
  auto after = (*model)->GatherModelUnits();
  EXPECT_TRUE(BitEqual(*before, *after));
}

TEST(CheckpointMpiTest, SafetensorsRoundTrip) {
  const std::string path = g_dir + "/model.safetensors";
  // Export a model, import into one initialised with another seed.
  auto backend = *CpuBackend::Create({.num_threads = 1});
  CkptRun run;
  auto a = MakeModel(*g_world, backend.get(), run);
  ASSERT_TRUE(a.ok());
  ASSERT_TRUE(ExportSafetensors((*a)->runtime(), path).ok());
  run.init_seed = 31;
  auto b = MakeModel(*g_world, backend.get(), run);
  ASSERT_TRUE(b.ok());
  ASSERT_TRUE(ImportSafetensors((*b)->runtime(), path).ok());
  EXPECT_TRUE(BitEqual(*(*a)->GatherModelUnits(), *(*b)->GatherModelUnits()));
}

}  // namespace
}  // namespace fsdp::testing

int main(int argc, char** argv) {
  return fsdp::testing::MpiTestMain(
      argc, argv, "checkpoint_mpi_test",
      [](fsdp::Communicator& world) -> absl::Status {
        std::string dir;
        if (world.rank() == 0) {
          char tmpl[] = "/tmp/fsdp_ckpt_mpi_XXXXXX";
          if (mkdtemp(tmpl) != nullptr) dir = tmpl;
        }
        FSDP_ASSIGN_OR_RETURN(fsdp::testing::g_dir,
                              fsdp::checkpoint::BroadcastString(world, dir, 0, 4096));
        if (fsdp::testing::g_dir.empty()) {
          return absl::InternalError("no shared temporary directory");
        }
        fsdp::testing::g_world = &world;
        return absl::OkStatus();
      },
      [](fsdp::Communicator& world) {
        world.Barrier().IgnoreError();
        if (world.rank() == 0) std::filesystem::remove_all(fsdp::testing::g_dir);
      });
}
