// The secondary shard inside a host (ShardingOptions::secondary_shard_size; ZeRO++'s hpZ):
// training with it is bitwise training without it (the backward gathers the values forward
// used, from the host's ranks), the shard group stops carrying backward's gathers, the memory
// report counts the secondary shards as the backend holds them, and bad settings fail at
// creation naming the option. Ranks as threads, hosts simulated (CommOptions::ranks_per_host).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <bit>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "fsdp/local_world.h"
#include "fsdp/sharding.h"
#include "tests/fsdp/parity_util.h"

namespace fsdp::testing {
namespace {

using ::testing::HasSubstr;

struct Config {
  std::string name;
  ShardingStrategy strategy = ShardingStrategy::kFullShard;
  int world = 4, hybrid = 0, ranks_per_host = 2, n = 2;
  DType param_dtype = DType::kF32;
  WireFormat all_gather = WireFormat::kDType, reduction = WireFormat::kDType;
  int checkpoint_every = 0, micro_batches = 1;
  Accumulation accumulation = Accumulation::kNoSync;
};

absl::StatusOr<std::vector<TrainResult>> Train(const Config& c, int secondary) {
  TrainSpec spec;
  spec.steps = 3;
  spec.lr = 3e-3f;
  spec.checkpoint_every = c.checkpoint_every;
  spec.micro_batches = c.micro_batches;
  spec.accumulation = c.accumulation;
  CommOptions co;
  co.timeout = absl::Seconds(60);
  co.ranks_per_host = c.ranks_per_host;
  std::vector<TrainResult> out(c.world);
  FSDP_RETURN_IF_ERROR(LocalWorld::Run(c.world, co, [&](Communicator& comm) -> absl::Status {
    ShardingOptions so;
    so.strategy = c.strategy;
    so.hybrid_shard_size = c.hybrid;
    so.secondary_shard_size = secondary;
    so.mixed_precision.param_dtype = c.param_dtype;
    so.communication.all_gather = c.all_gather;
    so.communication.reduction = c.reduction;
    so.communication.block_size = 64;
    FSDP_ASSIGN_OR_RETURN(out[comm.rank()], TrainSharded(comm, spec, so, 1));
    return absl::OkStatus();
  }));
  return out;
}

bool BitEqual(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::bit_cast<uint32_t>(a[i]) != std::bit_cast<uint32_t>(b[i])) return false;
  }
  return true;
}

class SecondaryShardTest : public ::testing::TestWithParam<Config> {};

TEST_P(SecondaryShardTest, TrainsBitwiseAsWithoutItAndGathersBackwardInsideTheHost) {
  const Config& c = GetParam();
  auto probe = MakeTestBackend(1);
  ASSERT_TRUE(probe.ok()) << probe.status();
  if ((c.all_gather != WireFormat::kDType || c.reduction != WireFormat::kDType) &&
      !(*probe)->runtime_ops().supports_wire_format(WireFormat::kInt8)) {
    GTEST_SKIP() << "skipped: the " << (*probe)->name() << " backend has no quantization ops";
  }
  absl::StatusOr<std::vector<TrainResult>> plain = Train(c, 0);
  ASSERT_TRUE(plain.ok()) << plain.status();
  absl::StatusOr<std::vector<TrainResult>> hpz = Train(c, c.n);
  ASSERT_TRUE(hpz.ok()) << hpz.status();
  const TrainResult& a = (*plain)[0];
  const TrainResult& b = (*hpz)[0];
  EXPECT_EQ(a.losses, b.losses);
  EXPECT_EQ(a.grad_norms, b.grad_norms);
  ASSERT_EQ(a.params.size(), b.params.size());
  for (size_t u = 0; u < a.params.size(); ++u) {
    EXPECT_TRUE(BitEqual(a.params[u], b.params[u])) << "unit " << u << " differs";
  }
  EXPECT_LT(b.losses.back(), b.losses.front()) << "it trains";
  // Backward regathers every unit but the two kept gathered (the root and the last block;
  // in the first pass the last is not known yet), once per micro-batch: over the secondary
  // group now, not over the shard group.
  const int64_t passes = int64_t{3} * c.micro_batches;
  const int64_t regathers = (b.num_units - 1) + int64_t{b.num_units - 2} * (passes - 1);
  if (a.shard_all_gathers >= 0) {
    EXPECT_EQ(a.shard_all_gathers - b.shard_all_gathers, regathers);
  } else {
    std::printf("not counted: the %s backend's data plane runs its own collectives, which the "
                "shard group's communicator does not count\n", std::string((*probe)->name()).c_str());
  }
  // Memory: the secondary shards, 1/N of each unit resharded after forward (in the first step
  // the last block too, before the order is known), counted as the backend holds them, and
  // none left after the step.
  const int64_t S = c.hybrid > 0 ? c.hybrid : c.world;
  int64_t expected = 0;
  for (int u = 1; u < b.num_units; ++u) {
    expected += b.unit_shard_numel[u] * S / c.n * static_cast<int64_t>(DTypeSize(c.param_dtype));
  }
  for (int r = 0; r < c.world; ++r) {
    const TrainResult& t = (*hpz)[r];
    ExpectReportIsBackend(t.memory, t.backend_memory, absl::StrCat("rank ", r));
    EXPECT_EQ(t.memory.secondary_param_peak_bytes, expected) << "rank " << r;
    EXPECT_EQ(t.memory.secondary_param_bytes, 0) << "rank " << r;
    EXPECT_EQ((*plain)[r].memory.secondary_param_peak_bytes, 0);
  }
}

std::vector<Config> Configs() {
  std::vector<Config> out;
  out.push_back({.name = "FULL_SHARD_N4_f32"});
  out.push_back({.name = "FULL_SHARD_N4_bf16", .param_dtype = DType::kBF16});
  out.push_back({.name = "FULL_SHARD_N4_int8", .all_gather = WireFormat::kInt8,
                 .reduction = WireFormat::kInt8});
  out.push_back({.name = "FULL_SHARD_N4_checkpointed_accum2", .checkpoint_every = 1,
                 .micro_batches = 2});
  out.push_back({.name = "FULL_SHARD_N8_secondary4", .world = 8, .ranks_per_host = 4, .n = 4});
  out.push_back({.name = "HYBRID_SHARD_N8_S4_secondary2_sharded_accum2",
                 .strategy = ShardingStrategy::kHybridShard, .world = 8, .hybrid = 4,
                 .ranks_per_host = 4, .param_dtype = DType::kBF16, .micro_batches = 2,
                 .accumulation = Accumulation::kSharded});
  return out;
}

INSTANTIATE_TEST_SUITE_P(Configs, SecondaryShardTest, ::testing::ValuesIn(Configs()),
                         [](const auto& info) { return info.param.name; });

// An evaluation pass (forward only) gives the secondary shards back.
TEST(SecondaryShardEvalTest, ForwardOnlyGivesTheSecondaryShardsBack) {
  CommOptions co;
  co.timeout = absl::Seconds(30);
  const absl::Status s = LocalWorld::Run(4, co, [&](Communicator& comm) -> absl::Status {
    FSDP_ASSIGN_OR_RETURN(nn::ModelConfig config, nn::ModelConfig::FromName("nano"));
    FSDP_ASSIGN_OR_RETURN(auto backend, MakeTestBackend(1));
    nn::ShardedModelOptions o;
    o.sharding.secondary_shard_size = 2;
    o.batch_size = 2;
    o.seq_len = 16;
    FSDP_ASSIGN_OR_RETURN(auto model, nn::ShardedModel::Create(config, backend.get(), comm, o));
    TrainSpec spec;
    spec.batch_size = 2;
    spec.seq_len = 16;
    nn::Batch b = RankBatch(spec, comm.rank(), comm.size(), 0, 0);
    FSDP_RETURN_IF_ERROR(model->Forward(b.inputs.data(), b.targets.data()).status());
    // Once the device is done with them (a host backend: at once).
    FSDP_RETURN_IF_ERROR(backend->Synchronize());
    const int64_t peak = model->memory().secondary_param_peak_bytes;
    model->runtime().ResetPeaks();
    const MemoryReport m = model->memory();
    EXPECT_GT(peak, 0);
    EXPECT_EQ(m.secondary_param_bytes, 0);
    EXPECT_EQ(m.bytes_in_use(), backend->memory_stats().bytes_in_use) << FormatMemoryReport(m);
    return absl::OkStatus();
  });
  ASSERT_TRUE(s.ok()) << s;
}

// Bad settings fail on every rank at creation, naming the option, the value and what is allowed.
TEST(SecondaryShardBadInputTest, RefusedAtCreationNamingTheOption) {
  struct Bad {
    ShardingStrategy strategy;
    int hybrid, n, ranks_per_host;
    const char* says;
  };
  const Bad cases[] = {
      {ShardingStrategy::kShardGradOp, 0, 2, 0, "FULL_SHARD and HYBRID_SHARD"},
      {ShardingStrategy::kNoShard, 0, 2, 0, "FULL_SHARD and HYBRID_SHARD"},
      {ShardingStrategy::kHybridShardGradOp, 2, 2, 0, "FULL_SHARD and HYBRID_SHARD"},
      {ShardingStrategy::kFullShard, 0, 3, 0, "a divisor N of the shard group size"},
      {ShardingStrategy::kFullShard, 0, 4, 0, "is the shard group itself"},
      {ShardingStrategy::kFullShard, 0, 1, 0, "SHARD_GRAD_OP"},
      {ShardingStrategy::kFullShard, 0, -2, 0, "allowed: 0 (off)"},
      {ShardingStrategy::kHybridShard, 2, 2, 0, "2 <= N < 2"},
      {ShardingStrategy::kFullShard, 0, 2, 1, "spans hosts 0 and 1"},
  };
  for (const Bad& bad : cases) {
    SCOPED_TRACE(absl::StrCat(std::string(StrategyName(bad.strategy)), " secondary ", bad.n));
    CommOptions co;
    co.timeout = absl::Seconds(5);
    co.ranks_per_host = bad.ranks_per_host;
    std::vector<absl::Status> got(4);
    const absl::Status run = LocalWorld::Run(4, co, [&](Communicator& comm) -> absl::Status {
      FSDP_ASSIGN_OR_RETURN(auto backend, MakeTestBackend(1));
      ShardingOptions so;
      so.strategy = bad.strategy;
      so.hybrid_shard_size = bad.hybrid;
      so.secondary_shard_size = bad.n;
      got[comm.rank()] = ShardingRuntime::Create(backend.get(), comm, so).status();
      return absl::OkStatus();
    });
    ASSERT_TRUE(run.ok()) << run;
    for (int r = 0; r < 4; ++r) {
      EXPECT_EQ(got[r].code(), absl::StatusCode::kInvalidArgument) << got[r];
      EXPECT_THAT(got[r].message(), HasSubstr("secondary_shard_size is")) << got[r];
      EXPECT_THAT(got[r].message(), HasSubstr(bad.says)) << got[r];
    }
  }
}

}  // namespace
}  // namespace fsdp::testing
