// The projection (fsdp/project.h): the replay of a step against timelines worked out by hand,
// the collectives' costs against the simulated link's and the ring's formulas, the profile of
// a measured run, bad input, and fsdp_bench --project / --validate_projection. One file
// (about 710 lines): the hand-worked timelines and the CLI cases share its helpers.
#include "fsdp/project.h"

#include <sys/wait.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "fsdp/bench.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/bench/cli_util.h"
#include "tests/sanitizer.h"

namespace fsdp {
namespace {

#ifdef FSDP_BENCH_BINARY
using testing::Ran;
using testing::ExpectUsageError;
using testing::RunCli;
#endif
using testing::UnderSanitizer;

// Two blocks, every unit 400 f32 elements (divisible by 2 and 4: no padding), forward 2 s and
// backward 3 s per block, optimizer 0.5 s, nothing else.
StepProfile TwoBlocks() {
  StepProfile p;
  p.unit_numel = {400, 400, 400};
  p.block_forward_s = {2, 2};
  p.block_backward_s = {3, 3};
  p.block_recompute_s = {0, 0};
  p.optimizer_s = 0.5;
  p.tokens_per_rank = 100;
  return p;
}

// One level, 800 bytes/s, no latency: a gather or reduce-scatter of a unit on 2 ranks moves a
// chunk of 800 bytes to the one peer, 1 s.
LinkSpec OneSecondPerUnit() {
  LinkSpec l;
  l.intra_bytes_per_s = 800;
  return l;
}

ProjectionRun MakeRun(ShardingStrategy s, int world, bool prefetch) {
  ProjectionRun r;
  r.strategy = s;
  r.world_size = world;
  r.prefetch = prefetch;
  return r;
}

TEST(ProjectStep, FreeLinkIsTheCompute) {
  for (ShardingStrategy s : {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp,
                             ShardingStrategy::kNoShard, ShardingStrategy::kHybridShard}) {
    for (bool prefetch : {false, true}) {
      LinkSpec free;
      free.ranks_per_host = 2;
      absl::StatusOr<Projection> p = ProjectStep(TwoBlocks(), free, MakeRun(s, 4, prefetch));
      ASSERT_TRUE(p.ok()) << p.status();
      EXPECT_DOUBLE_EQ(p->step_s, 10.5);
      EXPECT_DOUBLE_EQ(p->compute_s, 10.5);
      EXPECT_DOUBLE_EQ(p->exposed_comm_s, 0);
      EXPECT_DOUBLE_EQ(p->tokens_per_s, 4 * 100 / 10.5);
    }
  }
}

// FULL_SHARD on 2 ranks without prefetch, worked out by hand (times in s):
//   forward: gather root [0,1], block 0 [1,2], compute 2-4, block 1 [4,5], compute 5-7 (the
//   root and the last block stay gathered); backward: block 1 7-10, reduce-scatter [10,11];
//   block 0's gather is issued at 10 behind it, [11,12] (2 s waited), compute 12-15,
//   reduce-scatter [15,16]; the root's queues behind, [16,17]: the runtime waits for the
//   older one (1 s), then drains (1 s); the norm's all_gather (8 bytes) 0.01 s; optimizer.
TEST(ProjectStep, WithoutPrefetchEveryTransferIsWaitedFor) {
  absl::StatusOr<Projection> p =
      ProjectStep(TwoBlocks(), OneSecondPerUnit(), MakeRun(ShardingStrategy::kFullShard, 2, false));
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_NEAR(p->exposed_comm_s, 7.01, 1e-12);
  EXPECT_NEAR(p->step_s, 17.51, 1e-12);
  EXPECT_NEAR(p->step_s, p->compute_s + p->exposed_comm_s, 1e-12);
  // 4 gathers, 3 reduce-scatters and the norm's gather.
  ASSERT_EQ(p->collectives.size(), 8u);
  EXPECT_NEAR(p->comm_total_s, 7.01, 1e-12);
  EXPECT_NEAR(p->comm_busy_s, 7.01, 1e-12);
  // Bus bytes as BenchResult counts them: S (n-1)/n per collective.
  EXPECT_NEAR(p->bus_bytes_per_rank, 7 * 1600 / 2.0 + 16 / 2.0, 1e-9);
  EXPECT_NEAR(p->comm_bytes_per_rank, 7 * 1600 + 16, 1e-9);
}

// With prefetch: the next unit's gather is issued before this one's compute and overlaps it.
//   forward: root [0,1] and block 0 [1,2] issued at once (2 s waited), block 1 [2,3] during
//   block 0's compute (2-4), block 1 computes 4-6; backward: block 0's gather [6,7] issued at
//   the head, hidden by block 1's backward (6-9); reduce-scatters [9,10], [12,13], the root's
//   [13,14]: 1 s waited for the older, 1 s drained; the norm 0.01 s.
TEST(ProjectStep, PrefetchOverlapsTheNextGather) {
  absl::StatusOr<Projection> p =
      ProjectStep(TwoBlocks(), OneSecondPerUnit(), MakeRun(ShardingStrategy::kFullShard, 2, true));
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_NEAR(p->exposed_comm_s, 4.01, 1e-12);
  EXPECT_NEAR(p->step_s, 14.51, 1e-12);
  // The same bytes as without prefetch.
  EXPECT_EQ(p->collectives.size(), 8u);
  // SHARD_GRAD_OP keeps every unit gathered from forward into backward: no gathers in backward.
  absl::StatusOr<Projection> sgo = ProjectStep(TwoBlocks(), OneSecondPerUnit(),
                                               MakeRun(ShardingStrategy::kShardGradOp, 2, true));
  ASSERT_TRUE(sgo.ok()) << sgo.status();
  EXPECT_EQ(sgo->collectives.size(), 7u);
  EXPECT_NEAR(sgo->step_s, 14.51, 1e-12);  // the backward gather was hidden anyway
}

// HYBRID_SHARD on 2 hosts of 2 ranks: free inside a host, 448 bytes/s between hosts. Each
// unit's replica all_reduce moves its 200-element shard in two phases of a 112-element slice
// (100 rounded up to 64 bytes) to the one peer: 2 x 448 / 448 = 2 s. A host backend moves a
// reduction on (issues its all_reduce) only when a later unit's gradient comes, so the three
// all_reduces run back to back after the last backward and are all waited for: 6 s.
TEST(ProjectStep, HybridAllReducesAcrossHosts) {
  LinkSpec l;
  l.ranks_per_host = 2;
  l.inter_bytes_per_s = 448;
  absl::StatusOr<double> a = CollectiveSeconds(CollectiveKind::kAllReduce, 800, 4, {0, 2}, l);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_DOUBLE_EQ(*a, 2.0);
  for (bool prefetch : {false, true}) {
    absl::StatusOr<Projection> p =
        ProjectStep(TwoBlocks(), l, MakeRun(ShardingStrategy::kHybridShard, 4, prefetch));
    ASSERT_TRUE(p.ok()) << p.status();
    EXPECT_EQ(p->shard_size, 2);
    EXPECT_EQ(p->replicate_size, 2);
    EXPECT_NEAR(p->exposed_comm_s, 6.0, 1e-12);
    EXPECT_NEAR(p->step_s, 16.5, 1e-12);
    int all_reduces = 0;
    for (const ProjectedCollective& c : p->collectives) {
      if (c.kind == "all_reduce") {
        ++all_reduces;
        EXPECT_EQ(c.group, "replicate");
        EXPECT_EQ(c.bytes, 800);
      }
    }
    EXPECT_EQ(all_reduces, 3);
  }
}

// K micro-batches per step, through the same schedule as the runtime (collective_counts_test
// counts the runtime's): no_sync reduces once, "sharded" reduce-scatters every micro-batch and
// all-reduces across replicas once, "every" does both every time. Compute is K micro-batches'
// plus one optimizer step, and the tokens are K micro-batches'.
// A quantized all-gather carries each rank's codes (its 200 elements, one byte each) and scales
// (one f32 per block of 64: 4 blocks) instead of 200 f32: 216 bytes a rank instead of 800, so
// on a link of 800 bytes/s each gather takes 0.27 s instead of 1 s and the step gets shorter.
TEST(ProjectStep, QuantizedAllGatherCarriesCodesAndScales) {
  const StepProfile profile = TwoBlocks();
  double step_s[2] = {0, 0};
  for (WireFormat f : {WireFormat::kDType, WireFormat::kInt8}) {
    ProjectionRun run = MakeRun(ShardingStrategy::kFullShard, 2, false);
    run.communication.all_gather = f;
    run.communication.block_size = 64;
    absl::StatusOr<Projection> p = ProjectStep(profile, OneSecondPerUnit(), run);
    ASSERT_TRUE(p.ok()) << p.status();
    int gathers = 0;
    for (const ProjectedCollective& c : p->collectives) {
      if (c.kind != "all_gather" || c.unit < 0) continue;
      ++gathers;
      EXPECT_EQ(c.bytes, f == WireFormat::kDType ? 1600 : 2 * 216) << "unit " << c.unit;
      EXPECT_NEAR(c.end_s - c.start_s, f == WireFormat::kDType ? 1.0 : 0.27, 1e-9);
    }
    EXPECT_GT(gathers, 0);
    step_s[f == WireFormat::kInt8] = p->step_s;
  }
  EXPECT_LT(step_s[1], step_s[0]);
  ProjectionRun bad = MakeRun(ShardingStrategy::kFullShard, 2, false);
  bad.communication.all_gather = WireFormat::kFp8E4M3;
  bad.communication.block_size = 7;
  EXPECT_THAT(std::string(ProjectStep(profile, OneSecondPerUnit(), bad).status().message()),
              ::testing::HasSubstr("communication.block_size is 7"));
}

// A secondary shard over the 2 ranks of each host: backward's regather (the one block not kept
// gathered) runs over the "secondary" group, inside the host, and the step gets shorter when the
// link between hosts is the slow one; forward's gathers stay on the shard group.
TEST(ProjectStep, SecondaryShardGathersBackwardInsideTheHost) {
  LinkSpec l;
  l.ranks_per_host = 2;
  l.intra_bytes_per_s = 1e6;
  l.inter_bytes_per_s = 400;
  double step_s[2] = {0, 0};
  for (int n : {0, 2}) {
    ProjectionRun run = MakeRun(ShardingStrategy::kFullShard, 4, false);
    run.secondary_shard_size = n;
    absl::StatusOr<Projection> p = ProjectStep(TwoBlocks(), l, run);
    ASSERT_TRUE(p.ok()) << p.status();
    int forward = 0, backward = 0;
    for (const ProjectedCollective& c : p->collectives) {
      if (c.kind != "all_gather" || c.unit < 0) continue;
      if (c.group == "secondary") {
        ++backward;
        EXPECT_EQ(c.unit, 1);
        EXPECT_EQ(c.bytes, 1600);  // the padded unit in f32, from 2 ranks
        EXPECT_LT(c.end_s - c.start_s, 0.01);
      } else {
        EXPECT_EQ(c.group, "shard");
        ++forward;
      }
    }
    EXPECT_EQ(backward, n ? 1 : 0);
    EXPECT_EQ(forward, n ? 3 : 4);  // each unit in forward (+ block 1 in backward without)
    step_s[n > 0] = p->step_s;
  }
  EXPECT_LT(step_s[1], step_s[0] - 1.0);
  ProjectionRun bad = MakeRun(ShardingStrategy::kFullShard, 4, false);
  bad.secondary_shard_size = 3;
  EXPECT_THAT(std::string(ProjectStep(TwoBlocks(), l, bad).status().message()),
              ::testing::HasSubstr("secondary_shard_size is 3"));
  bad.secondary_shard_size = 2;
  l.ranks_per_host = 1;
  EXPECT_THAT(std::string(ProjectStep(TwoBlocks(), l, bad).status().message()),
              ::testing::HasSubstr("a secondary group would span hosts"));
  bad.strategy = ShardingStrategy::kShardGradOp;
  EXPECT_THAT(std::string(ProjectStep(TwoBlocks(), l, bad).status().message()),
              ::testing::HasSubstr("FULL_SHARD and HYBRID_SHARD"));
}

TEST(ProjectStep, MicroBatchesAccumulateAsTheModeSays) {
  LinkSpec l;
  l.ranks_per_host = 2;
  l.inter_bytes_per_s = 448;
  const StepProfile profile = TwoBlocks();
  constexpr int kUnits = 3, kMicro = 4;
  struct Want {
    Accumulation mode;
    int reduce_scatters, all_reduces;
  };
  double sharded_s = 0, every_s = 0;
  for (Want w : {Want{Accumulation::kNoSync, kUnits, kUnits},
                 Want{Accumulation::kSharded, kMicro * kUnits, kUnits},
                 Want{Accumulation::kEvery, kMicro * kUnits, kMicro * kUnits}}) {
    SCOPED_TRACE(std::string(AccumulationName(w.mode)));
    ProjectionRun run = MakeRun(ShardingStrategy::kHybridShard, 4, true);
    run.micro_batches = kMicro;
    run.accumulation = w.mode;
    absl::StatusOr<Projection> p = ProjectStep(profile, l, run);
    ASSERT_TRUE(p.ok()) << p.status();
    int reduce_scatters = 0, all_reduces = 0;
    for (const ProjectedCollective& c : p->collectives) {
      reduce_scatters += c.kind == "reduce_scatter";
      all_reduces += c.kind == "all_reduce";
    }
    EXPECT_EQ(reduce_scatters, w.reduce_scatters);
    EXPECT_EQ(all_reduces, w.all_reduces);
    EXPECT_NEAR(p->compute_s, profile.compute_s() + (kMicro - 1) * (profile.compute_s() -
                                                                     profile.optimizer_s -
                                                                     profile.after_optimizer_s),
                1e-9);
    (w.mode == Accumulation::kSharded ? sharded_s : every_s) = p->step_s;
  }
  // Three fewer all-reduces of 2 s each across the hosts.
  EXPECT_LT(sharded_s, every_s);
  ProjectionRun bad = MakeRun(ShardingStrategy::kHybridShard, 4, true);
  bad.micro_batches = 0;
  absl::StatusOr<Projection> p = ProjectStep(profile, l, bad);
  EXPECT_NE(p.status().message().find("micro_batches=0: allowed: 1 to 1024"), std::string::npos)
      << p.status();
}

// ---- the bytes of every group shape ---------------------------------------------------------
// Units whose sizes do not divide by the shard group, bf16 gathers and f32 reductions: the
// root 1001 elements, the blocks 802 and 599 (TwoBlocks' times).
StepProfile PaddedUnits() {
  StepProfile p = TwoBlocks();
  p.unit_numel = {1001, 802, 599};
  p.param_dtype = DType::kBF16;
  p.reduce_dtype = DType::kF32;
  return p;
}

struct WantCollective {
  const char* kind;
  const char* group;
  int unit;
  int64_t bytes;
};

// The projected collectives against a list worked out by hand, and each one's time on NCCL's
// ring inside one host at 1000 bytes/s with no latency: nccl-tests' bus bytes over the bus
// bandwidth, (n-1)/n S for an all_gather or reduce_scatter and 2 (n-1)/n S for an all_reduce,
// n the size of the collective's own group (S for "shard", R for "replicate").
void ExpectCollectives(const Projection& p, const std::vector<WantCollective>& want, int S,
                       int R) {
  ASSERT_EQ(p.collectives.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    const ProjectedCollective& c = p.collectives[i];
    SCOPED_TRACE(absl::StrCat("collective ", i, ": ", c.kind, " ", c.group, " unit ", c.unit));
    EXPECT_EQ(c.kind, want[i].kind);
    EXPECT_EQ(c.group, want[i].group);
    EXPECT_EQ(c.unit, want[i].unit);
    EXPECT_EQ(c.bytes, want[i].bytes);
    const double n = std::string(want[i].group) == "shard" ? S : R;
    const double phases = std::string(want[i].kind) == "all_reduce" ? 2 : 1;
    EXPECT_NEAR(c.end_s - c.start_s, phases * (n - 1) / n * want[i].bytes / 1000.0, 1e-12);
  }
}

LinkSpec RingOfOneHost() {
  LinkSpec l;
  l.algorithm = CollectiveAlgorithm::kRing;
  l.intra_bytes_per_s = 1000;
  return l;
}

// HYBRID_SHARD on 8 ranks as R x S = 2 x 4 (hybrid_shard_size 4), without prefetch.
// Padded to a multiple of S = 4: 1001 -> 1004 (shard 251), 802 -> 804 (201), 599 -> 600 (150).
// Issue order: forward gathers the root, block 0, block 1 (the root and the last block stay
// gathered into backward); block 1's backward reduce-scatters it; block 0 is gathered again
// and reduce-scattered, which moves block 1's reduction on (its replica all_reduce: more than
// max(1, prefetch) = 1 held); the root's reduce-scatter moves block 0's on; the drain the
// root's; then the gradient norm's all_gather of an f32 pair per rank of the shard group.
//   all_gather (bf16, padded x 2):   2008 + 1608 + 1200 + 1608 = 6424 bytes
//   reduce_scatter (f32, padded x 4): 1200 x 2 = 2400, 3216, 4016 -> 9632 bytes
//   all_reduce of the shard (f32):    150 x 4 = 600, 804, 1004    -> 2408 bytes
//   the norm: 8 x S = 32 bytes
// comm bytes 6424 + 9632 + 2408 + 32 = 18496; bus bytes (S-1)/S = 3/4 of the shard group's
// 16088 = 12066, plus 2 (R-1)/R = 1 x 2408 of the replicate group's: 14474.
TEST(ProjectBytes, HybridTwoByFour) {
  ProjectionRun run = MakeRun(ShardingStrategy::kHybridShard, 8, false);
  run.hybrid_shard_size = 4;
  absl::StatusOr<Projection> p = ProjectStep(PaddedUnits(), RingOfOneHost(), run);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->shard_size, 4);
  EXPECT_EQ(p->replicate_size, 2);
  ExpectCollectives(*p,
                    {{"all_gather", "shard", 0, 2008},
                     {"all_gather", "shard", 1, 1608},
                     {"all_gather", "shard", 2, 1200},
                     {"reduce_scatter", "shard", 2, 2400},
                     {"all_gather", "shard", 1, 1608},
                     {"reduce_scatter", "shard", 1, 3216},
                     {"all_reduce", "replicate", 2, 600},
                     {"reduce_scatter", "shard", 0, 4016},
                     {"all_reduce", "replicate", 1, 804},
                     {"all_reduce", "replicate", 0, 1004},
                     {"all_gather", "shard", -1, 32}},
                    4, 2);
  EXPECT_DOUBLE_EQ(p->comm_bytes_per_rank, 18496);
  EXPECT_DOUBLE_EQ(p->bus_bytes_per_rank, 14474);
}

// The same world as R x S = 4 x 2 (hybrid_shard_size 2). Padded to a multiple of 2: 1001 ->
// 1002 (shard 501), 802 (401), 599 -> 600 (300); the same issue order.
//   all_gather (bf16):     2004 + 1604 + 1200 + 1604 = 6412 bytes
//   reduce_scatter (f32):  2400 + 3208 + 4008       = 9616 bytes
//   all_reduce (f32):      1200 + 1604 + 2004       = 4808 bytes
//   the norm: 8 x 2 = 16 bytes
// comm bytes 6412 + 9616 + 4808 + 16 = 20852; bus bytes (S-1)/S = 1/2 of 16044 = 8022, plus
// 2 (R-1)/R = 3/2 of 4808 = 7212: 15234.
TEST(ProjectBytes, HybridFourByTwo) {
  ProjectionRun run = MakeRun(ShardingStrategy::kHybridShard, 8, false);
  run.hybrid_shard_size = 2;
  absl::StatusOr<Projection> p = ProjectStep(PaddedUnits(), RingOfOneHost(), run);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->shard_size, 2);
  EXPECT_EQ(p->replicate_size, 4);
  ExpectCollectives(*p,
                    {{"all_gather", "shard", 0, 2004},
                     {"all_gather", "shard", 1, 1604},
                     {"all_gather", "shard", 2, 1200},
                     {"reduce_scatter", "shard", 2, 2400},
                     {"all_gather", "shard", 1, 1604},
                     {"reduce_scatter", "shard", 1, 3208},
                     {"all_reduce", "replicate", 2, 1200},
                     {"reduce_scatter", "shard", 0, 4008},
                     {"all_reduce", "replicate", 1, 1604},
                     {"all_reduce", "replicate", 0, 2004},
                     {"all_gather", "shard", -1, 16}},
                    2, 4);
  EXPECT_DOUBLE_EQ(p->comm_bytes_per_rank, 20852);
  EXPECT_DOUBLE_EQ(p->bus_bytes_per_rank, 15234);
}

// NO_SHARD on 8 ranks: R x S = 8 x 1. Nothing is padded or gathered (a bf16 copy of a whole
// unit is a local cast), there is no norm all_gather (every rank holds every gradient), and
// each unit's f32 gradient is all-reduced over the 8 replicas as its backward ends, in
// backward order: 599 x 4 = 2396, 802 x 4 = 3208, 1001 x 4 = 4004, 9608 bytes in all; bus
// bytes 2 (R-1)/R = 7/4 of it: 16814.
TEST(ProjectBytes, NoShard) {
  for (bool prefetch : {false, true}) {
    absl::StatusOr<Projection> p = ProjectStep(PaddedUnits(), RingOfOneHost(),
                                               MakeRun(ShardingStrategy::kNoShard, 8, prefetch));
    ASSERT_TRUE(p.ok()) << p.status();
    EXPECT_EQ(p->shard_size, 1);
    EXPECT_EQ(p->replicate_size, 8);
    ExpectCollectives(*p,
                      {{"all_reduce", "replicate", 2, 2396},
                       {"all_reduce", "replicate", 1, 3208},
                       {"all_reduce", "replicate", 0, 4004}},
                      1, 8);
    EXPECT_DOUBLE_EQ(p->comm_bytes_per_rank, 9608);
    EXPECT_DOUBLE_EQ(p->bus_bytes_per_rank, 16814);
  }
}

// The runtime moves the bytes the projection counts: nano trained on 8 ranks as threads as
// 2 x 4, 4 x 2 and NO_SHARD, each rank's measured collectives (the tracer's "comm" spans, with
// the size of their own group) against the projection of the same run. 2 x 4 and 4 x 2 tell
// a replicate group counted with the shard group's size apart from the right one.
TEST(ProjectBytes, MeasuredRunsMoveTheProjectedBytes) {
  const nn::ModelConfig mc = *nn::ModelConfig::FromName("nano");
  struct Shape {
    ShardingStrategy strategy;
    int shard;
    DType reduce;
  };
  for (const Shape& s : {Shape{ShardingStrategy::kHybridShard, 4, DType::kF32},
                         Shape{ShardingStrategy::kHybridShard, 2, DType::kBF16},
                         Shape{ShardingStrategy::kNoShard, 0, DType::kF32}}) {
    BenchConfig c;
    c.model = "nano";
    c.strategy = s.strategy;
    c.hybrid_shard_size = s.shard;
    c.world_size = 8;
    c.batch_size = 1;
    c.seq_len = 16;
    c.param_dtype = DType::kBF16;
    c.reduce_dtype = s.reduce;
    c.threads_per_rank = 1;
    c.warmup_steps = 1;
    c.steps = 2;
    c.peak_gflops_per_core = 50;
    absl::StatusOr<BenchResult> r = RunBench(c);
    ASSERT_TRUE(r.ok()) << r.status();
    absl::StatusOr<StepProfile> p = ProfileFromBench(*r, mc);
    ASSERT_TRUE(p.ok()) << p.status();
    ProjectionRun run = MakeRun(s.strategy, 8, true);
    run.hybrid_shard_size = s.shard;
    absl::StatusOr<Projection> proj = ProjectStep(*p, SimulatedLink(c.link), run);
    ASSERT_TRUE(proj.ok()) << proj.status();
    SCOPED_TRACE(absl::StrCat(r->strategy, " ", proj->replicate_size, " x ", proj->shard_size));
    EXPECT_EQ(proj->collectives.size(), static_cast<size_t>(r->collectives_per_step));
    EXPECT_DOUBLE_EQ(proj->comm_bytes_per_rank, r->comm_bytes_per_rank);
    EXPECT_DOUBLE_EQ(proj->bus_bytes_per_rank, r->bus_bytes_per_rank);
  }
}

// The local communicator's charge: the sum over peers of latency + chunk / bandwidth, at the
// level of each pair.
TEST(CollectiveSeconds, SimulatedLinkChargesEveryPeer) {
  LinkSpec l;
  l.ranks_per_host = 2;
  l.intra_bytes_per_s = 100;
  l.intra_latency_s = 0.5;
  l.inter_bytes_per_s = 10;
  l.inter_latency_s = 1;
  // 4 ranks, chunk 100 bytes: one peer inside (0.5 + 1) and two outside (1 + 10 each).
  absl::StatusOr<double> ag = CollectiveSeconds(CollectiveKind::kAllGather, 400, 4, {0, 1, 2, 3}, l);
  ASSERT_TRUE(ag.ok()) << ag.status();
  EXPECT_DOUBLE_EQ(*ag, 1.5 + 2 * 11);
  absl::StatusOr<double> rs =
      CollectiveSeconds(CollectiveKind::kReduceScatter, 400, 4, {0, 1, 2, 3}, l);
  EXPECT_DOUBLE_EQ(*rs, *ag);
  // One level: (n - 1) x (latency + chunk / bandwidth).
  LinkSpec one;
  one.intra_bytes_per_s = 100;
  one.intra_latency_s = 0.5;
  EXPECT_DOUBLE_EQ(*CollectiveSeconds(CollectiveKind::kAllGather, 400, 4, {0, 1, 2, 3}, one),
                   3 * 1.5);
  EXPECT_DOUBLE_EQ(*CollectiveSeconds(CollectiveKind::kAllGather, 400, 4, {0}, one), 0);
}

// NCCL's ring: (n-1)/n S at the slowest leg's bandwidth; the hosts' network shared by the
// groups that run at once.
TEST(CollectiveSeconds, RingAndHierarchical) {
  LinkSpec l;
  l.algorithm = CollectiveAlgorithm::kRing;
  l.ranks_per_host = 8;
  l.intra_bytes_per_s = 100e9;
  l.inter_bytes_per_s = 50e9;
  const int64_t S = 8'000'000'000;
  std::vector<int> host(8), two_hosts(16);
  for (int i = 0; i < 16; ++i) {
    if (i < 8) host[i] = i;
    two_hosts[i] = i;
  }
  EXPECT_DOUBLE_EQ(*CollectiveSeconds(CollectiveKind::kAllGather, S, 2, host, l),
                   7.0 / 8 * S / 100e9);
  EXPECT_DOUBLE_EQ(*CollectiveSeconds(CollectiveKind::kAllReduce, S, 2, host, l),
                   2 * 7.0 / 8 * S / 100e9);
  EXPECT_DOUBLE_EQ(*CollectiveSeconds(CollectiveKind::kAllGather, S, 2, two_hosts, l),
                   15.0 / 16 * S / 50e9);
  // One rank per host, as HYBRID's replicate groups: 8 such groups share each host's network.
  EXPECT_DOUBLE_EQ(*CollectiveSeconds(CollectiveKind::kAllReduce, S, 2, {0, 8}, l),
                   2 * 0.5 * S / (50e9 / 8));
  // Achieved fractions scale the bandwidths; latency per hop.
  l.inter_efficiency = 0.5;
  l.inter_latency_s = 1e-3;
  l.intra_latency_s = 1e-4;
  EXPECT_DOUBLE_EQ(*CollectiveSeconds(CollectiveKind::kAllGather, S, 2, two_hosts, l),
                   14 * 1e-4 + 1 * 1e-3 + 15.0 / 16 * S / 25e9);
  l.inter_efficiency = 1;
  l.inter_latency_s = l.intra_latency_s = 0;
  l.algorithm = CollectiveAlgorithm::kHierarchical;
  EXPECT_DOUBLE_EQ(*CollectiveSeconds(CollectiveKind::kAllGather, S, 2, two_hosts, l),
                   0.5 * S / 8 / (50e9 / 8) + 7.0 / 8 * S / 100e9);
}

TEST(ProjectStep, ComputeSlowsWhileCollectivesRun) {
  ProjectionRun run = MakeRun(ShardingStrategy::kFullShard, 2, true);
  absl::StatusOr<Projection> fast = ProjectStep(TwoBlocks(), OneSecondPerUnit(), run);
  run.overlap_slowdown = 0.5;
  absl::StatusOr<Projection> slow = ProjectStep(TwoBlocks(), OneSecondPerUnit(), run);
  ASSERT_TRUE(fast.ok() && slow.ok());
  // Block 1's gather [2,3] runs during block 0's forward (2-4): 1 s of it at half speed costs
  // 0.5 s more; block 0's backward gather [6,7] during block 1's backward, 0.5 s more; ...
  EXPECT_GT(slow->step_s, fast->step_s + 0.9);
  EXPECT_LT(slow->step_s, fast->step_s + 0.5 * fast->comm_total_s + 1e-9);
  // Without communication nothing changes.
  LinkSpec free;
  absl::StatusOr<Projection> none = ProjectStep(TwoBlocks(), free, run);
  EXPECT_DOUBLE_EQ(none->step_s, 10.5);
}

TEST(ProjectStep, BadInputSaysWhatIsWrong) {
  auto message = [](const absl::StatusOr<Projection>& p) {
    EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
    return std::string(p.status().message());
  };
  const LinkSpec l = OneSecondPerUnit();
  const ProjectionRun run = MakeRun(ShardingStrategy::kFullShard, 2, true);
  StepProfile p;
  EXPECT_NE(message(ProjectStep(p, l, run)).find("no blocks"), std::string::npos);
  p = TwoBlocks();
  p.unit_numel = {400, 400};
  EXPECT_NE(message(ProjectStep(p, l, run)).find("unit sizes"), std::string::npos);
  p = TwoBlocks();
  p.block_backward_s = {3};
  EXPECT_NE(message(ProjectStep(p, l, run)).find("one of each per block"), std::string::npos);
  p = TwoBlocks();
  p.head_s = -1;
  EXPECT_NE(message(ProjectStep(p, l, run)).find(">= 0"), std::string::npos);
  p = TwoBlocks();
  p.block_forward_s[1] = NAN;
  EXPECT_NE(message(ProjectStep(p, l, run)).find("block time"), std::string::npos);
  EXPECT_NE(message(ProjectStep(TwoBlocks(), l, MakeRun(ShardingStrategy::kFullShard, 0, true)))
                .find("world_size=0"),
            std::string::npos);
  ProjectionRun hybrid = MakeRun(ShardingStrategy::kHybridShard, 4, true);
  hybrid.hybrid_shard_size = 3;
  EXPECT_NE(message(ProjectStep(TwoBlocks(), l, hybrid)).find("divisor"), std::string::npos);
  LinkSpec bad = l;
  bad.inter_efficiency = 1.5;
  EXPECT_NE(message(ProjectStep(TwoBlocks(), bad, run)).find("inter_efficiency"),
            std::string::npos);
  bad = l;
  bad.intra_bytes_per_s = -1;
  EXPECT_NE(message(ProjectStep(TwoBlocks(), bad, run)).find("intra_bytes_per_s"),
            std::string::npos);
  bad = l;
  bad.ranks_per_host = 3;
  EXPECT_NE(message(ProjectStep(TwoBlocks(), bad, MakeRun(ShardingStrategy::kFullShard, 4, true)))
                .find("ranks_per_host=3"),
            std::string::npos);
  ProjectionRun slow = run;
  slow.overlap_slowdown = 1;
  EXPECT_NE(message(ProjectStep(TwoBlocks(), l, slow)).find("overlap_slowdown"),
            std::string::npos);
  EXPECT_FALSE(ParseCollectiveAlgorithm("tree").ok());
  EXPECT_EQ(*ParseCollectiveAlgorithm("Ring"), CollectiveAlgorithm::kRing);
}

TEST(ProfileFromFlops, FollowsModelSpec) {
  const nn::ModelConfig mc = *nn::ModelConfig::FromName("llama2-7b");
  DeviceSpec d{"H100", 1000e12, 0.5, 3e12};
  FlopsWorkload w;
  w.batch_size = 1;
  w.seq_len = 4096;
  w.checkpoint_every = 2;
  absl::StatusOr<StepProfile> p = ProfileFromFlops(mc, d, w, 8);
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_EQ(p->num_blocks(), 32);
  ASSERT_EQ(p->unit_numel.size(), 33u);
  const double tokens = 4096, C = 4096;
  const double fwd = (2.0 * mc.UnitNumel(1) * tokens + 4 * C * 4096 * tokens) / 500e12;
  EXPECT_DOUBLE_EQ(p->block_forward_s[0], fwd);
  EXPECT_DOUBLE_EQ(p->block_backward_s[0], 2 * fwd);
  EXPECT_DOUBLE_EQ(p->block_recompute_s[0], fwd);  // blocks 0, 2, 4, ... checkpointed
  EXPECT_DOUBLE_EQ(p->block_recompute_s[1], 0);
  EXPECT_DOUBLE_EQ(p->head_s, 6.0 * 32000 * C * tokens / 500e12);
  EXPECT_DOUBLE_EQ(p->optimizer_s, 28.0 * mc.num_parameters() / 8 / 3e12);
  // Without recomputation, the blocks and the head are MODEL_SPEC.md's FLOPs at the rate.
  w.checkpoint_every = 0;
  p = ProfileFromFlops(mc, d, w, 8);
  double blocks = 0;
  for (int i = 0; i < 32; ++i) blocks += p->block_forward_s[i] + p->block_backward_s[i];
  EXPECT_NEAR((blocks + p->head_s) * 500e12, mc.flops_per_step(4096, 4096),
              1e-6 * mc.flops_per_step(4096, 4096));
  d.achieved_fraction = 0;
  EXPECT_EQ(ProfileFromFlops(mc, d, w, 8).status().code(), absl::StatusCode::kInvalidArgument);
  d.achieved_fraction = 0.5;
  w.seq_len = 8192;
  EXPECT_EQ(ProfileFromFlops(mc, d, w, 8).status().code(), absl::StatusCode::kInvalidArgument);
}

// A measured run's profile: the blocks' spans are its compute, the places around them its
// "other", and projecting it with no link gives its step back (within the noise of the run).
TEST(ProfileFromBench, IsTheMeasuredSplit) {
  BenchConfig c;
  c.model = "nano";
  c.world_size = 2;
  c.threads_per_rank = 1;
  c.steps = 4;
  c.peak_gflops_per_core = 50;
  absl::StatusOr<BenchResult> r = RunBench(c);
  ASSERT_TRUE(r.ok()) << r.status();
  const nn::ModelConfig mc = *nn::ModelConfig::FromName("nano");
  absl::StatusOr<StepProfile> p = ProfileFromBench(*r, mc);
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_EQ(p->num_blocks(), mc.num_layers());
  double blocks = 0;
  for (int i = 0; i < p->num_blocks(); ++i) {
    EXPECT_GT(p->block_forward_s[i], 0);
    EXPECT_GT(p->block_backward_s[i], 0);
    EXPECT_EQ(p->block_recompute_s[i], 0);
    blocks += p->block_forward_s[i] + p->block_backward_s[i];
  }
  EXPECT_NEAR(blocks, r->compute_s, 1e-9 + 1e-9 * r->compute_s);
  EXPECT_NEAR(r->before_blocks_s + r->forward_gaps_s + r->head_s + r->backward_gaps_s +
                  r->after_blocks_s + r->after_optimizer_s,
              r->other_s, 1e-6);
  EXPECT_NEAR(p->compute_s(), r->step_mean_s - r->exposed_comm_s, 1e-6);
  absl::StatusOr<Projection> proj =
      ProjectStep(*p, SimulatedLink(c.link), MakeRun(ShardingStrategy::kFullShard, 2, true));
  ASSERT_TRUE(proj.ok()) << proj.status();
  // A run with no link: its waits are the profile's sync_s, added to the step.
  EXPECT_DOUBLE_EQ(p->sync_s, r->exposed_comm_s);
  EXPECT_NEAR(proj->step_s, r->step_mean_s, 1e-6);
  EXPECT_NEAR(proj->exposed_comm_s, r->exposed_comm_s, 1e-9);
  // A result of another model is refused.
  EXPECT_EQ(ProfileFromBench(*r, *nn::ModelConfig::FromName("mini")).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

// ---- sizes: bounded work, or an error -------------------------------------------------------

// Seconds ProjectStep takes, and its answer.
double TimedProject(const StepProfile& p, const LinkSpec& l, const ProjectionRun& run,
                    absl::StatusOr<Projection>* out) {
  const auto start = std::chrono::steady_clock::now();
  *out = ProjectStep(p, l, run);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// A world at the bound (1 << 20 ranks) answers in well under a second on every algorithm: a
// collective's cost comes from its group's shape, not from a loop over its ranks (pairs of
// ranks, for the simulated link). A world past it is an error, not a vector of a billion
// ranks. The timing is generous for a shared machine and skipped under sanitizers.
TEST(ProjectBounds, AWorldAtTheBoundAnswersFastAndBeyondIsAnError) {
  const nn::ModelConfig mc = *nn::ModelConfig::FromName("llama2-70b");
  const DeviceSpec device{"H100", 989e12, 0.5, 3.35e12};
  FlopsWorkload w;
  w.seq_len = 4096;
  LinkSpec l;
  l.ranks_per_host = 8;
  l.intra_bytes_per_s = 450e9;
  l.intra_latency_s = 2e-6;
  l.inter_bytes_per_s = 400e9;
  l.inter_latency_s = 15e-6;
  for (CollectiveAlgorithm a : {CollectiveAlgorithm::kSimulatedLink, CollectiveAlgorithm::kRing,
                                CollectiveAlgorithm::kHierarchical}) {
    l.algorithm = a;
    for (ShardingStrategy s : {ShardingStrategy::kFullShard, ShardingStrategy::kHybridShard,
                               ShardingStrategy::kNoShard}) {
      ProjectionRun run = MakeRun(s, kMaxPlanWorldSize, true);
      run.overlap_slowdown = 0.1;
      const int shard = s == ShardingStrategy::kNoShard     ? 1
                        : s == ShardingStrategy::kHybridShard ? 8
                                                              : kMaxPlanWorldSize;
      absl::StatusOr<StepProfile> profile = ProfileFromFlops(mc, device, w, shard);
      ASSERT_TRUE(profile.ok()) << profile.status();
      absl::StatusOr<Projection> p;
      const double seconds = TimedProject(*profile, l, run, &p);
      ASSERT_TRUE(p.ok()) << p.status();
      EXPECT_GT(p->step_s, p->compute_s) << CollectiveAlgorithmName(a) << " " << StrategyName(s);
      if (!UnderSanitizer()) {
        EXPECT_LT(seconds, 1.0) << CollectiveAlgorithmName(a) << " " << StrategyName(s);
      }
    }
  }
  absl::StatusOr<StepProfile> profile = ProfileFromFlops(mc, device, w, 8);
  ASSERT_TRUE(profile.ok()) << profile.status();
  for (int world : {kMaxPlanWorldSize + 1, 1000000000}) {
    absl::StatusOr<Projection> p =
        ProjectStep(*profile, l, MakeRun(ShardingStrategy::kFullShard, world, true));
    ASSERT_FALSE(p.ok()) << world;
    EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(p.status().message().find(
                  absl::StrCat("world_size=", world, ": allowed: 1 to 1048576 ranks")),
              std::string::npos)
        << p.status();
  }
  // One host of 1 << 20 ranks on the simulated link: every rank pays n - 1 transfers.
  std::vector<int> group(kMaxPlanWorldSize);
  for (int i = 0; i < kMaxPlanWorldSize; ++i) group[i] = i;
  LinkSpec one;
  one.intra_bytes_per_s = 1e9;
  one.intra_latency_s = 1e-6;
  const int64_t bytes = int64_t{1} << 30;
  absl::StatusOr<double> ag = CollectiveSeconds(CollectiveKind::kAllGather, bytes, 4, group, one);
  ASSERT_TRUE(ag.ok()) << ag.status();
  const double chunk = static_cast<double>(bytes) / kMaxPlanWorldSize;
  EXPECT_NEAR(*ag, (kMaxPlanWorldSize - 1) * (1e-6 + chunk / 1e9), 1e-9 * *ag);
  group.push_back(kMaxPlanWorldSize);
  EXPECT_FALSE(CollectiveSeconds(CollectiveKind::kAllGather, bytes, 4, group, one).ok());
}

// A profile at the bound of blocks answers in well under a second, also with every unit
// prefetched, SHARD_GRAD_OP keeping every unit gathered and compute slowed beside the
// collectives; a block more, or a unit past 2^56 elements, is an error.
TEST(ProjectBounds, BlocksAtTheBoundAnswerFastAndBeyondIsAnError) {
  StepProfile p;
  p.unit_numel.assign(nn::kMaxLayers + 1, 1 << 20);
  p.block_forward_s.assign(nn::kMaxLayers, 1e-3);
  p.block_backward_s.assign(nn::kMaxLayers, 2e-3);
  p.block_recompute_s.assign(nn::kMaxLayers, 0);
  p.optimizer_s = 0.1;
  LinkSpec l;
  l.algorithm = CollectiveAlgorithm::kRing;
  l.ranks_per_host = 8;
  l.intra_bytes_per_s = 100e9;
  l.inter_bytes_per_s = 10e9;
  for (ShardingStrategy s : {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp,
                             ShardingStrategy::kHybridShard}) {
    for (int prefetch : {1, std::numeric_limits<int>::max()}) {
      ProjectionRun run = MakeRun(s, 64, true);
      run.prefetch = prefetch;
      run.overlap_slowdown = 0.2;
      absl::StatusOr<Projection> r;
      const double seconds = TimedProject(p, l, run, &r);
      ASSERT_TRUE(r.ok()) << r.status();
      if (!UnderSanitizer()) {
        EXPECT_LT(seconds, 1.0) << StrategyName(s) << " prefetch " << prefetch;
      }
    }
  }
  StepProfile deeper = p;
  deeper.unit_numel.push_back(1 << 20);
  deeper.block_forward_s.push_back(1e-3);
  deeper.block_backward_s.push_back(2e-3);
  deeper.block_recompute_s.push_back(0);
  const ProjectionRun run = MakeRun(ShardingStrategy::kFullShard, 64, true);
  absl::StatusOr<Projection> r = ProjectStep(deeper, l, run);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("the profile has 10001 blocks: allowed: 1 to 10000"),
            std::string::npos)
      << r.status();
  StepProfile wide = TwoBlocks();
  wide.unit_numel[1] = (int64_t{1} << 56) + 1;
  r = ProjectStep(wide, l, run);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("a unit of 72057594037927937 elements: allowed: 1 to 2^56"),
            std::string::npos)
      << r.status();
}

// ---- the command line ------------------------------------------------------------------------
#ifdef FSDP_BENCH_BINARY


TEST(FsdpBenchProject, ClusterPresetPrintsAssumptionsAndATable) {
  const Ran r = RunCli("--project --cluster p5 --models llama2-7b --strategies "
                       "FULL_SHARD,HYBRID_SHARD --nodes 1,2,16 --seq 4096 --batch 1 "
                       "--checkpoint 1");
  ASSERT_EQ(r.rc, 0) << r.output;
  for (const char* word : {"Assumptions", "989 TFLOP/s", "x 0.5 achieved", "ring",
                           "450 GB/s per device", "400 GB/s per host", "PlanMemory",
                           "step ms", "exposed", "eff", "HYBRID_SHARD", "fits"}) {
    EXPECT_NE(r.output.find(word), std::string::npos) << word << "\n" << r.output;
  }
  // 2 strategies x 3 worlds.
  int rows = 0;
  for (size_t at = r.output.find("\nllama2-7b "); at != std::string::npos;
       at = r.output.find("\nllama2-7b ", at + 1)) {
    ++rows;
  }
  EXPECT_EQ(rows, 6) << r.output;
}

TEST(FsdpBenchProject, ValidationMeasuresAndPredicts) {
  const Ran r = RunCli("--validate_projection --models nano --worlds 2 --validate_links 0.05 "
                       "--threads 1 --warmup 1 --steps 2");
  ASSERT_EQ(r.rc, 0) << r.output;
  for (const char* word : {"calibration: nano 2 ranks", "predicted", "error", "median |error|",
                           "worst"}) {
    EXPECT_NE(r.output.find(word), std::string::npos) << word << "\n" << r.output;
  }
}

TEST(FsdpBenchProject, BadFlagsExit2WithOneLine) {
  for (const char* args :
       {"--project --achieved 2", "--nodes 2", "--validate_projection",
        "--validate_projection --validate_links 1:x", "--project --algorithm tree",
        "--overlap_slowdown 0.5", "--project --cluster p6", "--project --peak_tflops 100",
        "--validate_projection --validate_links 1:0.1", "--project --validate_projection",
        "--project --cluster p5 --overlap_slowdown 1", "--validate_links 1",
        "--calibrate each", "--validate_projection --validate_links 1 --calibrate all",
        "--project --inter_eff 0.5,2", "--project --cluster p5 --published 87",
        "--project --cluster p5 --nodes 1000000000 --ranks_per_host 1",
        "--project --cluster p5 --nodes 131073", "--project --cluster p5 --worlds 1048577",
        "--project --cluster p5 --ranks_per_host 2147483647",
        "--project --cluster p5 --batch 2147483647"}) {
    ExpectUsageError(args);
  }
  const Ran help = RunCli("--help");
  EXPECT_EQ(help.rc, 0);
  for (const char* word : {"--project", "--cluster", "--nodes", "--algorithm", "--intra_eff",
                           "--project_from", "--peak_tflops", "--achieved", "--hbm_gbps",
                           "--device_mem_gib", "--compute_scale", "--overlap_slowdown",
                           "--validate_projection", "--validate_links", "--calibrate",
                           "--published"}) {
    EXPECT_NE(help.output.find(word), std::string::npos) << word;
  }
}

#endif  // FSDP_BENCH_BINARY

}  // namespace
}  // namespace fsdp
