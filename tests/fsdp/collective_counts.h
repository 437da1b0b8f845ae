// How many all-gathers, reduce-scatters and all-reduces each forward, each backward and each
// Step() issues, per group, read from the communicators' own counters (Communicator::issued),
// against the numbers each strategy is meant to issue (docs/sharding.md). Loss parity cannot
// see a collective too many: an extra gather, or a reduction across replicas on every
// micro-batch, computes the same numbers and only costs time. Shared by the test with ranks as
// threads and the one under mpirun.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "fsdp/communicator.h"
#include "fsdp/nn/sharded_model.h"
#include "fsdp/sharding.h"
#include "gtest/gtest.h"
#include "tests/fsdp/parity_util.h"

namespace fsdp::testing {

// Collectives issued on one group over some interval.
struct Issued {
  int64_t all_gather = 0, reduce_scatter = 0, all_reduce = 0;
  int64_t other = 0;  // broadcast, barrier: the runtime's hooks and step issue none
  bool operator==(const Issued&) const = default;
  Issued operator-(const Issued& o) const {
    return {all_gather - o.all_gather, reduce_scatter - o.reduce_scatter,
            all_reduce - o.all_reduce, other - o.other};
  }
  Issued operator+(const Issued& o) const {
    return {all_gather + o.all_gather, reduce_scatter + o.reduce_scatter,
            all_reduce + o.all_reduce, other + o.other};
  }
};
inline Issued IssuedOn(const Communicator& c) {
  return {c.issued(CollectiveKind::kAllGather), c.issued(CollectiveKind::kReduceScatter),
          c.issued(CollectiveKind::kAllReduce),
          c.issued(CollectiveKind::kBroadcast) + c.issued(CollectiveKind::kBarrier)};
}
inline std::string Describe(const Issued& i) {
  return absl::StrCat("all_gather ", i.all_gather, ", reduce_scatter ", i.reduce_scatter,
                      ", all_reduce ", i.all_reduce, ", broadcast/barrier ", i.other);
}

// The three groups a runtime talks over: its shard group, its replicate group and the world
// (the control plane: nothing of a training step may go there).
struct GroupsIssued {
  Issued shard, replicate, world;
  bool operator==(const GroupsIssued&) const = default;
  GroupsIssued operator-(const GroupsIssued& o) const {
    return {shard - o.shard, replicate - o.replicate, world - o.world};
  }
  GroupsIssued operator+(const GroupsIssued& o) const {
    return {shard + o.shard, replicate + o.replicate, world + o.world};
  }
};
inline GroupsIssued IssuedBy(const ShardingRuntime& rt) {
  return {IssuedOn(rt.shard_group()), IssuedOn(rt.replicate_group()), IssuedOn(rt.world())};
}
inline std::string Describe(const GroupsIssued& g) {
  return absl::StrCat("shard group {", Describe(g.shard), "}; replicate group {",
                      Describe(g.replicate), "}; world {", Describe(g.world), "}");
}

struct CountCase {
  ShardingStrategy strategy = ShardingStrategy::kFullShard;
  int world = 2;
  int hybrid_shard = 0;    // S of the HYBRID strategies
  int prefetch = 1;        // 0: forward_prefetch and backward_prefetch off; else max_prefetch_units
  int micro_batches = 1;   // > 1: accumulated as `accumulation` says
  Accumulation accumulation = Accumulation::kNoSync;
  bool checkpoint = false; // checkpoint_every = 1: every block recomputed in backward
  int layers = 4;          // L blocks of nano's width: U = L + 1 units with the root
};

inline std::string CountCaseName(const CountCase& c) {
  std::string name = std::string(StrategyName(c.strategy));
  absl::StrAppend(&name, "_N", c.world);
  if (c.hybrid_shard > 0) absl::StrAppend(&name, "_S", c.hybrid_shard);
  absl::StrAppend(&name, c.prefetch == 0 ? "_noprefetch" : absl::StrCat("_prefetch", c.prefetch),
                  "_accum", c.micro_batches, c.checkpoint ? "_ckpt" : "");
  if (c.accumulation != Accumulation::kNoSync) {
    absl::StrAppend(&name, "_", std::string(AccumulationName(c.accumulation)));
  }
  return name;
}

// The mesh of the strategy: R x S.
inline int ShardSize(const CountCase& c) {
  switch (c.strategy) {
    case ShardingStrategy::kNoShard: return 1;
    case ShardingStrategy::kHybridShard:
    case ShardingStrategy::kHybridShardGradOp: return c.hybrid_shard;
    default: return c.world;
  }
}
inline int ReplicaCount(const CountCase& c) { return c.world / ShardSize(c); }
inline bool ReshardsAfterForward(const CountCase& c) {
  return c.strategy == ShardingStrategy::kFullShard || c.strategy == ShardingStrategy::kHybridShard;
}

// The formulas, for U = L + 1 units (the root unit: embeddings, final norm and the tied head;
// one unit per block), a shard group of S ranks and a replicate group of R (FULL_SHARD and
// SHARD_GRAD_OP: 1 x N; NO_SHARD: N x 1; HYBRID: N/S x S), f32 parameters. Prefetch depth
// and activation checkpointing change none of them: a prefetch issues the gather of a unit
// that is about to be used earlier, never one more; a checkpointed block recomputes its
// forward on the parameters its PreBackward gathered, it does not gather them again.
//
// Forward, every micro-batch: shard-group all-gathers = U when S > 1, else 0 (no gather on a
// shard group of one: the shard is the unit). Every unit was given back by the previous
// backward (PostBackward frees each unit, the root and the last block included).
inline GroupsIssued ExpectedForward(const CountCase& c, int units) {
  GroupsIssued e;
  if (ShardSize(c) > 1) e.shard.all_gather = units;
  return e;
}
// Backward:
// - shard-group all-gathers: 0 when S == 1 or when the strategy keeps the units gathered from
//   forward to backward (SHARD_GRAD_OP, HYBRID_SHARD_GRAD_OP). FULL_SHARD and HYBRID_SHARD
//   keep two units from forward into backward, the root (first in forward, its head starts
//   backward) and the last block (whose backward comes first), and regather the other
//   U - 2 blocks. The first backward of a run regathers U - 1: the units' order is learnt
//   during the first forward, so the last block's PostForward does not know yet that it is
//   the last and frees it.
// - shard-group reduce-scatters: U on a backward with sync on when S > 1, else 0.
// - replicate-group all-reduces: U on a backward with sync on when R > 1, else 0 (NO_SHARD:
//   the unsharded gradient; HYBRID: the shard the reduce-scatter produced, once per unit),
//   except HYBRID (S > 1) with requires_all_reduce off: 0, the shards accumulate until a
//   backward with it on, whose U all-reduces carry them.
// - with sync off (no_sync): no reduction at all, on any group; the gradients accumulate.
inline GroupsIssued ExpectedBackward(const CountCase& c, int units, bool first_backward,
                                     bool sync, bool all_reduce = true) {
  GroupsIssued e;
  if (ShardSize(c) > 1 && ReshardsAfterForward(c)) {
    e.shard.all_gather = first_backward ? units - 1 : units - 2;
  }
  if (sync) {
    if (ShardSize(c) > 1) e.shard.reduce_scatter = units;
    if (ReplicaCount(c) > 1 && (all_reduce || ShardSize(c) == 1)) {
      e.replicate.all_reduce = units;
    }
  }
  return e;
}
// Step(): one shard-group all-gather when S > 1 (each rank's sum of squares of its gradient
// shards, for the global norm; replicas hold equal shards, so nothing crosses the replicate
// group) and nothing else: no reduction, no loss averaging (the caller's MeanOverRanks does
// that over the world, when it wants the mean loss).
inline GroupsIssued ExpectedStep(const CountCase& c) {
  GroupsIssued e;
  if (ShardSize(c) > 1) e.shard.all_gather = 1;
  return e;
}

inline void ExpectIssued(const GroupsIssued& got, const GroupsIssued& want,
                         const std::string& where) {
  EXPECT_EQ(got, want) << where << ":\n  issued   " << Describe(got) << "\n  expected "
                       << Describe(want);
}

// Trains `steps` steps of `c` on `comm`'s ranks (CPU backend: the data plane is the groups'
// own communicators) and checks every forward, backward and Step() against the formulas
// above, and each step's total against their sum.
inline absl::Status CheckCollectiveCounts(Communicator& comm, const CountCase& c, int steps = 2) {
  nn::GptConfig config = *nn::GptConfig::FromName("nano");
  config.num_layers = c.layers;
  FSDP_ASSIGN_OR_RETURN(auto backend, MakeTestBackend(1, 0, "cpu"));
  nn::ShardedModelOptions o;
  o.sharding.strategy = c.strategy;
  o.sharding.hybrid_shard_size = c.hybrid_shard;
  o.sharding.forward_prefetch = o.sharding.backward_prefetch = c.prefetch > 0;
  if (c.prefetch > 0) o.sharding.max_prefetch_units = c.prefetch;
  o.sharding.max_grad_norm = 1.0f;
  o.batch_size = 1;
  o.seq_len = 8;
  o.checkpoint_every = c.checkpoint ? 1 : 0;
  FSDP_ASSIGN_OR_RETURN(auto model, nn::ShardedModel::Create(config, backend.get(), comm, o));
  ShardingRuntime& rt = model->runtime();
  const int units = rt.num_units();
  TrainSpec spec;
  spec.batch_size = o.batch_size;
  spec.seq_len = o.seq_len;
  spec.micro_batches = c.micro_batches;
  const std::string name = absl::StrCat(CountCaseName(c), " rank ", comm.rank());
  bool first_backward = true;
  for (int s = 0; s < steps; ++s) {
    const GroupsIssued at_step = IssuedBy(rt);
    GroupsIssued want_step;
    for (int j = 0; j < c.micro_batches; ++j) {
      ConfigureMicroBatch(rt, c.accumulation, j, c.micro_batches);
      const bool sync = rt.sync_gradients();
      nn::Batch b = RankBatch(spec, comm.rank(), comm.size(), s, j);
      const std::string where = absl::StrCat(name, " step ", s, " micro-batch ", j,
                                             sync ? "" : " (no_sync)");
      const GroupsIssued before = IssuedBy(rt);
      FSDP_RETURN_IF_ERROR(model->TrainForward(b.inputs.data(), b.targets.data()).status());
      const GroupsIssued after_forward = IssuedBy(rt);
      FSDP_RETURN_IF_ERROR(model->Backward());
      const GroupsIssued after_backward = IssuedBy(rt);
      const GroupsIssued fwd = ExpectedForward(c, units);
      const GroupsIssued bwd =
          ExpectedBackward(c, units, first_backward, sync, rt.requires_all_reduce());
      ExpectIssued(after_forward - before, fwd, where + " forward");
      ExpectIssued(after_backward - after_forward, bwd, where + " backward");
      want_step = want_step + fwd + bwd;
      first_backward = false;
    }
    const GroupsIssued before_step = IssuedBy(rt);
    FSDP_RETURN_IF_ERROR(model->Step(1e-3f).status());
    ExpectIssued(IssuedBy(rt) - before_step, ExpectedStep(c), absl::StrCat(name, " step ", s,
                                                                            " Step()"));
    want_step = want_step + ExpectedStep(c);
    ExpectIssued(IssuedBy(rt) - at_step, want_step, absl::StrCat(name, " step ", s, " in all"));
  }
  return absl::OkStatus();
}

}  // namespace fsdp::testing
