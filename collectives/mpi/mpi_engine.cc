// The engine thread of the mpi communicator (MpiEngine, mpi_engine.h): MPI's initialization and
// shutdown, the commands posted to it, communicator duplication, and the loop that polls every
// group's calls (their state machine is in mpi_group.cc).
#include "collectives/mpi/mpi_engine.h"

#include <algorithm>
#include <future>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "fsdp/trace.h"

namespace fsdp::internal {

// ----------------------------------------------------------------------------- MpiEngine

MpiEngine& MpiEngine::Get() {
  static MpiEngine engine;
  return engine;
}

absl::Status MpiEngine::Start() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (shut_) return absl::FailedPreconditionError("MPI was shut down (ShutdownMpi)");
  }
  std::call_once(once_, [this] {
    auto started = std::make_shared<std::promise<absl::Status>>();
    auto result = started->get_future();
    thread_ = std::thread([this, started] {
      int initialized = 0;
      MPI_Initialized(&initialized);
      absl::Status status;
      if (!initialized) {
        int provided = MPI_THREAD_SINGLE;
        const int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
        if (rc != MPI_SUCCESS) {
          status = absl::InternalError("MPI_Init_thread failed: " + MpiErrorString(rc));
        } else {
          we_initialized_ = true;
          thread_multiple_ = provided >= MPI_THREAD_MULTIPLE;
          // This thread initialized MPI and is the only one that calls it: FUNNELED suffices.
          if (provided < MPI_THREAD_FUNNELED) {
            status = absl::FailedPreconditionError(absl::StrFormat(
                "MPI provides thread level %d; libfsdp needs MPI_THREAD_FUNNELED or higher", provided));
          }
        }
      } else {
        int provided = MPI_THREAD_SINGLE;
        MPI_Query_thread(&provided);
        thread_multiple_ = provided >= MPI_THREAD_MULTIPLE;
        if (provided < MPI_THREAD_SERIALIZED) {
          status = absl::FailedPreconditionError(absl::StrFormat(
              "MPI was initialized with thread level %d; libfsdp calls MPI from its own thread and "
              "needs MPI_THREAD_SERIALIZED (MPI_THREAD_MULTIPLE if you also call MPI yourself)",
              provided));
        }
      }
      if (status.ok()) {  // the engine's spans belong to this process's world rank
        int world_rank = 0;
        MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
        SetTraceRank(world_rank);
        world_rank_.store(world_rank);
      }
      start_status_ = status;
      started->set_value(status);
      if (status.ok()) Loop();
      if (we_initialized_) MPI_Finalize();
    });
    result.wait();
    if (!result.get().ok()) thread_.join();
  });
  return start_status_;
}

bool MpiEngine::Post(std::function<void()> cmd) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_ || !thread_.joinable()) return false;
    cmds_.push_back(std::move(cmd));
  }
  cv_.notify_one();
  return true;
}

absl::Status MpiEngine::RunSync(const std::function<void()>& fn) {
  auto done = std::make_shared<std::promise<void>>();
  auto f = done->get_future();
  if (!Post([&fn, done] {
        fn();
        done->set_value();
      })) {
    return absl::FailedPreconditionError("the MPI engine is not running (ShutdownMpi was called)");
  }
  f.wait();
  return absl::OkStatus();
}

void MpiEngine::Shutdown() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (shut_) return;
    shut_ = true;
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

absl::Status MpiEngine::Health() {
  absl::Status health;
  const absl::Status ran = RunSync([&] {
    for (const auto& g : groups_) {
      absl::Status h = g->health();
      if (!h.ok() && health.ok()) health = h;
    }
  });
  return ran.ok() ? health : absl::OkStatus();  // not running: no group to wait for
}

void MpiEngine::Abort(int code) {
  auto done = std::make_shared<std::promise<void>>();
  auto f = done->get_future();
  if (Post([code] { MPI_Abort(MPI_COMM_WORLD, code); })) {
    f.wait_for(std::chrono::seconds(5));
  }
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized) MPI_Abort(MPI_COMM_WORLD, code);
  std::_Exit(code);
}

void MpiEngine::AddGroup(std::shared_ptr<MpiGroup> group) {
  group->Open();
  groups_.push_back(std::move(group));
}

void MpiEngine::DupAsync(MPI_Comm parent, absl::Duration timeout,
                         std::function<void(absl::Status, MPI_Comm[3], uint64_t)> done) {
  auto d = std::make_unique<PendingDup>();
  d->parent = parent;
  d->until = Clock::now() + absl::ToChronoNanoseconds(timeout);
  d->timeout = timeout;
  d->done = std::move(done);
  // Behind an earlier join still in flight, this one starts when that one ends (PollAll).
  if (dups_.empty() && !StartNextDup(*d)) return;
  dups_.push_back(std::move(d));
}

bool MpiEngine::StartNextDup(PendingDup& d) {
  const int i = d.next++;
  int rc = MPI_SUCCESS;
  if (i < 3) {
    rc = MPI_Comm_idup(d.parent, &d.comms[i], &d.reqs[i]);
  } else {
    d.epoch_mine = NewToken();
    rc = MPI_Iallreduce(&d.epoch_mine, &d.epoch, 1, MPI_UINT64_T, MPI_BXOR, d.comms[0], &d.reqs[i]);
  }
  if (rc == MPI_SUCCESS) return true;
  for (int j = 0; j < std::min(i, 3); ++j) MPI_Comm_free(&d.comms[j]);
  d.done(absl::InternalError(absl::StrCat(i < 3 ? "MPI_Comm_idup" : "MPI_Iallreduce",
                                          " failed: ", MpiErrorString(rc))),
         d.comms, 0);
  return false;
}

MpiGroup::Activity MpiEngine::PollAll() {
  MpiGroup::Activity act = MpiGroup::Activity::kIdle;
  const auto now = Clock::now();
  // The front join is the one in flight (one MPI_Comm_idup at a time, see DupAsync).
  while (!dups_.empty()) {
    PendingDup& d = *dups_.front();
    if (d.next == 0 && !StartNextDup(d)) {  // queued behind a join that has ended
      dups_.pop_front();
      continue;
    }
    int flag = 0;
    MPI_Test(&d.reqs[d.next - 1], &flag, MPI_STATUS_IGNORE);
    if (flag && d.next < 4) {
      if (!StartNextDup(d)) dups_.pop_front();
      continue;
    }
    if (flag) {
      d.done(absl::OkStatus(), d.comms, d.epoch);
      dups_.pop_front();
      continue;
    }
    if (now >= d.until) {
      d.done(absl::DeadlineExceededError(absl::StrFormat(
                 "CreateMpiWorld: not every process of MPI_COMM_WORLD joined within %s",
                 absl::FormatDuration(d.timeout))),
             d.comms, 0);
      dup_orphans_.push_back(std::move(dups_.front()));
      dups_.pop_front();
      continue;
    }
    act = MpiGroup::Activity::kStalled;
    break;
  }
  // By index: a split adds its new group while this loop runs.
  for (size_t i = 0; i < groups_.size(); ++i) {
    const std::shared_ptr<MpiGroup> g = groups_[i];
    act = std::max(act, g->Poll(*this));
  }
  for (const auto& g : groups_) {
    if (!g->closed()) continue;
    orphans_.insert(orphans_.end(), g->orphans_.begin(), g->orphans_.end());
    g->orphans_.clear();
  }
  std::erase_if(groups_, [](const auto& g) { return g->closed(); });
  std::erase_if(orphans_, [](const auto& op) { return TestOrphan(*op); });
  return act;
}

void MpiEngine::Loop() {
  MpiGroup::Activity act = MpiGroup::Activity::kIdle;
  for (;;) {
    std::deque<std::function<void()>> cmds;
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (cmds_.empty() && !stop_) {
        switch (act) {
          case MpiGroup::Activity::kBusy:
            lock.unlock();
            std::this_thread::yield();
            lock.lock();
            break;
          case MpiGroup::Activity::kWaiting:
            cv_.wait_for(lock, std::chrono::microseconds(50));
            break;
          case MpiGroup::Activity::kStalled:
            cv_.wait_for(lock, std::chrono::milliseconds(1));
            break;
          case MpiGroup::Activity::kIdle:
            // Diagnostic queries from peers still need answers: wake up now and then.
            if (groups_.empty()) {
              cv_.wait(lock, [&] { return stop_ || !cmds_.empty(); });
            } else {
              cv_.wait_for(lock, std::chrono::milliseconds(2));
            }
            break;
        }
      }
      cmds.swap(cmds_);
      if (stop_ && cmds.empty()) break;
    }
    for (auto& c : cmds) c();
    act = PollAll();
  }
  for (auto& g : groups_) {
    g->CloseNow();
    orphans_.insert(orphans_.end(), g->orphans_.begin(), g->orphans_.end());
  }
  groups_.clear();  // orphans_ stays until the engine is destroyed, after MPI_Finalize
}

}  // namespace fsdp::internal
