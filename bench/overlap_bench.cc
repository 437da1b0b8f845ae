// Overlap benchmark: FULL_SHARD training steps of a GPT on 2 ranks (threads, one core each)
// over the local communicator's simulated link, set so that one step's communication takes
// about half of its compute. Prints the median step time of
//   (a) the link off (communication nearly free: shared-memory copies only),
//   (b) the link on with forward/backward prefetch, and
//   (c) the link on without prefetch,
// the ratios b/a and c/a, and the exposed communication per step measured from the timeline
// (time the compute thread spent blocked on collectives).
//
//   overlap_bench [--steps N] [--layers L] [--comm_fraction F] [--backend cpu|sim]
//                 [--op_latency_us U] [--trace FILE] [--check]
//
// --backend sim: the ranks run on the strict simulated accelerator (backends/sim): every op is
// issued to the device's compute stream and every collective to its communication stream,
// each taking at least U microseconds (--op_latency_us, default 50), and the simulated link is
// the sim data plane's. Streams and events, not the host, order the work.
// --trace FILE: writes the timeline of the prefetch run (b) as Chrome trace JSON (Perfetto).
// --steps N: timed steps per run (default 16; each run adds 2 warm-up steps; there are 5 runs:
// link off, 3 calibration runs without prefetch, the run with prefetch). Fewer steps give a
// shorter run (for CI) and a noisier median.
// --check: exit 1 unless prefetch hides the communication, i.e. (b)/(a) <= kPrefetchTarget
// (1.10), and the run without prefetch is clearly slower, (c)/(a) >= kNoPrefetchMin (1.2);
// below that the link calibration failed and the comparison means nothing. It prints what it
// checks and PASS or FAIL per check. Without --check the exit status is 0 whatever the ratios
// (1 on an error in the run, 2 for bad flags).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "fsdp/backend.h"
#include "fsdp/cpu_backend.h"
#include "fsdp/local_world.h"
#include "fsdp/nn/data.h"
#include "fsdp/nn/sharded_gpt.h"
#include "fsdp/registry.h"
#include "fsdp/trace.h"

namespace {

struct Result {
  double step_s = 0;       // median step time
  double exposed_s = 0;    // exposed communication per step (rank 0)
  double comm_busy_s = 0;  // union of rank 0's comm spans per step (incl. waiting for peers)
};

struct Params {
  int steps = 16, layers = 8, ranks = 2;
  double comm_fraction = 0.5;
  bool check = false;
  std::string backend = "cpu";
  int op_latency_us = 50;
  std::string trace;
};

// --check: the prefetch run may be at most this much slower than the communication-free step,
constexpr double kPrefetchTarget = 1.10;
// and the run without prefetch must be at least this much slower (else the link calibration
// failed: the communication is not long enough for the comparison to mean anything).
constexpr double kNoPrefetchMin = 1.2;

int Usage() {
  std::fprintf(stderr, "usage: overlap_bench [--steps N] [--layers L] [--comm_fraction F] "
                       "[--backend cpu|sim] [--op_latency_us U] [--trace FILE] [--check]\n");
  return 2;
}

// The rank's backend: the CPU, or a sim device whose data plane carries the simulated link.
absl::StatusOr<std::unique_ptr<fsdp::Backend>> MakeBackend(const Params& p, double link) {
  fsdp::BackendOptions o = {{"threads", "1"}};
  if (p.backend == "sim") {
    o["op_latency_us"] = absl::StrCat(p.op_latency_us);
    o["link_bytes_per_second"] = absl::StrCat(link);
  }
  return fsdp::CreateBackend(p.backend, o);
}

Result Run(const Params& p, double link_bytes_per_second, bool prefetch, bool write_trace) {
  const bool sim = p.backend == "sim";
  fsdp::nn::GptConfig config = *fsdp::nn::GptConfig::FromName("nano");
  config.num_layers = p.layers;
  config.channels = 256;
  config.num_heads = 4;
  config.block_size = 128;
  fsdp::CommOptions comm;
  // On the CPU the host communicator is the data plane; on sim it carries only control data.
  comm.link_bytes_per_second = sim ? 0 : link_bytes_per_second;
  const auto data = fsdp::nn::TokenDataset::FromText(fsdp::nn::EmbeddedCorpus());
  std::vector<double> times;
  Result r;
  fsdp::Tracer& tracer = fsdp::Tracer::Global();
  absl::Status s = fsdp::LocalWorld::Run(p.ranks, comm, [&](fsdp::Communicator& world) {
    FSDP_ASSIGN_OR_RETURN(auto backend, MakeBackend(p, link_bytes_per_second));
    fsdp::nn::ShardedGptOptions o;
    o.sharding.strategy = fsdp::ShardingStrategy::kFullShard;
    o.sharding.forward_prefetch = o.sharding.backward_prefetch = prefetch;
    o.batch_size = 4;
    o.seq_len = 128;
    FSDP_ASSIGN_OR_RETURN(auto model, fsdp::nn::ShardedGpt::Create(config, backend.get(), world, o));
    FSDP_ASSIGN_OR_RETURN(auto loader, fsdp::nn::DataLoader::Create(
        &data, {.batch_size = 4, .seq_len = 128, .rank = world.rank(),
                .world_size = world.size()}));
    const int warmup = 2;
    for (int step = 0; step < warmup + p.steps; ++step) {
      FSDP_RETURN_IF_ERROR(world.Barrier());
      if (step == warmup && world.rank() == 0) {
        tracer.Clear();
        tracer.Enable();
      }
      FSDP_RETURN_IF_ERROR(world.Barrier());
      const auto t0 = std::chrono::steady_clock::now();
      const fsdp::nn::Batch b = loader.Next();
      FSDP_RETURN_IF_ERROR(model->ForwardBackward(b.inputs.data(), b.targets.data()).status());
      FSDP_RETURN_IF_ERROR(model->Step(1e-4f).status());
      const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (step >= warmup && world.rank() == 0) times.push_back(dt);
    }
    FSDP_RETURN_IF_ERROR(world.Barrier());
    if (world.rank() == 0) tracer.Disable();
    return absl::OkStatus();
  });
  if (!s.ok()) {
    std::fprintf(stderr, "overlap_bench: %s\n", s.ToString().c_str());
    std::exit(1);
  }
  std::sort(times.begin(), times.end());
  r.step_s = times[times.size() / 2];
  const std::vector<fsdp::Span> spans = tracer.Snapshot();
  r.exposed_s = fsdp::ExposedNs(spans, 0) * 1e-9 / p.steps;
  r.comm_busy_s =
      fsdp::UnionNs(spans, 0, sim ? fsdp::kDeviceCommStream : fsdp::kCommStream) * 1e-9 /
      p.steps;
  if (write_trace && !p.trace.empty()) {
    const absl::Status w = tracer.WriteChromeTrace(p.trace);
    if (!w.ok()) {
      std::fprintf(stderr, "overlap_bench: %s\n", w.ToString().c_str());
      std::exit(1);
    }
    std::printf("timeline of run (b): %s\n", p.trace.c_str());
  }
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  const auto start = std::chrono::steady_clock::now();
  Params p;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--check")) {
      p.check = true;
      continue;
    }
    if (i + 1 >= argc) return Usage();
    if (!std::strcmp(argv[i], "--steps")) p.steps = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--layers")) p.layers = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--comm_fraction")) p.comm_fraction = std::atof(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--backend")) p.backend = argv[i + 1];
    else if (!std::strcmp(argv[i], "--op_latency_us")) p.op_latency_us = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--trace")) p.trace = argv[i + 1];
    else return Usage();
    ++i;
  }
  if (p.steps < 1 || p.layers < 1 || !(p.comm_fraction > 0) || p.op_latency_us < 0 ||
      (p.backend != "cpu" && p.backend != "sim")) {
    return Usage();
  }
  std::printf("overlap_bench: FULL_SHARD, %d ranks x 1 thread, GPT L=%d C=256 H=4 T=128, "
              "batch 4 per rank, %d steps (median), backend %s", p.ranks, p.layers, p.steps,
              p.backend.c_str());
  if (p.backend == "sim") std::printf(" (op latency %d us)", p.op_latency_us);
  std::printf("\n");
  const Result off = Run(p, 0, true, false);
  // Calibrate the link so that a step's communication (the time compute waits for it in
  // the run without prefetch, less what it waits with the link off) is comm_fraction of the
  // communication-free step: transfer time scales with 1 / bandwidth.
  double bw = 1e9;
  Result without;
  for (int round = 0; round < 3; ++round) {
    without = Run(p, bw, false, false);
    if (round == 2) break;
    const double comm = std::max(1e-4, without.exposed_s - off.exposed_s);
    // At most 10x per round: one noisy measurement must not make the link absurdly slow.
    bw *= std::clamp(comm / (p.comm_fraction * off.step_s), 0.1, 10.0);
  }
  const Result with = Run(p, bw, true, true);
  std::printf("simulated link: %.3f GB/s (communication ~%.0f%% of compute)\n", bw / 1e9,
              100 * p.comm_fraction);
  std::printf("%-34s %10s %8s %14s %14s\n", "run", "step ms", "ratio", "exposed ms/step",
              "comm spans ms/step");
  auto row = [&](const char* name, const Result& r) {
    std::printf("%-34s %10.1f %8.3f %14.1f %14.1f\n", name, r.step_s * 1e3,
                r.step_s / off.step_s, r.exposed_s * 1e3, r.comm_busy_s * 1e3);
  };
  row("(a) link off", off);
  row("(b) link on, prefetch", with);
  row("(c) link on, no prefetch", without);
  const double with_ratio = with.step_s / off.step_s, without_ratio = without.step_s / off.step_s;
  std::printf("prefetch: %.3fx of the communication-free step (target <= %.2f); "
              "no prefetch: %.3fx (expected ~1.5)\n",
              with_ratio, kPrefetchTarget, without_ratio);
  const double elapsed =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("overlap_bench: %.1f s in all\n", elapsed);
  if (!p.check) return 0;
  // The calibration first: without a clearly slower no-prefetch run, the prefetch ratio says
  // nothing about overlap.
  const bool calibrated = without_ratio >= kNoPrefetchMin;
  const bool hidden = with_ratio <= kPrefetchTarget;
  std::printf("check: no prefetch (c)/(a) = %.3f >= %.2f (the link makes communication "
              "matter): %s\n",
              without_ratio, kNoPrefetchMin, calibrated ? "PASS" : "FAIL");
  std::printf("check: prefetch (b)/(a) = %.3f <= %.2f (prefetch hides the communication): %s\n",
              with_ratio, kPrefetchTarget, hidden ? "PASS" : "FAIL");
  std::printf("check: %s\n", calibrated && hidden ? "PASS" : "FAIL");
  std::fflush(stdout);
  if (!calibrated || !hidden) {
    if (!calibrated) {
      std::fprintf(stderr, "overlap_bench: FAIL: --check: the run without prefetch is not clearly "
                           "slower (%.3fx < %.2fx): the link calibration failed and the comparison "
                           "is meaningless\n", without_ratio, kNoPrefetchMin);
    }
    if (!hidden) {
      std::fprintf(stderr, "overlap_bench: FAIL: --check: prefetch did not hide the communication "
                           "(%.3fx > %.2fx)\n", with_ratio, kPrefetchTarget);
    }
    return 1;
  }
  return 0;
}
