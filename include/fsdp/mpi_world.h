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
#include <vector>

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

// Ranks as threads inside MPI processes, for backends with several devices per process (a
// PJRT client's devices, a host's GPUs): every process of MPI_COMM_WORLD plays `threads` ranks
// of one world of processes x threads ranks, world rank = process rank * threads + thread.
// Collective over the processes, each passing the same `threads` (InvalidArgument otherwise).
// Returns this process's communicators in thread order: hand communicator t to the thread
// that plays rank (process rank * threads + t). With one thread it is the mpi world, with one
// process a local world. Groups split from it are local communicators when their ranks are in
// one process, mpi communicators when each of their processes holds one of their ranks (the
// replicate groups of HYBRID_SHARD with a process's ranks as the shard group), and otherwise
// of the transport "mpi_threads": every rank's send buffer reaches every rank (inside a
// process through the local transport, across processes through one mpi communicator of the
// processes' first ranks) and each rank reduces in rank order, so results are bitwise those of
// the other transports; it moves (ranks - 1) times the data of a ring, so HYBRID_SHARD with the
// shard group inside a process is the layout to use at scale.
absl::StatusOr<std::vector<std::unique_ptr<Communicator>>> CreateMpiThreadsWorld(
    int threads, CommOptions options = {});

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
