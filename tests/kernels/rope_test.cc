// rope_forward / rope_backward (Hugging Face layout) against a double reference, a worked
// example, the f32 angles PyTorch uses, and finite differences.
#include <cstring>

#include "fsdp/kernels_cpu.h"
#include "tests/kernels/reference.h"

namespace fsdp::kernels::cpu {
namespace {

using namespace fsdp::kernels::cpu::testing;

struct Shape {
  int64_t B, T, W, NH, D;
};

std::string Name(const ::testing::TestParamInfo<Shape>& info) {
  const Shape& s = info.param;
  return absl::StrCat("B", s.B, "T", s.T, "W", s.W, "NH", s.NH, "D", s.D);
}

class RopeTest : public ::testing::TestWithParam<Shape> {};

TEST_P(RopeTest, ForwardMatchesReferenceAndLeavesOtherColumnsAlone) {
  const auto [B, T, W, NH, D] = GetParam();
  std::mt19937 rng(static_cast<unsigned>(B * 1000 + T * 100 + W * 10 + NH + D));
  const Vec x0 = Random(B * T * W, rng, -2.0f, 2.0f);
  const DVec want = RopeRef(ToDouble(x0), B, T, W, NH, D, 10000.0);
  Vec x = x0;
  rope_forward(x.data(), B, T, W, NH, D, 10000.0f);
  ExpectClose(x, want, 2e-6, 2e-6, "x");
  for (int64_t r = 0; r < B * T; ++r) {
    // Bitwise: columns [NH*D, W) are not touched.
    EXPECT_EQ(std::memcmp(&x[r * W + NH * D], &x0[r * W + NH * D], (W - NH * D) * sizeof(float)),
              0)
        << "row " << r;
    // Position 0 is the identity.
    if (r % T == 0) {
      EXPECT_EQ(std::memcmp(&x[r * W], &x0[r * W], NH * D * sizeof(float)), 0) << "row " << r;
    }
  }
}

TEST_P(RopeTest, BackwardIsTheTransposeAndUndoesForward) {
  const auto [B, T, W, NH, D] = GetParam();
  std::mt19937 rng(static_cast<unsigned>(B * 7 + T * 11 + W * 13 + NH * 17 + D));
  const Vec x0 = Random(B * T * W, rng), dout = Random(B * T * W, rng);
  // d/dx of <rope(x), dout>, by central differences on the double reference.
  const DVec want = NumericGrad(
      [&](const DVec& x) { return Dot(RopeRef(x, B, T, W, NH, D, 10000.0), dout); },
      ToDouble(x0));
  Vec dx = dout;
  rope_backward(dx.data(), B, T, W, NH, D, 10000.0f);
  ExpectClose(dx, want, 1e-6, 1e-5, "dx");  // in place, no accumulation

  // Rotating back recovers the input (to rounding).
  Vec x = x0;
  rope_forward(x.data(), B, T, W, NH, D, 10000.0f);
  rope_backward(x.data(), B, T, W, NH, D, 10000.0f);
  ExpectClose(x, x0, 1e-6, 1e-6, "backward(forward(x))");
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, RopeTest,
    ::testing::Values(Shape{1, 1, 4, 1, 4}, Shape{1, 5, 2, 1, 2}, Shape{2, 7, 24, 2, 8},
                      Shape{1, 9, 30, 3, 6}, Shape{2, 6, 48, 4, 8}, Shape{1, 13, 37, 2, 16},
                      Shape{3, 4, 96, 5, 12}),
    Name);

TEST(Rope, WorkedExample) {
  // D = 4, theta = 10000: inv_freq = [1, 10000^(-1/2)] = [1, 0.01]; pairs (x0, x2), (x1, x3).
  // At position p: x0' = x0 cos(p) - x2 sin(p), x2' = x2 cos(p) + x0 sin(p), and the same
  // with (x1, x3) and angle 0.01 p. Row [1, 2, 3, 4] at positions 0, 1, 2; column 4 is not
  // part of a head.
  const int64_t B = 1, T = 3, W = 5, NH = 1, D = 4;
  Vec x;
  for (int t = 0; t < T; ++t) x.insert(x.end(), {1.0f, 2.0f, 3.0f, 4.0f, 9.0f});
  rope_forward(x.data(), B, T, W, NH, D, 10000.0f);
  const std::vector<double> want = {
      1.0, 2.0, 3.0, 4.0, 9.0,
      // 1 cos 1 - 3 sin 1, 2 cos .01 - 4 sin .01, 3 cos 1 + sin 1, 4 cos .01 + 2 sin .01
      -1.9841106485555495, 1.959900667496664, 2.4623779024123156, 4.019799668334994, 9.0,
      -3.1440391170241875, 1.9196053465598233, -0.33914308281574557, 4.039197360052977, 9.0};
  ExpectClose(x, want, 1e-6, 1e-6, "x");
}

TEST(Rope, AnglesAreComputedInF32AsPyTorchDoes) {
  // At large positions the f32 angle float(p) * inv_freq differs from the exact one by up to
  // half an ulp of p (2.4e-4 at p ~ 4096); Hugging Face computes it in f32, and so must the
  // kernel to match it. Reference: inv_freq and the angle rounded to f32 the same way,
  // everything else in double.
  const int64_t B = 1, T = 4096, D = 128, NH = 1, W = D;
  const float theta = 10000.0f;
  std::mt19937 rng(21);
  const Vec x0 = Random(B * T * W, rng);
  DVec want(x0.size());
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t j = 0; j < D / 2; ++j) {
      const float inv_freq =
          1.0f / std::pow(theta, static_cast<float>(2 * j) / static_cast<float>(D));
      const double angle = static_cast<float>(t) * inv_freq;  // the product rounded to f32
      const double a = x0[t * W + j], b = x0[t * W + j + D / 2];
      want[t * W + j] = a * std::cos(angle) - b * std::sin(angle);
      want[t * W + j + D / 2] = b * std::cos(angle) + a * std::sin(angle);
    }
  }
  Vec x = x0;
  rope_forward(x.data(), B, T, W, NH, D, theta);
  ExpectClose(x, want, 1e-6, 1e-6, "x");
}

}  // namespace
}  // namespace fsdp::kernels::cpu
