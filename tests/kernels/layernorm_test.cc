// layernorm_forward / layernorm_backward against a double reference and finite differences.
#include "fsdp/kernels_cpu.h"
#include "tests/kernels/reference.h"

namespace fsdp::kernels::cpu {
namespace {

using namespace fsdp::kernels::cpu::testing;

struct Shape {
  int64_t N, C;
};

class LayernormTest : public ::testing::TestWithParam<Shape> {};

TEST_P(LayernormTest, ForwardMatchesReference) {
  const auto [N, C] = GetParam();
  std::mt19937 rng(static_cast<unsigned>(N * 100 + C));
  // An offset mean checks that the variance does not cancel catastrophically.
  const Vec inp = Random(N * C, rng, 2.0f, 4.0f), weight = Random(C, rng), bias = Random(C, rng);
  DVec want_mean, want_rstd;
  const DVec want = LayernormRef(ToDouble(inp), ToDouble(weight), ToDouble(bias), N, C,
                                 &want_mean, &want_rstd);
  Vec out(N * C), mean(N), rstd(N);
  layernorm_forward(out.data(), mean.data(), rstd.data(), inp.data(), weight.data(),
                    bias.data(), N, C);
  ExpectClose(out, want, 2e-5, 2e-5, "out");
  ExpectClose(mean, want_mean, 1e-6, 1e-6, "mean");
  ExpectClose(rstd, want_rstd, 1e-5, 1e-5, "rstd");
}

TEST_P(LayernormTest, BackwardMatchesFiniteDifferences) {
  const auto [N, C] = GetParam();
  std::mt19937 rng(static_cast<unsigned>(N * 7 + C * 13));
  const Vec inp = Random(N * C, rng, -2.0f, 2.0f), weight = Random(C, rng, 0.5f, 1.5f),
            bias = Random(C, rng), dout = Random(N * C, rng);
  const DVec di = ToDouble(inp), dw = ToDouble(weight), db = ToDouble(bias);
  // Rows are independent, so d/dinp is taken row by row (keeps larger shapes cheap).
  DVec want_dinp(N * C);
  for (int64_t n = 0; n < N; ++n) {
    const Vec drow(dout.begin() + n * C, dout.begin() + (n + 1) * C);
    const DVec g = NumericGrad(
        [&](const DVec& x) { return Dot(LayernormRef(x, dw, db, 1, C), drow); },
        DVec(di.begin() + n * C, di.begin() + (n + 1) * C));
    std::copy(g.begin(), g.end(), want_dinp.begin() + n * C);
  }
  const DVec want_dweight = NumericGrad(
      [&](const DVec& x) { return Dot(LayernormRef(di, x, db, N, C), dout); }, dw);
  const DVec want_dbias = NumericGrad(
      [&](const DVec& x) { return Dot(LayernormRef(di, dw, x, N, C), dout); }, db);

  Vec out(N * C), mean(N), rstd(N);
  layernorm_forward(out.data(), mean.data(), rstd.data(), inp.data(), weight.data(),
                    bias.data(), N, C);
  const Vec dinp0 = Random(N * C, rng), dweight0 = Random(C, rng), dbias0 = Random(C, rng);
  Vec dinp = dinp0, dweight = dweight0, dbias = dbias0;
  layernorm_backward(dinp.data(), dweight.data(), dbias.data(), dout.data(), inp.data(),
                     weight.data(), mean.data(), rstd.data(), N, C);
  ExpectAccumulatedClose(dinp, dinp0, want_dinp, 1e-4, 1e-4, "dinp");
  ExpectAccumulatedClose(dweight, dweight0, want_dweight, 1e-4, 1e-4, "dweight");
  ExpectAccumulatedClose(dbias, dbias0, want_dbias, 1e-4, 1e-4, "dbias");

  for (int which = 0; which < 3; ++which) {
    Vec a = dinp0, b = dweight0, c = dbias0;
    layernorm_backward(which == 0 ? a.data() : nullptr, which == 1 ? b.data() : nullptr,
                       which == 2 ? c.data() : nullptr, dout.data(), inp.data(),
                       weight.data(), mean.data(), rstd.data(), N, C);
    EXPECT_EQ(a, which == 0 ? dinp : dinp0) << which;
    EXPECT_EQ(b, which == 1 ? dweight : dweight0) << which;
    EXPECT_EQ(c, which == 2 ? dbias : dbias0) << which;
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, LayernormTest,
                         ::testing::Values(Shape{1, 1}, Shape{3, 2}, Shape{5, 7}, Shape{4, 16},
                                           Shape{9, 37}, Shape{2, 67}, Shape{130, 160}),
                         [](const auto& info) {
                           return absl::StrCat("N", info.param.N, "C", info.param.C);
                         });

TEST(Layernorm, LargeOffsetKeepsPrecision) {
  // mean 1000, std ~0.3: E[x^2] - E[x]^2 in f32 would lose most digits.
  std::mt19937 rng(3);
  const int64_t N = 4, C = 256;
  const Vec inp = Random(N * C, rng, 999.5f, 1000.5f);
  const Vec weight(C, 1.0f), bias(C, 0.0f);
  const DVec want = LayernormRef(ToDouble(inp), ToDouble(weight), ToDouble(bias), N, C);
  Vec out(N * C), mean(N), rstd(N);
  layernorm_forward(out.data(), mean.data(), rstd.data(), inp.data(), weight.data(),
                    bias.data(), N, C);
  ExpectClose(out, want, 2e-5, 2e-5, "out");
}

}  // namespace
}  // namespace fsdp::kernels::cpu
