// The pieces of fsdp_bench (bench/fsdp_bench.cc): its command line (fsdp_bench_args.cc), the
// measured grid (fsdp_bench.cc) and the projection with its validation (fsdp_bench_project.cc).
// A tool's internals, not library API.
#pragma once

#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "fsdp/bench.h"
#include "fsdp/files.h"
#include "fsdp/nn/model_config.h"

namespace fsdp_bench {

// The command line, after ParseArgs checked it (defaults as fsdp_bench --help states them).
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
  // --all_gather (a grid axis of measured runs; projections take one) and --quant_block: the
  // format of the first entry, or each entry's in the measured grid.
  std::vector<fsdp::WireFormat> all_gather = {fsdp::WireFormat::kDType};
  // --reduction: the same for the gradient reduction (runs with a format reduce in f32).
  std::vector<fsdp::WireFormat> reduction = {fsdp::WireFormat::kDType};
  // --secondary_shard: ShardingOptions::secondary_shard_size per run (a grid axis; it applies
  // to FULL_SHARD and HYBRID_SHARD runs whose shard group it divides).
  std::vector<int> secondary_shard = {0};
  fsdp::CommunicationOptions communication;
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

// The command line, checked: bad usage prints one line naming the flag, its value and what is
// allowed, and exits with code 2; --help prints the options and exits with 0.
Args ParseArgs(int argc, char** argv);
[[noreturn]] void BadUsage(const std::string& message);
// f32, bf16 or f16 for `flag`, or bad usage.
fsdp::DType FloatDTypeFlag(const std::string& flag, const std::string& v);
// Every output file is new or of its own kind (bad usage otherwise).
void CheckOutputs(const Args& a);

// Shared by the measured runs and the projection (fsdp_bench.cc).
std::string RunName(const fsdp::BenchConfig& c, int world);
// The ranks each unit is sharded over: 1 for NO_SHARD, the world for FULL_SHARD and
// SHARD_GRAD_OP, for the HYBRID strategies the shard size given, else the ranks per host when
// they divide the world, else the world.
int ShardSize(fsdp::ShardingStrategy s, int world, int hybrid_shard, int ranks_per_host);
// A run of `model` with the grid's common settings (no strategy, world, link or peak yet).
fsdp::BenchConfig BaseConfig(const Args& a, const std::string& model, fsdp::DType dtype,
                             int checkpoint, int threads);
bool WriteFile(const std::string& path, const std::string& text, const fsdp::OutputKind& kind);

// fsdp_bench --project and --validate_projection (fsdp_bench_project.cc): the exit status.
int RunProjection(const Args& a);
int RunValidation(const Args& a);

}  // namespace fsdp_bench
