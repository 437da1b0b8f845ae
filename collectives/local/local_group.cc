// The rendezvous and the shared-memory algorithms of a local group (see local_group.h).
//
// Why two slots are enough: a rank passes the rendezvous of call s+1 only once every rank has
// arrived there, which each rank does after leaving call s. So the slot of s is reused (for
// s+2) only after every rank has left s, and nobody still looks at it.
#include "collectives/local/local_group.h"

#include <algorithm>
#include <chrono>
#include <map>
#include <thread>

#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "collectives/reduce.h"
#include "collectives/work_state.h"

namespace fsdp::internal {
namespace {
std::vector<int> IdentityRanks(int size) {
  std::vector<int> ranks(size);
  for (int r = 0; r < size; ++r) ranks[r] = r;
  return ranks;
}
}  // namespace

LocalGroup::LocalGroup(std::string name, int size, CommOptions options,
                       std::vector<int> world_ranks)
    : name_(std::move(name)),
      size_(size),
      options_(options),
      world_ranks_(world_ranks.empty() ? IdentityRanks(size) : std::move(world_ranks)),
      issued_(new std::atomic<int64_t>[size]),
      arrived_seq_(size, -1),
      completed_seq_(size, -1) {
  for (int r = 0; r < size; ++r) issued_[r].store(0, std::memory_order_relaxed);
  for (Slot& s : slots_) {
    s.present.assign(size, 0);
    s.posts.resize(size);
  }
}

absl::Status LocalGroup::health() const {
  std::lock_guard<std::mutex> lock(mu_);
  return Detach(failure_);
}

void LocalGroup::Fail(absl::Status reason, int64_t seq) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (failure_.ok() && !reason.ok()) {
      failure_ = Detach(reason);
      failure_seq_ = seq;
    }
  }
  cv_.notify_all();
}

absl::Status LocalGroup::FailedStatus(const LocalPost& post, int64_t seq) const {
  return absl::Status(failure_.code(),
                      absl::StrFormat("%s at sequence %d of group '%s' was not run: the group "
                                      "had failed: %s",
                                      DescribeCall(post.call), seq, name_, failure_.message()));
}

std::string LocalGroup::MissingRanks(const Slot& slot) const {
  std::vector<int> missing;
  std::vector<std::string> notes;
  for (int q = 0; q < size_; ++q) {
    if (slot.present[q]) continue;
    missing.push_back(q);
    const int64_t issued = issued_[q].load(std::memory_order_relaxed);
    notes.push_back(arrived_seq_[q] < 0
                        ? absl::StrFormat("rank %d had issued %d calls and arrived at none", q, issued)
                        : absl::StrFormat("rank %d had issued %d calls and last arrived at sequence %d",
                                          q, issued, arrived_seq_[q]));
  }
  return absl::StrFormat("ranks [%s] did not arrive (%s)", absl::StrJoin(missing, ", "),
                         absl::StrJoin(notes, "; "));
}

void LocalGroup::Decide(Slot& s) {
  std::vector<std::string> invalid;
  for (const LocalPost& p : s.posts) {
    if (!p.invalid.ok()) invalid.emplace_back(p.invalid.message());
  }
  if (!invalid.empty()) {  // every rank learns of it; the schedule is intact, the group lives
    s.verdict = absl::InvalidArgumentError(absl::StrFormat(
        "invalid arguments at sequence %d of group '%s': %s", s.seq, name_,
        absl::StrJoin(invalid, "; ")));
    return;
  }
  bool same = true;
  for (const LocalPost& p : s.posts) {
    same = same && p.call.SameSchedule(s.posts[0].call) && p.label == s.posts[0].label;
  }
  if (!same) {
    std::vector<std::string> calls;
    for (int q = 0; q < size_; ++q) {
      std::string d = DescribeCall(s.posts[q].call);
      if (s.posts[q].call.kind == CollectiveKind::kSplit) d += " label '" + s.posts[q].label + "'";
      calls.push_back(std::move(d));
    }
    s.verdict = ScheduleMismatch(s.seq, name_, calls);
    if (failure_.ok()) {
      failure_ = s.verdict;
      failure_seq_ = s.seq;
    }
    return;
  }
  if (s.posts[0].call.kind == CollectiveKind::kSplit) {
    std::map<int, std::vector<std::pair<int, int>>> members;  // color -> (key, rank)
    for (int q = 0; q < size_; ++q) {
      if (s.posts[q].color >= 0) members[s.posts[q].color].push_back({s.posts[q].key, q});
    }
    s.split_results.assign(size_, LocalSplitResult{});
    const std::string label = s.posts[0].label.empty() ? "split" : s.posts[0].label;
    for (auto& [color, list] : members) {
      std::sort(list.begin(), list.end());
      std::vector<int> world_ranks;
      for (const auto& member : list) world_ranks.push_back(world_ranks_[member.second]);
      auto group = std::make_shared<LocalGroup>(absl::StrFormat("%s/%s%d", name_, label, color),
                                                static_cast<int>(list.size()), options_,
                                                std::move(world_ranks));
      for (size_t i = 0; i < list.size(); ++i) {
        s.split_results[list[i].second] = {group, static_cast<int>(i)};
      }
    }
  }
}

absl::Status LocalGroup::Run(int rank, int64_t seq, const LocalPost& post, LocalSplitResult* split,
                             int64_t* peer_wait_ns) {
  const auto arrival = peer_wait_ns ? std::chrono::steady_clock::now()
                                    : std::chrono::steady_clock::time_point();
  auto note_wait = [&] {
    if (peer_wait_ns) {
      *peer_wait_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                          std::chrono::steady_clock::now() - arrival).count();
    }
  };
  std::unique_lock<std::mutex> lock(mu_);
  if (!failure_.ok()) return FailedStatus(post, seq);
  Slot& s = slots_[seq & 1];
  if (s.seq != seq) {
    s.seq = seq;
    s.arrived = s.left = s.done = 0;
    s.phase[0] = s.phase[1] = 0;
    std::fill(s.present.begin(), s.present.end(), 0);
    s.verdict = absl::OkStatus();
    s.split_results.clear();
  }
  s.posts[rank] = post;
  s.present[rank] = 1;
  arrived_seq_[rank] = seq;
  if (++s.arrived == size_) {
    note_wait();
    Decide(s);
    cv_.notify_all();
  } else {
    const auto deadline =
        std::chrono::steady_clock::now() + absl::ToChronoNanoseconds(options_.timeout);
    while (s.arrived < size_ && failure_.ok()) {
      if (cv_.wait_until(lock, deadline) == std::cv_status::timeout && s.arrived < size_ &&
          failure_.ok()) {
        failure_ = absl::DeadlineExceededError(absl::StrFormat(
            "%s at sequence %d of group '%s' (local, %d ranks): rank %d waited %s and %s",
            DescribeCall(post.call), seq, name_, size_, rank,
            absl::FormatDuration(options_.timeout), MissingRanks(s)));
        failure_seq_ = seq;
        cv_.notify_all();
      }
    }
    note_wait();
    // All arrived wins over a failure that came later: peers are already reading our buffers.
    if (s.arrived < size_) return failure_seq_ == seq ? Detach(failure_) : FailedStatus(post, seq);
  }
  if (!s.verdict.ok()) {
    ++s.left;
    completed_seq_[rank] = seq;
    return Detach(s.verdict);
  }
  if (split != nullptr && post.call.kind == CollectiveKind::kSplit) *split = s.split_results[rank];
  Move(rank, s, lock);
  if (++s.done == size_) cv_.notify_all();
  WaitCount(lock, s.done);
  ++s.left;
  completed_seq_[rank] = seq;
  return absl::OkStatus();
}

void LocalGroup::WaitCount(std::unique_lock<std::mutex>& lock, int& counter) {
  cv_.wait(lock, [&] { return counter >= size_; });
}

void LocalGroup::ExpireWait(int rank, int64_t seq, const std::string& what,
                            absl::Duration waited) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (completed_seq_[rank] >= seq || !failure_.ok()) return;  // completes on its own
    const Slot& mine = slots_[seq & 1];
    if (mine.seq == seq && mine.arrived == size_) return;  // past the rendezvous: copying
    std::string where;
    int64_t stuck_seq = seq;
    for (const Slot& s : slots_) {
      if (s.seq >= 0 && s.arrived < size_) {
        where = absl::StrFormat("the group is waiting at sequence %d: %s", s.seq, MissingRanks(s));
        stuck_seq = s.seq;
      }
    }
    if (where.empty()) {
      where = absl::StrFormat("rank %d has not reached it yet (its last completed call is sequence %d)",
                              rank, completed_seq_[rank]);
    }
    failure_ = absl::DeadlineExceededError(absl::StrFormat(
        "%s (local, %d ranks): Wait on rank %d passed its deadline of %s; %s", what, size_, rank,
        absl::FormatDuration(waited), where));
    failure_seq_ = stuck_seq;
  }
  cv_.notify_all();
}

void LocalGroup::ChargeLink(std::chrono::steady_clock::time_point start, int transfers,
                            size_t bytes) const {
  if (transfers <= 0) return;
  const bool bw = options_.link_bytes_per_second > 0;
  if (!bw && options_.link_latency <= absl::ZeroDuration()) return;
  const double per = absl::ToDoubleSeconds(options_.link_latency) +
                     (bw ? static_cast<double>(bytes) / options_.link_bytes_per_second : 0.0);
  std::this_thread::sleep_until(start + std::chrono::duration_cast<std::chrono::nanoseconds>(
                                            std::chrono::duration<double>(per * transfers)));
}

namespace {
void SleepUntil(std::chrono::steady_clock::time_point start, double seconds) {
  if (seconds <= 0) return;
  std::this_thread::sleep_until(start + std::chrono::duration_cast<std::chrono::nanoseconds>(
                                            std::chrono::duration<double>(seconds)));
}
}  // namespace

double LocalGroup::TransferSeconds(int a, int b, size_t bytes) const {
  const int per_host = options_.ranks_per_host;
  const bool inter = world_ranks_[a] / per_host != world_ranks_[b] / per_host;
  const double bw = inter ? options_.inter_host_bytes_per_second : options_.link_bytes_per_second;
  const absl::Duration latency = inter ? options_.inter_host_latency : options_.link_latency;
  return std::max(0.0, absl::ToDoubleSeconds(latency)) +
         (bw > 0 ? static_cast<double>(bytes) / bw : 0.0);
}

void LocalGroup::ChargePeer(std::chrono::steady_clock::time_point start, int rank, int peer,
                            size_t bytes) const {
  if (!two_levels()) return ChargeLink(start, 1, bytes);
  SleepUntil(start, TransferSeconds(rank, peer, bytes));
}

void LocalGroup::ChargeAllPeers(std::chrono::steady_clock::time_point start, int rank,
                                size_t bytes) const {
  if (!two_levels()) return ChargeLink(start, size_ - 1, bytes);
  double seconds = 0;
  for (int q = 0; q < size_; ++q) {
    if (q != rank) seconds += TransferSeconds(rank, q, bytes);
  }
  SleepUntil(start, seconds);
}

void LocalGroup::ChargeBarrier(std::chrono::steady_clock::time_point start, int rank) const {
  if (!two_levels()) return ChargeLink(start, size_ > 1 ? 1 : 0, 0);
  double seconds = 0;
  for (int q = 0; q < size_; ++q) {
    if (q != rank) seconds = std::max(seconds, TransferSeconds(rank, q, 0));
  }
  SleepUntil(start, seconds);
}

void LocalGroup::Move(int rank, Slot& s, std::unique_lock<std::mutex>& lock) {
  const CollectiveCall& me = s.posts[rank].call;
  const int n = size_;
  const size_t e = DTypeSize(me.dtype);
  const int64_t c = me.count;
  std::vector<const void*> srcs(n);
  auto byte_ptr = [](const void* p, size_t off) { return static_cast<const char*>(p) + off; };
  lock.unlock();
  auto start = std::chrono::steady_clock::now();
  switch (me.kind) {
    case CollectiveKind::kAllGather: {
      const size_t chunk = c * e;
      char* recv = static_cast<char*>(me.recv);
      // Each rank starts at its own chunk, so the ranks read different peers at a time.
      for (int k = 0; k < n; ++k) {
        const int q = (rank + k) % n;
        coll::CopyBytes(recv + q * chunk, s.posts[q].call.send, chunk);
      }
      ChargeAllPeers(start, rank, chunk);
      break;
    }
    case CollectiveKind::kReduceScatter: {
      const size_t chunk = c * e;
      for (int q = 0; q < n; ++q) srcs[q] = byte_ptr(s.posts[q].call.send, rank * chunk);
      coll::ReduceBuffers(me.dtype, me.op, srcs.data(), n, me.recv, c, n);
      ChargeAllPeers(start, rank, chunk);
      break;
    }
    case CollectiveKind::kAllReduce: {
      // Each rank reduces one slice of everyone's send into its recv; then each copies the
      // other slices from the peers' recv. Slices are cache-line aligned.
      const int64_t align = static_cast<int64_t>(64 / e);
      const int64_t per = ((c + n - 1) / n + align - 1) / align * align;
      auto slice = [&](int q, int64_t* lo, int64_t* hi) {
        *lo = std::min(c, q * per);
        *hi = std::min(c, *lo + per);
      };
      int64_t lo, hi;
      slice(rank, &lo, &hi);
      for (int q = 0; q < n; ++q) srcs[q] = byte_ptr(s.posts[q].call.send, lo * e);
      coll::ReduceBuffers(me.dtype, me.op, srcs.data(), n, static_cast<char*>(me.recv) + lo * e,
                          hi - lo, n);
      ChargeAllPeers(start, rank, (hi - lo) * e);
      lock.lock();
      if (++s.phase[0] == n) cv_.notify_all();
      WaitCount(lock, s.phase[0]);
      lock.unlock();
      start = std::chrono::steady_clock::now();
      for (int k = 1; k < n; ++k) {
        const int q = (rank + k) % n;
        slice(q, &lo, &hi);
        coll::CopyBytes(static_cast<char*>(me.recv) + lo * e, byte_ptr(s.posts[q].call.recv, lo * e),
                        (hi - lo) * e);
      }
      ChargeAllPeers(start, rank, per * e);
      break;
    }
    case CollectiveKind::kBroadcast:
      if (rank != me.root) {
        coll::CopyBytes(me.recv, s.posts[me.root].call.recv, c * e);
        ChargePeer(start, rank, me.root, c * e);
      }
      break;
    case CollectiveKind::kAllToAll: {
      // Chunk `rank` of every peer's send; each rank starts at its own, as all_gather does.
      const size_t chunk = c * e;
      char* recv = static_cast<char*>(me.recv);
      for (int k = 0; k < n; ++k) {
        const int q = (rank + k) % n;
        coll::CopyBytes(recv + q * chunk, byte_ptr(s.posts[q].call.send, rank * chunk), chunk);
      }
      ChargeAllPeers(start, rank, chunk);
      break;
    }
    case CollectiveKind::kBarrier:
      ChargeBarrier(start, rank);
      break;
    case CollectiveKind::kSplit:
      break;
  }
  lock.lock();
}

}  // namespace fsdp::internal
