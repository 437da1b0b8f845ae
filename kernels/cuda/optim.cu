// CUDA optimizer updates and the reductions into device scalars (kernels.h), with the
// semantics of the CPU kernels (optimizers.cc, reductions.cc) and of the host op table
// (backends/host/host_ops.h: SumSquares, SplitF64, GlobalNormClip, Mean).
//
// Design:
// - adamw_update, sgd_update: one thread per element in grid-stride loops. The per-call
//   scalars (bias corrections, decay, step size) come computed on the host, once for every
//   backend (AdamWStepScalars, src/fsdp/optim.cc), and the element update follows the CPU's f32
//   operations one by one through the __f*_rn intrinsics (never contracted into FMAs): the
//   results are bit-identical to the CPU loop evaluated without contraction (a CPU build with
//   -ffp-contract=off). The default CPU build (GCC, -march=x86-64-v3) fuses some of these
//   products and sums into FMAs, so against it they agree to an ulp or so, not bitwise.
// - sum_squares: each thread sums x^2 in double over its grid-stride elements, the block adds
//   its threads' sums in a fixed order into its partial, and one block adds the partials in a
//   fixed order to out[0]: accumulated in double, in a different order from the CPU's but the
//   same on every run (no atomics).
// - mean: one block walks all of x and sums in double in a fixed order: deterministic.
// - split_f64, global_norm_clip: one thread, the host op's code in double.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kernels/cuda/elementwise_utils.cuh"
#include "kernels/cuda/kernels.h"
#include "kernels/cuda/launch.cuh"

namespace fsdp::kernels::cuda {
namespace {

using ew::FirstIndex;
using ew::GridFor;
using ew::GridStride;
using ew::kThreads;

// ---- AdamW ---------------------------------------------------------------------------------

// The element loop of cpu::adamw_update, operation for operation.
__global__ void AdamWKernel(float* param, const float* grad, float* m, float* v, int64_t n,
                            float beta1, float beta2, float eps, float decay, float step_size,
                            float inv_bc2_sqrt, float one_minus_b1, float one_minus_b2) {
  for (int64_t i = FirstIndex(); i < n; i += GridStride()) {
    const float g = grad[i];
    // mi = beta1 * m[i] + one_minus_b1 * g
    const float mi = __fadd_rn(__fmul_rn(beta1, m[i]), __fmul_rn(one_minus_b1, g));
    // vi = beta2 * v[i] + one_minus_b2 * g * g   ((one_minus_b2 * g) * g)
    const float vi =
        __fadd_rn(__fmul_rn(beta2, v[i]), __fmul_rn(__fmul_rn(one_minus_b2, g), g));
    m[i] = mi;
    v[i] = vi;
    // denom = sqrt(vi) * inv_bc2_sqrt + eps
    const float denom = __fadd_rn(__fmul_rn(__fsqrt_rn(vi), inv_bc2_sqrt), eps);
    // param[i] = param[i] * decay - step_size * mi / denom   ((step_size * mi) / denom)
    param[i] = __fsub_rn(__fmul_rn(param[i], decay), __fdiv_rn(__fmul_rn(step_size, mi), denom));
  }
}

// ---- SGD -----------------------------------------------------------------------------------

// momentum == 0: param[i] -= lr * (grad[i] + weight_decay * param[i]); no momentum buffer.
__global__ void SgdPlainKernel(float* param, const float* grad, int64_t n, float lr,
                               float weight_decay) {
  for (int64_t i = FirstIndex(); i < n; i += GridStride()) {
    const float p = param[i];
    param[i] = __fsub_rn(p, __fmul_rn(lr, __fadd_rn(grad[i], __fmul_rn(weight_decay, p))));
  }
}

// The momentum loop of cpu::sgd_update; the buffer is not read on the first step.
__global__ void SgdMomentumKernel(float* param, const float* grad, float* momentum_buf,
                                  int64_t n, float lr, float momentum, float keep,
                                  float weight_decay, bool nesterov, bool first_step) {
  for (int64_t i = FirstIndex(); i < n; i += GridStride()) {
    const float p = param[i];
    // g = grad[i] + weight_decay * param[i]
    const float g = __fadd_rn(grad[i], __fmul_rn(weight_decay, p));
    // buf = first_step ? g : momentum * momentum_buf[i] + keep * g
    const float buf =
        first_step ? g : __fadd_rn(__fmul_rn(momentum, momentum_buf[i]), __fmul_rn(keep, g));
    momentum_buf[i] = buf;
    // param[i] -= lr * (nesterov ? g + momentum * buf : buf)
    const float d = nesterov ? __fadd_rn(g, __fmul_rn(momentum, buf)) : buf;
    param[i] = __fsub_rn(p, __fmul_rn(lr, d));
  }
}

// ---- reductions ----------------------------------------------------------------------------

// The most blocks of sum_squares, one partial each; the block that adds them has as many
// threads.
constexpr int64_t kSumSquaresMaxBlocks = kSumSquaresPartials;
static_assert(kSumSquaresMaxBlocks <= 1024 && kSumSquaresMaxBlocks % 32 == 0);
// The single block of mean.
constexpr int kMeanThreads = 1024;

// Block size kThreads.
__global__ void SumSquaresKernel(double* partials, const float* x, int64_t n) {
  double acc = 0.0;
  for (int64_t i = FirstIndex(); i < n; i += GridStride()) {
    const double xd = x[i];
    acc += xd * xd;  // the product of two floats is exact in double
  }
  acc = ew::BlockSum(acc);
  if (threadIdx.x == 0) partials[blockIdx.x] = acc;
}

// One block of kSumSquaresMaxBlocks threads: out[0] += the first `blocks` partials.
__global__ void SumPartialsKernel(double* out, const double* partials, int64_t blocks) {
  double acc = threadIdx.x < blocks ? partials[threadIdx.x] : 0.0;
  acc = ew::BlockSum(acc);
  if (threadIdx.x == 0) out[0] = __dadd_rn(out[0], acc);
}

// One block of kMeanThreads threads.
__global__ void MeanKernel(float* out, const float* x, int64_t n) {
  double acc = 0.0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) acc += static_cast<double>(x[i]);
  acc = ew::BlockSum(acc);
  // n == 0 gives 0 / 0 = NaN, as the host op does.
  if (threadIdx.x == 0) out[0] = static_cast<float>(__ddiv_rn(acc, static_cast<double>(n)));
}

// One thread, as HostOps::SplitF64.
__global__ void SplitF64Kernel(float* out, const double* in) {
  const double v = in[0];
  const float hi = static_cast<float>(v);
  out[0] = hi;
  out[1] = static_cast<float>(__dsub_rn(v, static_cast<double>(hi)));
}

// One thread, as HostOps::GlobalNormClip.
__global__ void GlobalNormClipKernel(double* total_sq, float* factor, const void* partials,
                                     bool wide, int64_t n, double k, float max_norm) {
  double sum = 0.0;
  for (int64_t r = 0; r < n; ++r) {
    if (wide) {
      sum = __dadd_rn(sum, static_cast<const double*>(partials)[r]);
    } else {
      const float* p = static_cast<const float*>(partials);
      // sum += double(p[2r]) + p[2r+1], the pair added first
      sum = __dadd_rn(sum, __dadd_rn(static_cast<double>(p[2 * r]), static_cast<double>(p[2 * r + 1])));
    }
  }
  total_sq[0] = sum;
  const float coef = ClipCoefficient(__ddiv_rn(__dsqrt_rn(sum), k), max_norm);
  factor[0] = static_cast<float>(__ddiv_rn(static_cast<double>(coef), k));
}

}  // namespace

void adamw_update(cudaStream_t s, float* param, const float* grad, float* m, float* v, int64_t n,
                  const AdamWScalars& k) {
  if (n <= 0) return;
  FSDP_LAUNCH(AdamWKernel, GridFor(n), kThreads, 0, s)
  (param, grad, m, v, n, k.beta1, k.beta2, k.eps, k.decay, k.step_size, k.inv_bc2_sqrt,
   k.one_minus_beta1, k.one_minus_beta2);
}

void sgd_update(cudaStream_t s, float* param, const float* grad, float* momentum_buf, int64_t n,
                float lr, float momentum, float dampening, float weight_decay, bool nesterov,
                bool first_step) {
  if (n <= 0) return;
  if (momentum == 0.0f) {
    FSDP_LAUNCH(SgdPlainKernel, GridFor(n), kThreads, 0, s)(param, grad, n, lr, weight_decay);
    return;
  }
  const float keep = 1.0f - dampening;
  FSDP_LAUNCH(SgdMomentumKernel, GridFor(n), kThreads, 0, s)
  (param, grad, momentum_buf, n, lr, momentum, keep, weight_decay, nesterov, first_step);
}

void sum_squares(cudaStream_t s, double* out, const float* x, int64_t n, double* partials) {
  if (n <= 0) return;  // adds 0: out[0] is unchanged
  const unsigned int grid = static_cast<unsigned int>(
      std::min<int64_t>((n + kThreads - 1) / kThreads, kSumSquaresMaxBlocks));
  FSDP_LAUNCH(SumSquaresKernel, grid, kThreads, 0, s)(partials, x, n);
  FSDP_LAUNCH(SumPartialsKernel, 1, static_cast<unsigned int>(kSumSquaresMaxBlocks), 0, s)
  (out, partials, static_cast<int64_t>(grid));
}

void split_f64(cudaStream_t s, float* out, const double* in) {
  FSDP_LAUNCH(SplitF64Kernel, 1, 1, 0, s)(out, in);
}

void global_norm_clip(cudaStream_t s, double* total_sq, float* factor, const void* partials,
                      bool wide, int64_t n, double k, float max_norm) {
  // Launched for n == 0 too: the host op then writes total 0 and factor 1 / k.
  FSDP_LAUNCH(GlobalNormClipKernel, 1, 1, 0, s)
  (total_sq, factor, partials, wide, n < 0 ? 0 : n, k, max_norm);
}

void mean(cudaStream_t s, float* out, const float* x, int64_t n) {
  // Launched for n == 0 too (one block): the host op then writes NaN.
  FSDP_LAUNCH(MeanKernel, 1, kMeanThreads, 0, s)(out, x, n < 0 ? 0 : n);
}

}  // namespace fsdp::kernels::cuda
