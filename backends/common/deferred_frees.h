// Part of the kit the device backends share (backends/common): stream-ordered frees, as
// cudaFreeAsync. A freed allocation's bytes go back only once the work issued before the free
// on both streams has run (a buffer dropped on an error path may still be written by queued
// work); neither stream waits for the other, and the host waits only in Reap(true). Thread-safe.
#pragma once

#include <deque>
#include <functional>
#include <mutex>
#include <utility>

#include "fsdp/backend.h"

namespace fsdp::backend_kit {

class DeferredFrees {
 public:
  // `release` gives the bytes back once `compute` and `comm` (events recorded on the two
  // streams at the free) are complete.
  void Add(Event compute, Event comm, std::function<void()> release) {
    std::lock_guard<std::mutex> lock(mu_);
    pending_.push_back({std::move(compute), std::move(comm), std::move(release)});
  }
  // Releases what the streams are done with; with `wait_all`, waits for everything first
  // (a failed stream has still run its items).
  void Reap(bool wait_all) {
    std::lock_guard<std::mutex> lock(mu_);
    std::erase_if(pending_, [&](Pending& f) {
      if (wait_all) {
        f.compute.Wait().IgnoreError();
        f.comm.Wait().IgnoreError();
      } else if (!f.compute.Done() || !f.comm.Done()) {
        return false;
      }
      f.release();
      return true;
    });
  }
  size_t size() const {
    std::lock_guard<std::mutex> lock(mu_);
    return pending_.size();
  }

 private:
  struct Pending {
    Event compute, comm;
    std::function<void()> release;
  };
  mutable std::mutex mu_;
  std::deque<Pending> pending_;
};

}  // namespace fsdp::backend_kit
