// Parity of every strategy with a single rank training on the concatenated batches: 20 AdamW
// steps on nano (GPT) and llama-nano with clipping, ranks as threads.
#include <gtest/gtest.h>

#include <map>
#include <tuple>
#include <mutex>

#include "fsdp/local_world.h"
#include "tests/fsdp/parity_util.h"

namespace fsdp::testing {
namespace {


struct Case {
  ShardingStrategy strategy;
  int world;
  int hybrid_shard = 0;
  int micro_batches = 1;
  Clip clip = Clip::kAlways;
  std::string model = "nano";
  Accumulation accumulation = Accumulation::kNoSync;
};

std::string CaseName(const ::testing::TestParamInfo<Case>& info) {
  std::string s = info.param.model == "nano" ? "" : "llama_";
  s += StrategyName(info.param.strategy);
  s += "_N" + std::to_string(info.param.world);
  if (info.param.hybrid_shard) s += "_S" + std::to_string(info.param.hybrid_shard);
  if (info.param.micro_batches > 1) s += "_accum" + std::to_string(info.param.micro_batches);
  if (info.param.accumulation != Accumulation::kNoSync) {
    s += "_" + std::string(AccumulationName(info.param.accumulation));
  }
  s += std::string("_") + ClipName(info.param.clip);
  return s;
}

// The reference of a (model, world, micro_batches, clipping) case, computed once.
const TrainResult& Reference(const TrainSpec& spec, int world) {
  static std::mutex mu;
  static std::map<std::tuple<std::string, int, int, float>, TrainResult> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto key = std::make_tuple(spec.config, world, spec.micro_batches, spec.max_grad_norm);
  auto it = cache.find(key);
  if (it == cache.end()) {
    auto r = TrainReference(spec, world, 2);
    EXPECT_TRUE(r.ok()) << r.status();
    it = cache.emplace(key, r.ok() ? *std::move(r) : TrainResult{}).first;
  }
  return it->second;
}

class ParityTest : public ::testing::TestWithParam<Case> {};

TEST_P(ParityTest, LossesAndParamsMatchSingleRankOnConcatenatedBatch) {
  const Case c = GetParam();
  TrainSpec spec;
  spec.config = c.model;
  spec.micro_batches = c.micro_batches;
  spec.accumulation = c.accumulation;
  spec.max_grad_norm = 0;
  spec.max_grad_norm = ClipThreshold(c.clip, Reference(spec, c.world).grad_norms);
  const TrainResult& ref = Reference(spec, c.world);
  ASSERT_EQ(ref.losses.size(), static_cast<size_t>(spec.steps));

  ShardingOptions sharding;
  sharding.strategy = c.strategy;
  sharding.hybrid_shard_size = c.hybrid_shard;
  std::vector<TrainResult> results(c.world);
  const int threads = std::max(1, 2 / c.world);
  absl::Status s = LocalWorld::Run(c.world, CommOptions{}, [&](Communicator& comm) {
    FSDP_ASSIGN_OR_RETURN(results[comm.rank()], TrainSharded(comm, spec, sharding, threads));
    return absl::OkStatus();
  });
  ASSERT_TRUE(s.ok()) << s;
  for (int r = 0; r < c.world; ++r) {
    ExpectMatchesReference(results[r], ref, c.clip, "rank " + std::to_string(r));
  }
  // The loss fell: the parity is over real training, not a constant.
  EXPECT_LT(ref.losses.back(), ref.losses.front() - 0.5);
}

std::vector<Case> AllCases() {
  const std::vector<Case> base = {
      {ShardingStrategy::kFullShard, 1}, {ShardingStrategy::kFullShard, 2},
      {ShardingStrategy::kFullShard, 3}, {ShardingStrategy::kFullShard, 4},
      {ShardingStrategy::kShardGradOp, 1}, {ShardingStrategy::kShardGradOp, 2},
      {ShardingStrategy::kShardGradOp, 3}, {ShardingStrategy::kShardGradOp, 4},
      {ShardingStrategy::kNoShard, 1}, {ShardingStrategy::kNoShard, 2},
      {ShardingStrategy::kNoShard, 3}, {ShardingStrategy::kNoShard, 4},
      {ShardingStrategy::kHybridShard, 4, 2}, {ShardingStrategy::kHybridShardGradOp, 4, 2},
      {ShardingStrategy::kHybridShard, 2, 1},
      {ShardingStrategy::kFullShard, 1, 0, 4}, {ShardingStrategy::kFullShard, 2, 0, 4},
      {ShardingStrategy::kFullShard, 3, 0, 4}, {ShardingStrategy::kShardGradOp, 2, 0, 4},
      {ShardingStrategy::kNoShard, 2, 0, 4}, {ShardingStrategy::kHybridShard, 4, 2, 4}};
  std::vector<Case> out;
  for (Clip clip : {Clip::kOff, Clip::kSome, Clip::kAlways}) {
    for (Case c : base) {
      c.clip = clip;
      out.push_back(c);
    }
  }
  // Gradients reduce-scattered every micro-batch: HYBRID (replica all-reduce in the last only,
  // carrying the accumulated shards), HYBRID_SHARD_GRAD_OP and FULL_SHARD.
  for (Case c : {Case{ShardingStrategy::kHybridShard, 4, 2, 4},
                 Case{ShardingStrategy::kHybridShardGradOp, 4, 2, 4},
                 Case{ShardingStrategy::kFullShard, 2, 0, 4}}) {
    c.clip = Clip::kSome;
    c.accumulation = Accumulation::kSharded;
    out.push_back(c);
  }
  return out;
}

// Llama (RMSNorm, RoPE, grouped-query attention, SwiGLU, untied head) through the same
// runtime: every strategy on 1 to 4 ranks, HYBRID 2x2, accumulation, and each clipping mode.
std::vector<Case> LlamaCases() {
  const std::vector<Case> base = {
      {ShardingStrategy::kFullShard, 1}, {ShardingStrategy::kFullShard, 2},
      {ShardingStrategy::kFullShard, 3}, {ShardingStrategy::kFullShard, 4},
      {ShardingStrategy::kShardGradOp, 1}, {ShardingStrategy::kShardGradOp, 2},
      {ShardingStrategy::kShardGradOp, 3}, {ShardingStrategy::kShardGradOp, 4},
      {ShardingStrategy::kNoShard, 1}, {ShardingStrategy::kNoShard, 2},
      {ShardingStrategy::kNoShard, 3}, {ShardingStrategy::kNoShard, 4},
      {ShardingStrategy::kHybridShard, 4, 2}, {ShardingStrategy::kHybridShardGradOp, 4, 2},
      {ShardingStrategy::kFullShard, 2, 0, 4}, {ShardingStrategy::kHybridShard, 4, 2, 4}};
  std::vector<Case> out;
  for (Case c : base) {
    c.model = "llama-nano";
    out.push_back(c);
  }
  for (Clip clip : {Clip::kOff, Clip::kSome}) {
    for (Case c : {Case{ShardingStrategy::kFullShard, 2}, Case{ShardingStrategy::kHybridShard, 4, 2}}) {
      c.model = "llama-nano";
      c.clip = clip;
      out.push_back(c);
    }
  }
  // HYBRID's shards accumulated over the micro-batches and all-reduced once across replicas.
  Case sharded{ShardingStrategy::kHybridShard, 4, 2, 4, Clip::kSome, "llama-nano"};
  sharded.accumulation = Accumulation::kSharded;
  out.push_back(sharded);
  return out;
}

INSTANTIATE_TEST_SUITE_P(Strategies, ParityTest, ::testing::ValuesIn(AllCases()), CaseName);
INSTANTIATE_TEST_SUITE_P(Llama, ParityTest, ::testing::ValuesIn(LlamaCases()), CaseName);

}  // namespace
}  // namespace fsdp::testing
