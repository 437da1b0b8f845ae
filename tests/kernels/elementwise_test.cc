// gelu and residual kernels against double references and finite differences.
#include "fsdp/kernels_cpu.h"
#include "tests/kernels/reference.h"

namespace fsdp::kernels::cpu {
namespace {

using namespace fsdp::kernels::cpu::testing;

class ElementwiseTest : public ::testing::TestWithParam<int64_t> {};

TEST_P(ElementwiseTest, GeluForwardMatchesReference) {
  const int64_t n = GetParam();
  std::mt19937 rng(static_cast<unsigned>(n));
  Vec inp = Random(n, rng, -6.0f, 6.0f);
  if (n >= 4) {  // the tails, where tanh saturates
    inp[0] = -12.0f;
    inp[1] = 12.0f;
    inp[2] = 0.0f;
    inp[3] = 1e-4f;
  }
  DVec want(n);
  for (int64_t i = 0; i < n; ++i) want[i] = GeluRef(inp[i]);
  Vec out(n);
  gelu_forward(out.data(), inp.data(), n);
  ExpectClose(out, want, 1e-6, 1e-5, "gelu");
  // Written in bf16 / f16: bitwise the f32 values cast, across the 1024-element blocks and the
  // parallel threshold.
  for (DType d : {DType::kBF16, DType::kF16}) {
    std::vector<uint16_t> got(n, 0xabcd);
    gelu_forward_lowp(got.data(), inp.data(), n, d);
    EXPECT_EQ(got, ToLowp(out, d)) << DTypeName(d);
  }
}

TEST_P(ElementwiseTest, GeluBackwardMatchesFiniteDifferences) {
  const int64_t n = GetParam();
  std::mt19937 rng(static_cast<unsigned>(n + 1));
  const Vec inp = Random(n, rng, -5.0f, 5.0f), dout = Random(n, rng);
  // Element-wise, so one FD per element of sum_i gelu(x_i) * dout_i is d/dx_i directly.
  DVec want(n);
  for (int64_t i = 0; i < n; ++i) {
    const double h = 1e-5, x = inp[i];
    want[i] = dout[i] * (GeluRef(x + h) - GeluRef(x - h)) / (2 * h);
  }
  const Vec dinp0 = Random(n, rng);
  Vec dinp = dinp0;
  gelu_backward(dinp.data(), inp.data(), dout.data(), n);
  ExpectAccumulatedClose(dinp, dinp0, want, 1e-5, 1e-4, "dinp");
  // The input kept in bf16 / f16: bitwise the f32 kernel on the widened values, across the
  // 1024-element widening blocks and the parallel threshold.
  for (DType d : {DType::kBF16, DType::kF16}) {
    const std::vector<uint16_t> low = ToLowp(inp, d);
    const Vec widened = FromLowp(low, d);
    Vec got = dinp0, ref = dinp0;
    gelu_backward_lowp(got.data(), low.data(), dout.data(), n, d);
    gelu_backward(ref.data(), widened.data(), dout.data(), n);
    EXPECT_EQ(got, ref) << DTypeName(d);
  }
}

TEST_P(ElementwiseTest, Residual) {
  const int64_t n = GetParam();
  std::mt19937 rng(static_cast<unsigned>(n + 2));
  const Vec a = Random(n, rng), b = Random(n, rng), dout = Random(n, rng);
  Vec out(n);
  residual_forward(out.data(), a.data(), b.data(), n);
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(out[i], a[i] + b[i]);
  Vec alias = a;  // out may alias an input
  residual_forward(alias.data(), alias.data(), b.data(), n);
  EXPECT_EQ(alias, out);

  // d(sum(out * dout))/da = dout, accumulated; FD of the double reference agrees trivially,
  // so compare exactly with the definition.
  const Vec da0 = Random(n, rng), db0 = Random(n, rng);
  Vec da = da0, db = db0;
  residual_backward(da.data(), db.data(), dout.data(), n);
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_EQ(da[i], da0[i] + dout[i]);
    ASSERT_EQ(db[i], db0[i] + dout[i]);
  }
  Vec only_b = db0;
  residual_backward(nullptr, only_b.data(), dout.data(), n);
  EXPECT_EQ(only_b, db);
  Vec only_a = da0;
  residual_backward(only_a.data(), nullptr, dout.data(), n);
  EXPECT_EQ(only_a, da);
}

// Sizes around the vector width, the 2048-element GELU block and the parallel thresholds.
INSTANTIATE_TEST_SUITE_P(Sizes, ElementwiseTest,
                         ::testing::Values(1, 3, 7, 8, 9, 31, 2047, 2049, 5000, 70001));

TEST(Elementwise, ResidualFiniteDifference) {
  std::mt19937 rng(9);
  const int64_t n = 5;
  const Vec a = Random(n, rng), b = Random(n, rng), w = Random(n, rng);
  const DVec db = ToDouble(b);
  const auto f = [&](const DVec& x) {
    DVec out(n);
    for (int64_t i = 0; i < n; ++i) out[i] = x[i] + db[i];
    return Dot(out, w);
  };
  const DVec want = NumericGrad(f, ToDouble(a));
  Vec da(n, 0.0f);
  residual_backward(da.data(), nullptr, w.data(), n);
  ExpectClose(da, want, 1e-7, 1e-7, "da");
}

}  // namespace
}  // namespace fsdp::kernels::cpu
