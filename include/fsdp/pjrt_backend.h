// `pjrt`: a backend on a PJRT plugin (the XLA CPU plugin in CI; libtpu, the Neuron plugin or
// XLA's CUDA plugin on accelerators), one device per rank, all ranks of a process sharing one
// pjrt::Client. docs/pjrt.md says what works and what does not yet.
// - Memory: an allocation is a typed 1-D PJRT array held in Allocation::storage, of the dtype
//   of the first view that reaches it (f32[n] for parameters, gradients and optimizer state,
//   bf16[n] for gathered bf16 parameters, ...; ui8[bytes] only where that view is bytes), made
//   (zeros) at its first use. A view is a slice of it inside a program (a view of another
//   dtype: a bitcast, or the array's bytes). Writes (ops, copies, memsets, collective results)
//   run a program that donates the old array and returns the new one.
// - Streams: each stream is an in-order queue on a host thread. An op's item launches its
//   program without waiting (the plugin orders launches that use its outputs after it); an
//   event recorded on the stream completes once the PJRT completion events of everything
//   launched before it have, and carries the first error. Copies and collectives wait for
//   their own launch. The two streams of a rank run concurrently.
// - Data plane: for a group whose ranks are threads of one process, one device each of its
//   client, all_gather, reduce_scatter and all_reduce (sum, avg, max; f32, bf16, f16) are
//   StableHLO collective programs over the group's replicas, compiled once per structure and
//   devices and launched by each rank on its own device with a launch id shared by the ranks
//   of a call.
//   A group whose ranks are in several processes (CreateMpiThreadsWorld under mpirun): the
//   host-staged bridge (PjrtBackendOptions::cross_process), reported by data_paths().
// - Ops: the ops of fsdp/ops.h issued on a stream between two other items of it (an event
//   recorded or waited for, a copy to or from the host, a collective) run as ONE program
//   (fuse_ops): a block's forward, its backward, the head with the loss, a unit's optimizer
//   update. Device-to-device copies and memsets join it. The program takes the allocations
//   its ops' views touch and the views' offsets and scalars at run time; it is compiled once
//   per structure, found in the client's cache by a key of integers built without its text.
//   Each op's stored values pass an optimization barrier: how ops are grouped into programs
//   never changes a result. An error fails the stream with the ops' names and the plugin's
//   message.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "fsdp/pjrt_client.h"
#include "fsdp/backend.h"
#include "fsdp/communicator.h"

namespace fsdp {

// How a group whose ranks are in several processes moves its data.
enum class CrossProcess {
  // The bridge (the plugin's own collectives over a client that spans processes are not
  // implemented yet; this will choose them where a client can).
  kAuto,
  // Always through host memory: device -> host, the group's host communicator (Open MPI
  // across processes), host -> device, on the communication stream.
  kBridge,
  // The plugin's collectives only: a group across processes is FailedPrecondition on a client
  // that spans one process, Unimplemented on one that spans several.
  kPlugin,
};

struct PjrtBackendOptions {
  // The data plane's deadline for all ranks to arrive at a collective (the ranks agree on the
  // call on the host before the program is launched, so a missing rank is an error, not a
  // hang inside the plugin).
  CommOptions data_plane = {};
  // Bytes the backend may hold (0: what the device gives). Past it an allocation is a
  // RESOURCE_EXHAUSTED error, as on a device whose memory is full; the runtime names the buffer.
  int64_t memory_limit_bytes = 0;
  // Groups that span processes (ranks as threads of several processes under mpirun:
  // CreateMpiThreadsWorld). Groups inside one process always use the plugin's collectives.
  CrossProcess cross_process = CrossProcess::kAuto;
  // Ops issued back to back on a stream run as one program (at most max_fused_ops ops each);
  // false: a program per op (the fallback, and the reference the fused programs are tested
  // against).
  bool fuse_ops = true;
  int max_fused_ops = 512;
  // Each launch waits for its program and adds its time to PjrtLaunchStats::program_time (a
  // profile: the streams no longer overlap).
  bool profile = false;
  // Boolean XLA debug options for every program, as XLA_FLAGS names them (JAX's
  // compiler_options), after the backend's own: on the CPU plugin
  // xla_cpu_copy_insertion_use_region_analysis = true (XLA otherwise copies whole arrays that
  // a program reads in one op and updates in place in a later one). A plugin that does not know
  // an option fails the first compile with a message naming it.
  std::vector<std::pair<std::string, bool>> xla_options;
};

// What a backend has launched (PjrtBackend::launch_stats).
struct PjrtLaunchStats {
  int64_t programs = 0;  // launches of every kind
  int64_t op_programs = 0;  // of them, programs of ops (one per fused run of ops)
  int64_t ops = 0;  // ops (and device-to-device copies and memsets) in those programs
  // Programs that took an allocation held as bytes (ui8) rather than typed elements, with
  // their launches: "name: ui8[bytes], ...". An allocation is typed by the dtype of the
  // first view that reaches it; it is bytes where that view is bytes (a byte contract, e.g.
  // a copy between views of two dtypes) or its size is not a multiple of that dtype's.
  std::map<std::string, int64_t> byte_programs;
  // The temporary memory XLA gives each program beyond its arguments and outputs, in bytes
  // (the largest over the executables of that name; from the plugin's compiled memory stats,
  // absent where the plugin does not give them). An update in place that XLA turns into a copy
  // of its array shows here.
  std::map<std::string, int64_t> temp_bytes;
  // With PjrtBackendOptions::profile: each program's launches and seconds from launch to done.
  struct Time {
    int64_t launches = 0;
    double seconds = 0;
  };
  std::map<std::string, Time> program_time;
};

class PjrtBackend final : public Backend {
 public:
  // The backend of device `device` (0 .. client->num_devices() - 1) of `client`.
  static absl::StatusOr<std::unique_ptr<PjrtBackend>> Create(std::shared_ptr<pjrt::Client> client,
                                                             int device,
                                                             PjrtBackendOptions options = {});
  // Waits for the work queued on both streams.
  ~PjrtBackend() override;

  std::string_view name() const override { return "pjrt"; }
  std::string description() const override;
  bool is_host() const override { return false; }
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

  pjrt::Client& client() const;
  int device() const;
  // The data path of each data plane made so far, in order: (group name, "plugin" or
  // "bridge"), the same on every rank of a group.
  std::vector<std::pair<std::string, std::string>> data_paths() const;
  // Launches so far (counted when issued to the plugin, on the streams' threads: read them
  // after a Record(...).Wait() of each stream).
  PjrtLaunchStats launch_stats() const;

  struct Impl;

 protected:
  absl::Status DoCopyToHost(void* dst, View src, Stream s) override;

 private:
  explicit PjrtBackend(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace fsdp
