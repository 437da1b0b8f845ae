// What the cuda backend's two data planes share (nccl_data_plane.cc, shared_gpu_data_plane.cc;
// cuda_data_plane.cc chooses between them): deadlines, a scoped CUDA device, owned CUDA events,
// and the description and pointer check of a call.
#pragma once

#include <algorithm>
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "absl/time/time.h"
#include "backends/cuda/cuda_internal.h"
#include "fsdp/communicator.h"

namespace fsdp::cuda_internal {

using Clock = std::chrono::steady_clock;

// The most inputs one reduce kernel takes (kernels/cuda/kernels.h).
inline constexpr int kMaxReduceInputs = 16;

// A status that shares nothing with `s` (statuses handed between threads; see
// collectives/work_state.h).
inline absl::Status Detach(const absl::Status& s) {
  return s.ok() ? absl::OkStatus() : absl::Status(s.code(), s.message());
}

// now + timeout (an infinite or huge timeout is capped at 100 years rather than overflowing).
inline Clock::time_point DeadlineAfter(absl::Duration timeout) {
  const absl::Duration capped =
      std::clamp(timeout, absl::ZeroDuration(), absl::Hours(24 * 365 * 100));
  return Clock::now() + absl::ToChronoNanoseconds(capped);
}

inline std::string Dur(absl::Duration d) { return absl::FormatDuration(d); }

// Sets the calling thread's CUDA device for a scope and restores the previous one: for the
// paths that may run on any thread (Wait, Abort, destructors).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) : device_(device) {
    if (cudaGetDevice(&saved_) != cudaSuccess) saved_ = -1;
    if (saved_ != device_) (void)cudaSetDevice(device_);
  }
  ~DeviceGuard() {
    if (saved_ >= 0 && saved_ != device_) (void)cudaSetDevice(saved_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int device_;
  int saved_ = -1;
};

// A CUDA event owned here (destroyed with the last reference; a pending event's resources are
// released by CUDA once it completes, and a stream that already waits on it keeps waiting).
class DeviceEvent {
 public:
  static absl::StatusOr<std::shared_ptr<DeviceEvent>> Record(cudaStream_t stream,
                                                             const std::string& what) {
    cudaEvent_t e = nullptr;
    FSDP_RETURN_IF_ERROR(CudaStatus(cudaEventCreateWithFlags(&e, cudaEventDisableTiming),
                                    what + ": cudaEventCreateWithFlags"));
    std::shared_ptr<DeviceEvent> ev(new DeviceEvent(e));
    FSDP_RETURN_IF_ERROR(CudaStatus(cudaEventRecord(e, stream), what + ": cudaEventRecord"));
    return ev;
  }
  ~DeviceEvent() { (void)cudaEventDestroy(event_); }
  DeviceEvent(const DeviceEvent&) = delete;
  DeviceEvent& operator=(const DeviceEvent&) = delete;
  cudaEvent_t get() const { return event_; }

 private:
  explicit DeviceEvent(cudaEvent_t e) : event_(e) {}
  cudaEvent_t event_;
};

// ---------------------------------------------------------------------------------- calls

// The call as the Communicator describes and compares it; pointers are filled in only once the
// views have been checked.
inline CollectiveCall MakeCall(CollectiveKind kind, const View& send, const View& recv, ReduceOp op,
                               int size) {
  CollectiveCall c;
  c.kind = kind;
  c.count = kind == CollectiveKind::kReduceScatter ? recv.count
            : kind == CollectiveKind::kAllToAll    ? send.count / size
                                                   : send.count;
  c.dtype = send.dtype;
  c.op = kind == CollectiveKind::kReduceScatter || kind == CollectiveKind::kAllReduce
             ? op
             : ReduceOp::kSum;
  return c;
}

// "all_gather(count=10, f32) at sequence 3 of group 'world'"
inline std::string Where(const CollectiveCall& call, int64_t seq, const std::string& group) {
  return absl::StrFormat("%s at sequence %d of group '%s'", DescribeCall(call), seq, group);
}

// The device pointers of a call whose views DataPlane checked (memory of this rank's backend,
// in their allocations, dtypes and counts that fit): fills call->send / call->recv, then checks
// what only the pointers show (null buffers, in-place positions, overlaps) as the Communicator
// does: OK or InvalidArgument "<call> on rank r: <what is wrong>".
inline absl::Status CheckCall(const View& send, const View& recv, int rank, int size,
                       CollectiveCall* call) {
  call->send = Ptr(send);
  call->recv = Ptr(recv);
  // Null buffers, in-place positions and overlaps, as the Communicator checks them.
  return ValidateCall(*call, rank, size);
}

// The two planes (cuda_data_plane.cc picks one for a group).
absl::StatusOr<std::unique_ptr<DataPlane>> CreateNcclPlane(CudaBackend& b, Communicator& group);
// Ranks as threads of one process on one GPU (`device`: which, for messages), each with its own
// backend (`backend_ids`, in rank order).
absl::StatusOr<std::unique_ptr<DataPlane>> CreateSharedPlane(CudaBackend& b, Communicator& group,
                                                             const std::string& device,
                                                             const std::vector<uint64_t>& backend_ids);

}  // namespace fsdp::cuda_internal
