// The mpi communicator: Open MPI, one rank per process, across processes and hosts.
//
// libfsdp makes every MPI call on one thread of its own (the MPI engine), which initializes
// MPI (MPI_Init_thread, asking for MPI_THREAD_MULTIPLE) on first use and polls the
// non-blocking collectives so that they progress while the caller computes. Code that wants
// to call MPI itself does so through RunOnMpiThread.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "fsdp/communicator.h"

namespace fsdp {

// True when libfsdp was built with Open MPI.
bool MpiBuilt();

// Collective over MPI_COMM_WORLD: a new communicator on a duplicate of it, named "world".
// May be called several times (each gets its own MPI communicators). Unimplemented when
// built without MPI.
absl::StatusOr<std::unique_ptr<Communicator>> CreateMpiWorld(CommOptions options = {});

// The same over the caller's communicator: `mpi_comm` points to an MPI_Comm (e.g. one half of
// an MPI_Comm_split, or mpi4py's MPI._addressof(comm)), collective over its processes, which
// become the world's ranks in their order there. The library works on duplicates of it; the
// caller keeps and frees its own. MPI initialised by the caller must provide
// MPI_THREAD_MULTIPLE if the caller goes on calling MPI itself. InvalidArgument for NULL or
// MPI_COMM_NULL.
absl::StatusOr<std::unique_ptr<Communicator>> CreateMpiWorldFrom(const void* mpi_comm,
                                                                 CommOptions options = {});

// Where an mpi communicator's group moves its data: "shm" (every rank runs on this host: POSIX
// shared memory, CommOptions::mpi_shared_memory), "mpi" (Open MPI's collectives), or
// "undecided" until its first collective has completed on this rank. Empty for a communicator
// of another transport.
std::string MpiDataPath(const Communicator& comm);

// Runs fn on the MPI engine thread and waits for it: the way to make raw MPI calls (for
// example to compare with MPI's own collectives) without racing libfsdp's.
absl::Status RunOnMpiThread(const std::function<void()>& fn);

// Destroy every mpi communicator first. Stops the engine and calls MPI_Finalize if libfsdp
// initialized MPI. Called at exit otherwise. Idempotent. After a failed collective use
// FinishMpi instead: MPI_Finalize waits for every peer, also one that is dead or stopped.
void ShutdownMpi();

// The end of an MPI program's main(): `return fsdp::FinishMpi(status, "my_trainer");`.
// When `status` is OK and no mpi communicator failed, shuts MPI down (ShutdownMpi) and
// returns 0; destroy the communicators first. Otherwise prints "<program>: [rank R] <status>"
// to stderr and calls MPI_Abort(MPI_COMM_WORLD, 1), so that mpirun ends every rank at once,
// also one that hangs or was stopped, and the job exits non-zero; it does not return then.
int FinishMpi(const absl::Status& status, std::string_view program);

}  // namespace fsdp
