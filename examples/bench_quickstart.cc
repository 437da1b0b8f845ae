// A benchmark harness in a few lines: fsdp::RunBench (fsdp/bench.h) measures training steps of
// a bundled model under one sharding configuration and returns the figures as a struct.
// Here: the nano GPT, FULL_SHARD, on 1 and 2 ranks (threads, one core each), then the
// weak-scaling efficiency of the pair.
//
//   bench_quickstart [model] [steps]      (default: nano 5)
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "fsdp/bench.h"
#include "fsdp/bench_report.h"

int main(int argc, char** argv) {
  fsdp::BenchConfig config;
  config.model = argc > 1 ? argv[1] : "nano";
  config.steps = argc > 2 ? std::atoi(argv[2]) : 5;
  config.strategy = fsdp::ShardingStrategy::kFullShard;
  config.batch_size = 4;  // per rank: the global batch grows with the world (weak scaling)
  config.seq_len = 64;
  config.threads_per_rank = 1;  // the same cores per rank in both runs

  std::vector<fsdp::BenchResult> results;
  for (int world : {1, 2}) {
    config.world_size = world;
    absl::StatusOr<fsdp::BenchResult> r = fsdp::RunBench(config);
    if (!r.ok()) {
      std::fprintf(stderr, "bench_quickstart: %s\n", r.status().ToString().c_str());
      return 1;
    }
    results.push_back(*std::move(r));
  }
  fsdp::SetScalingEfficiency(results);  // tokens/s at N / (N x tokens/s at 1 rank)

  for (const fsdp::BenchResult& r : results) {
    std::printf("%s %s %d rank(s): %.0f tokens/s, step %.1f ms (p10 %.1f, p90 %.1f), "
                "MFU %.2f%%, exposed communication %.1f%%, peak memory %.2f MiB/rank, "
                "%.2f MiB sent/rank/step, efficiency %.3f\n",
                r.model.c_str(), r.strategy.c_str(), r.world_size, r.tokens_per_s,
                r.step_median_s * 1e3, r.step_p10_s * 1e3, r.step_p90_s * 1e3, 100 * r.mfu,
                100 * r.exposed_comm_fraction, r.memory.peak_bytes / 1048576.0,
                r.bus_bytes_per_rank / 1048576.0, r.scaling_efficiency);
  }
  std::printf("%s\n", fsdp::BenchResultJson(results.back()).c_str());
  return 0;
}
