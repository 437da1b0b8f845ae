// fsdp_bench: the scaling harness. Runs a grid of training configurations (models x strategies
// x world sizes x dtypes x activation checkpointing x prefetch) with fsdp::RunBench
// (fsdp/bench.h), prints a progress line per run to stderr and a table to stdout, and writes
// JSON lines, CSV and SVG plots. `fsdp_bench --help` explains every option and figure;
// docs/scaling.md has the long form.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "fsdp/bench.h"
#include "fsdp/cpu_backend.h"
#include "fsdp/mpi_world.h"
#include "fsdp/nn/model_config.h"

namespace {

constexpr const char* kHelp = R"(fsdp_bench: training steps of the bundled models under a grid
of sharding configurations; prints a table and writes JSON lines, CSV and SVG plots.

Usage: fsdp_bench [options]     (each list is comma-separated; the grid is every combination)

Grid:
  --models LIST        bundled models (default nano): nano, mini, gpt2, ..., llama-nano,
                       llama-mini, ...
  --strategies LIST    FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD, HYBRID_SHARD_GRAD_OP
                       (default FULL_SHARD)
  --worlds LIST        ranks, as threads of this process (default 1,2). Under mpirun the world
                       is the MPI job's and this flag is ignored.
  --dtypes LIST        parameter (compute) dtype: f32, bf16, f16 (default f32)
  --checkpoint LIST    activation checkpointing: 0 (off) or k (every k-th block) (default 0)
  --prefetch LIST      forward/backward prefetch: 0 or 1 (default 1)
Each run:
  --reduce_dtype D     gradient reduction dtype: same (the parameter dtype), f32, bf16, f16
                       (default same)
  --hybrid_shard S     HYBRID strategies: ranks per shard group; 0 = --ranks_per_host when set,
                       else the whole world. A world smaller than S uses one group. (default 0)
  --batch B            sequences per rank and step, B (default 4): weak scaling, the global
                       batch is B x world size
  --seq T              sequence length (default 64; 0 = the model's block size)
  --threads N          OpenMP threads per rank; 0 = the cores divided by the largest world of
                       the grid, the same for every run so that runs compare per rank (default 0)
  --warmup N           warm-up steps, not measured (default 2)
  --steps N            measured steps (default 5)
Simulated link (the local communicator; 0 = off):
  --link_gbps G        bandwidth between two ranks of a host, GB/s (1e9 bytes/s)
  --link_latency_us U  latency per transfer inside a host, microseconds
  --ranks_per_host R   ranks per simulated host (0 = one host, one level of link); it must
                       divide each world size; a world smaller than R is one host
  --inter_gbps G       bandwidth between hosts, GB/s
  --inter_latency_us U latency per transfer between hosts, microseconds
Outputs:
  --jsonl PATH         one JSON object per run
  --csv PATH           a header and one row per run (the JSON fields)
  --svg_dir DIR        throughput.svg, efficiency.svg, step_split.svg (created if missing)
  --peak_gflops P      GEMM peak per core for MFU, GFLOP/s (default: measured once per dtype)
  --help               this text

Figures (docs/scaling.md):
  tokens/s      B x T x world size / the median step time. A step's time is the slowest
                rank's; every step starts on all ranks together (a barrier, not timed).
  step          median over the measured steps, and p10-p90 (min and max in the files).
  MFU           model FLOPs per second / peak. Model FLOPs per step = 6 P tokens +
                12 L C T tokens (MODEL_SPEC.md; recomputation not counted). Peak = the GEMM
                2048^3 rate of one core measured in this run (sgemm for f32, the bf16/f16 GEMM
                for those dtypes when the CPU has one) x cores used (world x threads per rank,
                at most the machine's hardware threads when ranks oversubscribe them).
  split         per step, mean over ranks and steps, from the timeline (fsdp/trace.h):
                compute = forward/backward/recompute of the blocks; exposed communication =
                time the compute thread was blocked on collectives ("wait" spans: what
                compute did not hide); optimizer = Step() less the waits inside it; other =
                the rest (embedding, head, loss, token copies, host work). They add up to
                the mean step time.
  comm MiB      per rank per step, counted from the collectives the rank ran: the sum of
                their sizes (nccl-tests' S) in the files, and bus bytes S(n-1)/n for
                all_gather and reduce_scatter, 2S(n-1)/n for all_reduce (the table's figure).
  peak MiB      the runtime's MemoryReport peak per rank (the largest rank); the files hold
                every category.
  syncs         host synchronisations per step (StepStats::host_syncs).
  efficiency    weak scaling: tokens/s at N / (N x tokens/s of the 1-rank run of the same
                configuration), when the grid has that run (e.g. --worlds 1,2,4).

Exit status: 0 when every run succeeded, 1 when a run failed, 2 for bad flags.
)";

struct Args {
  std::vector<std::string> models = {"nano"};
  std::vector<fsdp::ShardingStrategy> strategies = {fsdp::ShardingStrategy::kFullShard};
  std::vector<int> worlds = {1, 2};
  std::vector<fsdp::DType> dtypes = {fsdp::DType::kF32};
  std::vector<int> checkpoint = {0};
  std::vector<int> prefetch = {1};
  std::string reduce_dtype = "same";
  int hybrid_shard = 0, batch = 4, seq = 64, threads = 0, warmup = 2, steps = 5;
  double link_gbps = 0, link_latency_us = 0, inter_gbps = 0, inter_latency_us = 0;
  int ranks_per_host = 0;
  std::string jsonl, csv, svg_dir;
  double peak_gflops = 0;
};

[[noreturn]] void BadUsage(const std::string& message) {
  std::fprintf(stderr, "fsdp_bench: %s (fsdp_bench --help lists the options)\n",
               message.c_str());
  std::exit(2);
}

int ParseInt(const std::string& flag, const std::string& v, int min) {
  int x = 0;
  if (!absl::SimpleAtoi(v, &x) || x < min) {
    BadUsage(absl::StrCat(flag, "=", v, ": allowed: an integer >= ", min));
  }
  return x;
}

double ParseDouble(const std::string& flag, const std::string& v) {
  double x = 0;
  if (!absl::SimpleAtod(v, &x) || !std::isfinite(x) || x < 0) {
    BadUsage(absl::StrCat(flag, "=", v, ": allowed: a number >= 0"));
  }
  return x;
}

std::vector<std::string> List(const std::string& flag, const std::string& v) {
  std::vector<std::string> out = absl::StrSplit(v, ',', absl::SkipEmpty());
  if (out.empty()) BadUsage(absl::StrCat(flag, "='", v, "': an empty list"));
  return out;
}

fsdp::DType ParseDType(const std::string& flag, const std::string& v) {
  if (v == "f32") return fsdp::DType::kF32;
  if (v == "bf16") return fsdp::DType::kBF16;
  if (v == "f16") return fsdp::DType::kF16;
  BadUsage(absl::StrCat(flag, ": '", v, "' is not f32, bf16 or f16"));
}

Args ParseArgs(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    std::string k = argv[i], v;
    if (k == "--help" || k == "-h" || k == "--helpfull") {
      std::fputs(kHelp, stdout);
      std::exit(0);
    }
    if (k.rfind("--", 0) != 0) {
      BadUsage(absl::StrCat("unexpected argument '", k, "': flags start with --"));
    }
    if (const size_t eq = k.find('='); eq != std::string::npos) {
      v = k.substr(eq + 1);
      k = k.substr(0, eq);
    } else {
      if (i + 1 >= argc) BadUsage(absl::StrCat(k, ": needs a value"));
      v = argv[++i];
    }
    if (k == "--models") {
      a.models = List(k, v);
      for (const std::string& m : a.models) {
        if (!fsdp::nn::ModelConfig::FromName(m).ok()) {
          BadUsage(absl::StrCat("--models: unknown model '", m, "' (known: ",
                                absl::StrJoin(fsdp::nn::ModelConfig::Names(), ", "), ")"));
        }
      }
    } else if (k == "--strategies") {
      a.strategies.clear();
      for (const std::string& s : List(k, v)) {
        auto st = fsdp::ParseStrategy(s);
        if (!st.ok()) {
          BadUsage(absl::StrCat("--strategies: '", s, "' is not FULL_SHARD, SHARD_GRAD_OP, "
                                "NO_SHARD, HYBRID_SHARD or HYBRID_SHARD_GRAD_OP"));
        }
        a.strategies.push_back(*st);
      }
    } else if (k == "--worlds") {
      a.worlds.clear();
      for (const std::string& s : List(k, v)) a.worlds.push_back(ParseInt(k, s, 1));
    } else if (k == "--dtypes") {
      a.dtypes.clear();
      for (const std::string& s : List(k, v)) a.dtypes.push_back(ParseDType(k, s));
    } else if (k == "--checkpoint") {
      a.checkpoint.clear();
      for (const std::string& s : List(k, v)) a.checkpoint.push_back(ParseInt(k, s, 0));
    } else if (k == "--prefetch") {
      a.prefetch.clear();
      for (const std::string& s : List(k, v)) {
        if (s != "0" && s != "1") BadUsage(absl::StrCat("--prefetch: '", s, "' is not 0 or 1"));
        a.prefetch.push_back(s == "1");
      }
    } else if (k == "--reduce_dtype") {
      if (v != "same") ParseDType(k, v);
      a.reduce_dtype = v;
    } else if (k == "--hybrid_shard") {
      a.hybrid_shard = ParseInt(k, v, 0);
    } else if (k == "--batch") {
      a.batch = ParseInt(k, v, 1);
    } else if (k == "--seq") {
      a.seq = ParseInt(k, v, 0);
    } else if (k == "--threads") {
      a.threads = ParseInt(k, v, 0);
    } else if (k == "--warmup") {
      a.warmup = ParseInt(k, v, 0);
    } else if (k == "--steps") {
      a.steps = ParseInt(k, v, 1);
    } else if (k == "--link_gbps") {
      a.link_gbps = ParseDouble(k, v);
    } else if (k == "--link_latency_us") {
      a.link_latency_us = ParseDouble(k, v);
    } else if (k == "--ranks_per_host") {
      a.ranks_per_host = ParseInt(k, v, 0);
    } else if (k == "--inter_gbps") {
      a.inter_gbps = ParseDouble(k, v);
    } else if (k == "--inter_latency_us") {
      a.inter_latency_us = ParseDouble(k, v);
    } else if (k == "--jsonl") {
      a.jsonl = v;
    } else if (k == "--csv") {
      a.csv = v;
    } else if (k == "--svg_dir") {
      a.svg_dir = v;
    } else if (k == "--peak_gflops") {
      a.peak_gflops = ParseDouble(k, v);
    } else {
      BadUsage(absl::StrCat("unknown flag '", k, "'"));
    }
  }
  if (a.threads > fsdp::HardwareThreads()) {
    BadUsage(absl::StrCat("--threads=", a.threads, ": allowed: 0 (automatic) to the ",
                          fsdp::HardwareThreads(), " hardware threads"));
  }
  // Sequence lengths against every model's block size.
  for (const std::string& m : a.models) {
    const int block = fsdp::nn::ModelConfig::FromName(m)->block_size();
    if (a.seq > block) {
      BadUsage(absl::StrCat("--seq=", a.seq, ": allowed: 1 to the block size of --models ", m,
                            ", ", block, " (0: the block size)"));
    }
  }
  // The shard group of each hybrid run must divide its world.
  for (fsdp::ShardingStrategy s : a.strategies) {
    if (s != fsdp::ShardingStrategy::kHybridShard &&
        s != fsdp::ShardingStrategy::kHybridShardGradOp) {
      continue;
    }
    const int shard = a.hybrid_shard > 0 ? a.hybrid_shard : a.ranks_per_host;
    for (int w : a.worlds) {
      if (shard > 0 && w >= shard && w % shard != 0) {
        BadUsage(absl::StrCat("--hybrid_shard=", shard, ": ", std::string(fsdp::StrategyName(s)),
                              " needs a divisor of each world size, not of ", w));
      }
    }
  }
  for (int w : a.worlds) {
    if (a.ranks_per_host > 0 && w >= a.ranks_per_host && w % a.ranks_per_host != 0) {
      BadUsage(absl::StrCat("--ranks_per_host=", a.ranks_per_host,
                            ": every host holds the same number of ranks, so it must divide "
                            "each world size of --worlds, not ", w));
    }
  }
  if (a.ranks_per_host == 0 && (a.inter_gbps > 0 || a.inter_latency_us > 0)) {
    BadUsage("--inter_gbps/--inter_latency_us: need --ranks_per_host (the ranks of one host)");
  }
  return a;
}

std::string Mib(double bytes) { return absl::StrFormat("%.2f", bytes / (1 << 20)); }

std::string RunName(const fsdp::BenchConfig& c, int world) {
  std::string s = absl::StrCat(c.model, " ", std::string(fsdp::StrategyName(c.strategy)), " ",
                               world, world == 1 ? " rank " : " ranks ",
                               std::string(fsdp::DTypeName(c.param_dtype)));
  if (c.checkpoint_every > 0) absl::StrAppend(&s, " ckpt ", c.checkpoint_every);
  absl::StrAppend(&s, c.prefetch ? " prefetch" : " no-prefetch");
  return s;
}

void PrintTable(const std::vector<fsdp::BenchResult>& rs) {
  std::printf("%-10s %-20s %3s %5s %-5s %4s %3s %10s %17s %6s %28s %6s %9s %8s %5s %6s\n",
              "model", "strategy", "N", "shard", "dtype", "ckpt", "pf", "tokens/s",
              "step ms (p10-p90)", "MFU%", "compute/exposed/opt/other ms", "exp%",
              "comm MiB", "peak MiB", "syncs", "eff");
  for (const fsdp::BenchResult& r : rs) {
    const std::string step = absl::StrFormat("%.1f (%.1f-%.1f)", r.step_median_s * 1e3,
                                             r.step_p10_s * 1e3, r.step_p90_s * 1e3);
    const std::string split =
        absl::StrFormat("%.1f/%.1f/%.1f/%.1f", r.compute_s * 1e3, r.exposed_comm_s * 1e3,
                        r.optimizer_s * 1e3, r.other_s * 1e3);
    const std::string eff = std::isfinite(r.scaling_efficiency)
                                ? absl::StrFormat("%.3f", r.scaling_efficiency)
                                : std::string("-");
    std::printf("%-10s %-20s %3d %5d %-5s %4d %3d %10.0f %17s %6.2f %28s %6.1f %9s %8s %5.1f %6s\n",
                r.model.c_str(), r.strategy.c_str(), r.world_size, r.hybrid_shard_size,
                fsdp::DTypeName(r.param_dtype).data(), r.checkpoint_every, r.prefetch ? 1 : 0,
                r.tokens_per_s, step.c_str(), 100 * r.mfu, split.c_str(),
                100 * r.exposed_comm_fraction, Mib(r.bus_bytes_per_rank).c_str(),
                Mib(static_cast<double>(r.memory.peak_bytes)).c_str(), r.host_syncs_per_step,
                eff.c_str());
  }
}

bool WriteFile(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f << text;
  f.close();
  if (!f) {
    std::fprintf(stderr, "fsdp_bench: cannot write %s\n", path.c_str());
    return false;
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = ParseArgs(argc, argv);
  // Under mpirun: one rank per process, the world is the job's.
  std::unique_ptr<fsdp::Communicator> mpi;
  const bool under_mpi = std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr;
  if (under_mpi) {
    auto world = fsdp::CreateMpiWorld();
    if (!world.ok()) return fsdp::FinishMpi(world.status(), "fsdp_bench");
    mpi = *std::move(world);
  }
  const bool rank0 = mpi == nullptr || mpi->rank() == 0;
  std::vector<int> worlds = a.worlds;
  if (mpi != nullptr) worlds = {mpi->size()};
  // Outputs are checked before anything runs.
  if (rank0 && !a.svg_dir.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(a.svg_dir, ec);
    if (ec || !std::filesystem::is_directory(a.svg_dir)) {
      BadUsage(absl::StrCat("--svg_dir=", a.svg_dir, ": cannot create the directory"));
    }
  }
  for (const std::string* path : {&a.jsonl, &a.csv}) {
    if (!rank0 || path->empty()) continue;
    std::ofstream f(*path, std::ios::trunc);
    if (!f) BadUsage(absl::StrCat(*path, ": cannot write this file"));
  }
  const int max_world = *std::max_element(worlds.begin(), worlds.end());
  const int threads =
      a.threads > 0 ? a.threads : std::max(1, fsdp::HardwareThreads() / max_world);

  fsdp::CommOptions link;
  link.link_bytes_per_second = a.link_gbps * 1e9;
  link.link_latency = absl::Microseconds(a.link_latency_us);
  link.ranks_per_host = a.ranks_per_host;
  link.inter_host_bytes_per_second = a.inter_gbps * 1e9;
  link.inter_host_latency = absl::Microseconds(a.inter_latency_us);

  std::vector<fsdp::BenchConfig> grid;
  for (const std::string& m : a.models) {
    for (fsdp::ShardingStrategy s : a.strategies) {
      for (int w : worlds) {
        for (fsdp::DType d : a.dtypes) {
          for (int ck : a.checkpoint) {
            for (int pf : a.prefetch) {
              fsdp::BenchConfig c;
              c.model = m;
              c.strategy = s;
              c.world_size = w;
              c.param_dtype = d;
              c.reduce_dtype = a.reduce_dtype == "same" ? d : ParseDType("", a.reduce_dtype);
              c.checkpoint_every = ck;
              c.prefetch = pf != 0;
              c.batch_size = a.batch;
              c.seq_len = a.seq;
              c.threads_per_rank = threads;
              c.warmup_steps = a.warmup;
              c.steps = a.steps;
              c.link = link;
              // A world smaller than a host is one host.
              if (w < a.ranks_per_host) c.link.ranks_per_host = w;
              const int shard = a.hybrid_shard > 0 ? a.hybrid_shard : a.ranks_per_host;
              c.hybrid_shard_size = shard > 0 && w < shard ? w : a.hybrid_shard;
              grid.push_back(c);
            }
          }
        }
      }
    }
  }
  if (rank0) {
    std::fprintf(stderr, "fsdp_bench: %zu runs, %d thread(s) per rank, B=%d per rank, %d warm-up + "
                 "%d measured steps each%s\n", grid.size(), threads, a.batch, a.warmup, a.steps,
                 mpi != nullptr ? absl::StrCat(", under mpirun (", mpi->size(), " ranks)").c_str()
                                : "");
    if (threads * max_world > fsdp::HardwareThreads()) {
      std::fprintf(stderr, "fsdp_bench: note: %d ranks x %d threads oversubscribe the %d "
                   "hardware threads: the largest worlds share cores\n", max_world, threads,
                   fsdp::HardwareThreads());
    }
  }

  // The MFU peak, once per dtype (rank 0 measures; under mpirun RunBench broadcasts it).
  std::map<fsdp::DType, fsdp::GemmPeak> peaks;
  std::vector<fsdp::BenchResult> results;
  const auto start = std::chrono::steady_clock::now();
  auto elapsed = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  bool failed = false;
  for (size_t i = 0; i < grid.size(); ++i) {
    fsdp::BenchConfig c = grid[i];
    if (a.peak_gflops > 0) {
      c.peak_gflops_per_core = a.peak_gflops;
      c.peak_kind = "given (--peak_gflops)";
    } else if (auto it = peaks.find(c.param_dtype); it != peaks.end()) {
      c.peak_gflops_per_core = it->second.gflops_per_core;
      c.peak_kind = it->second.kind;
    } else if (mpi == nullptr) {
      if (rank0) {
        std::fprintf(stderr, "fsdp_bench: measuring the %s GEMM peak of one core ...\n",
                     fsdp::DTypeName(c.param_dtype).data());
      }
      peaks[c.param_dtype] = fsdp::PeakGflopsPerCore(c.param_dtype);
      c.peak_gflops_per_core = peaks[c.param_dtype].gflops_per_core;
      c.peak_kind = peaks[c.param_dtype].kind;
    }
    if (rank0) {
      std::string eta = "ETA -";
      if (i > 0) {
        eta = absl::StrFormat("ETA %.0f s", elapsed() / static_cast<double>(i) *
                                                static_cast<double>(grid.size() - i));
      }
      std::fprintf(stderr, "fsdp_bench: [%zu/%zu done] running %s | %.0f s elapsed, %s\n", i,
                   grid.size(), RunName(c, mpi != nullptr ? mpi->size() : c.world_size).c_str(),
                   elapsed(), eta.c_str());
    }
    absl::StatusOr<fsdp::BenchResult> r =
        mpi != nullptr ? fsdp::RunBench(c, *mpi) : fsdp::RunBench(c);
    if (!r.ok()) {
      if (rank0) {
        std::fprintf(stderr, "fsdp_bench: %s failed: %s\n",
                     RunName(c, c.world_size).c_str(), r.status().ToString().c_str());
      }
      failed = true;
      if (mpi != nullptr) return fsdp::FinishMpi(r.status(), "fsdp_bench");
      continue;
    }
    if (mpi != nullptr && !peaks.count(c.param_dtype)) {
      peaks[c.param_dtype] = {r->peak_gflops_per_core, r->peak_kind};
    }
    results.push_back(*std::move(r));
  }
  if (rank0) {
    std::fprintf(stderr, "fsdp_bench: [%zu/%zu done] in %.0f s\n", grid.size(), grid.size(),
                 elapsed());
  }
  fsdp::SetScalingEfficiency(results);
  bool written = true;
  if (rank0) {
    if (!results.empty()) {
      const fsdp::BenchResult& r0 = results.front();
      std::map<fsdp::DType, std::string> peak_text;
      for (const fsdp::BenchResult& r : results) {
        peak_text[r.param_dtype] = absl::StrFormat(
            "%s %.1f GFLOP/s (%s)", std::string(fsdp::DTypeName(r.param_dtype)),
            r.peak_gflops_per_core, r.peak_kind);
      }
      std::vector<std::string> peaks_line;
      for (const auto& [dtype, text] : peak_text) peaks_line.push_back(text);
      std::printf("fsdp_bench: B=%d x T=%d per rank, %d threads per rank, MFU peak per core: %s; "
                  "median of %d steps after %d warm-up\n",
                  r0.batch_size, r0.seq_len, r0.threads_per_rank,
                  absl::StrJoin(peaks_line, ", ").c_str(), r0.steps, r0.warmup_steps);
    }
    PrintTable(results);
    std::fflush(stdout);
    if (!a.jsonl.empty()) {
      std::string text;
      for (const fsdp::BenchResult& r : results) {
        absl::StrAppend(&text, fsdp::BenchResultJson(r), "\n");
      }
      written &= WriteFile(a.jsonl, text);
    }
    if (!a.csv.empty()) {
      std::string text = fsdp::BenchCsvHeader() + "\n";
      for (const fsdp::BenchResult& r : results) {
        absl::StrAppend(&text, fsdp::BenchCsvRow(r), "\n");
      }
      written &= WriteFile(a.csv, text);
    }
    if (!a.svg_dir.empty()) {
      const std::filesystem::path dir(a.svg_dir);
      written &= WriteFile((dir / "throughput.svg").string(), fsdp::ThroughputSvg(results));
      written &= WriteFile((dir / "efficiency.svg").string(), fsdp::EfficiencySvg(results));
      written &= WriteFile((dir / "step_split.svg").string(), fsdp::StepSplitSvg(results));
    }
  }
  const int rc = failed || !written ? 1 : 0;
  if (mpi != nullptr) {
    mpi.reset();
    return fsdp::FinishMpi(absl::OkStatus(), "fsdp_bench") == 0 ? rc : 1;
  }
  return rc;
}
