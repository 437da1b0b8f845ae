// Parameter gathers, as the unit schedule (schedule.h) asks for them: issuing a unit's
// all-gather (in f32 out of the master shard; else in place, after staging the master shard,
// cast to the param dtype, into its slot on the compute stream) within the rate limit, the
// compute stream waiting for a gather, and giving gathered parameters back once the device is
// done with them.
#include "src/fsdp/runtime_impl.h"

namespace fsdp {

using internal::Unit;

absl::Status ShardingRuntime::Impl::IssueGather(int u) {
  Unit& unit = units[u];
  const DType pd = param_dtype();
  // An offloaded unit's update comes back from the host first (in the compute stream's order,
  // before the gather's staging reads the shard).
  FSDP_RETURN_IF_ERROR(EnsureUploaded(u));
  // In f32 with a shard group of one, the shard is the unit: nothing to gather (unless the
  // shard lives on the host: then the unit is copied up into `gathered` like any other).
  if (unit.gathered.allocated() || (S() == 1 && pd == DType::kF32 && !host_shards(u))) {
    return absl::OkStatus();
  }
  const int64_t padded = unit.layout.padded_numel;
  // The rate limit (FSDP's limit_all_gathers): a host running ahead of an asynchronous device
  // waits here until at most one unit it gave back is still read by the device's queued
  // compute, so the gathered units are those in use, those kept for backward, at most
  // max_prefetch_units prefetched, and one the device is finishing with. Waiting for that
  // last one too would idle the device while the host issues the next unit. A host backend
  // never waits (its compute is done when the host gives a unit back).
  throttle_waits += pending.WaitUntilAtMost(&book.gathered, 1);
  FSDP_ASSIGN_OR_RETURN(unit.gathered,
                        Alloc(book.gathered, "the gathered parameters", &unit, padded, pd));
  if (unit.secondary.allocated()) return IssueSecondaryGather(unit);
  // Offload all: the f32 shard comes up from the host into a transient buffer, which goes back
  // once the staging below (or the quantization) has read it. (A quantized backward regathers
  // from the codes kept since forward: nothing to bring up.)
  const bool up = host_shards(u) && !(quantized_gather() && schedule->in_backward());
  if (up) {
    // (Counted with the gathered parameters: it is the gather's input in transit.)
    FSDP_ASSIGN_OR_RETURN(unit.param_shard, UpFromHost(u, false, book.gathered,
                                                       "the parameter shard, up from the host"));
  }
  const absl::Status s = StageAndGather(unit);
  if (up) pending.Add(std::move(unit.param_shard), {backend->Record(Stream::kCompute)});
  return s;
}

absl::Status ShardingRuntime::Impl::StageAndGather(Unit& unit) {
  const int u = static_cast<int>(&unit - units.data());
  const DType pd = param_dtype();
  const int64_t sn = unit.layout.shard_numel;
  if (quantized_gather()) return IssueQuantizedGather(unit);
  const fsdp::View gathered = unit.gathered.view(pd);
  const fsdp::View slot = gathered.Slice(mesh->shard_index() * sn, sn);
  const fsdp::View master = unit.param_shard.view();
  // In f32 the all-gather reads the resident master shard itself (out of place): no staging
  // copy (on a backend that launches programs, one launch fewer per gather). The shard is then
  // read on the communication stream until the compute stream has waited for the gather, which
  // SettleShardRead makes every writer of the shard do. An offloaded unit's shard is written
  // by its host update's copy: it is staged as below.
  if (pd == DType::kF32 && S() > 1 && (offload == nullptr || !offload->offloaded(u))) {
    unit.gather_issued_ns = internal::NowIfTracing();
    FSDP_ASSIGN_OR_RETURN(unit.gather_event,
                          shard_plane->AllGather(master, gathered, Stream::kCompute));
    unit.shard_read = unit.gather_event;
    return absl::OkStatus();
  }
  // In place, as NCCL defines it: the shard is staged into its own slot of the gathered
  // buffer (cast from the fp32 master on the way in a low param_dtype), and the all-gather
  // fills the other slots. Nothing copies the own chunk twice and no separate low-precision
  // shard is allocated.
  if (pd != DType::kF32) {
    ops().Cast(Stream::kCompute, slot, master);
  } else {
    FSDP_RETURN_IF_ERROR(backend->Copy(slot, master, Stream::kCompute));
  }
  if (S() == 1) return absl::OkStatus();
  unit.gather_issued_ns = internal::NowIfTracing();
  FSDP_ASSIGN_OR_RETURN(unit.gather_event,
                        shard_plane->AllGather(slot, gathered, Stream::kCompute));
  return absl::OkStatus();
}

// The quantized form of IssueGather: this rank's codes and scales (made from the f32 master
// once per forward pass; a backward's regather reuses them) go into their slot of the gathered
// codes, which the shard group all-gathers in place; WaitGather decodes them.
absl::Status ShardingRuntime::Impl::IssueQuantizedGather(Unit& unit) {
  const CommunicationOptions& c = options.communication;
  const QuantizedLayout chunk = QuantizedChunk(unit);
  const fsdp::View own = unit.quantized_shard.view(DType::kU8);
  if (!schedule->in_backward()) {
    ops().QuantizeBlocks(Stream::kCompute, own.Slice(0, chunk.code_bytes()),
                         own.Slice(chunk.code_bytes()).As(DType::kF32),
                         unit.param_shard.view(), c.block_size, c.all_gather);
  }
  FSDP_ASSIGN_OR_RETURN(unit.quantized_gathered,
                        Alloc(book.gathered, "the gathered parameter codes", &unit,
                              chunk.bytes() * S(), DType::kU8));
  const fsdp::View all = unit.quantized_gathered.view(DType::kU8);
  const fsdp::View slot = all.Slice(mesh->shard_index() * chunk.bytes(), chunk.bytes());
  FSDP_RETURN_IF_ERROR(backend->Copy(slot, own, Stream::kCompute));
  unit.gather_issued_ns = internal::NowIfTracing();
  FSDP_ASSIGN_OR_RETURN(unit.gather_event, shard_plane->AllGather(slot, all, Stream::kCompute));
  return absl::OkStatus();
}

// Backward's gather of a unit that kept a secondary shard: the shard goes into its slot of the
// gathered buffer and the secondary group (the ranks of this host) all-gathers in place. The
// values are forward's (decoded codes included), so backward computes with what forward did.
absl::Status ShardingRuntime::Impl::IssueSecondaryGather(Unit& unit) {
  const DType pd = param_dtype();
  const int64_t part = SecondaryNumel(unit);
  const fsdp::View gathered = unit.gathered.view(pd);
  const fsdp::View slot = gathered.Slice(secondary_group->rank() * part, part);
  FSDP_RETURN_IF_ERROR(backend->Copy(slot, unit.secondary.view(pd), Stream::kCompute));
  pending.Add(std::move(unit.secondary), {backend->Record(Stream::kCompute)});
  unit.gather_issued_ns = internal::NowIfTracing();
  FSDP_ASSIGN_OR_RETURN(unit.gather_event,
                        secondary_plane->AllGather(slot, gathered, Stream::kCompute));
  return absl::OkStatus();
}

absl::Status ShardingRuntime::Impl::KeepSecondary(int u) {
  Unit& unit = units[u];
  if (secondary_plane == nullptr || !unit.gathered.allocated() || unit.secondary.allocated()) {
    return absl::OkStatus();
  }
  const DType pd = param_dtype();
  const int64_t part = SecondaryNumel(unit);
  FSDP_ASSIGN_OR_RETURN(unit.secondary,
                        Alloc(book.secondary, "the secondary shard", &unit, part, pd));
  const fsdp::View from = unit.gathered.view(pd).Slice(secondary_group->rank() * part, part);
  return backend->Copy(unit.secondary.view(pd), from, Stream::kCompute);
}

void ShardingRuntime::Impl::DropSecondary(int u) {
  Unit& unit = units[u];
  if (unit.secondary.allocated()) {
    pending.Add(std::move(unit.secondary), {backend->Record(Stream::kCompute)});
  }
}

// Every rank's codes, its own included, decoded into the gathered parameters on the compute
// stream; the codes go back once decoded.
void ShardingRuntime::Impl::DecodeGathered(Unit& unit) {
  const CommunicationOptions& c = options.communication;
  const QuantizedLayout chunk = QuantizedChunk(unit);
  const fsdp::View all = unit.quantized_gathered.view(DType::kU8);
  const fsdp::View gathered = unit.gathered.view(param_dtype());
  for (int r = 0; r < S(); ++r) {
    const fsdp::View codes = all.Slice(r * chunk.bytes(), chunk.bytes());
    ops().DequantizeBlocks(Stream::kCompute, gathered.Slice(r * chunk.n, chunk.n),
                           codes.Slice(0, chunk.code_bytes()),
                           codes.Slice(chunk.code_bytes()).As(DType::kF32), c.block_size,
                           c.all_gather);
  }
  pending.Add(std::move(unit.quantized_gathered), {backend->Record(Stream::kCompute)});
}

absl::Status ShardingRuntime::Impl::WaitGather(int u, bool prefetched) {
  Unit& unit = units[u];
  if (!unit.gather_event.valid()) return absl::OkStatus();
  const absl::Status s =
      StreamWait(Stream::kCompute, unit.gather_event, "all_gather", unit.name);
  internal::RecordInflight(unit.gather_event, "all_gather", unit.gather_issued_ns, unit.name,
                           prefetched);
  unit.gather_event = Event();
  unit.shard_read = Event();  // the compute stream is after it now
  if (s.ok() && unit.quantized_gathered.allocated()) DecodeGathered(unit);
  return s;
}

absl::Status ShardingRuntime::Impl::SettleShardRead(int u) {
  Unit& unit = units[u];
  if (!unit.shard_read.valid()) return absl::OkStatus();
  const Event read = std::move(unit.shard_read);
  unit.shard_read = Event();
  // Whether or not it is done (what a backend that batches its launches does here must not
  // depend on timing). A failed gather's status is reported where the gather is waited for.
  return backend->Wait(Stream::kCompute, read);
}

void ShardingRuntime::Impl::FreeGathered(int u) {
  Unit& unit = units[u];
  if (!unit.gathered.allocated()) return;
  // Free once the gather (a prefetch nobody claimed may still be in flight) and the compute
  // that read the parameters are done.
  std::vector<Event> users = {backend->Record(Stream::kCompute)};
  if (unit.gather_event.valid()) users.push_back(unit.gather_event);
  pending.Add(std::move(unit.quantized_gathered), users);  // a prefetch never decoded
  pending.Add(std::move(unit.gathered), std::move(users));
  unit.gather_event = Event();
}

}  // namespace fsdp
