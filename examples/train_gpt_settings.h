// train_gpt's settings: its flags (defined in train_gpt_settings.cc), read, checked against
// each other, the data, the output directories, the backend and the memory planner, and
// resolved into what every rank runs with, before any rank starts (exit code 2 on bad usage).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "fsdp/checkpoint.h"
#include "fsdp/nn/data.h"
#include "fsdp/nn/model_config.h"
#include "fsdp/nn/sharded_model.h"
#include "fsdp/registry.h"
#include "fsdp/status.h"

namespace train_gpt {

using fsdp::nn::ModelConfig;

enum class Schedule { kCosine, kConstant };

struct Settings {
  ModelConfig config;
  fsdp::nn::ShardedModelOptions model;
  int micro_batches = 1, steps = 0, warmup = 0, log_every = 1, eval_every = 0, threads = 0;
  fsdp::Accumulation accumulation = fsdp::Accumulation::kNoSync;  // --accumulate
  int ranks_on_host = 1;
  std::string backend = "cpu";          // --backend: a name in the registry
  fsdp::BackendOptions backend_options;  // its options, from the flags
  int sample_tokens = 0, checkpoint_every = 0;
  Schedule schedule = Schedule::kCosine;
  float max_lr = 0, temperature = 0;
  uint64_t seed = 0;
  std::string prompt;
  std::string data_name;  // for messages: "--data=PATH" or "the embedded corpus"
  std::shared_ptr<const fsdp::nn::TrainValSplit> data;  // read once, shared by the rank threads
  std::string checkpoint_dir, init_safetensors, export_path;
  std::string export_hf_dir;          // --export_hf_dir: the Hugging Face layout
  double export_max_file_mb = 5000;  // its largest file, MB of 10^6 bytes
  bool allow_model_change = false;
  bool checkpoint_fallback = true;  // resume past a damaged checkpoint (--checkpoint_fallback)
  bool checkpoint_async = false;     // --checkpoint_async: saves in the background
  int64_t checkpoint_async_max_mib = 0;  // its snapshot's bound (0: none)
  int64_t device_memory_bytes = 0;
  // Rank 0 holds the checkpoint directory's lock for the whole run (no second job saves there).
  std::shared_ptr<fsdp::CheckpointDirLock> checkpoint_lock;
  std::vector<std::string> warnings;  // printed once, before training (stderr)
  std::vector<std::string> notes;     // ... (stdout): what the start-up cleaned up
};

// The settings of this process's ranks: `world_size` ranks in all, `ranks_on_host` on this host,
// `rank` the process's rank under mpirun (0 for ranks as threads); `ranks_share_process`: ranks
// are threads of this process. InvalidArgument "--flag=value: what is allowed" (or the library's
// own error, prefixed with the flag) on bad usage.
absl::StatusOr<Settings> SettingsFromFlags(int world_size, int ranks_on_host, int rank,
                                           bool ranks_share_process, int ranks_per_process = 1);
// --ranks: ranks as threads of this process.
int RanksFlag();
// --ranks_per_process: ranks each process plays as threads under mpirun.
int RanksPerProcessFlag();

}  // namespace train_gpt
