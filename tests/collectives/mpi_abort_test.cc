// The end of an MPI job after a failed collective (fsdp::FinishMpi), run by
// mpi_abort_check.sh under mpirun: rank 1 stops itself (SIGSTOP, a hung peer) or exits
// without finalizing (a dead peer) between two collectives; rank 0 hits the deadline, prints
// its error and aborts the job, which must then end on every rank, non-zero, within the
// deadline plus a few seconds. In mode "ok" nothing fails and the job ends with 0.
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>

#include "fsdp/mpi_world.h"

int main(int argc, char** argv) {
  const char* mode = argc > 1 ? argv[1] : "ok";
  fsdp::CommOptions options;
  options.timeout = absl::Seconds(3);
  auto world = fsdp::CreateMpiWorld(options);
  if (!world.ok()) return fsdp::FinishMpi(world.status(), "mpi_abort_test");
  fsdp::Communicator& w = **world;
  float x = 1.0f, y = 0.0f;
  absl::Status s = w.AllReduce(&x, &y, 1, fsdp::DType::kF32, fsdp::ReduceOp::kSum);
  if (s.ok() && w.rank() == 1) {
    if (std::strcmp(mode, "stop") == 0) raise(SIGSTOP);
    if (std::strcmp(mode, "exit") == 0) _exit(3);
  }
  if (s.ok()) s = w.AllReduce(&x, &y, 1, fsdp::DType::kF32, fsdp::ReduceOp::kSum);
  if (s.ok()) {
    std::printf("mpi_abort_test: [rank %d] both collectives done\n", w.rank());
    world->reset();
  }
  return fsdp::FinishMpi(s, "mpi_abort_test");
}
