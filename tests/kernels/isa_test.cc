// The element-wise kernels compiled for AVX-512 (GELU and the bf16 casts) against their
// baseline (x86-64-v3) variant, bit for bit, over random values in wide ranges and the special ones
// (signed zeros, subnormals, the largest floats, infinities, NaNs), at lengths that leave vector
// tails.
#include "kernels/cpu/isa.h"

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>

#include "fsdp/kernels_cpu.h"
#include "tests/kernels/reference.h"

namespace fsdp::kernels::cpu {
namespace {

using namespace fsdp::kernels::cpu::testing;
using internal::ElementwiseIsa;
using internal::ForceBaselineIsa;
using internal::Isa;

class IsaVariantTest : public ::testing::TestWithParam<int64_t> {
 protected:
  void SetUp() override {
    if (ElementwiseIsa() != Isa::kAvx512) {
      GTEST_SKIP() << "skipped: no AVX-512 variant to compare: this CPU has no AVX-512, the "
                      "build targets the machine (FSDP_NATIVE), or FSDP_CPU_ISA=baseline is set";
    }
  }
  void TearDown() override { ForceBaselineIsa(false); }

  // Random floats over [-span, span] with the special values spread through.
  static Vec Inputs(int64_t n, unsigned seed, float span) {
    std::mt19937 rng(seed);
    Vec x = Random(static_cast<size_t>(n), rng, -span, span);
    const float special[] = {0.0f,
                             -0.0f,
                             std::numeric_limits<float>::denorm_min(),
                             -1e-40f,
                             std::numeric_limits<float>::min(),
                             std::numeric_limits<float>::max(),
                             -std::numeric_limits<float>::max(),
                             std::numeric_limits<float>::infinity(),
                             -std::numeric_limits<float>::infinity(),
                             std::numeric_limits<float>::quiet_NaN(),
                             std::bit_cast<float>(0x7f800001u),  // signalling NaN
                             std::bit_cast<float>(0xffc12345u),  // negative NaN with payload
                             1.00390625f,                        // a bf16 rounding tie
                             -9.2f,
                             88.0f,
                             -104.0f};
    for (size_t i = 0; i < std::size(special) && i * 7 < x.size(); ++i) x[i * 7] = special[i];
    return x;
  }

  template <typename T>
  static void ExpectBitwise(const std::vector<T>& got, const std::vector<T>& want,
                            const char* what) {
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i) {
      if (std::memcmp(&got[i], &want[i], sizeof(T)) != 0) {
        ADD_FAILURE() << what << ": element " << i << " differs between the AVX-512 and the "
                      << "baseline variant";
        return;
      }
    }
  }
};

// Runs f once with the baseline variant and once with the AVX-512 one.
template <typename F>
void BothVariants(F f) {
  ForceBaselineIsa(true);
  f(true);
  ForceBaselineIsa(false);
  f(false);
}

TEST_P(IsaVariantTest, GeluForward) {
  const int64_t n = GetParam();
  for (float span : {3.0f, 12.0f, 1e20f}) {
    const Vec x = Inputs(n, static_cast<unsigned>(n), span);
    Vec base(n), avx(n);
    BothVariants([&](bool baseline) { gelu_forward((baseline ? base : avx).data(), x.data(), n); });
    ExpectBitwise(avx, base, "gelu_forward");
  }
}

TEST_P(IsaVariantTest, GeluBackward) {
  const int64_t n = GetParam();
  std::mt19937 rng(static_cast<unsigned>(n + 3));
  const Vec x = Inputs(n, static_cast<unsigned>(n + 1), 8.0f);
  const Vec dout = Random(static_cast<size_t>(n), rng), dinp0 = Random(static_cast<size_t>(n), rng);
  Vec base = dinp0, avx = dinp0;
  BothVariants([&](bool baseline) {
    gelu_backward((baseline ? base : avx).data(), x.data(), dout.data(), n);
  });
  ExpectBitwise(avx, base, "gelu_backward");
}

TEST_P(IsaVariantTest, CastsBf16) {
  const int64_t n = GetParam();
  const Vec x = Inputs(n, static_cast<unsigned>(n + 2), 1e30f);
  std::vector<uint16_t> base(n), avx(n);
  BothVariants(
      [&](bool baseline) { cast_f32_to_bf16((baseline ? base : avx).data(), x.data(), n); });
  ExpectBitwise(avx, base, "cast_f32_to_bf16");
  for (int64_t i = 0; i < n; ++i) {  // and both are the scalar converter of fsdp/dtype.h
    if (base[i] != FloatToBf16(x[i])) {
      ADD_FAILURE() << "cast_f32_to_bf16: element " << i << " is not FloatToBf16";
      break;
    }
  }
  Vec wide_base(n), wide_avx(n);
  BothVariants([&](bool baseline) {
    cast_bf16_to_f32((baseline ? wide_base : wide_avx).data(), base.data(), n);
  });
  ExpectBitwise(wide_avx, wide_base, "cast_bf16_to_f32");
  Vec round_base(n), round_avx(n);
  BothVariants([&](bool baseline) {
    round_f32_through_bf16((baseline ? round_base : round_avx).data(), x.data(), n);
  });
  ExpectBitwise(round_avx, round_base, "round_f32_through_bf16");
  ExpectBitwise(round_base, wide_base, "round_f32_through_bf16 against the two casts");
}

// Lengths below and above the parallel thresholds, with tails of every size.
INSTANTIATE_TEST_SUITE_P(Lengths, IsaVariantTest,
                         ::testing::Values(1, 15, 17, 255, 4099, 65537, 300001));

}  // namespace
}  // namespace fsdp::kernels::cpu
