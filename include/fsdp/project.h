// Projection: the step time, exposed communication and scaling efficiency of a sharded training
// run on a described cluster, predicted from what one step computes (per unit) and from the
// bytes its collectives move over the cluster's links. docs/scaling.md, "Projection", has the
// long form and the validation against measured runs.
//
// The model is a replay of one step of the sharding runtime (fsdp/sharding.h) as ShardedModel
// drives it, with the runtime's own rules: gathers issued on use and (with prefetch) one unit
// ahead in the recorded order, the root unit and the last block kept gathered from forward into
// backward under FULL_SHARD, SHARD_GRAD_OP keeping every unit, a reduce-scatter issued after
// each unit's backward with at most one more in flight, HYBRID's all-reduce of the reduced
// shard across replicas issued as the runtime moves the reduce-scatter on, the drain at the end
// of backward and the gradient norm's all-gather in the optimizer step. Two kinds of timeline
// per rank: the compute thread (serial) and one serial queue per communicator (the shard group
// and the replicate group), as the runtime's communicators run their collectives one after
// another. Exposed communication is the time the compute thread waits for a collective.
//
//   fsdp::StepProfile p = *fsdp::ProfileFromFlops(config, device, workload, /*shard_size=*/128);
//   fsdp::LinkSpec link;  // 8 devices per host, NVLink inside, the network between hosts
//   link.algorithm = fsdp::CollectiveAlgorithm::kRing;
//   link.ranks_per_host = 8;
//   link.intra_bytes_per_s = 450e9;
//   link.inter_bytes_per_s = 400e9;
//   fsdp::ProjectionRun run;
//   run.world_size = 128;
//   fsdp::Projection r = *fsdp::ProjectStep(p, link, run);  // r.step_s, r.exposed_comm_s ...
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "fsdp/bench.h"
#include "fsdp/communicator.h"
#include "fsdp/dtype.h"
#include "fsdp/nn/model_config.h"
#include "fsdp/plan.h"
#include "fsdp/sharding.h"
#include "fsdp/status.h"

namespace fsdp {

// What one step of one rank computes, by place in the step, in seconds; and the units' sizes.
struct StepProfile {
  std::string source;  // where the figures come from ("measured: ...", "FLOPs: ...")
  // The runtime's units as ShardedModel registers them: unit 0 is the root (embedding, head,
  // final norm), unit i >= 1 is block i - 1. Unpadded element counts.
  std::vector<int64_t> unit_numel;
  // Per block: forward, backward and recompute (activation checkpointing; 0 without).
  std::vector<double> block_forward_s, block_backward_s, block_recompute_s;
  double before_blocks_s = 0;   // token copies and embedding, before the first block
  double forward_gaps_s = 0;    // host work between blocks in forward (the whole step's)
  double head_s = 0;            // head, loss and head backward
  double backward_gaps_s = 0;   // host work between blocks in backward
  double after_blocks_s = 0;    // embedding backward, before the optimizer
  double optimizer_s = 0;       // the optimizer step, less its wait for the norm
  double after_optimizer_s = 0;
  // Waits for collectives that a run with no link cost measured (ranks out of step, the copies,
  // the rendezvous): added to the step as exposed communication. 0 from FLOPs.
  double sync_s = 0;
  DType param_dtype = DType::kF32;   // the gathers' dtype
  DType reduce_dtype = DType::kF32;  // the reductions' dtype
  int64_t tokens_per_rank = 0;       // B x T (for tokens/s)
  double model_flops_per_rank = 0;   // MODEL_SPEC.md FLOPs of B x T tokens (for MFU)

  int num_blocks() const { return static_cast<int>(block_forward_s.size()); }
  // Everything the compute thread does in a step without communication.
  double compute_s() const;
};

// How collectives are charged.
enum class CollectiveAlgorithm : uint8_t {
  // The local communicator's simulated link, exactly as collectives/local charges it: an
  // all_gather or reduce_scatter of chunk c bytes per rank costs every rank the sum over the
  // other ranks q of latency(r, q) + c / bandwidth(r, q); an all_reduce two such phases of its
  // slice (ceil(count / n) elements, 64-byte aligned); a collective ends when its slowest rank
  // ends.
  kSimulatedLink,
  // NCCL's ring over the group: an all_gather or reduce_scatter of S bytes in all (n chunks)
  // takes (n-1)/n S / busbw, an all_reduce 2 (n-1)/n S / busbw, busbw the slowest leg of the
  // ring: a device's intra-host bandwidth, or, for a group across hosts, the host's inter-host
  // bandwidth divided among the groups of that host that run at the same time (a ring moves
  // (n-1)/n S through each host's network interface, however many of its devices it holds);
  // plus the latency of each hop around the ring.
  kRing,
  // Two levels: among the hosts (devices with the same local index, each with its share of the
  // host's inter-host bandwidth), then inside each host; the two phases' times add up.
  kHierarchical,
};
std::string_view CollectiveAlgorithmName(CollectiveAlgorithm a);  // "simulated", "ring", ...
absl::StatusOr<CollectiveAlgorithm> ParseCollectiveAlgorithm(std::string_view name);

// The network between the ranks.
struct LinkSpec {
  CollectiveAlgorithm algorithm = CollectiveAlgorithm::kSimulatedLink;
  // Ranks (devices) per host; 0 = one host holding every rank (one level of link).
  int ranks_per_host = 0;
  // Inside a host: bytes/s of one device's link (one direction) and seconds per transfer/hop.
  // 0 bandwidth: transfers cost only their latency.
  double intra_bytes_per_s = 0;
  double intra_latency_s = 0;
  // Between hosts. kSimulatedLink: between two ranks on different hosts (as CommOptions);
  // kRing / kHierarchical: the whole host's network bandwidth (one direction), shared by its
  // devices.
  double inter_bytes_per_s = 0;
  double inter_latency_s = 0;
  // kRing / kHierarchical: the fraction of each bandwidth that collectives achieve (NCCL's
  // algorithm and protocol efficiency, the network's achieved rate); 1 = the link's rate.
  double intra_efficiency = 1.0;
  double inter_efficiency = 1.0;
};
// The link of a BenchConfig's CommOptions, as the local communicator charges it.
LinkSpec SimulatedLink(const CommOptions& options);

// The most micro-batches a projected step replays (each is a replay of every block).
inline constexpr int kMaxProjectedMicroBatches = 1024;

// The strategy and world of one projected run.
struct ProjectionRun {
  ShardingStrategy strategy = ShardingStrategy::kFullShard;
  int world_size = 1;
  // HYBRID strategies: ranks per shard group; 0 = link.ranks_per_host when it divides the world,
  // else the world.
  int hybrid_shard_size = 0;
  int prefetch = 1;  // forward and backward prefetch: units gathered ahead (0 = none)
  // Micro-batches per step (the profile's times are one micro-batch's; the optimizer runs
  // once), and how their gradients accumulate (fsdp/sharding.h).
  int micro_batches = 1;
  Accumulation accumulation = Accumulation::kNoSync;
  // A quantized parameter all-gather: each unit's all-gather carries S x its chunk's codes and
  // scales (fsdp/wire_format.h) instead of the padded unit in param_dtype. The quantize and
  // decode kernels are not in the profile's times.
  CommunicationOptions communication;
  // ShardingOptions::secondary_shard_size (FULL_SHARD, HYBRID_SHARD): backward's all-gathers
  // of the units resharded after forward run over the secondary group (N consecutive ranks,
  // group "secondary") in param_dtype instead of over the shard group. 0: off.
  int secondary_shard_size = 0;
  // The fraction by which compute slows down while a collective runs beside it (on a GPU,
  // NCCL's kernels take streaming multiprocessors and memory bandwidth); 0 = not at all.
  double overlap_slowdown = 0;
};

// One collective of the projected step.
struct ProjectedCollective {
  std::string kind;   // "all_gather", "reduce_scatter", "all_reduce", "all_to_all"
  std::string group;  // "shard", "replicate" or "secondary"
  int unit = -1;      // -1: the gradient norm's all_gather
  int64_t bytes = 0;  // nccl-tests' size S: the gathered output / full input / the buffer
  double start_s = 0, end_s = 0;
};

struct Projection {
  double step_s = 0;          // the step's time (every rank alike)
  double compute_s = 0;  // the compute thread's work (StepProfile::compute_s per micro-batch,
                         // the optimizer once), at full speed
  double exposed_comm_s = 0;  // the compute thread waiting for collectives
  double comm_busy_s = 0;     // time at least one collective of the rank is running
  double comm_total_s = 0;    // the collectives' durations added up
  double bus_bytes_per_rank = 0;  // S (n-1)/n per all_gather / reduce_scatter, 2 S (n-1)/n
                                  // per all_reduce, as BenchResult counts them
  double comm_bytes_per_rank = 0;  // the sizes S added up
  int shard_size = 1, replicate_size = 1;
  double tokens_per_s = 0;  // world x micro_batches x tokens_per_rank / step_s (0 without tokens)
  std::vector<ProjectedCollective> collectives;  // in the order they were issued
};

// Replays one step. InvalidArgument (what is wrong, what to do) for a profile without blocks or
// with negative or non-finite times, unit sizes that do not match the blocks, a world < 1, a
// hybrid shard size that does not divide the world, a link with negative figures or
// ranks_per_host that does not divide the world, or an overlap_slowdown outside [0, 1).
// The bounds are the memory planner's (plan.h): a world of at most kMaxPlanWorldSize (1 << 20)
// ranks, at most nn::kMaxLayers (10000) blocks, units of at most kMaxPlanUnitNumel elements.
// micro_batches: 1 to kMaxProjectedMicroBatches.
// A collective's cost is worked out from its group's shape (ranks, hosts, the most and fewest
// ranks on a host), once per group, so the replay does not grow with the world: a projection
// at the bounds answers in well under a second (tests/bench/project_test.cc).
absl::StatusOr<Projection> ProjectStep(const StepProfile& profile, const LinkSpec& link,
                                       const ProjectionRun& run);

// The time of one collective over the ranks `group` (world ranks) on `link`: kind kAllGather,
// kReduceScatter (`bytes` = nccl-tests' S, the whole gathered / scattered buffer) or kAllReduce
// (`bytes` = the buffer); `elem_bytes` is the dtype's size (the all_reduce's slices are
// aligned to 64 bytes of it). The slowest rank's time. Groups of up to kMaxPlanWorldSize ranks.
absl::StatusOr<double> CollectiveSeconds(CollectiveKind kind, int64_t bytes, int elem_bytes,
                                         const std::vector<int>& group, const LinkSpec& link);

// The profile of a measured run (RunBench): its per-block compute, the places around the
// blocks, and the units' sizes of `config` (the run's model); sync_s is the run's exposed
// communication when it ran with no simulated link (bandwidth and latencies 0), else 0.
// FailedPrecondition when the result has no per-block figures.
absl::StatusOr<StepProfile> ProfileFromBench(const BenchResult& result,
                                             const nn::ModelConfig& config);

// A device for ProfileFromFlops.
struct DeviceSpec {
  std::string name;
  double peak_flops = 0;         // dense FLOP/s in the compute dtype (data sheet)
  double achieved_fraction = 0;  // of the peak, in the model's matmuls (forward and backward)
  double memory_bytes_per_s = 0;  // HBM bandwidth: the optimizer step is memory-bound
};
struct FlopsWorkload {
  int batch_size = 1;  // B per rank
  int seq_len = 0;     // T; 0 = the model's block size
  DType param_dtype = DType::kBF16;
  DType reduce_dtype = DType::kBF16;
  int checkpoint_every = 0;  // activation checkpointing every k-th block: recompute its forward
};
// A profile from MODEL_SPEC.md's FLOPs at peak x achieved fraction: a block's forward
// 2 P_block tokens + 4 C T tokens FLOPs, its backward twice that, recompute one forward more;
// the head (the lm_head matmul) 2 V C tokens forward and twice that backward; the optimizer
// reads and writes 28 bytes per parameter of the rank's shard (f32 master, gradient, two AdamW
// moments; the shard is 1/shard_size of the model) at memory_bytes_per_s. The embedding lookup,
// norms, activations' element-wise work and the hooks' host work are taken as free.
absl::StatusOr<StepProfile> ProfileFromFlops(const nn::ModelConfig& config,
                                             const DeviceSpec& device,
                                             const FlopsWorkload& workload, int shard_size);

}  // namespace fsdp
