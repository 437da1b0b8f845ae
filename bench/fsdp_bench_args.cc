// fsdp_bench's command line (fsdp_bench.h): the options as absl::flags, the help text, and the
// checks that give each bad value its one-line error and exit code 2.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "bench/fsdp_bench.h"
#include "fsdp/cpu_backend.h"
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
FSDP_BENCH_OPTION(all_gather);
FSDP_BENCH_OPTION(reduction);
FSDP_BENCH_OPTION(quant_block);
FSDP_BENCH_OPTION(secondary_shard);
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

namespace fsdp_bench {
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
      {"all_gather", &FLAGS_all_gather},
      {"reduction", &FLAGS_reduction},
      {"quant_block", &FLAGS_quant_block},
      {"secondary_shard", &FLAGS_secondary_shard},
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
  --all_gather LIST    what the parameter all-gather carries: dtype (the parameter dtype),
                       int8 or fp8 (codes and an f32 scale per --quant_block elements); a
                       grid axis of measured runs, one format with --project (default dtype)
  --reduction LIST     what the gradient reduction carries: dtype (--reduce_dtype), int8 or
                       fp8 (each rank's gradient quantized once, exchanged by all_to_all in
                       the shard group and all-gathered as codes across replicas, added in
                       f32: such runs reduce in f32); a grid axis like --all_gather
                       (default dtype)
  --quant_block N      elements per scale of a quantized all-gather or reduction: a power of
                       two from 16 to 65536 (default 256)
  --secondary_shard LIST
                       FULL_SHARD and HYBRID_SHARD: after forward keep 1/N of each unit on
                       each rank so that backward gathers inside groups of N consecutive
                       ranks (a host's; ZeRO++'s hpZ); 0 = off; a grid axis, applied to the
                       runs whose shard group N divides (2 <= N < it) (default 0)
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

// Bounds on the sizes of a run (docs/scaling.md). Measured runs are ranks as threads of this
// process, as many as LocalWorld takes; a projection is a replay whose collectives cost the
// same however many ranks they span, up to the memory planner's world (fsdp/plan.h). B up to
// the largest micro-batch the planner searches (LargestMicroBatch).
constexpr int kMaxMeasuredWorld = 4096;
constexpr int kMaxProjectedWorld = fsdp::kMaxPlanWorldSize;
constexpr int kMaxBatch = 1 << 20;

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

// A list of wire formats (--all_gather, --reduction).
std::vector<fsdp::WireFormat> Formats(const std::string& flag, const std::string& v) {
  std::vector<fsdp::WireFormat> out;
  for (const std::string& x : List(flag, v)) {
    absl::StatusOr<fsdp::WireFormat> f = fsdp::ParseWireFormat(x);
    if (!f.ok()) BadUsage(absl::StrCat(flag, ": '", x, "' is not dtype, int8 or fp8"));
    out.push_back(*f);
  }
  return out;
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
  } else if (k == "--all_gather") {
    a.all_gather = Formats(k, v);
    a.communication.all_gather = a.all_gather.front();
  } else if (k == "--reduction") {
    a.reduction = Formats(k, v);
    a.communication.reduction = a.reduction.front();
  } else if (k == "--quant_block") {
    a.communication.block_size = ParseInt(k, v, 1);
    fsdp::CommunicationOptions c = a.communication;
    c.all_gather = fsdp::WireFormat::kInt8;  // the range, whatever the format given
    if (!fsdp::CheckCommunicationOptions(c).ok()) {
      BadUsage(absl::StrCat(k, "=", v, ": allowed: a power of two from 16 to 65536"));
    }
  } else if (k == "--secondary_shard") {
    a.secondary_shard.clear();
    for (const std::string& s : List(k, v)) a.secondary_shard.push_back(ParseInt(k, s, 0));
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

}  // namespace

[[noreturn]] void BadUsage(const std::string& message) {
  std::fprintf(stderr, "fsdp_bench: %s (fsdp_bench --help lists the options)\n",
               message.c_str());
  std::exit(2);
}

fsdp::DType FloatDTypeFlag(const std::string& flag, const std::string& v) {
  const std::optional<fsdp::DType> d = fsdp::ParseDType(v);
  if (d.has_value() && fsdp::IsFloat16Or32(*d)) return *d;
  BadUsage(absl::StrCat(flag, ": '", v, "' is not f32, bf16 or f16"));
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
  if (a.all_gather.size() > 1 && (a.project || a.validate)) {
    BadUsage("--all_gather: --project and --validate_projection take one format");
  }
  if (a.reduction.size() > 1 && (a.project || a.validate)) {
    BadUsage("--reduction: --project and --validate_projection take one format");
  }
  if (a.secondary_shard.size() > 1 && (a.project || a.validate)) {
    BadUsage("--secondary_shard: --project and --validate_projection take one value");
  }
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

}  // namespace fsdp_bench
