// The device-memory caching allocator of the CUDA backend. It keeps the blocks it got from the
// device and hands them out again, so that a training step does not call cudaMalloc and
// cudaFree (which synchronise the device) for every buffer. It makes no CUDA call itself: it
// works over DeviceMemory (the backend's cudaMalloc / cudaFree) and Fence (the backend's events),
// so its logic is tested on the host with fakes.
//
// - Blocks. A request is rounded up to a multiple of 512 bytes below 1 MiB and to a multiple of
//   2 MiB from 1 MiB on; the rounded size is what the device gives for a new block. A block is
//   never split or merged: it is handed out whole, and only to a request whose rounded size is
//   at least 4/5 of the block's (a block of at most 5/4 of the rounded request, the smallest
//   such; ties go to the lowest address), so a small request never takes a large block.
// - Stream-ordered free (fsdp/backend.h, as cudaFreeAsync). Free(p, fence) counts the block free
//   at once in the statistics but puts it on a pending list with the fence: a point in the
//   device's work after every use of the block already issued (the backend records one event per
//   stream). The block is handed out again only once its fence is Done(). Allocate first moves
//   every pending block whose fence is Done() to the free pool (all of them, not only the oldest),
//   then takes the best-fitting free block, or else gets a new block from the device.
// - Out of memory: the device's Malloc failed with ResourceExhausted, or the reserved bytes
//   would pass the limit. Then, in order, until one succeeds: wait for every pending fence and
//   retry from the pool; give every free block back to the device and retry the device; fail
//   with ResourceExhausted saying how many bytes were asked for, in use, reserved and cached, and
//   the limit, and what to do. Other device errors are returned as they are.
// - Statistics (fsdp::MemoryStats): bytes_in_use is the sum of the requested (not rounded)
//   sizes handed out and not freed; peak_bytes its high-water mark since construction or
//   ResetPeak(); num_allocs the Allocate calls that returned memory. reserved_bytes() is what the
//   device gave and has not got back; cached_bytes() the part of it not handed out (pending and
//   free blocks).
// - Misuse: Allocate(0) returns nullptr and counts nothing; Free(nullptr, ...) does nothing.
//   Freeing a pointer that is not a block handed out (never given, or already freed) changes
//   nothing and is counted in bad_frees().
// - Threads: every method may be called from any thread. One mutex guards the state; the device
//   (Malloc, Free) and Fence::Wait() are called without it, so a Free from another thread, or a
//   device call that synchronises, never waits behind a thread that is waiting for the device.
//   The out-of-memory path and ReleaseCached() run one at a time (a second mutex, taken before
//   the first), so a thread that runs out of memory sees the blocks another thread is giving
//   back as given back.
// - Destruction waits for every pending fence, then gives every block back to the device,
//   including blocks still handed out: the backend frees its buffers and synchronises first.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <set>
#include <unordered_map>
#include <utility>
#include <vector>

#include "fsdp/backend.h"
#include "fsdp/status.h"

namespace fsdp::cuda_internal {

// The device's memory, block by block (cudaMalloc / cudaFree in the CUDA backend).
class DeviceMemory {
 public:
  virtual ~DeviceMemory();
  // `bytes` of device memory; ResourceExhausted when the device is out of memory.
  virtual absl::StatusOr<void*> Malloc(size_t bytes) = 0;
  // Gives back a block Malloc returned. May synchronise the device: the allocator calls it only
  // when it trims its cache (out of memory, ReleaseCached(), destruction).
  virtual void Free(void* p) = 0;
};

// A point in the device's work (the CUDA backend records one event per stream at Free time).
class Fence {
 public:
  virtual ~Fence();
  // Whether the work before the point has run; never blocks.
  virtual bool Done() = 0;
  // Blocks the calling thread until Done().
  virtual void Wait() = 0;
};

class CachingAllocator {
 public:
  // `device` must outlive the allocator. `limit_bytes` caps the reserved bytes (0 = no limit
  // but the device's memory).
  CachingAllocator(DeviceMemory* device, int64_t limit_bytes);
  // Waits for every pending fence, then gives every block back to the device.
  ~CachingAllocator();
  CachingAllocator(const CachingAllocator&) = delete;
  CachingAllocator& operator=(const CachingAllocator&) = delete;

  // A block of at least `bytes` (see the top of the file); nullptr for 0 bytes. Out of memory
  // is ResourceExhausted.
  // `scratch`: the backend's own working memory (kernel workspaces, rounded GEMM operands), not
  // a buffer asked for through Backend::Allocate: it counts towards reserved_bytes() and the
  // limit, not towards stats()' bytes in use, peak and allocations (so that those stay what the
  // runtime asked for, as on the CPU backend); scratch_peak_bytes() has its own high-water mark.
  absl::StatusOr<void*> Allocate(size_t bytes, bool scratch = false);
  // Stream-ordered free: `p` counts free at once and is handed out again once `fence` is done
  // (a null fence: at once). `p` must come from Allocate and not be freed yet; otherwise nothing
  // changes and bad_frees() counts it. Free(nullptr, ...) does nothing.
  void Free(void* p, std::shared_ptr<Fence> fence);

  MemoryStats stats() const;  // reserved_bytes: reserved_bytes()
  // The most scratch bytes handed out at once since construction or ResetPeak().
  int64_t scratch_peak_bytes() const;
  // peak_bytes = bytes_in_use now (and the scratch peak the scratch in use).
  void ResetPeak();
  // Bytes the device gave and has not got back.
  int64_t reserved_bytes() const;
  // Reserved bytes of the blocks not handed out (pending and free).
  int64_t cached_bytes() const;
  // Frees that were ignored: pointers not handed out by this allocator, or already freed.
  int64_t bad_frees() const;
  // Gives every free block back to the device (first moving the pending blocks whose fence is
  // done to the free pool); pending and handed-out blocks stay.
  void ReleaseCached();

 private:
  enum class State : uint8_t { kInUse, kPending, kFree };
  struct Block {
    size_t size = 0;       // rounded: what the device gave
    size_t requested = 0;  // while handed out
    bool scratch = false;  // while handed out
    State state = State::kInUse;
    std::shared_ptr<Fence> fence;  // while pending
  };

  // Moves the pending blocks whose fence is done to the free pool.
  void CollectDoneLocked();
  // The best-fitting free block for a request of `rounded` bytes, handed out; nullptr if none.
  void* TakeFromPoolLocked(size_t rounded, size_t requested, bool scratch);
  void HandOutLocked(Block& block, size_t requested, bool scratch);
  // A new block from the device (within the limit). ResourceExhausted when out of memory;
  // other errors are the device's.
  absl::StatusOr<void*> MallocBlock(size_t rounded, size_t requested, bool scratch);
  // Gives the free blocks back to the device. Called with trim_mu_ held, not mu_.
  void ReleaseFreeBlocks();
  absl::Status OutOfMemory(size_t requested, size_t rounded, const absl::Status& device) const;

  DeviceMemory* const device_;
  const int64_t limit_;

  std::mutex trim_mu_;  // the out-of-memory path and ReleaseCached(); taken before mu_
  mutable std::mutex mu_;
  std::unordered_map<void*, Block> blocks_;   // every block held (in use, pending, free)
  std::set<std::pair<size_t, void*>> free_;   // the free pool by (size, address)
  std::vector<void*> pending_;                // blocks waiting for their fence
  int64_t in_use_ = 0;        // requested bytes handed out
  int64_t peak_ = 0;
  int64_t num_allocs_ = 0;
  int64_t scratch_in_use_ = 0;  // requested scratch bytes handed out
  int64_t scratch_peak_ = 0;
  int64_t reserved_ = 0;      // bytes the device gave and has not got back
  int64_t handed_out_ = 0;    // rounded bytes of the blocks handed out
  int64_t in_flight_ = 0;     // bytes of device Mallocs under way (counted against the limit)
  int64_t bad_frees_ = 0;
};

}  // namespace fsdp::cuda_internal
