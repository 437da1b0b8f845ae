// The mpi communicator's front end: numbers each call, hands it to the MPI engine thread
// (mpi_engine.h) and returns a Work handle.
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string_view>
#include <future>

#include "absl/strings/str_format.h"
#include "collectives/mpi/mpi_engine.h"
#include "fsdp/mpi_world.h"

namespace fsdp {
namespace internal {
namespace {

class MpiCommunicator final : public Communicator {
 public:
  explicit MpiCommunicator(std::shared_ptr<MpiGroup> group) : group_(std::move(group)) {}

  // Lets the calls in flight finish (each is bounded by its deadline), then frees the group.
  ~MpiCommunicator() override {
    auto closed = std::make_shared<std::promise<void>>();
    auto f = closed->get_future();
    if (MpiEngine::Get().Post(
            [g = group_, closed] { g->BeginClose([closed] { closed->set_value(); }); })) {
      f.wait();
    }
  }

  int rank() const override { return group_->rank(); }
  int size() const override { return group_->size(); }
  const std::string& name() const override { return group_->name(); }
  std::string_view backend() const override { return "mpi"; }
  const CommOptions& options() const override { return group_->options(); }

  absl::StatusOr<std::unique_ptr<Communicator>> Split(int color, int key,
                                                      std::string_view label) override {
    auto op = std::make_shared<MpiOp>();
    op->call = {.kind = CollectiveKind::kSplit};
    op->color = color;
    op->key = key;
    op->label = std::string(label);
    Work work = Push(std::move(op));
    FSDP_RETURN_IF_ERROR(work.Wait());
    auto result = std::static_pointer_cast<MpiSplitPayload>(work.state()->payload);
    if (result == nullptr || result->group == nullptr) return std::unique_ptr<Communicator>();
    return std::unique_ptr<Communicator>(new MpiCommunicator(result->group));
  }

  void Abort(const absl::Status& reason) override {
    absl::Status r = reason.ok() ? absl::AbortedError("aborted") : reason;
    MpiEngine::Get().Post([g = group_, r] { g->Fail(r, -1, true); });
  }
  absl::Status health() const override { return group_->health(); }
  const std::shared_ptr<MpiGroup>& group() const { return group_; }

 protected:
  Work Submit(const CollectiveCall& call, absl::Status invalid) override {
    if (invalid.ok() && call.count > INT_MAX) {
      invalid = absl::InvalidArgumentError(absl::StrFormat(
          "%s on rank %d: the mpi communicator takes at most %d elements per call",
          DescribeCall(call), rank(), INT_MAX));
    }
    auto op = std::make_shared<MpiOp>();
    op->call = call;
    op->invalid = std::move(invalid);
    return Push(std::move(op));
  }

 private:
  Work Push(std::shared_ptr<MpiOp> op) {
    std::lock_guard<std::mutex> lock(mu_);  // sequence order == engine queue order
    op->seq = next_seq_++;
    op->work = std::make_shared<WorkState>(
        absl::StrFormat("%s at sequence %d of group '%s'", DescribeCall(op->call), op->seq,
                        group_->name()),
        group_->options().timeout);
    const int64_t seq = op->seq;
    op->work->set_on_expire([g = group_, seq](absl::Duration waited) {
      MpiEngine::Get().Post([g, seq, waited] { g->Expire(seq, waited); });
    });
    group_->NoteIssued(seq);
    Work work(op->work);
    auto w = op->work;
    if (!MpiEngine::Get().Post([g = group_, op = std::move(op)]() mutable { g->Add(std::move(op)); })) {
      w->Complete(absl::FailedPreconditionError(w->description() + ": MPI was shut down"));
    }
    return work;
  }

  const std::shared_ptr<MpiGroup> group_;
  std::mutex mu_;
  int64_t next_seq_ = 0;
};

}  // namespace
}  // namespace internal

bool MpiBuilt() { return true; }

namespace {

absl::StatusOr<std::unique_ptr<Communicator>> CreateOver(MPI_Comm base, CommOptions options) {
  if (options.timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "CreateMpiWorld: timeout must be > 0, got %s", absl::FormatDuration(options.timeout)));
  }
  FSDP_ASSIGN_OR_RETURN(const bool shm, MpiSharedMemoryFromEnv());
  if (!shm) options.mpi_shared_memory = false;
  auto& engine = internal::MpiEngine::Get();
  FSDP_RETURN_IF_ERROR(engine.Start());
  auto result = std::make_shared<std::promise<absl::StatusOr<std::shared_ptr<internal::MpiGroup>>>>();
  auto f = result->get_future();
  const bool posted = engine.Post([&engine, base, options, result] {
    engine.DupAsync(base, options.timeout, [&engine, options, result](absl::Status s, MPI_Comm c[3],
                                                           uint64_t epoch) {
      if (!s.ok()) {
        result->set_value(std::move(s));
        return;
      }
      auto g = std::make_shared<internal::MpiGroup>("world", options, c[0], c[1], c[2],
                                                    epoch);
      engine.AddGroup(g);
      result->set_value(std::move(g));
    });
  });
  if (!posted) return absl::FailedPreconditionError("CreateMpiWorld: MPI was shut down");
  FSDP_ASSIGN_OR_RETURN(std::shared_ptr<internal::MpiGroup> group, f.get());
  return std::unique_ptr<Communicator>(new internal::MpiCommunicator(std::move(group)));
}

}  // namespace

absl::StatusOr<std::unique_ptr<Communicator>> CreateMpiWorld(CommOptions options) {
  return CreateOver(MPI_COMM_WORLD, options);
}

absl::StatusOr<std::unique_ptr<Communicator>> CreateMpiWorldFrom(const void* mpi_comm,
                                                                 CommOptions options) {
  if (mpi_comm == nullptr) {
    return absl::InvalidArgumentError("CreateMpiWorldFrom: mpi_comm is NULL; pass &comm");
  }
  MPI_Comm base;
  std::memcpy(&base, mpi_comm, sizeof base);
  if (base == MPI_COMM_NULL) {
    return absl::InvalidArgumentError(
        "CreateMpiWorldFrom: the communicator is MPI_COMM_NULL (a process outside the split?)");
  }
  return CreateOver(base, options);
}

std::string MpiDataPath(const Communicator& comm) {
  const auto* mpi = dynamic_cast<const internal::MpiCommunicator*>(&comm);
  if (mpi == nullptr) return {};
  std::string path = "undecided";
  internal::MpiEngine::Get().RunSync([&] { path = mpi->group()->transport_name(); }).IgnoreError();
  return path;
}

absl::Status RunOnMpiThread(const std::function<void()>& fn) {
  auto& engine = internal::MpiEngine::Get();
  FSDP_RETURN_IF_ERROR(engine.Start());
  return engine.RunSync(fn);
}

void ShutdownMpi() { internal::MpiEngine::Get().Shutdown(); }

int FinishMpi(const absl::Status& status, std::string_view program) {
  auto& engine = internal::MpiEngine::Get();
  absl::Status s = status;
  if (s.ok()) s = engine.Health();
  if (s.ok()) {
    ShutdownMpi();
    return 0;
  }
  std::fprintf(stderr, "%.*s: [rank %d] %s\n", static_cast<int>(program.size()), program.data(),
               engine.world_rank(), s.ToString().c_str());
  std::fflush(stderr);
  std::fflush(stdout);
  engine.Abort(1);
}

}  // namespace fsdp
