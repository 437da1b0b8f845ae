// The mpi communicator when libfsdp is built without Open MPI (FSDP_WITH_MPI=OFF).
#include "fsdp/mpi_world.h"

#include <cstdio>

namespace fsdp {

bool MpiBuilt() { return false; }

absl::StatusOr<std::unique_ptr<Communicator>> CreateMpiWorld(CommOptions) {
  return absl::UnimplementedError("libfsdp was built without Open MPI (FSDP_WITH_MPI=OFF)");
}

absl::StatusOr<std::unique_ptr<Communicator>> CreateMpiWorldFrom(const void*, CommOptions) {
  return absl::UnimplementedError("libfsdp was built without Open MPI (FSDP_WITH_MPI=OFF)");
}

absl::StatusOr<std::vector<std::unique_ptr<Communicator>>> CreateMpiThreadsWorld(int,
                                                                                CommOptions) {
  return absl::UnimplementedError("libfsdp was built without Open MPI (FSDP_WITH_MPI=OFF)");
}

absl::Status RunOnMpiThread(const std::function<void()>&) {
  return absl::UnimplementedError("libfsdp was built without Open MPI (FSDP_WITH_MPI=OFF)");
}

std::string MpiDataPath(const Communicator&) { return {}; }

void ShutdownMpi() {}

int FinishMpi(const absl::Status& status, std::string_view program) {
  if (status.ok()) return 0;
  std::fprintf(stderr, "%.*s: %s\n", static_cast<int>(program.size()), program.data(),
               status.ToString().c_str());
  return 1;
}

}  // namespace fsdp
