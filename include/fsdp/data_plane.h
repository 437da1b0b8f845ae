// The data plane: collectives on device memory, ordered by streams and events as NCCL orders
// them. A call starts once the work already issued on the stream `after` (of this rank's
// backend) has run; the returned Event completes when `recv` holds the result, and a stream
// that reads `recv` waits for it (Backend::Wait). `send` and `recv` must stay alive and
// unwritten until then. Semantics otherwise as the Communicator's (fsdp/communicator.h):
// every rank of the group makes the same calls in the same order; a rank that does not arrive
// within the deadline, or calls differently, fails the collective on every rank (the event's
// Wait() returns the error) and the group.
//
// The control plane (agreement, fingerprints, checkpoint coordination, host scalars) is the
// host Communicator the data plane was made from (Backend::CreateDataPlane).
#pragma once

#include <memory>
#include <string>

#include "fsdp/backend.h"
#include "fsdp/collective_types.h"

namespace fsdp {

class Communicator;

// The public calls check their arguments here, once for every backend (the views are memory of
// this rank's backend that fits in its allocation, the dtypes match and reduce in f32, bf16 or
// f16, the counts fit the group), then hand them to the backend's Enqueue*: an InvalidArgument
// "<kind> data plane '<group>' <collective> on rank r: <what is wrong>" issues nothing.
class DataPlane {
 public:
  virtual ~DataPlane() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual const std::string& name() const = 0;

  // recv (size() * send.count elements) = every rank's send, in rank order.
  absl::StatusOr<Event> AllGather(View send, View recv, Stream after = Stream::kCompute);
  // recv (send.count / size() elements) = op over ranks of this rank's chunk of send.
  absl::StatusOr<Event> ReduceScatter(View send, View recv, ReduceOp op,
                                      Stream after = Stream::kCompute);
  // recv = op over ranks of send (send and recv may be the same view).
  absl::StatusOr<Event> AllReduce(View send, View recv, ReduceOp op,
                                  Stream after = Stream::kCompute);
  // recv[q * k ...] = chunk `rank()` of rank q's send, for every rank q, where k = send.count /
  // size(): chunk d of send goes to rank d. Equal counts, a multiple of size(); any dtype; send
  // and recv must not overlap. The quantized gradient reduction exchanges its codes with it.
  absl::StatusOr<Event> AllToAll(View send, View recv, Stream after = Stream::kCompute);
  // Fails the group on every rank: collectives in flight and later ones fail with `reason`.
  virtual void Abort(const absl::Status& reason) = 0;

 protected:
  // `backend`: the rank's backend, whose memory the views must be; `kind`: its name for the
  // messages ("sim", "pjrt", "cuda shared-GPU").
  DataPlane(const Backend* backend, std::string kind)
      : backend_(backend), kind_(std::move(kind)) {}
  const std::string& kind() const { return kind_; }

  // The calls, their arguments checked.
  virtual absl::StatusOr<Event> EnqueueAllGather(View send, View recv, Stream after) = 0;
  virtual absl::StatusOr<Event> EnqueueReduceScatter(View send, View recv, ReduceOp op,
                                                     Stream after) = 0;
  virtual absl::StatusOr<Event> EnqueueAllReduce(View send, View recv, ReduceOp op,
                                                 Stream after) = 0;
  virtual absl::StatusOr<Event> EnqueueAllToAll(View send, View recv, Stream after) = 0;
  // A call whose arguments failed the check (`why`): by default nothing is issued and the
  // caller gets `why` (the group's other ranks then meet their deadline). A plane whose ranks
  // can tell each other may post the failure so that they fail at once.
  virtual absl::StatusOr<Event> Rejected(CollectiveKind kind, View send, View recv, ReduceOp op,
                                         Stream after, absl::Status why) {
    (void)kind, (void)send, (void)recv, (void)op, (void)after;
    return why;
  }

 private:
  absl::Status Check(CollectiveKind kind, const View& send, const View& recv, ReduceOp op) const;

  const Backend* backend_;
  std::string kind_;
};

// The data plane of a host backend (is_host()): the group's own Communicator moves the
// buffers' host bytes (the local transport for ranks as threads, Open MPI for processes).
std::unique_ptr<DataPlane> MakeHostDataPlane(Backend* backend, Communicator& group);

}  // namespace fsdp
