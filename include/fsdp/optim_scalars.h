// The scalars of an optimizer step that do not depend on the element, computed once on the host
// (src/fsdp/optim.cc) and handed to every backend's op, as llm.c's gpt2_update does: the AdamW
// bias corrections are written here only, not once per backend. And the clip coefficient of the
// global-norm clipping, one inline function for the host and for device code (the norm it
// scales by is a device value: the backends' GlobalNormClip ops apply it on the device, without
// a host synchronisation). No dependencies, so that kernels and CUDA sources can include it.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define FSDP_HOST_DEVICE __host__ __device__
#else
#define FSDP_HOST_DEVICE
#endif

namespace fsdp {

// One AdamW step (torch.optim.AdamW for f32 parameters):
//   m = beta1 m + one_minus_beta1 g;  v = beta2 v + one_minus_beta2 g g;
//   p = p decay - step_size m / (sqrt(v) inv_bc2_sqrt + eps)
struct AdamWScalars {
  float beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f;
  float one_minus_beta1 = 0.1f, one_minus_beta2 = 0.001f;
  float decay = 1.0f;         // 1 - lr weight_decay
  float step_size = 0.0f;     // lr / (1 - beta1^step)
  float inv_bc2_sqrt = 1.0f;  // 1 / sqrt(1 - beta2^step)
};

// The scalars of step `step` (>= 1): the bias corrections in double, each rounded once to f32.
AdamWScalars AdamWStepScalars(float lr, float beta1, float beta2, float eps, float weight_decay,
                              int64_t step);

// Gradient clipping by global norm (MODEL_SPEC.md): every gradient is multiplied by this.
// max_norm / (total_norm + 1e-6) when total_norm > max_norm, else 1; max_norm <= 0 disables.
FSDP_HOST_DEVICE inline float ClipCoefficient(double total_norm, float max_norm) {
  if (max_norm <= 0 || !(total_norm > max_norm)) return 1.0f;
  return static_cast<float>(static_cast<double>(max_norm) / (total_norm + 1e-6));
}

}  // namespace fsdp
