// Part of the kit the device backends share (backends/common): the event of a stream whose
// work runs on a host thread (the sim and pjrt streams, their collectives). Completed once, with
// the work's status and the time; Wait blocks until then. Thread-safe.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <utility>

#include "fsdp/backend.h"

namespace fsdp::backend_kit {

class HostEvent final : public EventState {
 public:
  // The first call wins; later ones are ignored.
  void Complete(absl::Status s) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (done_.load(std::memory_order_relaxed)) return;
      status_ = std::move(s);
      at_.store(std::chrono::steady_clock::now().time_since_epoch().count(),
                std::memory_order_release);
      done_.store(true, std::memory_order_release);
    }
    cv_.notify_all();
  }
  bool Done() const override { return done_.load(std::memory_order_acquire); }
  absl::Status Wait() override {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return done_.load(std::memory_order_relaxed); });
    return status_;
  }
  std::optional<std::chrono::steady_clock::time_point> completed_at() const override {
    if (!Done()) return std::nullopt;
    return std::chrono::steady_clock::time_point(
        std::chrono::steady_clock::duration(at_.load(std::memory_order_acquire)));
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<bool> done_{false};
  std::atomic<std::chrono::steady_clock::rep> at_{0};
  absl::Status status_;
};

}  // namespace fsdp::backend_kit
