// The local communicator: N ranks as threads of one process, exchanging through shared
// memory. Each rank's communicator has a progress thread that runs its collectives in order,
// so asynchronous calls return at once and overlap the caller's compute.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "fsdp/communicator.h"

namespace fsdp {

namespace internal {
class LocalGroup;
}

class LocalWorld {
 public:
  // A world of `size` ranks (1 <= size <= 4096), named `name` in its errors and traces.
  static absl::StatusOr<std::unique_ptr<LocalWorld>> Create(int size, CommOptions options = {},
                                                            std::string name = "world");
  ~LocalWorld();

  int size() const { return size_; }
  // The communicator of rank `rank`, handed out once; give it to the thread that plays the
  // rank. Communicators may outlive the LocalWorld.
  absl::StatusOr<std::unique_ptr<Communicator>> TakeRank(int rank);

  // Convenience: creates a world, runs body(comm) on `size` threads (one per rank), joins
  // them and returns the first error in rank order.
  static absl::Status Run(int size, const CommOptions& options,
                          const std::function<absl::Status(Communicator&)>& body);

 private:
  LocalWorld(int size, std::shared_ptr<internal::LocalGroup> group);
  int size_;
  std::shared_ptr<internal::LocalGroup> group_;
  std::unique_ptr<bool[]> taken_;
};

}  // namespace fsdp
