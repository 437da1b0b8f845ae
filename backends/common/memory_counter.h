// Part of the kit the device backends share (backends/common): the bytes a backend has handed
// out against its memory limit, their peak and the allocation count (fsdp::MemoryStats), and
// the out-of-memory message every backend gives. Thread-safe.
//
//   FSDP_ASSIGN_OR_RETURN(const int64_t now, counter.Reserve(bytes));  // ResourceExhausted past the limit
//   ... allocate; on failure: counter.Release(bytes) ...
//   counter.Commit(now);                                               // peak and count
//   ... on Free: counter.Release(bytes)
#pragma once

#include <atomic>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "fsdp/backend.h"
#include "fsdp/status.h"

namespace fsdp::backend_kit {

class MemoryCounter {
 public:
  // limit_bytes: 0 = no limit.
  explicit MemoryCounter(int64_t limit_bytes = 0) : limit_(limit_bytes) {}
  void set_limit(int64_t limit_bytes) { limit_ = limit_bytes; }

  // Counts `bytes` as in use; past the limit it counts nothing and says how much was asked for,
  // how much is in use and what to do. Returns the bytes in use with these.
  absl::StatusOr<int64_t> Reserve(int64_t bytes) {
    const int64_t now = in_use_.fetch_add(bytes) + bytes;
    if (limit_ > 0 && now > limit_) {
      in_use_.fetch_sub(bytes);
      return absl::ResourceExhaustedError(absl::StrCat(
          "out of memory: ", bytes, " bytes asked for with ", now - bytes, " of the ", limit_,
          "-byte limit in use; reduce the batch size, checkpoint activations or shard over more "
          "ranks"));
    }
    return now;
  }
  // The reserved allocation exists: the peak (with `now`, what Reserve returned) and the count.
  void Commit(int64_t now) {
    int64_t peak = peak_.load();
    while (now > peak && !peak_.compare_exchange_weak(peak, now)) {
    }
    allocs_.fetch_add(1);
  }
  // Reserved bytes that were not allocated after all, or an allocation freed.
  void Release(int64_t bytes) { in_use_.fetch_sub(bytes); }

  MemoryStats stats() const {
    const int64_t in_use = in_use_.load();
    return {in_use, peak_.load(), allocs_.load(), in_use};
  }
  void ResetPeak() { peak_.store(in_use_.load()); }
  int64_t limit() const { return limit_; }

 private:
  int64_t limit_;
  std::atomic<int64_t> in_use_{0}, peak_{0}, allocs_{0};
};

}  // namespace fsdp::backend_kit
