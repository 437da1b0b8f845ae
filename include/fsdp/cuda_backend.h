// `cuda`: a backend on one NVIDIA GPU per rank (A100 / H100 / H200: sm_80, sm_90, and PTX for
// later devices), built when the CUDA toolkit and NCCL are found. docs/cuda.md says what is
// done, what was verified and on what.
// - Memory: a caching allocator (backends/cuda/caching_allocator.h) over cudaMalloc. Free is
//   stream-ordered: a block is handed out again only after the events recorded on both
//   streams when it was freed have completed, so a step allocates from the cache and never
//   calls cudaMalloc / cudaFree once it is warm. Host copies go through pinned staging buffers.
// - Streams: two non-blocking CUDA streams, compute and communication; Record() is a CUDA
//   event, Wait() a cudaStreamWaitEvent. The host waits only in Sync(), Synchronize() and
//   CopyToHost(), which the runtime counts as host synchronisations.
// - Ops: CUDA kernels (kernels/cuda/) and cuBLASLt matmuls (f32, or bf16 / f16 with f32
//   accumulation; TF32 only with CudaBackendOptions::allow_tf32).
// - Errors: a failed launch, a CUDA error or a bad view fails the backend: the error (naming
//   the op) is returned by the next Wait(), Sync(), Synchronize() or CopyToHost(), and later
//   work is not issued.
// - Data plane: NCCL for ranks on distinct GPUs (threads or processes); for ranks as threads
//   sharing one GPU, copies and reduction kernels on the communication streams.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "fsdp/backend.h"
#include "fsdp/communicator.h"

namespace fsdp {

struct CudaBackendOptions {
  // The CUDA device ordinal (cudaGetDeviceCount() devices are visible).
  int device = 0;
  // Bytes the caching allocator may hold (0: what the device gives). Past it an allocation is
  // RESOURCE_EXHAUSTED, after the cache has been given back to the device.
  int64_t memory_limit_bytes = 0;
  // f32 matmuls on TF32 tensor cores (10-bit mantissa products). Off by default: f32 results
  // then match the CPU backend to f32 rounding, which the parity suites require.
  bool allow_tf32 = false;
  // The data plane's deadline for the ranks of a group to arrive at a collective, and how
  // long a collective may run on the device before the group is failed.
  CommOptions data_plane = {};
  // A stream of the caller's (a cudaStream_t on `device`) to adopt as the compute stream, so
  // that a framework's own kernels and the runtime's run in one order without events between
  // them; nullptr: a stream of the backend's own. The backend never destroys an adopted stream
  // (it synchronises it when destroyed); it must outlive the backend.
  void* compute_stream = nullptr;
};

// The number of CUDA devices this process sees (0 without a driver or a device).
int CudaDeviceCount();
// "" when a CUDA device is usable, else why not, starting "no CUDA device" (the skip message
// of the gpu tests).
std::string CudaUnavailableReason();

class CudaBackend final : public Backend {
 public:
  // FailedPrecondition "no CUDA device ..." without one; InvalidArgument for a bad ordinal.
  static absl::StatusOr<std::unique_ptr<CudaBackend>> Create(CudaBackendOptions options = {});
  // Waits for the work queued on both streams, then gives the memory back.
  ~CudaBackend() override;

  std::string_view name() const override { return "cuda"; }
  std::string description() const override;
  bool is_host() const override { return false; }
  absl::StatusOr<Allocation> Allocate(size_t bytes) override;
  void Free(const Allocation& allocation) override;
  MemoryStats memory_stats() const override;
  void ResetPeak() override;
  absl::Status CopyFromHost(View dst, const void* src, Stream s = Stream::kCompute) override;
  // cudaMemcpyAsync straight to / from the host bytes (no staging): asynchronous when they are
  // pinned (PinHostMemory: cudaHostRegister).
  absl::Status CopyToHostAsync(void* dst, View src, Stream s = Stream::kCompute) override;
  absl::Status CopyFromHostAsync(View dst, const void* src, Stream s = Stream::kCompute) override;
  absl::Status PinHostMemory(void* p, size_t bytes) override;
  void UnpinHostMemory(void* p) override;
  absl::Status Copy(View dst, View src, Stream s = Stream::kCompute) override;
  absl::Status Memset(View dst, int byte, Stream s = Stream::kCompute) override;
  Event Record(Stream s) override;
  absl::Status Wait(Stream s, const Event& e) override;
  void* native_stream(Stream s) override;
  // A view of `count` elements of `dtype` at the device pointer `p` (cudaMalloc'd memory of this
  // backend's device, the caller's): the runtime never frees it.
  absl::StatusOr<View> WrapNativeMemory(void* p, int64_t count, DType dtype) override;
  RuntimeOps& runtime_ops() override;
  Ops* model_ops() override;
  absl::StatusOr<std::unique_ptr<DataPlane>> CreateDataPlane(Communicator& group) override;

  int device() const;
  const CudaBackendOptions& options() const;

  struct Impl;
  Impl& impl() { return *impl_; }

 protected:
  absl::Status DoCopyToHost(void* dst, View src, Stream s) override;

 private:
  explicit CudaBackend(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace fsdp
