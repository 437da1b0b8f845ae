// The local communicator's endpoints: each rank's Communicator numbers its calls and hands
// them to its own progress thread, which runs them one after another through the group's
// rendezvous (local_group.h). The caller returns at once with a Work handle.
#include "fsdp/local_world.h"

#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/strings/str_format.h"
#include "collectives/comm_trace.h"
#include "collectives/local/local_group.h"
#include "collectives/work_state.h"
#include "fsdp/trace.h"

namespace fsdp {
namespace internal {
namespace {

class LocalCommunicator final : public Communicator {
 public:
  // trace_rank: the world rank that the progress thread records its spans on (a split group
  // inherits its parent's).
  LocalCommunicator(std::shared_ptr<LocalGroup> group, int rank, int trace_rank)
      : group_(std::move(group)),
        rank_(rank),
        trace_rank_(trace_rank),
        thread_([this] { ProgressLoop(); }) {}

  // Runs what is queued (each call is bounded by the deadline), then stops the thread.
  ~LocalCommunicator() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

  int rank() const override { return rank_; }
  int size() const override { return group_->size(); }
  const std::string& name() const override { return group_->name(); }
  std::string_view backend() const override { return "local"; }
  const CommOptions& options() const override { return group_->options(); }

  absl::StatusOr<std::unique_ptr<Communicator>> Split(int color, int key,
                                                      std::string_view label) override {
    LocalPost post;
    post.call.kind = CollectiveKind::kSplit;
    post.color = color;
    post.key = key;
    post.label = std::string(label);
    Work work = Push(std::move(post));
    FSDP_RETURN_IF_ERROR(work.Wait());
    auto result = std::static_pointer_cast<LocalSplitResult>(work.state()->payload);
    if (result == nullptr || result->group == nullptr) return std::unique_ptr<Communicator>();
    return std::unique_ptr<Communicator>(
        new LocalCommunicator(result->group, result->rank, trace_rank_));
  }

  void Abort(const absl::Status& reason) override {
    group_->Fail(reason.ok() ? absl::AbortedError("aborted") : reason);
  }
  absl::Status health() const override { return group_->health(); }

 protected:
  Work Submit(const CollectiveCall& call, absl::Status invalid) override {
    LocalPost post;
    post.call = call;
    post.invalid = std::move(invalid);
    return Push(std::move(post));
  }

 private:
  struct Task {
    LocalPost post;
    int64_t seq;
    std::shared_ptr<WorkState> work;
  };

  Work Push(LocalPost post) {
    std::shared_ptr<WorkState> work;
    {
      std::lock_guard<std::mutex> lock(mu_);
      const int64_t seq = next_seq_++;
      work = std::make_shared<WorkState>(
          absl::StrFormat("%s at sequence %d of group '%s'", DescribeCall(post.call), seq,
                          group_->name()),
          group_->options().timeout);
      // The hook holds the group, not this communicator: a Work may outlive its communicator.
      std::weak_ptr<WorkState> weak = work;
      work->set_on_expire([group = group_, rank = rank_, seq, weak](absl::Duration waited) {
        if (auto w = weak.lock()) group->ExpireWait(rank, seq, w->description(), waited);
      });
      group_->NoteIssued(rank_, seq);
      queue_.push_back(Task{std::move(post), seq, work});
    }
    cv_.notify_one();
    return Work(std::move(work));
  }

  void ProgressLoop() {
    SetTraceRank(trace_rank_);
    for (;;) {
      Task task;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stopping, and nothing left to run
        task = std::move(queue_.front());
        queue_.pop_front();
      }
      LocalSplitResult split;
      Tracer& tracer = Tracer::Global();
      const bool trace = tracer.enabled();
      const int64_t begin_ns = trace ? tracer.NowNs() : 0;
      int64_t peer_wait_ns = -1;
      absl::Status status =
          group_->Run(rank_, task.seq, task.post, &split, trace ? &peer_wait_ns : nullptr);
      if (trace) {
        RecordCollectiveSpan(task.post.call, group_->name(), group_->size(), task.seq, begin_ns,
                             tracer.NowNs(), peer_wait_ns, status);
      }
      if (status.ok() && task.post.call.kind == CollectiveKind::kSplit) {
        task.work->payload = std::make_shared<LocalSplitResult>(std::move(split));
      }
      task.work->Complete(std::move(status));
    }
  }

  const std::shared_ptr<LocalGroup> group_;
  const int rank_;
  const int trace_rank_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Task> queue_;
  bool stopping_ = false;
  int64_t next_seq_ = 0;
  std::thread thread_;  // last: starts once the members above exist
};

}  // namespace

absl::Status CheckHostLevel(const CommOptions& options, int size, std::string_view who) {
  if (options.ranks_per_host < 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: CommOptions::ranks_per_host must be >= 0 (0 = one level of simulated link), got %d",
        who, options.ranks_per_host));
  }
  if (options.inter_host_bytes_per_second < 0 ||
      options.inter_host_latency < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: the simulated link between hosts needs inter_host_bytes_per_second >= 0 and "
        "inter_host_latency >= 0, got %g bytes/s and %s",
        who, options.inter_host_bytes_per_second,
        absl::FormatDuration(options.inter_host_latency)));
  }
  const bool inter_figures = options.inter_host_bytes_per_second > 0 ||
                             options.inter_host_latency > absl::ZeroDuration();
  if (options.ranks_per_host == 0 && inter_figures) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: inter_host_bytes_per_second / inter_host_latency are set but ranks_per_host is 0; "
        "set ranks_per_host to the number of ranks that share a host (a divisor of the world "
        "size %d), or leave the inter-host figures at 0",
        who, size));
  }
  if (options.ranks_per_host > 0 && size % options.ranks_per_host != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: ranks_per_host %d does not divide the world size %d; every host holds the same "
        "number of ranks, so use a divisor of %d (or 0 for one level of simulated link)",
        who, options.ranks_per_host, size, size));
  }
  return absl::OkStatus();
}

}  // namespace internal

LocalWorld::LocalWorld(int size, std::shared_ptr<internal::LocalGroup> group)
    : size_(size), group_(std::move(group)), taken_(new bool[size]()) {}

LocalWorld::~LocalWorld() = default;

absl::StatusOr<std::unique_ptr<LocalWorld>> LocalWorld::Create(int size, CommOptions options,
                                                            std::string name) {
  if (size < 1 || size > 4096) {
    return absl::InvalidArgumentError(
        absl::StrFormat("LocalWorld: size must be in [1, 4096], got %d", size));
  }
  if (options.timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "LocalWorld: timeout must be > 0, got %s", absl::FormatDuration(options.timeout)));
  }
  if (options.link_bytes_per_second < 0 || options.link_latency < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("LocalWorld: the simulated link needs bandwidth >= 0 and latency >= 0");
  }
  FSDP_RETURN_IF_ERROR(internal::CheckHostLevel(options, size, "LocalWorld"));
  auto group = std::make_shared<internal::LocalGroup>(std::move(name), size, options);
  return std::unique_ptr<LocalWorld>(new LocalWorld(size, std::move(group)));
}

absl::StatusOr<std::unique_ptr<Communicator>> LocalWorld::TakeRank(int rank) {
  if (rank < 0 || rank >= size_) {
    return absl::InvalidArgumentError(
        absl::StrFormat("LocalWorld::TakeRank: rank %d is not in [0, %d)", rank, size_));
  }
  if (taken_[rank]) {
    return absl::FailedPreconditionError(
        absl::StrFormat("LocalWorld::TakeRank: rank %d was already taken", rank));
  }
  taken_[rank] = true;
  return std::unique_ptr<Communicator>(new internal::LocalCommunicator(group_, rank, rank));
}

absl::Status LocalWorld::Run(int size, const CommOptions& options,
                             const std::function<absl::Status(Communicator&)>& body) {
  FSDP_ASSIGN_OR_RETURN(std::unique_ptr<LocalWorld> world, Create(size, options));
  std::vector<std::unique_ptr<Communicator>> comms(size);
  for (int r = 0; r < size; ++r) {
    FSDP_ASSIGN_OR_RETURN(comms[r], world->TakeRank(r));
  }
  std::vector<absl::Status> results(size);
  std::vector<std::thread> threads;
  threads.reserve(size);
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      SetTraceRank(r);
      results[r] = body(*comms[r]);
    });
  }
  for (std::thread& t : threads) t.join();
  for (const absl::Status& s : results) FSDP_RETURN_IF_ERROR(s);
  return absl::OkStatus();
}

}  // namespace fsdp
