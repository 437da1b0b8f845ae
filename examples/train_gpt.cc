// Trains the GPT of MODEL_SPEC.md with sharded data parallelism and samples text from it.
// By default: 2 ranks as threads, FULL_SHARD, a small byte-level GPT on the corpus embedded in
// libfsdp, about a minute on two cores. Under `mpirun -np N` each process is one rank.
// `train_gpt --help` lists the flags.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "fsdp/backend.h"
#include "fsdp/checkpoint.h"
#include "fsdp/local_world.h"
#include "fsdp/mpi_world.h"
#include "fsdp/nn/data.h"
#include "fsdp/nn/sharded_gpt.h"
#include "fsdp/optim.h"

ABSL_FLAG(std::string, config, "nano", "nano, mini, gpt2, gpt2-medium or gpt2-xl");
ABSL_FLAG(int, layers, 4, "override the config's number of layers (0 = keep)");
ABSL_FLAG(int, channels, 128, "override the config's width C (0 = keep)");
ABSL_FLAG(int, heads, 4, "override the config's number of heads (0 = keep)");
ABSL_FLAG(int, ranks, 2, "data-parallel ranks, as threads of this process (ignored under mpirun)");
ABSL_FLAG(std::string, strategy, "FULL_SHARD",
          "FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD or HYBRID_SHARD_GRAD_OP");
ABSL_FLAG(int, hybrid_shard, 0, "ranks per shard group for the HYBRID strategies");
ABSL_FLAG(bool, prefetch, true, "prefetch the next unit's all-gather while a unit computes");
ABSL_FLAG(int, batch, 16, "sequences per step, over all ranks (a multiple of the rank count)");
ABSL_FLAG(int, micro_batches, 1, "gradient accumulation: micro-batches per step");
ABSL_FLAG(int, seq, 64, "sequence length T (at most the config's block size)");
ABSL_FLAG(int, steps, 1000, "optimizer steps");
ABSL_FLAG(double, lr, 3e-3, "peak learning rate (warmup, then cosine down to lr / 10)");
ABSL_FLAG(int, warmup, 50, "warmup steps");
ABSL_FLAG(double, clip, 1.0, "clip gradients to this global L2 norm (0 = off)");
ABSL_FLAG(double, weight_decay, 0.1, "AdamW weight decay of weights and embeddings");
ABSL_FLAG(uint64_t, seed, 1, "seed of the initialisation, the data order and the sampling");
ABSL_FLAG(int, threads, 0, "OpenMP threads per rank (0 = the cores divided among the ranks)");
ABSL_FLAG(std::string, data, "",
          "token file (.bin of uint16) or text file; default: the embedded corpus");
ABSL_FLAG(int, log_every, 50, "print a progress line every this many steps");
ABSL_FLAG(int, eval_every, 250, "validation loss every this many steps (0 = only at the end)");
ABSL_FLAG(int, sample_tokens, 300, "tokens to sample after training (0 = none)");
ABSL_FLAG(double, temperature, 0.8, "sampling temperature (0 = greedy)");
ABSL_FLAG(std::string, prompt, "This License", "text the samples start from");
ABSL_FLAG(std::string, checkpoint_dir, "",
          "sharded checkpoints go to DIR/step-N; training resumes from the latest one there");
ABSL_FLAG(int, checkpoint_every, 0, "save a checkpoint every this many steps (0 = at the end)");
ABSL_FLAG(std::string, export_safetensors, "", "write the trained model to this .safetensors file");

namespace {

using fsdp::Communicator;
using fsdp::nn::GptConfig;
using fsdp::nn::ShardedGpt;

struct Settings {
  GptConfig config;
  fsdp::nn::ShardedGptOptions model;
  int micro_batches = 1, steps = 0, log_every = 1, eval_every = 0, threads = 0;
  int ranks_on_host = 1;
  float max_lr = 0;
  uint64_t seed = 0;
};

absl::StatusOr<Settings> SettingsFromFlags(int world_size, int ranks_on_host) {
  Settings s;
  if (world_size < 1) return absl::InvalidArgumentError("--ranks must be >= 1");
  FSDP_ASSIGN_OR_RETURN(s.config, GptConfig::FromName(absl::GetFlag(FLAGS_config)));
  if (absl::GetFlag(FLAGS_layers) > 0) s.config.num_layers = absl::GetFlag(FLAGS_layers);
  if (absl::GetFlag(FLAGS_channels) > 0) s.config.channels = absl::GetFlag(FLAGS_channels);
  if (absl::GetFlag(FLAGS_heads) > 0) s.config.num_heads = absl::GetFlag(FLAGS_heads);
  FSDP_RETURN_IF_ERROR(s.config.Validate());
  const int batch = absl::GetFlag(FLAGS_batch);
  s.micro_batches = absl::GetFlag(FLAGS_micro_batches);
  if (s.micro_batches < 1 || batch < 1 || batch % (world_size * s.micro_batches) != 0) {
    return absl::InvalidArgumentError(
        "--batch must be a positive multiple of the rank count times --micro_batches");
  }
  FSDP_ASSIGN_OR_RETURN(s.model.sharding.strategy,
                        fsdp::ParseStrategy(absl::GetFlag(FLAGS_strategy)));
  s.model.sharding.hybrid_shard_size = absl::GetFlag(FLAGS_hybrid_shard);
  s.model.sharding.forward_prefetch = s.model.sharding.backward_prefetch =
      absl::GetFlag(FLAGS_prefetch);
  s.model.sharding.max_grad_norm = static_cast<float>(absl::GetFlag(FLAGS_clip));
  s.max_lr = static_cast<float>(absl::GetFlag(FLAGS_lr));
  s.model.sharding.adamw.lr = s.max_lr;
  s.model.sharding.adamw.weight_decay = static_cast<float>(absl::GetFlag(FLAGS_weight_decay));
  s.model.batch_size = batch / world_size / s.micro_batches;
  s.model.seq_len = absl::GetFlag(FLAGS_seq);
  s.seed = absl::GetFlag(FLAGS_seed);
  s.model.seed = s.seed;
  s.steps = absl::GetFlag(FLAGS_steps);
  s.log_every = std::max(1, absl::GetFlag(FLAGS_log_every));
  s.eval_every = absl::GetFlag(FLAGS_eval_every);
  s.threads = absl::GetFlag(FLAGS_threads);
  s.ranks_on_host = ranks_on_host;
  return s;
}

std::string Seconds(double s) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), s < 100 ? "%.1f s" : "%.0f s", s);
  return buf;
}

// Mean loss over the validation split, each rank taking its share of the windows.
absl::StatusOr<float> Evaluate(ShardedGpt& model, const fsdp::nn::DataLoader& val) {
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
absl::StatusOr<std::string> Sample(ShardedGpt& model, const std::string& prompt, int n,
                                   float temperature, uint64_t seed) {
  const int B = model.model().batch_size(), T = model.model().seq_len();
  const int V = model.model().config().vocab_size;
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
        logits.data(), model.logits() + static_cast<size_t>(len - 1) * V, V * sizeof(float)));
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

// Everything one rank does. Rank 0 prints.
absl::Status RunRank(Communicator& world, const Settings& s) {
  const bool lead = world.rank() == 0;
  FSDP_ASSIGN_OR_RETURN(auto backend,
                        fsdp::CpuBackend::Create({.num_threads = s.threads,
                                                  .ranks_sharing_cores = s.ranks_on_host}));
  backend->BindCurrentThread();
  const std::string path = absl::GetFlag(FLAGS_data);
  fsdp::nn::TokenDataset data;
  if (path.empty()) {
    data = fsdp::nn::TokenDataset::FromText(fsdp::nn::EmbeddedCorpus());
  } else {
    FSDP_ASSIGN_OR_RETURN(data, fsdp::nn::TokenDataset::FromFile(path, s.config.vocab_size));
  }
  FSDP_ASSIGN_OR_RETURN(auto split, fsdp::nn::SplitTrainVal(data, 0.1));
  const int B = s.model.batch_size, T = s.model.seq_len, N = world.size();
  // Each micro-batch is one loader step, so the data order is that of B*N-row batches.
  FSDP_ASSIGN_OR_RETURN(auto train, fsdp::nn::DataLoader::Create(
      &split.train, {.batch_size = B, .seq_len = T, .rank = world.rank(), .world_size = N,
                     .seed = s.seed}));
  FSDP_ASSIGN_OR_RETURN(auto val, fsdp::nn::DataLoader::Create(
      &split.val, {.batch_size = B, .seq_len = T, .rank = world.rank(), .world_size = N,
                   .order = fsdp::nn::SampleOrder::kSequential}));
  FSDP_ASSIGN_OR_RETURN(auto model,
                        ShardedGpt::Create(s.config, backend.get(), world, s.model));
  const fsdp::WarmupCosine schedule(absl::GetFlag(FLAGS_warmup), s.steps, s.max_lr,
                                    s.max_lr / 10);
  const int64_t tokens_per_step = static_cast<int64_t>(B) * T * N * s.micro_batches;
  // Resume from the latest checkpoint, on any number of ranks or strategy.
  const std::string ckpt_dir = absl::GetFlag(FLAGS_checkpoint_dir);
  int start_step = 0;
  if (!ckpt_dir.empty()) {
    auto latest = fsdp::LatestCheckpoint(ckpt_dir);
    if (latest.ok()) {
      FSDP_ASSIGN_OR_RETURN(fsdp::LoadedCheckpoint loaded,
                            fsdp::LoadCheckpoint(model->runtime(), *latest));
      if (loaded.state.data) FSDP_RETURN_IF_ERROR(train.Restore(*loaded.state.data));
      start_step = static_cast<int>(loaded.step);
      if (lead) std::printf("resumed from %s (step %d)\n", latest->c_str(), start_step);
    } else if (!absl::IsNotFound(latest.status())) {
      return latest.status();
    }
  }
  auto save = [&](int step) -> absl::Status {
    fsdp::TrainingState state;
    state.data = train.state();
    const std::string dir = ckpt_dir + "/step-" + std::to_string(step);
    FSDP_RETURN_IF_ERROR(fsdp::SaveCheckpoint(model->runtime(), dir, state));
    if (lead) std::printf("saved %s\n", dir.c_str());
    return absl::OkStatus();
  };
  if (lead) {
    std::printf("train_gpt: %s L=%d H=%d C=%d V=%d, %.2fM parameters | %s on %d ranks (%s), "
                "%d units | batch %d x %d per step | %d steps | %d threads per rank\n",
                s.config.name.c_str(), s.config.num_layers, s.config.num_heads,
                s.config.channels, s.config.vocab_size, s.config.num_parameters() / 1e6,
                std::string(fsdp::StrategyName(s.model.sharding.strategy)).c_str(), N,
                std::string(world.backend()).c_str(), model->runtime().num_units(),
                B * N * s.micro_batches, T, s.steps, backend->num_threads());
  }
  const auto start = std::chrono::steady_clock::now();
  auto elapsed = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  double loss_sum = 0;
  int loss_count = 0;
  double first_loss = NAN, last_loss = NAN;  // the first and last progress lines' losses
  float val_loss = NAN;
  for (int step = start_step; step < s.steps; ++step) {
    double step_loss = 0;
    for (int m = 0; m < s.micro_batches; ++m) {
      model->runtime().set_sync_gradients(m + 1 == s.micro_batches);  // no_sync until the last
      const fsdp::nn::Batch b = train.Next();
      FSDP_ASSIGN_OR_RETURN(float loss, model->ForwardBackward(b.inputs.data(), b.targets.data()));
      step_loss += loss / s.micro_batches;
    }
    FSDP_ASSIGN_OR_RETURN(fsdp::StepStats stats, model->runtime().Step(schedule));
    FSDP_ASSIGN_OR_RETURN(float mean_loss, model->MeanOverRanks(static_cast<float>(step_loss)));
    loss_sum += mean_loss;
    ++loss_count;
    const bool last = step + 1 == s.steps;
    if (lead && ((step + 1) % s.log_every == 0 || step == start_step || last)) {
      const double t = elapsed();
      const double done = step + 1 - start_step;
      last_loss = loss_sum / loss_count;
      if (std::isnan(first_loss)) first_loss = last_loss;
      std::printf("step %5d/%d | loss %.4f | lr %.2e | norm %6.3f | %6.0f tok/s | %s | ETA %s\n",
                  step + 1, s.steps, loss_sum / loss_count, stats.lr, stats.grad_norm,
                  done * tokens_per_step / t, Seconds(t).c_str(),
                  Seconds(t / done * (s.steps - step - 1)).c_str());
      loss_sum = 0;
      loss_count = 0;
    }
    if (last || (s.eval_every > 0 && (step + 1) % s.eval_every == 0)) {
      FSDP_ASSIGN_OR_RETURN(val_loss, Evaluate(*model, val));
      if (lead) std::printf("step %5d/%d | val loss %.4f\n", step + 1, s.steps, val_loss);
    }
    const int every = absl::GetFlag(FLAGS_checkpoint_every);
    if (!ckpt_dir.empty() && (last || (every > 0 && (step + 1) % every == 0))) {
      FSDP_RETURN_IF_ERROR(save(step + 1));
    }
  }
  const std::string export_path = absl::GetFlag(FLAGS_export_safetensors);
  if (!export_path.empty()) {
    FSDP_RETURN_IF_ERROR(fsdp::ExportSafetensors(model->runtime(), export_path));
    if (lead) std::printf("exported %s\n", export_path.c_str());
  }
  if (lead) {
    std::printf("trained %d steps in %s: loss %.4f -> %.4f, val loss %.4f\nmemory per rank: %s\n",
                s.steps - start_step, Seconds(elapsed()).c_str(), first_loss, last_loss,
                val_loss, fsdp::FormatMemoryReport(model->memory()).c_str());
  }
  const int n = absl::GetFlag(FLAGS_sample_tokens);
  if (n > 0 && s.config.vocab_size == 256) {
    for (int i = 0; i < 2; ++i) {
      FSDP_ASSIGN_OR_RETURN(std::string text,
                            Sample(*model, absl::GetFlag(FLAGS_prompt), n,
                                   static_cast<float>(absl::GetFlag(FLAGS_temperature)),
                                   s.seed + i));
      if (lead) std::printf("\n--- sample %d ---\n%s\n", i + 1, text.c_str());
    }
  } else if (n > 0 && lead) {
    std::printf("(sampling prints text only for byte-level models, V = 256)\n");
  }
  return absl::OkStatus();
}

int EnvInt(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::atoi(v) : fallback;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Trains a GPT with sharded data parallelism (ranks as threads, or processes under "
      "mpirun) and samples from it.");
  absl::ParseCommandLine(argc, argv);
  absl::Status status;
  if (std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr) {  // launched by mpirun
    auto world = fsdp::CreateMpiWorld();
    if (!world.ok()) {
      status = world.status();
    } else {
      auto settings = SettingsFromFlags((*world)->size(),
                                        EnvInt("OMPI_COMM_WORLD_LOCAL_SIZE", 1));
      status = settings.ok() ? RunRank(**world, *settings) : settings.status();
      world->reset();
    }
    fsdp::ShutdownMpi();
  } else {
    const int ranks = absl::GetFlag(FLAGS_ranks);
    auto settings = SettingsFromFlags(ranks, ranks);
    status = settings.ok() ? fsdp::LocalWorld::Run(ranks, {},
                                                   [&](Communicator& world) {
                                                     return RunRank(world, *settings);
                                                   })
                           : settings.status();
  }
  if (!status.ok()) {
    std::fprintf(stderr, "train_gpt: %s\n", status.ToString().c_str());
    return 1;
  }
  return 0;
}
