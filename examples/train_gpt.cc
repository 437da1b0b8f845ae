// Trains the GPT of MODEL_SPEC.md on one rank (the CPU backend, all cores) and samples text
// from it. By default: a small byte-level GPT on the corpus embedded in libfsdp, about a
// minute on two cores. `train_gpt --help` lists the flags.
//
// Each unit (the root, then each block) has one flat parameter buffer, one flat gradient
// buffer and its own AdamW, exactly what the sharding runtime later holds per rank shard.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "fsdp/backend.h"
#include "fsdp/nn/data.h"
#include "fsdp/nn/gpt.h"
#include "fsdp/optim.h"

ABSL_FLAG(std::string, config, "nano", "nano, mini, gpt2, gpt2-medium or gpt2-xl");
ABSL_FLAG(int, layers, 4, "override the config's number of layers (0 = keep)");
ABSL_FLAG(int, channels, 128, "override the config's width C (0 = keep)");
ABSL_FLAG(int, heads, 4, "override the config's number of heads (0 = keep)");
ABSL_FLAG(int, batch, 16, "sequences per step");
ABSL_FLAG(int, seq, 64, "sequence length T (at most the config's block size)");
ABSL_FLAG(int, steps, 1000, "optimizer steps");
ABSL_FLAG(double, lr, 3e-3, "peak learning rate (warmup, then cosine down to lr / 10)");
ABSL_FLAG(int, warmup, 50, "warmup steps");
ABSL_FLAG(double, clip, 1.0, "clip gradients to this global L2 norm (0 = off)");
ABSL_FLAG(double, weight_decay, 0.1, "AdamW weight decay of weights and embeddings");
ABSL_FLAG(uint64_t, seed, 1, "seed of the initialisation, the data order and the sampling");
ABSL_FLAG(int, threads, 0, "OpenMP threads (0 = all cores)");
ABSL_FLAG(std::string, data, "",
          "token file (.bin of uint16) or text file; default: the embedded corpus");
ABSL_FLAG(int, log_every, 50, "print a progress line every this many steps");
ABSL_FLAG(int, eval_every, 250, "validation loss every this many steps (0 = only at the end)");
ABSL_FLAG(int, sample_tokens, 300, "tokens to sample after training (0 = none)");
ABSL_FLAG(double, temperature, 0.8, "sampling temperature (0 = greedy)");
ABSL_FLAG(std::string, prompt, "This License", "text the samples start from");

namespace {

using fsdp::Backend;
using fsdp::Buffer;
using fsdp::nn::Gpt;
using fsdp::nn::GptConfig;

#define CHECK_OK(expr)                                                      \
  do {                                                                      \
    const absl::Status s_ = (expr);                                         \
    if (!s_.ok()) {                                                         \
      std::fprintf(stderr, "train_gpt: %s\n", s_.ToString().c_str());      \
      std::exit(1);                                                         \
    }                                                                       \
  } while (0)

template <typename T>
T ValueOrDie(absl::StatusOr<T> v) {
  CHECK_OK(v.status());
  return std::move(*v);
}

// ---- trainer pieces: parameters, gradients and optimizer state, unit by unit ----------------

struct Unit {
  int64_t numel = 0;
  Buffer params, grads;
  std::unique_ptr<fsdp::AdamW> optimizer;
};

std::vector<Unit> CreateUnits(Backend* backend, const GptConfig& config, uint64_t seed,
                              fsdp::AdamWOptions adamw) {
  const auto specs = fsdp::nn::GptParamSpecs(config);
  std::vector<Unit> units(fsdp::nn::GptNumUnits(config));
  for (int u = 0; u < static_cast<int>(units.size()); ++u) {
    Unit& unit = units[u];
    unit.numel = fsdp::nn::GptUnitNumel(config, u);
    const size_t bytes = unit.numel * sizeof(float);
    std::vector<float> host(unit.numel);
    fsdp::nn::InitUnit(config, u, seed, host.data());
    unit.params = ValueOrDie(Buffer::Create(backend, bytes));
    CHECK_OK(backend->CopyFromHost(unit.params.data(), host.data(), bytes));
    unit.grads = ValueOrDie(Buffer::Create(backend, bytes));
    unit.optimizer = ValueOrDie(fsdp::AdamW::Create(backend, unit.numel,
                                                    fsdp::nn::UnitDecayRanges(specs, u), adamw));
  }
  return units;
}

std::vector<const float*> Params(const std::vector<Unit>& units) {
  std::vector<const float*> p;
  for (const Unit& u : units) p.push_back(u.params.as<float>());
  return p;
}

std::vector<float*> Grads(const std::vector<Unit>& units) {
  std::vector<float*> g;
  for (const Unit& u : units) g.push_back(u.grads.as<float>());
  return g;
}

// Token ids of a batch, on the device.
struct DeviceBatch {
  Buffer inputs, targets;
  static DeviceBatch Create(Backend* backend, int B, int T) {
    const size_t bytes = static_cast<size_t>(B) * T * sizeof(int32_t);
    return {ValueOrDie(Buffer::Create(backend, bytes)), ValueOrDie(Buffer::Create(backend, bytes))};
  }
  void Upload(Backend* backend, const fsdp::nn::Batch& b) {
    CHECK_OK(backend->CopyFromHost(inputs.data(), b.inputs.data(), inputs.bytes()));
    CHECK_OK(backend->CopyFromHost(targets.data(), b.targets.data(), targets.bytes()));
  }
};

// Forward, backward, clip by the global gradient norm, AdamW on every unit. Returns the loss.
float TrainStep(Backend* backend, Gpt& gpt, std::vector<Unit>& units, const DeviceBatch& batch,
                float lr, float max_norm) {
  const fsdp::Ops& ops = backend->ops();
  const float loss = ValueOrDie(
      gpt.Forward(Params(units), batch.inputs.as<int32_t>(), batch.targets.as<int32_t>()));
  for (Unit& u : units) CHECK_OK(backend->Memset(u.grads.data(), 0, u.grads.bytes()));
  CHECK_OK(gpt.Backward(Params(units), Grads(units)));
  double sum_squares = 0;
  for (const Unit& u : units) sum_squares += ops.sum_squares(u.grads.as<float>(), u.numel);
  const float clip = fsdp::ClipCoefficient(std::sqrt(sum_squares), max_norm);
  for (Unit& u : units) {
    if (clip != 1.0f) ops.scale_inplace(u.grads.as<float>(), clip, u.numel);
    u.optimizer->set_lr(lr);
    CHECK_OK(u.optimizer->Step(u.params.as<float>(), u.grads.as<float>()));
  }
  return loss;
}

// Mean loss over one pass of the validation split.
float Evaluate(Backend* backend, Gpt& gpt, const std::vector<Unit>& units,
               const fsdp::nn::DataLoader& val, DeviceBatch& batch) {
  double sum = 0;
  const int64_t steps = val.steps_per_epoch();
  for (int64_t s = 0; s < steps; ++s) {
    batch.Upload(backend, val.At(s));
    sum += ValueOrDie(
        gpt.Forward(Params(units), batch.inputs.as<int32_t>(), batch.targets.as<int32_t>()));
  }
  return static_cast<float>(sum / steps);
}

// Continues `prompt` by `n` tokens, one forward of the whole window per token.
std::vector<int32_t> Sample(Backend* backend, const GptConfig& config,
                            const std::vector<Unit>& units, std::vector<int32_t> tokens, int n,
                            int T, float temperature, uint64_t seed) {
  auto gpt = ValueOrDie(Gpt::Create(config, backend, 1, T));
  Buffer idx = ValueOrDie(Buffer::Create(backend, T * sizeof(int32_t)));
  std::mt19937_64 rng(seed);
  std::vector<float> logits(config.vocab_size);
  for (int i = 0; i < n; ++i) {
    // The last T tokens, zero-padded at the end: causal attention never looks at the padding.
    const int len = std::min<int>(static_cast<int>(tokens.size()), T);
    std::vector<int32_t> window(T, 0);
    std::copy(tokens.end() - len, tokens.end(), window.begin());
    CHECK_OK(backend->CopyFromHost(idx.data(), window.data(), T * sizeof(int32_t)));
    CHECK_OK(gpt->Forward(Params(units), idx.as<int32_t>(), nullptr).status());
    CHECK_OK(backend->CopyToHost(logits.data(), gpt->logits() + (len - 1) * config.vocab_size,
                                 logits.size() * sizeof(float)));
    int32_t next = static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) -
                                        logits.begin());
    if (temperature > 0) {
      std::vector<double> w(logits.size());
      for (size_t v = 0; v < w.size(); ++v) w[v] = std::exp((logits[v] - logits[next]) / temperature);
      next = std::discrete_distribution<int32_t>(w.begin(), w.end())(rng);
    }
    tokens.push_back(next);
  }
  return tokens;
}

// ---- setup -----------------------------------------------------------------------------------

GptConfig ConfigFromFlags() {
  GptConfig c = ValueOrDie(GptConfig::FromName(absl::GetFlag(FLAGS_config)));
  if (absl::GetFlag(FLAGS_layers) > 0) c.num_layers = absl::GetFlag(FLAGS_layers);
  if (absl::GetFlag(FLAGS_channels) > 0) c.channels = absl::GetFlag(FLAGS_channels);
  if (absl::GetFlag(FLAGS_heads) > 0) c.num_heads = absl::GetFlag(FLAGS_heads);
  CHECK_OK(c.Validate());
  return c;
}

fsdp::nn::TokenDataset LoadData(const GptConfig& config) {
  const std::string path = absl::GetFlag(FLAGS_data);
  if (path.empty()) return fsdp::nn::TokenDataset::FromText(fsdp::nn::EmbeddedCorpus());
  return ValueOrDie(fsdp::nn::TokenDataset::FromFile(path, config.vocab_size));
}

std::string Seconds(double s) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), s < 100 ? "%.1f s" : "%.0f s", s);
  return buf;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("Trains a GPT on one rank and samples from it.");
  absl::ParseCommandLine(argc, argv);
  const GptConfig config = ConfigFromFlags();
  const int B = absl::GetFlag(FLAGS_batch), T = absl::GetFlag(FLAGS_seq);
  const int steps = absl::GetFlag(FLAGS_steps), log_every = std::max(1, absl::GetFlag(FLAGS_log_every));
  const int eval_every = absl::GetFlag(FLAGS_eval_every);
  const uint64_t seed = absl::GetFlag(FLAGS_seed);
  const float max_lr = static_cast<float>(absl::GetFlag(FLAGS_lr));

  auto backend = ValueOrDie(fsdp::CpuBackend::Create({.num_threads = absl::GetFlag(FLAGS_threads)}));
  backend->BindCurrentThread();
  auto split = ValueOrDie(fsdp::nn::SplitTrainVal(LoadData(config), 0.1));
  auto train = ValueOrDie(fsdp::nn::DataLoader::Create(
      &split.train, {.batch_size = B, .seq_len = T, .seed = seed}));
  auto val = ValueOrDie(fsdp::nn::DataLoader::Create(
      &split.val, {.batch_size = B, .seq_len = T, .order = fsdp::nn::SampleOrder::kSequential}));
  auto gpt = ValueOrDie(Gpt::Create(config, backend.get(), B, T));
  std::vector<Unit> units = CreateUnits(
      backend.get(), config, seed,
      {.lr = max_lr, .weight_decay = static_cast<float>(absl::GetFlag(FLAGS_weight_decay))});
  const fsdp::WarmupCosine schedule(absl::GetFlag(FLAGS_warmup), steps, max_lr, max_lr / 10);
  DeviceBatch batch = DeviceBatch::Create(backend.get(), B, T);

  std::printf("train_gpt: %s L=%d H=%d C=%d V=%d, %.2fM parameters | batch %dx%d | %d steps | "
              "%d threads | %lld train / %lld val tokens\n",
              config.name.c_str(), config.num_layers, config.num_heads, config.channels,
              config.vocab_size, config.num_parameters() / 1e6, B, T, steps,
              backend->num_threads(), static_cast<long long>(split.train.size()),
              static_cast<long long>(split.val.size()));

  const auto start = std::chrono::steady_clock::now();
  auto elapsed = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  double loss_sum = 0;
  int loss_count = 0;
  for (int step = 0; step < steps; ++step) {
    batch.Upload(backend.get(), train.Next());
    const float lr = schedule.At(step);
    loss_sum += TrainStep(backend.get(), *gpt, units, batch, lr,
                          static_cast<float>(absl::GetFlag(FLAGS_clip)));
    ++loss_count;
    const bool last = step + 1 == steps;
    if ((step + 1) % log_every == 0 || step == 0 || last) {
      const double t = elapsed();
      std::printf("step %5d/%d | loss %.4f | lr %.2e | %6.0f tok/s | %s | ETA %s\n", step + 1,
                  steps, loss_sum / loss_count, lr, (step + 1.0) * B * T / t,
                  Seconds(t).c_str(), Seconds(t / (step + 1) * (steps - step - 1)).c_str());
      loss_sum = 0;
      loss_count = 0;
    }
    if (last || (eval_every > 0 && (step + 1) % eval_every == 0)) {
      std::printf("step %5d/%d | val loss %.4f\n", step + 1, steps,
                  Evaluate(backend.get(), *gpt, units, val, batch));
    }
  }
  std::printf("trained in %s\n", Seconds(elapsed()).c_str());

  const int n = absl::GetFlag(FLAGS_sample_tokens);
  if (n > 0 && config.vocab_size == 256) {
    std::string prompt = absl::GetFlag(FLAGS_prompt);
    if (prompt.empty()) prompt.push_back('\n');  // the model needs a first token
    for (int i = 0; i < 2; ++i) {
      const auto tokens = Sample(backend.get(), config, units,
                                 std::vector<int32_t>(prompt.begin(), prompt.end()), n, T,
                                 static_cast<float>(absl::GetFlag(FLAGS_temperature)), seed + i);
      std::printf("\n--- sample %d ---\n%s\n", i + 1, std::string(tokens.begin(), tokens.end()).c_str());
    }
  } else if (n > 0) {
    std::printf("(sampling prints text only for byte-level models, V = 256)\n");
  }
  return 0;
}
