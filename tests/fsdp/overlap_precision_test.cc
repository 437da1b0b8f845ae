// Prefetch and activation checkpointing change nothing but timing and memory (bitwise equal
// results for every strategy); bf16 and f16 training converge close to f32.
#include <gtest/gtest.h>

#include <numeric>

#include "fsdp/cpu_backend.h"
#include "fsdp/local_world.h"
#include "tests/fsdp/parity_util.h"

namespace fsdp::testing {
namespace {

std::vector<TrainResult> TrainOnRanks(int ranks, const TrainSpec& spec, ShardingOptions so) {
  std::vector<TrainResult> res(ranks);
  absl::Status s = LocalWorld::Run(ranks, CommOptions{}, [&](Communicator& comm) {
    FSDP_ASSIGN_OR_RETURN(res[comm.rank()], TrainSharded(comm, spec, so, 1));
    return absl::OkStatus();
  });
  EXPECT_TRUE(s.ok()) << s;
  return res;
}

struct Strategy {
  ShardingStrategy strategy;
  int ranks, hybrid;
};

TEST(OverlapParityTest, PrefetchAndCheckpointingGiveBitwiseTheSameTraining) {
  TrainSpec base;
  base.steps = 5;
  for (Strategy st : {Strategy{ShardingStrategy::kFullShard, 2, 0},
                      Strategy{ShardingStrategy::kShardGradOp, 2, 0},
                      Strategy{ShardingStrategy::kNoShard, 2, 0},
                      Strategy{ShardingStrategy::kHybridShard, 4, 2}}) {
    ShardingOptions plain;
    plain.strategy = st.strategy;
    plain.hybrid_shard_size = st.hybrid;
    plain.forward_prefetch = plain.backward_prefetch = false;
    const std::vector<TrainResult> ref = TrainOnRanks(st.ranks, base, plain);
    for (int prefetch = 0; prefetch < 2; ++prefetch) {
      for (int ckpt = 0; ckpt < 2; ++ckpt) {
        if (!prefetch && !ckpt) continue;
        TrainSpec spec = base;
        spec.checkpoint_every = ckpt;  // every block
        ShardingOptions so = plain;
        so.forward_prefetch = so.backward_prefetch = prefetch == 1;
        const std::vector<TrainResult> got = TrainOnRanks(st.ranks, spec, so);
        for (int r = 0; r < st.ranks; ++r) {
          EXPECT_EQ(got[r].losses, ref[r].losses)
              << StrategyName(st.strategy) << " prefetch " << prefetch << " ckpt " << ckpt;
          EXPECT_EQ(got[r].params, ref[r].params)
              << StrategyName(st.strategy) << " prefetch " << prefetch << " ckpt " << ckpt;
          if (ckpt) {
            EXPECT_LT(got[r].memory.activation_peak_bytes, ref[r].memory.activation_peak_bytes);
          }
        }
      }
    }
  }
}

// Activation checkpointing of every block cuts the activation bytes of mini (B=8, T=256) by
// at least 3x.
TEST(CheckpointingMemoryTest, MiniActivationPeakFallsThreefold) {
  auto config = nn::GptConfig::FromName("mini");
  int64_t bytes[2] = {0, 0};
  for (int ckpt = 0; ckpt < 2; ++ckpt) {
    ASSERT_TRUE(LocalWorld::Run(1, CommOptions{}, [&](Communicator& comm) {
      FSDP_ASSIGN_OR_RETURN(auto backend, testing::MakeTestBackend(1));
      nn::ShardedGptOptions o;
      o.batch_size = 8;
      o.seq_len = 256;
      o.checkpoint_every = ckpt;
      FSDP_ASSIGN_OR_RETURN(auto model, nn::ShardedGpt::Create(*config, backend.get(), comm, o));
      bytes[ckpt] = model->memory().activation_peak_bytes;
      return absl::OkStatus();
    }).ok());
  }
  std::printf("mini B=8 T=256 activation bytes: %.1f MiB without checkpointing, %.1f MiB with "
              "(%.2fx)\n", bytes[0] / 1048576.0, bytes[1] / 1048576.0,
              static_cast<double>(bytes[0]) / bytes[1]);
  EXPECT_GE(bytes[0], 3 * bytes[1]);
}

double MeanOfLast(const std::vector<float>& v, int n) {
  return std::accumulate(v.end() - n, v.end(), 0.0) / n;
}

// 200 nano steps on 2 ranks, FULL_SHARD, compute and reduction in bf16 (f16), fp32 master
// shards: the loss of the last 20 steps stays within kMargin of the f32 run's.
constexpr double kMargin = 0.05;

TEST(MixedPrecisionTest, Bf16AndF16TrainingConvergeNearF32) {
  TrainSpec spec;
  spec.steps = 200;
  spec.batch_size = 4;
  spec.seq_len = 64;
  spec.max_grad_norm = 1.0f;
  ShardingOptions f32;
  const std::vector<TrainResult> ref = TrainOnRanks(2, spec, f32);
  const double ref_loss = MeanOfLast(ref[0].losses, 20);
  EXPECT_LT(ref_loss, ref[0].losses.front() - 1.5);
  for (DType dt : {DType::kBF16, DType::kF16}) {
    ShardingOptions so;
    so.mixed_precision.param_dtype = dt;
    so.mixed_precision.reduce_dtype = dt;
    if (dt == DType::kF16) {
      so.mixed_precision.dynamic_loss_scale = true;
      so.mixed_precision.initial_loss_scale = 16777216.0f;  // 2^24 overflows: must back off
      so.mixed_precision.growth_interval = 50;
    }
    const std::vector<TrainResult> got = TrainOnRanks(2, spec, so);
    const double loss = MeanOfLast(got[0].losses, 20);
    std::printf("%s: mean loss of the last 20 steps %.4f (f32 %.4f), skipped steps %d\n",
                std::string(DTypeName(dt)).c_str(), loss, ref_loss, got[0].skipped_steps);
    EXPECT_NEAR(loss, ref_loss, kMargin) << DTypeName(dt);
    if (dt == DType::kF16) {
      EXPECT_GT(got[0].skipped_steps, 0) << "the overflowing scale never backed off";
      EXPECT_EQ(got[0].skipped_steps, got[1].skipped_steps) << "ranks disagreed on skipping";
    }
  }
}

}  // namespace
}  // namespace fsdp::testing
