// The strict simulated accelerator (fsdp/sim_backend.h): device addresses without access rights,
// storage elsewhere, a worker thread per stream running ops, copies and collectives in issue
// order, events, a memory budget, injected latency, and a data plane for ranks as threads
// that runs on the communication stream.
#include "fsdp/sim_backend.h"

#include <omp.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "backends/common/checked_ops.h"
#include "backends/common/deferred_frees.h"
#include "backends/common/host_event.h"
#include "backends/common/memory_counter.h"
#include "backends/common/rendezvous.h"
#include "backends/common/worker_stream.h"
#include "backends/host/host_ops.h"
#include "collectives/control.h"
#include "collectives/reduce.h"
#include "fsdp/data_plane.h"
#include "fsdp/local_world.h"
#include "fsdp/trace.h"

namespace fsdp {
namespace {

constexpr size_t kAlignment = 256;

// Device addresses: one range reserved for the process with no access rights, handed out in
// 256-byte granules (freed ranges are reused by size).
class AddressSpace {
 public:
  static AddressSpace& Get() {
    static AddressSpace* space = new AddressSpace();
    return *space;
  }
  absl::StatusOr<uintptr_t> Reserve(size_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    if (base_ == 0) {
      return absl::ResourceExhaustedError(
          "sim: could not reserve an address range for device addresses (mmap failed)");
    }
    auto it = free_.find(bytes);
    if (it != free_.end()) {
      const uintptr_t a = it->second;
      free_.erase(it);
      return a;
    }
    if (next_ + bytes > size_) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "sim: the device address range (", size_ >> 30, " GiB) is used up"));
    }
    const uintptr_t a = base_ + next_;
    next_ += bytes;
    return a;
  }
  void Release(uintptr_t address, size_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    free_.emplace(bytes, address);
  }

 private:
  AddressSpace() {
    for (size_t size : {size_t{1} << 38, size_t{1} << 34}) {
      void* p = mmap(nullptr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      if (p != MAP_FAILED) {
        base_ = reinterpret_cast<uintptr_t>(p);
        size_ = size;
        return;
      }
    }
  }
  std::mutex mu_;
  uintptr_t base_ = 0;
  size_t size_ = 0, next_ = kAlignment;  // address base_ itself is never handed out
  std::multimap<size_t, uintptr_t> free_;
};

using SimEvent = backend_kit::HostEvent;

// A stream: a worker thread running what is submitted, in order (backends/common). A failed
// wait or collective marks the stream failed; events recorded after that carry the error.
using SimStream = backend_kit::WorkerStream;

std::atomic<uint64_t> g_next_backend_id{1};

// The Views of a sim backend reach their bytes through the allocation's storage.
char* StorageOf(const View& v) { return internal::Bytes(v); }

}  // namespace

namespace internal {
struct SimExec;
}

struct SimBackend::Impl {
  SimBackendOptions options;
  uint64_t id = g_next_backend_id.fetch_add(1);
  backend_kit::MemoryCounter memory;  // in use, peak, count, the limit
  std::unique_ptr<SimStream> compute, comm;
  std::unique_ptr<internal::SimExec> exec;
  std::unique_ptr<Ops> ops;

  SimStream& stream(Stream s) { return s == Stream::kCompute ? *compute : *comm; }

  // Freed allocations whose bytes go back once the work issued before the free has run on
  // both streams; checked at each Allocate and Free, without ever making a stream wait.
  backend_kit::DeferredFrees deferred;
  void Reap(bool wait_all) { deferred.Reap(wait_all); }
  // The injected time of an op moving `bytes`.
  void Delay(size_t bytes) const {
    absl::Duration d = options.op_latency;
    if (options.copy_bytes_per_second > 0 && bytes > 0) {
      d += absl::Seconds(static_cast<double>(bytes) / options.copy_bytes_per_second);
    }
    if (d > absl::ZeroDuration()) absl::SleepFor(d);
  }
  // The injected time of a copy of `bytes` between host and device.
  void HostDelay(size_t bytes) const {
    const double rate = options.host_copy_bytes_per_second > 0
                            ? options.host_copy_bytes_per_second
                            : options.copy_bytes_per_second;
    absl::Duration d = options.op_latency;
    if (rate > 0 && bytes > 0) d += absl::Seconds(static_cast<double>(bytes) / rate);
    if (d > absl::ZeroDuration()) absl::SleepFor(d);
  }
};

// Runs the ops of HostOps on the stream's worker, after the injected latency.
struct internal::SimExec {
  SimBackend::Impl* impl;
  template <class F>
  void Run(Stream s, const char* op, F&& work) {
    SimBackend::Impl* m = impl;
    m->stream(s).Submit(op, [m, w = std::forward<F>(work)]() mutable {
      m->Delay(0);
      w();
    });
  }
  // An op's views were wrong: the stream fails there, in order (the work before it runs).
  void Fail(Stream s, const char* op, const absl::Status& why) {
    backend_kit::WorkerStream* stream = &impl->stream(s);
    const absl::Status failure(why.code(), absl::StrCat("sim op ", op, ": ", why.message()));
    stream->Submit(op, [stream, failure] { stream->SetFailure(failure); });
  }
};

namespace {

// Ranks as threads of one process, each with a sim backend: a collective is an item on the
// communication stream that waits for the stream the input came from, then runs over the
// group's shared-memory transport on the devices' storage (with the simulated link).
class SimDataPlane final : public DataPlane {
 public:
  SimDataPlane(SimBackend* backend, SimBackend::Impl* impl, std::unique_ptr<Communicator> comm)
      : DataPlane(backend, "sim"), backend_(backend), impl_(impl), comm_(std::move(comm)) {}
  int rank() const override { return comm_->rank(); }
  int size() const override { return comm_->size(); }
  const std::string& name() const override { return comm_->name(); }

  void Abort(const absl::Status& reason) override { comm_->Abort(reason); }

 private:
  absl::StatusOr<Event> EnqueueAllGather(View send, View recv, Stream after) override {
    return Issue("all_gather", after, [send, recv](Communicator& c) {
      return c.AllGather(ConstBufferView{StorageOf(send), send.count, send.dtype},
                         BufferView{StorageOf(recv), recv.count, recv.dtype});
    });
  }
  absl::StatusOr<Event> EnqueueReduceScatter(View send, View recv, ReduceOp op,
                                             Stream after) override {
    return Issue("reduce_scatter", after, [send, recv, op](Communicator& c) {
      return c.ReduceScatter(ConstBufferView{StorageOf(send), send.count, send.dtype},
                             BufferView{StorageOf(recv), recv.count, recv.dtype}, op);
    });
  }
  absl::StatusOr<Event> EnqueueAllReduce(View send, View recv, ReduceOp op,
                                         Stream after) override {
    return Issue("all_reduce", after, [send, recv, op](Communicator& c) {
      return c.AllReduce(ConstBufferView{StorageOf(send), send.count, send.dtype},
                         BufferView{StorageOf(recv), recv.count, recv.dtype}, op);
    });
  }
  absl::StatusOr<Event> EnqueueAllToAll(View send, View recv, Stream after) override {
    return Issue("all_to_all", after, [send, recv](Communicator& c) {
      return c.AllToAll(ConstBufferView{StorageOf(send), send.count, send.dtype},
                        BufferView{StorageOf(recv), recv.count, recv.dtype});
    });
  }
  absl::StatusOr<Event> Issue(const char* what, Stream after,
                              std::function<absl::Status(Communicator&)> run) {
    const Event ready = backend_->Record(after);
    auto done = std::make_shared<SimEvent>();
    Communicator* comm = comm_.get();
    SimStream* stream = &impl_->stream(Stream::kComm);
    const absl::Duration latency = impl_->options.data_plane.link_latency;
    stream->Submit(what, [ready, done, comm, stream, latency, run = std::move(run)] {
      absl::Status s = ready.Wait();
      // The link's latency passes before the data moves, so work that reads the result
      // without waiting for the event reads stale memory.
      if (s.ok() && latency > absl::ZeroDuration()) absl::SleepFor(latency);
      if (s.ok()) s = run(*comm);
      if (!s.ok()) stream->SetFailure(s);
      done->Complete(s);
    });
    return Event(done);
  }

  SimBackend* backend_;
  SimBackend::Impl* impl_;
  std::unique_ptr<Communicator> comm_;
};


}  // namespace

absl::StatusOr<std::unique_ptr<SimBackend>> SimBackend::Create(SimBackendOptions options) {
  if (options.num_threads < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("SimBackend: num_threads must be >= 1, got ", options.num_threads));
  }
  if (options.memory_limit_bytes < 0 || options.copy_bytes_per_second < 0 ||
      options.host_copy_bytes_per_second < 0 ||
      options.op_latency < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        "SimBackend: memory_limit_bytes, op_latency, copy_bytes_per_second and "
        "host_copy_bytes_per_second must be >= 0");
  }
  const CommOptions& plane = options.data_plane;
  if (plane.ranks_per_host != 0 || plane.inter_host_bytes_per_second != 0 ||
      plane.inter_host_latency != absl::ZeroDuration()) {
    // The data plane is a world per group, made from the group's ranks alone: it does not know
    // where the members sit in the world, so it has no hosts to put them on.
    return absl::InvalidArgumentError(
        "SimBackend: data_plane has one level of simulated link (link_bytes_per_second, "
        "link_latency); leave ranks_per_host and inter_host_* at 0 (the local communicator "
        "honours them: pass them to LocalWorld)");
  }
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  impl->memory.set_limit(options.memory_limit_bytes);
  const int compute_threads = options.num_threads;
  impl->compute = std::make_unique<SimStream>(SimStream::Options{
      std::string(kDeviceComputeStream), [compute_threads] { omp_set_num_threads(compute_threads); },
      nullptr});
  impl->comm = std::make_unique<SimStream>(
      SimStream::Options{std::string(kDeviceCommStream), [] { omp_set_num_threads(1); }, nullptr});
  std::unique_ptr<SimBackend> b(new SimBackend(std::move(impl)));
  b->impl_->exec = std::make_unique<internal::SimExec>(internal::SimExec{b->impl_.get()});
  internal::SimExec* exec = b->impl_->exec.get();
  b->impl_->ops = std::make_unique<backend_kit::CheckedOps>(
      std::make_unique<internal::HostOps<internal::SimExec>>(exec),
      [exec](Stream s, const char* op, const absl::Status& why) { exec->Fail(s, op, why); });
  return b;
}

SimBackend::SimBackend(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

std::string SimBackend::description() const {
  return absl::StrCat("sim backend, ", impl_->options.num_threads,
                      impl_->options.num_threads == 1 ? " thread" : " threads");
}

SimBackend::~SimBackend() {
  // The streams drain their queues before their workers stop.
  impl_->compute.reset();
  impl_->comm.reset();
  impl_->Reap(/*wait_all=*/true);
}

const SimBackendOptions& SimBackend::options() const { return impl_->options; }

absl::StatusOr<Allocation> SimBackend::Allocate(size_t bytes) {
  if (bytes == 0) return Allocation{};
  impl_->Reap(/*wait_all=*/false);
  const auto n = static_cast<int64_t>(bytes);
  FSDP_ASSIGN_OR_RETURN(const int64_t now, impl_->memory.Reserve(n));
  const size_t rounded = (bytes + kAlignment - 1) / kAlignment * kAlignment;
  absl::StatusOr<uintptr_t> address = AddressSpace::Get().Reserve(rounded);
  void* storage = address.ok() ? std::aligned_alloc(64, rounded) : nullptr;
  if (storage == nullptr) {
    if (address.ok()) AddressSpace::Get().Release(*address, rounded);
    impl_->memory.Release(n);
    return address.ok() ? absl::ResourceExhaustedError(absl::StrCat(
                              "out of memory: the system could not give ", bytes, " bytes"))
                        : address.status();
  }
  impl_->memory.Commit(now);
  return Allocation{reinterpret_cast<void*>(*address), storage, bytes};
}

void SimBackend::Free(const Allocation& a) {
  if (a.address == nullptr) return;
  const size_t rounded = (a.bytes + kAlignment - 1) / kAlignment * kAlignment;
  impl_->memory.Release(static_cast<int64_t>(a.bytes));
  // Stream-ordered, as cudaFreeAsync: the bytes go back once the work issued so far on both
  // streams has run (a buffer dropped on an error path may still be written by queued work).
  // Neither stream waits for the other.
  void* storage = a.storage;
  const auto address = reinterpret_cast<uintptr_t>(a.address);
  impl_->deferred.Add(Record(Stream::kCompute), Record(Stream::kComm), [storage, address, rounded] {
    std::free(storage);
    AddressSpace::Get().Release(address, rounded);
  });
  impl_->Reap(/*wait_all=*/false);
}

MemoryStats SimBackend::memory_stats() const {
  return impl_->memory.stats();
}

void SimBackend::ResetPeak() { impl_->memory.ResetPeak(); }

absl::Status SimBackend::DoCopyToHost(void* dst, View src, Stream s) {
  FSDP_RETURN_IF_ERROR(Record(s).Wait());
  impl_->HostDelay(static_cast<size_t>(src.bytes()));
  if (src.count > 0) std::memcpy(dst, StorageOf(src), static_cast<size_t>(src.bytes()));
  return absl::OkStatus();
}

absl::Status SimBackend::CopyFromHost(View dst, const void* src, Stream s) {
  if (dst.count == 0) return absl::OkStatus();
  // The host's bytes are taken now (the caller may reuse them), written in stream order.
  auto staged = std::make_shared<std::string>(static_cast<const char*>(src),
                                              static_cast<size_t>(dst.bytes()));
  Impl* m = impl_.get();
  char* to = StorageOf(dst);
  m->stream(s).Submit("copy_from_host", [m, to, staged] {
    m->HostDelay(staged->size());
    std::memcpy(to, staged->data(), staged->size());
  });
  return absl::OkStatus();
}

absl::Status SimBackend::CopyToHostAsync(void* dst, View src, Stream s) {
  if (src.count == 0) return absl::OkStatus();
  Impl* m = impl_.get();
  const char* from = StorageOf(src);
  const size_t bytes = static_cast<size_t>(src.bytes());
  m->stream(s).Submit("copy_to_host", [m, dst, from, bytes] {
    m->HostDelay(bytes);
    std::memcpy(dst, from, bytes);
  });
  return absl::OkStatus();
}

absl::Status SimBackend::CopyFromHostAsync(View dst, const void* src, Stream s) {
  if (dst.count == 0) return absl::OkStatus();
  Impl* m = impl_.get();
  char* to = StorageOf(dst);
  const size_t bytes = static_cast<size_t>(dst.bytes());
  m->stream(s).Submit("copy_from_host", [m, to, src, bytes] {
    m->HostDelay(bytes);
    std::memcpy(to, src, bytes);
  });
  return absl::OkStatus();
}

absl::Status SimBackend::Copy(View dst, View src, Stream s) {
  if (dst.bytes() != src.bytes()) {
    return absl::InvalidArgumentError(absl::StrCat("SimBackend::Copy: ", src.bytes(),
                                                   " bytes into ", dst.bytes()));
  }
  if (dst.count == 0) return absl::OkStatus();
  Impl* m = impl_.get();
  char* to = StorageOf(dst);
  const char* from = StorageOf(src);
  const size_t bytes = static_cast<size_t>(dst.bytes());
  m->stream(s).Submit("copy", [m, to, from, bytes] {
    m->Delay(bytes);
    coll::CopyBytes(to, from, bytes);
  });
  return absl::OkStatus();
}

absl::Status SimBackend::Memset(View dst, int byte, Stream s) {
  if (dst.count == 0) return absl::OkStatus();
  Impl* m = impl_.get();
  char* to = StorageOf(dst);
  const size_t bytes = static_cast<size_t>(dst.bytes());
  m->stream(s).Submit("memset", [m, to, byte, bytes] {
    m->Delay(0);
    std::memset(to, byte, bytes);
  });
  return absl::OkStatus();
}

Event SimBackend::Record(Stream s) {
  auto e = std::make_shared<SimEvent>();
  SimStream* stream = &impl_->stream(s);
  stream->Submit("record", [e, stream] { e->Complete(stream->failure()); });
  return Event(e);
}

absl::Status SimBackend::Wait(Stream s, const Event& e) {
  if (!e.valid()) return absl::OkStatus();
  if (e.Done()) return e.Wait();  // nothing to wait for; its error, if any, now
  SimStream* stream = &impl_->stream(s);
  const bool exposed = s == Stream::kCompute;
  stream->Submit("wait", [e, stream, exposed] {
    absl::Status st;
    if (exposed && !e.Done()) {  // the compute stream stalls: exposed communication
      TraceSpan span("wait", kWaitStream);
      st = e.Wait();
    } else {
      st = e.Wait();
    }
    if (!st.ok()) stream->SetFailure(st);
  });
  return absl::OkStatus();
}

RuntimeOps& SimBackend::runtime_ops() { return *impl_->ops; }
Ops* SimBackend::model_ops() { return impl_->ops.get(); }

absl::StatusOr<std::unique_ptr<DataPlane>> SimBackend::CreateDataPlane(Communicator& group) {
  // The ranks of the group find each other by their backends' ids: they must be threads of
  // one process.
  FSDP_ASSIGN_OR_RETURN(std::vector<uint64_t> all,
                        internal::AllGatherU64(group, {impl_->id, static_cast<uint64_t>(getpid())}));
  std::vector<uint64_t> ids;
  for (int r = 0; r < group.size(); ++r) {
    if (all[2 * r + 1] != static_cast<uint64_t>(getpid())) {
      return absl::FailedPreconditionError(absl::StrCat(
          "sim data plane of group '", group.name(), "': rank ", r, " is another process; the "
          "sim backend connects ranks as threads of one process"));
    }
    ids.push_back(all[2 * r]);
  }
  // The ranks of the group meet to share one shared-memory world.
  const std::string key = absl::StrCat("sim|", group.name(), "|", absl::StrJoin(ids, ","));
  CommOptions options = impl_->options.data_plane;
  options.link_latency = absl::ZeroDuration();  // charged by the data plane, before the move
  const int rank = group.rank();
  FSDP_ASSIGN_OR_RETURN(
      std::unique_ptr<Communicator> comm,
      backend_kit::Rendezvous<LocalWorld>::Join<std::unique_ptr<Communicator>>(
          key, group.size(),
          [&]() { return LocalWorld::Create(group.size(), options, group.name()); },
          [rank](const std::shared_ptr<LocalWorld>& w) { return w->TakeRank(rank); }));
  return std::unique_ptr<DataPlane>(new SimDataPlane(this, impl_.get(), std::move(comm)));
}

}  // namespace fsdp
