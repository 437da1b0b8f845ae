// The memory planner: what one rank of a sharded training run holds on its device, by the
// categories of the runtime's MemoryReport (fsdp/sharding.h), before anything is allocated.
//
// The figures come from the runtime's own rules, not from a formula fitted to them: the planner
// replays one training step's hooks (PreForward ... FinishBackward, Step) over the units' sizes
// with the runtime's allocation order, padding, dtypes, prefetch and rate limit, reduction queue
// and deferred frees, and counts every buffer in the category the runtime books it in. The
// model's share (activations) is what the model's Create would allocate for B x T. So a plan
// holds for any model size without allocating it (Llama 2 70B on a laptop), and the test
// tests/plan/plan_test.cc holds it to within 5% of the report measured on real training steps.
//
//   fsdp::PlanRequest r;
//   r.model = "llama2-7b";
//   r.world_size = 16;
//   r.ranks_per_host = 8;
//   r.strategy = fsdp::ShardingStrategy::kHybridShard;  // shard group: one host (8 ranks)
//   r.param_dtype = fsdp::DType::kBF16;
//   r.seq_len = 4096;
//   r.device_memory_bytes = 80LL << 30;
//   absl::StatusOr<fsdp::MemoryPlan> plan = fsdp::PlanMemory(r);
//   if (plan.ok()) std::puts(fsdp::FormatMemoryPlan(*plan).c_str());
//
// The step planned is the one ShardedModel runs (the root unit used for the whole step, each
// block unit in forward and, in reverse, in backward), on a backend whose compute completes in
// order (the CPU backend), from the second step on (the first records the order prefetching
// follows). A collective is taken to complete when the runtime waits for it: with
// max_prefetch_units <= 1 that changes nothing, with more it makes the gradient buffers an upper
// bound. An asynchronous accelerator may hold one more gathered unit that its queued compute
// still reads (docs/planning.md).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "fsdp/dtype.h"
#include "fsdp/nn/model_config.h"
#include "fsdp/sharding.h"
#include "fsdp/status.h"

namespace fsdp {

// Bounds on what the planner takes (docs/planning.md, "Bounds"); a request beyond one is an
// InvalidArgument error that names it, and a byte figure beyond int64 (8 EiB) is an error that
// says so, never a wrapped or negative number.
//  - Units: the replay is per unit, so a model has at most nn::kMaxLayers (10000) blocks and
//    the root unit: ten times the deepest transformer trained (DeepNet, 1000 layers). A
//    request at the bound plans in well under a second (tests/plan/plan_test.cc, PlanBounds).
//  - World: 1 << 20 ranks, tens of times the largest clusters trained on (tens of thousands
//    of accelerators); the replay's cost does not depend on it.
//  - A unit: 2^56 elements, so that each of its buffers, padded to the shard group, fits in
//    int64 bytes with room to spare.
inline constexpr int kMaxPlanUnits = nn::kMaxLayers + 1;
inline constexpr int kMaxPlanWorldSize = 1 << 20;
inline constexpr int64_t kMaxPlanUnitNumel = int64_t{1} << 56;
// Micro-batches per step the replay runs (each one replays every unit's hooks).
inline constexpr int kMaxPlanMicroBatches = 1024;

// A model as the planner needs it: plain numbers. PlanModelFor builds one from a bundled
// model's configuration; a framework with its own model fills it in itself.
struct PlanModel {
  std::string name;
  int64_t num_parameters = 0;
  // The runtime's units in registration order, as ShardedModel registers them: unit 0 is the
  // root unit (the model's root tensors plus every block that no other unit took), used for
  // the whole step; units 1.. are the wrapped blocks (or runs of blocks) in forward order.
  // Unpadded element counts; the runtime pads each to a multiple of the shard group size.
  std::vector<std::string> unit_names;
  std::vector<int64_t> unit_numel;
  // Bytes the model holds on the device for one micro-batch (its activations, gradient
  // scratch, f32 copies of low-precision parameters and the token buffers): with the
  // checkpointing of the request, with none, and with every block checkpointed (or with the
  // request's pattern when it asks for some).
  int64_t activation_bytes = 0;
  int64_t activation_bytes_without_checkpointing = 0;
  int64_t activation_bytes_with_checkpointing = 0;
};

struct PlanRequest {
  // The model: a bundled configuration's name (fsdp::nn::ModelConfig::Names(): "nano", "mini",
  // "gpt2", "gpt2-medium", "gpt2-xl", "llama-nano", "llama-mini", "llama2-7b", "llama2-13b",
  // "llama2-70b"), or `config` with explicit sizes (used when set; `model` is then ignored),
  // or `explicit_model`, a model given by its units' sizes (used when set).
  std::string model = "nano";
  std::optional<nn::ModelConfig> config;
  std::optional<PlanModel> explicit_model;

  int world_size = 1;      // data-parallel ranks
  int ranks_per_host = 0;  // 0: all ranks on one host. Must divide world_size.
  ShardingStrategy strategy = ShardingStrategy::kFullShard;
  // HYBRID strategies: ranks per shard group; 0 = ranks_per_host (one host per group).
  int hybrid_shard_size = 0;
  DType param_dtype = DType::kF32;   // gathered parameters and the model's Linear layers
  DType reduce_dtype = DType::kF32;  // gradient reductions
  OptimizerKind optimizer = OptimizerKind::kAdamW;
  bool sgd_momentum = false;  // SGD: a momentum buffer (momentum != 0)
  // Activation checkpointing, as ShardedModelOptions: one flag per block, or every k-th block
  // (blocks 0, k, 2k, ...) when checkpoint_blocks is empty and checkpoint_every > 0.
  int checkpoint_every = 0;
  std::vector<bool> checkpoint_blocks;
  int batch_size = 1;  // B, sequences per rank and micro-batch
  int seq_len = 0;     // T; 0 = the model's block size
  // Micro-batches per step and how their gradients accumulate (fsdp/sharding.h): no_sync holds
  // every unit's whole gradient between micro-batches; sharded and every hold only shards.
  int micro_batches = 1;
  Accumulation accumulation = Accumulation::kNoSync;
  int max_prefetch_units = 1;
  // Quantized communication (ShardingOptions::communication). An all-gather format: each
  // rank's codes and scales are kept with its parameter shard, and the shard group's are held
  // while a unit is gathered, until decoded. A reduction format: while a unit's gradient is
  // reduced, the codes this rank sends and receives and a decoded chunk (communication
  // buffers, counted with the gradient buffers).
  CommunicationOptions communication;
  // ShardingOptions::secondary_shard_size (FULL_SHARD, HYBRID_SHARD): each unit's 1/N of its
  // gathered parameters kept from its forward to its backward (secondary_param_peak_bytes).
  // N must divide the shard group and the ranks per host.
  int secondary_shard_size = 0;
  bool forward_prefetch = true;
  bool backward_prefetch = true;
  // Device memory per rank; 0 = unknown (the plan then says nothing about fitting).
  int64_t device_memory_bytes = 0;
  // Checkpoints saved in the background (AsyncCheckpointer): plan the snapshot's host memory.
  bool async_checkpoint = false;
  // ShardingOptions::offload: the units it chooses (by the same rule, over the units' shard
  // sizes and names) keep no optimizer state on the device; host_offload_bytes says what they
  // take on the host. Needs AdamW.
  OffloadOptions offload;
};

// Bytes per rank. The first eight fields are the MemoryReport fields of the same names (the
// "now" fields of a report are not planned: they are 0 between steps).
struct MemoryPlan {
  int64_t param_shard_bytes = 0;          // f32 master shards (and a quantized gather's codes)
  int64_t grad_shard_bytes = 0;           // f32 gradient shards
  int64_t optimizer_bytes = 0;            // AdamW exp_avg + exp_avg_sq (f32), SGD momentum
  int64_t gathered_param_peak_bytes = 0;  // unsharded units in param_dtype, at peak
  // Unsharded f32 gradients and the reductions' buffers, at peak (includes the next field).
  int64_t grad_buffer_peak_bytes = 0;
  int64_t activation_peak_bytes = 0;  // the model's buffers for B x T (a fixed allocation)
  int64_t secondary_param_peak_bytes = 0;  // secondary shards in param_dtype, at peak
  int64_t peak_bytes = 0;  // everything together at its peak (not the sum of the peaks)
  // Communication buffers: the runtime has no separate category for them. All-gathers run in
  // place into the gathered buffer (counted in gathered_param_peak_bytes); the reductions'
  // low-precision send copies, reduce-scatter outputs and widened shards, and the optimizer
  // step's gradient-norm scratch (the output of its all-gather over the shard group; booked
  // here at S = 1 too, (4 + 2 S + 3) f32 elements), are counted in grad_buffer_peak_bytes,
  // and this is their own peak. The transport's staging (the MPI
  // transport widens bf16/f16 reductions to f32 on the host) is host memory, outside the plan.
  int64_t communication_peak_bytes = 0;
  // Host memory, not in peak_bytes: a background save's snapshot of the rank's shards of
  // parameters and optimizer state (PlanRequest::async_checkpoint; 0 otherwise), an upper
  // bound of AsyncCheckpointer::snapshot_bytes() (which leaves out a last shard's padding).
  int64_t checkpoint_snapshot_bytes = 0;
  // Host memory, not in peak_bytes: what the offload holds (MemoryReport::host_offload_bytes),
  // and how many units it takes.
  int64_t host_offload_bytes = 0;
  int offloaded_units = 0;
  OffloadKind offload = OffloadKind::kNone;  // what those units keep on the host

  // What was planned.
  std::string model;
  int64_t num_parameters = 0;
  int num_units = 0;
  int world_size = 1;
  int replicate_size = 1;  // R of the R x S mesh
  int shard_size = 1;      // S: ranks each unit is sharded over
  ShardingStrategy strategy = ShardingStrategy::kFullShard;
  DType param_dtype = DType::kF32;
  DType reduce_dtype = DType::kF32;
  CommunicationOptions communication;
  int secondary_shard_size = 0;
  int batch_size = 1;
  int seq_len = 1;
  int checkpointed_blocks = 0;
  int num_blocks = 0;
  int max_prefetch_units = 1;
  // The activations without checkpointing and with (see PlanModel), for comparison.
  int64_t activation_bytes_without_checkpointing = 0;
  int64_t activation_bytes_with_checkpointing = 0;
  int64_t device_memory_bytes = 0;
  bool fits = true;  // peak_bytes <= device_memory_bytes (true when the latter is 0)

  int64_t persistent_bytes() const {
    return param_shard_bytes + grad_shard_bytes + optimizer_bytes;
  }
  // The plan as a MemoryReport, to compare with ShardingRuntime::memory().
  MemoryReport AsReport() const;
};

// Everything but the model: the settings a plan of a PlanModel needs. PlanMemory(PlanRequest)
// takes them from the request.
absl::StatusOr<MemoryPlan> PlanMemory(const PlanModel& model, const PlanRequest& settings);

// The PlanModel of a bundled model for the request's B, T, param_dtype and checkpointing,
// wrapped as ShardedModel wraps it (one unit per block, plus the root). Nothing is allocated.
absl::StatusOr<PlanModel> PlanModelFor(const nn::ModelConfig& config, const PlanRequest& request);

// The plan of a request. InvalidArgument, saying what is wrong and what to do, for bad input:
// an unknown model, T above the block size, B < 1, a world size the hybrid shard size or
// ranks_per_host does not divide, a dtype other than f32/bf16/f16, sizes beyond the bounds
// above, a B x T whose activations or a model whose shards come to more than int64 bytes, ...
absl::StatusOr<MemoryPlan> PlanMemory(const PlanRequest& request);

// The largest micro-batch B (sequences per rank) whose plan fits the request's device memory,
// everything else as in the request (its batch_size is ignored); 0 when not even B = 1 fits.
// Needs device_memory_bytes > 0 and a model whose activations the planner can size for any B
// (a bundled model or a config). Searches up to B = 1 << 20; a B whose activations come to
// more than int64 bytes does not fit. The replay runs once: each B counts only activations.
absl::StatusOr<int> LargestMicroBatch(const PlanRequest& request);

// One cell of a strategies x world sizes table.
struct PlanTableCell {
  ShardingStrategy strategy = ShardingStrategy::kFullShard;
  int world_size = 1;
  absl::Status status;  // why there is no plan (e.g. a hybrid shard size that does not divide)
  MemoryPlan plan;
  int largest_micro_batch = -1;  // -1 when the request has no device memory
};

// The request planned for every strategy and world size (row-major: strategies outer).
// Per-cell errors are in the cells; an error that no cell can avoid (a bad model, B < 1, ...)
// is returned.
absl::StatusOr<std::vector<PlanTableCell>> PlanTable(
    const PlanRequest& request, const std::vector<ShardingStrategy>& strategies,
    const std::vector<int>& world_sizes);

// Human-readable text: one line per category in GiB (and MiB), the total against the device.
std::string FormatMemoryPlan(const MemoryPlan& plan);
// A table: one row per cell (strategy, world, per-rank GiB of each category, peak, fits,
// largest micro-batch), as aligned text or as a Markdown table.
std::string FormatPlanTable(const std::vector<PlanTableCell>& cells, bool markdown = false);

// "80GiB", "80GB", "80 GiB", "81920MiB", "85899345920" (bytes), "1.5TiB": bytes. GB/MB/KB/TB
// are powers of 1000, GiB/MiB/KiB/TiB of 1024, a bare number is bytes.
absl::StatusOr<int64_t> ParseByteSize(std::string_view text);

}  // namespace fsdp

namespace fsdp {

// Physical memory of this host in bytes; 0 when unknown.
int64_t HostPhysicalMemoryBytes();

// Whether a planned run fits where it would run, before anything is allocated: the plan's
// peak per rank against `device_memory_bytes` (when > 0), and, when the device's memory is
// the host's (the cpu and sim backends), the peak times the `ranks_on_host` ranks against the
// host's physical memory (a run past it would page the host to a crawl or meet the OOM
// killer), and the offloaded state (MemoryPlan::host_offload_bytes) times the ranks against
// the host's memory on any backend. ResourceExhausted with the figures and what to change
// otherwise (offloading more units among the fixes when `can_offload`: a device backend).
absl::Status CheckPlanFits(const MemoryPlan& plan, int64_t device_memory_bytes,
                           int ranks_on_host, bool device_is_host, bool can_offload = false);

}  // namespace fsdp
