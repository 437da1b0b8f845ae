// The intra-host data path of the mpi communicator: the ranks of a group that all run on one
// host exchange the data of all_gather, reduce_scatter, all_reduce, broadcast and all_to_all
// through one POSIX shared-memory segment instead of Open MPI's collectives (which, between
// processes of one host, reach a tenth of the bandwidth of the thread transport).
//
// The segment holds, per rank, a staging slot of two halves and three counters. A call moves
// in rounds of at most one half per rank: each rank copies its part of the round into its
// slot and publishes it (`ready`), then reads what it needs from every slot (the same
// direct-copy and reduction loops as the local transport, in rank order, so results are
// bitwise the local transport's), and marks the round consumed (`done`). all_reduce adds a
// middle phase (`reduced`): each rank reduces one slice of the round into its own slot, then
// every rank copies all slices. The counters only grow over the group's life, so two halves
// let round k+1 fill while round k is still being read, and nothing is ever reset.
//
// Nothing here blocks: Attach and Advance do what they can and return, so one engine thread
// progresses every group. A rank's own buffers are only read and written by itself, so a call
// is complete on a rank as soon as its own last round is consumed.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "fsdp/communicator.h"

namespace fsdp::internal {

// The progress of one call through the channel (the engine keeps it with the call).
struct ShmTransfer {
  CollectiveCall call;
  int64_t pos = 0;     // elements (per rank for all_gather / reduce_scatter / all_to_all) done so far
  int phase = 0;       // 0: copy in, 1: wait and read (all_reduce: reduce), 2: all_reduce: gather
  int64_t round = -1;  // the channel round of the current piece
  int64_t piece = 0;   // elements of the current piece
};

class ShmChannel {
 public:
  // The staging half of each rank, in bytes (each rank's slot is two halves).
  static constexpr size_t kDefaultHalfBytes = size_t{1} << 20;

  // Rank 0 creates the segment `name` ("/fsdp-..."), the others open it once it exists; the
  // segment is unlinked as soon as every rank has it mapped (or when rank 0 is destroyed).
  // Non-blocking: call Attach until it returns true.
  ShmChannel(std::string name, int rank, int size, size_t half_bytes = kDefaultHalfBytes);
  ~ShmChannel();
  ShmChannel(const ShmChannel&) = delete;
  ShmChannel& operator=(const ShmChannel&) = delete;

  // true once this rank has the segment mapped; false: not yet (another rank still has to make
  // it); an error when the segment cannot be made or is not the one expected.
  absl::StatusOr<bool> Attach();

  // Moves `t` on as far as it can without waiting; true when this rank's part is complete.
  // One call at a time, in the group's sequence order, the same calls on every rank.
  bool Advance(ShmTransfer& t);

  // For a deadline message: where `t` waits, naming the ranks that have not got there yet.
  std::string DescribeWait(const ShmTransfer& t) const;

  const std::string& name() const { return name_; }
  size_t segment_bytes() const { return bytes_; }

 private:
  struct Header;
  struct Counters;
  Counters& counters(int q) const;
  char* half(int q, int64_t round) const;
  // All ranks' `field` >= target?
  bool AllAtLeast(std::atomic<int64_t> Counters::*field, int64_t target) const;
  bool Begin(ShmTransfer& t);  // starts a new round: false while its half is still being read
  void Publish(std::atomic<int64_t> Counters::*field, int64_t value);
  int64_t PieceLimit(const CollectiveCall& c) const;
  void CopyIn(const ShmTransfer& t);
  // all_reduce: the slice [lo, hi) of the current piece that rank q reduces (cache-line aligned).
  void Slice(const ShmTransfer& t, int q, int64_t* lo, int64_t* hi) const;
  void Unlink();

  const std::string name_;
  const int rank_, size_;
  const size_t half_bytes_;
  size_t bytes_ = 0;
  int fd_ = -1;
  char* base_ = nullptr;
  bool created_ = false;  // rank 0 made the name (and so removes it)
  bool unlinked_ = false;
  int64_t next_round_ = 0;  // rounds this rank has begun
};

// This process's host, as a number: the same for two processes exactly when they share the
// hostname and the kernel's boot id (namespace "hosts" with their own hostnames differ).
uint64_t ThisHostId();

}  // namespace fsdp::internal
