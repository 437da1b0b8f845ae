// ShardingRuntime: the per-unit state machine (the hooks), Finalize, the sharded optimizer
// step with global-norm clipping computed on the device, and inspection. Gathers are in
// gather.cc, reductions in reduce.cc, the unit record and memory book in unit.h.
//
// Gradients: reduce-scatter (avg) in the shard group, then all-reduce (avg) of the shard in
// the replicate group, then added into the gradient shard.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "fsdp/agreement.h"
#include "fsdp/cpu_backend.h"
#include "fsdp/plan.h"
#include "fsdp/trace.h"
#include "src/fsdp/rank_agreement.h"
#include "src/fsdp/runtime_impl.h"
#include "src/fsdp/strategy.h"

namespace fsdp {

using internal::Accounted;
using internal::Unit;
using internal::UnitState;

std::string FormatMemoryReport(const MemoryReport& m) {
  auto mib = [](int64_t b) { return static_cast<double>(b) / (1 << 20); };
  return absl::StrFormat(
      "params %.2f MiB, grads %.2f MiB, optimizer %.2f MiB (persistent %.2f MiB); gathered "
      "params now %.2f / peak %.2f MiB; grad buffers now %.2f / peak %.2f MiB; activations "
      "peak %.2f MiB%s",
      mib(m.param_shard_bytes), mib(m.grad_shard_bytes), mib(m.optimizer_bytes),
      mib(m.persistent_bytes()), mib(m.gathered_param_bytes), mib(m.gathered_param_peak_bytes),
      mib(m.grad_buffer_bytes), mib(m.grad_buffer_peak_bytes), mib(m.activation_peak_bytes),
      m.secondary_param_peak_bytes == 0
          ? ""
          : absl::StrFormat("; secondary shards now %.2f / peak %.2f MiB",
                            mib(m.secondary_param_bytes), mib(m.secondary_param_peak_bytes)));
}

// ---- Impl: errors, allocation, views ------------------------------------------------------------

absl::Status ShardingRuntime::Impl::Fail(absl::Status s) {
  if (!s.ok() && failure.ok()) {
    failure = absl::Status(s.code(), absl::StrCat("rank ", world->rank(), ": ", s.message()));
    if (shard_plane) shard_plane->Abort(failure);
    if (replicate_plane) replicate_plane->Abort(failure);
    if (mesh) {
      mesh->shard_group().Abort(failure);
      mesh->replicate_group().Abort(failure);
    }
    world->Abort(failure);
  }
  return s;
}

absl::Status ShardingRuntime::Impl::CheckUsable(absl::string_view what) const {
  if (!failure.ok()) {
    return absl::FailedPreconditionError(absl::StrCat(
        what, ": the sharding runtime failed earlier and cannot continue: ", failure.message()));
  }
  if (!finalized) {
    return absl::FailedPreconditionError(
        absl::StrCat(what, ": call Finalize() after registering the units first"));
  }
  return absl::OkStatus();
}

absl::StatusOr<Unit*> ShardingRuntime::Impl::GetUnit(int u, absl::string_view what) {
  FSDP_RETURN_IF_ERROR(CheckUsable(what));
  if (u < 0 || u >= static_cast<int>(units.size())) {
    return absl::OutOfRangeError(absl::StrCat(what, ": unit ", u, " does not exist (",
                                              units.size(), " units registered)"));
  }
  return &units[u];
}

absl::Status ShardingRuntime::Impl::ExpectState(int u, absl::string_view what,
                                                std::initializer_list<UnitState> allowed) const {
  const UnitState state = schedule->state(u);
  for (UnitState s : allowed) {
    if (state == s) return absl::OkStatus();
  }
  return absl::FailedPreconditionError(absl::StrCat(
      what, "(unit '", units[u].name, "') called out of order: the unit is ",
      internal::StateName(state),
      "; each micro-batch must call PreForward, PostForward, PreBackward, PostBackward per "
      "unit, then FinishBackward"));
}

UnitView ShardingRuntime::Impl::MakeView(int u, bool with_grads) const {
  const Unit& unit = units[u];
  UnitView v;
  v.unit = u;
  v.dtype = param_dtype();
  const Accounted& params = unit.gathered.allocated() ? unit.gathered : unit.param_shard;
  v.numel = unit.layout.numel;
  v.data_view = params.view(v.dtype).Slice(0, v.numel);
  v.data = v.data_view.host();
  v.params = v.dtype == DType::kF32 ? static_cast<const float*>(v.data) : nullptr;
  if (with_grads) {
    v.grads_view = unit.full_grad.view().Slice(0, v.numel);
    v.grads = v.grads_view.host_as<float>();
  }
  v.tensors = &unit.slots;
  return v;
}

absl::Status ShardingRuntime::Impl::GatherToHost(const Unit& unit, const Accounted& shard,
                                                 absl::string_view what, float* out) {
  const int64_t numel = unit.layout.numel;
  if (S() == 1) {
    absl::Status s = backend->CopyToHost(out, shard.view().Slice(0, numel));
    pending.Collect();
    return s;
  }
  FSDP_ASSIGN_OR_RETURN(Accounted tmp, Alloc(book.gathered, what, &unit,
                                             unit.layout.padded_numel));
  FSDP_ASSIGN_OR_RETURN(Event done, shard_plane->AllGather(shard.view(), tmp.view()));
  FSDP_RETURN_IF_ERROR(backend->Wait(Stream::kCompute, done));
  // The copy waited for the compute stream, which waited for the gather: `tmp` is free, and
  // so is whatever the device was done with before.
  absl::Status s = backend->CopyToHost(out, tmp.view().Slice(0, numel));
  pending.Collect();
  return s;
}

void ShardingRuntime::Impl::Quiesce() {
  // Collectives and device work still in flight use our buffers: let them finish (or fail)
  // before the buffers go.
  for (Unit& u : units) {
    u.reduce_event.Wait().IgnoreError();
    u.gather_event.Wait().IgnoreError();
  }
  if (backend != nullptr) backend->Synchronize().IgnoreError();
  if (offload != nullptr) offload->Drain();
  pending.Drain();
}

absl::Status ShardingRuntime::Impl::EnsureUploaded(int u) {
  if (offload == nullptr || !offload->pending(u)) return absl::OkStatus();
  // Host-held shards go up into a transient buffer where they are read (UpFromHost): here
  // only the update (and with it the optimizer state) is waited for.
  if (host_shards(u)) return Fail(offload->WaitUpdate(u));
  return Fail(offload->EnsureUploaded(u, units[u].param_shard.view()));
}

absl::StatusOr<Accounted> ShardingRuntime::Impl::UpFromHost(int u, bool grads,
                                                            internal::Gauge& category,
                                                            absl::string_view what) {
  Unit& unit = units[u];
  FSDP_ASSIGN_OR_RETURN(Accounted shard, Alloc(category, what, &unit, unit.layout.shard_numel));
  absl::Status s = grads ? offload->UploadGradient(u, shard.view())
                         : offload->UploadParams(u, shard.view());
  if (!s.ok()) return Fail(s);
  return shard;
}

// ---- creation -----------------------------------------------------------------------------------

ShardingRuntime::ShardingRuntime(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ShardingRuntime::~ShardingRuntime() { impl_->Quiesce(); }

namespace {

// ShardingOptions::offload on its own: what it needs of the backend and the optimizer.
absl::Status CheckOffloadOptions(Backend* backend, const ShardingOptions& options) {
  const OffloadOptions& o = options.offload;
  if (o.what == OffloadKind::kNone) return absl::OkStatus();
  if (backend->is_host()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "offload is ", std::string(OffloadName(o.what)), " on the ", std::string(backend->name()),
        " backend, whose device memory is the host's: there is nowhere to offload to. Offload "
        "on a device backend (cuda, sim), or set offload to none"));
  }
  if (options.optimizer != OptimizerKind::kAdamW) {
    return absl::InvalidArgumentError(absl::StrCat(
        "offload ", std::string(OffloadName(o.what)),
        " needs AdamW (the host runs the AdamW update); SGD keeps its state on the device: set "
        "offload to none or use AdamW"));
  }
  if (o.units.empty() && o.budget_bytes >= 0) {
    const int64_t host = HostPhysicalMemoryBytes();
    if (host > 0 && o.budget_bytes > host) {
      return absl::InvalidArgumentError(absl::StrCat(
          "offload.budget_bytes is ", o.budget_bytes, " bytes (", o.budget_bytes >> 20,
          " MiB), more than this host's physical memory (", host, " bytes, ", host >> 20,
          " MiB); give at most what the ranks of this host can share"));
    }
  }
  return absl::OkStatus();
}

// The checks of Create that need no other rank. The hybrid shard size 0 (a shard group per
// host) is checked once the hosts are known.
absl::Status CheckOptions(Backend* backend, const ShardingOptions& options, int world_size) {
  if (backend == nullptr) return absl::InvalidArgumentError("ShardingRuntime: backend is null");
  const bool hybrid = options.strategy == ShardingStrategy::kHybridShard ||
                      options.strategy == ShardingStrategy::kHybridShardGradOp;
  if (!hybrid || options.hybrid_shard_size != 0) {
    FSDP_RETURN_IF_ERROR(internal::StrategyMesh(options, world_size).status());
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
  for (DType d : {mp.param_dtype, mp.reduce_dtype}) {
    if (!IsFloat16Or32(d)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "mixed precision dtypes must be f32, bf16 or f16, got ", std::string(DTypeName(d))));
    }
  }
  const CommunicationOptions& c = options.communication;
  FSDP_RETURN_IF_ERROR(CheckCommunicationOptions(c));
  for (const auto& [field, format] : {std::pair{"all_gather", c.all_gather},
                                       std::pair{"reduction", c.reduction}}) {
    if (format != WireFormat::kDType && !backend->runtime_ops().supports_wire_format(format)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "communication.", field, " is ", std::string(WireFormatName(format)), ", which the ",
          std::string(backend->name()),
          " backend does not implement (the cpu, sim, cuda and pjrt backends do); use dtype"));
    }
  }
  FSDP_RETURN_IF_ERROR(CheckReductionDtype(c, mp.reduce_dtype));
  FSDP_RETURN_IF_ERROR(CheckOffloadOptions(backend, options));
  if (c.reduction != WireFormat::kDType && mp.dynamic_loss_scale) {
    return absl::InvalidArgumentError(absl::StrCat(
        "communication.reduction is ", std::string(WireFormatName(c.reduction)),
        " with dynamic loss scaling: block codes keep 8 bits below each block's largest "
        "value, so the small gradients loss scaling exists to keep round to zero; train in "
        "bf16 without loss scaling, or set the reduction to dtype"));
  }
  if (mp.dynamic_loss_scale &&
      !(mp.initial_loss_scale > 0 && std::isfinite(mp.initial_loss_scale) &&
        mp.growth_factor >= 1 && mp.backoff_factor > 0 && mp.backoff_factor < 1 &&
        mp.growth_interval >= 1)) {
    return absl::InvalidArgumentError(
        "dynamic loss scaling needs initial_loss_scale > 0, growth_factor >= 1, "
        "0 < backoff_factor < 1 and growth_interval >= 1");
  }
  return absl::OkStatus();
}

// Collective over `world`: each secondary group (N consecutive ranks of a shard group) must
// share a host, so that backward's gathers stay inside it. The same layout, so the same
// outcome, on every rank.
absl::Status CheckSecondaryHosts(Communicator& world, const ShardingOptions& options, int S) {
  FSDP_ASSIGN_OR_RETURN(HostLayout layout, DiscoverHostLayout(world));
  const int n = options.secondary_shard_size;
  for (int first = 0; first < world.size(); first += n) {  // groups of n: inside a shard group
    for (int r = first + 1; r < first + n; ++r) {
      if (layout.host_of[r] == layout.host_of[first]) continue;
      return absl::InvalidArgumentError(absl::StrCat(
          "secondary_shard_size is ", n, ": the secondary group of ranks ", first, "..",
          first + n - 1, " (of a shard group of ", S, ") spans hosts ", layout.host_of[first],
          " and ", layout.host_of[r], ", so backward's gathers would cross hosts; the ranks of '",
          world.name(), "' run as ", layout.Describe(),
          ". Set it to a divisor of the ranks each host holds (consecutive ranks: mpirun "
          "--map-by slot), or 0"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<ShardingRuntime>> ShardingRuntime::Create(
    Backend* backend, Communicator& world, ShardingOptions options) {
  // Pre-flight, before any collective of the mesh: options that are invalid on one rank, or
  // that differ between ranks, fail every rank at once with the same error (naming the rank,
  // or the option and both values), rather than leaving the others at the mesh's collectives
  // until their deadline, or building meshes of different shapes.
  FSDP_RETURN_IF_ERROR(AgreeOnStatus(world, CheckOptions(backend, options, world.size())));
  FSDP_RETURN_IF_ERROR(CheckSameSettings(world, internal::ShardingOptionSettings(options),
                                         "sharding options"));
  const bool hybrid = options.strategy == ShardingStrategy::kHybridShard ||
                      options.strategy == ShardingStrategy::kHybridShardGradOp;
  if (hybrid && options.hybrid_shard_size == 0) {  // the shard group is a host
    FSDP_ASSIGN_OR_RETURN(HostLayout layout, DiscoverHostLayout(world));
    options.hybrid_shard_size = layout.uniform_ranks_per_host();
    if (options.hybrid_shard_size == 0) {  // the same layout, so the same error, on every rank
      return absl::InvalidArgumentError(absl::StrCat(
          std::string(StrategyName(options.strategy)),
          " with hybrid_shard_size 0 makes each host a shard group, which needs every host to "
          "hold the same number of consecutive ranks; the ranks of group '", world.name(),
          "' run as ", layout.Describe(),
          ". Launch the ranks of a host one after another (mpirun --map-by slot) or set "
          "hybrid_shard_size"));
    }
  }
  FSDP_ASSIGN_OR_RETURN(internal::MeshShape shape, internal::StrategyMesh(options, world.size()));
  // The same options and the same shape on every rank: the same outcome.
  FSDP_RETURN_IF_ERROR(CheckSecondaryShard(options, shape.shard));
  if (options.secondary_shard_size > 0) {
    FSDP_RETURN_IF_ERROR(CheckSecondaryHosts(world, options, shape.shard));
  }
  SetTraceRank(world.rank());
  auto impl = std::make_unique<Impl>();
  impl->scaler.Init(options.mixed_precision);
  impl->backend = backend;
  impl->world = &world;
  impl->options = options;
  FSDP_ASSIGN_OR_RETURN(DeviceMesh mesh, DeviceMesh::Create(world, shape.replicate, shape.shard));
  impl->mesh.emplace(std::move(mesh));
  FSDP_ASSIGN_OR_RETURN(impl->shard_plane, backend->CreateDataPlane(impl->mesh->shard_group()));
  FSDP_ASSIGN_OR_RETURN(impl->replicate_plane,
                        backend->CreateDataPlane(impl->mesh->replicate_group()));
  if (const int n = options.secondary_shard_size; n > 0) {
    const int i = impl->mesh->shard_index();
    FSDP_ASSIGN_OR_RETURN(impl->secondary_group,
                          impl->mesh->shard_group().Split(i / n, i % n, "secondary"));
    FSDP_ASSIGN_OR_RETURN(impl->secondary_plane,
                          backend->CreateDataPlane(*impl->secondary_group));
  }
  if (options.offload.what != OffloadKind::kNone) {
    // The host's kernel threads, shared by the ranks of this host.
    FSDP_ASSIGN_OR_RETURN(HostLayout layout, DiscoverHostLayout(world));
    const int here = static_cast<int>(std::count(layout.host_of.begin(), layout.host_of.end(),
                                                 layout.host_of[world.rank()]));
    FSDP_ASSIGN_OR_RETURN(impl->offload,
                          internal::HostOffload::Create(backend, ThreadsPerRank(0, here)));
  }
  impl->host_syncs_at_step = backend->host_syncs();
  impl->schedule.emplace(impl.get(),
                         internal::ScheduleOptions::From(options, impl->mesh->shard_size(),
                                                         impl->mesh->replicate_size()));
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
  m.schedule->AddUnit();
  return static_cast<int>(m.units.size()) - 1;
}

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
  // (The options were compared in Create.)

  // The offloaded units: the same sizes and options, so the same choice, on every rank.
  std::vector<bool> offloaded(m.units.size(), false);
  if (m.offload != nullptr) {
    std::vector<int64_t> shard_numel;
    for (const Unit& u : m.units) shard_numel.push_back(u.layout.shard_numel);
    absl::StatusOr<std::vector<int>> chosen =
        ChooseOffloadedUnits(m.options.offload, names, shard_numel);
    if (!chosen.ok()) return m.Fail(chosen.status());
    for (int u : *chosen) offloaded[u] = true;
  }

  // Allocate and initialise; a failure on one rank (out of memory) fails every rank.
  auto allocate = [&]() -> absl::Status {
    const int shard_rank = m.mesh->shard_index();
    for (Unit& u : m.units) {
      const int index = static_cast<int>(&u - m.units.data());
      const int64_t sn = u.layout.shard_numel;
      // OffloadKind::kAll: the shards live on the host (HostOffload::AddUnit).
      const bool on_host = offloaded[index] && m.options.offload.what == OffloadKind::kAll;
      if (!on_host) {
        FSDP_ASSIGN_OR_RETURN(u.param_shard,
                              m.Alloc(m.book.params, "the parameter shard", &u, sn));
        FSDP_ASSIGN_OR_RETURN(u.grad_shard, m.Alloc(m.book.grads, "the gradient shard", &u, sn));
        FSDP_RETURN_IF_ERROR(m.backend->Memset(u.grad_shard.view(), 0));
      }
      // Initialise on the host and copy once, so any backend works the same way.
      std::vector<float> host(sn, 0.0f);
      for (const internal::ShardPiece& p : u.layout.Pieces(shard_rank)) {
        if (init) {
          init(static_cast<int>(&u - m.units.data()), u.params[p.tensor], p.tensor_begin,
               p.tensor_end, host.data() + p.shard_offset);
        }
      }
      if (!on_host) {
        FSDP_RETURN_IF_ERROR(m.backend->CopyFromHost(u.param_shard.view(), host.data()));
      }
      if (m.quantized_gather()) {
        FSDP_ASSIGN_OR_RETURN(u.quantized_shard,
                              m.Alloc(m.book.params, "the quantized parameter shard", &u,
                                      m.QuantizedChunk(u).bytes(), DType::kU8));
        // The codes' padding to 4 bytes is never written by the kernels: zero, so that the
        // wire carries defined bytes.
        FSDP_RETURN_IF_ERROR(m.backend->Memset(u.quantized_shard.view(DType::kU8), 0));
      }
      std::vector<DecayRange> ranges = u.layout.ShardDecayRanges(shard_rank);
      if (offloaded[index]) {
        absl::Status s = m.offload->AddUnit(index, sn, std::move(ranges), m.options.adamw,
                                            &u.optimizer, on_host ? host.data() : nullptr);
        if (!s.ok()) {
          return absl::Status(
              s.code(), absl::StrCat("offloading the ", on_host ? "shards and " : "",
                                     "optimizer state of unit '", u.name, "' to host memory: ",
                                     s.message()));
        }
        continue;
      }
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

// ---- hooks --------------------------------------------------------------------------------------

absl::StatusOr<UnitView> ShardingRuntime::PreForward(int u) {
  Impl& m = *impl_;
  FSDP_RETURN_IF_ERROR(m.GetUnit(u, "PreForward").status());
  absl::Status s = m.ExpectState(u, "PreForward", {UnitState::kIdle});
  if (s.ok()) s = m.EnsureUploaded(u);
  if (s.ok()) s = m.schedule->PreForward(u);
  if (!s.ok()) return m.Fail(s);
  return m.MakeView(u, false);
}

absl::Status ShardingRuntime::PostForward(int u) {
  Impl& m = *impl_;
  FSDP_RETURN_IF_ERROR(m.GetUnit(u, "PostForward").status());
  FSDP_RETURN_IF_ERROR(m.Fail(m.ExpectState(u, "PostForward", {UnitState::kForward})));
  return m.Fail(m.schedule->PostForward(u));
}

absl::StatusOr<UnitView> ShardingRuntime::PreBackward(int u) {
  Impl& m = *impl_;
  FSDP_RETURN_IF_ERROR(m.GetUnit(u, "PreBackward").status());
  absl::Status s = m.ExpectState(u, "PreBackward", {UnitState::kForwardDone});
  if (s.ok()) s = m.schedule->PreBackward(u);
  if (!s.ok()) return m.Fail(s);
  return m.MakeView(u, true);
}

absl::Status ShardingRuntime::PostBackward(int u) {
  Impl& m = *impl_;
  FSDP_RETURN_IF_ERROR(m.GetUnit(u, "PostBackward").status());
  FSDP_RETURN_IF_ERROR(m.Fail(m.ExpectState(u, "PostBackward", {UnitState::kBackward})));
  if (!m.requires_all_reduce && m.sync_gradients && m.R() > 1 && m.host_shards(u)) {
    return m.Fail(absl::FailedPreconditionError(absl::StrCat(
        "PostBackward(unit '", m.units[u].name,
        "'): set_requires_all_reduce(false) accumulates the shard-group reductions in the "
        "gradient shard on the device, which offload all keeps on the host; keep "
        "requires_all_reduce on, or offload the optimizer only")));
  }
  return m.Fail(m.schedule->PostBackward(u, m.sync_gradients, m.requires_all_reduce));
}

absl::Status ShardingRuntime::FinishBackward() {
  Impl& m = *impl_;
  FSDP_RETURN_IF_ERROR(m.CheckUsable("FinishBackward"));
  for (int u = 0; u < static_cast<int>(m.units.size()); ++u) {
    FSDP_RETURN_IF_ERROR(
        m.Fail(m.ExpectState(u, "FinishBackward: every unit must have run PostBackward; "
                                "PostBackward",
                             {UnitState::kBackwardDone})));
  }
  FSDP_RETURN_IF_ERROR(m.Fail(m.schedule->FinishBackward()));
  ++m.passes_since_step;
  return absl::OkStatus();
}

absl::Status ShardingRuntime::FinishForwardOnly() {
  Impl& m = *impl_;
  FSDP_RETURN_IF_ERROR(m.CheckUsable("FinishForwardOnly"));
  for (int u = 0; u < static_cast<int>(m.units.size()); ++u) {
    FSDP_RETURN_IF_ERROR(m.Fail(m.ExpectState(
        u, "FinishForwardOnly: every unit must have run PostForward; PostForward",
        {UnitState::kForwardDone})));
  }
  m.schedule->FinishForwardOnly();
  return absl::OkStatus();
}

// ---- the optimizer step -------------------------------------------------------------------------

absl::StatusOr<StepStats> ShardingRuntime::Step(float lr) {
  Impl& m = *impl_;
  FSDP_RETURN_IF_ERROR(m.CheckStepAllowed(lr));
  TraceSpan span("optimizer step", kComputeStream);
  StepStats stats;
  stats.lr = lr;
  // Gradients hold the sum over k backward passes of loss_scale times the mean gradient.
  const double k = static_cast<double>(m.passes_since_step) * m.scaler.scale();
  FSDP_ASSIGN_OR_RETURN(Impl::GlobalNorm norm, m.ReduceGlobalNorm(k));
  stats.grad_norm = std::sqrt(norm.total_sq) / k;
  if (!std::isfinite(norm.total_sq)) {
    FSDP_RETURN_IF_ERROR(m.SkipNonFiniteStep(std::move(norm), stats));
  } else {
    FSDP_RETURN_IF_ERROR(m.ApplyOptimizers(std::move(norm), lr, k, stats));
  }
  m.CloseStep(stats);
  return stats;
}

absl::Status ShardingRuntime::Impl::CheckAllReduced(int u, absl::string_view what) const {
  if (!schedule->replica_pending(u)) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      what, ": unit '", units[u].name,
      "' holds gradients reduced inside its shard group but not yet across the replicas "
      "(requires_all_reduce was off in every backward since the last step); run the last "
      "micro-batch's backward with set_requires_all_reduce(true)"));
}

absl::Status ShardingRuntime::Impl::CheckStepAllowed(float lr) {
  FSDP_RETURN_IF_ERROR(CheckUsable("Step"));
  for (int u = 0; u < static_cast<int>(units.size()); ++u) {
    const Unit& unit = units[u];
    if (schedule->state(u) != UnitState::kIdle) {
      return Fail(absl::FailedPreconditionError(absl::StrCat(
          "Step(): unit '", unit.name, "' is ", internal::StateName(schedule->state(u)),
          "; finish the backward pass (PostBackward for every unit, then FinishBackward)")));
    }
    if (schedule->unsynced(u)) {
      return Fail(absl::FailedPreconditionError(absl::StrCat(
          "Step(): unit '", unit.name,
          "' holds gradients accumulated with sync_gradients off that were never reduced; "
          "run the last micro-batch's backward with sync_gradients on")));
    }
    FSDP_RETURN_IF_ERROR(Fail(CheckAllReduced(u, "Step()")));
  }
  if (passes_since_step == 0) {
    return Fail(absl::FailedPreconditionError(
        "Step() without a backward pass since the last step: there is no gradient"));
  }
  if (!std::isfinite(lr) || lr < 0) {
    return Fail(absl::InvalidArgumentError(
        absl::StrCat("Step(): the learning rate must be finite and >= 0, got ", lr)));
  }
  return absl::OkStatus();
}

// Each rank sums the squares of its shards (each element of the padded flat buffers lives on
// exactly one rank of the shard group; replicas hold equal copies), the sums are gathered over
// the shard group and added in rank order. Every rank gets the same sum, so the decisions that
// follow are the same everywhere.
absl::StatusOr<ShardingRuntime::Impl::GlobalNorm> ShardingRuntime::Impl::ReduceGlobalNorm(
    double k) {
  RuntimeOps& o = ops();
  const Stream cs = Stream::kCompute;
  GlobalNorm norm;
  // Two arrays of one dtype each (a device may hold an allocation as an array of one type):
  // the f64 sums, [0] this rank's and [1] the total; and f32 elements: the S ranks' sums as
  // f32 pairs, this rank's pair, the factor.
  FSDP_ASSIGN_OR_RETURN(norm.sums, Alloc(book.grad_buffers, "the global norm's sums", nullptr, 4));
  FSDP_ASSIGN_OR_RETURN(norm.scratch, Alloc(book.grad_buffers, "the global norm's scratch",
                                            nullptr, 2 * S() + 3));
  const View sums = norm.sums.view().As(DType::kF64), scr = norm.scratch.view();
  const View local = sums.Slice(0, 1), total = sums.Slice(1, 1);
  norm.factor = scr.Slice(2 * S() + 2, 1);
  FSDP_RETURN_IF_ERROR(backend->Memset(local, 0, cs));
  for (int u = 0; u < static_cast<int>(units.size()); ++u) {
    if (!host_shards(u)) {
      o.SumSquares(cs, local, units[u].grad_shard.view());
      continue;
    }
    // The host's gradient shard through a transient device copy: the same kernel in the same
    // order as the device's shards, so the norm is bitwise what it is without offload.
    FSDP_ASSIGN_OR_RETURN(Accounted up, UpFromHost(u, true, book.grad_buffers,
                                                   "the gradient shard, up from the host"));
    o.SumSquares(cs, local, up.view());
    pending.Add(std::move(up), {backend->Record(cs)});
  }
  if (S() > 1) {
    const View mine = scr.Slice(2 * S(), 2), partials = scr.Slice(0, 2 * S());
    o.SplitF64(cs, mine, local);
    FSDP_ASSIGN_OR_RETURN(Event gathered, shard_plane->AllGather(mine, partials, cs));
    absl::Status w = StreamWait(cs, gathered, "gradient norm", "");
    if (!w.ok()) return Fail(w);
    o.GlobalNormClip(cs, total, norm.factor, partials, k, options.max_grad_norm);
  } else {
    o.GlobalNormClip(cs, total, norm.factor, local, k, options.max_grad_norm);
  }
  // The one value the host needs: whether to step at all, and the norm to report.
  absl::Status r = backend->CopyToHost(&norm.total_sq, total, cs);
  if (!r.ok()) return Fail(r);
  return norm;
}

absl::Status ShardingRuntime::Impl::SkipNonFiniteStep(GlobalNorm norm, StepStats& stats) {
  const bool scaling = scaler.enabled();
  const bool error = !scaling && options.nonfinite == NonFinitePolicy::kError;
  // Units whose local shards hold inf or NaN, for the message (a host read only then).
  std::vector<std::string> here;
  if (error) {
    for (const Unit& unit : units) {
      const int u = static_cast<int>(&unit - units.data());
      const View shard = host_shards(u) ? offload->host_grads(u) : unit.grad_shard.view();
      std::vector<float> g(shard.count);
      if (!shard.backend->CopyToHost(g.data(), shard).ok()) continue;
      if (!std::all_of(g.begin(), g.end(), [](float x) { return std::isfinite(x); })) {
        here.push_back(unit.name);
      }
    }
  }
  // Skip the step on every rank: drop the gradients, back the loss scale off.
  for (int u = 0; u < static_cast<int>(units.size()); ++u) {
    if (host_shards(u)) {
      FSDP_RETURN_IF_ERROR(Fail(offload->DropGradients(u)));
    } else {
      FSDP_RETURN_IF_ERROR(backend->Memset(units[u].grad_shard.view(), 0));
    }
    units[u].grad_shard_zero = true;
  }
  passes_since_step = 0;
  pending.Add(std::move(norm.sums), {backend->Record(Stream::kCompute)});
  pending.Add(std::move(norm.scratch), {backend->Record(Stream::kCompute)});
  if (error) {
    return absl::OutOfRangeError(absl::StrCat(
        "Step(): the gradients of step ", steps + 1, " hold inf or NaN (global norm ",
        std::sqrt(norm.total_sq), "; ",
        here.empty() ? std::string("in other ranks' shards")
                     : absl::StrCat("in rank ", world->rank(), "'s shard of unit(s) ",
                                    absl::StrJoin(here, ", ")),
        "). The parameters were not updated and the gradients were dropped. Lower the "
        "learning rate, clip gradients (max_grad_norm), use dynamic loss scaling for f16, "
        "or set nonfinite = kSkip to skip such steps"));
  }
  scaler.OnSkipped();
  stats.skipped = stats.nonfinite = true;
  stats.clip_coefficient = 0;
  stats.step = steps;
  stats.loss_scale = scaler.scale();
  return absl::OkStatus();
}

absl::Status ShardingRuntime::Impl::ApplyOptimizers(GlobalNorm norm, float lr, double k,
                                                    StepStats& stats) {
  const Stream cs = Stream::kCompute;
  stats.clip_coefficient = ClipCoefficient(stats.grad_norm, options.max_grad_norm);
  // The factor (clip coefficient / k) was computed on the device; it is 1 exactly when there
  // is no clipping and nothing to average.
  const bool scale = options.max_grad_norm > 0 || k != 1.0;
  // The offloaded units first (in forward order): their shards go to the host, whose updates
  // then run while the device updates the other units and starts the next forward; each comes
  // back before the unit's next gather (EnsureUploaded).
  // Offload all: the clip factor goes to the host once, after everything the step issued so
  // far (the norm's copies of the host gradients among it), before the host's updates.
  bool factor_issued = false;
  for (int u = 0; u < static_cast<int>(units.size()); ++u) {
    FSDP_RETURN_IF_ERROR(Fail(SettleShardRead(u)));
  }
  for (const bool host : {true, false}) {
    for (Unit& unit : units) {
      const int u = static_cast<int>(&unit - units.data());
      if ((offload != nullptr && offload->offloaded(u)) != host) continue;
      if (host_shards(u)) {
        absl::Status s;
        if (!factor_issued) s = offload->IssueFactor(norm.factor);
        factor_issued = true;
        if (s.ok()) s = offload->IssueHostUpdate(u, scale, lr);
        if (!s.ok()) return Fail(s);
        continue;
      }
      const View g = unit.grad_shard.view();
      if (scale) ops().ScaleBy(cs, g, norm.factor);
      if (host) {  // (which zeroes the gradient shard after its copy)
        absl::Status s = offload->IssueUpdate(u, unit.param_shard.view(), g, lr);
        if (!s.ok()) return Fail(s);
        unit.grad_shard_zero = true;  // (on the communication stream, before any reduction)
        continue;
      }
      unit.optimizer->set_lr(lr);
      absl::Status s = unit.optimizer->Step(unit.param_shard.view(), g);
      if (!s.ok()) return Fail(s);
      FSDP_RETURN_IF_ERROR(backend->Memset(g, 0, cs));
      unit.grad_shard_zero = true;
    }
  }
  passes_since_step = 0;
  stats.step = ++steps;
  scaler.OnGoodStep();
  stats.loss_scale = scaler.scale();
  pending.Add(std::move(norm.sums), {backend->Record(cs)});
  pending.Add(std::move(norm.scratch), {backend->Record(cs)});
  return absl::OkStatus();
}

void ShardingRuntime::Impl::CloseStep(StepStats& stats) {
  // Everything of this step is issued; what the device no longer uses is given back (the host
  // does not wait for the rest: the next step's hooks collect it).
  pending.Collect();
  const int64_t syncs = backend->host_syncs();
  stats.host_syncs = syncs - host_syncs_at_step;
  stats.throttle_waits = throttle_waits - throttle_waits_at_step;
  host_syncs_at_step = syncs;
  throttle_waits_at_step = throttle_waits;
}

// ---- inspection ---------------------------------------------------------------------------------

void ShardingRuntime::set_sync_gradients(bool sync) { impl_->sync_gradients = sync; }
bool ShardingRuntime::sync_gradients() const { return impl_->sync_gradients; }
void ShardingRuntime::set_requires_all_reduce(bool all_reduce) {
  impl_->requires_all_reduce = all_reduce;
}
bool ShardingRuntime::requires_all_reduce() const { return impl_->requires_all_reduce; }
int ShardingRuntime::num_units() const { return static_cast<int>(impl_->units.size()); }
const std::vector<TensorSlot>& ShardingRuntime::unit_tensors(int u) const {
  return impl_->units.at(u).slots;
}
int64_t ShardingRuntime::unit_numel(int u) const { return impl_->units.at(u).layout.numel; }
int64_t ShardingRuntime::unit_shard_numel(int u) const {
  return impl_->units.at(u).layout.shard_numel;
}
View ShardingRuntime::param_shard(int u) const {
  // Offload all: the host's shard, once its update is done.
  if (impl_->host_shards(u)) return impl_->offload->host_params(u);
  // An offloaded update still on the host goes back first (an error fails the runtime: the
  // next hook reports it).
  impl_->EnsureUploaded(u).IgnoreError();
  // A gather still reading the shard (a prefetch nobody waited for) is done before the caller
  // may write it from the host.
  const internal::Unit& unit = impl_->units.at(u);
  if (unit.shard_read.valid()) unit.shard_read.Wait().IgnoreError();
  return unit.param_shard.view();
}
View ShardingRuntime::grad_shard(int u) const {
  if (impl_->host_shards(u)) return impl_->offload->host_grads(u);
  impl_->EnsureUploaded(u).IgnoreError();  // (orders the compute stream after its zeroing)
  return impl_->units.at(u).grad_shard.view();
}
Optimizer& ShardingRuntime::optimizer(int u) {
  impl_->EnsureUploaded(u).IgnoreError();  // its state is final once the update is back
  return *impl_->units.at(u).optimizer;
}
std::vector<int> ShardingRuntime::offloaded_units() const {
  return impl_->offload == nullptr ? std::vector<int>() : impl_->offload->units();
}
OffloadStats ShardingRuntime::offload_stats() const {
  return impl_->offload == nullptr ? OffloadStats() : impl_->offload->stats();
}
ShardingStrategy ShardingRuntime::strategy() const { return impl_->options.strategy; }
Communicator& ShardingRuntime::world() const { return *impl_->world; }
Communicator& ShardingRuntime::shard_group() const { return impl_->mesh->shard_group(); }
Communicator& ShardingRuntime::replicate_group() const { return impl_->mesh->replicate_group(); }
DataPlane& ShardingRuntime::shard_plane() const { return *impl_->shard_plane; }
int64_t ShardingRuntime::steps() const { return impl_->steps; }
float ShardingRuntime::loss_scale() const { return impl_->scaler.scale(); }
int64_t ShardingRuntime::skipped_steps() const { return impl_->scaler.skipped_steps(); }
void ShardingRuntime::set_steps(int64_t steps) { impl_->steps = steps; }
ShardingRuntime::LossScaleState ShardingRuntime::loss_scale_state() const {
  const internal::LossScaler& s = impl_->scaler;
  return {s.scale(), s.good_steps(), s.skipped_steps()};
}
void ShardingRuntime::set_loss_scale_state(const LossScaleState& state) {
  impl_->scaler.Restore(state.scale, state.good_steps, state.skipped_steps);
}
Backend* ShardingRuntime::backend() const { return impl_->backend; }
void ShardingRuntime::set_model_description(
    std::vector<std::pair<std::string, std::string>> description) {
  impl_->model_description = std::move(description);
}
const std::vector<std::pair<std::string, std::string>>& ShardingRuntime::model_description()
    const {
  return impl_->model_description;
}

absl::Status ShardingRuntime::GatherUnit(int u, float* out) {
  Impl& m = *impl_;
  FSDP_ASSIGN_OR_RETURN(Unit * unit, m.GetUnit(u, "GatherUnit"));
  FSDP_RETURN_IF_ERROR(m.EnsureUploaded(u));
  if (m.host_shards(u)) {
    FSDP_ASSIGN_OR_RETURN(Accounted up, m.UpFromHost(u, false, m.book.gathered, "GatherUnit"));
    absl::Status s = m.GatherToHost(*unit, up, "GatherUnit", out);
    m.pending.Add(std::move(up), {m.backend->Record(Stream::kCompute)});
    return s;
  }
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
  FSDP_RETURN_IF_ERROR(m.CheckAllReduced(u, "GatherUnitGradient"));
  if (m.host_shards(u)) {
    FSDP_ASSIGN_OR_RETURN(Accounted up,
                          m.UpFromHost(u, true, m.book.grad_buffers, "GatherUnitGradient"));
    absl::Status s = m.GatherToHost(*unit, up, "GatherUnitGradient", out);
    m.pending.Add(std::move(up), {m.backend->Record(Stream::kCompute)});
    FSDP_RETURN_IF_ERROR(s);
  } else {
    FSDP_RETURN_IF_ERROR(m.GatherToHost(*unit, unit->grad_shard, "GatherUnitGradient", out));
  }
  const double k = static_cast<double>(m.passes_since_step) * m.scaler.scale();
  for (int64_t i = 0; i < unit->layout.numel; ++i) out[i] = static_cast<float>(out[i] / k);
  return absl::OkStatus();
}

MemoryReport ShardingRuntime::memory() const {
  const internal::MemoryBook& b = impl_->book;
  MemoryReport r;
  r.param_shard_bytes = b.params.now;
  r.grad_shard_bytes = b.grads.now;
  r.optimizer_bytes = b.optimizer.now;
  r.gathered_param_bytes = b.gathered.now;
  r.gathered_param_peak_bytes = b.gathered.peak;
  r.grad_buffer_bytes = b.grad_buffers.now;
  r.grad_buffer_peak_bytes = b.grad_buffers.peak;
  r.activation_peak_bytes = b.activations;
  r.secondary_param_bytes = b.secondary.now;
  r.secondary_param_peak_bytes = b.secondary.peak;
  r.peak_bytes = b.total.peak + b.activations;
  if (impl_->offload != nullptr) {
    r.host_offload_bytes = impl_->offload->host_bytes();
    r.offloaded_units = static_cast<int>(impl_->offload->units().size());
  }
  return r;
}

void ShardingRuntime::SetActivationBytes(int64_t bytes) {
  impl_->book.activations = std::max(impl_->book.activations, bytes);
}

void ShardingRuntime::ResetPeaks() {
  // What the device is done with goes back first (as every hook does), so that the peaks
  // restart from what is still in use.
  impl_->pending.Collect();
  internal::MemoryBook& b = impl_->book;
  b.gathered.peak = b.gathered.now;
  b.grad_buffers.peak = b.grad_buffers.now;
  b.secondary.peak = b.secondary.now;
  b.total.peak = b.total.now;
}

}  // namespace fsdp
