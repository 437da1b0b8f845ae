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
  HostDataPlane(Backend* backend, Communicator& group) : DataPlane(backend, "host"), group_(group) {}
  int rank() const override { return group_.rank(); }
  int size() const override { return group_.size(); }
  const std::string& name() const override { return group_.name(); }

  void Abort(const absl::Status& reason) override { group_.Abort(reason); }

 private:
  absl::StatusOr<Event> EnqueueAllGather(View send, View recv, Stream) override {
    return Wrap(group_.AllGatherAsync(ConstBufferView{send.host(), send.count, send.dtype},
                                      BufferView{recv.host(), recv.count, recv.dtype}));
  }
  absl::StatusOr<Event> EnqueueReduceScatter(View send, View recv, ReduceOp op, Stream) override {
    return Wrap(group_.ReduceScatterAsync(ConstBufferView{send.host(), send.count, send.dtype},
                                          BufferView{recv.host(), recv.count, recv.dtype}, op));
  }
  absl::StatusOr<Event> EnqueueAllReduce(View send, View recv, ReduceOp op, Stream) override {
    return Wrap(group_.AllReduceAsync(ConstBufferView{send.host(), send.count, send.dtype},
                                      BufferView{recv.host(), recv.count, recv.dtype}, op));
  }
  absl::StatusOr<Event> EnqueueAllToAll(View send, View recv, Stream) override {
    return Wrap(group_.AllToAllAsync(ConstBufferView{send.host(), send.count, send.dtype},
                                     BufferView{recv.host(), recv.count, recv.dtype}));
  }
  static Event Wrap(Work work) { return Event(std::make_shared<WorkEvent>(std::move(work))); }

  Communicator& group_;
};

}  // namespace

std::unique_ptr<DataPlane> MakeHostDataPlane(Backend* backend, Communicator& group) {
  return std::make_unique<HostDataPlane>(backend, group);
}

}  // namespace fsdp
