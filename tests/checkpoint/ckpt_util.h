// Shared by the checkpoint tests (threads and mpirun): one rank's training run of the nano
// GPT that can start from a checkpoint and end with one, with a data loader, a warmup-cosine
// schedule and a per-rank state, so resumption has everything to restore.
#pragma once

#include <cstring>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "fsdp/checkpoint.h"
#include "fsdp/communicator.h"
#include "fsdp/cpu_backend.h"
#include "fsdp/local_world.h"
#include "fsdp/nn/data.h"
#include "fsdp/nn/sharded_model.h"
#include "tests/fsdp/parity_util.h"

namespace fsdp::testing {

struct CkptRun {
  ShardingStrategy strategy = ShardingStrategy::kFullShard;
  int hybrid_shard = 0;
  int batch_size = 2;  // per rank: keep world * batch_size fixed to compare world sizes
  int seq_len = 32;
  OptimizerKind optimizer = OptimizerKind::kAdamW;
  nn::WrapPolicy wrap;
  std::string config = "nano";  // any ModelConfig name, or "nano-narrow"
  int heads = 0;                 // GPT: another number of heads (same shapes); 0 = the config's
  bool allow_model_change = false;  // LoadOptions::allow_model_change
  uint64_t init_seed = 1337;
  float max_grad_norm = 0.5f;
  std::string backend = TestBackendName();  // the ranks' backend (tests/test_backend.h)
  // Save with an AsyncCheckpointer, then train this many more steps while it writes.
  bool async_save = false;
  int steps_after_save = 0;
  // ShardingOptions::offload (a device backend: sim, cuda).
  OffloadKind offload = OffloadKind::kNone;
};

struct CkptResult {
  std::vector<float> losses;               // mean over ranks, per step run here
  std::vector<std::vector<float>> params;  // model units after the run
  std::vector<double> grad_norms;          // pre-clip global gradient norm, per step run here
  int clipped_steps = 0;
  LoadedCheckpoint loaded;                 // what the load returned, when there was one
};

// Whether two models' units (GatherModelUnits) are equal bit for bit.
inline bool BitEqual(const std::vector<std::vector<float>>& a,
                     const std::vector<std::vector<float>>& b) {
  if (a.size() != b.size()) return false;
  for (size_t u = 0; u < a.size(); ++u) {
    if (a[u].size() != b[u].size() ||
        std::memcmp(a[u].data(), b[u].data(), a[u].size() * sizeof(float)) != 0) {
      return false;
    }
  }
  return true;
}

// The whole of a file (empty when it cannot be read).
inline std::string ReadAll(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

inline const WarmupCosine& TestSchedule() {
  static const WarmupCosine s(3, 20, 2e-3f, 2e-4f);
  return s;
}

inline std::string RankState(int rank, int64_t step) {
  return absl::StrCat("rng-of-rank-", rank, "-at-step-", step);
}

inline absl::StatusOr<std::unique_ptr<nn::ShardedModel>> MakeModel(Communicator& comm,
                                                                   Backend* backend,
                                                                   const CkptRun& run) {
  // "nano-narrow": another model with the same tensor names (C = 32).
  const bool narrow = run.config == "nano-narrow";
  FSDP_ASSIGN_OR_RETURN(nn::ModelConfig named,
                        nn::ModelConfig::FromName(narrow ? "nano" : run.config));
  nn::ModelConfig config = named;
  if (narrow || run.heads > 0) {
    nn::GptConfig c = named.gpt();
    if (narrow) c.channels = 32;
    if (run.heads > 0) c.num_heads = run.heads;
    config = c;
  }
  nn::ShardedModelOptions o;
  o.sharding.strategy = run.strategy;
  o.sharding.hybrid_shard_size = run.hybrid_shard;
  o.sharding.optimizer = run.optimizer;
  o.sharding.sgd.momentum = 0.9f;
  o.sharding.max_grad_norm = run.max_grad_norm;
  o.sharding.offload.what = run.offload;
  o.batch_size = run.batch_size;
  o.seq_len = run.seq_len;
  o.wrap = run.wrap;
  o.seed = run.init_seed;
  return nn::ShardedModel::Create(config, backend, comm, o);
}

// Trains `steps` steps on this rank, after loading `load_dir` when given, and saves to
// `save_dir` at the end when given. The data loader position and the schedule position come
// from the checkpoint; the rank state is checked against what the saver wrote.
inline absl::StatusOr<CkptResult> RunRank(Communicator& comm, const CkptRun& run, int steps,
                                          const std::string& load_dir,
                                          const std::string& save_dir) {
  FSDP_ASSIGN_OR_RETURN(auto backend, testing::MakeTestBackend(1, 0, run.backend));
  FSDP_ASSIGN_OR_RETURN(auto model, MakeModel(comm, backend.get(), run));
  nn::DataLoaderOptions lo;
  lo.batch_size = run.batch_size;
  lo.seq_len = run.seq_len;
  lo.rank = comm.rank();
  lo.world_size = comm.size();
  lo.seed = 7;
  FSDP_ASSIGN_OR_RETURN(nn::DataLoader loader, nn::DataLoader::Create(&TestCorpus(), lo));
  CkptResult result;
  if (!load_dir.empty()) {
    LoadOptions load;
    load.allow_model_change = run.allow_model_change;
    FSDP_ASSIGN_OR_RETURN(result.loaded, LoadCheckpoint(model->runtime(), load_dir, load));
    if (!result.loaded.state.data) return absl::InternalError("no data loader state loaded");
    FSDP_RETURN_IF_ERROR(loader.Restore(*result.loaded.state.data));
    if (result.loaded.rank_state_restored &&
        result.loaded.state.rank_state != RankState(comm.rank(), model->runtime().steps())) {
      return absl::InternalError(
          absl::StrCat("rank state not restored: '", result.loaded.state.rank_state, "'"));
    }
  }
  for (int s = 0; s < steps; ++s) {
    nn::Batch b = loader.Next();
    FSDP_ASSIGN_OR_RETURN(float loss, model->ForwardBackward(b.inputs.data(), b.targets.data()));
    FSDP_ASSIGN_OR_RETURN(float mean, model->MeanOverRanks(loss));
    result.losses.push_back(mean);
    FSDP_ASSIGN_OR_RETURN(StepStats st, model->runtime().Step(TestSchedule()));
    result.grad_norms.push_back(st.grad_norm);
    if (st.clip_coefficient < 1.0f) ++result.clipped_steps;
  }
  if (!save_dir.empty()) {
    TrainingState st;
    st.data = loader.state();
    st.values["note"] = "ckpt test";
    st.rank_state = RankState(comm.rank(), model->runtime().steps());
    if (!run.async_save) {
      FSDP_RETURN_IF_ERROR(SaveCheckpoint(model->runtime(), save_dir, st));
    } else {
      FSDP_ASSIGN_OR_RETURN(auto saver, AsyncCheckpointer::Create(model->runtime()));
      FSDP_RETURN_IF_ERROR(saver->Save(save_dir, st).status());
      for (int s = 0; s < run.steps_after_save; ++s) {  // while the writer writes
        nn::Batch b = loader.Next();
        FSDP_ASSIGN_OR_RETURN(float loss,
                              model->ForwardBackward(b.inputs.data(), b.targets.data()));
        FSDP_ASSIGN_OR_RETURN(float mean, model->MeanOverRanks(loss));
        result.losses.push_back(mean);
        FSDP_RETURN_IF_ERROR(model->runtime().Step(TestSchedule()).status());
      }
      FSDP_RETURN_IF_ERROR(saver->Wait());
    }
  }
  FSDP_ASSIGN_OR_RETURN(result.params, model->GatherModelUnits());
  return result;
}

// RunRank on `world` ranks as threads; rank 0's result (losses and params are equal on all).
inline absl::StatusOr<CkptResult> RunThreads(int world, const CkptRun& run, int steps,
                                             const std::string& load_dir,
                                             const std::string& save_dir) {
  std::vector<CkptResult> results(world);
  CommOptions co;
  co.timeout = absl::Seconds(60);
  FSDP_RETURN_IF_ERROR(LocalWorld::Run(world, co, [&](Communicator& comm) -> absl::Status {
    FSDP_ASSIGN_OR_RETURN(results[comm.rank()], RunRank(comm, run, steps, load_dir, save_dir));
    return absl::OkStatus();
  }));
  return results[0];
}

}  // namespace fsdp::testing
