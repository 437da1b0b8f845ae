// The sharding runtime at PyTorch FSDP2's test scale: nano (GPT) trained for a few AdamW steps
// on 128 ranks as threads, FULL_SHARD and SHARD_GRAD_OP (every unit sharded 128 ways: nano's
// units pad to multiples of 128), NO_SHARD (gradients all-reduced over 128 replicas) and
// HYBRID_SHARD as 16 x 8 and 8 x 16, on the CPU backend and (sharding_n128_test_sim) on the
// strict simulated accelerator, against the single-rank reference that trains on the 128 ranks' batches
// concatenated (tests/fsdp/parity_util.h): losses, pre-clip gradient norms, the first step's
// reduced gradients and the final parameters.
#include <gtest/gtest.h>

#include <ostream>
#include <string>
#include <vector>

#include "fsdp/local_world.h"
#include "tests/fsdp/parity_util.h"

namespace fsdp::testing {
namespace {

constexpr int kWorld = 128;

struct Case {
  ShardingStrategy strategy;
  int hybrid_shard = 0;
  Clip clip = Clip::kOff;
};

std::string CaseName(const ::testing::TestParamInfo<Case>& info) {
  std::string s = std::string(StrategyName(info.param.strategy)) + "_N" + std::to_string(kWorld);
  if (info.param.hybrid_shard) s += "_S" + std::to_string(info.param.hybrid_shard);
  return s + "_" + ClipName(info.param.clip);
}

// One sequence of 32 tokens per rank, 4 steps: the reference trains on 128 x 32 tokens a step.
TrainSpec Spec() {
  TrainSpec spec;
  spec.batch_size = 1;
  spec.seq_len = 32;
  spec.steps = 4;
  spec.max_grad_norm = 0;
  return spec;
}

const TrainResult& UnclippedReference() {
  static const TrainResult* ref = [] {
    auto r = TrainReference(Spec(), kWorld, 2);
    EXPECT_TRUE(r.ok()) << r.status();
    return new TrainResult(r.ok() ? *std::move(r) : TrainResult{});
  }();
  return *ref;
}

void PrintTo(const Case& c, std::ostream* os) {
  *os << StrategyName(c.strategy) << " S=" << c.hybrid_shard << " " << ClipName(c.clip);
}

class N128ParityTest : public ::testing::TestWithParam<Case> {};

TEST_P(N128ParityTest, LossesAndParamsMatchSingleRankOnConcatenatedBatch) {
  const Case c = GetParam();
  TrainSpec spec = Spec();
  const TrainResult& unclipped = UnclippedReference();
  ASSERT_EQ(unclipped.losses.size(), static_cast<size_t>(spec.steps));
  spec.max_grad_norm = ClipThreshold(c.clip, unclipped.grad_norms);
  TrainResult clipped_ref;
  if (c.clip != Clip::kOff) {
    auto r = TrainReference(spec, kWorld, 2);
    ASSERT_TRUE(r.ok()) << r.status();
    clipped_ref = *std::move(r);
  }
  const TrainResult& ref = c.clip == Clip::kOff ? unclipped : clipped_ref;

  ShardingOptions sharding;
  sharding.strategy = c.strategy;
  sharding.hybrid_shard_size = c.hybrid_shard;
  CommOptions options;
  options.timeout = absl::Seconds(300);  // 128 ranks on two cores: a rank may wait its turn
  std::vector<TrainResult> results(kWorld);
  absl::Status s = LocalWorld::Run(kWorld, options, [&](Communicator& comm) {
    FSDP_ASSIGN_OR_RETURN(results[comm.rank()], TrainSharded(comm, spec, sharding, 1));
    return absl::OkStatus();
  });
  ASSERT_TRUE(s.ok()) << s;
  for (int r = 0; r < kWorld; ++r) {
    ExpectMatchesReference(results[r], ref, c.clip, "rank " + std::to_string(r));
    if (HasFailure()) break;  // one rank's report is enough
  }
  // The loss fell: the parity is over real training, not a constant.
  EXPECT_LT(ref.losses.back(), ref.losses.front());
}

INSTANTIATE_TEST_SUITE_P(Nano, N128ParityTest,
                         ::testing::Values(Case{ShardingStrategy::kFullShard},
                                           Case{ShardingStrategy::kShardGradOp, 0, Clip::kSome},
                                           Case{ShardingStrategy::kNoShard},
                                           Case{ShardingStrategy::kHybridShard, 8, Clip::kSome},
                                           Case{ShardingStrategy::kHybridShard, 16}),
                         CaseName);

}  // namespace
}  // namespace fsdp::testing
