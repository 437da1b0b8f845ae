// The scaling harness: training steps of a bundled model (MODEL_SPEC.md) under one sharding
// configuration, measured the way docs/scaling.md defines the figures: tokens/s, step time
// (median and spread), MFU against a GEMM peak measured in the same run, the step split into
// compute, exposed communication and optimizer (from the timeline, fsdp/trace.h), bytes
// communicated per rank, peak memory per rank (MemoryReport) and host synchronisations.
// bench/fsdp_bench runs a grid of these and adds weak-scaling efficiency.
//
//   fsdp::BenchConfig c;
//   c.model = "mini";
//   c.world_size = 2;                 // ranks as threads of this process
//   c.threads_per_rank = 1;
//   absl::StatusOr<fsdp::BenchResult> r = fsdp::RunBench(c);
//   if (r.ok()) std::printf("%.0f tokens/s, MFU %.1f%%\n", r->tokens_per_s, 100 * r->mfu);
//
// Under mpirun each process calls RunBench(config, *world) with its MPI communicator instead
// (config.world_size and config.link are then ignored: the world is the communicator's).
//
// The tracer (fsdp/trace.h) is process-wide: RunBench enables it for its measured steps (and
// clears it afterwards unless it was already on, e.g. with FSDP_TRACE), so two RunBench calls
// must not run at once in one process.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "fsdp/backend.h"
#include "fsdp/communicator.h"
#include "fsdp/dtype.h"
#include "fsdp/nn/model_config.h"
#include "fsdp/registry.h"
#include "fsdp/sharding.h"
#include "fsdp/status.h"

namespace fsdp {

struct BenchConfig {
  // The model: a bundled configuration's name (nn::ModelConfig::Names()), or `config` when set.
  std::string model = "nano";
  std::optional<nn::ModelConfig> config;
  ShardingStrategy strategy = ShardingStrategy::kFullShard;
  // HYBRID strategies: ranks per shard group; 0 = link.ranks_per_host when set, else the whole
  // world (one group, i.e. FULL_SHARD's layout).
  int hybrid_shard_size = 0;
  int world_size = 1;        // ranks as threads (RunBench(config) only)
  int batch_size = 4;        // B: sequences per rank and step (weak scaling: fixed per rank)
  int seq_len = 64;          // T: 0 = the model's block size
  DType param_dtype = DType::kF32;
  DType reduce_dtype = DType::kF32;
  // What the parameter all-gather carries (ShardingOptions::communication).
  CommunicationOptions communication;
  // ShardingOptions::secondary_shard_size (FULL_SHARD, HYBRID_SHARD): 0 = off.
  int secondary_shard_size = 0;
  int checkpoint_every = 0;  // activation checkpointing: every k-th block (0 = off)
  // Forward and backward prefetch: at most this many units gathered ahead of their use per
  // direction (ShardingOptions::max_prefetch_units); 0 = no prefetch.
  int prefetch = 1;
  // OpenMP threads of each rank's kernels; 0 = the cores divided among the ranks of this
  // host (CpuBackendOptions::ranks_sharing_cores).
  int threads_per_rank = 0;
  int warmup_steps = 2;      // not measured (the first step records the prefetch order)
  int steps = 5;             // measured steps
  float max_grad_norm = 1.0f;
  // The simulated link of the local communicator (and the timeout): link_* inside a host,
  // inter_host_* between hosts of ranks_per_host ranks (fsdp/communicator.h).
  CommOptions link;
  // The GEMM peak per core in GFLOP/s for MFU; 0 = measured in this run (PeakGflopsPerCore).
  double peak_gflops_per_core = 0;
  std::string peak_kind = "given";  // what the given peak is (BenchResult::peak_kind)
  // The backend, by name from the registry (fsdp/registry.h), and its options (RunBench(config)
  // and RunBench(config, world); the overloads with a factory ignore them). MFU is against the
  // host CPU's GEMM peak, which is what the cpu and sim backends compute on.
  std::string backend = "cpu";
  BackendOptions backend_options;
};

// The GEMM peak of one core, as MODEL_SPEC.md "Figures" defines MFU's peak: oneDNN GEMM
// 2048^3 on one thread, median of `repeats`. f32: sgemm; bf16 / f16: the GEMM with operands in
// that dtype and f32 accumulation, falling back to sgemm when the CPU has no native one
// (`kind` says which: "f32 GEMM", "bf16 GEMM", "f32 GEMM (no native bf16 GEMM)").
struct GemmPeak {
  double gflops_per_core = 0;
  std::string kind;
};
GemmPeak PeakGflopsPerCore(DType compute_dtype, int repeats = 3);

struct BenchResult {
  // What ran.
  std::string model;
  std::string strategy;  // StrategyName
  int world_size = 0;
  int hybrid_shard_size = 0;  // ranks per shard group as run (FULL_SHARD: world; NO_SHARD: 1)
  int threads_per_rank = 0;   // as resolved
  int batch_size = 0, seq_len = 0;
  DType param_dtype = DType::kF32, reduce_dtype = DType::kF32;
  WireFormat all_gather = WireFormat::kDType;  // CommunicationOptions as run
  WireFormat reduction = WireFormat::kDType;
  int quant_block = 0;                         // their block size (0 with kDType for both)
  int secondary_shard_size = 0;                // ShardingOptions::secondary_shard_size as run
  int checkpoint_every = 0;
  int prefetch = 1;  // units gathered ahead (0 = none)
  int pass = 1;      // which pass over the grid this run belongs to (fsdp_bench --repeat), from 1
  int warmup_steps = 0, steps = 0;
  double link_gbps = 0, link_latency_us = 0;  // GB/s = 1e9 bytes/s
  int ranks_per_host = 0;
  double inter_gbps = 0, inter_latency_us = 0;
  int64_t num_parameters = 0;

  // Step time: a step's time is the slowest rank's (ranks start each step together).
  double step_median_s = 0, step_min_s = 0, step_max_s = 0, step_p10_s = 0, step_p90_s = 0;
  int64_t tokens_per_step = 0;  // B * T * world_size
  double tokens_per_s = 0;      // tokens_per_step / step_median_s
  double model_flops_per_step = 0;  // MODEL_SPEC.md (6 P tokens + 12 L C T tokens)
  double achieved_tflops = 0;       // model_flops_per_step / step_median_s / 1e12
  double peak_gflops_per_core = 0;
  std::string peak_kind;
  // world_size * threads_per_rank; with ranks as threads at most the hardware threads of
  // this process (oversubscribed ranks share cores).
  int cores_used = 0;
  double mfu = 0;  // achieved / (peak_gflops_per_core * cores_used), a fraction

  // The step split, seconds per step, the mean over ranks and measured steps (from the
  // timeline). They add up to step_mean_s, the mean of the ranks' own step times.
  double compute_s = 0;        // forward / backward / recompute of the blocks ("compute" lane)
  double exposed_comm_s = 0;   // compute thread blocked on collectives ("wait" lane)
  double optimizer_s = 0;      // Step(): norm, clip, AdamW (less the waits inside it)
  double other_s = 0;          // the rest: embedding, head and loss, token copies, host work
  double step_mean_s = 0;
  double exposed_comm_fraction = 0;  // exposed_comm_s / step_mean_s
  // exposed_comm_s by where in the step the compute thread waited (they add up to it): before
  // the first block's forward (the first gathers), from there to the end of the last forward
  // block, then to the first backward block (head and loss), to the end of the last backward
  // block, from there to the optimizer step (the reductions still in flight: FinishBackward),
  // and in and after the optimizer step (the global norm's collective).
  double exposed_start_s = 0, exposed_forward_s = 0, exposed_head_s = 0, exposed_backward_s = 0,
         exposed_tail_s = 0, exposed_optimizer_s = 0;

  // Communication per rank per step, counted from the collectives this rank ran (the "comm"
  // lane's spans: world, shard and replicate groups, control data included).
  double comm_bytes_per_rank = 0;  // sum of their sizes S (nccl-tests: the gathered output of
                                   // an all_gather, the full input of a reduce_scatter)
  double bus_bytes_per_rank = 0;   // what the rank sends on a ring: S (n-1)/n for all_gather,
                                   // reduce_scatter and all_to_all, 2 S (n-1)/n for all_reduce
  int64_t collectives_per_step = 0;
  // The collectives' own time per rank and step, added up: each "comm" span less the time it
  // waited for its peers (peer_wait_ns). With a simulated link, the time the step's bytes take
  // on it; compare with compute_s + optimizer_s + other_s to see how slow the link is.
  double comm_s = 0;

  // Memory per rank (the largest over ranks of each field) after the measured steps, peaks
  // since the start of the measured steps: ShardingRuntime::memory().
  MemoryReport memory;
  double host_syncs_per_step = 0;  // StepStats::host_syncs, mean over measured steps (rank 0)
  float final_loss = 0;            // rank 0's loss of the last step

  // Weak scaling against one rank (SetScalingEfficiency): tokens_per_s / (world_size x the
  // 1-rank run's tokens_per_s); NaN when the grid had no such run.
  double scaling_efficiency = 0;
  double baseline_tokens_per_s = 0;

  std::vector<double> step_times_s;  // every measured step, in order

  // Where the compute of a step goes, for projections (fsdp/project.h): seconds per step, the
  // mean over ranks and measured steps, each less the waits on collectives inside it. Per block
  // (index = block): its forward, backward and recompute spans on the "compute" lane. Around
  // them: from the step's start to the first block's forward (token copies, embedding), the
  // gaps between blocks in forward and in backward (the hooks' host work), from the last
  // forward to the first backward (head, loss, head backward), from the last backward to the
  // optimizer (embedding backward), and from the optimizer's end to the step's end.
  std::vector<double> block_forward_s, block_backward_s, block_recompute_s;
  double before_blocks_s = 0, forward_gaps_s = 0, head_s = 0, backward_gaps_s = 0,
         after_blocks_s = 0, after_optimizer_s = 0;
};

// Makes the backend of `rank`, on the thread that runs the rank.
using BenchBackendFactory = std::function<absl::StatusOr<std::unique_ptr<Backend>>(int rank)>;

// Collective over `world`: every rank calls it with the same config and its backend factory;
// every rank gets the same result. The communicator's own options (link, timeout) apply;
// config.world_size is ignored.
absl::StatusOr<BenchResult> RunBench(const BenchConfig& config, Communicator& world,
                                     const BenchBackendFactory& make_backend);
// The same with config.world_size ranks as threads of this process (LocalWorld, config.link).
absl::StatusOr<BenchResult> RunBench(const BenchConfig& config,
                                     const BenchBackendFactory& make_backend);
// Both with config.backend from the registry (RegistryBenchBackend).
absl::StatusOr<BenchResult> RunBench(const BenchConfig& config);
absl::StatusOr<BenchResult> RunBench(const BenchConfig& config, Communicator& world);
// The factory of config.backend with config.backend_options, to which it adds, for cpu and sim
// unless given, "threads" (config.threads_per_rank) and "ranks_sharing_cores"
// (`ranks_sharing_cores`: the ranks on this host).
BenchBackendFactory RegistryBenchBackend(const BenchConfig& config, int ranks_sharing_cores);

// Weak-scaling efficiency for every result that has a 1-rank run of the same configuration
// (model, B, T, dtypes, checkpointing, prefetch, threads per rank, pass; the same strategy
// first, else any, since one rank communicates nothing whatever the strategy) in `results`.
void SetScalingEfficiency(std::vector<BenchResult>& results);

}  // namespace fsdp
