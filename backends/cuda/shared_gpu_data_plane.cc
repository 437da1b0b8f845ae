// The shared-GPU data plane of the cuda backend: ranks as threads of one process on one GPU
// (cuda_data_plane.cc chooses it).
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
#include "backends/common/rendezvous.h"
#include "backends/cuda/cuda_data_plane_common.h"
#include "backends/cuda/cuda_internal.h"
#include "collectives/control.h"
#include "kernels/cuda/kernels.h"
namespace fsdp::cuda_internal {
namespace {

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
    std::vector<std::string> calls;
    for (int q = 0; q < size_; ++q) calls.push_back(DescribeCall(s.posts[q].call));
    s.verdict = ScheduleMismatch(seq, name_, calls, " (cuda shared-GPU data plane)");
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

class SharedDeviceDataPlane final : public DataPlane {
 public:
  SharedDeviceDataPlane(CudaBackend& b, std::shared_ptr<SharedGroup> group, int rank)
      : DataPlane(&b, "cuda shared-GPU"),
        b_(b),
        group_(std::move(group)),
        rank_(rank),
        timeout_(b.options().data_plane.timeout) {}

  int rank() const override { return rank_; }
  int size() const override { return group_->size(); }
  const std::string& name() const override { return group_->name(); }

  void Abort(const absl::Status& reason) override { group_->Fail(reason, -1); }

 private:
  absl::StatusOr<Event> EnqueueAllGather(View send, View recv, Stream after) override {
    return Call(CollectiveKind::kAllGather, send, recv, ReduceOp::kSum, after, absl::OkStatus());
  }
  absl::StatusOr<Event> EnqueueReduceScatter(View send, View recv, ReduceOp op,
                                             Stream after) override {
    return Call(CollectiveKind::kReduceScatter, send, recv, op, after, absl::OkStatus());
  }
  absl::StatusOr<Event> EnqueueAllReduce(View send, View recv, ReduceOp op,
                                         Stream after) override {
    return Call(CollectiveKind::kAllReduce, send, recv, op, after, absl::OkStatus());
  }
  absl::StatusOr<Event> EnqueueAllToAll(View send, View recv, Stream after) override {
    return Call(CollectiveKind::kAllToAll, send, recv, ReduceOp::kSum, after, absl::OkStatus());
  }
  // An invalid call is posted like a valid one, so that every rank fails at once with its reason
  // instead of waiting for this one until the deadline.
  absl::StatusOr<Event> Rejected(CollectiveKind kind, View send, View recv, ReduceOp op,
                                 Stream after, absl::Status why) override {
    return Call(kind, send, recv, op, after, std::move(why));
  }

  static int KernelDtype(DType d) { return d == DType::kF32 ? 0 : d == DType::kBF16 ? 1 : 2; }
  static int KernelOp(ReduceOp op) { return op == ReduceOp::kSum ? 0 : op == ReduceOp::kAvg ? 1 : 2; }

  absl::StatusOr<Event> Call(CollectiveKind kind, View send, View recv, ReduceOp op,
                             Stream after, absl::Status invalid) {
    std::lock_guard<std::mutex> serial(call_mu_);
    const int n = size();
    const int me = rank_;
    CollectiveCall call = MakeCall(kind, send, recv, op, size());
    const int64_t seq = seq_++;
    const std::string what =
        absl::StrFormat("%s (cuda shared-GPU data plane)", Where(call, seq, name()));

    SharedPost post;
    post.invalid = invalid.ok() ? CheckCall(send, recv, me, n, &call) : std::move(invalid);
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
      if (kind == CollectiveKind::kAllGather || kind == CollectiveKind::kAllToAll) {
        // all_to_all: chunk `me` of every rank's send (never in place).
        const size_t from = kind == CollectiveKind::kAllToAll ? static_cast<size_t>(me) * bytes : 0;
        for (int q = 0; q < n; ++q) {
          const void* src = static_cast<const char*>(posts[q].call.send) + from;
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

}  // namespace

absl::StatusOr<std::unique_ptr<DataPlane>> CreateSharedPlane(CudaBackend& b, Communicator& group,
                                                             const std::string& device,
                                                             const std::vector<uint64_t>& backend_ids) {
  const int n = group.size();
  if (n > kMaxReduceInputs) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "cuda data plane of group '%s': its %d ranks are threads of one process on one GPU (%s), "
        "and the shared-GPU data plane serves at most %d ranks (one reduction kernel reads every "
        "rank's buffer); use at most %d ranks per shared GPU, or give each rank its own GPU "
        "(the NCCL data plane)",
        group.name(), n, device, kMaxReduceInputs, kMaxReduceInputs));
  }
  // The ranks of the group meet (backends/common/rendezvous.h) to share one SharedGroup.
  const std::string key =
      absl::StrCat("cuda shared-GPU|", group.name(), "|", absl::StrJoin(backend_ids, ","));
  FSDP_ASSIGN_OR_RETURN(
      std::shared_ptr<SharedGroup> shared,
      backend_kit::Rendezvous<SharedGroup>::Join<std::shared_ptr<SharedGroup>>(
          key, n,
          [&]() -> absl::StatusOr<std::unique_ptr<SharedGroup>> {
            return std::make_unique<SharedGroup>(group.name(), n);
          },
          [](const std::shared_ptr<SharedGroup>& g) -> absl::StatusOr<std::shared_ptr<SharedGroup>> {
            return g;
          }));
  shared->Join(group.rank(), FailureOf(b));
  return std::unique_ptr<DataPlane>(new SharedDeviceDataPlane(b, std::move(shared), group.rank()));
}

}  // namespace fsdp::cuda_internal
