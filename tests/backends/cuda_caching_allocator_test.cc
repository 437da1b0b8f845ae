// The CUDA backend's caching allocator (backends/cuda/caching_allocator.h) over a fake device
// and fake fences: reuse only after the fence, best fit within 5/4, rounding, statistics, the
// out-of-memory path, misuse, threads, and destruction.
#include "backends/cuda/caching_allocator.h"

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace fsdp::cuda_internal {
namespace {

using ::testing::HasSubstr;

constexpr size_t kKiB = size_t{1} << 10;
constexpr size_t kMiB = size_t{1} << 20;

// Device memory with a capacity: distinct addresses from a counter (never reused), a count of
// mallocs and frees, the sizes asked for, and ResourceExhausted past the capacity.
class FakeDevice : public DeviceMemory {
 public:
  explicit FakeDevice(size_t capacity = SIZE_MAX) : capacity_(capacity) {}
  ~FakeDevice() override = default;

  absl::StatusOr<void*> Malloc(size_t bytes) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (!next_error_.ok()) {
      absl::Status s = next_error_;
      next_error_ = absl::OkStatus();
      return s;
    }
    if (bytes > capacity_ - used_) {
      ++failed_mallocs_;
      return absl::ResourceExhaustedError("fake device: out of memory");
    }
    void* p = reinterpret_cast<void*>(next_);
    next_ += bytes + 4096;
    live_[p] = bytes;
    used_ += bytes;
    ++mallocs_;
    sizes_.push_back(bytes);
    return p;
  }
  void Free(void* p) override {
    std::function<void(void*)> hook;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = live_.find(p);
      if (it == live_.end()) {
        ++unknown_frees_;
        return;
      }
      used_ -= it->second;
      live_.erase(it);
      ++frees_;
      hook = on_free_;
    }
    if (hook) hook(p);
  }

  void FailNextMalloc(absl::Status s) {
    std::lock_guard<std::mutex> lock(mu_);
    next_error_ = std::move(s);
  }
  void OnFree(std::function<void(void*)> f) {
    std::lock_guard<std::mutex> lock(mu_);
    on_free_ = std::move(f);
  }
  int64_t mallocs() const { return Get(mallocs_); }
  int64_t frees() const { return Get(frees_); }
  int64_t failed_mallocs() const { return Get(failed_mallocs_); }
  int64_t unknown_frees() const { return Get(unknown_frees_); }
  int64_t used() const {
    std::lock_guard<std::mutex> lock(mu_);
    return static_cast<int64_t>(used_);
  }
  bool live(void* p) const {
    std::lock_guard<std::mutex> lock(mu_);
    return live_.count(p) == 1;
  }
  std::vector<size_t> sizes() const {
    std::lock_guard<std::mutex> lock(mu_);
    return sizes_;
  }

 private:
  int64_t Get(const int64_t& v) const {
    std::lock_guard<std::mutex> lock(mu_);
    return v;
  }

  const size_t capacity_;
  mutable std::mutex mu_;
  uintptr_t next_ = 0x100000;
  size_t used_ = 0;
  std::map<void*, size_t> live_;
  std::vector<size_t> sizes_;
  int64_t mallocs_ = 0, frees_ = 0, failed_mallocs_ = 0, unknown_frees_ = 0;
  absl::Status next_error_;
  std::function<void(void*)> on_free_;
};

// A flag the test sets; Wait() sets it and counts the waits. `on_wait` runs in Wait() first.
class FakeFence : public Fence {
 public:
  explicit FakeFence(bool done = false) : done_(done) {}
  bool Done() override { return done_.load(); }
  void Wait() override {
    if (on_wait) on_wait();
    waits_.fetch_add(1);
    done_.store(true);
  }
  void Set() { done_.store(true); }
  int waits() const { return waits_.load(); }

  std::function<void()> on_wait;

 private:
  std::atomic<bool> done_;
  std::atomic<int> waits_{0};
};

std::shared_ptr<FakeFence> Pending() { return std::make_shared<FakeFence>(false); }
std::shared_ptr<FakeFence> Done() { return std::make_shared<FakeFence>(true); }

void* MustAllocate(CachingAllocator& a, size_t bytes) {
  absl::StatusOr<void*> p = a.Allocate(bytes);
  EXPECT_TRUE(p.ok()) << "Allocate(" << bytes << "): " << p.status();
  return p.ok() ? *p : nullptr;
}

// A freed block goes back to the pool only once its fence is done; before, a request of its
// size gets a new block from the device.
TEST(CudaCachingAllocatorTest, ReusesAFreedBlockOnlyOnceItsFenceIsDone) {
  FakeDevice device;
  CachingAllocator a(&device, 0);
  void* x = MustAllocate(a, 1000);
  auto fence = Pending();
  a.Free(x, fence);
  void* y = MustAllocate(a, 1000);
  EXPECT_NE(y, x) << "a block was reused before its fence was done";
  EXPECT_EQ(device.mallocs(), 2);
  fence->Set();
  void* z = MustAllocate(a, 1000);
  EXPECT_EQ(z, x) << "the block whose fence is done was not reused";
  EXPECT_EQ(device.mallocs(), 2);
  EXPECT_EQ(fence->waits(), 0) << "the allocator waited although memory was plentiful";
  EXPECT_EQ(a.reserved_bytes(), 2048);
  EXPECT_EQ(a.cached_bytes(), 0);
}

// A pending block is never handed out, however many requests of its size come; and every
// pending block is checked, not only the oldest.
TEST(CudaCachingAllocatorTest, APendingBlockIsNotHandedOutAndEveryPendingBlockIsChecked) {
  FakeDevice device;
  CachingAllocator a(&device, 0);
  void* held = MustAllocate(a, 4000);
  auto held_fence = Pending();
  a.Free(held, held_fence);
  for (int i = 0; i < 5; ++i) {
    void* p = MustAllocate(a, 4000);
    EXPECT_NE(p, held) << "request " << i << " got the pending block";
  }
  EXPECT_EQ(device.mallocs(), 6);
  EXPECT_EQ(a.cached_bytes(), 4096);

  // The oldest pending block's fence is not done, a younger one's is: the younger is reused.
  void* young = MustAllocate(a, 4000);
  auto young_fence = Pending();
  a.Free(young, young_fence);
  young_fence->Set();
  EXPECT_EQ(MustAllocate(a, 4000), young);
  EXPECT_EQ(device.mallocs(), 7);
  EXPECT_EQ(held_fence->waits(), 0);
}

// The smallest free block of at least the rounded request and at most 5/4 of it.
TEST(CudaCachingAllocatorTest, BestFitWithinFiveFourthsOfTheRequest) {
  FakeDevice device;
  CachingAllocator a(&device, 0);
  void* b64 = MustAllocate(a, 64 * kMiB);
  void* b8 = MustAllocate(a, 8 * kMiB);
  void* b10 = MustAllocate(a, 10 * kMiB);
  void* b12 = MustAllocate(a, 12 * kMiB);
  for (void* p : {b64, b8, b10, b12}) a.Free(p, Done());
  ASSERT_EQ(device.mallocs(), 4);
  ASSERT_EQ(a.cached_bytes(), static_cast<int64_t>(94 * kMiB));

  void* kib = MustAllocate(a, 1 * kKiB);
  EXPECT_NE(kib, b64) << "a 1 KiB request took the 64 MiB block";
  EXPECT_EQ(device.mallocs(), 5) << "a 1 KiB request took a cached block";
  EXPECT_EQ(device.sizes().back(), 1 * kKiB);
  EXPECT_EQ(MustAllocate(a, 9 * kMiB), b10) << "9 MiB rounds to 10 MiB: the 10 MiB block fits";
  EXPECT_EQ(MustAllocate(a, 7 * kMiB + 1), b8) << "8 MiB: the 8 MiB block fits exactly";
  void* fresh = MustAllocate(a, 8 * kMiB);
  EXPECT_NE(fresh, b12) << "12 MiB is past 5/4 of 8 MiB";
  EXPECT_NE(fresh, b64);
  EXPECT_EQ(device.mallocs(), 6);
  EXPECT_EQ(MustAllocate(a, 11 * kMiB), b12) << "11 MiB rounds to 12 MiB";
  EXPECT_EQ(MustAllocate(a, 52 * kMiB), b64) << "64 MiB is within 5/4 of 52 MiB";
  EXPECT_EQ(device.mallocs(), 6);
  EXPECT_EQ(a.cached_bytes(), 0);
}

// 512-byte granularity below 1 MiB, 2 MiB from 1 MiB on; a cached block serves any request
// that rounds to its size.
TEST(CudaCachingAllocatorTest, RoundsSizes) {
  FakeDevice device;
  CachingAllocator a(&device, 0);
  const std::vector<size_t> asked = {1, 512, 513, kMiB - 1, kMiB, 2 * kMiB, 2 * kMiB + 1,
                                     5 * kMiB};
  std::vector<void*> got;
  for (size_t n : asked) got.push_back(MustAllocate(a, n));
  const std::vector<size_t> want = {512,      512,      1024,     kMiB,
                                    2 * kMiB, 2 * kMiB, 4 * kMiB, 6 * kMiB};
  EXPECT_EQ(device.sizes(), want);
  EXPECT_EQ(a.reserved_bytes(), static_cast<int64_t>(1024 + 1024 + kMiB + 4 * kMiB +
                                                     4 * kMiB + 6 * kMiB));
  // The 513-byte request's 1024-byte block serves 600 and 1024 bytes; not 1025 (1536).
  a.Free(got[2], Done());
  EXPECT_EQ(MustAllocate(a, 600), got[2]);
  a.Free(got[2], Done());
  EXPECT_EQ(MustAllocate(a, 1024), got[2]);
  a.Free(got[2], Done());
  EXPECT_NE(MustAllocate(a, 1025), got[2]);
  EXPECT_EQ(device.sizes().back(), 1536u);
}

// bytes_in_use counts the requested sizes and drops at Free, before the fence; the peak, its
// reset, and num_allocs.
TEST(CudaCachingAllocatorTest, StatsCountRequestedBytes) {
  FakeDevice device;
  CachingAllocator a(&device, 0);
  void* x = MustAllocate(a, 1000);
  void* y = MustAllocate(a, 3 * kMiB);
  MemoryStats s = a.stats();
  EXPECT_EQ(s.bytes_in_use, static_cast<int64_t>(1000 + 3 * kMiB));
  EXPECT_EQ(s.peak_bytes, s.bytes_in_use);
  EXPECT_EQ(s.num_allocs, 2);
  EXPECT_EQ(a.reserved_bytes(), static_cast<int64_t>(1024 + 4 * kMiB));
  EXPECT_EQ(a.cached_bytes(), 0);

  auto fence = Pending();
  a.Free(x, fence);
  s = a.stats();
  EXPECT_EQ(s.bytes_in_use, static_cast<int64_t>(3 * kMiB)) << "a Free counts at once";
  EXPECT_EQ(s.peak_bytes, static_cast<int64_t>(1000 + 3 * kMiB));
  EXPECT_EQ(a.cached_bytes(), 1024);
  EXPECT_EQ(a.reserved_bytes(), static_cast<int64_t>(1024 + 4 * kMiB));

  a.ResetPeak();
  EXPECT_EQ(a.stats().peak_bytes, static_cast<int64_t>(3 * kMiB));
  void* z = MustAllocate(a, 100);
  s = a.stats();
  EXPECT_EQ(s.bytes_in_use, static_cast<int64_t>(3 * kMiB + 100));
  EXPECT_EQ(s.peak_bytes, static_cast<int64_t>(3 * kMiB + 100));
  EXPECT_EQ(s.num_allocs, 3);
  a.Free(y, Done());
  a.Free(z, Done());
  s = a.stats();
  EXPECT_EQ(s.bytes_in_use, 0);
  EXPECT_EQ(s.peak_bytes, static_cast<int64_t>(3 * kMiB + 100));
  EXPECT_EQ(s.num_allocs, 3);
  EXPECT_EQ(a.cached_bytes(), a.reserved_bytes());
}

// Scratch (the backend's own working memory) is reserved and bounded by the limit like any
// block, but stays out of the buffers' statistics; it has its own peak. A block freed as
// scratch is handed out again as a buffer and counted as one.
TEST(CudaCachingAllocatorTest, ScratchIsReservedButNotCountedAsBuffers) {
  FakeDevice device;
  CachingAllocator a(&device, 3 * kMiB);
  void* buf = MustAllocate(a, 1000);
  absl::StatusOr<void*> scratch = a.Allocate(2000, /*scratch=*/true);
  ASSERT_TRUE(scratch.ok()) << scratch.status();
  MemoryStats s = a.stats();
  EXPECT_EQ(s.bytes_in_use, 1000);
  EXPECT_EQ(s.peak_bytes, 1000);
  EXPECT_EQ(s.num_allocs, 1);
  EXPECT_EQ(s.reserved_bytes, 1024 + 2048);
  EXPECT_EQ(a.scratch_peak_bytes(), 2000);
  // The limit counts the scratch: 3 MiB - 3 KiB left, so a 3 MiB scratch block does not fit.
  EXPECT_EQ(a.Allocate(3 * kMiB, /*scratch=*/true).status().code(),
            absl::StatusCode::kResourceExhausted);
  a.Free(*scratch, Done());
  EXPECT_EQ(a.stats().bytes_in_use, 1000);
  EXPECT_EQ(a.scratch_peak_bytes(), 2000);
  void* again = MustAllocate(a, 1900);  // the scratch block, now a buffer
  EXPECT_EQ(again, *scratch);
  s = a.stats();
  EXPECT_EQ(s.bytes_in_use, 2900);
  EXPECT_EQ(s.num_allocs, 2);
  a.ResetPeak();
  EXPECT_EQ(a.scratch_peak_bytes(), 0);
  a.Free(again, Done());
  a.Free(buf, Done());
  EXPECT_EQ(a.stats().bytes_in_use, 0);
}

// Past the limit, the pending fences are waited for and their blocks reused, without giving
// anything back to the device.
TEST(CudaCachingAllocatorTest, PastTheLimitPendingFencesAreWaitedForAndTheirBlocksReused) {
  FakeDevice device;
  CachingAllocator a(&device, 4 * kMiB);
  void* x = MustAllocate(a, 2 * kMiB);
  MustAllocate(a, 2 * kMiB);
  auto fence = Pending();
  a.Free(x, fence);
  EXPECT_EQ(MustAllocate(a, 2 * kMiB), x);
  EXPECT_EQ(fence->waits(), 1);
  EXPECT_EQ(device.mallocs(), 2);
  EXPECT_EQ(device.frees(), 0);
  EXPECT_EQ(a.reserved_bytes(), static_cast<int64_t>(4 * kMiB));
}

// When waiting does not give a fitting block, the free blocks go back to the device and the
// device is asked again: past the limit, and when the device itself is full.
TEST(CudaCachingAllocatorTest, ThenCachedBlocksAreReleasedAndTheDeviceAskedAgain) {
  for (bool by_limit : {true, false}) {
    SCOPED_TRACE(by_limit ? "limit" : "device capacity");
    FakeDevice device(by_limit ? SIZE_MAX : 4 * kMiB);
    CachingAllocator a(&device, by_limit ? 4 * kMiB : 0);
    void* x = MustAllocate(a, 2 * kMiB);
    void* y = MustAllocate(a, 2 * kMiB);
    auto fence = Pending();
    a.Free(x, Done());
    a.Free(y, fence);
    void* big = MustAllocate(a, 4 * kMiB);
    EXPECT_NE(big, nullptr);
    EXPECT_EQ(fence->waits(), 1) << "the pending block was not waited for first";
    EXPECT_EQ(device.frees(), 2);
    EXPECT_FALSE(device.live(x));
    EXPECT_FALSE(device.live(y));
    EXPECT_EQ(device.mallocs(), 3);
    EXPECT_EQ(device.failed_mallocs(), by_limit ? 0 : 1);
    EXPECT_EQ(a.reserved_bytes(), static_cast<int64_t>(4 * kMiB));
    EXPECT_EQ(a.cached_bytes(), 0);
    EXPECT_EQ(a.stats().bytes_in_use, static_cast<int64_t>(4 * kMiB));
  }
}

// When nothing helps: ResourceExhausted with the numbers and what to do, after waiting and
// releasing; the allocator stays usable.
TEST(CudaCachingAllocatorTest, ThenResourceExhaustedWithTheNumbers) {
  FakeDevice device;
  CachingAllocator a(&device, 8 * kMiB);
  void* x = MustAllocate(a, 5 * kMiB);  // a 6 MiB block
  void* small = MustAllocate(a, 1000);
  auto fence = Pending();
  a.Free(small, fence);
  absl::StatusOr<void*> p = a.Allocate(3 * kMiB);  // a 4 MiB block: 10 MiB reserved
  ASSERT_EQ(p.status().code(), absl::StatusCode::kResourceExhausted) << p.status();
  const std::string m(p.status().message());
  EXPECT_THAT(m, HasSubstr("3145728 bytes asked for"));
  EXPECT_THAT(m, HasSubstr("4194304-byte block"));
  EXPECT_THAT(m, HasSubstr("5242880 bytes in use"));
  EXPECT_THAT(m, HasSubstr("6291456 bytes reserved (0 of them cached)"));
  EXPECT_THAT(m, HasSubstr("8388608-byte limit"));
  EXPECT_THAT(m, HasSubstr("smaller batch"));
  EXPECT_THAT(m, HasSubstr("activation checkpointing"));
  EXPECT_THAT(m, HasSubstr("FULL_SHARD"));
  EXPECT_THAT(m, HasSubstr("larger memory limit"));
  EXPECT_EQ(fence->waits(), 1);
  EXPECT_EQ(device.frees(), 1) << "the cached 1 KiB block was not released";
  EXPECT_FALSE(device.live(small));
  EXPECT_TRUE(device.live(x));
  MemoryStats s = a.stats();
  EXPECT_EQ(s.bytes_in_use, static_cast<int64_t>(5 * kMiB));
  EXPECT_EQ(s.num_allocs, 2);
  EXPECT_EQ(a.reserved_bytes(), static_cast<int64_t>(6 * kMiB));
  EXPECT_NE(MustAllocate(a, 2 * kMiB), nullptr) << "a request within the limit fails";
  EXPECT_EQ(a.reserved_bytes(), static_cast<int64_t>(8 * kMiB));

  // Without a limit, the device's own error is the cause.
  FakeDevice full(4 * kMiB);
  CachingAllocator b(&full, 0);
  p = b.Allocate(6 * kMiB);
  ASSERT_EQ(p.status().code(), absl::StatusCode::kResourceExhausted) << p.status();
  EXPECT_THAT(p.status().message(), HasSubstr("6291456 bytes asked for"));
  EXPECT_THAT(p.status().message(), HasSubstr("the device's memory (no limit set)"));
  EXPECT_THAT(p.status().message(), HasSubstr("fake device: out of memory"));
  EXPECT_EQ(full.failed_mallocs(), 2) << "asked once, then again after releasing";
}

// A device error other than out of memory is returned as it is, without waiting or releasing.
TEST(CudaCachingAllocatorTest, OtherDeviceErrorsPassThrough) {
  FakeDevice device;
  CachingAllocator a(&device, 0);
  a.Free(MustAllocate(a, 1000), Done());
  auto fence = Pending();
  a.Free(MustAllocate(a, 2000), fence);
  device.FailNextMalloc(absl::InternalError("illegal address"));
  absl::StatusOr<void*> p = a.Allocate(3 * kMiB);
  EXPECT_EQ(p.status().code(), absl::StatusCode::kInternal) << p.status();
  EXPECT_EQ(p.status().message(), "illegal address");
  EXPECT_EQ(fence->waits(), 0);
  EXPECT_EQ(device.frees(), 0);
  EXPECT_EQ(a.stats().num_allocs, 2);
  EXPECT_EQ(a.reserved_bytes(), 1024 + 2048);
}

TEST(CudaCachingAllocatorTest, AllocateZeroAndFreeNull) {
  FakeDevice device;
  CachingAllocator a(&device, 0);
  absl::StatusOr<void*> p = a.Allocate(0);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(*p, nullptr);
  auto fence = Pending();
  a.Free(nullptr, fence);
  a.Free(nullptr, nullptr);
  MemoryStats s = a.stats();
  EXPECT_EQ(s.bytes_in_use, 0);
  EXPECT_EQ(s.peak_bytes, 0);
  EXPECT_EQ(s.num_allocs, 0);
  EXPECT_EQ(a.reserved_bytes(), 0);
  EXPECT_EQ(a.bad_frees(), 0);
  EXPECT_EQ(device.mallocs(), 0);
}

// A pointer never handed out, and a second free of a block, change nothing and are counted.
TEST(CudaCachingAllocatorTest, BadFreesAreCountedAndHarmless) {
  FakeDevice device;
  CachingAllocator a(&device, 0);
  void* x = MustAllocate(a, 1000);
  void* y = MustAllocate(a, 1000);
  int not_a_block = 0;
  a.Free(&not_a_block, Done());
  EXPECT_EQ(a.bad_frees(), 1);
  EXPECT_EQ(a.stats().bytes_in_use, 2000);
  EXPECT_EQ(a.cached_bytes(), 0);

  auto fence = Pending();
  a.Free(x, fence);
  a.Free(x, Done());  // a second free, with a done fence, must not make x reusable early
  EXPECT_EQ(a.bad_frees(), 2);
  EXPECT_EQ(a.stats().bytes_in_use, 1000);
  EXPECT_NE(MustAllocate(a, 1000), x);
  fence->Set();
  EXPECT_EQ(MustAllocate(a, 1000), x);
  void* next = MustAllocate(a, 1000);
  EXPECT_NE(next, x) << "a double free handed the same block out twice";
  EXPECT_NE(next, y);
  EXPECT_EQ(a.stats().bytes_in_use, 4000);
  EXPECT_EQ(device.mallocs(), 4);
  EXPECT_EQ(device.unknown_frees(), 0);
}

// ReleaseCached gives back the free blocks only: not the pending ones nor those in use.
TEST(CudaCachingAllocatorTest, ReleaseCachedGivesBackOnlyFreeBlocks) {
  FakeDevice device;
  CachingAllocator a(&device, 0);
  void* used = MustAllocate(a, 1000);
  void* freed = MustAllocate(a, 3 * kMiB);
  void* pending = MustAllocate(a, 2000);
  a.Free(freed, Done());
  auto fence = Pending();
  a.Free(pending, fence);
  a.ReleaseCached();
  EXPECT_EQ(device.frees(), 1);
  EXPECT_FALSE(device.live(freed));
  EXPECT_TRUE(device.live(used));
  EXPECT_TRUE(device.live(pending));
  EXPECT_EQ(fence->waits(), 0);
  EXPECT_EQ(a.reserved_bytes(), 1024 + 2048);
  EXPECT_EQ(a.cached_bytes(), 2048);
  fence->Set();
  a.ReleaseCached();
  EXPECT_EQ(device.frees(), 2);
  EXPECT_EQ(a.reserved_bytes(), 1024);
  EXPECT_EQ(a.cached_bytes(), 0);
  EXPECT_EQ(a.stats().bytes_in_use, 1000);
}

// Fence::Wait() runs without the allocator's lock: a thread that frees while the allocator
// waits is not blocked.
TEST(CudaCachingAllocatorTest, FenceWaitRunsWithoutTheLock) {
  FakeDevice device;
  CachingAllocator a(&device, 2 * kMiB);
  void* x = MustAllocate(a, 1000);
  void* y = MustAllocate(a, 1000);
  auto fence = Pending();
  fence->on_wait = [&] {
    auto freed = std::async(std::launch::async, [&] {
      a.Free(y, Done());
      return a.stats().bytes_in_use;
    });
    if (freed.wait_for(std::chrono::seconds(20)) != std::future_status::ready) {
      std::fprintf(stderr, "Free from another thread blocked while the allocator waited\n");
      std::abort();
    }
    EXPECT_EQ(freed.get(), 0);
  };
  a.Free(x, fence);
  absl::StatusOr<void*> p = a.Allocate(2 * kMiB);  // past the limit: waits for x's fence
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(fence->waits(), 1);
  EXPECT_EQ(device.frees(), 2) << "x and y given back for the 2 MiB block";
  EXPECT_EQ(a.reserved_bytes(), static_cast<int64_t>(2 * kMiB));
}

// Threads allocating and freeing at once: no block is handed out twice, and the statistics
// add up at the end. With a limit, the out-of-memory path runs concurrently too.
TEST(CudaCachingAllocatorTest, ConcurrentAllocateAndFreeKeepStatsConsistent) {
  constexpr int kThreads = 4;
  constexpr int kOps = 1000;
  // Each thread asks for growing small sizes (512 bytes to 200 KiB, a cycle of 400 requests
  // whose blocks alone are 39 MiB), and every tenth time for 1 to 4 MiB: the cache outgrows the
  // limit even when the threads happen to run one after the other, so the allocator trims.
  constexpr int64_t kLimit = 24 * kMiB;  // 4 threads x 4 MiB = 16 MiB in use at most
  auto size_of = [](int64_t j, std::mt19937& rng) -> size_t {
    if (j % 10 == 9) return kMiB + rng() % (3 * kMiB);
    return 512 * (j % 400 + 1) - rng() % 512;
  };
  for (int64_t limit : {int64_t{0}, kLimit}) {
    SCOPED_TRACE(limit == 0 ? "no limit" : "24 MiB limit");
    FakeDevice device;
    std::atomic<int64_t> oom{0}, allocs{0}, over_limit{0};
    std::mutex live_mu;
    std::set<void*> live;  // handed out now, over all threads
    std::atomic<int> double_hand_outs{0};
    {
      CachingAllocator a(&device, limit);
      std::vector<std::thread> threads;
      for (int t = 0; t < kThreads; ++t) {
        threads.emplace_back([&, t] {
          std::mt19937 rng(1234 + t);
          std::vector<void*> mine;
          int64_t asked = 0;
          for (int i = 0; i < kOps; ++i) {
            // At most one block per thread (two without a limit).
            const size_t most = limit == 0 ? 2 : 1;
            const bool allocate = mine.empty() || (mine.size() < most && rng() % 2 == 0);
            if (allocate) {
              absl::StatusOr<void*> p = a.Allocate(size_of(asked++, rng));
              if (!p.ok()) {
                EXPECT_EQ(p.status().code(), absl::StatusCode::kResourceExhausted);
                ++oom;
                continue;
              }
              ++allocs;
              {
                std::lock_guard<std::mutex> lock(live_mu);
                if (!live.insert(*p).second) ++double_hand_outs;
              }
              mine.push_back(*p);
            } else {
              void* p = mine.back();
              mine.pop_back();
              {
                std::lock_guard<std::mutex> lock(live_mu);
                live.erase(p);
              }
              a.Free(p, rng() % 4 == 0 ? nullptr : Done());
            }
            if (limit > 0 && a.reserved_bytes() > limit) ++over_limit;
          }
          for (void* p : mine) {
            {
              std::lock_guard<std::mutex> lock(live_mu);
              live.erase(p);
            }
            a.Free(p, Done());
          }
        });
      }
      for (auto& th : threads) th.join();
      EXPECT_EQ(double_hand_outs.load(), 0);
      EXPECT_EQ(over_limit.load(), 0);
      const MemoryStats s = a.stats();
      EXPECT_EQ(s.bytes_in_use, 0);
      EXPECT_EQ(s.num_allocs, allocs.load());
      EXPECT_GT(s.num_allocs, kThreads * kOps / 4);
      EXPECT_EQ(a.reserved_bytes(), a.cached_bytes());
      EXPECT_EQ(a.reserved_bytes(), device.used());
      EXPECT_EQ(a.bad_frees(), 0);
      if (limit == 0) {
        EXPECT_EQ(oom.load(), 0);
        EXPECT_EQ(device.frees(), 0) << "nothing to trim without a limit";
      } else {
        EXPECT_GT(device.frees(), 0) << "the limit never made the allocator trim";
        EXPECT_LT(oom.load(), kThreads * kOps / 100) << "too many failures under the limit";
      }
      std::printf("%s: %lld allocations, %lld device mallocs, %lld device frees, %lld out of "
                  "memory\n",
                  limit == 0 ? "no limit" : "24 MiB limit", static_cast<long long>(allocs.load()),
                  static_cast<long long>(device.mallocs()),
                  static_cast<long long>(device.frees()), static_cast<long long>(oom.load()));
    }
    EXPECT_EQ(device.frees(), device.mallocs());
    EXPECT_EQ(device.used(), 0);
  }
}

// Destruction waits for the pending fences, then gives every block back: free, pending, and
// still in use.
TEST(CudaCachingAllocatorTest, DestructorWaitsForFencesAndGivesEveryBlockBack) {
  FakeDevice device;
  auto fence = Pending();
  void* pending = nullptr;
  bool pending_freed_after_wait = false;
  device.OnFree([&](void* p) {
    if (p == pending) pending_freed_after_wait = fence->waits() == 1;
  });
  {
    CachingAllocator a(&device, 0);
    void* freed = MustAllocate(a, 1000);
    pending = MustAllocate(a, 3 * kMiB);
    MustAllocate(a, 200 * kKiB);  // still in use
    a.Free(freed, Done());
    a.Free(pending, fence);
    EXPECT_EQ(device.frees(), 0);
  }
  EXPECT_EQ(fence->waits(), 1);
  EXPECT_TRUE(pending_freed_after_wait) << "the pending block went back before its fence";
  EXPECT_EQ(device.mallocs(), 3);
  EXPECT_EQ(device.frees(), 3);
  EXPECT_EQ(device.used(), 0);
  EXPECT_EQ(device.unknown_frees(), 0);
}

}  // namespace
}  // namespace fsdp::cuda_internal
