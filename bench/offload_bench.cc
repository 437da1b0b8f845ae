// Offload benchmark (ShardingOptions::offload): llama-mini, FULL_SHARD on 2 ranks as threads,
// each on a sim device (one kernel thread) whose link to the host runs at --host_gbps (PCIe 4
// x16: about 25 GB/s). Runs, interleaved step by step, with their median step times:
//   (a) the optimizer state on the device,
//   (b) every unit's optimizer state offloaded (AdamW on the host),
//   (c) offloaded by a budget of half of (b)'s host bytes (the largest units first),
//   (d) every unit's parameter and gradient shards and optimizer state offloaded (all: the
//       shards go up for each gather, each reduced gradient comes down to be added on the host);
// for (b) to (d) the host's update time per step, how long the step waited for it with the
// device idle (exposed), the overlap (the share of the host's update time the device was busy
// for) and the bytes moved. Then a device budget between the two peaks: (a) runs out of memory
// at once, (b) trains on it.
//
//   offload_bench [--steps N] [--host_gbps G] [--model NAME] [--check]
//
// --check: exit 1 unless (b) / (a) <= 1.3 and the budget case behaves as said.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "fsdp/local_world.h"
#include "fsdp/nn/data.h"
#include "fsdp/nn/sharded_model.h"
#include "fsdp/sim_backend.h"
#include "bench/timing.h"

namespace {

struct Params {
  int steps = 5;
  double host_gbps = 25;
  std::string model = "llama-mini";
  int seq = 128;  // min(128, the model's block size)
  bool check = false;
};

struct Config {
  const char* name;
  fsdp::OffloadOptions offload;
};

struct Outcome {
  std::vector<double> step_s;  // rank 0's step times after the warm-up, per config
  fsdp::MemoryReport memory;
  fsdp::OffloadStats stats;
  int64_t device_peak = 0;
  absl::Status status;
};

// Trains `steps` + 1 steps of every config; step s of each config runs before step s + 1 of
// any, so that the machine's noise falls on all alike. Each config has its own runtime.
std::vector<Outcome> Run(const Params& p, const std::vector<Config>& configs,
                         int64_t device_budget) {
  std::vector<Outcome> out(configs.size());
  const auto data = fsdp::nn::TokenDataset::FromText(fsdp::nn::EmbeddedCorpus());
  fsdp::CommOptions comm;
  comm.timeout = absl::Seconds(300);
  const absl::Status s = fsdp::LocalWorld::Run(2, comm, [&](fsdp::Communicator& world)
                                                            -> absl::Status {
    FSDP_ASSIGN_OR_RETURN(fsdp::nn::ModelConfig config, fsdp::nn::ModelConfig::FromName(p.model));
    struct Rank {
      std::unique_ptr<fsdp::SimBackend> backend;
      std::unique_ptr<fsdp::nn::ShardedModel> model;
      absl::Status status;
    };
    std::vector<Rank> ranks(configs.size());
    for (size_t c = 0; c < configs.size(); ++c) {
      fsdp::SimBackendOptions so;
      so.num_threads = 1;
      so.memory_limit_bytes = device_budget;
      so.host_copy_bytes_per_second = p.host_gbps * 1e9;
      FSDP_ASSIGN_OR_RETURN(ranks[c].backend, fsdp::SimBackend::Create(so));
      fsdp::nn::ShardedModelOptions o;
      o.sharding.strategy = fsdp::ShardingStrategy::kFullShard;
      o.sharding.max_grad_norm = 1.0f;
      o.sharding.offload = configs[c].offload;
      o.batch_size = 4;
      o.seq_len = p.seq;
      auto model = fsdp::nn::ShardedModel::Create(config, ranks[c].backend.get(), world, o);
      if (!model.ok()) {
        ranks[c].status = model.status();
        continue;
      }
      ranks[c].model = *std::move(model);
    }
    FSDP_ASSIGN_OR_RETURN(auto loader, fsdp::nn::DataLoader::Create(
        &data, {.batch_size = 4, .seq_len = p.seq, .rank = world.rank(),
                .world_size = world.size()}));
    for (int step = 0; step < 1 + p.steps; ++step) {
      const fsdp::nn::Batch b = loader.Next();
      for (size_t c = 0; c < configs.size(); ++c) {
        Rank& r = ranks[c];
        if (!r.status.ok()) continue;
        FSDP_RETURN_IF_ERROR(world.Barrier());
        const auto t0 = std::chrono::steady_clock::now();
        r.status = r.model->ForwardBackward(b.inputs.data(), b.targets.data()).status();
        if (r.status.ok()) r.status = r.model->Step(1e-4f).status();
        if (r.status.ok()) r.status = r.backend->Synchronize();
        const double dt =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        if (!r.status.ok()) return r.status;
        if (step >= 1 && world.rank() == 0) out[c].step_s.push_back(dt);
      }
    }
    if (world.rank() == 0) {
      for (size_t c = 0; c < configs.size(); ++c) {
        out[c].status = ranks[c].status;
        if (ranks[c].model == nullptr) continue;
        out[c].memory = ranks[c].model->memory();
        out[c].stats = ranks[c].model->runtime().offload_stats();
        out[c].device_peak = ranks[c].backend->memory_stats().peak_bytes;
      }
    }
    return absl::OkStatus();
  });
  if (!s.ok()) {
    for (Outcome& o : out) {
      if (o.status.ok()) o.status = s;
    }
  }
  return out;
}

using fsdp_bench::Median;

}  // namespace

int main(int argc, char** argv) {
  Params p;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--check")) {
      p.check = true;
      continue;
    }
    if (i + 1 >= argc) return 2;
    if (!std::strcmp(argv[i], "--steps")) p.steps = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--host_gbps")) p.host_gbps = std::atof(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--model")) p.model = argv[i + 1];
    else {
      std::fprintf(stderr, "usage: offload_bench [--steps N] [--host_gbps G] [--model NAME] "
                           "[--check]\n");
      return 2;
    }
    ++i;
  }
  if (p.steps < 1 || !(p.host_gbps > 0)) {
    std::fprintf(stderr, "offload_bench: --steps must be >= 1 and --host_gbps > 0\n");
    return 2;
  }
  const absl::StatusOr<fsdp::nn::ModelConfig> config = fsdp::nn::ModelConfig::FromName(p.model);
  if (!config.ok()) {
    std::fprintf(stderr, "offload_bench: --model: %s\n", config.status().ToString().c_str());
    return 2;
  }
  p.seq = std::min(128, config->block_size());
  std::printf("offload_bench: %s, FULL_SHARD on 2 ranks (threads, sim devices of 1 kernel "
              "thread), B=4 T=%d, clip 1.0, host link %.1f GB/s, %d steps after 1 warm-up "
              "(medians, configs interleaved)\n",
              p.model.c_str(), p.seq, p.host_gbps, p.steps);
  fsdp::OffloadOptions all;
  all.what = fsdp::OffloadKind::kOptimizer;
  // (c)'s budget: half of what offloading every unit takes (known once (b) has run: a first,
  // one-step probe sizes it).
  Params probe = p;
  probe.steps = 1;
  const std::vector<Outcome> sized = Run(probe, {{"probe", all}}, 0);
  if (!sized[0].status.ok()) {
    std::fprintf(stderr, "offload_bench: %s\n", sized[0].status.ToString().c_str());
    return 1;
  }
  fsdp::OffloadOptions half = all;
  half.budget_bytes = sized[0].memory.host_offload_bytes / 2;
  fsdp::OffloadOptions shards = all;
  shards.what = fsdp::OffloadKind::kAll;
  const std::vector<Config> configs = {
      {"(a) optimizer state on the device", {}},
      {"(b) offload: every unit", all},
      {"(c) offload: budget of half", half},
      {"(d) offload all: every unit", shards}};
  const std::vector<Outcome> r = Run(p, configs, 0);
  for (const Outcome& o : r) {
    if (!o.status.ok()) {
      std::fprintf(stderr, "offload_bench: %s\n", o.status.ToString().c_str());
      return 1;
    }
  }
  const double base = Median(r[0].step_s);
  std::printf("%-36s %8s %6s %7s %9s %9s %9s %8s %10s %10s\n", "run", "step ms", "ratio",
              "units", "host MiB", "upd ms", "exp ms", "overlap", "dev MiB", "MiB moved");
  for (size_t c = 0; c < configs.size(); ++c) {
    const Outcome& o = r[c];
    const double n = static_cast<double>(p.steps + 1);
    std::printf("%-36s %8.1f %6.3f %7d %9.1f %9.1f %9.1f %7.0f%% %10.1f %10.1f\n",
                configs[c].name, Median(o.step_s) * 1e3, Median(o.step_s) / base,
                o.memory.offloaded_units, o.memory.host_offload_bytes / 1048576.0,
                o.stats.host_update_seconds / n * 1e3, o.stats.exposed_seconds / n * 1e3,
                100 * o.stats.overlap(), o.device_peak / 1048576.0,
                (o.stats.bytes_to_host + o.stats.bytes_to_device) / n / 1048576.0);
  }
  std::printf("(upd: the host's AdamW per step; exp: the part of it the step waited for with "
              "the device idle; overlap: 1 - exp / upd; dev: the device's peak; moved: per "
              "step)\n");

  // A device between the two peaks: without offload it runs out of memory, with it it trains.
  const int64_t budget = (r[0].device_peak + r[1].device_peak) / 2;
  Params one = p;
  one.steps = 2;
  // (Separately: a rank that runs out of memory stops its world.)
  const std::vector<Outcome> tight = {Run(one, {{"without offload", {}}}, budget)[0],
                                      Run(one, {{"with offload", all}}, budget)[0]};
  std::printf("device budget %.1f MiB: without offload: %s\n", budget / 1048576.0,
              tight[0].status.ok() ? "trained" : tight[0].status.ToString().c_str());
  std::printf("device budget %.1f MiB: with offload: %s (device peak %.1f MiB)\n",
              budget / 1048576.0,
              tight[1].status.ok() ? "trained" : tight[1].status.ToString().c_str(),
              tight[1].device_peak / 1048576.0);
  if (!p.check) return 0;
  bool ok = true;
  const double ratio = Median(r[1].step_s) / base;
  std::printf("check: (b)/(a) = %.3f <= 1.30: %s\n", ratio, ratio <= 1.3 ? "PASS" : "FAIL");
  ok = ok && ratio <= 1.3;
  const bool fits = !tight[0].status.ok() && tight[1].status.ok();
  std::printf("check: the budget stops (a) and not (b): %s\n", fits ? "PASS" : "FAIL");
  ok = ok && fits;
  return ok ? 0 : 1;
}
