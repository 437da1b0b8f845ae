// Element-wise optimizer updates on a flat f32 shard, with PyTorch's semantics (MODEL_SPEC.md).
// The per-call scalars (bias corrections) come computed (AdamWStepScalars, src/fsdp/optim.cc);
// the element loop is f32, as torch.optim's is for f32 parameters.
#include <cmath>

#include "fsdp/kernels_cpu.h"

namespace fsdp::kernels::cpu {
namespace {

constexpr int64_t kParallelMin = 1 << 15;

}  // namespace

void adamw_update(float* param, const float* grad, float* m, float* v, int64_t n,
                  const AdamWScalars& k) {
  const float beta1 = k.beta1, beta2 = k.beta2, eps = k.eps, decay = k.decay;
  const float step_size = k.step_size, inv_bc2_sqrt = k.inv_bc2_sqrt;
  const float one_minus_b1 = k.one_minus_beta1, one_minus_b2 = k.one_minus_beta2;
#pragma omp parallel for simd schedule(static) if (n > kParallelMin)
  for (int64_t i = 0; i < n; ++i) {
    const float g = grad[i];
    const float mi = beta1 * m[i] + one_minus_b1 * g;
    const float vi = beta2 * v[i] + one_minus_b2 * g * g;
    m[i] = mi;
    v[i] = vi;
    const float denom = std::sqrt(vi) * inv_bc2_sqrt + eps;
    param[i] = param[i] * decay - step_size * mi / denom;
  }
}

void sgd_update(float* param, const float* grad, float* momentum_buf, int64_t n, float lr,
                float momentum, float dampening, float weight_decay, bool nesterov,
                bool first_step) {
  if (momentum == 0.0f) {
#pragma omp parallel for simd schedule(static) if (n > kParallelMin)
    for (int64_t i = 0; i < n; ++i) param[i] -= lr * (grad[i] + weight_decay * param[i]);
    return;
  }
  const float keep = 1.0f - dampening;
#pragma omp parallel for simd schedule(static) if (n > kParallelMin)
  for (int64_t i = 0; i < n; ++i) {
    const float g = grad[i] + weight_decay * param[i];
    const float buf = first_step ? g : momentum * momentum_buf[i] + keep * g;
    momentum_buf[i] = buf;
    param[i] -= lr * (nesterov ? g + momentum * buf : buf);
  }
}

}  // namespace fsdp::kernels::cpu
