// A framework's own model on the sharding runtime's per-unit hooks (fsdp/sharding.h): a stack
// of Linear layers (tanh between them) whose forward and backward are written here, as plain
// loops over the host pointers that UnitView exposes on the CPU backend. Each layer is one
// unit; the runtime gathers its parameters before use, frees them after (FULL_SHARD),
// reduce-scatters its gradient and updates the local shards.
//
// The task is a synthetic regression: inputs x uniform in [-1, 1]^in, targets y = T2 tanh(T1 x)
// from a fixed random "teacher"; the loss is the mean squared error. Every sample, weight and
// teacher value is a function of its indices (and --seed), so the run is the same on any
// number of ranks: with --ranks 1 and --ranks 2 the losses agree to rounding.
//
// By default: 2 ranks as threads, FULL_SHARD, AdamW. `custom_layers --help` lists the flags.
// Exit codes: 0 trained (the loss is printed as it falls), 1 a failure while training, 2 bad
// usage (a flag value).
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "fsdp/cpu_backend.h"
#include "fsdp/local_world.h"
#include "fsdp/sharding.h"

ABSL_FLAG(int, ranks, 2, "data-parallel ranks, as threads of this process");
ABSL_FLAG(std::string, strategy, "FULL_SHARD",
          "FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD or HYBRID_SHARD_GRAD_OP");
ABSL_FLAG(int, hybrid_shard, 0, "ranks per shard group, for the HYBRID strategies only");
ABSL_FLAG(int, layers, 3, "Linear layers (tanh between them)");
ABSL_FLAG(int, in, 8, "input features");
ABSL_FLAG(int, hidden, 32, "width of the hidden layers");
ABSL_FLAG(int, out, 2, "outputs");
ABSL_FLAG(int, batch, 64, "samples per step, over all ranks (a multiple of --ranks)");
ABSL_FLAG(int, steps, 200, "optimizer steps");
ABSL_FLAG(double, lr, 1e-2, "learning rate");
ABSL_FLAG(std::string, optimizer, "adamw", "adamw or sgd");
ABSL_FLAG(int, log_every, 20, "print the loss every this many steps (and at the first and last)");
ABSL_FLAG(uint64_t, seed, 1, "seed of the data, the teacher and the initial weights");

namespace {

constexpr int kExitFailure = 1;
constexpr int kExitUsage = 2;

struct Settings {
  int ranks, layers, in, hidden, out, batch, steps, log_every;
  float lr;
  uint64_t seed;
  fsdp::ShardingOptions sharding;
};

// A uniform value in [-1, 1) from a tuple of indices (splitmix64 of their mix).
float Uniform(uint64_t a, uint64_t b, uint64_t c, uint64_t d) {
  uint64_t z = a * 0x9E3779B97F4A7C15ull ^ (b + 0x632BE59BD9B4E019ull) * 0xBF58476D1CE4E5B9ull ^
               (c + 0x85157AF5ull) * 0x94D049BB133111EBull ^ (d + 0x1B873593ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return static_cast<float>(static_cast<double>(z >> 11) * 0x1.0p-53 * 2.0 - 1.0);
}

int LayerIn(const Settings& s, int l) { return l == 0 ? s.in : s.hidden; }
int LayerOut(const Settings& s, int l) { return l == s.layers - 1 ? s.out : s.hidden; }

// The teacher: y = T2 tanh(T1 x), T1 of 16 x in, T2 of out x 16.
constexpr int kTeacherHidden = 16;
void Teacher(const Settings& s, const float* x, float* y) {
  float h[kTeacherHidden];
  for (int i = 0; i < kTeacherHidden; ++i) {
    float z = 0;
    for (int j = 0; j < s.in; ++j) z += 2.0f * Uniform(s.seed, 1, i, j) * x[j];
    h[i] = std::tanh(z);
  }
  for (int k = 0; k < s.out; ++k) {
    float z = 0;
    for (int i = 0; i < kTeacherHidden; ++i) z += Uniform(s.seed, 2, k, i) * h[i];
    y[k] = z;
  }
}

// What one rank does: its share of every step's samples, through the hooks.
absl::Status RunRank(fsdp::Communicator& world, const Settings& s) {
  FSDP_ASSIGN_OR_RETURN(auto backend, fsdp::CpuBackend::Create(
                                          {.num_threads = 1, .ranks_sharing_cores = world.size()}));
  FSDP_ASSIGN_OR_RETURN(auto rt, fsdp::ShardingRuntime::Create(backend.get(), world, s.sharding));

  // Set-up: one unit per layer, W (out x in) and b (out); parameter names are unique.
  for (int l = 0; l < s.layers; ++l) {
    const std::string name = absl::StrCat("layer", l);
    FSDP_ASSIGN_OR_RETURN(
        int unit, rt->RegisterUnit(name, {{name + ".weight", {LayerOut(s, l), LayerIn(s, l)}},
                                          {name + ".bias", {LayerOut(s, l)}}}));
    if (unit != l) return absl::InternalError("units are numbered in registration order");
  }
  // Each rank fills only the pieces of its shards; the values depend on the element's index
  // alone, so every sharding gives the same model.
  FSDP_RETURN_IF_ERROR(rt->Finalize([&](int unit, const fsdp::ParamInfo& p, int64_t begin,
                                        int64_t end, float* out) {
    const float scale = 1.0f / std::sqrt(static_cast<float>(LayerIn(s, unit)));
    for (int64_t j = begin; j < end; ++j) {
      out[j - begin] = p.shape.size() == 1 ? 0.0f : scale * Uniform(s.seed, 3, unit, j);  // bias 0
    }
  }));

  const int local = s.batch / world.size();
  const int first_sample = world.rank() * local;
  // acts[l]: the input of layer l for the local samples (local x LayerIn), acts[layers]: the
  // output; the tanh outputs are the next layer's inputs.
  std::vector<std::vector<float>> acts(s.layers + 1);
  for (int l = 0; l <= s.layers; ++l) {
    acts[l].resize(static_cast<size_t>(local) * (l == s.layers ? s.out : LayerIn(s, l)));
  }
  int64_t activation_bytes = 0;
  for (const auto& a : acts) activation_bytes += static_cast<int64_t>(a.size()) * 4;
  rt->SetActivationBytes(2 * activation_bytes);  // the activations and their gradients
  std::vector<float> target(static_cast<size_t>(local) * s.out);
  std::vector<float> grad_out, grad_in;

  float first_loss = 0, loss = 0;
  for (int step = 0; step < s.steps; ++step) {
    // The step's samples: global sample i of step t is a function of (seed, t, i).
    for (int i = 0; i < local; ++i) {
      float* x = &acts[0][static_cast<size_t>(i) * s.in];
      for (int j = 0; j < s.in; ++j) x[j] = Uniform(s.seed, 4 + step, first_sample + i, j);
      Teacher(s, x, &target[static_cast<size_t>(i) * s.out]);
    }

    // Forward: a_{l+1} = act(W_l a_l + b_l), tanh on every layer but the last.
    for (int l = 0; l < s.layers; ++l) {
      FSDP_ASSIGN_OR_RETURN(fsdp::UnitView v, rt->PreForward(l));
      const float* w = v.param(0);
      const float* b = v.param(1);
      const int n_in = LayerIn(s, l), n_out = LayerOut(s, l);
      const bool last = l == s.layers - 1;
      for (int i = 0; i < local; ++i) {
        const float* a = &acts[l][static_cast<size_t>(i) * n_in];
        float* z = &acts[l + 1][static_cast<size_t>(i) * n_out];
        for (int k = 0; k < n_out; ++k) {
          float sum = b[k];
          for (int j = 0; j < n_in; ++j) sum += w[static_cast<size_t>(k) * n_in + j] * a[j];
          z[k] = last ? sum : std::tanh(sum);
        }
      }
      FSDP_RETURN_IF_ERROR(rt->PostForward(l));
    }

    // Loss: the mean over the local samples and outputs of (y - t)^2; its gradient.
    const float inv = 1.0f / static_cast<float>(local * s.out);
    grad_out.assign(target.size(), 0.0f);
    float local_loss = 0;
    for (size_t k = 0; k < target.size(); ++k) {
      const float d = acts[s.layers][k] - target[k];
      local_loss += d * d * inv;
      grad_out[k] = 2.0f * d * inv;
    }
    // The reported loss is the mean over the ranks, i.e. over the whole batch.
    loss = local_loss;
    FSDP_RETURN_IF_ERROR(world.AllReduce(&loss, &loss, 1, fsdp::DType::kF32, fsdp::ReduceOp::kAvg));

    // Backward, last layer first. grad_out: dL/d(output of layer l) for the local samples.
    for (int l = s.layers - 1; l >= 0; --l) {
      FSDP_ASSIGN_OR_RETURN(fsdp::UnitView v, rt->PreBackward(l));
      const float* w = v.param(0);
      float* dw = v.grad(0);
      float* db = v.grad(1);
      const int n_in = LayerIn(s, l), n_out = LayerOut(s, l);
      const bool last = l == s.layers - 1;
      grad_in.assign(static_cast<size_t>(local) * n_in, 0.0f);
      for (int i = 0; i < local; ++i) {
        const float* a = &acts[l][static_cast<size_t>(i) * n_in];
        const float* y = &acts[l + 1][static_cast<size_t>(i) * n_out];
        float* da = &grad_in[static_cast<size_t>(i) * n_in];
        for (int k = 0; k < n_out; ++k) {
          // Through the tanh: d tanh(z) / dz = 1 - tanh(z)^2.
          const float dz = grad_out[static_cast<size_t>(i) * n_out + k] *
                           (last ? 1.0f : 1.0f - y[k] * y[k]);
          db[k] += dz;  // the hooks' contract: accumulate into the gradient buffer
          for (int j = 0; j < n_in; ++j) {
            dw[static_cast<size_t>(k) * n_in + j] += dz * a[j];
            da[j] += w[static_cast<size_t>(k) * n_in + j] * dz;
          }
        }
      }
      FSDP_RETURN_IF_ERROR(rt->PostBackward(l));  // the gradient's reduction starts
      grad_out.swap(grad_in);
    }
    FSDP_RETURN_IF_ERROR(rt->FinishBackward());
    FSDP_ASSIGN_OR_RETURN(fsdp::StepStats stats, rt->Step(s.lr));

    if (step == 0) first_loss = loss;
    if (world.rank() == 0 &&
        (step == 0 || step == s.steps - 1 || (s.log_every > 0 && step % s.log_every == 0))) {
      std::printf("step %4d  loss %.7f  grad norm %.5f\n", step, loss, stats.grad_norm);
    }
  }
  if (world.rank() == 0) {
    std::printf("trained %d steps on %d rank%s (%s): loss %.7f -> %.7f\n", s.steps,
                world.size(), world.size() == 1 ? "" : "s",
                std::string(fsdp::StrategyName(rt->strategy())).c_str(), first_loss, loss);
    std::printf("memory per rank: %s\n", fsdp::FormatMemoryReport(rt->memory()).c_str());
  }
  return absl::OkStatus();
}

absl::StatusOr<Settings> SettingsFromFlags() {
  Settings s;
  s.ranks = absl::GetFlag(FLAGS_ranks);
  s.layers = absl::GetFlag(FLAGS_layers);
  s.in = absl::GetFlag(FLAGS_in);
  s.hidden = absl::GetFlag(FLAGS_hidden);
  s.out = absl::GetFlag(FLAGS_out);
  s.batch = absl::GetFlag(FLAGS_batch);
  s.steps = absl::GetFlag(FLAGS_steps);
  s.log_every = absl::GetFlag(FLAGS_log_every);
  s.lr = static_cast<float>(absl::GetFlag(FLAGS_lr));
  s.seed = absl::GetFlag(FLAGS_seed);
  if (s.ranks < 1 || s.ranks > 64) {
    return absl::InvalidArgumentError(absl::StrCat("--ranks=", s.ranks, ": use 1 to 64"));
  }
  for (auto [name, value] : {std::pair{"layers", s.layers}, {"in", s.in}, {"hidden", s.hidden},
                             {"out", s.out}, {"steps", s.steps}}) {
    if (value < 1 || value > 4096) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", name, "=", value, ": must be in [1, 4096]"));
    }
  }
  if (s.batch < 1 || s.batch % s.ranks != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--batch=", s.batch, ": must be a positive multiple of --ranks=", s.ranks));
  }
  if (!(s.lr > 0)) return absl::InvalidArgumentError("--lr must be > 0");
  FSDP_ASSIGN_OR_RETURN(s.sharding.strategy, fsdp::ParseStrategy(absl::GetFlag(FLAGS_strategy)));
  s.sharding.hybrid_shard_size = absl::GetFlag(FLAGS_hybrid_shard);
  const std::string optimizer = absl::GetFlag(FLAGS_optimizer);
  if (optimizer == "adamw") {
    s.sharding.optimizer = fsdp::OptimizerKind::kAdamW;
    s.sharding.adamw.weight_decay = 0.0f;
  } else if (optimizer == "sgd") {
    s.sharding.optimizer = fsdp::OptimizerKind::kSgd;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("--optimizer=", optimizer, ": use adamw or sgd"));
  }
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  absl::SetProgramUsageMessage(
      "Trains a stack of Linear+tanh layers written in this example through the sharding "
      "runtime's per-unit hooks, ranks as threads. Exit codes: 0 trained, 1 failed, 2 bad usage.");
  const std::vector<char*> positional = absl::ParseCommandLine(argc, argv);
  if (positional.size() > 1) {
    std::fprintf(stderr, "custom_layers: unexpected argument '%s': flags start with --\n",
                 positional[1]);
    return kExitUsage;
  }
  const absl::StatusOr<Settings> settings = SettingsFromFlags();
  if (!settings.ok()) {
    std::fprintf(stderr, "custom_layers: %s\n", std::string(settings.status().message()).c_str());
    return kExitUsage;
  }
  const absl::Status s = fsdp::LocalWorld::Run(
      settings->ranks, {}, [&](fsdp::Communicator& world) { return RunRank(world, *settings); });
  if (!s.ok()) {
    std::fprintf(stderr, "custom_layers: %s\n", s.ToString().c_str());
    return kExitFailure;
  }
  return 0;
}
