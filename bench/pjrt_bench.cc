// PJRT benchmark: what running through a PJRT plugin costs next to the CPU backend.
//
//   pjrt_bench [--plugin PATH] [--models nano,mini] [--ranks N] [--steps S] [--launches K]
//              [--max_fused_ops M] [--profile N] [--xla_options NAME=true|false,...]
//
// 1. Per-launch overhead: K launches of the smallest op (Scale of one f32) on one device,
//    (a) each waited for (issue, run, event: the latency a dependent op sees) and (b) issued
//    back to back and waited for once (the rate of a stream: a launch per op with a program
//    per op, "pjrt per-op"; the K ops as programs of up to --max_fused_ops ops, "pjrt fused",
//    compiled before the timed run), in an allocation of 4 KiB and of
//    64 MiB (an op writes into its allocation's buffer, donated to the program: if the plugin
//    copied the buffer instead, the 64 MiB row would show it). The CPU backend's rows are the
//    same ops on the host.
// 2. Per model: FULL_SHARD training on N ranks as threads (a device of the plugin each, or the
//    CPU backend), batch 4 x 64 per rank: the first step (it compiles every program of the
//    model: the client's compile count and seconds are printed), then the median of S steps,
//    and the ratio pjrt / cpu; with the ops of a stream fused into programs (the default) and
//    with a program per op (fuse_ops = false), and the launches per step of rank 0: programs
//    of every kind, op programs, the programs of a ForwardBackward per unit (counted in one more
//    step, both streams waited for after its ForwardBackward and after its Step: "launches A +
//    B" at the end of the row), and launches of programs
//    that took an allocation as bytes (ui8 args: 0 when every allocation is a typed array), and
//    the largest temporary memory XLA gave one of the programs (temp MiB; -1 where the plugin
//    does not say): a whole-array copy of an update in place shows there.
// 3. With --profile N: per model, a run with a program per op and one with fused programs
//    where each launch waits for its program (PjrtBackendOptions::profile; a stream's programs
//    no longer overlap), and the N programs of rank 0 that took the most time per step:
//    launches per step, ms per step, us per launch (the fused run: what a step launches).
// --xla_options: XLA debug options of every program of the pjrt runs (PjrtBackendOptions::
// xla_options), e.g. xla_cpu_copy_insertion_use_region_analysis=false to see what the backend's
// default saves.
// The plugin is --plugin or $FSDP_PJRT_PLUGIN. Exit status 1 on an error, 2 on bad flags.
#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "fsdp/pjrt_backend.h"
#include "fsdp/backend.h"
#include "fsdp/cpu_backend.h"
#include "fsdp/local_world.h"
#include "fsdp/nn/data.h"
#include "fsdp/nn/sharded_model.h"
#include "fsdp/ops.h"
#include "bench/timing.h"

namespace {

using fsdp_bench::Clock;
using fsdp_bench::Median;
using fsdp_bench::Seconds;

struct Params {
  std::string plugin;
  std::vector<std::string> models = {"nano", "mini"};
  int ranks = 2, steps = 5, launches = 200;
  int max_fused_ops = fsdp::PjrtBackendOptions{}.max_fused_ops;
  int profile = 0;  // programs to list per model (0: no profile run)
  std::vector<std::pair<std::string, bool>> xla_options;
};

[[noreturn]] void Usage(const std::string& why) {
  std::fprintf(stderr,
               "pjrt_bench: %s\nusage: pjrt_bench [--plugin PATH] [--models nano,mini] "
               "[--ranks N] [--steps S] [--launches K] [--max_fused_ops M] [--profile N]\n"
               "       [--xla_options NAME=true|false,...]\n",
               why.c_str());
  std::exit(2);
}

Params Parse(int argc, char** argv) {
  Params p;
  const char* env = std::getenv("FSDP_PJRT_PLUGIN");
  if (env != nullptr) p.plugin = env;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help") Usage("help");
    if (i + 1 >= argc) Usage("flag " + a + " needs a value");
    const std::string v = argv[++i];
    auto count = [&](int lo, int hi) {
      int x = 0;
      if (!absl::SimpleAtoi(v, &x) || x < lo || x > hi) {
        Usage(a + "=" + v + ": allowed " + std::to_string(lo) + " to " + std::to_string(hi));
      }
      return x;
    };
    if (a == "--plugin") {
      p.plugin = v;
    } else if (a == "--models") {
      p.models = absl::StrSplit(v, ',', absl::SkipEmpty());
    } else if (a == "--ranks") {
      p.ranks = count(1, 8);
    } else if (a == "--steps") {
      p.steps = count(1, 1000);
    } else if (a == "--launches") {
      p.launches = count(1, 100000);
    } else if (a == "--max_fused_ops") {
      p.max_fused_ops = count(1, 1000000);
    } else if (a == "--profile") {
      p.profile = count(0, 1000);
    } else if (a == "--xla_options") {
      const std::vector<std::string> options = absl::StrSplit(v, ',', absl::SkipEmpty());
      for (const std::string& o : options) {
        const std::vector<std::string> kv = absl::StrSplit(o, '=');
        if (kv.size() != 2 || kv[0].empty() || (kv[1] != "true" && kv[1] != "false")) {
          Usage("--xla_options " + o + ": want NAME=true or NAME=false");
        }
        p.xla_options.emplace_back(kv[0], kv[1] == "true");
      }
    } else {
      Usage("unknown flag " + a);
    }
  }
  if (p.plugin.empty()) Usage("no plugin: --plugin PATH or $FSDP_PJRT_PLUGIN");
  return p;
}

void Check(const absl::Status& s, const char* what) {
  if (!s.ok()) {
    std::fprintf(stderr, "pjrt_bench: %s: %s\n", what, s.ToString().c_str());
    std::exit(1);
  }
}
template <typename T>
T Check(absl::StatusOr<T> v, const char* what) {
  Check(v.status(), what);
  return *std::move(v);
}

// Microseconds per launch: (waited each, back to back).
std::pair<double, double> LaunchCost(fsdp::Backend* b, size_t bytes, int launches) {
  fsdp::Buffer buf = Check(fsdp::Buffer::Create(b, bytes), "allocate");
  const fsdp::View one = buf.view(fsdp::DType::kF32).Slice(0, 1);
  const float x = 1.0f;
  Check(b->CopyFromHost(one, &x), "copy");
  for (int i = 0; i < 3; ++i) b->ops().Scale(fsdp::Stream::kCompute, one, 1.0f);  // compiles
  Check(b->Record(fsdp::Stream::kCompute).Wait(), "warm-up");
  std::vector<double> each;
  for (int i = 0; i < launches; ++i) {
    const auto t0 = Clock::now();
    b->ops().Scale(fsdp::Stream::kCompute, one, 1.0f);
    Check(b->Record(fsdp::Stream::kCompute).Wait(), "launch");
    each.push_back(Seconds(t0, Clock::now()));
  }
  // Back to back: once to compile what a fused backend makes of them, then timed.
  for (int i = 0; i < launches; ++i) b->ops().Scale(fsdp::Stream::kCompute, one, 1.0f);
  Check(b->Record(fsdp::Stream::kCompute).Wait(), "launches");
  const auto t0 = Clock::now();
  for (int i = 0; i < launches; ++i) b->ops().Scale(fsdp::Stream::kCompute, one, 1.0f);
  Check(b->Record(fsdp::Stream::kCompute).Wait(), "launches");
  return {Median(each) * 1e6, Seconds(t0, Clock::now()) / launches * 1e6};
}

// Microseconds per MatmulForward out[M,N] = inp[M,K] . w[N,K]^T + b (waited each, median):
// the weight a view inside a larger flat buffer, as a gathered unit's is.
double MatmulCost(fsdp::Backend* b, int64_t M, int64_t K, int64_t N, int launches) {
  auto make = [&](int64_t n) { return Check(fsdp::Buffer::Create(b, n * 4), "allocate"); };
  fsdp::Buffer inp = make(M * K), out = make(M * N), unit = make(4 * N * K + N);
  std::vector<float> ones(static_cast<size_t>(std::max(4 * N * K + N, M * K)), 0.01f);
  Check(b->CopyFromHost(unit.view(), ones.data()), "copy");
  Check(b->CopyFromHost(inp.view(), ones.data()), "copy");
  const fsdp::View w = unit.view().Slice(N * K, N * K), bias = unit.view().Slice(4 * N * K, N);
  std::vector<double> each;
  for (int i = 0; i < launches + 3; ++i) {
    const auto t0 = Clock::now();
    b->ops().MatmulForward(fsdp::Stream::kCompute, out.view(), inp.view(), w, bias, M, K, N);
    Check(b->Record(fsdp::Stream::kCompute).Wait(), "matmul");
    if (i >= 3) each.push_back(Seconds(t0, Clock::now()));
  }
  return Median(each) * 1e6;
}

struct ModelRun {
  double first_s = 0, step_s = 0;
  int64_t compiles = 0;
  double compile_s = 0;
  float loss = 0;
  double programs = 0, op_programs = 0, ops = 0;  // per step (rank 0, after the first)
  double byte_launches = 0;  // per step: launches with an allocation held as bytes (ui8)
  // One more step after the timed ones, both streams waited for after its ForwardBackward:
  // the launches of the micro-batch (forward, backward, their collectives) and of Step().
  int64_t micro_batch_programs = 0, step_programs = 0;
  std::map<std::string, fsdp::PjrtLaunchStats::Time> profile;  // per step (rank 0)
  int64_t temp_bytes = -1;  // the largest temporary memory of a program (rank 0)
};

ModelRun Train(const Params& p, const std::string& model,
               const std::shared_ptr<fsdp::pjrt::Client>& client, bool fuse = true,
               bool profile = false) {
  const auto config = Check(fsdp::nn::ModelConfig::FromName(model), "model");
  const auto data = fsdp::nn::TokenDataset::FromText(fsdp::nn::EmbeddedCorpus());
  ModelRun r;
  std::vector<double> times;
  const int64_t compiles0 = client ? client->compile_count() : 0;
  const double compile0 = client ? client->compile_seconds() : 0;
  const int threads = std::max(1, fsdp::HardwareThreads() / p.ranks);
  Check(fsdp::LocalWorld::Run(p.ranks, {}, [&](fsdp::Communicator& world) -> absl::Status {
          std::unique_ptr<fsdp::Backend> backend;
          if (client) {
            fsdp::PjrtBackendOptions bo;
            bo.fuse_ops = fuse;
            bo.max_fused_ops = p.max_fused_ops;
            bo.profile = profile;
            bo.xla_options = p.xla_options;
            FSDP_ASSIGN_OR_RETURN(backend, fsdp::PjrtBackend::Create(client, world.rank(), bo));
          } else {
            FSDP_ASSIGN_OR_RETURN(auto cpu, fsdp::CpuBackend::Create({.num_threads = threads}));
            cpu->BindCurrentThread();
            backend = std::move(cpu);
          }
          fsdp::nn::ShardedModelOptions o;
          o.sharding.strategy = fsdp::ShardingStrategy::kFullShard;
          o.batch_size = 4;
          o.seq_len = 64;
          FSDP_ASSIGN_OR_RETURN(auto m,
                                fsdp::nn::ShardedModel::Create(config, backend.get(), world, o));
          FSDP_ASSIGN_OR_RETURN(auto loader,
                                fsdp::nn::DataLoader::Create(
                                    &data, {.batch_size = 4, .seq_len = 64,
                                            .rank = world.rank(), .world_size = world.size()}));
          auto* pj = dynamic_cast<fsdp::PjrtBackend*>(backend.get());
          fsdp::PjrtLaunchStats after_first;
          for (int step = 0; step <= p.steps; ++step) {
            FSDP_RETURN_IF_ERROR(world.Barrier());
            if (step == 1 && pj != nullptr) after_first = pj->launch_stats();
            const auto t0 = Clock::now();
            const fsdp::nn::Batch b = loader.Next();
            FSDP_ASSIGN_OR_RETURN(float loss, m->ForwardBackward(b.inputs.data(), b.targets.data()));
            FSDP_RETURN_IF_ERROR(m->Step(1e-3f).status());
            FSDP_RETURN_IF_ERROR(world.Barrier());
            const double dt = Seconds(t0, Clock::now());
            if (world.rank() == 0) {
              if (step == 0) {
                r.first_s = dt;
              } else {
                times.push_back(dt);
              }
              r.loss = loss;
            }
          }
          // Every item of both streams has run: the counts are final.
          auto settled = [&]() -> absl::StatusOr<fsdp::PjrtLaunchStats> {
            FSDP_RETURN_IF_ERROR(backend->Record(fsdp::Stream::kCompute).Wait());
            FSDP_RETURN_IF_ERROR(backend->Record(fsdp::Stream::kComm).Wait());
            return pj->launch_stats();
          };
          fsdp::PjrtLaunchStats end;
          if (pj != nullptr && p.steps > 0) {
            FSDP_ASSIGN_OR_RETURN(end, settled());
            const fsdp::nn::Batch b = loader.Next();
            FSDP_RETURN_IF_ERROR(m->ForwardBackward(b.inputs.data(), b.targets.data()).status());
            FSDP_ASSIGN_OR_RETURN(const fsdp::PjrtLaunchStats fb, settled());
            FSDP_RETURN_IF_ERROR(m->Step(1e-3f).status());
            FSDP_ASSIGN_OR_RETURN(const fsdp::PjrtLaunchStats st, settled());
            if (world.rank() == 0) {
              r.micro_batch_programs = fb.programs - end.programs;
              r.step_programs = st.programs - fb.programs;
            }
          }
          if (pj != nullptr && world.rank() == 0 && p.steps > 0) {
            r.programs = static_cast<double>(end.programs - after_first.programs) / p.steps;
            r.op_programs = static_cast<double>(end.op_programs - after_first.op_programs) / p.steps;
            r.ops = static_cast<double>(end.ops - after_first.ops) / p.steps;
            int64_t bytes = 0;
            for (const auto& [name, k] : end.byte_programs) bytes += k;
            for (const auto& [name, k] : after_first.byte_programs) bytes -= k;
            r.byte_launches = static_cast<double>(bytes) / p.steps;
            for (const auto& [name, t] : end.temp_bytes) r.temp_bytes = std::max(r.temp_bytes, t);
            for (const auto& [name, t] : end.program_time) {
              fsdp::PjrtLaunchStats::Time d = t;
              const auto it = after_first.program_time.find(name);
              if (it != after_first.program_time.end()) {
                d.launches -= it->second.launches;
                d.seconds -= it->second.seconds;
              }
              if (d.launches > 0) r.profile[name] = d;
            }
          }
          return absl::OkStatus();
        }),
        "training");
  r.step_s = Median(times);
  if (client) {
    r.compiles = client->compile_count() - compiles0;
    r.compile_s = client->compile_seconds() - compile0;
  }
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  const Params p = Parse(argc, argv);
  fsdp::pjrt::PjrtClientOptions o;
  o.plugin_path = p.plugin;
  o.create_options["cpu_device_count"] = int64_t{std::max(p.ranks, 1)};
  const auto client = Check(fsdp::pjrt::Client::Create(o), "PJRT client");
  std::printf("# pjrt_bench: plugin %s (%s, %d devices), %d hardware threads\n", p.plugin.c_str(),
              client->platform_name().c_str(), client->num_devices(), fsdp::HardwareThreads());

  std::printf("\n# per-launch overhead: Scale of one f32, %d launches (median us per launch)\n",
              p.launches);
  std::printf("%-12s %12s %14s %16s\n", "backend", "allocation", "waited each", "back to back");
  {
    fsdp::PjrtBackendOptions per_op;
    per_op.fuse_ops = false;
    per_op.xla_options = p.xla_options;
    fsdp::PjrtBackendOptions fused;
    fused.max_fused_ops = p.max_fused_ops;
    fused.xla_options = p.xla_options;
    auto pj = Check(fsdp::PjrtBackend::Create(client, 0, per_op), "pjrt backend");
    auto pf = Check(fsdp::PjrtBackend::Create(client, 0, fused), "pjrt backend");
    auto cpu = Check(fsdp::CpuBackend::Create({.num_threads = 1}), "cpu backend");
    cpu->BindCurrentThread();
    for (size_t bytes : {size_t{4096}, size_t{64} << 20}) {
      const char* size = bytes == 4096 ? "4 KiB" : "64 MiB";
      const auto [pw, pb] = LaunchCost(pj.get(), bytes, p.launches);
      std::printf("%-12s %12s %14.1f %16.1f\n", "pjrt per-op", size, pw, pb);
      const auto [fw, fb] = LaunchCost(pf.get(), bytes, p.launches);
      std::printf("%-12s %12s %14.1f %16.1f\n", "pjrt fused", size, fw, fb);
      const auto [cw, cb] = LaunchCost(cpu.get(), bytes, p.launches);
      std::printf("%-12s %12s %14.1f %16.1f\n", "cpu", size, cw, cb);
    }
  }

  std::printf("\n# MatmulForward out[M,N] = inp[M,K] . w[N,K]^T + b, waited each (median us)\n");
  std::printf("%-20s %12s %12s %8s\n", "M x K x N", "pjrt us", "cpu us", "ratio");
  {
    fsdp::PjrtBackendOptions bo;
    bo.xla_options = p.xla_options;
    auto pj = Check(fsdp::PjrtBackend::Create(client, 0, bo), "pjrt backend");
    auto cpu = Check(fsdp::CpuBackend::Create({.num_threads = 1}), "cpu backend");
    cpu->BindCurrentThread();
    for (auto [M, K, N] : {std::array<int64_t, 3>{512, 64, 256}, {512, 256, 64},
                           {1024, 256, 1024}}) {
      const double pu = MatmulCost(pj.get(), M, K, N, std::max(10, p.launches / 10));
      const double cu = MatmulCost(cpu.get(), M, K, N, std::max(10, p.launches / 10));
      std::printf("%-20s %12.1f %12.1f %7.1fx\n",
                  (std::to_string(M) + " x " + std::to_string(K) + " x " + std::to_string(N)).c_str(),
                  pu, cu, pu / cu);
    }
  }

  std::printf("\n# FULL_SHARD on %d ranks (threads), batch 4 x 64 per rank: first step (compiles), "
              "median of %d steps\n",
              p.ranks, p.steps);
  std::printf("%-6s %-7s %9s %9s %12s %12s %11s %6s %10s %10s %8s %10s %9s %9s\n", "model",
              "ops", "compiles", "compile s", "pjrt first s", "pjrt step ms", "cpu step ms",
              "ratio", "launches", "op progs", "ops", "/unit/mb", "ui8 args", "temp MiB");
  std::printf("# /unit/mb: launches of a ForwardBackward per unit, its collectives included "
              "(\"launches A + B\": A of a ForwardBackward, B of a Step, counted in one more "
              "step)\n");
  for (const std::string& m : p.models) {
    const ModelRun cpu = Train(p, m, nullptr);
    const int units = Check(fsdp::nn::ModelConfig::FromName(m), "model").num_units();
    for (const bool fuse : {true, false}) {
      const ModelRun pj = Train(p, m, client, fuse);
      std::printf("%-6s %-7s %9lld %9.2f %12.2f %12.1f %11.1f %5.2fx %10.0f %10.0f %8.0f %10.1f"
                  " %9.0f %9.2f   (loss %.4f pjrt, %.4f cpu; launches %lld + %lld)\n",
                  m.c_str(), fuse ? "fused" : "per-op", static_cast<long long>(pj.compiles),
                  pj.compile_s, pj.first_s, pj.step_s * 1e3, cpu.step_s * 1e3,
                  pj.step_s / cpu.step_s, pj.programs, pj.op_programs, pj.ops,
                  static_cast<double>(pj.micro_batch_programs) / units, pj.byte_launches,
                  pj.temp_bytes < 0 ? -1.0 : static_cast<double>(pj.temp_bytes) / (1 << 20),
                  pj.loss, cpu.loss, static_cast<long long>(pj.micro_batch_programs),
                  static_cast<long long>(pj.step_programs));
    }
  }
  for (const std::string& m : p.models) {
    if (p.profile == 0) break;
    for (const bool fuse : {false, true}) {
      const ModelRun pj = Train(p, m, client, fuse, /*profile=*/true);
      std::vector<std::pair<std::string, fsdp::PjrtLaunchStats::Time>> rows(pj.profile.begin(),
                                                                            pj.profile.end());
      std::sort(rows.begin(), rows.end(),
                [](const auto& a, const auto& b) { return a.second.seconds > b.second.seconds; });
      double total = 0;
      for (const auto& [name, t] : rows) total += t.seconds;
      std::printf("\n# profile of %s, %s, each launch waited for (rank 0), per step: %.1f ms in "
                  "programs, step %.1f ms\n",
                  m.c_str(), fuse ? "fused programs" : "a program per op", total * 1e3 / p.steps,
                  pj.step_s * 1e3);
      std::printf("%-32s %10s %10s %12s %7s\n", "program", "launches", "ms", "us/launch",
                  "share");
      for (size_t i = 0; i < rows.size() && i < static_cast<size_t>(p.profile); ++i) {
        const auto& [name, t] = rows[i];
        std::printf("%-32s %10.1f %10.2f %12.1f %6.1f%%\n", name.c_str(),
                    static_cast<double>(t.launches) / p.steps, t.seconds * 1e3 / p.steps,
                    t.seconds * 1e6 / static_cast<double>(t.launches), 100 * t.seconds / total);
      }
    }
  }
  return 0;
}
