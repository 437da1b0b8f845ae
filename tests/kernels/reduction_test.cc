// sum_squares, scale_inplace and all_finite.
#include <omp.h>

#include <bit>
#include <cmath>
#include <limits>

#include "fsdp/kernels_cpu.h"
#include "tests/kernels/reference.h"

namespace fsdp::kernels::cpu {
namespace {

using namespace fsdp::kernels::cpu::testing;

TEST(SumSquares, MatchesDoubleReference) {
  std::mt19937 rng(31);
  for (int64_t n : {0, 1, 7, 8191, 8192, 8193, 100001}) {
    const Vec x = Random(n, rng, -3.0f, 3.0f);
    double want = 0;
    for (float v : x) want += double{v} * v;
    EXPECT_NEAR(sum_squares(x.data(), n), want, 1e-12 * std::max(want, 1.0)) << n;
  }
}

TEST(SumSquares, AccumulatesInDouble) {
  // 2^24 ones: an f32 accumulator would stop at 2^24 = 16777216 when adding more ones.
  const int64_t n = (1 << 24) + 1000;
  const Vec x(n, 1.0f);
  EXPECT_EQ(sum_squares(x.data(), n), static_cast<double>(n));
  // Values whose squares underflow in f32 still count.
  const Vec tiny(10, 1e-30f);
  const double t = tiny[0];
  EXPECT_DOUBLE_EQ(sum_squares(tiny.data(), 10), 10 * t * t);
}

TEST(SumSquares, IndependentOfThreadCount) {
  std::mt19937 rng(32);
  const int64_t n = 300007;
  const Vec x = Random(n, rng);
  const int saved = omp_get_max_threads();
  omp_set_num_threads(1);
  const double one = sum_squares(x.data(), n);
  omp_set_num_threads(3);
  const double three = sum_squares(x.data(), n);
  omp_set_num_threads(saved);
  EXPECT_EQ(one, three);
}

TEST(ScaleInplace, Scales) {
  std::mt19937 rng(33);
  for (int64_t n : {1, 9, 70000}) {
    const Vec x0 = Random(n, rng);
    Vec x = x0;
    scale_inplace(x.data(), 0.37f, n);
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(x[i], x0[i] * 0.37f);
  }
}

TEST(AllFinite, DetectsNaNAndInfAnywhere) {
  for (int64_t n : {1, 5, 8, 9, 100000}) {
    Vec x(n, 1.5f);
    x[0] = std::numeric_limits<float>::max();
    x[n - 1] = std::numeric_limits<float>::denorm_min();
    EXPECT_TRUE(all_finite(x.data(), n)) << n;
    for (float bad : {std::numeric_limits<float>::infinity(),
                      -std::numeric_limits<float>::infinity(),
                      std::numeric_limits<float>::quiet_NaN(),
                      std::bit_cast<float>(0xff800001u)}) {
      for (int64_t pos : {int64_t{0}, n / 2, n - 1}) {
        Vec y = x;
        y[pos] = bad;
        EXPECT_FALSE(all_finite(y.data(), n)) << n << " " << pos;
      }
    }
  }
  EXPECT_TRUE(all_finite(nullptr, 0));
}

}  // namespace
}  // namespace fsdp::kernels::cpu
