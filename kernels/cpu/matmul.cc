// Linear layer forward/backward and plain sgemm: thin wrappers over internal::Gemm (oneDNN).
// weight^T and dout^T are transposed views of the stored matrices; backward accumulates
// through the GEMM itself (a `sum` post-op), with no temporaries.
#include "fsdp/kernels_cpu.h"
#include "kernels/cpu/column_sum.h"
#include "kernels/cpu/gemm.h"

namespace fsdp::kernels::cpu {

using internal::Gemm;
using internal::Operand;

void matmul_forward(float* out, const float* inp, const float* weight, const float* bias,
                    int64_t M, int64_t K, int64_t N) {
  // out[M,N] = inp[M,K] . (weight[N,K])^T + bias
  Gemm(out, N, Operand{inp, K, false}, Operand{weight, K, true}, bias, M, K, N, false);
}

void matmul_backward(float* dinp, float* dweight, float* dbias, const float* dout,
                     const float* inp, const float* weight, int64_t M, int64_t K, int64_t N) {
  // dinp[M,K] += dout[M,N] . weight[N,K]
  if (dinp != nullptr) {
    Gemm(dinp, K, Operand{dout, N, false}, Operand{weight, K, false}, nullptr, M, N, K, true);
  }
  // dweight[N,K] += (dout[M,N])^T . inp[M,K]
  if (dweight != nullptr) {
    Gemm(dweight, K, Operand{dout, N, true}, Operand{inp, K, false}, nullptr, N, M, K, true);
  }
  if (dbias != nullptr) {
    internal::AccumulateColumnSums(dbias, M, N,
                                   [=](int64_t r, int64_t c) { return dout[r * N + c]; });
  }
}

void sgemm(float* c, const float* a, const float* b, int64_t M, int64_t K, int64_t N) {
  Gemm(c, N, Operand{a, K, false}, Operand{b, N, false}, nullptr, M, K, N, false);
}

}  // namespace fsdp::kernels::cpu
