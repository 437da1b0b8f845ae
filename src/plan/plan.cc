// The memory planner's core: the sharding runtime's own unit schedule (src/fsdp/schedule.h)
// executed over plain unit sizes. Replay below is its executor: each of its functions mirrors
// the runtime's executor function of the same name (src/fsdp/gather.cc, reduce.cc) as it runs
// on a host backend: the same buffers, allocated and freed at the same points, in the same
// categories. What the runtime decides from timing (whether a collective has completed when it
// looks) is taken as "not yet" until the runtime waits for it, the most memory any rank can
// see.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <deque>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "fsdp/plan.h"
#include "src/core/checked.h"
#include "src/fsdp/strategy.h"
#include "src/fsdp/schedule.h"
#include "src/fsdp/unit.h"

namespace fsdp {
namespace {

using internal::Gauge;  // the runtime's own byte gauge (src/fsdp/unit.h)

enum Category { kParams, kGrads, kOptimizer, kGathered, kGradBuffers, kSecondary, kNumCategories };

// An allocation counted in its category (and, for the reductions' own buffers, as
// communication) while it lives; as internal::Accounted.
struct Buf {
  int category = -1;
  int64_t bytes = 0;
  bool comm = false;
  bool allocated() const { return bytes != 0; }
};

constexpr int kEmptyEvent = -1;  // Event(): complete (the CPU backend's Record)

struct SimUnit {
  int64_t numel = 0, shard_numel = 0, padded_numel = 0;
  Buf gathered, full_grad, lowp_grad, reduced;
  Buf quantized_gathered;  // the shard group's codes and scales, until decoded
  Buf secondary;           // PlanRequest::secondary_shard_size: kept from forward to backward
  Buf quantized_grad, quantized_reduced;  // a quantized reduction's codes (sent, received)
  int code_ranks = 0;
  bool code_chunks = false;
  int gather_event = kEmptyEvent;
  int reduce_event = kEmptyEvent;
  bool grad_shard_zero = true;  // nothing added since the last step (reduce.cc)
};

class Replay {
 public:
  Replay(const std::vector<int64_t>& numel, int S, int R, const PlanRequest& o)
      : S_(S), R_(R), o_(o), schedule_(this, Options(o, S, R)) {
    for (int64_t n : numel) {
      SimUnit u;
      u.numel = n;
      u.shard_numel = (n + S - 1) / S;  // FlatLayout::Build
      u.padded_numel = u.shard_numel * S;
      units_.push_back(u);
      schedule_.AddUnit();
    }
  }

  // ShardingRuntime::Finalize: per unit the parameter and gradient shards, then the
  // optimizer's state (AdamW: exp_avg and exp_avg_sq; SGD with momentum: one buffer).
  // Offloaded units (`offloaded`) keep their state on the host instead: host_bytes().
  // OffloadKind::kAll: their parameter and gradient shards too (host_shards_).
  void Finalize(const std::vector<bool>& offloaded) {
    const bool all = o_.offload.what == OffloadKind::kAll;
    host_shards_.assign(units_.size(), false);
    for (SimUnit& u : units_) {
      const bool off = offloaded[&u - units_.data()];
      host_shards_[&u - units_.data()] = off && all;
      if (!(off && all)) Keep(Alloc(kParams, u.shard_numel * 4));
      if (quantized()) Keep(Alloc(kParams, Chunk(u).bytes()));
      if (!(off && all)) Keep(Alloc(kGrads, u.shard_numel * 4));
      if (off) {
        host_bytes_ += OffloadHostBytes(u.shard_numel, o_.offload.what);
        continue;
      }
      const int states = o_.optimizer == OptimizerKind::kAdamW ? 2 : o_.sgd_momentum ? 1 : 0;
      for (int i = 0; i < states; ++i) Keep(Alloc(kOptimizer, u.shard_numel * 4));
    }
  }

  // The micro-batches and the optimizer step, with the hooks in ShardedModel's order. (The
  // replay's executor never fails: its functions return OK.)
  void TrainStep() {
    for (int j = 0; j < o_.micro_batches; ++j) {
      MicroBatch(AccumulationSwitches(o_.accumulation, j, o_.micro_batches));
    }
    Step();
  }

  void MicroBatch(const MicroBatchSwitches& sw) {
    const int n = static_cast<int>(units_.size());
    schedule_.PreForward(0).IgnoreError();
    for (int u = 1; u < n; ++u) {
      schedule_.PreForward(u).IgnoreError();
      schedule_.PostForward(u).IgnoreError();
    }
    schedule_.PostForward(0).IgnoreError();
    schedule_.PreBackward(0).IgnoreError();
    for (int u = n - 1; u >= 1; --u) {
      schedule_.PreBackward(u).IgnoreError();
      schedule_.PostBackward(u, sw.sync_gradients, sw.requires_all_reduce).IgnoreError();
    }
    schedule_.PostBackward(0, sw.sync_gradients, sw.requires_all_reduce).IgnoreError();
    schedule_.FinishBackward().IgnoreError();
  }

  const Gauge& gauge(Category c) const { return gauges_[c]; }
  const Gauge& total() const { return total_; }
  int64_t host_bytes() const { return host_bytes_; }
  const Gauge& comm() const { return comm_; }
  // An allocation took the total past int64 bytes: the figures are not the plan's (the replay
  // went on without that buffer).
  bool overflowed() const { return overflowed_; }

  // ---- the executor of the unit schedule (src/fsdp/schedule.h) on a host backend ---------------
  bool is_host() const { return true; }
  bool Gathered(int u) const { return units_[u].gathered.allocated(); }

  // gather.cc
  absl::Status IssueGather(int u) {
    SimUnit& unit = units_[u];
    if (unit.gathered.allocated() || (S_ == 1 && pd() == DType::kF32 && !host_shards_[u])) {
      return absl::OkStatus();
    }
    WaitUntilAtMost(kGathered, 1);
    unit.gathered =
        Alloc(kGathered, unit.padded_numel * static_cast<int64_t>(DTypeSize(pd())));
    if (host_shards_[u] && !unit.secondary.allocated() &&
        !(quantized() && schedule_.in_backward())) {
      // Offload all: the shard up from the host, given back once staged.
      Buf up = Alloc(kGathered, unit.shard_numel * 4);
      PendingAdd(up, {kEmptyEvent});
    }
    if (S_ == 1) return absl::OkStatus();
    if (unit.secondary.allocated()) {  // IssueSecondaryGather: copied in, then given back
      PendingAdd(unit.secondary, {kEmptyEvent});
      unit.gather_event = NewCollective();
      return absl::OkStatus();
    }
    if (quantized()) unit.quantized_gathered = Alloc(kGathered, Chunk(unit).bytes() * S_);
    unit.gather_event = NewCollective();
    return absl::OkStatus();
  }
  absl::Status WaitGather(int u, bool /*prefetched*/) {
    SimUnit& unit = units_[u];
    if (unit.gather_event == kEmptyEvent) return absl::OkStatus();
    Wait(unit.gather_event);
    unit.gather_event = kEmptyEvent;
    // Decoded on the compute stream, then given back (DecodeGathered).
    PendingAdd(unit.quantized_gathered, {kEmptyEvent});
    return absl::OkStatus();
  }
  void FreeGathered(int u) {
    SimUnit& unit = units_[u];
    if (!unit.gathered.allocated()) return;
    std::vector<int> users = {kEmptyEvent};
    if (unit.gather_event != kEmptyEvent) users.push_back(unit.gather_event);
    PendingAdd(unit.quantized_gathered, users);
    PendingAdd(unit.gathered, std::move(users));
    unit.gather_event = kEmptyEvent;
  }

  absl::Status KeepSecondary(int u) {
    SimUnit& unit = units_[u];
    if (!unit.gathered.allocated() || unit.secondary.allocated()) return absl::OkStatus();
    unit.secondary = Alloc(kSecondary, unit.padded_numel / o_.secondary_shard_size *
                                           static_cast<int64_t>(DTypeSize(pd())));
    return absl::OkStatus();
  }
  void DropSecondary(int u) { PendingAdd(units_[u].secondary, {kEmptyEvent}); }

  // reduce.cc
  absl::Status PrepareGradient(int u) {
    SimUnit& unit = units_[u];
    if (!unit.full_grad.allocated()) unit.full_grad = Alloc(kGradBuffers, unit.padded_numel * 4);
    return absl::OkStatus();
  }
  absl::StatusOr<bool> IssueReduction(int u) {
    SimUnit& unit = units_[u];
    // The first f32 reduce-scatter since the step writes the gradient shard itself.
    const bool into_shard = unit.grad_shard_zero && S_ > 1 && R_ == 1 && rd() == DType::kF32 &&
                            !quantized_reduce_scatter() && !host_shards_[u];
    unit.grad_shard_zero = false;
    if (S_ == 1 && R_ == 1) {
      PendingAdd(unit.full_grad, {kEmptyEvent});
      return false;
    }
    if (quantized_reduce_scatter()) {  // IssueQuantizedReduceScatter
      unit.quantized_grad = Alloc(kGradBuffers, Chunk(unit).bytes() * S_, /*comm=*/true);
      PendingAdd(unit.full_grad, {kEmptyEvent});
      unit.quantized_reduced = Alloc(kGradBuffers, Chunk(unit).bytes() * S_, /*comm=*/true);
      unit.code_ranks = S_;
      unit.reduce_event = NewCollective();
      return true;
    }
    if (quantized_replicas()) {
      IssueReplicaExchange(unit);
      PendingAdd(unit.full_grad, {kEmptyEvent});
      return true;
    }
    const int64_t rsize = static_cast<int64_t>(DTypeSize(rd()));
    if (rd() != DType::kF32) {
      unit.lowp_grad = Alloc(kGradBuffers, unit.padded_numel * rsize, /*comm=*/true);
      PendingAdd(unit.full_grad, {kEmptyEvent});
    }
    if (S_ > 1 && !into_shard) {
      unit.reduced = Alloc(kGradBuffers, unit.shard_numel * rsize, /*comm=*/true);
    }
    unit.reduce_event = NewCollective();
    return true;
  }
  bool ReductionDone(int u) const { return Done(units_[u].reduce_event); }
  absl::Status WaitReduction(int u) {
    Wait(units_[u].reduce_event);
    return absl::OkStatus();
  }
  absl::Status ReductionStatus(int /*u*/) { return absl::OkStatus(); }
  absl::Status AdvanceReduction(int u, internal::Reduction stage, bool to_replicas,
                                bool with_accumulated) {
    SimUnit& unit = units_[u];
    if (stage == internal::Reduction::kShardGroup && S_ > 1) {
      PendingAdd(unit.full_grad, {unit.reduce_event});
      PendingAdd(unit.lowp_grad, {unit.reduce_event});
      PendingAdd(unit.quantized_grad, {unit.reduce_event});
    }
    if (!to_replicas) {
      FinishReduction(unit);
      return absl::OkStatus();
    }
    if (quantized_reduce_scatter()) {
      Wait(unit.reduce_event);  // the compute stream waits for the all_to_all
      unit.reduced = Alloc(kGradBuffers, unit.shard_numel * 4, /*comm=*/true);
      DecodeMean(unit, unit.shard_numel);
      IssueReplicaExchange(unit);
      PendingAdd(unit.reduced, {kEmptyEvent});
      return absl::OkStatus();
    }
    Wait(unit.reduce_event);  // the comm stream waits for the reduce-scatter
    if (with_accumulated) unit.grad_shard_zero = true;  // FoldAccumulatedShard zeroes it
    if (with_accumulated && rd() != DType::kF32) {
      // FoldAccumulatedShard: the reduced shard widened to f32 while the gradient shard joins it.
      Buf wide = Alloc(kGradBuffers, unit.shard_numel * 4, /*comm=*/true);
      PendingAdd(wide, {kEmptyEvent});
    }
    unit.reduce_event = NewCollective();
    return absl::OkStatus();
  }
  // IssueReplicaExchange, IssueReplicaGather (replica 0's chunk: the largest) and DecodeMean
  // (of n elements).
  int64_t ReplicaSlotBytes(const SimUnit& u) const {
    return ReplicaChunkLayout(o_.communication, u.shard_numel, R_).bytes();
  }
  void IssueReplicaExchange(SimUnit& unit) {
    unit.quantized_grad = Alloc(kGradBuffers, ReplicaSlotBytes(unit) * R_, /*comm=*/true);
    unit.quantized_reduced = Alloc(kGradBuffers, ReplicaSlotBytes(unit) * R_, /*comm=*/true);
    unit.code_ranks = R_;
    unit.reduce_event = NewCollective();
  }
  absl::Status IssueReplicaGather(int u) {
    SimUnit& unit = units_[u];
    Wait(unit.reduce_event);  // the communication stream waits for the all_to_all
    PendingAdd(unit.quantized_grad, {unit.reduce_event});
    const int64_t n = std::min(unit.shard_numel,
                               ReplicaChunkLayout(o_.communication, unit.shard_numel, R_).n);
    Buf mean;
    if (n > 0) {
      mean = Alloc(kGradBuffers, n * 4, /*comm=*/true);
      DecodeMean(unit, n);
    } else {
      PendingAdd(unit.quantized_reduced, {kEmptyEvent});
    }
    unit.quantized_reduced = Alloc(kGradBuffers, ReplicaSlotBytes(unit) * R_, /*comm=*/true);
    unit.code_ranks = R_;
    unit.code_chunks = true;
    PendingAdd(mean, {kEmptyEvent});
    unit.reduce_event = NewCollective();
    return absl::OkStatus();
  }
  void DecodeMean(SimUnit& unit, int64_t n) {
    Buf term;
    if (unit.code_ranks > 1) term = Alloc(kGradBuffers, n * 4, /*comm=*/true);
    PendingAdd(term, {kEmptyEvent});
    PendingAdd(unit.quantized_reduced, {kEmptyEvent});
    unit.code_ranks = 0;
  }

  void Collect() {
    for (auto it = pending_.begin(); it != pending_.end();) {
      if (EntryDone(*it)) {
        Free(it->buffer);
        it = pending_.erase(it);
      } else {
        ++it;
      }
    }
  }

 private:
  static internal::ScheduleOptions Options(const PlanRequest& o, int S, int R) {
    internal::ScheduleOptions so;
    so.strategy = o.strategy;
    so.forward_prefetch = o.forward_prefetch;
    so.backward_prefetch = o.backward_prefetch;
    so.max_prefetch_units = o.max_prefetch_units;
    so.shard_size = S;
    so.replicate_size = R;
    so.two_phase_replicas = QuantizesReplicaReduction(o.communication, R);
    so.secondary_shard_size = o.secondary_shard_size;
    return so;
  }
  DType pd() const { return o_.param_dtype; }
  // ShardingRuntime::Impl::quantized_gather(), quantized_reduce_scatter(),
  // quantized_replicas() and QuantizedChunk().
  bool quantized() const { return QuantizesAllGather(o_.communication, S_); }
  bool quantized_reduce_scatter() const { return QuantizesReduceScatter(o_.communication, S_); }
  bool quantized_replicas() const { return QuantizesReplicaReduction(o_.communication, R_); }
  QuantizedLayout Chunk(const SimUnit& u) const {
    return {u.shard_numel, o_.communication.block_size};
  }
  DType rd() const { return o_.reduce_dtype; }

  // ---- the memory book ------------------------------------------------------------------------
  // Every category and the communication gauge are parts of the total: checking the total
  // keeps them all within int64.
  Buf Alloc(Category c, int64_t bytes, bool comm = false) {
    int64_t sum = 0;
    if (!internal::CheckedAdd(total_.now, bytes, &sum)) {
      overflowed_ = true;
      return Buf{};
    }
    Buf b{c, bytes, comm};
    gauges_[c].Add(bytes);
    total_.Add(bytes);
    if (comm) comm_.Add(bytes);
    return b;
  }
  void Free(Buf& b) {
    if (!b.allocated()) return;
    gauges_[b.category].Sub(b.bytes);
    total_.Sub(b.bytes);
    if (b.comm) comm_.Sub(b.bytes);
    b = Buf{};
  }
  static void Keep(Buf) {}  // persistent: lives as long as the runtime

  // ---- events: a collective completes when the runtime waits for it ---------------------------
  int NewCollective() {
    done_.push_back(false);
    return static_cast<int>(done_.size()) - 1;
  }
  bool Done(int e) const { return e == kEmptyEvent || done_[e]; }
  void Wait(int e) {
    if (e != kEmptyEvent) done_[e] = true;
  }

  // ---- internal::PendingFrees -----------------------------------------------------------------
  struct Entry {
    Buf buffer;
    std::vector<int> events;
  };
  bool EntryDone(const Entry& e) const {
    return std::all_of(e.events.begin(), e.events.end(), [&](int ev) { return Done(ev); });
  }
  void PendingAdd(Buf& buffer, std::vector<int> events) {
    if (!buffer.allocated()) return;
    std::erase_if(events, [&](int e) { return Done(e); });
    if (events.empty()) {
      Free(buffer);
      return;
    }
    pending_.push_back({buffer, std::move(events)});
    buffer = Buf{};
  }
  int Count(int category) const {
    return static_cast<int>(std::count_if(pending_.begin(), pending_.end(), [&](const Entry& e) {
      return e.buffer.category == category;
    }));
  }
  void WaitUntilAtMost(int category, int keep) {
    Collect();
    while (Count(category) > keep) {
      for (Entry& e : pending_) {
        if (e.buffer.category != category) continue;
        for (int ev : e.events) Wait(ev);
        break;
      }
      Collect();
    }
  }

  void FinishReduction(SimUnit& unit) {
    Wait(unit.reduce_event);
    Buf wide;
    if (unit.quantized_reduced.allocated()) {
      wide = Alloc(kGradBuffers, unit.shard_numel * 4, /*comm=*/true);
      if (unit.code_chunks) {  // DecodeChunks
        PendingAdd(unit.quantized_reduced, {kEmptyEvent});
        unit.code_chunks = false;
      } else {
        DecodeMean(unit, unit.shard_numel);
      }
    } else if (rd() != DType::kF32) {
      wide = Alloc(kGradBuffers, unit.shard_numel * 4, /*comm=*/true);
    }
    PendingAdd(wide, {kEmptyEvent});
    PendingAdd(unit.reduced, {kEmptyEvent});
    PendingAdd(unit.lowp_grad, {kEmptyEvent});
    PendingAdd(unit.full_grad, {kEmptyEvent});
    unit.reduce_event = kEmptyEvent;
  }

  void Step() {
    // The global norm's sums (this rank's and the total, f64) and scratch (the S ranks' f32
    // pairs, all-gathered, this rank's pair and the clip factor).
    Buf sums = Alloc(kGradBuffers, 2 * 8, /*comm=*/true);
    Buf scratch = Alloc(kGradBuffers, (2 * int64_t{S_} + 3) * 4, /*comm=*/true);
    // Offload all: each host gradient shard up for the norm, given back once summed.
    for (size_t u = 0; u < units_.size(); ++u) {
      if (!host_shards_[u]) continue;
      Buf up = Alloc(kGradBuffers, units_[u].shard_numel * 4);
      PendingAdd(up, {kEmptyEvent});
    }
    PendingAdd(sums, {kEmptyEvent});
    PendingAdd(scratch, {kEmptyEvent});
    Collect();
    for (SimUnit& u : units_) u.grad_shard_zero = true;  // the gradient shards start again
  }

  const int S_, R_;
  const PlanRequest& o_;
  std::vector<SimUnit> units_;
  Gauge gauges_[kNumCategories];
  Gauge total_, comm_;
  std::vector<bool> done_;
  std::deque<Entry> pending_;
  bool overflowed_ = false;
  int64_t host_bytes_ = 0;
  std::vector<bool> host_shards_;  // OffloadKind::kAll: the unit's shards live on the host
  internal::UnitSchedule<Replay> schedule_;  // last: it runs on the members above
};

absl::Status Invalid(std::string message) { return absl::InvalidArgumentError(std::move(message)); }

double GiB(int64_t b) { return static_cast<double>(b) / (1024.0 * 1024.0 * 1024.0); }
double MiB(int64_t b) { return static_cast<double>(b) / (1024.0 * 1024.0); }

}  // namespace

MemoryReport MemoryPlan::AsReport() const {
  MemoryReport r;
  r.param_shard_bytes = param_shard_bytes;
  r.grad_shard_bytes = grad_shard_bytes;
  r.optimizer_bytes = optimizer_bytes;
  r.gathered_param_peak_bytes = gathered_param_peak_bytes;
  r.grad_buffer_peak_bytes = grad_buffer_peak_bytes;
  r.activation_peak_bytes = activation_peak_bytes;
  r.secondary_param_peak_bytes = secondary_param_peak_bytes;
  r.peak_bytes = peak_bytes;
  r.host_offload_bytes = host_offload_bytes;
  r.offloaded_units = offloaded_units;
  return r;
}

absl::StatusOr<MemoryPlan> PlanMemory(const PlanModel& model, const PlanRequest& o) {
  if (model.unit_numel.empty()) {
    return Invalid("the model has no units; give at least the root unit's element count");
  }
  if (model.unit_numel.size() > static_cast<size_t>(kMaxPlanUnits)) {
    return Invalid(absl::StrCat("the model has ", model.unit_numel.size(),
                                " units; the planner takes at most ", kMaxPlanUnits, " (",
                                nn::kMaxLayers, " blocks and the root): wrap runs of blocks "
                                "as one unit"));
  }
  if (!model.unit_names.empty() && model.unit_names.size() != model.unit_numel.size()) {
    return Invalid(absl::StrCat("the model names ", model.unit_names.size(), " units but gives ",
                                model.unit_numel.size(), " sizes; give one name per unit or none"));
  }
  for (size_t u = 0; u < model.unit_numel.size(); ++u) {
    if (model.unit_numel[u] < 1 || model.unit_numel[u] > kMaxPlanUnitNumel) {
      return Invalid(absl::StrCat("unit ", u, " of the model has ", model.unit_numel[u],
                                  " elements; give 1 to 2^56 (", kMaxPlanUnitNumel,
                                  ") per unit"));
    }
  }
  if (model.activation_bytes < 0 || model.activation_bytes_without_checkpointing < 0 ||
      model.activation_bytes_with_checkpointing < 0) {
    return Invalid("the model's activation bytes are negative; give the bytes it allocates");
  }
  if (o.world_size < 1) {
    return Invalid(absl::StrCat("world size ", o.world_size, ": give at least 1 rank"));
  }
  if (o.world_size > kMaxPlanWorldSize) {
    return Invalid(absl::StrCat("world size ", o.world_size, ": the planner takes at most ",
                                kMaxPlanWorldSize, " ranks (1 << 20)"));
  }
  const int per_host = o.ranks_per_host == 0 ? o.world_size : o.ranks_per_host;
  if (per_host < 1 || o.world_size % per_host != 0) {
    return Invalid(absl::StrCat("ranks per host (", o.ranks_per_host,
                                ") must be >= 1 and divide the world size (", o.world_size,
                                "); use e.g. 8 for hosts of 8 devices, or 0 for one host"));
  }
  for (auto [name, d] : {std::pair<const char*, DType>{"param_dtype", o.param_dtype},
                         std::pair<const char*, DType>{"reduce_dtype", o.reduce_dtype}}) {
    if (!IsFloat16Or32(d)) {
      return Invalid(absl::StrCat(name, " is ", std::string(DTypeName(d)),
                                  "; use f32, bf16 or f16"));
    }
  }
  if (o.max_prefetch_units < 0) {
    return Invalid(absl::StrCat("max_prefetch_units must be >= 0 (0 disables prefetching), got ",
                                o.max_prefetch_units));
  }
  if (o.micro_batches < 1 || o.micro_batches > kMaxPlanMicroBatches) {
    return Invalid(absl::StrCat("micro_batches must be 1 to ", kMaxPlanMicroBatches, ", got ",
                                o.micro_batches));
  }
  if (absl::Status c = CheckCommunicationOptions(o.communication); !c.ok()) {
    return Invalid(std::string(c.message()));
  }
  if (absl::Status c = CheckReductionDtype(o.communication, o.reduce_dtype); !c.ok()) {
    return Invalid(std::string(c.message()));
  }
  if (o.device_memory_bytes < 0) {
    return Invalid(absl::StrCat("device memory must be >= 0 bytes (0 = unknown), got ",
                                o.device_memory_bytes));
  }
  ShardingOptions so;
  so.strategy = o.strategy;
  so.hybrid_shard_size = o.hybrid_shard_size == 0 ? per_host : o.hybrid_shard_size;
  FSDP_ASSIGN_OR_RETURN(internal::MeshShape mesh, internal::StrategyMesh(so, o.world_size));
  so.secondary_shard_size = o.secondary_shard_size;
  if (absl::Status c = CheckSecondaryShard(so, mesh.shard); !c.ok()) {
    return Invalid(std::string(c.message()));
  }
  if (o.secondary_shard_size > 0 && per_host % o.secondary_shard_size != 0) {
    return Invalid(absl::StrCat(
        "secondary_shard_size is ", o.secondary_shard_size, " with ", per_host,
        " ranks per host: a secondary group would span hosts; give a divisor of the ranks per "
        "host, or 0"));
  }

  // The offloaded units, as the runtime chooses them.
  std::vector<bool> offloaded(model.unit_numel.size(), false);
  if (o.offload.what != OffloadKind::kNone) {
    if (o.optimizer != OptimizerKind::kAdamW) {
      return Invalid(absl::StrCat("offload ", std::string(OffloadName(o.offload.what)),
                                  " needs AdamW (the host runs the AdamW update)"));
    }
    std::vector<int64_t> shard_numel;
    for (int64_t n : model.unit_numel) shard_numel.push_back((n + mesh.shard - 1) / mesh.shard);
    absl::StatusOr<std::vector<int>> chosen =
        ChooseOffloadedUnits(o.offload, model.unit_names, shard_numel);
    if (!chosen.ok()) return Invalid(std::string(chosen.status().message()));
    for (int u : *chosen) offloaded[u] = true;
  }

  // The runtime's first step records the orders and prefetches nothing; the second and later
  // steps are alike. Peaks are since creation, as ShardingRuntime::memory() reports them.
  Replay replay(model.unit_numel, mesh.shard, mesh.replicate, o);
  replay.Finalize(offloaded);
  for (int step = 0; step < 3; ++step) replay.TrainStep();
  int64_t peak = 0;
  if (replay.overflowed() ||
      !internal::CheckedAdd(replay.total().peak, model.activation_bytes, &peak)) {
    return Invalid(absl::StrCat(
        "the plan of ", model.name.empty() ? "the model" : model.name, " on a shard group of ",
        mesh.shard, " rank(s) comes to more than 2^63 - 1 bytes (8 EiB) per rank",
        replay.overflowed() ? "" : " with its activations",
        "; give a smaller model, more ranks per shard group, or a smaller B x T"));
  }

  MemoryPlan p;
  p.param_shard_bytes = replay.gauge(kParams).now;
  p.grad_shard_bytes = replay.gauge(kGrads).now;
  p.optimizer_bytes = replay.gauge(kOptimizer).now;
  p.gathered_param_peak_bytes = replay.gauge(kGathered).peak;
  p.grad_buffer_peak_bytes = replay.gauge(kGradBuffers).peak;
  p.secondary_param_peak_bytes = replay.gauge(kSecondary).peak;
  p.communication_peak_bytes = replay.comm().peak;
  p.activation_peak_bytes = model.activation_bytes;
  p.peak_bytes = peak;
  // A background save's snapshot: the rank's shards of parameters and optimizer state, in host
  // memory (AsyncCheckpointer::snapshot_bytes, which leaves out the padding of a last shard).
  p.host_offload_bytes = replay.host_bytes();
  p.offloaded_units = static_cast<int>(std::count(offloaded.begin(), offloaded.end(), true));
  // (The offloaded units' state is 8 of their 16 host bytes an element: exp_avg and
  // exp_avg_sq; with offload all, the parameters too: 12 of 20.)
  if (o.async_checkpoint) {
    p.checkpoint_snapshot_bytes =
        p.param_shard_bytes + p.optimizer_bytes +
        (o.offload.what == OffloadKind::kAll ? p.host_offload_bytes / 20 * 12
                                             : p.host_offload_bytes / 2);
  }
  p.offload = o.offload.what;

  p.model = model.name;
  p.num_parameters = model.num_parameters;
  p.num_units = static_cast<int>(model.unit_numel.size());
  p.world_size = o.world_size;
  p.replicate_size = mesh.replicate;
  p.shard_size = mesh.shard;
  p.strategy = o.strategy;
  p.param_dtype = o.param_dtype;
  p.reduce_dtype = o.reduce_dtype;
  p.communication = o.communication;
  p.secondary_shard_size = o.secondary_shard_size;
  p.batch_size = o.batch_size;
  p.seq_len = o.seq_len;
  p.max_prefetch_units = o.max_prefetch_units;
  p.num_blocks = p.num_units - 1;
  if (!o.checkpoint_blocks.empty()) {
    p.checkpointed_blocks =
        static_cast<int>(std::count(o.checkpoint_blocks.begin(), o.checkpoint_blocks.end(), true));
  } else if (o.checkpoint_every > 0) {
    p.checkpointed_blocks = (p.num_blocks + o.checkpoint_every - 1) / o.checkpoint_every;
  }
  p.activation_bytes_without_checkpointing = model.activation_bytes_without_checkpointing;
  p.activation_bytes_with_checkpointing = model.activation_bytes_with_checkpointing;
  p.device_memory_bytes = o.device_memory_bytes;
  p.fits = o.device_memory_bytes == 0 || p.peak_bytes <= o.device_memory_bytes;
  return p;
}

std::string FormatMemoryPlan(const MemoryPlan& p) {
  auto line = [](const char* what, int64_t b, const char* note) {
    return absl::StrFormat("  %-34s %10.3f GiB %12.1f MiB%s%s\n", what, GiB(b), MiB(b),
                           *note ? "  " : "", note);
  };
  std::string ckpt = p.checkpointed_blocks == 0
                         ? std::string("no activation checkpointing")
                         : absl::StrCat("activation checkpointing on ", p.checkpointed_blocks,
                                        " of ", p.num_blocks, " blocks");
  std::string out = absl::StrFormat(
      "%s (%.3f B parameters, %d units) on %d ranks, %s (mesh %d x %d), param %s, reduce %s,\n"
      "B=%d T=%d, %s, prefetch %d unit(s)\n"
      "per rank:\n",
      p.model, static_cast<double>(p.num_parameters) / 1e9, p.num_units, p.world_size,
      std::string(StrategyName(p.strategy)), p.replicate_size, p.shard_size,
      std::string(DTypeName(p.param_dtype)), std::string(DTypeName(p.reduce_dtype)), p.batch_size,
      p.seq_len, ckpt, p.max_prefetch_units);
  if (const CommunicationOptions& c = p.communication; c.quantizes()) {
    out.insert(out.size() - std::string("per rank:\n").size(),
               absl::StrFormat("quantized: all-gather %s, reduction %s, a scale per %d elements\n",
                               WireFormatName(c.all_gather), WireFormatName(c.reduction),
                               c.block_size));
  }
  out += line("parameter shards (f32)", p.param_shard_bytes, "");
  out += line("gradient shards (f32)", p.grad_shard_bytes, "");
  out += line("optimizer state (f32)", p.optimizer_bytes, "");
  out += line("gathered parameters, peak", p.gathered_param_peak_bytes, "");
  out += line("unsharded gradient buffers, peak", p.grad_buffer_peak_bytes, "");
  out += line("  of which communication buffers", p.communication_peak_bytes, "");
  if (p.secondary_shard_size > 0) {
    out += line(absl::StrCat("secondary shards (1/", p.secondary_shard_size, "), peak").c_str(),
                p.secondary_param_peak_bytes, "");
  }
  out += line("activations", p.activation_peak_bytes, "");
  out += line("  without checkpointing", p.activation_bytes_without_checkpointing, "");
  out += line("  with checkpointing", p.activation_bytes_with_checkpointing, "");
  out += line("peak (all together)", p.peak_bytes, "");
  if (p.offloaded_units > 0) {
    const std::string note = absl::StrCat(
        p.offloaded_units, " of ", p.num_units,
        p.offload == OffloadKind::kAll ? " units' parameter, gradient and AdamW shards"
                                       : " units' AdamW state and staging");
    out += line("offload (host)", p.host_offload_bytes, note.c_str());
  }
  if (p.checkpoint_snapshot_bytes > 0) {
    out += line("background save's snapshot (host)", p.checkpoint_snapshot_bytes, "");
  }
  if (p.device_memory_bytes > 0) {
    out += absl::StrFormat(
        "  %-34s %10.3f GiB: %s (%.1f%% of the device, %s %.3f GiB)\n", "device memory",
        GiB(p.device_memory_bytes), p.fits ? "fits" : "DOES NOT FIT",
        100.0 * static_cast<double>(p.peak_bytes) / static_cast<double>(p.device_memory_bytes),
        p.fits ? "headroom" : "short by",
        GiB(p.fits ? p.device_memory_bytes - p.peak_bytes : p.peak_bytes - p.device_memory_bytes));
  }
  return out;
}

std::string FormatPlanTable(const std::vector<PlanTableCell>& cells, bool markdown) {
  const std::vector<std::string> head = {"strategy", "ranks", "mesh R x S", "params GiB",
                                         "grads GiB", "optimizer GiB", "gathered GiB",
                                         "grad buffers GiB", "activations GiB", "peak GiB",
                                         "fits", "largest B"};
  std::vector<std::vector<std::string>> rows;
  for (const PlanTableCell& c : cells) {
    std::vector<std::string> row = {std::string(StrategyName(c.strategy)),
                                    absl::StrCat(c.world_size)};
    if (!c.status.ok()) {
      row.push_back(std::string(c.status.message()));
      rows.push_back(std::move(row));
      continue;
    }
    const MemoryPlan& p = c.plan;
    auto gib = [](int64_t b) { return absl::StrFormat("%.2f", GiB(b)); };
    row.push_back(absl::StrCat(p.replicate_size, " x ", p.shard_size));
    for (int64_t b : {p.param_shard_bytes, p.grad_shard_bytes, p.optimizer_bytes,
                      p.gathered_param_peak_bytes, p.grad_buffer_peak_bytes,
                      p.activation_peak_bytes, p.peak_bytes}) {
      row.push_back(gib(b));
    }
    row.push_back(p.device_memory_bytes == 0 ? "-" : p.fits ? "yes" : "no");
    row.push_back(c.largest_micro_batch < 0 ? std::string("-")
                                            : absl::StrCat(c.largest_micro_batch));
    rows.push_back(std::move(row));
  }
  std::string out;
  if (markdown) {
    auto line = [](const std::vector<std::string>& cols) {
      std::string l = "|";
      for (const std::string& c : cols) absl::StrAppend(&l, " ", c, " |");
      return l + "\n";
    };
    out += line(head);
    std::string rule = "|";
    for (size_t i = 0; i < head.size(); ++i) rule += i < 2 ? "---|" : "---:|";
    out += rule + "\n";
    for (const auto& r : rows) out += line(r);
    return out;
  }
  std::vector<size_t> width(head.size(), 0);
  for (size_t i = 0; i < head.size(); ++i) width[i] = head[i].size();
  for (const auto& r : rows) {
    if (r.size() != head.size()) continue;  // an error message spans the row
    for (size_t i = 0; i < r.size(); ++i) width[i] = std::max(width[i], r[i].size());
  }
  auto line = [&](const std::vector<std::string>& cols) {
    std::string l;
    for (size_t i = 0; i < cols.size(); ++i) {
      const size_t pad = i < width.size() && cols[i].size() < width[i] ? width[i] - cols[i].size()
                                                                        : 0;
      if (i > 0) l += "  ";
      // Names left-aligned, numbers right-aligned; an error message after the world size.
      if (i == 0) {
        l += cols[i] + std::string(pad, ' ');
      } else if (i + 1 == cols.size() && cols.size() != head.size()) {
        l += cols[i];
      } else {
        l += std::string(pad, ' ') + cols[i];
      }
    }
    return l + "\n";
  };
  out += line(head);
  for (const auto& r : rows) out += line(r);
  return out;
}

absl::StatusOr<int64_t> ParseByteSize(std::string_view text) {
  std::string s = absl::AsciiStrToLower(absl::StripAsciiWhitespace(
      absl::string_view(text.data(), text.size())));
  const std::string original(text);
  auto bad = [&]() {
    return Invalid(absl::StrCat("'", original,
                                "' is not a memory size; write e.g. 80GiB, 80GB, 81920MiB or a "
                                "number of bytes"));
  };
  struct Unit {
    const char* suffix;
    double factor;
  };
  // Longest suffixes first.
  static const Unit kUnits[] = {
      {"kib", 1024.0}, {"mib", 1048576.0}, {"gib", 1073741824.0}, {"tib", 1099511627776.0},
      {"kb", 1e3},     {"mb", 1e6},         {"gb", 1e9},            {"tb", 1e12},
      {"k", 1024.0},   {"m", 1048576.0},    {"g", 1073741824.0},    {"t", 1099511627776.0},
      {"b", 1.0},
  };
  double factor = 1.0;
  for (const Unit& u : kUnits) {
    if (absl::EndsWith(s, u.suffix)) {
      s.resize(s.size() - std::string_view(u.suffix).size());
      factor = u.factor;
      break;
    }
  }
  s = std::string(absl::StripAsciiWhitespace(s));
  double v = 0;
  if (s.empty() || !absl::SimpleAtod(s, &v) || !std::isfinite(v) || v < 0) return bad();
  const double bytes = v * factor;
  if (bytes >= 9.2e18) return bad();
  return static_cast<int64_t>(std::llround(bytes));
}

}  // namespace fsdp
