// Softmax cross-entropy forward/backward against a double reference and finite differences,
// with ignored (negative) targets.
#include "fsdp/kernels_cpu.h"
#include "tests/kernels/reference.h"

namespace fsdp::kernels::cpu {
namespace {

using namespace fsdp::kernels::cpu::testing;

struct Shape {
  int64_t N, V;
};

std::vector<int32_t> Targets(int64_t N, int64_t V, std::mt19937& rng) {
  std::uniform_int_distribution<int32_t> dist(0, static_cast<int32_t>(V - 1));
  std::vector<int32_t> t(N);
  for (int64_t n = 0; n < N; ++n) t[n] = (n % 4 == 3) ? -1 : dist(rng);  // every 4th ignored
  return t;
}

std::string Name(const ::testing::TestParamInfo<Shape>& info) {
  return absl::StrCat("N", info.param.N, "V", info.param.V);
}

class CrossEntropyTest : public ::testing::TestWithParam<Shape> {};
// Finite differences cost O(size^2): run on the small shapes only.
class CrossEntropyGradTest : public CrossEntropyTest {};

TEST_P(CrossEntropyTest, ForwardMatchesReference) {
  const auto [N, V] = GetParam();
  std::mt19937 rng(static_cast<unsigned>(N * 31 + V));
  const Vec logits = Random(N * V, rng, -8.0f, 8.0f);
  const std::vector<int32_t> targets = Targets(N, V, rng);
  DVec want_probs;
  const DVec want = CrossEntropyRef(ToDouble(logits), targets, N, V, &want_probs);
  Vec losses(N, 9.0f), probs(N * V);
  softmax_crossentropy_forward(losses.data(), probs.data(), logits.data(), targets.data(), N, V);
  ExpectClose(losses, want, 1e-5, 1e-5, "losses");
  ExpectClose(probs, want_probs, 1e-7, 1e-5, "probs");
  for (int64_t n = 0; n < N; ++n) {
    if (targets[n] < 0) {
      EXPECT_EQ(losses[n], 0.0f) << n;
    }
  }
}

TEST_P(CrossEntropyGradTest, BackwardMatchesFiniteDifferences) {
  const auto [N, V] = GetParam();
  std::mt19937 rng(static_cast<unsigned>(N + V * 3));
  const Vec logits = Random(N * V, rng, -3.0f, 3.0f);
  const std::vector<int32_t> targets = Targets(N, V, rng);
  const float dloss = 1.0f / static_cast<float>(N);  // the mean loss
  const DVec want = NumericGrad(
      [&](const DVec& x) {
        double total = 0;
        for (double l : CrossEntropyRef(x, targets, N, V)) total += l;
        return total * dloss;
      },
      ToDouble(logits));
  Vec losses(N), probs(N * V);
  softmax_crossentropy_forward(losses.data(), probs.data(), logits.data(), targets.data(), N, V);
  const Vec d0 = Random(N * V, rng);
  Vec dlogits = d0;
  softmax_crossentropy_backward(dlogits.data(), probs.data(), targets.data(), dloss, N, V);
  ExpectAccumulatedClose(dlogits, d0, want, 1e-6, 1e-4, "dlogits");
  for (int64_t n = 0; n < N; ++n) {  // ignored rows untouched, bit for bit
    if (targets[n] >= 0) continue;
    for (int64_t v = 0; v < V; ++v) ASSERT_EQ(dlogits[n * V + v], d0[n * V + v]);
  }
}

const auto kSmallShapes = ::testing::Values(Shape{1, 1}, Shape{4, 2}, Shape{5, 7}, Shape{8, 33},
                                            Shape{12, 256});
INSTANTIATE_TEST_SUITE_P(Small, CrossEntropyTest, kSmallShapes, Name);
INSTANTIATE_TEST_SUITE_P(Small, CrossEntropyGradTest, kSmallShapes, Name);
INSTANTIATE_TEST_SUITE_P(Large, CrossEntropyTest, ::testing::Values(Shape{64, 1031}), Name);

TEST(CrossEntropy, ExtremeLogitsGiveFiniteLoss) {
  // The target's probability underflows to 0 in f32; the loss must still be finite (~1000).
  const int64_t V = 3;
  const float logits[V] = {1000.0f, 0.0f, -1000.0f};
  const int32_t target = 2;
  float loss = 0, probs[V];
  softmax_crossentropy_forward(&loss, probs, logits, &target, 1, V);
  EXPECT_FLOAT_EQ(loss, 2000.0f);
  EXPECT_EQ(probs[0], 1.0f);
  EXPECT_EQ(probs[2], 0.0f);
}

}  // namespace
}  // namespace fsdp::kernels::cpu
