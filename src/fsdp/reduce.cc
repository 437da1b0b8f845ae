// Gradient reductions, as the unit schedule (schedule.h) moves them on: issued per unit in
// PostBackward (reduce-scatter in the shard group, or NO_SHARD's all-reduce), moved on in issue
// order as they complete (HYBRID: the reduced shard's all-reduce across replicas), and added
// into the gradient shard on the compute stream. A unit's unsharded gradient is given back as
// soon as its reduction has read it.
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
  if (S() == 1 && R() == 1) {  // a single rank: nothing to reduce
    AccumulateShard(unit, full);
    pending.Add(std::move(unit.full_grad), {backend->Record(Stream::kCompute)});
    return false;
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
  if (S() > 1) {
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

void ShardingRuntime::Impl::AccumulateShard(Unit& unit, fsdp::View add) {
  const fsdp::View g = unit.grad_shard.view();
  ops().Add(Stream::kCompute, g, g, add.Slice(0, unit.layout.shard_numel));
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
  if (rd == DType::kF32) {
    AccumulateShard(unit, src.view());
  } else {
    FSDP_ASSIGN_OR_RETURN(wide, Alloc(book.grad_buffers, "the widened gradient shard", &unit, sn));
    ops().Cast(Stream::kCompute, wide.view(), src.view(rd).Slice(0, sn));
    AccumulateShard(unit, wide.view());
  }
  const Event done = backend->Record(Stream::kCompute);
  pending.Add(std::move(wide), {done});
  pending.Add(std::move(unit.reduced), {done});
  pending.Add(std::move(unit.lowp_grad), {done});
  pending.Add(std::move(unit.full_grad), {done});
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
  }
  if (!to_replicas) return FinishReduction(unit, stage);
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
