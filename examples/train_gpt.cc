// Trains a bundled model of MODEL_SPEC.md (the GPT, or Llama 2 with --model=llama-mini) with
// sharded data parallelism and samples text from it.
// By default: 2 ranks as threads, FULL_SHARD, the `nano` GPT on the corpus embedded in
// libfsdp with the optimizer defaults of MODEL_SPEC.md. Under `mpirun -np N` each process is
// one rank. `train_gpt --help` lists the flags; scripts/run_example.sh runs the README's
// example (a wider model, a higher learning rate).
//
// Exit codes (docs/failures.md says what each failure looks like and what to do):
//   0  trained (or --help)
//   1  a failure after start-up: loading the checkpoint to resume from, a training step, a
//      save, the export, a collective
//   2  bad usage, found at start-up before anything is trained: a flag value or combination,
//      FSDP_COMM_TIMEOUT_S, or a file or directory a flag names that cannot be used
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <random>
#include <optional>
#include <string>
#include <thread>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "fsdp/agreement.h"
#include "fsdp/backend.h"
#include "fsdp/kernels_cpu.h"
#include "fsdp/checkpoint.h"
#include "fsdp/communicator.h"
#include "fsdp/cpu_backend.h"
#include "fsdp/files.h"
#include "fsdp/plan.h"
#include "fsdp/registry.h"
#include "fsdp/local_world.h"
#include "fsdp/mpi_world.h"
#include "fsdp/nn/data.h"
#include "fsdp/nn/sharded_model.h"
#include "fsdp/optim.h"
#include "tools/command_line.h"

#include "examples/train_gpt_settings.h"

namespace {

using fsdp::Communicator;
using fsdp::nn::ModelConfig;
using fsdp::nn::ShardedModel;

constexpr int kExitFailed = 1;
constexpr int kExitUsage = 2;

using train_gpt::Schedule;
using train_gpt::Settings;
using train_gpt::SettingsFromFlags;


std::string Seconds(double s) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), s < 100 ? "%.1f s" : "%.0f s", s);
  return buf;
}

std::string Millis(double s) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.1f ms", s * 1e3);
  return buf;
}

// --schedule constant: the linear warmup of WarmupCosine, then the peak learning rate.
class WarmupConstant final : public fsdp::LrSchedule {
 public:
  WarmupConstant(int64_t warmup_steps, float lr) : warmup_steps_(warmup_steps), lr_(lr) {}
  float At(int64_t step) const override {
    return step < warmup_steps_ ? lr_ * static_cast<float>(step + 1) / warmup_steps_ : lr_;
  }

 private:
  int64_t warmup_steps_;
  float lr_;
};

// Mean loss over the validation split, each rank taking its share of the windows.
absl::StatusOr<float> Evaluate(ShardedModel& model, const fsdp::nn::DataLoader& val) {
  double sum = 0;
  const int64_t steps = val.steps_per_epoch();
  for (int64_t s = 0; s < steps; ++s) {
    const fsdp::nn::Batch b = val.At(s);
    FSDP_ASSIGN_OR_RETURN(float loss, model.Forward(b.inputs.data(), b.targets.data()));
    sum += loss;
  }
  return model.MeanOverRanks(static_cast<float>(sum / std::max<int64_t>(1, steps)));
}

// Continues `prompt` by `n` tokens. Collective: every rank runs the forward passes (the
// parameters are sharded), rank 0's choice of each token is broadcast.
absl::StatusOr<std::string> Sample(ShardedModel& model, const std::string& prompt, int n,
                                   float temperature, uint64_t seed) {
  const int B = model.model().batch_size(), T = model.model().seq_len();
  const int V = model.model().vocab_size();
  std::vector<int32_t> tokens(prompt.begin(), prompt.end());
  if (tokens.empty()) tokens.push_back('\n');  // the model needs a first token
  std::mt19937_64 rng(seed);
  std::vector<int32_t> window(static_cast<size_t>(B) * T, 0);
  std::vector<float> logits(V);
  for (int i = 0; i < n; ++i) {
    // Row 0 holds the last T tokens, zero-padded at the end: causal attention never looks
    // at the padding.
    const int len = std::min<int>(static_cast<int>(tokens.size()), T);
    std::fill(window.begin(), window.end(), 0);
    std::copy(tokens.end() - len, tokens.end(), window.begin());
    FSDP_RETURN_IF_ERROR(model.Forward(window.data(), nullptr).status());
    FSDP_RETURN_IF_ERROR(model.runtime().backend()->CopyToHost(
        logits.data(), model.logits().Slice(static_cast<int64_t>(len - 1) * V, V)));
    float next = static_cast<float>(std::max_element(logits.begin(), logits.end()) -
                                    logits.begin());
    if (temperature > 0) {
      std::vector<double> w(V);
      const float top = logits[static_cast<int>(next)];
      for (int v = 0; v < V; ++v) w[v] = std::exp((logits[v] - top) / temperature);
      next = static_cast<float>(std::discrete_distribution<int>(w.begin(), w.end())(rng));
    }
    FSDP_RETURN_IF_ERROR(model.runtime().world().Broadcast(&next, 1, fsdp::DType::kF32, 0));
    tokens.push_back(static_cast<int32_t>(next));
  }
  return std::string(tokens.begin(), tokens.end());
}

// The end of a run: it fails, and nothing more is saved or exported, when more than half of
// its `steps` optimizer steps were skipped (inf/NaN gradients: the parameters barely moved),
// or when the validation loss is not finite (the parameters cannot be trusted).
absl::Status CheckTrained(const Settings& s, int64_t steps, int64_t skipped, float val_loss) {
  const std::string nothing = absl::StrCat(
      "Nothing was saved", s.checkpoint_dir.empty() ? "" : " at the end",
      s.export_path.empty() && s.export_hf_dir.empty() ? "" : " or exported", ".");
  if (2 * skipped > steps) {
    const bool scaling = s.model.sharding.mixed_precision.dynamic_loss_scale;
    return absl::FailedPreconditionError(absl::StrCat(
        skipped, " of the run's ", steps, " steps were skipped for inf/NaN gradients, more than "
        "half: the model was hardly trained. ", nothing, " ",
        scaling ? "Start --loss_scaling from a smaller scale (e.g. 65536), or train longer"
                : "Lower --lr, keep --clip on, or use --nonfinite error to stop at the first"));
  }
  if (!std::isfinite(val_loss)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the validation loss is ", val_loss, ": the parameters cannot be trusted. ", nothing,
        " Lower --lr, keep --clip on, or resume from an earlier checkpoint"));
  }
  return absl::OkStatus();
}

// A library error with the options it names in the trainer's flags.
absl::Status InTrainGptTerms(const absl::Status& s) {
  if (s.ok()) return s;
  return absl::Status(s.code(), absl::StrReplaceAll(
      s.message(), {{"LoadOptions::allow_model_change", "--allow_model_change"},
                    {"SafetensorsImportOptions::allow_model_change", "--allow_model_change"},
                    {"ResumeOptions::fallback", "--checkpoint_fallback=true"},
                    {"AsyncSaveOptions::max_snapshot_bytes", "--checkpoint_async_max_mib"}}));
}

// ---- one rank's run, step by step ----------------------------------------------------------

// Each micro-batch is one loader step, so the data order is that of B*N-row batches.
struct Loaders {
  fsdp::nn::DataLoader train, val;
};
absl::StatusOr<Loaders> MakeLoaders(const Settings& s, const Communicator& world) {
  const int B = s.model.batch_size, T = s.model.seq_len, N = world.size();
  FSDP_ASSIGN_OR_RETURN(auto train, fsdp::nn::DataLoader::Create(
      &s.data->train, {.batch_size = B, .seq_len = T, .rank = world.rank(), .world_size = N,
                       .seed = s.seed}));
  FSDP_ASSIGN_OR_RETURN(auto val, fsdp::nn::DataLoader::Create(
      &s.data->val, {.batch_size = B, .seq_len = T, .rank = world.rank(), .world_size = N,
                     .order = fsdp::nn::SampleOrder::kSequential}));
  return Loaders{std::move(train), std::move(val)};
}

// --init_safetensors: the parameters from a Hugging Face-style file.
absl::Status InitFromSafetensors(const Settings& s, ShardedModel& model, bool lead) {
  if (s.init_safetensors.empty()) return absl::OkStatus();
  fsdp::SafetensorsImportOptions import;
  import.allow_model_change = s.allow_model_change;
  FSDP_RETURN_IF_ERROR(InTrainGptTerms(
      fsdp::ImportSafetensors(model.runtime(), s.init_safetensors, import)));
  if (lead) std::printf("initialised the parameters from %s\n", s.init_safetensors.c_str());
  return absl::OkStatus();
}

std::unique_ptr<fsdp::LrSchedule> MakeSchedule(const Settings& s) {
  if (s.schedule == Schedule::kCosine) {
    return std::make_unique<fsdp::WarmupCosine>(s.warmup, s.steps, s.max_lr, s.max_lr / 10);
  }
  return std::make_unique<WarmupConstant>(s.warmup, s.max_lr);
}

// Resumes from the newest intact checkpoint of --checkpoint_dir, on any number of ranks or
// strategy, and returns its step (0 without one). Every file of the checkpoint is verified
// first. Checkpoints without a valid COMMIT marker, and (--checkpoint_fallback) those with a
// damaged file, are skipped, saying so (`skipped`), and a save of the same step later replaces
// them. (Rank 0 cleaned up what crashed saves left before any rank started.)
absl::StatusOr<int> Resume(const Settings& s, ShardedModel& model, fsdp::nn::DataLoader& train,
                           bool lead, std::vector<fsdp::SkippedCheckpoint>* skipped) {
  if (s.checkpoint_dir.empty()) return 0;
  fsdp::ResumeOptions options;
  options.load.allow_model_change = s.allow_model_change;
  options.fallback = s.checkpoint_fallback;
  absl::StatusOr<fsdp::ResumedCheckpoint> resumed =
      fsdp::ResumeFromLatestCheckpoint(model.runtime(), s.checkpoint_dir, options);
  if (!resumed.ok()) return InTrainGptTerms(resumed.status());
  *skipped = resumed->skipped;
  if (lead) {
    for (const fsdp::SkippedCheckpoint& k : *skipped) {
      std::fprintf(stderr, "train_gpt: warning: skipping checkpoint %s: %s\n", k.path.c_str(),
                   std::string(k.why.message()).c_str());
    }
  }
  if (resumed->path.empty()) {
    if (lead && !skipped->empty()) {
      std::fprintf(stderr, "train_gpt: warning: no intact checkpoint in %s: starting from step 0\n",
                   s.checkpoint_dir.c_str());
    }
    return 0;
  }
  fsdp::LoadedCheckpoint& loaded = resumed->loaded;
  if (lead) {
    for (const std::string& change : loaded.model_changes) {
      std::fprintf(stderr, "train_gpt: warning: --allow_model_change: %s\n", change.c_str());
    }
    if (!loaded.model_recorded) {
      std::fprintf(stderr, "train_gpt: warning: %s records no model configuration (saved "
                   "by an older version): only its tensors' names and shapes were "
                   "checked\n", resumed->path.c_str());
    }
  }
  if (loaded.state.data) FSDP_RETURN_IF_ERROR(train.Restore(*loaded.state.data));
  const int step = static_cast<int>(loaded.step);
  if (lead) {
    std::printf("resumed from %s (step %d)%s\n", resumed->path.c_str(), step,
                skipped->empty() ? "" : ", the newest intact checkpoint");
  }
  return step;
}

// The background saves that finished: each said, a failed one the run's error.
absl::Status ReportBackgroundSaves(fsdp::AsyncCheckpointer& saver, bool lead) {
  for (const fsdp::AsyncSaveResult& r : saver.TakeFinished()) {
    if (!r.status.ok()) {
      return absl::Status(r.status.code(), absl::StrCat("the background save of ", r.dir,
                                                        " failed: ", r.status.message()));
    }
    if (lead) {
      std::printf("saved %s in the background (written in %s)\n", r.dir.c_str(),
                  Millis(r.write_seconds).c_str());
    }
  }
  return absl::OkStatus();
}

// A test's crash at a point of a save (FSDP_CHECKPOINT_KILL_AT=POINT:NAME, e.g.
// "shard_written:step-4"): the process is killed with SIGKILL there, on the thread that
// writes, as a machine that fails mid-save would be. Unset: no hook.
std::function<absl::Status(std::string_view)> KillHook(const std::string& name) {
  const char* env = std::getenv("FSDP_CHECKPOINT_KILL_AT");
  if (env == nullptr || *env == '\0') return nullptr;
  const std::string spec = env;
  const size_t colon = spec.find(':');
  if (colon == std::string::npos || spec.substr(colon + 1) != name) return nullptr;
  return [point = spec.substr(0, colon)](std::string_view at) {
    if (at == point) {
      std::fflush(stdout);
      std::raise(SIGKILL);
    }
    return absl::OkStatus();
  };
}

// Saves checkpoint step-<step> with the data position: at once, or (--checkpoint_async) as a
// snapshot written in the background by `saver`. Rank 0 says what it did and what it cost the
// training thread.
absl::Status Save(const Settings& s, ShardedModel& model, const fsdp::nn::DataLoader& train,
                  const std::vector<fsdp::SkippedCheckpoint>& skipped, int step, bool lead,
                  fsdp::AsyncCheckpointer* saver) {
  fsdp::TrainingState state;
  state.data = train.state();
  const std::string name = "step-" + std::to_string(step);
  const std::string dir = s.checkpoint_dir + "/" + name;
  const bool replaces = std::any_of(skipped.begin(), skipped.end(), [&](const auto& k) {
    return std::filesystem::path(k.path).filename() == name;
  });
  // A skipped checkpoint of that name, incomplete or damaged, is replaced (one whose COMMIT
  // marker is valid needs overwrite).
  fsdp::SaveOptions options;
  options.overwrite = replaces;
  options.fault_injection = KillHook(name);
  const char* replacing = replaces ? " (replacing the damaged checkpoint of that name)" : "";
  const auto start = std::chrono::steady_clock::now();
  if (saver == nullptr) {
    FSDP_RETURN_IF_ERROR(fsdp::SaveCheckpoint(model.runtime(), dir, state, options));
    if (lead) {
      std::printf("saved %s%s; training blocked for %s\n", dir.c_str(), replacing,
                  Millis(std::chrono::duration<double>(std::chrono::steady_clock::now() -
                                                       start).count()).c_str());
    }
    return absl::OkStatus();
  }
  const bool waits = saver->in_flight();  // this rank's previous save is still being written
  absl::StatusOr<fsdp::AsyncSaveStart> started = saver->Save(dir, state, options);
  if (absl::IsResourceExhausted(started.status()) && step < s.steps) {
    // No host memory for the snapshot: this save is left out, said, and training goes on (the
    // last save of the run is not: its failure is the run's).
    if (lead) {
      std::fprintf(stderr, "train_gpt: warning: %s; training goes on\n",
                   std::string(InTrainGptTerms(started.status()).message()).c_str());
    }
    return ReportBackgroundSaves(*saver, lead);
  }
  if (!started.ok()) {
    return absl::Status(started.status().code(),
                        absl::StrCat("the run's last save was not taken: ",
                                     InTrainGptTerms(started.status()).message()));
  }
  const double blocked =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  // Every rank's previous save has finished now (Save waited for any in flight): its outcome is
  // known alike on every rank.
  FSDP_RETURN_IF_ERROR(ReportBackgroundSaves(*saver, lead));
  if (lead && *started == fsdp::AsyncSaveStart::kStarted) {
    std::printf("saving %s in the background%s; training blocked for %s (a snapshot of %s per "
                "rank%s)\n", dir.c_str(), replacing, Millis(blocked).c_str(),
                fsdp::FormatBytes(saver->snapshot_bytes()).c_str(),
                waits ? ", after waiting for the previous save to be written" : "");
  }
  return absl::OkStatus();
}

// The first line rank 0 prints: the model, the sharding, the batch, the schedule, the device.
void PrintBanner(const Settings& s, const Communicator& world, ShardedModel& model,
                 const fsdp::Backend& backend, int start_step) {
  const fsdp::MixedPrecision& mp = s.model.sharding.mixed_precision;
  std::string extras;
  if (mp.param_dtype != fsdp::DType::kF32 || mp.reduce_dtype != fsdp::DType::kF32) {
    absl::StrAppend(&extras, " | params ", std::string(fsdp::DTypeName(mp.param_dtype)),
                    ", reductions ", std::string(fsdp::DTypeName(mp.reduce_dtype)));
  }
  if (mp.dynamic_loss_scale) {
    absl::StrAppend(&extras, " | dynamic loss scaling from ", mp.initial_loss_scale);
  }
  if (const fsdp::CommunicationOptions& c = s.model.sharding.communication; c.quantizes()) {
    absl::StrAppend(&extras, " | all-gather ", std::string(fsdp::WireFormatName(c.all_gather)),
                    ", reduction ", std::string(fsdp::WireFormatName(c.reduction)),
                    c.reduction != fsdp::WireFormat::kDType ? " (all_to_all, f32 sum)" : "",
                    ", a scale per ", c.block_size, " elements");
  }
  if (s.model.sharding.strategy == fsdp::ShardingStrategy::kHybridShard ||
      s.model.sharding.strategy == fsdp::ShardingStrategy::kHybridShardGradOp) {
    absl::StrAppend(&extras, " | mesh ", model.runtime().replicate_group().size(), " x ",
                    model.runtime().shard_group().size(),
                    s.model.sharding.hybrid_shard_size == 0 ? " (a shard group per host)" : "");
  }
  if (const int n = s.model.sharding.secondary_shard_size; n > 0) {
    absl::StrAppend(&extras, " | secondary shard over ", n,
                    " ranks of a host (backward gathers inside it)");
  }
  if (!s.model.sharding.forward_prefetch) {
    absl::StrAppend(&extras, " | no prefetch");
  } else if (s.model.sharding.max_prefetch_units > 1) {
    absl::StrAppend(&extras, " | prefetch ", s.model.sharding.max_prefetch_units, " units ahead");
  }
  if (s.micro_batches > 1) {
    absl::StrAppend(&extras, " | ", s.micro_batches, " micro-batches accumulated ",
                    std::string(fsdp::AccumulationName(s.accumulation)));
  }
  if (const std::vector<int> off = model.runtime().offloaded_units(); !off.empty()) {
    absl::StrAppend(&extras, " | ",
                    s.model.sharding.offload.what == fsdp::OffloadKind::kAll
                        ? "parameter, gradient and optimizer shards"
                        : "optimizer state",
                    " of ", off.size(), " of ",
                    model.runtime().num_units(), " units offloaded to the host (",
                    fsdp::FormatBytes(model.memory().host_offload_bytes), " per rank)");
  }
  if (s.model.checkpoint_every > 0) {
    absl::StrAppend(&extras, " | activation checkpointing every ", s.model.checkpoint_every,
                    s.model.checkpoint_every == 1 ? " block" : " blocks");
  }
  if (mp.param_dtype != fsdp::DType::kF32 &&
      (backend.name() == "cpu" || backend.name() == "sim")) {
    // The CPU kernels' choice for the Linear layers' GEMMs (measured once per process).
    const fsdp::kernels::cpu::LowpGemmChoice c =
        fsdp::kernels::cpu::lowp_gemm_choice(mp.param_dtype);
    absl::StrAppend(&extras, " | ", std::string(fsdp::DTypeName(mp.param_dtype)),
                    " Linear GEMMs ", c.native ? "native" : "widened to f32", " (", c.reason,
                    ")");
  }
  const std::string heads =
      s.config.is_gpt()
          ? absl::StrCat("H=", s.config.gpt().num_heads)
          : absl::StrCat("H=", s.config.llama().num_heads, " Hkv=", s.config.llama().num_kv_heads,
                         " F=", s.config.llama().mlp_hidden);
  const std::string device = "rank 0: " + backend.description();
  const int N = world.size();
  std::printf("train_gpt: %s %s L=%d %s C=%d V=%d, %.2fM parameters | %s on %d ranks (%s), "
              "%d units | batch %d x %d per step | %d steps, lr %.2e %s, warmup %d | "
              "%s%s\n",
              s.config.is_gpt() ? "GPT" : "Llama", s.config.name().c_str(),
              s.config.num_layers(), heads.c_str(), s.config.channels(),
              s.config.vocab_size(), s.config.num_parameters() / 1e6,
              std::string(fsdp::StrategyName(s.model.sharding.strategy)).c_str(), N,
              std::string(world.backend()).c_str(), model.runtime().num_units(),
              s.model.batch_size * N * s.micro_batches, s.model.seq_len, s.steps, s.max_lr,
              s.schedule == Schedule::kCosine ? "cosine" : "constant", s.warmup,
              device.c_str(), extras.c_str());
  if (start_step >= s.steps) {
    std::printf("nothing to train: the checkpoint is at step %d, --steps is %d\n", start_step,
                s.steps);
  }
}

// What the training loop leaves for the summary.
struct Trained {
  double seconds = 0;
  double first_loss = NAN, last_loss = NAN;  // the first and last progress lines' losses
  float val_loss = NAN;
};

// Steps start_step .. --steps: micro-batches, the optimizer step, progress lines, evaluation,
// and the checkpoints. Nothing that cannot be trusted is saved, and a run that did not train
// does not end as a success (docs/failures.md, "A run that did nothing").
absl::StatusOr<Trained> Train(const Settings& s, const Communicator& world, ShardedModel& model,
                              Loaders& data, int start_step,
                              const std::vector<fsdp::SkippedCheckpoint>& skipped, bool lead) {
  const std::unique_ptr<fsdp::LrSchedule> schedule = MakeSchedule(s);
  const int64_t tokens_per_step = static_cast<int64_t>(s.model.batch_size) * s.model.seq_len *
                                  world.size() * s.micro_batches;
  const auto start = std::chrono::steady_clock::now();
  auto elapsed = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  Trained out;
  double loss_sum = 0;
  int loss_count = 0;
  // Skipped steps (inf/NaN gradients) before this run, and at the last save.
  const int64_t skipped_at_start = model.runtime().skipped_steps();
  int64_t skipped_at_save = skipped_at_start;
  int saved_after = start_step;
  std::unique_ptr<fsdp::AsyncCheckpointer> saver;
  if (s.checkpoint_async) {
    fsdp::AsyncSaveOptions o;
    o.max_snapshot_bytes = static_cast<uint64_t>(s.checkpoint_async_max_mib) << 20;
    FSDP_ASSIGN_OR_RETURN(saver, fsdp::AsyncCheckpointer::Create(model.runtime(), o));
  }
  for (int step = start_step; step < s.steps; ++step) {
    double step_loss = 0;
    for (int m = 0; m < s.micro_batches; ++m) {
      fsdp::ConfigureMicroBatch(model.runtime(), s.accumulation, m, s.micro_batches);
      const fsdp::nn::Batch b = data.train.Next();
      FSDP_ASSIGN_OR_RETURN(float loss, model.ForwardBackward(b.inputs.data(), b.targets.data()));
      step_loss += loss / s.micro_batches;
    }
    FSDP_ASSIGN_OR_RETURN(fsdp::StepStats stats, model.runtime().Step(*schedule));
    FSDP_ASSIGN_OR_RETURN(float mean_loss, model.MeanOverRanks(static_cast<float>(step_loss)));
    loss_sum += mean_loss;
    ++loss_count;
    const bool last = step + 1 == s.steps;
    if (lead && ((step + 1) % s.log_every == 0 || step == start_step || last)) {
      const double t = elapsed();
      const double done = step + 1 - start_step;
      out.last_loss = loss_sum / loss_count;
      if (std::isnan(out.first_loss)) out.first_loss = out.last_loss;
      const int64_t skipped_steps = model.runtime().skipped_steps();
      std::printf("step %5d/%d | loss %.4f | lr %.2e | norm %6.3f | %lld host syncs | %6.0f "
                  "tok/s | %s | ETA %s%s\n",
                  step + 1, s.steps, loss_sum / loss_count, stats.lr, stats.grad_norm,
                  static_cast<long long>(stats.host_syncs),
                  done * tokens_per_step / t, Seconds(t).c_str(),
                  Seconds(t / done * (s.steps - step - 1)).c_str(),
                  skipped_steps > 0
                      ? absl::StrCat(" | ", skipped_steps, " steps skipped (inf/NaN)").c_str()
                      : "");
      loss_sum = 0;
      loss_count = 0;
    }
    if (last || (s.eval_every > 0 && (step + 1) % s.eval_every == 0)) {
      FSDP_ASSIGN_OR_RETURN(out.val_loss, Evaluate(model, data.val));
      if (lead) std::printf("step %5d/%d | val loss %.4f\n", step + 1, s.steps, out.val_loss);
    }
    const int64_t skipped_now = model.runtime().skipped_steps();
    if (last) {
      FSDP_RETURN_IF_ERROR(CheckTrained(s, step + 1 - start_step, skipped_now - skipped_at_start,
                                        out.val_loss));
    }
    if (!s.checkpoint_dir.empty() &&
        (last || (s.checkpoint_every > 0 && (step + 1) % s.checkpoint_every == 0))) {
      if (!std::isfinite(mean_loss)) {
        return absl::FailedPreconditionError(absl::StrCat(
            "the loss of step ", step + 1, " is ", mean_loss, ": the parameters cannot be "
            "trusted, so step-", step + 1, " was not saved (", s.checkpoint_dir, " keeps the last "
            "good checkpoint). Lower --lr, keep --clip on, or resume from that checkpoint"));
      }
      if (!last && skipped_now - skipped_at_save == step + 1 - saved_after) {
        if (lead) {
          std::printf("not saving step-%d: every step since %s was skipped (inf/NaN "
                      "gradients), so the parameters have not changed\n",
                      step + 1, saved_after == start_step && start_step == 0
                                    ? "the start"
                                    : absl::StrCat("step ", saved_after).c_str());
        }
      } else {
        FSDP_RETURN_IF_ERROR(Save(s, model, data.train, skipped, step + 1, lead, saver.get()));
      }
      skipped_at_save = skipped_now;
      saved_after = step + 1;
    }
  }
  if (saver != nullptr) {  // the last save is durable before the run goes on
    saver->Wait().IgnoreError();  // its outcome, as every one's, is reported here
    FSDP_RETURN_IF_ERROR(ReportBackgroundSaves(*saver, lead));
  }
  out.seconds = elapsed();
  return out;
}

// After training: the export, the summary, samples of text.
absl::Status Finish(const Settings& s, ShardedModel& model, const fsdp::Backend& backend,
                    int start_step, const Trained& t, bool lead) {
  if (!s.export_path.empty()) {
    FSDP_RETURN_IF_ERROR(fsdp::ExportSafetensors(model.runtime(), s.export_path));
    if (lead) std::printf("exported %s\n", s.export_path.c_str());
  }
  if (!s.export_hf_dir.empty()) {
    fsdp::SafetensorsExportOptions o;
    o.max_file_bytes = static_cast<uint64_t>(s.export_max_file_mb * 1e6);
    if (!s.config.is_gpt()) {
      o.extra_files["config.json"] = s.config.llama().HuggingFaceConfigJson(o.dtype);
    }
    FSDP_ASSIGN_OR_RETURN(fsdp::SafetensorsExportReport r,
                          fsdp::ExportSafetensorsDirectory(model.runtime(), s.export_hf_dir, o));
    if (lead) {
      std::printf("exported %s in the Hugging Face layout: %d file%s, %s of tensors; the "
                  "export held %s of host memory per rank\n",
                  s.export_hf_dir.c_str(), r.files, r.files == 1 ? "" : "s",
                  fsdp::FormatBytes(r.total_size).c_str(),
                  fsdp::FormatBytes(r.host_bytes_per_rank).c_str());
    }
  }
  if (lead && start_step < s.steps) {
    std::printf("trained %d steps in %s: loss %.4f -> %.4f, val loss %.4f\nmemory per rank: %s\n",
                s.steps - start_step, Seconds(t.seconds).c_str(), t.first_loss, t.last_loss,
                t.val_loss, fsdp::FormatMemoryReport(model.memory()).c_str());
    if (!backend.is_host()) {
      std::printf("device memory of rank 0: peak %.1f MiB allocated through the backend\n",
                  static_cast<double>(backend.memory_stats().peak_bytes) / (1 << 20));
    }
    if (const fsdp::MemoryReport m = model.memory(); m.offloaded_units > 0) {
      const fsdp::OffloadStats o = model.runtime().offload_stats();
      std::printf("offload of rank 0: %d of %d units' %s on the host (%.1f MiB); "
                  "%lld host updates took %.1f ms; the step waited %.1f ms for them, %.1f ms "
                  "of it with the device idle: %.0f%% of the host's updates overlapped with "
                  "device compute; %.1f MiB to the host, %.1f MiB back\n",
                  m.offloaded_units, model.runtime().num_units(),
                  s.model.sharding.offload.what == fsdp::OffloadKind::kAll
                      ? "parameter, gradient and optimizer shards"
                      : "optimizer state",
                  static_cast<double>(m.host_offload_bytes) / (1 << 20),
                  static_cast<long long>(o.updates), 1e3 * o.host_update_seconds,
                  1e3 * o.wait_seconds, 1e3 * o.exposed_seconds, 100 * o.overlap(),
                  static_cast<double>(o.bytes_to_host) / (1 << 20),
                  static_cast<double>(o.bytes_to_device) / (1 << 20));
    }
  }
  const int n = s.sample_tokens;
  if (n > 0 && s.config.vocab_size() == 256) {
    for (int i = 0; i < 2; ++i) {
      FSDP_ASSIGN_OR_RETURN(std::string text,
                            Sample(model, s.prompt, n, s.temperature, s.seed + i));
      if (lead) std::printf("\n--- sample %d ---\n%s\n", i + 1, text.c_str());
    }
  } else if (n > 0 && lead) {
    std::printf("(sampling prints text only for byte-level models, V = 256)\n");
  }
  return absl::OkStatus();
}

// Everything one rank does. Rank 0 prints.
absl::Status RunRank(Communicator& world, const Settings& s) {
  const bool lead = world.rank() == 0;
  FSDP_ASSIGN_OR_RETURN(std::unique_ptr<fsdp::Backend> backend,
                        fsdp::CreateBackend(s.backend, s.backend_options, world.rank()));
  FSDP_ASSIGN_OR_RETURN(Loaders data, MakeLoaders(s, world));
  FSDP_ASSIGN_OR_RETURN(auto model, ShardedModel::Create(s.config, backend.get(), world, s.model));
  FSDP_RETURN_IF_ERROR(InitFromSafetensors(s, *model, lead));
  std::vector<fsdp::SkippedCheckpoint> skipped;
  FSDP_ASSIGN_OR_RETURN(const int start_step, Resume(s, *model, data.train, lead, &skipped));
  if (lead) PrintBanner(s, world, *model, *backend, start_step);
  FSDP_ASSIGN_OR_RETURN(const Trained trained,
                        Train(s, world, *model, data, start_step, skipped, lead));
  return Finish(s, *model, *backend, start_step, trained, lead);
}

int EnvInt(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::atoi(v) : fallback;
}

// What every rank of an mpirun job must have been given alike: every flag of this program but
// the per-process ones, and the data by its contents (ranks may read it from different paths).
std::vector<fsdp::Setting> AgreedSettings(const Settings& s, int world_size) {
  std::vector<fsdp::Setting> out;
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    if (std::string_view(flag->Filename()).find("train_gpt") == std::string_view::npos) continue;
    if (name == "threads" || name == "data" || name == "ranks") continue;
    out.push_back({std::string(name), flag->CurrentValue()});
  }
  std::sort(out.begin(), out.end(),
            [](const fsdp::Setting& a, const fsdp::Setting& b) { return a.name < b.name; });
  uint64_t digest = 1469598103934665603ull;  // FNV-1a over both splits' tokens
  for (const fsdp::nn::TokenDataset* part : {&s.data->train, &s.data->val}) {
    for (uint16_t t : part->tokens()) digest = (digest ^ t) * 1099511628211ull;
  }
  out.push_back({"data (tokens, digest)", absl::StrCat(s.data->train.size() + s.data->val.size(),
                                                       " tokens, ", absl::Hex(digest))});
  out.push_back({"world size", absl::StrCat(world_size)});
  return out;
}

// What the start-up found (warnings, stderr) and did (cleaned up, stdout): printed once.
void PrintWarnings(const Settings& s) {
  for (const std::string& w : s.warnings)
    std::fprintf(stderr, "train_gpt: warning: %s\n", w.c_str());
  for (const std::string& n : s.notes) std::printf("%s\n", n.c_str());
}

// Prints a status that ended the run and returns the exit code.
int Report(const absl::Status& status, bool usage) {
  if (usage) {
    std::fprintf(stderr, "train_gpt: %s\ntrain_gpt: nothing was trained (exit code %d: bad usage; "
                 "train_gpt --help lists the flags)\n",
                 std::string(status.message()).c_str(), kExitUsage);
    return kExitUsage;
  }
  std::fprintf(stderr, "train_gpt: %s\n", status.ToString().c_str());
  return kExitFailed;
}

}  // namespace

int main(int argc, char** argv) {
  // Line-buffered even into a file or a pipe: every line printed is in the file at once, also
  // when the process is killed.
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  absl::SetProgramUsageMessage(
      "Trains a GPT with sharded data parallelism (ranks as threads, or processes under "
      "mpirun) and samples from it. Exit codes: 0 trained, 1 failed after start-up, 2 bad "
      "usage (found before training).");
  // --help lists the flags of train_gpt's files (train_gpt_settings.cc defines them).
  absl::FlagsUsageConfig usage;
  usage.contains_help_flags = [](absl::string_view file) {
    return absl::StrContains(file, "train_gpt");
  };
  absl::SetFlagsUsageConfig(usage);
  const std::vector<char*> positional = fsdp::cli::ParseCommandLine(argc, argv);
  if (positional.size() > 1) {
    return Report(absl::InvalidArgumentError(absl::StrCat(
                      "unexpected argument '", positional[1], "': flags start with --")),
                  true);
  }
  if (std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr) {  // launched by mpirun
    // FSDP_MPI_SHM is read when the world is made: a bad value is bad usage, said once (by
    // rank 0) and before MPI starts.
    if (absl::Status shm = fsdp::MpiSharedMemoryFromEnv().status(); !shm.ok()) {
      if (EnvInt("OMPI_COMM_WORLD_RANK", 0) == 0) Report(shm, true);
      return kExitUsage;
    }
    // Each process plays --ranks_per_process ranks as threads (one per device of a PJRT
    // client); with 1 the world is the mpi communicator itself.
    const int per_process = train_gpt::RanksPerProcessFlag();
    if (per_process < 1 || per_process > 1024) {
      if (EnvInt("OMPI_COMM_WORLD_RANK", 0) == 0) {
        Report(absl::InvalidArgumentError(absl::StrCat(
                   "--ranks_per_process=", per_process, ": allowed: 1 to 1024")),
               true);
      }
      return kExitUsage;
    }
    auto world = fsdp::CreateMpiThreadsWorld(per_process);
    if (!world.ok()) return fsdp::FinishMpi(world.status(), "train_gpt");
    const Communicator& first = *(*world)[0];
    auto settings = SettingsFromFlags(first.size(),
                                      EnvInt("OMPI_COMM_WORLD_LOCAL_SIZE", 1) * per_process,
                                      first.rank(), /*ranks_share_process=*/false, per_process);
    std::vector<absl::Status> usage(per_process), status(per_process);
    // Every rank learns at once that a rank's flags are bad (instead of waiting for it at the
    // first collective until the deadline), and that ranks were given different flags or data.
    auto agree = [&](int t) {
      Communicator& w = *(*world)[t];
      usage[t] = fsdp::AgreeOnStatus(w, settings.status());
      if (usage[t].ok()) {
        usage[t] = fsdp::CheckSameSettings(w, AgreedSettings(*settings, w.size()), "");
      }
      if (!usage[t].ok()) {
        // The same message on every rank: rank 0 prints it once, and no rank exits before it
        // has (mpirun ends the job when the first rank exits non-zero).
        if (w.rank() == 0) Report(usage[t], true);
        w.Barrier().IgnoreError();
      }
    };
    auto train = [&](int t) {
      Communicator& w = *(*world)[t];
      status[t] = RunRank(w, *settings);
      // The process's other ranks fail at once instead of at their deadline.
      if (!status[t].ok()) w.Abort(status[t]);
    };
    auto on_threads = [&](const std::function<void(int)>& fn) {
      std::vector<std::thread> threads;
      for (int t = 1; t < per_process; ++t) threads.emplace_back(fn, t);
      fn(0);
      for (std::thread& th : threads) th.join();
    };
    on_threads(agree);
    if (!usage[0].ok()) {
      world->clear();
      fsdp::ShutdownMpi();
      return kExitUsage;
    }
    if (first.rank() == 0) PrintWarnings(*settings);
    on_threads(train);
    absl::Status failed;
    for (const absl::Status& s : status) {
      if (!s.ok()) {
        failed = s;
        break;
      }
    }
    // After a failed collective MPI_Finalize would wait for the peers forever: FinishMpi
    // prints the error and aborts the job instead, so that mpirun ends every rank now.
    if (failed.ok()) world->clear();
    return fsdp::FinishMpi(failed, "train_gpt");
  }
  const int ranks = train_gpt::RanksFlag();
  auto settings = SettingsFromFlags(ranks, ranks, 0, /*ranks_share_process=*/true);
  if (!settings.ok()) return Report(settings.status(), true);
  PrintWarnings(*settings);
  const absl::Status status = fsdp::LocalWorld::Run(
      ranks, {}, [&](Communicator& world) { return RunRank(world, *settings); });
  return status.ok() ? 0 : Report(status, false);
}
