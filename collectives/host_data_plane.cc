// The data plane of a host backend: the group's Communicator moves the buffers' host bytes.
// A host backend runs its streams synchronously, so the data is ready when a collective is
// issued; the collective runs on the communicator's own thread and its Work is the event.
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "collectives/work_state.h"
#include "fsdp/communicator.h"
#include "fsdp/data_plane.h"

namespace fsdp {
namespace {

class WorkEvent final : public EventState {
 public:
  explicit WorkEvent(Work work) : work_(std::move(work)) {}
  bool Done() const override { return work_.Test(); }
  absl::Status Wait() override { return work_.Wait(); }
  std::optional<std::chrono::steady_clock::time_point> completed_at() const override {
    return work_.completed_at();
  }

 private:
  Work work_;
};

class HostDataPlane final : public DataPlane {
 public:
  HostDataPlane(Backend* backend, Communicator& group) : backend_(backend), group_(group) {}
  int rank() const override { return group_.rank(); }
  int size() const override { return group_.size(); }
  const std::string& name() const override { return group_.name(); }

  absl::StatusOr<Event> AllGather(View send, View recv, Stream) override {
    FSDP_RETURN_IF_ERROR(Check(send, recv, "AllGather"));
    return Wrap(group_.AllGatherAsync(ConstBufferView{send.host(), send.count, send.dtype},
                                      BufferView{recv.host(), recv.count, recv.dtype}));
  }
  absl::StatusOr<Event> ReduceScatter(View send, View recv, ReduceOp op, Stream) override {
    FSDP_RETURN_IF_ERROR(Check(send, recv, "ReduceScatter"));
    return Wrap(group_.ReduceScatterAsync(ConstBufferView{send.host(), send.count, send.dtype},
                                          BufferView{recv.host(), recv.count, recv.dtype}, op));
  }
  absl::StatusOr<Event> AllReduce(View send, View recv, ReduceOp op, Stream) override {
    FSDP_RETURN_IF_ERROR(Check(send, recv, "AllReduce"));
    return Wrap(group_.AllReduceAsync(ConstBufferView{send.host(), send.count, send.dtype},
                                      BufferView{recv.host(), recv.count, recv.dtype}, op));
  }
  void Abort(const absl::Status& reason) override { group_.Abort(reason); }

 private:
  absl::Status Check(const View& send, const View& recv, const char* what) const {
    for (const View* v : {&send, &recv}) {
      if (v->count > 0 && (v->backend != backend_ || v->host() == nullptr)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "host data plane '", group_.name(), "' ", what,
            ": a buffer is not host memory of this rank's backend"));
      }
    }
    return absl::OkStatus();
  }
  static Event Wrap(Work work) { return Event(std::make_shared<WorkEvent>(std::move(work))); }

  Backend* backend_;
  Communicator& group_;
};

}  // namespace

std::unique_ptr<DataPlane> MakeHostDataPlane(Backend* backend, Communicator& group) {
  return std::make_unique<HostDataPlane>(backend, group);
}

}  // namespace fsdp
