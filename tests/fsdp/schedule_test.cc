// The unit schedule (src/fsdp/schedule.h) on its own, with a fake executor that logs what it
// is asked to do: which gathers are issued at which hook, which units are given back, when
// reductions are issued, waited for and moved on, for each strategy and prefetch depth. The
// executor behaves as a host backend: a collective completes when it is waited for.
#include "src/fsdp/schedule.h"

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace fsdp::internal {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;

class FakeExec {
 public:
  explicit FakeExec(int units, bool host = true) : gathered_(units), reduce_(units), host_(host) {}

  bool is_host() const { return host_; }
  bool Gathered(int u) const { return gathered_[u]; }
  absl::Status IssueGather(int u) {
    if (gathered_[u]) return absl::OkStatus();
    gathered_[u] = true;
    Log("gather", u);
    return absl::OkStatus();
  }
  absl::Status WaitGather(int u, bool prefetched) {
    Log(prefetched ? "use-prefetched" : "use", u);
    return absl::OkStatus();
  }
  void FreeGathered(int u) {
    if (!gathered_[u]) return;
    gathered_[u] = false;
    Log("free", u);
  }
  absl::Status KeepSecondary(int u) {
    secondary_.resize(gathered_.size());
    secondary_[u] = true;
    Log("keep", u);
    return absl::OkStatus();
  }
  void DropSecondary(int u) {
    if (static_cast<size_t>(u) >= secondary_.size() || !secondary_[u]) return;
    secondary_[u] = false;
    Log("drop", u);
  }
  absl::Status PrepareGradient(int u) {
    Log("grad", u);
    return absl::OkStatus();
  }
  absl::StatusOr<bool> IssueReduction(int u) {
    if (single_rank_) {
      Log("accumulate", u);
      return false;
    }
    reduce_[u] = kInFlight;
    Log("reduce", u);
    return true;
  }
  bool ReductionDone(int u) const { return reduce_[u] == kDone; }
  absl::Status WaitReduction(int u) {
    reduce_[u] = kDone;
    Log("wait-reduce", u);
    return absl::OkStatus();
  }
  absl::Status ReductionStatus(int) { return absl::OkStatus(); }
  absl::Status AdvanceReduction(int u, Reduction stage, bool to_replicas, bool with_accumulated) {
    if (to_replicas) {
      reduce_[u] = kInFlight;
      Log(with_accumulated ? "replica-reduce+accumulated" : "replica-reduce", u);
    } else {
      reduce_[u] = kNone;
      Log(stage == Reduction::kShardGroup ? "land" : "land-replica", u);
    }
    return absl::OkStatus();
  }
  absl::Status IssueReplicaGather(int u) {
    reduce_[u] = kInFlight;
    Log("replica-gather", u);
    return absl::OkStatus();
  }
  void Collect() {}

  // What happened since the last call, e.g. "gather 1,use 0".
  std::string Take() {
    std::string s = absl::StrJoin(log_, ",");
    log_.clear();
    return s;
  }
  // Completes every collective in flight (a device that has caught up).
  void CompleteAll() {
    for (int& r : reduce_) {
      if (r == kInFlight) r = kDone;
    }
  }
  void set_single_rank() { single_rank_ = true; }

 private:
  enum { kNone, kInFlight, kDone };
  void Log(const char* what, int u) { log_.push_back(absl::StrCat(what, " ", u)); }
  std::vector<bool> gathered_, secondary_;
  std::vector<int> reduce_;
  bool host_;
  bool single_rank_ = false;
  std::vector<std::string> log_;
};

ScheduleOptions Opts(ShardingStrategy s, int prefetch, int S, int R) {
  ScheduleOptions o;
  o.strategy = s;
  o.forward_prefetch = o.backward_prefetch = prefetch > 0;
  o.max_prefetch_units = std::max(1, prefetch);
  o.shard_size = S;
  o.replicate_size = R;
  return o;
}

// ShardedModel's order over a root (unit 0) and L blocks, recording what each hook did.
struct StepLog {
  std::vector<std::string> forward, backward;  // per hook pair, root first
  std::string finish;
};

StepLog Step(UnitSchedule<FakeExec>& s, FakeExec& e, int units, bool sync = true,
             bool all_reduce = true) {
  StepLog log;
  e.Take();
  EXPECT_TRUE(s.PreForward(0).ok());
  log.forward.push_back(e.Take());
  for (int u = 1; u < units; ++u) {
    EXPECT_TRUE(s.PreForward(u).ok());
    EXPECT_TRUE(s.PostForward(u).ok());
    log.forward.push_back(e.Take());
  }
  EXPECT_TRUE(s.PostForward(0).ok());
  EXPECT_TRUE(s.PreBackward(0).ok());
  log.backward.push_back(e.Take());
  for (int u = units - 1; u >= 1; --u) {
    EXPECT_TRUE(s.PreBackward(u).ok());
    EXPECT_TRUE(s.PostBackward(u, sync, all_reduce).ok());
    log.backward.push_back(e.Take());
  }
  EXPECT_TRUE(s.PostBackward(0, sync, all_reduce).ok());
  EXPECT_TRUE(s.FinishBackward().ok());
  log.finish = e.Take();
  return log;
}

UnitSchedule<FakeExec> Make(FakeExec* e, const ScheduleOptions& o, int units) {
  UnitSchedule<FakeExec> s(e, o);
  for (int u = 0; u < units; ++u) s.AddUnit();
  return s;
}

// FULL_SHARD, a root and 3 blocks, one unit ahead. The first step records the order and
// prefetches nothing; from the second on, each use tops the queue up to one unit ahead. The
// root and the last block stay gathered from forward into backward; every other block is
// given back after its forward and gathered again (prefetched) in backward.
TEST(UnitScheduleTest, FullShardPrefetchesOneUnitAheadFromTheSecondStep) {
  FakeExec e(4);
  auto s = Make(&e, Opts(ShardingStrategy::kFullShard, 1, 2, 1), 4);
  const StepLog first = Step(s, e, 4);
  // The last block is not known to be last yet: it is given back too.
  EXPECT_THAT(first.forward, ElementsAre("gather 0,use 0", "gather 1,use 1,free 1",
                                         "gather 2,use 2,free 2", "gather 3,use 3,free 3"));
  // Backward, recording its order: the root is still gathered, the blocks gathered on use.
  // The reduction queue holds up to one unit: the second one waits for the first.
  EXPECT_THAT(first.backward,
              ElementsAre("use 0,grad 0", "gather 3,use 3,grad 3,free 3,reduce 3",
                          "gather 2,use 2,grad 2,free 2,reduce 2,wait-reduce 3,land 3",
                          "gather 1,use 1,grad 1,free 1,reduce 1,wait-reduce 2,land 2"));
  EXPECT_EQ(first.finish, "free 0,reduce 0,wait-reduce 1,land 1,land 0");
  const StepLog second = Step(s, e, 4);
  EXPECT_THAT(second.forward,
              ElementsAre("gather 0,gather 1,use 0", "gather 2,use-prefetched 1,free 1",
                          "gather 3,use-prefetched 2,free 2", "use-prefetched 3"));
  // The root's PreBackward prefetches block 2 (block 3 was kept); block 2's use, block 1.
  EXPECT_THAT(second.backward,
              ElementsAre("gather 2,use 0,grad 0", "use 3,grad 3,free 3,reduce 3",
                          "gather 1,use-prefetched 2,grad 2,free 2,reduce 2,wait-reduce 3,land 3",
                          "use-prefetched 1,grad 1,free 1,reduce 1,wait-reduce 2,land 2"));
}

// Two units ahead: the queue is topped up to two gathers in flight.
TEST(UnitScheduleTest, TwoUnitsAhead) {
  FakeExec e(5);
  auto s = Make(&e, Opts(ShardingStrategy::kFullShard, 2, 2, 1), 5);
  Step(s, e, 5);
  const StepLog second = Step(s, e, 5);
  EXPECT_THAT(second.forward,
              ElementsAre("gather 0,gather 1,gather 2,use 0", "gather 3,use-prefetched 1,free 1",
                          "gather 4,use-prefetched 2,free 2", "use-prefetched 3,free 3",
                          "use-prefetched 4"));
  // Backward: 0 and 4 were kept; 3 and 2 are prefetched at the root's use, 1 when 3 is used.
  // Two reductions may be in flight.
  EXPECT_EQ(second.backward[0], "gather 3,gather 2,use 0,grad 0");
  EXPECT_EQ(second.backward[1], "use 4,grad 4,free 4,reduce 4");
  EXPECT_EQ(second.backward[2], "gather 1,use-prefetched 3,grad 3,free 3,reduce 3");
  EXPECT_EQ(second.backward[3],
            "use-prefetched 2,grad 2,free 2,reduce 2,wait-reduce 4,land 4");
}

// Without prefetch, every gather happens at its use.
TEST(UnitScheduleTest, NoPrefetchGathersAtUse) {
  FakeExec e(3);
  auto s = Make(&e, Opts(ShardingStrategy::kFullShard, 0, 4, 1), 3);
  Step(s, e, 3);
  const StepLog second = Step(s, e, 3);
  EXPECT_THAT(second.forward,
              ElementsAre("gather 0,use 0", "gather 1,use 1,free 1", "gather 2,use 2"));
}

// SHARD_GRAD_OP keeps every unit gathered from forward to the end of backward: nothing is
// gathered in backward.
TEST(UnitScheduleTest, ShardGradOpGathersOnlyInForward) {
  FakeExec e(4);
  auto s = Make(&e, Opts(ShardingStrategy::kShardGradOp, 1, 2, 1), 4);
  Step(s, e, 4);
  const StepLog second = Step(s, e, 4);
  for (const std::string& b : second.backward) {
    EXPECT_EQ(b.find("gather"), std::string::npos) << b;
  }
  EXPECT_EQ(second.forward[1], "gather 2,use-prefetched 1");  // no free after forward
}

// A shard group of one (NO_SHARD, or one rank): nothing is prefetched.
TEST(UnitScheduleTest, NoShardNeverPrefetches) {
  FakeExec e(3);
  auto s = Make(&e, Opts(ShardingStrategy::kNoShard, 1, 1, 4), 3);
  Step(s, e, 3);
  const StepLog second = Step(s, e, 3);
  EXPECT_THAT(second.forward, ElementsAre("gather 0,use 0", "gather 1,use 1", "gather 2,use 2"));
}

// HYBRID: a reduction goes on to the replica group. On a host backend it moves on when the
// shard group's queue is over its limit; on a device at once (its streams order the work).
TEST(UnitScheduleTest, HybridMovesReductionsToTheReplicas) {
  FakeExec host(3);
  auto s = Make(&host, Opts(ShardingStrategy::kHybridShard, 1, 2, 2), 3);
  Step(s, host, 3);
  const StepLog h = Step(s, host, 3);
  EXPECT_EQ(h.backward[1], "use 2,grad 2,free 2,reduce 2");
  EXPECT_EQ(h.backward[2],
            "use-prefetched 1,grad 1,free 1,reduce 1,wait-reduce 2,replica-reduce 2");
  EXPECT_EQ(h.finish,
            "free 0,reduce 0,wait-reduce 1,replica-reduce 1,wait-reduce 2,land-replica 2,"
            "replica-reduce 0,land-replica 1,land-replica 0");
  FakeExec device(3, /*host=*/false);
  auto d = Make(&device, Opts(ShardingStrategy::kHybridShard, 1, 2, 2), 3);
  Step(d, device, 3);
  const StepLog dl = Step(d, device, 3);
  EXPECT_EQ(dl.backward[1], "use 2,grad 2,free 2,reduce 2,replica-reduce 2");
}

// A quantized reduction across replicas has two collectives: the replicas' all_to_all
// ("replica-reduce"), then the all_gather of their chunks ("replica-gather"), a third queue
// moved on as the others: on a host backend when over its limit, on a device at once; NO_SHARD's
// only stage is the all_to_all.
TEST(UnitScheduleTest, QuantizedReplicasGatherAfterTheirExchange) {
  ScheduleOptions o = Opts(ShardingStrategy::kHybridShard, 1, 2, 2);
  o.two_phase_replicas = true;
  FakeExec host(3);
  auto s = Make(&host, o, 3);
  Step(s, host, 3);
  const StepLog h = Step(s, host, 3);
  EXPECT_EQ(h.backward[2],
            "use-prefetched 1,grad 1,free 1,reduce 1,wait-reduce 2,replica-reduce 2");
  EXPECT_EQ(h.finish,
            "free 0,reduce 0,wait-reduce 1,replica-reduce 1,wait-reduce 2,replica-gather 2,"
            "replica-reduce 0,replica-gather 1,replica-gather 0,land-replica 2,land-replica 1,"
            "land-replica 0");
  FakeExec device(3, /*host=*/false);
  auto d = Make(&device, o, 3);
  Step(d, device, 3);
  const StepLog dl = Step(d, device, 3);
  EXPECT_EQ(dl.backward[1], "use 2,grad 2,free 2,reduce 2,replica-reduce 2,replica-gather 2");
  ScheduleOptions n = Opts(ShardingStrategy::kNoShard, 1, 1, 3);
  n.two_phase_replicas = true;
  FakeExec ddp(2);
  auto ns = Make(&ddp, n, 2);
  Step(ns, ddp, 2);
  const StepLog nl = Step(ns, ddp, 2);
  EXPECT_EQ(nl.backward[1], "use 1,grad 1,free 1,reduce 1");
  EXPECT_EQ(nl.finish,
            "free 0,reduce 0,wait-reduce 1,replica-gather 1,replica-gather 0,land-replica 1,"
            "land-replica 0");
}

// HYBRID without the replica all-reduce (requires_all_reduce off): each backward reduces in
// the shard group and lands the shard; the next backward with it on carries what landed.
TEST(UnitScheduleTest, HybridAccumulatesShardsAndAllReducesOnce) {
  for (bool host : {true, false}) {
    SCOPED_TRACE(host ? "host" : "device");
    FakeExec e(3, host);
    auto s = Make(&e, Opts(ShardingStrategy::kHybridShard, 1, 2, 2), 3);
    Step(s, e, 3);
    for (int micro = 0; micro < 2; ++micro) {
      const StepLog log = Step(s, e, 3, /*sync=*/true, /*all_reduce=*/false);
      std::string all = log.finish;
      for (const std::string& b : log.backward) all += "," + b;
      EXPECT_EQ(all.find("replica"), std::string::npos) << all;
      EXPECT_NE(log.finish.find("land 0"), std::string::npos) << log.finish;
      EXPECT_TRUE(s.replica_pending(0) && s.replica_pending(1) && s.replica_pending(2));
    }
    e.CompleteAll();
    const StepLog last = Step(s, e, 3);
    EXPECT_NE(last.finish.find("replica-reduce+accumulated 0"), std::string::npos)
        << last.finish;
    EXPECT_NE(last.finish.find("land-replica 0"), std::string::npos) << last.finish;
    EXPECT_EQ(last.finish.find("replica-reduce 0"), std::string::npos) << last.finish;
    EXPECT_FALSE(s.replica_pending(0) || s.replica_pending(1) || s.replica_pending(2));
    // Without replicas (FULL_SHARD) the switch changes nothing: the shard lands, nothing waits.
    FakeExec f(2, host);
    auto full = Make(&f, Opts(ShardingStrategy::kFullShard, 1, 2, 1), 2);
    Step(full, f, 2, /*sync=*/true, /*all_reduce=*/false);
    EXPECT_FALSE(full.replica_pending(0) || full.replica_pending(1));
  }
}

// no_sync: backward passes accumulate locally; the last one with sync reduces.
TEST(UnitScheduleTest, AccumulationReducesOnlyWithSync) {
  FakeExec e(3);
  auto s = Make(&e, Opts(ShardingStrategy::kFullShard, 1, 2, 1), 3);
  const StepLog local = Step(s, e, 3, /*sync=*/false);
  for (const std::string& b : local.backward) {
    EXPECT_EQ(b.find("reduce"), std::string::npos) << b;
  }
  EXPECT_TRUE(s.unsynced(0) && s.unsynced(1) && s.unsynced(2));
  const StepLog synced = Step(s, e, 3);
  EXPECT_FALSE(s.unsynced(0) || s.unsynced(1) || s.unsynced(2));
  EXPECT_NE(synced.finish.find("land 0"), std::string::npos) << synced.finish;
}

// A single rank reduces nothing: the gradient lands in the shard at once.
TEST(UnitScheduleTest, SingleRankAccumulatesAtOnce) {
  FakeExec e(2);
  e.set_single_rank();
  auto s = Make(&e, Opts(ShardingStrategy::kFullShard, 1, 1, 1), 2);
  const StepLog log = Step(s, e, 2);
  EXPECT_EQ(log.backward[1], "gather 1,use 1,grad 1,free 1,accumulate 1");
  EXPECT_EQ(s.reduction(1), Reduction::kNone);
}

// A forward without backward (evaluation) gives everything back and keeps the order.
TEST(UnitScheduleTest, ForwardOnlyGivesEverythingBack) {
  FakeExec e(3);
  auto s = Make(&e, Opts(ShardingStrategy::kShardGradOp, 1, 2, 1), 3);
  for (int u = 0; u < 3; ++u) {
    ASSERT_TRUE(s.PreForward(u).ok());
    ASSERT_TRUE(s.PostForward(u).ok());
  }
  e.Take();
  s.FinishForwardOnly();
  EXPECT_EQ(e.Take(), "free 0,free 1,free 2");
  EXPECT_TRUE(s.forward_recorded());
  for (int u = 0; u < 3; ++u) EXPECT_EQ(s.state(u), UnitState::kIdle);
  ASSERT_TRUE(s.PreForward(0).ok());
  EXPECT_EQ(e.Take(), "gather 0,gather 1,use 0");  // the recorded order prefetches
}

// A secondary shard (hpZ): each unit resharded after forward keeps its part first; the two
// units kept gathered into backward keep none. Without the option nothing is kept.
TEST(UnitScheduleTest, SecondaryShardIsKeptWhereForwardReshards) {
  for (int n : {0, 2}) {
    SCOPED_TRACE(n);
    FakeExec e(4);
    ScheduleOptions o = Opts(ShardingStrategy::kFullShard, 1, 4, 1);
    o.secondary_shard_size = n;
    auto s = Make(&e, o, 4);
    Step(s, e, 4);  // records the orders
    const StepLog log = Step(s, e, 4);
    EXPECT_EQ(log.forward[1], n ? "gather 2,use-prefetched 1,keep 1,free 1"
                                : "gather 2,use-prefetched 1,free 1");
    EXPECT_EQ(log.forward[2], n ? "gather 3,use-prefetched 2,keep 2,free 2"
                                : "gather 3,use-prefetched 2,free 2");
    EXPECT_EQ(log.forward[3], "use-prefetched 3");  // the last unit stays gathered into backward
    // Backward regathers units 2 and 1 (the executor gathers them from their secondary shards).
    EXPECT_THAT(log.backward, ::testing::Contains(::testing::HasSubstr("gather 1")));
  }
  // SHARD_GRAD_OP keeps the whole unit: no secondary shard is asked for.
  FakeExec e(3);
  ScheduleOptions o = Opts(ShardingStrategy::kShardGradOp, 1, 4, 1);
  o.secondary_shard_size = 2;
  auto s = Make(&e, o, 3);
  const StepLog log = Step(s, e, 3);
  for (const std::string& f : log.forward) EXPECT_THAT(f, ::testing::Not(::testing::HasSubstr("keep")));
}

// A forward without backward gives the secondary shards back with the gathered units.
TEST(UnitScheduleTest, ForwardOnlyDropsSecondaryShards) {
  FakeExec e(3);
  ScheduleOptions o = Opts(ShardingStrategy::kFullShard, 0, 4, 1);
  o.secondary_shard_size = 2;
  auto s = Make(&e, o, 3);
  for (int u = 0; u < 3; ++u) {
    ASSERT_TRUE(s.PreForward(u).ok());
    ASSERT_TRUE(s.PostForward(u).ok());
  }
  // The root stays gathered (it runs again at the head); in the first pass the last unit is
  // not known yet, so it reshards too.
  EXPECT_EQ(e.Take(), "gather 0,use 0,gather 1,use 1,keep 1,free 1,gather 2,use 2,keep 2,free 2");
  s.FinishForwardOnly();
  EXPECT_EQ(e.Take(), "free 0,drop 1,drop 2");
}

}  // namespace
}  // namespace fsdp::internal
