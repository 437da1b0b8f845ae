// Soak: a long FULL_SHARD run with prefetch (default 2,000 steps of nano on 4 ranks as
// threads), twice with the same seed. Prints the process's resident memory after warm-up and
// at the end of each run (its growth is what a leak or a cache that never stops growing
// would show), the backend bytes in use per rank at the end (back to the persistent shards
// between steps), and whether the two runs' losses and parameters are bitwise equal. Build it
// with -DFSDP_SANITIZE=address to run it under LeakSanitizer.
//
//   soak_bench [--steps 2000] [--ranks 4] [--warmup 100] [--check]
//
// --check exits 1 when the two runs differ, the resident memory grew by more than 8 MiB after
// warm-up, or a rank holds more than its persistent bytes between steps.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "fsdp/backend.h"
#include "fsdp/cpu_backend.h"
#include "fsdp/local_world.h"
#include "fsdp/nn/data.h"
#include "fsdp/nn/sharded_gpt.h"

namespace {

struct Args {
  int steps = 2000, ranks = 4, warmup = 100;
  bool check = false;
};

// Resident set size of this process, in bytes (/proc/self/statm).
int64_t ResidentBytes() {
  std::ifstream f("/proc/self/statm");
  int64_t size = 0, resident = 0;
  f >> size >> resident;
  return resident * sysconf(_SC_PAGESIZE);
}

struct RunResult {
  std::vector<float> losses;
  std::vector<std::vector<float>> params;
  int64_t rss_after_warmup = 0, rss_end = 0;
  std::vector<int64_t> in_use_end, persistent;  // per rank, backend bytes between steps
};

RunResult Run(const Args& a) {
  RunResult r;
  r.in_use_end.resize(a.ranks);
  r.persistent.resize(a.ranks);
  const auto data = fsdp::nn::TokenDataset::FromText(fsdp::nn::EmbeddedCorpus());
  const fsdp::nn::GptConfig config = *fsdp::nn::GptConfig::FromName("nano");
  absl::Status s = fsdp::LocalWorld::Run(a.ranks, {}, [&](fsdp::Communicator& world) -> absl::Status {
    FSDP_ASSIGN_OR_RETURN(auto backend,
                          fsdp::CpuBackend::Create({.ranks_sharing_cores = world.size()}));
    backend->BindCurrentThread();
    fsdp::nn::ShardedGptOptions o;
    o.sharding.max_grad_norm = 1.0f;
    o.batch_size = 4;
    o.seq_len = 64;
    FSDP_ASSIGN_OR_RETURN(auto model, fsdp::nn::ShardedGpt::Create(config, backend.get(), world, o));
    FSDP_ASSIGN_OR_RETURN(auto loader, fsdp::nn::DataLoader::Create(
        &data, {.batch_size = 4, .seq_len = 64, .rank = world.rank(), .world_size = world.size(),
                .seed = 3}));
    for (int step = 0; step < a.steps; ++step) {
      const fsdp::nn::Batch b = loader.Next();
      FSDP_ASSIGN_OR_RETURN(float loss, model->ForwardBackward(b.inputs.data(), b.targets.data()));
      FSDP_RETURN_IF_ERROR(model->Step(1e-3f).status());
      FSDP_ASSIGN_OR_RETURN(float mean, model->MeanOverRanks(loss));
      if (world.rank() == 0) {
        r.losses.push_back(mean);
        if (step + 1 == a.warmup) r.rss_after_warmup = ResidentBytes();
        if ((step + 1) % 500 == 0) {
          std::printf("  step %5d | loss %.4f | resident %.1f MiB\n", step + 1, mean,
                      ResidentBytes() / 1048576.0);
        }
      }
    }
    FSDP_RETURN_IF_ERROR(world.Barrier());
    if (world.rank() == 0) r.rss_end = ResidentBytes();
    const fsdp::MemoryReport m = model->memory();
    r.in_use_end[world.rank()] = backend->memory_stats().bytes_in_use;
    r.persistent[world.rank()] = m.persistent_bytes() + m.activation_peak_bytes;
    FSDP_ASSIGN_OR_RETURN(auto params, model->GatherModelUnits());
    if (world.rank() == 0) r.params = std::move(params);
    return absl::OkStatus();
  });
  if (!s.ok()) {
    std::fprintf(stderr, "soak_bench: %s\n", s.ToString().c_str());
    std::exit(1);
  }
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (k == "--check") {
      a.check = true;
    } else if (i + 1 < argc && (k == "--steps" || k == "--ranks" || k == "--warmup")) {
      const int v = std::atoi(argv[++i]);
      (k == "--steps" ? a.steps : k == "--ranks" ? a.ranks : a.warmup) = v;
    } else {
      std::fprintf(stderr, "usage: soak_bench [--steps 2000] [--ranks 4] [--warmup 100] [--check]\n");
      return 2;
    }
  }
  if (a.steps < 1 || a.ranks < 1 || a.warmup < 1 || a.warmup >= a.steps) {
    std::fprintf(stderr, "soak_bench: need steps > warmup >= 1 and ranks >= 1\n");
    return 2;
  }
  std::printf("soak_bench: nano, FULL_SHARD with prefetch, %d ranks as threads, %d steps, twice\n",
              a.ranks, a.steps);
  std::vector<RunResult> runs;
  for (int i = 0; i < 2; ++i) {
    std::printf("run %d\n", i + 1);
    runs.push_back(Run(a));
  }
  bool ok = true;
  for (int i = 0; i < 2; ++i) {
    const RunResult& r = runs[i];
    const double growth = (r.rss_end - r.rss_after_warmup) / 1048576.0;
    std::printf("run %d: resident %.1f MiB after %d steps, %.1f MiB at the end: growth %+.2f MiB\n",
                i + 1, r.rss_after_warmup / 1048576.0, a.warmup, r.rss_end / 1048576.0, growth);
    if (growth > 8.0) ok = false;
    for (int k = 0; k < a.ranks; ++k) {
      if (r.in_use_end[k] != r.persistent[k]) {
        std::printf("  rank %d holds %lld bytes between steps, its shards and activations are %lld\n",
                    k, static_cast<long long>(r.in_use_end[k]),
                    static_cast<long long>(r.persistent[k]));
        ok = false;
      }
    }
  }
  const bool same = runs[0].losses == runs[1].losses && runs[0].params == runs[1].params;
  std::printf("the two runs are %s (losses of %zu steps and every parameter)\n",
              same ? "bitwise equal" : "DIFFERENT", runs[0].losses.size());
  std::printf("loss %.4f -> %.4f\n", runs[0].losses.front(), runs[0].losses.back());
  ok = ok && same;
  if (a.check) {
    std::printf("check: %s (bitwise equal runs, resident growth <= 8 MiB, nothing held between "
                "steps)\n", ok ? "PASS" : "FAIL");
    return ok ? 0 : 1;
  }
  return 0;
}
