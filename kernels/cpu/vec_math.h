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
inline float ExpF(float x) {
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

// max of in[0..n), n >= 1 (NaN entries are passed over; exp then turns them into NaN). Eight
// independent lanes: GCC does not vectorise a float max reduction written as one loop (its
// `omp simd reduction(max)` compiles to a scalar vmaxss chain), and the max is exact in any
// order, so the result is the same.
inline float RowMax(const float* in, int64_t n) {
  constexpr int64_t kLanes = 8;
  float lane[kLanes];
  for (int64_t j = 0; j < kLanes; ++j) lane[j] = in[0];
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int64_t j = 0; j < kLanes; ++j) lane[j] = lane[j] < in[i + j] ? in[i + j] : lane[j];
  }
  float mx = lane[0];
  for (int64_t j = 1; j < kLanes; ++j) mx = mx < lane[j] ? lane[j] : mx;
  for (; i < n; ++i) mx = mx < in[i] ? in[i] : mx;
  return mx;
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
