// What must never go wrong with sharded checkpoints, ranks as threads: a flipped byte, a
// truncated or missing shard, metadata of another model, a missing COMMIT marker are each an
// error naming the file, nothing is loaded on any rank, and the older checkpoint next to it
// still loads; a save that crashes at any point leaves no visible checkpoint and the previous
// one intact; a resume passes over a checkpoint with a damaged file unless told not to.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>

#include "tests/checkpoint/ckpt_util.h"

namespace fsdp::testing {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;


void FlipByte(const std::string& path, uint64_t offset) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(static_cast<std::streamoff>(offset));
  char c = 0;
  f.read(&c, 1);
  c = static_cast<char>(c ^ 0x10);
  f.seekp(static_cast<std::streamoff>(offset));
  f.write(&c, 1);
}

// On 2 ranks: a model is trained 1 step, loading `dir` is attempted, and the parameters and
// step afterwards must be exactly those before on every rank. Returns rank 0's status (all
// ranks must return the same).
absl::Status AttemptLoad(const std::string& dir) {
  std::vector<absl::Status> got(2);
  absl::Status run = LocalWorld::Run(2, {}, [&](Communicator& comm) -> absl::Status {
    FSDP_ASSIGN_OR_RETURN(auto backend, CpuBackend::Create({.num_threads = 1}));
    FSDP_ASSIGN_OR_RETURN(auto model, MakeModel(comm, backend.get(), CkptRun{}));
    nn::Batch b = RankBatch(TrainSpec{}, comm.rank(), 2, 0, 0);
    FSDP_RETURN_IF_ERROR(model->ForwardBackward(b.inputs.data(), b.targets.data()).status());
    FSDP_RETURN_IF_ERROR(model->Step(1e-3f).status());
    FSDP_ASSIGN_OR_RETURN(auto before, model->GatherModelUnits());
    got[comm.rank()] = LoadCheckpoint(model->runtime(), dir).status();
    FSDP_ASSIGN_OR_RETURN(auto after, model->GatherModelUnits());
    const bool same = BitEqual(before, after) && model->runtime().steps() == 1;
    if (!got[comm.rank()].ok() && !same)
      return absl::InternalError("a failed load changed the model");
    return absl::OkStatus();
  });
  if (!run.ok()) return absl::InternalError(absl::StrCat("harness: ", run.ToString()));
  if (got[0] != got[1]) {
    return absl::InternalError(
        absl::StrCat("ranks disagree: ", got[0].ToString(), " vs ", got[1].ToString()));
  }
  return got[0];
}

class CorruptionTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    parent_ = absl::StrCat(::testing::TempDir(), "/fsdp_ckpt_corrupt_", getpid());
    fs::remove_all(parent_);
    fs::create_directories(parent_);
    auto older = RunThreads(2, CkptRun{}, 3, "", parent_ + "/step-3");
    ASSERT_TRUE(older.ok()) << older.status();
    older_params_ = older->params;
    ASSERT_TRUE(RunThreads(2, CkptRun{}, 6, "", parent_ + "/step-6").ok());
    CkptRun narrow;
    narrow.config = "nano-narrow";
    ASSERT_TRUE(RunThreads(2, narrow, 1, "", parent_ + "/narrow").ok());
  }
  static void TearDownTestSuite() { fs::remove_all(parent_); }

  // A copy of the newer checkpoint to damage.
  std::string Copy(const std::string& name) {
    const std::string d = parent_ + "/" + name;
    fs::copy(parent_ + "/step-6", d, fs::copy_options::recursive);
    return d;
  }

  // After every failure, the older checkpoint in the same parent loads and is intact.
  void ExpectOlderLoads() {
    auto r = RunThreads(2, CkptRun{}, 0, parent_ + "/step-3", "");
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_TRUE(BitEqual(r->params, older_params_));
  }

  static std::string parent_;
  static std::vector<std::vector<float>> older_params_;
};
std::string CorruptionTest::parent_;
std::vector<std::vector<float>> CorruptionTest::older_params_;

TEST_F(CorruptionTest, IntactCheckpointLoads) { EXPECT_TRUE(AttemptLoad(Copy("intact")).ok()); }

TEST_F(CorruptionTest, FlippedByteInAShardIsAChecksumError) {
  // Only rank 1 reads shard 1: rank 0 must still load nothing.
  const std::string d = Copy("flipped");
  FlipByte(d + "/shard-00001-of-00002.bin", 1000);
  absl::Status s = AttemptLoad(d);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("shard-00001-of-00002.bin: checksum mismatch"));
  ExpectOlderLoads();
}

TEST_F(CorruptionTest, FlippedByteInAShardHeader) {
  const std::string d = Copy("flipped_header");
  FlipByte(d + "/shard-00000-of-00002.bin", 20);
  absl::Status s = AttemptLoad(d);
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("shard-00000-of-00002.bin: shard header checksum"));
  ExpectOlderLoads();
}

TEST_F(CorruptionTest, TruncatedShard) {
  const std::string d = Copy("truncated");
  const std::string f = d + "/shard-00000-of-00002.bin";
  fs::resize_file(f, fs::file_size(f) - 100);
  absl::Status s = AttemptLoad(d);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("shard-00000-of-00002.bin"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("truncated"));
  ExpectOlderLoads();
}

TEST_F(CorruptionTest, MissingShard) {
  const std::string d = Copy("missing");
  fs::remove(d + "/shard-00001-of-00002.bin");
  absl::Status s = AttemptLoad(d);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("shard-00001-of-00002.bin: shard file missing"));
  ExpectOlderLoads();
}

TEST_F(CorruptionTest, MissingCommitMarkerMeansIncomplete) {
  const std::string d = Copy("no_commit");
  fs::remove(d + "/COMMIT");
  absl::Status s = AttemptLoad(d);
  EXPECT_THAT(std::string(s.message()), HasSubstr("COMMIT: missing: the checkpoint is incomplete"));
  ExpectOlderLoads();
}

TEST_F(CorruptionTest, MetadataFromAnotherModelFailsItsChecksum) {
  const std::string d = Copy("other_metadata");
  fs::copy_file(parent_ + "/narrow/metadata.json", d + "/metadata.json",
                fs::copy_options::overwrite_existing);
  absl::Status s = AttemptLoad(d);
  EXPECT_THAT(std::string(s.message()), HasSubstr("metadata.json: checksum mismatch"));
  ExpectOlderLoads();
}

TEST_F(CorruptionTest, MetadataAndCommitFromAnotherModelNameTheTensor) {
  const std::string d = Copy("other_model");
  for (const char* f : {"metadata.json", "COMMIT"}) {
    fs::copy_file(parent_ + "/narrow/" + f, d + "/" + f, fs::copy_options::overwrite_existing);
  }
  absl::Status s = AttemptLoad(d);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("holds another model: tensor 'transformer.wte.weight' has shape "
                        "[256, 32] in the checkpoint but [256, 64] in this model"));
  ExpectOlderLoads();
}

TEST_F(CorruptionTest, FlippedByteInMetadata) {
  const std::string d = Copy("flipped_metadata");
  FlipByte(d + "/metadata.json", 30);
  absl::Status s = AttemptLoad(d);
  EXPECT_THAT(std::string(s.message()), HasSubstr("metadata.json: checksum mismatch"));
  ExpectOlderLoads();
}

TEST_F(CorruptionTest, NoSuchDirectory) {
  EXPECT_EQ(AttemptLoad(parent_ + "/nope").code(), absl::StatusCode::kNotFound);
}

// A save that "crashes" (the fault hook stops it) at each point, on every rank or on rank 1
// only: no checkpoint becomes visible, the previous one stays intact, the next save works.
class CrashTest : public ::testing::TestWithParam<std::pair<const char*, bool>> {};

TEST_P(CrashTest, CrashDuringSaveLeavesNoHalfCheckpoint) {
  const auto [point, only_rank1] = GetParam();
  const std::string parent = absl::StrCat(::testing::TempDir(), "/fsdp_ckpt_crash_", getpid(), "_",
                                          point, only_rank1 ? "_r1" : "");
  fs::remove_all(parent);
  auto prev = RunThreads(2, CkptRun{}, 2, "", parent + "/step-2");
  ASSERT_TRUE(prev.ok()) << prev.status();
  absl::Status s = LocalWorld::Run(2, {}, [&](Communicator& comm) -> absl::Status {
    FSDP_ASSIGN_OR_RETURN(auto backend, CpuBackend::Create({.num_threads = 1}));
    FSDP_ASSIGN_OR_RETURN(auto model, MakeModel(comm, backend.get(), CkptRun{}));
    SaveOptions o;
    o.fault_injection = [&, point = std::string(point), only = only_rank1](std::string_view at) {
      if (at == point && (!only || comm.rank() == 1)) return absl::AbortedError("simulated crash");
      return absl::OkStatus();
    };
    absl::Status crashed = SaveCheckpoint(model->runtime(), parent + "/step-4", {}, o);
    if (crashed.ok()) return absl::InternalError("the save did not fail");
    if (crashed.message().find("save interrupted at") == absl::string_view::npos) return crashed;
    // The same for a save that replaces the previous checkpoint.
    o.overwrite = true;
    crashed = SaveCheckpoint(model->runtime(), parent + "/step-2", {}, o);
    if (crashed.ok()) return absl::InternalError("the overwriting save did not fail");
    return absl::OkStatus();
  });
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_FALSE(fs::exists(parent + "/step-4"));
  auto latest = LatestCheckpoint(parent);
  ASSERT_TRUE(latest.ok()) << latest.status();
  EXPECT_EQ(*latest, parent + "/step-2");
  auto reload = RunThreads(2, CkptRun{}, 0, parent + "/step-2", "");
  ASSERT_TRUE(reload.ok()) << reload.status();
  EXPECT_TRUE(BitEqual(reload->params, prev->params));
  // The next save of the same name succeeds and cleans up what the crash left.
  ASSERT_TRUE(RunThreads(2, CkptRun{}, 4, "", parent + "/step-4").ok());
  for (const auto& e : fs::directory_iterator(parent)) {
    EXPECT_EQ(e.path().filename().string().find("step-4.tmp-"), std::string::npos) << e.path();
  }
  EXPECT_EQ(*LatestCheckpoint(parent), parent + "/step-4");
  fs::remove_all(parent);
}

INSTANTIATE_TEST_SUITE_P(Points, CrashTest,
                         ::testing::Values(std::make_pair("shard_written", false),
                                           std::make_pair("shard_written", true),
                                           std::make_pair("metadata_written", false),
                                           std::make_pair("metadata_written", true),
                                           std::make_pair("commit_written", false)),
                         [](const ::testing::TestParamInfo<std::pair<const char*, bool>>& i) {
                           return absl::StrCat(i.param.first,
                                               i.param.second ? "_rank1_only" : "_all_ranks");
                         });

// The newest checkpoint damaged after it was written (its COMMIT marker removed): a resumed
// run falls back to the previous one, trains the same steps again and saves the same step
// again. That save must replace the damaged directory, not fail with AlreadyExists.
TEST(DamagedNewestTest, SaveReplacesACheckpointWithoutCommitMarker) {
  const std::string parent =
      absl::StrCat(::testing::TempDir(), "/fsdp_ckpt_replace_", getpid());
  fs::remove_all(parent);
  ASSERT_TRUE(RunThreads(2, CkptRun{}, 2, "", parent + "/step-2").ok());
  auto four = RunThreads(2, CkptRun{}, 4, "", parent + "/step-4");
  ASSERT_TRUE(four.ok()) << four.status();
  fs::remove(parent + "/step-4/COMMIT");
  ASSERT_EQ(*LatestCheckpoint(parent), parent + "/step-2");
  auto again = RunThreads(2, CkptRun{}, 2, parent + "/step-2", parent + "/step-4");
  ASSERT_TRUE(again.ok()) << again.status();
  ASSERT_EQ(*LatestCheckpoint(parent), parent + "/step-4");
  auto reload = RunThreads(2, CkptRun{}, 0, parent + "/step-4", "");
  ASSERT_TRUE(reload.ok()) << reload.status();
  EXPECT_TRUE(BitEqual(reload->params, four->params));  // 2 + 2 steps == 4 steps
  for (const auto& e : fs::directory_iterator(parent)) {
    const std::string name = e.path().filename().string();
    EXPECT_TRUE(name == "step-2" || name == "step-4") << "left behind: " << name;
  }
  fs::remove_all(parent);
}

// LatestCheckpoint passes over a checkpoint whose COMMIT marker is missing or damaged, or
// whose metadata.json does not match it, and says which and why; directories that hold
// anything but checkpoint files are not reported. A save of the same name replaces such a
// checkpoint unless SaveOptions::replace_incomplete is off; a directory holding other files is
// never replaced, not even with overwrite.
TEST(DamagedNewestTest, LatestCheckpointReportsWhatItSkippedAndWhy) {
  const std::string parent =
      absl::StrCat(::testing::TempDir(), "/fsdp_ckpt_skipped_", getpid());
  const std::string pristine = parent + "-pristine";
  fs::remove_all(parent);
  fs::remove_all(pristine);
  ASSERT_TRUE(RunThreads(2, CkptRun{}, 2, "", parent + "/step-2").ok());
  ASSERT_TRUE(RunThreads(2, CkptRun{}, 4, "", pristine).ok());
  fs::create_directories(parent + "/logs");
  std::ofstream(parent + "/logs/run.txt") << "not a checkpoint";
  const std::string d = parent + "/step-4";
  struct Damage {
    const char* what;
    std::function<void()> apply;
    const char* why;
  };
  const std::vector<Damage> damages = {
      {"COMMIT removed", [&] { fs::remove(d + "/COMMIT"); },
       "step-4/COMMIT: missing: the checkpoint is incomplete"},
      {"COMMIT overwritten", [&] { std::ofstream(d + "/COMMIT", std::ios::trunc) << "garbage\n"; },
       "step-4/COMMIT: not a libfsdp commit marker"},
      {"byte of COMMIT flipped", [&] { FlipByte(d + "/COMMIT", 30); }, "step-4/COMMIT"},
      {"metadata.json replaced",
       [&] { std::ofstream(d + "/metadata.json", std::ios::trunc) << "{}"; },
       "step-4/metadata.json: checksum mismatch"},
      {"metadata.json removed", [&] { fs::remove(d + "/metadata.json"); },
       "step-4/metadata.json: missing or unreadable"},
  };
  for (const Damage& damage : damages) {
    SCOPED_TRACE(damage.what);
    fs::remove_all(d);
    fs::copy(pristine, d, fs::copy_options::recursive);
    damage.apply();
    std::vector<SkippedCheckpoint> skipped = {{"stale entry", absl::OkStatus()}};
    auto latest = LatestCheckpoint(parent, &skipped);
    ASSERT_TRUE(latest.ok()) << latest.status();
    EXPECT_EQ(*latest, parent + "/step-2");
    ASSERT_EQ(skipped.size(), 1u);
    EXPECT_EQ(skipped[0].path, d);
    EXPECT_EQ(skipped[0].why.code(), absl::StatusCode::kDataLoss) << skipped[0].why;
    EXPECT_THAT(std::string(skipped[0].why.message()), HasSubstr(damage.why));
    // LoadCheckpoint refuses it with the same reason.
    EXPECT_THAT(std::string(AttemptLoad(d).message()), HasSubstr(damage.why));
  }
  absl::Status s = LocalWorld::Run(2, {}, [&](Communicator& comm) -> absl::Status {
    FSDP_ASSIGN_OR_RETURN(auto backend, CpuBackend::Create({.num_threads = 1}));
    FSDP_ASSIGN_OR_RETURN(auto model, MakeModel(comm, backend.get(), CkptRun{}));
    SaveOptions keep;
    keep.replace_incomplete = false;
    absl::Status refused = SaveCheckpoint(model->runtime(), d, {}, keep);
    if (refused.code() != absl::StatusCode::kAlreadyExists ||
        refused.message().find("incomplete or damaged checkpoint") == absl::string_view::npos) {
      return absl::InternalError(absl::StrCat("replace_incomplete off: ", refused.ToString()));
    }
    SaveOptions overwrite;
    overwrite.overwrite = true;
    refused = SaveCheckpoint(model->runtime(), parent + "/logs", {}, overwrite);
    if (refused.code() != absl::StatusCode::kAlreadyExists ||
        refused.message().find("is not a checkpoint") == absl::string_view::npos) {
      return absl::InternalError(absl::StrCat("other files: ", refused.ToString()));
    }
    return SaveCheckpoint(model->runtime(), d);  // replaces the damaged one
  });
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_TRUE(fs::exists(parent + "/logs/run.txt"));
  std::vector<SkippedCheckpoint> skipped;
  auto latest = LatestCheckpoint(parent, &skipped);
  ASSERT_TRUE(latest.ok()) << latest.status();
  EXPECT_TRUE(skipped.empty());
  EXPECT_TRUE(AttemptLoad(d).ok());
  // Nothing intact at all: NotFound, with every damaged one reported.
  fs::remove(d + "/COMMIT");
  fs::remove(parent + "/step-2/COMMIT");
  latest = LatestCheckpoint(parent, &skipped);
  EXPECT_EQ(latest.status().code(), absl::StatusCode::kNotFound) << latest.status();
  ASSERT_EQ(skipped.size(), 2u);
  EXPECT_EQ(skipped[0].path, parent + "/step-2");
  EXPECT_EQ(skipped[1].path, d);
  fs::remove_all(parent);
  fs::remove_all(pristine);
}

// ResumeFromLatestCheckpoint verifies every file of the newest committed checkpoint before it
// loads anything: a shard file with a flipped byte, cut short or missing is reported with the
// file and why, and the resume falls back to the previous intact checkpoint (bitwise its
// parameters), on the saved world size and on another one. With fallback off it is a DataLoss
// error on every rank naming the file, and nothing is loaded.
TEST(DamagedNewestTest, ResumeVerifiesEveryFileAndFallsBackPastADamagedShard) {
  const std::string parent =
      absl::StrCat(::testing::TempDir(), "/fsdp_ckpt_fallback_", getpid());
  const std::string pristine = parent + "-pristine";
  fs::remove_all(parent);
  fs::remove_all(pristine);
  absl::StatusOr<CkptResult> at2 = RunThreads(2, CkptRun{}, 2, "", parent + "/step-2");
  ASSERT_TRUE(at2.ok()) << at2.status();
  ASSERT_TRUE(RunThreads(2, CkptRun{}, 4, "", pristine).ok());
  std::vector<std::string> shards;
  for (const auto& e : fs::directory_iterator(pristine)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("shard-", 0) == 0) shards.push_back(name);
  }
  std::sort(shards.begin(), shards.end());
  ASSERT_EQ(shards.size(), 2u);
  const std::string d = parent + "/step-4";
  struct Damage {
    const char* what;
    std::function<void()> apply;
    std::string file, why;
  };
  const std::vector<Damage> damages = {
      {"a byte of the second shard file flipped",
       [&] { FlipByte(d + "/" + shards[1], fs::file_size(d + "/" + shards[1]) - 5); }, shards[1],
       "checksum mismatch"},
      {"the first shard file cut short",
       [&] { fs::resize_file(d + "/" + shards[0], fs::file_size(d + "/" + shards[0]) - 10); },
       shards[0], "(truncated)"},
      {"the second shard file removed", [&] { fs::remove(d + "/" + shards[1]); }, shards[1],
       "shard file missing or unreadable"},
  };
  for (const Damage& damage : damages) {
    for (int world : {2, 3}) {
      for (bool fallback : {true, false}) {
        SCOPED_TRACE(absl::StrCat(damage.what, ", ", world, " ranks, fallback ", fallback));
        fs::remove_all(d);
        fs::copy(pristine, d, fs::copy_options::recursive);
        damage.apply();
        std::vector<absl::StatusOr<ResumedCheckpoint>> resumed(world);
        std::vector<std::vector<std::vector<float>>> before(world), after(world);
        std::vector<int64_t> steps(world, -1);
        ASSERT_TRUE(LocalWorld::Run(world, {}, [&](Communicator& comm) -> absl::Status {
          FSDP_ASSIGN_OR_RETURN(auto backend, CpuBackend::Create({.num_threads = 1}));
          FSDP_ASSIGN_OR_RETURN(auto model, MakeModel(comm, backend.get(), CkptRun{}));
          FSDP_ASSIGN_OR_RETURN(before[comm.rank()], model->GatherModelUnits());
          ResumeOptions options;
          options.fallback = fallback;
          resumed[comm.rank()] = ResumeFromLatestCheckpoint(model->runtime(), parent, options);
          steps[comm.rank()] = model->runtime().steps();
          FSDP_ASSIGN_OR_RETURN(after[comm.rank()], model->GatherModelUnits());
          return absl::OkStatus();
        }).ok());
        for (int r = 0; r < world; ++r) {
          SCOPED_TRACE(absl::StrCat("rank ", r));
          if (fallback) {
            ASSERT_TRUE(resumed[r].ok()) << resumed[r].status();
            EXPECT_EQ(resumed[r]->path, parent + "/step-2");
            ASSERT_EQ(resumed[r]->skipped.size(), 1u);
            const SkippedCheckpoint& k = resumed[r]->skipped[0];
            EXPECT_EQ(k.path, d);
            EXPECT_EQ(k.why.code(), absl::StatusCode::kDataLoss) << k.why;
            EXPECT_THAT(std::string(k.why.message()), HasSubstr(d + "/" + damage.file));
            EXPECT_THAT(std::string(k.why.message()), HasSubstr(damage.why));
            EXPECT_EQ(steps[r], 2);
            EXPECT_TRUE(BitEqual(after[r], at2->params)) << "not step-2's parameters";
          } else {
            ASSERT_FALSE(resumed[r].ok());
            const absl::Status& e = resumed[r].status();
            EXPECT_EQ(e.code(), absl::StatusCode::kDataLoss) << e;
            EXPECT_THAT(std::string(e.message()), HasSubstr(d + "/" + damage.file));
            EXPECT_THAT(std::string(e.message()), HasSubstr(damage.why));
            EXPECT_THAT(std::string(e.message()), HasSubstr("ResumeOptions::fallback"));
            EXPECT_EQ(steps[r], 0);
            EXPECT_TRUE(BitEqual(after[r], before[r])) << "something was loaded";
          }
        }
      }
    }
  }
  // Intact again: the newest is resumed from, nothing skipped; VerifyCheckpoint passes.
  fs::remove_all(d);
  fs::copy(pristine, d, fs::copy_options::recursive);
  ASSERT_TRUE(LocalWorld::Run(2, {}, [&](Communicator& comm) -> absl::Status {
    FSDP_RETURN_IF_ERROR(VerifyCheckpoint(comm, d));
    FSDP_ASSIGN_OR_RETURN(auto backend, CpuBackend::Create({.num_threads = 1}));
    FSDP_ASSIGN_OR_RETURN(auto model, MakeModel(comm, backend.get(), CkptRun{}));
    FSDP_ASSIGN_OR_RETURN(ResumedCheckpoint r, ResumeFromLatestCheckpoint(model->runtime(), parent));
    if (r.path != d || !r.skipped.empty() || r.loaded.step != 4) {
      return absl::InternalError(absl::StrCat("resumed ", r.path, " at ", r.loaded.step, " with ",
                                              r.skipped.size(), " skipped"));
    }
    return absl::OkStatus();
  }).ok());
  // No checkpoint at all: nothing loaded, no error.
  const std::string empty = parent + "-empty";
  ASSERT_TRUE(LocalWorld::Run(2, {}, [&](Communicator& comm) -> absl::Status {
    FSDP_ASSIGN_OR_RETURN(auto backend, CpuBackend::Create({.num_threads = 1}));
    FSDP_ASSIGN_OR_RETURN(auto model, MakeModel(comm, backend.get(), CkptRun{}));
    FSDP_ASSIGN_OR_RETURN(ResumedCheckpoint r, ResumeFromLatestCheckpoint(model->runtime(), empty));
    if (!r.path.empty() || !r.skipped.empty() || model->runtime().steps() != 0) {
      return absl::InternalError(absl::StrCat("resumed '", r.path, "' from nothing"));
    }
    return absl::OkStatus();
  }).ok());
  fs::remove_all(parent);
  fs::remove_all(pristine);
}

}  // namespace
}  // namespace fsdp::testing

namespace fsdp::testing {
namespace {

// A model whose parameters hold a NaN (a diverged run) is never saved or exported without the
// explicit override, on every rank, leaving nothing behind; a checkpoint or file holding NaN
// (written with the override) is not loaded or imported without it.
TEST(NonFiniteTest, DivergedModelsAreNotSavedExportedLoadedOrImported) {
  const std::string parent = absl::StrCat(::testing::TempDir(), "/fsdp_ckpt_nan_", getpid());
  fs::remove_all(parent);
  fs::create_directories(parent);
  std::vector<absl::Status> save(2), save_forced(2), load(2), load_forced(2), exported(2),
      exported_forced(2), imported(2), imported_forced(2);
  absl::Status run = LocalWorld::Run(2, {}, [&](Communicator& comm) -> absl::Status {
    const int r = comm.rank();
    FSDP_ASSIGN_OR_RETURN(auto backend, CpuBackend::Create({.num_threads = 1}));
    FSDP_ASSIGN_OR_RETURN(auto model, MakeModel(comm, backend.get(), CkptRun{}));
    ShardingRuntime& rt = model->runtime();
    // Rank 1's shard of the last unit diverged.
    if (r == 1) rt.param_shard(rt.num_units() - 1).host_as<float>()[3] = NAN;
    save[r] = SaveCheckpoint(rt, parent + "/step-1");
    exported[r] = ExportSafetensors(rt, parent + "/m.safetensors");
    SaveOptions force_save;
    force_save.allow_nonfinite = true;
    save_forced[r] = SaveCheckpoint(rt, parent + "/forced", {}, force_save);
    SafetensorsExportOptions force_export;
    force_export.allow_nonfinite = true;
    exported_forced[r] = ExportSafetensors(rt, parent + "/forced.safetensors", force_export);
    // A fresh model refuses both files unless told otherwise.
    FSDP_ASSIGN_OR_RETURN(auto fresh, MakeModel(comm, backend.get(), CkptRun{}));
    FSDP_ASSIGN_OR_RETURN(auto before, fresh->GatherModelUnits());
    load[r] = LoadCheckpoint(fresh->runtime(), parent + "/forced").status();
    imported[r] = ImportSafetensors(fresh->runtime(), parent + "/forced.safetensors");
    FSDP_ASSIGN_OR_RETURN(auto after, fresh->GatherModelUnits());
    if (!BitEqual(before, after)) return absl::InternalError("a refused load changed the model");
    LoadOptions force_load;
    force_load.allow_nonfinite = true;
    load_forced[r] = LoadCheckpoint(fresh->runtime(), parent + "/forced", force_load).status();
    SafetensorsImportOptions force_import;
    force_import.allow_nonfinite = true;
    imported_forced[r] =
        ImportSafetensors(fresh->runtime(), parent + "/forced.safetensors", force_import);
    return absl::OkStatus();
  });
  ASSERT_TRUE(run.ok()) << run;
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(save[r].code(), absl::StatusCode::kFailedPrecondition) << save[r];
    EXPECT_THAT(save[r].message(), HasSubstr("holds NaN"));
    EXPECT_THAT(save[r].message(), HasSubstr("allow_nonfinite"));
    EXPECT_EQ(exported[r].code(), absl::StatusCode::kFailedPrecondition) << exported[r];
    EXPECT_THAT(exported[r].message(), HasSubstr("tensor 'transformer.h.1."));
    EXPECT_EQ(load[r].code(), absl::StatusCode::kFailedPrecondition) << load[r];
    EXPECT_THAT(load[r].message(), HasSubstr("not resuming from"));
    EXPECT_EQ(imported[r].code(), absl::StatusCode::kFailedPrecondition) << imported[r];
    EXPECT_THAT(imported[r].message(), HasSubstr("holds NaN"));
    EXPECT_TRUE(save_forced[r].ok()) << save_forced[r];
    EXPECT_TRUE(exported_forced[r].ok()) << exported_forced[r];
    EXPECT_TRUE(load_forced[r].ok()) << load_forced[r];
    EXPECT_TRUE(imported_forced[r].ok()) << imported_forced[r];
  }
  // The refused save and export left nothing behind.
  EXPECT_FALSE(fs::exists(parent + "/step-1"));
  EXPECT_FALSE(fs::exists(parent + "/m.safetensors"));
  for (const auto& e : fs::directory_iterator(parent)) {
    const std::string name = e.path().filename().string();
    EXPECT_TRUE(name == "forced" || name == "forced.safetensors") << "left behind: " << name;
  }
  fs::remove_all(parent);
}

}  // namespace
}  // namespace fsdp::testing
