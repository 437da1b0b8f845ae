// Activation checkpointing (GptOptions::checkpoint_layers): losses and every gradient bitwise
// equal to the model without it, whatever the mask; BackwardBlock of a checkpointed block
// without recomputation is an error; and the activation memory it saves on `mini`.
#include <cstdio>
#include <random>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/nn/test_util.h"

namespace fsdp::nn {
namespace {

using ::testing::HasSubstr;
using testing::LowpUnits;
using testing::UnitBuffers;
using Grads = std::vector<std::vector<float>>;

using testing::RandomTokens;

std::string MaskName(const std::vector<bool>& mask) {
  std::string s;
  for (bool b : mask) s += b ? '1' : '0';
  return s.empty() ? "none" : s;
}

struct Step {
  float loss = 0;
  std::vector<float> logits;
  Grads grads;
};

// Two steps on different batches, gradients accumulating across them. `staged` drives the
// stages by hand and recomputes every checkpointed block (even the last one, whose activations
// are still in the scratch) right before its backward; otherwise Gpt::Backward does.
std::vector<Step> RunSteps(Gpt& gpt, const LowpUnits& params, UnitBuffers& u, bool staged) {
  const GptConfig& c = gpt.config();
  const int n = gpt.batch_size() * gpt.seq_len();
  std::vector<Step> out;
  u.ZeroGrads();
  const auto p = params.views();
  const auto g = u.grad_views();
  for (uint64_t seed : {11, 12}) {
    const auto idx = RandomTokens(n, c.vocab_size, seed);
    const auto tgt = RandomTokens(n, c.vocab_size, seed + 100);
    Step s;
    auto loss = gpt.Forward(p, testing::I32(u.grads[0].backend(), idx),
                            testing::I32(u.grads[0].backend(), tgt));
    EXPECT_TRUE(loss.ok()) << loss.status();
    s.loss = loss.value_or(-1.0f);
    const float* logits = gpt.logits().host_as<float>();
    s.logits.assign(logits, logits + static_cast<int64_t>(n) * c.vocab_size);
    if (staged) {
      EXPECT_TRUE(gpt.BackwardHead(p[0], g[0]).ok());
      for (int i = c.num_layers - 1; i >= 0; --i) {
        if (gpt.layer_checkpointed(i)) {
          EXPECT_TRUE(gpt.ForwardBlock(i, p[1 + i]).ok());
        }
        auto st = gpt.BackwardBlock(i, p[1 + i], g[1 + i]);
        EXPECT_TRUE(st.ok()) << st;
      }
      EXPECT_TRUE(gpt.BackwardEmbed(g[0]).ok());
    } else {
      auto st = gpt.Backward(p, g);
      EXPECT_TRUE(st.ok()) << st;
    }
    s.grads = u.grad_values();
    out.push_back(std::move(s));
  }
  return out;
}

void ExpectBitwiseEqual(const std::vector<Step>& got, const std::vector<Step>& want,
                        const std::string& what) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t k = 0; k < got.size(); ++k) {
    EXPECT_EQ(got[k].loss, want[k].loss) << what << " step " << k;
    EXPECT_TRUE(got[k].logits == want[k].logits) << what << " step " << k << ": logits differ";
    for (size_t u = 0; u < want[k].grads.size(); ++u) {
      int64_t differ = 0;
      for (size_t j = 0; j < want[k].grads[u].size(); ++j) {
        differ += got[k].grads[u][j] != want[k].grads[u][j];
      }
      EXPECT_EQ(differ, 0) << what << " step " << k << ": unit " << u << " has " << differ
                           << " gradients that differ";
    }
  }
}

class CheckpointTest : public ::testing::TestWithParam<DType> {
 protected:
  void SetUp() override {
    backend_ = testing::MakeCpuBackend();
    config_ = *GptConfig::FromName("nano");
    u_ = UnitBuffers::Create(backend_.get(), config_);
    u_.Init(config_, 3);
    params_ = LowpUnits::Create(backend_.get(), config_, GetParam());
    params_.CastFrom(*backend_, u_);
  }
  std::unique_ptr<Gpt> Make(std::vector<bool> mask, int B = 4, int T = 32) {
    auto gpt = Gpt::Create(config_, backend_.get(), B, T,
                           {.compute_dtype = GetParam(), .checkpoint_layers = std::move(mask)});
    EXPECT_TRUE(gpt.ok()) << gpt.status();
    return std::move(*gpt);
  }
  std::unique_ptr<CpuBackend> backend_;
  GptConfig config_;
  UnitBuffers u_;
  LowpUnits params_;
};

TEST_P(CheckpointTest, BitwiseEqualToTheModelWithoutCheckpointing) {
  auto plain = Make({});
  const std::vector<Step> want = RunSteps(*plain, params_, u_, false);
  // nano has 2 layers: all, every other (both phases), none.
  for (const std::vector<bool>& mask : std::vector<std::vector<bool>>{
           {true, true}, {true, false}, {false, true}, {false, false}}) {
    auto ck = Make(mask);
    for (int i = 0; i < config_.num_layers; ++i) EXPECT_EQ(ck->layer_checkpointed(i), mask[i]);
    for (bool staged : {false, true}) {
      ExpectBitwiseEqual(RunSteps(*ck, params_, u_, staged), want,
                         absl::StrCat(std::string(DTypeName(GetParam())), " mask ",
                                      MaskName(mask), staged ? " staged" : " Backward"));
    }
  }
}

TEST_P(CheckpointTest, BackwardWithoutRecomputationIsAnError) {
  auto gpt = Make({true, true});
  const auto p = params_.views();
  const auto g = u_.grad_views();
  const auto idx = RandomTokens(4 * 32, config_.vocab_size, 1);
  ASSERT_TRUE(gpt->Forward(p, testing::I32(backend_, idx), testing::I32(backend_, idx)).ok());
  ASSERT_TRUE(gpt->BackwardHead(p[0], g[0]).ok());
  // The scratch still holds block 1's activations (its forward ran last): no recompute needed.
  ASSERT_TRUE(gpt->BackwardBlock(1, p[2], g[2]).ok());
  auto s = gpt->BackwardBlock(0, p[1], g[1]);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("recompute"));
  EXPECT_THAT(s.message(), HasSubstr("ForwardBlock(0, params)"));
  EXPECT_THAT(s.message(), HasSubstr("holds block 1's"));
  ASSERT_TRUE(gpt->ForwardBlock(0, p[1]).ok());
  ASSERT_TRUE(gpt->BackwardBlock(0, p[1], g[1]).ok());
  ASSERT_TRUE(gpt->BackwardEmbed(g[0]).ok());

  // Recomputing the wrong block replaces the right one's activations.
  ASSERT_TRUE(gpt->Forward(p, testing::I32(backend_, idx), testing::I32(backend_, idx)).ok());
  ASSERT_TRUE(gpt->BackwardHead(p[0], g[0]).ok());
  ASSERT_TRUE(gpt->ForwardBlock(0, p[1]).ok());
  s = gpt->BackwardBlock(1, p[2], g[2]);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("holds block 0's"));
  ASSERT_TRUE(gpt->ForwardBlock(1, p[2]).ok());
  ASSERT_TRUE(gpt->BackwardBlock(1, p[2], g[2]).ok());
  // Stage order is still checked first; a recomputation does not reorder the backward.
  EXPECT_THAT(gpt->BackwardBlock(1, p[2], g[2]).message(), HasSubstr("next block"));
  EXPECT_THAT(gpt->BackwardEmbed(g[0]).message(), HasSubstr("every BackwardBlock"));
  ASSERT_TRUE(gpt->ForwardBlock(0, p[1]).ok());
  ASSERT_TRUE(gpt->BackwardBlock(0, p[1], g[1]).ok());
  ASSERT_TRUE(gpt->BackwardEmbed(g[0]).ok());

  // A new step starts with nothing in the scratch.
  ASSERT_TRUE(gpt->ForwardEmbed(p[0], testing::I32(backend_, idx)).ok());
  ASSERT_TRUE(gpt->ForwardBlock(0, p[1]).ok());
  ASSERT_TRUE(gpt->ForwardBlock(1, p[2]).ok());
  ASSERT_TRUE(gpt->ForwardEmbed(p[0], testing::I32(backend_, idx)).ok());
  EXPECT_EQ(gpt->ForwardHead(p[0], testing::I32(backend_, idx)).status().code(),
            absl::StatusCode::kFailedPrecondition);  // blocks not run for this ForwardEmbed
}

INSTANTIATE_TEST_SUITE_P(Dtypes, CheckpointTest, ::testing::Values(DType::kF32, DType::kBF16),
                         [](const ::testing::TestParamInfo<DType>& info) {
                           return std::string(DTypeName(info.param));
                         });

TEST(CheckpointMemoryTest, MiniAllCheckpointedHoldsUnderAThirdOfTheActivations) {
  auto backend = testing::MakeCpuBackend(1);
  const GptConfig mini = *GptConfig::FromName("mini");
  const int L = mini.num_layers;
  auto bytes = [&](std::vector<bool> mask) {
    auto gpt = Gpt::Create(mini, backend.get(), 8, 256, {.checkpoint_layers = std::move(mask)});
    EXPECT_TRUE(gpt.ok()) << gpt.status();
    return gpt.ok() ? (*gpt)->activation_bytes() : 0;
  };
  std::vector<bool> every_other(L);
  for (int i = 0; i < L; ++i) every_other[i] = i % 2 == 0;
  const int64_t none = bytes({}), all = bytes(std::vector<bool>(L, true));
  const int64_t half = bytes(every_other);
  std::printf("mini B=8 T=256 activation_bytes: none %.1f MiB, every other %.1f MiB, all %.1f "
              "MiB (%.2fx smaller)\n",
              none / 1048576.0, half / 1048576.0, all / 1048576.0,
              static_cast<double>(none) / static_cast<double>(all));
  EXPECT_GE(none, 3 * all);
  EXPECT_LT(all, half);
  EXPECT_LT(half, none);
  // The backend's accounting agrees: one model holds what it reports.
  const int64_t before = backend->memory_stats().bytes_in_use;
  auto gpt = *Gpt::Create(mini, backend.get(), 8, 256,
                          {.checkpoint_layers = std::vector<bool>(L, true)});
  EXPECT_EQ(backend->memory_stats().bytes_in_use - before, all);
}

}  // namespace
}  // namespace fsdp::nn
