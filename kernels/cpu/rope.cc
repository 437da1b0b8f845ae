// Rotary position embeddings in the Hugging Face layout (MODEL_SPEC.md, Llama), in place,
// forward and backward. Within a head of D columns, column j and column j + D/2 form a pair
// rotated by the angle p * inv_freq[j] at position p:
//   x'[j] = x[j] cos - x[j + D/2] sin,   x'[j + D/2] = x[j + D/2] cos + x[j] sin,
// which is x * cos + rotate_half(x) * sin. Backward applies the transposed rotation (the
// angle negated). The angles are computed as PyTorch computes them, in f32:
// inv_freq[j] = 1 / theta^(2j / D), angle = float(p) * inv_freq[j], then cos and sin, into a
// [T, D/2] table per call, shared by all heads and batches.
#include <cassert>
#include <cmath>
#include <cstdint>
#include <vector>

#include "fsdp/kernels_cpu.h"

namespace fsdp::kernels::cpu {
namespace {

constexpr int64_t kParallelMin = 1 << 14;

struct RopeTable {
  std::vector<float> cos, sin;  // [T, D/2]
};

RopeTable MakeTable(int64_t T, int64_t D, float theta) {
  const int64_t half = D / 2;
  std::vector<float> inv_freq(static_cast<size_t>(half));
  for (int64_t j = 0; j < half; ++j) {
    const float exponent = static_cast<float>(2 * j) / static_cast<float>(D);
    inv_freq[j] = 1.0f / std::pow(theta, exponent);
  }
  RopeTable tab{std::vector<float>(static_cast<size_t>(T * half)),
                std::vector<float>(static_cast<size_t>(T * half))};
#pragma omp parallel for schedule(static) if (T * half > kParallelMin)
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t j = 0; j < half; ++j) {
      const float angle = static_cast<float>(t) * inv_freq[j];
      tab.cos[t * half + j] = std::cos(angle);
      tab.sin[t * half + j] = std::sin(angle);
    }
  }
  return tab;
}

// Rotates the first NH heads of every row of x[B,T,W] by +angle (sign = 1) or -angle
// (sign = -1, the transpose).
void Rotate(float* x, int64_t B, int64_t T, int64_t W, int64_t NH, int64_t D, float theta,
            float sign) {
  assert(D % 2 == 0 && NH * D <= W);
  const int64_t half = D / 2;
  const RopeTable tab = MakeTable(T, D, theta);
#pragma omp parallel for schedule(static) if (B * T * NH * D > kParallelMin)
  for (int64_t bt = 0; bt < B * T; ++bt) {
    const float* c = tab.cos.data() + (bt % T) * half;
    const float* s = tab.sin.data() + (bt % T) * half;
    float* row = x + bt * W;
    for (int64_t h = 0; h < NH; ++h) {
      float* lo = row + h * D;
      float* hi = lo + half;
#pragma omp simd
      for (int64_t j = 0; j < half; ++j) {
        const float a = lo[j], b = hi[j], sn = sign * s[j];
        lo[j] = a * c[j] - b * sn;
        hi[j] = b * c[j] + a * sn;
      }
    }
  }
}

}  // namespace

void rope_forward(float* x, int64_t B, int64_t T, int64_t W, int64_t NH, int64_t D,
                  float theta) {
  Rotate(x, B, T, W, NH, D, theta, 1.0f);
}

void rope_backward(float* dx, int64_t B, int64_t T, int64_t W, int64_t NH, int64_t D,
                   float theta) {
  Rotate(dx, B, T, W, NH, D, theta, -1.0f);
}

}  // namespace fsdp::kernels::cpu
