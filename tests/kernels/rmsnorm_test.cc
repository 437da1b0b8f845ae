// rmsnorm_forward / rmsnorm_backward against a double reference and finite differences.
#include <omp.h>

#include "fsdp/kernels_cpu.h"
#include "tests/kernels/reference.h"

namespace fsdp::kernels::cpu {
namespace {

using namespace fsdp::kernels::cpu::testing;

struct Shape {
  int64_t N, C;
};

class RmsnormTest : public ::testing::TestWithParam<Shape> {};

TEST_P(RmsnormTest, ForwardMatchesReference) {
  const auto [N, C] = GetParam();
  std::mt19937 rng(static_cast<unsigned>(N * 100 + C));
  const Vec inp = Random(N * C, rng, -3.0f, 3.0f), weight = Random(C, rng);
  DVec want_rstd;
  const DVec want = RmsnormRef(ToDouble(inp), ToDouble(weight), N, C, &want_rstd);
  Vec out(N * C, 5.0f), rstd(N, 5.0f);
  rmsnorm_forward(out.data(), rstd.data(), inp.data(), weight.data(), N, C);
  ExpectClose(out, want, 1e-6, 1e-5, "out");
  ExpectClose(rstd, want_rstd, 1e-6, 1e-5, "rstd");
}

TEST_P(RmsnormTest, BackwardMatchesFiniteDifferencesAndAccumulates) {
  const auto [N, C] = GetParam();
  std::mt19937 rng(static_cast<unsigned>(N * 7 + C * 13));
  const Vec inp = Random(N * C, rng, -2.0f, 2.0f), weight = Random(C, rng, 0.5f, 1.5f),
            dout = Random(N * C, rng);
  const DVec di = ToDouble(inp), dw = ToDouble(weight);
  // Rows are independent, so d/dinp is taken row by row (keeps larger shapes cheap).
  DVec want_dinp(N * C);
  for (int64_t n = 0; n < N; ++n) {
    const Vec drow(dout.begin() + n * C, dout.begin() + (n + 1) * C);
    const DVec g =
        NumericGrad([&](const DVec& x) { return Dot(RmsnormRef(x, dw, 1, C), drow); },
                    DVec(di.begin() + n * C, di.begin() + (n + 1) * C));
    std::copy(g.begin(), g.end(), want_dinp.begin() + n * C);
  }
  const DVec want_dweight =
      NumericGrad([&](const DVec& x) { return Dot(RmsnormRef(di, x, N, C), dout); }, dw);

  Vec out(N * C), rstd(N);
  rmsnorm_forward(out.data(), rstd.data(), inp.data(), weight.data(), N, C);
  // Non-zero starting gradients: backward adds to them.
  const Vec dinp0 = Random(N * C, rng), dweight0 = Random(C, rng);
  Vec dinp = dinp0, dweight = dweight0;
  rmsnorm_backward(dinp.data(), dweight.data(), dout.data(), inp.data(), weight.data(),
                   rstd.data(), N, C);
  ExpectAccumulatedClose(dinp, dinp0, want_dinp, 1e-5, 1e-4, "dinp");
  ExpectAccumulatedClose(dweight, dweight0, want_dweight, 1e-5, 1e-4, "dweight");

  // A nullptr gradient output is skipped; the other one is computed exactly as before.
  for (int which = 0; which < 2; ++which) {
    Vec a = dinp0, b = dweight0;
    rmsnorm_backward(which == 0 ? a.data() : nullptr, which == 1 ? b.data() : nullptr,
                     dout.data(), inp.data(), weight.data(), rstd.data(), N, C);
    EXPECT_EQ(a, which == 0 ? dinp : dinp0) << which;
    EXPECT_EQ(b, which == 1 ? dweight : dweight0) << which;
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, RmsnormTest,
                         ::testing::Values(Shape{1, 1}, Shape{3, 2}, Shape{5, 7}, Shape{4, 16},
                                           Shape{9, 37}, Shape{2, 67}, Shape{130, 160}),
                         [](const auto& info) {
                           return absl::StrCat("N", info.param.N, "C", info.param.C);
                         });

TEST(Rmsnorm, EpsAndZeroRows) {
  // A zero row gives rstd = 1/sqrt(eps) and a zero output; eps is the caller's.
  const int64_t N = 2, C = 8;
  Vec inp(N * C, 0.0f), weight(C, 1.0f), out(N * C, 5.0f), rstd(N);
  for (int64_t c = 0; c < C; ++c) inp[C + c] = 1e-3f;
  rmsnorm_forward(out.data(), rstd.data(), inp.data(), weight.data(), N, C, 1e-6f);
  EXPECT_FLOAT_EQ(rstd[0], 1000.0f);
  EXPECT_EQ(out[0], 0.0f);
  // mean(x^2) = 1e-6 = eps: rstd = 1 / sqrt(2e-6)
  EXPECT_NEAR(rstd[1], 1.0 / std::sqrt(2e-6), 1e-5 / std::sqrt(2e-6));
  EXPECT_NEAR(out[C], 1e-3 / std::sqrt(2e-6), 1e-5);
}

TEST(Rmsnorm, WeightGradientDoesNotDependOnTheThreadCount) {
  // Large enough for the parallel paths; the column sums must be bitwise the same whatever
  // the number of threads.
  const int64_t N = 300, C = 200;
  std::mt19937 rng(5);
  const Vec inp = Random(N * C, rng), weight = Random(C, rng), dout = Random(N * C, rng);
  Vec out(N * C), rstd(N);
  rmsnorm_forward(out.data(), rstd.data(), inp.data(), weight.data(), N, C);
  const int saved = omp_get_max_threads();
  std::vector<Vec> dw, dx;
  for (int threads : {1, 2, 3, 4}) {
    omp_set_num_threads(threads);
    dw.emplace_back(C, 0.5f);
    dx.emplace_back(N * C, 0.25f);
    rmsnorm_backward(dx.back().data(), dw.back().data(), dout.data(), inp.data(),
                     weight.data(), rstd.data(), N, C);
  }
  omp_set_num_threads(saved);
  for (size_t i = 1; i < dw.size(); ++i) {
    EXPECT_EQ(dw[i], dw[0]) << i;
    EXPECT_EQ(dx[i], dx[0]) << i;
  }
}

}  // namespace
}  // namespace fsdp::kernels::cpu
