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

class DataPlane {
 public:
  virtual ~DataPlane() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual const std::string& name() const = 0;

  // recv (size() * send.count elements) = every rank's send, in rank order.
  virtual absl::StatusOr<Event> AllGather(View send, View recv,
                                          Stream after = Stream::kCompute) = 0;
  // recv (send.count / size() elements) = op over ranks of this rank's chunk of send.
  virtual absl::StatusOr<Event> ReduceScatter(View send, View recv, ReduceOp op,
                                              Stream after = Stream::kCompute) = 0;
  // recv = op over ranks of send (send and recv may be the same view).
  virtual absl::StatusOr<Event> AllReduce(View send, View recv, ReduceOp op,
                                          Stream after = Stream::kCompute) = 0;
  // Fails the group on every rank: collectives in flight and later ones fail with `reason`.
  virtual void Abort(const absl::Status& reason) = 0;
};

// The data plane of a host backend (is_host()): the group's own Communicator moves the
// buffers' host bytes (the local transport for ranks as threads, Open MPI for processes).
std::unique_ptr<DataPlane> MakeHostDataPlane(Backend* backend, Communicator& group);

}  // namespace fsdp
