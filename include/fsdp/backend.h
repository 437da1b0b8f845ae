// The device contract (ARCHITECTURE.md "Device memory and ordering"): what every backend
// provides and how the runtime and models use it.
//
// - Memory is owned by Buffers and addressed through Views: (allocation, byte offset, count,
//   dtype). Nothing above the backend does arithmetic on device pointers or touches device
//   memory from the host; data reaches the host only through CopyToHost / CopyFromHost. A
//   host backend (is_host(): the CPU) also lets the host reach a buffer's bytes directly.
// - Each rank's device has two streams, compute and communication. Work issued on one stream
//   runs in issue order; the two are ordered against each other only by events: Record() an
//   event on one stream, Wait() for it on the other. The host blocks only in Sync(),
//   Synchronize() and CopyToHost(), which count as host synchronisations (host_syncs()).
// - Compute goes through the op table (fsdp/ops.h); collectives through a DataPlane
//   (fsdp/data_plane.h) that the backend makes for a group of ranks.
//
// backends: `cpu` (fsdp/cpu_backend.h, the reference), `sim` (fsdp/sim_backend.h, a strict
// simulated accelerator). docs/backends.md says what a backend implements and which test
// suites it must pass.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "fsdp/dtype.h"
#include "fsdp/status.h"

namespace fsdp {

class Backend;
class Communicator;
class DataPlane;
class Ops;
class RuntimeOps;

// The streams of a rank's device.
enum class Stream : uint8_t { kCompute = 0, kComm = 1 };
std::string_view StreamName(Stream s);  // "compute", "comm"

// One allocation. `address` identifies it and is what a user sees (on a host backend the host
// pointer; on a device, a device address the host must not dereference); `storage` is the
// backend's own handle to the bytes.
struct Allocation {
  void* address = nullptr;
  void* storage = nullptr;
  size_t bytes = 0;
};

// A typed window of an allocation: `count` elements of `dtype` from byte `offset`. Views do
// not own memory; the Buffer they come from must outlive every use, including work still
// queued on a stream.
struct View {
  Backend* backend = nullptr;
  Allocation allocation;
  int64_t offset = 0;  // bytes
  int64_t count = 0;   // elements
  DType dtype = DType::kF32;

  bool empty() const { return count == 0; }
  int64_t bytes() const { return count * static_cast<int64_t>(DTypeSize(dtype)); }
  // Elements [begin, begin + n) of this view.
  View Slice(int64_t begin, int64_t n) const;
  View Slice(int64_t begin) const { return Slice(begin, count - begin); }
  // The same bytes seen as elements of another dtype (the byte size must divide).
  View As(DType d) const;
  // Host pointer to the first element: only for host backends (nullptr otherwise).
  void* host() const;
  template <typename T>
  T* host_as() const { return static_cast<T*>(host()); }
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
  // The whole buffer as elements of `dtype`.
  View view(DType dtype = DType::kF32) const;
  size_t bytes() const { return allocation_.bytes; }
  Backend* backend() const { return backend_; }
  const Allocation& allocation() const { return allocation_; }
  // The device address identifying the allocation (never dereference it on a device).
  const void* address() const { return allocation_.address; }
  // Host access for host backends (Backend::is_host()); nullptr otherwise.
  void* data() const;
  template <typename T>
  T* as() const { return static_cast<T*>(data()); }

 private:
  Backend* backend_ = nullptr;
  Allocation allocation_;
};

// The state of an event, defined by whoever makes it (a backend's stream, a collective).
class EventState {
 public:
  virtual ~EventState() = default;
  virtual bool Done() const = 0;      // never blocks
  virtual absl::Status Wait() = 0;    // blocks the calling thread; the work's status
  // When it completed, once Done() (the timeline shows what was in flight when).
  virtual std::optional<std::chrono::steady_clock::time_point> completed_at() const {
    return std::nullopt;
  }
};

// A point in a stream's work, or the completion of a collective. Copies share the state. An
// empty Event is complete and OK.
class Event {
 public:
  Event() = default;
  explicit Event(std::shared_ptr<EventState> state) : state_(std::move(state)) {}
  bool Done() const { return state_ == nullptr || state_->Done(); }
  // Blocks this thread (not counted as a host synchronisation: use Backend::Sync for that).
  absl::Status Wait() const { return state_ == nullptr ? absl::OkStatus() : state_->Wait(); }
  std::optional<std::chrono::steady_clock::time_point> completed_at() const;
  bool valid() const { return state_ != nullptr; }
  const std::shared_ptr<EventState>& state() const { return state_; }

 private:
  std::shared_ptr<EventState> state_;
};

struct MemoryStats {
  int64_t bytes_in_use = 0;  // allocated now through this backend
  int64_t peak_bytes = 0;    // high-water mark since creation or ResetPeak()
  int64_t num_allocs = 0;    // allocations ever made
  // What the backend holds from its device for them and for its own working memory: rounding,
  // cached blocks and kernel scratch (a caching allocator's reserved bytes). Host backends hold
  // exactly what is allocated: bytes_in_use. A memory_limit_bytes option bounds this figure.
  int64_t reserved_bytes = 0;
};

// `count` elements of `dtype` at host memory `p` that the caller owns, as a view of a host
// backend (is_host()): how a framework hands its own host tensors to the model and the
// runtime without a copy. FailedPrecondition on a device backend (copy with CopyFromHost).
// The memory must outlive every use of the view.
absl::StatusOr<View> WrapHostMemory(Backend* backend, void* p, int64_t count, DType dtype);

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string_view name() const = 0;
  // One line for logs: the backend and what it runs on ("cpu backend, 2 threads").
  virtual std::string description() const { return std::string(name()) + " backend"; }
  // True when a buffer's bytes are host memory that the calling thread may read and write
  // directly (Buffer::data(), View::host()), and work on the streams runs synchronously.
  virtual bool is_host() const = 0;

  // ---- memory ---------------------------------------------------------------------------------
  // Zero bytes give an empty allocation. Out of memory is ResourceExhausted.
  virtual absl::StatusOr<Allocation> Allocate(size_t bytes) = 0;
  // Stream-ordered (as cudaFreeAsync): the bytes are reused only after the work issued so far
  // on both streams has run, so a buffer may be dropped while queued work still uses it. The
  // memory is counted free at once.
  virtual void Free(const Allocation& allocation) = 0;
  virtual MemoryStats memory_stats() const = 0;
  virtual void ResetPeak() = 0;

  // ---- copies, ordered on a stream ----------------------------------------------------------
  // Host to device after the work issued on `s`; `src` may be reused as soon as this returns.
  virtual absl::Status CopyFromHost(View dst, const void* src, Stream s = Stream::kCompute) = 0;
  // Device to host: waits for the work issued on `s`, then copies. A host synchronisation.
  absl::Status CopyToHost(void* dst, View src, Stream s = Stream::kCompute);
  // Device to host without blocking the host (cudaMemcpyAsync into pinned memory): `dst` is
  // written in the order of `s`, once the work issued on `s` before has run; the host may read
  // it only after an event recorded on `s` after this call has completed (Event::Wait, Sync).
  // `dst` must stay valid until then. Not a host synchronisation. Default: CopyToHost (the host
  // waits here; correct, without the overlap).
  virtual absl::Status CopyToHostAsync(void* dst, View src, Stream s = Stream::kCompute);
  // Host to device in the order of `s`, reading `src` when the copy runs (no staging copy):
  // `src` must not change until an event recorded on `s` after this call has completed.
  // Default: CopyFromHost (which stages).
  virtual absl::Status CopyFromHostAsync(View dst, const void* src, Stream s = Stream::kCompute);
  // Host memory the asynchronous copies above use often (offloaded optimizer state): pinned
  // (page-locked) where the device copies pinned memory faster and truly asynchronously
  // (cudaHostRegister), until UnpinHostMemory. Default: nothing to do.
  virtual absl::Status PinHostMemory(void* p, size_t bytes);
  virtual void UnpinHostMemory(void* p);
  // Device to device (dst and src of this backend).
  virtual absl::Status Copy(View dst, View src, Stream s = Stream::kCompute) = 0;
  // Every byte of `dst` set to `byte`.
  virtual absl::Status Memset(View dst, int byte, Stream s = Stream::kCompute) = 0;

  // ---- streams and events --------------------------------------------------------------------
  // An event that completes when the work issued on `s` so far has run.
  virtual Event Record(Stream s) = 0;
  // Work issued on `s` from now on runs after `e` completed. An error of `e` that is already
  // known is returned (on a host backend this waits for `e`).
  virtual absl::Status Wait(Stream s, const Event& e) = 0;
  // The host waits for `e`; a host synchronisation.
  absl::Status Sync(const Event& e);
  // The host waits for the work issued on every stream; a host synchronisation.
  absl::Status Synchronize();
  // The device runtime's own handle of stream `s` (a cudaStream_t on the cuda backend), for a
  // framework that issues its own kernels in the runtime's order; nullptr where the streams are
  // the library's own (cpu, sim) or the device runtime exposes none (PJRT).
  virtual void* native_stream(Stream /*s*/) { return nullptr; }
  // A view of memory the caller allocated with the device runtime itself (a CUDA device
  // pointer), which the runtime reads and writes but never frees. Default: on a host backend
  // WrapHostMemory, elsewhere Unimplemented (PJRT buffers are opaque: copy with CopyFromHost).
  virtual absl::StatusOr<View> WrapNativeMemory(void* p, int64_t count, DType dtype);

  // ---- compute and communication -------------------------------------------------------------
  // The runtime's ops (fsdp/ops.h RuntimeOps): every backend has them.
  virtual RuntimeOps& runtime_ops() = 0;
  // The bundled models' layers as well (fsdp/ops.h Ops; supports_op says which), or nullptr:
  // a runtime-only backend, which trains a framework's own model through the hooks.
  virtual Ops* model_ops() { return nullptr; }
  // model_ops() of a backend that has them. On a runtime-only backend it aborts with a message:
  // a program error, which the bundled models rule out by checking model_ops() at creation.
  Ops& ops();
  // The data plane of `group` (a host communicator of the same ranks, each with a backend of
  // this kind): collectives on this backend's memory. Collective over `group`.
  virtual absl::StatusOr<std::unique_ptr<DataPlane>> CreateDataPlane(Communicator& group) = 0;

  // Host synchronisations so far (CopyToHost, Sync, Synchronize) on any thread.
  int64_t host_syncs() const { return host_syncs_.load(std::memory_order_relaxed); }

 protected:
  virtual absl::Status DoCopyToHost(void* dst, View src, Stream s) = 0;
  void CountHostSync() { host_syncs_.fetch_add(1, std::memory_order_relaxed); }

 private:
  std::atomic<int64_t> host_syncs_{0};
};

}  // namespace fsdp
