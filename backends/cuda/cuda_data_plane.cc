// The data planes of the cuda backend (CreateCudaDataPlane, cuda_internal.h).
//
// Choosing. CreateCudaDataPlane gathers over the group's host communicator, from every rank:
// a process identity (a random per-process nonce, the pid, the hostname) and its GPU (UUID,
// PCI address, ordinal). All ranks threads of one process on one GPU -> the shared-GPU plane
// (this also covers a group of one rank); every rank on a GPU of its own (distinct (host, GPU))
// -> NCCL; anything else (two processes on one GPU, some ranks sharing a GPU and others not)
// -> FailedPrecondition saying which ranks share which GPU and what to do. Every rank decides
// from the same gathered data, so all ranks make the same choice or fail together.
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
// SharedDeviceDataPlane: ranks as threads of one process, each with its own CudaBackend on the
// same GPU. The ranks of a group meet in a process-wide rendezvous (as the sim plane does),
// which holds one slot per call sequence number. A call runs in two host rounds:
//   1. Arrive: each rank posts its call (kind, count, dtype, op, device pointers, its argument
//      check) and an event recorded on its `after` stream, then waits (condition variable,
//      deadline) for all ranks. The last to arrive decides: an argument error of any rank ->
//      InvalidArgument on every rank (the plane lives on); different calls -> "schedule
//      mismatch" on every rank and the plane fails. Then each rank issues on its own comm
//      stream: waits for every rank's `after` event, then its own part (copies for
//      all_gather, one reduce kernel over every rank's buffer in rank order for
//      reduce_scatter / all_reduce), and records a "done" event.
//   2. Done: each rank posts its done event and waits until every rank has posted; then its
//      comm stream waits for every rank's done event and records the end event it returns.
// So a rank's end event completes only once every rank has finished reading its buffers: the
// caller may overwrite or free `send` as soon as the event completes, as with NCCL, and the
// next call on the plane cannot overwrite memory a peer still reads (this subsumes waiting on
// each peer's previous end event). Round 2 costs only a host wait for peers that are already in
// the call, issuing. An in-place all_reduce reduces into stream-ordered scratch and copies it
// into recv after round 2 (nobody reads recv any more by then). The slot of a call is freed
// when the last rank leaves it (with the events in it), so at most two slots exist at a time.
// The reduce kernel takes at most 16 inputs, and chunking would round bf16/f16 sums and avg
// more than once (the Communicator rounds once), so this plane serves at most 16 ranks:
// larger groups are refused when the plane is made.
//
// Failure of the shared plane (deadline, schedule mismatch, a CUDA error, Abort) fails it for
// every rank: waiting ranks wake with the reason, every rank's backend Failure is set, and
// later calls fail at once.
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
#include "backends/cuda/cuda_internal.h"
#include "collectives/control.h"
#include "kernels/cuda/kernels.h"

namespace fsdp::cuda_internal {
namespace {

using Clock = std::chrono::steady_clock;

// The most inputs one reduce kernel takes (kernels/cuda/kernels.h).
constexpr int kMaxReduceInputs = 16;

// A status that shares nothing with `s` (statuses handed between threads; see
// collectives/work_state.h).
absl::Status Detach(const absl::Status& s) {
  return s.ok() ? absl::OkStatus() : absl::Status(s.code(), s.message());
}

// now + timeout (an infinite or huge timeout is capped at 100 years rather than overflowing).
Clock::time_point DeadlineAfter(absl::Duration timeout) {
  const absl::Duration capped =
      std::clamp(timeout, absl::ZeroDuration(), absl::Hours(24 * 365 * 100));
  return Clock::now() + absl::ToChronoNanoseconds(capped);
}

std::string Dur(absl::Duration d) { return absl::FormatDuration(d); }

// Sets the calling thread's CUDA device for a scope and restores the previous one: for the
// paths that may run on any thread (Wait, Abort, destructors).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) : device_(device) {
    if (cudaGetDevice(&saved_) != cudaSuccess) saved_ = -1;
    if (saved_ != device_) (void)cudaSetDevice(device_);
  }
  ~DeviceGuard() {
    if (saved_ >= 0 && saved_ != device_) (void)cudaSetDevice(saved_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int device_;
  int saved_ = -1;
};

// A CUDA event owned here (destroyed with the last reference; a pending event's resources are
// released by CUDA once it completes, and a stream that already waits on it keeps waiting).
class DeviceEvent {
 public:
  static absl::StatusOr<std::shared_ptr<DeviceEvent>> Record(cudaStream_t stream,
                                                             const std::string& what) {
    cudaEvent_t e = nullptr;
    FSDP_RETURN_IF_ERROR(CudaStatus(cudaEventCreateWithFlags(&e, cudaEventDisableTiming),
                                    what + ": cudaEventCreateWithFlags"));
    std::shared_ptr<DeviceEvent> ev(new DeviceEvent(e));
    FSDP_RETURN_IF_ERROR(CudaStatus(cudaEventRecord(e, stream), what + ": cudaEventRecord"));
    return ev;
  }
  ~DeviceEvent() { (void)cudaEventDestroy(event_); }
  DeviceEvent(const DeviceEvent&) = delete;
  DeviceEvent& operator=(const DeviceEvent&) = delete;
  cudaEvent_t get() const { return event_; }

 private:
  explicit DeviceEvent(cudaEvent_t e) : event_(e) {}
  cudaEvent_t event_;
};

// ---------------------------------------------------------------------------------- calls

// The call as the Communicator describes and compares it; pointers are filled in only once the
// views have been checked.
CollectiveCall MakeCall(CollectiveKind kind, const View& send, const View& recv, ReduceOp op) {
  CollectiveCall c;
  c.kind = kind;
  c.count = kind == CollectiveKind::kReduceScatter ? recv.count : send.count;
  c.dtype = send.dtype;
  c.op = kind == CollectiveKind::kAllGather ? ReduceOp::kSum : op;
  return c;
}

// "all_gather(count=10, f32) at sequence 3 of group 'world'"
std::string Where(const CollectiveCall& call, int64_t seq, const std::string& group) {
  return absl::StrFormat("%s at sequence %d of group '%s'", DescribeCall(call), seq, group);
}

// The arguments of `call` on `rank` (views of backend `b`): OK or InvalidArgument "<call> on
// rank r: <what is wrong>". Fills call->send / call->recv with the device pointers.
absl::Status CheckCall(CudaBackend& b, const View& send, const View& recv, int rank, int size,
                       CollectiveCall* call) {
  const std::string what = DescribeCall(*call);
  auto bad = [&](const std::string& why) {
    return absl::InvalidArgumentError(absl::StrFormat("%s on rank %d: %s", what, rank, why));
  };
  if (static_cast<unsigned>(send.dtype) > static_cast<unsigned>(DType::kU8) ||
      static_cast<unsigned>(recv.dtype) > static_cast<unsigned>(DType::kU8)) {
    return bad("unknown dtype");
  }
  auto check_view = [&](const View& v, const char* label) -> absl::Status {
    if (v.count < 0) return bad(absl::StrFormat("the %s view has count %d (< 0)", label, v.count));
    if (v.count == 0) return absl::OkStatus();
    if (v.count > std::numeric_limits<int64_t>::max() / 64) {
      return bad(absl::StrFormat("the %s view's count %d is too large", label, v.count));
    }
    if (v.backend != &b) {
      return bad(absl::StrFormat(
          "the %s view is not memory of this rank's CUDA backend; pass views of buffers made by "
          "the backend the data plane was created with",
          label));
    }
    if (v.offset < 0 || v.allocation.storage == nullptr ||
        v.offset + v.bytes() > static_cast<int64_t>(v.allocation.bytes)) {
      return bad(absl::StrFormat(
          "the %s view (offset %d, %d bytes) does not fit in its allocation of %d bytes", label,
          v.offset, v.bytes(), static_cast<int64_t>(v.allocation.bytes)));
    }
    return absl::OkStatus();
  };
  FSDP_RETURN_IF_ERROR(check_view(send, "send"));
  FSDP_RETURN_IF_ERROR(check_view(recv, "recv"));
  if (send.dtype != recv.dtype) {
    return bad(absl::StrFormat("send is %s but recv is %s", std::string(DTypeName(send.dtype)),
                               std::string(DTypeName(recv.dtype))));
  }
  const bool reduces = call->kind != CollectiveKind::kAllGather;
  if (reduces && !IsFloat16Or32(send.dtype)) {
    return bad(absl::StrFormat("reductions take f32, bf16 or f16, not %s; all_gather moves any dtype",
                               std::string(DTypeName(send.dtype))));
  }
  if (static_cast<unsigned>(call->op) > static_cast<unsigned>(ReduceOp::kMax)) {
    return bad(absl::StrFormat("unknown reduce op %d", static_cast<int>(call->op)));
  }
  switch (call->kind) {
    case CollectiveKind::kAllGather:
      if (recv.count != send.count * size) {
        return bad(absl::StrFormat("recv holds %d elements but must hold group size %d x send %d = %d",
                                   recv.count, size, send.count, send.count * size));
      }
      break;
    case CollectiveKind::kReduceScatter:
      if (send.count % size != 0) {
        return bad(absl::StrFormat(
            "send holds %d elements, not a multiple of the group size %d; the caller pads it to %d "
            "(PaddedCount)",
            send.count, size, PaddedCount(send.count, size)));
      }
      if (recv.count * size != send.count) {
        return bad(absl::StrFormat("recv holds %d elements but must hold send %d / group size %d = %d",
                                   recv.count, send.count, size, send.count / size));
      }
      break;
    case CollectiveKind::kAllReduce:
      if (recv.count != send.count) {
        return bad(absl::StrFormat("send holds %d elements but recv holds %d", send.count,
                                   recv.count));
      }
      break;
    default:
      return bad("not a data plane collective");
  }
  call->send = Ptr(send);
  call->recv = Ptr(recv);
  // Null buffers, in-place positions and overlaps, as the Communicator checks them.
  return ValidateCall(*call, rank, size);
}

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
      : b_(b), shared_(std::move(shared)), after_event_(after_event), timeout_(timeout) {}

  ~NcclDataPlane() override {
    shared_->Close(timeout_);
    DeviceGuard device(shared_->device());
    (void)cudaEventDestroy(after_event_);
  }

  int rank() const override { return shared_->rank(); }
  int size() const override { return shared_->size(); }
  const std::string& name() const override { return shared_->group(); }

  absl::StatusOr<Event> AllGather(View send, View recv, Stream after) override {
    return Issue(CollectiveKind::kAllGather, send, recv, ReduceOp::kSum, after);
  }
  absl::StatusOr<Event> ReduceScatter(View send, View recv, ReduceOp op, Stream after) override {
    return Issue(CollectiveKind::kReduceScatter, send, recv, op, after);
  }
  absl::StatusOr<Event> AllReduce(View send, View recv, ReduceOp op, Stream after) override {
    return Issue(CollectiveKind::kAllReduce, send, recv, op, after);
  }
  void Abort(const absl::Status& reason) override { shared_->Fail(reason).IgnoreError(); }

 private:
  absl::StatusOr<Event> Issue(CollectiveKind kind, View send, View recv, ReduceOp op,
                              Stream after) {
    std::lock_guard<std::mutex> lock(issue_mu_);
    CollectiveCall call = MakeCall(kind, send, recv, op);
    const int64_t seq = seq_++;
    const std::string what = absl::StrFormat("%s (cuda nccl data plane)",
                                             Where(call, seq, shared_->group()));
    if (shared_->failed()) {
      const absl::Status h = shared_->health();
      return absl::Status(h.code(), absl::StrCat(what, " was not run: the data plane had failed: ",
                                                 std::string(h.message())));
    }
    absl::Status invalid = CheckCall(b_, send, recv, rank(), size(), &call);
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

// ------------------------------------------------------------------------ shared GPU plane

struct SharedPost {
  bool present = false;
  absl::Status invalid;  // this rank's argument check
  CollectiveCall call;   // with this rank's device pointers
  std::shared_ptr<DeviceEvent> ready;  // recorded on its `after` stream (round 1)
  std::shared_ptr<DeviceEvent> done;   // recorded after its part of the call (round 2)
};

struct SharedSlot {
  std::vector<SharedPost> posts;
  int arrived = 0;  // round 1 posts
  int issued = 0;   // round 2 posts
  int left = 0;     // ranks done with the slot; the last one frees it
  absl::Status verdict;
};

// The ranks of one group: the rendezvous of their calls.
class SharedGroup {
 public:
  SharedGroup(std::string name, int size)
      : name_(std::move(name)), size_(size), backends_(size), arrived_seq_(size, -1) {}

  const std::string& name() const { return name_; }
  int size() const { return size_; }

  void Join(int rank, std::shared_ptr<Failure> backend) {
    std::lock_guard<std::mutex> lock(mu_);
    backends_[rank] = std::move(backend);
  }

  void Fail(absl::Status s, int64_t seq) {
    std::lock_guard<std::mutex> lock(mu_);
    FailLocked(std::move(s), seq);
  }

  // One call of `rank` (see the top of the file). `ready`: null when the rank has nothing to
  // wait for (an invalid or empty call). `issue(posts)` issues this rank's part on its comm
  // stream and returns its done event; `finish(posts)` issues what follows round 2.
  template <class Issue, class Finish>
  absl::StatusOr<Event> Run(int rank, int64_t seq, const std::string& what, absl::Duration timeout,
                            SharedPost post, Issue&& issue, Finish&& finish);

 private:
  void FailLocked(absl::Status s, int64_t seq) {
    if (!failure_.ok()) return;
    failure_ = s.ok() ? absl::AbortedError(absl::StrFormat(
                            "cuda shared-GPU data plane of group '%s' aborted", name_))
                      : Detach(s);
    failure_seq_ = seq;
    for (const std::shared_ptr<Failure>& f : backends_) {
      if (f != nullptr) f->Set(failure_);
    }
    cv_.notify_all();
  }
  absl::Status FailureFor(const std::string& what, int64_t seq) const {
    if (failure_seq_ == seq) return Detach(failure_);
    return absl::Status(failure_.code(),
                        absl::StrCat(what, " failed: the data plane failed: ",
                                     std::string(failure_.message())));
  }
  std::string Missing(const SharedSlot& s, bool round2) const {
    std::vector<int> missing;
    std::vector<std::string> notes;
    for (int q = 0; q < size_; ++q) {
      const SharedPost& p = s.posts[q];
      if (round2 ? p.done != nullptr : p.present) continue;
      missing.push_back(q);
      if (!round2) {
        notes.push_back(arrived_seq_[q] < 0
                            ? absl::StrFormat("rank %d arrived at no call", q)
                            : absl::StrFormat("rank %d last arrived at sequence %d", q,
                                              arrived_seq_[q]));
      }
    }
    if (round2) {
      return absl::StrFormat("ranks [%s] arrived but did not finish issuing their part",
                             absl::StrJoin(missing, ", "));
    }
    return absl::StrFormat("ranks [%s] did not arrive (%s)", absl::StrJoin(missing, ", "),
                           absl::StrJoin(notes, "; "));
  }
  // The last arrival decides for every rank.
  void Decide(SharedSlot& s, int64_t seq) {
    std::vector<std::string> invalid;
    for (const SharedPost& p : s.posts) {
      if (!p.invalid.ok()) invalid.emplace_back(p.invalid.message());
    }
    if (!invalid.empty()) {  // every rank learns of it; the schedule is intact, the plane lives
      s.verdict = absl::InvalidArgumentError(absl::StrFormat(
          "invalid arguments at sequence %d of group '%s' (cuda shared-GPU data plane): %s", seq,
          name_, absl::StrJoin(invalid, "; ")));
      return;
    }
    bool same = true;
    for (const SharedPost& p : s.posts) same = same && p.call.SameSchedule(s.posts[0].call);
    if (same) return;
    std::vector<std::pair<std::string, std::vector<int>>> calls;  // in order of first rank
    for (int q = 0; q < size_; ++q) {
      const std::string d = DescribeCall(s.posts[q].call);
      auto it = std::find_if(calls.begin(), calls.end(), [&](auto& c) { return c.first == d; });
      if (it == calls.end()) {
        calls.push_back({d, {q}});
      } else {
        it->second.push_back(q);
      }
    }
    std::vector<std::string> parts;
    for (auto& [d, ranks] : calls) {
      parts.push_back(absl::StrFormat("ranks [%s] called %s", absl::StrJoin(ranks, ", "), d));
    }
    s.verdict = absl::FailedPreconditionError(absl::StrFormat(
        "schedule mismatch at sequence %d of group '%s' (cuda shared-GPU data plane): %s; every "
        "rank must issue the same collectives in the same order; the group failed",
        seq, name_, absl::StrJoin(parts, "; ")));
    FailLocked(s.verdict, seq);
  }
  // Leaves slot `seq`; the last rank to leave frees it (its events are destroyed outside the
  // lock by the caller, who gets the node).
  std::map<int64_t, SharedSlot>::node_type LeaveLocked(int64_t seq, SharedSlot& s) {
    if (++s.left == size_) return slots_.extract(seq);
    return {};
  }

  const std::string name_;
  const int size_;
  std::mutex mu_;
  std::condition_variable cv_;
  absl::Status failure_;
  int64_t failure_seq_ = -1;
  std::map<int64_t, SharedSlot> slots_;
  std::vector<std::shared_ptr<Failure>> backends_;
  std::vector<int64_t> arrived_seq_;
};

template <class Issue, class Finish>
absl::StatusOr<Event> SharedGroup::Run(int rank, int64_t seq, const std::string& what,
                                       absl::Duration timeout, SharedPost post, Issue&& issue,
                                       Finish&& finish) {
  const Clock::time_point deadline = DeadlineAfter(timeout);
  std::map<int64_t, SharedSlot>::node_type freed;  // destroyed after the lock is released
  std::unique_lock<std::mutex> lock(mu_);
  if (!failure_.ok()) {
    return absl::Status(failure_.code(), absl::StrCat(what, " was not run: the data plane had failed: ",
                                                      std::string(failure_.message())));
  }
  // Round 1: arrive.
  SharedSlot& s = slots_[seq];
  if (s.posts.empty()) s.posts.resize(size_);
  post.present = true;
  s.posts[rank] = std::move(post);
  arrived_seq_[rank] = seq;
  if (++s.arrived == size_) {
    Decide(s, seq);
    cv_.notify_all();
  } else {
    while (s.arrived < size_ && failure_.ok()) {
      if (cv_.wait_until(lock, deadline) == std::cv_status::timeout && s.arrived < size_ &&
          failure_.ok()) {
        FailLocked(absl::DeadlineExceededError(absl::StrFormat(
                       "%s: rank %d waited %s and %s; the group failed", what, rank,
                       Dur(timeout), Missing(s, false))),
                   seq);
      }
    }
    if (s.arrived < size_) return FailureFor(what, seq);
  }
  if (!s.verdict.ok()) {
    absl::Status verdict = Detach(s.verdict);
    freed = LeaveLocked(seq, s);
    lock.unlock();
    return verdict;
  }
  if (!failure_.ok()) return FailureFor(what, seq);
  if (s.posts[rank].call.count == 0) {  // every rank's call is empty: nothing moves
    freed = LeaveLocked(seq, s);
    lock.unlock();
    return Event();
  }
  const std::vector<SharedPost> round1 = s.posts;  // copies: events stay alive through them
  lock.unlock();

  // This rank's part, on its comm stream.
  absl::StatusOr<std::shared_ptr<DeviceEvent>> done = issue(round1);
  lock.lock();
  if (!done.ok()) {
    FailLocked(done.status(), seq);
    return FailureFor(what, seq);
  }
  if (!failure_.ok()) return FailureFor(what, seq);

  // Round 2: every rank has issued its part.
  s.posts[rank].done = std::move(*done);
  if (++s.issued == size_) {
    cv_.notify_all();
  } else {
    while (s.issued < size_ && failure_.ok()) {
      if (cv_.wait_until(lock, deadline) == std::cv_status::timeout && s.issued < size_ &&
          failure_.ok()) {
        FailLocked(absl::DeadlineExceededError(absl::StrFormat(
                       "%s: rank %d waited %s and %s; the group failed", what, rank,
                       Dur(timeout), Missing(s, true))),
                   seq);
      }
    }
    if (s.issued < size_) return FailureFor(what, seq);
  }
  if (!failure_.ok()) return FailureFor(what, seq);
  const std::vector<SharedPost> round2 = s.posts;
  freed = LeaveLocked(seq, s);
  lock.unlock();

  absl::StatusOr<Event> end = finish(round2);
  if (!end.ok()) Fail(end.status(), seq);
  return end;
}

// The groups of shared-GPU planes being made: the ranks of a group meet here.
struct SharedRendezvous {
  std::shared_ptr<SharedGroup> group;
  int taken = 0;
};
std::mutex g_shared_mu;
std::map<std::string, SharedRendezvous>& SharedPlanes() {
  static auto* planes = new std::map<std::string, SharedRendezvous>();
  return *planes;
}

class SharedDeviceDataPlane final : public DataPlane {
 public:
  SharedDeviceDataPlane(CudaBackend& b, std::shared_ptr<SharedGroup> group, int rank)
      : b_(b), group_(std::move(group)), rank_(rank), timeout_(b.options().data_plane.timeout) {}

  int rank() const override { return rank_; }
  int size() const override { return group_->size(); }
  const std::string& name() const override { return group_->name(); }

  absl::StatusOr<Event> AllGather(View send, View recv, Stream after) override {
    return Call(CollectiveKind::kAllGather, send, recv, ReduceOp::kSum, after);
  }
  absl::StatusOr<Event> ReduceScatter(View send, View recv, ReduceOp op, Stream after) override {
    return Call(CollectiveKind::kReduceScatter, send, recv, op, after);
  }
  absl::StatusOr<Event> AllReduce(View send, View recv, ReduceOp op, Stream after) override {
    return Call(CollectiveKind::kAllReduce, send, recv, op, after);
  }
  void Abort(const absl::Status& reason) override { group_->Fail(reason, -1); }

 private:
  static int KernelDtype(DType d) { return d == DType::kF32 ? 0 : d == DType::kBF16 ? 1 : 2; }
  static int KernelOp(ReduceOp op) { return op == ReduceOp::kSum ? 0 : op == ReduceOp::kAvg ? 1 : 2; }

  absl::StatusOr<Event> Call(CollectiveKind kind, View send, View recv, ReduceOp op,
                             Stream after) {
    std::lock_guard<std::mutex> serial(call_mu_);
    const int n = size();
    const int me = rank_;
    CollectiveCall call = MakeCall(kind, send, recv, op);
    const int64_t seq = seq_++;
    const std::string what =
        absl::StrFormat("%s (cuda shared-GPU data plane)", Where(call, seq, name()));

    SharedPost post;
    post.invalid = CheckCall(b_, send, recv, me, n, &call);
    post.call = call;
    if (post.invalid.ok()) {
      // A rank whose device cannot take part fails the group (it cannot run its part).
      absl::Status local = UseDevice(b_);
      const std::shared_ptr<Failure>& failure = FailureOf(b_);
      if (local.ok() && failure->failed()) {
        const absl::Status f = failure->Get();
        local = absl::Status(f.code(), absl::StrCat("rank ", me, "'s CUDA backend had failed: ",
                                                    std::string(f.message())));
      }
      if (local.ok() && call.count > 0) {
        absl::StatusOr<std::shared_ptr<DeviceEvent>> ready =
            DeviceEvent::Record(StreamOf(b_, after), what);
        if (ready.ok()) {
          post.ready = std::move(*ready);
        } else {
          local = ready.status();
        }
      }
      if (!local.ok()) {
        const absl::Status s(local.code(), absl::StrCat(what, " on rank ", me, ": ",
                                                        std::string(local.message()),
                                                        "; the group failed"));
        group_->Fail(s, seq);
        return s;
      }
    }

    cudaStream_t cs = StreamOf(b_, Stream::kComm);
    const size_t esize = DTypeSize(call.dtype);
    const size_t bytes = static_cast<size_t>(call.count) * esize;
    // In place (all_reduce with send == recv and peers reading it): reduce into scratch, copy
    // after round 2.
    const bool via_scratch =
        kind == CollectiveKind::kAllReduce && call.send == call.recv && n > 1;
    Scratch scratch;

    auto issue = [&](const std::vector<SharedPost>& posts)
        -> absl::StatusOr<std::shared_ptr<DeviceEvent>> {
      for (const SharedPost& p : posts) {
        if (p.ready != nullptr) {
          FSDP_RETURN_IF_ERROR(CudaStatus(cudaStreamWaitEvent(cs, p.ready->get(), 0),
                                          what + ": cudaStreamWaitEvent (a rank's input)"));
        }
      }
      char* recv_p = static_cast<char*>(call.recv);
      if (kind == CollectiveKind::kAllGather) {
        for (int q = 0; q < n; ++q) {
          const void* src = posts[q].call.send;
          char* dst = recv_p + static_cast<size_t>(q) * bytes;
          if (q == me && src == dst) continue;  // in place: already there
          FSDP_RETURN_IF_ERROR(CudaStatus(
              cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, cs),
              absl::StrCat(what, ": cudaMemcpyAsync of rank ", q, "'s chunk")));
        }
      } else {
        std::array<const void*, kMaxReduceInputs> ins{};
        const size_t chunk = kind == CollectiveKind::kReduceScatter
                                 ? static_cast<size_t>(me) * bytes
                                 : 0;
        for (int q = 0; q < n; ++q) {
          ins[q] = static_cast<const char*>(posts[q].call.send) + chunk;
        }
        void* out = recv_p;
        if (via_scratch) {
          absl::StatusOr<Scratch> made = Scratch::Create(b_, bytes);
          if (!made.ok()) {
            return absl::Status(made.status().code(),
                                absl::StrCat(what, ": scratch for the in-place result: ",
                                             std::string(made.status().message())));
          }
          scratch = std::move(*made);
          out = scratch.get();
        }
        // The check after the launch must see only this launch: drop a non-sticky error an
        // earlier, already handled call left on this thread (a sticky one comes back anyway).
        (void)cudaGetLastError();
        kernels::cuda::reduce(cs, out, ins.data(), n, call.count, KernelDtype(call.dtype),
                              KernelOp(call.op));
        FSDP_RETURN_IF_ERROR(CudaStatus(cudaGetLastError(), what + ": reduce kernel launch"));
      }
      return DeviceEvent::Record(cs, what);
    };

    auto finish = [&](const std::vector<SharedPost>& posts) -> absl::StatusOr<Event> {
      for (int q = 0; q < n; ++q) {
        if (q == me || posts[q].done == nullptr) continue;
        FSDP_RETURN_IF_ERROR(CudaStatus(cudaStreamWaitEvent(cs, posts[q].done->get(), 0),
                                        what + ": cudaStreamWaitEvent (a rank's part)"));
      }
      if (via_scratch) {
        FSDP_RETURN_IF_ERROR(CudaStatus(
            cudaMemcpyAsync(call.recv, scratch.get(), bytes, cudaMemcpyDeviceToDevice, cs),
            what + ": cudaMemcpyAsync of the result into recv"));
        scratch.Release();  // reused only once the streams have run past the copy
      }
      const std::shared_ptr<Failure>& failure = FailureOf(b_);
      Event end = RecordEvent(b_.device(), cs, failure);
      if (failure->failed()) return failure->Get();
      return end;
    };

    return group_->Run(me, seq, what, timeout_, std::move(post), issue, finish);
  }

  CudaBackend& b_;
  const std::shared_ptr<SharedGroup> group_;
  const int rank_;
  const absl::Duration timeout_;
  std::mutex call_mu_;
  int64_t seq_ = 0;
};

// ---------------------------------------------------------------------------------- choosing

// Distinguishes this process from any other (a pid alone repeats across hosts and pid
// namespaces; the nonce, pid and hostname together do not).
uint64_t ProcessNonce() {
  static const uint64_t nonce = [] {
    std::random_device rd;
    uint64_t v = (static_cast<uint64_t>(rd()) << 32) ^ rd();
    v ^= static_cast<uint64_t>(Clock::now().time_since_epoch().count()) * 0x9e3779b97f4a7c15ull;
    return v == 0 ? 1 : v;
  }();
  return nonce;
}

constexpr size_t kHostWords = 8;  // hostname: 64 bytes
constexpr size_t kFields = 8 + kHostWords;

struct RankInfo {
  bool ok = false;
  uint64_t nonce = 0, pid = 0, backend = 0, uuid_lo = 0, uuid_hi = 0, pci = 0;
  int64_t ordinal = -1;
  std::string host;

  bool SameProcess(const RankInfo& o) const {
    return nonce == o.nonce && pid == o.pid && host == o.host;
  }
  bool HasUuid() const { return uuid_lo != 0 || uuid_hi != 0; }
  bool SameDevice(const RankInfo& o) const {
    if (host != o.host) return false;
    if (HasUuid() && o.HasUuid()) return uuid_lo == o.uuid_lo && uuid_hi == o.uuid_hi;
    return pci == o.pci;
  }
  std::string Device() const {
    return absl::StrFormat("GPU %04x:%02x:%02x.0 (device %d) on host '%s'",
                           static_cast<unsigned>(pci >> 32),
                           static_cast<unsigned>((pci >> 8) & 0xffffff),
                           static_cast<unsigned>(pci & 0xff), ordinal, host);
  }
};

absl::Status ReadLocalInfo(CudaBackend& b, RankInfo* info) {
  info->nonce = ProcessNonce();
  info->pid = static_cast<uint64_t>(getpid());
  info->backend = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(&b));
  char host[kHostWords * 8 + 1] = {};
  if (gethostname(host, kHostWords * 8) != 0) std::strcpy(host, "?");
  host[kHostWords * 8] = '\0';
  info->host = host;
  FSDP_RETURN_IF_ERROR(UseDevice(b));
  cudaDeviceProp prop;
  std::memset(&prop, 0, sizeof(prop));
  FSDP_RETURN_IF_ERROR(CudaStatus(cudaGetDeviceProperties(&prop, b.device()),
                                  absl::StrCat("cudaGetDeviceProperties(", b.device(), ")")));
  std::memcpy(&info->uuid_lo, prop.uuid.bytes, 8);
  std::memcpy(&info->uuid_hi, prop.uuid.bytes + 8, 8);
  info->pci = (static_cast<uint64_t>(static_cast<uint32_t>(prop.pciDomainID)) << 32) |
              (static_cast<uint64_t>(static_cast<uint32_t>(prop.pciBusID) & 0xffffff) << 8) |
              (static_cast<uint64_t>(static_cast<uint32_t>(prop.pciDeviceID)) & 0xff);
  info->ordinal = b.device();
  info->ok = true;
  return absl::OkStatus();
}

std::vector<uint64_t> Pack(const RankInfo& i) {
  std::vector<uint64_t> v = {i.ok ? uint64_t{1} : uint64_t{0}, i.nonce, i.pid, i.backend,
                             i.uuid_lo, i.uuid_hi, i.pci, static_cast<uint64_t>(i.ordinal)};
  char host[kHostWords * 8] = {};
  std::memcpy(host, i.host.data(), std::min(i.host.size(), sizeof(host)));
  for (size_t w = 0; w < kHostWords; ++w) {
    uint64_t x = 0;
    std::memcpy(&x, host + 8 * w, 8);
    v.push_back(x);
  }
  return v;
}

RankInfo Unpack(const uint64_t* d) {
  RankInfo i;
  i.ok = d[0] != 0;
  i.nonce = d[1];
  i.pid = d[2];
  i.backend = d[3];
  i.uuid_lo = d[4];
  i.uuid_hi = d[5];
  i.pci = d[6];
  i.ordinal = static_cast<int64_t>(d[7]);
  char host[kHostWords * 8 + 1] = {};
  std::memcpy(host, d + 8, kHostWords * 8);
  i.host = host;
  return i;
}

absl::StatusOr<std::unique_ptr<DataPlane>> CreateSharedPlane(CudaBackend& b, Communicator& group,
                                                             const std::vector<RankInfo>& infos) {
  const int n = group.size();
  if (n > kMaxReduceInputs) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "cuda data plane of group '%s': its %d ranks are threads of one process on one GPU (%s), "
        "and the shared-GPU data plane serves at most %d ranks (one reduction kernel reads every "
        "rank's buffer); use at most %d ranks per shared GPU, or give each rank its own GPU "
        "(the NCCL data plane)",
        group.name(), n, infos[0].Device(), kMaxReduceInputs, kMaxReduceInputs));
  }
  std::vector<uint64_t> ids;
  for (const RankInfo& i : infos) ids.push_back(i.backend);
  const std::string key = absl::StrCat(group.name(), "|", absl::StrJoin(ids, ","));
  std::shared_ptr<SharedGroup> shared;
  {
    std::lock_guard<std::mutex> lock(g_shared_mu);
    SharedRendezvous& entry = SharedPlanes()[key];
    if (entry.group == nullptr) entry.group = std::make_shared<SharedGroup>(group.name(), n);
    shared = entry.group;
    if (++entry.taken == n) SharedPlanes().erase(key);
  }
  shared->Join(group.rank(), FailureOf(b));
  return std::unique_ptr<DataPlane>(new SharedDeviceDataPlane(b, std::move(shared), group.rank()));
}

}  // namespace

absl::StatusOr<std::unique_ptr<DataPlane>> CreateCudaDataPlane(CudaBackend& b,
                                                               Communicator& group) {
  const std::string name = group.name();
  const int n = group.size();
  RankInfo mine;
  const absl::Status local = ReadLocalInfo(b, &mine);
  absl::StatusOr<std::vector<uint64_t>> all = internal::AllGatherU64(group, Pack(mine));
  if (!local.ok()) {
    return absl::Status(local.code(),
                        absl::StrFormat("cuda data plane of group '%s': rank %d could not read "
                                        "its CUDA device: %s",
                                        name, group.rank(), std::string(local.message())));
  }
  if (!all.ok()) {
    return absl::Status(all.status().code(),
                        absl::StrFormat("cuda data plane of group '%s': gathering the ranks' "
                                        "processes and GPUs failed: %s",
                                        name, std::string(all.status().message())));
  }
  if (all->size() != kFields * static_cast<size_t>(n)) {
    return absl::InternalError(absl::StrFormat(
        "cuda data plane of group '%s': gathered %d values, expected %d", name, all->size(),
        kFields * static_cast<size_t>(n)));
  }
  std::vector<RankInfo> infos;
  std::vector<int> unreadable;
  for (int r = 0; r < n; ++r) {
    infos.push_back(Unpack(all->data() + kFields * static_cast<size_t>(r)));
    if (!infos.back().ok) unreadable.push_back(r);
  }
  if (!unreadable.empty()) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "cuda data plane of group '%s': ranks [%s] could not read their CUDA device (their own "
        "errors say why); no data plane was made",
        name, absl::StrJoin(unreadable, ", ")));
  }

  bool one_process_one_gpu = true;
  for (const RankInfo& i : infos) {
    one_process_one_gpu = one_process_one_gpu && i.SameProcess(infos[0]) && i.SameDevice(infos[0]);
  }
  if (one_process_one_gpu) return CreateSharedPlane(b, group, infos);

  // Ranks by device, in order of first rank.
  std::vector<std::vector<int>> by_device;
  for (int r = 0; r < n; ++r) {
    auto it = std::find_if(by_device.begin(), by_device.end(),
                           [&](const std::vector<int>& d) { return infos[d[0]].SameDevice(infos[r]); });
    if (it == by_device.end()) {
      by_device.push_back({r});
    } else {
      it->push_back(r);
    }
  }
  if (by_device.size() == static_cast<size_t>(n)) return CreateNcclPlane(b, group);

  std::vector<std::string> shared;
  for (const std::vector<int>& d : by_device) {
    if (d.size() < 2) continue;
    std::vector<std::string> users;
    for (int r : d) users.push_back(absl::StrFormat("%d (process %d)", r, infos[r].pid));
    shared.push_back(absl::StrFormat("%s is used by ranks %s", infos[d[0]].Device(),
                                     absl::StrJoin(users, ", ")));
  }
  return absl::FailedPreconditionError(absl::StrFormat(
      "cuda data plane of group '%s' (%d ranks): %s. The NCCL data plane needs one GPU per rank, "
      "and the shared-GPU data plane needs every rank to be a thread of one process on one GPU; "
      "give each rank its own GPU (CudaBackendOptions::device, or CUDA_VISIBLE_DEVICES per "
      "process), or run all the ranks as threads of one process on one GPU",
      name, n, absl::StrJoin(shared, "; ")));
}

}  // namespace fsdp::cuda_internal
