// swiglu_forward / swiglu_backward against a double reference and finite differences;
// the 16-bit forms (swiglu_forward_lowp's output, swiglu_backward_lowp's kept input) bitwise
// against the f32 kernel.
#include "fsdp/kernels_cpu.h"
#include "tests/kernels/reference.h"

namespace fsdp::kernels::cpu {
namespace {

using namespace fsdp::kernels::cpu::testing;

struct Shape {
  int64_t N, F;
};

class SwigluTest : public ::testing::TestWithParam<Shape> {};

TEST_P(SwigluTest, ForwardMatchesReference) {
  const auto [N, F] = GetParam();
  std::mt19937 rng(static_cast<unsigned>(N * 100 + F));
  const Vec gu = Random(N * 2 * F, rng, -6.0f, 6.0f);
  const DVec want = SwigluRef(ToDouble(gu), N, F);
  Vec out(N * F, 5.0f);
  swiglu_forward(out.data(), gu.data(), N, F);
  ExpectClose(out, want, 1e-6, 1e-6, "out");
  // Written in bf16 / f16: bitwise the f32 values cast.
  for (DType d : {DType::kBF16, DType::kF16}) {
    std::vector<uint16_t> got(N * F, 0xabcd);
    swiglu_forward_lowp(got.data(), gu.data(), N, F, d);
    EXPECT_EQ(got, ToLowp(out, d)) << DTypeName(d);
  }
}

TEST_P(SwigluTest, BackwardMatchesFiniteDifferencesAndAccumulates) {
  const auto [N, F] = GetParam();
  std::mt19937 rng(static_cast<unsigned>(N * 7 + F * 13));
  const Vec gu = Random(N * 2 * F, rng, -5.0f, 5.0f), dout = Random(N * F, rng);
  // Rows are independent, so the finite differences are taken row by row.
  const DVec dgu_all = ToDouble(gu);
  DVec want(gu.size());
  for (int64_t n = 0; n < N; ++n) {
    const Vec drow(dout.begin() + n * F, dout.begin() + (n + 1) * F);
    const DVec g =
        NumericGrad([&](const DVec& x) { return Dot(SwigluRef(x, 1, F), drow); },
                    DVec(dgu_all.begin() + n * 2 * F, dgu_all.begin() + (n + 1) * 2 * F));
    std::copy(g.begin(), g.end(), want.begin() + n * 2 * F);
  }
  const Vec dgu0 = Random(gu.size(), rng);
  Vec dgu = dgu0;
  swiglu_backward(dgu.data(), dout.data(), gu.data(), N, F);
  ExpectAccumulatedClose(dgu, dgu0, want, 1e-5, 1e-5, "dgu");
  // A second call adds the same gradient again.
  swiglu_backward(dgu.data(), dout.data(), gu.data(), N, F);
  DVec twice(want.size());
  for (size_t i = 0; i < want.size(); ++i) twice[i] = 2 * want[i];
  ExpectAccumulatedClose(dgu, dgu0, twice, 2e-5, 1e-5, "dgu twice");
}

TEST_P(SwigluTest, KeptInputIsTheF32KernelOnItsWidenedValues) {
  const auto [N, F] = GetParam();
  std::mt19937 rng(static_cast<unsigned>(N * 3 + F * 5));
  const Vec gu = Random(N * 2 * F, rng, -5.0f, 5.0f), dout = Random(N * F, rng),
            dgu0 = Random(gu.size(), rng);
  for (DType d : {DType::kBF16, DType::kF16}) {
    const std::vector<uint16_t> low = ToLowp(gu, d);
    const Vec widened = FromLowp(low, d);
    Vec got = dgu0, want = dgu0;
    swiglu_backward_lowp(got.data(), dout.data(), low.data(), N, F, d);
    swiglu_backward(want.data(), dout.data(), widened.data(), N, F);
    EXPECT_EQ(got, want) << DTypeName(d);
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, SwigluTest,
                         ::testing::Values(Shape{1, 1}, Shape{3, 2}, Shape{5, 7}, Shape{4, 16},
                                           Shape{9, 37}, Shape{70, 300},
                                           Shape{3, 1100}, Shape{16, 1030}),
                         [](const auto& info) {
                           return absl::StrCat("N", info.param.N, "F", info.param.F);
                         });

TEST(Swiglu, ExtremeGatesStayFinite) {
  // exp(-g) overflows f32 for g < -88: silu(g) must still be ~0 (not NaN) and its gradient
  // ~0; for large g, silu(g) = g.
  const int64_t N = 1, F = 4;
  const Vec gu = {-1000.0f, -100.0f, 100.0f, 1000.0f, 2.0f, 3.0f, 4.0f, 5.0f};
  Vec out(F), dgu(2 * F, 0.0f);
  const Vec dout(F, 1.0f);
  swiglu_forward(out.data(), gu.data(), N, F);
  swiglu_backward(dgu.data(), dout.data(), gu.data(), N, F);
  EXPECT_NEAR(out[0], 0.0f, 1e-30f);
  EXPECT_NEAR(out[1], 0.0f, 1e-30f);
  EXPECT_FLOAT_EQ(out[2], 400.0f);
  EXPECT_FLOAT_EQ(out[3], 5000.0f);
  for (float g : dgu) EXPECT_TRUE(std::isfinite(g)) << g;
  EXPECT_NEAR(dgu[0], 0.0f, 1e-30f);
  EXPECT_FLOAT_EQ(dgu[2], 4.0f);   // d/dg = up for large g
  EXPECT_FLOAT_EQ(dgu[7], 1000.0f);  // d/dup = silu(g)
}

}  // namespace
}  // namespace fsdp::kernels::cpu
