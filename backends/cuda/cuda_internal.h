// What the CUDA backend's parts share (cuda_backend.cc, cuda_ops.cc, the data planes): the
// backend's state, CUDA error conversion, events and stream-ordered scratch memory.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "backends/cuda/caching_allocator.h"
#include "fsdp/cuda_backend.h"
#include "fsdp/data_plane.h"
#include "fsdp/ops.h"

namespace fsdp::cuda_internal {

// OK, or Internal "<what>: <cudaGetErrorName>: <cudaGetErrorString>" (ResourceExhausted for
// cudaErrorMemoryAllocation).
absl::Status CudaStatus(cudaError_t e, const std::string& what);

// The first error of a backend: once set, every wait returns it and no more work is issued.
// It also holds the collectives in flight that the host must watch while it blocks: an NCCL
// collective whose peer never arrives never completes on the device, so every host wait of the
// backend polls its stream and these events' Done() (which checks the collective's deadline
// and NCCL's asynchronous errors, and fails the group) instead of blocking in CUDA.
class Failure {
 public:
  void Set(const absl::Status& s);
  absl::Status Get() const;
  bool failed() const { return failed_.load(std::memory_order_acquire); }

  void Watch(Event e);
  // Polls the watched events, forgetting the completed ones.
  void PollWatched();

 private:
  mutable std::mutex mu_;
  std::atomic<bool> failed_{false};
  absl::Status status_;
  std::mutex watch_mu_;
  std::vector<Event> watched_;
};

// Blocks until `query` (cudaEventQuery / cudaStreamQuery of the backend's work) stops
// returning cudaErrorNotReady or `failure` is set, polling the watched collectives meanwhile;
// the error of the query, if any, is set on `failure`. Returns failure->Get().
absl::Status HostWait(const std::shared_ptr<Failure>& failure, cudaEvent_t event,
                      const char* what);

// A CUDA event recorded on a stream, as an fsdp::Event. Done() polls cudaEventQuery; Wait()
// synchronises on the event; both report the backend's failure. completed_at() is when the
// host first saw it complete.
class CudaEventState : public EventState {
 public:
  CudaEventState(int device, cudaEvent_t event, std::shared_ptr<Failure> failure)
      : device_(device), event_(event), failure_(std::move(failure)) {}
  ~CudaEventState() override;
  bool Done() const override;
  absl::Status Wait() override;
  std::optional<std::chrono::steady_clock::time_point> completed_at() const override;
  cudaEvent_t event() const { return event_; }
  int device() const { return device_; }

 private:
  void MarkDone() const;
  int device_;
  cudaEvent_t event_;
  std::shared_ptr<Failure> failure_;
  mutable std::once_flag done_once_;
  mutable std::atomic<bool> done_{false};
  mutable std::chrono::steady_clock::time_point at_;
};

// Records a new event on `stream` of `device`. On a CUDA error the failure is set and the
// returned event carries it.
Event RecordEvent(int device, cudaStream_t stream, const std::shared_ptr<Failure>& failure);

// The CUDA stream of `s` on backend `b`.
cudaStream_t StreamOf(CudaBackend& b, Stream s);
// The backend's failure state (shared with its events).
const std::shared_ptr<Failure>& FailureOf(CudaBackend& b);
// Sets the CUDA device of the calling thread to the backend's.
absl::Status UseDevice(CudaBackend& b);

// Stream-ordered scratch memory: `bytes` from the caching allocator for work about to be
// issued on stream `s`; it is given back with Release() after that work has been issued, and
// reused only once both streams have run past that point.
class Scratch {
 public:
  static absl::StatusOr<Scratch> Create(CudaBackend& b, size_t bytes);
  Scratch() = default;
  Scratch(Scratch&& o) noexcept { *this = std::move(o); }
  Scratch& operator=(Scratch&& o) noexcept;
  ~Scratch() { Release(); }
  void* get() const { return p_; }
  template <typename T>
  T* as() const { return static_cast<T*>(p_); }
  void Release();

 private:
  CudaBackend* b_ = nullptr;
  void* p_ = nullptr;
  size_t bytes_ = 0;
};

// A device pointer to the first element of a view of this backend (nullptr when empty).
inline char* Ptr(const View& v) {
  return v.count == 0 ? nullptr : static_cast<char*>(v.allocation.storage) + v.offset;
}

// The op table (cuda_ops.cc).
std::unique_ptr<Ops> MakeCudaOps(CudaBackend* backend);

// The data plane of `group` for backend `b` (cuda_data_plane.cc): NCCL when every rank has a
// GPU of its own; copies and reduction kernels between the ranks' streams when the ranks are
// threads of this process sharing one GPU. Collective over `group`.
absl::StatusOr<std::unique_ptr<DataPlane>> CreateCudaDataPlane(CudaBackend& b,
                                                               Communicator& group);

}  // namespace fsdp::cuda_internal
