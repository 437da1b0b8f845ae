// The mpi_threads communicator: ranks as threads inside Open MPI processes (fsdp/mpi_world.h,
// CreateMpiThreadsWorld). A group whose ranks are all in one process is a local communicator,
// a group with one rank in each of its processes an mpi communicator; the rest, groups with
// several ranks in some process and ranks in several processes, are this transport:
//
// - Each rank of such a group has a worker thread that runs its calls in order. A call is two
//   exchanges of "every rank's bytes to every rank": first a fixed-size header (the call, its
//   sequence number, whether its arguments were valid), compared by every rank as the other
//   transports compare their fingerprints; then the payload (the send buffer).
// - One exchange: the process's ranks all-gather their bytes over their local communicator;
//   the first of them (the leader) all-gathers the process's block with the other processes'
//   leaders over an mpi communicator of one rank per process (Open MPI, or shared memory
//   inside a host: CommOptions::mpi_shared_memory); the leader broadcasts the whole set to
//   its process's ranks.
// - Each rank then computes its result from every rank's send buffer, reducing in rank order
//   in f32 (collectives/reduce.h) like the local transport, so results are bitwise those of
//   the other transports.
// - Deadlines: the mpi communicator waits `timeout`, the local one a little longer and the
//   Work longer still, so that a process that does not arrive is reported as such (by the
//   mpi communicator, naming it) rather than as the leader that waits for it.
// - A failure of either communicator fails the group: the leader aborts the local
//   communicator with the mpi communicator's error and every rank's later calls fail.
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "collectives/reduce.h"
#include "collectives/work_state.h"
#include "fsdp/local_world.h"
#include "fsdp/mpi_world.h"

namespace fsdp {
namespace internal {
namespace {

// How much longer than the mpi communicator the local one and the Work wait.
absl::Duration Grace(absl::Duration timeout) {
  return std::clamp(timeout / 10, absl::Milliseconds(100), absl::Seconds(2));
}

// A mixed group as one process sees it.
struct Layout {
  int size = 0;                 // ranks of the group
  int procs = 0;                // processes holding ranks of it (>= 2)
  int slots = 0;                // the most ranks any one process holds
  std::vector<int> proc_of;     // group rank -> process (its rank in the mpi communicator)
  std::vector<int> slot_of;     // group rank -> its index among its process's ranks
};

struct SplitOutcome;

// What the ranks of a mixed group in one process share.
struct Shared {
  std::string name;
  CommOptions options;
  Layout layout;
  std::vector<int> local_ranks;  // the group's ranks in this process, by local rank
  // The sequence number each of them has started (its worker took the call), for naming the
  // ranks that did not arrive.
  std::unique_ptr<std::atomic<int64_t>[]> started;
  std::unique_ptr<Communicator> mpi;  // one rank per process; used by the leader's worker only
  std::mutex mu;
  std::map<int64_t, std::shared_ptr<SplitOutcome>> splits;  // by the split's sequence number
  // A failure every process found by itself (a schedule mismatch: all see the same headers),
  // so not sent to the other processes (a late message could reach the next communicator
  // that MPI builds on the same context id). Guarded by mu.
  absl::Status failed;
};

// The process's ranks of a mixed group talk over two local communicators: `fast` (the
// group's deadline) for their all-gather, `slow` (longer: the leader may be waiting for other
// processes meanwhile) for the leader's broadcast.
struct Locals {
  std::unique_ptr<Communicator> fast, slow;
};

// One new group of a split, as built by the leader for its process's ranks.
struct Built {
  std::unique_ptr<LocalWorld> local;        // the process's ranks of it (local and mixed groups)
  std::unique_ptr<LocalWorld> slow;         // mixed groups: the broadcasts' local world
  std::unique_ptr<Communicator> mpi;        // a group with one rank per process: that rank's
  std::shared_ptr<Shared> mixed;            // a mixed group
  std::vector<int> local_ranks;             // its ranks in this process, ascending
};
struct SplitOutcome {
  absl::Status status;
  std::map<int, Built> by_color;
  int taken = 0;
};

// The call's header, exchanged before its data. Fixed size, plain bytes.
struct Header {
  int64_t seq = 0, kind = 0, dtype = 0, count = 0, op = 0, root = 0;
  int64_t color = 0, key = 0, invalid = 0;
  char reason[184] = {};
};
static_assert(sizeof(Header) == 256);

struct Task {
  CollectiveCall call;
  absl::Status invalid;
  int color = 0, key = 0;
  std::string label;
  int64_t seq = 0;
  std::shared_ptr<WorkState> work;
};

class ThreadsCommunicator;
absl::StatusOr<std::unique_ptr<Communicator>> TakeFromBuilt(Built& b, int old_rank,
                                                            int new_rank);

class ThreadsCommunicator final : public Communicator {
 public:
  ThreadsCommunicator(std::shared_ptr<Shared> shared, Locals local, int rank)
      : shared_(std::move(shared)),
        local_(std::move(local.fast)),
        slow_(std::move(local.slow)),
        rank_(rank) {
    worker_ = std::thread([this] { Loop(); });
  }
  // Lets the calls in flight finish (each is bounded by its deadline).
  ~ThreadsCommunicator() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      closing_ = true;
    }
    cv_.notify_all();
    worker_.join();
  }

  int rank() const override { return rank_; }
  int size() const override { return shared_->layout.size; }
  const std::string& name() const override { return shared_->name; }
  std::string_view backend() const override { return "mpi_threads"; }
  const CommOptions& options() const override { return shared_->options; }

  absl::StatusOr<std::unique_ptr<Communicator>> Split(int color, int key,
                                                      std::string_view label) override {
    Task t;
    t.call.kind = CollectiveKind::kSplit;
    t.color = color;
    t.key = key;
    t.label = std::string(label);
    Work work = Push(std::move(t));
    FSDP_RETURN_IF_ERROR(work.Wait());
    auto result = std::static_pointer_cast<std::unique_ptr<Communicator>>(work.state()->payload);
    if (result == nullptr) return std::unique_ptr<Communicator>();
    return std::move(*result);
  }

  void Abort(const absl::Status& reason) override {
    const absl::Status r = reason.ok() ? absl::AbortedError("aborted") : reason;
    local_->Abort(r);
    slow_->Abort(r);
    if (shared_->mpi != nullptr) shared_->mpi->Abort(r);
  }
  absl::Status health() const override {
    {
      std::lock_guard<std::mutex> lock(shared_->mu);
      FSDP_RETURN_IF_ERROR(Detach(shared_->failed));
    }
    FSDP_RETURN_IF_ERROR(local_->health());
    FSDP_RETURN_IF_ERROR(slow_->health());
    return shared_->mpi != nullptr ? shared_->mpi->health() : absl::OkStatus();
  }

 protected:
  Work Submit(const CollectiveCall& call, absl::Status invalid) override {
    Task t;
    t.call = call;
    t.invalid = std::move(invalid);
    return Push(std::move(t));
  }

 private:
  Work Push(Task t) {
    std::lock_guard<std::mutex> lock(mu_);
    t.seq = next_seq_++;
    const absl::Duration timeout = options().timeout + 2 * Grace(options().timeout);
    t.work = std::make_shared<WorkState>(
        absl::StrFormat("%s at sequence %d of group '%s'", DescribeCall(t.call), t.seq, name()),
        timeout);
    std::weak_ptr<WorkState> weak = t.work;
    const std::string what = t.work->description();
    const int64_t seq = t.seq;
    t.work->set_on_expire([this, what, seq](absl::Duration waited) {
      const std::string missing = MissingHere(seq);
      Abort(absl::DeadlineExceededError(absl::StrFormat(
          "%s (mpi_threads, %d ranks over %d processes): Wait on rank %d passed its deadline "
          "of %s and %s; the group failed",
          what, size(), shared_->layout.procs, rank_, absl::FormatDuration(waited),
          missing.empty() ? "ranks of another process did not arrive (this process's all did)"
                          : absl::StrCat("ranks [", missing, "] did not arrive"))));
    });
    Work work(t.work);
    queue_.push_back(std::move(t));
    cv_.notify_all();
    return work;
  }

  // This process's ranks that have not started call `seq`: "3, 5".
  std::string MissingHere(int64_t seq) const {
    std::vector<int> missing;
    for (size_t i = 0; i < shared_->local_ranks.size(); ++i) {
      if (shared_->started[i].load() < seq) missing.push_back(shared_->local_ranks[i]);
    }
    return absl::StrJoin(missing, ", ");
  }

  // The mpi communicator's deadline error names processes; add the group's ranks in them.
  std::string RanksOfProcesses(const std::string& message) const {
    const size_t at = message.find("ranks [");
    const size_t end = message.find("] did not arrive", at);
    if (at == std::string::npos || end == std::string::npos ||
        message.find("mpi_threads") != std::string::npos) {
      return message;
    }
    std::vector<int> ranks;
    for (absl::string_view p : absl::StrSplit(message.substr(at + 7, end - at - 7), ", ")) {
      int proc = 0;
      if (!absl::SimpleAtoi(p, &proc)) return message;
      for (int g = 0; g < size(); ++g) {
        if (shared_->layout.proc_of[g] == proc) ranks.push_back(g);
      }
    }
    return absl::StrCat(message, " (the processes of ranks [", absl::StrJoin(ranks, ", "),
                        "] of this group did not arrive)");
  }

  void Loop() {
    for (;;) {
      Task t;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return closing_ || !queue_.empty(); });
        if (queue_.empty()) return;
        t = std::move(queue_.front());
        queue_.pop_front();
      }
      for (size_t i = 0; i < shared_->local_ranks.size(); ++i) {
        if (shared_->local_ranks[i] == rank_) shared_->started[i].store(t.seq);
      }
      std::shared_ptr<void> payload;
      absl::Status s = Run(t, &payload);
      if (!s.ok()) {
        s = absl::Status(s.code(), absl::StrFormat("%s (mpi_threads, %d ranks over %d "
                                                   "processes): %s",
                                                   t.work->description(), size(),
                                                   shared_->layout.procs, s.message()));
      }
      t.work->payload = std::move(payload);
      t.work->Complete(std::move(s));
    }
  }

  // Every rank's `bytes` bytes, in group rank order, into `all` (size() * bytes).
  absl::Status GatherAll(int64_t seq, const void* mine, int64_t bytes, std::vector<uint8_t>* all) {
    const Layout& l = shared_->layout;
    const int k = local_->size();
    std::vector<uint8_t> ours(static_cast<size_t>(k * bytes));
    if (absl::Status s = local_->AllGather(mine, ours.data(), bytes, DType::kU8); !s.ok()) {
      const std::string missing = MissingHere(seq);
      if (s.code() == absl::StatusCode::kDeadlineExceeded && !missing.empty() &&
          s.message().find("mpi_threads") == absl::string_view::npos) {  // not our own abort
        s = absl::DeadlineExceededError(absl::StrFormat(
            "sequence %d of group '%s' (mpi_threads): rank %d waited %s and ranks [%s] did not "
            "arrive",
            seq, name(), rank_, absl::FormatDuration(options().timeout), missing));
      }
      Abort(s);  // the other processes learn it from the mpi communicator
      return s;
    }
    all->assign(static_cast<size_t>(l.size * bytes), 0);
    if (local_->rank() == 0) {
      std::vector<uint8_t> block(static_cast<size_t>(l.slots * bytes), 0);
      std::memcpy(block.data(), ours.data(), ours.size());
      std::vector<uint8_t> every(static_cast<size_t>(l.procs) * block.size());
      absl::Status s = shared_->mpi->AllGather(block.data(), every.data(), l.slots * bytes,
                                               DType::kU8);
      if (!s.ok()) {
        s = absl::Status(s.code(), RanksOfProcesses(std::string(s.message())));
        Abort(s);  // the process's other ranks wait for the leader's broadcast
        return s;
      }
      for (int g = 0; g < l.size; ++g) {
        std::memcpy(all->data() + g * bytes,
                    every.data() + (static_cast<int64_t>(l.proc_of[g]) * l.slots + l.slot_of[g]) * bytes,
                    static_cast<size_t>(bytes));
      }
    }
    return slow_->Broadcast(all->data(), l.size * bytes, DType::kU8, 0);
  }

  // Fails the group in this process only (every process has found the same failure).
  void FailHere(const absl::Status& s) {
    {
      std::lock_guard<std::mutex> lock(shared_->mu);
      if (shared_->failed.ok()) shared_->failed = s;
    }
    local_->Abort(s);
    slow_->Abort(s);
  }

  absl::Status Run(const Task& t, std::shared_ptr<void>* payload) {
    {
      std::lock_guard<std::mutex> lock(shared_->mu);
      if (!shared_->failed.ok()) {
        return absl::Status(shared_->failed.code(),
                            absl::StrCat("not run: the group had failed: ",
                                         shared_->failed.message()));
      }
    }
    const int n = size();
    Header h;
    h.seq = t.seq;
    h.kind = static_cast<int64_t>(t.call.kind);
    h.dtype = static_cast<int64_t>(t.call.dtype);
    h.count = t.call.count;
    h.op = static_cast<int64_t>(t.call.op);
    h.root = t.call.root;
    h.color = t.color;
    h.key = t.key;
    h.invalid = t.invalid.ok() ? 0 : 1;
    std::snprintf(h.reason, sizeof h.reason, "%s", std::string(t.invalid.message()).c_str());
    std::vector<uint8_t> raw;
    FSDP_RETURN_IF_ERROR(GatherAll(t.seq, &h, sizeof h, &raw));
    std::vector<Header> hs(static_cast<size_t>(n));
    std::memcpy(hs.data(), raw.data(), raw.size());

    std::vector<std::string> invalid;
    for (const Header& o : hs) {
      if (o.invalid) invalid.push_back(std::string(o.reason, strnlen(o.reason, sizeof o.reason)));
    }
    if (!invalid.empty()) {  // every rank learns of it; the schedule is intact, the group lives
      return absl::InvalidArgumentError(
          absl::StrCat("invalid arguments: ", absl::StrJoin(invalid, "; ")));
    }
    bool same = true;
    for (const Header& o : hs) {
      same = same && o.seq == h.seq && o.kind == h.kind && o.dtype == h.dtype &&
             o.count == h.count && o.op == h.op && o.root == h.root;
    }
    if (!same) {
      std::vector<std::string> calls;
      for (const Header& o : hs) {
        CollectiveCall c{.kind = static_cast<CollectiveKind>(o.kind), .count = o.count,
                         .dtype = static_cast<DType>(o.dtype), .op = static_cast<ReduceOp>(o.op),
                         .root = static_cast<int>(o.root)};
        std::string d = DescribeCall(c);
        if (o.seq != h.seq) d += absl::StrFormat(" as its sequence %d", o.seq);
        calls.push_back(std::move(d));
      }
      absl::Status s = ScheduleMismatch(t.seq, name(), calls, " (mpi_threads)");
      FailHere(s);
      return s;
    }
    const CollectiveCall& c = t.call;
    const auto es = static_cast<int64_t>(DTypeSize(c.dtype));
    // No data: the header exchange was the whole call (every rank arrived and agreed).
    if (c.kind != CollectiveKind::kSplit && c.count == 0) return absl::OkStatus();
    std::vector<uint8_t> all;
    switch (c.kind) {
      case CollectiveKind::kBarrier:
        return absl::OkStatus();
      case CollectiveKind::kSplit:
        return DoSplit(t, hs, payload);
      case CollectiveKind::kAllGather: {
        const int64_t bytes = c.count * es;
        FSDP_RETURN_IF_ERROR(GatherAll(t.seq, c.send, bytes, &all));
        coll::CopyBytes(c.recv, all.data(), all.size());
        return absl::OkStatus();
      }
      case CollectiveKind::kBroadcast: {
        const int64_t bytes = c.count * es;
        FSDP_RETURN_IF_ERROR(GatherAll(t.seq, c.send, bytes, &all));
        if (rank_ != c.root) coll::CopyBytes(c.recv, all.data() + c.root * bytes, bytes);
        return absl::OkStatus();
      }
      case CollectiveKind::kAllToAll: {
        const int64_t chunk = c.count * es;
        FSDP_RETURN_IF_ERROR(GatherAll(t.seq, c.send, n * chunk, &all));
        auto* out = static_cast<uint8_t*>(c.recv);
        for (int q = 0; q < n; ++q) {
          std::memcpy(out + q * chunk, all.data() + (q * n + rank_) * chunk,
                      static_cast<size_t>(chunk));
        }
        return absl::OkStatus();
      }
      case CollectiveKind::kAllReduce:
      case CollectiveKind::kReduceScatter: {
        const bool rs = c.kind == CollectiveKind::kReduceScatter;
        const int64_t whole = (rs ? n * c.count : c.count) * es;
        FSDP_RETURN_IF_ERROR(GatherAll(t.seq, c.send, whole, &all));
        const int64_t from = rs ? rank_ * c.count * es : 0;
        std::vector<const void*> srcs(static_cast<size_t>(n));
        for (int q = 0; q < n; ++q) srcs[q] = all.data() + q * whole + from;
        coll::ReduceBuffers(c.dtype, c.op, srcs.data(), n, c.recv, c.count, n);
        return absl::OkStatus();
      }
    }
    return absl::InternalError("unknown collective");
  }

  // The split, once every rank's color and key are known (`hs`): the leader of this process
  // builds the new groups its ranks belong to (and joins the other processes in making their
  // mpi communicators), then hands each rank its own.
  absl::Status DoSplit(const Task& t, const std::vector<Header>& hs,
                       std::shared_ptr<void>* payload) {
    const int n = size();
    // Each color's ranks in new-rank order: by (key, rank).
    std::map<int, std::vector<int>> members;
    for (int q = 0; q < n; ++q) {
      if (hs[q].color >= 0) members[static_cast<int>(hs[q].color)].push_back(q);
    }
    for (auto& [color, m] : members) {
      std::stable_sort(m.begin(), m.end(), [&](int a, int b) { return hs[a].key < hs[b].key; });
    }
    std::shared_ptr<SplitOutcome> outcome;
    if (local_->rank() == 0) {
      outcome = std::make_shared<SplitOutcome>();
      outcome->status = Build(members, t.label, &outcome->by_color);
      std::lock_guard<std::mutex> lock(shared_->mu);
      shared_->splits[t.seq] = outcome;
    }
    FSDP_RETURN_IF_ERROR(local_->Barrier());
    {
      std::lock_guard<std::mutex> lock(shared_->mu);
      auto it = shared_->splits.find(t.seq);
      if (it == shared_->splits.end()) return absl::InternalError("split: no outcome");
      outcome = it->second;
      if (++outcome->taken == local_->size()) shared_->splits.erase(it);
    }
    if (!outcome->status.ok()) {  // the other processes may have built theirs: fail them too
      const absl::Status s = Detach(outcome->status);
      Abort(s);
      return s;
    }
    const int color = static_cast<int>(hs[rank_].color);
    if (color < 0) return absl::OkStatus();
    const std::vector<int>& m = members[color];
    const int new_rank = static_cast<int>(std::find(m.begin(), m.end(), rank_) - m.begin());
    std::unique_ptr<Communicator> comm;
    {
      std::lock_guard<std::mutex> lock(shared_->mu);
      FSDP_ASSIGN_OR_RETURN(comm, TakeFromBuilt(outcome->by_color[color], rank_, new_rank));
    }
    *payload = std::make_shared<std::unique_ptr<Communicator>>(std::move(comm));
    return absl::OkStatus();
  }

  // The leader's part of a split: every process runs the same rounds of mpi splits (computed
  // alike from the same headers), so that each group spanning processes gets its mpi
  // communicator, then the groups with ranks in this process are built.
  absl::Status Build(const std::map<int, std::vector<int>>& members, const std::string& label,
                     std::map<int, Built>* out) {
    const Layout& l = shared_->layout;
    const int me = l.proc_of[rank_];
    struct Group {
      std::vector<int> procs;  // in order of first rank
      bool ours = false;
    };
    std::map<int, Group> groups;
    for (const auto& [color, m] : members) {
      Group& g = groups[color];
      for (int q : m) {
        if (std::find(g.procs.begin(), g.procs.end(), l.proc_of[q]) == g.procs.end()) {
          g.procs.push_back(l.proc_of[q]);
        }
        g.ours = g.ours || l.proc_of[q] == me;
      }
    }
    // Rounds: a color goes to the first round where none of its processes is busy.
    std::vector<std::vector<bool>> busy;  // [round][proc]
    std::vector<std::map<int, int>> round_color;  // [round] proc -> color
    for (const auto& [color, g] : groups) {
      if (g.procs.size() < 2) continue;
      size_t r = 0;
      for (;; ++r) {
        if (r == busy.size()) {
          busy.emplace_back(static_cast<size_t>(l.procs), false);
          round_color.emplace_back();
        }
        bool free = true;
        for (int p : g.procs) free = free && !busy[r][p];
        if (free) break;
      }
      for (int p : g.procs) {
        busy[r][p] = true;
        round_color[r][p] = color;
      }
    }
    std::map<int, std::unique_ptr<Communicator>> mpi_of;
    for (auto& rc : round_color) {
      auto it = rc.find(me);
      const int color = it == rc.end() ? -1 : it->second;
      int key = 0;
      if (color >= 0) {
        const auto& procs = groups[color].procs;
        key = static_cast<int>(std::find(procs.begin(), procs.end(), me) - procs.begin());
      }
      FSDP_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> c,
                            shared_->mpi->Split(color, key, label));
      if (color >= 0) mpi_of[color] = std::move(c);
    }
    const std::string base = absl::StrCat(shared_->name, "/", label.empty() ? "split" : label);
    for (const auto& [color, g] : groups) {
      if (!g.ours) continue;
      const std::vector<int>& m = members.at(color);
      Built b;
      for (int q : m) {
        if (l.proc_of[q] == me) b.local_ranks.push_back(q);
      }
      const std::string name = absl::StrCat(base, color);
      bool one_each = g.procs.size() > 1;
      std::map<int, int> per_proc;
      for (int q : m) one_each = one_each && ++per_proc[l.proc_of[q]] == 1;
      if (!one_each) {
        const int k = static_cast<int>(b.local_ranks.size());
        FSDP_ASSIGN_OR_RETURN(b.local, LocalWorld::Create(k, shared_->options, name));
        if (g.procs.size() > 1) {
          CommOptions slow = shared_->options;
          slow.timeout += 2 * Grace(slow.timeout);
          FSDP_ASSIGN_OR_RETURN(b.slow, LocalWorld::Create(k, slow, name));
        }
      }
      if (g.procs.size() > 1) {
        std::unique_ptr<Communicator>& mc = mpi_of[color];
        if (one_each) {
          b.mpi = std::move(mc);
        } else {
          auto s = std::make_shared<Shared>();
          s->name = name;
          s->options = shared_->options;
          s->mpi = std::move(mc);
          for (int q : b.local_ranks) {
            s->local_ranks.push_back(static_cast<int>(std::find(m.begin(), m.end(), q) - m.begin()));
          }
          s->started.reset(new std::atomic<int64_t>[s->local_ranks.size()]);
          for (size_t i = 0; i < s->local_ranks.size(); ++i) s->started[i].store(-1);
          Layout& nl = s->layout;
          nl.size = static_cast<int>(m.size());
          nl.procs = static_cast<int>(g.procs.size());
          std::map<int, int> fill;
          for (int q : m) {
            const int p = static_cast<int>(
                std::find(g.procs.begin(), g.procs.end(), l.proc_of[q]) - g.procs.begin());
            nl.proc_of.push_back(p);
            nl.slot_of.push_back(fill[p]++);
          }
          for (const auto& [p, k] : fill) nl.slots = std::max(nl.slots, k);
          b.mixed = std::move(s);
        }
      }
      (*out)[color] = std::move(b);
    }
    return absl::OkStatus();
  }

  const std::shared_ptr<Shared> shared_;
  const std::unique_ptr<Communicator> local_;
  const std::unique_ptr<Communicator> slow_;
  const int rank_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Task> queue_;
  bool closing_ = false;
  int64_t next_seq_ = 0;
  std::thread worker_;
};

absl::StatusOr<std::unique_ptr<Communicator>> TakeFromBuilt(Built& b, int old_rank,
                                                            int new_rank) {
  if (b.mpi != nullptr) return std::move(b.mpi);
  // The local world's rank i is the i-th of the new group's ranks in this process.
  const auto it = std::find(b.local_ranks.begin(), b.local_ranks.end(), old_rank);
  if (it == b.local_ranks.end() || b.local == nullptr) {
    return absl::InternalError("split: this rank's new group was not built");
  }
  const int i = static_cast<int>(it - b.local_ranks.begin());
  Locals local;
  FSDP_ASSIGN_OR_RETURN(local.fast, b.local->TakeRank(i));
  if (b.mixed == nullptr) return std::move(local.fast);
  FSDP_ASSIGN_OR_RETURN(local.slow, b.slow->TakeRank(i));
  return std::unique_ptr<Communicator>(
      new ThreadsCommunicator(b.mixed, std::move(local), new_rank));
}

}  // namespace
}  // namespace internal

absl::StatusOr<std::vector<std::unique_ptr<Communicator>>> CreateMpiThreadsWorld(
    int threads, CommOptions options) {
  if (threads < 1 || threads > 4096) {
    return absl::InvalidArgumentError(absl::StrCat(
        "CreateMpiThreadsWorld: threads (ranks per process) must be in [1, 4096], got ", threads));
  }
  std::vector<std::unique_ptr<Communicator>> comms;
  // The processes' communicator waits a little longer than the ranks inside a process (see
  // the top of this file).
  CommOptions across = options;
  across.timeout += internal::Grace(options.timeout);
  FSDP_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> mpi, CreateMpiWorld(across));
  const int procs = mpi->size();
  // Every process must play the same number of ranks: agree on it before anything else.
  std::vector<int64_t> all(static_cast<size_t>(procs));
  const int64_t mine = threads;
  FSDP_RETURN_IF_ERROR(mpi->AllGather(&mine, all.data(), 1, DType::kI64));
  for (int p = 0; p < procs; ++p) {
    if (all[p] != threads) {
      return absl::InvalidArgumentError(absl::StrCat(
          "CreateMpiThreadsWorld: every process must play the same number of ranks; process ",
          p, " asked for ", all[p], ", process ", mpi->rank(), " for ", threads));
    }
  }
  if (threads == 1) {
    comms.push_back(std::move(mpi));
    return comms;
  }
  if (procs == 1) {
    mpi.reset();
    FSDP_ASSIGN_OR_RETURN(auto world, LocalWorld::Create(threads, options, "world"));
    for (int t = 0; t < threads; ++t) {
      FSDP_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> c, world->TakeRank(t));
      comms.push_back(std::move(c));
    }
    return comms;
  }
  auto shared = std::make_shared<internal::Shared>();
  shared->name = "world";
  shared->options = options;
  internal::Layout& l = shared->layout;
  l.size = procs * threads;
  l.procs = procs;
  l.slots = threads;
  for (int g = 0; g < l.size; ++g) {
    l.proc_of.push_back(g / threads);
    l.slot_of.push_back(g % threads);
  }
  shared->mpi = std::move(mpi);
  const int first = shared->mpi->rank() * threads;
  shared->started.reset(new std::atomic<int64_t>[threads]);
  for (int t = 0; t < threads; ++t) {
    shared->local_ranks.push_back(first + t);
    shared->started[t].store(-1);
  }
  CommOptions slow = options;
  slow.timeout += 2 * internal::Grace(options.timeout);
  FSDP_ASSIGN_OR_RETURN(auto local, LocalWorld::Create(threads, options, "world"));
  FSDP_ASSIGN_OR_RETURN(auto local_slow, LocalWorld::Create(threads, slow, "world"));
  for (int t = 0; t < threads; ++t) {
    internal::Locals c;
    FSDP_ASSIGN_OR_RETURN(c.fast, local->TakeRank(t));
    FSDP_ASSIGN_OR_RETURN(c.slow, local_slow->TakeRank(t));
    comms.push_back(std::unique_ptr<Communicator>(
        new internal::ThreadsCommunicator(shared, std::move(c), first + t)));
  }
  return comms;
}

}  // namespace fsdp
