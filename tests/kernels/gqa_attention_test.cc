// Grouped-query causal attention (gqa_attention_forward / gqa_attention_backward) against a
// double reference and finite differences, with multi-query (NKV = 1) and grouped (NKV =
// NH/2) heads and small blocks; and bitwise the GPT's attention when NKV = NH. The backward
// with kept bf16 / f16 qkv and out is the f32 kernel on their widened values.
#include <omp.h>

#include <array>
#include <cstring>
#include <utility>
#include <vector>

#include "fsdp/kernels_cpu.h"
#include "kernels/cpu/attention.h"
#include "tests/kernels/reference.h"

namespace fsdp::kernels::cpu {
namespace {

using namespace fsdp::kernels::cpu::testing;

void ExpectBitwiseEqual(const Vec& got, const Vec& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size() * sizeof(float)), 0) << what;
}

struct Shape {
  int64_t B, T, NH, NKV, D, block;
};

std::string Name(const ::testing::TestParamInfo<Shape>& info) {
  const Shape& s = info.param;
  return absl::StrCat("B", s.B, "T", s.T, "NH", s.NH, "NKV", s.NKV, "D", s.D, "block", s.block);
}

class GqaAttentionTest : public ::testing::TestWithParam<Shape> {};

TEST_P(GqaAttentionTest, ForwardAndBackwardMatchReferenceAndFiniteDifferences) {
  const auto [B, T, NH, NKV, D, block] = GetParam();
  const int64_t W = (NH + 2 * NKV) * D;
  std::mt19937 rng(static_cast<unsigned>(B * 31 + T * 7 + NH * 5 + NKV * 3 + D + block));
  const Vec qkv = Random(B * T * W, rng, -1.5f, 1.5f), dout = Random(B * T * NH * D, rng);
  DVec want_lse;
  const DVec want_out = GqaAttentionRef(ToDouble(qkv), B, T, NH, NKV, D, &want_lse);
  Vec out(B * T * NH * D, 5.0f), lse(B * NH * T, 5.0f);  // forward overwrites both fully
  internal::AttentionForward(out.data(), lse.data(), qkv.data(), B, T, NH, NKV, D, block);
  ExpectClose(out, want_out, 2e-6, 2e-5, "out");
  ExpectClose(lse, want_lse, 2e-6, 2e-5, "lse");

  const DVec want = NumericGrad(
      [&](const DVec& x) { return Dot(GqaAttentionRef(x, B, T, NH, NKV, D), dout); },
      ToDouble(qkv));
  const Vec dqkv0 = Random(qkv.size(), rng);
  Vec dqkv = dqkv0;
  internal::AttentionBackward(dqkv.data(), dout.data(), qkv.data(), DType::kF32, out.data(),
                              DType::kF32, lse.data(), B, T, NH, NKV, D, block);
  ExpectAccumulatedClose(dqkv, dqkv0, want, 1e-4, 1e-4, "dqkv");

  // qkv and out as kept bf16 / f16 copies, each or both: the f32 kernel on their widened values
  // (the task's rows are widened into scratch, then the same arithmetic).
  for (DType d : {DType::kBF16, DType::kF16}) {
    const std::vector<uint16_t> qkv16 = ToLowp(qkv, d), out16 = ToLowp(out, d);
    const Vec qkvw = FromLowp(qkv16, d), outw = FromLowp(out16, d);
    for (const auto& [kept_qkv, kept_out] :
         {std::pair{true, true}, {true, false}, {false, true}}) {
      const Vec& qkv_want = kept_qkv ? qkvw : qkv;
      const Vec& out_want = kept_out ? outw : out;
      Vec want_d = dqkv0, got = dqkv0;
      internal::AttentionBackward(want_d.data(), dout.data(), qkv_want.data(), DType::kF32,
                                  out_want.data(), DType::kF32, lse.data(), B, T, NH, NKV, D,
                                  block);
      internal::AttentionBackward(
          got.data(), dout.data(), kept_qkv ? static_cast<const void*>(qkv16.data()) : qkv.data(),
          kept_qkv ? d : DType::kF32,
          kept_out ? static_cast<const void*>(out16.data()) : out.data(),
          kept_out ? d : DType::kF32, lse.data(), B, T, NH, NKV, D, block);
      // The GEMMs read the widened q, k, v from compact scratch rather than at qkv's row
      // stride, which oneDNN may sum in another order: f32 rounding apart, the same values.
      const std::string what = absl::StrCat("dqkv, kept ", std::string(DTypeName(d)),
                                            kept_qkv ? " qkv" : "", kept_out ? " out" : "");
      if (kept_qkv) {
        ExpectClose(got, want_d, 1e-6, 1e-5, what);
      } else {
        ExpectBitwiseEqual(got, want_d, what);
      }
    }
  }
}

// Multi-query (NKV = 1), grouped (NKV = NH / 2 and others), odd head sizes, one row per block,
// partial last blocks (T = 13, block 4), one block for everything.
INSTANTIATE_TEST_SUITE_P(
    Blocks, GqaAttentionTest,
    ::testing::Values(Shape{1, 13, 4, 1, 4, 4}, Shape{2, 13, 4, 2, 3, 4},
                      Shape{1, 9, 2, 1, 5, 1}, Shape{2, 10, 6, 3, 2, 3},
                      Shape{1, 11, 6, 2, 4, 5}, Shape{1, 7, 4, 4, 4, 2},
                      Shape{2, 6, 3, 1, 4, 16}, Shape{1, 1, 2, 1, 3, 4}),
    Name);

TEST(GqaAttention, LargeShapesMatchReferenceAtTheKernelsBlockSize) {
  // Several blocks of internal::kAttentionBlock rows with a partial last one; the backward
  // against the closed form.
  for (const int64_t NKV : {int64_t{1}, int64_t{2}}) {
    const int64_t B = 2, T = internal::kAttentionBlock * 2 + 22, NH = 4, D = 8;
    const int64_t W = (NH + 2 * NKV) * D;
    std::mt19937 rng(static_cast<unsigned>(NKV));
    const Vec qkv = Random(B * T * W, rng), dout = Random(B * T * NH * D, rng);
    DVec want_lse;
    const DVec want_out = GqaAttentionRef(ToDouble(qkv), B, T, NH, NKV, D, &want_lse);
    Vec out(B * T * NH * D), lse(B * NH * T), dqkv(qkv.size(), 0.0f);
    gqa_attention_forward(out.data(), lse.data(), qkv.data(), B, T, NH, NKV, D);
    gqa_attention_backward(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), B, T, NH,
                           NKV, D);
    const std::string what = absl::StrCat(" NKV ", NKV);
    ExpectClose(out, want_out, 2e-6, 2e-5, "out" + what);
    ExpectClose(lse, want_lse, 2e-6, 2e-5, "lse" + what);
    ExpectClose(dqkv, GqaAttentionBackwardRef(ToDouble(qkv), dout, B, T, NH, NKV, D), 1e-5,
                1e-4, "dqkv" + what);
  }
}

TEST(GqaAttention, WithAsManyKvHeadsAsQueryHeadsIsBitwiseTheGptAttention) {
  // qkv[B,T,3C] is the NKV = NH layout with D = C / NH; both blocked paths (T > block).
  for (const auto& [B, T, C, NH] : std::vector<std::array<int64_t, 4>>{
           {2, 5, 12, 3}, {1, internal::kAttentionBlock + 37, 32, 4}, {2, 70, 16, 1}}) {
    const std::string what = absl::StrCat(" B", B, " T", T, " C", C, " NH", NH);
    std::mt19937 rng(static_cast<unsigned>(T + C));
    const Vec qkv = Random(B * T * 3 * C, rng), dout = Random(B * T * C, rng),
              dqkv0 = Random(qkv.size(), rng);
    Vec out(B * T * C), lse(B * NH * T), dqkv = dqkv0;
    attention_forward(out.data(), lse.data(), qkv.data(), B, T, C, NH);
    attention_backward(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), B, T, C, NH);
    Vec gout(B * T * C), glse(B * NH * T), gdqkv = dqkv0;
    gqa_attention_forward(gout.data(), glse.data(), qkv.data(), B, T, NH, NH, C / NH);
    gqa_attention_backward(gdqkv.data(), dout.data(), qkv.data(), gout.data(), glse.data(), B, T,
                           NH, NH, C / NH);
    ExpectBitwiseEqual(gout, out, "out" + what);
    ExpectBitwiseEqual(glse, lse, "lse" + what);
    ExpectBitwiseEqual(gdqkv, dqkv, "dqkv" + what);
    // And both are the attention of the reference.
    ExpectClose(out, AttentionRef(ToDouble(qkv), B, T, C, NH), 2e-6, 2e-5, "out ref" + what);
  }
}

TEST(GqaAttention, BackwardDoesNotDependOnTheThreadCount) {
  // dk and dv of a kv head sum over its query heads: one thread adds them in a fixed order,
  // so the result is the same bitwise with any number of threads.
  const int64_t B = 3, T = 40, NH = 6, NKV = 2, D = 8, W = (NH + 2 * NKV) * D;
  std::mt19937 rng(3);
  const Vec qkv = Random(B * T * W, rng), dout = Random(B * T * NH * D, rng);
  Vec out(B * T * NH * D), lse(B * NH * T);
  gqa_attention_forward(out.data(), lse.data(), qkv.data(), B, T, NH, NKV, D);
  const int saved = omp_get_max_threads();
  std::vector<Vec> results;
  for (int threads : {1, 2, 4}) {
    omp_set_num_threads(threads);
    results.emplace_back(qkv.size(), 0.0f);
    gqa_attention_backward(results.back().data(), dout.data(), qkv.data(), out.data(),
                           lse.data(), B, T, NH, NKV, D);
    EXPECT_EQ(omp_get_max_threads(), threads);  // the caller's setting is left alone
  }
  omp_set_num_threads(saved);
  for (size_t i = 1; i < results.size(); ++i) {
    ExpectBitwiseEqual(results[i], results[0], absl::StrCat("threads #", i));
  }
}

}  // namespace
}  // namespace fsdp::kernels::cpu
