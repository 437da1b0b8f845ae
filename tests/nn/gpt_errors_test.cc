// Bad input to the GPT gives clear errors, not crashes: configs, shapes, token ids, layer
// indices and the order of the stages.
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/nn/test_util.h"

namespace fsdp::nn {
namespace {

using ::testing::HasSubstr;
using testing::UnitBuffers;

TEST(GptErrorsTest, BadConfigs) {
  auto unknown = GptConfig::FromName("gpt5");
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(unknown.status().message(), HasSubstr("nano"));  // lists the known names
  GptConfig c = *GptConfig::FromName("nano");
  c.num_heads = 3;  // 64 % 3 != 0
  EXPECT_THAT(c.Validate().message(), HasSubstr("divisible"));
  c = *GptConfig::FromName("nano");
  c.num_layers = 0;
  EXPECT_EQ(c.Validate().code(), absl::StatusCode::kInvalidArgument);
  auto backend = testing::MakeCpuBackend(1);
  EXPECT_EQ(Gpt::Create(c, backend.get(), 1, 8).status().code(),
            absl::StatusCode::kInvalidArgument);
  // Sizes beyond the bounds of model.h, so that parameter counts cannot overflow.
  c = *GptConfig::FromName("nano");
  c.num_layers = kMaxLayers;
  EXPECT_TRUE(c.Validate().ok()) << c.Validate();
  c.num_layers = kMaxLayers + 1;
  EXPECT_THAT(c.Validate().message(), HasSubstr("num_layers must be <= 10000"));
  c = *GptConfig::FromName("nano");
  c.channels = 2147483646;  // divisible by the 2 heads
  EXPECT_THAT(c.Validate().message(), HasSubstr("channels must be <= 1048576"));
}

TEST(GptErrorsTest, BadShapes) {
  auto backend = testing::MakeCpuBackend(1);
  const GptConfig c = *GptConfig::FromName("nano");
  EXPECT_THAT(Gpt::Create(c, backend.get(), 1, 65).status().message(), HasSubstr("block_size"));
  EXPECT_FALSE(Gpt::Create(c, backend.get(), 0, 8).ok());
  EXPECT_FALSE(Gpt::Create(c, backend.get(), 2, 0).ok());
  EXPECT_FALSE(Gpt::Create(c, backend.get(), -1, 8).ok());
  EXPECT_FALSE(Gpt::Create(c, nullptr, 1, 8).ok());
  EXPECT_TRUE(Gpt::Create(c, backend.get(), 1, 64).ok());
}

class GptStageErrorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    backend_ = testing::MakeCpuBackend(1);
    config_ = *GptConfig::FromName("nano");
    units_ = UnitBuffers::Create(backend_.get(), config_);
    units_.Init(config_, 1);
    gpt_ = *Gpt::Create(config_, backend_.get(), 2, 8);
    tokens_.assign(16, 65);
  }
  std::unique_ptr<CpuBackend> backend_;
  GptConfig config_;
  UnitBuffers units_;
  std::unique_ptr<Gpt> gpt_;
  std::vector<int32_t> tokens_;
};

TEST_F(GptStageErrorsTest, TokenIdsOutsideTheVocabulary) {
  auto p = units_.param_views();
  tokens_[9] = 256;
  auto s = gpt_->ForwardEmbed(p[0], testing::I32(backend_, tokens_));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("idx[1, 1] = 256"));
  tokens_[9] = -1;
  EXPECT_FALSE(gpt_->ForwardEmbed(p[0], testing::I32(backend_, tokens_)).ok());
  tokens_[9] = 0;
  std::vector<int32_t> targets(16, 300);
  auto loss = gpt_->Forward(p, testing::I32(backend_, tokens_), testing::I32(backend_, targets));
  EXPECT_THAT(loss.status().message(), HasSubstr("targets"));
}

TEST_F(GptStageErrorsTest, LayerOutOfRange) {
  auto p = units_.param_views();
  auto g = units_.grad_views();
  ASSERT_TRUE(gpt_->ForwardEmbed(p[0], testing::I32(backend_, tokens_)).ok());
  EXPECT_EQ(gpt_->ForwardBlock(2, p[1]).code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(gpt_->ForwardBlock(-1, p[1]).code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(gpt_->BackwardBlock(2, p[1], g[1]).code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(gpt_->ForwardBlock(0, View{}).code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(GptStageErrorsTest, StagesOutOfOrder) {
  auto p = units_.param_views();
  auto g = units_.grad_views();
  // Nothing has run yet.
  EXPECT_EQ(gpt_->ForwardBlock(0, p[1]).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(gpt_->ForwardHead(p[0], testing::I32(backend_, tokens_)).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(gpt_->BackwardHead(p[0], g[0]).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(gpt_->Backward(p, g).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(gpt_->BackwardEmbed(g[0]).code(), absl::StatusCode::kFailedPrecondition);
  // Block 1 before block 0.
  ASSERT_TRUE(gpt_->ForwardEmbed(p[0], testing::I32(backend_, tokens_)).ok());
  EXPECT_THAT(gpt_->ForwardBlock(1, p[2]).message(), HasSubstr("next block is 0"));
  // Logits only (no targets): there is no loss to differentiate.
  ASSERT_TRUE(gpt_->ForwardBlock(0, p[1]).ok());
  ASSERT_TRUE(gpt_->ForwardBlock(1, p[2]).ok());
  ASSERT_TRUE(gpt_->ForwardHead(p[0], View{}).ok());
  EXPECT_EQ(gpt_->BackwardHead(p[0], g[0]).code(), absl::StatusCode::kFailedPrecondition);
  // Backward blocks must go L-1 .. 0, and the embedding last.
  ASSERT_TRUE(gpt_->ForwardHead(p[0], testing::I32(backend_, tokens_)).ok());
  ASSERT_TRUE(gpt_->BackwardHead(p[0], g[0]).ok());
  EXPECT_THAT(gpt_->BackwardBlock(0, p[1], g[1]).message(), HasSubstr("next block"));
  EXPECT_EQ(gpt_->BackwardEmbed(g[0]).code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(gpt_->BackwardBlock(1, p[2], g[2]).ok());
  ASSERT_TRUE(gpt_->BackwardBlock(0, p[1], g[1]).ok());
  ASSERT_TRUE(gpt_->BackwardEmbed(g[0]).ok());
  // A backward consumes its forward.
  EXPECT_EQ(gpt_->BackwardHead(p[0], g[0]).code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(GptStageErrorsTest, WrongNumberOfUnits) {
  auto p = units_.param_views();
  p.pop_back();
  EXPECT_EQ(gpt_->Forward(p, testing::I32(backend_, tokens_), testing::I32(backend_, tokens_)).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace fsdp::nn
