// The transport-independent part of the Communicator: names, argument checks, the public
// entry points (all of which go through Enqueue -> Submit), Work handles and deadlines.
#include "fsdp/communicator.h"

#include <algorithm>
#include <cstdlib>
#include <limits>

#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "collectives/work_state.h"

namespace fsdp {

absl::StatusOr<absl::Duration> ParseCommTimeoutSeconds(std::string_view text) {
  double seconds = 0;
  if (!absl::SimpleAtod(absl::string_view(text.data(), text.size()), &seconds) ||
      !(seconds > 0 && seconds < 1e9)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "FSDP_COMM_TIMEOUT_S='%s' is not a valid timeout: give a number of seconds greater "
        "than 0 and below 1e9, without a unit (e.g. 30 or 2.5); unset, it is 60",
        std::string(text)));
  }
  return absl::Seconds(seconds);
}

absl::StatusOr<absl::Duration> CommTimeoutFromEnv() {
  const char* env = std::getenv("FSDP_COMM_TIMEOUT_S");
  if (env == nullptr || *env == '\0') return absl::Seconds(60);
  return ParseCommTimeoutSeconds(env);
}

absl::StatusOr<bool> MpiSharedMemoryFromEnv() {
  const char* env = std::getenv("FSDP_MPI_SHM");
  if (env == nullptr || *env == '\0') return true;
  const std::string_view v(env);
  if (v == "0" || v == "1") return v == "1";
  return absl::InvalidArgumentError(absl::StrFormat(
      "FSDP_MPI_SHM='%s' is not valid: give 0 (Open MPI's collectives inside a host) or 1 "
      "(shared memory inside a host, the default)",
      v));
}

absl::Duration DefaultCommTimeout() {
  const absl::StatusOr<absl::Duration> t = CommTimeoutFromEnv();
  return t.ok() ? *t : absl::Seconds(60);
}

absl::Status ScheduleMismatch(int64_t seq, std::string_view group,
                              const std::vector<std::string>& calls, std::string_view where) {
  std::vector<std::pair<std::string, std::vector<int>>> distinct;  // in order of first rank
  for (int q = 0; q < static_cast<int>(calls.size()); ++q) {
    auto it = std::find_if(distinct.begin(), distinct.end(),
                           [&](const auto& c) { return c.first == calls[q]; });
    if (it == distinct.end()) {
      distinct.push_back({calls[q], {q}});
    } else {
      it->second.push_back(q);
    }
  }
  std::vector<std::string> parts;
  for (const auto& [d, ranks] : distinct) {
    parts.push_back(absl::StrFormat("ranks [%s] called %s", absl::StrJoin(ranks, ", "), d));
  }
  return absl::FailedPreconditionError(absl::StrFormat(
      "schedule mismatch at sequence %d of group '%s'%s: %s; every rank must issue the same "
      "collectives in the same order; the group failed",
      seq, std::string(group), std::string(where), absl::StrJoin(parts, "; ")));
}

std::string DescribeCall(const CollectiveCall& c) {
  switch (c.kind) {
    case CollectiveKind::kAllGather:
    case CollectiveKind::kAllToAll:
      return absl::StrFormat("%s(count=%d, %s)", CollectiveName(c.kind), c.count,
                             DTypeName(c.dtype));
    case CollectiveKind::kReduceScatter:
    case CollectiveKind::kAllReduce:
      return absl::StrFormat("%s(count=%d, %s, %s)", CollectiveName(c.kind), c.count,
                             DTypeName(c.dtype), ReduceOpName(c.op));
    case CollectiveKind::kBroadcast:
      return absl::StrFormat("broadcast(count=%d, %s, root=%d)", c.count, DTypeName(c.dtype),
                             c.root);
    case CollectiveKind::kBarrier: return "barrier()";
    case CollectiveKind::kSplit: return "split()";
  }
  return "?";
}

namespace {

bool Overlap(const void* a, size_t a_bytes, const void* b, size_t b_bytes) {
  const auto x = reinterpret_cast<uintptr_t>(a), y = reinterpret_cast<uintptr_t>(b);
  return a_bytes > 0 && b_bytes > 0 && x < y + b_bytes && y < x + a_bytes;
}

}  // namespace

absl::Status ValidateCall(const CollectiveCall& c, int rank, int size) {
  const std::string what = DescribeCall(c);
  auto bad = [&](std::string_view why) {
    return absl::InvalidArgumentError(absl::StrFormat("%s on rank %d: %s", what, rank, why));
  };
  if (static_cast<unsigned>(c.dtype) > static_cast<unsigned>(DType::kU8)) {
    return bad(absl::StrFormat("unknown dtype %d", static_cast<int>(c.dtype)));
  }
  const bool reduces = c.kind == CollectiveKind::kAllReduce ||
                       c.kind == CollectiveKind::kReduceScatter;
  if (reduces && static_cast<unsigned>(c.dtype) > static_cast<unsigned>(DType::kF16)) {
    return bad("reductions take f32, bf16 or f16; all_gather and broadcast move any dtype");
  }
  if (static_cast<unsigned>(c.op) > static_cast<unsigned>(ReduceOp::kMax)) {
    return bad(absl::StrFormat("unknown reduce op %d", static_cast<int>(c.op)));
  }
  if (c.kind == CollectiveKind::kBarrier || c.kind == CollectiveKind::kSplit) return absl::OkStatus();
  const bool per_rank = c.kind == CollectiveKind::kAllGather ||
                        c.kind == CollectiveKind::kReduceScatter ||
                        c.kind == CollectiveKind::kAllToAll;
  if (c.count < 0) {
    return bad(absl::StrFormat("%s must be >= 0, got %d", per_rank ? "count_per_rank" : "count",
                               c.count));
  }
  const int64_t esize = static_cast<int64_t>(DTypeSize(c.dtype));
  if (c.count > std::numeric_limits<int64_t>::max() / 8 / size) {
    return bad(absl::StrFormat("count %d is too large", c.count));
  }
  if (c.kind == CollectiveKind::kBroadcast) {
    if (c.root < 0 || c.root >= size) {
      return bad(absl::StrFormat("root %d is not a rank of a group of size %d", c.root, size));
    }
    if (c.count > 0 && c.recv == nullptr) return bad("buffer is null");
    return absl::OkStatus();
  }
  if (c.count == 0) return absl::OkStatus();
  if (c.send == nullptr) return bad("send buffer is null");
  if (c.recv == nullptr) return bad("recv buffer is null");
  const size_t chunk = static_cast<size_t>(c.count * esize);
  const size_t whole = chunk * static_cast<size_t>(size);
  switch (c.kind) {
    case CollectiveKind::kAllGather: {
      const void* in_place = static_cast<const char*>(c.recv) + chunk * rank;
      if (c.send != in_place && Overlap(c.send, chunk, c.recv, whole)) {
        return bad("send overlaps recv but is not at the in-place position recv + rank * count_per_rank");
      }
      break;
    }
    case CollectiveKind::kReduceScatter: {
      const void* in_place = static_cast<const char*>(c.send) + chunk * rank;
      if (c.recv != in_place && Overlap(c.send, whole, c.recv, chunk)) {
        return bad("recv overlaps send but is not at the in-place position send + rank * count_per_rank");
      }
      break;
    }
    case CollectiveKind::kAllReduce:
      if (c.send != c.recv && Overlap(c.send, chunk, c.recv, chunk)) {
        return bad("send and recv overlap without being the same buffer (in-place)");
      }
      break;
    case CollectiveKind::kAllToAll:
      if (Overlap(c.send, whole, c.recv, whole)) {
        return bad("send and recv overlap; all_to_all is not in place: give it separate buffers");
      }
      break;
    default: break;
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------- Work

namespace internal {

void WorkState::Complete(absl::Status status) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (done_.load(std::memory_order_relaxed)) return;
    status_ = Detach(status);
    completed_at_.store(std::chrono::steady_clock::now().time_since_epoch().count(),
                        std::memory_order_release);
    done_.store(true, std::memory_order_release);
  }
  cv_.notify_all();
}

absl::Status WorkState::Wait(absl::Duration timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  const auto until = std::chrono::steady_clock::now() +
                     absl::ToChronoNanoseconds(std::max(timeout, absl::ZeroDuration()));
  if (cv_.wait_until(lock, until, [&] { return done_.load(std::memory_order_relaxed); })) {
    return Detach(status_);
  }
  lock.unlock();
  // The deadline passed. The transport fails the group so that the collective stops waiting
  // for its peers and completes with an error naming who is missing; only then may the
  // caller reuse its buffers, so wait for that completion (it comes promptly).
  if (on_expire_) {
    on_expire_(timeout);
  } else {
    Complete(absl::DeadlineExceededError(absl::StrFormat(
        "%s did not complete within %s", description_, absl::FormatDuration(timeout))));
  }
  lock.lock();
  cv_.wait(lock, [&] { return done_.load(std::memory_order_relaxed); });
  return Detach(status_);
}

std::shared_ptr<WorkState> CompletedWork(std::string description, absl::Status status) {
  auto w = std::make_shared<WorkState>(std::move(description), absl::ZeroDuration());
  w->Complete(std::move(status));
  return w;
}

}  // namespace internal

Work::Work(std::shared_ptr<internal::WorkState> state) : state_(std::move(state)) {}

absl::Status Work::Wait() const {
  if (!state_) return absl::FailedPreconditionError("Wait on an empty Work handle");
  return state_->Wait(state_->default_timeout());
}

absl::Status Work::Wait(absl::Duration timeout) const {
  if (!state_) return absl::FailedPreconditionError("Wait on an empty Work handle");
  return state_->Wait(timeout);
}

bool Work::Test() const { return !state_ || state_->done(); }

std::optional<std::chrono::steady_clock::time_point> Work::completed_at() const {
  if (!state_ || !state_->done()) return std::nullopt;
  return state_->completed_at();
}

std::string Work::description() const { return state_ ? state_->description() : "(empty Work)"; }

absl::Status WaitAll(std::span<const Work> works) {
  absl::Status first;
  for (const Work& w : works) {
    absl::Status s = w.Wait();
    if (first.ok() && !s.ok()) first = std::move(s);
  }
  return first;
}

// -------------------------------------------------------------------------- Communicator

std::string Communicator::description() const {
  return absl::StrFormat("%s group '%s' rank %d of %d", backend(), name(), rank(), size());
}

Work Communicator::Enqueue(const CollectiveCall& call, absl::Status extra_check) {
  issued_[static_cast<size_t>(call.kind)].fetch_add(1, std::memory_order_relaxed);
  absl::Status invalid = ValidateCall(call, rank(), size());
  if (invalid.ok()) invalid = std::move(extra_check);
  return Submit(call, std::move(invalid));
}

Work Communicator::AllGatherAsync(const void* send, void* recv, int64_t count_per_rank,
                                  DType dtype) {
  return Enqueue({.kind = CollectiveKind::kAllGather, .send = send, .recv = recv,
                  .count = count_per_rank, .dtype = dtype});
}

Work Communicator::ReduceScatterAsync(const void* send, void* recv, int64_t count_per_rank,
                                      DType dtype, ReduceOp op) {
  return Enqueue({.kind = CollectiveKind::kReduceScatter, .send = send, .recv = recv,
                  .count = count_per_rank, .dtype = dtype, .op = op});
}

Work Communicator::AllReduceAsync(const void* send, void* recv, int64_t count, DType dtype,
                                  ReduceOp op) {
  return Enqueue({.kind = CollectiveKind::kAllReduce, .send = send, .recv = recv,
                  .count = count, .dtype = dtype, .op = op});
}

Work Communicator::BroadcastAsync(void* buf, int64_t count, DType dtype, int root) {
  return Enqueue({.kind = CollectiveKind::kBroadcast, .send = buf, .recv = buf,
                  .count = count, .dtype = dtype, .root = root});
}

Work Communicator::BarrierAsync() { return Enqueue({.kind = CollectiveKind::kBarrier}); }

Work Communicator::AllToAllAsync(const void* send, void* recv, int64_t count_per_rank,
                                 DType dtype) {
  return Enqueue({.kind = CollectiveKind::kAllToAll, .send = send, .recv = recv,
                  .count = count_per_rank, .dtype = dtype});
}

namespace {

absl::Status SameDtype(std::string_view op, ConstBufferView send, ConstBufferView recv) {
  if (send.dtype == recv.dtype) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrFormat("%s: send is %s but recv is %s", op,
                                                    DTypeName(send.dtype), DTypeName(recv.dtype)));
}

}  // namespace

Work Communicator::AllGatherAsync(ConstBufferView send, BufferView recv) {
  absl::Status check = SameDtype("all_gather", send, recv);
  if (check.ok() && recv.count != send.count * size()) {
    check = absl::InvalidArgumentError(absl::StrFormat(
        "all_gather: recv holds %d elements but must hold group size %d x send %d = %d",
        recv.count, size(), send.count, send.count * size()));
  }
  return Enqueue({.kind = CollectiveKind::kAllGather, .send = send.data, .recv = recv.data,
                  .count = send.count, .dtype = send.dtype},
                 std::move(check));
}

Work Communicator::ReduceScatterAsync(ConstBufferView send, BufferView recv, ReduceOp op) {
  absl::Status check = SameDtype("reduce_scatter", send, recv);
  if (check.ok() && send.count % size() != 0) {
    check = absl::InvalidArgumentError(absl::StrFormat(
        "reduce_scatter: send holds %d elements, not a multiple of the group size %d; the "
        "caller pads it to %d (PaddedCount)",
        send.count, size(), PaddedCount(send.count, size())));
  } else if (check.ok() && recv.count * size() != send.count) {
    check = absl::InvalidArgumentError(absl::StrFormat(
        "reduce_scatter: recv holds %d elements but must hold send %d / group size %d = %d",
        recv.count, send.count, size(), send.count / size()));
  }
  return Enqueue({.kind = CollectiveKind::kReduceScatter, .send = send.data, .recv = recv.data,
                  .count = send.count / size(), .dtype = send.dtype, .op = op},
                 std::move(check));
}

Work Communicator::AllReduceAsync(ConstBufferView send, BufferView recv, ReduceOp op) {
  absl::Status check = SameDtype("all_reduce", send, recv);
  if (check.ok() && recv.count != send.count) {
    check = absl::InvalidArgumentError(absl::StrFormat(
        "all_reduce: send holds %d elements but recv holds %d", send.count, recv.count));
  }
  return Enqueue({.kind = CollectiveKind::kAllReduce, .send = send.data, .recv = recv.data,
                  .count = send.count, .dtype = send.dtype, .op = op},
                 std::move(check));
}

Work Communicator::AllToAllAsync(ConstBufferView send, BufferView recv) {
  absl::Status check = SameDtype("all_to_all", send, recv);
  if (check.ok() && send.count % size() != 0) {
    check = absl::InvalidArgumentError(absl::StrFormat(
        "all_to_all: send holds %d elements, not a multiple of the group size %d (one equal "
        "chunk per rank); the caller pads it to %d (PaddedCount)",
        send.count, size(), PaddedCount(send.count, size())));
  } else if (check.ok() && recv.count != send.count) {
    check = absl::InvalidArgumentError(absl::StrFormat(
        "all_to_all: send holds %d elements but recv holds %d; they must be equal", send.count,
        recv.count));
  }
  return Enqueue({.kind = CollectiveKind::kAllToAll, .send = send.data, .recv = recv.data,
                  .count = send.count / size(), .dtype = send.dtype},
                 std::move(check));
}

absl::Status Communicator::AllToAll(const void* send, void* recv, int64_t count_per_rank,
                                    DType dtype) {
  return AllToAllAsync(send, recv, count_per_rank, dtype).Wait();
}
absl::Status Communicator::AllToAll(ConstBufferView send, BufferView recv) {
  return AllToAllAsync(send, recv).Wait();
}

absl::Status Communicator::AllGather(const void* send, void* recv, int64_t count_per_rank,
                                     DType dtype) {
  return AllGatherAsync(send, recv, count_per_rank, dtype).Wait();
}
absl::Status Communicator::ReduceScatter(const void* send, void* recv, int64_t count_per_rank,
                                         DType dtype, ReduceOp op) {
  return ReduceScatterAsync(send, recv, count_per_rank, dtype, op).Wait();
}
absl::Status Communicator::AllReduce(const void* send, void* recv, int64_t count, DType dtype,
                                     ReduceOp op) {
  return AllReduceAsync(send, recv, count, dtype, op).Wait();
}
absl::Status Communicator::Broadcast(void* buf, int64_t count, DType dtype, int root) {
  return BroadcastAsync(buf, count, dtype, root).Wait();
}
absl::Status Communicator::Barrier() { return BarrierAsync().Wait(); }
absl::Status Communicator::AllGather(ConstBufferView send, BufferView recv) {
  return AllGatherAsync(send, recv).Wait();
}
absl::Status Communicator::ReduceScatter(ConstBufferView send, BufferView recv, ReduceOp op) {
  return ReduceScatterAsync(send, recv, op).Wait();
}
absl::Status Communicator::AllReduce(ConstBufferView send, BufferView recv, ReduceOp op) {
  return AllReduceAsync(send, recv, op).Wait();
}

}  // namespace fsdp
