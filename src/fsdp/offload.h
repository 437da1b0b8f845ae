// The host side of ShardingOptions::offload: the offloaded units' AdamW state in host memory,
// their update on a worker thread with the CPU kernels, and the copies between the device and
// the host that feed it (fsdp/sharding.h, OffloadOptions, says what a user sees).
//
// Per step and offloaded unit u (the caller's thread issues every device call; the worker
// thread touches only host memory and waits only on events):
//   optimizer (the state on the host):
//   IssueUpdate(u)     the device's (already clipped and averaged) gradient shard and the
//                      parameter shard go to pinned host staging on the communication stream
//                      (CopyToHostAsync), which then zeroes the gradient shard; the worker
//                      waits for them, then runs AdamW on them;
//   EnsureUploaded(u)  before anything reads the unit's parameter shard again (its next
//                      gather, an accessor): the caller waits for u's update, and the updated
//                      shard goes back in the compute stream's order (CopyFromHostAsync).
//   all (the parameter and gradient shards on the host too):
//   UploadParams(u)    before a gather: u's update done, its shard copied up into a transient
//                      device buffer on the compute stream;
//   IssueGradientDown(u)  a reduced gradient shard copied down on the communication stream
//                      into staging, which the worker adds into the host's gradient shard;
//   UploadGradient(u)  the accumulated host gradient into a transient device buffer (the norm);
//   IssueFactor, IssueUpdate(u)  the clip factor copied down once per step; the worker scales
//                      the host gradient by it, runs AdamW, and zeroes the gradient.
// Jobs run in the order they were issued; the worker keeps nothing between steps.
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
  // `all_params` (OffloadKind::kAll): the parameter shard lives here, starting from `init`
  // (shard_numel floats), the gradient shard too (zero), with staging for arriving gradients.
  absl::Status AddUnit(int u, int64_t shard_numel, std::vector<DecayRange> ranges,
                       const AdamWOptions& options, std::unique_ptr<Optimizer>* optimizer,
                       const float* all_params = nullptr);
  bool offloaded(int u) const { return u < static_cast<int>(units_.size()) && units_[u].opt; }
  // Its parameter and gradient shards live here (OffloadKind::kAll).
  bool holds_shards(int u) const { return offloaded(u) && units_[u].all; }

  // ---- OffloadKind::kAll ----
  // u's parameters (its update done) into `dst` (a device buffer of shard_numel f32) on the
  // compute stream.
  absl::Status UploadParams(int u, View dst);
  // u's reduced gradient shard `grad` (f32, shard_numel, on the device, written by the compute
  // stream's work so far) down to the host on the communication stream, added there into the
  // host's gradient shard by the worker. Returns the copy's event: `grad` is free after it.
  absl::StatusOr<Event> IssueGradientDown(int u, View grad);
  // Waits until every gradient of u sent down has been added (and its update, if pending, ran).
  absl::Status WaitGradients(int u);
  // u's accumulated gradient (every arrival added) into `dst` (device) on the compute stream.
  absl::Status UploadGradient(int u, View dst);
  // The step's clip factor (a device f32, written by the compute stream's work so far) copied
  // to the host for the kAll updates that follow, which scale their gradient by it.
  absl::Status IssueFactor(View factor);
  // The host's shards of u (its update and gradients done first): host memory views.
  View host_params(int u);
  View host_grads(int u);
  // Waits for u's pending update (its outcome), counting the wait; pending becomes false.
  absl::Status WaitUpdate(int u);
  // Zeroes u's host gradient (a skipped step), once its arrivals are added.
  absl::Status DropGradients(int u);

  // Step: the device's shards of unit u (f32, shard_numel) go to the host after the work issued
  // on the compute stream so far, the gradient shard is zeroed behind them, and the worker
  // updates them with learning rate `lr`.
  absl::Status IssueUpdate(int u, View param_shard, View grad_shard, float lr);
  // kAll: the worker scales u's host gradient by the factor of IssueFactor when `scale`, runs
  // AdamW with `lr` on the host's shards, and zeroes the gradient.
  absl::Status IssueHostUpdate(int u, bool scale, float lr);
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
    bool all = false;          // kAll: param and grad are the unit's shards, not staging
    Buffer param, grad;        // pinned staging on the host backend
    Buffer arriving;           // kAll: a reduced gradient on its way to be added into grad
    int arrivals = 0;          // kAll: gradients sent down and not yet added (under mu_)
    absl::Status arrival_status;  // kAll: the first failed arrival (under mu_)
    bool pending = false;      // an update issued whose parameters are not back yet
    Event copied;              // its shards on the host and the gradient shard zeroed
    bool done = false;         // the worker finished it (under mu_)
    absl::Status status;       // its outcome (under mu_)
  };
  struct Job {
    enum Kind { kUpdate, kAdd } kind = kUpdate;
    int unit = -1;
    Event copied;  // the inputs on the host
    float lr = 0;
    bool all = false, scale = false;
  };
  void Push(Job job);
  // `src` (u's shard_numel floats on the host) into `dst` on the compute stream, counted.
  absl::Status CopyUp(int u, View dst, const Buffer& src);
  HostOffload(Backend* device, std::unique_ptr<CpuBackend> host);
  void Work();

  Backend* device_;
  std::unique_ptr<CpuBackend> host_;
  std::vector<UnitState> units_;
  int64_t host_bytes_ = 0;
  Buffer factor_;        // kAll: the step's clip factor on the host
  Event factor_ready_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> jobs_;
  bool stop_ = false;
  OffloadStats stats_;
  std::thread worker_;  // last: it runs on the members above
};

}  // namespace fsdp::internal
