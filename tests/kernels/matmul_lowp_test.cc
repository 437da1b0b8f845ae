// matmul_forward_lowp / matmul_backward_lowp (bf16 and f16 weights, f32 activations): against
// the f32 kernels on the same rounded operands (tight: both accumulate in f32), against plain
// f32 (bf16/f16-level tolerance), on oneDNN's native path and on the forced upcasting fallback,
// accumulation and nullptr outputs, and rank threads calling at once.
#include <omp.h>

#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <thread>

#include "fsdp/dtype.h"
#include "fsdp/kernels_cpu.h"
#include "gmock/gmock.h"
#include "tests/kernels/reference.h"

namespace fsdp::kernels::cpu {
namespace {

using namespace fsdp::kernels::cpu::testing;
using U16 = std::vector<uint16_t>;
using ::testing::HasSubstr;

U16 Down(const Vec& x, DType d) {
  U16 out(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    out[i] = d == DType::kBF16 ? FloatToBf16(x[i]) : FloatToF16(x[i]);
  }
  return out;
}

Vec Up(const U16& x, DType d) {
  Vec out(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    out[i] = d == DType::kBF16 ? Bf16ToFloat(x[i]) : F16ToFloat(x[i]);
  }
  return out;
}

Vec Round(const Vec& x, DType d) { return Up(Down(x, d), d); }

// Sets FSDP_FORCE_LOWP_FALLBACK for its lifetime (tests run on one thread; the kernels' OpenMP
// workers do not read the environment).
class ForceFallback {
 public:
  explicit ForceFallback(bool on) : on_(on) {
    if (on_) setenv("FSDP_FORCE_LOWP_FALLBACK", "1", 1);
  }
  ~ForceFallback() {
    if (on_) unsetenv("FSDP_FORCE_LOWP_FALLBACK");
  }

 private:
  bool on_;
};

// Sets FSDP_LOWP_GEMM for a scope (nullptr: unset), restoring what was there.
class LowpGemmPolicy {
 public:
  explicit LowpGemmPolicy(const char* value) {
    if (const char* old = std::getenv("FSDP_LOWP_GEMM")) saved_ = old;
    if (value == nullptr) {
      unsetenv("FSDP_LOWP_GEMM");
    } else {
      setenv("FSDP_LOWP_GEMM", value, 1);
    }
  }
  ~LowpGemmPolicy() {
    if (saved_.has_value()) {
      setenv("FSDP_LOWP_GEMM", saved_->c_str(), 1);
    } else {
      unsetenv("FSDP_LOWP_GEMM");
    }
  }

 private:
  std::optional<std::string> saved_;
};

struct Case {
  DType dtype;
  bool fallback;  // forced upcasting fallback instead of oneDNN's low-precision matmul
  int64_t M, K, N;
};

std::string Name(const ::testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  return absl::StrCat(std::string(DTypeName(c.dtype)), c.fallback ? "_fallback" : "_native", "_M", c.M, "K",
                      c.K, "N", c.N);
}

// Unit roundoff of the type: the relative error of one rounding.
double Eps(DType d) { return d == DType::kBF16 ? 1.0 / 256 : 1.0 / 2048; }

class MatmulLowpTest : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    const Case& c = GetParam();
    if (c.fallback) return;
    // The native path is only tested where oneDNN has it; the fallback always. Under the default
    // policy the choice is a timing of the two kernels, which a loaded machine can tip towards
    // the widened one, so these cases name the native kernel for their whole run.
    if (!lowp_gemm_choice(c.dtype).native_available) {
      GTEST_SKIP() << "oneDNN has no " << DTypeName(c.dtype)
                   << " matmul on this CPU (the fallback cases cover it)";
    }
    policy_.emplace("native");
    ASSERT_TRUE(matmul_lowp_native(c.dtype));
  }

 private:
  std::optional<LowpGemmPolicy> policy_;
};

TEST_P(MatmulLowpTest, ForwardMatchesF32OnRoundedOperandsAndPlainF32) {
  const auto [dtype, fallback, M, K, N] = GetParam();
  ForceFallback force(fallback);
  std::mt19937 rng(static_cast<unsigned>(M * 131 + K * 7 + N));
  const Vec inp = Random(M * K, rng), weight = Random(N * K, rng), bias = Random(N, rng);
  const U16 w16 = Down(weight, dtype), b16 = Down(bias, dtype);
  for (bool with_bias : {true, false}) {
    Vec got(M * N, 123.0f);  // forward overwrites
    matmul_forward_lowp(got.data(), inp.data(), w16.data(), with_bias ? b16.data() : nullptr, M,
                        K, N, dtype);
    // The f32 kernel on the same rounded values: only the summation order differs.
    const Vec inp_r = Round(inp, dtype), w_r = Up(w16, dtype), b_r = Up(b16, dtype);
    Vec want(M * N);
    matmul_forward(want.data(), inp_r.data(), w_r.data(), with_bias ? b_r.data() : nullptr, M, K,
                   N);
    const double tight = 2e-6 * std::sqrt(static_cast<double>(K));
    ExpectClose(got, want, tight, tight, absl::StrCat("vs f32 on rounded, bias=", with_bias));
    // Plain f32: each product carries up to two roundings of eps/2; random signs add up as
    // sqrt(K). Values are in [-1, 1], products ~1/3.
    const DVec exact = MatmulRef(ToDouble(inp), ToDouble(weight),
                                 with_bias ? ToDouble(bias) : DVec{}, M, K, N);
    const double loose = Eps(dtype) * (1.0 + std::sqrt(static_cast<double>(K)));
    ExpectClose(got, exact, loose, 0.0, absl::StrCat("vs plain f32, bias=", with_bias));
    // The input given as a kept copy in dtype (its rounding done): bitwise the same.
    const U16 inp16 = Down(inp, dtype);
    Vec kept(M * N, 123.0f);
    matmul_forward_lowp(kept.data(), inp16.data(), w16.data(), with_bias ? b16.data() : nullptr,
                        M, K, N, dtype, dtype);
    EXPECT_EQ(kept, got) << "kept input, bias=" << with_bias;
  }
}

TEST_P(MatmulLowpTest, BackwardAccumulatesLikeF32OnRoundedOperands) {
  const auto [dtype, fallback, M, K, N] = GetParam();
  ForceFallback force(fallback);
  std::mt19937 rng(static_cast<unsigned>(M * 3 + K * 5 + N * 7));
  const Vec inp = Random(M * K, rng), weight = Random(N * K, rng), dout = Random(M * N, rng);
  const U16 w16 = Down(weight, dtype);
  const Vec dinp0 = Random(M * K, rng), dweight0 = Random(N * K, rng), dbias0 = Random(N, rng);

  Vec dinp = dinp0, dweight = dweight0, dbias = dbias0;
  matmul_backward_lowp(dinp.data(), dweight.data(), dbias.data(), dout.data(), inp.data(),
                       w16.data(), M, K, N, dtype);
  const Vec inp_r = Round(inp, dtype), dout_r = Round(dout, dtype), w_r = Up(w16, dtype);
  Vec want_dinp = dinp0, want_dweight = dweight0, want_dbias = dbias0;
  matmul_backward(want_dinp.data(), want_dweight.data(), nullptr, dout_r.data(), inp_r.data(),
                  w_r.data(), M, K, N);
  // dbias is the f32 column sum of the unrounded dout, as the f32 kernel computes it.
  matmul_backward(nullptr, nullptr, want_dbias.data(), dout.data(), inp.data(), weight.data(), M,
                  K, N);
  const double tol_n = 2e-6 * (1 + std::sqrt(static_cast<double>(N)));
  const double tol_m = 2e-6 * (1 + std::sqrt(static_cast<double>(M)));
  ExpectClose(dinp, want_dinp, tol_n, tol_n, "dinp");
  ExpectClose(dweight, want_dweight, tol_m, tol_m, "dweight");
  EXPECT_EQ(dbias, want_dbias);
  // The input given as a kept copy in dtype (its rounding done): bitwise the same.
  Vec kdinp = dinp0, kdweight = dweight0, kdbias = dbias0;
  const U16 inp16 = Down(inp, dtype);
  matmul_backward_lowp(kdinp.data(), kdweight.data(), kdbias.data(), dout.data(), inp16.data(),
                       w16.data(), M, K, N, dtype, dtype);
  EXPECT_EQ(kdinp, dinp);
  EXPECT_EQ(kdweight, dweight);
  EXPECT_EQ(kdbias, dbias);

  // Against plain f32 gradients in double (what the f32 kernels approximate).
  DVec exact_dinp(M * K, 0.0), exact_dweight(N * K, 0.0);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t n = 0; n < N; ++n) {
      const double g = dout[m * N + n];
      for (int64_t k = 0; k < K; ++k) {
        exact_dinp[m * K + k] += g * weight[n * K + k];
        exact_dweight[n * K + k] += g * inp[m * K + k];
      }
    }
  }
  ExpectAccumulatedClose(dinp, dinp0, exact_dinp,
                         Eps(dtype) * (1 + std::sqrt(static_cast<double>(N))), 0.0,
                         "dinp vs plain f32");
  ExpectAccumulatedClose(dweight, dweight0, exact_dweight,
                         Eps(dtype) * (1 + std::sqrt(static_cast<double>(M))), 0.0,
                         "dweight vs plain f32");

  // Each output alone (the others nullptr) gives the same values.
  for (int which = 0; which < 3; ++which) {
    Vec a = dinp0, b = dweight0, c = dbias0;
    matmul_backward_lowp(which == 0 ? a.data() : nullptr, which == 1 ? b.data() : nullptr,
                         which == 2 ? c.data() : nullptr, dout.data(), inp.data(), w16.data(), M,
                         K, N, dtype);
    EXPECT_EQ(a, which == 0 ? dinp : dinp0) << which;
    EXPECT_EQ(b, which == 1 ? dweight : dweight0) << which;
    EXPECT_EQ(c, which == 2 ? dbias : dbias0) << which;
  }
}

std::vector<Case> Cases() {
  std::vector<Case> out;
  for (DType d : {DType::kBF16, DType::kF16}) {
    for (bool fallback : {false, true}) {
      for (auto [M, K, N] : {std::tuple<int64_t, int64_t, int64_t>{7, 13, 5}, {1, 1, 1},
                             {17, 3, 33}, {64, 96, 80}, {130, 257, 67}}) {
        out.push_back({d, fallback, M, K, N});
      }
    }
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(All, MatmulLowpTest, ::testing::ValuesIn(Cases()), Name);

TEST(MatmulLowp, ReportsThePathsTaken) {
  const bool bf16 = matmul_lowp_native(DType::kBF16), f16 = matmul_lowp_native(DType::kF16);
  std::printf("oneDNN low-precision matmul on this CPU: bf16 %s, f16 %s\n",
              bf16 ? "native" : "fallback (upcast to f32)",
              f16 ? "native" : "fallback (upcast to f32)");
  EXPECT_TRUE(matmul_lowp_native(DType::kF32));
  ForceFallback force(true);
  EXPECT_FALSE(matmul_lowp_native(DType::kBF16));
  EXPECT_FALSE(matmul_lowp_native(DType::kF16));
}

// Which kernel the Linear layers run: the policy's, the measured faster one under auto, the
// widened one where oneDNN has no native matmul; matmul_lowp_native follows the choice.
TEST(MatmulLowp, KernelChoiceFollowsThePolicy) {
  const LowpGemmChoice f32 = lowp_gemm_choice(DType::kF32);
  EXPECT_TRUE(f32.native);
  for (DType d : {DType::kBF16, DType::kF16}) {
    const std::string name(DTypeName(d));
    for (const char* policy : {static_cast<const char*>(nullptr), "auto", "native", "widened",
                               "fastest"}) {
      LowpGemmPolicy set(policy);
      const LowpGemmChoice c = lowp_gemm_choice(d);
      const std::string what = name + " FSDP_LOWP_GEMM=" + (policy ? policy : "(unset)");
      EXPECT_EQ(c.dtype, d) << what;
      EXPECT_EQ(matmul_lowp_native(d), c.native) << what;
      {
        ForceFallback force(true);  // FSDP_FORCE_LOWP_FALLBACK=1 always widens
        EXPECT_FALSE(matmul_lowp_native(d)) << what;
      }
      if (!c.native_available) {
        EXPECT_FALSE(c.native) << what;
        EXPECT_THAT(c.reason, HasSubstr("no native matmul")) << what;
        continue;
      }
      const std::string p = policy ? policy : "auto";
      if (p == "native" || p == "widened") {
        EXPECT_EQ(c.native, p == "native") << what;
        EXPECT_THAT(c.reason, HasSubstr(p)) << what;
      } else {  // auto, and a value it does not know (reported on stderr, taken as auto)
        EXPECT_GT(c.native_gflops, 0) << what;
        EXPECT_GT(c.widened_gflops, 0) << what;
        EXPECT_EQ(c.native, kLowpGemmWidenedMargin * c.widened_gflops <= c.native_gflops)
            << what;
        EXPECT_THAT(c.reason, HasSubstr("measured")) << what;
      }
    }
    LowpGemmPolicy unset(nullptr);
    const LowpGemmChoice c = lowp_gemm_choice(d);
    std::printf("%s Linear GEMMs on this CPU: %s (%s; native %.1f, widened %.1f GFLOP/s)\n",
                name.c_str(), c.native ? "native" : "widened to f32", c.reason,
                c.native_gflops, c.widened_gflops);
  }
}

// oneDNN's native low-precision matmul against the forced upcasting fallback, per dtype. Where
// oneDNN has no native path for the dtype, both runs would take the fallback and compare it
// with itself: the case skips, saying so.
class MatmulLowpNativeVsFallback : public ::testing::TestWithParam<DType> {};

TEST_P(MatmulLowpNativeVsFallback, Agree) {
  const DType d = GetParam();
  LowpGemmPolicy native_unless_forced("native");
  if (!matmul_lowp_native(d)) {
    GTEST_SKIP() << "oneDNN has no native " << DTypeName(d)
                 << " matmul on this CPU: the \"native\" run would be the upcasting fallback, "
                    "compared with itself";
  }
  const int64_t M = 48, K = 72, N = 40;
  std::mt19937 rng(11);
  const Vec inp = Random(M * K, rng), weight = Random(N * K, rng), bias = Random(N, rng);
  const Vec dout = Random(M * N, rng);
  const U16 w16 = Down(weight, d), b16 = Down(bias, d);
  auto run = [&](bool fallback) {
    ForceFallback force(fallback);
    EXPECT_EQ(matmul_lowp_native(d), !fallback);  // the path this run takes
    std::vector<Vec> r{Vec(M * N), Vec(M * K, 0.0f), Vec(N * K, 0.0f), Vec(N, 0.0f)};
    matmul_forward_lowp(r[0].data(), inp.data(), w16.data(), b16.data(), M, K, N, d);
    matmul_backward_lowp(r[1].data(), r[2].data(), r[3].data(), dout.data(), inp.data(),
                         w16.data(), M, K, N, d);
    return r;
  };
  const auto native = run(false), fallback = run(true);
  for (size_t i = 0; i < native.size(); ++i) {
    ExpectClose(native[i], ToDouble(fallback[i]), 2e-5, 2e-5,
                absl::StrCat(std::string(DTypeName(d)), " output ", i));
  }
  EXPECT_EQ(native[3], fallback[3]);  // dbias: the same f32 column sums
}

INSTANTIATE_TEST_SUITE_P(All, MatmulLowpNativeVsFallback,
                         ::testing::Values(DType::kBF16, DType::kF16),
                         [](const ::testing::TestParamInfo<DType>& info) {
                           return std::string(DTypeName(info.param));
                         });

TEST(MatmulLowp, F32DtypeIsTheF32Kernel) {
  const int64_t M = 9, K = 21, N = 6;
  std::mt19937 rng(3);
  const Vec inp = Random(M * K, rng), weight = Random(N * K, rng), bias = Random(N, rng);
  const Vec dout = Random(M * N, rng);
  Vec a(M * N), b(M * N);
  matmul_forward_lowp(a.data(), inp.data(), weight.data(), bias.data(), M, K, N, DType::kF32);
  matmul_forward(b.data(), inp.data(), weight.data(), bias.data(), M, K, N);
  EXPECT_EQ(a, b);
  Vec da(M * K, 1.0f), dw(N * K, 1.0f), db(N, 1.0f);
  Vec ea = da, ew = dw, eb = db;
  matmul_backward_lowp(da.data(), dw.data(), db.data(), dout.data(), inp.data(), weight.data(), M,
                       K, N, DType::kF32);
  matmul_backward(ea.data(), ew.data(), eb.data(), dout.data(), inp.data(), weight.data(), M, K,
                  N);
  EXPECT_EQ(da, ea);
  EXPECT_EQ(dw, ew);
  EXPECT_EQ(db, eb);
}

TEST(MatmulLowp, EmptyReductionGivesBias) {
  const U16 bias = Down({1, 2, 3}, DType::kBF16);
  float out[6] = {9, 9, 9, 9, 9, 9};
  matmul_forward_lowp(out, nullptr, nullptr, bias.data(), 2, 0, 3, DType::kBF16);
  for (int i = 0; i < 6; ++i) EXPECT_EQ(out[i], static_cast<float>(i % 3 + 1));
}

TEST(MatmulLowp, RankThreadsAtOnceGiveTheirAloneResults) {
  // Each thread has its own scratch: concurrent callers of different sizes must not collide.
  struct Job {
    int64_t M, K, N;
    DType d;
    Vec inp, dout;
    U16 w;
    Vec out, dinp, dweight;
    void Run() {
      out.assign(M * N, 0.0f);
      dinp.assign(M * K, 0.0f);
      dweight.assign(N * K, 0.0f);
      for (int rep = 0; rep < 3; ++rep) {
        matmul_forward_lowp(out.data(), inp.data(), w.data(), nullptr, M, K, N, d);
        matmul_backward_lowp(dinp.data(), dweight.data(), nullptr, dout.data(), inp.data(),
                             w.data(), M, K, N, d);
      }
    }
  };
  std::vector<Job> jobs;
  std::mt19937 rng(21);
  for (auto [M, K, N, d] : {std::tuple{96, 64, 48, DType::kBF16}, {33, 128, 20, DType::kF16},
                            {200, 40, 72, DType::kBF16}}) {
    jobs.push_back({M, K, N, d, Random(M * K, rng), Random(M * N, rng),
                    Down(Random(N * K, rng), d), {}, {}, {}});
  }
  std::vector<Job> alone = jobs;
  for (Job& j : alone) j.Run();
  std::vector<std::thread> threads;
  for (Job& j : jobs) {
    threads.emplace_back([&j] {
      omp_set_num_threads(1);
      j.Run();
    });
  }
  for (std::thread& t : threads) t.join();
  for (size_t i = 0; i < jobs.size(); ++i) {
    // One OpenMP thread versus the default: oneDNN may split the sums differently.
    ExpectClose(jobs[i].out, ToDouble(alone[i].out), 1e-4, 1e-4, "out");
    ExpectClose(jobs[i].dinp, ToDouble(alone[i].dinp), 1e-4, 1e-4, "dinp");
    ExpectClose(jobs[i].dweight, ToDouble(alone[i].dweight), 1e-4, 1e-4, "dweight");
  }
}

}  // namespace
}  // namespace fsdp::kernels::cpu
