// The kernels' private exp, softmax, row max and dot product (kernels/cpu/vec_math.h):
// accuracy against double, edge cases, every tail length, and results that do not depend on
// where the data sits in memory.
#include "kernels/cpu/vec_math.h"

#include <bit>
#include <cmath>
#include <limits>

#include "fsdp/kernels_cpu.h"
#include "tests/kernels/reference.h"

namespace fsdp::kernels::cpu {
namespace {

using namespace fsdp::kernels::cpu::testing;

// Distance in units in the last place between f32 values of the same sign.
int64_t UlpDistance(float a, float b) {
  return std::abs(int64_t{std::bit_cast<int32_t>(a)} - int64_t{std::bit_cast<int32_t>(b)});
}

TEST(ExpF, WithinTwoUlpOverTheNormalRange) {
  int64_t worst = 0;
  float worst_x = 0;
  for (float x = -87.0f; x <= 88.5f; x += 0.000731f) {
    const float want = static_cast<float>(std::exp(static_cast<double>(x)));
    const int64_t d = UlpDistance(internal::ExpF(x), want);
    if (d > worst) {
      worst = d;
      worst_x = x;
    }
  }
  EXPECT_LE(worst, 2) << "at x = " << worst_x;
}

TEST(ExpF, EdgeCases) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(internal::ExpF(0.0f), 1.0f);
  EXPECT_EQ(internal::ExpF(-inf), 0.0f);
  EXPECT_EQ(internal::ExpF(inf), inf);
  EXPECT_EQ(internal::ExpF(89.0f), inf);
  EXPECT_EQ(internal::ExpF(-200.0f), 0.0f);
  EXPECT_TRUE(std::isnan(internal::ExpF(std::numeric_limits<float>::quiet_NaN())));
  // Near FLT_MAX and in the subnormal range the result is still close to exact.
  for (float x : {88.72f, -88.0f, -95.0f, -100.0f, -103.0f}) {
    const double want = std::exp(static_cast<double>(x));
    EXPECT_NEAR(internal::ExpF(x), want, 2e-7 * want + std::ldexp(1.0, -149)) << x;
  }
}

TEST(Softmax, MatchesDoubleAndSumsToOne) {
  std::mt19937 rng(41);
  for (int64_t n : {1, 2, 7, 8, 9, 100, 50304}) {
    const Vec x = Random(n, rng, -30.0f, 30.0f);
    Vec p(n);
    const internal::SoftmaxStats st = internal::Softmax(p.data(), x.data(), n);
    double mx = -INFINITY, sum = 0;
    for (float v : x) mx = std::max(mx, double{v});
    for (float v : x) sum += std::exp(v - mx);
    DVec want(n);
    for (int64_t i = 0; i < n; ++i) want[i] = std::exp(x[i] - mx) / sum;
    ExpectClose(p, want, 1e-9, 1e-5, "softmax");
    EXPECT_EQ(st.max, static_cast<float>(mx));
    EXPECT_NEAR(st.sum, sum, 2e-6 * sum);
  }
}

TEST(RowMax, EveryLengthAndPositionOfTheMax) {
  std::mt19937 rng(43);
  for (int64_t n = 1; n <= 40; ++n) {
    for (int64_t at = 0; at < n; ++at) {  // the max in every lane and in the tail
      Vec x = Random(n, rng, -5.0f, 5.0f);
      x[at] = 7.0f;
      EXPECT_EQ(internal::RowMax(x.data(), n), 7.0f) << "n=" << n << " at=" << at;
    }
  }
  // NaN entries are passed over, wherever they are (but the first).
  Vec x = Random(33, rng, -5.0f, 5.0f);
  x[20] = 6.0f;
  for (int64_t i : {1, 7, 8, 15, 32}) x[i] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(internal::RowMax(x.data(), 33), 6.0f);
}

TEST(Dot, MatchesDoubleForEveryTailLength) {
  std::mt19937 rng(44);
  for (int64_t n = 0; n <= 70; ++n) {
    const Vec a = Random(n, rng), b = Random(n, rng);
    double want = 0, mag = 0;
    for (int64_t i = 0; i < n; ++i) {
      want += double{a[i]} * b[i];
      mag += std::abs(double{a[i]} * b[i]);
    }
    EXPECT_NEAR(internal::Dot(a.data(), b.data(), n), want, 1e-6 * mag + 1e-30) << "n=" << n;
  }
  // A difference in any one element shows: each position is counted once.
  for (int64_t n : {16, 17, 31, 33}) {
    const Vec ones(n, 1.0f);
    for (int64_t i = 0; i < n; ++i) {
      Vec b(n, 1.0f);
      b[i] = 3.0f;
      EXPECT_EQ(internal::Dot(ones.data(), b.data(), n), static_cast<float>(n + 2))
          << "n=" << n << " i=" << i;
    }
  }
}

// Same values at different addresses (and so different alignments) give the same bits.
TEST(Determinism, ResultsDoNotDependOnBufferAlignment) {
  std::mt19937 rng(42);
  const int64_t B = 2, T = 13, C = 12, NH = 3, N = 37;
  const Vec qkv = Random(B * T * 3 * C, rng), dout = Random(B * T * C, rng),
            x = Random(N * 19, rng, -6.0f, 6.0f);
  struct Result {
    Vec att_out, lse, dqkv, gelu, dgelu, probs;
  };
  const auto run = [&](size_t offset) {
    // Copy every input to `offset` floats past a fresh allocation.
    const auto at = [offset](const Vec& v) {
      Vec buf(v.size() + offset);
      std::copy(v.begin(), v.end(), buf.begin() + offset);
      return buf;
    };
    const Vec q = at(qkv), d = at(dout), xx = at(x);
    Vec out(B * T * C + offset), lse(B * NH * T + offset), dq(qkv.size() + offset, 0.0f);
    attention_forward(out.data() + offset, lse.data() + offset, q.data() + offset, B, T, C, NH);
    attention_backward(dq.data() + offset, d.data() + offset, q.data() + offset,
                       out.data() + offset, lse.data() + offset, B, T, C, NH);
    Vec g(x.size() + offset), dg(x.size() + offset, 0.0f), probs(x.size() + offset),
        losses(N + offset);
    gelu_forward(g.data() + offset, xx.data() + offset, static_cast<int64_t>(x.size()));
    gelu_backward(dg.data() + offset, xx.data() + offset, xx.data() + offset,
                  static_cast<int64_t>(x.size()));
    const std::vector<int32_t> targets(N, 3);
    softmax_crossentropy_forward(losses.data() + offset, probs.data() + offset,
                                 xx.data() + offset, targets.data(), N, 19);
    const auto strip = [offset](const Vec& v) { return Vec(v.begin() + offset, v.end()); };
    return Result{strip(out), strip(lse), strip(dq), strip(g), strip(dg), strip(probs)};
  };
  const Result base = run(0);
  for (size_t offset = 1; offset < 8; ++offset) {
    const Result r = run(offset);
    EXPECT_EQ(r.att_out, base.att_out) << offset;
    EXPECT_EQ(r.lse, base.lse) << offset;
    EXPECT_EQ(r.dqkv, base.dqkv) << offset;
    EXPECT_EQ(r.gelu, base.gelu) << offset;
    EXPECT_EQ(r.dgelu, base.dgelu) << offset;
    EXPECT_EQ(r.probs, base.probs) << offset;
  }
}

}  // namespace
}  // namespace fsdp::kernels::cpu
