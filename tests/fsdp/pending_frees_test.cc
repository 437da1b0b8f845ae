// The runtime's deferred frees (internal::PendingFrees, src/fsdp/unit.h) on their own, with
// events the test completes by hand: a buffer leaves the memory book, and goes back to the
// backend, only once every one of its events has completed, in whatever order they complete;
// the host-side bound (WaitUntilAtMost) and Drain wait for every event of a buffer too. (The
// runtime frees a gathered unit on the compute stream's event and, for a prefetch nobody
// claimed, its gather's event: both must be waited for.)
#include <atomic>
#include <memory>
#include <vector>

#include "fsdp/cpu_backend.h"
#include "gtest/gtest.h"
#include "src/fsdp/unit.h"

namespace fsdp::internal {
namespace {

// An event the test completes; a host wait on it stands for the device finishing the work.
class FakeEvent final : public EventState {
 public:
  bool Done() const override { return done_.load(); }
  absl::Status Wait() override {
    waits_.fetch_add(1);
    done_.store(true);
    return absl::OkStatus();
  }
  void Complete() { done_.store(true); }
  int waits() const { return waits_.load(); }

 private:
  std::atomic<bool> done_{false};
  std::atomic<int> waits_{0};
};

class PendingFreesTest : public ::testing::Test {
 protected:
  void SetUp() override { backend_ = std::move(CpuBackend::Create({.num_threads = 1})).value(); }
  // A buffer of `bytes` counted in `gauge`.
  Accounted Booked(int64_t bytes, Gauge& gauge) {
    return Accounted(std::move(fsdp::Buffer::Create(backend_.get(), bytes)).value(), &book_,
                     &gauge);
  }
  static std::vector<std::shared_ptr<FakeEvent>> Events(int n) {
    std::vector<std::shared_ptr<FakeEvent>> e;
    for (int i = 0; i < n; ++i) e.push_back(std::make_shared<FakeEvent>());
    return e;
  }
  static std::vector<Event> Of(const std::vector<std::shared_ptr<FakeEvent>>& fakes) {
    std::vector<Event> out;
    for (const auto& f : fakes) out.emplace_back(f);
    return out;
  }
  int64_t backend_bytes() const { return backend_->memory_stats().bytes_in_use; }

  std::unique_ptr<CpuBackend> backend_;
  MemoryBook book_;
};

// Each order in which three events complete: the buffer stays booked (and allocated) until
// the last of them, whichever it is.
TEST_F(PendingFreesTest, ABufferWaitsForEveryOneOfItsEvents) {
  const int kOrders[][3] = {{0, 1, 2}, {2, 1, 0}, {1, 2, 0}, {2, 0, 1}};
  for (const auto& order : kOrders) {
    SCOPED_TRACE(testing::Message() << "completed in order " << order[0] << order[1] << order[2]);
    PendingFrees pending;
    auto events = Events(3);
    pending.Add(Booked(4096, book_.gathered), Of(events));
    for (int i = 0; i < 3; ++i) {
      pending.Collect();
      EXPECT_EQ(pending.Count(&book_.gathered), 1) << "freed after " << i << " of 3 events";
      EXPECT_EQ(book_.gathered.now, 4096);
      EXPECT_EQ(book_.total.now, 4096);
      EXPECT_EQ(backend_bytes(), 4096);
      events[order[i]]->Complete();
    }
    pending.Collect();
    EXPECT_EQ(pending.Count(&book_.gathered), 0);
    EXPECT_EQ(book_.gathered.now, 0);
    EXPECT_EQ(book_.total.now, 0);
    EXPECT_EQ(backend_bytes(), 0);
    for (const auto& e : events) EXPECT_EQ(e->waits(), 0) << "Collect never blocks";
  }
}

// Events already complete when the buffer is handed over are dropped; the others still hold
// it. With none left, the buffer goes at once.
TEST_F(PendingFreesTest, CompletedEventsAreDroppedTheOthersStillHoldTheBuffer) {
  PendingFrees pending;
  auto events = Events(2);
  events[0]->Complete();
  pending.Add(Booked(1024, book_.gathered), Of(events));
  EXPECT_EQ(pending.Count(&book_.gathered), 1);
  EXPECT_EQ(book_.gathered.now, 1024);
  events[1]->Complete();
  pending.Collect();
  EXPECT_EQ(book_.gathered.now, 0);

  auto done = Events(2);
  for (auto& e : done) e->Complete();
  pending.Add(Booked(512, book_.grad_buffers), Of(done));
  EXPECT_EQ(pending.Count(&book_.grad_buffers), 0);
  EXPECT_EQ(book_.grad_buffers.now, 0);
  pending.Add(Booked(512, book_.grad_buffers), {});  // no user at all
  EXPECT_EQ(book_.grad_buffers.now, 0);
  EXPECT_EQ(backend_bytes(), 0);
}

// The host-side bound waits for every event of the oldest buffers of a category, and for
// nothing else: not the newer buffer kept, not another category's.
TEST_F(PendingFreesTest, WaitUntilAtMostWaitsForEveryEventOfTheBuffersItFrees) {
  PendingFrees pending;
  auto oldest = Events(2), newer = Events(2), other = Events(1);
  pending.Add(Booked(1000, book_.gathered), Of(oldest));
  pending.Add(Booked(2000, book_.grad_buffers), Of(other));
  pending.Add(Booked(3000, book_.gathered), Of(newer));
  EXPECT_EQ(pending.WaitUntilAtMost(&book_.gathered, 1), 1);
  for (const auto& e : oldest) EXPECT_EQ(e->waits(), 1);
  for (const auto& e : newer) EXPECT_EQ(e->waits(), 0);
  EXPECT_EQ(other[0]->waits(), 0);
  EXPECT_EQ(pending.Count(&book_.gathered), 1);
  EXPECT_EQ(book_.gathered.now, 3000);
  EXPECT_EQ(book_.grad_buffers.now, 2000);
  // One event of the newer buffer completes on its own: the bound still waits for the other.
  newer[1]->Complete();
  EXPECT_EQ(pending.WaitUntilAtMost(&book_.gathered, 0), 1);
  EXPECT_EQ(newer[0]->waits(), 1);
  EXPECT_EQ(book_.gathered.now, 0);
  EXPECT_EQ(pending.WaitUntilAtMost(&book_.gathered, 0), 0) << "nothing left to wait for";
  // Drain waits for every event of what is left.
  pending.Drain();
  EXPECT_EQ(other[0]->waits(), 1);
  EXPECT_EQ(book_.total.now, 0);
  EXPECT_EQ(backend_bytes(), 0);
}

TEST_F(PendingFreesTest, DrainWaitsForEveryEventOfEveryBuffer) {
  PendingFrees pending;
  auto a = Events(3), b = Events(2);
  a[1]->Complete();
  pending.Add(Booked(100, book_.gathered), Of(a));
  pending.Add(Booked(200, book_.grad_buffers), Of(b));
  pending.Drain();
  EXPECT_EQ(a[0]->waits(), 1);
  EXPECT_EQ(a[2]->waits(), 1);
  for (const auto& e : b) EXPECT_EQ(e->waits(), 1);
  EXPECT_EQ(book_.total.now, 0);
  EXPECT_EQ(backend_bytes(), 0);
}

}  // namespace
}  // namespace fsdp::internal
