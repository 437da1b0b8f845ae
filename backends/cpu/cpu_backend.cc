// The CPU backend: 64-byte aligned host memory with byte accounting, and the CPU kernels run
// at once on the calling thread (its streams are always drained, its events complete).
#include "fsdp/cpu_backend.h"

#include <omp.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>

#include "absl/strings/str_cat.h"
#include "backends/common/checked_ops.h"
#include "backends/common/host_event.h"
#include "backends/host/host_ops.h"
#include "fsdp/data_plane.h"
#include "fsdp/status.h"

namespace fsdp {
namespace {

constexpr size_t kAlignment = 64;

#if defined(__SANITIZE_THREAD__)
constexpr bool kUnderThreadSanitizer = true;
#else
constexpr bool kUnderThreadSanitizer = false;
#endif

}  // namespace

// Runs every op on the calling thread, now (timed per op name with a clock). An op whose views
// are wrong fails the backend: later ops are not run, and its copies, events and waits return
// the first failure (sticky, as a device's).
struct CpuBackend::Executor {
  OpClock* clock = nullptr;
  std::atomic<bool> failed{false};
  std::mutex mu;
  absl::Status failure;  // the first, under mu

  void Fail(Stream, const char* op, const absl::Status& why) {
    std::lock_guard<std::mutex> lock(mu);
    if (!failure.ok()) return;
    failure = absl::Status(why.code(), absl::StrCat("cpu op ", op, ": ", why.message()));
    failed.store(true, std::memory_order_release);
  }
  absl::Status status() {
    if (!failed.load(std::memory_order_acquire)) return absl::OkStatus();
    std::lock_guard<std::mutex> lock(mu);
    return failure;
  }
  template <class F>
  void Run(Stream, const char* op, F&& work) {
    if (failed.load(std::memory_order_relaxed)) return;
    if (clock == nullptr) {
      work();
      return;
    }
    const auto t0 = std::chrono::steady_clock::now();
    work();
    clock->Add(op, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
};

void CpuBackend::OpClock::Add(const char* op, double seconds) {
  std::lock_guard<std::mutex> lock(mu);
  auto it = times.find(std::string_view(op));
  if (it == times.end()) it = times.emplace(op, CpuOpTime{op, 0, 0}).first;
  ++it->second.calls;
  it->second.seconds += seconds;
}

int HardwareThreads() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    const int n = CPU_COUNT(&set);
    if (n > 0) return n;
  }
  const unsigned n = std::thread::hardware_concurrency();
  return n > 0 ? static_cast<int>(n) : 1;
}

int ThreadsPerRank(int requested, int ranks_sharing_cores) {
  if (requested > 0) return requested;
  return std::max(1, HardwareThreads() / std::max(1, ranks_sharing_cores));
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
  int threads = ThreadsPerRank(options.num_threads, options.ranks_sharing_cores);
  // ThreadSanitizer cannot see the synchronisation inside OpenMP's runtime (libgomp is not
  // instrumented) and would report its team's work as races: under TSan each rank's kernels
  // run on the rank's own thread, and TSan checks the rank and communication threads.
  if (kUnderThreadSanitizer) threads = 1;
  return std::unique_ptr<CpuBackend>(
      new CpuBackend(threads, options.memory_limit_bytes, options.time_ops));
}

CpuBackend::CpuBackend(int num_threads, int64_t limit, bool time_ops)
    : num_threads_(num_threads),
      limit_(limit),
      clock_(time_ops ? std::make_unique<OpClock>() : nullptr),
      exec_(std::make_unique<Executor>()),
      ops_(std::make_unique<backend_kit::CheckedOps>(
          std::make_unique<internal::HostOps<Executor>>(exec_.get()),
          [exec = exec_.get()](Stream s, const char* op, const absl::Status& why) {
            exec->Fail(s, op, why);
          })) {
  exec_->clock = clock_.get();
}

CpuBackend::~CpuBackend() = default;

std::string CpuBackend::description() const {
  return absl::StrCat("cpu backend, ", num_threads_, num_threads_ == 1 ? " thread" : " threads");
}

absl::StatusOr<Allocation> CpuBackend::Allocate(size_t bytes) {
  if (bytes == 0) return Allocation{};
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
  const size_t total = (bytes + kAlignment - 1) / kAlignment * kAlignment;
  void* p = std::aligned_alloc(kAlignment, total);
  if (p == nullptr) {
    in_use_.fetch_sub(n);
    return absl::ResourceExhaustedError(absl::StrCat(
        "out of memory: the system could not give ", bytes, " bytes (", now - n,
        " bytes already in use); reduce the batch size or shard over more ranks"));
  }
  int64_t peak = peak_.load();
  while (now > peak && !peak_.compare_exchange_weak(peak, now)) {
  }
  allocs_.fetch_add(1);
  return Allocation{p, p, bytes};
}

void CpuBackend::Free(const Allocation& a) {
  if (a.address == nullptr) return;
  in_use_.fetch_sub(static_cast<int64_t>(a.bytes));
  std::free(a.storage);
}

MemoryStats CpuBackend::memory_stats() const {
  const int64_t in_use = in_use_.load();
  return MemoryStats{in_use, peak_.load(), allocs_.load(), in_use};
}

void CpuBackend::ResetPeak() { peak_.store(in_use_.load()); }

absl::Status CpuBackend::DoCopyToHost(void* dst, View src, Stream) {
  FSDP_RETURN_IF_ERROR(exec_->status());
  if (src.count > 0) std::memcpy(dst, src.host(), static_cast<size_t>(src.bytes()));
  return absl::OkStatus();
}

absl::Status CpuBackend::CopyFromHost(View dst, const void* src, Stream) {
  FSDP_RETURN_IF_ERROR(exec_->status());
  if (dst.count > 0) std::memcpy(dst.host(), src, static_cast<size_t>(dst.bytes()));
  return absl::OkStatus();
}

absl::Status CpuBackend::Copy(View dst, View src, Stream) {
  FSDP_RETURN_IF_ERROR(exec_->status());
  if (dst.bytes() != src.bytes()) {
    return absl::InvalidArgumentError(absl::StrCat("CpuBackend::Copy: ", dst.bytes(),
                                                   " bytes into ", src.bytes()));
  }
  if (dst.count > 0 && dst.host() != src.host()) {
    std::memcpy(dst.host(), src.host(), static_cast<size_t>(dst.bytes()));
  }
  return absl::OkStatus();
}

absl::Status CpuBackend::Memset(View dst, int byte, Stream) {
  FSDP_RETURN_IF_ERROR(exec_->status());
  if (dst.count > 0) std::memset(dst.host(), byte, static_cast<size_t>(dst.bytes()));
  return absl::OkStatus();
}

Event CpuBackend::Record(Stream) {
  absl::Status failure = exec_->status();
  if (failure.ok()) return Event();
  auto done = std::make_shared<backend_kit::HostEvent>();
  done->Complete(std::move(failure));
  return Event(std::move(done));
}

absl::Status CpuBackend::Wait(Stream, const Event& e) {
  FSDP_RETURN_IF_ERROR(exec_->status());
  return e.Wait();
}

RuntimeOps& CpuBackend::runtime_ops() { return *ops_; }
Ops* CpuBackend::model_ops() { return ops_.get(); }

absl::StatusOr<std::unique_ptr<DataPlane>> CpuBackend::CreateDataPlane(Communicator& group) {
  return MakeHostDataPlane(this, group);
}

void CpuBackend::BindCurrentThread() const { omp_set_num_threads(num_threads_); }

std::vector<CpuOpTime> CpuBackend::op_times() const {
  std::vector<CpuOpTime> out;
  if (clock_ == nullptr) return out;
  std::lock_guard<std::mutex> lock(clock_->mu);
  for (const auto& [name, t] : clock_->times) out.push_back(t);
  return out;
}

void CpuBackend::ResetOpTimes() {
  if (clock_ == nullptr) return;
  std::lock_guard<std::mutex> lock(clock_->mu);
  clock_->times.clear();
}

}  // namespace fsdp
