// ShardingOptions::offload: the AdamW state of chosen units in host memory, updated on the
// host. On the sim device (separate host and device memory, a device budget): training is
// bitwise the run without offload, the device holds 8 bytes per offloaded shard element fewer
// (the report is still the backend's allocations to the byte), a model that does not fit the
// device budget trains with offload, checkpoints round-trip; the choice by budget; bad input.
#include <algorithm>
#include <cstdio>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "fsdp/local_world.h"
#include "fsdp/sharding.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/checkpoint/ckpt_util.h"
#include "tests/fsdp/parity_util.h"

namespace fsdp {
namespace {

using ::testing::HasSubstr;

std::vector<testing::TrainResult> TrainOnRanks(int world, const testing::TrainSpec& spec,
                                               const ShardingOptions& so,
                                               absl::Status* status = nullptr) {
  std::vector<testing::TrainResult> res(world);
  CommOptions co;
  co.timeout = absl::Seconds(120);
  absl::Status s = LocalWorld::Run(world, co, [&](Communicator& comm) -> absl::Status {
    FSDP_ASSIGN_OR_RETURN(res[comm.rank()], testing::TrainSharded(comm, spec, so, 1, "sim"));
    return absl::OkStatus();
  });
  if (status != nullptr) {
    *status = s;
  } else {
    EXPECT_TRUE(s.ok()) << s;
  }
  return res;
}

struct Case {
  const char* name;
  ShardingStrategy strategy;
  int world, hybrid;
  std::string config;
  int micro_batches;
  DType param_dtype;
  Accumulation accumulation = Accumulation::kNoSync;
};

// Every unit offloaded, and half of them by budget: losses, norms and parameters bit for bit
// those of the run that keeps the state on the device (the host runs the same AdamW kernel on
// the same clipped and averaged gradient).
TEST(OffloadTest, TrainsBitwiseTheRunWithoutOffload) {
  const Case cases[] = {
      {"FULL_SHARD N2 nano", ShardingStrategy::kFullShard, 2, 0, "nano", 1, DType::kF32},
      {"HYBRID_SHARD 2x2 llama-nano accum2 bf16", ShardingStrategy::kHybridShard, 4, 2,
       "llama-nano", 2, DType::kBF16},
      {"NO_SHARD N2 nano", ShardingStrategy::kNoShard, 2, 0, "nano", 1, DType::kF32},
      // A reduction on every micro-batch: offload all adds each on the host.
      {"FULL_SHARD N2 nano accum3 every", ShardingStrategy::kFullShard, 2, 0, "nano", 3,
       DType::kF32, Accumulation::kEvery},
  };
  for (const Case& c : cases) {
    testing::TrainSpec spec;
    spec.config = c.config;
    spec.steps = 4;
    spec.micro_batches = c.micro_batches;
    spec.accumulation = c.accumulation;
    spec.max_grad_norm = 0.5f;  // clipping on some steps: the factor is the device's
    ShardingOptions so;
    so.strategy = c.strategy;
    so.hybrid_shard_size = c.hybrid;
    so.mixed_precision.param_dtype = c.param_dtype;
    const std::vector<testing::TrainResult> base = TrainOnRanks(c.world, spec, so);
    for (const OffloadKind kind : {OffloadKind::kOptimizer, OffloadKind::kAll}) {
      for (int64_t budget : {int64_t{-1}, int64_t{0}, int64_t{1} << 20}) {
        ShardingOptions off = so;
        off.offload.what = kind;
        off.offload.budget_bytes = budget;
        const std::vector<testing::TrainResult> res = TrainOnRanks(c.world, spec, off);
        const bool all = kind == OffloadKind::kAll;
        for (int r = 0; r < c.world; ++r) {
          const testing::TrainResult &a = base[r], &b = res[r];
          const std::string where = absl::StrCat(c.name, ", offload ", std::string(OffloadName(kind)),
                                                 ", budget ", budget, ", rank ", r);
          EXPECT_EQ(b.losses, a.losses) << where;
          EXPECT_EQ(b.grad_norms, a.grad_norms) << where;
          EXPECT_TRUE(testing::BitEqual(b.params, a.params)) << where;
          // What moved: 8 bytes per offloaded shard element off the device (16 with all: the
          // parameter and gradient shards too), 16 onto the host (20 with all).
          int64_t numel = 0;
          for (int u : b.offloaded_units) numel += b.unit_shard_numel[u];
          EXPECT_EQ(b.memory.optimizer_bytes, a.memory.optimizer_bytes - 8 * numel) << where;
          EXPECT_EQ(b.memory.param_shard_bytes, a.memory.param_shard_bytes - (all ? 4 * numel : 0))
              << where;
          EXPECT_EQ(b.memory.grad_shard_bytes, a.memory.grad_shard_bytes - (all ? 4 * numel : 0))
              << where;
          EXPECT_EQ(b.memory.host_offload_bytes, (all ? 20 : 16) * numel) << where;
          EXPECT_EQ(b.memory.offloaded_units, static_cast<int>(b.offloaded_units.size())) << where;
          testing::ExpectReportIsBackend(b.memory, b.backend_memory, where);
          if (budget < 0) {
            EXPECT_EQ(static_cast<int>(b.offloaded_units.size()), b.num_units) << where;
            EXPECT_EQ(b.memory.optimizer_bytes, 0) << where;
          }
          if (budget == 0) {
            EXPECT_TRUE(b.offloaded_units.empty()) << where;
          }
          EXPECT_EQ(b.offload.updates,
                    spec.steps * static_cast<int64_t>(b.offloaded_units.size())) << where;
          EXPECT_LE(b.memory.host_offload_bytes, budget < 0 ? INT64_MAX : budget) << where;
        }
        std::printf("%s, offload %s, budget %lld: %zu of %d units offloaded, device "
                    "persistent %lld -> %lld bytes, host %lld bytes; host updates %.1f ms, "
                    "waited %.1f ms\n",
                    c.name, std::string(OffloadName(kind)).c_str(),
                    static_cast<long long>(budget), res[0].offloaded_units.size(),
                    res[0].num_units, static_cast<long long>(base[0].memory.persistent_bytes()),
                    static_cast<long long>(res[0].memory.persistent_bytes()),
                    static_cast<long long>(res[0].memory.host_offload_bytes),
                    1e3 * res[0].offload.host_update_seconds, 1e3 * res[0].offload.wait_seconds);
      }
    }
  }
}

// A sim device too small for the model's state trains once the optimizer state lives on the
// host, and computes what the unbounded device does.
TEST(OffloadTest, AModelThatDoesNotFitTheDeviceTrainsWithOffload) {
  testing::TrainSpec spec;
  spec.config = "nano";
  spec.steps = 2;
  ShardingOptions so;
  const std::vector<testing::TrainResult> free_run = TrainOnRanks(2, spec, so);
  // The budget: the device's peak without offload, less half of what offload saves.
  const int64_t peak = free_run[0].backend_memory.peak_bytes;
  const int64_t saved = free_run[0].memory.optimizer_bytes;
  spec.memory_limit_bytes = peak - saved / 2;
  absl::Status without;
  TrainOnRanks(2, spec, so, &without);
  EXPECT_EQ(without.code(), absl::StatusCode::kResourceExhausted) << without;
  ShardingOptions off = so;
  off.offload.what = OffloadKind::kOptimizer;
  const std::vector<testing::TrainResult> with = TrainOnRanks(2, spec, off);
  EXPECT_EQ(with[0].losses, free_run[0].losses);
  EXPECT_TRUE(testing::BitEqual(with[0].params, free_run[0].params));
  EXPECT_LE(with[0].backend_memory.peak_bytes, spec.memory_limit_bytes);
  std::printf("nano, 2 ranks: device budget %lld bytes; without offload: %s; with: peak %lld\n",
              static_cast<long long>(spec.memory_limit_bytes), without.ToString().c_str(),
              static_cast<long long>(with[0].backend_memory.peak_bytes));
  // Smaller still: less than offloading the optimizer state saves. Offload all (the parameter
  // and gradient shards too) fits, and still computes what the unbounded device does.
  const int64_t shards = free_run[0].memory.param_shard_bytes;
  spec.memory_limit_bytes = peak - saved - shards / 2;
  absl::Status optimizer_only;
  TrainOnRanks(2, spec, off, &optimizer_only);
  EXPECT_EQ(optimizer_only.code(), absl::StatusCode::kResourceExhausted) << optimizer_only;
  off.offload.what = OffloadKind::kAll;
  const std::vector<testing::TrainResult> all = TrainOnRanks(2, spec, off);
  EXPECT_EQ(all[0].losses, free_run[0].losses);
  EXPECT_TRUE(testing::BitEqual(all[0].params, free_run[0].params));
  EXPECT_LE(all[0].backend_memory.peak_bytes, spec.memory_limit_bytes);
  std::printf("nano, 2 ranks: device budget %lld bytes; offload optimizer: %s; offload all: "
              "peak %lld\n",
              static_cast<long long>(spec.memory_limit_bytes), optimizer_only.ToString().c_str(),
              static_cast<long long>(all[0].backend_memory.peak_bytes));
}

void CheckpointRoundTrip(OffloadKind kind);

// A checkpoint saved with offload holds the host's state: loading it (with or without offload)
// continues bitwise as the uninterrupted run.
TEST(OffloadTest, CheckpointsRoundTripTheHostState) {
  for (const OffloadKind kind : {OffloadKind::kOptimizer, OffloadKind::kAll}) {
    SCOPED_TRACE(std::string(OffloadName(kind)));
    CheckpointRoundTrip(kind);
  }
}

void CheckpointRoundTrip(OffloadKind kind) {
  const std::string dir = ::testing::TempDir() + "/offload_ckpt_" + std::to_string(getpid()) +
                          "_" + std::string(OffloadName(kind));
  testing::CkptRun run;
  run.backend = "sim";
  run.offload = kind;
  auto whole = testing::RunThreads(2, run, 4, "", "");
  ASSERT_TRUE(whole.ok()) << whole.status();
  ASSERT_TRUE(testing::RunThreads(2, run, 2, "", dir + "/a").ok());
  for (OffloadKind resume : {kind, OffloadKind::kNone}) {
    testing::CkptRun again = run;
    again.offload = resume;
    auto rest = testing::RunThreads(2, again, 2, dir + "/a", "");
    ASSERT_TRUE(rest.ok()) << rest.status();
    EXPECT_TRUE(testing::BitEqual(rest->params, whole->params)) << OffloadName(resume);
  }
  // And a checkpoint of a run without offload resumes with it.
  testing::CkptRun plain = run;
  plain.offload = OffloadKind::kNone;
  ASSERT_TRUE(testing::RunThreads(2, plain, 2, "", dir + "/b").ok());
  auto rest = testing::RunThreads(2, run, 2, dir + "/b", "");
  ASSERT_TRUE(rest.ok()) << rest.status();
  EXPECT_TRUE(testing::BitEqual(rest->params, whole->params));
}

// The choice by budget: largest first, ties by name; independent of the registration order,
// a superset for a larger budget, never over it; explicit names.
TEST(OffloadChoiceTest, LargestFirstMonotoneNeverOverTheBudget) {
  std::mt19937 rng(3);
  for (int trial = 0; trial < 200; ++trial) {
    const int n = 1 + static_cast<int>(rng() % 12);
    std::vector<std::string> names;
    std::vector<int64_t> numel;
    for (int u = 0; u < n; ++u) {
      names.push_back("u" + std::to_string(u));
      numel.push_back(1 + static_cast<int64_t>(rng() % 5) * 100);  // ties on purpose
    }
    OffloadOptions o;
    o.what = OffloadKind::kOptimizer;
    std::vector<std::string> prev;
    for (int64_t budget = 0; budget <= 16 * 2500; budget += 16 * 50) {
      o.budget_bytes = budget;
      auto chosen = ChooseOffloadedUnits(o, names, numel);
      ASSERT_TRUE(chosen.ok());
      int64_t bytes = 0;
      std::vector<std::string> got;
      for (int u : *chosen) {
        bytes += OffloadHostBytes(numel[u]);
        got.push_back(names[u]);
      }
      std::sort(got.begin(), got.end());
      EXPECT_LE(bytes, budget);
      EXPECT_TRUE(std::includes(got.begin(), got.end(), prev.begin(), prev.end()))
          << "budget " << budget << " dropped a unit a smaller budget took";
      // Largest first: every unit left out is no larger than the smallest taken... unless
      // the walk stopped at it.
      int64_t smallest = INT64_MAX;
      for (int u : *chosen) smallest = std::min(smallest, numel[u]);
      for (int u = 0; u < n; ++u) {
        if (std::find(chosen->begin(), chosen->end(), u) == chosen->end()) {
          EXPECT_LE(numel[u], smallest) << "a larger unit was left out";
        }
      }
      // The same choice (by name) in another registration order.
      std::vector<int> perm(n);
      std::iota(perm.begin(), perm.end(), 0);
      std::shuffle(perm.begin(), perm.end(), rng);
      std::vector<std::string> pn;
      std::vector<int64_t> pnum;
      for (int i : perm) {
        pn.push_back(names[i]);
        pnum.push_back(numel[i]);
      }
      auto again = ChooseOffloadedUnits(o, pn, pnum);
      ASSERT_TRUE(again.ok());
      std::vector<std::string> got2;
      for (int u : *again) got2.push_back(pn[u]);
      std::sort(got2.begin(), got2.end());
      EXPECT_EQ(got2, got);
      prev = got;
    }
    o.budget_bytes = -1;
    EXPECT_EQ(ChooseOffloadedUnits(o, names, numel)->size(), static_cast<size_t>(n));
  }
  OffloadOptions o;
  o.what = OffloadKind::kOptimizer;
  o.units = {"b", "a"};
  EXPECT_EQ(*ChooseOffloadedUnits(o, {"a", "b", "c"}, {1, 2, 3}), (std::vector<int>{0, 1}));
  o.units = {"zz"};
  auto bad = ChooseOffloadedUnits(o, {"a", "b"}, {1, 2});
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("'zz'"));
}

absl::Status CreateWith(const std::string& backend_name, const ShardingOptions& so) {
  return LocalWorld::Run(1, {}, [&](Communicator& comm) -> absl::Status {
    FSDP_ASSIGN_OR_RETURN(auto backend, testing::MakeTestBackend(1, 0, backend_name));
    return ShardingRuntime::Create(backend.get(), comm, so).status();
  });
}

TEST(OffloadTest, BadSettingsAreClearErrorsBeforeTraining) {
  ShardingOptions so;
  so.offload.what = OffloadKind::kOptimizer;
  absl::Status cpu = CreateWith("cpu", so);
  EXPECT_EQ(cpu.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(cpu.message(), HasSubstr("cpu backend"));
  EXPECT_THAT(cpu.message(), HasSubstr("nowhere to offload"));
  ShardingOptions sgd = so;
  sgd.optimizer = OptimizerKind::kSgd;
  EXPECT_THAT(CreateWith("sim", sgd).message(), HasSubstr("needs AdamW"));
  ShardingOptions huge = so;
  huge.offload.budget_bytes = int64_t{1} << 60;
  absl::Status h = CreateWith("sim", huge);
  EXPECT_EQ(h.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(h.message(), HasSubstr("physical memory"));
  EXPECT_TRUE(CreateWith("sim", so).ok());
  EXPECT_EQ(ParseOffload("Optimizer").value(), OffloadKind::kOptimizer);
  EXPECT_THAT(ParseOffload("some").status().message(),
              HasSubstr("use none, optimizer (the AdamW state"));
  EXPECT_EQ(*ParseOffload("ALL"), OffloadKind::kAll);
  // An unknown unit name: Finalize fails on every rank, naming it.
  testing::TrainSpec spec;
  spec.steps = 1;
  ShardingOptions named = so;
  named.offload.units = {"no-such-unit"};
  absl::Status st;
  TrainOnRanks(2, spec, named, &st);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_THAT(st.message(), HasSubstr("no-such-unit"));
  // Offload all with HYBRID's accumulation without the replica all-reduce (whose fold reads
  // the accumulated gradient shard on the device): a clear error, not a wrong gradient.
  testing::TrainSpec accum;
  accum.config = "nano";
  accum.steps = 1;
  accum.micro_batches = 2;
  accum.accumulation = Accumulation::kSharded;
  ShardingOptions hybrid;
  hybrid.strategy = ShardingStrategy::kHybridShard;
  hybrid.hybrid_shard_size = 2;
  hybrid.offload.what = OffloadKind::kAll;
  absl::Status sharded;
  TrainOnRanks(4, accum, hybrid, &sharded);
  EXPECT_EQ(sharded.code(), absl::StatusCode::kFailedPrecondition) << sharded;
  EXPECT_THAT(sharded.message(), HasSubstr("offload all keeps on the host"));
  hybrid.offload.what = OffloadKind::kOptimizer;  // the optimizer's offload takes it
  TrainOnRanks(4, accum, hybrid);
}

}  // namespace
}  // namespace fsdp
