// The mpi communicator when libfsdp is built without Open MPI (FSDP_WITH_MPI=OFF).
#include "fsdp/mpi_world.h"

namespace fsdp {

bool MpiBuilt() { return false; }

absl::StatusOr<std::unique_ptr<Communicator>> CreateMpiWorld(CommOptions) {
  return absl::UnimplementedError("libfsdp was built without Open MPI (FSDP_WITH_MPI=OFF)");
}

absl::Status RunOnMpiThread(const std::function<void()>&) {
  return absl::UnimplementedError("libfsdp was built without Open MPI (FSDP_WITH_MPI=OFF)");
}

void ShutdownMpi() {}

}  // namespace fsdp
