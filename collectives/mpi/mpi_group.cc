// The state machine of each group's calls in the mpi communicator (MpiGroup, mpi_engine.h):
// fingerprint exchange -> data collective -> completion, with deadlines, diagnostics and
// failure. The engine thread that polls the groups is in mpi_engine.cc.
#include "collectives/mpi/mpi_engine.h"

#include <algorithm>
#include <climits>
#include <cstring>
#include <random>
#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "collectives/comm_trace.h"
#include "collectives/reduce.h"
#include "fsdp/trace.h"

namespace fsdp::internal {
namespace {

constexpr int kDiagTag = 4242;
enum DiagType : int64_t { kQuery = 1, kReply = 2, kAbort = 3 };

// Data collectives at least this large are polled without sleeping while in flight: Open MPI
// moves large messages in fragments, each of which needs a progress call.
constexpr size_t kBusyBytes = 64 << 10;
constexpr auto kSpinAfterStart = std::chrono::milliseconds(1);
// A call whose peers have not all arrived after this long is polled less often, so that a
// rank waiting for slow peers leaves the CPU to them.
constexpr auto kStallAfter = std::chrono::milliseconds(10);

MPI_Datatype ElementType(DType t) {
  switch (t) {
    case DType::kF32: return MPI_FLOAT;
    case DType::kBF16:
    case DType::kF16: return MPI_UINT16_T;
    case DType::kF64: return MPI_DOUBLE;
    case DType::kI32: return MPI_INT32_T;
    case DType::kI64: return MPI_INT64_T;
    case DType::kU8: return MPI_UINT8_T;
  }
  return MPI_BYTE;
}

CollectiveCall CallOf(const FpRecord& r) {
  return {.kind = static_cast<CollectiveKind>(r.kind), .count = r.count,
          .dtype = static_cast<DType>(r.dtype), .op = static_cast<ReduceOp>(r.op),
          .root = static_cast<int>(r.root)};
}

// Records `op` on the timeline as it ends: from the start of its fingerprint exchange (which
// waits for every rank to arrive) to now.
void TraceOp(const MpiOp& op, const std::string& group, int size, const absl::Status& status) {
  Tracer& tracer = Tracer::Global();
  if (!tracer.enabled()) return;
  const Clock::time_point now = Clock::now();
  const Clock::time_point arrived = op.data_start > op.issued ? op.data_start : now;
  const int64_t waited =
      std::chrono::duration_cast<std::chrono::nanoseconds>(arrived - op.issued).count();
  RecordCollectiveSpan(op.call, group, size, op.seq, tracer.ToTraceNs(op.issued),
                       tracer.ToTraceNs(now), waited, status);
}


bool ShmKind(CollectiveKind k) {
  return k == CollectiveKind::kAllGather || k == CollectiveKind::kReduceScatter ||
         k == CollectiveKind::kAllReduce || k == CollectiveKind::kBroadcast ||
         k == CollectiveKind::kAllToAll;
}

absl::Duration DiagnosisGrace(absl::Duration timeout) {
  return std::clamp(timeout / 4, absl::Milliseconds(50), absl::Seconds(1));
}

}  // namespace

bool TestOrphan(MpiOp& op) {
  int a = 1, b = 1;
  if (op.fp_req != MPI_REQUEST_NULL) MPI_Test(&op.fp_req, &a, MPI_STATUS_IGNORE);
  if (op.data_req != MPI_REQUEST_NULL) MPI_Test(&op.data_req, &b, MPI_STATUS_IGNORE);
  return a && b;
}

uint64_t NewToken() {
  static std::atomic<uint64_t> counter{0};
  std::random_device rd;
  const uint64_t t = static_cast<uint64_t>(Clock::now().time_since_epoch().count());
  return (static_cast<uint64_t>(rd()) << 32 ^ rd()) ^ (t * 0x9E3779B97F4A7C15ULL) ^
         (static_cast<uint64_t>(getpid()) << 40) ^ counter.fetch_add(1);
}

std::string MpiErrorString(int code) {
  char buf[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, buf, &len) != MPI_SUCCESS) return absl::StrFormat("MPI error %d", code);
  return std::string(buf, len);
}

// ------------------------------------------------------------------------------ MpiGroup

MpiGroup::MpiGroup(std::string name, CommOptions options, MPI_Comm data, MPI_Comm ctrl,
                   MPI_Comm diag, uint64_t epoch)
    : name_(std::move(name)),
      options_(options),
      data_(data),
      ctrl_(ctrl),
      diag_(diag),
      token_(NewToken()),
      epoch_(epoch) {
  MPI_Comm_rank(data_, &rank_);
  MPI_Comm_size(data_, &size_);
  for (MPI_Comm c : {data_, ctrl_, diag_}) MPI_Comm_set_errhandler(c, MPI_ERRORS_RETURN);
}

absl::Status MpiGroup::health() const {
  std::lock_guard<std::mutex> lock(mu_);
  return Detach(failure_);
}

void MpiGroup::Open() {
  MPI_Irecv(&diag_in_, sizeof(DiagMsg), MPI_BYTE, MPI_ANY_SOURCE, kDiagTag, diag_, &diag_recv_);
}

std::string MpiGroup::Header(const CollectiveCall& call, int64_t seq) const {
  return absl::StrFormat("%s at sequence %d of group '%s' (mpi, %d ranks)", DescribeCall(call), seq,
                         name_, size_);
}

absl::Status MpiGroup::NotRun(const MpiOp& op) const {
  return absl::Status(failure_.code(),
                      absl::StrFormat("%s at sequence %d of group '%s' was not run: the group "
                                      "had failed: %s",
                                      DescribeCall(op.call), op.seq, name_, failure_.message()));
}

void MpiGroup::Add(std::shared_ptr<MpiOp> op) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!failure_.ok()) {
      op->work->Complete(NotRun(*op));
      return;
    }
  }
  FpRecord& m = op->mine;
  m.seq = op->seq;
  m.kind = static_cast<int64_t>(op->call.kind);
  m.dtype = static_cast<int64_t>(op->call.dtype);
  m.count = op->call.count;
  m.op = static_cast<int64_t>(op->call.op);
  m.root = op->call.root;
  m.color = op->color;
  m.key = op->key;
  m.label_hash = std::hash<std::string>{}(op->label);
  m.host_id = ThisHostId();
  m.token = token_;
  m.shm_ok = options_.mpi_shared_memory ? 1 : 0;
  m.invalid = op->invalid.ok() ? 0 : 1;
  std::snprintf(m.reason, sizeof(m.reason), "%s", std::string(op->invalid.message()).c_str());
  op->all.resize(size_);
  const int rc = MPI_Iallgather(&op->mine, sizeof(FpRecord), MPI_BYTE, op->all.data(),
                                sizeof(FpRecord), MPI_BYTE, ctrl_, &op->fp_req);
  op->issued = Clock::now();
  op->deadline = op->issued + absl::ToChronoNanoseconds(options_.timeout);
  ops_.push_back(op);
  if (rc != MPI_SUCCESS) {
    Fail(absl::InternalError(absl::StrFormat("%s: MPI_Iallgather of the fingerprint failed: %s",
                                             Header(op->call, op->seq), MpiErrorString(rc))),
         op->seq, true);
  }
}

void MpiGroup::Verify(MpiOp& op) {
  std::vector<std::string> invalid;
  for (int q = 0; q < size_; ++q) {
    if (!op.all[q].invalid) continue;
    invalid.push_back(q == rank_ ? std::string(op.invalid.message()) : std::string(op.all[q].reason));
  }
  if (!invalid.empty()) {  // every rank learns of it; the schedule is intact, the group lives
    absl::Status status = absl::InvalidArgumentError(absl::StrFormat(
        "invalid arguments at sequence %d of group '%s': %s", op.seq, name_,
        absl::StrJoin(invalid, "; ")));
    TraceOp(op, name_, size_, status);
    op.work->Complete(std::move(status));
    op.stage = MpiOp::Stage::kDone;
    return;
  }
  const FpRecord& a = op.all[0];
  bool same = true;
  for (const FpRecord& b : op.all) {
    same = same && a.seq == b.seq && a.kind == b.kind && a.dtype == b.dtype && a.count == b.count &&
           a.op == b.op && a.root == b.root && a.label_hash == b.label_hash;
  }
  if (same) {
    if (transport_ == Transport::kUndecided) DecideTransport(op);
    op.stage = MpiOp::Stage::kReady;
    return;
  }
  std::vector<std::string> calls;
  for (int q = 0; q < size_; ++q) {
    std::string d = DescribeCall(CallOf(op.all[q]));
    if (op.all[q].seq != op.seq) d += absl::StrFormat(" as its sequence %d", op.all[q].seq);
    calls.push_back(std::move(d));
  }
  // Every rank sees the same fingerprints, so every rank fails the group on its own.
  Fail(ScheduleMismatch(op.seq, name_, calls), op.seq, false);
}

void MpiGroup::DecideTransport(const MpiOp& op) {
  // Every rank sees the same records, so every rank decides the same.
  bool shm = size_ > 1;
  for (const FpRecord& r : op.all) {
    shm = shm && r.shm_ok && r.host_id == op.all[0].host_id;
  }
  transport_ = shm ? Transport::kShm : Transport::kMpi;
  if (shm) {
    shm_ = std::make_unique<ShmChannel>(absl::StrFormat("/fsdp-%016x", op.all[0].token), rank_,
                                        size_);
  }
}

void MpiGroup::StartData(MpiOp& op, MpiEngine& engine) {
  const CollectiveCall& c = op.call;
  if (transport_ == Transport::kShm && ShmKind(c.kind)) {
    op.data_start = Clock::now();
    op.deadline = op.data_start + absl::ToChronoNanoseconds(options_.timeout);
    op.stage = MpiOp::Stage::kData;
    op.use_shm = true;
    op.xfer = ShmTransfer{.call = c};
    return;
  }
  const int n = size_;
  const size_t e = DTypeSize(c.dtype);
  const int count = static_cast<int>(c.count);  // checked <= INT_MAX when submitted
  const bool wide = c.dtype != DType::kF32 &&
                    (c.kind == CollectiveKind::kReduceScatter || c.kind == CollectiveKind::kAllReduce);
  const MPI_Op mop = c.op == ReduceOp::kMax ? MPI_MAX : MPI_SUM;
  op.data_start = Clock::now();
  op.deadline = op.data_start + absl::ToChronoNanoseconds(options_.timeout);
  op.stage = MpiOp::Stage::kData;
  int rc = MPI_SUCCESS;
  switch (c.kind) {
    case CollectiveKind::kAllGather: {
      const void* in_place = static_cast<const char*>(c.recv) + rank_ * c.count * e;
      rc = MPI_Iallgather(c.send == in_place ? MPI_IN_PLACE : c.send, count, ElementType(c.dtype),
                          c.recv, count, ElementType(c.dtype), data_, &op.data_req);
      break;
    }
    case CollectiveKind::kReduceScatter: {
      if (wide) {  // f32 accumulation: widen, reduce in f32, narrow when done
        op.wide.resize(static_cast<size_t>(c.count) * (n + 1));
        coll::WidenToF32(c.dtype, c.send, op.wide.data(), c.count * n);
        rc = MPI_Ireduce_scatter_block(op.wide.data(), op.wide.data() + c.count * n, count,
                                       MPI_FLOAT, mop, data_, &op.data_req);
      } else {
        // In place, MPI would put the result at the start of the buffer: use scratch instead.
        const void* in_place = static_cast<const char*>(c.send) + rank_ * c.count * e;
        void* out = c.recv;
        if (c.recv == in_place) {
          op.scratch.resize(c.count * e);
          out = op.scratch.data();
        }
        rc = MPI_Ireduce_scatter_block(c.send, out, count, MPI_FLOAT, mop, data_, &op.data_req);
      }
      break;
    }
    case CollectiveKind::kAllReduce:
      if (wide) {
        op.wide.resize(c.count);
        coll::WidenToF32(c.dtype, c.send, op.wide.data(), c.count);
        rc = MPI_Iallreduce(MPI_IN_PLACE, op.wide.data(), count, MPI_FLOAT, mop, data_, &op.data_req);
      } else {
        rc = MPI_Iallreduce(c.send == c.recv ? MPI_IN_PLACE : c.send, c.recv, count, MPI_FLOAT, mop,
                            data_, &op.data_req);
      }
      break;
    case CollectiveKind::kBroadcast:
      rc = MPI_Ibcast(c.recv, count, ElementType(c.dtype), c.root, data_, &op.data_req);
      break;
    case CollectiveKind::kBarrier:
      rc = MPI_Ibarrier(data_, &op.data_req);
      break;
    case CollectiveKind::kAllToAll:
      rc = MPI_Ialltoall(c.send, count, ElementType(c.dtype), c.recv, count, ElementType(c.dtype),
                         data_, &op.data_req);
      break;
    case CollectiveKind::kSplit: {
      // Every rank has arrived (the fingerprints agreed), so these blocking calls return
      // promptly, unless the same processes are making another group's communicators at the
      // same time in another order (two groups of this process split from two threads, ranks
      // as threads of CreateMpiThreadsWorld): with MPI_THREAD_MULTIPLE they run on a thread of
      // their own, so that the engine goes on making the other group's.
      auto split = std::make_shared<PendingSplit>();
      auto make = [split, data = data_, color = op.color, key = op.key] {
        split->rc = MPI_Comm_split(data, color >= 0 ? color : MPI_UNDEFINED, key, &split->comm);
        if (split->rc == MPI_SUCCESS && split->comm != MPI_COMM_NULL) {
          split->rc = MPI_Comm_dup(split->comm, &split->ctrl);
          if (split->rc == MPI_SUCCESS) split->rc = MPI_Comm_dup(split->comm, &split->diag);
          const uint64_t mine = NewToken();
          if (split->rc == MPI_SUCCESS) {
            split->rc = MPI_Allreduce(&mine, &split->epoch, 1, MPI_UINT64_T, MPI_BXOR, split->comm);
          }
        }
        split->done.store(true, std::memory_order_release);
      };
      op.split = split;
      if (engine.thread_multiple()) {
        std::thread(std::move(make)).detach();
      } else {
        make();
      }
      FinishSplit(op, engine);
      break;
    }
  }
  if (rc != MPI_SUCCESS) {
    Fail(absl::InternalError(absl::StrFormat("%s: starting the MPI collective failed: %s",
                                             Header(c, op.seq), MpiErrorString(rc))),
         op.seq, true);
  }
}

void MpiGroup::FinishSplit(MpiOp& op, MpiEngine& engine) {
  PendingSplit& s = *op.split;
  if (!s.done.load(std::memory_order_acquire)) return;
  if (s.rc != MPI_SUCCESS) {
    Fail(absl::InternalError(absl::StrFormat("%s: making the new group's communicators failed: %s",
                                             Header(op.call, op.seq), MpiErrorString(s.rc))),
         op.seq, true);
    return;
  }
  auto payload = std::make_shared<MpiSplitPayload>();
  if (s.comm != MPI_COMM_NULL) {
    payload->group = std::make_shared<MpiGroup>(
        absl::StrFormat("%s/%s%d", name_, op.label.empty() ? "split" : op.label, op.color),
        options_, s.comm, s.ctrl, s.diag, s.epoch);
    engine.AddGroup(payload->group);
  }
  op.work->payload = payload;
  TraceOp(op, name_, size_, absl::OkStatus());
  op.work->Complete(absl::OkStatus());
  op.stage = MpiOp::Stage::kDone;
}

void MpiGroup::FinishData(MpiOp& op) {
  const CollectiveCall& c = op.call;
  const int divisor = c.op == ReduceOp::kAvg ? size_ : 1;
  switch (c.kind) {
    case CollectiveKind::kReduceScatter:
      if (!op.wide.empty()) {
        coll::NarrowFromF32(c.dtype, op.wide.data() + c.count * size_, c.recv, c.count, divisor);
      } else if (!op.scratch.empty()) {
        coll::NarrowFromF32(DType::kF32, reinterpret_cast<const float*>(op.scratch.data()), c.recv,
                            c.count, divisor);
      } else if (divisor != 1) {
        coll::NarrowFromF32(DType::kF32, static_cast<const float*>(c.recv), c.recv, c.count, divisor);
      }
      break;
    case CollectiveKind::kAllReduce:
      if (!op.wide.empty()) {
        coll::NarrowFromF32(c.dtype, op.wide.data(), c.recv, c.count, divisor);
      } else if (divisor != 1) {
        coll::NarrowFromF32(DType::kF32, static_cast<const float*>(c.recv), c.recv, c.count, divisor);
      }
      break;
    default:
      break;
  }
  op.wide = {};
  op.scratch = {};
  TraceOp(op, name_, size_, absl::OkStatus());
  op.work->Complete(absl::OkStatus());
  op.stage = MpiOp::Stage::kDone;
}

void MpiGroup::PollShm() {
  for (size_t i = 0; i < ops_.size() && failure_.ok(); ++i) {
    const std::shared_ptr<MpiOp> op = ops_[i];
    if (op->stage != MpiOp::Stage::kData || !op->use_shm) continue;
    absl::StatusOr<bool> attached = shm_->Attach();
    if (!attached.ok()) {
      Fail(absl::Status(attached.status().code(),
                        absl::StrCat(Header(op->call, op->seq), ": ", attached.status().message())),
           op->seq, true);
      return;
    }
    if (!*attached || !shm_->Advance(op->xfer)) return;  // later calls wait for this one
    TraceOp(*op, name_, size_, absl::OkStatus());
    op->work->Complete(absl::OkStatus());
    op->stage = MpiOp::Stage::kDone;
  }
}

MpiGroup::Activity MpiGroup::Poll(MpiEngine& engine) {
  // Fingerprints that have arrived.
  // (Each loop holds its op: failing the group clears ops_.)
  for (size_t i = 0; i < ops_.size() && failure_.ok(); ++i) {
    const std::shared_ptr<MpiOp> op = ops_[i];
    if (op->stage != MpiOp::Stage::kFingerprint) continue;
    int flag = 0;
    MPI_Test(&op->fp_req, &flag, MPI_STATUS_IGNORE);
    if (flag) Verify(*op);
  }
  // Data collectives start in sequence order, behind any call whose fingerprint is pending.
  // A split in flight holds back the later calls: its communicator creation and their
  // collectives use the same communicator, and must be issued in the same order everywhere.
  for (size_t i = 0; i < ops_.size() && failure_.ok(); ++i) {
    const std::shared_ptr<MpiOp> op = ops_[i];
    if (op->stage == MpiOp::Stage::kFingerprint) break;
    if (op->stage == MpiOp::Stage::kReady) StartData(*op, engine);
    if (op->stage == MpiOp::Stage::kData && op->split != nullptr) break;
  }
  PollShm();
  for (size_t i = 0; i < ops_.size() && failure_.ok(); ++i) {
    const std::shared_ptr<MpiOp> op = ops_[i];
    if (op->stage != MpiOp::Stage::kData || op->use_shm) continue;
    if (op->split != nullptr) {
      FinishSplit(*op, engine);
      continue;
    }
    int flag = 0;
    MPI_Test(&op->data_req, &flag, MPI_STATUS_IGNORE);
    if (flag) FinishData(*op);
  }
  // Diagnostics after the completions: a call that MPI has completed here is reported as
  // done even when a peer's abort came in meanwhile (the peer may have aborted right after
  // completing it).
  PollDiag();
  // Deadlines.
  const auto now = Clock::now();
  for (size_t i = 0; i < ops_.size() && failure_.ok(); ++i) {
    const std::shared_ptr<MpiOp> op = ops_[i];
    if (now < op->deadline) continue;
    if (op->stage == MpiOp::Stage::kFingerprint && !diagnosis_) {
      StartDiagnosis(*op, absl::StrFormat("rank %d waited %s", rank_,
                                          absl::FormatDuration(options_.timeout)));
    } else if (op->stage == MpiOp::Stage::kData && op->use_shm) {
      Fail(absl::DeadlineExceededError(absl::StrFormat(
               "%s: every rank arrived, but the transfer through shared memory did not complete "
               "within %s: %s",
               Header(op->call, op->seq), absl::FormatDuration(options_.timeout),
               shm_->DescribeWait(op->xfer))),
           op->seq, true);
    } else if (op->stage == MpiOp::Stage::kData) {
      Fail(absl::DeadlineExceededError(absl::StrFormat(
               "%s: every rank arrived, but the transfer did not complete within %s",
               Header(op->call, op->seq), absl::FormatDuration(options_.timeout))),
           op->seq, true);
    }
  }
  if (diagnosis_) ContinueDiagnosis();
  std::erase_if(ops_, [](const auto& op) { return op->stage == MpiOp::Stage::kDone; });
  std::erase_if(orphans_, [](const auto& op) { return TestOrphan(*op); });

  if (closing_ && ops_.empty() && !closed_) {
    CloseNow();
    if (on_closed_) on_closed_();
  }
  Activity act = Activity::kIdle;
  for (const auto& op : ops_) {
    act = std::max(act, op->stage == MpiOp::Stage::kFingerprint && now - op->issued > kStallAfter
                            ? Activity::kStalled
                            : Activity::kWaiting);
    if (op->stage == MpiOp::Stage::kData &&
        (static_cast<size_t>(op->call.count) * DTypeSize(op->call.dtype) >= kBusyBytes ||
         now - op->data_start < kSpinAfterStart)) {
      act = Activity::kBusy;
    }
  }
  if (diagnosis_) act = std::max(act, Activity::kStalled);
  return act;
}

void MpiGroup::Expire(int64_t seq, absl::Duration waited) {
  if (!failure_.ok() || diagnosis_) return;
  for (const auto& op : ops_) {
    // Past the fingerprint every rank has arrived: the transfer finishes, or fails at its own
    // deadline; the caller's buffers are in use until then.
    if (op->seq == seq && op->stage == MpiOp::Stage::kFingerprint) {
      StartDiagnosis(*op, absl::StrFormat("Wait on rank %d passed its deadline of %s", rank_,
                                          absl::FormatDuration(waited)));
    }
  }
}

void MpiGroup::StartDiagnosis(const MpiOp& op, std::string why) {
  diagnosis_ = Diagnosis{.seq = op.seq, .what = Header(op.call, op.seq), .why = std::move(why),
                         .until = Clock::now() + absl::ToChronoNanoseconds(DiagnosisGrace(options_.timeout)),
                         .issued = std::vector<int64_t>(size_, -1)};
  diagnosis_->issued[rank_] = issued_.load(std::memory_order_relaxed);
  for (int q = 0; q < size_; ++q) {
    if (q != rank_) SendDiag(q, DiagMsg{.type = kQuery, .seq = op.seq, .issued = 0, .code = 0, .epoch = 0, .text = {}});
  }
}

void MpiGroup::ContinueDiagnosis() {
  Diagnosis& d = *diagnosis_;
  const bool all = std::none_of(d.issued.begin(), d.issued.end(), [](int64_t v) { return v < 0; });
  if (!all && Clock::now() < d.until) return;
  std::vector<int> missing;
  std::vector<std::string> notes;
  for (int q = 0; q < size_; ++q) {
    if (d.issued[q] > d.seq) continue;  // it issued this call: arrived
    missing.push_back(q);
    notes.push_back(d.issued[q] < 0
                        ? absl::StrFormat("rank %d did not answer: not running, or its MPI engine is stuck", q)
                        : absl::StrFormat("rank %d had issued %d calls on this group", q, d.issued[q]));
  }
  std::string who = missing.empty()
                        ? std::string("every rank has arrived since, too late")
                        : absl::StrFormat("ranks [%s] did not arrive (%s)", absl::StrJoin(missing, ", "),
                                          absl::StrJoin(notes, "; "));
  const int64_t seq = d.seq;
  std::string msg = absl::StrFormat("%s: %s and %s", d.what, d.why, who);
  diagnosis_.reset();
  Fail(absl::DeadlineExceededError(msg), seq, true);
}

void MpiGroup::SendDiag(int to, const DiagMsg& msg) {
  auto buf = std::make_unique<DiagMsg>(msg);
  buf->epoch = epoch_;
  MPI_Request req = MPI_REQUEST_NULL;
  if (MPI_Isend(buf.get(), sizeof(DiagMsg), MPI_BYTE, to, kDiagTag, diag_, &req) == MPI_SUCCESS) {
    diag_sends_.emplace_back(req, std::move(buf));
  }
}

void MpiGroup::PollDiag() {
  for (;;) {
    if (diag_recv_ == MPI_REQUEST_NULL) break;
    int flag = 0;
    MPI_Status st;
    MPI_Test(&diag_recv_, &flag, &st);
    if (!flag) break;
    const DiagMsg m = diag_in_;
    const int from = st.MPI_SOURCE;
    Open();  // the next message
    if (m.epoch != epoch_) continue;  // meant for an earlier group on the same context id
    switch (m.type) {
      case kQuery:
        SendDiag(from, DiagMsg{.type = kReply, .seq = m.seq,
                               .issued = issued_.load(std::memory_order_relaxed), .code = 0, .epoch = 0, .text = {}});
        break;
      case kReply:
        if (diagnosis_ && diagnosis_->seq == m.seq) diagnosis_->issued[from] = m.issued;
        break;
      case kAbort: {
        const auto code = static_cast<absl::StatusCode>(m.code);
        Fail(absl::Status(code == absl::StatusCode::kOk ? absl::StatusCode::kAborted : code,
                          absl::StrFormat("group '%s' was failed by rank %d: %.*s", name_, from,
                                          static_cast<int>(strnlen(m.text, sizeof(m.text))), m.text)),
             m.seq, false);
        break;
      }
      default:
        break;
    }
  }
  std::erase_if(diag_sends_, [](auto& s) {
    int flag = 0;
    MPI_Test(&s.first, &flag, MPI_STATUS_IGNORE);
    return flag != 0;
  });
}

void MpiGroup::Fail(absl::Status reason, int64_t seq, bool tell_peers) {
  bool first = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (failure_.ok() && !reason.ok()) {
      failure_ = reason;
      failure_seq_ = seq;
      first = true;
    }
  }
  for (auto& op : ops_) {
    if (op->stage == MpiOp::Stage::kDone) continue;
    absl::Status status = op->seq == failure_seq_ ? Detach(failure_) : NotRun(*op);
    TraceOp(*op, name_, size_, status);
    op->work->Complete(std::move(status));
    op->stage = MpiOp::Stage::kDone;
    // MPI may still hold the fingerprint or the data request: keep them until they finish
    // (nonblocking collectives cannot be cancelled).
    if (op->fp_req != MPI_REQUEST_NULL || op->data_req != MPI_REQUEST_NULL) orphans_.push_back(op);
  }
  ops_.clear();
  diagnosis_.reset();
  if (first && tell_peers) {
    DiagMsg m{.type = kAbort, .seq = seq, .issued = 0, .code = static_cast<int64_t>(reason.code()), .epoch = 0, .text = {}};
    std::snprintf(m.text, sizeof(m.text), "%s", std::string(reason.message()).c_str());
    for (int q = 0; q < size_; ++q) {
      if (q != rank_) SendDiag(q, m);
    }
  }
}

void MpiGroup::CloseNow() {
  if (closed_) return;
  if (!ops_.empty()) Fail(absl::CancelledError("the communicator was shut down"), -1, false);
  if (diag_recv_ != MPI_REQUEST_NULL) {
    MPI_Cancel(&diag_recv_);
    MPI_Wait(&diag_recv_, MPI_STATUS_IGNORE);
  }
  for (auto& s : diag_sends_) MPI_Request_free(&s.first);  // point-to-point: allowed
  diag_sends_.clear();
  // Orphaned collectives keep their communicator until they complete; MPI_Comm_free only
  // marks it for deallocation.
  for (MPI_Comm* c : {&data_, &ctrl_, &diag_}) {
    if (*c != MPI_COMM_NULL) MPI_Comm_free(c);
  }
  shm_.reset();
  closed_ = true;
}

}  // namespace fsdp::internal
