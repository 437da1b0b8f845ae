// fsdp_bench: the scaling harness. Runs a grid of training configurations (models x strategies
// x world sizes x dtypes x activation checkpointing x prefetch) with fsdp::RunBench
// (fsdp/bench.h), prints a progress line per run to stderr and a table to stdout, and writes
// JSON lines, CSV and SVG plots. `fsdp_bench --project` predicts the same figures on a described
// cluster instead (fsdp/project.h), and `--validate_projection` checks the prediction against
// runs measured on the simulated link. `fsdp_bench --help` explains every option and figure;
// docs/scaling.md has the long form.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "bench/fsdp_bench.h"
#include "fsdp/bench.h"
#include "fsdp/bench_report.h"
#include "fsdp/cpu_backend.h"
#include "fsdp/files.h"
#include "fsdp/mpi_world.h"

namespace fsdp_bench {

int ShardSize(fsdp::ShardingStrategy s, int world, int hybrid_shard, int ranks_per_host) {
  if (s == fsdp::ShardingStrategy::kNoShard) return 1;
  if (s != fsdp::ShardingStrategy::kHybridShard &&
      s != fsdp::ShardingStrategy::kHybridShardGradOp) {
    return world;
  }
  const int shard = hybrid_shard > 0 ? hybrid_shard : ranks_per_host;
  return shard > 0 && shard <= world && world % shard == 0 ? shard : world;
}

std::string RunName(const fsdp::BenchConfig& c, int world) {
  std::string s = absl::StrCat(c.model, " ", std::string(fsdp::StrategyName(c.strategy)), " ",
                               world, world == 1 ? " rank " : " ranks ",
                               std::string(fsdp::DTypeName(c.param_dtype)));
  if (c.communication.all_gather != fsdp::WireFormat::kDType) {
    absl::StrAppend(&s, " all-gather ", std::string(fsdp::WireFormatName(c.communication.all_gather)));
  }
  if (c.communication.reduction != fsdp::WireFormat::kDType) {
    absl::StrAppend(&s, " reduction ", std::string(fsdp::WireFormatName(c.communication.reduction)));
  }
  if (c.secondary_shard_size > 0) absl::StrAppend(&s, " secondary ", c.secondary_shard_size);
  if (c.checkpoint_every > 0) absl::StrAppend(&s, " ckpt ", c.checkpoint_every);
  absl::StrAppend(&s, c.prefetch == 0   ? " no-prefetch"
                     : c.prefetch == 1 ? " prefetch"
                                       : absl::StrCat(" prefetch ", c.prefetch));
  return s;
}

fsdp::BenchConfig BaseConfig(const Args& a, const std::string& model, fsdp::DType dtype,
                             int checkpoint, int threads) {
  fsdp::BenchConfig c;
  c.model = model;
  c.config = a.configs.at(model);
  c.param_dtype = dtype;
  c.reduce_dtype = a.reduce_dtype == "same" ? dtype : FloatDTypeFlag("", a.reduce_dtype);
  c.communication = a.communication;
  c.secondary_shard_size = a.secondary_shard.front();
  c.checkpoint_every = checkpoint;
  c.batch_size = a.batch;
  c.seq_len = a.seq;
  c.threads_per_rank = threads;
  c.warmup_steps = a.warmup;
  c.steps = a.steps;
  return c;
}

// Outputs replace only a file of their own kind (fsdp/files.h), written whole and renamed.
bool WriteFile(const std::string& path, const std::string& text, const fsdp::OutputKind& kind) {
  if (absl::Status s = fsdp::WriteOutputFile(path, text, kind); !s.ok()) {
    std::fprintf(stderr, "fsdp_bench: %s\n", std::string(s.message()).c_str());
    return false;
  }
  return true;
}

// Every output file is new or of its own kind, the two files are not one, and the plots'
// directory holds no other kind of file under their names (bad usage otherwise).
void CheckOutputs(const Args& a) {
  if (!a.jsonl.empty() && !a.csv.empty() &&
      (a.jsonl == a.csv || fsdp::SameFile(a.jsonl, a.csv))) {
    BadUsage(absl::StrCat("--jsonl and --csv name the same file, ", a.jsonl,
                          ": give each its own"));
  }
  std::vector<std::pair<std::string, const fsdp::OutputKind*>> outputs;
  if (!a.jsonl.empty()) outputs.emplace_back(a.jsonl, &fsdp::kJsonLinesFile);
  if (!a.csv.empty()) outputs.emplace_back(a.csv, &fsdp::kCsvFile);
  if (!a.svg_dir.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(a.svg_dir, ec);
    if (ec || !std::filesystem::is_directory(a.svg_dir)) {
      BadUsage(absl::StrCat("--svg_dir=", a.svg_dir, ": cannot create the directory"));
    }
    for (const char* name : {"throughput.svg", "efficiency.svg", "step_split.svg",
                             "projected_efficiency.svg", "projected_throughput.svg"}) {
      outputs.emplace_back((std::filesystem::path(a.svg_dir) / name).string(), &fsdp::kSvgFile);
    }
  }
  for (const auto& [path, kind] : outputs) {
    if (absl::Status s = fsdp::CheckOutputPath(path, *kind); !s.ok()) {
      BadUsage(std::string(s.message()));
    }
  }
}

namespace {

std::string Mib(double bytes) { return absl::StrFormat("%.2f", bytes / (1 << 20)); }

// The model column: as wide as the longest name of the results ("llama-mini-L32"), at least 10.
int ModelWidth(const std::vector<fsdp::BenchResult>& rs) {
  size_t w = 10;
  for (const fsdp::BenchResult& r : rs) w = std::max(w, r.model.size());
  return static_cast<int>(w);
}

void PrintTable(const std::vector<fsdp::BenchResult>& rs) {
  const int mw = ModelWidth(rs);
  // dtype: the parameters', and a quantized all-gather's format after a '+' (f32+int8).
  std::printf("%-*s %-20s %3s %5s %-9s %4s %3s %10s %17s %6s %28s %6s %9s %8s %8s %5s %6s\n", mw,
              "model", "strategy", "N", "shard", "dtype", "ckpt", "pf", "tokens/s",
              "step ms (p10-p90)", "MFU%", "compute/exposed/opt/other ms", "exp%", "comm MiB",
              "comm ms", "peak MiB", "syncs", "eff");
  for (const fsdp::BenchResult& r : rs) {
    const std::string step = absl::StrFormat("%.1f (%.1f-%.1f)", r.step_median_s * 1e3,
                                             r.step_p10_s * 1e3, r.step_p90_s * 1e3);
    const std::string split =
        absl::StrFormat("%.1f/%.1f/%.1f/%.1f", r.compute_s * 1e3, r.exposed_comm_s * 1e3,
                        r.optimizer_s * 1e3, r.other_s * 1e3);
    const std::string eff = std::isfinite(r.scaling_efficiency)
                                ? absl::StrFormat("%.3f", r.scaling_efficiency)
                                : std::string("-");
    std::string dtype(fsdp::DTypeName(r.param_dtype));
    if (r.all_gather != fsdp::WireFormat::kDType) {
      absl::StrAppend(&dtype, "+", std::string(fsdp::WireFormatName(r.all_gather)));
    }
    if (r.reduction != fsdp::WireFormat::kDType) {
      absl::StrAppend(&dtype, "/", std::string(fsdp::WireFormatName(r.reduction)));
    }
    if (r.secondary_shard_size > 0) absl::StrAppend(&dtype, " sec", r.secondary_shard_size);
    std::printf(
        "%-*s %-20s %3d %5d %-9s %4d %3d %10.0f %17s %6.2f %28s %6.1f %9s %8.1f %8s %5.1f %6s\n",
        mw, r.model.c_str(), r.strategy.c_str(), r.world_size, r.hybrid_shard_size,
        dtype.c_str(), r.checkpoint_every, r.prefetch, r.tokens_per_s,
        step.c_str(), 100 * r.mfu, split.c_str(), 100 * r.exposed_comm_fraction,
        Mib(r.bus_bytes_per_rank).c_str(), r.comm_s * 1e3,
        Mib(static_cast<double>(r.memory.peak_bytes)).c_str(), r.host_syncs_per_step, eff.c_str());
  }
}

// The link's time for the step's bytes against everything else the step does (comm ms /
// (compute + opt + other)); 0 when there is nothing to compare.
double CommToCompute(const fsdp::BenchResult& r) {
  const double busy = r.compute_s + r.optimizer_s + r.other_s;
  return busy > 0 ? r.comm_s / busy : 0.0;
}

// Where the exposed communication was, in % of the mean step, for the runs that had some (at
// least 1% of the step): a run per line, the phases of BenchResult::exposed_start_s ...
void PrintExposedPhases(const std::vector<fsdp::BenchResult>& rs) {
  const int mw = ModelWidth(rs);
  bool any = false;
  for (const fsdp::BenchResult& r : rs) {
    if (r.exposed_comm_fraction < 0.01) continue;
    if (!any) {
      std::printf("\nexposed communication by phase, %% of the step (fsdp_bench --help):\n");
      std::printf("%-*s %-20s %3s %3s %6s %7s %6s %8s %6s %6s %6s %9s\n", mw, "model", "strategy",
                  "N", "pf", "start", "forward", "head", "backward", "tail", "opt", "exp%",
                  "comm/cmp");
      any = true;
    }
    const double pct = 100 / r.step_mean_s;
    std::printf("%-*s %-20s %3d %3d %6.1f %7.1f %6.1f %8.1f %6.1f %6.1f %6.1f %9.2f\n", mw,
                r.model.c_str(), r.strategy.c_str(), r.world_size, r.prefetch,
                pct * r.exposed_start_s, pct * r.exposed_forward_s, pct * r.exposed_head_s,
                pct * r.exposed_backward_s, pct * r.exposed_tail_s, pct * r.exposed_optimizer_s,
                pct * r.exposed_comm_s, CommToCompute(r));
  }
}

// --comm_to_compute F: `c` without a link measures the compute of a step (everything but the
// waits for collectives) and the bus bytes per rank; the simulated link then gets, on both
// levels, the bandwidth at which those bytes take F times that compute. The local
// communicator charges a collective its bus bytes / bandwidth plus latencies and the copies,
// which a second short run with that link measures (its comm_s): the bandwidth is then
// corrected so that bytes / bandwidth + those copies come to F times the compute.
constexpr int kMatchAttempts = 3;  // runs of one configuration under --comm_to_compute

absl::Status MatchLinkToCompute(double ratio, fsdp::BenchConfig& c) {
  fsdp::BenchConfig probe = c;
  probe.link.link_bytes_per_second = 0;
  probe.link.inter_host_bytes_per_second = 0;
  probe.warmup_steps = 2;
  probe.steps = 3;
  FSDP_ASSIGN_OR_RETURN(fsdp::BenchResult off, fsdp::RunBench(probe));
  const double compute_s = off.step_mean_s - off.exposed_comm_s;
  const double bytes = off.bus_bytes_per_rank;
  if (bytes <= 0 || compute_s <= 0) {
    std::fprintf(stderr, "fsdp_bench: no link: %s on %d rank(s) communicates nothing\n",
                 off.strategy.c_str(), off.world_size);
    return absl::OkStatus();
  }
  auto set = [&](fsdp::BenchConfig& x, double bytes_per_s) {
    x.link.link_bytes_per_second = bytes_per_s;
    x.link.inter_host_bytes_per_second = x.link.ranks_per_host > 0 ? bytes_per_s : 0;
  };
  double bytes_per_s = bytes / (ratio * compute_s);
  set(probe, bytes_per_s);
  FSDP_ASSIGN_OR_RETURN(fsdp::BenchResult on, fsdp::RunBench(probe));
  const double overhead_s = on.comm_s - bytes / bytes_per_s;  // latencies and copies
  const double target_s = ratio * (on.step_mean_s - on.exposed_comm_s);
  if (target_s - overhead_s > 0.1 * target_s) bytes_per_s = bytes / (target_s - overhead_s);
  set(c, bytes_per_s);
  std::fprintf(stderr,
               "fsdp_bench: link %.4g GB/s: %.2f MiB per rank and %.1f ms of copies and latency "
               "in %g x %.1f ms of compute\n",
               bytes_per_s / 1e9, bytes / (1 << 20), overhead_s * 1e3, ratio,
               target_s / ratio * 1e3);
  return absl::OkStatus();
}

// --repeat N: per configuration (in the grid's order), the median and the range over the N
// passes of the figures that drift with a shared machine.
void PrintPasses(const std::vector<fsdp::BenchResult>& rs, int passes) {
  auto key = [](const fsdp::BenchResult& r) {
    return absl::StrCat(r.model, "|", r.strategy, "|", r.world_size, "|", r.hybrid_shard_size, "|",
                        std::string(fsdp::DTypeName(r.param_dtype)), "|",
                        std::string(fsdp::DTypeName(r.reduce_dtype)), "|",
                        std::string(fsdp::WireFormatName(r.all_gather)), "|",
                        std::string(fsdp::WireFormatName(r.reduction)), "|",
                        r.secondary_shard_size, "|", r.checkpoint_every, "|",
                        r.prefetch);
  };
  std::vector<std::string> order;
  std::map<std::string, std::vector<const fsdp::BenchResult*>> groups;
  for (const fsdp::BenchResult& r : rs) {
    std::vector<const fsdp::BenchResult*>& g = groups[key(r)];
    if (g.empty()) order.push_back(key(r));
    g.push_back(&r);
  }
  // "median (min-max)" of the finite values, or "-" when there are none.
  auto spread = [](std::vector<double> v, int decimals) {
    v.erase(std::remove_if(v.begin(), v.end(), [](double x) { return !std::isfinite(x); }),
            v.end());
    if (v.empty()) return std::string("-");
    std::sort(v.begin(), v.end());
    const size_t n = v.size();
    const double median = n % 2 == 1 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
    return absl::StrFormat("%.*f (%.*f-%.*f)", decimals, median, decimals, v.front(), decimals,
                           v.back());
  };
  std::printf("\nover the %d passes (--repeat): median (min-max) per configuration:\n", passes);
  const int mw = ModelWidth(rs);
  std::printf("%-*s %-20s %3s %3s %5s %16s %24s %18s %18s %20s\n", mw, "model", "strategy", "N",
              "pf", "runs", "tokens/s", "step ms", "exp%", "comm/cmp", "eff");
  for (const std::string& k : order) {
    const std::vector<const fsdp::BenchResult*>& g = groups[k];
    std::vector<double> tps, step, exp, ratio, eff;
    for (const fsdp::BenchResult* r : g) {
      tps.push_back(r->tokens_per_s);
      step.push_back(r->step_median_s * 1e3);
      exp.push_back(100 * r->exposed_comm_fraction);
      ratio.push_back(CommToCompute(*r));
      eff.push_back(r->scaling_efficiency);
    }
    const fsdp::BenchResult& r = *g.front();
    std::printf("%-*s %-20s %3d %3d %5zu %16s %24s %18s %18s %20s\n", mw, r.model.c_str(),
                r.strategy.c_str(), r.world_size, r.prefetch, g.size(), spread(tps, 0).c_str(),
                spread(step, 1).c_str(), spread(exp, 1).c_str(), spread(ratio, 2).c_str(),
                spread(eff, 3).c_str());
  }
}

// Under mpirun (one rank per process, the world is the job's): joins the MPI world into `mpi`.
// Returns the exit code when the program must stop instead.
std::optional<int> JoinMpiIfLaunched(std::unique_ptr<fsdp::Communicator>& mpi) {
  if (std::getenv("OMPI_COMM_WORLD_SIZE") == nullptr) return std::nullopt;
  // FSDP_MPI_SHM is read when the world is made: a bad value is bad usage, said once.
  if (absl::Status shm = fsdp::MpiSharedMemoryFromEnv().status(); !shm.ok()) {
    const char* r = std::getenv("OMPI_COMM_WORLD_RANK");
    if (r == nullptr || std::string_view(r) == "0") {
      std::fprintf(stderr, "fsdp_bench: %s\n", std::string(shm.message()).c_str());
    }
    return 2;
  }
  auto world = fsdp::CreateMpiWorld();
  if (!world.ok()) return fsdp::FinishMpi(world.status(), "fsdp_bench");
  mpi = *std::move(world);
  return std::nullopt;
}

// The measured grid: every combination of the lists, in the order of the loops.
std::vector<fsdp::BenchConfig> MeasuredGrid(const Args& a, const std::vector<int>& worlds,
                                            int threads) {
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
              for (fsdp::WireFormat f : a.all_gather) {
                for (fsdp::WireFormat g : a.reduction) {
                  for (int n : a.secondary_shard) {
                    fsdp::BenchConfig c = BaseConfig(a, m, d, ck, threads);
                    c.secondary_shard_size = n;
                    c.strategy = s;
                    c.world_size = w;
                    c.prefetch = pf;
                    c.communication.all_gather = f;
                    c.communication.reduction = g;
                    // A quantized reduction adds in f32 from the f32 gradient.
                    if (g != fsdp::WireFormat::kDType) c.reduce_dtype = fsdp::DType::kF32;
                    c.link = link;
                    // A world smaller than a host is one host.
                    if (w < a.ranks_per_host) c.link.ranks_per_host = w;
                    const int shard = a.hybrid_shard > 0 ? a.hybrid_shard : a.ranks_per_host;
                    c.hybrid_shard_size = shard > 0 && w < shard ? w : a.hybrid_shard;
                    if (n > 0) {  // only where a secondary shard means something
                      fsdp::ShardingOptions probe;
                      probe.strategy = s;
                      probe.secondary_shard_size = n;
                      const int S = ShardSize(s, w, c.hybrid_shard_size, c.link.ranks_per_host);
                      if (!fsdp::CheckSecondaryShard(probe, S).ok()) {
                        std::fprintf(stderr,
                                     "fsdp_bench: --secondary_shard %d does not apply to %s "
                                     "(FULL_SHARD or HYBRID_SHARD with a shard group it "
                                     "divides, 2 <= N < group): not run\n",
                                     n, RunName(c, w).c_str());
                        continue;
                      }
                    }
                    grid.push_back(c);
                  }
                }
              }
            }
          }
        }
      }
    }
  }
  return grid;
}

// One configuration of the grid, measured. With --comm_to_compute F the link is first set from
// the compute (MatchLinkToCompute); the compute of a shared machine drifts between the probes
// and the run, so a run whose link missed F x its compute by more than --match_tolerance runs
// again with the bandwidth corrected from that run's figures, up to twice, and the run closest
// to F is kept.
absl::StatusOr<fsdp::BenchResult> MeasureOne(const Args& a, fsdp::BenchConfig& c,
                                             fsdp::Communicator* mpi) {
  if (a.comm_to_compute > 0) {
    if (absl::Status matched = MatchLinkToCompute(a.comm_to_compute, c); !matched.ok()) {
      return matched;
    }
  }
  absl::StatusOr<fsdp::BenchResult> r = mpi != nullptr ? fsdp::RunBench(c, *mpi)
                                                       : fsdp::RunBench(c);
  const double want = a.comm_to_compute;
  auto miss = [&](const fsdp::BenchResult& x) { return std::abs(CommToCompute(x) / want - 1); };
  std::optional<fsdp::BenchResult> last;  // the latest run, which the next one corrects
  if (r.ok()) last = *r;
  for (int attempt = 2; want > 0 && r.ok() && attempt <= kMatchAttempts; ++attempt) {
    const double got = CommToCompute(*last);
    // (No link: the strategy communicates nothing, MatchLinkToCompute set none.)
    if (got <= 0 || last->link_gbps <= 0 || miss(*r) <= a.match_tolerance) break;
    // The link's time is bytes / bandwidth plus copies and latency that do not scale with
    // it: the bandwidth is set so that the bytes take what the copies leave of the target.
    const double bw = last->link_gbps * 1e9, bytes = last->bus_bytes_per_rank;
    const double busy = last->comm_s / got, fixed = last->comm_s - bytes / bw;
    const double left = want * busy - fixed;
    c.link.link_bytes_per_second = left > 0.1 * want * busy ? bytes / left : bw * got / want;
    if (c.link.inter_host_bytes_per_second > 0) {
      c.link.inter_host_bytes_per_second = c.link.link_bytes_per_second;
    }
    std::fprintf(stderr,
                 "fsdp_bench: the link took %.2f x the compute, not %g: again at %.4g GB/s "
                 "(attempt %d of %d)\n",
                 got, want, c.link.link_bytes_per_second / 1e9, attempt, kMatchAttempts);
    absl::StatusOr<fsdp::BenchResult> again = fsdp::RunBench(c);
    if (again.ok()) last = *again;
    if (!again.ok() || miss(*again) < miss(*r)) r = std::move(again);
    if (r.ok() && attempt == kMatchAttempts) {
      std::fprintf(stderr, "fsdp_bench: kept the run at %.4f x the compute (%.4g GB/s)\n",
                   CommToCompute(*r), r->link_gbps);
    }
  }
  return r;
}

// On rank 0: the tables on stdout, then the files asked for. False when a file was not written.
bool Report(const Args& a, const std::vector<fsdp::BenchResult>& results) {
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
  PrintExposedPhases(results);
  if (a.repeat > 1) PrintPasses(results, a.repeat);
  std::fflush(stdout);
  bool written = true;
  if (!a.jsonl.empty()) {
    std::string text;
    for (const fsdp::BenchResult& r : results) {
      absl::StrAppend(&text, fsdp::BenchResultJson(r), "\n");
    }
    written &= WriteFile(a.jsonl, text, fsdp::kJsonLinesFile);
  }
  if (!a.csv.empty()) {
    std::string text = fsdp::BenchCsvHeader() + "\n";
    for (const fsdp::BenchResult& r : results) {
      absl::StrAppend(&text, fsdp::BenchCsvRow(r), "\n");
    }
    written &= WriteFile(a.csv, text, fsdp::kCsvFile);
  }
  if (!a.svg_dir.empty()) {
    const std::filesystem::path dir(a.svg_dir);
    written &= WriteFile((dir / "throughput.svg").string(), fsdp::ThroughputSvg(results),
                         fsdp::kSvgFile);
    written &= WriteFile((dir / "efficiency.svg").string(), fsdp::EfficiencySvg(results),
                         fsdp::kSvgFile);
    written &= WriteFile((dir / "step_split.svg").string(), fsdp::StepSplitSvg(results),
                         fsdp::kSvgFile);
  }
  return written;
}

int Main(int argc, char** argv) {
  const Args a = ParseArgs(argc, argv);
  if (a.project) {
    CheckOutputs(a);
    return RunProjection(a);
  }
  if (a.validate) return RunValidation(a);
  std::unique_ptr<fsdp::Communicator> mpi;
  if (std::optional<int> stop = JoinMpiIfLaunched(mpi); stop.has_value()) return *stop;
  const bool rank0 = mpi == nullptr || mpi->rank() == 0;
  if (mpi != nullptr && a.comm_to_compute > 0) {
    BadUsage("--comm_to_compute: the simulated link is the local communicator's (ranks as "
             "threads), not mpirun's");
  }
  std::vector<int> worlds = a.worlds;
  if (mpi != nullptr) worlds = {mpi->size()};
  // Outputs are checked before anything runs: nothing is written (or truncated) before the
  // end, and what is in the way is found now.
  if (rank0) CheckOutputs(a);
  const int max_world = *std::max_element(worlds.begin(), worlds.end());
  const int threads =
      a.threads > 0 ? a.threads : std::max(1, fsdp::HardwareThreads() / max_world);
  const std::vector<fsdp::BenchConfig> grid = MeasuredGrid(a, worlds, threads);
  if (rank0) {
    std::fprintf(
        stderr,
        "fsdp_bench: %s, %d thread(s) per rank, B=%d per rank, %d warm-up + "
        "%d measured steps each%s\n",
        a.repeat > 1 ? absl::StrCat(grid.size() * a.repeat, " runs (", grid.size(),
                                    " configurations x ", a.repeat, " passes)")
                           .c_str()
                     : absl::StrCat(grid.size(), " runs").c_str(),
        threads, a.batch, a.warmup, a.steps,
        mpi != nullptr ? absl::StrCat(", under mpirun (", mpi->size(), " ranks)").c_str() : "");
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
  const size_t runs = grid.size() * static_cast<size_t>(a.repeat);
  for (size_t i = 0; i < runs; ++i) {
    fsdp::BenchConfig c = grid[i % grid.size()];
    const int pass = static_cast<int>(i / grid.size()) + 1;
    if (a.peak_gflops > 0) {
      c.peak_gflops_per_core = a.peak_gflops;
      c.peak_kind = "given (--peak_gflops)";
    } else if (auto it = peaks.find(c.param_dtype); it != peaks.end()) {
      c.peak_gflops_per_core = it->second.gflops_per_core;
      c.peak_kind = it->second.kind;
    } else if (mpi == nullptr) {
      std::fprintf(stderr, "fsdp_bench: measuring the %s GEMM peak of one core ...\n",
                   fsdp::DTypeName(c.param_dtype).data());
      peaks[c.param_dtype] = fsdp::PeakGflopsPerCore(c.param_dtype);
      c.peak_gflops_per_core = peaks[c.param_dtype].gflops_per_core;
      c.peak_kind = peaks[c.param_dtype].kind;
    }
    if (rank0) {
      std::string eta = "ETA -";
      if (i > 0) {
        eta = absl::StrFormat("ETA %.0f s",
                              elapsed() / static_cast<double>(i) * static_cast<double>(runs - i));
      }
      std::fprintf(stderr, "fsdp_bench: [%zu/%zu done] running %s%s | %.0f s elapsed, %s\n", i,
                   runs, RunName(c, mpi != nullptr ? mpi->size() : c.world_size).c_str(),
                   a.repeat > 1 ? absl::StrCat(" (pass ", pass, " of ", a.repeat, ")").c_str() : "",
                   elapsed(), eta.c_str());
    }
    absl::StatusOr<fsdp::BenchResult> r = MeasureOne(a, c, mpi.get());
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
    r->pass = pass;
    results.push_back(*std::move(r));
  }
  if (rank0) {
    std::fprintf(stderr, "fsdp_bench: [%zu/%zu done] in %.0f s\n", runs, runs, elapsed());
  }
  fsdp::SetScalingEfficiency(results);
  const bool written = !rank0 || Report(a, results);
  const int rc = failed || !written ? 1 : 0;
  if (mpi != nullptr) {
    mpi.reset();
    return fsdp::FinishMpi(absl::OkStatus(), "fsdp_bench") == 0 ? rc : 1;
  }
  return rc;
}

}  // namespace
}  // namespace fsdp_bench

int main(int argc, char** argv) { return fsdp_bench::Main(argc, argv); }
