// The sharding runtime (FSDP / ZeRO): flat-parameter units, the four strategies, the sharded
// optimizer, gradient clipping, accumulation and memory accounting.
//
// A unit is a group of parameters flattened into one contiguous f32 buffer, padded so that
// every rank of the shard group holds the same number of elements. Between uses each rank
// keeps only its shard (and the gradient and optimizer-state shards of the same shape).
//
// The per-unit hooks, for frameworks that run their own autograd (the bundled GPT uses the
// same ones, see fsdp/nn/sharded_gpt.h). One step with every unit u, in the model's order:
//
//   for each micro-batch:
//     view = PreForward(u)      // gathered parameters of u (read them with your kernels)
//     ... forward of u ...
//     PostForward(u)            // FULL_SHARD frees the gathered parameters again
//     ... loss ...
//     view = PreBackward(u)     // (reverse order) parameters again, plus a gradient buffer
//     ... backward of u, accumulating (+=) into view.grads ...
//     PostBackward(u)           // reduce-scatters the gradient asynchronously
//     FinishBackward()          // waits for the reductions (HYBRID: all-reduce across groups)
//   Step()                      // clip by global norm, optimizer update of the local shards
//
// With set_sync_gradients(false) (FSDP's no_sync) PostBackward keeps the unit's full
// gradient and accumulates into it; the next backward with sync on reduces it once. With
// set_requires_all_reduce(false) (HYBRID strategies, FSDP2's set_requires_all_reduce) each
// backward reduce-scatters inside the shard group and accumulates the shard, and the next
// backward with it on all-reduces the sum across replicas once (Accumulation below). The
// gradient that Step() uses is the mean over the data-parallel ranks and over the backward
// passes since the last step, i.e. the gradient of the mean loss of the concatenated batch.
//
// Every hook checks the order it is called in and the shapes registered on each rank, and
// reports a violation as an error before any data is touched.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "fsdp/backend.h"
#include "fsdp/communicator.h"
#include "fsdp/data_plane.h"
#include "fsdp/optim.h"
#include "fsdp/status.h"
#include "fsdp/wire_format.h"

namespace fsdp {

enum class ShardingStrategy : uint8_t {
  kFullShard,          // shard params, grads, optimizer; gather in forward and in backward
  kShardGradOp,        // gather once in forward, keep until the unit's backward ends
  kNoShard,            // replicate everything, all-reduce gradients (DDP)
  kHybridShard,        // FULL_SHARD inside a shard group, replicate across groups
  kHybridShardGradOp,  // SHARD_GRAD_OP inside a shard group, replicate across groups
};
std::string_view StrategyName(ShardingStrategy s);  // "FULL_SHARD", ...
// Accepts the names of StrategyName, case-insensitive, '-' or '_'.
absl::StatusOr<ShardingStrategy> ParseStrategy(std::string_view name);

// How a step of K micro-batches accumulates its gradients: the switches of micro-batch j
// (ConfigureMicroBatch). train_gpt --accumulate, the collective-count tests and the
// projection (fsdp/project.h) use the same modes.
enum class Accumulation : uint8_t {
  // sync_gradients off until the last micro-batch: every unit's whole gradient is held
  // between micro-batches, and one reduction per unit and step (FSDP's no_sync).
  kNoSync,
  // sync on every micro-batch: each reduce-scatters inside the shard group into the f32
  // gradient shard, and HYBRID strategies all-reduce across replicas only in the last (FSDP2's
  // set_requires_all_reduce(False) until the last). Gradients stay sharded; the link between
  // hosts carries one all-reduce per step. Without replicas it is kEvery.
  kSharded,
  // Every reduction on every micro-batch.
  kEvery,
};
std::string_view AccumulationName(Accumulation a);  // "no_sync", "sharded", "every"
absl::StatusOr<Accumulation> ParseAccumulation(std::string_view name);

struct ParamInfo {
  ParamInfo() = default;
  ParamInfo(std::string name, std::vector<int64_t> shape, bool requires_grad = true,
            std::optional<bool> weight_decay = std::nullopt)
      : name(std::move(name)), shape(std::move(shape)), requires_grad(requires_grad),
        weight_decay(weight_decay) {}

  std::string name;
  std::vector<int64_t> shape;
  bool requires_grad = true;  // false: frozen (no gradient, never updated)
  // Weight decay; when unset, tensors of two or more dimensions get it (MODEL_SPEC.md).
  std::optional<bool> weight_decay;
};

enum class OptimizerKind : uint8_t { kAdamW, kSgd };

// Mixed precision. The optimizer always updates fp32 master shards; parameters are gathered
// (and handed to the model) in param_dtype, gradients are reduced in reduce_dtype (bf16 and
// f16 reductions accumulate in f32 inside the communicator and round once).
struct MixedPrecision {
  DType param_dtype = DType::kF32;
  DType reduce_dtype = DType::kF32;
  // Dynamic loss scaling (turn it on for f16 training): the model multiplies the
  // loss gradient by loss_scale(); Step() unscales, and when any rank's gradients hold an
  // inf or NaN the step is skipped on every rank and the scale backs off; after
  // growth_interval good steps in a row it grows.
  bool dynamic_loss_scale = false;
  float initial_loss_scale = 65536.0f;
  float growth_factor = 2.0f;
  float backoff_factor = 0.5f;
  int growth_interval = 2000;
};

// What Step() does when the gradients hold an inf or NaN (on any rank; every rank decides
// the same, from the global gradient norm). With dynamic loss scaling an overflow always
// skips the step and backs the scale off, whatever this says.
enum class NonFinitePolicy : uint8_t {
  kError,  // Step() fails on every rank with OutOfRange, naming the step and the units
  kSkip,   // the step is skipped on every rank (no update, gradients dropped) and counted
};

// Quantized communication (DeepSpeed ZeRO++'s qwZ, torchao's float8 all-gather): what a unit's
// parameter all-gather carries on the wire across its shard group.
struct CommunicationOptions {
  // kDType: param_dtype, as without it. int8 / fp8: each rank block-quantizes its f32 master
  // shard once per forward pass (the backward's regather reuses those codes), the shard group
  // all-gathers codes and scales (fsdp/wire_format.h: about 1 + 4 / block_size bytes per
  // element), and every rank decodes all of them, its own included, into the gathered buffer
  // in param_dtype: every rank computes with the same parameters. The f32 master shards and
  // the optimizer stay exact. A shard group of one rank gathers nothing and ignores it.
  WireFormat all_gather = WireFormat::kDType;
  // What a unit's gradient reduction carries (DeepSpeed ZeRO++'s qgZ). kDType: reduce_dtype, as
  // without it. int8 / fp8: the sum is taken in f32 from codes quantized once, so its error
  // does not grow with the number of ranks:
  // - in the shard group, each rank block-quantizes its f32 gradient once per backward, chunk
  //   d for rank d, the group exchanges the chunks (all_to_all), and each rank decodes the
  //   group's codes of its own shard and adds them in f32, in rank order (the mean);
  // - across replicas (HYBRID; NO_SHARD's all-reduce), each rank quantizes its reduced shard,
  //   the replicas all-gather the codes and every replica decodes and adds all of them in the
  //   same order: the replicas keep bitwise-equal gradient shards. This moves (R - 1) chunks
  //   per rank, less than an f32 ring all-reduce's 2 (R - 1) / R for R < 8 replicas.
  // Needs reduce_dtype f32 (the gradient is quantized from f32) and no dynamic loss scaling.
  WireFormat reduction = WireFormat::kDType;
  // Elements per scale: a power of two from 16 to 65536. Blocks split each rank's shard (the
  // last block of a shard may be shorter).
  int block_size = 256;
  bool quantizes() const {
    return all_gather != WireFormat::kDType || reduction != WireFormat::kDType;
  }
};
// InvalidArgument, naming the field and the allowed values, for a block size out of range when
// a format is set. (Whether the backend has the format is checked when the runtime is created.)
absl::Status CheckCommunicationOptions(const CommunicationOptions& c);
// Whether a unit's parameter all-gather over a shard group of `shard_size` ranks carries codes
// and scales: a format is set and there is more than one rank to gather from. The runtime, the
// planner and the projection decide by it.
inline bool QuantizesAllGather(const CommunicationOptions& c, int shard_size) {
  return c.all_gather != WireFormat::kDType && shard_size > 1;
}
// Whether a unit's gradient reduction in the shard group exchanges codes (all_to_all), and
// whether its reduction across `replicate_size` replicas all-gathers codes.
inline bool QuantizesReduceScatter(const CommunicationOptions& c, int shard_size) {
  return c.reduction != WireFormat::kDType && shard_size > 1;
}
inline bool QuantizesReplicaReduction(const CommunicationOptions& c, int replicate_size) {
  return c.reduction != WireFormat::kDType && replicate_size > 1;
}
// A quantized reduction across `replicate_size` replicas cuts a shard of `shard_numel` elements
// into chunks of this many (the last replicas' shorter, or empty), each sent in a slot of the
// layout's bytes(). The runtime, the planner and the projection size them by it.
inline QuantizedLayout ReplicaChunkLayout(const CommunicationOptions& c, int64_t shard_numel,
                                          int replicate_size) {
  return {(shard_numel + replicate_size - 1) / replicate_size, c.block_size};
}
// InvalidArgument, naming the option, when a quantized reduction meets a reduce_dtype other
// than f32 (its codes are made from the f32 gradient and added in f32).
absl::Status CheckReductionDtype(const CommunicationOptions& c, DType reduce_dtype);

// Offload to host memory (FSDP2's CPUOffloadPolicy, DeepSpeed ZeRO-Offload): the AdamW state
// (exp_avg, exp_avg_sq) of the chosen units lives in host memory, and their optimizer step runs
// on the host (the CPU AdamW kernel, vectorised, on the host's threads). Per step and offloaded
// unit, after the gradient is clipped and averaged on the device, its gradient and parameter
// shards go to the host (stream-ordered, CopyToHostAsync into pinned memory, so the copy of one
// unit overlaps the host's update of the one before), the host updates them on a worker thread
// while the device steps the other units and the next forward starts, and the updated shard
// goes back (CopyFromHostAsync) right before the unit's next gather needs it. The result is
// bitwise the device's (the same AdamW kernel; the device backends compute with it too).
// Host memory per offloaded unit: 16 bytes per shard element (the two state tensors and the
// parameter and gradient staging); device memory saved: 8. Needs AdamW and a device whose
// memory is not the host's (the cpu backend refuses: there is nothing to move).
//
// kAll (FSDP1's CPUOffload(offload_params=True), ZeRO-Offload with the parameters): the unit's
// f32 parameter shard and its gradient shard live on the host as well, so the device holds
// none of the unit's 16 bytes per shard element between uses. Before each gather the shard is
// copied up into a transient device buffer (freed once the gather has read it); each reduced
// gradient shard is copied down (on the communication stream) and added into the host's
// gradient shard by the host's worker; at Step the global norm reads each host gradient shard
// through a transient device copy (the same kernel, in the same order: the norm is bitwise the
// device's), and the host clips, updates and zeroes. Host memory: 20 bytes per shard element
// (the parameters, the accumulated gradient, the state, and staging for an arriving gradient).
// Not with HYBRID's set_requires_all_reduce(false) accumulation (the fold across micro-batches
// reads the accumulated shard on the device): PostBackward says so.
enum class OffloadKind : uint8_t {
  kNone,
  kOptimizer,  // the optimizer state of the chosen units, and their update
  kAll,        // also their parameter and gradient shards
};
std::string_view OffloadName(OffloadKind k);  // "none", "optimizer", "all"
absl::StatusOr<OffloadKind> ParseOffload(std::string_view name);

struct OffloadOptions {
  OffloadKind what = OffloadKind::kNone;
  // The units offloaded: those named here (unit names as registered), when not empty; else
  // chosen by `budget_bytes`.
  std::vector<std::string> units;
  // Host bytes per rank the offload may take (OffloadHostBytes per unit). Units are taken
  // largest first (ties: by name), as long as the running total fits: the first unit that does
  // not fit ends the choice. So the choice does not depend on the order units were registered,
  // grows with the budget (a larger budget offloads a superset), and never overshoots it.
  // < 0: every unit.
  int64_t budget_bytes = -1;
};
// Host bytes per rank that offloading a unit of `shard_numel` elements per rank takes: 16 per
// element for kOptimizer, 20 for kAll.
inline int64_t OffloadHostBytes(int64_t shard_numel, OffloadKind what = OffloadKind::kOptimizer) {
  return (what == OffloadKind::kAll ? 20 : 16) * shard_numel;
}
// The units OffloadOptions chooses among units of `shard_numel` elements per rank named
// `names`: their indices, ascending. InvalidArgument for a name in `o.units` that no unit has.
absl::StatusOr<std::vector<int>> ChooseOffloadedUnits(const OffloadOptions& o,
                                                      const std::vector<std::string>& names,
                                                      const std::vector<int64_t>& shard_numel);

struct ShardingOptions {
  ShardingStrategy strategy = ShardingStrategy::kFullShard;
  // HYBRID strategies: ranks per shard group (the mesh is world/shard x shard). Must divide
  // the world size. 0: the ranks of one host (fsdp::DiscoverHostLayout; every host must hold
  // the same number of consecutive ranks). Ignored by the other strategies.
  int hybrid_shard_size = 0;
  OptimizerKind optimizer = OptimizerKind::kAdamW;
  AdamWOptions adamw;
  SgdOptions sgd;
  float max_grad_norm = 0.0f;  // clip by global norm when > 0
  // Overlap: while a unit computes, the all-gather of the next unit (in the order recorded
  // during the first forward / backward pass) is already in flight.
  bool forward_prefetch = true;
  bool backward_prefetch = true;
  // Rate limit (FSDP's limit_all_gathers): at most this many units gathered ahead of their
  // use at once, per direction, so prefetching raises the peak of gathered parameters by at
  // most this many units.
  int max_prefetch_units = 1;
  MixedPrecision mixed_precision;
  CommunicationOptions communication;
  NonFinitePolicy nonfinite = NonFinitePolicy::kError;
  // A secondary shard inside each host (DeepSpeed ZeRO++'s hpZ; FSDP2's reshard_after_forward
  // as an int). 0: off. N: FULL_SHARD and HYBRID_SHARD keep, after a unit's forward, 1/N of
  // its gathered parameters on each rank (in param_dtype, the values forward computed with)
  // instead of only the 1/S shard, and the unit's backward all-gather runs over a secondary
  // group of N ranks (consecutive ranks of the shard group, which must share a host) instead
  // of the whole shard group: backward's gathers never leave the host, and its results are
  // bitwise forward's. Costs P / N elements of param_dtype per unit of P (padded) elements
  // from its forward to its backward (MemoryReport::secondary_param_*). N must divide the
  // shard group size S, with 2 <= N < S.
  int secondary_shard_size = 0;
  // Offload of the optimizer state to host memory (OffloadOptions above). Off by default.
  OffloadOptions offload;
};
// InvalidArgument, naming the option, the value and what is allowed, when a secondary shard of
// `o.secondary_shard_size` ranks does not fit `o.strategy` with a shard group of `shard_size`
// (0: not known yet, a shard group per host: the strategy and N >= 2 only). Whether each
// secondary group shares a host is checked when the runtime is created.
absl::Status CheckSecondaryShard(const ShardingOptions& o, int shard_size);

// A parameter of a unit as seen through a view: element `offset` of the unit's flat buffer is
// its first element.
struct TensorSlot {
  std::string name;
  std::vector<int64_t> shape;
  int64_t offset = 0;
  int64_t numel = 0;
};

// What a hook hands the model: the unit's gathered parameters (numel elements in `dtype`) and,
// in backward, the f32 gradient buffer of the same layout to accumulate into, as views of the
// backend's memory. On a host backend (the CPU) the same memory is also reachable through the
// host pointers; on a device they are nullptr.
struct UnitView {
  int unit = -1;
  int64_t numel = 0;  // unpadded
  const std::vector<TensorSlot>* tensors = nullptr;
  DType dtype = DType::kF32;
  View data_view;   // the parameters in `dtype`
  View grads_view;  // f32 gradients; empty in forward
  // Host pointers (host backends only): the parameters in `dtype`, as f32 when dtype is f32,
  // and the gradients.
  const void* data = nullptr;
  const float* params = nullptr;
  float* grads = nullptr;
  View param_view(int i) const {
    return data_view.Slice((*tensors)[i].offset, (*tensors)[i].numel);
  }
  View grad_view(int i) const {
    return grads_view.Slice((*tensors)[i].offset, (*tensors)[i].numel);
  }
  const float* param(int i) const { return params + (*tensors)[i].offset; }
  float* grad(int i) const { return grads + (*tensors)[i].offset; }
};

// Bytes per rank, by what they hold. "persistent" = parameter, gradient and optimizer shards.
// Every figure is the size of allocations the runtime holds on its backend (counted as each
// is made and freed), plus what the model reports for its activations; so with a backend of
// its own, bytes_in_use() and peak_bytes equal the backend's memory_stats().
struct MemoryReport {
  int64_t param_shard_bytes = 0;  // f32 master shards (and their codes: CommunicationOptions)
  int64_t grad_shard_bytes = 0;
  int64_t optimizer_bytes = 0;
  int64_t gathered_param_bytes = 0;       // unsharded parameter buffers alive now
  int64_t gathered_param_peak_bytes = 0;  // ... and at peak since the last ResetPeaks()
  int64_t grad_buffer_bytes = 0;          // unsharded gradient / reduction buffers alive now
  int64_t grad_buffer_peak_bytes = 0;
  int64_t activation_peak_bytes = 0;      // as reported by the model (SetActivationBytes)
  // ShardingOptions::secondary_shard_size: the units' secondary shards kept from their forward
  // to their backward (param_dtype), now and at peak.
  int64_t secondary_param_bytes = 0;
  int64_t secondary_param_peak_bytes = 0;
  int64_t peak_bytes = 0;  // all of the above together at their peak (not the sum of peaks)
  // Host memory (not in peak_bytes): what the offload (ShardingOptions::offload) holds, and how
  // many units it took.
  int64_t host_offload_bytes = 0;
  int offloaded_units = 0;
  int64_t persistent_bytes() const {
    return param_shard_bytes + grad_shard_bytes + optimizer_bytes;
  }
  int64_t bytes_in_use() const {
    return persistent_bytes() + gathered_param_bytes + grad_buffer_bytes +
           secondary_param_bytes + activation_peak_bytes;
  }
};
std::string FormatMemoryReport(const MemoryReport& m);

struct StepStats {
  double grad_norm = 0;       // global L2 norm before clipping (unscaled)
  float clip_coefficient = 1;  // what the gradients were multiplied by
  float lr = 0;
  int64_t step = 0;            // optimizer steps taken, including this one
  bool skipped = false;        // inf/NaN gradients on some rank: no update
  bool nonfinite = false;      // the gradients held an inf or NaN (then skipped is true)
  float loss_scale = 1.0f;     // the scale the next backward pass uses
  // Since the previous Step(): times the host waited for the backend to read a value (the
  // loss of each forward, the global norm here, and any CopyToHost), and times it waited for
  // the device to bound the memory held (a host running ahead of an asynchronous device).
  int64_t host_syncs = 0;
  int64_t throttle_waits = 0;
};

// What the offload (ShardingOptions::offload) did since the runtime was made: the host's
// optimizer updates (each from its unit's shards arriving on the host to its update done, on
// the worker thread), how long the caller's thread waited for them before a unit's parameters
// could go back, and how much of that wait the device sat idle (its compute stream had run
// everything issued): the exposed part. overlap() is the fraction of the host's update time
// that was not exposed, i.e. that ran while the device computed.
struct OffloadStats {
  int64_t updates = 0;  // unit updates run on the host
  double host_update_seconds = 0;
  double wait_seconds = 0;
  double exposed_seconds = 0;
  int64_t bytes_to_host = 0, bytes_to_device = 0;
  double overlap() const {
    if (host_update_seconds <= 0) return 0;
    const double o = 1.0 - exposed_seconds / host_update_seconds;
    return o < 0 ? 0 : o;
  }
};

class ShardingRuntime {
 public:
  // Collective over `world`: builds the mesh of the strategy (NO_SHARD: world x 1,
  // FULL_SHARD / SHARD_GRAD_OP: 1 x world, HYBRID: world/S x S). `world` must outlive the
  // runtime; `backend` holds every buffer. Options that are invalid on any rank, or that
  // differ between ranks, are InvalidArgument on every rank at once, naming the rank, or the
  // option and both values.
  static absl::StatusOr<std::unique_ptr<ShardingRuntime>> Create(Backend* backend,
                                                                 Communicator& world,
                                                                 ShardingOptions options);
  ~ShardingRuntime();

  // ---- set-up (local, then one collective Finalize) ------------------------------------------
  // Registers a unit; returns its index (units are numbered in registration order).
  // Errors: empty unit, a parameter name used twice, a dimension < 1, after Finalize.
  absl::StatusOr<int> RegisterUnit(std::string name, std::vector<ParamInfo> params);
  // Collective: checks that every rank registered the same units (names, shapes, flags) and
  // allocates the shards and optimizer state. Then fills each rank's shard through `init`,
  // which is called once per piece of a tensor inside the shard: fill elements
  // [begin, end) of tensor `param` of unit `unit` into `out` (end - begin floats).
  using InitFn = std::function<void(int unit, const ParamInfo& param, int64_t begin,
                                    int64_t end, float* out)>;
  absl::Status Finalize(const InitFn& init);

  // ---- hooks ----------------------------------------------------------------------------------
  absl::StatusOr<UnitView> PreForward(int unit);
  absl::Status PostForward(int unit);
  absl::StatusOr<UnitView> PreBackward(int unit);
  absl::Status PostBackward(int unit);
  absl::Status FinishBackward();
  // Ends a forward pass that has no backward (evaluation, sampling): every unit must be after
  // PostForward; frees what SHARD_GRAD_OP kept gathered and makes the units idle again.
  absl::Status FinishForwardOnly();
  // Clips, updates every local shard with `lr`, zeroes the gradient shards.
  absl::StatusOr<StepStats> Step(float lr);
  // The same with the learning rate of `schedule` at the 0-based index of this step.
  absl::StatusOr<StepStats> Step(const LrSchedule& schedule) {
    return Step(schedule.At(steps()));
  }

  // no_sync: while false, backward passes accumulate full gradients locally.
  void set_sync_gradients(bool sync);
  bool sync_gradients() const;
  // HYBRID strategies: while false, a backward with sync on reduce-scatters each unit inside
  // its shard group and adds the result into the f32 gradient shard, without the all-reduce
  // across replicas; the next backward with it on all-reduces the whole accumulated shard
  // once. Step() and GatherUnitGradient() refuse gradients still waiting for that all-reduce.
  // Every rank must set it alike (else their collectives differ and fail). Strategies without
  // a replica all-reduce after a shard-group reduction (FULL_SHARD, SHARD_GRAD_OP, NO_SHARD,
  // HYBRID with one rank per shard group or one replica) ignore it. Default true.
  void set_requires_all_reduce(bool all_reduce);
  bool requires_all_reduce() const;

  // ---- inspection -----------------------------------------------------------------------------
  int num_units() const;
  const std::vector<TensorSlot>& unit_tensors(int unit) const;
  int64_t unit_numel(int unit) const;        // unpadded
  int64_t unit_shard_numel(int unit) const;  // elements per rank (padded / shard size)
  // The local shard (unit_shard_numel() f32 elements) of a unit's parameters (fp32 master) and
  // of its gradient (the sum over the backward passes since the last step of the reduced
  // gradients, times loss_scale()).
  View param_shard(int unit) const;
  View grad_shard(int unit) const;
  Optimizer& optimizer(int unit);
  // Collective over the shard group: the whole unit's parameters (numel floats) into `out`.
  absl::Status GatherUnit(int unit, float* out);
  // Collective over the shard group, between FinishBackward() and Step(): the unit's
  // gradient as Step() will use it before clipping (the mean over the data-parallel ranks and
  // over the backward passes since the last step, loss scaling undone; numel floats).
  absl::Status GatherUnitGradient(int unit, float* out);

  ShardingStrategy strategy() const;
  Communicator& world() const;
  Communicator& shard_group() const;
  Communicator& replicate_group() const;
  // The data plane of the shard group (collectives on the backend's memory).
  DataPlane& shard_plane() const;
  int64_t steps() const;
  // What the model multiplies the loss gradient by (1 without dynamic loss scaling).
  float loss_scale() const;
  // Steps skipped for inf/NaN gradients (loss scaling, or NonFinitePolicy::kSkip).
  int64_t skipped_steps() const;
  // Restoring a checkpoint: the optimizer steps taken (the index Step(LrSchedule) uses next).
  void set_steps(int64_t steps);
  // The dynamic loss scaler's state, for checkpoints.
  struct LossScaleState {
    float scale = 1.0f;
    int good_steps = 0;  // good steps in a row since the scale last changed
    int64_t skipped_steps = 0;
  };
  LossScaleState loss_scale_state() const;
  void set_loss_scale_state(const LossScaleState& state);
  Backend* backend() const;  // where every shard lives

  // The model's configuration as (key, value) pairs, e.g. {"family", "gpt"}, {"num_heads",
  // "12"} (ShardedModel sets its config's, nn::ModelConfig::Describe()). Checkpoints and
  // safetensors exports record it; LoadCheckpoint and ImportSafetensors compare it with what
  // the file records and refuse another model whose tensors happen to have the same shapes
  // (another number of heads, say). The key "name" is informative, never compared.
  void set_model_description(std::vector<std::pair<std::string, std::string>> description);
  const std::vector<std::pair<std::string, std::string>>& model_description() const;

  MemoryReport memory() const;
  // ShardingOptions::offload: which units are offloaded (ascending), and what it did so far.
  std::vector<int> offloaded_units() const;
  OffloadStats offload_stats() const;
  void SetActivationBytes(int64_t bytes);  // the model reports its activation footprint
  // Gives back the buffers the device is done with (as every hook does first), then restarts
  // the report's peaks from what is allocated now.
  void ResetPeaks();

 private:
  struct Impl;
  explicit ShardingRuntime(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// The switches of micro-batch `micro_batch` (0-based) of `micro_batches` under `mode`; both are
// on in the last micro-batch.
struct MicroBatchSwitches {
  bool sync_gradients = true;
  bool requires_all_reduce = true;
};
MicroBatchSwitches AccumulationSwitches(Accumulation mode, int micro_batch, int micro_batches);
// Sets them on `rt`.
void ConfigureMicroBatch(ShardingRuntime& rt, Accumulation mode, int micro_batch,
                         int micro_batches);

}  // namespace fsdp
