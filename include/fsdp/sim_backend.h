// `sim`: a strict simulated accelerator that keeps the device contract (fsdp/backend.h) the way
// a real device would force it, so that an integration that works on it works on an
// accelerator:
// - device addresses live in a reserved range with no access rights: the host reading or
//   writing a device address faults (the bytes are kept elsewhere, where only the device's
//   streams reach them);
// - every op, copy and collective runs asynchronously on a worker thread per stream, in issue
//   order, optionally slowed by an injected latency per op and per byte; only events order the
//   two streams, and the host waits only in Sync(), Synchronize() and CopyToHost();
// - memory has a budget; an allocation past it is a ResourceExhausted error;
// - its data plane, for ranks as threads of one process, moves data only on the device's own
//   streams (the communication stream's worker runs the collective), over a simulated link.
// Ops compute with the CPU reference kernels, so f32 results are bitwise those of the CPU
// backend. Usable in tests and by anyone who wants to check an integration before a device.
#pragma once

#include <cstdint>
#include <memory>

#include "absl/time/time.h"
#include "fsdp/backend.h"
#include "fsdp/communicator.h"

namespace fsdp {

struct SimBackendOptions {
  // OpenMP threads the compute stream's kernels use.
  int num_threads = 1;
  // The device's memory in bytes (0 = only what the system gives).
  int64_t memory_limit_bytes = 0;
  // Injected time: every op and copy takes at least op_latency, and a copy of S bytes
  // S / copy_bytes_per_second more (0 = as fast as the host runs it).
  absl::Duration op_latency = absl::ZeroDuration();
  double copy_bytes_per_second = 0;
  // The link between host and device (PCIe): copies to and from the host take
  // S / host_copy_bytes_per_second instead (0 = copy_bytes_per_second).
  double host_copy_bytes_per_second = 0;
  // The data plane's deadline and simulated link (CommOptions::link_*). One level only:
  // ranks_per_host and inter_host_* must stay 0 (Create rejects them).
  CommOptions data_plane = {};
};

class SimBackend final : public Backend {
 public:
  static absl::StatusOr<std::unique_ptr<SimBackend>> Create(SimBackendOptions options = {});
  // Waits for the work queued on both streams.
  ~SimBackend() override;

  std::string_view name() const override { return "sim"; }
  std::string description() const override;
  bool is_host() const override { return false; }
  absl::StatusOr<Allocation> Allocate(size_t bytes) override;
  void Free(const Allocation& allocation) override;
  MemoryStats memory_stats() const override;
  void ResetPeak() override;
  absl::Status CopyFromHost(View dst, const void* src, Stream s = Stream::kCompute) override;
  absl::Status CopyToHostAsync(void* dst, View src, Stream s = Stream::kCompute) override;
  absl::Status CopyFromHostAsync(View dst, const void* src, Stream s = Stream::kCompute) override;
  absl::Status Copy(View dst, View src, Stream s = Stream::kCompute) override;
  absl::Status Memset(View dst, int byte, Stream s = Stream::kCompute) override;
  Event Record(Stream s) override;
  absl::Status Wait(Stream s, const Event& e) override;
  RuntimeOps& runtime_ops() override;
  Ops* model_ops() override;
  absl::StatusOr<std::unique_ptr<DataPlane>> CreateDataPlane(Communicator& group) override;

  const SimBackendOptions& options() const;

  struct Impl;

 protected:
  absl::Status DoCopyToHost(void* dst, View src, Stream s) override;

 private:
  explicit SimBackend(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace fsdp
