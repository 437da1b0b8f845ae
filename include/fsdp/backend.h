// A backend is a device: memory, host<->device copies, an op table of compute kernels, and a
// count of the bytes it holds. The CPU backend is always built and is the reference that
// every other backend is tested against, op by op.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string_view>

#include "fsdp/kernels_cpu.h"
#include "fsdp/status.h"

namespace fsdp {

// The op table: device pointers in, device pointers out; semantics as in kernels_cpu.h.
// Coarse on purpose (whole layers), so a backend that runs compiled programs can fill it.
struct Ops {
  decltype(&kernels::cpu::matmul_forward) matmul_forward;
  decltype(&kernels::cpu::matmul_backward) matmul_backward;
  decltype(&kernels::cpu::layernorm_forward) layernorm_forward;
  decltype(&kernels::cpu::layernorm_backward) layernorm_backward;
  decltype(&kernels::cpu::gelu_forward) gelu_forward;
  decltype(&kernels::cpu::gelu_backward) gelu_backward;
  decltype(&kernels::cpu::attention_forward) attention_forward;
  decltype(&kernels::cpu::attention_backward) attention_backward;
  decltype(&kernels::cpu::softmax_crossentropy_forward) softmax_crossentropy_forward;
  decltype(&kernels::cpu::softmax_crossentropy_backward) softmax_crossentropy_backward;
  decltype(&kernels::cpu::embedding_forward) embedding_forward;
  decltype(&kernels::cpu::embedding_backward) embedding_backward;
  decltype(&kernels::cpu::residual_forward) residual_forward;
  decltype(&kernels::cpu::residual_backward) residual_backward;
  decltype(&kernels::cpu::cast_f32_to_bf16) cast_f32_to_bf16;
  decltype(&kernels::cpu::cast_bf16_to_f32) cast_bf16_to_f32;
  decltype(&kernels::cpu::cast_f32_to_f16) cast_f32_to_f16;
  decltype(&kernels::cpu::cast_f16_to_f32) cast_f16_to_f32;
  decltype(&kernels::cpu::adamw_update) adamw_update;
  decltype(&kernels::cpu::sgd_update) sgd_update;
  decltype(&kernels::cpu::sum_squares) sum_squares;
  decltype(&kernels::cpu::scale_inplace) scale_inplace;
  decltype(&kernels::cpu::all_finite) all_finite;
  // Appended: the low-precision Linear (bf16/f16 weights, f32 activations and gradients).
  decltype(&kernels::cpu::matmul_forward_lowp) matmul_forward_lowp;
  decltype(&kernels::cpu::matmul_backward_lowp) matmul_backward_lowp;
};

struct MemoryStats {
  int64_t bytes_in_use = 0;   // allocated now through this backend
  int64_t peak_bytes = 0;     // high-water mark since creation or ResetPeak()
  int64_t num_allocs = 0;     // allocations ever made
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string_view name() const = 0;

  // Device memory. Allocate never returns nullptr for bytes > 0; zero bytes gives nullptr.
  virtual absl::StatusOr<void*> Allocate(size_t bytes) = 0;
  virtual void Free(void* ptr) = 0;
  virtual absl::Status CopyToHost(void* host_dst, const void* device_src, size_t bytes) = 0;
  virtual absl::Status CopyFromHost(void* device_dst, const void* host_src, size_t bytes) = 0;
  virtual absl::Status Memset(void* device_dst, int value, size_t bytes) = 0;
  // Waits until all work issued on this backend by the calling thread has finished.
  virtual absl::Status Synchronize() = 0;

  virtual const Ops& ops() const = 0;
  virtual MemoryStats memory_stats() const = 0;
  virtual void ResetPeak() = 0;
};

// Owns one allocation of a backend; frees it on destruction. Movable, not copyable.
class Buffer {
 public:
  Buffer() = default;
  static absl::StatusOr<Buffer> Create(Backend* backend, size_t bytes);
  Buffer(Buffer&& o) noexcept { *this = std::move(o); }
  Buffer& operator=(Buffer&& o) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() { Reset(); }

  void Reset();
  void* data() const { return data_; }
  template <typename T>
  T* as() const { return static_cast<T*>(data_); }
  size_t bytes() const { return bytes_; }
  Backend* backend() const { return backend_; }

 private:
  Backend* backend_ = nullptr;
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

struct CpuBackendOptions {
  // OpenMP threads the kernels of this backend use, for the thread that calls
  // BindCurrentThread(). 0 = all hardware threads divided by `ranks_sharing_cores`.
  int num_threads = 0;
  // How many ranks share this machine's cores (ranks as threads, or processes on one host).
  int ranks_sharing_cores = 1;
  // Device memory of this backend, in bytes (0 = only what the system gives): an allocation
  // past it fails with ResourceExhausted, as on an accelerator with that much memory.
  int64_t memory_limit_bytes = 0;
};

class CpuBackend final : public Backend {
 public:
  static absl::StatusOr<std::unique_ptr<CpuBackend>> Create(CpuBackendOptions options = {});

  std::string_view name() const override { return "cpu"; }
  absl::StatusOr<void*> Allocate(size_t bytes) override;
  void Free(void* ptr) override;
  absl::Status CopyToHost(void* host_dst, const void* device_src, size_t bytes) override;
  absl::Status CopyFromHost(void* device_dst, const void* host_src, size_t bytes) override;
  absl::Status Memset(void* device_dst, int value, size_t bytes) override;
  absl::Status Synchronize() override { return absl::OkStatus(); }
  const Ops& ops() const override;
  MemoryStats memory_stats() const override;
  void ResetPeak() override;

  int num_threads() const { return num_threads_; }
  // Makes the kernels called from the current thread use num_threads() OpenMP threads.
  // Each rank thread calls this once, so ranks sharing the cores do not oversubscribe them.
  void BindCurrentThread() const;

 private:
  CpuBackend(int num_threads, int64_t limit) : num_threads_(num_threads), limit_(limit) {}
  int num_threads_;
  int64_t limit_;
  std::atomic<int64_t> in_use_{0}, peak_{0}, allocs_{0};
};

// Hardware threads usable by this process (affinity mask aware).
int HardwareThreads();

}  // namespace fsdp
