// The CPU backend: 64-byte aligned host memory with byte accounting, and the CPU kernels.
#include <omp.h>
#include <sched.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"
#include "fsdp/backend.h"

namespace fsdp {
namespace {

constexpr size_t kAlignment = 64;

#if defined(__SANITIZE_THREAD__)
constexpr bool kUnderThreadSanitizer = true;
#else
constexpr bool kUnderThreadSanitizer = false;
#endif

// Each allocation carries its size in a header so Free can account for it.
struct alignas(kAlignment) AllocHeader {
  size_t bytes;
};

const Ops& CpuOps() {
  namespace k = kernels::cpu;
  static const Ops ops = {
      k::matmul_forward, k::matmul_backward, k::layernorm_forward, k::layernorm_backward,
      k::gelu_forward, k::gelu_backward, k::attention_forward, k::attention_backward,
      k::softmax_crossentropy_forward, k::softmax_crossentropy_backward,
      k::embedding_forward, k::embedding_backward, k::residual_forward, k::residual_backward,
      k::cast_f32_to_bf16, k::cast_bf16_to_f32, k::cast_f32_to_f16, k::cast_f16_to_f32,
      k::adamw_update, k::sgd_update, k::sum_squares, k::scale_inplace, k::all_finite,
      k::matmul_forward_lowp, k::matmul_backward_lowp,
  };
  return ops;
}

}  // namespace

int HardwareThreads() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    const int n = CPU_COUNT(&set);
    if (n > 0) return n;
  }
  const unsigned n = std::thread::hardware_concurrency();
  return n > 0 ? static_cast<int>(n) : 1;
}

absl::StatusOr<Buffer> Buffer::Create(Backend* backend, size_t bytes) {
  if (backend == nullptr) return absl::InvalidArgumentError("Buffer::Create: backend is null");
  Buffer b;
  auto p = backend->Allocate(bytes);
  if (!p.ok()) return p.status();
  b.backend_ = backend;
  b.data_ = *p;
  b.bytes_ = bytes;
  return b;
}

Buffer& Buffer::operator=(Buffer&& o) noexcept {
  if (this != &o) {
    Reset();
    backend_ = o.backend_;
    data_ = o.data_;
    bytes_ = o.bytes_;
    o.backend_ = nullptr;
    o.data_ = nullptr;
    o.bytes_ = 0;
  }
  return *this;
}

void Buffer::Reset() {
  if (backend_ != nullptr && data_ != nullptr) backend_->Free(data_);
  backend_ = nullptr;
  data_ = nullptr;
  bytes_ = 0;
}

absl::StatusOr<std::unique_ptr<CpuBackend>> CpuBackend::Create(CpuBackendOptions options) {
  if (options.num_threads < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("CpuBackend: num_threads must be >= 0 (0 = automatic), got ",
                     options.num_threads));
  }
  if (options.ranks_sharing_cores < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("CpuBackend: ranks_sharing_cores must be >= 1, got ",
                     options.ranks_sharing_cores));
  }
  if (options.memory_limit_bytes < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("CpuBackend: memory_limit_bytes must be >= 0 (0 = no limit), got ",
                     options.memory_limit_bytes));
  }
  int threads = options.num_threads;
  if (threads == 0) threads = std::max(1, HardwareThreads() / options.ranks_sharing_cores);
  // ThreadSanitizer cannot see the synchronisation inside OpenMP's runtime (libgomp is not
  // instrumented) and would report its team's work as races: under TSan each rank's kernels
  // run on the rank's own thread, and TSan checks the rank and communication threads.
  if (kUnderThreadSanitizer) threads = 1;
  return std::unique_ptr<CpuBackend>(new CpuBackend(threads, options.memory_limit_bytes));
}

absl::StatusOr<void*> CpuBackend::Allocate(size_t bytes) {
  if (bytes == 0) return nullptr;
  const auto n = static_cast<int64_t>(bytes);
  // Reserve first, so that concurrent allocations cannot pass the limit together.
  const int64_t now = in_use_.fetch_add(n) + n;
  if (limit_ > 0 && now > limit_) {
    in_use_.fetch_sub(n);
    return absl::ResourceExhaustedError(absl::StrCat(
        "out of memory: ", bytes, " bytes asked for with ", now - n, " of the ", limit_,
        "-byte limit in use; reduce the batch size, checkpoint activations or shard over more "
        "ranks"));
  }
  const size_t total = (sizeof(AllocHeader) + bytes + kAlignment - 1) / kAlignment * kAlignment;
  void* raw = std::aligned_alloc(kAlignment, total);
  if (raw == nullptr) {
    in_use_.fetch_sub(n);
    return absl::ResourceExhaustedError(absl::StrCat(
        "out of memory: the system could not give ", bytes, " bytes (", now - n,
        " bytes already in use); reduce the batch size or shard over more ranks"));
  }
  static_cast<AllocHeader*>(raw)->bytes = bytes;
  int64_t peak = peak_.load();
  while (now > peak && !peak_.compare_exchange_weak(peak, now)) {
  }
  allocs_.fetch_add(1);
  return static_cast<char*>(raw) + sizeof(AllocHeader);
}

void CpuBackend::Free(void* ptr) {
  if (ptr == nullptr) return;
  auto* header = reinterpret_cast<AllocHeader*>(static_cast<char*>(ptr) - sizeof(AllocHeader));
  in_use_.fetch_sub(static_cast<int64_t>(header->bytes));
  std::free(header);
}

absl::Status CpuBackend::CopyToHost(void* host_dst, const void* device_src, size_t bytes) {
  if (bytes > 0) std::memcpy(host_dst, device_src, bytes);
  return absl::OkStatus();
}

absl::Status CpuBackend::CopyFromHost(void* device_dst, const void* host_src, size_t bytes) {
  if (bytes > 0) std::memcpy(device_dst, host_src, bytes);
  return absl::OkStatus();
}

absl::Status CpuBackend::Memset(void* device_dst, int value, size_t bytes) {
  if (bytes > 0) std::memset(device_dst, value, bytes);
  return absl::OkStatus();
}

const Ops& CpuBackend::ops() const { return CpuOps(); }

MemoryStats CpuBackend::memory_stats() const {
  return MemoryStats{in_use_.load(), peak_.load(), allocs_.load()};
}

void CpuBackend::ResetPeak() { peak_.store(in_use_.load()); }

void CpuBackend::BindCurrentThread() const { omp_set_num_threads(num_threads_); }

}  // namespace fsdp
