// Sharded checkpoints with ranks as threads: exact resume for every strategy (bit for bit at
// the same world size), resharding to other world sizes, meshes, strategies and wrap
// policies (parity tolerance), the optimizer and rank state, and LatestCheckpoint.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include "tests/checkpoint/ckpt_util.h"

namespace fsdp::testing {
namespace {

constexpr double kTol = 1e-5;  // the parity tests' tolerance

std::string FreshDir(const std::string& name) {
  const std::string d = absl::StrCat(::testing::TempDir(), "/fsdp_ckpt_", getpid(), "_", name);
  std::filesystem::remove_all(d);
  std::filesystem::create_directories(d);
  return d;
}

bool BitEqual(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
}

struct ResumeCase {
  const char* name;
  ShardingStrategy strategy;
  int world;
  int hybrid_shard = 0;
  OptimizerKind optimizer = OptimizerKind::kAdamW;
  const char* model = "nano";
};

class ExactResumeTest : public ::testing::TestWithParam<ResumeCase> {};

// 10 steps, save, a fresh model (another init seed) loads, 10 more: the same losses and
// parameters as 20 uninterrupted steps, bit for bit.
TEST_P(ExactResumeTest, TenPlusTenEqualsTwentyBitForBit) {
  const ResumeCase c = GetParam();
  CkptRun run;
  run.config = c.model;
  run.strategy = c.strategy;
  run.hybrid_shard = c.hybrid_shard;
  run.optimizer = c.optimizer;
  const std::string dir = FreshDir(c.name);
  auto full = RunThreads(c.world, run, 20, "", "");
  ASSERT_TRUE(full.ok()) << full.status();
  auto first = RunThreads(c.world, run, 10, "", dir + "/step-10");
  ASSERT_TRUE(first.ok()) << first.status();
  CkptRun resumed = run;
  resumed.init_seed = 4242;  // everything must come from the checkpoint
  auto second = RunThreads(c.world, resumed, 10, dir + "/step-10", "");
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(second->loaded.step, 10);
  EXPECT_TRUE(second->loaded.rank_state_restored);
  EXPECT_EQ(second->loaded.state.values.at("note"), "ckpt test");
  for (int i = 0; i < 10; ++i) {
    EXPECT_EQ(first->losses[i], full->losses[i]) << "step " << i;
    EXPECT_EQ(second->losses[i], full->losses[10 + i]) << "step " << 10 + i;
  }
  ASSERT_EQ(second->params.size(), full->params.size());
  for (size_t u = 0; u < full->params.size(); ++u) {
    EXPECT_TRUE(BitEqual(second->params[u], full->params[u])) << "unit " << u;
  }
  if (c.optimizer == OptimizerKind::kAdamW) {  // SGD at this learning rate barely moves
    EXPECT_LT(full->losses.back(), full->losses.front() - 0.3) << "training did not progress";
  }
  std::filesystem::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(
    Strategies, ExactResumeTest,
    ::testing::Values(ResumeCase{"FULL_SHARD_N2", ShardingStrategy::kFullShard, 2},
                      ResumeCase{"FULL_SHARD_N3", ShardingStrategy::kFullShard, 3},
                      ResumeCase{"SHARD_GRAD_OP_N2", ShardingStrategy::kShardGradOp, 2},
                      ResumeCase{"NO_SHARD_N2", ShardingStrategy::kNoShard, 2},
                      ResumeCase{"HYBRID_SHARD_N4_S2", ShardingStrategy::kHybridShard, 4, 2},
                      ResumeCase{"llama_FULL_SHARD_N2", ShardingStrategy::kFullShard, 2, 0,
                                 OptimizerKind::kAdamW, "llama-nano"},
                      ResumeCase{"llama_HYBRID_SHARD_N4_S2", ShardingStrategy::kHybridShard, 4,
                                 2, OptimizerKind::kAdamW, "llama-nano"},
                      ResumeCase{"HYBRID_SHARD_GRAD_OP_N4_S2", ShardingStrategy::kHybridShardGradOp,
                                 4, 2},
                      ResumeCase{"FULL_SHARD_N2_SGD_momentum", ShardingStrategy::kFullShard, 2, 0,
                                 OptimizerKind::kSgd}),
    [](const ::testing::TestParamInfo<ResumeCase>& i) { return std::string(i.param.name); });

// A layout: world size, strategy, mesh and wrap policy. The global batch is 12 rows on
// every layout, so the losses are comparable across world sizes.
struct Layout {
  const char* name;
  int world;
  ShardingStrategy strategy;
  int hybrid_shard = 0;
  bool one_unit = false;  // every block in the root unit instead of one unit per block
};

CkptRun RunFor(const Layout& l) {
  CkptRun r;
  r.strategy = l.strategy;
  r.hybrid_shard = l.hybrid_shard;
  r.batch_size = 12 / l.world;
  if (l.one_unit) r.wrap.kind = nn::WrapPolicy::Kind::kExplicit;
  return r;
}

const Layout kFull2{"FULL_SHARD_N2", 2, ShardingStrategy::kFullShard};
const Layout kFull3{"FULL_SHARD_N3", 3, ShardingStrategy::kFullShard};
const Layout kHybrid4{"HYBRID_SHARD_N4_S2", 4, ShardingStrategy::kHybridShard, 2};
const Layout kNoShard1{"NO_SHARD_N1", 1, ShardingStrategy::kNoShard};
const Layout kGradOp3OneUnit{"SHARD_GRAD_OP_N3_one_unit", 3, ShardingStrategy::kShardGradOp, 0,
                             true};

struct ReshardCase {
  Layout save, load;
  Clip clip = Clip::kAlways;
};

class ReshardTest : public ::testing::TestWithParam<ReshardCase> {};

// Saved on one layout after 10 steps, loaded on another, 10 more: the losses, the pre-clip
// gradient norms and the parameters of 20 uninterrupted steps on the saving layout, to the
// parity tolerance, with clipping off, on some steps and on every step (the norms see a
// gradient scale that AdamW and clipping would hide).
TEST_P(ReshardTest, ResumesOnAnotherLayout) {
  const ReshardCase c = GetParam();
  const std::string dir = FreshDir(absl::StrCat(c.save.name, "_to_", c.load.name, "_",
                                                ClipName(c.clip)));
  CkptRun save = RunFor(c.save);
  save.max_grad_norm = 0;
  auto unclipped = RunThreads(c.save.world, save, 20, "", "");
  ASSERT_TRUE(unclipped.ok()) << unclipped.status();
  save.max_grad_norm = ClipThreshold(c.clip, unclipped->grad_norms);
  auto full = RunThreads(c.save.world, save, 20, "", "");
  ASSERT_TRUE(full.ok()) << full.status();
  switch (c.clip) {
    case Clip::kOff: EXPECT_EQ(full->clipped_steps, 0); break;
    case Clip::kSome:
      EXPECT_GT(full->clipped_steps, 0);
      EXPECT_LT(full->clipped_steps, 20);
      break;
    case Clip::kAlways: EXPECT_EQ(full->clipped_steps, 20); break;
  }
  auto first = RunThreads(c.save.world, save, 10, "", dir + "/ckpt");
  ASSERT_TRUE(first.ok()) << first.status();
  CkptRun load = RunFor(c.load);
  load.init_seed = 99;
  load.max_grad_norm = save.max_grad_norm;
  auto second = RunThreads(c.load.world, load, 10, dir + "/ckpt", "");
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(second->loaded.saved_world_size, c.save.world);
  EXPECT_EQ(second->loaded.rank_state_restored, c.save.world == c.load.world);
  for (int i = 0; i < 10; ++i) {
    const float want = full->losses[10 + i];
    EXPECT_NEAR(second->losses[i], want, kTol * want) << "step " << 10 + i;
    const double norm = full->grad_norms[10 + i];
    EXPECT_NEAR(second->grad_norms[i], norm, kTol * norm) << "gradient norm, step " << 10 + i;
  }
  ASSERT_EQ(second->params.size(), full->params.size());
  for (size_t u = 0; u < full->params.size(); ++u) {
    EXPECT_LT(NormRelDiff(second->params[u], full->params[u]), kTol) << "unit " << u;
  }
  std::filesystem::remove_all(dir);
}

std::vector<ReshardCase> ReshardCases() {
  std::vector<ReshardCase> out;
  for (Clip clip : {Clip::kOff, Clip::kSome, Clip::kAlways}) {
    for (ReshardCase c : {ReshardCase{kFull2, kFull3}, ReshardCase{kFull2, kHybrid4},
                          ReshardCase{kFull2, kNoShard1}, ReshardCase{kFull3, kFull2},
                          ReshardCase{kHybrid4, kFull2}, ReshardCase{kNoShard1, kFull2},
                          ReshardCase{kFull2, kGradOp3OneUnit},
                          ReshardCase{kGradOp3OneUnit, kHybrid4}}) {
      c.clip = clip;
      out.push_back(c);
    }
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Layouts, ReshardTest, ::testing::ValuesIn(ReshardCases()),
                         [](const ::testing::TestParamInfo<ReshardCase>& i) {
                           return absl::StrCat(i.param.save.name, "_to_", i.param.load.name, "_",
                                               ClipName(i.param.clip));
                         });

// A checkpoint is the model's, not the device's: saved by ranks on one backend, it resumes on
// ranks of another. 10 steps on `from`, saved; 10 more on `to` from the checkpoint: the losses
// and parameters of 20 steps on `from`, to the tolerance of the two backends' kernels (pjrt's
// programs sum in XLA's order).
void ExpectResumesAcross(const std::string& from, const std::string& to) {
  for (const std::string& b : {from, to}) {
    if (b == "pjrt" && !PjrtUnavailable().empty()) GTEST_SKIP() << PjrtUnavailable();
    if (b == "cuda" && !CudaUnavailable().empty()) GTEST_SKIP() << CudaUnavailable();
  }
  const double tol = (from == "cpu" || from == "sim") && to == "cpu" ? kTol : 1e-4;
  const std::string dir = FreshDir(from + "_to_" + to);
  for (const char* model : {"nano", "llama-nano"}) {
    SCOPED_TRACE(model);
    CkptRun save;
    save.config = model;
    save.backend = from;
    auto full = RunThreads(2, save, 20, "", "");
    ASSERT_TRUE(full.ok()) << full.status();
    auto first = RunThreads(2, save, 10, "", dir + "/ckpt");
    ASSERT_TRUE(first.ok()) << first.status();
    CkptRun load = save;
    load.backend = to;
    load.init_seed = 4242;
    auto second = RunThreads(2, load, 10, dir + "/ckpt", "");
    ASSERT_TRUE(second.ok()) << second.status();
    EXPECT_EQ(second->loaded.step, 10);
    for (int i = 0; i < 10; ++i) {
      const float want = full->losses[10 + i];
      EXPECT_NEAR(second->losses[i], want, tol * want) << "step " << 10 + i;
    }
    ASSERT_EQ(second->params.size(), full->params.size());
    for (size_t u = 0; u < full->params.size(); ++u) {
      EXPECT_LT(NormRelDiff(second->params[u], full->params[u]), tol) << "unit " << u;
    }
    EXPECT_LT(full->losses.back(), full->losses.front() - 0.3) << "training did not progress";
    std::filesystem::remove_all(dir + "/ckpt");
  }
  std::filesystem::remove_all(dir);
}

TEST(CrossBackendCheckpointTest, SavedOnPjrtResumesOnCpu) { ExpectResumesAcross("pjrt", "cpu"); }
TEST(CrossBackendCheckpointTest, SavedOnCpuResumesOnPjrt) { ExpectResumesAcross("cpu", "pjrt"); }
TEST(CrossBackendCheckpointTest, SavedOnCudaResumesOnCpu) { ExpectResumesAcross("cuda", "cpu"); }
TEST(CrossBackendCheckpointTest, SavedOnCpuResumesOnCuda) { ExpectResumesAcross("cpu", "cuda"); }
TEST(CrossBackendCheckpointTest, SavedOnSimResumesOnCpu) { ExpectResumesAcross("sim", "cpu"); }

TEST(CheckpointApiTest, LatestCheckpointPicksTheHighestCompleteStep) {
  const std::string dir = FreshDir("latest");
  CkptRun run;
  ASSERT_TRUE(RunThreads(2, run, 2, "", dir + "/b-early").ok());
  ASSERT_TRUE(RunThreads(2, run, 3, "", dir + "/a-late").ok());
  std::filesystem::create_directories(dir + "/zz-not-a-checkpoint");
  auto latest = LatestCheckpoint(dir);
  ASSERT_TRUE(latest.ok()) << latest.status();
  EXPECT_EQ(*latest, dir + "/a-late");
  EXPECT_EQ(LatestCheckpoint(dir + "/zz-not-a-checkpoint").status().code(),
            absl::StatusCode::kNotFound);
  std::filesystem::remove_all(dir);
}

TEST(CheckpointApiTest, ExistingDirectoryNeedsOverwriteAndOptimizerMustMatch) {
  const std::string dir = FreshDir("api");
  CkptRun run;
  ASSERT_TRUE(RunThreads(2, run, 2, "", dir + "/c").ok());
  auto again = RunThreads(2, run, 2, "", dir + "/c");
  EXPECT_EQ(again.status().code(), absl::StatusCode::kAlreadyExists) << again.status();
  // overwrite replaces it; a non-checkpoint directory is never replaced.
  absl::Status s = LocalWorld::Run(2, {}, [&](Communicator& comm) -> absl::Status {
    FSDP_ASSIGN_OR_RETURN(auto backend, testing::MakeTestBackend(1));
    FSDP_ASSIGN_OR_RETURN(auto model, MakeModel(comm, backend.get(), run));
    SaveOptions o;
    o.overwrite = true;
    FSDP_RETURN_IF_ERROR(SaveCheckpoint(model->runtime(), dir + "/c", {}, o));
    FSDP_ASSIGN_OR_RETURN(LoadedCheckpoint l, LoadCheckpoint(model->runtime(), dir + "/c"));
    if (l.step != 0) return absl::InternalError("overwrite kept the old checkpoint");
    std::filesystem::create_directories(dir + "/plain");
    absl::Status refused = SaveCheckpoint(model->runtime(), dir + "/plain", {}, o);
    if (refused.code() != absl::StatusCode::kAlreadyExists) {
      return absl::InternalError(absl::StrCat("plain directory: ", refused.ToString()));
    }
    // An SGD runtime cannot take AdamW state, but can take the parameters alone.
    CkptRun sgd = run;
    sgd.optimizer = OptimizerKind::kSgd;
    FSDP_ASSIGN_OR_RETURN(auto other, MakeModel(comm, backend.get(), sgd));
    absl::Status mismatch = LoadCheckpoint(other->runtime(), dir + "/c").status();
    if (mismatch.code() != absl::StatusCode::kFailedPrecondition ||
        mismatch.message().find("exp_avg") == absl::string_view::npos) {
      return absl::InternalError(absl::StrCat("optimizer mismatch: ", mismatch.ToString()));
    }
    LoadOptions params_only;
    params_only.load_optimizer_state = false;
    return LoadCheckpoint(other->runtime(), dir + "/c", params_only).status();
  });
  EXPECT_TRUE(s.ok()) << s;
  std::filesystem::remove_all(dir);
}

// What crashed saves leave behind (NAME.tmp-<pid>-<hex>) is removed; nothing else is.
TEST(CheckpointApiTest, RemoveCheckpointTemporariesRemovesOnlyCrashedSaves) {
  namespace fs = std::filesystem;
  const std::string dir = FreshDir("temporaries");
  for (const char* d : {"step-6.tmp-123-abc", "step-2.tmp-99-0", "notes.tmp-x", "a.tmp-1-xyz",
                        "step-4", "step-4.old-1-2"}) {
    fs::create_directories(dir + "/" + d);
  }
  std::ofstream(dir + "/step-6.tmp-123-abc/shard-00000-of-00002.bin") << "partial";
  auto removed = RemoveCheckpointTemporaries(dir);
  ASSERT_TRUE(removed.ok()) << removed.status();
  EXPECT_EQ(*removed, (std::vector<std::string>{dir + "/step-2.tmp-99-0",
                                                dir + "/step-6.tmp-123-abc"}));
  for (const char* d : {"notes.tmp-x", "a.tmp-1-xyz", "step-4", "step-4.old-1-2"}) {
    EXPECT_TRUE(fs::exists(dir + "/" + d)) << d;
  }
  EXPECT_FALSE(fs::exists(dir + "/step-6.tmp-123-abc"));
  removed = RemoveCheckpointTemporaries(dir);
  ASSERT_TRUE(removed.ok());
  EXPECT_TRUE(removed->empty());
  removed = RemoveCheckpointTemporaries(dir + "/does-not-exist");
  ASSERT_TRUE(removed.ok()) << removed.status();
  EXPECT_TRUE(removed->empty());
  fs::remove_all(dir);
}

// Start-up checks of the places a run will write to, so that a bad one is reported before
// training rather than at the first save or the export.
TEST(CheckpointApiTest, WritabilityChecksBeforeTraining) {
  namespace fs = std::filesystem;
  const std::string dir = FreshDir("writable");
  EXPECT_TRUE(CheckCheckpointDirWritable(dir).ok());
  EXPECT_TRUE(CheckCheckpointDirWritable(dir + "/new/sub").ok());
  EXPECT_TRUE(fs::is_directory(dir + "/new/sub"));
  EXPECT_TRUE(fs::is_empty(dir + "/new/sub"));  // the probe file is gone
  absl::Status s = CheckCheckpointDirWritable("/proc/x");
  EXPECT_FALSE(s.ok());
  EXPECT_THAT(
      std::string(s.message()),
      ::testing::HasSubstr("cannot save checkpoints in /proc/x: cannot create the directory"));
  std::ofstream(dir + "/file") << "x";
  s = CheckCheckpointDirWritable(dir + "/file");
  EXPECT_THAT(std::string(s.message()), ::testing::HasSubstr("it exists and is not a directory"));

  EXPECT_TRUE(CheckExportPathWritable(dir + "/m.safetensors").ok());
  EXPECT_FALSE(fs::exists(dir + "/m.safetensors"));
  s = CheckExportPathWritable("/nonexistent/dir/m.safetensors");
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  EXPECT_THAT(std::string(s.message()),
              ::testing::HasSubstr("the directory /nonexistent/dir does not exist"));
  s = CheckExportPathWritable(dir);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  s = CheckExportPathWritable("/proc/m.safetensors");
  EXPECT_FALSE(s.ok());
  EXPECT_THAT(std::string(s.message()), ::testing::HasSubstr("cannot create a file in /proc"));
  fs::remove_all(dir);
}

}  // namespace
}  // namespace fsdp::testing
