// The host side of ShardingOptions::offload: the offloaded units' AdamW state in host memory,
// their update on a worker thread with the CPU kernels, and the copies between the device and
// the host that feed it (fsdp/sharding.h, OffloadOptions, says what a user sees).
//
// Per step and offloaded unit u (the caller's thread issues every device call; the worker
// thread touches only host memory and waits only on events):
//   IssueUpdate(u)     the device's (already clipped and averaged) gradient shard and the
//                      parameter shard go to pinned host staging on the communication stream
//                      (CopyToHostAsync), which then zeroes the gradient shard; the worker
//                      waits for them, then runs AdamW on them;
//   EnsureUploaded(u)  before anything reads the unit's parameter shard again (its next
//                      gather, an accessor): the caller waits for u's update, and the updated
//                      shard goes back in the compute stream's order (CopyFromHostAsync).
// Units are updated in the order they were issued; the worker keeps nothing between steps.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "fsdp/backend.h"
#include "fsdp/cpu_backend.h"
#include "fsdp/optim.h"
#include "fsdp/sharding.h"

namespace fsdp::internal {

class HostOffload {
 public:
  // `device`: where the shards live; `threads`: the host's kernel threads for the updates.
  static absl::StatusOr<std::unique_ptr<HostOffload>> Create(Backend* device, int threads);
  // Waits for the updates in flight, then stops the worker.
  ~HostOffload();

  // Unit u's host state: AdamW over `shard_numel` elements (its state on the host), and pinned
  // staging for its parameter and gradient shards. The optimizer is the unit's: `*optimizer`.
  absl::Status AddUnit(int u, int64_t shard_numel, std::vector<DecayRange> ranges,
                       const AdamWOptions& options, std::unique_ptr<Optimizer>* optimizer);
  bool offloaded(int u) const { return u < static_cast<int>(units_.size()) && units_[u].opt; }

  // Step: the device's shards of unit u (f32, shard_numel) go to the host after the work issued
  // on the compute stream so far, the gradient shard is zeroed behind them, and the worker
  // updates them with learning rate `lr`.
  absl::Status IssueUpdate(int u, View param_shard, View grad_shard, float lr);
  // The updated parameters of unit u back into `param_shard`, once the host has them; nothing
  // when no update of u is pending. Returns the update's error, if it failed.
  absl::Status EnsureUploaded(int u, View param_shard);
  bool pending(int u) const { return offloaded(u) && units_[u].pending; }
  // Waits until the worker has run every update issued (destruction).
  void Drain();

  int64_t host_bytes() const { return host_bytes_; }
  std::vector<int> units() const;
  OffloadStats stats() const;

 private:
  struct UnitState {
    Optimizer* opt = nullptr;  // owned by the runtime's unit
    Buffer param, grad;        // pinned staging on the host backend
    bool pending = false;      // an update issued whose parameters are not back yet
    Event copied;              // its shards on the host and the gradient shard zeroed
    bool done = false;         // the worker finished it (under mu_)
    absl::Status status;       // its outcome (under mu_)
  };
  struct Job {
    int unit = -1;
    Event copied;
    float lr = 0;
  };
  HostOffload(Backend* device, std::unique_ptr<CpuBackend> host);
  void Work();

  Backend* device_;
  std::unique_ptr<CpuBackend> host_;
  std::vector<UnitState> units_;
  int64_t host_bytes_ = 0;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> jobs_;
  bool stop_ = false;
  OffloadStats stats_;
  std::thread worker_;  // last: it runs on the members above
};

}  // namespace fsdp::internal
