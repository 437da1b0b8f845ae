// Gradient reductions, as the unit schedule (schedule.h) moves them on: issued per unit in
// PostBackward (reduce-scatter in the shard group, or NO_SHARD's all-reduce), moved on in issue
// order as they complete (HYBRID: the reduced shard's all-reduce across replicas), and added
// into the gradient shard on the compute stream. A unit's unsharded gradient is given back as
// soon as its reduction has read it.
#include <algorithm>

#include "fsdp/trace.h"
#include "src/fsdp/runtime_impl.h"

namespace fsdp {

using internal::Reduction;
using internal::Unit;

absl::Status ShardingRuntime::Impl::PrepareGradient(int u) {
  Unit& unit = units[u];
  if (unit.full_grad.allocated()) return absl::OkStatus();  // no_sync accumulation goes on
  FSDP_ASSIGN_OR_RETURN(unit.full_grad, Alloc(book.grad_buffers, "the unsharded gradient", &unit,
                                              unit.layout.padded_numel));
  return backend->Memset(unit.full_grad.view(), 0);
}

absl::StatusOr<bool> ShardingRuntime::Impl::IssueReduction(int u) {
  Unit& unit = units[u];
  const fsdp::View full = unit.full_grad.view();
  for (auto [b, e] : unit.frozen) {
    FSDP_RETURN_IF_ERROR(backend->Memset(full.Slice(b, e - b), 0, Stream::kCompute));
  }
  const DType rd = reduce_dtype();
  const int64_t padded = unit.layout.padded_numel, sn = unit.layout.shard_numel;
  // The first f32 reduction into a gradient shard that holds nothing since the last step
  // writes the shard itself (as FSDP does when a parameter has no gradient yet): no output
  // buffer, nothing to add, one launch fewer on a backend that launches programs. Every
  // reduction after it goes through `reduced` and is added.
  const bool into_shard = unit.grad_shard_zero && S() > 1 && R() == 1 && rd == DType::kF32 &&
                          !quantized_reduce_scatter() && !host_shards(u);
  unit.grad_shard_zero = false;
  unit.reduces_into_shard = into_shard;
  if (S() == 1 && R() == 1) {  // a single rank: nothing to reduce
    FSDP_RETURN_IF_ERROR(AccumulateShard(unit, full));
    std::vector<Event> done = {backend->Record(Stream::kCompute)};
    if (unit.grad_down.valid()) done.push_back(std::move(unit.grad_down));
    unit.grad_down = Event();
    pending.Add(std::move(unit.full_grad), std::move(done));
    return false;
  }
  if (quantized_reduce_scatter()) {
    FSDP_RETURN_IF_ERROR(IssueQuantizedReduceScatter(unit));
    return true;
  }
  if (quantized_replicas()) {  // a shard group of one (NO_SHARD): the replicas' all_to_all
    unit.reduce_issued_ns = internal::NowIfTracing();
    FSDP_RETURN_IF_ERROR(IssueReplicaExchange(unit, full.Slice(0, sn), Stream::kCompute));
    pending.Add(std::move(unit.full_grad), {backend->Record(Stream::kCompute)});
    return true;
  }
  fsdp::View send = full;
  if (rd != DType::kF32) {  // reduce the low-precision copy; the f32 gradient is done
    FSDP_ASSIGN_OR_RETURN(unit.lowp_grad, Alloc(book.grad_buffers, "the low-precision gradient",
                                                &unit, padded, rd));
    send = unit.lowp_grad.view(rd);
    ops().Cast(Stream::kCompute, send, full);
    pending.Add(std::move(unit.full_grad), {backend->Record(Stream::kCompute)});
  }
  unit.reduce_issued_ns = internal::NowIfTracing();
  if (into_shard) {
    FSDP_ASSIGN_OR_RETURN(unit.reduce_event,
                          shard_plane->ReduceScatter(send, unit.grad_shard.view(),
                                                     ReduceOp::kAvg, Stream::kCompute));
  } else if (S() > 1) {
    FSDP_ASSIGN_OR_RETURN(unit.reduced, Alloc(book.grad_buffers, "the reduce-scatter output",
                                              &unit, sn, rd));
    FSDP_ASSIGN_OR_RETURN(unit.reduce_event,
                          shard_plane->ReduceScatter(send, unit.reduced.view(rd), ReduceOp::kAvg,
                                                     Stream::kCompute));
  } else {
    FSDP_ASSIGN_OR_RETURN(unit.reduce_event, replicate_plane->AllReduce(send, send, ReduceOp::kAvg,
                                                                        Stream::kCompute));
  }
  return true;
}

// Each rank's f32 gradient, quantized once: chunk d (rank d's shard) into slot d of the codes,
// which the shard group exchanges; the f32 gradient goes back once quantized.
absl::Status ShardingRuntime::Impl::IssueQuantizedReduceScatter(Unit& unit) {
  const CommunicationOptions& c = options.communication;
  const QuantizedLayout chunk = QuantizedChunk(unit);
  const int64_t sn = unit.layout.shard_numel;
  const fsdp::View full = unit.full_grad.view();
  FSDP_ASSIGN_OR_RETURN(unit.quantized_grad, Alloc(book.grad_buffers, "the gradient codes", &unit,
                                                   chunk.bytes() * S(), DType::kU8));
  const fsdp::View send = unit.quantized_grad.view(DType::kU8);
  // The kernels do not write the codes' padding to 4 bytes: the wire carries zeros there.
  if (chunk.code_bytes() != chunk.n) FSDP_RETURN_IF_ERROR(backend->Memset(send, 0));
  for (int d = 0; d < S(); ++d) {
    const fsdp::View codes = send.Slice(d * chunk.bytes(), chunk.bytes());
    ops().QuantizeBlocks(Stream::kCompute, codes.Slice(0, chunk.code_bytes()),
                         codes.Slice(chunk.code_bytes()).As(DType::kF32), full.Slice(d * sn, sn),
                         c.block_size, c.reduction);
  }
  pending.Add(std::move(unit.full_grad), {backend->Record(Stream::kCompute)});
  FSDP_ASSIGN_OR_RETURN(unit.quantized_reduced,
                        Alloc(book.grad_buffers, "the received gradient codes", &unit,
                              chunk.bytes() * S(), DType::kU8));
  unit.code_ranks = S();
  unit.reduce_issued_ns = internal::NowIfTracing();
  FSDP_ASSIGN_OR_RETURN(unit.reduce_event,
                        shard_plane->AllToAll(send, unit.quantized_reduced.view(DType::kU8),
                                              Stream::kCompute));
  return absl::OkStatus();
}

// Codes and scales of `n` elements at `slot` (a slot of a quantized reduction's buffer).
namespace {
struct SlotViews {
  fsdp::View codes, scales;
};
SlotViews Parts(const fsdp::View& slot, const QuantizedLayout& layout) {
  return {slot.Slice(0, layout.code_bytes()),
          slot.Slice(layout.code_bytes(), 4 * layout.blocks()).As(DType::kF32)};
}
}  // namespace

QuantizedLayout ShardingRuntime::Impl::ReplicaChunk(const Unit& unit, int r) const {
  const int64_t c = ReplicaChunkNumel(unit);
  const int64_t n = std::clamp<int64_t>(unit.layout.shard_numel - r * c, 0, c);
  return {n, options.communication.block_size};
}

// The replicas' first phase: `shard` (f32, shard_numel) cut into R chunks, chunk r (replica
// r's) quantized into slot r of this rank's codes, exchanged by all_to_all, on stream `s`.
absl::Status ShardingRuntime::Impl::IssueReplicaExchange(Unit& unit, fsdp::View shard,
                                                         Stream s) {
  const CommunicationOptions& c = options.communication;
  const int64_t slot = ReplicaSlotBytes(unit), chunk = ReplicaChunkNumel(unit);
  FSDP_ASSIGN_OR_RETURN(unit.quantized_grad, Alloc(book.grad_buffers, "the gradient codes", &unit,
                                                   slot * R(), DType::kU8));
  const fsdp::View send = unit.quantized_grad.view(DType::kU8);
  // A shorter last chunk and the codes' padding leave bytes of a slot unwritten: zeros.
  FSDP_RETURN_IF_ERROR(backend->Memset(send, 0, s));
  for (int r = 0; r < R(); ++r) {
    const QuantizedLayout layout = ReplicaChunk(unit, r);
    if (layout.n == 0) continue;  // a shard shorter than the replicas: nothing for replica r
    const SlotViews p = Parts(send.Slice(r * slot, slot), layout);
    ops().QuantizeBlocks(s, p.codes, p.scales, shard.Slice(r * chunk, layout.n), c.block_size,
                         c.reduction);
  }
  FSDP_ASSIGN_OR_RETURN(unit.quantized_reduced,
                        Alloc(book.grad_buffers, "the received gradient codes", &unit, slot * R(),
                              DType::kU8));
  unit.code_ranks = R();
  FSDP_ASSIGN_OR_RETURN(unit.reduce_event,
                        replicate_plane->AllToAll(send, unit.quantized_reduced.view(DType::kU8), s));
  return absl::OkStatus();
}

// The replicas' second phase, on the communication stream after their all_to_all: the mean of
// this replica's chunk from every replica's codes, re-encoded into its slot of the chunks'
// codes, all-gathered in place. Every replica then decodes the same codes: their gradient
// shards agree bit for bit.
absl::Status ShardingRuntime::Impl::IssueReplicaGather(int u) {
  Unit& unit = units[u];
  const CommunicationOptions& c = options.communication;
  internal::RecordInflight(unit.reduce_event, "replica all_to_all", unit.reduce_issued_ns,
                           unit.name, false);
  FSDP_RETURN_IF_ERROR(StreamWait(Stream::kComm, unit.reduce_event, "replica all_to_all",
                                  unit.name));
  pending.Add(std::move(unit.quantized_grad), {unit.reduce_event});
  const int me = mesh->replicate_index();
  const int64_t slot = ReplicaSlotBytes(unit);
  const QuantizedLayout mine = ReplicaChunk(unit, me);
  internal::Accounted mean;
  if (mine.n > 0) {
    FSDP_ASSIGN_OR_RETURN(mean, Alloc(book.grad_buffers, "the replicas' mean chunk", &unit,
                                      mine.n));
    FSDP_RETURN_IF_ERROR(DecodeMean(unit, mean.view(), mine, slot, Stream::kComm));
  } else {
    pending.Add(std::move(unit.quantized_reduced), {backend->Record(Stream::kComm)});
  }
  FSDP_ASSIGN_OR_RETURN(unit.quantized_reduced,
                        Alloc(book.grad_buffers, "the replicas' chunk codes", &unit, slot * R(),
                              DType::kU8));
  unit.code_ranks = R();
  unit.code_chunks = true;
  const fsdp::View all = unit.quantized_reduced.view(DType::kU8);
  const fsdp::View own = all.Slice(me * slot, slot);
  FSDP_RETURN_IF_ERROR(backend->Memset(own, 0, Stream::kComm));  // what the codes leave
  if (mine.n > 0) {
    const SlotViews p = Parts(own, mine);
    ops().QuantizeBlocks(Stream::kComm, p.codes, p.scales, mean.view(), c.block_size,
                         c.reduction);
  }
  pending.Add(std::move(mean), {backend->Record(Stream::kComm)});
  unit.reduce_issued_ns = internal::NowIfTracing();
  FSDP_ASSIGN_OR_RETURN(unit.reduce_event, replicate_plane->AllGather(own, all, Stream::kComm));
  return absl::OkStatus();
}

absl::Status ShardingRuntime::Impl::DecodeMean(Unit& unit, fsdp::View out,
                                               const QuantizedLayout& layout, int64_t stride,
                                               Stream s) {
  const CommunicationOptions& c = options.communication;
  const fsdp::View all = unit.quantized_reduced.view(DType::kU8);
  const int n = unit.code_ranks;
  internal::Accounted term;  // rank q's decoded chunk, q >= 1
  for (int q = 0; q < n; ++q) {
    if (q == 1) {
      FSDP_ASSIGN_OR_RETURN(term, Alloc(book.grad_buffers, "a decoded gradient chunk", &unit,
                                        layout.n));
    }
    const SlotViews p = Parts(all.Slice(q * stride, stride), layout);
    ops().DequantizeBlocks(s, q == 0 ? out : term.view(), p.codes, p.scales, c.block_size,
                           c.reduction);
    if (q > 0) ops().Add(s, out, out, term.view());
  }
  ops().Scale(s, out, 1.0f / static_cast<float>(n));
  const Event done = backend->Record(s);
  pending.Add(std::move(term), {done});
  pending.Add(std::move(unit.quantized_reduced), {done});
  unit.code_ranks = 0;
  return absl::OkStatus();
}

// The replicas' chunks, decoded into their places of `out` (f32, shard_numel) on the compute
// stream; the codes go back.
void ShardingRuntime::Impl::DecodeChunks(Unit& unit, fsdp::View out) {
  const CommunicationOptions& c = options.communication;
  const fsdp::View all = unit.quantized_reduced.view(DType::kU8);
  const int64_t slot = ReplicaSlotBytes(unit), chunk = ReplicaChunkNumel(unit);
  for (int r = 0; r < R(); ++r) {
    const QuantizedLayout layout = ReplicaChunk(unit, r);
    if (layout.n == 0) continue;
    const SlotViews p = Parts(all.Slice(r * slot, slot), layout);
    ops().DequantizeBlocks(Stream::kCompute, out.Slice(r * chunk, layout.n), p.codes, p.scales,
                           c.block_size, c.reduction);
  }
  pending.Add(std::move(unit.quantized_reduced), {backend->Record(Stream::kCompute)});
  unit.code_ranks = 0;
  unit.code_chunks = false;
}

absl::Status ShardingRuntime::Impl::WaitReduction(int u) {
  Unit& unit = units[u];
  TraceSpan span(schedule->reduction(u) == Reduction::kShardGroup ? "reduce"
                                                                   : "replica all_reduce",
                 kWaitStream, {{"unit", unit.name}});
  unit.reduce_event.Wait().IgnoreError();  // its status is read when it is moved on
  ++throttle_waits;
  return absl::OkStatus();
}

absl::Status ShardingRuntime::Impl::ReductionStatus(int u) {
  Event& e = units[u].reduce_event;
  return e.Done() ? e.Wait() : absl::OkStatus();
}

absl::Status ShardingRuntime::Impl::AccumulateShard(Unit& unit, fsdp::View add) {
  const int u = static_cast<int>(&unit - units.data());
  if (host_shards(u)) {
    // Offload all: down to the host, which adds it into its gradient shard (the same kernel).
    FSDP_ASSIGN_OR_RETURN(unit.grad_down,
                          offload->IssueGradientDown(u, add.Slice(0, unit.layout.shard_numel)));
    return absl::OkStatus();
  }
  const fsdp::View g = unit.grad_shard.view();
  ops().Add(Stream::kCompute, g, g, add.Slice(0, unit.layout.shard_numel));
  return absl::OkStatus();
}

// The reduced shard of the unit in reduce_dtype (the reduce-scatter output, or for NO_SHARD
// the all-reduced buffer), widened to f32 if needed, added into grad_shard once the compute
// stream has waited for the reduction; then every gradient buffer of the unit goes back.
absl::Status ShardingRuntime::Impl::FinishReduction(Unit& unit, Reduction stage) {
  FSDP_RETURN_IF_ERROR(StreamWait(Stream::kCompute, unit.reduce_event,
                                  stage == Reduction::kShardGroup ? "reduce"
                                                                  : "replica all_reduce",
                                  unit.name));
  const DType rd = reduce_dtype();
  const int64_t sn = unit.layout.shard_numel;
  const internal::Accounted& src = S() > 1 ? unit.reduced
                                   : rd == DType::kF32 ? unit.full_grad
                                                       : unit.lowp_grad;
  internal::Accounted wide;
  if (unit.quantized_reduced.allocated()) {  // codes: the replicas' chunks, or their mean
    FSDP_ASSIGN_OR_RETURN(wide, Alloc(book.grad_buffers, "the decoded gradient shard", &unit, sn));
    if (unit.code_chunks) {
      DecodeChunks(unit, wide.view());
    } else {
      const QuantizedLayout layout = QuantizedChunk(unit);
      FSDP_RETURN_IF_ERROR(DecodeMean(unit, wide.view(), layout, layout.bytes(), Stream::kCompute));
    }
    FSDP_RETURN_IF_ERROR(Fail(AccumulateShard(unit, wide.view())));
  } else if (unit.reduces_into_shard) {
    unit.reduces_into_shard = false;  // the reduce-scatter wrote grad_shard
  } else if (rd == DType::kF32) {
    FSDP_RETURN_IF_ERROR(Fail(AccumulateShard(unit, src.view())));
  } else {
    FSDP_ASSIGN_OR_RETURN(wide, Alloc(book.grad_buffers, "the widened gradient shard", &unit, sn));
    ops().Cast(Stream::kCompute, wide.view(), src.view(rd).Slice(0, sn));
    FSDP_RETURN_IF_ERROR(Fail(AccumulateShard(unit, wide.view())));
  }
  // (Offload all: the copy to the host reads the shard on the communication stream too.)
  std::vector<Event> done = {backend->Record(Stream::kCompute)};
  if (unit.grad_down.valid()) done.push_back(std::move(unit.grad_down));
  unit.grad_down = Event();
  pending.Add(std::move(wide), done);
  pending.Add(std::move(unit.reduced), done);
  pending.Add(std::move(unit.lowp_grad), done);
  pending.Add(std::move(unit.full_grad), done);
  unit.reduce_event = Event();
  return absl::OkStatus();
}

// The earlier micro-batches' shard-group reductions, which the gradient shard holds in f32,
// join this one in `reduced` before its all-reduce across replicas, and the gradient shard
// starts again from zero: the all-reduce then carries the sum of every micro-batch since the
// last step, rounded once to reduce_dtype. On the compute stream, after the reduce-scatter;
// the communication stream waits for it.
absl::Status ShardingRuntime::Impl::FoldAccumulatedShard(Unit& unit) {
  FSDP_RETURN_IF_ERROR(StreamWait(Stream::kCompute, unit.reduce_event, "reduce", unit.name));
  const DType rd = reduce_dtype();
  const int64_t sn = unit.layout.shard_numel;
  const fsdp::View g = unit.grad_shard.view();
  const fsdp::View reduced = unit.reduced.view(rd).Slice(0, sn);
  internal::Accounted wide;
  if (rd == DType::kF32) {
    ops().Add(Stream::kCompute, reduced, reduced, g);
  } else {
    FSDP_ASSIGN_OR_RETURN(wide, Alloc(book.grad_buffers, "the widened gradient shard", &unit, sn));
    ops().Cast(Stream::kCompute, wide.view(), reduced);
    ops().Add(Stream::kCompute, wide.view(), wide.view(), g);
    ops().Cast(Stream::kCompute, reduced, wide.view());
  }
  FSDP_RETURN_IF_ERROR(backend->Memset(g, 0, Stream::kCompute));
  unit.grad_shard_zero = true;
  const Event folded = backend->Record(Stream::kCompute);
  pending.Add(std::move(wide), {folded});
  return backend->Wait(Stream::kComm, folded);
}

// The reduction of the unit in its current group has been issued; move it on (the events
// order the work, the host does not wait here): to the replica all-reduce (HYBRID) or into the
// gradient shard. The unsharded gradient goes back as soon as the shard group is done with it.
absl::Status ShardingRuntime::Impl::AdvanceReduction(int u, Reduction stage, bool to_replicas,
                                                     bool with_accumulated) {
  Unit& unit = units[u];
  const bool shard_step = stage == Reduction::kShardGroup;
  internal::RecordInflight(unit.reduce_event,
                           shard_step ? (S() > 1 ? "reduce_scatter" : "all_reduce")
                                      : "replica all_reduce",
                           unit.reduce_issued_ns, unit.name, false);
  if (shard_step && S() > 1) {
    pending.Add(std::move(unit.full_grad), {unit.reduce_event});
    pending.Add(std::move(unit.lowp_grad), {unit.reduce_event});
    pending.Add(std::move(unit.quantized_grad), {unit.reduce_event});
  }
  if (!to_replicas) return FinishReduction(unit, stage);
  if (quantized_reduce_scatter()) {
    // The shard group's codes decoded (with the earlier micro-batches' shard added), then the
    // replicas' codes of the result: on the communication stream, after the all_to_all, so
    // that a device's compute stream goes on with the next unit's backward meanwhile. (The
    // gradient shard was last written on the compute stream, which the replica stage's end
    // waits for before it adds into it again.)
    FSDP_RETURN_IF_ERROR(StreamWait(Stream::kComm, unit.reduce_event, "reduce", unit.name));
    if (with_accumulated) {
      FSDP_RETURN_IF_ERROR(backend->Wait(Stream::kComm, backend->Record(Stream::kCompute)));
    }
    FSDP_ASSIGN_OR_RETURN(unit.reduced, Alloc(book.grad_buffers, "the reduce-scatter output",
                                              &unit, unit.layout.shard_numel));
    const fsdp::View reduced = unit.reduced.view();
    const QuantizedLayout layout = QuantizedChunk(unit);
    FSDP_RETURN_IF_ERROR(DecodeMean(unit, reduced, layout, layout.bytes(), Stream::kComm));
    if (with_accumulated) {
      const fsdp::View g = unit.grad_shard.view();
      ops().Add(Stream::kComm, reduced, reduced, g);
      FSDP_RETURN_IF_ERROR(backend->Memset(g, 0, Stream::kComm));
    }
    unit.reduce_issued_ns = internal::NowIfTracing();
    FSDP_RETURN_IF_ERROR(IssueReplicaExchange(unit, reduced, Stream::kComm));
    pending.Add(std::move(unit.reduced), {backend->Record(Stream::kComm)});
    return absl::OkStatus();
  }
  if (with_accumulated) {
    FSDP_RETURN_IF_ERROR(FoldAccumulatedShard(unit));
  } else {
    // The replicas all-reduce the reduced shard once the reduce-scatter wrote it.
    FSDP_RETURN_IF_ERROR(StreamWait(Stream::kComm, unit.reduce_event, "reduce", unit.name));
  }
  unit.reduce_issued_ns = internal::NowIfTracing();
  const fsdp::View shard = unit.reduced.view(reduce_dtype());
  FSDP_ASSIGN_OR_RETURN(unit.reduce_event,
                        replicate_plane->AllReduce(shard, shard, ReduceOp::kAvg, Stream::kComm));
  return absl::OkStatus();
}

}  // namespace fsdp
