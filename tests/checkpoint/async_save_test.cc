// Asynchronous saves (AsyncCheckpointer), ranks as threads: the checkpoint of a background save
// is the synchronous save's, file for file, while training goes on undisturbed; at most one
// save in flight (a second one waits or is skipped, on every rank alike); a crash of the
// background write at each point leaves the previous checkpoint intact and the next save
// works; a snapshot over its host memory bound is refused before anything is copied and
// training continues; Shutdown gives up past its deadline with a clear error.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <thread>

#include "fsdp/plan.h"
#include "tests/checkpoint/ckpt_util.h"

namespace fsdp::testing {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;


// One rank's model and data, trained a step at a time.
struct Rank {
  std::unique_ptr<Backend> backend;
  std::unique_ptr<nn::ShardedModel> model;
  std::optional<nn::DataLoader> loader;
  std::vector<float> losses;

  static absl::StatusOr<Rank> Make(Communicator& comm) {
    Rank r;
    FSDP_ASSIGN_OR_RETURN(r.backend, testing::MakeTestBackend(1, 0, "cpu"));
    FSDP_ASSIGN_OR_RETURN(r.model, MakeModel(comm, r.backend.get(), CkptRun{}));
    nn::DataLoaderOptions lo;
    lo.batch_size = 2;
    lo.seq_len = 32;
    lo.rank = comm.rank();
    lo.world_size = comm.size();
    lo.seed = 7;
    FSDP_ASSIGN_OR_RETURN(nn::DataLoader l, nn::DataLoader::Create(&TestCorpus(), lo));
    r.loader.emplace(std::move(l));
    return r;
  }
  absl::Status Train(int steps) {
    for (int s = 0; s < steps; ++s) {
      nn::Batch b = loader->Next();
      FSDP_ASSIGN_OR_RETURN(float loss, model->ForwardBackward(b.inputs.data(), b.targets.data()));
      FSDP_ASSIGN_OR_RETURN(float mean, model->MeanOverRanks(loss));
      losses.push_back(mean);
      FSDP_RETURN_IF_ERROR(model->runtime().Step(TestSchedule()).status());
    }
    return absl::OkStatus();
  }
  TrainingState State(Communicator& comm) const {
    TrainingState st;
    st.data = loader->state();
    st.rank_state = RankState(comm.rank(), model->runtime().steps());
    return st;
  }
};

class AsyncSaveTest : public ::testing::Test {
 protected:
  void SetUp() override {
    parent_ = absl::StrCat(::testing::TempDir(), "/fsdp_async_", getpid(), "_",
                           ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(parent_);
    fs::create_directories(parent_);
  }
  void TearDown() override { fs::remove_all(parent_); }
  std::string parent_;
};

TEST_F(AsyncSaveTest, WritesTheSynchronousSavesFilesWhileTrainingGoesOn) {
  std::vector<float> sync_losses, async_losses;
  std::vector<AsyncSaveResult> results(2);
  std::vector<uint64_t> snapshot_bytes(2);
  for (bool async : {false, true}) {
    ASSERT_TRUE(LocalWorld::Run(2, {}, [&](Communicator& comm) -> absl::Status {
      FSDP_ASSIGN_OR_RETURN(Rank r, Rank::Make(comm));
      FSDP_RETURN_IF_ERROR(r.Train(3));
      const std::string dir = parent_ + (async ? "/async" : "/sync");
      if (!async) {
        FSDP_RETURN_IF_ERROR(SaveCheckpoint(r.model->runtime(), dir, r.State(comm)));
        FSDP_RETURN_IF_ERROR(r.Train(3));
        if (comm.rank() == 0) sync_losses = r.losses;
        return absl::OkStatus();
      }
      FSDP_ASSIGN_OR_RETURN(auto saver, AsyncCheckpointer::Create(r.model->runtime()));
      FSDP_ASSIGN_OR_RETURN(AsyncSaveStart started, saver->Save(dir, r.State(comm)));
      if (started != AsyncSaveStart::kStarted) return absl::InternalError("not started");
      FSDP_RETURN_IF_ERROR(r.Train(3));  // while the writer writes
      FSDP_RETURN_IF_ERROR(saver->Wait());
      std::vector<AsyncSaveResult> done = saver->TakeFinished();
      if (done.size() != 1) return absl::InternalError("not one finished save");
      results[comm.rank()] = done[0];
      snapshot_bytes[comm.rank()] = saver->snapshot_bytes();
      if (comm.rank() == 0) async_losses = r.losses;
      return absl::OkStatus();
    }).ok());
  }
  EXPECT_EQ(async_losses, sync_losses) << "the background save disturbed training";
  for (const AsyncSaveResult& r : results) {
    EXPECT_TRUE(r.status.ok()) << r.status;
    EXPECT_EQ(r.dir, parent_ + "/async");
    EXPECT_GT(r.write_seconds, 0);
  }
  // Every file of the two checkpoints, byte for byte.
  int files = 0;
  for (const auto& e : fs::directory_iterator(parent_ + "/sync")) {
    const std::string name = e.path().filename().string();
    EXPECT_EQ(ReadAll(e.path().string()), ReadAll(parent_ + "/async/" + name)) << name;
    ++files;
  }
  EXPECT_EQ(files, 4);  // two shard files, metadata.json, COMMIT
  // The snapshot: the rank's shard of parameters and AdamW's two states, in f32.
  auto plain = RunThreads(2, CkptRun{}, 0, parent_ + "/async", "");
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_EQ(plain->loaded.step, 3);
  // The planner's snapshot: rank 0's shards hold no padding, so it is exact there.
  PlanRequest pr;
  pr.model = "nano";
  pr.world_size = 2;
  pr.batch_size = 2;
  pr.seq_len = 32;
  pr.async_checkpoint = true;
  auto plan = PlanMemory(pr);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(snapshot_bytes[0], static_cast<uint64_t>(plan->checkpoint_snapshot_bytes));
  EXPECT_LE(snapshot_bytes[1], snapshot_bytes[0]);
  std::printf("snapshot per rank: %llu bytes; the save blocked training for %.1f ms, the "
              "background write took %.1f ms\n",
              static_cast<unsigned long long>(snapshot_bytes[0]),
              results[0].snapshot_seconds * 1e3, results[0].write_seconds * 1e3);
}

// Holds every writer at "shard_written" until released.
struct Gate {
  std::atomic<bool> open{false};
  std::atomic<int> arrived{0};
  std::function<absl::Status(std::string_view)> Hook() {
    return [this](std::string_view at) {
      if (at != "shard_written") return absl::OkStatus();
      arrived.fetch_add(1);
      while (!open.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      return absl::OkStatus();
    };
  }
};

TEST_F(AsyncSaveTest, OneSaveInFlightASecondWaitsOrIsSkippedOnEveryRank) {
  for (bool skip : {true, false}) {
    SCOPED_TRACE(skip ? "skip_when_busy" : "wait");
    Gate gate;
    std::vector<AsyncSaveStart> second(2);
    const std::string first_dir = parent_ + (skip ? "/skip-1" : "/wait-1");
    const std::string second_dir = parent_ + (skip ? "/skip-2" : "/wait-2");
    std::thread opener;
    ASSERT_TRUE(LocalWorld::Run(2, {}, [&](Communicator& comm) -> absl::Status {
      FSDP_ASSIGN_OR_RETURN(Rank r, Rank::Make(comm));
      AsyncSaveOptions ao;
      ao.skip_when_busy = skip;
      FSDP_ASSIGN_OR_RETURN(auto saver, AsyncCheckpointer::Create(r.model->runtime(), ao));
      SaveOptions held;
      held.fault_injection = gate.Hook();
      FSDP_RETURN_IF_ERROR(saver->Save(first_dir, r.State(comm), held).status());
      FSDP_RETURN_IF_ERROR(r.Train(1));
      if (comm.rank() == 0 && !skip) {
        // Released while the second Save waits for the first.
        opener = std::thread([&] {
          std::this_thread::sleep_for(std::chrono::milliseconds(200));
          gate.open = true;
        });
      }
      FSDP_ASSIGN_OR_RETURN(second[comm.rank()], saver->Save(second_dir, r.State(comm)));
      gate.open = true;
      return saver->Wait();
    }).ok());
    if (opener.joinable()) opener.join();
    for (AsyncSaveStart s : second) {
      EXPECT_EQ(s, skip ? AsyncSaveStart::kSkipped : AsyncSaveStart::kStarted);
    }
    EXPECT_TRUE(CheckpointStep(first_dir).ok());
    EXPECT_EQ(CheckpointStep(second_dir).ok(), !skip);
    if (!skip) {
      EXPECT_EQ(*CheckpointStep(second_dir), 1);
    }
  }
}

// The background write "crashes" (the fault hook stops it) at each point, on every rank or on
// rank 1 only: the save fails, no checkpoint becomes visible, the previous one is intact and
// loads bitwise, and the next save works.
class AsyncCrashTest : public ::testing::TestWithParam<std::pair<const char*, bool>> {};

TEST_P(AsyncCrashTest, ACrashOfTheBackgroundWriteLeavesThePreviousCheckpoint) {
  const auto [point, only_rank1] = GetParam();
  const std::string parent = absl::StrCat(::testing::TempDir(), "/fsdp_async_crash_", getpid(),
                                          "_", point, only_rank1 ? "_r1" : "");
  fs::remove_all(parent);
  auto prev = RunThreads(2, CkptRun{}, 2, "", parent + "/step-2");
  ASSERT_TRUE(prev.ok()) << prev.status();
  ASSERT_TRUE(LocalWorld::Run(2, {}, [&](Communicator& comm) -> absl::Status {
    FSDP_ASSIGN_OR_RETURN(Rank r, Rank::Make(comm));
    FSDP_RETURN_IF_ERROR(r.Train(4));
    FSDP_ASSIGN_OR_RETURN(auto saver, AsyncCheckpointer::Create(r.model->runtime()));
    SaveOptions o;
    o.fault_injection = [&, point = std::string(point), only = only_rank1](std::string_view at) {
      if (at == point && (!only || comm.rank() == 1)) return absl::AbortedError("simulated crash");
      return absl::OkStatus();
    };
    FSDP_RETURN_IF_ERROR(saver->Save(parent + "/step-4", r.State(comm), o).status());
    FSDP_RETURN_IF_ERROR(r.Train(1));
    absl::Status crashed = saver->Wait();
    if (crashed.ok()) return absl::InternalError("the background save did not fail");
    if (crashed.message().find("save interrupted at") == absl::string_view::npos) return crashed;
    // The same for a save that replaces the previous checkpoint.
    o.overwrite = true;
    FSDP_RETURN_IF_ERROR(saver->Save(parent + "/step-2", r.State(comm), o).status());
    if (saver->Wait().ok()) return absl::InternalError("the overwriting save did not fail");
    // The next save, without a fault, works.
    FSDP_RETURN_IF_ERROR(saver->Save(parent + "/step-5", r.State(comm)).status());
    return saver->Wait();
  }).ok());
  EXPECT_FALSE(fs::exists(parent + "/step-4"));
  auto reload = RunThreads(2, CkptRun{}, 0, parent + "/step-2", "");
  ASSERT_TRUE(reload.ok()) << reload.status();
  EXPECT_TRUE(BitEqual(reload->params, prev->params));
  EXPECT_EQ(*LatestCheckpoint(parent), parent + "/step-5");
  fs::remove_all(parent);
}

INSTANTIATE_TEST_SUITE_P(Points, AsyncCrashTest,
                         ::testing::Values(std::make_pair("shard_written", false),
                                           std::make_pair("shard_written", true),
                                           std::make_pair("metadata_written", false),
                                           std::make_pair("commit_written", false)),
                         [](const ::testing::TestParamInfo<std::pair<const char*, bool>>& i) {
                           return absl::StrCat(i.param.first,
                                               i.param.second ? "_rank1_only" : "_all_ranks");
                         });

TEST_F(AsyncSaveTest, ASnapshotOverItsBoundIsRefusedAndTrainingContinues) {
  std::vector<absl::Status> refused(2);
  ASSERT_TRUE(LocalWorld::Run(2, {}, [&](Communicator& comm) -> absl::Status {
    FSDP_ASSIGN_OR_RETURN(Rank r, Rank::Make(comm));
    AsyncSaveOptions ao;
    ao.max_snapshot_bytes = 1000;
    FSDP_ASSIGN_OR_RETURN(auto saver, AsyncCheckpointer::Create(r.model->runtime(), ao));
    refused[comm.rank()] = saver->Save(parent_ + "/step-0", r.State(comm)).status();
    FSDP_RETURN_IF_ERROR(r.Train(2));  // training continues
    return saver->Wait();
  }).ok());
  for (const absl::Status& s : refused) {
    EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr("max_snapshot_bytes (1000 bytes)"));
    EXPECT_THAT(std::string(s.message()), HasSubstr("nothing was copied or written"));
  }
  EXPECT_FALSE(fs::exists(parent_ + "/step-0"));
}

TEST_F(AsyncSaveTest, ShutdownGivesUpPastItsDeadlineWithAClearError) {
  Gate gate;
  std::vector<absl::Status> shut(2);
  std::thread opener([&] {
    while (gate.arrived.load() < 2) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    gate.open = true;
  });
  ASSERT_TRUE(LocalWorld::Run(2, {}, [&](Communicator& comm) -> absl::Status {
    FSDP_ASSIGN_OR_RETURN(Rank r, Rank::Make(comm));
    FSDP_ASSIGN_OR_RETURN(auto saver, AsyncCheckpointer::Create(r.model->runtime()));
    SaveOptions held;
    held.fault_injection = gate.Hook();
    FSDP_RETURN_IF_ERROR(saver->Save(parent_ + "/step-0", r.State(comm), held).status());
    shut[comm.rank()] = saver->Shutdown(absl::Milliseconds(50));
    if (saver->Save(parent_ + "/again", r.State(comm)).ok()) {
      return absl::InternalError("a save after Shutdown");
    }
    return absl::OkStatus();
  }).ok());
  opener.join();
  for (const absl::Status& s : shut) {
    EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr(parent_ + "/step-0"));
  }
  EXPECT_FALSE(CheckpointStep(parent_ + "/step-0").ok()) << "the given-up save committed";
}

}  // namespace
}  // namespace fsdp::testing
