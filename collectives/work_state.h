// The shared state behind a Work handle: completion, status, the deadline of Wait(), and the
// hook that a transport sets to fail its group when a Wait passes its deadline.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include "absl/time/time.h"
#include "fsdp/status.h"

namespace fsdp::internal {

class WorkState {
 public:
  WorkState(std::string description, absl::Duration default_timeout)
      : description_(std::move(description)), default_timeout_(default_timeout) {}

  // Completes the work; the first call wins, later ones are ignored.
  void Complete(absl::Status status);
  bool done() const { return done_.load(std::memory_order_acquire); }
  // When Complete() ran (steady clock); meaningful once done().
  std::chrono::steady_clock::time_point completed_at() const {
    return std::chrono::steady_clock::time_point(
        std::chrono::steady_clock::duration(completed_at_.load(std::memory_order_acquire)));
  }
  // Waits up to `timeout`; on expiry calls the expire hook (which must make the work complete
  // promptly, by failing the group) and then waits for completion.
  absl::Status Wait(absl::Duration timeout);
  // Set before the Work is handed out. Receives the waited duration.
  void set_on_expire(std::function<void(absl::Duration)> fn) { on_expire_ = std::move(fn); }

  const std::string& description() const { return description_; }
  absl::Duration default_timeout() const { return default_timeout_; }

  // A result beyond the status (the new group of a split); set before Complete().
  std::shared_ptr<void> payload;

 private:
  const std::string description_;
  const absl::Duration default_timeout_;
  std::function<void(absl::Duration)> on_expire_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<bool> done_{false};
  std::atomic<std::chrono::steady_clock::rep> completed_at_{0};
  absl::Status status_;
};

// A copy of `s` that shares nothing with it. absl::Status reference-counts its message, and
// the count lives in libabsl, which sanitizers do not see: a status handed to another thread
// is detached, so each thread owns the statuses it reads (and ThreadSanitizer stays exact).
inline absl::Status Detach(const absl::Status& s) {
  return s.ok() ? absl::OkStatus() : absl::Status(s.code(), s.message());
}

// A Work that is already complete with `status`.
std::shared_ptr<WorkState> CompletedWork(std::string description, absl::Status status);

}  // namespace fsdp::internal
