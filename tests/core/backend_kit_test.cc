// The backend kit (backends/common), which the sim and pjrt backends are built from: the memory
// counter (the limit, the out-of-memory text, the peak and the count only of allocations that
// happened, concurrent use) and the stream-ordered frees (nothing goes back before both
// streams' events complete; Reap(true) waits for them).
#include <atomic>
#include <condition_variable>
#include <mutex>

#include "backends/common/deferred_frees.h"
#include "backends/common/memory_counter.h"

#include <gtest/gtest.h>

#include <thread>
#include <vector>

namespace fsdp::backend_kit {
namespace {

TEST(MemoryCounterTest, CountsAgainstTheLimitAndSaysWhatToDo) {
  MemoryCounter c(1000);
  absl::StatusOr<int64_t> a = c.Reserve(600);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(*a, 600);
  c.Commit(*a);
  const absl::StatusOr<int64_t> b = c.Reserve(500);
  EXPECT_EQ(b.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(b.status().message().find(
                "out of memory: 500 bytes asked for with 600 of the 1000-byte limit in use"),
            std::string::npos)
      << b.status();
  EXPECT_EQ(c.stats().bytes_in_use, 600) << "a refused reservation counts nothing";
  // Reserved, then the allocation itself failed: released, no peak, no count.
  absl::StatusOr<int64_t> d = c.Reserve(400);
  ASSERT_TRUE(d.ok());
  c.Release(400);
  EXPECT_EQ(c.stats().bytes_in_use, 600);
  EXPECT_EQ(c.stats().peak_bytes, 600);
  EXPECT_EQ(c.stats().num_allocs, 1);
  c.Release(600);
  EXPECT_EQ(c.stats().bytes_in_use, 0);
  EXPECT_EQ(c.stats().peak_bytes, 600);
  c.ResetPeak();
  EXPECT_EQ(c.stats().peak_bytes, 0);
}

TEST(MemoryCounterTest, NoLimitAndManyThreads) {
  MemoryCounter c;  // no limit
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&c] {
      for (int i = 0; i < 1000; ++i) {
        absl::StatusOr<int64_t> now = c.Reserve(8);
        ASSERT_TRUE(now.ok());
        c.Commit(*now);
        c.Release(8);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(c.stats().bytes_in_use, 0);
  EXPECT_EQ(c.stats().num_allocs, 4000);
  EXPECT_GE(c.stats().peak_bytes, 8);
  EXPECT_LE(c.stats().peak_bytes, 32);
}

// An event completed by the test.
class ManualEvent final : public EventState {
 public:
  bool Done() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return done_;
  }
  absl::Status Wait() override {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return done_; });
    return absl::OkStatus();
  }
  void Complete() {
    std::lock_guard<std::mutex> lock(mu_);
    done_ = true;
    cv_.notify_all();
  }

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
};

TEST(DeferredFreesTest, ReleasesOnlyOnceBothStreamsAreDone) {
  DeferredFrees frees;
  std::atomic<int> released{0};
  auto compute = std::make_shared<ManualEvent>(), comm = std::make_shared<ManualEvent>();
  frees.Add(Event(compute), Event(comm), [&] { released.fetch_add(1); });
  frees.Add(Event(), Event(), [&] { released.fetch_add(10); });  // empty events: complete
  frees.Reap(false);
  EXPECT_EQ(released.load(), 10);
  EXPECT_EQ(frees.size(), 1u);
  compute->Complete();
  frees.Reap(false);
  EXPECT_EQ(released.load(), 10) << "released before the comm stream was done";
  comm->Complete();
  frees.Reap(false);
  EXPECT_EQ(released.load(), 11);
  EXPECT_EQ(frees.size(), 0u);

  // Reap(true) waits for the events.
  auto late = std::make_shared<ManualEvent>();
  frees.Add(Event(late), Event(), [&] { released.fetch_add(100); });
  std::thread completer([&] { late->Complete(); });
  frees.Reap(true);
  completer.join();
  EXPECT_EQ(released.load(), 111);
}

}  // namespace
}  // namespace fsdp::backend_kit
