// The unit schedule of the sharding runtime, written once: the hooks' state machine, the order
// the units were first used in, prefetching and its rate limit, resharding after forward, the
// two units FULL_SHARD keeps gathered into backward, and the queues of gradient reductions.
// Three executors run it:
//   - the runtime (src/fsdp/runtime_impl.h): buffers on the backend, collectives on the data
//     plane, frees deferred until the device is done;
//   - the memory planner (src/plan/plan.cc): the same buffers as byte counts;
//   - the projection (src/bench/project.cc): the same collectives as times on a described link.
// So a change to when a unit is gathered, freed or reduced is made here, and the planner and
// the projection follow it.
//
// The executor `Exec` is asked, for unit index u:
//   bool is_host() const;          // the backend's compute is done when the host issues it
//   bool Gathered(int u) const;    // its parameters are gathered or on their way
//   absl::Status IssueGather(int u);  // starts the gather, unless not needed (a no-op then)
//   absl::Status WaitGather(int u, bool prefetched);  // compute waits for it
//   void FreeGathered(int u);      // gives the gathered parameters back (deferred)
//   // A secondary shard (ScheduleOptions::secondary_shard_size): keeps this rank's part of
//   // the gathered unit before FreeGathered after forward, so that IssueGather in backward
//   // gathers over the secondary group; DropSecondary gives an unused one back.
//   absl::Status KeepSecondary(int u);
//   void DropSecondary(int u);
//   absl::Status PrepareGradient(int u);  // PreBackward: the unsharded gradient buffer
//   // PostBackward with sync: starts the unit's reduction in the shard group (NO_SHARD: across
//   // replicas); false when nothing is in flight (a single rank: already in the shard).
//   absl::StatusOr<bool> IssueReduction(int u);
//   bool ReductionDone(int u) const;        // the reduction in flight has completed
//   absl::Status WaitReduction(int u);      // the host waits for it (counted as a throttle)
//   absl::Status ReductionStatus(int u);    // the status of a completed reduction
//   // Moves a reduction on from `stage`: with `to_replicas` issues the replica all-reduce of
//   // the reduced shard (HYBRID after the shard group), else adds it into the gradient shard;
//   // gives back what the stage used. `with_accumulated`: the all-reduce also carries what
//   // earlier micro-batches' shard-group reductions added into the gradient shard (their
//   // replica all-reduce was left out: ShardingRuntime::set_requires_all_reduce).
//   absl::Status AdvanceReduction(int u, Reduction stage, bool to_replicas,
//                                 bool with_accumulated);
//   // A quantized reduction across replicas: their all_to_all has completed (as the streams
//   // order it); decode this replica's chunk, re-encode it and all-gather the chunks.
//   absl::Status IssueReplicaGather(int u);
//   void Collect();                // frees what the device is done with
#pragma once

#include <algorithm>
#include <cstddef>
#include <deque>
#include <vector>

#include "fsdp/sharding.h"
#include "fsdp/status.h"
#include "src/fsdp/unit.h"

namespace fsdp::internal {

// What decides the schedule: the strategy's resharding, prefetching and the mesh.
struct ScheduleOptions {
  ShardingStrategy strategy = ShardingStrategy::kFullShard;
  bool forward_prefetch = true, backward_prefetch = true;
  int max_prefetch_units = 1;
  int shard_size = 1, replicate_size = 1;
  // A quantized reduction across replicas: an all_to_all, then an all_gather (two stages).
  bool two_phase_replicas = false;
  // ShardingOptions::secondary_shard_size: a unit resharded after forward keeps a secondary
  // shard for its backward's gather.
  int secondary_shard_size = 0;

  static ScheduleOptions From(const ShardingOptions& o, int shard_size, int replicate_size) {
    return {o.strategy,   o.forward_prefetch, o.backward_prefetch, o.max_prefetch_units,
            shard_size,   replicate_size,
            QuantizesReplicaReduction(o.communication, replicate_size),
            o.secondary_shard_size};
  }
  // FULL_SHARD and HYBRID_SHARD give a unit's gathered parameters back after its forward.
  bool reshard_after_forward() const {
    return strategy == ShardingStrategy::kFullShard || strategy == ShardingStrategy::kHybridShard;
  }
};

// The order units were used in during the first pass of a direction, and where each unit
// first appears in it (a std::find over the order, without its cost per use).
struct UseOrder {
  std::vector<int> units;
  std::vector<int> first;  // per unit: its first index in `units`, or -1
  size_t scanned = 0;      // prefetch: where this pass's last scan stopped
  void Record(int u) {
    if (first.size() <= static_cast<size_t>(u)) first.resize(u + 1, -1);
    if (first[u] < 0) first[u] = static_cast<int>(units.size());
    units.push_back(u);
  }
  // The index after u's first use, or units.size() when u was not used.
  size_t After(int u) const {
    const bool seen = static_cast<size_t>(u) < first.size() && first[u] >= 0;
    return seen ? static_cast<size_t>(first[u]) + 1 : units.size();
  }
};

template <class Exec>
class UnitSchedule {
 public:
  UnitSchedule(Exec* exec, const ScheduleOptions& options) : exec_(exec), o_(options) {}

  // A unit registered (units are numbered in registration order).
  void AddUnit() { units_.emplace_back(); }
  int num_units() const { return static_cast<int>(units_.size()); }
  const ScheduleOptions& options() const { return o_; }

  UnitState state(int u) const { return units_[u].state; }
  bool prefetched(int u) const { return units_[u].prefetched; }
  // The unit holds gradients accumulated with sync_gradients off that were never reduced.
  bool unsynced(int u) const { return units_[u].unsynced; }
  // HYBRID: the unit's gradient shard holds shard-group reductions whose all-reduce across
  // replicas was left out (requires_all_reduce off); a later one carries them.
  bool replica_pending(int u) const { return units_[u].replica_pending; }
  Reduction reduction(int u) const { return units_[u].reduction; }
  bool forward_recorded() const { return forward_recorded_; }
  bool in_backward() const { return in_backward_; }

  // A replay of a step after the first (the projection): the orders as if recorded.
  void AssumeRecorded(const std::vector<int>& forward, const std::vector<int>& backward) {
    forward_ = backward_ = UseOrder{};
    for (int u : forward) forward_.Record(u);
    for (int u : backward) backward_.Record(u);
    forward_recorded_ = backward_recorded_ = true;
  }

  // ---- the hooks: the caller checked the unit's state (ExpectState) ---------------------------
  absl::Status PreForward(int u) {
    if (in_backward_ || pass_ended_) StartPass(forward_);
    in_backward_ = false;
    exec_->Collect();
    FSDP_RETURN_IF_ERROR(Acquire(u, forward_, !forward_recorded_, o_.forward_prefetch));
    units_[u].state = UnitState::kForward;
    return absl::OkStatus();
  }

  absl::Status PostForward(int u) {
    if (o_.reshard_after_forward() && !NeededFirstInBackward(u)) {
      if (o_.secondary_shard_size > 0) FSDP_RETURN_IF_ERROR(exec_->KeepSecondary(u));
      Free(u);
    }
    units_[u].state = UnitState::kForwardDone;
    return absl::OkStatus();
  }

  absl::Status PreBackward(int u) {
    if (!in_backward_) {
      in_backward_ = true;
      forward_recorded_ = true;
      StartPass(backward_);
    }
    exec_->Collect();
    FSDP_RETURN_IF_ERROR(Acquire(u, backward_, !backward_recorded_, o_.backward_prefetch));
    FSDP_RETURN_IF_ERROR(exec_->PrepareGradient(u));
    units_[u].state = UnitState::kBackward;
    return absl::OkStatus();
  }

  // `sync`: reduce the gradient now (ShardingRuntime::set_sync_gradients), or keep
  // accumulating it locally. `all_reduce` (HYBRID; ShardingRuntime::set_requires_all_reduce):
  // the reduction goes on across replicas, or stops at the shard group and the gradient shard
  // keeps it for a later backward's all-reduce.
  absl::Status PostBackward(int u, bool sync, bool all_reduce = true) {
    Free(u);
    if (sync) {
      FSDP_ASSIGN_OR_RETURN(const bool in_flight, exec_->IssueReduction(u));
      units_[u].unsynced = false;
      units_[u].all_reduce = all_reduce;
      if (in_flight) {
        units_[u].reduction = Reduction::kShardGroup;
        shard_reductions_.push_back(u);
      }
      // Earlier units whose reduction completed give their unsharded gradients back now.
      FSDP_RETURN_IF_ERROR(ProgressReductions(false));
    } else {
      units_[u].unsynced = true;
    }
    units_[u].state = UnitState::kBackwardDone;
    return absl::OkStatus();
  }

  absl::Status FinishBackward() {
    // The reductions still in flight land in their gradient shards (ordered by events).
    FSDP_RETURN_IF_ERROR(ProgressReductions(true));
    for (int u = 0; u < num_units(); ++u) {
      units_[u].state = UnitState::kIdle;
      Free(u);  // a prefetch that no hook claimed
      exec_->DropSecondary(u);  // a unit whose backward did not run
    }
    backward_recorded_ = true;
    in_backward_ = false;
    pass_ended_ = true;
    return absl::OkStatus();
  }

  void FinishForwardOnly() {
    for (int u = 0; u < num_units(); ++u) {
      Free(u);
      exec_->DropSecondary(u);
      units_[u].state = UnitState::kIdle;
    }
    exec_->Collect();
    forward_recorded_ = true;
    pass_ended_ = true;
  }

  // Moves the queues on: without `drain`, what has completed, waiting (on the host) for the
  // oldest when more than max(1, max_prefetch_units) are in flight in a group; with `drain`,
  // every reduction, ordered by events (the compute stream waits, not the host).
  absl::Status ProgressReductions(bool drain) {
    const size_t in_flight = drain ? 0 : static_cast<size_t>(std::max(1, o_.max_prefetch_units));
    // HYBRID moves a reduction on by issuing the replica all-reduce: every rank must do that at
    // the same point of its program (the collectives of the two groups share the communication
    // stream), so when depends on counts, never on timing. A device moves it on at once (its
    // stream orders the all-reduce after the reduce-scatter); a host backend, whose stream
    // waits block the host, when more than `in_flight` are held.
    FSDP_RETURN_IF_ERROR(ProgressQueue(shard_reductions_, drain, in_flight));
    FSDP_RETURN_IF_ERROR(ProgressQueue(replica_reductions_, drain, in_flight));
    FSDP_RETURN_IF_ERROR(ProgressQueue(gather_reductions_, drain, in_flight));
    exec_->Collect();
    return absl::OkStatus();
  }

  // FULL_SHARD keeps two units gathered from forward into backward, as FSDP does with the root
  // and FSDP2 recommends for the last block: the first unit of the forward order (the root,
  // which runs again at the head and starts backward) and the last one (whose backward comes
  // first). Regathering them would be exposed: nothing runs to overlap with.
  bool NeededFirstInBackward(int u) const {
    if (forward_.units.empty()) return false;
    return u == forward_.units.front() || (forward_recorded_ && u == forward_.units.back());
  }

 private:
  struct UnitRecord {
    UnitState state = UnitState::kIdle;
    bool prefetched = false;  // gathered ahead of use, not yet claimed by a Pre* hook
    bool unsynced = false;
    bool all_reduce = true;  // the reduction in flight goes on across replicas (HYBRID)
    bool replica_pending = false;
    Reduction reduction = Reduction::kNone;
  };

  // One queue of ProgressReductions, in order. A unit moves on when its collective has
  // completed, unless moving it issues the next collective (HYBRID's replica stage after the
  // shard group, a quantized reduction's all_gather after the replicas' all_to_all): a device
  // then moves it at once, a host backend when more than `in_flight` are held.
  absl::Status ProgressQueue(std::deque<int>& queue, bool drain, size_t in_flight) {
    while (!queue.empty()) {
      const int u = queue.front();
      const bool done = exec_->ReductionDone(u);
      const bool move_now = CollectiveNext(units_[u]) ? !exec_->is_host() : done;
      if (!move_now && !drain) {
        if (queue.size() <= in_flight) break;
        // Too many unsharded gradients held: wait for the oldest reduction (on the host, which
        // issues the next unit's gradient; a host backend's compute thread is blocked).
        if (!done) FSDP_RETURN_IF_ERROR(exec_->WaitReduction(u));
      }
      FSDP_RETURN_IF_ERROR(exec_->ReductionStatus(u));
      queue.pop_front();
      FSDP_RETURN_IF_ERROR(Advance(u));
    }
    return absl::OkStatus();
  }

  // Both groups have more than one rank: a shard-group reduction goes on across replicas.
  bool hybrid() const { return o_.shard_size > 1 && o_.replicate_size > 1; }
  // The stage in flight is the replicas' all_to_all of a quantized reduction (HYBRID's replica
  // stage; NO_SHARD's only stage): its all_gather follows.
  bool ReplicaPhaseOne(const UnitRecord& unit) const {
    if (!o_.two_phase_replicas) return false;
    return unit.reduction == Reduction::kReplicaGroup ||
           (unit.reduction == Reduction::kShardGroup && o_.shard_size == 1);
  }
  // Moving the unit on issues a collective.
  bool CollectiveNext(const UnitRecord& unit) const {
    return (unit.reduction == Reduction::kShardGroup && hybrid() && unit.all_reduce) ||
           ReplicaPhaseOne(unit);
  }

  // The state a unit is in right before the hook that the current direction calls next.
  UnitState NextState() const {
    return in_backward_ ? UnitState::kForwardDone : UnitState::kIdle;
  }

  void StartPass(UseOrder& order) {
    order.scanned = 0;
    pass_ended_ = false;
  }

  // Makes unit `u` gathered for use now, and keeps up to max_prefetch_units gathers issued
  // ahead of it in the recorded order: each use tops the queue up, so a block that computes
  // late (or a transfer that finishes early) does not leave the link idle while more than one
  // unit could already be on its way. Prefetch decisions depend only on the recorded order and
  // the units' states, so every rank issues the same collectives.
  absl::Status Acquire(int u, UseOrder& order, bool recording, bool prefetch) {
    if (recording) order.Record(u);
    UnitRecord& unit = units_[u];
    const bool was_prefetched = unit.prefetched;
    if (unit.prefetched) {
      unit.prefetched = false;
      --prefetched_units_;
    }
    FSDP_RETURN_IF_ERROR(exec_->IssueGather(u));
    if (prefetch && !recording && o_.shard_size > 1) {
      // From the unit after this one, or from where this pass's last scan stopped: the units
      // an earlier scan of this pass passed over are gathered (only a unit's own hooks free it
      // within a pass, and a unit is used once per pass) or past their turn, so a pass scans
      // each unit once, not once per use.
      size_t i = std::max(order.After(u), order.scanned);
      for (; i < order.units.size() && prefetched_units_ < o_.max_prefetch_units; ++i) {
        const int v = order.units[i];
        if (exec_->Gathered(v) || units_[v].state != NextState()) continue;
        FSDP_RETURN_IF_ERROR(exec_->IssueGather(v));
        units_[v].prefetched = true;
        ++prefetched_units_;
      }
      order.scanned = i;
    }
    return exec_->WaitGather(u, was_prefetched);
  }

  void Free(int u) {
    exec_->FreeGathered(u);
    if (units_[u].prefetched) {
      units_[u].prefetched = false;
      --prefetched_units_;
    }
  }

  absl::Status Advance(int u) {
    UnitRecord& unit = units_[u];
    if (ReplicaPhaseOne(unit)) {
      FSDP_RETURN_IF_ERROR(exec_->IssueReplicaGather(u));
      unit.reduction = Reduction::kReplicaGather;
      gather_reductions_.push_back(u);
      return absl::OkStatus();
    }
    const bool shard_stage = unit.reduction == Reduction::kShardGroup && hybrid();
    const bool to_replicas = shard_stage && unit.all_reduce;
    FSDP_RETURN_IF_ERROR(exec_->AdvanceReduction(u, unit.reduction, to_replicas,
                                                 to_replicas && unit.replica_pending));
    if (to_replicas) {
      unit.replica_pending = false;
      unit.reduction = Reduction::kReplicaGroup;
      replica_reductions_.push_back(u);
    } else {
      if (shard_stage) unit.replica_pending = true;
      unit.reduction = Reduction::kNone;
    }
    return absl::OkStatus();
  }

  Exec* exec_;
  ScheduleOptions o_;
  std::vector<UnitRecord> units_;
  UseOrder forward_, backward_;
  bool forward_recorded_ = false, backward_recorded_ = false;
  bool in_backward_ = false;
  bool pass_ended_ = true;  // the next PreForward starts a pass
  int prefetched_units_ = 0;
  // Units whose gradient reduction is in flight, in the order issued: first in the shard
  // group, then (HYBRID) across replicas, then (a quantized reduction) the replicas' gather.
  // Each advances strictly in order, so every rank issues the replicas' collectives in the
  // same order whatever the timing.
  std::deque<int> shard_reductions_, replica_reductions_, gather_reductions_;
};

}  // namespace fsdp::internal
