// Causal attention forward/backward against a double reference and finite differences.
#include <omp.h>

#include "fsdp/kernels_cpu.h"
#include "kernels/cpu/attention.h"
#include "tests/kernels/reference.h"

namespace fsdp::kernels::cpu {
namespace {

using namespace fsdp::kernels::cpu::testing;

struct Shape {
  int64_t B, T, C, NH;
};

std::string Name(const ::testing::TestParamInfo<Shape>& info) {
  const Shape& s = info.param;
  return absl::StrCat("B", s.B, "T", s.T, "C", s.C, "NH", s.NH);
}

class AttentionTest : public ::testing::TestWithParam<Shape> {};
// Finite differences cost O(size^2): run on the small shapes only.
class AttentionGradTest : public AttentionTest {};

TEST_P(AttentionTest, ForwardMatchesReference) {
  const auto [B, T, C, NH] = GetParam();
  std::mt19937 rng(static_cast<unsigned>(B * 1000 + T * 10 + C + NH));
  // Spread-out scores so the softmax is far from uniform.
  const Vec qkv = Random(B * T * 3 * C, rng, -2.0f, 2.0f);
  DVec want_lse;
  const DVec want = AttentionRef(ToDouble(qkv), B, T, C, NH, &want_lse);
  Vec out(B * T * C, 5.0f), lse(B * NH * T, 5.0f);  // forward overwrites both fully
  attention_forward(out.data(), lse.data(), qkv.data(), B, T, C, NH);
  ExpectClose(out, want, 2e-6, 2e-5, "out");
  ExpectClose(lse, want_lse, 2e-6, 2e-5, "lse");
}

TEST_P(AttentionGradTest, BackwardMatchesFiniteDifferences) {
  const auto [B, T, C, NH] = GetParam();
  std::mt19937 rng(static_cast<unsigned>(B * 7 + T * 11 + C * 13 + NH));
  const Vec qkv = Random(B * T * 3 * C, rng, -1.5f, 1.5f), dout = Random(B * T * C, rng);
  const DVec want = NumericGrad(
      [&](const DVec& x) { return Dot(AttentionRef(x, B, T, C, NH), dout); }, ToDouble(qkv));

  Vec out(B * T * C), lse(B * NH * T);
  attention_forward(out.data(), lse.data(), qkv.data(), B, T, C, NH);
  const Vec dqkv0 = Random(qkv.size(), rng);
  Vec dqkv = dqkv0;
  attention_backward(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), B, T, C, NH);
  ExpectAccumulatedClose(dqkv, dqkv0, want, 1e-4, 1e-4, "dqkv");
}

// Odd head sizes, T = 1, NH = 1, T not a multiple of the vector width.
const auto kSmallShapes =
    ::testing::Values(Shape{1, 1, 4, 1}, Shape{1, 1, 6, 2}, Shape{2, 5, 8, 2}, Shape{1, 7, 12, 3},
                      Shape{2, 9, 5, 1}, Shape{3, 4, 16, 4}, Shape{1, 17, 6, 2});
INSTANTIATE_TEST_SUITE_P(Small, AttentionTest, kSmallShapes, Name);
INSTANTIATE_TEST_SUITE_P(Small, AttentionGradTest, kSmallShapes, Name);
INSTANTIATE_TEST_SUITE_P(Large, AttentionTest,
                         ::testing::Values(Shape{2, 64, 64, 4}, Shape{1, 100, 96, 6},
                                           Shape{1, 150, 32, 2}, Shape{1, 256, 64, 1}),
                         Name);

// The kernels skip the masked half block by block (internal::kAttentionBlock rows per block).
// Small blocks put many blocks, and partial last blocks, on shapes small enough for finite
// differences.
struct BlockedShape {
  int64_t B, T, C, NH, block;
};

class BlockedAttentionTest : public ::testing::TestWithParam<BlockedShape> {};

TEST_P(BlockedAttentionTest, ForwardAndBackwardMatchReferenceAndFiniteDifferences) {
  const auto [B, T, C, NH, block] = GetParam();
  std::mt19937 rng(static_cast<unsigned>(B * 31 + T * 7 + C * 5 + NH * 3 + block));
  const Vec qkv = Random(B * T * 3 * C, rng, -1.5f, 1.5f), dout = Random(B * T * C, rng);
  DVec want_lse;
  const DVec want_out = AttentionRef(ToDouble(qkv), B, T, C, NH, &want_lse);
  Vec out(B * T * C, 5.0f), lse(B * NH * T, 5.0f);  // forward overwrites both fully
  internal::AttentionForward(out.data(), lse.data(), qkv.data(), B, T, NH, NH, C / NH, block);
  ExpectClose(out, want_out, 2e-6, 2e-5, "out");
  ExpectClose(lse, want_lse, 2e-6, 2e-5, "lse");

  const DVec want = NumericGrad(
      [&](const DVec& x) { return Dot(AttentionRef(x, B, T, C, NH), dout); }, ToDouble(qkv));
  const Vec dqkv0 = Random(qkv.size(), rng);
  Vec dqkv = dqkv0;
  internal::AttentionBackward(dqkv.data(), dout.data(), qkv.data(), DType::kF32, out.data(),
                              DType::kF32, lse.data(), B, T, NH, NH, C / NH, block);
  ExpectAccumulatedClose(dqkv, dqkv0, want, 1e-4, 1e-4, "dqkv");
}

INSTANTIATE_TEST_SUITE_P(
    Blocks, BlockedAttentionTest,
    ::testing::Values(BlockedShape{1, 9, 6, 2, 1}, BlockedShape{2, 10, 8, 2, 3},
                      BlockedShape{1, 12, 12, 3, 4}, BlockedShape{1, 13, 4, 1, 5},
                      BlockedShape{2, 7, 8, 2, 7}, BlockedShape{1, 6, 8, 2, 16}),
    [](const ::testing::TestParamInfo<BlockedShape>& info) {
      const BlockedShape& s = info.param;
      return absl::StrCat("B", s.B, "T", s.T, "C", s.C, "NH", s.NH, "block", s.block);
    });

class AttentionLargeBackwardTest : public ::testing::TestWithParam<int64_t> {};

// Backward of larger shapes against a closed-form double backward (FD would be too slow):
// one block, and several blocks with a partial last one at the kernels' own block size.
TEST_P(AttentionLargeBackwardTest, BackwardMatchesReference) {
  const int64_t B = 2, T = GetParam(), C = 32, NH = 2, D = C / NH;
  std::mt19937 rng(11);
  const Vec qkv = Random(B * T * 3 * C, rng), dout = Random(B * T * C, rng);
  const DVec want = GqaAttentionBackwardRef(ToDouble(qkv), dout, B, T, NH, NH, D);
  Vec out(B * T * C), lse(B * NH * T), dqkv(qkv.size(), 0.0f);
  attention_forward(out.data(), lse.data(), qkv.data(), B, T, C, NH);
  attention_backward(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), B, T, C, NH);
  ExpectClose(dqkv, want, 1e-5, 1e-4, "dqkv");
}
INSTANTIATE_TEST_SUITE_P(Sizes, AttentionLargeBackwardTest,
                         ::testing::Values(int64_t{48}, internal::kAttentionBlock * 2 + 22),
                         [](const ::testing::TestParamInfo<int64_t>& info) {
                           return absl::StrCat("T", info.param);
                         });

TEST(Attention, LargeScoresDoNotOverflow) {
  // Scores around +-400 overflow exp() without the max subtraction.
  const int64_t B = 1, T = 6, C = 4, NH = 1;
  std::mt19937 rng(12);
  const Vec qkv = Random(B * T * 3 * C, rng, -20.0f, 20.0f);
  DVec want_lse;
  const DVec want = AttentionRef(ToDouble(qkv), B, T, C, NH, &want_lse);
  Vec out(B * T * C), lse(B * NH * T);
  attention_forward(out.data(), lse.data(), qkv.data(), B, T, C, NH);
  ExpectClose(out, want, 1e-4, 1e-4, "out");
  ExpectClose(lse, want_lse, 1e-5, 1e-4, "lse");
}

TEST(Attention, LeavesTheCallersThreadCountAlone) {
  // The kernel runs each head's GEMMs single-threaded inside its parallel region; that
  // setting must not leak out to the calling (rank) thread.
  const int saved = omp_get_max_threads();
  omp_set_num_threads(3);
  const int64_t B = 2, T = 4, C = 8, NH = 2;
  std::mt19937 rng(13);
  const Vec qkv = Random(B * T * 3 * C, rng), dout = Random(B * T * C, rng);
  Vec out(B * T * C), lse(B * NH * T), dqkv(qkv.size(), 0.0f);
  attention_forward(out.data(), lse.data(), qkv.data(), B, T, C, NH);
  attention_backward(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), B, T, C, NH);
  EXPECT_EQ(omp_get_max_threads(), 3);
  omp_set_num_threads(saved);
}

}  // namespace
}  // namespace fsdp::kernels::cpu
