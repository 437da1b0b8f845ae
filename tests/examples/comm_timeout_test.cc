// FSDP_COMM_TIMEOUT_S: what ParseCommTimeoutSeconds and CommTimeoutFromEnv accept, and that
// everything else is an error naming the variable and the value (DefaultCommTimeout() alone
// silently falls back to 60 s, so programs check the variable at start-up).
#include <cstdlib>
#include <optional>
#include <string>
#include <utility>

#include "absl/time/time.h"
#include "fsdp/communicator.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace fsdp {
namespace {

using ::testing::HasSubstr;

TEST(CommTimeoutTest, AcceptsSecondsAsADecimalNumber) {
  for (const auto& [text, want] :
       {std::pair<std::string, absl::Duration>{"30", absl::Seconds(30)},
        {"2.5", absl::Milliseconds(2500)},
        {"0.001", absl::Milliseconds(1)},
        {"1e3", absl::Seconds(1000)},
        {" 7 ", absl::Seconds(7)}}) {
    auto t = ParseCommTimeoutSeconds(text);
    ASSERT_TRUE(t.ok()) << "'" << text << "': " << t.status();
    EXPECT_EQ(*t, want) << "'" << text << "'";
  }
}

TEST(CommTimeoutTest, RejectsAnythingElseNamingTheVariableAndTheValue) {
  for (const std::string text : {"5s", "60 s", "1m", "abc", "", "0", "-1", "-0.5", "nan", "inf",
                                 "1e9", "1e400", "5,5"}) {
    auto t = ParseCommTimeoutSeconds(text);
    ASSERT_FALSE(t.ok()) << "'" << text << "' was accepted as " << *t;
    EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(t.status().message()),
                HasSubstr("FSDP_COMM_TIMEOUT_S='" + text + "' is not a valid timeout"));
    EXPECT_THAT(std::string(t.status().message()), HasSubstr("number of seconds"));
  }
}

class CommTimeoutEnvTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (const char* v = std::getenv("FSDP_COMM_TIMEOUT_S")) saved_ = v;
  }
  void TearDown() override {
    if (saved_) {
      setenv("FSDP_COMM_TIMEOUT_S", saved_->c_str(), 1);
    } else {
      unsetenv("FSDP_COMM_TIMEOUT_S");
    }
  }
  std::optional<std::string> saved_;
};

TEST_F(CommTimeoutEnvTest, UnsetOrEmptyIsSixtySeconds) {
  unsetenv("FSDP_COMM_TIMEOUT_S");
  ASSERT_TRUE(CommTimeoutFromEnv().ok());
  EXPECT_EQ(*CommTimeoutFromEnv(), absl::Seconds(60));
  setenv("FSDP_COMM_TIMEOUT_S", "", 1);
  ASSERT_TRUE(CommTimeoutFromEnv().ok());
  EXPECT_EQ(*CommTimeoutFromEnv(), absl::Seconds(60));
  EXPECT_EQ(DefaultCommTimeout(), absl::Seconds(60));
}

TEST_F(CommTimeoutEnvTest, ValidValueIsUsedEverywhere) {
  setenv("FSDP_COMM_TIMEOUT_S", "12.5", 1);
  ASSERT_TRUE(CommTimeoutFromEnv().ok());
  EXPECT_EQ(*CommTimeoutFromEnv(), absl::Milliseconds(12500));
  EXPECT_EQ(DefaultCommTimeout(), absl::Milliseconds(12500));
  EXPECT_EQ(CommOptions{}.timeout, absl::Milliseconds(12500));
}

TEST_F(CommTimeoutEnvTest, InvalidValueIsAnErrorButTheDefaultStaysUsable) {
  setenv("FSDP_COMM_TIMEOUT_S", "5s", 1);
  auto t = CommTimeoutFromEnv();
  ASSERT_FALSE(t.ok());
  EXPECT_THAT(std::string(t.status().message()),
              HasSubstr("FSDP_COMM_TIMEOUT_S='5s' is not a valid timeout"));
  EXPECT_EQ(DefaultCommTimeout(), absl::Seconds(60));  // the member initializer never fails
}

}  // namespace
}  // namespace fsdp
