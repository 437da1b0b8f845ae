// The CUDA backend (cuda_backend.h): device state, the caching allocator over cudaMalloc,
// pinned staging for host copies, the two streams and their events.
#include "fsdp/cuda_backend.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "backends/cuda/cuda_internal.h"

namespace fsdp {
namespace cuda_internal {

absl::Status CudaStatus(cudaError_t e, const std::string& what) {
  if (e == cudaSuccess) return absl::OkStatus();
  const std::string msg = absl::StrCat(what, ": ", cudaGetErrorName(e), ": ", cudaGetErrorString(e));
  if (e == cudaErrorMemoryAllocation) return absl::ResourceExhaustedError(msg);
  return absl::InternalError(msg);
}

void Failure::Set(const absl::Status& s) {
  if (s.ok()) return;
  std::lock_guard<std::mutex> lock(mu_);
  if (failed_.load(std::memory_order_relaxed)) return;
  status_ = s;
  failed_.store(true, std::memory_order_release);
}

absl::Status Failure::Get() const {
  if (!failed()) return absl::OkStatus();
  std::lock_guard<std::mutex> lock(mu_);
  return status_;
}

void Failure::Watch(Event e) {
  std::lock_guard<std::mutex> lock(watch_mu_);
  watched_.push_back(std::move(e));
}

void Failure::PollWatched() {
  std::vector<Event> watched;
  {
    std::lock_guard<std::mutex> lock(watch_mu_);
    watched.swap(watched_);
  }
  std::vector<Event> pending;
  for (Event& e : watched) {
    if (!e.Done()) pending.push_back(std::move(e));
  }
  std::lock_guard<std::mutex> lock(watch_mu_);
  for (Event& e : pending) watched_.push_back(std::move(e));
}

absl::Status HostWait(const std::shared_ptr<Failure>& failure, cudaEvent_t event,
                      const char* what) {
  for (int i = 0; !failure->failed(); ++i) {
    const bool clean = cudaPeekAtLastError() == cudaSuccess;
    const cudaError_t e = cudaEventQuery(event);
    if (e == cudaSuccess) break;
    if (e != cudaErrorNotReady) {
      failure->Set(CudaStatus(e, what));
      break;
    }
    if (clean) (void)cudaGetLastError();  // not-ready is not an error of the next launch
    failure->PollWatched();
    if (i < 100) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }
  return failure->Get();
}

namespace {

// Makes `device` the calling thread's device when it is not. Events are waited on, polled and
// dropped from any thread (a thread that waits for a collective, the allocator's callers); a
// thread that never chose a device would otherwise get a CUDA context on device 0 from its
// first event call (hundreds of MiB of device 0 in every process of a multi-GPU job). The
// device is not restored: every entry point of the backend sets its own.
void EnsureDevice(int device) {
  int current = -1;
  if (cudaGetDevice(&current) != cudaSuccess || current != device) (void)cudaSetDevice(device);
}

}  // namespace

CudaEventState::~CudaEventState() {
  if (event_ != nullptr) {
    EnsureDevice(device_);
    cudaEventDestroy(event_);
  }
}

void CudaEventState::MarkDone() const {
  std::call_once(done_once_, [&] {
    at_ = std::chrono::steady_clock::now();
    done_.store(true, std::memory_order_release);
  });
}

bool CudaEventState::Done() const {
  if (done_.load(std::memory_order_acquire)) return true;
  if (failure_->failed()) return true;
  if (event_ == nullptr) return true;
  EnsureDevice(device_);
  // cudaEventQuery records cudaErrorNotReady as the thread's last error, which the launch check
  // of the next op (cuda_ops.cc, End) would take for a failed launch: clear it, unless an
  // error was already pending (then a launch check still sees one and fails the op).
  const bool clean = cudaPeekAtLastError() == cudaSuccess;
  const cudaError_t e = cudaEventQuery(event_);
  if (e == cudaErrorNotReady) {
    if (clean) (void)cudaGetLastError();
    return false;
  }
  if (e != cudaSuccess) failure_->Set(CudaStatus(e, "cudaEventQuery"));
  MarkDone();
  return true;
}

absl::Status CudaEventState::Wait() {
  if (event_ != nullptr && !done_.load(std::memory_order_acquire) && !failure_->failed()) {
    EnsureDevice(device_);
    // Polled, not cudaEventSynchronize: a collective that never completes must turn into its
    // deadline's error (Failure::Watch), not a hang.
    if (HostWait(failure_, event_, "waiting for an event").ok()) MarkDone();
  }
  return failure_->Get();
}

std::optional<std::chrono::steady_clock::time_point> CudaEventState::completed_at() const {
  if (!Done() || !done_.load(std::memory_order_acquire)) return std::nullopt;
  return at_;
}

Event RecordEvent(int device, cudaStream_t stream, const std::shared_ptr<Failure>& failure) {
  cudaEvent_t ev = nullptr;
  cudaError_t e = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
  if (e == cudaSuccess) e = cudaEventRecord(ev, stream);
  if (e != cudaSuccess) {
    failure->Set(CudaStatus(e, "recording an event"));
    if (ev != nullptr) cudaEventDestroy(ev);
    ev = nullptr;
  }
  return Event(std::make_shared<CudaEventState>(device, ev, failure));
}

namespace {

// cudaMalloc / cudaFree on one device.
class CudaDeviceMemory final : public DeviceMemory {
 public:
  explicit CudaDeviceMemory(int device) : device_(device) {}
  absl::StatusOr<void*> Malloc(size_t bytes) override {
    cudaSetDevice(device_);
    void* p = nullptr;
    const cudaError_t e = cudaMalloc(&p, bytes);
    if (e != cudaSuccess) {
      cudaGetLastError();  // an out-of-memory error is not sticky: clear it
      return CudaStatus(e, absl::StrCat("cudaMalloc(", bytes, ")"));
    }
    return p;
  }
  void Free(void* p) override {
    cudaSetDevice(device_);
    cudaFree(p);
  }

 private:
  int device_;
};

// The events recorded on both streams when a block was freed.
class StreamsFence final : public Fence {
 public:
  explicit StreamsFence(std::vector<Event> events) : events_(std::move(events)) {}
  bool Done() override {
    return std::all_of(events_.begin(), events_.end(), [](const Event& e) { return e.Done(); });
  }
  void Wait() override {
    for (const Event& e : events_) (void)e.Wait();
  }

 private:
  std::vector<Event> events_;
};

// Pinned host buffers for host copies, reused once the copy that used them has run.
class StagingPool {
 public:
  struct Block {
    void* p = nullptr;
    size_t bytes = 0;
    Event done;  // the copy that last used it
  };
  ~StagingPool() {
    for (Block& b : free_) {
      (void)b.done.Wait();
      cudaFreeHost(b.p);
    }
  }
  absl::StatusOr<Block> Take(size_t bytes) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (size_t i = 0; i < free_.size(); ++i) {
        if (free_[i].bytes >= bytes && free_[i].done.Done()) {
          Block b = std::move(free_[i]);
          free_.erase(free_.begin() + static_cast<std::ptrdiff_t>(i));
          return b;
        }
      }
    }
    Block b;
    b.bytes = std::max<size_t>(bytes, size_t{1} << 20);
    const cudaError_t e = cudaMallocHost(&b.p, b.bytes);
    if (e != cudaSuccess) {
      cudaGetLastError();
      return CudaStatus(e, absl::StrCat("cudaMallocHost(", b.bytes, ") for a staging buffer"));
    }
    return b;
  }
  void Give(Block b) {
    std::lock_guard<std::mutex> lock(mu_);
    free_.push_back(std::move(b));
    // Keep a few: a checkpoint load of large shards must not pin its whole size for ever.
    while (free_.size() > 8) {
      auto smallest = std::min_element(free_.begin(), free_.end(), [](const Block& a, const Block& c) {
        return a.bytes < c.bytes;
      });
      (void)smallest->done.Wait();
      cudaFreeHost(smallest->p);
      free_.erase(smallest);
    }
  }

 private:
  std::mutex mu_;
  std::vector<Block> free_;
};

}  // namespace
}  // namespace cuda_internal

using cuda_internal::CudaStatus;

struct CudaBackend::Impl {
  CudaBackendOptions options;
  int device = 0;
  cudaStream_t streams[2] = {nullptr, nullptr};
  bool adopted_compute = false;  // streams[0] is the caller's (options.compute_stream)
  std::shared_ptr<cuda_internal::Failure> failure = std::make_shared<cuda_internal::Failure>();
  std::unique_ptr<cuda_internal::CudaDeviceMemory> memory;
  std::unique_ptr<cuda_internal::CachingAllocator> allocator;
  cuda_internal::StagingPool staging;
  std::unique_ptr<Ops> ops;

  cudaStream_t stream(Stream s) const { return streams[static_cast<int>(s)]; }
  absl::Status Use() const { return CudaStatus(cudaSetDevice(device), "cudaSetDevice"); }
};

namespace cuda_internal {

cudaStream_t StreamOf(CudaBackend& b, Stream s) { return b.impl().stream(s); }

const std::shared_ptr<Failure>& FailureOf(CudaBackend& b) { return b.impl().failure; }
absl::Status UseDevice(CudaBackend& b) { return b.impl().Use(); }

absl::StatusOr<Scratch> Scratch::Create(CudaBackend& b, size_t bytes) {
  Scratch s;
  if (bytes == 0) return s;
  // The backend's own memory: within the limit, outside memory_stats()' buffers.
  FSDP_RETURN_IF_ERROR(b.impl().Use());
  FSDP_ASSIGN_OR_RETURN(void* p, b.impl().allocator->Allocate(bytes, /*scratch=*/true));
  s.b_ = &b;
  s.p_ = p;
  s.bytes_ = bytes;
  return s;
}

Scratch& Scratch::operator=(Scratch&& o) noexcept {
  if (this != &o) {
    Release();
    b_ = o.b_;
    p_ = o.p_;
    bytes_ = o.bytes_;
    o.b_ = nullptr;
    o.p_ = nullptr;
    o.bytes_ = 0;
  }
  return *this;
}

void Scratch::Release() {
  if (b_ != nullptr && p_ != nullptr) b_->Free(Allocation{p_, p_, bytes_});
  b_ = nullptr;
  p_ = nullptr;
  bytes_ = 0;
}

}  // namespace cuda_internal

void* CudaBackend::native_stream(Stream s) { return impl().stream(s); }

absl::StatusOr<View> CudaBackend::WrapNativeMemory(void* p, int64_t count, DType dtype) {
  if (p == nullptr || count < 0) {
    return absl::InvalidArgumentError("CudaBackend::WrapNativeMemory: null pointer or negative count");
  }
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess || a.type != cudaMemoryTypeDevice ||
      a.device != impl_->device) {
    cudaGetLastError();
    return absl::InvalidArgumentError(absl::StrCat(
        "CudaBackend::WrapNativeMemory: ", absl::Hex(reinterpret_cast<uintptr_t>(p)),
        " is not device memory of GPU ", impl_->device));
  }
  View v;
  v.backend = this;
  v.allocation = Allocation{p, p, static_cast<size_t>(count) * DTypeSize(dtype)};
  v.count = count;
  v.dtype = dtype;
  return v;
}

int CudaDeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

std::string CudaUnavailableReason() {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return absl::StrCat("no CUDA device (cudaGetDeviceCount: ", cudaGetErrorName(e), ": ",
                        cudaGetErrorString(e), ")");
  }
  if (n == 0) return "no CUDA device (cudaGetDeviceCount found none)";
  return "";
}

absl::StatusOr<std::unique_ptr<CudaBackend>> CudaBackend::Create(CudaBackendOptions options) {
  const std::string why = CudaUnavailableReason();
  if (!why.empty()) return absl::FailedPreconditionError(absl::StrCat("CudaBackend: ", why));
  const int n = CudaDeviceCount();
  if (options.device < 0 || options.device >= n) {
    return absl::InvalidArgumentError(absl::StrCat("CudaBackend: device ", options.device,
                                                   " does not exist: this process sees ", n,
                                                   " CUDA device(s), 0 .. ", n - 1));
  }
  if (options.memory_limit_bytes < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "CudaBackend: memory_limit_bytes must be >= 0 (0 = the device's memory), got ",
        options.memory_limit_bytes));
  }
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  impl->device = options.device;
  FSDP_RETURN_IF_ERROR(impl->Use());
  if (options.compute_stream != nullptr) {
    impl->streams[0] = static_cast<cudaStream_t>(options.compute_stream);
    impl->adopted_compute = true;
  }
  for (cudaStream_t& s : impl->streams) {
    if (s != nullptr) continue;  // adopted
    const absl::Status st =
        CudaStatus(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
    if (!st.ok()) {
      // The streams made so far are not the backend's yet: nothing else destroys them.
      for (int i = 0; i < 2; ++i) {
        cudaStream_t& made = impl->streams[i];
        if (made != nullptr && !(i == 0 && impl->adopted_compute)) cudaStreamDestroy(made);
        made = nullptr;
      }
      return st;
    }
  }
  impl->memory = std::make_unique<cuda_internal::CudaDeviceMemory>(options.device);
  impl->allocator = std::make_unique<cuda_internal::CachingAllocator>(impl->memory.get(),
                                                                      options.memory_limit_bytes);
  std::unique_ptr<CudaBackend> b(new CudaBackend(std::move(impl)));
  b->impl_->ops = cuda_internal::MakeCudaOps(b.get());
  return b;
}

CudaBackend::CudaBackend(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

std::string CudaBackend::description() const {
  return absl::StrCat("cuda backend, GPU ", impl_->device, " of ", CudaDeviceCount());
}

CudaBackend::~CudaBackend() {
  (void)impl_->Use();
  for (cudaStream_t s : impl_->streams) {
    if (s != nullptr) cudaStreamSynchronize(s);
  }
  impl_->ops.reset();
  impl_->allocator.reset();  // waits for pending frees, gives every block back
  for (int i = 0; i < 2; ++i) {
    cudaStream_t s = impl_->streams[i];
    if (s != nullptr && !(i == 0 && impl_->adopted_compute)) cudaStreamDestroy(s);
  }
}

int CudaBackend::device() const { return impl_->device; }
const CudaBackendOptions& CudaBackend::options() const { return impl_->options; }

absl::StatusOr<Allocation> CudaBackend::Allocate(size_t bytes) {
  if (bytes == 0) return Allocation{};
  FSDP_RETURN_IF_ERROR(impl_->Use());
  FSDP_ASSIGN_OR_RETURN(void* p, impl_->allocator->Allocate(bytes));
  return Allocation{p, p, bytes};
}

void CudaBackend::Free(const Allocation& a) {
  if (a.storage == nullptr) return;
  std::vector<Event> events;
  for (Stream s : {Stream::kCompute, Stream::kComm}) events.push_back(Record(s));
  impl_->allocator->Free(a.storage,
                         std::make_shared<cuda_internal::StreamsFence>(std::move(events)));
}

MemoryStats CudaBackend::memory_stats() const { return impl_->allocator->stats(); }
void CudaBackend::ResetPeak() { impl_->allocator->ResetPeak(); }

namespace {

absl::Status CheckView(const Backend* b, const View& v, const char* what) {
  if (v.count == 0) return absl::OkStatus();
  if (v.backend != b) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": the view is not memory of this cuda backend"));
  }
  if (v.count < 0 || v.offset < 0 ||
      v.offset + v.bytes() > static_cast<int64_t>(v.allocation.bytes)) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": the view (offset ", v.offset, ", ",
                                                   v.bytes(), " bytes) is outside its ",
                                                   v.allocation.bytes, "-byte allocation"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CudaBackend::CopyFromHost(View dst, const void* src, Stream s) {
  FSDP_RETURN_IF_ERROR(CheckView(this, dst, "CopyFromHost"));
  FSDP_RETURN_IF_ERROR(impl_->failure->Get());
  if (dst.count == 0) return absl::OkStatus();
  FSDP_RETURN_IF_ERROR(impl_->Use());
  const size_t n = static_cast<size_t>(dst.bytes());
  FSDP_ASSIGN_OR_RETURN(cuda_internal::StagingPool::Block block, impl_->staging.Take(n));
  std::memcpy(block.p, src, n);
  absl::Status st = CudaStatus(
      cudaMemcpyAsync(cuda_internal::Ptr(dst), block.p, n, cudaMemcpyHostToDevice, impl_->stream(s)),
      "CopyFromHost: cudaMemcpyAsync");
  block.done = Record(s);
  impl_->staging.Give(std::move(block));
  impl_->failure->Set(st);
  return st;
}

absl::Status CudaBackend::CopyToHostAsync(void* dst, View src, Stream s) {
  FSDP_RETURN_IF_ERROR(CheckView(this, src, "CopyToHostAsync"));
  FSDP_RETURN_IF_ERROR(impl_->failure->Get());
  if (src.count == 0) return absl::OkStatus();
  FSDP_RETURN_IF_ERROR(impl_->Use());
  absl::Status st = CudaStatus(cudaMemcpyAsync(dst, cuda_internal::Ptr(src),
                                               static_cast<size_t>(src.bytes()),
                                               cudaMemcpyDeviceToHost, impl_->stream(s)),
                               "CopyToHostAsync: cudaMemcpyAsync");
  impl_->failure->Set(st);
  return st;
}

absl::Status CudaBackend::CopyFromHostAsync(View dst, const void* src, Stream s) {
  FSDP_RETURN_IF_ERROR(CheckView(this, dst, "CopyFromHostAsync"));
  FSDP_RETURN_IF_ERROR(impl_->failure->Get());
  if (dst.count == 0) return absl::OkStatus();
  FSDP_RETURN_IF_ERROR(impl_->Use());
  absl::Status st = CudaStatus(cudaMemcpyAsync(cuda_internal::Ptr(dst), src,
                                               static_cast<size_t>(dst.bytes()),
                                               cudaMemcpyHostToDevice, impl_->stream(s)),
                               "CopyFromHostAsync: cudaMemcpyAsync");
  impl_->failure->Set(st);
  return st;
}

absl::Status CudaBackend::PinHostMemory(void* p, size_t bytes) {
  if (p == nullptr || bytes == 0) return absl::OkStatus();
  FSDP_RETURN_IF_ERROR(impl_->Use());
  return CudaStatus(cudaHostRegister(p, bytes, cudaHostRegisterDefault),
                    absl::StrCat("PinHostMemory: cudaHostRegister of ", bytes, " bytes"));
}

void CudaBackend::UnpinHostMemory(void* p) {
  if (p == nullptr || !impl_->Use().ok()) return;
  (void)cudaHostUnregister(p);
}

absl::Status CudaBackend::DoCopyToHost(void* dst, View src, Stream s) {
  FSDP_RETURN_IF_ERROR(CheckView(this, src, "CopyToHost"));
  FSDP_RETURN_IF_ERROR(impl_->failure->Get());
  if (src.count == 0) return absl::OkStatus();
  FSDP_RETURN_IF_ERROR(impl_->Use());
  const size_t n = static_cast<size_t>(src.bytes());
  FSDP_ASSIGN_OR_RETURN(cuda_internal::StagingPool::Block block, impl_->staging.Take(n));
  absl::Status st = CudaStatus(
      cudaMemcpyAsync(block.p, cuda_internal::Ptr(src), n, cudaMemcpyDeviceToHost, impl_->stream(s)),
      "CopyToHost: cudaMemcpyAsync");
  impl_->failure->Set(st);
  Event copied = Record(s);
  block.done = copied;
  if (st.ok()) st = copied.Wait();  // polled: see Failure::Watch
  if (st.ok()) std::memcpy(dst, block.p, n);
  impl_->staging.Give(std::move(block));
  impl_->failure->Set(st);
  return impl_->failure->Get();
}

absl::Status CudaBackend::Copy(View dst, View src, Stream s) {
  FSDP_RETURN_IF_ERROR(CheckView(this, dst, "Copy"));
  FSDP_RETURN_IF_ERROR(CheckView(this, src, "Copy"));
  if (dst.bytes() != src.bytes()) {
    return absl::InvalidArgumentError(absl::StrCat("Copy: ", src.bytes(), " bytes into a view of ",
                                                   dst.bytes(), " bytes"));
  }
  FSDP_RETURN_IF_ERROR(impl_->failure->Get());
  if (dst.count == 0) return absl::OkStatus();
  FSDP_RETURN_IF_ERROR(impl_->Use());
  const absl::Status st = CudaStatus(
      cudaMemcpyAsync(cuda_internal::Ptr(dst), cuda_internal::Ptr(src),
                      static_cast<size_t>(dst.bytes()), cudaMemcpyDeviceToDevice, impl_->stream(s)),
      "Copy: cudaMemcpyAsync");
  impl_->failure->Set(st);
  return st;
}

absl::Status CudaBackend::Memset(View dst, int byte, Stream s) {
  FSDP_RETURN_IF_ERROR(CheckView(this, dst, "Memset"));
  FSDP_RETURN_IF_ERROR(impl_->failure->Get());
  if (dst.count == 0) return absl::OkStatus();
  FSDP_RETURN_IF_ERROR(impl_->Use());
  const absl::Status st =
      CudaStatus(cudaMemsetAsync(cuda_internal::Ptr(dst), byte, static_cast<size_t>(dst.bytes()),
                                 impl_->stream(s)),
                 "Memset: cudaMemsetAsync");
  impl_->failure->Set(st);
  return st;
}

Event CudaBackend::Record(Stream s) {
  (void)impl_->Use();
  return cuda_internal::RecordEvent(impl_->device, impl_->stream(s), impl_->failure);
}

absl::Status CudaBackend::Wait(Stream s, const Event& e) {
  if (!e.valid()) return impl_->failure->Get();
  auto* ce = dynamic_cast<cuda_internal::CudaEventState*>(e.state().get());
  if (ce == nullptr) {
    // Not a CUDA event (e.g. a host collective's): the host waits for it.
    FSDP_RETURN_IF_ERROR(e.Wait());
    return impl_->failure->Get();
  }
  if (ce->event() == nullptr || e.Done()) {
    // Done: its error (if any) is already known.
    FSDP_RETURN_IF_ERROR(e.Wait());
    return impl_->failure->Get();
  }
  FSDP_RETURN_IF_ERROR(impl_->Use());
  const absl::Status st =
      CudaStatus(cudaStreamWaitEvent(impl_->stream(s), ce->event(), 0), "cudaStreamWaitEvent");
  impl_->failure->Set(st);
  return impl_->failure->Get();
}

RuntimeOps& CudaBackend::runtime_ops() { return *impl_->ops; }
Ops* CudaBackend::model_ops() { return impl_->ops.get(); }

absl::StatusOr<std::unique_ptr<DataPlane>> CudaBackend::CreateDataPlane(Communicator& group) {
  return cuda_internal::CreateCudaDataPlane(*this, group);
}

}  // namespace fsdp
