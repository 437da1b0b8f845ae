// The CPU backend: the reference that every other backend is tested against, op by op. Buffers
// are 64-byte aligned host memory with byte accounting (and an optional limit that stands in
// for a device's memory); every op runs at once on the calling thread with the CPU kernels
// (fsdp/kernels_cpu.h), so its streams are always drained and events always complete; its
// data plane is the group's own Communicator on the host bytes.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "fsdp/backend.h"
#include "fsdp/ops.h"

namespace fsdp {

struct CpuBackendOptions {
  // OpenMP threads the kernels of this backend use, for the thread that calls
  // BindCurrentThread(). 0 = all hardware threads divided by `ranks_sharing_cores`.
  int num_threads = 0;
  // How many ranks share this machine's cores (ranks as threads, or processes on one host).
  int ranks_sharing_cores = 1;
  // Device memory of this backend, in bytes (0 = only what the system gives): an allocation
  // past it fails with ResourceExhausted, as on an accelerator with that much memory.
  int64_t memory_limit_bytes = 0;
  // Adds up each op's wall time per op name (CpuBackend::op_times()), for benchmarks that ask
  // where a step's time goes: two clock reads and a locked map update per op.
  bool time_ops = false;
};

// One op's calls and wall time since the last CpuBackend::ResetOpTimes().
struct CpuOpTime {
  std::string op;  // the Ops method, e.g. "MatmulBackward"
  int64_t calls = 0;
  double seconds = 0;
};

class CpuBackend final : public Backend {
 public:
  static absl::StatusOr<std::unique_ptr<CpuBackend>> Create(CpuBackendOptions options = {});
  ~CpuBackend() override;

  std::string_view name() const override { return "cpu"; }
  std::string description() const override;
  bool is_host() const override { return true; }
  absl::StatusOr<Allocation> Allocate(size_t bytes) override;
  void Free(const Allocation& allocation) override;
  MemoryStats memory_stats() const override;
  void ResetPeak() override;
  absl::Status CopyFromHost(View dst, const void* src, Stream s = Stream::kCompute) override;
  absl::Status Copy(View dst, View src, Stream s = Stream::kCompute) override;
  absl::Status Memset(View dst, int byte, Stream s = Stream::kCompute) override;
  Event Record(Stream s) override;
  absl::Status Wait(Stream s, const Event& e) override;
  RuntimeOps& runtime_ops() override;
  Ops* model_ops() override;
  absl::StatusOr<std::unique_ptr<DataPlane>> CreateDataPlane(Communicator& group) override;

  int num_threads() const { return num_threads_; }
  // Makes the kernels called from the current thread use num_threads() OpenMP threads.
  // Each rank thread calls this once, so ranks sharing the cores do not oversubscribe them.
  void BindCurrentThread() const;

  // With CpuBackendOptions::time_ops: the ops run since the last reset, by name (empty
  // otherwise).
  std::vector<CpuOpTime> op_times() const;
  void ResetOpTimes();

 protected:
  absl::Status DoCopyToHost(void* dst, View src, Stream s) override;

 private:
  CpuBackend(int num_threads, int64_t limit, bool time_ops);
  // Each op's wall time by name (with time_ops); the executor adds to it.
  struct OpClock {
    std::mutex mu;
    std::map<std::string, CpuOpTime, std::less<>> times;
    void Add(const char* op, double seconds);
  };
  int num_threads_;
  int64_t limit_;
  std::atomic<int64_t> in_use_{0}, peak_{0}, allocs_{0};
  std::unique_ptr<OpClock> clock_;  // null without time_ops
  struct Executor;
  std::unique_ptr<Executor> exec_;
  std::unique_ptr<Ops> ops_;
};

// Hardware threads usable by this process (affinity mask aware).
int HardwareThreads();
// A rank's kernel threads: `requested` when > 0, else the hardware threads divided among the
// `ranks_sharing_cores` ranks of this host (at least 1), as CpuBackendOptions::num_threads = 0.
int ThreadsPerRank(int requested, int ranks_sharing_cores);

}  // namespace fsdp
