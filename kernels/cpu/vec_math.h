// Private helpers for the kernels: an exp that GCC vectorises, and the row softmax that
// attention and cross-entropy share.
//
// Why not std::exp or Eigen: GCC does not vectorise std::exp without -ffast-math, and Eigen
// peels the unaligned head of a row with scalar std::exp, so its results (and its sums)
// depend on the buffer's address. The code here is plain arithmetic, identical in the vector
// body and the scalar tail, so results depend on the values only.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>

namespace fsdp::kernels::cpu::internal {

// exp(x) in f32, within ~2 ulp (Cephes expf): x = n ln2 + r, |r| <= ln2/2, polynomial in r,
// then scaled by 2^n in two steps so that subnormal results and those near FLT_MAX are right.
// Overflow gives +Inf, underflow 0, NaN stays NaN.
[[gnu::always_inline]] inline float ExpF(float x) {
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2Hi = 0.693359375f;  // ln 2 split so n * kLn2Hi is exact
  constexpr float kLn2Lo = -2.12194440e-4f;
  constexpr float kRound = 12582912.0f;   // 1.5 * 2^23: adding it rounds to an integer
  const float xc = std::min(std::max(x, -104.0f), 88.7228394f);
  const float t = xc * kLog2e + kRound;
  const float n = t - kRound;
  const int32_t ni = std::bit_cast<int32_t>(t) - std::bit_cast<int32_t>(kRound);
  const float r = (xc - n * kLn2Hi) - n * kLn2Lo;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t half = ni >> 1;  // ni in [-150, 128]: both factors are normal floats
  const float s1 = std::bit_cast<float>((half + 127) << 23);
  const float s2 = std::bit_cast<float>((ni - half + 127) << 23);
  const float y = p * s1 * s2;
  return x != x ? x : y;  // NaN in, NaN out (the clamps above would lose it)
}

// FloatToBf16 (fsdp/dtype.h) without branches, so that loops over it vectorise: round to
// nearest even, NaN kept and made quiet, Inf kept.
[[gnu::always_inline]] inline uint16_t Bf16Bits(float x) {
  const uint32_t u = std::bit_cast<uint32_t>(x);
  const bool nan = static_cast<int32_t>(u & 0x7fffffffu) > 0x7f800000;
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>(nan ? ((u >> 16) | 0x40u) : rounded);
}

// Eight floats in a GCC/Clang vector (one ymm register on x86-64-v3, two NEON registers on
// AArch64). GCC compiles neither a float max nor a float sum reduction written as one loop to
// vector code (its `omp simd reduction` gives a scalar vmaxss or vfmadd231ss chain, four
// cycles an element), nor eight scalar lanes in an array (eight vmovss loads): these helpers
// say it with vectors.
using F8 = float __attribute__((vector_size(32)));
inline F8 LoadF8(const float* p) {
  F8 v;
  __builtin_memcpy(&v, p, sizeof(v));  // unaligned
  return v;
}

// max of in[0..n), n >= 1 (NaN entries are passed over; exp then turns them into NaN). The
// max is exact in any order, so the lanes do not change the result.
inline float RowMax(const float* in, int64_t n) {
  float mx = in[0];
  int64_t i = 0;
  if (n >= 8) {
    F8 lane = LoadF8(in);
    for (i = 8; i + 8 <= n; i += 8) {
      const F8 x = LoadF8(in + i);
      lane = lane < x ? x : lane;
    }
    mx = lane[0];
    for (int j = 1; j < 8; ++j) mx = mx < lane[j] ? lane[j] : mx;
  }
  for (; i < n; ++i) mx = mx < in[i] ? in[i] : mx;
  return mx;
}

// sum of a[i] * b[i] over [0, n): sixteen lanes (two vectors of eight) added pairwise at the
// end, then the tail.
inline float Dot(const float* a, const float* b, int64_t n) {
  F8 lo = {}, hi = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    lo += LoadF8(a + i) * LoadF8(b + i);
    hi += LoadF8(a + i + 8) * LoadF8(b + i + 8);
  }
  lo += hi;
  float sum = ((lo[0] + lo[4]) + (lo[2] + lo[6])) + ((lo[1] + lo[5]) + (lo[3] + lo[7]));
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

struct SoftmaxStats {
  float max;  // max of scale * in
  float sum;  // sum of exp(scale * in - max): log-sum-exp = max + log(sum)
};

// out = softmax(scale * in) over n >= 1 elements, scale > 0; out may alias in. Subtracting
// the max keeps exp from overflowing whatever the size of the inputs.
inline SoftmaxStats Softmax(float* out, const float* in, int64_t n, float scale = 1.0f) {
  const float mx = RowMax(in, n);
  // f32 partial sums over short blocks, added in double: a plain f32 sum over a 50k-entry
  // vocabulary row would lose ~1e-5 relative.
  constexpr int64_t kBlock = 256;
  double sum = 0.0;
  for (int64_t b = 0; b < n; b += kBlock) {
    const int64_t end = std::min(n, b + kBlock);
    float part = 0.0f;
#pragma omp simd reduction(+ : part)
    for (int64_t i = b; i < end; ++i) {
      const float e = ExpF((in[i] - mx) * scale);
      out[i] = e;
      part += e;
    }
    sum += part;
  }
  const float inv = static_cast<float>(1.0 / sum);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] *= inv;
  return {mx * scale, static_cast<float>(sum)};
}

}  // namespace fsdp::kernels::cpu::internal
