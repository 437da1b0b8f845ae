// Projection of a sharded training step onto a described cluster (fsdp/project.h): a replay of
// the sharding runtime's step with a compute thread and one serial queue per communicator.
#include "fsdp/project.h"

#include <algorithm>
#include <cmath>
#include <deque>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "src/fsdp/schedule.h"

namespace fsdp {
namespace {

absl::Status Bad(std::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("ProjectStep: ", std::string(what)));
}

bool IsHybrid(ShardingStrategy s) {
  return s == ShardingStrategy::kHybridShard || s == ShardingStrategy::kHybridShardGradOp;
}

bool FiniteNonNegative(double x) { return std::isfinite(x) && x >= 0; }

absl::Status CheckLink(const LinkSpec& l) {
  for (auto [name, v] : {std::pair<const char*, double>{"intra_bytes_per_s", l.intra_bytes_per_s},
                         {"intra_latency_s", l.intra_latency_s},
                         {"inter_bytes_per_s", l.inter_bytes_per_s},
                         {"inter_latency_s", l.inter_latency_s}}) {
    if (!FiniteNonNegative(v)) {
      return Bad(absl::StrCat("link ", name, "=", v, ": allowed: a finite number >= 0"));
    }
  }
  for (auto [name, v] : {std::pair<const char*, double>{"intra_efficiency", l.intra_efficiency},
                         {"inter_efficiency", l.inter_efficiency}}) {
    if (!std::isfinite(v) || v <= 0 || v > 1) {
      return Bad(absl::StrCat("link ", name, "=", v, ": allowed: a fraction in (0, 1]"));
    }
  }
  if (l.ranks_per_host < 0) {
    return Bad(absl::StrCat("link ranks_per_host=", l.ranks_per_host,
                            ": allowed: 0 (one host) or the ranks of each host"));
  }
  return absl::OkStatus();
}

int HostOf(int rank, const LinkSpec& l) { return l.ranks_per_host > 0 ? rank / l.ranks_per_host : 0; }

// What a collective's cost depends on in a group: its ranks, its hosts, and the most and the
// fewest of its ranks that share a host. Worked out once per group, so that a collective costs
// the same to charge however many ranks it spans.
struct GroupShape {
  int n = 0, hosts = 0, most_on_a_host = 0, fewest_on_a_host = 0;
};

GroupShape ShapeOf(const std::vector<int>& g, const LinkSpec& l) {
  std::vector<int> hosts;
  hosts.reserve(g.size());
  for (int r : g) hosts.push_back(HostOf(r, l));
  if (!std::is_sorted(hosts.begin(), hosts.end())) std::sort(hosts.begin(), hosts.end());
  GroupShape s;
  s.n = static_cast<int>(g.size());
  s.fewest_on_a_host = s.n;
  for (size_t i = 0; i < hosts.size();) {
    size_t j = i;
    while (j < hosts.size() && hosts[j] == hosts[i]) ++j;
    const int on_host = static_cast<int>(j - i);
    ++s.hosts;
    s.most_on_a_host = std::max(s.most_on_a_host, on_host);
    s.fewest_on_a_host = std::min(s.fewest_on_a_host, on_host);
    i = j;
  }
  return s;
}

// The local communicator's TransferSeconds (collectives/local/local_group.cc).
double Transfer(bool inter, double bytes, const LinkSpec& l) {
  const double bw = inter ? l.inter_bytes_per_s : l.intra_bytes_per_s;
  const double lat = inter ? l.inter_latency_s : l.intra_latency_s;
  return lat + (bw > 0 ? bytes / bw : 0.0);
}

// The slowest rank's charge for sending `bytes` to every other rank of the group: a rank
// with k - 1 peers on its host pays k - 1 transfers inside it and n - k between hosts, so the
// slowest is on the fullest or on the emptiest host.
double AllPeers(const GroupShape& g, double bytes, const LinkSpec& l) {
  const double intra = Transfer(false, bytes, l), inter = Transfer(true, bytes, l);
  double worst = 0;
  for (int k : {g.most_on_a_host, g.fewest_on_a_host}) {
    worst = std::max(worst, (k - 1) * intra + (g.n - k) * inter);
  }
  return worst;
}

double SimulatedSeconds(CollectiveKind kind, int64_t bytes, int elem, const GroupShape& g,
                        const LinkSpec& l) {
  const int n = g.n;
  if (kind == CollectiveKind::kAllReduce) {
    const int64_t count = bytes / elem;
    const int64_t align = std::max<int64_t>(1, 64 / elem);
    const int64_t slice = count / n + (count % n != 0 ? 1 : 0);  // ceil(count / n)
    const int64_t per = (slice + align - 1) / align * align;
    return 2 * AllPeers(g, static_cast<double>(per) * elem, l);
  }
  return AllPeers(g, static_cast<double>(bytes) / n, l);
}

double Div(double bytes, double bw) { return bw > 0 ? bytes / bw : 0.0; }

double RingSeconds(CollectiveKind kind, int64_t bytes, const GroupShape& g, const LinkSpec& l,
                   bool hierarchical) {
  const int n = g.n;
  const int h = g.hosts;
  const int per_host = n / h;  // ranks of the group on each host
  const int host_ranks = l.ranks_per_host > 0 ? l.ranks_per_host : n;
  // Groups of the same shape run at once on every host (every rank runs the same step): they
  // share the host's network interface.
  const int sharing = std::max(1, host_ranks / per_host);
  const double intra_bw = l.intra_bytes_per_s * l.intra_efficiency;
  const double nic_bw = l.inter_bytes_per_s * l.inter_efficiency / sharing;
  const double phases = kind == CollectiveKind::kAllReduce ? 2.0 : 1.0;
  const double S = static_cast<double>(bytes);
  if (h == 1) {
    return phases * ((n - 1) * l.intra_latency_s + Div((n - 1.0) / n * S, intra_bw));
  }
  if (hierarchical) {
    // Among hosts: h ranks with the same local index, each with 1/per_host of the group's
    // share of the interface, move (h-1)/h of S/per_host; then inside the host (per_host
    // ranks, (per_host-1)/per_host of S).
    const double inter = (h - 1) * l.inter_latency_s +
                         Div((h - 1.0) / h * S / per_host, nic_bw / per_host);
    const double intra = per_host > 1 ? (per_host - 1) * l.intra_latency_s +
                                            Div((per_host - 1.0) / per_host * S, intra_bw)
                                      : 0.0;
    return phases * (inter + intra);
  }
  // A ring: (n-1)/n S through each hop and through each host's interface; hops: h cross hosts,
  // the others stay inside a host (per step of the n-1).
  const double bw = per_host > 1 ? std::min(intra_bw > 0 ? intra_bw : nic_bw, nic_bw) : nic_bw;
  const double latency = (n - h) * l.intra_latency_s + (h - 1) * l.inter_latency_s;
  return phases * (latency + Div((n - 1.0) / n * S, bw));
}

absl::StatusOr<double> ShapeSeconds(CollectiveKind kind, int64_t bytes, int elem_bytes,
                                    const GroupShape& group, const LinkSpec& link) {
  FSDP_RETURN_IF_ERROR(CheckLink(link));
  if (kind != CollectiveKind::kAllGather && kind != CollectiveKind::kReduceScatter &&
      kind != CollectiveKind::kAllReduce && kind != CollectiveKind::kAllToAll) {
    return Bad(absl::StrCat("CollectiveSeconds: ", std::string(CollectiveName(kind)),
                            ": allowed: all_gather, reduce_scatter, all_reduce, all_to_all"));
  }
  if (bytes < 0 || elem_bytes < 1) {
    return Bad(absl::StrCat("CollectiveSeconds: bytes=", bytes, ", elem_bytes=", elem_bytes,
                            ": allowed: bytes >= 0, elem_bytes >= 1"));
  }
  if (group.n == 0) return Bad("CollectiveSeconds: an empty group");
  if (group.n == 1) return 0.0;
  switch (link.algorithm) {
    case CollectiveAlgorithm::kSimulatedLink:
      return SimulatedSeconds(kind, bytes, elem_bytes, group, link);
    case CollectiveAlgorithm::kRing:
      return RingSeconds(kind, bytes, group, link, false);
    case CollectiveAlgorithm::kHierarchical:
      return RingSeconds(kind, bytes, group, link, true);
  }
  return Bad("CollectiveSeconds: unknown algorithm");
}

// ---- the replay ----------------------------------------------------------------------------

// The runtime's unit schedule (src/fsdp/schedule.h) on a clock: Replay is its executor, whose
// collectives take the times of the described link on rank 0's groups (every rank's look
// alike), and whose compute takes the profile's times.
class Replay {
 public:
  Replay(const StepProfile& p, const LinkSpec& l, const ProjectionRun& run, int S, int R)
      : p_(p), link_(l), run_(run), S_(S), R_(R), schedule_(this, Options(run, S, R)) {
    const int U = static_cast<int>(p.unit_numel.size());
    units_.resize(U);
    for (int u = 0; u < U; ++u) schedule_.AddUnit();
    // Rank 0's groups (ranks r = replicate index x S + shard index); every rank's look alike.
    std::vector<int> group;
    for (int i = 0; i < S; ++i) group.push_back(i);
    shard_.shape = ShapeOf(group, l);
    group.clear();
    for (int i = 0; i < R; ++i) group.push_back(i * S);
    replicate_.shape = ShapeOf(group, l);
    if (run.secondary_shard_size > 0) {
      group.clear();
      for (int i = 0; i < run.secondary_shard_size; ++i) group.push_back(i);
      secondary_.shape = ShapeOf(group, l);
    }
    // A step after the first: the orders ShardedModel's first step records.
    std::vector<int> forward, backward = {0};
    for (int u = 0; u < U; ++u) forward.push_back(u);
    for (int u = U - 1; u >= 1; --u) backward.push_back(u);
    schedule_.AssumeRecorded(forward, backward);
  }

  // One micro-batch's forward and backward, with its accumulation switches.
  absl::Status MicroBatch(const MicroBatchSwitches& sw) {
    const int L = p_.num_blocks();
    // Forward.
    FSDP_RETURN_IF_ERROR(schedule_.PreForward(0));
    Compute(p_.before_blocks_s);
    for (int i = 0; i < L; ++i) {
      FSDP_RETURN_IF_ERROR(schedule_.PreForward(i + 1));
      Compute(p_.forward_gaps_s / L + p_.block_forward_s[i]);
      FSDP_RETURN_IF_ERROR(schedule_.PostForward(i + 1));
    }
    // The head: its forward (a third) before PostForward(root), its backward after.
    Compute(p_.head_s / 3);
    FSDP_RETURN_IF_ERROR(schedule_.PostForward(0));
    FSDP_RETURN_IF_ERROR(schedule_.PreBackward(0));
    Compute(p_.head_s * 2 / 3);
    for (int i = L - 1; i >= 0; --i) {
      FSDP_RETURN_IF_ERROR(schedule_.PreBackward(i + 1));
      Compute(p_.backward_gaps_s / L + p_.block_recompute_s[i] + p_.block_backward_s[i]);
      FSDP_RETURN_IF_ERROR(
          schedule_.PostBackward(i + 1, sw.sync_gradients, sw.requires_all_reduce));
    }
    Compute(p_.after_blocks_s);
    FSDP_RETURN_IF_ERROR(schedule_.PostBackward(0, sw.sync_gradients, sw.requires_all_reduce));
    return schedule_.FinishBackward();
  }

  absl::StatusOr<Projection> Run() {
    const int K = run_.micro_batches;
    for (int j = 0; j < K; ++j) {
      FSDP_RETURN_IF_ERROR(MicroBatch(AccumulationSwitches(run_.accumulation, j, K)));
    }
    // The optimizer step: the gradient norm's all_gather (an f32 pair per rank) over the
    // shard group, then the update.
    if (S_ > 1) {
      FSDP_ASSIGN_OR_RETURN(int c, Issue(true, CollectiveKind::kAllGather, 8LL * S_, 4, -1));
      Wait(c);
    }
    Compute(p_.optimizer_s + p_.after_optimizer_s);
    t_ += p_.sync_s;
    exposed_ += p_.sync_s;

    Projection out;
    out.step_s = t_;
    const double once = p_.optimizer_s + p_.after_optimizer_s;  // per step, not micro-batch
    out.compute_s = (p_.compute_s() - once) * K + once;
    out.exposed_comm_s = exposed_;
    out.shard_size = S_;
    out.replicate_size = R_;
    std::vector<std::pair<double, double>> spans;
    for (const ProjectedCollective& c : colls_) {
      out.comm_total_s += c.end_s - c.start_s;
      spans.push_back({c.start_s, c.end_s});
      const double n = c.group == "shard"       ? S_
                       : c.group == "secondary" ? run_.secondary_shard_size
                                                : R_;
      out.comm_bytes_per_rank += static_cast<double>(c.bytes);
      out.bus_bytes_per_rank += (c.kind == "all_reduce" ? 2 : 1) * static_cast<double>(c.bytes) *
                                (n - 1) / n;
    }
    std::sort(spans.begin(), spans.end());
    double covered_to = 0;
    for (auto [b, e] : spans) {
      b = std::max(b, covered_to);
      if (e > b) {
        out.comm_busy_s += e - b;
        covered_to = e;
      }
    }
    out.tokens_per_s = p_.tokens_per_rank > 0 && t_ > 0
                           ? static_cast<double>(p_.tokens_per_rank) * K * run_.world_size / t_
                           : 0;
    out.collectives = std::move(colls_);
    return out;
  }

 // ---- the executor of the unit schedule, on a host backend ------------------------------------
  bool is_host() const { return true; }
  bool Gathered(int u) const { return units_[u].gathered; }
  absl::Status IssueGather(int u) {
    Unit& unit = units_[u];
    if (unit.gathered || S_ == 1) return absl::OkStatus();
    unit.gathered = true;
    if (unit.secondary) {  // backward's gather inside the host, in param_dtype
      unit.secondary = false;
      const int e = static_cast<int>(DTypeSize(p_.param_dtype));
      FSDP_ASSIGN_OR_RETURN(unit.gather,
                            Issue(secondary_, CollectiveKind::kAllGather, Padded(u) * e, e, u));
      return absl::OkStatus();
    }
    const CommunicationOptions& c = run_.communication;
    if (QuantizesAllGather(c, S_)) {  // codes and scales, bytes on the wire
      const QuantizedLayout chunk{Padded(u) / S_, c.block_size};
      FSDP_ASSIGN_OR_RETURN(unit.gather,
                            Issue(true, CollectiveKind::kAllGather, chunk.bytes() * S_, 1, u));
      return absl::OkStatus();
    }
    const int e = static_cast<int>(DTypeSize(p_.param_dtype));
    FSDP_ASSIGN_OR_RETURN(unit.gather, Issue(true, CollectiveKind::kAllGather, Padded(u) * e, e, u));
    return absl::OkStatus();
  }
  absl::Status WaitGather(int u, bool /*prefetched*/) {
    Wait(units_[u].gather);
    units_[u].gather = -1;
    return absl::OkStatus();
  }
  void FreeGathered(int u) {
    units_[u].gathered = false;
    units_[u].gather = -1;
  }
  absl::Status KeepSecondary(int u) {
    units_[u].secondary = units_[u].gathered;
    return absl::OkStatus();
  }
  void DropSecondary(int u) { units_[u].secondary = false; }
  absl::Status PrepareGradient(int /*u*/) { return absl::OkStatus(); }
  absl::StatusOr<bool> IssueReduction(int u) {
    if (S_ == 1 && R_ == 1) return false;
    const CommunicationOptions& c = run_.communication;
    const QuantizedLayout chunk{Padded(u) / S_, c.block_size};  // codes, bytes on the wire
    if (QuantizesReduceScatter(c, S_)) {
      FSDP_ASSIGN_OR_RETURN(units_[u].reduce,
                            Issue(true, CollectiveKind::kAllToAll, chunk.bytes() * S_, 1, u));
      return true;
    }
    if (QuantizesReplicaReduction(c, R_)) {
      FSDP_ASSIGN_OR_RETURN(units_[u].reduce,
                            Issue(false, CollectiveKind::kAllToAll, ReplicaCodes(u), 1, u));
      return true;
    }
    const int e = static_cast<int>(DTypeSize(p_.reduce_dtype));
    if (S_ > 1) {
      FSDP_ASSIGN_OR_RETURN(units_[u].reduce,
                            Issue(true, CollectiveKind::kReduceScatter, Padded(u) * e, e, u));
    } else {
      FSDP_ASSIGN_OR_RETURN(units_[u].reduce,
                            Issue(false, CollectiveKind::kAllReduce, Padded(u) * e, e, u));
    }
    return true;
  }
  bool ReductionDone(int u) const { return Done(units_[u].reduce); }
  absl::Status WaitReduction(int u) {
    Wait(units_[u].reduce);
    return absl::OkStatus();
  }
  absl::Status ReductionStatus(int /*u*/) { return absl::OkStatus(); }
  // On a host backend, moving a reduction on waits for it (the stream waits block the host);
  // HYBRID then all-reduces the reduced shard across replicas.
  absl::Status AdvanceReduction(int u, internal::Reduction /*stage*/, bool to_replicas,
                                bool /*with_accumulated*/) {
    Wait(units_[u].reduce);
    units_[u].reduce = -1;
    if (!to_replicas) return absl::OkStatus();
    const CommunicationOptions& c = run_.communication;
    if (QuantizesReplicaReduction(c, R_)) {  // the reduced shard's codes, exchanged
      FSDP_ASSIGN_OR_RETURN(units_[u].reduce,
                            Issue(false, CollectiveKind::kAllToAll, ReplicaCodes(u), 1, u));
      return absl::OkStatus();
    }
    const int e = static_cast<int>(DTypeSize(p_.reduce_dtype));
    FSDP_ASSIGN_OR_RETURN(units_[u].reduce,
                          Issue(false, CollectiveKind::kAllReduce, Padded(u) / S_ * e, e, u));
    return absl::OkStatus();
  }
  // Then each replica's mean chunk, re-encoded, all-gathered.
  absl::Status IssueReplicaGather(int u) {
    Wait(units_[u].reduce);
    FSDP_ASSIGN_OR_RETURN(units_[u].reduce,
                          Issue(false, CollectiveKind::kAllGather, ReplicaCodes(u), 1, u));
    return absl::OkStatus();
  }
  void Collect() {}

 private:
  // A communicator: its group's shape, its collectives (indices into colls_) in the order they
  // were issued, the first of them that may still run, and when it is free.
  struct Queue {
    GroupShape shape;
    std::vector<int> colls;
    size_t live = 0;
    double free = 0;
  };
  struct Unit {
    bool gathered = false;
    bool secondary = false;  // holds a secondary shard: backward gathers over that group
    int gather = -1;  // the collective of its gather in flight, until waited for
    int reduce = -1;  // the collective of its reduction in flight
  };

  static internal::ScheduleOptions Options(const ProjectionRun& run, int S, int R) {
    internal::ScheduleOptions so;
    so.strategy = run.strategy;
    so.forward_prefetch = so.backward_prefetch = run.prefetch > 0;
    so.max_prefetch_units = std::max(1, run.prefetch);
    so.shard_size = S;
    so.replicate_size = R;
    so.two_phase_replicas = QuantizesReplicaReduction(run.communication, R);
    so.secondary_shard_size = run.secondary_shard_size;
    return so;
  }
  // A quantized reduction across replicas: the bytes of R slots of one replica's chunk.
  int64_t ReplicaCodes(int u) const {
    return ReplicaChunkLayout(run_.communication, Padded(u) / S_, R_).bytes() * R_;
  }

  int64_t Padded(int u) const {
    const int64_t n = p_.unit_numel[u];
    return (n + S_ - 1) / S_ * S_;
  }

  // `s` seconds of compute; while a collective runs beside it, compute runs at 1 - slowdown of
  // its speed (every collective issued so far has its times fixed already).
  void Compute(double s) {
    const double f = run_.overlap_slowdown;
    if (f <= 0 || s <= 0) {
      t_ += s;
      return;
    }
    // The collectives that end after now, by when they run from now on: each queue's from its
    // first that has not ended, in the order they were issued (a queue runs one after another,
    // so they start and end in that order), the queues merged as the walk goes. The walk
    // stops at the first that starts after the work is done: each call visits the collectives
    // that end during it, and one more, not every collective in flight.
    Queue* queues[] = {&shard_, &replicate_, &secondary_};
    for (Queue* q : queues) {
      while (q->live < q->colls.size() && colls_[q->colls[q->live]].end_s <= t_) ++q->live;
    }
    const double now = t_;
    auto span = [&](const Queue& q, size_t i) {
      const ProjectedCollective& c = colls_[q.colls[i]];
      return std::pair<double, double>(std::max(c.start_s, now), c.end_s);
    };
    size_t next[] = {shard_.live, replicate_.live, secondary_.live};
    double left = s;
    for (;;) {
      int from = -1;  // the queue whose next collective runs first
      for (int k = 0; k < 3; ++k) {
        if (next[k] >= queues[k]->colls.size()) continue;
        if (from < 0 || span(*queues[k], next[k]) < span(*queues[from], next[from])) from = k;
      }
      if (from < 0) break;
      auto [b, e] = span(*queues[from], next[from]++);
      if (e <= t_) continue;
      b = std::max(b, t_);
      if (b > t_) {  // free of communication until b
        if (t_ + left <= b) break;
        left -= b - t_;
        t_ = b;
      }
      const double slow = (e - t_) * (1 - f);  // work done until e
      if (slow >= left) {
        t_ += left / (1 - f);
        return;
      }
      left -= slow;
      t_ = e;
    }
    t_ += left;
  }

  absl::StatusOr<int> Issue(bool shard, CollectiveKind kind, int64_t bytes, int elem, int unit) {
    return Issue(shard ? shard_ : replicate_, kind, bytes, elem, unit);
  }
  absl::StatusOr<int> Issue(Queue& q, CollectiveKind kind, int64_t bytes, int elem, int unit) {
    FSDP_ASSIGN_OR_RETURN(double d, ShapeSeconds(kind, bytes, elem, q.shape, link_));
    double& free = q.free;
    ProjectedCollective c;
    c.kind = std::string(CollectiveName(kind));
    c.group = &q == &shard_ ? "shard" : &q == &secondary_ ? "secondary" : "replicate";
    c.unit = unit;
    c.bytes = bytes;
    c.start_s = std::max(t_, free);
    c.end_s = c.start_s + d;
    free = c.end_s;
    colls_.push_back(c);
    q.colls.push_back(static_cast<int>(colls_.size()) - 1);
    return static_cast<int>(colls_.size()) - 1;
  }
  void Wait(int c) {
    if (c < 0) return;
    if (colls_[c].end_s > t_) {
      exposed_ += colls_[c].end_s - t_;
      t_ = colls_[c].end_s;
    }
  }
  bool Done(int c) const { return c < 0 || colls_[c].end_s <= t_; }

  const StepProfile& p_;
  const LinkSpec& link_;
  const ProjectionRun& run_;
  const int S_, R_;
  Queue shard_, replicate_, secondary_;
  std::vector<Unit> units_;
  std::vector<ProjectedCollective> colls_;
  double t_ = 0, exposed_ = 0;
  internal::UnitSchedule<Replay> schedule_;  // last: it runs on the members above
};

}  // namespace

double StepProfile::compute_s() const {
  double s = before_blocks_s + forward_gaps_s + head_s + backward_gaps_s + after_blocks_s +
             optimizer_s + after_optimizer_s;
  for (double x : block_forward_s) s += x;
  for (double x : block_backward_s) s += x;
  for (double x : block_recompute_s) s += x;
  return s;
}

std::string_view CollectiveAlgorithmName(CollectiveAlgorithm a) {
  switch (a) {
    case CollectiveAlgorithm::kSimulatedLink: return "simulated";
    case CollectiveAlgorithm::kRing: return "ring";
    case CollectiveAlgorithm::kHierarchical: return "hierarchical";
  }
  return "?";
}

absl::StatusOr<CollectiveAlgorithm> ParseCollectiveAlgorithm(std::string_view name) {
  const std::string n = absl::AsciiStrToLower(std::string(name));
  if (n == "simulated") return CollectiveAlgorithm::kSimulatedLink;
  if (n == "ring") return CollectiveAlgorithm::kRing;
  if (n == "hierarchical") return CollectiveAlgorithm::kHierarchical;
  return absl::InvalidArgumentError(absl::StrCat(
      "collective algorithm '", std::string(name), "': allowed: simulated, ring, hierarchical"));
}

LinkSpec SimulatedLink(const CommOptions& o) {
  LinkSpec l;
  l.algorithm = CollectiveAlgorithm::kSimulatedLink;
  l.ranks_per_host = o.ranks_per_host;
  l.intra_bytes_per_s = o.link_bytes_per_second;
  l.intra_latency_s = std::max(0.0, absl::ToDoubleSeconds(o.link_latency));
  l.inter_bytes_per_s = o.inter_host_bytes_per_second;
  l.inter_latency_s = std::max(0.0, absl::ToDoubleSeconds(o.inter_host_latency));
  return l;
}

absl::StatusOr<double> CollectiveSeconds(CollectiveKind kind, int64_t bytes, int elem_bytes,
                                         const std::vector<int>& group, const LinkSpec& link) {
  if (group.size() > static_cast<size_t>(kMaxPlanWorldSize)) {
    return Bad(absl::StrCat("CollectiveSeconds: a group of ", group.size(),
                            " ranks: allowed: 1 to ", kMaxPlanWorldSize));
  }
  return ShapeSeconds(kind, bytes, elem_bytes, ShapeOf(group, link), link);
}

absl::StatusOr<Projection> ProjectStep(const StepProfile& p, const LinkSpec& link,
                                       const ProjectionRun& run) {
  const int L = p.num_blocks();
  if (L < 1) return Bad("the profile has no blocks: give each block's forward and backward time");
  if (L > nn::kMaxLayers) {
    return Bad(absl::StrCat("the profile has ", L, " blocks: allowed: 1 to ", nn::kMaxLayers,
                            " (the replay is per block)"));
  }
  if (static_cast<int>(p.block_backward_s.size()) != L ||
      static_cast<int>(p.block_recompute_s.size()) != L) {
    return Bad(absl::StrCat("the profile has ", L, " forward, ", p.block_backward_s.size(),
                            " backward and ", p.block_recompute_s.size(),
                            " recompute times: give one of each per block"));
  }
  if (static_cast<int>(p.unit_numel.size()) != L + 1) {
    return Bad(absl::StrCat("the profile has ", p.unit_numel.size(), " unit sizes for ", L,
                            " blocks: give the root unit's and each block's (", L + 1, ")"));
  }
  for (int64_t n : p.unit_numel) {
    if (n < 1 || n > kMaxPlanUnitNumel) {
      return Bad(absl::StrCat("a unit of ", n, " elements: allowed: 1 to 2^56 (",
                              kMaxPlanUnitNumel, ")"));
    }
  }
  for (const std::vector<double>* v :
       {&p.block_forward_s, &p.block_backward_s, &p.block_recompute_s}) {
    for (double x : *v) {
      if (!FiniteNonNegative(x)) {
        return Bad(absl::StrCat("a block time of ", x, " s: allowed: finite and >= 0"));
      }
    }
  }
  for (double x : {p.before_blocks_s, p.forward_gaps_s, p.head_s, p.backward_gaps_s,
                   p.after_blocks_s, p.optimizer_s, p.after_optimizer_s, p.sync_s}) {
    if (!FiniteNonNegative(x)) {
      return Bad(absl::StrCat("a compute time of ", x, " s: allowed: finite and >= 0"));
    }
  }
  FSDP_RETURN_IF_ERROR(CheckLink(link));
  if (!std::isfinite(run.overlap_slowdown) || run.overlap_slowdown < 0 ||
      run.overlap_slowdown >= 1) {
    return Bad(absl::StrCat("overlap_slowdown=", run.overlap_slowdown,
                            ": allowed: a fraction in [0, 1)"));
  }
  const int W = run.world_size;
  if (W < 1 || W > kMaxPlanWorldSize) {
    return Bad(absl::StrCat("world_size=", W, ": allowed: 1 to ", kMaxPlanWorldSize,
                            " ranks (1 << 20)"));
  }
  if (run.micro_batches < 1 || run.micro_batches > kMaxProjectedMicroBatches) {
    return Bad(absl::StrCat("micro_batches=", run.micro_batches, ": allowed: 1 to ",
                            kMaxProjectedMicroBatches, " per step"));
  }
  FSDP_RETURN_IF_ERROR(CheckCommunicationOptions(run.communication));
  if (run.prefetch < 0) {
    return Bad(absl::StrCat("prefetch=", run.prefetch,
                            ": allowed: 0 (none) or the units gathered ahead of their use"));
  }
  if (link.ranks_per_host > 0 && W > link.ranks_per_host && W % link.ranks_per_host != 0) {
    return Bad(absl::StrCat("ranks_per_host=", link.ranks_per_host, " does not divide the ",
                            W, " ranks: every host holds the same number of ranks"));
  }
  int S = W, R = 1;
  if (run.strategy == ShardingStrategy::kNoShard) {
    S = 1;
    R = W;
  } else if (IsHybrid(run.strategy)) {
    S = run.hybrid_shard_size;
    if (S <= 0) {
      const int rph = link.ranks_per_host;
      S = rph > 0 && rph <= W && W % rph == 0 ? rph : W;
    }
    if (S > W) S = W;
    if (W % S != 0) {
      return Bad(absl::StrCat("hybrid_shard_size=", run.hybrid_shard_size, " does not divide the ",
                              W, " ranks: give a divisor of the world size"));
    }
    R = W / S;
  }
  if (run.secondary_shard_size != 0) {
    ShardingOptions probe;
    probe.strategy = run.strategy;
    probe.secondary_shard_size = run.secondary_shard_size;
    if (absl::Status c = CheckSecondaryShard(probe, S); !c.ok()) return Bad(std::string(c.message()));
    if (link.ranks_per_host > 0 && link.ranks_per_host % run.secondary_shard_size != 0) {
      return Bad(absl::StrCat("secondary_shard_size=", run.secondary_shard_size,
                              " with ranks_per_host=", link.ranks_per_host,
                              ": a secondary group would span hosts; allowed: a divisor of the "
                              "ranks per host"));
    }
  }
  Replay replay(p, link, run, S, R);
  return replay.Run();
}

absl::StatusOr<StepProfile> ProfileFromBench(const BenchResult& r, const nn::ModelConfig& config) {
  if (absl::Status v = config.Validate(); !v.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("ProfileFromBench: ", v.message()));
  }
  const int L = config.num_layers();
  if (static_cast<int>(r.block_forward_s.size()) != L ||
      static_cast<int>(r.block_backward_s.size()) != L ||
      static_cast<int>(r.block_recompute_s.size()) != L) {
    return absl::FailedPreconditionError(absl::StrCat(
        "ProfileFromBench: the result has ", r.block_forward_s.size(),
        " per-block times for a model of ", L, " blocks: pass the result of RunBench for ",
        config.name()));
  }
  StepProfile p;
  p.source = absl::StrCat("measured: ", r.model, " ", r.strategy, " ", r.world_size,
                          r.world_size == 1 ? " rank" : " ranks", ", B=", r.batch_size,
                          " T=", r.seq_len, ", ", r.threads_per_rank, " thread(s) per rank");
  for (int u = 0; u < config.num_units(); ++u) p.unit_numel.push_back(config.UnitNumel(u));
  p.block_forward_s = r.block_forward_s;
  p.block_backward_s = r.block_backward_s;
  p.block_recompute_s = r.block_recompute_s;
  p.before_blocks_s = r.before_blocks_s;
  p.forward_gaps_s = r.forward_gaps_s;
  p.head_s = r.head_s;
  p.backward_gaps_s = r.backward_gaps_s;
  p.after_blocks_s = r.after_blocks_s;
  p.optimizer_s = r.optimizer_s;
  p.after_optimizer_s = r.after_optimizer_s;
  const bool no_link = r.link_gbps == 0 && r.link_latency_us == 0 && r.inter_gbps == 0 &&
                       r.inter_latency_us == 0;
  p.sync_s = no_link ? r.exposed_comm_s : 0;
  p.param_dtype = r.param_dtype;
  p.reduce_dtype = r.reduce_dtype;
  p.tokens_per_rank = static_cast<int64_t>(r.batch_size) * r.seq_len;
  p.model_flops_per_rank = config.flops_per_step(p.tokens_per_rank, r.seq_len);
  return p;
}

absl::StatusOr<StepProfile> ProfileFromFlops(const nn::ModelConfig& config,
                                             const DeviceSpec& d, const FlopsWorkload& w,
                                             int shard_size) {
  auto bad = [](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat("ProfileFromFlops: ", parts...));
  };
  if (absl::Status v = config.Validate(); !v.ok()) return bad(v.message());
  if (!std::isfinite(d.peak_flops) || d.peak_flops <= 0) {
    return bad("peak_flops=", d.peak_flops, ": give the device's dense FLOP/s (> 0)");
  }
  if (!std::isfinite(d.achieved_fraction) || d.achieved_fraction <= 0 ||
      d.achieved_fraction > 1) {
    return bad("achieved_fraction=", d.achieved_fraction, ": allowed: a fraction in (0, 1]");
  }
  if (!std::isfinite(d.memory_bytes_per_s) || d.memory_bytes_per_s <= 0) {
    return bad("memory_bytes_per_s=", d.memory_bytes_per_s, ": give the HBM bandwidth (> 0)");
  }
  const int T = w.seq_len > 0 ? w.seq_len : config.block_size();
  if (T > config.block_size()) {
    return bad("seq_len=", T, ": allowed: 1 to the block size of ", config.name(), ", ",
               config.block_size());
  }
  if (w.batch_size < 1) return bad("batch_size=", w.batch_size, ": allowed: 1 or more");
  if (shard_size < 1) return bad("shard_size=", shard_size, ": allowed: 1 or more");
  if (w.checkpoint_every < 0) return bad("checkpoint_every=", w.checkpoint_every);
  const double rate = d.peak_flops * d.achieved_fraction;
  const double tokens = static_cast<double>(w.batch_size) * T;
  const int L = config.num_layers();
  const double C = config.channels();
  StepProfile p;
  p.source = absl::StrCat("FLOPs: ", config.name(), " on ", d.name, " at ", d.achieved_fraction,
                          " of ", d.peak_flops / 1e12, " TFLOP/s, B=", w.batch_size, " T=", T);
  for (int u = 0; u < config.num_units(); ++u) p.unit_numel.push_back(config.UnitNumel(u));
  for (int i = 0; i < L; ++i) {
    const double fwd = 2.0 * static_cast<double>(config.UnitNumel(i + 1)) * tokens +
                       4.0 * C * T * tokens;
    p.block_forward_s.push_back(fwd / rate);
    p.block_backward_s.push_back(2 * fwd / rate);
    const bool ckpt = w.checkpoint_every > 0 && i % w.checkpoint_every == 0;
    p.block_recompute_s.push_back(ckpt ? fwd / rate : 0.0);
  }
  p.head_s = 6.0 * config.vocab_size() * C * tokens / rate;
  // AdamW on the rank's shard: read the f32 master, gradient and two moments, write the master
  // and the moments (28 bytes per parameter), memory-bound.
  const double shard_params = static_cast<double>(config.num_parameters()) / shard_size;
  p.optimizer_s = 28.0 * shard_params / d.memory_bytes_per_s;
  p.param_dtype = w.param_dtype;
  p.reduce_dtype = w.reduce_dtype;
  p.tokens_per_rank = static_cast<int64_t>(tokens);
  p.model_flops_per_rank = config.flops_per_step(p.tokens_per_rank, T);
  return p;
}

}  // namespace fsdp
