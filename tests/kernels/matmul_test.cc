// matmul_forward / matmul_backward / sgemm (oneDNN) against double references and finite
// differences; accumulation, nullptr outputs, and the sgemm peak helper.
#include <omp.h>

#include <tuple>

#include "fsdp/kernels_cpu.h"
#include "tests/kernels/reference.h"

namespace fsdp::kernels::cpu {
namespace {

using namespace fsdp::kernels::cpu::testing;

struct Shape {
  int64_t M, K, N;
};

std::string Name(const ::testing::TestParamInfo<Shape>& info) {
  return absl::StrCat("M", info.param.M, "K", info.param.K, "N", info.param.N);
}

class MatmulTest : public ::testing::TestWithParam<Shape> {};
// Finite differences cost O(size^2): run on the small shapes only.
class MatmulGradTest : public MatmulTest {};

TEST_P(MatmulTest, ForwardMatchesReference) {
  const auto [M, K, N] = GetParam();
  std::mt19937 rng(static_cast<unsigned>(M * 131 + K * 7 + N));
  const Vec inp = Random(M * K, rng), weight = Random(N * K, rng), bias = Random(N, rng);
  Vec out(M * N, 123.0f);  // forward overwrites
  matmul_forward(out.data(), inp.data(), weight.data(), bias.data(), M, K, N);
  const double tol = 1e-6 * std::sqrt(static_cast<double>(K));
  ExpectClose(out, MatmulRef(ToDouble(inp), ToDouble(weight), ToDouble(bias), M, K, N), tol,
              tol, "out");
  matmul_forward(out.data(), inp.data(), weight.data(), nullptr, M, K, N);
  ExpectClose(out, MatmulRef(ToDouble(inp), ToDouble(weight), {}, M, K, N), tol, tol,
              "out (no bias)");
}

TEST_P(MatmulGradTest, BackwardMatchesFiniteDifferences) {
  const auto [M, K, N] = GetParam();
  std::mt19937 rng(static_cast<unsigned>(M + K * 31 + N * 977));
  const Vec inp = Random(M * K, rng), weight = Random(N * K, rng), bias = Random(N, rng);
  const Vec dout = Random(M * N, rng);  // the objective is sum(out * dout)
  const DVec di = ToDouble(inp), dw = ToDouble(weight), db = ToDouble(bias);
  const DVec want_dinp = NumericGrad(
      [&](const DVec& x) { return Dot(MatmulRef(x, dw, db, M, K, N), dout); }, di);
  const DVec want_dweight = NumericGrad(
      [&](const DVec& x) { return Dot(MatmulRef(di, x, db, M, K, N), dout); }, dw);
  const DVec want_dbias = NumericGrad(
      [&](const DVec& x) { return Dot(MatmulRef(di, dw, x, M, K, N), dout); }, db);

  // Pre-filled gradients: backward must add to them.
  const Vec dinp0 = Random(M * K, rng), dweight0 = Random(N * K, rng), dbias0 = Random(N, rng);
  Vec dinp = dinp0, dweight = dweight0, dbias = dbias0;
  matmul_backward(dinp.data(), dweight.data(), dbias.data(), dout.data(), inp.data(),
                  weight.data(), M, K, N);
  ExpectAccumulatedClose(dinp, dinp0, want_dinp, 1e-4, 1e-4, "dinp");
  ExpectAccumulatedClose(dweight, dweight0, want_dweight, 1e-4, 1e-4, "dweight");
  ExpectAccumulatedClose(dbias, dbias0, want_dbias, 1e-4, 1e-4, "dbias");

  // Each output alone (the others nullptr) gives the same values.
  for (int which = 0; which < 3; ++which) {
    Vec a = dinp0, b = dweight0, c = dbias0;
    matmul_backward(which == 0 ? a.data() : nullptr, which == 1 ? b.data() : nullptr,
                    which == 2 ? c.data() : nullptr, dout.data(), inp.data(), weight.data(),
                    M, K, N);
    EXPECT_EQ(a, which == 0 ? dinp : dinp0) << which;
    EXPECT_EQ(b, which == 1 ? dweight : dweight0) << which;
    EXPECT_EQ(c, which == 2 ? dbias : dbias0) << which;
  }
}

// Larger shapes (other oneDNN code paths) against the closed-form gradients in double.
TEST_P(MatmulTest, BackwardMatchesReferenceGradients) {
  const auto [M, K, N] = GetParam();
  std::mt19937 rng(static_cast<unsigned>(M * 3 + K * 5 + N * 7));
  const Vec inp = Random(M * K, rng), weight = Random(N * K, rng), dout = Random(M * N, rng);
  DVec want_dinp(M * K, 0.0), want_dweight(N * K, 0.0), want_dbias(N, 0.0);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t n = 0; n < N; ++n) {
      const double g = dout[m * N + n];
      want_dbias[n] += g;
      for (int64_t k = 0; k < K; ++k) {
        want_dinp[m * K + k] += g * weight[n * K + k];
        want_dweight[n * K + k] += g * inp[m * K + k];
      }
    }
  }
  Vec dinp(M * K, 0.0f), dweight(N * K, 0.0f), dbias(N, 0.0f);
  matmul_backward(dinp.data(), dweight.data(), dbias.data(), dout.data(), inp.data(),
                  weight.data(), M, K, N);
  const double tol_n = 1e-6 * std::sqrt(static_cast<double>(N));
  const double tol_m = 1e-6 * std::sqrt(static_cast<double>(M));
  ExpectClose(dinp, want_dinp, tol_n, tol_n, "dinp");
  ExpectClose(dweight, want_dweight, tol_m, tol_m, "dweight");
  ExpectClose(dbias, want_dbias, tol_m, tol_m, "dbias");
}

TEST_P(MatmulTest, SgemmMatchesReference) {
  const auto [M, K, N] = GetParam();
  std::mt19937 rng(static_cast<unsigned>(M ^ (K << 8) ^ (N << 16)));
  const Vec a = Random(M * K, rng), b = Random(K * N, rng);
  DVec want(M * N, 0.0);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t k = 0; k < K; ++k) {
      for (int64_t n = 0; n < N; ++n) want[m * N + n] += double{a[m * K + k]} * b[k * N + n];
    }
  }
  Vec c(M * N, -7.0f);
  sgemm(c.data(), a.data(), b.data(), M, K, N);
  const double tol = 1e-6 * std::sqrt(static_cast<double>(K));
  ExpectClose(c, want, tol, tol, "c");
}

const auto kSmallShapes = ::testing::Values(Shape{7, 13, 5}, Shape{1, 1, 1}, Shape{1, 9, 3},
                                            Shape{4, 8, 16}, Shape{17, 3, 33});
INSTANTIATE_TEST_SUITE_P(Small, MatmulTest, kSmallShapes, Name);
INSTANTIATE_TEST_SUITE_P(Small, MatmulGradTest, kSmallShapes, Name);
INSTANTIATE_TEST_SUITE_P(Large, MatmulTest,
                         ::testing::Values(Shape{64, 96, 80}, Shape{130, 257, 67}), Name);

TEST(Matmul, EmptyReductionGivesBias) {
  const float bias[3] = {1, 2, 3};
  float out[6] = {9, 9, 9, 9, 9, 9};
  matmul_forward(out, nullptr, nullptr, bias, 2, 0, 3);
  for (int i = 0; i < 6; ++i) EXPECT_EQ(out[i], bias[i % 3]);
  matmul_forward(out, nullptr, nullptr, nullptr, 2, 0, 3);
  for (float v : out) EXPECT_EQ(v, 0.0f);
}

TEST(Matmul, RepeatedCallsReuseThePlanAndAgree) {
  std::mt19937 rng(5);
  const Vec inp = Random(33 * 20, rng), weight = Random(12 * 20, rng);
  Vec first(33 * 12), again(33 * 12);
  matmul_forward(first.data(), inp.data(), weight.data(), nullptr, 33, 20, 12);
  for (int i = 0; i < 3; ++i) {
    matmul_forward(again.data(), inp.data(), weight.data(), nullptr, 33, 20, 12);
    EXPECT_EQ(first, again);
  }
}

TEST(Matmul, ThreadCountChangesAreHonoured) {
  // The plan cache is keyed by the OpenMP thread count; results must not depend on it
  // beyond rounding.
  std::mt19937 rng(6);
  const int64_t M = 96, K = 128, N = 64;
  const Vec inp = Random(M * K, rng), weight = Random(N * K, rng);
  const DVec want = MatmulRef(ToDouble(inp), ToDouble(weight), {}, M, K, N);
  const int saved = omp_get_max_threads();
  for (int threads : {1, 2, 3}) {
    omp_set_num_threads(threads);
    Vec out(M * N);
    matmul_forward(out.data(), inp.data(), weight.data(), nullptr, M, K, N);
    ExpectClose(out, want, 2e-5, 2e-5, absl::StrCat("threads=", threads));
  }
  omp_set_num_threads(saved);
}

TEST(SgemmPeak, MeasuresAPositiveRateAndRestoresThreads) {
  const int saved = omp_get_max_threads();
  const double gflops = measure_sgemm_gflops(64, 1, 3);
  EXPECT_GT(gflops, 0.0);
  EXPECT_TRUE(std::isfinite(gflops));
  EXPECT_EQ(omp_get_max_threads(), saved);
  EXPECT_EQ(measure_sgemm_gflops(0, 1, 1), 0.0);
}

}  // namespace
}  // namespace fsdp::kernels::cpu
