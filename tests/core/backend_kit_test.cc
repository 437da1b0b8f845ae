// The backend kit (backends/common), which the sim and pjrt backends are built from: the memory
// counter (the limit, the out-of-memory text, the peak and the count only of allocations that
// happened, concurrent use) and the stream-ordered frees (nothing goes back before both
// streams' events complete; Reap(true) waits for them), the host-thread event, and the worker
// stream (order, the sticky failure, the rank and span of each item, draining at the end).
#include <atomic>
#include <condition_variable>
#include <mutex>

#include "backends/common/deferred_frees.h"
#include "backends/common/host_event.h"
#include "backends/common/memory_counter.h"
#include "backends/common/worker_stream.h"
#include "fsdp/trace.h"

#include <gtest/gtest.h>

#include <memory>
#include <string>
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

TEST(HostEventTest, TheFirstCompletionWinsAndWaitBlocksUntilIt) {
  HostEvent e;
  EXPECT_FALSE(e.Done());
  EXPECT_FALSE(e.completed_at().has_value());
  std::thread completer([&] { e.Complete(absl::DataLossError("first")); });
  EXPECT_EQ(e.Wait().code(), absl::StatusCode::kDataLoss);
  completer.join();
  e.Complete(absl::OkStatus());
  EXPECT_EQ(e.Wait().message(), "first") << "a second completion replaced the first";
  EXPECT_TRUE(e.Done());
  EXPECT_TRUE(e.completed_at().has_value());
}

TEST(WorkerStreamTest, RunsInOrderOnItsThreadAndDrainsWhenDestroyed) {
  std::vector<int> ran;  // written only by the worker thread, read after it joined
  std::thread::id start_thread, stop_thread, item_thread;
  int items_at_stop = -1;
  {
    WorkerStream::Options o;
    o.lane = "test_lane";
    o.on_start = [&] { start_thread = std::this_thread::get_id(); };
    o.on_stop = [&] {
      stop_thread = std::this_thread::get_id();
      items_at_stop = static_cast<int>(ran.size());
    };
    WorkerStream stream(std::move(o));
    // The first item holds the worker until every other item is queued.
    std::mutex mu;
    std::condition_variable cv;
    bool go = false;
    stream.Submit("first", [&] {
      item_thread = std::this_thread::get_id();
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [&] { return go; });
      ran.push_back(0);
    });
    for (int i = 1; i < 100; ++i) stream.Submit(nullptr, [&ran, i] { ran.push_back(i); });
    {
      std::lock_guard<std::mutex> lock(mu);
      go = true;
    }
    cv.notify_all();
  }  // the destructor runs what is queued, then on_stop
  ASSERT_EQ(ran.size(), 100u) << "the destructor dropped queued items";
  for (int i = 0; i < 100; ++i) EXPECT_EQ(ran[i], i) << "out of order";
  EXPECT_NE(item_thread, std::this_thread::get_id());
  EXPECT_EQ(start_thread, item_thread);
  EXPECT_EQ(stop_thread, item_thread);
  EXPECT_EQ(items_at_stop, 100) << "on_stop ran before the queue drained";
}

TEST(WorkerStreamTest, TheFirstFailureStaysAndItemsCarryTheSubmittersRankAndSpan) {
  Tracer& tracer = Tracer::Global();
  tracer.Clear();
  tracer.Enable();
  const int saved_rank = TraceRank();
  SetTraceRank(3);
  int seen_rank = -1;
  {
    WorkerStream stream({"kit_test_lane", nullptr, nullptr});
    EXPECT_TRUE(stream.failure().ok());
    stream.Submit("kit_item", [&] { seen_rank = TraceRank(); });
    stream.Submit(nullptr, [&] { stream.SetFailure(absl::InternalError("first")); });
    stream.Submit(nullptr, [&] { stream.SetFailure(absl::InternalError("second")); });
    // Shared with the item, as the backends share their events: Complete may still be
    // notifying when Wait returns.
    auto done = std::make_shared<HostEvent>();
    stream.Submit(nullptr, [&stream, done] { done->Complete(stream.failure()); });
    EXPECT_EQ(done->Wait().message(), "first");
  }
  tracer.Disable();
  SetTraceRank(saved_rank);
  EXPECT_EQ(seen_rank, 3) << "the item did not run with the submitting thread's rank";
  int spans = 0;
  for (const Span& span : tracer.Snapshot()) {
    if (span.name == "kit_item") {
      ++spans;
      EXPECT_EQ(span.stream, "kit_test_lane");
      EXPECT_EQ(span.rank, 3);
    }
  }
  EXPECT_EQ(spans, 1) << "a named item is one span on the stream's lane";
  tracer.Clear();
}

}  // namespace
}  // namespace fsdp::backend_kit
