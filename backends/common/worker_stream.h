// Part of the kit the device backends share (backends/common): a stream whose work runs on one
// host thread, in the order it was submitted (the sim and pjrt streams). The first failure set
// on it is sticky: the backend's Record completes events with it, and items that check it skip
// their work. Each item runs with the submitting thread's trace rank, in a trace span on the
// stream's lane when it has a name. Submit, SetFailure and failure are thread-safe.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

#include "absl/status/status.h"
#include "fsdp/trace.h"

namespace fsdp::backend_kit {

class WorkerStream {
 public:
  struct Options {
    std::string lane;                 // the trace lane of its spans
    std::function<void()> on_start;   // first, on the worker thread (e.g. its OpenMP threads)
    std::function<void()> on_stop;    // last, on the worker thread, after the queue drained
  };

  explicit WorkerStream(Options options) : options_(std::move(options)) {
    worker_ = std::thread([this] {
      if (options_.on_start) options_.on_start();
      Loop();
      if (options_.on_stop) options_.on_stop();
    });
  }
  // Runs what was submitted, then stops the thread.
  ~WorkerStream() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    worker_.join();
  }
  WorkerStream(const WorkerStream&) = delete;
  WorkerStream& operator=(const WorkerStream&) = delete;

  // `name` (a string literal, or nullptr for no span) names the item's trace span.
  void Submit(const char* name, std::function<void()> fn) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      items_.push_back({name, TraceRank(), std::move(fn)});
    }
    cv_.notify_one();
  }
  // The first failure wins; later ones are ignored.
  void SetFailure(const absl::Status& s) {
    std::lock_guard<std::mutex> lock(mu_);
    if (failure_.ok()) failure_ = s;
  }
  absl::Status failure() {
    std::lock_guard<std::mutex> lock(mu_);
    return failure_;
  }

 private:
  struct Item {
    const char* name;
    int rank;
    std::function<void()> fn;
  };
  void Loop() {
    for (;;) {
      Item item;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || !items_.empty(); });
        if (items_.empty()) return;  // stopped and drained
        item = std::move(items_.front());
        items_.pop_front();
      }
      SetTraceRank(item.rank);
      if (item.name != nullptr) {
        TraceSpan span(item.name, options_.lane);
        item.fn();
      } else {
        item.fn();
      }
    }
  }

  const Options options_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Item> items_;
  bool stop_ = false;
  absl::Status failure_;
  std::thread worker_;  // last: starts after the members it uses
};

}  // namespace fsdp::backend_kit
