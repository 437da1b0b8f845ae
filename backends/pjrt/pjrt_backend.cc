// The PJRT backend (pjrt_backend.h): allocations held as typed PJRT arrays, in-order host queues
// as streams, the data plane of ranks as threads (StableHLO collectives over replicas), and the
// op table's programs (pjrt_ops.h) launched in stream order.
#include "fsdp/pjrt_backend.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
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
#include "backends/pjrt/pjrt_ops.h"
#include "backends/pjrt/program.h"
#include "backends/pjrt/stablehlo.h"
#include "collectives/control.h"
#include "fsdp/data_plane.h"
#include "fsdp/local_world.h"
#include "fsdp/ops.h"

namespace fsdp {
namespace {

using HostEvent = backend_kit::HostEvent;

// A stream: a host thread running submitted items in order (backends/common), and the
// completion events of the programs it launched. The first error of an item is sticky: events
// recorded after it carry it.
// Ops are held back (AddOp) until another item is submitted, max_ops of them are held, or the
// queue is destroyed; then they run as one item (RunOps: one program), in their place in the
// queue's order. Where a program ends is therefore a function of the order of the calls on the
// stream only, never of timing (XLA may fuse the ops of a program across their boundaries, so
// the grouping can change the last bits of a result): a Mark() (the frees' records, issued when
// the runtime finds its events done) does not end the held ops' program.
class Queue {
 public:
  using RunOps = std::function<void(Queue&, const std::vector<pjrt::OpBuilder>&)>;
  Queue(RunOps run, int max_ops)
      : run_(std::move(run)),
        max_ops_(std::max(1, max_ops)),
        worker_({"", nullptr, [this] { Drain(); }}) {}
  ~Queue() {
    std::lock_guard<std::mutex> lock(ops_mu_);
    FlushLocked();
  }
  void Submit(std::function<void()> fn) {
    std::lock_guard<std::mutex> lock(ops_mu_);
    FlushLocked();
    worker_.Submit(nullptr, std::move(fn));
  }
  void AddOp(pjrt::OpBuilder op) {
    std::lock_guard<std::mutex> lock(ops_mu_);
    ops_.push_back(std::move(op));
    if (static_cast<int>(ops_.size()) >= max_ops_) FlushLocked();
  }
  // An event complete once everything issued on the queue so far has run, held ops included,
  // without ending their program: it completes at the first Drain() after them.
  Event Mark() {
    auto e = std::make_shared<HostEvent>();
    std::lock_guard<std::mutex> lock(ops_mu_);
    if (ops_.empty()) {
      worker_.Submit(nullptr, [this, e] {
        Drain();
        e->Complete(failure());
      });
    } else {
      marks_.push_back(e);
    }
    return Event(e);
  }
  void SetFailure(const absl::Status& s) { worker_.SetFailure(s); }
  absl::Status failure() { return worker_.failure(); }
  // On the worker thread only: the completion events of the programs launched and not yet
  // waited for. Drain() waits for them all; the first error fails the stream.
  void AddPending(pjrt::DeviceEvent e) {
    pending_.push_back(std::move(e));
    if (pending_.size() >= kMaxPending) Drain();
  }
  void Drain() {
    for (pjrt::DeviceEvent& e : pending_) {
      absl::Status s = e.Await();
      if (!s.ok()) SetFailure(s);
    }
    pending_.clear();
    for (const std::shared_ptr<HostEvent>& m : ran_marks_) m->Complete(failure());
    ran_marks_.clear();
  }

 private:
  void FlushLocked() {
    if (ops_.empty()) return;
    worker_.Submit(nullptr, [this, ops = std::move(ops_), marks = std::move(marks_)] {
      if (failure().ok()) run_(*this, ops);
      ran_marks_.insert(ran_marks_.end(), marks.begin(), marks.end());
    });
    ops_.clear();
    marks_.clear();
  }

  static constexpr size_t kMaxPending = 32;  // launches in flight before the queue waits
  const RunOps run_;
  const int max_ops_;
  std::mutex ops_mu_;
  std::vector<pjrt::OpBuilder> ops_;  // held back, not yet submitted
  std::vector<std::shared_ptr<HostEvent>> marks_;  // Mark()s after ops_, with them
  std::vector<pjrt::DeviceEvent> pending_;
  std::vector<std::shared_ptr<HostEvent>> ran_marks_;  // complete at the next Drain()
  backend_kit::WorkerStream worker_;  // last: its thread drains pending_ when it stops
};

// An allocation: a PJRT array type[bytes / size of type], replaced by each write. The type is
// the dtype of the first view that reaches the allocation (f32 for parameters, gradients and
// optimizer state, bf16 for gathered bf16 parameters, ...; ui8 where that view is bytes or the
// size is not a multiple of its dtype's); the array is made (zeros) at the first use. `mu` is
// held by the item that reads, makes or replaces the buffer.
struct Storage {
  std::mutex mu;
  pjrt::DeviceBuffer buf;  // null until the first use
  int64_t bytes = 0;
  std::atomic<int> type{-1};  // a DType once decided
};

Storage* StorageOf(const View& v) { return static_cast<Storage*>(v.allocation.storage); }
bool Whole(const View& v) {
  return v.offset == 0 && v.bytes() == static_cast<int64_t>(v.allocation.bytes);
}

std::atomic<uint64_t> g_next_backend_id{1};
std::atomic<int64_t> g_next_launch_base{0};

}  // namespace

struct PjrtBackend::Impl {
  std::shared_ptr<pjrt::Client> client;
  int device = 0;
  PjrtBackendOptions options;
  uint64_t id = g_next_backend_id.fetch_add(1);
  backend_kit::MemoryCounter memory;  // in use, peak, count, the limit
  std::unique_ptr<Queue> compute, comm;
  std::unique_ptr<Ops> ops;

  const Backend* backend = nullptr;  // the PjrtBackend of this Impl

  // The data path chosen for each group (PjrtBackend::data_paths).
  mutable std::mutex paths_mu;
  std::vector<std::pair<std::string, std::string>> paths;
  void NotePath(const std::string& group, const std::string& path) {
    std::lock_guard<std::mutex> lock(paths_mu);
    paths.emplace_back(group, path);
  }
  Queue& stream(Stream s) { return s == Stream::kCompute ? *compute : *comm; }

  // Freed allocations, released once the work issued before the free has run on both streams.
  backend_kit::DeferredFrees deferred;
  void Reap(bool wait_all) { deferred.Reap(wait_all); }

  // The element type of the array of v's allocation: decided by the first view that asks.
  DType ElementType(const View& v) const {
    if (v.backend != backend || v.allocation.storage == nullptr) return DType::kU8;
    Storage* st = StorageOf(v);
    int t = st->type.load();
    if (t < 0) {
      DType want = v.dtype;
      if (st->bytes % static_cast<int64_t>(DTypeSize(want)) != 0) want = DType::kU8;
      st->type.compare_exchange_strong(t, static_cast<int>(want));
      t = st->type.load();
    }
    return static_cast<DType>(t);
  }
  pjrt::ElementTypeFn element_types() const {
    return [this](const View& v) { return ElementType(v); };
  }
  // Makes st's array (zeros) if it has none yet (the caller holds st.mu).
  absl::Status Materialize(Storage& st) const {
    if (st.buf.get() != nullptr) return absl::OkStatus();
    int t = st.type.load();
    if (t < 0) {
      st.type.compare_exchange_strong(t, static_cast<int>(DType::kU8));
      t = st.type.load();
    }
    const auto type = static_cast<DType>(t);
    // Zeroed pages from the system: the host side costs nothing until the copy reads them.
    void* zeros = std::calloc(static_cast<size_t>(st.bytes), 1);
    if (zeros == nullptr) {
      return absl::ResourceExhaustedError(
          absl::StrCat("out of memory: the host could not stage ", st.bytes, " bytes"));
    }
    absl::StatusOr<pjrt::DeviceBuffer> buf = client->FromHost(
        zeros, type, st.bytes / static_cast<int64_t>(DTypeSize(type)), device);
    std::free(zeros);
    FSDP_RETURN_IF_ERROR(buf.status());
    st.buf = *std::move(buf);
    return absl::OkStatus();
  }

  // Launches `exe`, compiled from the program `p` describes: p's allocations locked (in
  // address order, so the two streams never deadlock) and made if new, their arrays, `inputs`
  // and the run-time values as arguments; the written allocations' arrays replaced by the
  // outputs (the old ones were donated). With a queue it does not wait for the program: the
  // plugin orders later launches that use the outputs after it, and the queue waits for its
  // completion event at the next event recorded on the stream. Without one it waits. Returns
  // the program's Outputs.
  absl::StatusOr<std::vector<pjrt::DeviceBuffer>> Launch(const pjrt::Program& p,
                                                         const pjrt::Executable& exe,
                                                         const std::vector<PJRT_Buffer*>& inputs,
                                                         Queue* q, int launch_id = 0) {
    std::vector<Storage*> order;
    for (const pjrt::Program::Arg& a : p.args()) order.push_back(static_cast<Storage*>(a.storage));
    std::sort(order.begin(), order.end());
    order.erase(std::unique(order.begin(), order.end()), order.end());
    std::vector<std::unique_lock<std::mutex>> locks;
    for (Storage* st : order) {
      locks.emplace_back(st->mu);
      FSDP_RETURN_IF_ERROR(Materialize(*st));
    }
    FSDP_ASSIGN_OR_RETURN(
        pjrt::DeviceBuffer params,
        client->I64Array(p.params().data(), static_cast<int64_t>(p.params().size()), device));
    std::vector<PJRT_Buffer*> args;
    bool bytes = false;
    for (const pjrt::Program::Arg& a : p.args()) {
      args.push_back(static_cast<Storage*>(a.storage)->buf.get());
      bytes = bytes || a.type == DType::kU8;
    }
    args.insert(args.end(), inputs.begin(), inputs.end());
    args.push_back(params.get());
    std::vector<pjrt::DeviceBuffer> out;
    if (options.profile) {
      const auto start = std::chrono::steady_clock::now();
      FSDP_ASSIGN_OR_RETURN(out, client->Execute(exe, device, args, launch_id));
      const std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
      std::lock_guard<std::mutex> lock(stats_mu);
      PjrtLaunchStats::Time& t = program_time[p.name()];
      ++t.launches;
      t.seconds += took.count();
    } else if (q != nullptr) {
      pjrt::DeviceEvent done;
      FSDP_ASSIGN_OR_RETURN(out, client->Launch(exe, device, args, &done, launch_id));
      q->AddPending(std::move(done));
    } else {
      FSDP_ASSIGN_OR_RETURN(out, client->Execute(exe, device, args, launch_id));
    }
    programs.fetch_add(1, std::memory_order_relaxed);
    if (bytes) NoteBytes(p);
    if (exe.temp_bytes >= 0) {
      std::lock_guard<std::mutex> lock(stats_mu);
      int64_t& t = temp_bytes[p.name()];
      t = std::max(t, exe.temp_bytes);
    }
    size_t j = 0;
    for (const pjrt::Program::Arg& a : p.args()) {
      if (a.written) static_cast<Storage*>(a.storage)->buf = std::move(out[j++]);
    }
    out.erase(out.begin(), out.begin() + static_cast<std::ptrdiff_t>(j));
    return out;
  }

  // Launches of programs with an allocation held as bytes among their arguments, and the
  // profile (options.profile).
  mutable std::mutex stats_mu;
  std::map<std::string, int64_t> byte_programs;  // "name (ops): ui8[n]" -> launches
  std::map<std::string, PjrtLaunchStats::Time> program_time;
  std::map<std::string, int64_t> temp_bytes;  // program name -> largest temporary memory
  void NoteBytes(const pjrt::Program& p) {
    std::vector<std::string> sizes;
    for (const pjrt::Program::Arg& a : p.args()) {
      if (a.type == DType::kU8) sizes.push_back(absl::StrCat("ui8[", a.bytes, "]"));
    }
    std::lock_guard<std::mutex> lock(stats_mu);
    ++byte_programs[absl::StrCat(p.name(), ": ", absl::StrJoin(sizes, ", "))];
  }

  // The program of `ops`: built dry (arguments, run-time values and its key, no text), found
  // in the client's cache by its key, and built as text only to be compiled the first time.
  absl::Status RunOps(const std::vector<pjrt::OpBuilder>& ops, Queue& q) {
    std::string name = ops.size() == 1 ? std::string(ops[0].name) : std::string("ops");
    if (ops.size() > 1) {
      // The name says which ops (the program's name in error messages and byte_programs).
      std::vector<std::string> names;
      for (const pjrt::OpBuilder& op : ops) {
        if (names.empty() || names.back() != op.name) names.push_back(op.name);
        if (names.size() == 6) break;
      }
      name = absl::StrCat("ops_", absl::StrJoin(names, "_"), names.size() == 6 ? "_etc" : "");
    }
    pjrt::Program p(name, /*dry=*/true, element_types());
    FSDP_ASSIGN_OR_RETURN(const pjrt::Executable* exe,
                          Compile(&p, [&](pjrt::Program* q) {
                            for (const pjrt::OpBuilder& op : ops) {
                              q->BeginOp(op.name);
                              op.build(q);
                            }
                          }));
    op_programs.fetch_add(1, std::memory_order_relaxed);
    op_count.fetch_add(static_cast<int64_t>(ops.size()), std::memory_order_relaxed);
    return Launch(p, *exe, {}, &q).status();
  }

  // A program of one op built by `build`, compiled (once per key), and launched now, waiting.
  absl::StatusOr<std::vector<pjrt::DeviceBuffer>> RunNow(
      const std::string& name, const std::function<void(pjrt::Program*)>& build,
      const std::vector<PJRT_Buffer*>& inputs) {
    pjrt::Program p(name, /*dry=*/true, element_types());
    FSDP_ASSIGN_OR_RETURN(const pjrt::Executable* exe, Compile(&p, [&](pjrt::Program* q) {
                            q->BeginOp(name.c_str());
                            build(q);
                          }));
    return Launch(p, *exe, inputs, nullptr);
  }

  // The executable of the program `build` makes: built into the dry program `p` (its arguments,
  // run-time values and key), found in the client's cache by the key and `devices` (none: a
  // portable single-device program), and built as text only to be compiled the first time.
  absl::StatusOr<const pjrt::Executable*> Compile(
      pjrt::Program* p, const std::function<void(pjrt::Program*)>& build,
      const std::vector<int64_t>& devices = {}) {
    build(p);
    FSDP_RETURN_IF_ERROR(p->CheckViews(backend));
    std::string key = absl::StrCat(p->Key(), overrides_key);
    if (!devices.empty()) absl::StrAppend(&key, "|", absl::StrJoin(devices, ","));
    return client->CompileKeyed(
        key, p->name(),
        [&] {
          pjrt::Program full(p->name(), /*dry=*/false, element_types());
          build(&full);
          return full.Text();
        },
        devices.empty() ? pjrt::PortableCompileOptions(overrides)
                        : pjrt::CompileOptions(devices, overrides));
  }
  // XLA options of every program (in the programs' cache keys: backends of one client may
  // differ). On the CPU plugin, copy insertion by region analysis: without it XLA
  // copies a whole array wherever one op of a program reads it and a later op updates it in
  // place with no data dependence between the two (AdamW of one tensor reads its unit's
  // gradient and moment arrays, AdamW of the next updates a slice of the moments, the memset
  // after them overwrites the gradient): 326 MiB per step and rank in mini's optimizer.
  pjrt::XlaOverrides overrides;  // then PjrtBackendOptions::xla_options
  std::string overrides_key;
  // v's bytes into host memory at dst (on a stream's thread; waits).
  absl::Status ReadToHost(const View& v, void* dst) {
    if (v.count == 0) return absl::OkStatus();
    Storage& st = *StorageOf(v);
    ElementType(v);
    if (Whole(v)) {
      std::lock_guard<std::mutex> lock(st.mu);
      FSDP_RETURN_IF_ERROR(Materialize(st));
      return client->ToHost(st.buf.get(), dst, static_cast<size_t>(v.bytes()));
    }
    const std::string raw = pjrt::ElementTypeOf(v.dtype);
    FSDP_ASSIGN_OR_RETURN(std::vector<pjrt::DeviceBuffer> out,
                          RunNow("read", [&](pjrt::Program* p) {
                            p->Output(p->Load(v, {v.count}, raw));
                          }, {}));
    return client->ToHost(out[0].get(), dst, static_cast<size_t>(v.bytes()));
  }
  // Host memory at src into v (on a stream's thread).
  absl::Status WriteFromHost(const View& v, const void* src) {
    if (v.count == 0) return absl::OkStatus();
    Storage& st = *StorageOf(v);
    const DType type = ElementType(v);
    if (Whole(v)) {
      // The same bytes as the array's type: no program.
      FSDP_ASSIGN_OR_RETURN(
          pjrt::DeviceBuffer buf,
          client->FromHost(src, type, st.bytes / static_cast<int64_t>(DTypeSize(type)), device));
      std::lock_guard<std::mutex> lock(st.mu);
      st.buf = std::move(buf);
      return absl::OkStatus();
    }
    FSDP_ASSIGN_OR_RETURN(pjrt::DeviceBuffer in, client->FromHost(src, v.dtype, v.count, device));
    return RunNow("write", [&](pjrt::Program* p) {
             p->Store(v, p->Input({v.count}, v.dtype));
           }, {in.get()}).status();
  }
  // Runs held-back ops on their queue's thread. After a failure on the stream, later ops do
  // not run.
  void RunOnQueue(Queue& q, const std::vector<pjrt::OpBuilder>& ops) {
    absl::Status st = RunOps(ops, q);
    if (st.ok()) return;
    std::string what;
    if (ops.size() == 1) {
      what = absl::StrCat("op ", ops[0].name);
    } else {
      std::vector<std::string> names;
      for (const pjrt::OpBuilder& op : ops) {
        if (names.size() == 12) {
          names.push_back("...");
          break;
        }
        names.push_back(op.name);
      }
      what = absl::StrCat("a program of ", ops.size(), " ops (", absl::StrJoin(names, ", "), ")");
    }
    q.SetFailure(absl::Status(st.code(), absl::StrCat("pjrt backend: ", what, ": ", st.message())));
  }

  // What has been launched (launch_stats).
  mutable std::atomic<int64_t> programs{0}, op_programs{0}, op_count{0};
};

namespace {

absl::Status CheckView(const PjrtBackend* backend, const View& v, const char* what) {
  if (v.count == 0) return absl::OkStatus();
  if (v.backend != backend || v.allocation.storage == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("pjrt backend: the ", what, " view is not memory of this backend"));
  }
  if (v.count < 0 || v.offset < 0 ||
      v.offset + v.bytes() > static_cast<int64_t>(v.allocation.bytes)) {
    return absl::InvalidArgumentError(
        absl::StrCat("pjrt backend: the ", what, " view (offset ", v.offset, ", ", v.bytes(),
                     " bytes) does not fit in its allocation of ", v.allocation.bytes, " bytes"));
  }
  return absl::OkStatus();
}

// Ranks as threads of one process, one device each of a shared client. A call is an item on
// the communication stream: it waits for the stream the input came from, agrees with the
// other ranks on the call over the host transport (within the deadline), then launches the
// collective program on this rank's device with the call's launch id.
// Runs `body` as an item of the communication stream, in order with the other collectives; an
// error (prefixed with `what`) fails the stream and the returned event.
Event OnCommStream(PjrtBackend::Impl* impl, std::string what,
                   std::function<absl::Status()> body) {
  auto done = std::make_shared<HostEvent>();
  Queue* q = &impl->stream(Stream::kComm);
  q->Submit([done, q, what = std::move(what), body = std::move(body)] {
    absl::Status s = body();
    if (!s.ok()) {
      s = absl::Status(s.code(), absl::StrCat(what, s.message()));
      q->SetFailure(s);
    }
    done->Complete(s);
  });
  return Event(done);
}

class PjrtDataPlane final : public DataPlane {
 public:
  PjrtDataPlane(PjrtBackend* backend, PjrtBackend::Impl* impl, std::unique_ptr<Communicator> comm,
                std::vector<int64_t> device_ids, int64_t launch_base)
      : DataPlane(backend, "pjrt"),
        backend_(backend),
        impl_(impl),
        comm_(std::move(comm)),
        device_ids_(std::move(device_ids)),
        launch_base_(launch_base) {}
  // Calls still queued on the communication stream use this object.
  ~PjrtDataPlane() override { backend_->Record(Stream::kComm).Wait().IgnoreError(); }
  int rank() const override { return comm_->rank(); }
  int size() const override { return comm_->size(); }
  const std::string& name() const override { return comm_->name(); }

  void Abort(const absl::Status& reason) override { comm_->Abort(reason); }

 private:
  absl::StatusOr<Event> EnqueueAllGather(View send, View recv, Stream after) override {
    return Issue(CollectiveKind::kAllGather, ReduceOp::kSum, send, recv, after);
  }
  absl::StatusOr<Event> EnqueueReduceScatter(View send, View recv, ReduceOp op,
                                             Stream after) override {
    return Issue(CollectiveKind::kReduceScatter, op, send, recv, after);
  }
  absl::StatusOr<Event> EnqueueAllReduce(View send, View recv, ReduceOp op,
                                         Stream after) override {
    return Issue(CollectiveKind::kAllReduce, op, send, recv, after);
  }
  absl::StatusOr<Event> EnqueueAllToAll(View send, View recv, Stream after) override {
    return Issue(CollectiveKind::kAllToAll, ReduceOp::kSum, send, recv, after);
  }

  // The other ranks make the same call: all pass (kind, count, dtype, op, ok) and compare.
  absl::Status Agree(CollectiveKind kind, const View& send, ReduceOp op,
                     const absl::Status& ready) {
    const int n = size();
    int64_t mine[5] = {static_cast<int64_t>(kind), send.count, static_cast<int64_t>(send.dtype),
                       static_cast<int64_t>(op), ready.ok() ? 1 : 0};
    std::vector<int64_t> all(5 * static_cast<size_t>(n));
    FSDP_RETURN_IF_ERROR(comm_->AllGather(ConstBufferView{mine, 5, DType::kI64},
                                          BufferView{all.data(), 5 * n, DType::kI64}));
    FSDP_RETURN_IF_ERROR(ready);
    const int64_t seq = agreed_++;  // calls run one at a time, in order, on the comm stream
    bool same = true;
    for (int r = 0; r < n; ++r) {
      const int64_t* d = &all[5 * static_cast<size_t>(r)];
      if (d[4] == 0) {
        return absl::AbortedError(absl::StrCat("rank ", r, " failed before the collective"));
      }
      same = same && std::equal(d, d + 4, mine);
    }
    if (same) return absl::OkStatus();
    std::vector<std::string> calls;
    for (int r = 0; r < n; ++r) {
      const int64_t* d = &all[5 * static_cast<size_t>(r)];
      CollectiveCall c;
      c.kind = static_cast<CollectiveKind>(d[0]);
      c.count = d[1];
      c.dtype = static_cast<DType>(d[2]);
      c.op = static_cast<ReduceOp>(d[3]);
      calls.push_back(DescribeCall(c));
    }
    return Fail(ScheduleMismatch(seq, name(), calls, " (pjrt data plane)"));
  }

  // Fails the group: this call and the later ones fail on every rank.
  absl::Status Fail(absl::Status s) {
    comm_->Abort(s);
    return s;
  }

  // The collective as a program of `ranks` replicas: it reads send's elements from its
  // allocation's array and writes the result into recv's (typed slices, pjrt::Program), in one
  // launch. Moves (all_gather, all_to_all) keep the dtype; reductions take f32, bf16 and f16,
  // accumulate in f32 and round once; avg divides the f32 sum by the ranks.
  void Build(pjrt::Program* p, CollectiveKind kind, ReduceOp op, const View& send,
             const View& recv) const {
    const int n = size();
    p->BeginOp("collective");
    switch (kind) {
      case CollectiveKind::kAllGather:
      case CollectiveKind::kAllToAll: {
        const pjrt::Value x = p->Load(send, {send.count}, pjrt::ElementTypeOf(send.dtype));
        p->Store(recv, kind == CollectiveKind::kAllGather ? p->AllGather(x, n) : p->AllToAll(x, n));
        break;
      }
      default: {
        const pjrt::Value x = p->Load(send, {send.count}, "f32");
        const char* fn = op == ReduceOp::kMax ? "maximum" : "add";
        pjrt::Value z = kind == CollectiveKind::kReduceScatter ? p->ReduceScatter(x, n, fn)
                                                               : p->AllReduce(x, n, fn);
        if (op == ReduceOp::kAvg) z = p->Div(z, p->Constant(n, "f32", z.dims));
        p->Store(recv, z);
        break;
      }
    }
  }

  // One launch, found in the cache by the program's structure (and the devices), not its text.
  absl::Status Run(CollectiveKind kind, ReduceOp op, const View& send, const View& recv,
                   int launch_id) {
    pjrt::Program p("collective", /*dry=*/true, impl_->element_types());
    FSDP_ASSIGN_OR_RETURN(
        const pjrt::Executable* exe,
        impl_->Compile(&p, [&](pjrt::Program* q) { Build(q, kind, op, send, recv); },
                       device_ids_));
    return impl_->Launch(p, *exe, {}, nullptr, launch_id).status();
  }

  absl::StatusOr<Event> Issue(CollectiveKind kind, ReduceOp op, View send, View recv,
                              Stream after) {
    if (send.count == 0 && recv.count == 0) return Event();
    const Event ready = backend_->Record(after);
    // All ranks issue the same calls in the same order: the sequence number names the call.
    const int launch_id = static_cast<int>(1 + (launch_base_ + seq_++) % 0x7ffffff0);
    CollectiveCall call;  // for the error messages
    call.kind = kind;
    call.count = kind == CollectiveKind::kAllGather  ? send.count
                 : kind == CollectiveKind::kAllToAll ? send.count / size()
                                                     : recv.count;
    call.dtype = send.dtype;
    call.op = op;
    std::string what = absl::StrCat("pjrt data plane '", name(), "' ", DescribeCall(call), ": ");
    return OnCommStream(impl_, std::move(what),
                        [this, kind, op, send, recv, ready, launch_id] {
                          absl::Status s = Agree(kind, send, op, ready.Wait());
                          if (s.ok()) s = Run(kind, op, send, recv, launch_id);
                          return s;
                        });
  }

  PjrtBackend* backend_;
  PjrtBackend::Impl* impl_;
  std::unique_ptr<Communicator> comm_;
  const std::vector<int64_t> device_ids_;  // global device id of each rank
  const int64_t launch_base_;
  int64_t agreed_ = 0;  // calls agreed on so far: the sequence number of the next
  int64_t seq_ = 0;
};

// The host-staged bridge, for groups whose ranks are in several processes (the plugin's client
// spans one process: the XLA CPU plugin has no cross-process collectives). A call is an item
// on the communication stream, as on the plugin path: it waits for the stream the input came
// from, copies the send view to host memory, runs the collective on the group's host
// communicator (a duplicate of the group's: Open MPI across processes, shared memory inside
// one) and copies the result into the recv view. Compute keeps running meanwhile; the
// communicator checks that the ranks make the same calls and enforces the deadline.
class PjrtBridgeDataPlane final : public DataPlane {
 public:
  PjrtBridgeDataPlane(PjrtBackend* backend, PjrtBackend::Impl* impl,
                      std::unique_ptr<Communicator> comm, std::string name)
      : DataPlane(backend, "pjrt bridge"),
        backend_(backend),
        impl_(impl),
        comm_(std::move(comm)),
        name_(std::move(name)) {}
  ~PjrtBridgeDataPlane() override { backend_->Record(Stream::kComm).Wait().IgnoreError(); }
  int rank() const override { return comm_->rank(); }
  int size() const override { return comm_->size(); }
  const std::string& name() const override { return name_; }
  void Abort(const absl::Status& reason) override { comm_->Abort(reason); }

 private:
  absl::StatusOr<Event> EnqueueAllGather(View send, View recv, Stream after) override {
    return Issue(CollectiveKind::kAllGather, ReduceOp::kSum, send, recv, after);
  }
  absl::StatusOr<Event> EnqueueReduceScatter(View send, View recv, ReduceOp op,
                                             Stream after) override {
    return Issue(CollectiveKind::kReduceScatter, op, send, recv, after);
  }
  absl::StatusOr<Event> EnqueueAllReduce(View send, View recv, ReduceOp op,
                                         Stream after) override {
    return Issue(CollectiveKind::kAllReduce, op, send, recv, after);
  }
  absl::StatusOr<Event> EnqueueAllToAll(View send, View recv, Stream after) override {
    return Issue(CollectiveKind::kAllToAll, ReduceOp::kSum, send, recv, after);
  }

  absl::Status Run(CollectiveKind kind, ReduceOp op, const View& send, const View& recv) {
    std::vector<uint8_t> in(static_cast<size_t>(send.bytes())), out(static_cast<size_t>(recv.bytes()));
    FSDP_RETURN_IF_ERROR(impl_->ReadToHost(send, in.data()));
    const ConstBufferView s{in.data(), send.count, send.dtype};
    const BufferView r{out.data(), recv.count, recv.dtype};
    switch (kind) {
      case CollectiveKind::kAllGather: FSDP_RETURN_IF_ERROR(comm_->AllGather(s, r)); break;
      case CollectiveKind::kReduceScatter: FSDP_RETURN_IF_ERROR(comm_->ReduceScatter(s, r, op)); break;
      case CollectiveKind::kAllReduce: FSDP_RETURN_IF_ERROR(comm_->AllReduce(s, r, op)); break;
      case CollectiveKind::kAllToAll: FSDP_RETURN_IF_ERROR(comm_->AllToAll(s, r)); break;
      default: return absl::InternalError("pjrt bridge: not a data collective");
    }
    return impl_->WriteFromHost(recv, out.data());
  }

  absl::StatusOr<Event> Issue(CollectiveKind kind, ReduceOp op, View send, View recv,
                              Stream after) {
    if (send.count == 0 && recv.count == 0) return Event();
    const Event ready = backend_->Record(after);
    return OnCommStream(impl_, absl::StrCat("pjrt data plane '", name_, "' (bridge): "),
                        [this, kind, op, send, recv, ready] {
                          absl::Status s = ready.Wait();
                          if (!s.ok()) {
                            comm_->Abort(absl::AbortedError(
                                absl::StrCat("rank ", rank(), " of group '", name_,
                                             "' failed before a collective: ", s.message())));
                            return s;
                          }
                          return Run(kind, op, send, recv);
                        });
  }

  PjrtBackend* backend_;
  PjrtBackend::Impl* impl_;
  std::unique_ptr<Communicator> comm_;
  const std::string name_;
};

// What the ranks of a group share: the host transport of their agreement, and the launch ids
// of their collective programs.
struct SharedPlane {
  std::unique_ptr<LocalWorld> world;
  int64_t launch_base = 0;
};
struct TakenPlane {
  std::unique_ptr<Communicator> comm;
  int64_t launch_base = 0;
};

}  // namespace

absl::StatusOr<std::unique_ptr<PjrtBackend>> PjrtBackend::Create(
    std::shared_ptr<pjrt::Client> client, int device, PjrtBackendOptions options) {
  if (client == nullptr) return absl::InvalidArgumentError("PjrtBackend: no client");
  if (device < 0 || device >= client->num_devices()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "PjrtBackend: device ", device, " does not exist: the client has ", client->num_devices(),
        " device(s) (for the XLA CPU plugin, set the create option cpu_device_count)"));
  }
  if (options.memory_limit_bytes < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "PjrtBackend: memory_limit_bytes must be >= 0 (0 = no limit), got ",
        options.memory_limit_bytes));
  }
  auto impl = std::make_unique<Impl>();
  impl->client = std::move(client);
  impl->device = device;
  impl->options = std::move(options);
  impl->memory.set_limit(impl->options.memory_limit_bytes);
  if (impl->client->platform_name() == "cpu") {
    impl->overrides = {{"xla_cpu_copy_insertion_use_region_analysis", true}};
  }
  impl->overrides.insert(impl->overrides.end(), impl->options.xla_options.begin(),
                         impl->options.xla_options.end());
  for (const auto& [name, value] : impl->overrides) {
    absl::StrAppend(&impl->overrides_key, "|", name, "=", value ? 1 : 0);
  }
  Impl* m = impl.get();
  const int max_ops = impl->options.fuse_ops ? impl->options.max_fused_ops : 1;
  if (max_ops < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "PjrtBackend: max_fused_ops must be >= 1, got ", impl->options.max_fused_ops));
  }
  auto run = [m](Queue& q, const std::vector<pjrt::OpBuilder>& ops) { m->RunOnQueue(q, ops); };
  impl->compute = std::make_unique<Queue>(run, max_ops);
  impl->comm = std::make_unique<Queue>(run, max_ops);
  // Every call's views checked first (backends/common/checked_ops.h): a bad one fails the
  // stream in order (the ops held before it run) and no program is built for it.
  impl->ops = std::make_unique<backend_kit::CheckedOps>(
      pjrt::MakeOps([m](Stream s, pjrt::OpBuilder op) { m->stream(s).AddOp(std::move(op)); }),
      [m](Stream s, const char* op, const absl::Status& why) {
        Queue* q = &m->stream(s);
        const absl::Status failure(why.code(),
                                   absl::StrCat("pjrt op ", op, ": ", why.message()));
        q->Submit([q, failure] { q->SetFailure(failure); });
      });
  return std::unique_ptr<PjrtBackend>(new PjrtBackend(std::move(impl)));
}

PjrtBackend::PjrtBackend(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {
  impl_->backend = this;
}

std::string PjrtBackend::description() const {
  std::string d = absl::StrCat("pjrt backend, ", impl_->client->platform_name(), " device ",
                               impl_->device, " of ", impl_->client->num_devices());
  const auto paths = data_paths();
  if (!paths.empty()) {
    std::vector<std::string> each;
    for (const auto& [group, path] : paths) each.push_back(absl::StrCat(group, " ", path));
    absl::StrAppend(&d, "; data planes: ", absl::StrJoin(each, ", "));
  }
  return d;
}

PjrtBackend::~PjrtBackend() {
  impl_->compute.reset();  // drain, then stop
  impl_->comm.reset();
  impl_->Reap(/*wait_all=*/true);
}

pjrt::Client& PjrtBackend::client() const { return *impl_->client; }
int PjrtBackend::device() const { return impl_->device; }

absl::StatusOr<Allocation> PjrtBackend::Allocate(size_t bytes) {
  if (bytes == 0) return Allocation{};
  impl_->Reap(/*wait_all=*/false);
  const auto n = static_cast<int64_t>(bytes);
  FSDP_ASSIGN_OR_RETURN(const int64_t now, impl_->memory.Reserve(n));
  // The array is made at the first use, typed by the first view that reaches it.
  auto* storage = new Storage();
  storage->bytes = n;
  impl_->memory.Commit(now);
  return Allocation{storage, storage, bytes};
}

void PjrtBackend::Free(const Allocation& a) {
  if (a.storage == nullptr) return;
  impl_->memory.Release(static_cast<int64_t>(a.bytes));
  Storage* storage = static_cast<Storage*>(a.storage);
  impl_->deferred.Add(impl_->compute->Mark(), impl_->comm->Mark(), [storage] { delete storage; });
  impl_->Reap(/*wait_all=*/false);
}

MemoryStats PjrtBackend::memory_stats() const {
  return impl_->memory.stats();
}

void PjrtBackend::ResetPeak() { impl_->memory.ResetPeak(); }

absl::Status PjrtBackend::DoCopyToHost(void* dst, View src, Stream s) {
  FSDP_RETURN_IF_ERROR(CheckView(this, src, "source"));
  Queue* q = &impl_->stream(s);
  auto done = std::make_shared<HostEvent>();
  Impl* m = impl_.get();
  q->Submit([m, q, dst, src, done] {
    q->Drain();
    absl::Status st = q->failure();
    if (st.ok()) st = m->ReadToHost(src, dst);
    done->Complete(st);
  });
  return done->Wait();
}

absl::Status PjrtBackend::CopyFromHost(View dst, const void* src, Stream s) {
  FSDP_RETURN_IF_ERROR(CheckView(this, dst, "destination"));
  if (dst.count == 0) return absl::OkStatus();
  // The host's bytes are taken now (the caller may reuse them), written in stream order.
  auto staged = std::make_shared<std::string>(static_cast<const char*>(src),
                                              static_cast<size_t>(dst.bytes()));
  Impl* m = impl_.get();
  Queue* q = &m->stream(s);
  q->Submit([m, q, dst, staged] {
    absl::Status st = m->WriteFromHost(dst, staged->data());
    if (!st.ok()) q->SetFailure(st);
  });
  return absl::OkStatus();
}

absl::Status PjrtBackend::Copy(View dst, View src, Stream s) {
  FSDP_RETURN_IF_ERROR(CheckView(this, dst, "destination"));
  FSDP_RETURN_IF_ERROR(CheckView(this, src, "source"));
  if (dst.bytes() != src.bytes()) {
    return absl::InvalidArgumentError(
        absl::StrCat("PjrtBackend::Copy: ", src.bytes(), " bytes into ", dst.bytes()));
  }
  if (dst.count == 0) return absl::OkStatus();
  // An op: it joins the program of the ops around it. Elements of one dtype are copied as
  // such (typed slices of typed arrays); views of two dtypes as bytes.
  const bool typed = dst.dtype == src.dtype;
  const View to = typed ? dst : dst.As(DType::kU8), from = typed ? src : src.As(DType::kU8);
  const std::string raw = pjrt::ElementTypeOf(to.dtype);
  impl_->stream(s).AddOp({"copy", [to, from, raw](pjrt::Program* p) {
                            p->Store(to, p->Load(from, {from.count}, raw));
                          }});
  return absl::OkStatus();
}

absl::Status PjrtBackend::Memset(View dst, int byte, Stream s) {
  FSDP_RETURN_IF_ERROR(CheckView(this, dst, "destination"));
  if (dst.count == 0) return absl::OkStatus();
  // Zeros in the view's own dtype (they are zero bytes in every dtype); other bytes as bytes.
  const auto value = static_cast<uint8_t>(byte);
  const View to = value == 0 ? dst : dst.As(DType::kU8);
  const std::string type = pjrt::ElementTypeOf(to.dtype);
  impl_->stream(s).AddOp({"memset", [to, value, type](pjrt::Program* p) {
                            p->Store(to, p->Constant(value, type, {to.count}));
                          }});
  return absl::OkStatus();
}

Event PjrtBackend::Record(Stream s) {
  auto e = std::make_shared<HostEvent>();
  Queue* q = &impl_->stream(s);
  q->Submit([e, q] {
    q->Drain();
    e->Complete(q->failure());
  });
  return Event(e);
}

absl::Status PjrtBackend::Wait(Stream s, const Event& e) {
  if (!e.valid()) return absl::OkStatus();
  if (e.Done()) FSDP_RETURN_IF_ERROR(e.Wait());
  // Submitted even when done: the held ops' program ends here whatever the timing.
  Queue* q = &impl_->stream(s);
  q->Submit([e, q] {
    absl::Status st = e.Wait();
    if (!st.ok()) q->SetFailure(st);
  });
  return absl::OkStatus();
}

RuntimeOps& PjrtBackend::runtime_ops() { return *impl_->ops; }
Ops* PjrtBackend::model_ops() { return impl_->ops.get(); }

absl::StatusOr<std::unique_ptr<DataPlane>> PjrtBackend::CreateDataPlane(Communicator& group) {
  // The ranks must be threads of this process on distinct devices of the same client.
  const auto client_key = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(impl_->client.get()));
  FSDP_ASSIGN_OR_RETURN(
      std::vector<uint64_t> all,
      internal::AllGatherU64(group,
                             {impl_->id, static_cast<uint64_t>(getpid()), client_key,
                              static_cast<uint64_t>(impl_->client->device_id(impl_->device))}));
  std::vector<uint64_t> ids;
  std::vector<int64_t> devices;
  // The choice, the same on every rank (all see the same table): the plugin's collectives when
  // the ranks share this process's client, else the host-staged bridge.
  bool one_client = true;
  for (int r = 0; r < group.size(); ++r) {
    const uint64_t* d = &all[4 * static_cast<size_t>(r)];
    one_client = one_client && d[1] == all[1] && d[2] == all[2];
  }
  if (!one_client) {
    const CrossProcess mode = impl_->options.cross_process;
    if (mode == CrossProcess::kPlugin &&
        impl_->client->global_device_count() > impl_->client->num_devices()) {
      return absl::UnimplementedError(absl::StrCat(
          "pjrt data plane of group '", group.name(), "': cross_process = plugin: this client "
          "spans processes (", impl_->client->global_device_count(), " devices, ",
          impl_->client->num_devices(), " of them here), but running the plugin's collectives "
          "over a multi-process client is not implemented yet; set cross_process to auto or "
          "bridge"));
    }
    if (mode == CrossProcess::kPlugin) {
      return absl::FailedPreconditionError(absl::StrCat(
          "pjrt data plane of group '", group.name(), "': its ranks are in several processes, "
          "and cross_process = plugin, but this process's PJRT client (platform ",
          impl_->client->platform_name(), ", ", impl_->client->num_devices(),
          " addressable devices) spans this process only: a plugin runs collectives across "
          "processes only on a client created with node_id / num_nodes and a key-value store "
          "(docs/pjrt.md); the XLA CPU plugin cannot at all. Set cross_process to auto or "
          "bridge to move such groups through host memory"));
    }
    FSDP_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> dup,
                          group.Split(0, group.rank(), "pjrt_bridge"));
    impl_->NotePath(group.name(), "bridge");
    return std::unique_ptr<DataPlane>(
        new PjrtBridgeDataPlane(this, impl_.get(), std::move(dup), group.name()));
  }
  for (int r = 0; r < group.size(); ++r) {
    const uint64_t* d = &all[4 * static_cast<size_t>(r)];
    if (d[1] != static_cast<uint64_t>(getpid()) || d[2] != client_key) {
      return absl::FailedPreconditionError(absl::StrCat(
          "pjrt data plane of group '", group.name(), "': rank ", r,
          " uses another PJRT client of this process; the ranks of a process must share one "
          "client (one per process)"));
    }
    const auto dev = static_cast<int64_t>(d[3]);
    if (std::find(devices.begin(), devices.end(), dev) != devices.end()) {
      return absl::FailedPreconditionError(absl::StrCat("pjrt data plane of group '", group.name(),
                                                        "': ranks share device ", dev,
                                                        "; give each rank its own device"));
    }
    devices.push_back(dev);
    ids.push_back(d[0]);
  }
  const std::string key = absl::StrCat("pjrt|", group.name(), "|", absl::StrJoin(ids, ","));
  const int rank = group.rank();
  FSDP_ASSIGN_OR_RETURN(
      TakenPlane taken,
      backend_kit::Rendezvous<SharedPlane>::Join<TakenPlane>(
          key, group.size(),
          [&]() -> absl::StatusOr<std::unique_ptr<SharedPlane>> {
            auto shared = std::make_unique<SharedPlane>();
            FSDP_ASSIGN_OR_RETURN(shared->world, LocalWorld::Create(group.size(),
                                                                    impl_->options.data_plane,
                                                                    group.name()));
            shared->launch_base = g_next_launch_base.fetch_add(int64_t{1} << 20);
            return shared;
          },
          [rank](const std::shared_ptr<SharedPlane>& p) -> absl::StatusOr<TakenPlane> {
            FSDP_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> comm, p->world->TakeRank(rank));
            return TakenPlane{std::move(comm), p->launch_base};
          }));
  impl_->NotePath(group.name(), "plugin");
  return std::unique_ptr<DataPlane>(new PjrtDataPlane(this, impl_.get(), std::move(taken.comm),
                                                      std::move(devices), taken.launch_base));
}

}  // namespace fsdp

namespace fsdp {

PjrtLaunchStats PjrtBackend::launch_stats() const {
  PjrtLaunchStats s;
  s.programs = impl_->programs.load();
  s.op_programs = impl_->op_programs.load();
  s.ops = impl_->op_count.load();
  std::lock_guard<std::mutex> lock(impl_->stats_mu);
  s.byte_programs = impl_->byte_programs;
  s.program_time = impl_->program_time;
  s.temp_bytes = impl_->temp_bytes;
  return s;
}

std::vector<std::pair<std::string, std::string>> PjrtBackend::data_paths() const {
  std::lock_guard<std::mutex> lock(impl_->paths_mu);
  return impl_->paths;
}

}  // namespace fsdp
