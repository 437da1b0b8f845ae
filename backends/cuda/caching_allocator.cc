// The caching allocator of the CUDA backend (backends/cuda/caching_allocator.h).
#include "backends/cuda/caching_allocator.h"

#include <algorithm>
#include <string>

#include "absl/strings/str_cat.h"

namespace fsdp::cuda_internal {
namespace {

constexpr size_t kSmallGranularity = 512;
constexpr size_t kLargeFrom = size_t{1} << 20;         // 1 MiB
constexpr size_t kLargeGranularity = size_t{2} << 20;  // 2 MiB
// Larger requests fail as out of memory at once (the rounding and the 5/4 bound stay exact).
constexpr size_t kMaxRequest = size_t{1} << 60;

size_t RoundUp(size_t bytes) {
  const size_t g = bytes < kLargeFrom ? kSmallGranularity : kLargeGranularity;
  return (bytes + g - 1) / g * g;
}

}  // namespace

DeviceMemory::~DeviceMemory() = default;
Fence::~Fence() = default;

CachingAllocator::CachingAllocator(DeviceMemory* device, int64_t limit_bytes)
    : device_(device), limit_(std::max<int64_t>(0, limit_bytes)) {}

CachingAllocator::~CachingAllocator() {
  std::vector<std::shared_ptr<Fence>> fences;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (void* p : pending_) fences.push_back(blocks_[p].fence);
  }
  for (const auto& f : fences) f->Wait();
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [p, block] : blocks_) device_->Free(p);
  blocks_.clear();
  free_.clear();
  pending_.clear();
}

absl::StatusOr<void*> CachingAllocator::Allocate(size_t bytes, bool scratch) {
  if (bytes == 0) return nullptr;
  const size_t rounded = bytes > kMaxRequest ? 0 : RoundUp(bytes);
  if (rounded == 0) {
    std::lock_guard<std::mutex> lock(mu_);
    return OutOfMemory(bytes, bytes, absl::ResourceExhaustedError("larger than any device"));
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    CollectDoneLocked();
    if (void* p = TakeFromPoolLocked(rounded, bytes, scratch)) return p;
  }
  absl::StatusOr<void*> p = MallocBlock(rounded, bytes, scratch);
  if (p.ok() || p.status().code() != absl::StatusCode::kResourceExhausted) return p;

  // Out of memory. One thread at a time trims; a thread that waited here sees what the one
  // before it gave back.
  std::lock_guard<std::mutex> trim(trim_mu_);
  // 1. Wait for the pending blocks (without the lock: their frees may come from other threads)
  //    and retry from the pool.
  std::vector<std::shared_ptr<Fence>> fences;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (void* p : pending_) fences.push_back(blocks_[p].fence);
  }
  for (const auto& f : fences) f->Wait();
  fences.clear();
  {
    std::lock_guard<std::mutex> lock(mu_);
    CollectDoneLocked();
    if (void* q = TakeFromPoolLocked(rounded, bytes, scratch)) return q;
  }
  // 2. Give the free blocks back and retry the device.
  ReleaseFreeBlocks();
  p = MallocBlock(rounded, bytes, scratch);
  if (p.ok() || p.status().code() != absl::StatusCode::kResourceExhausted) return p;
  // 3. Fail.
  std::lock_guard<std::mutex> lock(mu_);
  return OutOfMemory(bytes, rounded, p.status());
}

void CachingAllocator::Free(void* p, std::shared_ptr<Fence> fence) {
  if (p == nullptr) return;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = blocks_.find(p);
  if (it == blocks_.end() || it->second.state != State::kInUse) {
    ++bad_frees_;
    return;
  }
  Block& block = it->second;
  (block.scratch ? scratch_in_use_ : in_use_) -= static_cast<int64_t>(block.requested);
  handed_out_ -= static_cast<int64_t>(block.size);
  block.requested = 0;
  if (fence == nullptr) {
    block.state = State::kFree;
    free_.emplace(block.size, p);
  } else {
    block.state = State::kPending;
    block.fence = std::move(fence);
    pending_.push_back(p);
  }
}

MemoryStats CachingAllocator::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return MemoryStats{in_use_, peak_, num_allocs_, reserved_};
}

int64_t CachingAllocator::scratch_peak_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return scratch_peak_;
}

void CachingAllocator::ResetPeak() {
  std::lock_guard<std::mutex> lock(mu_);
  peak_ = in_use_;
  scratch_peak_ = scratch_in_use_;
}

int64_t CachingAllocator::reserved_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return reserved_;
}

int64_t CachingAllocator::cached_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return reserved_ - handed_out_;
}

int64_t CachingAllocator::bad_frees() const {
  std::lock_guard<std::mutex> lock(mu_);
  return bad_frees_;
}

void CachingAllocator::ReleaseCached() {
  std::lock_guard<std::mutex> trim(trim_mu_);
  ReleaseFreeBlocks();
}

void CachingAllocator::CollectDoneLocked() {
  auto still_pending = std::remove_if(pending_.begin(), pending_.end(), [&](void* p) {
    Block& block = blocks_[p];
    if (!block.fence->Done()) return false;
    block.fence.reset();
    block.state = State::kFree;
    free_.emplace(block.size, p);
    return true;
  });
  pending_.erase(still_pending, pending_.end());
}

void* CachingAllocator::TakeFromPoolLocked(size_t rounded, size_t requested, bool scratch) {
  auto it = free_.lower_bound({rounded, nullptr});
  if (it == free_.end() || it->first > rounded + rounded / 4) return nullptr;
  void* p = it->second;
  free_.erase(it);
  HandOutLocked(blocks_[p], requested, scratch);
  return p;
}

void CachingAllocator::HandOutLocked(Block& block, size_t requested, bool scratch) {
  block.state = State::kInUse;
  block.requested = requested;
  block.scratch = scratch;
  handed_out_ += static_cast<int64_t>(block.size);
  if (scratch) {
    scratch_in_use_ += static_cast<int64_t>(requested);
    scratch_peak_ = std::max(scratch_peak_, scratch_in_use_);
    return;
  }
  in_use_ += static_cast<int64_t>(requested);
  peak_ = std::max(peak_, in_use_);
  ++num_allocs_;
}

absl::StatusOr<void*> CachingAllocator::MallocBlock(size_t rounded, size_t requested,
                                                    bool scratch) {
  const auto n = static_cast<int64_t>(rounded);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (limit_ > 0 && reserved_ + in_flight_ + n > limit_) {
      return absl::ResourceExhaustedError("the block would pass the limit");
    }
    in_flight_ += n;
  }
  // Without the lock: cudaMalloc may take a while, and may synchronise.
  absl::StatusOr<void*> p = device_->Malloc(rounded);
  std::lock_guard<std::mutex> lock(mu_);
  in_flight_ -= n;
  if (!p.ok()) return p.status();
  if (*p == nullptr) {
    return absl::InternalError(absl::StrCat("the device gave a null block for ", rounded,
                                            " bytes"));
  }
  reserved_ += n;
  Block& block = blocks_[*p];
  block = Block{rounded, 0, false, State::kInUse, nullptr};
  HandOutLocked(block, requested, scratch);
  return *p;
}

void CachingAllocator::ReleaseFreeBlocks() {
  std::vector<std::pair<void*, size_t>> release;
  {
    std::lock_guard<std::mutex> lock(mu_);
    CollectDoneLocked();
    release.reserve(free_.size());
    for (const auto& [size, p] : free_) {
      release.emplace_back(p, size);
      blocks_.erase(p);
    }
    free_.clear();
  }
  if (release.empty()) return;
  // Without the lock: cudaFree synchronises the device. Until they are given back, the blocks
  // stay counted as reserved (and cached), so no thread goes past the limit meanwhile.
  int64_t released = 0;
  for (const auto& [p, size] : release) {
    device_->Free(p);
    released += static_cast<int64_t>(size);
  }
  std::lock_guard<std::mutex> lock(mu_);
  reserved_ -= released;
}

absl::Status CachingAllocator::OutOfMemory(size_t requested, size_t rounded,
                                           const absl::Status& device) const {
  const std::string limit =
      limit_ > 0 ? absl::StrCat("the ", limit_, "-byte limit")
                 : std::string("the device's memory (no limit set)");
  return absl::ResourceExhaustedError(absl::StrCat(
      "out of memory on the device: ", requested, " bytes asked for (a ", rounded, "-byte block) with ",
      in_use_, " bytes in use and ", reserved_, " bytes reserved (", reserved_ - handed_out_,
      " of them cached) of ", limit, "; cause: ", std::string(device.message()),
      "; use a smaller batch, activation checkpointing or FULL_SHARD, or a larger memory "
      "limit"));
}

}  // namespace fsdp::cuda_internal
