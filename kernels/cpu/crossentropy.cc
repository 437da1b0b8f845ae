// Softmax cross-entropy over V classes, one row per position, rows split across threads.
// Targets < 0 mark ignored positions (padding): loss 0, no gradient.
#include <cassert>
#include <cmath>

#include "fsdp/kernels_cpu.h"
#include "kernels/cpu/vec_math.h"

namespace fsdp::kernels::cpu {

void softmax_crossentropy_forward(float* losses, float* probs, const float* logits,
                                  const int32_t* targets, int64_t N, int64_t V) {
#pragma omp parallel for schedule(static) if (N * V > 16384)
  for (int64_t n = 0; n < N; ++n) {
    const float* x = logits + n * V;
    const internal::SoftmaxStats st = internal::Softmax(probs + n * V, x, V);
    const int32_t t = targets[n];
    assert(t < V);
    // From the logits (log-sum-exp), not -log(p[t]): p[t] may underflow to 0.
    losses[n] = t < 0 ? 0.0f : (st.max + std::log(st.sum)) - x[t];
  }
}

void softmax_crossentropy_backward(float* dlogits, const float* probs, const int32_t* targets,
                                   float dloss, int64_t N, int64_t V) {
#pragma omp parallel for schedule(static) if (N * V > 16384)
  for (int64_t n = 0; n < N; ++n) {
    const int32_t t = targets[n];
    if (t < 0) continue;
    float* d = dlogits + n * V;
    const float* p = probs + n * V;
#pragma omp simd
    for (int64_t v = 0; v < V; ++v) d[v] += dloss * p[v];
    d[t] -= dloss;
  }
}

}  // namespace fsdp::kernels::cpu
