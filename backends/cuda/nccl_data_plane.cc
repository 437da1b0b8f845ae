// The NCCL data plane of the cuda backend: every rank on a GPU of its own (cuda_data_plane.cc
// chooses it).
//
// NcclDataPlane. Rank 0's ncclUniqueId reaches the others over the host communicator; the
// communicator is non-blocking (config.blocking = 0) so that no NCCL call can hang the host:
// init, an enqueue that returns ncclInProgress and finalize are polled with
// ncclCommGetAsyncError until done, each against a deadline. A collective waits (on the comm
// stream) for an event recorded on `after`, is enqueued on the comm stream, and returns an
// NcclEventState (a CudaEventState) whose Wait() polls the CUDA event and the communicator's
// asynchronous error; past the deadline (the data plane's CommOptions::timeout from the issue)
// or on an NCCL error it fails the plane: the first error is kept, the backend's Failure is set
// (its streams stop) and the communicator is aborted. Every later call fails at once with that
// error. Argument errors are found locally and issue nothing (they do not fail the plane; a
// peer that did issue the call then waits for this rank until its deadline).
//
#include <nccl.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "backends/cuda/cuda_data_plane_common.h"
#include "backends/cuda/cuda_internal.h"
#include "collectives/control.h"
#include "kernels/cuda/kernels.h"
namespace fsdp::cuda_internal {
namespace {

// ---------------------------------------------------------------------------------- NCCL

std::optional<ncclDataType_t> NcclType(DType d) {
  switch (d) {
    case DType::kF32: return ncclFloat32;
    case DType::kBF16: return ncclBfloat16;
    case DType::kF16: return ncclFloat16;
    case DType::kF64: return ncclFloat64;
    case DType::kI32: return ncclInt32;
    case DType::kI64: return ncclInt64;
    case DType::kU8: return ncclUint8;
  }
  return std::nullopt;
}

ncclRedOp_t NcclOp(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return ncclSum;
    case ReduceOp::kAvg: return ncclAvg;
    case ReduceOp::kMax: return ncclMax;
  }
  return ncclSum;
}

// An NCCL error as a status: Unavailable for what a peer or the network did, else Internal.
absl::Status NcclStatus(ncclResult_t r, const std::string& what, const char* last_error) {
  const bool remote = r == ncclRemoteError || r == ncclSystemError;
  const std::string last = last_error != nullptr && *last_error != '\0'
                               ? absl::StrCat(" (", std::string(last_error), ")")
                               : std::string();
  const std::string msg = absl::StrFormat(
      "%s: NCCL error %d: %s%s%s", what, static_cast<int>(r), std::string(ncclGetErrorString(r)),
      last,
      remote ? "; a peer rank failed or its process exited, or the network failed (run with "
               "NCCL_DEBUG=WARN on every rank to see where)"
             : "");
  return remote ? absl::UnavailableError(msg) : absl::InternalError(msg);
}

// What a group's NCCL data plane shares with the events of its collectives (which may outlive
// the plane): the communicator and the plane's first error.
class NcclShared {
 public:
  NcclShared(int device, std::string group, int rank, int size, ncclComm_t comm,
             std::shared_ptr<Failure> backend_failure)
      : device_(device),
        group_(std::move(group)),
        rank_(rank),
        size_(size),
        backend_failure_(std::move(backend_failure)),
        comm_(comm) {}

  int device() const { return device_; }
  const std::string& group() const { return group_; }
  int rank() const { return rank_; }
  int size() const { return size_; }
  bool failed() const { return failed_.load(std::memory_order_acquire); }
  absl::Status health() const {
    std::lock_guard<std::mutex> lock(status_mu_);
    return Detach(failure_);
  }

  // Fails the plane (the first error is kept and returned), the backend (its streams stop) and
  // aborts the communicator. Never called with comm_mu_ held.
  absl::Status Fail(const absl::Status& s) {
    absl::Status first;
    {
      std::lock_guard<std::mutex> lock(status_mu_);
      if (failure_.ok()) {
        failure_ = s.ok() ? absl::AbortedError(absl::StrFormat(
                                "cuda nccl data plane of group '%s' aborted", group_))
                          : Detach(s);
        failed_.store(true, std::memory_order_release);
      }
      first = Detach(failure_);
    }
    backend_failure_->Set(first);
    AbortComm();
    return first;
  }

  // Runs `fn(comm)` with the communicator locked; FailedPrecondition once it is gone.
  template <class F>
  absl::Status WithComm(F&& fn) {
    std::lock_guard<std::mutex> lock(comm_mu_);
    if (comm_ == nullptr) {
      absl::Status h = health();
      return h.ok() ? absl::FailedPreconditionError(absl::StrFormat(
                          "the NCCL communicator of group '%s' is gone", group_))
                    : h;
    }
    return fn(comm_);
  }

  // With comm_mu_ held (inside WithComm): polls the communicator until it is no longer
  // ncclInProgress, the plane failed or the deadline passed.
  absl::Status PollLocked(ncclComm_t comm, const std::string& what, Clock::time_point deadline,
                          absl::Duration timeout) {
    for (int i = 0;; ++i) {
      ncclResult_t state = ncclSuccess;
      const ncclResult_t r = ncclCommGetAsyncError(comm, &state);
      if (r != ncclSuccess) {
        return NcclStatus(r, what + ": ncclCommGetAsyncError", ncclGetLastError(comm));
      }
      if (state == ncclSuccess) return absl::OkStatus();
      if (state != ncclInProgress) return NcclStatus(state, what, ncclGetLastError(comm));
      if (failed()) return health();
      if (Clock::now() >= deadline) {
        return absl::DeadlineExceededError(absl::StrFormat(
            "%s: NCCL did not get the call going within %s on rank %d (a rank did not arrive at "
            "it, or the ranks cannot connect; NCCL_DEBUG=INFO says more); the communicator was "
            "aborted and the group failed",
            what, Dur(timeout), rank_));
      }
      if (i < 64) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(20));
      }
    }
  }

  // The communicator's asynchronous error, without blocking on a thread that holds it.
  absl::Status CheckAsync(const std::string& what) {
    std::unique_lock<std::mutex> lock(comm_mu_, std::try_to_lock);
    if (!lock.owns_lock() || comm_ == nullptr) return absl::OkStatus();
    ncclResult_t state = ncclSuccess;
    const ncclResult_t r = ncclCommGetAsyncError(comm_, &state);
    if (r != ncclSuccess) {
      return NcclStatus(r, what + ": ncclCommGetAsyncError", ncclGetLastError(comm_));
    }
    if (state != ncclSuccess && state != ncclInProgress) {
      return NcclStatus(state, absl::StrCat(what, " failed on rank ", rank_),
                        ncclGetLastError(comm_));
    }
    return absl::OkStatus();
  }

  void AbortComm() {
    std::lock_guard<std::mutex> lock(comm_mu_);
    if (comm_ == nullptr) return;
    DeviceGuard device(device_);
    (void)ncclCommAbort(comm_);
    comm_ = nullptr;
  }

  // The plane's destructor: finalize (bounded) and destroy when healthy, else abort.
  void Close(absl::Duration timeout) {
    bool clean = false;
    {
      std::lock_guard<std::mutex> lock(comm_mu_);
      if (comm_ == nullptr) return;
      DeviceGuard device(device_);
      if (!failed()) {
        ncclResult_t r = ncclCommFinalize(comm_);
        if (r == ncclSuccess || r == ncclInProgress) {
          const Clock::time_point deadline = DeadlineAfter(timeout);
          ncclResult_t state = ncclInProgress;
          while ((r = ncclCommGetAsyncError(comm_, &state)) == ncclSuccess &&
                 state == ncclInProgress && Clock::now() < deadline) {
            std::this_thread::sleep_for(std::chrono::microseconds(200));
          }
          clean = r == ncclSuccess && state == ncclSuccess;
        }
        if (clean) {
          (void)ncclCommDestroy(comm_);
          comm_ = nullptr;
          return;
        }
      }
    }
    // Finalize failed or did not complete in time (a peer never finalized): what is still in
    // flight is abandoned, so the backend fails too.
    Fail(absl::UnavailableError(absl::StrFormat(
        "cuda nccl data plane of group '%s' (rank %d of %d): the communicator did not finalize "
        "within %s when the data plane was destroyed (a peer did not destroy its plane, or "
        "failed); it was aborted",
        group_, rank_, size_, Dur(timeout))))
        .IgnoreError();
  }

 private:
  const int device_;
  const std::string group_;
  const int rank_, size_;
  const std::shared_ptr<Failure> backend_failure_;
  mutable std::mutex status_mu_;
  absl::Status failure_;
  std::atomic<bool> failed_{false};
  std::mutex comm_mu_;  // NCCL calls on the communicator; never held while taking status_mu_ first
  ncclComm_t comm_;     // nullptr once aborted or destroyed
};

// The completion of one NCCL collective: the CUDA event recorded after it on the comm stream,
// watched against the communicator's errors and the deadline.
class NcclEventState final : public CudaEventState {
 public:
  NcclEventState(int device, cudaEvent_t event, std::shared_ptr<Failure> failure,
                 std::shared_ptr<NcclShared> plane, std::string what, Clock::time_point deadline,
                 absl::Duration timeout)
      : CudaEventState(device, event, std::move(failure)),
        plane_(std::move(plane)),
        what_(std::move(what)),
        deadline_(deadline),
        timeout_(timeout) {}

  // Also checks NCCL's asynchronous errors and the deadline, failing the group past it: the
  // backend's host waits poll this (Failure::Watch).
  bool Done() const override {
    if (plane_->failed() || CudaEventState::Done()) return true;
    return !Check();
  }

  absl::Status Wait() override {
    for (int i = 0;; ++i) {
      if (plane_->failed()) return Failed();
      if (CudaEventState::Done()) return CudaEventState::Wait();
      if (!Check()) return Failed();
      if (i < 200) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
    }
  }

 private:
  // False (and the group failed) on an NCCL error or past the deadline.
  bool Check() const {
    absl::Status async = plane_->CheckAsync(what_);
    if (!async.ok()) {
      plane_->Fail(absl::Status(
                       async.code(),
                       absl::StrCat(async.message(),
                                    "; the communicator was aborted and the group failed")))
          .IgnoreError();
      return false;
    }
    if (Clock::now() >= deadline_) {
      plane_->Fail(absl::DeadlineExceededError(absl::StrFormat(
                       "%s did not complete within %s on rank %d of %d: a rank did not arrive at "
                       "it, or the device stalled (NCCL cannot tell which rank is missing: look "
                       "for the rank that reports another error or is still computing); the "
                       "communicator was aborted and the group failed",
                       what_, Dur(timeout_), plane_->rank(), plane_->size())))
          .IgnoreError();
      return false;
    }
    return true;
  }

  // The plane's error, naming this collective when it was another's.
  absl::Status Failed() const {
    const absl::Status h = plane_->health();
    if (absl::StrContains(h.message(), what_)) return h;
    return absl::Status(h.code(), absl::StrCat(what_, " failed: the data plane failed: ",
                                               std::string(h.message())));
  }

  const std::shared_ptr<NcclShared> plane_;
  const std::string what_;
  const Clock::time_point deadline_;
  const absl::Duration timeout_;
};

class NcclDataPlane final : public DataPlane {
 public:
  NcclDataPlane(CudaBackend& b, std::shared_ptr<NcclShared> shared, cudaEvent_t after_event,
                absl::Duration timeout)
      : DataPlane(&b, "cuda nccl"),
        b_(b),
        shared_(std::move(shared)),
        after_event_(after_event),
        timeout_(timeout) {}

  ~NcclDataPlane() override {
    shared_->Close(timeout_);
    DeviceGuard device(shared_->device());
    (void)cudaEventDestroy(after_event_);
  }

  int rank() const override { return shared_->rank(); }
  int size() const override { return shared_->size(); }
  const std::string& name() const override { return shared_->group(); }

  void Abort(const absl::Status& reason) override { shared_->Fail(reason).IgnoreError(); }

 private:
  absl::StatusOr<Event> EnqueueAllGather(View send, View recv, Stream after) override {
    return Issue(CollectiveKind::kAllGather, send, recv, ReduceOp::kSum, after);
  }
  absl::StatusOr<Event> EnqueueReduceScatter(View send, View recv, ReduceOp op,
                                             Stream after) override {
    return Issue(CollectiveKind::kReduceScatter, send, recv, op, after);
  }
  absl::StatusOr<Event> EnqueueAllReduce(View send, View recv, ReduceOp op,
                                         Stream after) override {
    return Issue(CollectiveKind::kAllReduce, send, recv, op, after);
  }

  absl::StatusOr<Event> EnqueueAllToAll(View send, View recv, Stream after) override {
    return Issue(CollectiveKind::kAllToAll, send, recv, ReduceOp::kSum, after);
  }

  absl::StatusOr<Event> Issue(CollectiveKind kind, View send, View recv, ReduceOp op,
                              Stream after) {
    std::lock_guard<std::mutex> lock(issue_mu_);
    CollectiveCall call = MakeCall(kind, send, recv, op, size());
    const int64_t seq = seq_++;
    const std::string what = absl::StrFormat("%s (cuda nccl data plane)",
                                             Where(call, seq, shared_->group()));
    if (shared_->failed()) {
      const absl::Status h = shared_->health();
      return absl::Status(h.code(), absl::StrCat(what, " was not run: the data plane had failed: ",
                                                 std::string(h.message())));
    }
    absl::Status invalid = CheckCall(send, recv, rank(), size(), &call);
    if (!invalid.ok()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "cuda nccl data plane of group '%s': %s; nothing was issued (every rank must make the "
          "same call: a rank that issued it waits for this one until its deadline)",
          shared_->group(), std::string(invalid.message())));
    }
    const std::shared_ptr<Failure>& failure = FailureOf(b_);
    if (failure->failed()) {
      const absl::Status f = failure->Get();
      return shared_->Fail(absl::Status(
          f.code(), absl::StrCat(what, " was not run: this rank's CUDA backend had failed: ",
                                 std::string(f.message()))));
    }
    if (call.count == 0) return Event();  // nothing moves (NCCL skips empty calls too)
    absl::Status s = UseDevice(b_);
    if (!s.ok()) return shared_->Fail(s);
    cudaStream_t comm_stream = StreamOf(b_, Stream::kComm);
    if (after != Stream::kComm) {
      s = CudaStatus(cudaEventRecord(after_event_, StreamOf(b_, after)),
                     what + ": cudaEventRecord on the " + std::string(StreamName(after)) +
                         " stream");
      if (s.ok()) {
        s = CudaStatus(cudaStreamWaitEvent(comm_stream, after_event_, 0),
                       what + ": cudaStreamWaitEvent");
      }
      if (!s.ok()) return shared_->Fail(s);
    }
    const ncclDataType_t dt = *NcclType(call.dtype);  // CheckCall accepted the dtype
    const auto count = static_cast<size_t>(call.count);
    const Clock::time_point deadline = DeadlineAfter(timeout_);
    s = shared_->WithComm([&](ncclComm_t comm) -> absl::Status {
      ncclResult_t r = ncclSuccess;
      const char* fn = "";
      switch (kind) {
        case CollectiveKind::kAllGather:
          fn = "ncclAllGather";
          r = ncclAllGather(call.send, call.recv, count, dt, comm, comm_stream);
          break;
        case CollectiveKind::kReduceScatter:
          fn = "ncclReduceScatter";
          r = ncclReduceScatter(call.send, call.recv, count, dt, NcclOp(call.op), comm,
                                comm_stream);
          break;
        case CollectiveKind::kAllToAll:
          fn = "ncclAlltoAll";
          r = ncclAlltoAll(call.send, call.recv, count, dt, comm, comm_stream);
          break;
        default:
          fn = "ncclAllReduce";
          r = ncclAllReduce(call.send, call.recv, count, dt, NcclOp(call.op), comm, comm_stream);
          break;
      }
      if (r == ncclInProgress) return shared_->PollLocked(comm, what, deadline, timeout_);
      if (r != ncclSuccess) {
        return NcclStatus(r, absl::StrCat(what, ": ", fn, " on rank ", rank()),
                          ncclGetLastError(comm));
      }
      return absl::OkStatus();
    });
    if (!s.ok()) {
      return shared_->Fail(absl::Status(
          s.code(), absl::StrCat(std::string(s.message()),
                                 s.code() == absl::StatusCode::kDeadlineExceeded
                                     ? ""
                                     : "; the communicator was aborted and the group failed")));
    }
    cudaEvent_t done = nullptr;
    s = CudaStatus(cudaEventCreateWithFlags(&done, cudaEventDisableTiming),
                   what + ": cudaEventCreateWithFlags");
    if (s.ok()) {
      s = CudaStatus(cudaEventRecord(done, comm_stream), what + ": cudaEventRecord");
      if (!s.ok()) (void)cudaEventDestroy(done);
    }
    if (!s.ok()) return shared_->Fail(s);
    Event event(std::make_shared<NcclEventState>(b_.device(), done, failure, shared_, what,
                                                 deadline, timeout_));
    // Host waits of the backend poll it, so a missing peer fails it at the deadline even when
    // the host waits for a stream that waits for it (Failure::Watch).
    failure->Watch(event);
    return event;
  }

  CudaBackend& b_;
  const std::shared_ptr<NcclShared> shared_;
  std::mutex issue_mu_;
  cudaEvent_t after_event_;  // re-recorded per call (a wait already issued keeps its point)
  const absl::Duration timeout_;
  int64_t seq_ = 0;
};

// Creates the non-blocking communicator, polling it ready until `deadline`; aborts it on error.
absl::Status InitComm(ncclComm_t* out, int size, const ncclUniqueId& id, int rank,
                      const std::string& group, absl::Duration timeout) {
  const std::string what = absl::StrFormat(
      "cuda nccl data plane of group '%s': rank %d of %d: ncclCommInitRankConfig", group, rank,
      size);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t comm = nullptr;
  ncclResult_t r = ncclCommInitRankConfig(&comm, size, id, rank, &config);
  if (r != ncclSuccess && r != ncclInProgress) {
    absl::Status s = NcclStatus(r, what, ncclGetLastError(comm));
    if (comm != nullptr) (void)ncclCommAbort(comm);
    return s;
  }
  if (comm == nullptr) {
    return absl::InternalError(absl::StrCat(what, ": returned no communicator"));
  }
  const Clock::time_point deadline = DeadlineAfter(timeout);
  for (;;) {
    ncclResult_t state = ncclInProgress;
    r = ncclCommGetAsyncError(comm, &state);
    if (r != ncclSuccess || (state != ncclSuccess && state != ncclInProgress)) {
      const ncclResult_t e = r != ncclSuccess ? r : state;
      absl::Status s = NcclStatus(e, what, ncclGetLastError(comm));
      (void)ncclCommAbort(comm);
      return s;
    }
    if (state == ncclSuccess) break;
    if (Clock::now() >= deadline) {
      (void)ncclCommAbort(comm);
      return absl::DeadlineExceededError(absl::StrFormat(
          "%s: the communicator was not ready within %s: a rank did not arrive, or the ranks "
          "cannot reach each other (check NCCL_SOCKET_IFNAME and firewalls; NCCL_DEBUG=INFO "
          "says more); it was aborted",
          what, Dur(timeout)));
    }
    std::this_thread::sleep_for(std::chrono::microseconds(500));
  }
  *out = comm;
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<DataPlane>> CreateNcclPlane(CudaBackend& b, Communicator& group) {
  const std::string name = group.name();
  const int n = group.size(), me = group.rank();
  const absl::Duration timeout = b.options().data_plane.timeout;
  const absl::Duration init_timeout = std::min(timeout, group.options().timeout);

  // Rank 0's unique id (or why there is none), to every rank over the host communicator.
  std::string payload;
  if (me == 0) {
    ncclUniqueId id;
    std::memset(&id, 0, sizeof(id));
    const ncclResult_t r = ncclGetUniqueId(&id);
    if (r == ncclSuccess) {
      payload = std::string(1, '\1') + std::string(id.internal, NCCL_UNIQUE_ID_BYTES);
    } else {
      payload = std::string(1, '\0') +
                std::string(NcclStatus(r, "ncclGetUniqueId", ncclGetLastError(nullptr)).message());
    }
  }
  absl::StatusOr<std::string> got = internal::BroadcastString(group, payload, 0, 4096);
  if (!got.ok()) {
    return absl::Status(got.status().code(),
                        absl::StrFormat("cuda nccl data plane of group '%s': sharing rank 0's NCCL "
                                        "unique id failed: %s",
                                        name, std::string(got.status().message())));
  }
  if (got->size() != 1 + NCCL_UNIQUE_ID_BYTES || (*got)[0] != '\1') {
    return absl::FailedPreconditionError(absl::StrFormat(
        "cuda nccl data plane of group '%s': rank 0 could not make an NCCL unique id: %s", name,
        got->empty() ? std::string("(no reason given)") : got->substr(1)));
  }
  ncclUniqueId id;
  std::memcpy(id.internal, got->data() + 1, NCCL_UNIQUE_ID_BYTES);

  ncclComm_t comm = nullptr;
  absl::Status init = UseDevice(b);
  if (init.ok()) init = InitComm(&comm, n, id, me, name, init_timeout);

  // Every rank learns whether every rank has a communicator, so that none keeps a plane whose
  // peers have none.
  absl::StatusOr<std::vector<uint64_t>> agreed =
      internal::AllGatherU64(group, {init.ok() ? uint64_t{1} : uint64_t{0}});
  if (!init.ok()) return init;
  auto abort_comm = [&] {
    DeviceGuard device(b.device());
    (void)ncclCommAbort(comm);
  };
  if (!agreed.ok()) {
    abort_comm();
    return absl::Status(agreed.status().code(),
                        absl::StrFormat("cuda nccl data plane of group '%s': agreeing that every "
                                        "rank made its communicator failed: %s",
                                        name, std::string(agreed.status().message())));
  }
  std::vector<int> failed;
  for (int r = 0; r < n && static_cast<size_t>(r) < agreed->size(); ++r) {
    if ((*agreed)[r] == 0) failed.push_back(r);
  }
  if (!failed.empty()) {
    abort_comm();
    return absl::FailedPreconditionError(absl::StrFormat(
        "cuda nccl data plane of group '%s': ranks [%s] could not make their NCCL communicator "
        "(their own errors say why); no data plane was made",
        name, absl::StrJoin(failed, ", ")));
  }
  cudaEvent_t after_event = nullptr;
  absl::Status s = CudaStatus(cudaEventCreateWithFlags(&after_event, cudaEventDisableTiming),
                              "cuda nccl data plane: cudaEventCreateWithFlags");
  if (!s.ok()) {
    abort_comm();
    return s;
  }
  auto shared = std::make_shared<NcclShared>(b.device(), name, me, n, comm, FailureOf(b));
  return std::unique_ptr<DataPlane>(
      new NcclDataPlane(b, std::move(shared), after_event, timeout));
}

}  // namespace fsdp::cuda_internal
