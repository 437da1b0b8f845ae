// The scaling harness (fsdp/bench.h): RunBench's figures are consistent with each other, with
// the memory planner and with the units' sizes; a slow simulated link shows as exposed
// communication that prefetch reduces; the fsdp_bench command line writes files that parse and
// rejects bad flags with exit code 2.
#include "fsdp/bench.h"
#include "fsdp/bench_report.h"

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "fsdp/cpu_backend.h"
#include "fsdp/plan.h"
#include "fsdp/registry.h"
#include "gtest/gtest.h"
#include "tests/bench/cli_util.h"
#include "src/core/json.h"

namespace fsdp {
namespace {

#ifdef FSDP_BENCH_BINARY
using testing::Ran;
using testing::ExpectUsageError;
using testing::RunCli;
#endif

// Fixed so that the tests do not spend seconds measuring the GEMM peak.
constexpr double kPeak = 50;
// The share of a step the timeline's spans cover at least (the rest is "other": embedding,
// head, loss, host work, and a rank thread waiting for a core on a loaded machine). A loose
// floor: it only shows that the split is not all "other".
constexpr double kMeasuredShare = 0.2;

BenchConfig Nano(int world) {
  BenchConfig c;
  c.model = "nano";
  c.world_size = world;
  c.batch_size = 4;
  c.seq_len = 64;
  c.threads_per_rank = 1;
  c.warmup_steps = 2;
  c.steps = 4;
  c.peak_gflops_per_core = kPeak;
  return c;
}

class RunBenchTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    for (int world : {1, 2}) {
      absl::StatusOr<BenchResult> r = RunBench(Nano(world));
      ASSERT_TRUE(r.ok()) << r.status();
      results_.push_back(*r);
    }
    SetScalingEfficiency(results_);
  }
  static std::vector<BenchResult> results_;
};
std::vector<BenchResult> RunBenchTest::results_;

TEST_F(RunBenchTest, FiguresAreConsistent) {
  for (const BenchResult& r : results_) {
    SCOPED_TRACE(r.world_size);
    EXPECT_EQ(r.model, "nano");
    EXPECT_EQ(r.strategy, "FULL_SHARD");
    EXPECT_EQ(r.threads_per_rank, 1);
    EXPECT_EQ(r.cores_used, std::min(r.world_size, HardwareThreads()));
    ASSERT_EQ(r.step_times_s.size(), 4u);
    EXPECT_EQ(r.tokens_per_step, 4 * 64 * r.world_size);
    EXPECT_DOUBLE_EQ(r.tokens_per_s, 4.0 * 64 * r.world_size / r.step_median_s);
    EXPECT_GT(r.step_min_s, 0);
    EXPECT_LE(r.step_min_s, r.step_p10_s);
    EXPECT_LE(r.step_p10_s, r.step_median_s);
    EXPECT_LE(r.step_median_s, r.step_p90_s);
    EXPECT_LE(r.step_p90_s, r.step_max_s);
    // MFU from MODEL_SPEC.md's FLOPs and the given peak.
    const nn::ModelConfig mc = *nn::ModelConfig::FromName("nano");
    EXPECT_DOUBLE_EQ(r.model_flops_per_step, mc.flops_per_step(r.tokens_per_step, 64));
    EXPECT_NEAR(r.mfu, r.model_flops_per_step / r.step_median_s / (kPeak * 1e9 * r.cores_used),
                1e-9);
    // The split adds up to the mean step, and the measured parts are most of it.
    EXPECT_NEAR(r.compute_s + r.exposed_comm_s + r.optimizer_s + r.other_s, r.step_mean_s, 1e-9);
    EXPECT_GT(r.compute_s, 0);
    EXPECT_GT(r.optimizer_s, 0);
    EXPECT_GE(r.exposed_comm_s, 0);
    EXPECT_GT(r.other_s, -1e-4);
    EXPECT_GT(r.compute_s + r.exposed_comm_s + r.optimizer_s, kMeasuredShare * r.step_mean_s);
    // The exposed time by phase adds up to it.
    const double phases[] = {r.exposed_start_s, r.exposed_forward_s, r.exposed_head_s,
                             r.exposed_backward_s, r.exposed_tail_s, r.exposed_optimizer_s};
    double sum = 0;
    for (double x : phases) {
      EXPECT_GE(x, 0);
      sum += x;
    }
    EXPECT_NEAR(sum, r.exposed_comm_s, 1e-9);
    // The mean over ranks and steps is at most the slowest rank's slowest step.
    EXPECT_GT(r.step_mean_s, 0);
    EXPECT_LE(r.step_mean_s, r.step_max_s * (1 + 1e-9));
    // Host synchronisations: the loss of the forward and the global norm of Step().
    EXPECT_GE(r.host_syncs_per_step, 1);
    EXPECT_TRUE(std::isfinite(r.final_loss));
  }
  EXPECT_EQ(results_[0].bus_bytes_per_rank, 0);
  EXPECT_EQ(results_[0].exposed_comm_s, 0);
}

// Bytes per rank per step against the units' sizes: FULL_SHARD gathers each block unit in
// forward and again in backward, except the root unit and the last block, which stay gathered
// from forward into backward, and reduce-scatters every unit's gradient once; a ring sends
// (n-1)/n of each.
TEST_F(RunBenchTest, BytesMatchTheUnits) {
  const BenchResult& r = results_[1];
  const nn::ModelConfig mc = *nn::ModelConfig::FromName("nano");
  double expected = 0;
  for (int u = 0; u < mc.num_units(); ++u) {
    const double bytes = 4.0 * PaddedCount(mc.UnitNumel(u), 2);
    const bool kept = u == 0 || u == mc.num_units() - 1;
    expected += (kept ? 2 : 3) * bytes / 2;
  }
  EXPECT_NEAR(r.bus_bytes_per_rank, expected, 0.01 * expected);
  EXPECT_NEAR(r.comm_bytes_per_rank, 2 * expected, 0.01 * 2 * expected);
  EXPECT_GE(r.collectives_per_step, 2 * mc.num_units());
}

// A quantized all-gather: each gather carries the shard group's codes and scales (about a
// quarter of f32's bytes), the reduce-scatters are unchanged, and the result says so.
TEST(RunBench, QuantizedAllGatherBytesAreCodesAndScales) {
  BenchConfig c = Nano(2);
  c.communication.all_gather = WireFormat::kInt8;
  c.communication.block_size = 64;
  absl::StatusOr<BenchResult> r = RunBench(c);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->all_gather, WireFormat::kInt8);
  EXPECT_EQ(r->quant_block, 64);
  const nn::ModelConfig mc = *nn::ModelConfig::FromName("nano");
  double gathers = 0, f32_gathers = 0, reduce_scatters = 0;
  for (int u = 0; u < mc.num_units(); ++u) {
    const int64_t padded = PaddedCount(mc.UnitNumel(u), 2);
    const int n = u == 0 || u == mc.num_units() - 1 ? 1 : 2;  // kept units gather once
    gathers += n * 2.0 * static_cast<double>(QuantizedLayout{padded / 2, 64}.bytes());
    f32_gathers += n * 4.0 * padded;
    reduce_scatters += 4.0 * padded;
  }
  const double expected = gathers + reduce_scatters;
  EXPECT_NEAR(r->comm_bytes_per_rank, expected, 0.01 * expected);
  // The bound: an int8 all-gather moves at most 0.27x of an f32 one's bytes.
  EXPECT_LE(r->comm_bytes_per_rank - reduce_scatters, 0.27 * f32_gathers);
}

// Memory per rank: the runtime's report, which the planner predicts (persistent shards exactly).
TEST_F(RunBenchTest, MemoryIsTheRuntimeReport) {
  for (const BenchResult& r : results_) {
    PlanRequest req;
    req.model = "nano";
    req.world_size = r.world_size;
    req.batch_size = 4;
    req.seq_len = 64;
    absl::StatusOr<MemoryPlan> plan = PlanMemory(req);
    ASSERT_TRUE(plan.ok()) << plan.status();
    const MemoryReport want = plan->AsReport();
    EXPECT_EQ(r.memory.param_shard_bytes, want.param_shard_bytes);
    EXPECT_EQ(r.memory.grad_shard_bytes, want.grad_shard_bytes);
    EXPECT_EQ(r.memory.optimizer_bytes, want.optimizer_bytes);
    EXPECT_EQ(r.memory.activation_peak_bytes, want.activation_peak_bytes);
    EXPECT_NEAR(r.memory.peak_bytes, want.peak_bytes, 0.05 * want.peak_bytes);
    EXPECT_GE(r.memory.peak_bytes, r.memory.persistent_bytes());
  }
}

TEST_F(RunBenchTest, ScalingEfficiency) {
  EXPECT_DOUBLE_EQ(results_[0].scaling_efficiency, 1.0);
  EXPECT_DOUBLE_EQ(results_[1].baseline_tokens_per_s, results_[0].tokens_per_s);
  EXPECT_DOUBLE_EQ(results_[1].scaling_efficiency,
                   results_[1].tokens_per_s / (2 * results_[0].tokens_per_s));
  // Without a 1-rank run of the same configuration there is no efficiency.
  std::vector<BenchResult> only_two = {results_[1]};
  SetScalingEfficiency(only_two);
  EXPECT_TRUE(std::isnan(only_two[0].scaling_efficiency));
  std::vector<BenchResult> other_batch = results_;
  other_batch[0].batch_size = 8;
  SetScalingEfficiency(other_batch);
  EXPECT_TRUE(std::isnan(other_batch[1].scaling_efficiency));
}

TEST_F(RunBenchTest, JsonAndCsvHoldEveryField) {
  const std::string line = BenchResultJson(results_[1]);
  EXPECT_EQ(line.find('\n'), std::string::npos);
  absl::StatusOr<json::Value> v = json::Parse(line);
  ASSERT_TRUE(v.ok()) << v.status() << "\n" << line;
  ASSERT_TRUE(v->is_object());
  const std::vector<std::string> header = absl::StrSplit(BenchCsvHeader(), ',');
  EXPECT_EQ(v->keys(), header);
  EXPECT_EQ(v->Find("world_size")->int_value(), 2);
  EXPECT_DOUBLE_EQ(v->Find("tokens_per_s")->number(),
                   std::stod(absl::StrFormat("%.6g", results_[1].tokens_per_s)));
  EXPECT_EQ(v->Find("mem_peak_bytes")->int_value(), results_[1].memory.peak_bytes);
  const std::vector<std::string> row = absl::StrSplit(BenchCsvRow(results_[1]), ',');
  EXPECT_EQ(row.size(), header.size());
  for (const std::string& svg : {ThroughputSvg(results_), EfficiencySvg(results_),
                                 StepSplitSvg(results_)}) {
    EXPECT_EQ(svg.rfind("<svg", 0), 0u);
    EXPECT_NE(svg.find("</svg>"), std::string::npos);
  }
}

// Text fields with quotes, commas, line breaks and control characters: the JSON line still
// parses to the same text, and the CSV field is quoted with its quotes doubled (RFC 4180).
TEST(BenchReport, TextFieldsAreEscaped) {
  BenchResult r;
  r.model = "a\"b,c\nd\x01e";
  const std::string line = BenchResultJson(r);
  EXPECT_EQ(line.find('\n'), std::string::npos) << line;
  absl::StatusOr<json::Value> v = json::Parse(line);
  ASSERT_TRUE(v.ok()) << v.status() << "\n" << line;
  EXPECT_EQ(v->Find("model")->str(), r.model);
  const std::string row = BenchCsvRow(r);
  EXPECT_EQ(row.rfind("\"a\"\"b,c\nd\x01e\",", 0), 0u) << row;
}

// RunBench makes each rank's backend through the factory it is given, on the rank's thread; by
// default the registry's backend of config.backend, with the registry's errors.
TEST(RunBench, BackendsComeFromTheFactoryOrTheRegistry) {
  std::mutex mu;
  std::vector<int> ranks;
  BenchConfig c = Nano(2);
  c.warmup_steps = 1;
  c.steps = 1;
  absl::StatusOr<BenchResult> r =
      RunBench(c, [&](int rank) -> absl::StatusOr<std::unique_ptr<Backend>> {
        {
          std::lock_guard<std::mutex> lock(mu);
          ranks.push_back(rank);
        }
        return CreateBackend("sim", {{"threads", "1"}});
      });
  ASSERT_TRUE(r.ok()) << r.status();
  std::sort(ranks.begin(), ranks.end());
  EXPECT_EQ(ranks, (std::vector<int>{0, 1}));
  EXPECT_EQ(r->world_size, 2);
  EXPECT_TRUE(std::isfinite(r->final_loss));

  c.backend = "sim";
  c.backend_options = {{"link_latency_us", "5"}};
  absl::StatusOr<BenchResult> sim = RunBench(c);
  ASSERT_TRUE(sim.ok()) << sim.status();
  // The same model, data and steps on another backend: f32 results are bitwise the CPU's.
  EXPECT_EQ(sim->final_loss, r->final_loss);

  c.backend = "tpu";
  const absl::Status s = RunBench(c).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("no backend named 'tpu'"), std::string::npos) << s;
  c.backend = "cpu";
  c.backend_options = {{"link_latency_us", "5"}};
  EXPECT_EQ(RunBench(c).status().code(), absl::StatusCode::kInvalidArgument);
  absl::StatusOr<BenchResult> none =
      RunBench(Nano(1), [](int) -> absl::StatusOr<std::unique_ptr<Backend>> { return nullptr; });
  EXPECT_EQ(none.status().code(), absl::StatusCode::kInvalidArgument) << none.status();
}

TEST(RunBench, RejectsBadConfigs) {
  BenchConfig c = Nano(2);
  c.seq_len = 65;
  EXPECT_EQ(RunBench(c).status().code(), absl::StatusCode::kInvalidArgument);
  c = Nano(2);
  c.model = "gpt3";
  EXPECT_FALSE(RunBench(c).ok());
  c = Nano(4);
  c.strategy = ShardingStrategy::kHybridShard;
  c.hybrid_shard_size = 3;
  EXPECT_EQ(RunBench(c).status().code(), absl::StatusCode::kInvalidArgument);
  c = Nano(2);
  c.steps = 0;
  EXPECT_EQ(RunBench(c).status().code(), absl::StatusCode::kInvalidArgument);
  // A model far larger than this host's memory fails at once, before allocating, naming the
  // planner's figures (gpt2-xl's blocks 10,000 times, the most a config may have: 307 B
  // parameters).
  nn::GptConfig huge = *nn::GptConfig::FromName("gpt2-xl");
  huge.num_layers = nn::kMaxLayers;
  c = Nano(2);
  c.config = huge;
  c.seq_len = 64;
  const auto start = std::chrono::steady_clock::now();
  const absl::Status s = RunBench(c).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_NE(s.message().find("memory planner"), std::string::npos) << s;
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 60);
  // One block more is past the bound of fsdp/nn/model.h.
  huge.num_layers = nn::kMaxLayers + 1;
  c.config = huge;
  const absl::Status past = RunBench(c).status();
  EXPECT_EQ(past.code(), absl::StatusCode::kInvalidArgument) << past;
  EXPECT_NE(past.message().find("num_layers must be <= 10000"), std::string::npos) << past;
}

// A slow simulated link (communication about as long as compute): the compute thread waits
// for collectives far longer than with no link, and less with prefetch than without. A GPT
// of 6 narrow blocks, so that there is a next unit to prefetch while one computes.
TEST(RunBench, SlowLinkIsExposedAndPrefetchHidesSome) {
  nn::GptConfig g = *nn::GptConfig::FromName("nano");
  g.num_layers = 6;
  BenchConfig c = Nano(2);
  c.config = g;
  c.steps = 8;
  auto run = [&](double gbps, bool prefetch) {
    c.link.link_bytes_per_second = gbps * 1e9;
    c.prefetch = prefetch;
    absl::StatusOr<BenchResult> r = RunBench(c);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? *r : BenchResult{};
  };
  // Timing on a shared machine: a rank thread waiting for a core looks like exposed time, so
  // the comparison gets up to three tries, and one that holds decides.
  constexpr int kAttempts = 3;
  BenchResult off, without, with;
  bool held = false;
  for (int attempt = 1; attempt <= kAttempts && !held; ++attempt) {
    off = run(0, true);
    without = run(0.25, false);
    with = run(0.25, true);
    std::printf("try %d: exposed ms/step: no link %.2f, link without prefetch %.2f, with "
                "prefetch %.2f (steps %.2f, %.2f, %.2f ms)\n",
                attempt, off.exposed_comm_s * 1e3, without.exposed_comm_s * 1e3,
                with.exposed_comm_s * 1e3, off.step_median_s * 1e3,
                without.step_median_s * 1e3, with.step_median_s * 1e3);
    // Without prefetch at least the gathers' transfers (2/3 of the bytes) are exposed.
    const double transfer_s = without.bus_bytes_per_rank / 0.25e9;
    held = without.exposed_comm_s > off.exposed_comm_s + 0.5 * transfer_s &&
           with.exposed_comm_s < 0.9 * without.exposed_comm_s;
  }
  EXPECT_EQ(without.link_gbps, 0.25);
  // comm_s, the collectives' own time: at least the link's time for the step's bytes, and at
  // most the step (a rank's collectives of one group run one after another). The copies
  // themselves can take longer than the link (under a sanitizer): no upper bound from the link.
  const double link_s = without.bus_bytes_per_rank / 0.25e9;
  for (const BenchResult* r : {&without, &with}) {
    EXPECT_GE(r->comm_s, 0.95 * link_s) << "prefetch " << r->prefetch;
    EXPECT_LE(r->comm_s, r->step_mean_s) << "prefetch " << r->prefetch;
  }
  EXPECT_GT(off.comm_s, 0);
  EXPECT_LE(off.comm_s, off.step_mean_s);
  // Without prefetch, a gather issued right before its unit runs is waited for in every
  // phase that gathers: before the first block (the root and block 0), between the forward
  // blocks and between the backward blocks. The phases add up to the whole.
  EXPECT_GT(without.exposed_start_s, 0);
  EXPECT_GT(without.exposed_forward_s, 0);
  EXPECT_GT(without.exposed_backward_s, 0);
  EXPECT_NEAR(without.exposed_start_s + without.exposed_forward_s + without.exposed_head_s +
                  without.exposed_backward_s + without.exposed_tail_s +
                  without.exposed_optimizer_s,
              without.exposed_comm_s, 1e-9);
  EXPECT_TRUE(held) << "in " << kAttempts << " tries, the slow link never showed as exposed "
                    << "communication that prefetching reduced (figures above)";
  // The bytes do not depend on the link or on prefetching.
  EXPECT_NEAR(with.bus_bytes_per_rank, without.bus_bytes_per_rank,
              1e-6 * without.bus_bytes_per_rank);
}

// ---- the command line ------------------------------------------------------------------------
// Only when the benchmarks are built (FSDP_BUILD_BENCH).
#ifdef FSDP_BENCH_BINARY



std::string ReadAll(const std::filesystem::path& p) {
  std::ifstream f(p);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

// A path in the temporary directory, unique to this process: `name` followed by the pid.
std::filesystem::path TempPath(const std::string& name) {
  return std::filesystem::temp_directory_path() / (name + std::to_string(getpid()));
}

TEST(FsdpBenchCli, WritesTableJsonlCsvAndSvg) {
  const std::filesystem::path dir = TempPath("fsdp_bench_test_");
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const Ran ok = RunCli("--worlds 1,2 --prefetch 0,1 --steps 2 --warmup 1 --peak_gflops 50 "
                        "--jsonl " + (dir / "runs.jsonl").string() +
                        " --csv " + (dir / "runs.csv").string() +
                        " --svg_dir " + (dir / "svg").string());
  ASSERT_EQ(ok.rc, 0) << ok.output;
  EXPECT_NE(ok.output.find("[0/4 done] running nano FULL_SHARD 1 rank"), std::string::npos)
      << ok.output;
  EXPECT_NE(ok.output.find("ETA"), std::string::npos);
  EXPECT_NE(ok.output.find("tokens/s"), std::string::npos);
  const std::vector<std::string> lines =
      absl::StrSplit(ReadAll(dir / "runs.jsonl"), '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 4u);
  for (const std::string& line : lines) {
    absl::StatusOr<json::Value> v = json::Parse(line);
    ASSERT_TRUE(v.ok()) << v.status() << "\n" << line;
    ASSERT_TRUE(v->is_object());
    for (const char* key : {"tokens_per_s", "step_median_s", "mfu", "compute_s",
                            "exposed_comm_s", "exposed_tail_s", "optimizer_s", "bus_bytes_per_rank",
                            "mem_peak_bytes", "host_syncs_per_step", "scaling_efficiency"}) {
      EXPECT_NE(v->Find(key), nullptr) << key;
    }
    EXPECT_EQ(v->Find("scaling_efficiency")->kind(), json::Value::Kind::kNumber);
  }
  const std::vector<std::string> csv =
      absl::StrSplit(ReadAll(dir / "runs.csv"), '\n', absl::SkipEmpty());
  ASSERT_EQ(csv.size(), 5u);
  EXPECT_EQ(csv[0], BenchCsvHeader());
  for (const char* name : {"throughput.svg", "efficiency.svg", "step_split.svg"}) {
    const std::string svg = ReadAll(dir / "svg" / name);
    EXPECT_EQ(svg.rfind("<svg", 0), 0u) << name;
  }
  std::filesystem::remove_all(dir);
}

// --all_gather is a grid axis: each configuration runs with each format, the files say which,
// and the int8 run moves fewer bytes.
TEST(FsdpBenchCli, AllGatherFormatsAreAnAxis) {
  const std::filesystem::path dir = TempPath("fsdp_bench_test_");
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const Ran ok = RunCli("--worlds 2 --steps 1 --warmup 1 --peak_gflops 50 --all_gather dtype,int8 "
                        "--quant_block 64 --jsonl " + (dir / "runs.jsonl").string());
  ASSERT_EQ(ok.rc, 0) << ok.output;
  EXPECT_NE(ok.output.find("f32+int8"), std::string::npos) << ok.output;
  const std::vector<std::string> lines =
      absl::StrSplit(ReadAll(dir / "runs.jsonl"), '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 2u);
  std::map<std::string, double> bytes;
  for (const std::string& line : lines) {
    absl::StatusOr<json::Value> v = json::Parse(line);
    ASSERT_TRUE(v.ok()) << v.status() << "\n" << line;
    const json::Value* format = v->Find("all_gather");
    ASSERT_NE(format, nullptr);
    bytes[format->str()] = v->Find("comm_bytes_per_rank")->number();
  }
  ASSERT_EQ(bytes.size(), 2u);
  EXPECT_LT(bytes["int8"], 0.7 * bytes["dtype"]);
  std::filesystem::remove_all(dir);
}

// --layers runs a model at other depths (named by them), --prefetch N gathers up to N units
// ahead, and --comm_to_compute sets each run's link from its compute without a link.
TEST(FsdpBenchCli, LayersPrefetchDepthAndALinkMatchedToTheCompute) {
  const std::filesystem::path jsonl = TempPath("fsdp_bench_layers_").replace_extension(".jsonl");
  const Ran ok = RunCli("--layers 0,3 --worlds 2 --prefetch 2 --comm_to_compute 1 --steps 3 "
                        "--warmup 1 --peak_gflops 50 --jsonl " + jsonl.string());
  ASSERT_EQ(ok.rc, 0) << ok.output;
  EXPECT_NE(ok.output.find("running nano-L3 FULL_SHARD 2 ranks f32 prefetch 2"),
            std::string::npos) << ok.output;
  EXPECT_NE(ok.output.find("fsdp_bench: link "), std::string::npos) << ok.output;
  const std::vector<std::string> lines =
      absl::StrSplit(ReadAll(jsonl), '\n', absl::SkipEmpty());
  std::filesystem::remove(jsonl);
  ASSERT_EQ(lines.size(), 2u);
  std::map<std::string, double> params;
  for (const std::string& line : lines) {
    absl::StatusOr<json::Value> v = json::Parse(line);
    ASSERT_TRUE(v.ok()) << v.status() << "\n" << line;
    const std::string model = v->Find("model")->str();
    params[model] = v->Find("num_parameters")->number();
    EXPECT_EQ(v->Find("prefetch")->number(), 2) << model;
    // The link was set (nano's default config has none) and its time is of the order of the
    // compute measured without it (a loose band: a step of a few ms on a shared machine).
    EXPECT_GT(v->Find("link_gbps")->number(), 0) << model;
    const double compute = v->Find("compute_s")->number() + v->Find("optimizer_s")->number() +
                           v->Find("other_s")->number();
    EXPECT_GT(v->Find("comm_s")->number(), 0.25 * compute) << model;
    EXPECT_LT(v->Find("comm_s")->number(), 4 * compute) << model;
  }
  ASSERT_EQ(params.count("nano"), 1u);
  ASSERT_EQ(params.count("nano-L3"), 1u);
  nn::GptConfig deeper = *nn::GptConfig::FromName("nano");
  deeper.num_layers = 3;
  EXPECT_EQ(params["nano-L3"], static_cast<double>(nn::ModelConfig(deeper).num_parameters()));
  EXPECT_EQ(params["nano"],
            static_cast<double>(nn::ModelConfig::FromName("nano")->num_parameters()));
}

// A run whose link misses the compute by more than --match_tolerance runs again with the
// bandwidth corrected (tolerance 0: every run misses a little), three runs at most, and the
// files hold the one closest to the ratio asked for.
TEST(FsdpBenchCli, ALinkThatMissesTheComputeRunsAgainAndTheClosestIsKept) {
  const std::filesystem::path jsonl = TempPath("fsdp_bench_match_").replace_extension(".jsonl");
  const Ran ok = RunCli("--worlds 2 --comm_to_compute 1 --match_tolerance 0 --steps 3 "
                        "--warmup 1 --peak_gflops 50 --jsonl " + jsonl.string());
  ASSERT_EQ(ok.rc, 0) << ok.output;
  EXPECT_NE(ok.output.find("(attempt 2 of 3)"), std::string::npos) << ok.output;
  EXPECT_NE(ok.output.find("(attempt 3 of 3)"), std::string::npos) << ok.output;
  EXPECT_EQ(ok.output.find("(attempt 4 of"), std::string::npos) << ok.output;
  double first = 0, kept = 0;
  const size_t took = ok.output.find("the link took ");
  const size_t at = ok.output.find("kept the run at ");
  ASSERT_NE(took, std::string::npos) << ok.output;
  ASSERT_NE(at, std::string::npos) << ok.output;
  ASSERT_EQ(std::sscanf(ok.output.c_str() + took, "the link took %lf", &first), 1);
  ASSERT_EQ(std::sscanf(ok.output.c_str() + at, "kept the run at %lf", &kept), 1);
  // The kept run is no further from 1 than the first (printed to 2 decimals).
  EXPECT_LE(std::abs(kept - 1), std::abs(first - 1) + 0.005) << ok.output;
  const std::vector<std::string> lines =
      absl::StrSplit(ReadAll(jsonl), '\n', absl::SkipEmpty());
  std::filesystem::remove(jsonl);
  ASSERT_EQ(lines.size(), 1u);  // one configuration: the kept run only
  absl::StatusOr<json::Value> v = json::Parse(lines[0]);
  ASSERT_TRUE(v.ok()) << v.status();
  const double compute = v->Find("compute_s")->number() + v->Find("optimizer_s")->number() +
                         v->Find("other_s")->number();
  EXPECT_NEAR(v->Find("comm_s")->number() / compute, kept, 1e-4);
}

// --repeat N runs the grid N times over, one pass after the other: every run is in the files
// with its pass, each run's efficiency is against the 1-rank run of its own pass, and a last
// table gives the median and range per configuration.
TEST(FsdpBenchCli, RepeatRunsTheGridInPassesAndSummarisesThem) {
  const std::filesystem::path jsonl = TempPath("fsdp_bench_repeat_").replace_extension(".jsonl");
  const Ran ok = RunCli(
      "--worlds 1,2 --repeat 2 --steps 2 --warmup 1 --peak_gflops 50 "
      "--jsonl " +
      jsonl.string());
  ASSERT_EQ(ok.rc, 0) << ok.output;
  EXPECT_NE(ok.output.find("fsdp_bench: 4 runs (2 configurations x 2 passes)"), std::string::npos)
      << ok.output;
  EXPECT_NE(ok.output.find("[2/4 done] running nano FULL_SHARD 1 rank f32 prefetch (pass 2 of 2)"),
            std::string::npos)
      << ok.output;
  const size_t table = ok.output.find("over the 2 passes (--repeat)");
  ASSERT_NE(table, std::string::npos) << ok.output;
  // One line per configuration, each over 2 runs.
  EXPECT_NE(ok.output.find("nano       FULL_SHARD             1   1     2 ", table),
            std::string::npos)
      << ok.output;
  EXPECT_NE(ok.output.find("nano       FULL_SHARD             2   1     2 ", table),
            std::string::npos)
      << ok.output;
  const std::vector<std::string> lines = absl::StrSplit(ReadAll(jsonl), '\n', absl::SkipEmpty());
  std::filesystem::remove(jsonl);
  ASSERT_EQ(lines.size(), 4u);
  std::map<int, double> one_rank;                 // pass -> tokens/s of its 1-rank run
  std::vector<std::pair<int, double>> two_ranks;  // (pass, baseline_tokens_per_s)
  for (const std::string& line : lines) {
    absl::StatusOr<json::Value> v = json::Parse(line);
    ASSERT_TRUE(v.ok()) << v.status() << "\n" << line;
    ASSERT_NE(v->Find("pass"), nullptr) << line;
    const int pass = static_cast<int>(v->Find("pass")->number());
    if (v->Find("world_size")->number() == 1) {
      one_rank[pass] = v->Find("tokens_per_s")->number();
    } else {
      two_ranks.push_back({pass, v->Find("baseline_tokens_per_s")->number()});
    }
  }
  ASSERT_EQ(one_rank.size(), 2u);
  EXPECT_EQ(one_rank.count(1) + one_rank.count(2), 2u);
  ASSERT_EQ(two_ranks.size(), 2u);
  EXPECT_NE(two_ranks[0].first, two_ranks[1].first);
  for (const auto& [pass, baseline] : two_ranks) {
    EXPECT_EQ(baseline, one_rank[pass]) << "pass " << pass;
  }
}

TEST(FsdpBenchCli, BadFlagsExit2WithOneLine) {
  for (const char* args : {"--worlds 0",
                           "--strategies FOO",
                           "--dtypes f64",
                           "--bogus 1",
                           "--prefetch x",
                           "--prefetch 9",
                           "--layers -1",
                           "--layers x",
                           "--comm_to_compute 0",
                           "--comm_to_compute 1 --link_gbps 1",
                           "--comm_to_compute 1 --project",
                           "--match_tolerance 0.1",
                           "--comm_to_compute 1 --match_tolerance -1",
                           "--repeat 0",
                           "--repeat 101",
                           "--repeat x",
                           "--repeat 2 --project",
                           "--models gpt3",
                           "--seq 100",
                           "--steps",
                           "extra",
                           "--link_gbps -1",
                           "--strategies HYBRID_SHARD --worlds 4 --hybrid_shard 3",
                           "--inter_gbps 1",
                           "--worlds 2,3 --ranks_per_host 2",
                           "--worlds 4097",
                           "--worlds 1000000000",
                           "--ranks_per_host 4097",
                           "--hybrid_shard 2147483647",
                           "--batch 1048577",
                           "--layers 10001",
                           "--all_gather int4",
                           "--all_gather dtype,int8 --project",
                           "--quant_block 100"}) {
    ExpectUsageError(args);
  }
  const Ran help = RunCli("--help");
  EXPECT_EQ(help.rc, 0);
  for (const char* word : {"--link_gbps", "--inter_latency_us", "MFU", "exposed communication",
                           "efficiency", "tokens/s"}) {
    EXPECT_NE(help.output.find(word), std::string::npos) << word;
  }
}

#endif  // FSDP_BENCH_BINARY

}  // namespace
}  // namespace fsdp
