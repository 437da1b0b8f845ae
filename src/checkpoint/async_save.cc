// AsyncCheckpointer (fsdp/checkpoint.h): a save that does not stop training. Save() takes the
// rank's shards to host memory (the snapshot) and hands them to a writer thread, which runs
// SaveCheckpoint's protocol (sharded_save.h: write, fsync, checksum, metadata and COMMIT after
// every rank's files are durable, rename) over the writers' own group, split from the world at
// Create, so that its agreements never interleave with training's collectives.
#include <chrono>
#include <cstdio>
#include <condition_variable>
#include <mutex>
#include <new>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/time.h"
#include "fsdp/checkpoint.h"
#include "src/checkpoint/rank_sync.h"
#include "src/checkpoint/sharded_save.h"

namespace fsdp {
namespace {

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// This rank's shard data and what else the checkpoint records, as of one step.
struct Snapshot {
  checkpoint::SaveLayout layout;
  std::vector<std::vector<std::vector<float>>> data;  // [unit][copy]: params, then states
};

}  // namespace

struct AsyncCheckpointer::State {
  ShardingRuntime* rt = nullptr;
  AsyncSaveOptions options;
  std::unique_ptr<Communicator> writers;  // the world's ranks, for the writer threads only
  std::thread writer;
  mutable std::mutex mu;
  std::condition_variable cv;
  bool running = false;
  bool shut = false;
  std::string running_dir;
  std::vector<AsyncSaveResult> finished;  // since the last TakeFinished
  std::optional<AsyncSaveResult> last;    // the latest finished save
  uint64_t snapshot_bytes = 0;
};

absl::StatusOr<std::unique_ptr<AsyncCheckpointer>> AsyncCheckpointer::Create(
    ShardingRuntime& runtime, const AsyncSaveOptions& options) {
  Communicator& world = runtime.world();
  FSDP_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> writers,
                        world.Split(0, world.rank(), "checkpoint"));
  auto state = std::make_unique<State>();
  state->rt = &runtime;
  state->options = options;
  state->writers = std::move(writers);
  absl::StatusOr<checkpoint::SaveLayout> layout = checkpoint::TakeSaveLayout(runtime, {});
  FSDP_RETURN_IF_ERROR(AgreeOnStatus(world, layout.status()));
  state->snapshot_bytes = layout->shard_data_bytes();
  return std::unique_ptr<AsyncCheckpointer>(new AsyncCheckpointer(std::move(state)));
}

AsyncCheckpointer::AsyncCheckpointer(std::unique_ptr<State> state) : s_(std::move(state)) {}

AsyncCheckpointer::~AsyncCheckpointer() {
  absl::Status s = Shutdown(s_->options.shutdown_deadline);
  if (!s.ok()) std::fprintf(stderr, "libfsdp: %s\n", std::string(s.message()).c_str());
}

uint64_t AsyncCheckpointer::snapshot_bytes() const { return s_->snapshot_bytes; }

bool AsyncCheckpointer::in_flight() const {
  std::lock_guard<std::mutex> lock(s_->mu);
  return s_->running;
}

std::vector<AsyncSaveResult> AsyncCheckpointer::TakeFinished() {
  std::lock_guard<std::mutex> lock(s_->mu);
  std::vector<AsyncSaveResult> out = std::move(s_->finished);
  s_->finished.clear();
  return out;
}

absl::Status AsyncCheckpointer::Wait(absl::Duration deadline) {
  std::unique_lock<std::mutex> lock(s_->mu);
  const auto done = [&] { return !s_->running; };
  if (deadline == absl::InfiniteDuration()) {
    s_->cv.wait(lock, done);
  } else if (!s_->cv.wait_for(lock, absl::ToChronoNanoseconds(deadline), done)) {
    return absl::DeadlineExceededError(absl::StrCat(
        "the background save of ", s_->running_dir, " is still being written after ",
        absl::FormatDuration(deadline), " (a slow or stopped file system, or a rank whose "
        "writer stopped); the previous checkpoint is intact"));
  }
  lock.unlock();
  if (s_->writer.joinable()) s_->writer.join();
  lock.lock();
  return s_->last.has_value() ? s_->last->status : absl::OkStatus();
}

absl::Status AsyncCheckpointer::Shutdown(absl::Duration deadline) {
  {
    std::lock_guard<std::mutex> lock(s_->mu);
    if (s_->shut) return absl::OkStatus();
    s_->shut = true;
  }
  absl::Status waited = Wait(deadline);
  if (absl::IsDeadlineExceeded(waited)) {
    // The writer's exchanges fail at once; its file writes end as they end. The temporary
    // directory stays behind, as after a crash, and the next save or start-up removes it.
    s_->writers->Abort(waited);
    if (s_->writer.joinable()) s_->writer.join();
    return waited;
  }
  return absl::OkStatus();
}

absl::StatusOr<AsyncSaveStart> AsyncCheckpointer::Save(const std::string& dir,
                                                      const TrainingState& state,
                                                      const SaveOptions& options) {
  using namespace checkpoint;  // NOLINT: the save protocol's halves
  ShardingRuntime& rt = *s_->rt;
  Communicator& world = rt.world();
  const auto start = Clock::now();
  {
    std::lock_guard<std::mutex> lock(s_->mu);
    if (s_->shut) {
      return absl::FailedPreconditionError("AsyncCheckpointer::Save after Shutdown");
    }
  }
  // At most one save in flight: the ranks agree whether any writer is still busy, so that they
  // all skip, or all wait, alike.
  const float mine = in_flight() ? 1.0f : 0.0f;
  float busy = 0;
  FSDP_RETURN_IF_ERROR(world.AllReduce(&mine, &busy, 1, DType::kF32, ReduceOp::kMax));
  if (busy != 0.0f) {
    if (s_->options.skip_when_busy) return AsyncSaveStart::kSkipped;
    Wait().IgnoreError();  // its outcome is reported by TakeFinished
  }
  if (s_->writer.joinable()) s_->writer.join();

  // The snapshot: bounded, allocated before anything is copied, agreed.
  absl::StatusOr<SaveLayout> layout = TakeSaveLayout(rt, state);
  auto snapshot = std::make_unique<Snapshot>();
  absl::Status local = layout.status();
  if (local.ok()) {
    const uint64_t bytes = layout->shard_data_bytes();
    if (s_->options.max_snapshot_bytes > 0 && bytes > s_->options.max_snapshot_bytes) {
      local = absl::ResourceExhaustedError(absl::StrCat(
          "not saving ", dir, ": the snapshot of rank ", world.rank(), "'s shards takes ", bytes,
          " bytes of host memory, more than AsyncSaveOptions::max_snapshot_bytes (",
          s_->options.max_snapshot_bytes, " bytes); nothing was copied or written"));
    } else {
      try {
        snapshot->data.resize(layout->units.size());
        for (size_t u = 0; u < layout->units.size(); ++u) {
          if (!layout->writes_tensors) break;
          snapshot->data[u].assign(1 + layout->state_names.size(),
                                   std::vector<float>(layout->units[u].data_numel));
        }
      } catch (const std::bad_alloc&) {
        snapshot->data.clear();
        local = absl::ResourceExhaustedError(absl::StrCat(
            "not saving ", dir, ": no host memory for the snapshot of rank ", world.rank(),
            "'s shards (", bytes, " bytes); nothing was copied or written"));
      }
    }
  }
  FSDP_RETURN_IF_ERROR(AgreeOnStatus(world, local));
  snapshot->layout = *std::move(layout);
  const SaveLayout& l = snapshot->layout;
  ShardSource device = DeviceShardSource(rt);
  for (size_t u = 0; u < l.units.size() && local.ok() && l.writes_tensors; ++u) {
    for (size_t j = 0; j < snapshot->data[u].size() && local.ok(); ++j) {
      std::vector<float>& to = snapshot->data[u][j];
      if (to.empty()) continue;
      absl::StatusOr<const float*> from =
          device(static_cast<int>(u), static_cast<int>(j), static_cast<int64_t>(to.size()), to);
      local = from.status();
    }
  }
  FSDP_RETURN_IF_ERROR(AgreeOnStatus(world, local));
  const double snapshot_seconds = SecondsSince(start);

  {
    std::lock_guard<std::mutex> lock(s_->mu);
    s_->running = true;
    s_->running_dir = dir;
  }
  State* s = s_.get();
  s_->writer = std::thread([s, dir, options, snapshot_seconds,
                            snap = std::shared_ptr<Snapshot>(std::move(snapshot))]() mutable {
    const auto begin = Clock::now();
    ShardSource source = [&snap](int u, int j, int64_t n,
                                 std::vector<float>&) -> absl::StatusOr<const float*> {
      return snap->data[u][j].data();
    };
    absl::Status status = WriteCheckpoint(*s->writers, snap->layout, source, dir, options);
    AsyncSaveResult result{dir, std::move(status), snapshot_seconds, SecondsSince(begin)};
    snap.reset();  // the host memory goes back before the next save is allowed
    std::lock_guard<std::mutex> lock(s->mu);
    s->finished.push_back(result);
    s->last = std::move(result);
    s->running = false;
    s->cv.notify_all();
  });
  return AsyncSaveStart::kStarted;
}

}  // namespace fsdp
