// The shared state of one group of the local communicator: a sequence-numbered rendezvous
// where each rank posts its call and buffer pointers, the cross-rank checks (schedule
// mismatch, invalid arguments, deadlines), and the shared-memory algorithms that run once
// everyone has arrived: every rank copies or reduces its own part straight from its peers'
// buffers, then a completion barrier keeps the buffers alive until all are done with them.
#pragma once

#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "fsdp/communicator.h"

namespace fsdp::internal {

// What a rank posts at one sequence number.
struct LocalPost {
  CollectiveCall call;
  absl::Status invalid;  // this rank's argument check
  int color = 0, key = 0;  // split only
  std::string label;       // split only
};

class LocalGroup;
struct LocalSplitResult {
  std::shared_ptr<LocalGroup> group;  // null for a negative color
  int rank = -1;
};

class LocalGroup {
 public:
  // world_ranks[i]: the world rank of member i, which places it on a host of the simulated
  // link (CommOptions::ranks_per_host); empty means member i is world rank i.
  LocalGroup(std::string name, int size, CommOptions options, std::vector<int> world_ranks = {});

  const std::string& name() const { return name_; }
  int size() const { return size_; }
  const CommOptions& options() const { return options_; }

  // Runs `post` as `rank` at sequence `seq` (each rank's calls come in sequence order, one at
  // a time): rendezvous, checks, data movement, completion barrier. For a split, `split`
  // receives the rank's new group. `peer_wait_ns`, when given, receives how long the rank
  // waited at the rendezvous for the others (for the timeline tracer).
  absl::Status Run(int rank, int64_t seq, const LocalPost& post, LocalSplitResult* split,
                   int64_t* peer_wait_ns = nullptr);

  // Diagnostics: a rank has issued call number `seq` (called on the issuing thread).
  void NoteIssued(int rank, int64_t seq) {
    issued_[rank].store(seq + 1, std::memory_order_relaxed);
  }
  // A Wait on `rank` for sequence `seq` passed its deadline: unless that call is already past
  // its rendezvous, fail the group with a diagnosis of who is missing.
  void ExpireWait(int rank, int64_t seq, const std::string& what, absl::Duration waited);

  // Fails the group (the first reason wins) and wakes every waiter.
  void Fail(absl::Status reason, int64_t seq = -1);
  absl::Status health() const;

 private:
  struct Slot {
    int64_t seq = -1;
    int arrived = 0, left = 0;
    int phase[2] = {0, 0};  // intra-call barriers
    int done = 0;           // completion barrier
    std::vector<char> present;
    std::vector<LocalPost> posts;
    absl::Status verdict;                       // decided by the last rank to arrive
    std::vector<LocalSplitResult> split_results;
  };

  // Called with mu_ held by the last rank to arrive.
  void Decide(Slot& slot);
  absl::Status FailedStatus(const LocalPost& post, int64_t seq) const;  // mu_ held
  std::string MissingRanks(const Slot& slot) const;                     // mu_ held
  // Waits (mu_ held through `lock`) until `counter` reaches size_. No deadline: every rank
  // is past the rendezvous, so only bounded copies remain.
  void WaitCount(std::unique_lock<std::mutex>& lock, int& counter);
  // The data movement of one call; runs without the lock.
  void Move(int rank, Slot& slot, std::unique_lock<std::mutex>& lock);
  // The simulated link: sleeps until `start` plus the time the transfers take. One level
  // (ranks_per_host == 0): `transfers` transfers of `bytes` each at the link_* figures.
  void ChargeLink(std::chrono::steady_clock::time_point start, int transfers, size_t bytes) const;
  // Either level: one transfer of `bytes` between member `rank` and `peer`, at the figures of
  // its level (same host or not).
  void ChargePeer(std::chrono::steady_clock::time_point start, int rank, int peer,
                  size_t bytes) const;
  // One transfer of `bytes` with every other member, one after another, each at the figures
  // of its level.
  void ChargeAllPeers(std::chrono::steady_clock::time_point start, int rank, size_t bytes) const;
  // A barrier: the latency of the slowest level among the peers.
  void ChargeBarrier(std::chrono::steady_clock::time_point start, int rank) const;
  // Seconds of one transfer of `bytes` between members a and b (two levels only).
  double TransferSeconds(int a, int b, size_t bytes) const;
  bool two_levels() const { return options_.ranks_per_host > 0; }

  const std::string name_;
  const int size_;
  const CommOptions options_;
  const std::vector<int> world_ranks_;  // member -> world rank
  std::unique_ptr<std::atomic<int64_t>[]> issued_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  absl::Status failure_;
  int64_t failure_seq_ = -1;
  std::vector<int64_t> arrived_seq_;    // last sequence each rank arrived at
  std::vector<int64_t> completed_seq_;  // last sequence each rank completed
  Slot slots_[2];
};

// Checks the two-level fields of CommOptions (ranks_per_host, inter_host_*) for a world of
// `size` ranks: OK or InvalidArgument naming `who` and saying what to fix.
absl::Status CheckHostLevel(const CommOptions& options, int size, std::string_view who);

}  // namespace fsdp::internal
