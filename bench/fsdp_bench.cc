// fsdp_bench: the scaling harness. Runs a grid of training configurations (models x strategies
// x world sizes x dtypes x activation checkpointing x prefetch) with fsdp::RunBench
// (fsdp/bench.h), prints a progress line per run to stderr and a table to stdout, and writes
// JSON lines, CSV and SVG plots. `fsdp_bench --project` predicts the same figures on a described
// cluster instead (fsdp/project.h), and `--validate_projection` checks the prediction against
// runs measured on the simulated link. `fsdp_bench --help` explains every option and figure;
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
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "fsdp/bench.h"
#include "fsdp/bench_report.h"
#include "fsdp/files.h"
#include "fsdp/cpu_backend.h"
#include "fsdp/mpi_world.h"
#include "fsdp/nn/model_config.h"
#include "fsdp/plan.h"
#include "fsdp/project.h"
#include "tools/command_line.h"

// The options, as absl::flags: kHelp above says what each does (fsdp_bench --help prints it).
// Every value is text, checked by SetOption, so that each error is one line of fsdp_bench's.
ABSL_FLAG(bool, project, false, "project instead of measuring");
ABSL_FLAG(bool, validate_projection, false, "measure and project on the simulated link");
#define FSDP_BENCH_OPTION(name) ABSL_FLAG(std::string, name, "", "see fsdp_bench --help")
FSDP_BENCH_OPTION(cluster);
FSDP_BENCH_OPTION(nodes);
FSDP_BENCH_OPTION(algorithm);
FSDP_BENCH_OPTION(project_from);
FSDP_BENCH_OPTION(peak_tflops);
FSDP_BENCH_OPTION(achieved);
FSDP_BENCH_OPTION(hbm_gbps);
FSDP_BENCH_OPTION(intra_eff);
FSDP_BENCH_OPTION(inter_eff);
FSDP_BENCH_OPTION(published);
FSDP_BENCH_OPTION(device_mem_gib);
FSDP_BENCH_OPTION(overlap_slowdown);
FSDP_BENCH_OPTION(compute_scale);
FSDP_BENCH_OPTION(calibrate);
FSDP_BENCH_OPTION(validate_links);
FSDP_BENCH_OPTION(models);
FSDP_BENCH_OPTION(layers);
FSDP_BENCH_OPTION(strategies);
FSDP_BENCH_OPTION(worlds);
FSDP_BENCH_OPTION(dtypes);
FSDP_BENCH_OPTION(checkpoint);
FSDP_BENCH_OPTION(prefetch);
FSDP_BENCH_OPTION(reduce_dtype);
FSDP_BENCH_OPTION(hybrid_shard);
FSDP_BENCH_OPTION(batch);
FSDP_BENCH_OPTION(seq);
FSDP_BENCH_OPTION(threads);
FSDP_BENCH_OPTION(warmup);
FSDP_BENCH_OPTION(steps);
FSDP_BENCH_OPTION(repeat);
FSDP_BENCH_OPTION(link_gbps);
FSDP_BENCH_OPTION(link_latency_us);
FSDP_BENCH_OPTION(ranks_per_host);
FSDP_BENCH_OPTION(inter_gbps);
FSDP_BENCH_OPTION(inter_latency_us);
FSDP_BENCH_OPTION(comm_to_compute);
FSDP_BENCH_OPTION(match_tolerance);
FSDP_BENCH_OPTION(jsonl);
FSDP_BENCH_OPTION(csv);
FSDP_BENCH_OPTION(svg_dir);
FSDP_BENCH_OPTION(peak_gflops);
#undef FSDP_BENCH_OPTION

namespace {

// The text options, in the order they are applied.
const std::vector<std::pair<const char*, absl::Flag<std::string>*>>& Options() {
  static const auto* options = new std::vector<std::pair<const char*, absl::Flag<std::string>*>>{
      {"cluster", &FLAGS_cluster},
      {"nodes", &FLAGS_nodes},
      {"algorithm", &FLAGS_algorithm},
      {"project_from", &FLAGS_project_from},
      {"peak_tflops", &FLAGS_peak_tflops},
      {"achieved", &FLAGS_achieved},
      {"hbm_gbps", &FLAGS_hbm_gbps},
      {"intra_eff", &FLAGS_intra_eff},
      {"inter_eff", &FLAGS_inter_eff},
      {"published", &FLAGS_published},
      {"device_mem_gib", &FLAGS_device_mem_gib},
      {"overlap_slowdown", &FLAGS_overlap_slowdown},
      {"compute_scale", &FLAGS_compute_scale},
      {"calibrate", &FLAGS_calibrate},
      {"validate_links", &FLAGS_validate_links},
      {"models", &FLAGS_models},
      {"layers", &FLAGS_layers},
      {"strategies", &FLAGS_strategies},
      {"worlds", &FLAGS_worlds},
      {"dtypes", &FLAGS_dtypes},
      {"checkpoint", &FLAGS_checkpoint},
      {"prefetch", &FLAGS_prefetch},
      {"reduce_dtype", &FLAGS_reduce_dtype},
      {"hybrid_shard", &FLAGS_hybrid_shard},
      {"batch", &FLAGS_batch},
      {"seq", &FLAGS_seq},
      {"threads", &FLAGS_threads},
      {"warmup", &FLAGS_warmup},
      {"steps", &FLAGS_steps},
      {"repeat", &FLAGS_repeat},
      {"link_gbps", &FLAGS_link_gbps},
      {"link_latency_us", &FLAGS_link_latency_us},
      {"ranks_per_host", &FLAGS_ranks_per_host},
      {"inter_gbps", &FLAGS_inter_gbps},
      {"inter_latency_us", &FLAGS_inter_latency_us},
      {"comm_to_compute", &FLAGS_comm_to_compute},
      {"match_tolerance", &FLAGS_match_tolerance},
      {"jsonl", &FLAGS_jsonl},
      {"csv", &FLAGS_csv},
      {"svg_dir", &FLAGS_svg_dir},
      {"peak_gflops", &FLAGS_peak_gflops},
  };
  return *options;
}

}  // namespace

namespace {

constexpr const char* kHelp = R"(fsdp_bench: training steps of the bundled models under a grid
of sharding configurations; prints a table and writes JSON lines, CSV and SVG plots.

Usage: fsdp_bench [options]     (each list is comma-separated; the grid is every combination)

Grid:
  --models LIST        bundled models (default nano): nano, mini, gpt2, ..., llama-nano,
                       llama-mini, ...
  --layers LIST        blocks of each model: 0 = the config's (default 0). Any other depth
                       runs the model's blocks and sizes with that many blocks, named e.g.
                       mini-L24 (how a schedule scales with depth; train_gpt's --layers)
  --strategies LIST    FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD, HYBRID_SHARD_GRAD_OP
                       (default FULL_SHARD)
  --worlds LIST        ranks, as threads of this process (default 1,2; at most 4096, with
                       --project 1048576). Under mpirun the world is the MPI job's and this
                       flag is ignored.
  --dtypes LIST        parameter (compute) dtype: f32, bf16, f16 (default f32)
  --checkpoint LIST    activation checkpointing: 0 (off) or k (every k-th block) (default 0)
  --prefetch LIST      forward/backward prefetch: 0 (off) or N, at most N units gathered ahead
                       of their use (default 1)
Each run:
  --reduce_dtype D     gradient reduction dtype: same (the parameter dtype), f32, bf16, f16
                       (default same)
  --hybrid_shard S     HYBRID strategies: ranks per shard group; 0 = --ranks_per_host when set,
                       else the whole world. A world smaller than S uses one group. (default 0)
  --batch B            sequences per rank and step, B (default 4, at most 1048576): weak
                       scaling, the global batch is B x world size
  --seq T              sequence length (default 64; 0 = the model's block size)
  --threads N          OpenMP threads per rank; 0 = the cores divided by the largest world of
                       the grid, the same for every run so that runs compare per rank (default 0)
  --warmup N           warm-up steps, not measured (default 2)
  --steps N            measured steps (default 5)
  --repeat N           runs the whole grid N times over (1-100, default 1), one configuration
                       after the other in each pass, so that a shared machine's drift falls on
                       every configuration alike; each run is kept (its `pass` in the files,
                       its efficiency against the 1-rank run of the same pass), and a last
                       table gives each configuration's median and range over the passes
Simulated link (the local communicator; 0 = off):
  --link_gbps G        bandwidth between two ranks of a host, GB/s (1e9 bytes/s)
  --link_latency_us U  latency per transfer inside a host, microseconds
  --ranks_per_host R   ranks per simulated host (0 = one host, one level of link); it must
                       divide each world size; a world smaller than R is one host
  --inter_gbps G       bandwidth between hosts, GB/s
  --inter_latency_us U latency per transfer between hosts, microseconds
  --comm_to_compute F  instead of --link_gbps / --inter_gbps: before each run, the same run
                       without a link (2 warm-up + 3 steps) measures its compute (compute +
                       opt + other) and bytes, and both levels get the bandwidth at which the
                       step's bytes take F times that compute (F = 1: a link as slow as the
                       compute); a second short run with that link measures the copies and
                       latency on top, and the bandwidth is corrected for them. A run whose
                       comm ms then misses F x (compute + opt + other) by more than
                       --match_tolerance (the compute of a shared machine drifts) runs again
                       with the bandwidth corrected from that run's figures, up to 3 runs, and
                       the one closest to F is kept. The bandwidth is printed and in the files
                       (link_gbps)
  --match_tolerance T  with --comm_to_compute: the relative miss a run may have (default 0.05)
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
  by phase      (a second table, for runs that exposed at least 1%; exposed_*_s in the
                files) the exposed communication by where the step waited: start (before
                the first block: the first gathers), forward, head (last forward block to
                first backward block), backward, tail (last backward block to the
                optimizer: reductions still in flight), opt (the global norm's collective);
                comm/cmp = comm ms / (compute + opt + other): 1 for a link as slow as the
                compute, and what the link takes beyond 1 is exposed whatever the schedule
  comm MiB      per rank per step, counted from the collectives the rank ran: the sum of
                their sizes (nccl-tests' S) in the files, and bus bytes S(n-1)/n for
                all_gather and reduce_scatter, 2S(n-1)/n for all_reduce (the table's figure).
  comm ms       per rank per step, the collectives' own time added up (each less the time it
                waited for its peers): with a simulated link, what the step's bytes take on
                it. A link "as slow as the compute" makes it compute + opt + other.
  peak MiB      the runtime's MemoryReport peak per rank (the largest rank); the files hold
                every category.
  syncs         host synchronisations per step (StepStats::host_syncs).
  efficiency    weak scaling: tokens/s at N / (N x tokens/s of the 1-rank run of the same
                configuration), when the grid has that run (e.g. --worlds 1,2,4).

Projection (docs/scaling.md, "Projection"; nothing is trained unless said):
  --project            predict step time, exposed communication and scaling efficiency of
                       every run of the grid on a described cluster instead of measuring it,
                       printing every assumption. The grid: --models x --strategies x worlds x
                       --dtypes x --checkpoint x --prefetch, B = --batch, T = --seq.
  --cluster NAME       presets for the flags below: p5 (p5.48xlarge: 8 x H100 SXM, 989
                       TFLOP/s bf16, NVLink 900 GB/s both ways = 450 GB/s per direction, EFA
                       3,200 Gbit/s = 400 GB/s per node), p4de (p4de.24xlarge: 8 x A100 80GB,
                       312 TFLOP/s, NVLink 600 = 300 GB/s per direction, EFA 400 Gbit/s = 50
                       GB/s), or custom (default: nothing preset). Flags given override them.
  --nodes LIST         hosts; each world is nodes x --ranks_per_host (instead of --worlds),
                       at most 1048576 ranks
  --ranks_per_host R   (with --project) devices per host
  --link_gbps G        (with --project) a device's link inside a host, GB/s per direction
  --link_latency_us U  (with --project) latency per hop (ring) or transfer (simulated) inside
                       a host
  --inter_gbps G       (with --project) between hosts: ring / hierarchical: the host's whole
                       network, GB/s per direction; simulated: between two ranks of two hosts
  --inter_latency_us U (with --project) latency per hop / transfer between hosts
  --algorithm A        how collectives cost: ring (NCCL's ring; default with a preset),
                       hierarchical (among hosts, then inside), simulated (the local
                       communicator's simulated link, as measured runs charge it; default
                       otherwise)
  --intra_eff F, --inter_eff LIST
                       fraction of each bandwidth collectives achieve (ring, hierarchical;
                       default 0.8 with a preset, else 1); several --inter_eff values project
                       every run for each (a sensitivity)
  --published E@N      with --svg_dir: mark a published efficiency E at N devices on the
                       projected efficiency plot (e.g. 0.87@128)
  --project_from S     where compute times come from: flops (MODEL_SPEC.md FLOPs at
                       --peak_tflops x --achieved; default with a preset) or measured (one
                       1-rank run of the model here, link off, each time x --compute_scale;
                       default otherwise)
  --peak_tflops F      device dense peak in the compute dtype, TFLOP/s
  --achieved F         fraction of the peak the matmuls reach (default 0.5 with a preset)
  --hbm_gbps G         device memory bandwidth, GB/s (the optimizer step is memory-bound)
  --device_mem_gib G   device memory: each run's memory plan (fsdp::PlanMemory) says if it fits
  --compute_scale F    measured compute times are multiplied by F (default 1)
  --overlap_slowdown F compute runs at 1 - F of its speed while a collective runs beside it
                       (GPU: NCCL's kernels share the device; default 0)
  --validate_projection
                       measure and project on the simulated link: per world of --worlds one
                       calibration run (FULL_SHARD, link off, prefetch on) gives the compute per
                       block and the waits without a link; then every --strategies x --worlds x
                       --validate_links x --prefetch run is measured with the link and projected
                       from the link and (cal) the calibration's compute, (own) the run's own
                       compute spans; prints measured against predicted step time and exposed
                       communication, the errors, their median and the worst
  --validate_links LIST
                       simulated links, each INTRA:INTER in GB/s (inter needs
                       --ranks_per_host), e.g. 1:0.05,0.5:0.1; latencies from
                       --link_latency_us and --inter_latency_us
  --calibrate C        world (default): one calibration run per world, as above; each: before
                       every measured run, the same run with the link off (its compute and
                       waits), so that a shared machine's drifting speed hurts less

Exit status: 0 when every run succeeded, 1 when a run failed, 2 for bad flags.
)";

struct Args {
  std::vector<std::string> models = {"nano"};
  std::vector<int> layers = {0};
  // Each entry of `models` after --layers expanded it, by its name ("mini", "mini-L24").
  std::map<std::string, fsdp::nn::ModelConfig> configs;
  std::vector<fsdp::ShardingStrategy> strategies = {fsdp::ShardingStrategy::kFullShard};
  std::vector<int> worlds = {1, 2};
  std::vector<fsdp::DType> dtypes = {fsdp::DType::kF32};
  std::vector<int> checkpoint = {0};
  std::vector<int> prefetch = {1};
  std::string reduce_dtype = "same";
  int hybrid_shard = 0, batch = 4, seq = 64, threads = 0, warmup = 2, steps = 5, repeat = 1;
  double link_gbps = 0, link_latency_us = 0, inter_gbps = 0, inter_latency_us = 0;
  double comm_to_compute = 0;  // > 0: each run's link set from its compute (--comm_to_compute)
  double match_tolerance = 0.05;  // --match_tolerance: how far from it a run may come
  int ranks_per_host = 0;
  std::string jsonl, csv, svg_dir;
  double peak_gflops = 0;
  // Projection.
  bool project = false, validate = false;
  std::string cluster = "custom", algorithm, project_from;
  std::vector<int> nodes;
  std::vector<double> inter_effs;
  double published_eff = 0;
  int published_world = 0;
  double peak_tflops = 0, achieved = 0, hbm_gbps = 0, intra_eff = 0,
         device_mem_gib = 0, compute_scale = 1, overlap_slowdown = 0;
  std::vector<std::pair<double, double>> validate_links;
  bool calibrate_each = false;
  std::set<std::string> given;  // the flags on the command line
};

// Bounds on the sizes of a run (docs/scaling.md). Measured runs are ranks as threads of this
// process, as many as LocalWorld takes; a projection is a replay whose collectives cost the
// same however many ranks they span, up to the memory planner's world (fsdp/plan.h). B up to
// the largest micro-batch the planner searches (LargestMicroBatch).
constexpr int kMaxMeasuredWorld = 4096;
constexpr int kMaxProjectedWorld = fsdp::kMaxPlanWorldSize;
constexpr int kMaxBatch = 1 << 20;

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

fsdp::DType FloatDTypeFlag(const std::string& flag, const std::string& v) {
  const std::optional<fsdp::DType> d = fsdp::ParseDType(v);
  if (d.has_value() && fsdp::IsFloat16Or32(*d)) return *d;
  BadUsage(absl::StrCat(flag, ": '", v, "' is not f32, bf16 or f16"));
}

// One option of the command line (after absl::flags parsed it) into `a`, checked: bad usage
// names the flag, the value and what is allowed.
void SetOption(Args& a, const std::string& k, const std::string& v) {
  a.given.insert(k);
  if (k == "--cluster") {
    if (v != "p5" && v != "p4de" && v != "custom") {
      BadUsage(absl::StrCat("--cluster: '", v, "' is not p5, p4de or custom"));
    }
    a.cluster = v;
  } else if (k == "--nodes") {
    a.nodes.clear();
    for (const std::string& x : List(k, v)) a.nodes.push_back(ParseInt(k, x, 1));
  } else if (k == "--algorithm") {
    if (!fsdp::ParseCollectiveAlgorithm(v).ok()) {
      BadUsage(absl::StrCat("--algorithm: '", v, "' is not ring, hierarchical or simulated"));
    }
    a.algorithm = v;
  } else if (k == "--project_from") {
    if (v != "flops" && v != "measured") {
      BadUsage(absl::StrCat("--project_from: '", v, "' is not flops or measured"));
    }
    a.project_from = v;
  } else if (k == "--peak_tflops") {
    a.peak_tflops = ParseDouble(k, v);
  } else if (k == "--achieved") {
    a.achieved = ParseDouble(k, v);
    if (a.achieved <= 0 || a.achieved > 1) {
      BadUsage(absl::StrCat("--achieved=", v, ": allowed: a fraction in (0, 1]"));
    }
  } else if (k == "--hbm_gbps") {
    a.hbm_gbps = ParseDouble(k, v);
  } else if (k == "--intra_eff") {
    a.intra_eff = ParseDouble(k, v);
    if (a.intra_eff <= 0 || a.intra_eff > 1) {
      BadUsage(absl::StrCat(k, "=", v, ": allowed: a fraction in (0, 1]"));
    }
  } else if (k == "--inter_eff") {
    a.inter_effs.clear();
    for (const std::string& x : List(k, v)) {
      const double e = ParseDouble(k, x);
      if (e <= 0 || e > 1) BadUsage(absl::StrCat(k, "=", x, ": allowed: fractions in (0, 1]"));
      a.inter_effs.push_back(e);
    }
  } else if (k == "--published") {
    std::vector<std::string> parts = absl::StrSplit(v, '@');
    if (parts.size() != 2 || !absl::SimpleAtod(parts[0], &a.published_eff) ||
        !absl::SimpleAtoi(parts[1], &a.published_world) || a.published_eff <= 0 ||
        a.published_world < 1) {
      BadUsage(absl::StrCat("--published=", v, ": allowed: E@N, e.g. 0.87@128"));
    }
  } else if (k == "--device_mem_gib") {
    a.device_mem_gib = ParseDouble(k, v);
  } else if (k == "--overlap_slowdown") {
    a.overlap_slowdown = ParseDouble(k, v);
    if (a.overlap_slowdown >= 1) {
      BadUsage(absl::StrCat("--overlap_slowdown=", v, ": allowed: a fraction in [0, 1)"));
    }
  } else if (k == "--compute_scale") {
    a.compute_scale = ParseDouble(k, v);
    if (a.compute_scale <= 0) BadUsage(absl::StrCat("--compute_scale=", v, ": allowed: > 0"));
  } else if (k == "--calibrate") {
    if (v != "each" && v != "world") {
      BadUsage(absl::StrCat("--calibrate: '", v, "' is not each or world"));
    }
    a.calibrate_each = v == "each";
  } else if (k == "--validate_links") {
    a.validate_links.clear();
    for (const std::string& x : List(k, v)) {
      std::vector<std::string> parts = absl::StrSplit(x, ':');
      double intra = 0, inter = 0;
      if (parts.size() > 2 || !absl::SimpleAtod(parts[0], &intra) || intra <= 0 ||
          !std::isfinite(intra) ||
          (parts.size() == 2 && (!absl::SimpleAtod(parts[1], &inter) || inter <= 0 ||
                                 !std::isfinite(inter)))) {
        BadUsage(absl::StrCat("--validate_links: '", x,
                              "' is not INTRA or INTRA:INTER, GB/s > 0 (e.g. 1:0.05)"));
      }
      a.validate_links.push_back({intra, inter});
    }
  } else if (k == "--models") {
    a.models = List(k, v);
    for (const std::string& m : a.models) {
      if (!fsdp::nn::ModelConfig::FromName(m).ok()) {
        BadUsage(absl::StrCat("--models: unknown model '", m, "' (known: ",
                              absl::StrJoin(fsdp::nn::ModelConfig::Names(), ", "), ")"));
      }
    }
  } else if (k == "--layers") {
    a.layers.clear();
    for (const std::string& s : List(k, v)) a.layers.push_back(ParseInt(k, s, 0));
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
    for (const std::string& s : List(k, v)) a.dtypes.push_back(FloatDTypeFlag(k, s));
  } else if (k == "--checkpoint") {
    a.checkpoint.clear();
    for (const std::string& s : List(k, v)) a.checkpoint.push_back(ParseInt(k, s, 0));
  } else if (k == "--prefetch") {
    a.prefetch.clear();
    for (const std::string& s : List(k, v)) {
      int n = 0;
      if (!absl::SimpleAtoi(s, &n) || n < 0 || n > 8) {
        BadUsage(absl::StrCat("--prefetch: '", s, "' is not 0 (off) or 1 to 8 units ahead"));
      }
      a.prefetch.push_back(n);
    }
  } else if (k == "--reduce_dtype") {
    if (v != "same") FloatDTypeFlag(k, v);
    a.reduce_dtype = v;
  } else if (k == "--hybrid_shard") {
    a.hybrid_shard = ParseInt(k, v, 0);
  } else if (k == "--batch") {
    a.batch = ParseInt(k, v, 1);
    if (a.batch > kMaxBatch) {
      BadUsage(absl::StrCat("--batch=", v, ": allowed: 1 to ", kMaxBatch,
                            " sequences per rank"));
    }
  } else if (k == "--seq") {
    a.seq = ParseInt(k, v, 0);
  } else if (k == "--threads") {
    a.threads = ParseInt(k, v, 0);
  } else if (k == "--warmup") {
    a.warmup = ParseInt(k, v, 0);
  } else if (k == "--steps") {
    a.steps = ParseInt(k, v, 1);
  } else if (k == "--repeat") {
    a.repeat = ParseInt(k, v, 1);
    if (a.repeat > 100) BadUsage(absl::StrCat("--repeat=", v, ": allowed: 1 to 100 passes"));
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
  } else if (k == "--comm_to_compute") {
    a.comm_to_compute = ParseDouble(k, v);
    if (a.comm_to_compute <= 0) {
      BadUsage(absl::StrCat("--comm_to_compute=", v, ": allowed: a ratio > 0 (1: as slow as "
                            "the compute)"));
    }
  } else if (k == "--match_tolerance") {
    a.match_tolerance = ParseDouble(k, v);
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

Args ParseArgs(int argc, char** argv) {
  const std::set<std::string> flags_given =
      fsdp::cli::CheckFlagsBeforeParsing(argc, argv, kHelp, BadUsage);
  const std::vector<char*> positional = fsdp::cli::ParseCommandLine(argc, argv);
  if (positional.size() > 1) {
    BadUsage(absl::StrCat("unexpected argument '", positional[1], "': flags start with --"));
  }
  Args a;
  auto given = [&](const char* name) { return flags_given.count(name) > 0; };
  for (const auto& [name, flag] : Options()) {
    if (given(name)) SetOption(a, absl::StrCat("--", name), absl::GetFlag(*flag));
  }
  if (given("project")) a.given.insert("--project");
  if (given("validate_projection")) a.given.insert("--validate_projection");
  a.project = absl::GetFlag(FLAGS_project);
  a.validate = absl::GetFlag(FLAGS_validate_projection);
  // Projection: the cluster's presets fill what the command line did not give.
  auto unset = [&](const char* flag) { return a.given.count(flag) == 0; };
  if (a.project && a.validate) {
    BadUsage("--project and --validate_projection: give one of them");
  }
  if (!a.project && !a.validate) {
    for (const char* flag : {"--cluster", "--nodes", "--algorithm", "--project_from",
                             "--peak_tflops", "--achieved", "--hbm_gbps", "--intra_eff",
                             "--inter_eff", "--device_mem_gib", "--compute_scale", "--published",
                             "--overlap_slowdown"}) {
      if (!unset(flag)) BadUsage(absl::StrCat(flag, ": needs --project"));
    }
  }
  if (!a.validate && !unset("--validate_links")) {
    BadUsage("--validate_links: needs --validate_projection");
  }
  if (!a.validate && !unset("--calibrate")) BadUsage("--calibrate: needs --validate_projection");
  if (!unset("--repeat") && (a.project || a.validate)) {
    BadUsage("--repeat: measured runs only (not --project or --validate_projection)");
  }
  if (!unset("--match_tolerance") && a.comm_to_compute <= 0) {
    BadUsage("--match_tolerance: needs --comm_to_compute");
  }
  if (a.comm_to_compute > 0) {
    if (a.project || a.validate) {
      BadUsage("--comm_to_compute: measured runs only (not --project or --validate_projection)");
    }
    if (!unset("--link_gbps") || !unset("--inter_gbps")) {
      BadUsage("--comm_to_compute: sets the link's bandwidth itself; drop --link_gbps and "
               "--inter_gbps");
    }
  }
  // Ranks: threads of this process when measured, a replay's groups when projected.
  const int max_world = a.project ? kMaxProjectedWorld : kMaxMeasuredWorld;
  const char* what_world =
      a.project ? "ranks (--project)"
                : "ranks, as threads of this process (--project goes to 1048576)";
  for (auto [flag, v] : {std::pair<const char*, int>{"--ranks_per_host", a.ranks_per_host},
                         {"--hybrid_shard", a.hybrid_shard}}) {
    if (v > max_world) {
      BadUsage(absl::StrCat(flag, "=", v, ": allowed: 0 to ", max_world, " ", what_world));
    }
  }
  if (a.project) {
    const bool p5 = a.cluster == "p5", p4de = a.cluster == "p4de";
    if (p5 || p4de) {
      if (unset("--ranks_per_host")) a.ranks_per_host = 8;
      if (unset("--peak_tflops")) a.peak_tflops = p5 ? 989 : 312;
      if (unset("--achieved")) a.achieved = 0.5;
      if (unset("--hbm_gbps")) a.hbm_gbps = p5 ? 3350 : 2039;
      if (unset("--link_gbps")) a.link_gbps = p5 ? 450 : 300;
      if (unset("--link_latency_us")) a.link_latency_us = 2;
      if (unset("--inter_gbps")) a.inter_gbps = p5 ? 400 : 50;
      if (unset("--inter_latency_us")) a.inter_latency_us = 15;
      if (unset("--intra_eff")) a.intra_eff = 0.8;
      if (unset("--inter_eff")) a.inter_effs = {0.8};
      if (unset("--device_mem_gib")) a.device_mem_gib = 80;
      if (unset("--algorithm")) a.algorithm = "ring";
      if (unset("--project_from")) a.project_from = "flops";
      if (unset("--dtypes")) a.dtypes = {fsdp::DType::kBF16};
    }
    if (a.algorithm.empty()) a.algorithm = "simulated";
    if (a.project_from.empty()) a.project_from = a.peak_tflops > 0 ? "flops" : "measured";
    if (a.intra_eff == 0) a.intra_eff = 1;
    if (a.inter_effs.empty()) a.inter_effs = {1.0};
    if (a.project_from == "flops") {
      if (a.peak_tflops <= 0) BadUsage("--project_from flops: needs --peak_tflops (or --cluster)");
      if (a.achieved <= 0) BadUsage("--project_from flops: needs --achieved (or --cluster)");
      if (a.hbm_gbps <= 0) BadUsage("--project_from flops: needs --hbm_gbps (or --cluster)");
    }
    if (!a.nodes.empty()) {
      if (a.ranks_per_host <= 0) BadUsage("--nodes: needs --ranks_per_host (devices per host)");
      // Hosts x ranks per host within the projection's world (so the product fits an int).
      const int max_hosts = kMaxProjectedWorld / a.ranks_per_host;
      a.worlds.clear();
      for (int n : a.nodes) {
        if (n > max_hosts) {
          BadUsage(absl::StrCat("--nodes=", n, ": allowed: 1 to ", max_hosts, " hosts of ",
                                "--ranks_per_host=", a.ranks_per_host, " (at most ",
                                kMaxProjectedWorld, " ranks in all)"));
        }
        a.worlds.push_back(n * a.ranks_per_host);
      }
    }
  } else if (!a.nodes.empty()) {
    BadUsage("--nodes: needs --project");
  }
  for (int w : a.worlds) {
    if (w > max_world) {
      BadUsage(absl::StrCat("--worlds=", w, ": allowed: 1 to ", max_world, " ", what_world));
    }
  }
  if (a.validate) {
    if (a.validate_links.empty()) {
      BadUsage("--validate_projection: needs --validate_links (the simulated links to measure)");
    }
    for (const auto& [intra, inter] : a.validate_links) {
      if (inter > 0 && a.ranks_per_host == 0) {
        BadUsage("--validate_links INTRA:INTER: needs --ranks_per_host (the ranks of one host)");
      }
    }
  }
  if (a.threads > fsdp::HardwareThreads()) {
    BadUsage(absl::StrCat("--threads=", a.threads, ": allowed: 0 (automatic) to the ",
                          fsdp::HardwareThreads(), " hardware threads"));
  }
  // Every model at every depth of --layers, named by its depth when it is not the config's.
  std::vector<std::string> expanded;
  for (const std::string& m : a.models) {
    const fsdp::nn::ModelConfig base = *fsdp::nn::ModelConfig::FromName(m);
    for (int layers : a.layers) {
      fsdp::nn::ModelConfig mc = base;
      std::string name = m;
      if (layers > 0 && layers != base.num_layers()) {
        name = absl::StrCat(m, "-L", layers);
        if (base.is_gpt()) {
          fsdp::nn::GptConfig g = base.gpt();
          g.num_layers = layers;
          g.name = name;
          mc = g;
        } else {
          fsdp::nn::LlamaConfig l = base.llama();
          l.num_layers = layers;
          l.name = name;
          mc = l;
        }
      }
      if (absl::Status v = mc.Validate(); !v.ok()) {
        BadUsage(absl::StrCat("--layers=", layers, " with --models ", m, ": ", v.message()));
      }
      if (a.configs.emplace(name, mc).second) expanded.push_back(name);
    }
  }
  a.models = expanded;
  // Sequence lengths against every model's block size.
  for (const std::string& m : a.models) {
    const int block = a.configs.at(m).block_size();
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

fsdp::DType wl_reduce(const Args& a, fsdp::DType d) {
  return a.reduce_dtype == "same" ? d : FloatDTypeFlag("--reduce_dtype", a.reduce_dtype);
}

std::string Mib(double bytes) { return absl::StrFormat("%.2f", bytes / (1 << 20)); }

std::string RunName(const fsdp::BenchConfig& c, int world) {
  std::string s = absl::StrCat(c.model, " ", std::string(fsdp::StrategyName(c.strategy)), " ",
                               world, world == 1 ? " rank " : " ranks ",
                               std::string(fsdp::DTypeName(c.param_dtype)));
  if (c.checkpoint_every > 0) absl::StrAppend(&s, " ckpt ", c.checkpoint_every);
  absl::StrAppend(&s, c.prefetch == 0   ? " no-prefetch"
                     : c.prefetch == 1 ? " prefetch"
                                       : absl::StrCat(" prefetch ", c.prefetch));
  return s;
}

// The model column: as wide as the longest name of the results ("llama-mini-L32"), at least 10.
int ModelWidth(const std::vector<fsdp::BenchResult>& rs) {
  size_t w = 10;
  for (const fsdp::BenchResult& r : rs) w = std::max(w, r.model.size());
  return static_cast<int>(w);
}

void PrintTable(const std::vector<fsdp::BenchResult>& rs) {
  const int mw = ModelWidth(rs);
  std::printf("%-*s %-20s %3s %5s %-5s %4s %3s %10s %17s %6s %28s %6s %9s %8s %8s %5s %6s\n", mw,
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
    std::printf(
        "%-*s %-20s %3d %5d %-5s %4d %3d %10.0f %17s %6.2f %28s %6.1f %9s %8.1f %8s %5.1f %6s\n",
        mw, r.model.c_str(), r.strategy.c_str(), r.world_size, r.hybrid_shard_size,
        fsdp::DTypeName(r.param_dtype).data(), r.checkpoint_every, r.prefetch, r.tokens_per_s,
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
                        std::string(fsdp::DTypeName(r.reduce_dtype)), "|", r.checkpoint_every, "|",
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

// ---- projection --------------------------------------------------------------------------------

int ShardSize(fsdp::ShardingStrategy s, int world, int hybrid_shard, int ranks_per_host) {
  if (s == fsdp::ShardingStrategy::kNoShard) return 1;
  if (s != fsdp::ShardingStrategy::kHybridShard &&
      s != fsdp::ShardingStrategy::kHybridShardGradOp) {
    return world;
  }
  const int shard = hybrid_shard > 0 ? hybrid_shard : ranks_per_host;
  return shard > 0 && shard <= world && world % shard == 0 ? shard : world;
}

fsdp::BenchConfig BaseConfig(const Args& a, const std::string& model, fsdp::DType dtype,
                             int checkpoint, int threads) {
  fsdp::BenchConfig c;
  c.model = model;
  c.config = a.configs.at(model);
  c.param_dtype = dtype;
  c.reduce_dtype = a.reduce_dtype == "same" ? dtype : FloatDTypeFlag("", a.reduce_dtype);
  c.checkpoint_every = checkpoint;
  c.batch_size = a.batch;
  c.seq_len = a.seq;
  c.threads_per_rank = threads;
  c.warmup_steps = a.warmup;
  c.steps = a.steps;
  if (a.peak_gflops > 0) {
    c.peak_gflops_per_core = a.peak_gflops;
    c.peak_kind = "given (--peak_gflops)";
  } else {
    c.peak_gflops_per_core = 1;  // MFU is not used here: skip measuring the peak
    c.peak_kind = "not measured";
  }
  return c;
}

std::string Gbps(double bytes_per_s) { return absl::StrFormat("%g GB/s", bytes_per_s / 1e9); }

int RunProjection(const Args& a) {
  fsdp::LinkSpec link;
  link.algorithm = *fsdp::ParseCollectiveAlgorithm(a.algorithm);
  link.ranks_per_host = a.ranks_per_host;
  link.intra_bytes_per_s = a.link_gbps * 1e9;
  link.intra_latency_s = a.link_latency_us * 1e-6;
  link.inter_bytes_per_s = a.inter_gbps * 1e9;
  link.inter_latency_s = a.inter_latency_us * 1e-6;
  link.intra_efficiency = a.intra_eff;
  link.inter_efficiency = a.inter_effs.front();
  const bool flops = a.project_from == "flops";
  const int threads = a.threads > 0 ? a.threads : 1;

  std::printf("fsdp_bench --project: predicted, not measured. Assumptions:\n");
  std::printf("  cluster: %s; %s per host\n", a.cluster.c_str(),
              a.ranks_per_host > 0 ? absl::StrCat(a.ranks_per_host, " devices").c_str()
                                   : "all devices on one host");
  if (flops) {
    std::printf("  compute: MODEL_SPEC.md FLOPs at %g TFLOP/s dense peak x %g achieved = %g "
                "TFLOP/s per device: block forward 2 P_block BT + 4 C T BT, backward 2x forward, "
                "recompute 1x forward (checkpointed blocks), head 6 V C BT (forward + backward); "
                "embedding, norms, element-wise work and host work free\n",
                a.peak_tflops, a.achieved, a.peak_tflops * a.achieved);
    std::printf("  optimizer: AdamW on the rank's shard, 28 bytes per parameter at %g GB/s "
                "(memory-bound)\n", a.hbm_gbps);
  } else {
    std::printf("  compute: measured here, one rank (%d thread(s)), link off, per block and "
                "around the blocks, x %g\n", threads, a.compute_scale);
  }
  std::printf("  collectives: %s", std::string(fsdp::CollectiveAlgorithmName(link.algorithm)).c_str());
  if (link.algorithm == fsdp::CollectiveAlgorithm::kSimulatedLink) {
    std::printf(" (the local communicator's charge: latency + chunk / bandwidth per peer)\n");
  } else {
    std::printf(" (bus bandwidth = the slowest leg at the achieved fractions; the hosts' "
                "network shared by the groups that run at once)\n");
  }
  std::printf("  inside a host: %s per device and direction x %g achieved, %g us per hop\n",
              Gbps(link.intra_bytes_per_s).c_str(), link.intra_efficiency, a.link_latency_us);
  if (a.ranks_per_host > 0) {
    std::vector<std::string> effs;
    for (double e : a.inter_effs) effs.push_back(absl::StrFormat("%g", e));
    std::printf("  between hosts: %s per %s and direction x %s achieved, %g us per hop\n",
                Gbps(link.inter_bytes_per_s).c_str(),
                link.algorithm == fsdp::CollectiveAlgorithm::kSimulatedLink ? "pair of ranks"
                                                                            : "host",
                absl::StrJoin(effs, " / ").c_str(), a.inter_latency_us);
  }
  std::printf("  overlap: the runtime's schedule replayed (prefetch up to N units ahead, at most "
              "max(2, N + 1) reductions in flight, one serial queue per communicator); %s\n",
              a.overlap_slowdown > 0
                  ? absl::StrFormat("compute runs at %g of its speed while a collective runs "
                                    "beside it", 1 - a.overlap_slowdown).c_str()
                  : "compute runs at full speed beside collectives");
  std::printf("  batch: B=%d sequences per device, T=%s; weak scaling (the global batch grows "
              "with the devices)\n", a.batch,
              a.seq > 0 ? absl::StrCat(a.seq).c_str() : "the block size");
  if (a.device_mem_gib > 0) {
    std::printf("  memory: fsdp::PlanMemory per run against %g GiB per device\n",
                a.device_mem_gib);
  }
  std::printf("  efficiency: tokens/s per device against the same strategy's smallest world "
              "of the grid\n\n");

  struct Row {
    std::string model, strategy;
    fsdp::DType dtype;
    int ckpt, prefetch, world, shard;
    double inter_eff;
    fsdp::Projection p;
    double flops_per_rank;
    double eff = 0;
    std::string mem;
  };
  std::vector<Row> rows;
  std::set<std::string> plan_errors;  // why a run's mem GiB is "-"
  for (const std::string& m : a.models) {
    const fsdp::nn::ModelConfig& mc = a.configs.at(m);
    for (fsdp::DType d : a.dtypes) {
      for (int ck : a.checkpoint) {
        std::optional<fsdp::StepProfile> measured;
        if (!flops) {
          fsdp::BenchConfig c = BaseConfig(a, m, d, ck, threads);
          c.world_size = 1;
          std::fprintf(stderr, "fsdp_bench: measuring %s on 1 rank for its compute profile\n",
                       m.c_str());
          absl::StatusOr<fsdp::BenchResult> r = fsdp::RunBench(c);
          if (!r.ok()) {
            std::fprintf(stderr, "fsdp_bench: %s\n", r.status().ToString().c_str());
            return 1;
          }
          absl::StatusOr<fsdp::StepProfile> p = fsdp::ProfileFromBench(*r, mc);
          if (!p.ok()) {
            std::fprintf(stderr, "fsdp_bench: %s\n", p.status().ToString().c_str());
            return 1;
          }
          const double k = a.compute_scale;
          for (auto* v : {&p->block_forward_s, &p->block_backward_s, &p->block_recompute_s}) {
            for (double& x : *v) x *= k;
          }
          for (double* x : {&p->before_blocks_s, &p->forward_gaps_s, &p->head_s,
                            &p->backward_gaps_s, &p->after_blocks_s, &p->optimizer_s,
                            &p->after_optimizer_s}) {
            *x *= k;
          }
          measured = *p;
        }
        for (double ie : a.inter_effs) {
        for (fsdp::ShardingStrategy st : a.strategies) {
          for (int pf : a.prefetch) {
            for (int w : a.worlds) {
              const int shard = ShardSize(st, w, a.hybrid_shard, a.ranks_per_host);
              fsdp::StepProfile profile;
              if (flops) {
                fsdp::DeviceSpec dev{a.cluster, a.peak_tflops * 1e12, a.achieved, a.hbm_gbps * 1e9};
                fsdp::FlopsWorkload wl;
                wl.batch_size = a.batch;
                wl.seq_len = a.seq;
                wl.param_dtype = d;
                wl.reduce_dtype = a.reduce_dtype == "same" ? d : FloatDTypeFlag("", a.reduce_dtype);
                wl.checkpoint_every = ck;
                absl::StatusOr<fsdp::StepProfile> p = fsdp::ProfileFromFlops(mc, dev, wl, shard);
                if (!p.ok()) {
                  std::fprintf(stderr, "fsdp_bench: %s\n", p.status().ToString().c_str());
                  return 1;
                }
                profile = *p;
              } else {
                profile = *measured;
                // The optimizer updates the rank's shard: 1/shard of the 1-rank run's.
                profile.optimizer_s /= shard;
              }
              fsdp::ProjectionRun run;
              run.strategy = st;
              run.world_size = w;
              run.hybrid_shard_size = shard;
              run.prefetch = pf;
              run.overlap_slowdown = a.overlap_slowdown;
              fsdp::LinkSpec l = link;
              l.inter_efficiency = ie;
              if (l.ranks_per_host > w) l.ranks_per_host = w;
              absl::StatusOr<fsdp::Projection> p = fsdp::ProjectStep(profile, l, run);
              if (!p.ok()) {
                std::fprintf(stderr, "fsdp_bench: %s\n", p.status().ToString().c_str());
                return 1;
              }
              Row row{m, std::string(fsdp::StrategyName(st)), d, ck, pf, w, shard, ie, *p,
                      profile.model_flops_per_rank, 0.0, std::string()};
              fsdp::PlanRequest req;
              req.model = m;
              req.config = mc;
              req.world_size = w;
              req.ranks_per_host = a.ranks_per_host > 0 && a.ranks_per_host <= w ? a.ranks_per_host : 0;
              req.strategy = st;
              req.hybrid_shard_size = shard;
              req.param_dtype = d;
              req.reduce_dtype = wl_reduce(a, d);
              req.checkpoint_every = ck;
              req.batch_size = a.batch;
              req.seq_len = a.seq;
              req.device_memory_bytes =
                  static_cast<int64_t>(a.device_mem_gib * static_cast<double>(int64_t{1} << 30));
              absl::StatusOr<fsdp::MemoryPlan> plan = fsdp::PlanMemory(req);
              row.mem = plan.ok() ? absl::StrFormat("%.1f%s", static_cast<double>(plan->peak_bytes) /
                                                                  (int64_t{1} << 30),
                                                    a.device_mem_gib > 0
                                                        ? (plan->fits ? " fits" : " NO")
                                                        : "")
                                  : std::string("-");
              if (!plan.ok()) plan_errors.insert(std::string(plan.status().message()));
              rows.push_back(row);
            }
          }
        }
        }
      }
    }
  }
  // Efficiency against the smallest world of the same configuration.
  for (Row& r : rows) {
    const Row* base = nullptr;
    for (const Row& o : rows) {
      if (o.model == r.model && o.strategy == r.strategy && o.dtype == r.dtype &&
          o.ckpt == r.ckpt && o.prefetch == r.prefetch && o.inter_eff == r.inter_eff &&
          (base == nullptr || o.world < base->world)) {
        base = &o;
      }
    }
    r.eff = base->p.step_s / r.p.step_s;
  }
  std::printf("%-11s %-13s %5s %4s %5s %3s %7s %9s %9s %9s %9s %12s %6s %6s %11s\n", "model",
              "strategy", "hosts", "N", "shard", "pf", "net eff", "step ms", "compute",
              "exposed", "comm busy", "tokens/s", "MFU%", "eff", "mem GiB");
  for (const Row& r : rows) {
    const int hosts = a.ranks_per_host > 0 ? std::max(1, r.world / a.ranks_per_host) : 1;
    const double mfu = flops ? r.flops_per_rank / r.p.step_s / (a.peak_tflops * 1e12) : 0;
    std::printf("%-11s %-13s %5d %4d %5d %3d %7g %9.1f %9.1f %9.1f %9.1f %12.0f %6.1f %6.3f %11s\n",
                r.model.c_str(), r.strategy.c_str(), hosts, r.world, r.shard, r.prefetch,
                r.inter_eff,
                r.p.step_s * 1e3, r.p.compute_s * 1e3, r.p.exposed_comm_s * 1e3,
                r.p.comm_busy_s * 1e3, r.p.tokens_per_s, 100 * mfu, r.eff, r.mem.c_str());
  }
  std::fflush(stdout);  // the notes after the table
  for (const std::string& e : plan_errors) {
    std::fprintf(stderr, "fsdp_bench: mem GiB is - where the memory plan says: %s\n", e.c_str());
  }
  if (!a.svg_dir.empty()) {
    std::vector<fsdp::BenchResult> pts;
    for (const Row& r : rows) {
      fsdp::BenchResult b;
      // The series' label: what varies (the title says the rest).
      b.model = a.models.size() > 1 ? r.model : "";
      if (a.inter_effs.size() > 1) {
        absl::StrAppend(&b.model, b.model.empty() ? "" : " ", "net x", r.inter_eff);
      }
      b.strategy = r.strategy;
      b.world_size = r.world;
      b.param_dtype = r.dtype;
      b.checkpoint_every = r.ckpt;
      b.prefetch = r.prefetch;
      b.tokens_per_s = r.p.tokens_per_s;
      b.scaling_efficiency = r.eff;
      pts.push_back(b);
    }
    const std::filesystem::path dir(a.svg_dir);
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    const bool ok =
        WriteFile((dir / "projected_efficiency.svg").string(),
                  fsdp::ScalingEfficiencySvg(
                      pts, absl::StrCat("Projected efficiency, ", absl::StrJoin(a.models, ", "),
                                        " on ", a.cluster, ", against the smallest world"),
                      a.published_world, a.published_eff),
                  fsdp::kSvgFile) &&
        WriteFile((dir / "projected_throughput.svg").string(), fsdp::ThroughputSvg(pts),
                  fsdp::kSvgFile);
    if (!ok) return 1;
  }
  return 0;
}

int RunValidation(const Args& a) {
  const int max_world = *std::max_element(a.worlds.begin(), a.worlds.end());
  const int threads = a.threads > 0 ? a.threads : std::max(1, fsdp::HardwareThreads() / max_world);
  const fsdp::DType d = a.dtypes.front();
  const int ck = a.checkpoint.front();
  int runs = 0;
  for (size_t i = 0; i < a.models.size(); ++i) {
    runs += static_cast<int>(a.worlds.size() *
                             (a.calibrate_each ? 2 * a.strategies.size() * a.validate_links.size() *
                                                     a.prefetch.size()
                                               : 1 + a.strategies.size() *
                                                         a.validate_links.size() *
                                                         a.prefetch.size()));
  }
  std::fprintf(stderr, "fsdp_bench: validating the projection: %d runs, %d thread(s) per rank, "
               "B=%d, %d warm-up + %d measured steps each\n", runs, threads, a.batch, a.warmup,
               a.steps);
  const auto start = std::chrono::steady_clock::now();
  auto elapsed = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  int done = 0;
  auto progress = [&](const std::string& what) {
    std::fprintf(stderr, "fsdp_bench: [%d/%d done] %s | %.0f s elapsed\n", done, runs,
                 what.c_str(), elapsed());
  };
  struct Row {
    fsdp::BenchResult m;
    fsdp::Projection p;    // from the calibration run's compute
    fsdp::Projection own;  // from this run's own compute spans
    double err = 0, own_err = 0;
    double cal_compute = 0, cal_sync = 0;  // the calibration's compute and waits
  };
  std::vector<Row> rows;
  std::vector<std::string> calibrations;
  for (const std::string& model : a.models) {
    const fsdp::nn::ModelConfig& mc = a.configs.at(model);
    for (int w : a.worlds) {
      absl::StatusOr<fsdp::StepProfile> profile =
          absl::FailedPreconditionError("no calibration run yet");
      if (!a.calibrate_each) {
      fsdp::BenchConfig cal = BaseConfig(a, model, d, ck, threads);
      cal.world_size = w;
      cal.strategy = fsdp::ShardingStrategy::kFullShard;
      cal.prefetch = 1;
      progress(absl::StrCat("calibrating ", model, " on ", w, " ranks, link off"));
      absl::StatusOr<fsdp::BenchResult> cr = fsdp::RunBench(cal);
      ++done;
      if (!cr.ok()) {
        std::fprintf(stderr, "fsdp_bench: calibration failed: %s\n", cr.status().ToString().c_str());
        return 1;
      }
      profile = fsdp::ProfileFromBench(*cr, mc);
      if (!profile.ok()) {
        std::fprintf(stderr, "fsdp_bench: %s\n", profile.status().ToString().c_str());
        return 1;
      }
      double blocks = 0;
      for (size_t i = 0; i < cr->block_forward_s.size(); ++i) {
        blocks += cr->block_forward_s[i] + cr->block_backward_s[i] + cr->block_recompute_s[i];
      }
      calibrations.push_back(absl::StrFormat(
          "%s %d ranks: step %.1f ms, blocks %.1f ms, other compute %.1f ms, optimizer %.1f ms, "
          "exposed %.1f ms (added to every prediction of %d ranks)", model, w, cr->step_median_s * 1e3, blocks * 1e3,
          (profile->compute_s() - blocks - profile->optimizer_s) * 1e3, cr->optimizer_s * 1e3,
          cr->exposed_comm_s * 1e3, w));
      }
      for (fsdp::ShardingStrategy st : a.strategies) {
        for (const auto& [intra, inter] : a.validate_links) {
          for (int pf : a.prefetch) {
            fsdp::BenchConfig c = BaseConfig(a, model, d, ck, threads);
            c.world_size = w;
            c.strategy = st;
            c.prefetch = pf;
            c.link.link_bytes_per_second = intra * 1e9;
            c.link.link_latency = absl::Microseconds(a.link_latency_us);
            c.link.ranks_per_host = a.ranks_per_host > w ? w : a.ranks_per_host;
            c.link.inter_host_bytes_per_second = inter * 1e9;
            c.link.inter_host_latency = absl::Microseconds(a.inter_latency_us);
            const int shard = a.hybrid_shard > 0 ? a.hybrid_shard : a.ranks_per_host;
            c.hybrid_shard_size = shard > 0 && w < shard ? w : a.hybrid_shard;
            if (a.calibrate_each) {
              // The same run with the link off, right before: the compute it predicts from is
              // measured as close in time as possible (a shared machine's speed drifts).
              fsdp::BenchConfig off = c;
              off.link.link_bytes_per_second = off.link.inter_host_bytes_per_second = 0;
              off.link.link_latency = off.link.inter_host_latency = absl::ZeroDuration();
              progress(absl::StrCat("calibrating ", RunName(off, w), ", link off"));
              absl::StatusOr<fsdp::BenchResult> cr = fsdp::RunBench(off);
              ++done;
              if (!cr.ok()) {
                std::fprintf(stderr, "fsdp_bench: calibration failed: %s\n",
                             cr.status().ToString().c_str());
                return 1;
              }
              absl::StatusOr<fsdp::StepProfile> each = fsdp::ProfileFromBench(*cr, mc);
              if (!each.ok()) {
                std::fprintf(stderr, "fsdp_bench: %s\n", each.status().ToString().c_str());
                return 1;
              }
              profile = *each;
            }
            progress(absl::StrCat("running ", RunName(c, w), " link ", intra, ":", inter,
                                  " GB/s"));
            absl::StatusOr<fsdp::BenchResult> r = fsdp::RunBench(c);
            ++done;
            if (!r.ok()) {
              std::fprintf(stderr, "fsdp_bench: %s failed: %s\n", RunName(c, w).c_str(),
                           r.status().ToString().c_str());
              return 1;
            }
            fsdp::ProjectionRun run;
            run.strategy = st;
            run.world_size = w;
            run.hybrid_shard_size = r->hybrid_shard_size;
            run.prefetch = c.prefetch;
            absl::StatusOr<fsdp::Projection> p =
                fsdp::ProjectStep(*profile, fsdp::SimulatedLink(c.link), run);
            absl::StatusOr<fsdp::StepProfile> own_profile = fsdp::ProfileFromBench(*r, mc);
            // The waits without a link come from the calibration run, never from this one.
            if (own_profile.ok()) own_profile->sync_s = profile->sync_s;
            absl::StatusOr<fsdp::Projection> own =
                own_profile.ok() ? fsdp::ProjectStep(*own_profile, fsdp::SimulatedLink(c.link), run)
                                 : absl::StatusOr<fsdp::Projection>(own_profile.status());
            for (const absl::Status& st : {p.status(), own.status()}) {
              if (!st.ok()) {
                std::fprintf(stderr, "fsdp_bench: %s\n", st.ToString().c_str());
                return 1;
              }
            }
            // The profile's times are means over the measured steps: compared with the mean step.
            const double m = r->step_mean_s;
            rows.push_back({*r, *p, *own, (p->step_s - m) / m, (own->step_s - m) / m,
                            profile->compute_s(), profile->sync_s});
          }
        }
      }
    }
  }
  std::fprintf(stderr, "fsdp_bench: [%d/%d done] in %.0f s\n", runs, runs, elapsed());
  std::printf("fsdp_bench --validate_projection: each run measured on the simulated link "
              "(link GB/s: inside:between hosts) and predicted from the link and compute times "
              "alone: (cal) the compute per block and around the blocks (cal cmp), and the "
              "waits (cal wait), of %s with the link off; (own) the compute spans of the run "
              "itself (compute) with (cal)'s waits. No communication time is taken from a "
              "measurement with the link.\n",
              a.calibrate_each ? "the same run measured right before it"
                               : "its world's calibration run (FULL_SHARD, prefetch)");
  for (const std::string& c : calibrations) std::printf("calibration: %s\n", c.c_str());
  std::printf("%-6s %-13s %2s %5s %2s %10s | %8s %8s %8s %9s %7s | %8s %9s %7s | %8s %9s %9s\n",
              "model", "strategy", "N", "shard", "pf", "link GB/s", "mean ms", "cal cmp",
              "cal wait", "pred cal", "error", "compute", "pred own", "error", "exposed",
              "pred cal", "pred own");
  std::vector<double> errs, own_errs;
  for (const Row& r : rows) {
    const std::string linktext = absl::StrFormat("%g:%g", r.m.link_gbps, r.m.inter_gbps);
    std::printf("%-6s %-13s %2d %5d %2d %10s | %8.1f %8.1f %8.1f %9.1f %+6.1f%% | %8.1f %9.1f "
                "%+6.1f%% | %8.1f %9.1f %9.1f\n",
                r.m.model.c_str(), r.m.strategy.c_str(), r.m.world_size, r.m.hybrid_shard_size,
                r.m.prefetch, linktext.c_str(), r.m.step_mean_s * 1e3,
                r.cal_compute * 1e3, r.cal_sync * 1e3, r.p.step_s * 1e3, 100 * r.err, r.own.compute_s * 1e3, r.own.step_s * 1e3,
                100 * r.own_err, r.m.exposed_comm_s * 1e3, r.p.exposed_comm_s * 1e3,
                r.own.exposed_comm_s * 1e3);
    errs.push_back(std::fabs(r.err));
    own_errs.push_back(std::fabs(r.own_err));
  }
  auto summary = [](std::vector<double> e, const char* what) {
    std::sort(e.begin(), e.end());
    const double median = e.empty() ? 0
                          : e.size() % 2 ? e[e.size() / 2]
                                         : (e[e.size() / 2 - 1] + e[e.size() / 2]) / 2;
    std::printf("step time error, %s, over %zu runs: median |error| %.1f%%, worst %.1f%% "
                "(target: median <= 10%%, worst <= 20%%)\n",
                what, e.size(), 100 * median, e.empty() ? 0.0 : 100 * e.back());
  };
  summary(errs, "compute from the calibration runs (cal)");
  summary(own_errs, "compute from each run's own compute spans (own)");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = ParseArgs(argc, argv);
  if (a.project) {
    CheckOutputs(a);
    return RunProjection(a);
  }
  if (a.validate) return RunValidation(a);
  // Under mpirun: one rank per process, the world is the job's.
  std::unique_ptr<fsdp::Communicator> mpi;
  const bool under_mpi = std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr;
  if (under_mpi) {
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
  }
  const bool rank0 = mpi == nullptr || mpi->rank() == 0;
  if (mpi != nullptr && a.comm_to_compute > 0) {
    BadUsage("--comm_to_compute: the simulated link is the local communicator's (ranks as "
             "threads), not mpirun's");
  }
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
  // Nothing is written (or truncated) before the end; what is in the way is found now.
  if (rank0) CheckOutputs(a);
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
              c.config = a.configs.at(m);
              c.strategy = s;
              c.world_size = w;
              c.param_dtype = d;
              c.reduce_dtype = a.reduce_dtype == "same" ? d : FloatDTypeFlag("", a.reduce_dtype);
              c.checkpoint_every = ck;
              c.prefetch = pf;
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
        eta = absl::StrFormat("ETA %.0f s",
                              elapsed() / static_cast<double>(i) * static_cast<double>(runs - i));
      }
      std::fprintf(stderr, "fsdp_bench: [%zu/%zu done] running %s%s | %.0f s elapsed, %s\n", i,
                   runs, RunName(c, mpi != nullptr ? mpi->size() : c.world_size).c_str(),
                   a.repeat > 1 ? absl::StrCat(" (pass ", pass, " of ", a.repeat, ")").c_str() : "",
                   elapsed(), eta.c_str());
    }
    absl::Status matched = absl::OkStatus();
    if (a.comm_to_compute > 0) matched = MatchLinkToCompute(a.comm_to_compute, c);
    absl::StatusOr<fsdp::BenchResult> r =
        !matched.ok()    ? absl::StatusOr<fsdp::BenchResult>(matched)
        : mpi != nullptr ? fsdp::RunBench(c, *mpi)
                         : fsdp::RunBench(c);
    // The compute of a shared machine drifts between the probes and the run: a run whose link
    // missed F x its compute by more than --match_tolerance runs again with the bandwidth
    // corrected from that run's figures, up to twice, and the run closest to F is kept.
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
    PrintExposedPhases(results);
    if (a.repeat > 1) PrintPasses(results, a.repeat);
    std::fflush(stdout);
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
  }
  const int rc = failed || !written ? 1 : 0;
  if (mpi != nullptr) {
    mpi.reset();
    return fsdp::FinishMpi(absl::OkStatus(), "fsdp_bench") == 0 ? rc : 1;
  }
  return rc;
}
