// ShardingRuntime: the per-unit state machine, gathers and reductions of the FSDP strategies,
// the sharded optimizer step with global-norm clipping, and memory accounting.
//
// Every strategy is one mesh (replicate R x shard S) plus one flag:
//   FULL_SHARD 1 x N, SHARD_GRAD_OP 1 x N (params kept from forward to backward),
//   NO_SHARD N x 1 (a shard is the whole unit: no gathers, gradients all-reduced),
//   HYBRID_* R x S.
// Gradients: reduce-scatter (avg) in the shard group, then all-reduce (avg) of the shard in
// the replicate group, then accumulate into the gradient shard.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <deque>
#include <set>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "fsdp/agreement.h"
#include "fsdp/mesh.h"
#include "fsdp/sharding.h"
#include "fsdp/trace.h"
#include "src/fsdp/flat_layout.h"
#include "src/fsdp/rank_agreement.h"

namespace fsdp {

std::string_view StrategyName(ShardingStrategy s) {
  switch (s) {
    case ShardingStrategy::kFullShard: return "FULL_SHARD";
    case ShardingStrategy::kShardGradOp: return "SHARD_GRAD_OP";
    case ShardingStrategy::kNoShard: return "NO_SHARD";
    case ShardingStrategy::kHybridShard: return "HYBRID_SHARD";
    case ShardingStrategy::kHybridShardGradOp: return "HYBRID_SHARD_GRAD_OP";
  }
  return "?";
}

absl::StatusOr<ShardingStrategy> ParseStrategy(std::string_view name) {
  std::string n = absl::AsciiStrToUpper(absl::string_view(name.data(), name.size()));
  std::replace(n.begin(), n.end(), '-', '_');
  for (auto s : {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp,
                 ShardingStrategy::kNoShard, ShardingStrategy::kHybridShard,
                 ShardingStrategy::kHybridShardGradOp}) {
    if (n == StrategyName(s)) return s;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown sharding strategy '", std::string(name),
      "'; use FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD or HYBRID_SHARD_GRAD_OP"));
}

std::string FormatMemoryReport(const MemoryReport& m) {
  auto mib = [](int64_t b) { return static_cast<double>(b) / (1 << 20); };
  return absl::StrFormat(
      "params %.2f MiB, grads %.2f MiB, optimizer %.2f MiB (persistent %.2f MiB); gathered "
      "params now %.2f / peak %.2f MiB; grad buffers now %.2f / peak %.2f MiB; activations "
      "peak %.2f MiB",
      mib(m.param_shard_bytes), mib(m.grad_shard_bytes), mib(m.optimizer_bytes),
      mib(m.persistent_bytes()), mib(m.gathered_param_bytes), mib(m.gathered_param_peak_bytes),
      mib(m.grad_buffer_bytes), mib(m.grad_buffer_peak_bytes), mib(m.activation_peak_bytes));
}

namespace {

enum class UnitState { kIdle, kForward, kForwardDone, kBackward, kBackwardDone };

absl::string_view StateName(UnitState s) {
  switch (s) {
    case UnitState::kIdle: return "idle";
    case UnitState::kForward: return "in forward (after PreForward)";
    case UnitState::kForwardDone: return "after PostForward";
    case UnitState::kBackward: return "in backward (after PreBackward)";
    case UnitState::kBackwardDone: return "after PostBackward";
  }
  return "?";
}

// Bytes of one category, now and at peak.
struct Gauge {
  int64_t now = 0, peak = 0;
  void Add(int64_t b) {
    now += b;
    peak = std::max(peak, now);
  }
  void Sub(int64_t b) { now -= b; }
};

// The runtime's allocations by category, and all of them together (with the model's
// activations) for the combined peak.
struct MemoryBook {
  Gauge params, grads, optimizer, gathered, grad_buffers, total;
  int64_t activations = 0;
  void Add(Gauge& g, int64_t b) {
    g.Add(b);
    total.Add(b);
  }
  void Sub(Gauge& g, int64_t b) {
    g.Sub(b);
    total.Sub(b);
  }
};

// A backend allocation counted in one category of the book for as long as it lives, so the
// report cannot drift from what is allocated.
class Accounted {
 public:
  Accounted() = default;
  Accounted(Buffer buffer, MemoryBook* book, Gauge* gauge)
      : buffer_(std::move(buffer)), book_(book), gauge_(gauge) {
    book_->Add(*gauge_, static_cast<int64_t>(buffer_.bytes()));
  }
  Accounted(Accounted&& o) noexcept { *this = std::move(o); }
  Accounted& operator=(Accounted&& o) noexcept {
    if (this != &o) {
      Reset();
      buffer_ = std::move(o.buffer_);
      book_ = o.book_;
      gauge_ = o.gauge_;
    }
    return *this;
  }
  ~Accounted() { Reset(); }
  void Reset() {
    if (buffer_.data() != nullptr) book_->Sub(*gauge_, static_cast<int64_t>(buffer_.bytes()));
    buffer_.Reset();
  }
  void* data() const { return buffer_.data(); }
  template <typename T>
  T* as() const { return buffer_.as<T>(); }
  size_t bytes() const { return buffer_.bytes(); }

 private:
  Buffer buffer_;
  MemoryBook* book_ = nullptr;
  Gauge* gauge_ = nullptr;
};

// Where a unit's gradient reduction stands after PostBackward.
enum class Reduction {
  kNone,          // nothing in flight (or no_sync accumulation kept locally)
  kShardGroup,    // reduce-scatter in the shard group (NO_SHARD: the all-reduce) in flight
  kReplicaGroup,  // HYBRID: the reduced shard's all-reduce across replicas in flight
};

struct Unit {
  std::string name;
  std::vector<ParamInfo> params;
  internal::FlatLayout layout;
  std::vector<TensorSlot> slots;
  std::vector<std::pair<int64_t, int64_t>> frozen;  // flat ranges without gradient
  Accounted param_shard, grad_shard;
  Accounted gathered;    // padded unit parameters in param_dtype while gathered
  Accounted cast_shard;  // the shard cast to a low param_dtype, while its all-gather runs
  Accounted full_grad;   // padded unit gradient (f32), from PreBackward until reduced
  Accounted lowp_grad;   // full_grad cast to a low reduce_dtype, while it is reduced
  Accounted reduced;     // reduce-scatter output in reduce_dtype (shard size > 1 only)
  std::unique_ptr<Optimizer> optimizer;
  UnitState state = UnitState::kIdle;
  Work gather_work;         // all-gather in flight into `gathered`
  int64_t gather_issued_ns = 0;
  bool prefetched = false;  // gathered ahead of use, not yet claimed by a Pre* hook
  bool unsynced = false;    // full_grad holds no_sync accumulation not yet reduced
  Reduction reduction = Reduction::kNone;
  Work reduce_work;
  int64_t reduce_issued_ns = 0;
};

// Records a span on the in-flight lane: from when the runtime issued `work` to when it
// completed (the collective's own spans on the comm lane show when the transport ran it).
void RecordInflight(const Work& work, std::string_view name, int64_t issued_ns,
                    const std::string& unit, bool prefetched) {
  Tracer& tracer = Tracer::Global();
  if (!tracer.enabled() || issued_ns == 0) return;
  const auto done = work.completed_at();
  Span span;
  span.name = std::string(name);
  span.stream = std::string(kInflightStream);
  span.rank = TraceRank();
  span.begin_ns = issued_ns;
  span.end_ns = done ? tracer.ToTraceNs(*done) : tracer.NowNs();
  span.args = {{"unit", unit}, {"prefetch", prefetched ? 1 : 0}};
  tracer.Record(std::move(span));
}

int64_t NowIfTracing() {
  Tracer& tracer = Tracer::Global();
  return tracer.enabled() ? tracer.NowNs() : 0;
}

}  // namespace

struct ShardingRuntime::Impl {
  Backend* backend;
  Communicator* world;
  ShardingOptions options;
  std::optional<DeviceMesh> mesh;
  MemoryBook book;  // before the units: their buffers give their bytes back to it when freed
  std::vector<Unit> units;
  std::set<std::string> param_names;
  bool finalized = false;
  bool sync_gradients = true;
  absl::Status failure;  // set once a hook failed: the runtime is then unusable
  int64_t passes_since_step = 0;
  // Unit order of the first forward and backward pass, for prefetching.
  std::vector<int> forward_order, backward_order;
  bool forward_recorded = false, backward_recorded = false;
  bool in_backward = false;
  int prefetched_units = 0;
  // Units whose gradient reduction is in flight, in the order issued: first in the shard
  // group, then (HYBRID) across replicas. Both advance strictly in order, so every rank issues
  // the replica all-reduces in the same order whatever the timing.
  std::deque<int> shard_reductions, replica_reductions;
  // Dynamic loss scaling.
  float loss_scale = 1.0f;
  int good_steps = 0;
  int64_t skipped_steps = 0;
  int64_t steps = 0;

  int S() const { return mesh->shard_size(); }
  int R() const { return mesh->replicate_size(); }
  bool reshard_after_forward() const {
    return options.strategy == ShardingStrategy::kFullShard ||
           options.strategy == ShardingStrategy::kHybridShard;
  }

  // Fails the runtime and every group, so that peers blocked in (or later entering) a
  // collective get this rank's error instead of waiting for their deadline.
  absl::Status Fail(absl::Status s) {
    if (!s.ok() && failure.ok()) {
      failure = absl::Status(s.code(), absl::StrCat("rank ", world->rank(), ": ", s.message()));
      if (mesh) {
        mesh->shard_group().Abort(failure);
        mesh->replicate_group().Abort(failure);
      }
      world->Abort(failure);
    }
    return s;
  }

  absl::Status CheckUsable(absl::string_view what) const {
    if (!failure.ok()) {
      return absl::FailedPreconditionError(absl::StrCat(
          what, ": the sharding runtime failed earlier and cannot continue: ",
          failure.message()));
    }
    if (!finalized) {
      return absl::FailedPreconditionError(
          absl::StrCat(what, ": call Finalize() after registering the units first"));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<Unit*> GetUnit(int u, absl::string_view what) {
    FSDP_RETURN_IF_ERROR(CheckUsable(what));
    if (u < 0 || u >= static_cast<int>(units.size())) {
      return absl::OutOfRangeError(absl::StrCat(what, ": unit ", u, " does not exist (",
                                                units.size(), " units registered)"));
    }
    return &units[u];
  }

  absl::Status ExpectState(const Unit& unit, absl::string_view what,
                           std::initializer_list<UnitState> allowed) const {
    for (UnitState s : allowed) {
      if (unit.state == s) return absl::OkStatus();
    }
    return absl::FailedPreconditionError(absl::StrCat(
        what, "(unit '", unit.name, "') called out of order: the unit is ",
        StateName(unit.state),
        "; each micro-batch must call PreForward, PostForward, PreBackward, PostBackward per "
        "unit, then FinishBackward"));
  }

  // Every buffer of the runtime comes from here: counted in `category` while it lives. An
  // allocation that fails names what it was for.
  absl::StatusOr<Accounted> Alloc(Gauge& category, absl::string_view what, const Unit* unit,
                                  int64_t numel, DType dtype = DType::kF32) {
    const size_t bytes = static_cast<size_t>(numel) * DTypeSize(dtype);
    absl::StatusOr<Buffer> b = Buffer::Create(backend, bytes);
    if (!b.ok()) {
      return absl::Status(b.status().code(),
                          absl::StrCat("allocating ", what,
                                       unit != nullptr ? absl::StrCat(" of unit '", unit->name, "'")
                                                       : std::string(),
                                       " (", bytes, " bytes): ", b.status().message()));
    }
    return Accounted(*std::move(b), &book, &category);
  }
  DType param_dtype() const { return options.mixed_precision.param_dtype; }
  DType reduce_dtype() const { return options.mixed_precision.reduce_dtype; }

  // f32 -> bf16/f16 and back through the backend's kernels.
  void CastDown(DType to, const float* in, void* out, int64_t n) const {
    const Ops& ops = backend->ops();
    (to == DType::kBF16 ? ops.cast_f32_to_bf16 : ops.cast_f32_to_f16)(
        static_cast<uint16_t*>(out), in, n);
  }
  void CastUp(DType from, const void* in, float* out, int64_t n) const {
    const Ops& ops = backend->ops();
    (from == DType::kBF16 ? ops.cast_bf16_to_f32 : ops.cast_f16_to_f32)(
        out, static_cast<const uint16_t*>(in), n);
  }

  // Starts the all-gather of a unit's parameters unless they are gathered or on their way.
  // In f32 with a shard group of one, the shard is the unit: nothing to gather.
  absl::Status IssueGather(Unit& unit) {
    const DType pd = param_dtype();
    if (unit.gathered.data() != nullptr || (S() == 1 && pd == DType::kF32)) {
      return absl::OkStatus();
    }
    const int64_t padded = unit.layout.padded_numel, sn = unit.layout.shard_numel;
    FSDP_ASSIGN_OR_RETURN(unit.gathered,
                          Alloc(book.gathered, "the gathered parameters", &unit, padded, pd));
    const void* send = unit.param_shard.data();
    if (pd != DType::kF32) {  // cast the fp32 master shard, then gather the low precision copy
      if (S() == 1) {
        CastDown(pd, unit.param_shard.as<const float>(), unit.gathered.data(), sn);
        return absl::OkStatus();
      }
      FSDP_ASSIGN_OR_RETURN(unit.cast_shard,
                            Alloc(book.gathered, "the low-precision shard", &unit, sn, pd));
      CastDown(pd, unit.param_shard.as<const float>(), unit.cast_shard.data(), sn);
      send = unit.cast_shard.data();
    }
    unit.gather_issued_ns = NowIfTracing();
    unit.gather_work =
        mesh->shard_group().AllGatherAsync(send, unit.gathered.data(), sn, pd);
    return absl::OkStatus();
  }

  // Makes unit `u` gathered for use now, and prefetches the units that follow it in `order`
  // (recorded in the first pass) within the rate limit. Prefetch decisions depend only on
  // the order and the units' states, so every rank issues the same collectives.
  absl::Status Acquire(int u, std::vector<int>& order, bool recording, bool prefetch) {
    Unit& unit = units[u];
    if (recording) order.push_back(u);
    const bool was_prefetched = unit.prefetched;
    if (unit.prefetched) {
      unit.prefetched = false;
      --prefetched_units;
    }
    FSDP_RETURN_IF_ERROR(IssueGather(unit));
    if (prefetch && !recording && S() > 1) {
      auto pos = std::find(order.begin(), order.end(), u);
      for (auto it = pos == order.end() ? pos : pos + 1;
           it != order.end() && prefetched_units < options.max_prefetch_units; ++it) {
        Unit& next = units[*it];
        if (next.gathered.data() != nullptr || next.state != NextState(next)) continue;
        FSDP_RETURN_IF_ERROR(IssueGather(next));
        next.prefetched = true;
        ++prefetched_units;
        break;  // one unit ahead per use; the next use prefetches the next one
      }
    }
    return WaitGather(unit, was_prefetched);
  }

  // FULL_SHARD keeps two units gathered from forward into backward, as FSDP does with the
  // root and FSDP2 recommends for the last block: the first unit of the forward order (the
  // root, which runs again at the head and starts backward) and the last one (whose backward
  // comes first). Regathering them would be exposed: nothing runs to overlap with.
  bool NeededFirstInBackward(int u) const {
    if (forward_order.empty()) return false;
    return u == forward_order.front() || (forward_recorded && u == forward_order.back());
  }

  // The state a unit is in right before the hook that the current direction calls next.
  UnitState NextState(const Unit& unit) const {
    return in_backward ? UnitState::kForwardDone : UnitState::kIdle;
  }

  absl::Status WaitGather(Unit& unit, bool prefetched) {
    if (!unit.gather_work.valid()) return absl::OkStatus();
    absl::Status s;
    if (unit.gather_work.Test()) {
      s = unit.gather_work.Wait();
    } else {  // the compute thread is blocked: exposed communication on the timeline
      TraceSpan span("all_gather", kWaitStream, {{"unit", unit.name}});
      s = unit.gather_work.Wait();
    }
    RecordInflight(unit.gather_work, "all_gather", unit.gather_issued_ns, unit.name, prefetched);
    unit.gather_work = Work();
    unit.cast_shard.Reset();
    return s;
  }

  void FreeGathered(Unit& unit) {
    if (unit.gathered.data() == nullptr) return;
    if (unit.gather_work.valid()) {  // a prefetch never used: let it land before freeing
      unit.gather_work.Wait().IgnoreError();
      unit.gather_work = Work();
    }
    unit.cast_shard.Reset();
    if (unit.prefetched) {
      unit.prefetched = false;
      --prefetched_units;
    }
    unit.gathered.Reset();
  }

  const void* GatheredParams(const Unit& unit) const {
    return unit.gathered.data() != nullptr ? unit.gathered.data() : unit.param_shard.data();
  }

  UnitView View(int u, bool with_grads) const {
    const Unit& unit = units[u];
    UnitView v;
    v.unit = u;
    v.data = GatheredParams(unit);
    v.dtype = param_dtype();
    v.params = v.dtype == DType::kF32 ? static_cast<const float*>(v.data) : nullptr;
    v.grads = with_grads ? unit.full_grad.as<float>() : nullptr;
    v.numel = unit.layout.numel;
    v.tensors = &unit.slots;
    return v;
  }

  // ---- gradient reduction: issued per unit in PostBackward, finished as it completes -------

  // Issues the unit's gradient reduction: reduce-scatter in the shard group, or (NO_SHARD)
  // the all-reduce across replicas directly; a single rank has nothing to reduce.
  absl::Status IssueReduction(Unit& unit) {
    for (auto [b, e] : unit.frozen) {
      FSDP_RETURN_IF_ERROR(backend->Memset(unit.full_grad.as<float>() + b, 0, (e - b) * 4));
    }
    const DType rd = reduce_dtype();
    const int64_t padded = unit.layout.padded_numel, sn = unit.layout.shard_numel;
    unit.unsynced = false;
    if (S() == 1 && R() == 1) return AccumulateShard(unit, unit.full_grad.as<float>());
    void* send = unit.full_grad.data();
    if (rd != DType::kF32) {  // reduce the low-precision copy; the f32 gradient is done
      FSDP_ASSIGN_OR_RETURN(unit.lowp_grad, Alloc(book.grad_buffers,
                                                  "the low-precision gradient", &unit, padded, rd));
      CastDown(rd, unit.full_grad.as<const float>(), unit.lowp_grad.data(), padded);
      unit.full_grad.Reset();
      send = unit.lowp_grad.data();
    }
    unit.reduce_issued_ns = NowIfTracing();
    if (S() > 1) {
      FSDP_ASSIGN_OR_RETURN(unit.reduced, Alloc(book.grad_buffers, "the reduce-scatter output",
                                                &unit, sn, rd));
      unit.reduce_work = mesh->shard_group().ReduceScatterAsync(send, unit.reduced.data(), sn,
                                                                rd, ReduceOp::kAvg);
    } else {
      unit.reduce_work =
          mesh->replicate_group().AllReduceAsync(send, send, padded, rd, ReduceOp::kAvg);
    }
    unit.reduction = Reduction::kShardGroup;
    shard_reductions.push_back(static_cast<int>(&unit - units.data()));
    return absl::OkStatus();
  }

  // grad_shard += the reduced shard `add` (f32), then frees every gradient buffer of the unit.
  absl::Status AccumulateShard(Unit& unit, const float* add) {
    backend->ops().residual_forward(unit.grad_shard.as<float>(), unit.grad_shard.as<float>(),
                                    add, unit.layout.shard_numel);
    unit.reduced.Reset();
    unit.lowp_grad.Reset();
    unit.full_grad.Reset();
    unit.reduction = Reduction::kNone;
    return absl::OkStatus();
  }

  // The reduced shard of the unit in reduce_dtype (the reduce-scatter output, or for NO_SHARD
  // the all-reduced buffer), widened to f32 if needed, accumulated into grad_shard.
  absl::Status FinishReduction(Unit& unit) {
    const DType rd = reduce_dtype();
    const int64_t sn = unit.layout.shard_numel;
    const Accounted& src = S() > 1 ? unit.reduced : rd == DType::kF32 ? unit.full_grad
                                                                       : unit.lowp_grad;
    if (rd == DType::kF32) return AccumulateShard(unit, src.as<const float>());
    FSDP_ASSIGN_OR_RETURN(Accounted wide,
                          Alloc(book.grad_buffers, "the widened gradient shard", &unit, sn));
    CastUp(rd, src.data(), wide.as<float>(), sn);
    return AccumulateShard(unit, wide.as<const float>());
  }

  // Waits for (or, with block false, only checks) the reduction of unit `u` in its current
  // group, records it on the timeline, and moves it on: to the replica all-reduce (HYBRID) or
  // into the gradient shard. Frees the unsharded gradient as soon as the shard group is done.
  absl::StatusOr<bool> AdvanceReduction(Unit& unit, bool block) {
    if (!block && !unit.reduce_work.Test()) return false;
    absl::Status s;
    if (unit.reduce_work.Test()) {
      s = unit.reduce_work.Wait();
    } else {
      TraceSpan span(unit.reduction == Reduction::kShardGroup ? "reduce" : "replica all_reduce",
                     kWaitStream, {{"unit", unit.name}});
      s = unit.reduce_work.Wait();
    }
    const bool shard_step = unit.reduction == Reduction::kShardGroup;
    RecordInflight(unit.reduce_work,
                   shard_step ? (S() > 1 ? "reduce_scatter" : "all_reduce") : "replica all_reduce",
                   unit.reduce_issued_ns, unit.name, false);
    unit.reduce_work = Work();
    FSDP_RETURN_IF_ERROR(s);
    if (shard_step && S() > 1) {  // the unsharded gradient is no longer read
      unit.full_grad.Reset();
      unit.lowp_grad.Reset();
      if (R() > 1) {
        unit.reduce_issued_ns = NowIfTracing();
        unit.reduce_work = mesh->replicate_group().AllReduceAsync(
            unit.reduced.data(), unit.reduced.data(), unit.layout.shard_numel, reduce_dtype(),
            ReduceOp::kAvg);
        unit.reduction = Reduction::kReplicaGroup;
        replica_reductions.push_back(static_cast<int>(&unit - units.data()));
        return true;
      }
    }
    FSDP_RETURN_IF_ERROR(FinishReduction(unit));
    return true;
  }

  // Moves the queues forward in order. Without `drain`, only what has completed, except that
  // at most max(1, max_prefetch_units) reductions stay in flight in the shard group (the
  // oldest is waited for). With the unit in backward and the root unit (open for the whole
  // backward pass) that bounds the unsharded gradients held at once by 2 + that many units.
  // With `drain`, all.
  absl::Status ProgressReductions(bool drain) {
    const size_t in_flight =
        drain ? 0 : static_cast<size_t>(std::max(1, options.max_prefetch_units));
    while (!shard_reductions.empty()) {
      const bool block = shard_reductions.size() > in_flight;
      FSDP_ASSIGN_OR_RETURN(bool moved, AdvanceReduction(units[shard_reductions.front()], block));
      if (!moved) break;
      shard_reductions.pop_front();
    }
    while (!replica_reductions.empty()) {
      FSDP_ASSIGN_OR_RETURN(bool moved, AdvanceReduction(units[replica_reductions.front()], drain));
      if (!moved) break;
      replica_reductions.pop_front();
    }
    return absl::OkStatus();
  }

  // The whole of `shard` (the unit's f32 shard on each rank of the shard group) into host
  // `out` (numel floats), through a temporary gathered buffer when the group has several ranks.
  absl::Status GatherToHost(const Unit& unit, const Accounted& shard, absl::string_view what,
                            float* out) {
    const int64_t numel = unit.layout.numel;
    if (S() == 1) return backend->CopyToHost(out, shard.data(), numel * 4);
    FSDP_ASSIGN_OR_RETURN(Accounted tmp, Alloc(book.gathered, what, &unit,
                                               unit.layout.padded_numel));
    FSDP_RETURN_IF_ERROR(mesh->shard_group().AllGather(shard.data(), tmp.data(),
                                                       unit.layout.shard_numel, DType::kF32));
    return backend->CopyToHost(out, tmp.data(), numel * 4);
  }

  // Lets every collective still in flight finish (or fail) before its buffers go.
  void QuiesceCollectives() {
    for (Unit& u : units) {
      if (u.reduce_work.valid()) u.reduce_work.Wait().IgnoreError();
      if (u.gather_work.valid()) u.gather_work.Wait().IgnoreError();
    }
  }
};

ShardingRuntime::ShardingRuntime(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ShardingRuntime::~ShardingRuntime() {
  // Collectives still in flight read our buffers: let them finish (or fail) first.
  impl_->QuiesceCollectives();
}

absl::StatusOr<std::unique_ptr<ShardingRuntime>> ShardingRuntime::Create(
    Backend* backend, Communicator& world, ShardingOptions options) {
  if (backend == nullptr) return absl::InvalidArgumentError("ShardingRuntime: backend is null");
  const int n = world.size();
  int replicate = 1, shard = n;
  switch (options.strategy) {
    case ShardingStrategy::kFullShard:
    case ShardingStrategy::kShardGradOp:
      break;
    case ShardingStrategy::kNoShard:
      replicate = n;
      shard = 1;
      break;
    case ShardingStrategy::kHybridShard:
    case ShardingStrategy::kHybridShardGradOp:
      if (options.hybrid_shard_size < 1 || n % options.hybrid_shard_size != 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            std::string(StrategyName(options.strategy)), ": hybrid_shard_size (", options.hybrid_shard_size,
            ") must be >= 1 and divide the world size (", n,
            "); it is the number of ranks in a shard group, e.g. the ranks of one host"));
      }
      shard = options.hybrid_shard_size;
      replicate = n / shard;
      break;
  }
  if (options.max_grad_norm < 0 || !std::isfinite(options.max_grad_norm)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_grad_norm must be >= 0 (0 disables clipping), got ", options.max_grad_norm));
  }
  if (options.max_prefetch_units < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_prefetch_units must be >= 0 (0 disables prefetching), got ",
        options.max_prefetch_units));
  }
  const MixedPrecision& mp = options.mixed_precision;
  if (mp.dynamic_loss_scale &&
      !(mp.initial_loss_scale > 0 && std::isfinite(mp.initial_loss_scale) &&
        mp.growth_factor >= 1 && mp.backoff_factor > 0 && mp.backoff_factor < 1 &&
        mp.growth_interval >= 1)) {
    return absl::InvalidArgumentError(
        "dynamic loss scaling needs initial_loss_scale > 0, growth_factor >= 1, "
        "0 < backoff_factor < 1 and growth_interval >= 1");
  }
  SetTraceRank(world.rank());
  auto impl = std::make_unique<Impl>();
  impl->loss_scale = mp.dynamic_loss_scale ? mp.initial_loss_scale : 1.0f;
  impl->backend = backend;
  impl->world = &world;
  impl->options = options;
  FSDP_ASSIGN_OR_RETURN(DeviceMesh mesh, DeviceMesh::Create(world, replicate, shard));
  impl->mesh.emplace(std::move(mesh));
  return std::unique_ptr<ShardingRuntime>(new ShardingRuntime(std::move(impl)));
}

absl::StatusOr<int> ShardingRuntime::RegisterUnit(std::string name,
                                                  std::vector<ParamInfo> params) {
  Impl& m = *impl_;
  auto fail = [&](absl::Status s) -> absl::Status { return m.Fail(std::move(s)); };
  if (!m.failure.ok()) return m.CheckUsable("RegisterUnit");
  if (m.finalized) {
    return fail(absl::FailedPreconditionError(absl::StrCat(
        "RegisterUnit('", name, "') after Finalize(): register every unit first")));
  }
  if (params.empty()) {
    return fail(absl::InvalidArgumentError(
        absl::StrCat("RegisterUnit('", name, "'): a unit needs at least one parameter")));
  }
  std::vector<internal::FlatTensor> tensors;
  std::set<std::string> names_here;
  for (const ParamInfo& p : params) {
    if (p.name.empty()) {
      return fail(absl::InvalidArgumentError(
          absl::StrCat("RegisterUnit('", name, "'): a parameter has an empty name")));
    }
    if (m.param_names.count(p.name) || !names_here.insert(p.name).second) {
      return fail(absl::AlreadyExistsError(absl::StrCat(
          "RegisterUnit('", name, "'): parameter '", p.name,
          "' is already registered; each parameter belongs to exactly one unit")));
    }
    int64_t numel = 1;
    for (int64_t d : p.shape) {
      if (d < 1) {
        return fail(absl::InvalidArgumentError(absl::StrCat(
            "RegisterUnit('", name, "'): parameter '", p.name, "' has shape [",
            absl::StrJoin(p.shape, ", "), "]; every dimension must be >= 1")));
      }
      numel *= d;
    }
    tensors.push_back({p.name, p.shape, numel, 0, p.requires_grad,
                       p.weight_decay.value_or(p.shape.size() >= 2)});
  }
  m.param_names.insert(names_here.begin(), names_here.end());
  Unit unit;
  unit.name = std::move(name);
  unit.params = std::move(params);
  unit.layout = internal::FlatLayout::Build(std::move(tensors), m.S());
  for (const internal::FlatTensor& t : unit.layout.tensors) {
    unit.slots.push_back({t.name, t.shape, t.offset, t.numel});
    if (!t.requires_grad) unit.frozen.emplace_back(t.offset, t.offset + t.numel);
  }
  m.units.push_back(std::move(unit));
  return static_cast<int>(m.units.size()) - 1;
}

namespace {

// The options that decide which collectives run and what the step computes: ranks that
// disagree on any of them would diverge or deadlock.
std::vector<Setting> OptionSettings(const ShardingOptions& o) {
  auto num = [](double v) { return absl::StrFormat("%.9g", v); };
  const MixedPrecision& mp = o.mixed_precision;
  std::vector<Setting> out = {
      {"strategy", std::string(StrategyName(o.strategy))},
      {"hybrid_shard_size", absl::StrCat(o.hybrid_shard_size)},
      {"forward_prefetch", absl::StrCat(o.forward_prefetch)},
      {"backward_prefetch", absl::StrCat(o.backward_prefetch)},
      {"max_prefetch_units", absl::StrCat(o.max_prefetch_units)},
      {"max_grad_norm", num(o.max_grad_norm)},
      {"param_dtype", std::string(DTypeName(mp.param_dtype))},
      {"reduce_dtype", std::string(DTypeName(mp.reduce_dtype))},
      {"dynamic_loss_scale", absl::StrCat(mp.dynamic_loss_scale)},
      {"nonfinite", o.nonfinite == NonFinitePolicy::kError ? "error" : "skip"},
  };
  if (mp.dynamic_loss_scale) {
    out.push_back({"initial_loss_scale", num(mp.initial_loss_scale)});
    out.push_back({"growth_factor", num(mp.growth_factor)});
    out.push_back({"backoff_factor", num(mp.backoff_factor)});
    out.push_back({"growth_interval", absl::StrCat(mp.growth_interval)});
  }
  if (o.optimizer == OptimizerKind::kAdamW) {
    out.push_back({"optimizer", "AdamW"});
    out.push_back({"adamw.lr", num(o.adamw.lr)});
    out.push_back({"adamw.beta1", num(o.adamw.beta1)});
    out.push_back({"adamw.beta2", num(o.adamw.beta2)});
    out.push_back({"adamw.eps", num(o.adamw.eps)});
    out.push_back({"adamw.weight_decay", num(o.adamw.weight_decay)});
  } else {
    out.push_back({"optimizer", "SGD"});
    out.push_back({"sgd.lr", num(o.sgd.lr)});
    out.push_back({"sgd.momentum", num(o.sgd.momentum)});
    out.push_back({"sgd.dampening", num(o.sgd.dampening)});
    out.push_back({"sgd.weight_decay", num(o.sgd.weight_decay)});
    out.push_back({"sgd.nesterov", absl::StrCat(o.sgd.nesterov)});
  }
  return out;
}

}  // namespace

absl::Status ShardingRuntime::Finalize(const InitFn& init) {
  Impl& m = *impl_;
  if (!m.failure.ok()) return m.CheckUsable("Finalize");
  if (m.finalized) {
    return m.Fail(absl::FailedPreconditionError("Finalize() called twice"));
  }
  if (m.units.empty()) {
    return m.Fail(absl::FailedPreconditionError("Finalize(): no unit was registered"));
  }
  // Every rank must have registered the same units: compare fingerprints across the world.
  std::vector<uint64_t> fingerprints;
  std::vector<std::string> names;
  for (const Unit& u : m.units) {
    fingerprints.push_back(u.layout.Fingerprint() ^ std::hash<std::string>{}(u.name));
    names.push_back(u.name);
  }
  FSDP_RETURN_IF_ERROR(internal::CheckUnitsAgree(*m.world, fingerprints, names));
  FSDP_RETURN_IF_ERROR(
      CheckSameSettings(*m.world, OptionSettings(m.options), "sharding options"));

  // Allocate and initialise; a failure on one rank (out of memory) fails every rank.
  auto allocate = [&]() -> absl::Status {
    const int shard_rank = m.mesh->shard_index();
    for (Unit& u : m.units) {
      const int64_t sn = u.layout.shard_numel;
      FSDP_ASSIGN_OR_RETURN(u.param_shard, m.Alloc(m.book.params, "the parameter shard", &u, sn));
      FSDP_ASSIGN_OR_RETURN(u.grad_shard, m.Alloc(m.book.grads, "the gradient shard", &u, sn));
      FSDP_RETURN_IF_ERROR(m.backend->Memset(u.grad_shard.data(), 0, sn * 4));
      // Initialise on the host and copy once, so any backend works the same way.
      std::vector<float> host(sn, 0.0f);
      for (const internal::ShardPiece& p : u.layout.Pieces(shard_rank)) {
        if (init) {
          init(static_cast<int>(&u - m.units.data()), u.params[p.tensor], p.tensor_begin,
               p.tensor_end, host.data() + p.shard_offset);
        }
      }
      FSDP_RETURN_IF_ERROR(m.backend->CopyFromHost(u.param_shard.data(), host.data(), sn * 4));
      std::vector<DecayRange> ranges = u.layout.ShardDecayRanges(shard_rank);
      absl::StatusOr<std::unique_ptr<Optimizer>> opt;
      if (m.options.optimizer == OptimizerKind::kAdamW) {
        opt = AdamW::Create(m.backend, sn, ranges, m.options.adamw);
      } else {
        opt = Sgd::Create(m.backend, sn, ranges, m.options.sgd);
      }
      if (!opt.ok()) {
        return absl::Status(opt.status().code(),
                            absl::StrCat("creating the optimizer state of unit '", u.name,
                                         "': ", opt.status().message()));
      }
      u.optimizer = *std::move(opt);
      // The optimizer owns its state buffers; count what they actually take.
      for (const OptimizerState& st : u.optimizer->state()) {
        m.book.Add(m.book.optimizer, static_cast<int64_t>(st.bytes));
      }
    }
    return absl::OkStatus();
  };
  const absl::Status local = allocate();
  const absl::Status all = AgreeOnStatus(*m.world, local);
  if (!all.ok()) return m.Fail(local.ok() ? all : local);
  m.finalized = true;
  return absl::OkStatus();
}

absl::StatusOr<UnitView> ShardingRuntime::PreForward(int u) {
  Impl& m = *impl_;
  FSDP_ASSIGN_OR_RETURN(Unit * unit, m.GetUnit(u, "PreForward"));
  absl::Status s = m.ExpectState(*unit, "PreForward", {UnitState::kIdle});
  m.in_backward = false;
  if (s.ok()) {
    s = m.Acquire(u, m.forward_order, !m.forward_recorded, m.options.forward_prefetch);
  }
  if (!s.ok()) return m.Fail(s);
  unit->state = UnitState::kForward;
  return m.View(u, false);
}

absl::Status ShardingRuntime::PostForward(int u) {
  Impl& m = *impl_;
  FSDP_ASSIGN_OR_RETURN(Unit * unit, m.GetUnit(u, "PostForward"));
  FSDP_RETURN_IF_ERROR(m.Fail(m.ExpectState(*unit, "PostForward", {UnitState::kForward})));
  if (m.reshard_after_forward() && !m.NeededFirstInBackward(u)) m.FreeGathered(*unit);
  unit->state = UnitState::kForwardDone;
  return absl::OkStatus();
}

absl::StatusOr<UnitView> ShardingRuntime::PreBackward(int u) {
  Impl& m = *impl_;
  FSDP_ASSIGN_OR_RETURN(Unit * unit, m.GetUnit(u, "PreBackward"));
  absl::Status s = m.ExpectState(*unit, "PreBackward", {UnitState::kForwardDone});
  if (!m.in_backward) {
    m.in_backward = true;
    m.forward_recorded = true;
  }
  if (s.ok()) {
    s = m.Acquire(u, m.backward_order, !m.backward_recorded, m.options.backward_prefetch);
  }
  if (s.ok() && unit->full_grad.data() == nullptr) {
    const int64_t padded = unit->layout.padded_numel;
    auto b = m.Alloc(m.book.grad_buffers, "the unsharded gradient", unit, padded);
    s = b.status();
    if (s.ok()) {
      unit->full_grad = std::move(*b);
      s = m.backend->Memset(unit->full_grad.data(), 0, padded * 4);
    }
  }
  if (!s.ok()) return m.Fail(s);
  unit->state = UnitState::kBackward;
  return m.View(u, true);
}

absl::Status ShardingRuntime::PostBackward(int u) {
  Impl& m = *impl_;
  FSDP_ASSIGN_OR_RETURN(Unit * unit, m.GetUnit(u, "PostBackward"));
  FSDP_RETURN_IF_ERROR(m.Fail(m.ExpectState(*unit, "PostBackward", {UnitState::kBackward})));
  m.FreeGathered(*unit);
  if (m.sync_gradients) {
    FSDP_RETURN_IF_ERROR(m.Fail(m.IssueReduction(*unit)));
    // Earlier units whose reduction completed give their unsharded gradients back now.
    FSDP_RETURN_IF_ERROR(m.Fail(m.ProgressReductions(false)));
  } else {
    unit->unsynced = true;
  }
  unit->state = UnitState::kBackwardDone;
  return absl::OkStatus();
}

absl::Status ShardingRuntime::FinishBackward() {
  Impl& m = *impl_;
  FSDP_RETURN_IF_ERROR(m.CheckUsable("FinishBackward"));
  for (const Unit& unit : m.units) {
    FSDP_RETURN_IF_ERROR(
        m.Fail(m.ExpectState(unit, "FinishBackward: every unit must have run PostBackward; "
                                   "PostBackward",
                             {UnitState::kBackwardDone})));
  }
  // Wait for the reductions still in flight; each lands in its gradient shard.
  FSDP_RETURN_IF_ERROR(m.Fail(m.ProgressReductions(true)));
  for (Unit& unit : m.units) {
    unit.state = UnitState::kIdle;
    m.FreeGathered(unit);  // a prefetch that no hook claimed
  }
  ++m.passes_since_step;
  m.backward_recorded = true;
  m.in_backward = false;
  return absl::OkStatus();
}

absl::Status ShardingRuntime::FinishForwardOnly() {
  Impl& m = *impl_;
  FSDP_RETURN_IF_ERROR(m.CheckUsable("FinishForwardOnly"));
  for (const Unit& unit : m.units) {
    FSDP_RETURN_IF_ERROR(m.Fail(m.ExpectState(
        unit, "FinishForwardOnly: every unit must have run PostForward; PostForward",
        {UnitState::kForwardDone})));
  }
  for (Unit& unit : m.units) {
    m.FreeGathered(unit);
    unit.state = UnitState::kIdle;
  }
  m.forward_recorded = true;
  return absl::OkStatus();
}

absl::StatusOr<StepStats> ShardingRuntime::Step(float lr) {
  Impl& m = *impl_;
  FSDP_RETURN_IF_ERROR(m.CheckUsable("Step"));
  for (const Unit& unit : m.units) {
    if (unit.state != UnitState::kIdle) {
      return m.Fail(absl::FailedPreconditionError(absl::StrCat(
          "Step(): unit '", unit.name, "' is ", StateName(unit.state),
          "; finish the backward pass (PostBackward for every unit, then FinishBackward)")));
    }
    if (unit.unsynced) {
      return m.Fail(absl::FailedPreconditionError(absl::StrCat(
          "Step(): unit '", unit.name,
          "' holds gradients accumulated with sync_gradients off that were never reduced; "
          "run the last micro-batch's backward with sync_gradients on")));
    }
  }
  if (m.passes_since_step == 0) {
    return m.Fail(absl::FailedPreconditionError(
        "Step() without a backward pass since the last step: there is no gradient"));
  }
  if (!std::isfinite(lr) || lr < 0) {
    return m.Fail(absl::InvalidArgumentError(
        absl::StrCat("Step(): the learning rate must be finite and >= 0, got ", lr)));
  }
  const Ops& ops = m.backend->ops();
  TraceSpan span("optimizer step", kComputeStream);
  StepStats stats;
  stats.lr = lr;
  // Global norm: each element of the padded flat buffers lives on exactly one rank of the
  // shard group (replicas hold equal copies), so summing over the shard group counts each
  // once. Every rank gets the same sum, so the decisions below are the same everywhere.
  double local = 0;
  std::vector<std::string> nonfinite_here;
  for (const Unit& unit : m.units) {
    const double sq =
        ops.sum_squares(unit.grad_shard.as<const float>(), unit.layout.shard_numel);
    if (!std::isfinite(sq)) nonfinite_here.push_back(unit.name);
    local += sq;
  }
  FSDP_ASSIGN_OR_RETURN(double total_sq, internal::SumAcrossRanks(m.mesh->shard_group(), local));
  // Gradients hold the sum over k backward passes of loss_scale times the mean gradient.
  const double k = static_cast<double>(m.passes_since_step) * m.loss_scale;
  if (!std::isfinite(total_sq)) {
    // Skip the step on every rank: drop the gradients, back the loss scale off. Every rank
    // decides the same (from the same global sum), so no rank waits for another.
    for (Unit& unit : m.units) {
      FSDP_RETURN_IF_ERROR(
          m.backend->Memset(unit.grad_shard.data(), 0, unit.layout.shard_numel * 4));
    }
    m.passes_since_step = 0;
    const bool scaling = m.options.mixed_precision.dynamic_loss_scale;
    if (!scaling && m.options.nonfinite == NonFinitePolicy::kError) {
      return absl::OutOfRangeError(absl::StrCat(
          "Step(): the gradients of step ", m.steps + 1, " hold inf or NaN (global norm ",
          std::sqrt(total_sq), "; ",
          nonfinite_here.empty()
              ? std::string("in other ranks' shards")
              : absl::StrCat("in rank ", m.world->rank(), "'s shard of unit(s) ",
                             absl::StrJoin(nonfinite_here, ", ")),
          "). The parameters were not updated and the gradients were dropped. Lower the "
          "learning rate, clip gradients (max_grad_norm), use dynamic loss scaling for f16, "
          "or set nonfinite = kSkip to skip such steps"));
    }
    ++m.skipped_steps;
    if (scaling) {
      m.good_steps = 0;
      m.loss_scale *= m.options.mixed_precision.backoff_factor;
    }
    stats.skipped = stats.nonfinite = true;
    stats.grad_norm = std::sqrt(total_sq) / k;
    stats.clip_coefficient = 0;
    stats.step = m.steps;
    stats.loss_scale = m.loss_scale;
    return stats;
  }
  stats.grad_norm = std::sqrt(total_sq) / k;
  stats.clip_coefficient = ClipCoefficient(stats.grad_norm, m.options.max_grad_norm);
  const float scale = static_cast<float>(stats.clip_coefficient / k);
  for (Unit& unit : m.units) {
    float* g = unit.grad_shard.as<float>();
    if (scale != 1.0f) ops.scale_inplace(g, scale, unit.layout.shard_numel);
    unit.optimizer->set_lr(lr);
    absl::Status s = unit.optimizer->Step(unit.param_shard.as<float>(), g);
    if (!s.ok()) return m.Fail(s);
    FSDP_RETURN_IF_ERROR(m.backend->Memset(g, 0, unit.layout.shard_numel * 4));
  }
  m.passes_since_step = 0;
  stats.step = ++m.steps;
  if (m.options.mixed_precision.dynamic_loss_scale &&
      ++m.good_steps >= m.options.mixed_precision.growth_interval) {
    m.loss_scale *= m.options.mixed_precision.growth_factor;
    m.good_steps = 0;
  }
  stats.loss_scale = m.loss_scale;
  return stats;
}

void ShardingRuntime::set_sync_gradients(bool sync) { impl_->sync_gradients = sync; }
bool ShardingRuntime::sync_gradients() const { return impl_->sync_gradients; }
int ShardingRuntime::num_units() const { return static_cast<int>(impl_->units.size()); }
const std::vector<TensorSlot>& ShardingRuntime::unit_tensors(int u) const {
  return impl_->units.at(u).slots;
}
int64_t ShardingRuntime::unit_numel(int u) const { return impl_->units.at(u).layout.numel; }
int64_t ShardingRuntime::unit_shard_numel(int u) const {
  return impl_->units.at(u).layout.shard_numel;
}
const float* ShardingRuntime::param_shard(int u) const {
  return impl_->units.at(u).param_shard.as<const float>();
}
float* ShardingRuntime::mutable_param_shard(int u) {
  return impl_->units.at(u).param_shard.as<float>();
}
const float* ShardingRuntime::grad_shard(int u) const {
  return impl_->units.at(u).grad_shard.as<const float>();
}
Optimizer& ShardingRuntime::optimizer(int u) { return *impl_->units.at(u).optimizer; }
ShardingStrategy ShardingRuntime::strategy() const { return impl_->options.strategy; }
Communicator& ShardingRuntime::world() const { return *impl_->world; }
Communicator& ShardingRuntime::shard_group() const { return impl_->mesh->shard_group(); }
Communicator& ShardingRuntime::replicate_group() const { return impl_->mesh->replicate_group(); }
int64_t ShardingRuntime::steps() const { return impl_->steps; }
float ShardingRuntime::loss_scale() const { return impl_->loss_scale; }
int64_t ShardingRuntime::skipped_steps() const { return impl_->skipped_steps; }
void ShardingRuntime::set_steps(int64_t steps) { impl_->steps = steps; }
ShardingRuntime::LossScaleState ShardingRuntime::loss_scale_state() const {
  return {impl_->loss_scale, impl_->good_steps, impl_->skipped_steps};
}
void ShardingRuntime::set_loss_scale_state(const LossScaleState& state) {
  impl_->loss_scale = state.scale;
  impl_->good_steps = state.good_steps;
  impl_->skipped_steps = state.skipped_steps;
}
Backend* ShardingRuntime::backend() const { return impl_->backend; }

absl::Status ShardingRuntime::GatherUnit(int u, float* out) {
  Impl& m = *impl_;
  FSDP_ASSIGN_OR_RETURN(Unit * unit, m.GetUnit(u, "GatherUnit"));
  return m.GatherToHost(*unit, unit->param_shard, "GatherUnit", out);
}

absl::Status ShardingRuntime::GatherUnitGradient(int u, float* out) {
  Impl& m = *impl_;
  FSDP_ASSIGN_OR_RETURN(Unit * unit, m.GetUnit(u, "GatherUnitGradient"));
  if (m.passes_since_step == 0) {
    return absl::FailedPreconditionError(
        "GatherUnitGradient: no backward pass since the last step, so there is no gradient; "
        "call it between FinishBackward() and Step()");
  }
  FSDP_RETURN_IF_ERROR(m.GatherToHost(*unit, unit->grad_shard, "GatherUnitGradient", out));
  const double k = static_cast<double>(m.passes_since_step) * m.loss_scale;
  for (int64_t i = 0; i < unit->layout.numel; ++i) out[i] = static_cast<float>(out[i] / k);
  return absl::OkStatus();
}

MemoryReport ShardingRuntime::memory() const {
  const MemoryBook& b = impl_->book;
  MemoryReport r;
  r.param_shard_bytes = b.params.now;
  r.grad_shard_bytes = b.grads.now;
  r.optimizer_bytes = b.optimizer.now;
  r.gathered_param_bytes = b.gathered.now;
  r.gathered_param_peak_bytes = b.gathered.peak;
  r.grad_buffer_bytes = b.grad_buffers.now;
  r.grad_buffer_peak_bytes = b.grad_buffers.peak;
  r.activation_peak_bytes = b.activations;
  r.peak_bytes = b.total.peak + b.activations;
  return r;
}

void ShardingRuntime::SetActivationBytes(int64_t bytes) {
  impl_->book.activations = std::max(impl_->book.activations, bytes);
}

void ShardingRuntime::ResetPeaks() {
  MemoryBook& b = impl_->book;
  b.gathered.peak = b.gathered.now;
  b.grad_buffers.peak = b.grad_buffers.now;
  b.total.peak = b.total.now;
}

}  // namespace fsdp
