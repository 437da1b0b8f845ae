// What a checkpoint directory may hold and who may write it: the directory's lock, the
// clean-up of what crashed saves left, the check that a save's target can be replaced, and
// the model configuration a checkpoint records and a load compares.
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/checkpoint/ckpt_util.h"

namespace fsdp::testing {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

class CheckpointFilesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = absl::StrCat(::testing::TempDir(), "/fsdp_ckfiles_", getpid(), "_",
                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  // A complete checkpoint of two steps of nano on 2 ranks at `name`.
  void SaveOne(const std::string& name, const CkptRun& run = {}) {
    auto r = RunThreads(2, run, 2, "", dir_ + "/" + name);
    ASSERT_TRUE(r.ok()) << r.status();
  }
  // Exit code of `flock -n FILE true`: 0 when nobody holds the lock on FILE.
  static int FlockProbe(const std::string& file) {
    return WEXITSTATUS(std::system(absl::StrCat("flock -n '", file, "' true").c_str()));
  }
  std::string dir_;
};

TEST_F(CheckpointFilesTest, LockIsOneProcessAtATimeAndCountedInside) {
  const std::string lockfile = dir_ + "/" + kCheckpointLockFile;
  {
    auto a = CheckpointDirLock::Acquire(dir_);
    ASSERT_TRUE(a.ok()) << a.status();
    EXPECT_TRUE(a->locked());
    auto b = CheckpointDirLock::Acquire(dir_);  // this process again: counted, no conflict
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_NE(FlockProbe(lockfile), 0) << "another process could take the lock";
    std::string holder;
    std::getline(std::ifstream(lockfile), holder);
    EXPECT_THAT(holder, HasSubstr(absl::StrCat("pid ", getpid(), " on host ")));
  }
  EXPECT_FALSE(fs::exists(lockfile)) << "the lock file outlived its last holder";
  // Another process holds it: refused, naming the lock file.
  std::ofstream(lockfile) << "pid 1 on host elsewhere since then: train_gpt\n";
  ASSERT_EQ(std::system(absl::StrCat("flock '", lockfile, "' sleep 10 >/dev/null 2>&1 &").c_str()), 0);
  for (int i = 0; i < 200 && FlockProbe(lockfile) == 0; ++i) usleep(20000);
  const absl::Status held = CheckpointDirLock::Acquire(dir_).status();
  EXPECT_EQ(held.code(), absl::StatusCode::kFailedPrecondition) << held;
  EXPECT_THAT(std::string(held.message()),
              HasSubstr("is in use by another job (pid 1 on host elsewhere since then: "
                        "train_gpt; it holds the lock on " + lockfile));
  // A save does not go ahead while another job holds the directory.
  CkptRun run;
  auto saved = RunThreads(2, run, 1, "", dir_ + "/step-1");
  EXPECT_FALSE(saved.ok());
  EXPECT_THAT(std::string(saved.status().message()), HasSubstr("is in use by another job"));
  EXPECT_FALSE(fs::exists(dir_ + "/step-1"));
}

TEST_F(CheckpointFilesTest, LockFileOfAnotherKindIsAnError) {
  fs::create_directories(dir_ + "/" + kCheckpointLockFile);
  auto l = CheckpointDirLock::Acquire(dir_);
  EXPECT_FALSE(l.ok());
  EXPECT_THAT(std::string(l.status().message()), HasSubstr("is a directory, not the lock file"));
}

TEST_F(CheckpointFilesTest, CleanUpRemovesOnlyWhatCrashedSavesLeft) {
  SaveOne("step-2");
  // A finished replacement whose old copy was not removed yet.
  fs::copy(dir_ + "/step-2", dir_ + "/step-2.old-77-abc");
  // A crash between the two renames: step-4 gone, its old copy complete.
  SaveOne("step-4.old-78-abc");
  // A crash between the two renames: step-6 gone, the new copy complete, the old one damaged.
  SaveOne("step-6.tmp-79-abc");
  fs::copy(dir_ + "/step-2", dir_ + "/step-6.old-79-abc");
  fs::remove(dir_ + "/step-6.old-79-abc/COMMIT");
  // Not a save's: kept.
  fs::create_directories(dir_ + "/notes.old-1-2");
  std::ofstream(dir_ + "/notes.old-1-2/todo.txt") << "x";
  auto done = CleanUpCheckpointDirectory(dir_);
  ASSERT_TRUE(done.ok()) << done.status();
  std::vector<std::string> said;
  for (const CheckpointCleanup& c : *done) said.push_back(c.path + " " + c.action);
  EXPECT_THAT(said, ::testing::UnorderedElementsAre(
                        dir_ + "/step-2.old-77-abc removed: the old copy of step-2, which a "
                               "finished save replaced",
                        dir_ + "/step-4.old-78-abc restored as step-4: the complete copy that "
                               "a save was replacing when it stopped",
                        dir_ + "/step-6.tmp-79-abc renamed to step-6: the save replacing step-6 "
                               "had finished when it stopped",
                        dir_ + "/step-6.old-79-abc removed: the old copy of step-6, which that "
                               "save replaced"));
  for (const char* gone : {"step-2.old-77-abc", "step-4.old-78-abc", "step-6.tmp-79-abc",
                           "step-6.old-79-abc"}) {
    EXPECT_FALSE(fs::exists(dir_ + "/" + gone)) << gone;
  }
  EXPECT_TRUE(fs::exists(dir_ + "/notes.old-1-2/todo.txt"));
  for (const char* name : {"step-2", "step-4", "step-6"}) {
    EXPECT_TRUE(CheckpointStep(dir_ + "/" + name).ok()) << name;
  }
  done = CleanUpCheckpointDirectory(dir_);
  ASSERT_TRUE(done.ok());
  EXPECT_TRUE(done->empty());
}

TEST_F(CheckpointFilesTest, LatestCheckpointNeverPicksAnOldCopy) {
  SaveOne("step-2");
  fs::copy(dir_ + "/step-2", dir_ + "/step-2.old-5-f");  // same step, a later name
  auto latest = LatestCheckpoint(dir_);
  ASSERT_TRUE(latest.ok()) << latest.status();
  EXPECT_EQ(*latest, dir_ + "/step-2");
}

TEST_F(CheckpointFilesTest, CanSaveSaysWhatIsInTheWay) {
  EXPECT_TRUE(CheckCanSaveCheckpoint(dir_ + "/step-1").ok());
  std::ofstream(dir_ + "/step-2") << "x";
  absl::Status s = CheckCanSaveCheckpoint(dir_ + "/step-2");
  EXPECT_EQ(s.code(), absl::StatusCode::kAlreadyExists) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("exists and is a regular file, not a "
                                                  "checkpoint directory"));
  SaveOne("step-4");
  s = CheckCanSaveCheckpoint(dir_ + "/step-4");
  EXPECT_THAT(std::string(s.message()), HasSubstr("already exists"));
  SaveOptions overwrite;
  overwrite.overwrite = true;
  EXPECT_TRUE(CheckCanSaveCheckpoint(dir_ + "/step-4", overwrite).ok());
  fs::remove(dir_ + "/step-4/COMMIT");  // damaged: a save replaces it
  EXPECT_TRUE(CheckCanSaveCheckpoint(dir_ + "/step-4").ok());
  ASSERT_EQ(::mkfifo((dir_ + "/step-4/COMMIT").c_str(), 0644), 0);
  s = CheckCanSaveCheckpoint(dir_ + "/step-4");
  EXPECT_THAT(std::string(s.message()), HasSubstr("entries a save never writes: COMMIT is a FIFO"));
  std::vector<SkippedCheckpoint> skipped;  // and the resume says why it passes over it
  EXPECT_FALSE(LatestCheckpoint(dir_, &skipped).ok());
  ASSERT_EQ(skipped.size(), 1u);
  EXPECT_THAT(std::string(skipped[0].why.message()), HasSubstr("a FIFO, not a regular file"));
}

TEST_F(CheckpointFilesTest, AnotherModelWithTheSameShapesIsRefused) {
  SaveOne("c");
  const std::string meta = ReadAll(dir_ + "/c/metadata.json");
  EXPECT_THAT(meta, HasSubstr(R"("model":{"family":"gpt","name":"nano","vocab_size":"256",)"
                              R"("block_size":"64","num_layers":"2","num_heads":"2",)"
                              R"("channels":"64"})"));
  CkptRun four;
  four.heads = 4;  // C = 64: the same tensors, another model
  auto r = RunThreads(2, four, 1, dir_ + "/c", "");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(r.status().message()),
              HasSubstr("/c holds another model: num_heads: 2 in the checkpoint, 4 in this "
                        "model. Use the checkpoint's configuration, or "
                        "LoadOptions::allow_model_change"));
  four.allow_model_change = true;
  r = RunThreads(2, four, 1, dir_ + "/c", "");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->loaded.model_recorded);
  EXPECT_THAT(r->loaded.model_changes,
              ::testing::ElementsAre("num_heads: 2 in the checkpoint, 4 in this model"));
  r = RunThreads(2, CkptRun{}, 1, dir_ + "/c", "");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->loaded.model_changes.empty());
}

TEST_F(CheckpointFilesTest, ExportRecordsTheModelAndImportComparesIt) {
  const std::string path = dir_ + "/m.safetensors";
  ASSERT_TRUE(LocalWorld::Run(2, {}, [&](Communicator& comm) -> absl::Status {
                FSDP_ASSIGN_OR_RETURN(auto backend, CpuBackend::Create({.num_threads = 1}));
                FSDP_ASSIGN_OR_RETURN(auto model, MakeModel(comm, backend.get(), CkptRun{}));
                return ExportSafetensors(model->runtime(), path);
              }).ok());
  auto import = [&](int heads, bool allow) {
    return LocalWorld::Run(2, {}, [&](Communicator& comm) -> absl::Status {
      FSDP_ASSIGN_OR_RETURN(auto backend, CpuBackend::Create({.num_threads = 1}));
      CkptRun run;
      run.heads = heads;
      FSDP_ASSIGN_OR_RETURN(auto model, MakeModel(comm, backend.get(), run));
      SafetensorsImportOptions o;
      o.allow_model_change = allow;
      return ImportSafetensors(model->runtime(), path, o);
    });
  };
  EXPECT_TRUE(import(0, false).ok());
  const absl::Status s = import(4, false);
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("m.safetensors holds another model: num_heads: 2 in the file, 4 in this "
                        "model"));
  EXPECT_TRUE(import(4, true).ok());
}

TEST_F(CheckpointFilesTest, ExportReplacesOnlySafetensorsAndCleansUpDeadTemporaries) {
  const std::string path = dir_ + "/notes.txt";
  std::ofstream(path) << "notes";
  const absl::Status s = LocalWorld::Run(2, {}, [&](Communicator& comm) -> absl::Status {
    FSDP_ASSIGN_OR_RETURN(auto backend, CpuBackend::Create({.num_threads = 1}));
    FSDP_ASSIGN_OR_RETURN(auto model, MakeModel(comm, backend.get(), CkptRun{}));
    return ExportSafetensors(model->runtime(), path);
  });
  EXPECT_THAT(std::string(s.message()), HasSubstr("it exists and is not a safetensors file"));
  EXPECT_EQ(ReadAll(path), "notes");
  // Temporaries of killed exports: an empty one and a begun one go, a foreign one stays.
  const std::string m = dir_ + "/m.safetensors";
  std::ofstream(m + ".tmp-999991") << "";
  std::string begun(8, '\0');
  begun[0] = 8;
  std::ofstream(m + ".tmp-999992", std::ios::binary) << begun << "{}      ";
  std::ofstream(m + ".tmp-999993") << "someone's file";
  std::ofstream(m + ".tmp-x") << "";
  auto removed = RemoveDeadExportTemporaries(m);
  ASSERT_TRUE(removed.ok()) << removed.status();
  EXPECT_THAT(*removed, ::testing::ElementsAre(m + ".tmp-999991", m + ".tmp-999992"));
  EXPECT_TRUE(fs::exists(m + ".tmp-999993"));
  EXPECT_TRUE(fs::exists(m + ".tmp-x"));
}

}  // namespace
}  // namespace fsdp::testing
