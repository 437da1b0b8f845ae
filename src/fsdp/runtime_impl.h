// The sharding runtime's state, shared by the files that implement it:
//   unit.h           the unit record, the memory book, deferred frees (the bottom);
//   device.cc        the device executor: every allocation (counted in the book) and stream
//                    wait, which gather.cc and reduce.cc call down into;
//   schedule.h       the unit schedule (hook states, prefetch, reduction queues), which this
//                    Impl executes on the backend, as the planner and the projection execute
//                    it on byte counts and clocks;
//   gather.cc        parameter gathers and their rate limit;
//   reduce.cc        gradient reductions, from PostBackward until they land in the shards;
//   loss_scaler.h    dynamic loss scaling;
//   strategy.cc      strategy names and meshes;
//   sharding_runtime.cc  the hooks, Finalize, Step, inspection (the top).
//
// Ordering follows the device contract (fsdp/backend.h): the model's compute, casts, the
// optimizer and the reductions into the shards run on the compute stream; collectives run on
// the data planes after the compute work that produced their input; compute that reads a
// collective's output waits for its event first. The host waits only where it needs a value
// (Step reads the global gradient norm) or to bound memory (PendingFrees::WaitUntilAtMost).
#pragma once

#include <deque>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "fsdp/data_plane.h"
#include "fsdp/mesh.h"
#include "fsdp/ops.h"
#include "fsdp/sharding.h"
#include "src/fsdp/loss_scaler.h"
#include "src/fsdp/offload.h"
#include "src/fsdp/schedule.h"
#include "src/fsdp/unit.h"

namespace fsdp {

struct ShardingRuntime::Impl {
  Backend* backend = nullptr;
  Communicator* world = nullptr;
  ShardingOptions options;
  std::optional<DeviceMesh> mesh;  // the control plane: host groups of the strategy's mesh
  std::unique_ptr<DataPlane> shard_plane, replicate_plane;  // the data plane of the same groups
  // ShardingOptions::secondary_shard_size N: the N ranks of the shard group that share this
  // rank's secondary shard (shard indices N * (i / N) ...), and their data plane; else null.
  std::unique_ptr<Communicator> secondary_group;
  std::unique_ptr<DataPlane> secondary_plane;
  // ShardingOptions::offload: the host state of the offloaded units (null without offload),
  // made in Create, filled in Finalize. Before the units: their host optimizers' state lives
  // on its host backend (Quiesce drains its worker before anything goes).
  std::unique_ptr<internal::HostOffload> offload;
  internal::MemoryBook book;  // before the units: their buffers give their bytes back to it
  internal::PendingFrees pending;
  std::vector<internal::Unit> units;
  std::set<std::string> param_names;
  bool finalized = false;
  bool sync_gradients = true;
  bool requires_all_reduce = true;
  absl::Status failure;  // set once a hook failed: the runtime is then unusable
  int64_t passes_since_step = 0;
  // The unit schedule, executed by this Impl (made in Create, once the mesh is known).
  std::optional<internal::UnitSchedule<Impl>> schedule;
  internal::LossScaler scaler;
  int64_t steps = 0;
  std::vector<std::pair<std::string, std::string>> model_description;
  // Before the device reads unit u's parameter shard (its gather, PreForward, an accessor):
  // its offloaded update is back (Fail on error). Every pass runs PreForward on every unit, so
  // no update is still pending when Step() issues the next.
  absl::Status EnsureUploaded(int u);
  // OffloadKind::kAll: unit u's parameter and gradient shards live on the host (the device
  // holds them only in transit).
  bool host_shards(int u) const { return offload != nullptr && offload->holds_shards(u); }
  // A host-held shard of unit u (its parameters, or with `grads` its accumulated gradient) in a
  // transient device buffer, copied up on the compute stream; counted as `category`.
  absl::StatusOr<internal::Accounted> UpFromHost(int u, bool grads, internal::Gauge& category,
                                                 absl::string_view what);
  // Host synchronisations of the backend and memory throttle waits at the last Step().
  int64_t host_syncs_at_step = 0, throttle_waits = 0, throttle_waits_at_step = 0;

  int S() const { return mesh->shard_size(); }
  int R() const { return mesh->replicate_size(); }
  RuntimeOps& ops() const { return backend->runtime_ops(); }
  DType param_dtype() const { return options.mixed_precision.param_dtype; }
  DType reduce_dtype() const { return options.mixed_precision.reduce_dtype; }
  // The parameters' all-gather carries codes and scales (CommunicationOptions): a format is set
  // and the shard group has more than one rank.
  bool quantized_gather() const { return QuantizesAllGather(options.communication, S()); }
  // The gradient reduction exchanges codes: in the shard group (all_to_all), across replicas
  // (all_gather of the reduced shard's codes).
  bool quantized_reduce_scatter() const { return QuantizesReduceScatter(options.communication, S()); }
  bool quantized_replicas() const { return QuantizesReplicaReduction(options.communication, R()); }
  // One rank's codes and scales of a unit (a shard, or a chunk of the gradient for one rank).
  QuantizedLayout QuantizedChunk(const internal::Unit& unit) const {
    return {unit.layout.shard_numel, options.communication.block_size};
  }

  // ---- errors and checks (sharding_runtime.cc) ----------------------------------------------
  // Fails the runtime and every group, so that peers blocked in (or later entering) a
  // collective get this rank's error instead of waiting for their deadline.
  absl::Status Fail(absl::Status s);
  absl::Status CheckUsable(absl::string_view what) const;
  absl::StatusOr<internal::Unit*> GetUnit(int u, absl::string_view what);
  absl::Status ExpectState(int u, absl::string_view what,
                           std::initializer_list<internal::UnitState> allowed) const;
  // Every buffer of the runtime comes from here: counted in `category` while it lives. An
  // allocation that fails names what it was for.
  absl::StatusOr<internal::Accounted> Alloc(internal::Gauge& category, absl::string_view what,
                                            const internal::Unit* unit, int64_t numel,
                                            DType dtype = DType::kF32);
  UnitView MakeView(int u, bool with_grads) const;
  // The whole of `shard` (the unit's f32 shard on each rank of the shard group) into host
  // `out` (numel floats).
  absl::Status GatherToHost(const internal::Unit& unit, const internal::Accounted& shard,
                            absl::string_view what, float* out);
  // Waits for every collective in flight and frees what the device held (destruction).
  void Quiesce();
  // Stream `s` waits for `e`. On a host backend the calling thread blocks, which the timeline
  // shows as exposed communication (a span `name` on the wait lane); an asynchronous device's
  // stream records its own waits.
  absl::Status StreamWait(Stream s, const Event& e, absl::string_view name,
                          const std::string& unit);

  // ---- the executor of the unit schedule (schedule.h): gather.cc, reduce.cc ------------------
  bool is_host() const { return backend->is_host(); }
  bool Gathered(int u) const { return units[u].gathered.allocated(); }
  // Starts the all-gather of a unit's parameters unless they are gathered or on their way
  // (or need none: f32 in a shard group of one), within the rate limit.
  absl::Status IssueGather(int u);
  absl::Status IssueQuantizedGather(internal::Unit& unit);
  // The shard (cast to the param dtype) into its slot of `gathered`, then the all-gather (or
  // IssueQuantizedGather).
  absl::Status StageAndGather(internal::Unit& unit);
  // The compute stream waits for the unit's all-gather (and decodes a quantized one).
  absl::Status WaitGather(int u, bool prefetched);
  void DecodeGathered(internal::Unit& unit);
  // Gives the gathered parameters back (once the device is done with them).
  void FreeGathered(int u);
  // Orders the compute stream after an out-of-place gather that may still read the unit's
  // master shard (a prefetch nobody waited for), before anything writes the shard.
  absl::Status SettleShardRead(int u);
  // The secondary shard: this rank's 1/N of the gathered unit, copied after its forward; the
  // backward's gather (IssueSecondaryGather) starts from it over the secondary group.
  absl::Status KeepSecondary(int u);
  void DropSecondary(int u);
  absl::Status IssueSecondaryGather(internal::Unit& unit);
  int64_t SecondaryNumel(const internal::Unit& unit) const {
    return unit.layout.padded_numel / options.secondary_shard_size;
  }
  // The unsharded gradient, zeroed, unless it holds an earlier micro-batch's accumulation.
  absl::Status PrepareGradient(int u);
  absl::StatusOr<bool> IssueReduction(int u);
  bool ReductionDone(int u) const { return units[u].reduce_event.Done(); }
  absl::Status WaitReduction(int u);
  absl::Status ReductionStatus(int u);
  absl::Status AdvanceReduction(int u, internal::Reduction stage, bool to_replicas,
                                bool with_accumulated);
  void Collect() { pending.Collect(); }

  absl::Status FinishReduction(internal::Unit& unit, internal::Reduction stage);
  // The quantized reduction (CommunicationOptions::reduction): the shard group's all_to_all of
  // the gradient's codes; across replicas, the all_to_all of the chunks of `shard` (f32,
  // shard_numel: the reduced shard, or NO_SHARD's whole gradient; quantized on stream `s`),
  // then (IssueReplicaGather, a stage of the schedule) the all_gather of each replica's
  // re-encoded mean chunk.
  absl::Status IssueQuantizedReduceScatter(internal::Unit& unit);
  absl::Status IssueReplicaExchange(internal::Unit& unit, fsdp::View shard, Stream s);
  absl::Status IssueReplicaGather(int u);
  // Replica r's chunk of a unit's shard: ReplicaChunkNumel elements from r times that, the
  // last replicas' shorter (or empty); each in a slot of ReplicaSlotBytes.
  int64_t ReplicaChunkNumel(const internal::Unit& unit) const {
    return ReplicaChunkLayout(options.communication, unit.layout.shard_numel, R()).n;
  }
  QuantizedLayout ReplicaChunk(const internal::Unit& unit, int r) const;
  int64_t ReplicaSlotBytes(const internal::Unit& unit) const {
    return ReplicaChunkLayout(options.communication, unit.layout.shard_numel, R()).bytes();
  }
  // out (f32, layout.n) = the mean of the unit's code_ranks received codes (slots `stride`
  // bytes apart, each `layout`), decoded and added in f32 in rank order on stream `s` (which
  // has waited for them); the codes go back.
  absl::Status DecodeMean(internal::Unit& unit, fsdp::View out, const QuantizedLayout& layout,
                          int64_t stride, Stream s);
  // The replicas' all-gathered chunks decoded into their places of `out` (f32, shard_numel).
  void DecodeChunks(internal::Unit& unit, fsdp::View out);
  absl::Status FoldAccumulatedShard(internal::Unit& unit);
  // `add` (f32, shard_numel) into the unit's gradient shard on the compute stream (offload
  // all: down to the host, which adds it; unit.grad_down is the copy's event).
  absl::Status AccumulateShard(internal::Unit& unit, fsdp::View add);

  // ---- the optimizer step (sharding_runtime.cc), in the order Step() runs them -------------
  // HYBRID: FailedPrecondition when unit u's gradient shard still waits for its all-reduce
  // across replicas (set_requires_all_reduce), naming `what` and the unit.
  absl::Status CheckAllReduced(int u, absl::string_view what) const;
  // Every unit idle and synced, a backward pass since the last step, a usable learning rate.
  absl::Status CheckStepAllowed(float lr);
  // The global gradient norm over the shard group, on the device, and the clip factor.
  struct GlobalNorm {
    internal::Accounted sums;     // f64: this rank's sum of squares, the total
    internal::Accounted scratch;  // f32: the ranks' sums as pairs, this rank's pair, the factor
    View factor;                  // f32: clip coefficient / k
    double total_sq = 0;          // read on the host: whether to step, the norm to report
  };
  // `k` undoes the accumulation over micro-batches and the loss scale.
  absl::StatusOr<GlobalNorm> ReduceGlobalNorm(double k);
  // inf/NaN in the gradients: drops them on every rank and backs the loss scale off, or fails
  // with OutOfRange naming this rank's units (NonFinitePolicy::kError without loss scaling).
  absl::Status SkipNonFiniteStep(GlobalNorm norm, StepStats& stats);
  // Clips (and averages), then steps every unit's optimizer and zeroes its gradient shard.
  absl::Status ApplyOptimizers(GlobalNorm norm, float lr, double k, StepStats& stats);
  // Collects what the device is done with; the host syncs and throttle waits of this step.
  void CloseStep(StepStats& stats);
};

}  // namespace fsdp
