// The memory planner's core: a replay of the sharding runtime's allocations over plain unit
// sizes. Each function of Replay below mirrors the runtime function of the same name
// (src/fsdp/gather.cc, reduce.cc, sharding_runtime.cc, unit.cc) as it runs on a host backend:
// the same buffers, allocated and freed at the same points, in the same categories. What the
// runtime decides from timing (whether a collective has completed when it looks) is taken as
// "not yet" until the runtime waits for it, the most memory any rank can see.
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
#include "src/fsdp/unit.h"

namespace fsdp {
namespace {

using internal::Gauge;  // the runtime's own byte gauge (src/fsdp/unit.h)

enum Category { kParams, kGrads, kOptimizer, kGathered, kGradBuffers, kNumCategories };

// An allocation counted in its category (and, for the reductions' own buffers, as
// communication) while it lives; as internal::Accounted.
struct Buf {
  int category = -1;
  int64_t bytes = 0;
  bool comm = false;
  bool allocated() const { return bytes != 0; }
};

constexpr int kEmptyEvent = -1;  // Event(): complete (the CPU backend's Record)

enum class State { kIdle, kForward, kForwardDone, kBackward, kBackwardDone };
enum class Reduction { kNone, kShardGroup, kReplicaGroup };

struct SimUnit {
  int64_t numel = 0, shard_numel = 0, padded_numel = 0;
  State state = State::kIdle;
  Buf gathered, full_grad, lowp_grad, reduced;
  int gather_event = kEmptyEvent;
  bool prefetched = false;
  Reduction reduction = Reduction::kNone;
  int reduce_event = kEmptyEvent;
};

// The order units were used in, as the runtime records it, and where each unit first appears
// in it: the runtime's std::find over the order, without its cost per use (a replay of many
// units would take their number squared).
struct Order {
  std::vector<int> units;
  std::vector<int> first;  // per unit: its first index in `units`, or -1
  size_t scanned = 0;      // prefetch: where this pass's last scan stopped (Replay::Acquire)
  void Record(int u) {
    if (first.size() <= static_cast<size_t>(u)) first.resize(u + 1, -1);
    if (first[u] < 0) first[u] = static_cast<int>(units.size());
    units.push_back(u);
  }
  std::vector<int>::const_iterator Find(int u) const {
    const bool seen = static_cast<size_t>(u) < first.size() && first[u] >= 0;
    return seen ? units.begin() + first[u] : units.end();
  }
};

class Replay {
 public:
  Replay(const std::vector<int64_t>& numel, int S, int R, const PlanRequest& o)
      : S_(S), R_(R), o_(o) {
    for (int64_t n : numel) {
      SimUnit u;
      u.numel = n;
      u.shard_numel = (n + S - 1) / S;  // FlatLayout::Build
      u.padded_numel = u.shard_numel * S;
      units_.push_back(u);
    }
  }

  // ShardingRuntime::Finalize: per unit the parameter and gradient shards, then the
  // optimizer's state (AdamW: exp_avg and exp_avg_sq; SGD with momentum: one buffer).
  void Finalize() {
    for (SimUnit& u : units_) {
      Keep(Alloc(kParams, u.shard_numel * 4));
      Keep(Alloc(kGrads, u.shard_numel * 4));
      const int states = o_.optimizer == OptimizerKind::kAdamW ? 2 : o_.sgd_momentum ? 1 : 0;
      for (int i = 0; i < states; ++i) Keep(Alloc(kOptimizer, u.shard_numel * 4));
    }
  }

  // One micro-batch and the optimizer step, with the hooks in ShardedModel's order.
  void TrainStep() {
    const int n = static_cast<int>(units_.size());
    forward_order_.scanned = backward_order_.scanned = 0;  // a new pass of each
    PreForward(0);
    for (int u = 1; u < n; ++u) {
      PreForward(u);
      PostForward(u);
    }
    PostForward(0);
    PreBackward(0);
    for (int u = n - 1; u >= 1; --u) {
      PreBackward(u);
      PostBackward(u);
    }
    PostBackward(0);
    FinishBackward();
    Step();
  }

  const Gauge& gauge(Category c) const { return gauges_[c]; }
  const Gauge& total() const { return total_; }
  const Gauge& comm() const { return comm_; }
  // An allocation took the total past int64 bytes: the figures are not the plan's (the replay
  // went on without that buffer).
  bool overflowed() const { return overflowed_; }

 private:
  DType pd() const { return o_.param_dtype; }
  DType rd() const { return o_.reduce_dtype; }
  bool reshard_after_forward() const {
    return o_.strategy == ShardingStrategy::kFullShard ||
           o_.strategy == ShardingStrategy::kHybridShard;
  }

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

  // ---- gather.cc ------------------------------------------------------------------------------
  void IssueGather(SimUnit& unit) {
    if (unit.gathered.allocated() || (S_ == 1 && pd() == DType::kF32)) return;
    WaitUntilAtMost(kGathered, 1);
    unit.gathered =
        Alloc(kGathered, unit.padded_numel * static_cast<int64_t>(DTypeSize(pd())));
    if (S_ == 1) return;
    unit.gather_event = NewCollective();
  }

  void Acquire(int u, Order& order, bool recording, bool prefetch) {
    SimUnit& unit = units_[u];
    if (recording) order.Record(u);
    if (unit.prefetched) {
      unit.prefetched = false;
      --prefetched_units_;
    }
    IssueGather(unit);
    if (prefetch && !recording && S_ > 1) {
      // The runtime scans the order from the unit after this one. The units an earlier scan of
      // this pass passed over are still gathered (within a pass only a unit's own hooks free
      // it), so this scan goes on from where that one stopped: a pass scans each unit once,
      // not once per use (a replay of many units, all prefetched, would take their number
      // squared).
      const std::vector<int>& seq = order.units;
      auto pos = order.Find(u);
      size_t i = pos == seq.end() ? seq.size()
                                  : std::max<size_t>(pos - seq.begin() + 1, order.scanned);
      for (; i < seq.size() && prefetched_units_ < o_.max_prefetch_units; ++i) {
        SimUnit& next = units_[seq[i]];
        if (next.gathered.allocated() || next.state != NextState()) continue;
        IssueGather(next);
        next.prefetched = true;
        ++prefetched_units_;
      }
      order.scanned = i;
    }
    WaitGather(unit);
  }

  bool NeededFirstInBackward(int u) const {
    const std::vector<int>& f = forward_order_.units;
    if (f.empty()) return false;
    return u == f.front() || (forward_recorded_ && u == f.back());
  }
  State NextState() const { return in_backward_ ? State::kForwardDone : State::kIdle; }

  void WaitGather(SimUnit& unit) {
    if (unit.gather_event == kEmptyEvent) return;
    Wait(unit.gather_event);
    unit.gather_event = kEmptyEvent;
  }

  void FreeGathered(SimUnit& unit) {
    if (!unit.gathered.allocated()) return;
    std::vector<int> users = {kEmptyEvent};
    if (unit.gather_event != kEmptyEvent) users.push_back(unit.gather_event);
    PendingAdd(unit.gathered, std::move(users));
    unit.gather_event = kEmptyEvent;
    if (unit.prefetched) {
      unit.prefetched = false;
      --prefetched_units_;
    }
  }

  // ---- reduce.cc ------------------------------------------------------------------------------
  void IssueReduction(SimUnit& unit) {
    if (S_ == 1 && R_ == 1) {
      PendingAdd(unit.full_grad, {kEmptyEvent});
      return;
    }
    const int64_t rsize = static_cast<int64_t>(DTypeSize(rd()));
    if (rd() != DType::kF32) {
      unit.lowp_grad = Alloc(kGradBuffers, unit.padded_numel * rsize, /*comm=*/true);
      PendingAdd(unit.full_grad, {kEmptyEvent});
    }
    if (S_ > 1) {
      unit.reduced = Alloc(kGradBuffers, unit.shard_numel * rsize, /*comm=*/true);
    }
    unit.reduce_event = NewCollective();
    unit.reduction = Reduction::kShardGroup;
    shard_reductions_.push_back(static_cast<int>(&unit - units_.data()));
  }

  void FinishReduction(SimUnit& unit) {
    Wait(unit.reduce_event);
    Buf wide;
    if (rd() != DType::kF32) wide = Alloc(kGradBuffers, unit.shard_numel * 4, /*comm=*/true);
    PendingAdd(wide, {kEmptyEvent});
    PendingAdd(unit.reduced, {kEmptyEvent});
    PendingAdd(unit.lowp_grad, {kEmptyEvent});
    PendingAdd(unit.full_grad, {kEmptyEvent});
    unit.reduce_event = kEmptyEvent;
    unit.reduction = Reduction::kNone;
  }

  void AdvanceReduction(SimUnit& unit) {
    const bool shard_step = unit.reduction == Reduction::kShardGroup;
    if (shard_step && S_ > 1) {
      PendingAdd(unit.full_grad, {unit.reduce_event});
      PendingAdd(unit.lowp_grad, {unit.reduce_event});
      if (R_ > 1) {
        Wait(unit.reduce_event);  // the comm stream waits for the reduce-scatter
        unit.reduce_event = NewCollective();
        unit.reduction = Reduction::kReplicaGroup;
        replica_reductions_.push_back(static_cast<int>(&unit - units_.data()));
        return;
      }
    }
    FinishReduction(unit);
  }

  void ProgressReductions(bool drain) {
    const size_t in_flight = drain ? 0 : static_cast<size_t>(std::max(1, o_.max_prefetch_units));
    const bool collective_next = S_ > 1 && R_ > 1;
    while (!shard_reductions_.empty()) {
      SimUnit& unit = units_[shard_reductions_.front()];
      const bool done = Done(unit.reduce_event);
      const bool move_now = collective_next ? false : done;  // a host backend
      if (!move_now && !drain) {
        if (shard_reductions_.size() <= in_flight) break;
        if (!done) Wait(unit.reduce_event);
      }
      shard_reductions_.pop_front();
      AdvanceReduction(unit);
    }
    while (!replica_reductions_.empty()) {
      SimUnit& unit = units_[replica_reductions_.front()];
      if (!drain && !Done(unit.reduce_event)) {
        if (replica_reductions_.size() <= in_flight) break;
        Wait(unit.reduce_event);
      }
      replica_reductions_.pop_front();
      AdvanceReduction(unit);
    }
    Collect();
  }

  // ---- the hooks (sharding_runtime.cc) --------------------------------------------------------
  void PreForward(int u) {
    in_backward_ = false;
    Collect();
    Acquire(u, forward_order_, !forward_recorded_, o_.forward_prefetch);
    units_[u].state = State::kForward;
  }
  void PostForward(int u) {
    if (reshard_after_forward() && !NeededFirstInBackward(u)) FreeGathered(units_[u]);
    units_[u].state = State::kForwardDone;
  }
  void PreBackward(int u) {
    if (!in_backward_) {
      in_backward_ = true;
      forward_recorded_ = true;
    }
    Collect();
    Acquire(u, backward_order_, !backward_recorded_, o_.backward_prefetch);
    SimUnit& unit = units_[u];
    if (!unit.full_grad.allocated()) unit.full_grad = Alloc(kGradBuffers, unit.padded_numel * 4);
    unit.state = State::kBackward;
  }
  void PostBackward(int u) {
    SimUnit& unit = units_[u];
    FreeGathered(unit);
    IssueReduction(unit);
    ProgressReductions(false);
    unit.state = State::kBackwardDone;
  }
  void FinishBackward() {
    ProgressReductions(true);
    for (SimUnit& unit : units_) {
      unit.state = State::kIdle;
      FreeGathered(unit);
    }
    backward_recorded_ = true;
    in_backward_ = false;
  }
  void Step() {
    // The global norm's scratch: this rank's and the total f64 sums, the S ranks' f32 pairs
    // (all-gathered), this rank's pair and the clip factor.
    Buf scratch = Alloc(kGradBuffers, (4 + 2 * int64_t{S_} + 3) * 4, /*comm=*/true);
    PendingAdd(scratch, {kEmptyEvent});
    Collect();
  }

  const int S_, R_;
  const PlanRequest& o_;
  std::vector<SimUnit> units_;
  Gauge gauges_[kNumCategories];
  Gauge total_, comm_;
  std::vector<bool> done_;
  std::deque<Entry> pending_;
  Order forward_order_, backward_order_;
  bool forward_recorded_ = false, backward_recorded_ = false, in_backward_ = false;
  int prefetched_units_ = 0;
  std::deque<int> shard_reductions_, replica_reductions_;
  bool overflowed_ = false;
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
  r.peak_bytes = peak_bytes;
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
  if (o.device_memory_bytes < 0) {
    return Invalid(absl::StrCat("device memory must be >= 0 bytes (0 = unknown), got ",
                                o.device_memory_bytes));
  }
  ShardingOptions so;
  so.strategy = o.strategy;
  so.hybrid_shard_size = o.hybrid_shard_size == 0 ? per_host : o.hybrid_shard_size;
  FSDP_ASSIGN_OR_RETURN(internal::MeshShape mesh, internal::StrategyMesh(so, o.world_size));

  // The runtime's first step records the orders and prefetches nothing; the second and later
  // steps are alike. Peaks are since creation, as ShardingRuntime::memory() reports them.
  Replay replay(model.unit_numel, mesh.shard, mesh.replicate, o);
  replay.Finalize();
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
  p.communication_peak_bytes = replay.comm().peak;
  p.activation_peak_bytes = model.activation_bytes;
  p.peak_bytes = peak;

  p.model = model.name;
  p.num_parameters = model.num_parameters;
  p.num_units = static_cast<int>(model.unit_numel.size());
  p.world_size = o.world_size;
  p.replicate_size = mesh.replicate;
  p.shard_size = mesh.shard;
  p.strategy = o.strategy;
  p.param_dtype = o.param_dtype;
  p.reduce_dtype = o.reduce_dtype;
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
  out += line("parameter shards (f32)", p.param_shard_bytes, "");
  out += line("gradient shards (f32)", p.grad_shard_bytes, "");
  out += line("optimizer state (f32)", p.optimizer_bytes, "");
  out += line("gathered parameters, peak", p.gathered_param_peak_bytes, "");
  out += line("unsharded gradient buffers, peak", p.grad_buffer_peak_bytes, "");
  out += line("  of which communication buffers", p.communication_peak_bytes, "");
  out += line("activations", p.activation_peak_bytes, "");
  out += line("  without checkpointing", p.activation_bytes_without_checkpointing, "");
  out += line("  with checkpointing", p.activation_bytes_with_checkpointing, "");
  out += line("peak (all together)", p.peak_bytes, "");
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
