// What the cuBLASLt Linear needs besides the GEMM: the bias broadcast into the output rows,
// which the GEMM then accumulates onto (beta = 1). A low-precision bias is widened exactly.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/cuda/kernels.h"
#include "kernels/cuda/launch.cuh"

namespace fsdp::kernels::cuda {
namespace {

__device__ __forceinline__ float Widen(const void* p, int dtype, int64_t i) {
  if (dtype == 0) return static_cast<const float*>(p)[i];
  const uint16_t bits = static_cast<const uint16_t*>(p)[i];
  if (dtype == 1) return __uint_as_float(static_cast<uint32_t>(bits) << 16);
  return __half2float(__ushort_as_half(bits));
}

__global__ void BiasBroadcastKernel(float* out, const void* bias, int dtype, int64_t M,
                                    int64_t N) {
  const int64_t total = M * N;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[i] = Widen(bias, dtype, i % N);
  }
}

}  // namespace

void bias_broadcast(cudaStream_t s, float* out, const void* bias, int dtype, int64_t M,
                    int64_t N) {
  const int64_t total = M * N;
  if (total == 0) return;
  constexpr int kThreads = 256;
  const int64_t blocks = std::min<int64_t>((total + kThreads - 1) / kThreads, 65535 * 8);
  FSDP_LAUNCH(BiasBroadcastKernel, static_cast<unsigned>(blocks), kThreads, 0, s)
  (out, bias, dtype, M, N);
}

}  // namespace fsdp::kernels::cuda
